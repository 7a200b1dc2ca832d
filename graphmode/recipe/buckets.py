"""Shape buckets: the finite set of values each dim is compiled for, and their synthesis.

A request value v of a dim is padded up to the smallest bucket b >= v; its padding ratio
is (b - v) / b. Admissible request values of a dim are every integer in [lo, hi], where
[lo, hi] is `min..max` (explicit buckets: `min` (default 1) .. `max` (default: the
largest bucket)). `step` aligns bucket values: they are multiples of step (and `max`).

Synthesis (`max_padding` and/or `max_buckets`) is greedy from the smallest value: the
bucket for the smallest uncovered v is the largest aligned b with (b - v)/b <= p,
i.e. b <= v / (1 - p). Greedy is optimal for this interval cover (each step covers the
most), so its count is the smallest feasible `max_buckets` for that padding; the
smallest feasible padding for a bucket count is found by bisection over p.
The bound is then proved by Z3 for every admissible value (`constraints.prove_cover`).

Bounded work: a dim has at most `MAX_BUCKETS` buckets however they are named; greedy runs in
integers and steps over a run of consecutive aligned buckets at once, so a range up to
`MAX_DIM` synthesises in about a second at most, whatever `max_buckets` says.
"""
from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field
from fractions import Fraction
from functools import lru_cache
from typing import TYPE_CHECKING, Optional

from graphmode.errors import RecipeError
from graphmode.recipe.limits import MAX_BUCKETS

if TYPE_CHECKING:
    from graphmode.recipe.schema import DimSpec, Recipe

# The most plans (buckets of the cross product) a recipe may ask for: validation refuses more
# (`count_plans`), and `cross_product` (warm-up, serve, verify) never builds more.
MAX_PLANS = 1_000_000


@dataclass(frozen=True)
class Synthesis:
    """Result of `synthesize_buckets`. `buckets` is empty when infeasible."""
    lo: int
    hi: int
    step: int
    buckets: list[int]
    worst_padding: Fraction              # max over admissible v of (bucket(v) - v) / bucket(v)
    worst_value: Optional[int]           # a value attaining it
    feasible: bool
    max_padding: Optional[float] = None
    max_buckets: Optional[int] = None
    min_buckets_for_padding: Optional[int] = None    # smallest feasible max_buckets for max_padding
    min_padding_for_buckets: Optional[float] = None  # smallest feasible max_padding for max_buckets
    notes: list[str] = field(default_factory=list)

    def explain(self) -> str:
        if self.feasible:
            return (f"{len(self.buckets)} bucket(s) {self.buckets}, worst padding "
                    f"{float(self.worst_padding):.4f}" + (f" at {self.worst_value}" if self.worst_value else ""))
        limit = f"at most {self.max_buckets} " if self.max_buckets is not None else ""
        parts = [f"no bucket set over [{self.lo}, {self.hi}] (step {self.step}) has {limit}"
                 f"bucket(s) with padding <= {self.max_padding}"] + list(self.notes)
        if self.min_buckets_for_padding is not None:
            parts.append(f"padding {self.max_padding} needs max_buckets >= {self.min_buckets_for_padding}")
        if self.min_padding_for_buckets is not None:
            k = min(self.max_buckets or MAX_BUCKETS, MAX_BUCKETS)
            parts.append(f"{k} bucket(s) need max_padding >= {self.min_padding_for_buckets}")
        return "; ".join(parts)


def _down(x: int, step: int) -> int:
    return (x // step) * step


def _up(x: int, step: int) -> int:
    return -(-x // step) * step


def grid(lo: int, hi: int, step: int) -> list[int]:
    """Multiples of `step` in [lo, hi], plus `hi` (which should itself be a multiple)."""
    out = list(range(_up(lo, step), hi + 1, step))
    if not out or out[-1] != hi:
        out.append(hi)
    return out


def _consecutive_end(m: int, step: int, num: int, den: int) -> int:
    """Largest m' >= m - 1 such that, for every m'' in [m, m'], the bucket after m''*step is
    (m''+1)*step; from v = m''*step + 1 greedy's b = floor(v*den/(den-num)) stays below
    (m''+2)*step exactly while m''*step*num < 2*step*(den-num) - den."""
    if num == 0:
        return 1 << 62
    return -(-(2 * step * (den - num) - den) // (step * num)) - 1


def greedy(lo: int, hi: int, step: int, padding: Fraction,
           limit: int = MAX_BUCKETS) -> tuple[list[int] | None, int | None]:
    """Fewest step-aligned buckets covering [lo, hi] with padding <= `padding`.

    Returns (buckets, None); (None, None) if more than `limit` (at most MAX_BUCKETS) are
    needed; (None, v) if no aligned bucket can hold value v within the bound at all.
    """
    limit = min(limit, MAX_BUCKETS)
    p = exact(padding)
    num, den = p.numerator, p.denominator
    out: list[int] = []
    v, jump = lo, True
    while v <= hi:
        if out and jump:          # after the first bucket: a run of consecutive aligned buckets, taken at
            jump = False          # once; the run's condition only weakens with m, so it is checked once
            m = (v - 1) // step
            end = min(_consecutive_end(m, step, num, den), hi // step - 1)
            if end >= m:
                b = (m + 1) * step
                if (b - v) * den > num * b:          # the padding of a forced bucket falls with m
                    return None, v
                if len(out) + end - m + 1 > limit:
                    return None, None
                out.extend(range(b, (end + 1) * step + 1, step))
                v = (end + 1) * step + 1
                continue
        b = hi if num >= den else min(hi, _down(v * den // (den - num), step))
        if b < v:
            b = min(hi, _up(v, step))
            if (b - v) * den > num * b:
                return None, v
        out.append(b)
        if len(out) > limit:
            return None, None
        v = b + 1
    return out, None


def worst_padding(buckets: list[int], lo: int, hi: int, step: int = 1) -> tuple[Fraction, Optional[int]]:
    """Worst (bucket - v)/bucket over request values v in [lo, hi] (v above the last bucket ignored)."""
    wn, wd, at = 0, 1, None
    prev = lo - 1
    for b in sorted(set(buckets)):
        v = max(prev + 1, lo)
        if v <= min(b, hi) and (at is None or (b - v) * wd > wn * b):
            wn, wd, at = b - v, b, v
        prev = max(prev, b)
    return Fraction(wn, wd), at


def runs(values: list[int]) -> list[tuple[int, int, int]]:
    """Sorted unique `values` as maximal arithmetic progressions (first, spacing, last), so a
    step grid of 65536 buckets is one term of a Z3 formula, not 65536."""
    vals = sorted(set(values))
    out: list[tuple[int, int, int]] = []
    i = 0
    while i < len(vals):
        if i + 1 == len(vals):
            out.append((vals[i], 1, vals[i]))
            break
        d, j = vals[i + 1] - vals[i], i + 1
        while j + 1 < len(vals) and vals[j + 1] - vals[j] == d:
            j += 1
        out.append((vals[i], d, vals[j]))
        i = j + 1
    return out


def exact(x: float) -> Fraction:
    """The number as written (0.1 is 1/10, not the nearest double), so bounds compare exactly."""
    return x if isinstance(x, Fraction) else Fraction(str(x))


def min_padding_for(lo: int, hi: int, step: int, k: int) -> tuple[Fraction, list[int]]:
    """Smallest padding bound achievable with at most k aligned buckets (bisection, 1e-9)."""
    k = min(k, MAX_BUCKETS)
    zero, _ = greedy(lo, hi, step, Fraction(0), limit=k)
    if zero is not None:
        return Fraction(0), zero
    a, b = Fraction(0), Fraction(1)          # greedy(a) infeasible, greedy(b) feasible (one bucket: hi)
    for _ in range(40):
        mid = Fraction(round((a + b) / 2 * 10**9), 10**9)
        if mid <= a or mid >= b:
            break
        if greedy(lo, hi, step, mid, limit=k)[0] is None:
            a = mid
        else:
            b = mid
    best, _ = greedy(lo, hi, step, b, limit=k)
    assert best is not None
    w, _ = worst_padding(best, lo, hi, step)
    return w, best


def _round_up(x: Fraction, digits: int = 4) -> float:
    q = 10**digits
    return float(Fraction(-(-x.numerator * q // x.denominator), q))


def synthesize_buckets(lo: int, hi: int, *, max_padding: float | None = None, max_buckets: int | None = None,
                       step: int = 1) -> Synthesis:
    """Synthesise step-aligned buckets for request values [lo, hi] under a padding bound
    and/or a bucket budget. The largest bucket is always `hi`.

    - `max_padding` only: the fewest buckets meeting the bound;
    - `max_buckets` only: the smallest padding achievable with that many buckets;
    - both: the fewest buckets meeting the bound, infeasible if more than `max_buckets`
      (then `min_buckets_for_padding` and `min_padding_for_buckets` say what would work);
    - neither: every multiple of `step` in [lo, hi] (plus hi).
    """
    if lo < 1 or hi < lo or step < 1:
        raise RecipeError(f"invalid range [{lo}, {hi}] step {step}", fix="need 1 <= min <= max and step >= 1")
    if hi % step:
        raise RecipeError(f"max {hi} is not a multiple of step {step}",
                          fix=f"use max {_down(hi, step) or step} or {_up(hi, step)}")
    if max_padding is None and max_buckets is None:
        n = (hi - _up(lo, step)) // step + 1
        if n > MAX_BUCKETS:
            raise RecipeError(f"range [{lo}, {hi}] step {step} has {n} bucket values (one plan each), "
                              f"more than {MAX_BUCKETS}",
                              fix="give buckets, a larger step, or max_padding to synthesise")
        b = grid(lo, hi, step)
        w, at = worst_padding(b, lo, hi, step)
        return Synthesis(lo, hi, step, b, w, at, True)
    if max_padding is None:
        w, b = min_padding_for(lo, hi, step, max_buckets)
        _, at = worst_padding(b, lo, hi, step)
        return Synthesis(lo, hi, step, b, w, at, True, None, max_buckets, len(b), _round_up(w))
    p = exact(max_padding)
    b, impossible_at = greedy(lo, hi, step, p, limit=max_buckets if max_buckets is not None else MAX_BUCKETS)
    if b is not None:
        w, at = worst_padding(b, lo, hi, step)
        return Synthesis(lo, hi, step, b, w, at, True, max_padding, max_buckets, len(b))
    notes = []
    need = None
    if impossible_at is not None:
        nb = min(hi, _up(impossible_at, step))
        notes.append(f"value {impossible_at} pads to {nb} at best (step {step}): padding "
                     f"{float(Fraction(nb - impossible_at, nb)):.4f} > {max_padding} whatever the bucket count")
    else:
        full, _ = greedy(lo, hi, step, p)
        need = len(full) if full is not None else None
        if full is None:
            notes.append(f"padding {max_padding} needs more than {MAX_BUCKETS} buckets, the most one dim may have")
    min_p = None
    if max_buckets is not None:
        w, _ = min_padding_for(lo, hi, step, max_buckets)
        min_p = _round_up(w)
    return Synthesis(lo, hi, step, [], Fraction(1), None, False, max_padding, max_buckets, need, min_p, notes)


# ---- per-recipe views -------------------------------------------------------------------------

def dim_range(spec: "DimSpec") -> tuple[int, int]:
    if spec.buckets:
        return (spec.min or 1, spec.max or max(spec.buckets))
    return (spec.min or 1, spec.max if spec.max is not None else (spec.min or 1))


@lru_cache(maxsize=256)
def _synth_cached(lo: int, hi: int, step: int, pad: float | None, k: int | None) -> Synthesis:
    return synthesize_buckets(lo, hi, max_padding=pad, max_buckets=k, step=step)


def dim_synthesis(spec: "DimSpec") -> Synthesis:
    """Buckets of one dim: explicit, synthesised, or the full grid."""
    lo, hi = dim_range(spec)
    if spec.buckets:
        b = sorted(set(spec.buckets))
        w, at = worst_padding(b, lo, hi, spec.step)
        return Synthesis(lo, hi, spec.step, b, w, at, True, spec.max_padding, spec.max_buckets)
    if hi < lo:
        raise RecipeError(f"dim range min {lo} > max {hi}", fix="set min <= max")
    return _synth_cached(lo, hi, spec.step, spec.max_padding, spec.max_buckets)


def dim_buckets(recipe: "Recipe") -> dict[str, list[int]]:
    """Each dim's buckets; RecipeError for an infeasible synthesis or, as soon as the dims so
    far make more than MAX_PLANS plans, before synthesising the rest."""
    out: dict[str, list[int]] = {}
    for name, spec in recipe.dims.items():
        s = dim_synthesis(spec)
        if not s.feasible:
            raise RecipeError(s.explain(), where=f"dims.{name}", line=recipe.line_of(f"dims.{name}"),
                              fix="raise max_buckets or max_padding")
        out[name] = s.buckets
        count_plans(out)
    return out


def count_plans(per_dim: dict[str, list[int]]) -> int:
    """Plans of the cross product; RecipeError above MAX_PLANS (the one limit validate and
    warm-up share)."""
    n = 1
    for v in per_dim.values():
        n *= len(v)
    if n > MAX_PLANS:
        counts = " x ".join(f"{len(v)} ({d})" for d, v in per_dim.items())
        raise RecipeError(f"{n} buckets (plans) in the cross product {counts}, more than {MAX_PLANS}",
                          where="dims", value=n, fix="use fewer buckets per dim (max_padding synthesis, a larger step)")
    return n


def cross_product(per_dim: dict[str, list[int]]) -> list[dict[str, int]]:
    count_plans(per_dim)
    names = list(per_dim)
    return [dict(zip(names, combo)) for combo in itertools.product(*(per_dim[d] for d in names))]


def all_buckets(recipe: "Recipe") -> list[dict[str, int]]:
    """Every bucket of the recipe: the cross product of each dim's buckets (one plan each)."""
    return cross_product(dim_buckets(recipe))


def plans_count(recipe: "Recipe") -> int:
    return count_plans(dim_buckets(recipe))


def bucket_for(recipe: "Recipe", shape: dict[str, int]) -> dict[str, int] | None:
    """Smallest bucket holding `shape` (dim -> value); None if outside the contract."""
    if set(shape) - set(recipe.dims):
        return None
    per_dim = dim_buckets(recipe)
    out: dict[str, int] = {}
    for name, spec in recipe.dims.items():
        v = shape.get(name)
        if not isinstance(v, int) or isinstance(v, bool):
            return None
        lo, hi = dim_range(spec)
        if v < lo or v > hi:
            return None
        vals = per_dim[name]
        i = bisect.bisect_left(vals, v)
        if i == len(vals):
            return None
        out[name] = vals[i]
    return out
