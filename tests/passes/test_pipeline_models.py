"""The rewrite passes on the captured real models: canonicalize, constant_fold, cse, dce,
layout, dce through the pass manager (which verifies the IR after every pass). Checks that
the graphs shrink, ResNet's batch norms fold away, GPT-2's weight transposes are folded,
the result is deterministic, and the interpreter gives the captured graph's outputs."""
from __future__ import annotations

import pytest

from graphmode.ir import interpret
from graphmode.passes import PassContext, PassManager
from graphmode.passes.registry import check_order
from graphmode.verify.numerics import rel_l2

PIPELINE = ["canonicalize", "constant_fold", "cse", "dce", "layout", "dce"]
BUCKETS = {
    "minilm": [{"batch": 1, "seq": 16}, {"batch": 2, "seq": 33}],
    "gpt2": [{"batch": 1, "seq": 8}, {"batch": 2, "seq": 17}],
    "resnet18": [{"batch": 1}, {"batch": 2}],
}


class RewritePipeline(PassManager):
    """The pass manager without its "must end with memory_plan" rule: these tests are about
    the rewrite passes, not the planner. The order is still checked."""

    def __init__(self, names, ctx):
        problems = [p for p in check_order(names + ["memory_plan"]) if p[0] < len(names)]
        assert not problems, problems
        self.names = list(names)
        self.ctx = ctx


_CACHE: dict = {}


def optimized(captured, name):
    if name not in _CACHE:
        g, _ = captured(name)
        before = g.structural_hash()
        g2, report = RewritePipeline(PIPELINE, PassContext()).run(g)
        assert g.structural_hash() == before, "a pass mutated the shared captured graph"
        _CACHE[name] = (g, g2, report)
    return _CACHE[name]


@pytest.mark.parametrize("name", ["minilm", "gpt2", "resnet18"])
def test_pipeline_shrinks_and_is_deterministic(captured, name):
    g, g2, report = optimized(captured, name)
    assert len(g2.nodes) < len(g.nodes)
    assert g2.outputs == g.outputs and g2.inputs == g.inputs
    assert [p.name for p in report.passes] == PIPELINE
    assert "identity" not in g2.op_counts()
    again, _ = RewritePipeline(PIPELINE, PassContext()).run(g)
    assert again.structural_hash() == g2.structural_hash()


def test_resnet_batch_norms_fold(captured):
    g, g2, report = optimized(captured, "resnet18")
    assert g.op_counts()["batch_norm"] == 20
    assert "batch_norm" not in g2.op_counts()
    assert g2.op_counts()["conv2d"] == 20
    assert report.passes[1].stats["bn_folded"] == 20


def test_gpt2_weight_transposes_fold(captured):
    g, g2, report = optimized(captured, "gpt2")
    assert report.passes[1].stats["pretransposed"] == 48
    # every linear reads a constant [out, in] weight; only activation permutes remain
    assert all(n.inputs[1] in g2.constants for n in g2.nodes if n.op == "linear")
    assert not any(n.inputs[0] in g2.constants for n in g2.nodes if n.op == "permute")


@pytest.mark.parametrize("name", ["minilm", "gpt2", "resnet18"])
def test_pipeline_preserves_outputs(captured, bundle, name):
    g, g2, _ = optimized(captured, name)
    b = bundle(name)
    for seed, env in enumerate(BUCKETS[name]):
        inputs = b.make_inputs(env, seed)
        want, got = interpret(g, inputs), interpret(g2, inputs)
        for out in g.outputs:
            err = rel_l2(got[out], want[out])
            assert err < 1e-5, (name, env, out, err)
