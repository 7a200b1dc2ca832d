"""Fingerprints and recommendations: what counts as the same machine or architecture, and the
ranking (nearest architecture, then the same or most similar hardware, then the objective)."""
from __future__ import annotations

import pytest
from kb_helpers import spec

from graphmode.kb import KnowledgeBase
from graphmode.kb.fingerprint import hardware_of, hardware_similarity, model_distance, model_of, recipe_inputs
from graphmode.kb.record import perf, record
from graphmode.kb.recommend import recommend
from graphmode.targets import get_target


def _host_like(cores: int = 2, bandwidth: float = 10.0):
    t = get_target("cpu_avx2")
    groups = dict(t.groups, cpu={"model_name": "AMD EPYC 7B13", "isa": "x86_64"})
    return t.model_copy(update={"measured": True, "groups": groups, "compute_units": cores,
                                "memory_bandwidth_gbps": bandwidth})


def test_hardware_identity_is_the_machine_not_its_last_probe():
    a, b = hardware_of(_host_like(bandwidth=10.0)), hardware_of(_host_like(bandwidth=14.0))
    assert a["fingerprint"] == b["fingerprint"] and a["bandwidth_gbps"] != b["bandwidth_gbps"]
    four = hardware_of(_host_like(cores=4))
    gpu = hardware_of(get_target("h100_sxm"))
    assert four["fingerprint"] != a["fingerprint"]
    assert hardware_similarity(a, b) == 1.0 > hardware_similarity(a, four) > hardware_similarity(a, gpu) == 0.0
    assert hardware_of(get_target("a100_sxm"))["fingerprint"] != hardware_of(get_target("a100_pcie"))["fingerprint"]


TOKENS = [{"name": "input_ids", "dtype": "i64", "shape": ["batch", "seq"]},
          {"name": "attention_mask", "dtype": "i64", "shape": ["batch", "seq"], "role": "attention_mask"}]
RECIPES = {"encoder_small": {"inputs": TOKENS, "dims": {"batch": {"buckets": [1, 2]}, "seq": {"buckets": [4, 8]}}},
           "mlp": {"inputs": [{"name": "x", "dtype": "f32", "shape": ["batch", 16]}],
                   "dims": {"batch": {"buckets": [1, 2]}}}}
RECIPES["encoder_large"] = RECIPES["encoder_small"]


@pytest.fixture(scope="module")
def captured():
    """name -> (graph, source, recipe data): each model captured once."""
    from graphmode.compiler import capture
    from graphmode.recipe import load_recipe
    out = {}
    for name, r in RECIPES.items():
        data = {"version": 1, "name": name, **r}
        g, _, src = capture(spec(name), load_recipe(data))
        out[name] = (g, src, data)
    return out


def _row(captured, name):
    from graphmode.recipe import load_recipe
    g, src, data = captured[name]
    return model_of(g, src, recipe_inputs(load_recipe(data)))


def test_model_fingerprints_from_the_captured_graph(captured):
    small, large, mlp = (_row(captured, n) for n in ("encoder_small", "encoder_large", "mlp"))
    assert small["family"] == large["family"] == "tinyenc" and mlp["family"] == "mlp"
    assert small["op_histogram"] == large["op_histogram"] and small["op_histogram"]["linear"] == 1
    assert small["params"] < large["params"] and small["fingerprint"] != large["fingerprint"]
    assert small["inputs"] == {"input_ids": ["i64", ["*", "*"]], "attention_mask": ["i64", ["*", "*"]]}
    assert model_distance(small, small) == 0.0
    assert 0 < model_distance(small, large) < 1.0 < model_distance(small, mlp)


def test_recommend_ranks_nearest_model_then_hardware_then_objective(tmp_path, captured):
    from graphmode.kb.record import Subject
    from graphmode.recipe import load_recipe
    path = tmp_path / "kb.sqlite"
    here, there = "cpu_avx2", "h100_sxm"

    def measure(name, model, target, p99, tput, status="ok"):
        g, src, data = captured[model]
        s = Subject(load_recipe(dict(data, name=name)), get_target(target), src, g, None)
        assert record(path, s, [perf("tune", status=status, p50_ms=p99 / 2, p99_ms=p99, throughput=tput)]) is None

    measure("fast-here", "encoder_small", here, p99=2.0, tput=500.0)
    measure("slow-here", "encoder_small", here, p99=5.0, tput=900.0)
    measure("fastest-there", "encoder_small", there, p99=0.5, tput=5000.0)   # same model, other hardware
    measure("other-model", "mlp", here, p99=0.1, tput=9000.0)                # other family
    measure("broken", "encoder_small", here, p99=0.01, tput=1e6, status="violates")
    hw = hardware_of(get_target(here))
    with KnowledgeBase(path) as kb:
        lat = recommend(kb, _row(captured, "encoder_large"), hw, "latency", limit=None)
        tput = recommend(kb, _row(captured, "encoder_large"), hw, "throughput", limit=None)
    assert [r.recipe["name"] for r in lat] == ["fast-here", "slow-here", "fastest-there", "other-model"]
    assert [r.recipe["name"] for r in tput][:2] == ["slow-here", "fast-here"]
    top = lat[0]
    assert top.hardware_similarity == 1.0 and 0 < top.model_distance < 1.0 and top.best["p99_ms"] == 2.0
    assert "encoder_small" in top.why("latency") and "p99_ms 2 ms" in top.why("latency")
    assert all(r.recipe["name"] != "broken" for r in lat)                   # a violating run is no evidence


def test_a_recommendation_shows_one_measurements_metrics_together(tmp_path, captured):
    """A row paired the p99 of a 1-thread measurement (0.0859) with the p50 of a 2-thread one
    (0.0346): the best of each metric over different measurements, never measured together."""
    from graphmode.kb.record import Subject
    from graphmode.recipe import load_recipe
    path = tmp_path / "kb.sqlite"
    g, src, data = captured["mlp"]
    s = Subject(load_recipe(dict(data, name="mlp")), get_target("cpu_avx2"), src, g, None)
    rows = [perf("bench", p50_ms=0.0346, p99_ms=0.1083, throughput=100.0, threads=2),
            perf("bench", p50_ms=0.0351, p99_ms=0.0859, throughput=90.0, threads=1)]
    assert record(path, s, rows) is None
    with KnowledgeBase(path) as kb:
        lat, = recommend(kb, _row(captured, "mlp"), hardware_of(get_target("cpu_avx2")), "latency")
        tput, = recommend(kb, _row(captured, "mlp"), hardware_of(get_target("cpu_avx2")), "throughput")
    assert (lat.best["p99_ms"], lat.best["p50_ms"], lat.threads) == (0.0859, 0.0351, 1)
    assert (tput.best["throughput"], tput.best["p50_ms"], tput.threads) == (100.0, 0.0346, 2)
    assert "with 1 thread(s) (bench), the median of 1 of its 2 measurement(s)" in lat.why("latency")
    assert "no other recipe measured under the same conditions" in lat.why("latency")


def _ranked(tmp_path, captured, measured: dict[str, list[dict]], objective: str = "latency"):
    """Names in recommend's order, for recipes of one model on one machine measured as given."""
    from graphmode.kb.record import Subject
    from graphmode.recipe import load_recipe
    path = tmp_path / "kb.sqlite"
    g, src, data = captured["mlp"]
    for name, rows in measured.items():
        s = Subject(load_recipe(dict(data, name=name)), get_target("cpu_avx2"), src, g, None)
        assert record(path, s, rows) is None
    with KnowledgeBase(path) as kb:
        recs = recommend(kb, _row(captured, "mlp"), hardware_of(get_target("cpu_avx2")), objective, limit=None)
    return [r.recipe["name"] for r in recs], recs


def _bench(p99, batch=1, threads=2):
    return perf("bench", p50_ms=p99 / 2, p99_ms=p99, throughput=1000.0 / p99, bucket={"batch": batch},
                threads=threads)


def _tune(p99, run="r1", **extra):
    return perf("tune", p50_ms=p99 / 2, p99_ms=p99, throughput=1000.0 / p99, threads=2,
                extra={"run": run, **extra})


def test_recipes_are_compared_where_both_were_measured_not_by_their_best_number_anywhere(tmp_path, captured):
    """`a` was benched at batch 1 (1 ms) and tuned beside `b` over a mixed workload (3.3 ms vs 3.0):
    its batch-1 number ranked it first, though where the two were measured together `b` is faster."""
    names, recs = _ranked(tmp_path, captured, {"a": [_bench(1.0), _tune(3.3)], "b": [_tune(3.0)]})
    assert names == ["b", "a"]
    b, a = recs
    assert b.relative == 1.0 and a.relative == pytest.approx(1.1) and a.versus == 1
    assert "1.1x the best of 2 recipe(s) measured under the same conditions" in a.why("latency")
    assert b.best["p99_ms"] == 3.0 and a.best["p99_ms"] == 3.3          # shown where they were compared


def test_a_recipe_is_judged_by_its_median_not_its_luckiest_run(tmp_path, captured):
    names, recs = _ranked(tmp_path, captured, {"lucky": [_bench(1.0), _bench(5.0), _bench(5.2)],
                                               "steady": [_bench(4.0), _bench(4.1), _bench(4.2)]})
    assert names == ["steady", "lucky"] and recs[1].best["p99_ms"] == 5.0 and recs[1].samples == 3
    names, _ = _ranked(tmp_path / "t", captured, {"lucky": [_bench(1.0), _bench(5.0), _bench(5.2)],
                                                   "steady": [_bench(4.0), _bench(4.1), _bench(4.2)]}, "throughput")
    assert names == ["steady", "lucky"]


def test_a_tuning_gain_that_did_not_repeat_is_not_recommended_over_the_recipe_it_was_measured_against(
        tmp_path, captured):
    """Tune measured `tuned` at 2.0 ms against the recipe as written at 3.0, then both again (3.1 vs
    3.0): the gain did not hold and tune kept the recipe as written, but kb recommend ranked `tuned`
    first on its one lucky trial."""
    held = {"confirmation": "best", "held": False}
    names, _ = _ranked(tmp_path, captured, {
        "as-written": [_tune(3.0), _tune(3.0, confirmation="baseline", held=False)],
        "tuned": [_tune(2.0), _tune(3.1, **held)]})
    assert names == ["as-written"]
    held = {"confirmation": "best", "held": True}         # a gain that repeated: its confirmation counts
    names, recs = _ranked(tmp_path / "held", captured, {
        "as-written": [_tune(1.0), _tune(3.0, confirmation="baseline", held=True)],
        "tuned": [_tune(2.0), _tune(2.5, **held)]})
    assert names == ["tuned", "as-written"] and recs[1].best["p99_ms"] == 3.0
