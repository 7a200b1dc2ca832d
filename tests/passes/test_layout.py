"""layout: golden IR for transpose elimination and weight-layout decisions, plus
interpreter equivalence on two buckets."""
from __future__ import annotations

from harness import check_pass

import torch

from graphmode.ir import interpret, parse_graph, verify_graph
from graphmode.passes import PASSES, PassContext



def run_case(golden, case, text, **kw):
    return check_pass("layout", golden, case, text, **kw)


def test_matmul_of_transposed_constant_becomes_linear(golden):
    res = run_case(golden, "matmul_to_linear", """
graph @t(%x: f32[b,s,3], %k: f32[b,s,3]) -> (%y, %z) {
  param %w: f32[2,3] = [0.5, -1.0, 2.0, 1.5, 0.25, -0.75]
  %wt: f32[3,2] = permute(%w) {"perm": [1, 0]}
  %y: f32[b,s,2] = matmul(%x, %wt)
  %kt: f32[b,3,s] = permute(%k) {"perm": [0, 2, 1]}
  %z: f32[b,s,s] = matmul(%x, %kt)
  return %y, %z
}""")
    # the weight is read as [out, in] by linear: no transposed copy; the activation
    # transpose stays (the core op set has no transposed matmul)
    assert res.stats["matmul_to_linear"] == 1 and res.stats["matmul_permute_kept"] == 1
    assert res.stats["linear_weights_out_in_contiguous"] == 1


def test_permute_cancels_through_elementwise_chain(golden):
    res = run_case(golden, "permute_cancel", """
graph @t(%x: f32[b,s,4]) -> (%y, %z) {
  const %half: f32[] = 0.5
  %p: f32[b,4,s] = permute(%x) {"perm": [0, 2, 1]}
  %r: f32[b,4,s] = relu(%p)
  %m: f32[b,4,s] = mul(%r, %half)
  %c: f16[b,4,s] = cast(%m) {"dtype": "f16"}
  %y: f16[b,s,4] = permute(%c) {"perm": [0, 2, 1]}
  %p2: f32[s,b,4] = permute(%x) {"perm": [1, 0, 2]}
  %e: f32[s,b,4] = exp(%p2)
  %z: f32[4,b,s] = permute(%e) {"perm": [2, 1, 0]}
  return %y, %z
}""")
    assert res.stats["permute_cancel"] == 2
    g = res.graph
    assert [n.op for n in g.nodes].count("permute") == 1
    last = next(n for n in g.nodes if n.outputs == ("y",))
    assert last.op == "cast" and g.values["m"].type.text() == "f32[b,s,4]"
    z = next(n for n in g.nodes if n.outputs == ("z",))
    assert z.op == "permute" and z.attrs["perm"] == [2, 0, 1] and z.inputs == ("e",)


def test_permute_kept_when_shared_or_output(golden):
    res = run_case(golden, "permute_kept", """
graph @t(%x: f32[b,s,4]) -> (%y, %r) {
  %p: f32[b,4,s] = permute(%x) {"perm": [0, 2, 1]}
  %r: f32[b,4,s] = relu(%p)
  %y: f32[b,s,4] = permute(%r) {"perm": [0, 2, 1]}
  return %y, %r
}""")
    assert not res.modified and "permute_cancel" not in res.stats


def test_binary_with_equally_permuted_inputs(golden):
    res = run_case(golden, "sink_binary", """
graph @t(%a: f32[b,s,4], %c: f32[b,1,4]) -> (%y) {
  %pa: f32[4,s,b] = permute(%a) {"perm": [2, 1, 0]}
  %pc: f32[4,1,b] = permute(%c) {"perm": [2, 1, 0]}
  %m: f32[4,s,b] = add(%pa, %pc)
  %y: f32[b,s,4] = permute(%m) {"perm": [2, 1, 0]}
  return %y
}""")
    # two permutes sink into one below the add, which then cancels with the last one
    assert res.stats["permute_sink_binary"] == 1 and res.stats["permute_cancel"] == 1
    assert [n.op for n in res.graph.nodes] == ["add"] and res.graph.nodes[0].outputs == ("y",)


def test_target_kind_recorded_and_weights_contiguous():
    from graphmode.targets.registry import get_target
    w = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()  # non-contiguous [4, 3]
    g = parse_graph("""
graph @t(%x: f32[b,3]) -> (%y) {
  param %w: f32[4,3] #D
  %y: f32[b,4] = linear(%x, %w)
  return %y
}""".replace("#D", "= " + str(w.reshape(-1).tolist())))
    g.constants["w"] = w  # the captured tensor, strided
    res = PASSES["layout"](g, PassContext(target=get_target("cpu_avx2")))
    verify_graph(res.graph)
    assert res.stats["target_kind"] == "cpu" and res.stats["linear_weights_made_contiguous"] == 1
    assert res.graph.constants["w"].is_contiguous() and not g.constants["w"].is_contiguous()
    assert res.graph.structural_hash() == g.structural_hash()
    x = torch.randn(2, 3)
    assert torch.equal(interpret(res.graph, {"x": x})["y"], interpret(g, {"x": x})["y"])
