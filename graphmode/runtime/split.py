"""A batch between buckets: padded up to the next bucket, or cut into buckets it fills exactly.

With batch buckets [1, 2, 4] a request of batch 3 is padded to 4: a quarter of the plan's work
is padding. When the model's rows never meet (analysis.padding.positions_independent: no op
reads across the batch) the same request can run as a batch-2 and a batch-1 call whose outputs
are concatenated, with no padded row at all. Which is faster depends on the plan: two calls
pay the per-call cost (~90 steps of dispatch) twice, one padded call computes the extra rows.
Measured per thread on 2-core EPYC hosts (1 thread, CPU time, seq bucket 94): a T5 encoder
took 27.8 ms at batch 4 and 13.4 + 8.1 = 21.5 ms at 2 + 1; DistilBERT 28.1 against 21.8. At
small sizes the per-call cost wins instead. So `Chooser` times both ways on the model's own
calls: each (batch, bucket) key runs padded once and split once, then the faster by the best
time seen for each, so the choice follows the plans on this host and never stays on a way that
measured slower.
"""
from __future__ import annotations

import threading
from typing import Mapping, Sequence

from graphmode.ir.graph import Graph


def chunks(n: int, buckets: Sequence[int]) -> list[int]:
    """`n` as a sum of bucket values, largest first (greedy; [1, 2, 4] gives 3 = 2 + 1, 7 =
    4 + 2 + 1); [] when some remainder is smaller than every bucket."""
    out, left = [], n
    for b in sorted(set(buckets), reverse=True):
        while b <= left:
            out.append(b)
            left -= b
    return out if left == 0 else []


def output_axes(graph: Graph, dim: str) -> dict[str, int] | None:
    """The axis of each output whose extent is exactly `dim` (where the pieces of a split
    request are concatenated); None when an output has none or several."""
    out = {}
    for name in graph.outputs:
        axes = [i for i, d in enumerate(graph.values[name].type.shape)
                if not isinstance(d, int) and getattr(d, "is_Symbol", False) and d.name == dim]
        if len(axes) != 1:
            return None
        out[name] = axes[0]
    return out


class Chooser:
    """Per key (the request's batch and the bucket it pads to), the best wall time seen padded
    and split; `choose` explores each way once, then picks the faster."""

    def __init__(self) -> None:
        self.best: dict[tuple, dict[str, float]] = {}
        self._lock = threading.Lock()

    def choose(self, key: tuple) -> str:
        with self._lock:
            seen = self.best.get(key, {})
        for way in ("pad", "split"):
            if way not in seen:
                return way
        return min(seen, key=seen.get)

    def record(self, key: tuple, way: str, seconds: float) -> None:
        with self._lock:
            seen = self.best.setdefault(key, {})
            seen[way] = min(seconds, seen.get(way, seconds))

    def report(self) -> dict[str, Mapping[str, float]]:
        """`batch@bucket` -> best ms padded and split."""
        with self._lock:
            return {f"{k[0]}@{k[1]}": {w: round(s * 1e3, 3) for w, s in v.items()} for k, v in self.best.items()}


__all__ = ["chunks", "output_axes", "Chooser"]
