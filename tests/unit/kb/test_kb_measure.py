"""The numbers every recorder computes alike, and the contract applied to them, including the
determinism bound `sla.max_p99_over_p50`."""
from __future__ import annotations

import pytest
from kb_helpers import recipe_data

from graphmode.errors import RecipeErrors
from graphmode.kb.measure import judge, latency_summary, max_p99_over_p50
from graphmode.recipe import load_recipe, recipe_hash
from graphmode.recipe.hashing import canonical_json


def test_latency_summary_is_nearest_rank():
    s = latency_summary([float(x) for x in range(1, 101)])
    assert (s["p50_ms"], s["p99_ms"], s["p99_over_p50"]) == (50.0, 99.0, 1.98)
    assert latency_summary([]) == {"p50_ms": None, "p99_ms": None, "p99_over_p50": None}


def test_the_determinism_bound_is_part_of_the_contract():
    bounded = load_recipe(recipe_data(sla={"p99_ms": 10, "max_p99_over_p50": 2}, memory={"budget_mb": 4}))
    assert max_p99_over_p50(bounded) == 2.0
    assert judge(bounded, None, {"p50_ms": 1.0, "p99_ms": 1.5, "p99_over_p50": 1.5}) == ("ok", None)
    status, why = judge(bounded, None, {"p50_ms": 1.0, "p99_ms": 12.0, "p99_over_p50": 12.0, "peak_memory_mb": 5.0,
                                        "numerics_err": 1e-3}, tol=1e-5)
    assert status == "violates"
    for part in ("sla.p99_ms: measured 12 ms > 10 ms", "sla.max_p99_over_p50: measured 12 > 2",
                 "memory.budget_mb: plan needs 5.0 MB > 4 MB", "numerics: rel L2 vs eager 1.00e-03"):
        assert part in why
    plain = load_recipe(recipe_data(sla={"p99_ms": 10}))
    assert max_p99_over_p50(plain) is None and "max_p99_over_p50" not in canonical_json(plain)   # old stamps hold
    assert recipe_hash(plain) != recipe_hash(bounded)
    with pytest.raises(RecipeErrors, match="sla.max_p99_over_p50"):
        load_recipe(recipe_data(sla={"max_p99_over_p50": 0.5}))                                  # p99 >= p50 always


def test_a_bench_row_is_recorded_with_the_median_its_table_printed():
    """The table said median 0.3862 ms over 30 rounds; the knowledge base stored the lower
    middle (0.3859) as p50 (trial Z)."""
    from graphmode.kb.record import bench_perfs
    rec = load_recipe(recipe_data())
    rounds = [1.0, 2.0, 3.0, 4.0]
    row = {"engine": "graphmode", "label": "graphmode", "dims": {"batch": 2}, "status": "ok", "shape": [2],
           "median_ms": 2.5, "rounds_ms": rounds, "threads": 1, "rel_l2_err": 0.0}
    (p,) = bench_perfs([row], None, rec)
    assert p["p50_ms"] == 2.5 and p["p99_ms"] == 4.0 and p["p99_over_p50"] == 1.6
    assert p["throughput"] == 2 / 2.5e-3              # the batch dim's rows per call
