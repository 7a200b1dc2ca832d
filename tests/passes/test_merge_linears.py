"""merge_linears: golden IR for the groups it merges (q/k/v without bias, gate/up with bias) and
those it leaves (a runtime weight, a lone linear, a bias where the others have none), the
interpreter's outputs on two buckets, and quantize_weights storing the merged weight exactly as
the concatenation of the parts it would have stored (int8 per row, int4 groups along `in`, bf16)."""
from __future__ import annotations

import pytest
import torch
from harness import check_pass

from graphmode.ir import parse_graph
from graphmode.ir.graph import constant_digest
from graphmode.passes import PASSES, PassContext
from graphmode.passes.quantize_weights import quantize

TEXT = """
graph @t(%x: f32[b,s,64], %wr: f32[8,64]) -> (%y, %r, %o) {{
  param %wq: f32[32,64] #{wq}
  param %wk: f32[16,64] #{wk}
  param %wv: f32[16,64] #{wv}
  param %wo: f32[64,48] #{wo}
  param %wg: f32[48,32] #{wg}
  param %bg: f32[48] #{bg}
  param %wu: f32[48,32] #{wu}
  param %bu: f32[48] #{bu}
  param %wb: f32[8,64] #{wb}
  param %bb: f32[8] #{bb}
  %q: f32[b,s,32] = linear(%x, %wq)
  %k: f32[b,s,16] = linear(%x, %wk)
  %r: f32[b,s,8] = linear(%x, %wr)
  %v: f32[b,s,16] = linear(%x, %wv)
  %o: f32[b,s,8] = linear(%x, %wb, %bb)
  %kv: f32[b,s,32] = concat(%k, %v) {{"dim": 2}}
  %a: f32[b,s,32] = add(%q, %kv)
  %h: f32[b,s,48] = linear(%a, %wg, %bg)
  %u: f32[b,s,48] = linear(%a, %wu, %bu)
  %sg: f32[b,s,48] = silu(%h)
  %m: f32[b,s,48] = mul(%sg, %u)
  %d: f32[b,s,64] = linear(%m, %wo)
  %y: f32[b,s,64] = add(%d, %x)
  return %y, %r, %o
}}"""
SHAPES = {"wq": (32, 64), "wk": (16, 64), "wv": (16, 64), "wo": (64, 48), "wg": (48, 32), "bg": (48,),
          "wu": (48, 32), "bu": (48,), "wb": (8, 64), "bb": (8,)}


def _consts():
    gen = torch.Generator().manual_seed(0)
    return {k: torch.randn(s, generator=gen) for k, s in SHAPES.items()}


def _text(consts):
    return TEXT.format(**{k: constant_digest(t) for k, t in consts.items()})


def test_qkv_and_gate_up_merge(golden):
    consts = _consts()
    res = check_pass("merge_linears", golden, "qkv_gate_up", _text(consts), constants=consts)
    assert res.stats == {"merged": 2, "linears_before": 5, "parts": [2, 3]}
    g = res.graph
    assert sum(n.op == "linear" for n in g.nodes) == 5           # qkv, gate+up, the runtime weight, wb, wo
    qkv = next(n for n in g.nodes if n.op == "linear" and n.inputs[0] == "x" and g.type_of(n.outputs[0]).shape[-1] == 64)
    assert torch.equal(g.constants[qkv.inputs[1]], torch.cat([consts["wq"], consts["wk"], consts["wv"]]))
    gu = next(n for n in g.nodes if n.op == "linear" and n.inputs[0] == "a")
    assert torch.equal(g.constants[gu.inputs[2]], torch.cat([consts["bg"], consts["bu"]]))
    assert not {"wq", "wk", "wv", "wg", "wu", "bg", "bu"} & set(g.constants)


def test_nothing_to_merge():
    g = parse_graph("""
graph @t(%x: f32[b,64], %w: f32[8,64]) -> (%y) {
  %y: f32[b,8] = linear(%x, %w)
  return %y
}""")
    res = PASSES["merge_linears"](g, PassContext())
    assert not res.modified and res.graph is g


@pytest.mark.parametrize("weights,extra", [("int8", {}), ("bf16", {}), ("int4", {"int4_scheme": "symmetric"}),
                                           ("int4", {"int4_scheme": "asymmetric"})])
def test_quantized_merge_stores_the_parts_exactly(weights, extra):
    """int8 scales rows, int4 groups `in`: neither crosses a part's rows, so the merged weight
    quantizes to the parts' codes and scales, concatenated, bit for bit."""
    consts = _consts()
    merged = PASSES["merge_linears"](parse_graph(_text(consts), consts), PassContext()).graph
    opts = {"weights": weights, "group_size": 32, **extra}
    q = PASSES["quantize_weights"](merged, PassContext(options={"quantize_weights": opts})).graph
    qkv = next(n for n in q.nodes if n.op == "qlinear" and n.inputs[0] == "x" and q.type_of(n.outputs[0]).shape[-1] == 64)
    parts = [quantize(consts[w], weights, 32, extra.get("int4_scheme", "symmetric")) for w in ("wq", "wk", "wv")]
    assert torch.equal(q.constants[qkv.inputs[1]], torch.cat([p[0] for p in parts]))
    assert torch.equal(q.constants[qkv.inputs[2]], torch.cat([p[1] for p in parts]))


def test_after_shard_each_rank_merges_its_own_heads():
    """Under parallel.tensor the recipe runs shard first (after constant_fold): each rank's q, k
    and v hold its heads' rows, and merging them is local; the ranks together still equal the
    unsharded graph."""
    from test_shard import ATTENTION, BUCKETS, ctx, ir, weights

    from graphmode.compiler import pipeline
    from graphmode.ir import interpret
    from graphmode.parallel.comm import run_ranks
    from graphmode.passes.registry import PRESETS, with_merged_linears
    from graphmode.recipe import load_recipe
    from graphmode.verify.numerics import random_inputs, rel_l2
    rec = load_recipe({"version": 1, "name": "tp", "inputs": [{"name": "x", "dtype": "f32", "shape": ["b", "s", 8]}],
                       "dims": {"b": {"buckets": [1]}, "s": {"buckets": [4]}},
                       "parallel": {"tensor": 2, "device_group": ["a", "b"], "links": {"lo": {"bandwidth_gbps": 1}}},
                       "optimize": {"passes": with_merged_linears(PRESETS["default"])}})
    names = pipeline(rec)
    assert names.index("shard") < names.index("merge_linears") < names.index("quantize_weights")
    consts = weights(wq=(8, 8), wk=(8, 8), wv=(8, 8), wo=(8, 8))
    g = parse_graph(ir(ATTENTION, consts), consts)
    ranks = [PASSES["merge_linears"](PASSES["shard"](g, ctx(r)).graph, PassContext()) for r in range(2)]
    assert all(r.stats["merged"] == 1 and r.stats["parts"] == [3] for r in ranks)
    for seed, env in enumerate(BUCKETS):
        inputs = random_inputs(g, env, seed, int_high=2)
        want = interpret(g, inputs)["y"]
        got = run_ranks(2, lambda r, comm: interpret(ranks[r].graph, inputs)["y"], timeout_s=30)
        assert all(rel_l2(got[r], want) < 1e-5 for r in range(2))
