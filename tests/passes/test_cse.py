"""cse: golden IR for merged nodes, constants and fused regions, plus interpreter
equivalence on two buckets."""
from __future__ import annotations

from harness import check_pass

from graphmode.ir import parse_graph, verify_graph
from graphmode.passes import PASSES, PassContext



def run_case(golden, case, text, **kw):
    return check_pass("cse", golden, case, text, **kw)


def test_duplicate_nodes(golden):
    res = run_case(golden, "duplicates", """
graph @t(%x: f32[b,s], %w: f32[b,s]) -> (%y) {
  %a1: f32[b,s] = add(%x, %w)
  %a2: f32[b,s] = add(%w, %x) {"loc": "model.py:12"}
  %s1: f32[b,s] = sub(%x, %w)
  %s2: f32[b,s] = sub(%w, %x)
  %r1: f32[s,b] = permute(%a1) {"perm": [1, 0]}
  %r2: f32[s,b] = permute(%a2) {"perm": [1, 0]}
  %m1: f32[b*s] = reshape(%s1) {"shape": ["b*s"]}
  %m2: f32[b*s] = reshape(%s1) {"shape": [-1]}
  %t: f32[s,b] = mul(%r1, %r2)
  %u: f32[b*s] = add(%m1, %m2)
  %v: f32[b*s] = reshape(%s2) {"shape": ["b*s"]}
  %q: f32[b*s] = sub(%u, %v)
  %tt: f32[b*s] = reshape(%t) {"shape": ["b*s"]}
  %y: f32[b*s] = add(%q, %tt)
  return %y
}""")
    # add is commutative (a2 == a1, loc ignored), so r2 == r1 follows; sub is not, and
    # reshapes with differently written attributes stay distinct
    assert res.stats["merged"] == 2 and res.stats["merged_by_op"] == {"add": 1, "permute": 1}
    t = next(n for n in res.graph.nodes if n.outputs == ("t",))
    assert t.inputs == ("r1", "r1")


def test_constants_dedupe(golden):
    res = run_case(golden, "constants", """
graph @t(%x: f32[b,2]) -> (%y) {
  const %c0: f32[] = 0.5
  const %c1: f32[] = 0.5
  const %c2: f32[2] = [1.0, 2.0]
  const %c3: f32[2] = [1.0, 2.0]
  const %c4: f64[2] = [1.0, 2.0]
  const %nz: f32[] = -0.0
  const %pz: f32[] = 0.0
  param %p1: f32[2] = [1.0, 2.0]
  %a: f32[b,2] = mul(%x, %c0)
  %b2: f32[b,2] = mul(%x, %c1)
  %c: f32[b,2] = add(%a, %c2)
  %d: f32[b,2] = add(%b2, %c3)
  %e: f32[b,2] = sub(%c, %d)
  %f: f64[b,2] = add(%e, %c4)
  %g: f64[b,2] = add(%f, %nz)
  %h: f64[b,2] = add(%g, %pz)
  %y: f64[b,2] = add(%h, %p1)
  return %y
}""")
    # c1 -> c0, c3 -> c2; then b2 == a and d == c. f64 data, -0.0 vs 0.0 and params stay apart.
    assert res.stats["merged_constants"] == 2
    assert res.stats["merged_by_op"] == {"add": 1, "mul": 1}
    assert set(res.graph.constants) == {"c0", "c2", "c4", "nz", "pz", "p1"}
    params = PASSES["cse"](parse_graph(res.graph.text()), PassContext(options={"cse": {"dedupe_params": True}}))
    assert params.stats["merged_constants"] == 0  # p1 (param) and c2 (const) differ in role


def test_graph_outputs_keep_names(golden):
    res = run_case(golden, "outputs", """
graph @t(%x: f32[b,4]) -> (%o1, %o2, %o3) {
  %r: f32[b,4] = relu(%x)
  %o1: f32[b,4] = tanh(%r)
  %o2: f32[b,4] = tanh(%r)
  %t: f32[b,4] = neg(%x)
  %o3: f32[b,4] = neg(%x)
  %u: f32[b,4] = exp(%t)
  return %o1, %o2, %o3
}""", buckets=({"b": 1}, {"b": 3}))
    g = res.graph
    # o2 duplicates another output: kept. o3 duplicates t: t takes the output's name
    assert [n.outputs[0] for n in g.nodes] == ["r", "o1", "o2", "o3", "u"]
    assert g.nodes[-1].inputs == ("o3",) and "t" not in g.values
    assert res.stats["kept_for_output"] == 1


def test_fused_bodies_compared_structurally(golden):
    res = run_case(golden, "fused", """
graph @t(%x: f32[b,4]) -> (%y) {
  %f1: f32[b,4] = fused(%x) {"kind": "elementwise", "pattern": "relu+neg"} {
    %i1: f32[b,4] = relu(%x)
    %f1: f32[b,4] = neg(%i1)
  }
  %f2: f32[b,4] = fused(%x) {"kind": "elementwise", "pattern": "relu+neg"} {
    %i2: f32[b,4] = relu(%x)
    %f2: f32[b,4] = neg(%i2)
  }
  %f3: f32[b,4] = fused(%x) {"kind": "elementwise", "pattern": "relu+neg"} {
    %i3: f32[b,4] = relu(%x)
    %f3: f32[b,4] = exp(%i3)
  }
  %a: f32[b,4] = add(%f1, %f2)
  %y: f32[b,4] = add(%a, %f3)
  return %y
}""", buckets=({"b": 1}, {"b": 3}))
    assert res.stats["merged_by_op"] == {"fused": 1}


def test_random_fallback_not_merged():
    g = parse_graph("""
graph @t(%x: f32[4]) -> (%y) {
  %r1: f32[4] = fallback(%x) {"target": "aten.rand_like.default", "args": [{"$in": 0}]}
  %r2: f32[4] = fallback(%x) {"target": "aten.rand_like.default", "args": [{"$in": 0}]}
  %c1: f32[4] = fallback(%x) {"target": "aten.cumsum.default", "args": [{"$in": 0}, 0]}
  %c2: f32[4] = fallback(%x) {"target": "aten.cumsum.default", "args": [{"$in": 0}, 0]}
  %a: f32[4] = add(%r1, %r2)
  %b: f32[4] = add(%c1, %c2)
  %y: f32[4] = add(%a, %b)
  return %y
}""")
    res = PASSES["cse"](g, PassContext())
    verify_graph(res.graph)
    assert res.stats["merged_by_op"] == {"fallback": 1}
    assert [n.outputs[0] for n in res.graph.nodes if n.op == "fallback"] == ["r1", "r2", "c1"]


def test_deterministic():
    text = """
graph @t(%x: f32[b,4]) -> (%y) {
  const %k2: f32[] = 2.0
  const %k1: f32[] = 2.0
  %a: f32[b,4] = mul(%x, %k2)
  %c: f32[b,4] = mul(%x, %k1)
  %y: f32[b,4] = add(%a, %c)
  return %y
}"""
    r1 = PASSES["cse"](parse_graph(text), PassContext())
    r2 = PASSES["cse"](parse_graph(text), PassContext())
    assert r1.graph.text() == r2.graph.text()
    assert set(r1.graph.constants) == {"k1"}  # first name in sorted order wins
    assert not PASSES["cse"](r1.graph, PassContext()).modified
