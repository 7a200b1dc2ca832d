"""dce: golden IR for dead chains, unused constants, fallback nodes and fused bodies, plus
interpreter equivalence on two buckets."""
from __future__ import annotations

from harness import check_pass

from graphmode.ir import parse_graph, verify_graph
from graphmode.passes import PASSES, PassContext



def run_case(golden, case, text, **kw):
    return check_pass("dce", golden, case, text, **kw)


def test_dead_chain_and_constants(golden):
    res = run_case(golden, "dead_chain", """
graph @t(%x: f32[b,s], %unused: f32[b]) -> (%y) {
  const %c: f32[] = 2.0
  const %dead_c: f32[] = 3.0
  param %w: f32[2] = [1.0, 2.0]
  %a: f32[b,s] = mul(%x, %c)
  %d1: f32[b,s] = mul(%x, %dead_c)
  %d2: f32[b,s] = relu(%d1)
  %d3: f32[s,b] = permute(%d2) {"perm": [1, 0]}
  %y: f32[b,s] = exp(%a)
  %after: f32[b,s] = neg(%y)
  return %y
}""")
    assert [n.outputs[0] for n in res.graph.nodes] == ["a", "y"]
    assert set(res.graph.constants) == {"c"}
    assert res.stats["removed"] == 4 and res.stats["pruned_constants"] == 2
    assert "unused" in res.graph.values  # inputs are the runtime's contract
    assert not PASSES["dce"](res.graph, PassContext()).modified


def test_fallback_kept_only_if_used(golden):
    res = run_case(golden, "fallback", """
graph @t(%x: f32[b,4]) -> (%y) {
  %c1: f32[b,4] = fallback(%x) {"target": "aten.cumsum.default", "args": [{"$in": 0}, 1]}
  %c2: f32[b,4] = fallback(%x) {"target": "aten.cumprod.default", "args": [{"$in": 0}, 1]}
  %y: f32[b,4] = add(%x, %c1)
  return %y
}""", buckets=({"b": 1}, {"b": 3}))
    assert res.stats["removed_by_op"] == {"fallback": 1}


def test_fused_body_dead_inner_nodes(golden):
    res = run_case(golden, "fused_body", """
graph @t(%x: f32[b,4]) -> (%y) {
  %f: f32[b,4] = fused(%x) {"kind": "elementwise", "pattern": "relu"} {
    %i: f32[b,4] = relu(%x)
    %dead: f32[b,4] = exp(%i)
    %f: f32[b,4] = neg(%i)
  }
  %g: f32[b,4] = fused(%x) {"kind": "elementwise", "pattern": "tanh"} {
    %j: f32[b,4] = tanh(%x)
    %g: f32[b,4] = neg(%j)
  }
  %y: f32[b,4] = relu(%f)
  return %y
}""", buckets=({"b": 1}, {"b": 3}))
    assert res.stats["removed"] == 1 and res.stats["removed_in_bodies"] == 1
    body = res.graph.nodes[0].body
    assert [n.op for n in body.nodes] == ["relu", "neg"] and "dead" not in body.values


def test_multi_output_node_kept_if_any_output_used():
    g = parse_graph("""
graph @t(%x: f32[4]) -> (%y) {
  %a: f32[4], %b: f32[4] = fused(%x) {"kind": "elementwise", "pattern": "two"} {
    %a: f32[4] = relu(%x)
    %b: f32[4] = neg(%x)
  }
  %y: f32[4] = exp(%b)
  return %y
}""")
    res = PASSES["dce"](g, PassContext())
    verify_graph(res.graph)
    assert [n.op for n in res.graph.nodes] == ["fused", "exp"]
    assert [n.op for n in res.graph.nodes[0].body.nodes] == ["relu", "neg"]  # a is a region output
