"""End to end: compile real models, run graph / hybrid / eager, buckets and padding, contract
violations, the plan cache (incl. a corrupted entry) and concurrent calls."""
from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch

import graphmode
from graphmode.errors import ContractViolation, GraphmodeError
from graphmode.recipe import load_recipe
from graphmode.runtime.cache import ArtifactCache
from graphmode.verify.numerics import rel_l2

ROOT = Path(__file__).resolve().parents[2]


def resnet_recipe(**over) -> dict:
    r = {"version": 1, "name": "resnet-test",
         "inputs": [{"name": "pixel_values", "dtype": "f32", "shape": ["batch", 3, 64, 64]}],
         "dims": {"batch": {"buckets": [1, 2, 4]}}, "exe_mode": "graph", "targets": ["host"],
         "codegen": {"kernel_selection": "heuristic"}}     # tactics are timed in their own tests
    r.update(over)
    return r


def minilm_recipe(**over) -> dict:
    r = {"version": 1, "name": "minilm-test",
         "inputs": [{"name": n, "dtype": "i64", "shape": ["batch", "seq"]}
                    for n in ("input_ids", "attention_mask", "token_type_ids")],
         "dims": {"batch": {"buckets": [1, 2, 4]}, "seq": {"buckets": [8, 16, 32]}},
         "exe_mode": "graph", "targets": ["host"], "codegen": {"kernel_selection": "heuristic"}}
    r.update(over)
    return r


@pytest.fixture(scope="module")
def small_resnet():
    from graphmode.capture.zoo import build
    return build("resnet18", image_size=64)


@pytest.fixture(scope="module")
def resnet_model(small_resnet, tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    return graphmode.compile(small_resnet, load_recipe(resnet_recipe()), cache_dir=cache), cache


@pytest.fixture(scope="module")
def eager_fallback_cache(tmp_path_factory):
    """One cache for the tests of the on_violation: eager recipe: each builds the same plans."""
    return tmp_path_factory.mktemp("eager-fallback-cache")


def _eager(bundle, inputs):
    with torch.inference_mode():
        out = bundle.module(**inputs)
    return out[0] if isinstance(out, (tuple, list)) else out


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def test_graph_mode_matches_eager_in_every_bucket_and_pads(resnet_model, small_resnet):
    cm, _ = resnet_model
    for batch in (1, 2, 3, 4):       # 3 is padded up to the bucket 4 and sliced back
        x = small_resnet.make_inputs({"batch": batch}, seed=batch)
        got = _first(cm(**x))
        assert got.shape[0] == batch
        assert rel_l2(got, _eager(small_resnet, x)) < 1e-5
    assert cm.last_bucket == {"batch": 4}
    assert cm.events["compile"] + cm.events["cache_hit"] == 3
    assert cm.executable({"batch": 4}).generated >= 1 or not _compiler_available()


def _compiler_available() -> bool:
    try:
        from graphmode.backends.cpu.build import compiler_available
    except ImportError:
        return False
    return compiler_available()


def test_positional_call_and_structure(resnet_model, small_resnet):
    cm, _ = resnet_model
    x = small_resnet.make_inputs({"batch": 2}, seed=0)
    out = cm(x["pixel_values"])
    ref = small_resnet.module(**x)
    assert type(out) is type(ref) and len(out) == len(ref)


def test_shape_outside_contract_is_a_clear_violation(resnet_model, small_resnet):
    cm, _ = resnet_model
    with pytest.raises(ContractViolation, match=r"dim 'batch' = 5 is outside the recipe's range \[1, 4\]"):
        cm(pixel_values=torch.randn(5, 3, 64, 64))
    with pytest.raises(ContractViolation, match="axis 2 must be 64"):
        cm(pixel_values=torch.randn(1, 3, 32, 64))
    with pytest.raises(ContractViolation, match="dtype"):
        cm(pixel_values=torch.randn(1, 3, 64, 64, dtype=torch.float64))
    with pytest.raises(ContractViolation, match="unexpected keyword argument 'extra'"):
        cm(pixel_values=torch.randn(1, 3, 64, 64), extra=torch.ones(1))
    assert cm.metrics()["events"]["violation"] >= 1


def test_on_violation_eager_falls_back_and_counts(small_resnet, eager_fallback_cache):
    cm = graphmode.compile(small_resnet, load_recipe(resnet_recipe(on_violation="eager")),
                           cache_dir=eager_fallback_cache)
    x = torch.randn(6, 3, 64, 64)
    got = _first(cm(pixel_values=x))
    assert rel_l2(got, _eager(small_resnet, {"pixel_values": x})) < 1e-6
    assert cm.events["fallback"] == 1 and cm.events["violation"] == 1
    assert cm.metrics()["health_score"] == 0.0


def test_outputs_are_ordinary_tensors_the_caller_may_update(small_resnet, eager_fallback_cache):
    """Graph-mode outputs and an eager fallback's are plain tensors, as eager under no_grad gives:
    they were inference tensors, which refuse an in-place update outside inference mode."""
    cm = graphmode.compile(small_resnet, load_recipe(resnet_recipe(on_violation="eager")),
                           cache_dir=eager_fallback_cache)
    for batch in (2, 6):                         # 2: a bucket (graph); 6: outside it (eager)
        x = torch.randn(batch, 3, 64, 64)
        y = _first(cm(pixel_values=x))
        assert not y.is_inference() and not y.requires_grad
        want = y.clone() * 2
        y.mul_(2)                                # an inference tensor raised here
        assert torch.equal(y, want)
    assert cm.events["fallback"] == 1


def test_hybrid_mode_runs_excluded_op_as_eager_island(small_resnet, tmp_path):
    rec = resnet_recipe(exe_mode="hybrid", capture={"exclude_ops": ["max_pool2d"]})
    cm = graphmode.compile(small_resnet, load_recipe(rec), cache_dir=tmp_path)
    assert [f.target for f in cm.capture_report.fallbacks] == ["aten.max_pool2d.default"]
    assert any(n.op == "fallback" for n in cm.graph.nodes)
    x = small_resnet.make_inputs({"batch": 2}, seed=3)
    assert rel_l2(_first(cm(**x)), _eager(small_resnet, x)) < 1e-5
    with pytest.raises(GraphmodeError, match="exe_mode: hybrid"):
        graphmode.compile(small_resnet, load_recipe(resnet_recipe(capture={"exclude_ops": ["max_pool2d"]})),
                          cache_dir=tmp_path)


def test_eager_mode_runs_the_original_module(small_resnet, tmp_path):
    cm = graphmode.compile(small_resnet, load_recipe(resnet_recipe(exe_mode="eager")), cache_dir=tmp_path)
    x = small_resnet.make_inputs({"batch": 1}, seed=0)
    assert rel_l2(_first(cm(**x)), _eager(small_resnet, x)) == 0.0


@pytest.mark.slow     # ~14 s; corrupt and tampered entries: tests/e2e/test_cache_tamper.py
def test_cache_hit_and_corrupt_entry_rebuilt(small_resnet, tmp_path):
    rec = load_recipe(resnet_recipe())
    cm1 = graphmode.compile(small_resnet, rec, cache_dir=tmp_path)
    x = small_resnet.make_inputs({"batch": 2}, seed=0)
    ref = _first(cm1(**x))
    assert cm1.events["compile"] == 1
    cm2 = graphmode.compile(small_resnet, rec, cache_dir=tmp_path)
    # the same plan; not necessarily bit-identical: each executable re-reads the timing cache, and a
    # shape timed on a busy machine is timed again, so it may pick another (equally checked) tactic
    assert rel_l2(_first(cm2(**x)), ref) < 1e-5
    assert cm2.events["cache_hit"] == 1 and cm2.events["compile"] == 0
    cache = ArtifactCache(tmp_path)
    entry = next(e for e in cache.entries() if e.key["bucket"] == "batch=2")
    plan = entry.path / "plan.json"
    data = json.loads(plan.read_text())
    data["arena_bytes"] = 1      # a plausible-looking but wrong plan: the checksum must catch it
    plan.write_text(json.dumps(data))
    cm3 = graphmode.compile(small_resnet, rec, cache_dir=tmp_path)
    assert rel_l2(_first(cm3(**x)), ref) < 1e-5
    assert cm3.events["compile"] == 1
    assert any(e["event"] == "corrupt" for e in cm3.cache_events)
    (next(e for e in ArtifactCache(tmp_path).entries() if e.key["bucket"] == "batch=2").path / "plan.json").write_text("{")
    cm4 = graphmode.compile(small_resnet, rec, cache_dir=tmp_path)
    assert rel_l2(_first(cm4(**x)), ref) < 1e-5


def test_cache_explain_names_the_differing_field(small_resnet, tmp_path):
    from graphmode.runtime.cache import make_key
    rec = load_recipe(resnet_recipe())
    cm = graphmode.compile(small_resnet, rec, cache_dir=tmp_path)
    cm.executable({"batch": 1})
    cache = ArtifactCache(tmp_path)
    key = make_key(cm._graph_hash, rec.hash(), "host", {"batch": 2})
    res = cache.explain(key)
    assert res["result"] == "miss" and list(res["differs"]) == ["bucket"]
    assert cache.explain(make_key(cm._graph_hash, rec.hash(), "host", {"batch": 1}))["result"] == "hit"
    other = cache.explain(make_key("0" * 16, rec.hash(), "host", {"batch": 1}))   # another model's graph
    assert list(other["differs"]) == ["graph_hash"] and other["reason"].startswith("no entry holds this graph")
    assert cache.prune(0) and cache.entries() == []


def test_concurrent_calls_give_correct_results(resnet_model, small_resnet):
    cm, _ = resnet_model
    inputs = [small_resnet.make_inputs({"batch": b}, seed=10 + i) for i, b in enumerate((1, 2, 3, 4, 2, 1))]
    refs = [_eager(small_resnet, x) for x in inputs]
    errors: list[str] = []

    def worker(k: int) -> None:
        for r in range(4):
            i = (k + r) % len(inputs)
            got = _first(cm(**inputs[i]))
            if rel_l2(got, refs[i]) >= 1e-5:
                errors.append(f"thread {k} round {r}: input {i} mismatch")
    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors and not any(t.is_alive() for t in threads)


def test_minilm_graph_mode_with_padding_matches_eager(bundle, tmp_path):
    b = bundle("minilm")
    cm = graphmode.compile(b, load_recipe(minilm_recipe()), cache_dir=tmp_path)
    for env in ({"batch": 1, "seq": 8}, {"batch": 3, "seq": 11}):
        x = b.make_inputs(env, seed=2)
        out = cm(**x)
        ref = b.module(**x)
        for o, r in zip(out, ref):
            assert o.shape == r.shape
            assert rel_l2(o, r) < 1e-5
    assert cm.last_bucket == {"batch": 4, "seq": 16}


def test_real_sentences_cosine(bundle, tmp_path):
    from graphmode.capture.zoo import sentence_embeddings
    b = bundle("minilm")
    cm = graphmode.compile(b, load_recipe(minilm_recipe()), cache_dir=tmp_path)
    batch = b.tokenizer(["A man is eating food.", "A man is eating a piece of bread."], padding=True,
                        return_tensors="pt")
    x = {k: batch[k] for k in ("input_ids", "attention_mask", "token_type_ids")}
    emb = sentence_embeddings(cm(**x)[0], x["attention_mask"])
    assert abs(float(emb[0] @ emb[1]) - 0.755) < 0.01
