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
    assert "with 1 thread(s) (bench), the best of 2 measurement(s)" in lat.why("latency")
