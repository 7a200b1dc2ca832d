"""A batch between buckets: padded up to the next bucket, or cut into buckets it fills exactly.

With batch buckets [1, 2, 4] a request of batch 3 is padded to 4: a quarter of the plan's work
is padding. When the model's rows never meet (analysis.padding.positions_independent: no op
reads across the batch) the same request can run as a batch-2 and a batch-1 call whose outputs
are concatenated, with no padded row at all. Which is faster depends on the plan: two calls
pay the per-call cost (~90 steps of dispatch) twice, one padded call computes the extra rows.
Measured per thread on 2-core EPYC hosts (1 thread, CPU time, seq bucket 94): a T5 encoder
took 27.8 ms at batch 4 and 13.4 + 8.1 = 21.5 ms at 2 + 1; DistilBERT 28.1 against 21.8. At
small sizes the per-call cost wins instead. So `Chooser` times the ways on the model's own
calls: each request shape (its dims and the bucket it pads to) runs each allowed way twice, then
the fastest by the best time seen for each, so the choice follows the plans on this host and
never stays on a way that measured slower.

A third way, in `exe_mode: hybrid` only: eager PyTorch at the request's own shape. Padding the
seq of a request of 50 to a bucket of 94 is 1.9x the linear layers' work and 3.5x the
attention scores'; no way of running the bucket removes that, and eager at 50 does not pay it.
Its outputs are eager's by definition; every such call is an `eager_choice` event (counted by
the monitor with the fallbacks, not as a violation). Graph mode never runs it.
"""
from __future__ import annotations

from collections import Counter
from typing import Any, Mapping, Sequence

from graphmode.ir.graph import Graph
from graphmode.openmp import ForkSafeLock


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


WAYS = ("padded", "split", "eager")      # the order `Chooser.choose` explores them in
MAX_SHAPES = 4096       # request shapes remembered; a shape past them runs padded, unexplored
TRIES = 2               # timed calls per way before choosing: one starved call cannot decide alone


class Chooser:
    """Per key (the request's dims and the bucket it pads to), the best wall time seen for each
    way it may run: `padded` into the bucket, `split` into buckets it fills exactly, `eager` at
    its own shape (hybrid mode, runtime/compiled.py). `choose` explores the allowed ways in
    turn until each has `tries` timed calls, then picks the fastest."""

    def __init__(self, max_shapes: int = MAX_SHAPES, tries: int = TRIES) -> None:
        self.best: dict[tuple, dict[str, float]] = {}
        self.tries: dict[tuple, Counter[str]] = {}
        self.max_shapes, self.min_tries = max_shapes, tries
        self._lock = ForkSafeLock()

    def choose(self, key: tuple, ways: Sequence[str] = ("padded", "split")) -> str:
        with self._lock:
            seen = self.best.get(key)
            if seen is None and len(self.best) >= self.max_shapes:
                return ways[0]             # bounded memory: an unseen shape past the cap is not explored
            seen, tried = dict(seen or {}), Counter(self.tries.get(key) or {})
        least = min(ways, key=lambda w: tried[w])        # the first of the least tried, in `ways` order
        if tried[least] < self.min_tries:
            return least
        return min(ways, key=seen.__getitem__)

    def record(self, key: tuple, way: str, seconds: float) -> None:
        with self._lock:
            if key not in self.best and len(self.best) >= self.max_shapes:
                return
            seen = self.best.setdefault(key, {})
            seen[way] = min(seconds, seen.get(way, seconds))
            self.tries.setdefault(key, Counter())[way] += 1

    def settled(self, key: tuple, ways: Sequence[str]) -> bool:
        """Whether every way in `ways` has had its timed calls for `key`."""
        with self._lock:
            tried = self.tries.get(key) or {}
            return all(tried.get(w, 0) >= self.min_tries for w in ways)

    def chosen(self, key: tuple) -> str | None:
        """The way the key runs now that each has been tried (None while one is untried)."""
        with self._lock:
            seen = dict(self.best.get(key) or {})
        return min(seen, key=seen.__getitem__) if seen else None

    def report(self) -> dict[str, dict[str, Any]]:
        """`batch=3,seq=50@batch=4,seq=94` -> the best ms of each way tried and the `chosen`
        one (the fastest so far)."""
        with self._lock:
            items = [(k, dict(v)) for k, v in self.best.items()]
        return {key_label(k): {**{w: round(s * 1e3, 3) for w, s in v.items()}, "chosen": min(v, key=v.__getitem__)}
                for k, v in items}


def shape_key(dims: Mapping[str, int], bucket: Mapping[str, int]) -> tuple:
    """The chooser's key of a request: its dims and the bucket it pads to."""
    return tuple(sorted(dims.items())), tuple(sorted(bucket.items()))


def key_label(key: tuple) -> str:
    dims, bucket = key
    return ",".join(f"{k}={v}" for k, v in dims) + "@" + ",".join(f"{k}={v}" for k, v in bucket)


__all__ = ["chunks", "output_axes", "Chooser", "WAYS", "shape_key", "key_label"]
