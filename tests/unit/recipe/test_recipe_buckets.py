"""Bucket synthesis with guarantees: coverage and the padding bound, proved by Z3."""
from fractions import Fraction

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from graphmode.errors import RecipeError
from graphmode.recipe import load_recipe, synthesize_buckets
from graphmode.recipe.buckets import greedy, worst_padding
from graphmode.recipe.constraints import prove_cover


def brute_worst(buckets, lo, hi):
    """Worst padding by checking every value (the runtime's choice: smallest bucket >= v)."""
    worst = Fraction(0)
    for v in range(lo, hi + 1):
        b = min(x for x in buckets if x >= v)
        worst = max(worst, Fraction(b - v, b))
    return worst


def test_padding_bound_synthesis_is_proved():
    s = synthesize_buckets(2, 512, max_padding=0.25)
    assert s.feasible and s.buckets[-1] == 512 and len(s.buckets) == 18
    assert s.worst_padding <= Fraction(1, 4) == brute_worst(s.buckets, 2, 512)
    proof = prove_cover("seq", 2, 512, s.buckets, 0.25)
    assert proof.status == "proved", proof.message


def test_infeasible_reports_smallest_feasible_settings():
    s = synthesize_buckets(2, 512, max_padding=0.25, max_buckets=12)
    assert not s.feasible and s.buckets == []
    assert s.min_buckets_for_padding == 18                  # the greedy count is optimal...
    assert synthesize_buckets(2, 512, max_padding=0.25, max_buckets=18).feasible
    assert not synthesize_buckets(2, 512, max_padding=0.25, max_buckets=17).feasible
    p = s.min_padding_for_buckets                            # ...and the padding bisection is tight
    assert synthesize_buckets(2, 512, max_padding=p, max_buckets=12).feasible
    assert not synthesize_buckets(2, 512, max_padding=p - 0.002, max_buckets=12).feasible
    assert "max_buckets >= 18" in s.explain() and f"max_padding >= {p}" in s.explain()


def test_bucket_budget_only_minimises_padding():
    s = synthesize_buckets(1, 32, max_buckets=4)
    assert len(s.buckets) <= 4 and s.buckets[-1] == 32
    assert s.worst_padding == brute_worst(s.buckets, 1, 32)
    assert greedy(1, 32, 1, s.worst_padding - Fraction(1, 10**6), limit=4)[0] is None   # nothing better


def test_step_alignment():
    s = synthesize_buckets(16, 1024, max_padding=0.5, step=16)
    assert all(b % 16 == 0 for b in s.buckets) and s.buckets[-1] == 1024
    assert prove_cover("seq", 16, 1024, s.buckets, 0.5).status == "proved"
    grid = synthesize_buckets(2, 64, step=8)                 # no synthesis: every aligned value
    assert grid.buckets == [8, 16, 24, 32, 40, 48, 56, 64]
    impossible = synthesize_buckets(2, 512, max_padding=0.5, step=8)
    assert not impossible.feasible and "whatever the bucket count" in impossible.explain()
    with pytest.raises(RecipeError):
        synthesize_buckets(2, 510, step=8)


def test_cover_refutation_is_concrete():
    p = prove_cover("seq", 1, 100, [10, 50, 100], 0.5)
    assert p.status == "refuted"
    v = p.counterexample["seq"]
    b = min(x for x in [10, 50, 100] if x >= v)
    assert Fraction(b - v, b) > Fraction(1, 2)                # the counter-example really breaks the bound
    gap = prove_cover("batch", 1, 40, [1, 2, 4, 8, 16, 32], None)
    assert gap.status == "refuted" and gap.counterexample["batch"] > 32


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lo=st.integers(1, 64), span=st.integers(0, 600), pad=st.sampled_from([0.1, 0.2, 0.25, 1 / 3, 0.5, 0.75]),
       step=st.sampled_from([1, 1, 2, 8]))
def test_synthesis_property(lo, span, pad, step):
    hi = lo + span
    hi = -(-hi // step) * step
    s = synthesize_buckets(lo, hi, max_padding=pad, step=step)
    if not s.feasible:
        assert s.notes                                         # only when alignment makes it impossible
        return
    assert s.buckets == sorted(set(s.buckets)) and s.buckets[-1] == hi
    assert all(b % step == 0 or b == hi for b in s.buckets)
    assert brute_worst(s.buckets, lo, hi) == s.worst_padding <= Fraction(str(pad))
    assert prove_cover("d", lo, hi, s.buckets, pad).status == "proved"


RECIPE = """\
version: 1
name: b
inputs: [{name: x, dtype: i64, shape: [batch, seq]}]
dims:
  batch: {buckets: [1, 2, 4, 8]}
  seq: {min: 2, max: 512, max_padding: 0.5}
"""


def test_recipe_buckets_and_bucket_for():
    r = load_recipe(RECIPE)
    per = r.dim_buckets()
    assert per["batch"] == [1, 2, 4, 8] and per["seq"][-1] == 512
    assert r.plans_count() == len(r.buckets()) == 4 * len(per["seq"])
    assert r.buckets()[0] == {"batch": 1, "seq": per["seq"][0]}
    assert r.bucket_for({"batch": 3, "seq": 100}) == {"batch": 4, "seq": min(b for b in per["seq"] if b >= 100)}
    assert r.bucket_for({"batch": 8, "seq": 512}) == {"batch": 8, "seq": 512}
    assert r.bucket_for({"batch": 9, "seq": 10}) is None          # above the largest bucket
    assert r.bucket_for({"batch": 1, "seq": 1}) is None           # below min
    assert r.bucket_for({"batch": 1}) is None                     # a dim missing
    assert r.bucket_for({"batch": 1, "seq": 4, "beam": 2}) is None
    assert r.dim_range("seq") == (2, 512) and r.dim_range("batch") == (1, 8)


def test_worst_padding_helper():
    assert worst_padding([4, 8], 1, 8) == (Fraction(3, 4), 1)
    assert worst_padding([4, 8], 3, 8) == (Fraction(3, 8), 5)


def test_explicit_buckets_padding_bound_is_proved_or_refused():
    from pathlib import Path

    from graphmode.recipe import validate
    from graphmode.targets import load_target_file
    cpu = load_target_file(Path(__file__).resolve().parents[1] / "data" / "recipes" / "cpu_target.yaml")
    ok = load_recipe(RECIPE.replace("{buckets: [1, 2, 4, 8]}", "{buckets: [1, 2, 4, 8], max_padding: 0.5}"))
    rep = validate(ok, cpu)
    assert next(p for p in rep.proofs if p.name == "dims.batch.buckets").status == "proved"
    bad = load_recipe(RECIPE.replace("{buckets: [1, 2, 4, 8]}", "{buckets: [1, 2, 4, 8], max_padding: 0.3}"))
    rep = validate(bad, cpu)
    p = next(p for p in rep.proofs if p.name == "dims.batch.buckets")
    assert rep.verdict == "refused" and p.status == "refuted"
    v = p.counterexample["batch"]
    b = min(x for x in [1, 2, 4, 8] if x >= v)
    assert Fraction(b - v, b) > Fraction(3, 10)
