"""quantize_weights: golden IR for which linears become qlinear (constant f32 weights only; a
weight shared with another node keeps its f32 constant for it), the numbers it stores, and
the interpreter's outputs within the weight-only error bound of the f32 graph."""
from __future__ import annotations

import pytest
import torch

from graphmode.ir import interpret, parse_graph, verify_graph
from graphmode.ir.graph import constant_digest
from graphmode.passes import PASSES, PassContext
from graphmode.passes.quantize_weights import quantize
from graphmode.verify.numerics import WEIGHT_ONLY, random_inputs, rel_l2

TEXT = """
graph @t(%x: f32[b,s,16], %ids: i64[b,s], %wr: f32[8,16]) -> (%y, %z, %r) {{
  param %w1: f32[32,16] #{w1}
  param %b1: f32[32] #{b1}
  param %w2: f32[16,32] #{w2}
  param %emb: f32[10,16] #{emb}
  %h: f32[b,s,32] = linear(%x, %w1, %b1)
  %g: f32[b,s,32] = gelu(%h)
  %y: f32[b,s,16] = linear(%g, %w2)
  %e: f32[b,s,16] = embedding(%emb, %ids)
  %z: f32[b,s,10] = linear(%e, %emb)
  %r: f32[b,s,8] = linear(%x, %wr)
  return %y, %z, %r
}}"""


def _graph():
    g = torch.Generator().manual_seed(0)
    consts = {"w1": torch.randn(32, 16, generator=g), "b1": torch.randn(32, generator=g),
              "w2": torch.randn(16, 32, generator=g), "emb": torch.randn(10, 16, generator=g)}
    return parse_graph(TEXT.format(**{k: constant_digest(t) for k, t in consts.items()}), consts)


@pytest.mark.parametrize("weights", ["int8", "bf16"])
def test_constant_weights_become_qlinear(golden, weights):
    g = _graph()
    res = PASSES["quantize_weights"](g, PassContext(options={"quantize_weights": {"weights": weights}}))
    verify_graph(res.graph)
    golden(f"quantize_weights/{weights}", res.graph.text())
    out = res.graph
    assert res.stats["quantized"] == 3 and res.stats["linears"] == 3
    assert res.stats["bytes_after"] < res.stats["bytes_before"] * (0.3 if weights == "int8" else 0.55)
    # the runtime weight %wr is not a constant: its linear stays; the embedding keeps its f32 table
    assert [n.op for n in out.nodes if n.outputs[0] in ("h", "y", "z", "r")] == ["qlinear"] * 3 + ["linear"]
    assert "emb" in out.constants and "w1" not in out.constants and "w2" not in out.constants
    q, scale = quantize(g.constants["w1"], weights)
    h = next(n for n in out.nodes if n.outputs == ("h",))
    assert torch.equal(out.constants[h.inputs[1]], q) and torch.equal(out.constants[h.inputs[2]], scale)
    bound = WEIGHT_ONLY[weights]
    for seed, env in enumerate(({"b": 1, "s": 3}, {"b": 2, "s": 5})):
        inputs = random_inputs(g, env, seed, int_high=10)
        want, got = interpret(g, inputs), interpret(out, inputs)
        for name in g.outputs:
            assert rel_l2(got[name], want[name]) < bound, (weights, name)


def test_f32_weights_change_nothing():
    g = _graph()
    res = PASSES["quantize_weights"](g, PassContext())
    assert not res.modified and res.graph is g


@pytest.mark.parametrize("scheme", ["symmetric", "asymmetric"])
def test_int4_packs_the_linears_whose_input_holds_whole_groups(scheme):
    """Group 32: %w2 ([16, 32]) packs into u8 [16, 16] with scales per group; %w1 and the tied
    embedding (in = 16) stay f32 and are counted as left."""
    g = _graph()
    opts = {"weights": "int4", "group_size": 32, "int4_scheme": scheme}
    res = PASSES["quantize_weights"](g, PassContext(options={"quantize_weights": opts}))
    verify_graph(res.graph)
    out = res.graph
    assert res.stats["quantized"] == 1 and res.stats["left_f32"] == 2 and res.stats["int4_scheme"] == scheme
    assert [n.op for n in out.nodes if n.outputs[0] in ("h", "y", "z", "r")] == ["linear", "qlinear", "linear", "linear"]
    y = next(n for n in out.nodes if n.outputs == ("y",))
    w, scale = out.constants[y.inputs[1]], out.constants[y.inputs[2]]
    assert w.dtype == torch.uint8 and w.shape == (16, 16)
    assert scale.shape == ((16, 1, 2) if scheme == "asymmetric" else (16, 1))
    assert res.stats["bytes_after"] == w.numel() + scale.numel() * 4 and res.stats["bytes_before"] == 16 * 32 * 4
    for seed, env in enumerate(({"b": 1, "s": 3}, {"b": 2, "s": 5})):
        inputs = random_inputs(g, env, seed, int_high=10)
        want, got = interpret(g, inputs), interpret(out, inputs)
        assert rel_l2(got["y"], want["y"]) < WEIGHT_ONLY["int4"]
        assert torch.equal(got["r"], want["r"])


def test_int4_q8_activations_mark_the_qlinears():
    """int4_activations q8: the packed qlinears carry act q8, and the interpreter runs them as
    int4.q8_linear (x in int8 blocks), within the int4 bound of the f32 graph."""
    from graphmode.ir.ops import int4
    g = _graph()
    opts = {"weights": "int4", "group_size": 32, "int4_scheme": "symmetric", "int4_activations": "q8"}
    res = PASSES["quantize_weights"](g, PassContext(options={"quantize_weights": opts}))
    verify_graph(res.graph)
    out = res.graph
    y = next(n for n in out.nodes if n.outputs == ("y",))
    assert y.op == "qlinear" and y.attrs["act"] == "q8" and res.stats["int4_activations"] == "q8"
    inputs = random_inputs(g, {"b": 2, "s": 3}, 0, int_high=10)
    got, want = interpret(out, inputs), interpret(g, inputs)
    h = torch.nn.functional.gelu(torch.nn.functional.linear(inputs["x"], g.constants["w1"], g.constants["b1"]))
    assert torch.allclose(got["y"], int4.q8_linear(h, out.constants[y.inputs[1]], out.constants[y.inputs[2]]))
    assert 0 < rel_l2(got["y"], want["y"]) < WEIGHT_ONLY["int4"]


def test_what_stays_f32_is_said_and_storing_nothing_warns():
    """The pass counts why each linear keeps f32 weights (a computed weight, in features that
    hold no whole group); `weights_summary` says it, and flags a recipe that narrowed nothing;
    compiling such a recipe warns (GraphmodeNotice) instead of running f32 in silence."""
    from graphmode.passes.quantize_weights import weights_summary
    g = _graph()
    res = PASSES["quantize_weights"](g, PassContext(options={"quantize_weights": {"weights": "int4", "group_size": 32}}))
    assert res.stats["kept_f32"] == {"in features not a multiple of group_size 32": 2,
                                     "its weight is computed, not a constant": 1}
    line, warn = weights_summary(res.stats)         # some left f32 by the group size: a warning (it was silent)
    assert warn and line.startswith("precision.weights int4: 1 of 4 linear(s) stored int4 (2.0 KiB -> 0.3 KiB)")
    assert "2 stay f32 (in features not a multiple of group_size 32)" in line
    assert "no int4 group size (32, 64, 128) divides in features 16: precision.weights int8" in line
    res = PASSES["quantize_weights"](g, PassContext(options={"quantize_weights": {"weights": "int4", "group_size": 64}}))
    line, warn = weights_summary(res.stats)
    assert warn and "stored no weight narrow" in line and "precision.group_size: 32 narrows in features 32" in line
    assert weights_summary(PASSES["quantize_weights"](g, PassContext()).stats) is None


def test_compiling_a_recipe_that_narrows_nothing_warns(tmp_path):
    import warnings

    import graphmode
    from graphmode.capture.spec import GraphmodeNotice
    m = torch.nn.Linear(20, 8).eval()
    rec = {"version": 1, "name": "int4-nothing", "inputs": [{"name": "input", "dtype": "f32", "shape": ["batch", 20]}],
           "dims": {"batch": {"buckets": [2]}}, "exe_mode": "graph", "targets": ["host"],
           "precision": {"compute": "f32", "weights": "int4"}}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cm = graphmode.compile((m, {"input": torch.randn(2, 20)}), rec, cache_dir=tmp_path)
    said = [str(w.message) for w in caught if w.category is GraphmodeNotice]
    assert len(said) == 1 and "int4 stored no weight narrow" in said[0] and "group_size 32" in said[0]
    x = torch.randn(2, 20)
    with torch.no_grad():
        assert torch.allclose(cm(input=x), m(x), rtol=1e-5, atol=1e-5)
