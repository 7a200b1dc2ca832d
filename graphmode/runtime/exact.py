"""Plans for the values of a dim that requests keep sending: the buckets graphmode chose, refined.

A dim synthesised under `max_padding: 0.5` puts a request of seq 50 in bucket 94: 1.9x the
linear layers' work and 3.5x the attention scores' (measured: a T5 encoder at batch 3 x seq 50
ran 1.1-1.4x eager padded, whatever the way; runtime/split.py). Padding is the cost, so the
fix is a bucket at 50. When the recipe lets graphmode choose a dim's buckets and sets
`dims.D.exact_plans: N`, up to N values of D that recur (their third request) become buckets
too: a request then runs in the smallest of its recipe bucket and those values that holds it.
Each such value is inside the dim's proven range (the memory proof holds for every admissible
shape), its plans are built on first use like any bucket's (a `compile` event), and N bounds
how many there are: at most N x (buckets of the other dims) plans more.
"""
from __future__ import annotations

from collections import Counter
from typing import Any, Mapping, Sequence

from graphmode.openmp import ForkSafeLock

RECUR = 3              # a value gets its plans on its third request: once is no pattern
MAX_COUNTED = 4096     # values counted while not yet recurring (bounded memory)


class ExactValues:
    """Per dim with `exact_plans`, the values given buckets of their own, and how often the
    others were requested."""

    def __init__(self, recipe: Any) -> None:
        self.caps = {d: s.exact_plans for d, s in recipe.dims.items() if getattr(s, "exact_plans", None)}
        self.values: dict[str, list[int]] = {d: [] for d in self.caps}
        self._seen: Counter[tuple[str, int]] = Counter()
        self._failed: set[tuple[str, int]] = set()     # values whose plan did not build: never promoted again
        self._lock = ForkSafeLock()

    def refine(self, dims: Mapping[str, int], bucket: Mapping[str, int], exact: Sequence[str] = ()) -> dict[str, int]:
        """`bucket` with each refinable dim lowered to the smallest value with its own plans
        that holds the request (exactly the request's value for a dim in `exact`, which may not
        be padded); counts the request's value towards its own plans."""
        out = dict(bucket)
        if not self.caps:
            return out
        with self._lock:
            for d, cap in self.caps.items():
                v = dims.get(d)
                if v is None or v == bucket.get(d):
                    continue
                if v not in self.values[d] and len(self.values[d]) < cap:
                    key = (d, v)
                    if key not in self._failed and (key in self._seen or len(self._seen) < MAX_COUNTED):
                        self._seen[key] += 1
                        if self._seen[key] >= RECUR:
                            del self._seen[key]
                            self.values[d] = sorted([*self.values[d], v])
                held = [u for u in self.values[d] if (u == v if d in exact else v <= u < out[d])]
                if held:
                    out[d] = held[0]
        return out

    def forget(self, env: Mapping[str, int]) -> None:
        """Drop the values of `env` given plans of their own (their plan did not build), for good."""
        with self._lock:
            for d in self.caps:
                if env.get(d) in self.values[d]:
                    self.values[d].remove(env[d])
                    self._failed.add((d, env[d]))

    def report(self) -> dict[str, list[int]]:
        with self._lock:
            return {d: list(v) for d, v in self.values.items()}


__all__ = ["ExactValues", "RECUR"]
