"""precision pass: compute dtype with per-op overrides; outputs keep dtype and name."""
from __future__ import annotations

import torch

from graphmode.ir import Graph, TensorType, interpret, verify_graph
from graphmode.passes import PASSES, PassContext
from graphmode.verify.numerics import rel_l2


def attn_like() -> Graph:
    torch.manual_seed(0)
    g = Graph("p", dims={"batch": (1, 4)})
    g.add_input("x", TensorType("f32", ("batch", 16)))
    g.add_constant("w", torch.randn(16, 16) / 4)
    h, = g.add_node("linear", ["x", "w"], [TensorType("f32", ("batch", 16))])
    s, = g.add_node("softmax", [h], [TensorType("f32", ("batch", 16))], {"dim": -1})
    r, = g.add_node("reshape", [s], [TensorType("f32", ("batch*16",))], {"shape": [-1]})
    g.outputs = [r]
    return g


def run(g, compute, overrides=None):
    ctx = PassContext(options={"precision": {"compute": compute, "overrides": overrides or {}}})
    res = PASSES["precision"](g, ctx)
    verify_graph(res.graph)
    return res


def test_f32_is_a_no_op():
    g = attn_like()
    res = run(g, "f32")
    assert not res.modified and res.graph is g


def test_bf16_with_fp32_softmax_override(golden):
    g = attn_like()
    res = run(g, "bf16", {"softmax": "f32"})
    out = res.graph
    assert out.outputs == g.outputs and out.type_of("reshape").dtype == "f32"
    assert out.type_of("linear").dtype == "bf16" and out.type_of("softmax").dtype == "f32"
    assert res.stats["casts"] == 3          # x and w down for linear, linear up for softmax
    golden("precision/bf16_softmax_f32", out.text())
    x = {"x": torch.randn(3, 16)}
    assert rel_l2(interpret(out, x)["reshape"], interpret(g, x)["reshape"]) < 2e-2
    all_bf16 = run(g, "bf16").graph
    assert all_bf16.type_of("softmax").dtype == "bf16"


def test_bf16_output_is_cast_back_under_its_name():
    g = attn_like()
    g2 = g.clone(nodes=g.nodes[:2])
    g2.outputs = ["softmax"]
    out = run(g2, "f16").graph
    assert out.outputs == ["softmax"] and out.type_of("softmax").dtype == "f32"
    assert out.nodes[-1].op == "cast" and out.values["softmax"].role == "output"


def test_an_override_of_an_op_the_graph_does_not_have_is_said():
    """BERT's attention is captured as one sdpa op: `overrides: {softmax: bf16}` narrowed
    nothing and compiled without a word (trial T); an op name no op has is refused by the
    recipe check, an op this graph lacks is only known here."""
    import warnings

    from graphmode.capture.spec import GraphmodeNotice
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        res = run(attn_like(), "f32", {"layer_norm": "bf16", "softmax": "bf16"})
    notes = [str(w.message) for w in said if issubclass(w.category, GraphmodeNotice)]
    assert len(notes) == 1 and "layer_norm" in notes[0] and "softmax" not in notes[0].split(":")[1]
    assert res.stats["lowered"] == {"softmax": 1}
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        run(attn_like(), "bf16", {"softmax": "f32"})
    assert not [w for w in said if issubclass(w.category, GraphmodeNotice)]
