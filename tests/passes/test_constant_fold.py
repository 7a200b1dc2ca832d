"""constant_fold: golden IR for folding, weight pre-transposition and batch-norm folding,
plus interpreter equivalence on two buckets."""
from __future__ import annotations

from harness import check_pass

import torch

from graphmode.ir.graph import constant_digest
from graphmode.ir import parse_graph
from graphmode.passes import PASSES, PassContext



def run_case(golden, case, text, **kw):
    return check_pass("constant_fold", golden, case, text, **kw)


def _lin(*shape: int, lo: float = -1.0, hi: float = 1.0) -> torch.Tensor:
    """Deterministic, non-trivial weights (same bytes on every machine, so digests in the
    golden files are stable)."""
    n = 1
    for d in shape:
        n *= d
    return torch.linspace(lo, hi, n, dtype=torch.float32).reshape(shape)


def test_fold_chain(golden):
    res = run_case(golden, "fold_chain", """
graph @t(%x: f32[b,3]) -> (%y, %z) {
  param %w: f32[2,3] = [0.5, -1.0, 2.0, 1.5, 0.25, -0.75]
  const %c: f32[] = 2.0
  %wt: f32[3,2] = permute(%w) {"perm": [1, 0]}
  %ws: f32[3,2] = mul(%wt, %c)
  %f: f32[2] = full() {"shape": [2], "value": 0.5, "dtype": "f32"}
  %r: i64[3] = arange() {"end": 3}
  %rf: f32[3] = cast(%r) {"dtype": "f32"}
  %h: f32[b,2] = matmul(%x, %ws)
  %y: f32[b,2] = add(%h, %f)
  %z: f32[b,3] = add(%x, %rf)
  return %y, %z
}""")
    g = res.graph
    assert [n.op for n in g.nodes] == ["matmul", "add", "add"]
    assert res.stats["folded"] == 5 and res.stats["pretransposed"] == 1
    assert res.stats["folded_by_op"] == {"arange": 1, "cast": 1, "full": 1, "mul": 1, "permute": 1}
    # weight-derived results stay params; the rest are consts
    assert {k: g.values[k].role for k in ("wt", "ws", "f", "r", "rf")} == \
        {"wt": "param", "ws": "param", "f": "const", "r": "const", "rf": "const"}
    assert g.constants["wt"].is_contiguous()
    assert torch.equal(g.constants["ws"], torch.tensor([[1.0, 3.0], [-2.0, 0.5], [4.0, -1.5]]))


def test_symbolic_and_outputs_kept(golden):
    res = run_case(golden, "symbolic_kept", """
graph @t(%x: f32[b,s]) -> (%y, %o) {
  const %p: i64[1,8] = [0, 1, 2, 3, 4, 5, 6, 7]
  %r: i64[s] = arange() {"end": "s"}
  %f: f32[b,s] = full() {"shape": ["b", "s"], "value": 1.0, "dtype": "f32"}
  %sl: i64[1,s] = slice(%p) {"dim": 1, "start": 0, "end": "s", "step": 1}
  %rf: f32[1,s] = cast(%sl) {"dtype": "f32"}
  %a: f32[b,s] = add(%x, %f)
  %y: f32[b,s] = mul(%a, %rf)
  %o: f32[2] = full() {"shape": [2], "value": 3.0, "dtype": "f32"}
  return %y, %o
}""")
    assert not res.modified
    assert res.stats["skipped_symbolic"] == 3 and res.stats["folded"] == 0


def test_max_bytes_option():
    w = torch.arange(16, dtype=torch.float32).reshape(4, 4)
    g = parse_graph(f"""
graph @t(%x: f32[b,4]) -> (%y) {{
  param %w: f32[4,4] #{constant_digest(w)}
  %wt: f32[4,4] = permute(%w) {{"perm": [1, 0]}}
  %y: f32[b,4] = linear(%x, %wt)
  return %y
}}""", {"w": w})
    small = PASSES["constant_fold"](g, PassContext(options={"constant_fold": {"max_bytes": 32}}))
    assert not small.modified and small.stats["skipped_large"] == 1
    big = PASSES["constant_fold"](g, PassContext())
    assert big.stats["pretransposed"] == 1
    assert torch.equal(big.graph.constants["wt"], g.constants["w"].t())


def test_batch_norm_into_conv(golden):
    consts = {"w1": _lin(4, 3, 3, 3), "w3": _lin(4, 3, 3, 3, lo=-0.5, hi=0.7)}
    text = """
graph @t(%x: f32[b,3,6,6]) -> (%m, %z) {
  param %w1: f32[4,3,3,3] #D1
  param %w2: f32[4,3,1,1] = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, -0.1, -0.2, -0.3, -0.4, -0.5, -0.6]
  param %b2: f32[4] = [0.5, -0.5, 1.0, 0.0]
  param %w3: f32[4,3,3,3] #D3
  param %g: f32[4] = [1.0, 0.5, 2.0, -1.0]
  param %beta: f32[4] = [0.1, 0.2, 0.3, 0.4]
  param %mean: f32[4] = [0.0, 1.0, -1.0, 0.5]
  param %var: f32[4] = [1.0, 4.0, 0.25, 2.0]
  %c1: f32[b,4,4,4] = conv2d(%x, %w1) {"stride": [1, 1], "padding": [0, 0], "dilation": [1, 1], "groups": 1}
  %n1: f32[b,4,4,4] = batch_norm(%c1, %g, %beta, %mean, %var) {"eps": 1e-05}
  %r1: f32[b,4,4,4] = relu(%n1)
  %c2: f32[b,4,6,6] = conv2d(%x, %w2, %b2) {"stride": [1, 1], "padding": [0, 0], "dilation": [1, 1], "groups": 1}
  %n2: f32[b,4,6,6] = batch_norm(%c2, %g, %beta, %mean, %var) {"eps": 0.001}
  %c3: f32[b,4,4,4] = conv2d(%x, %w3) {"stride": [1, 1], "padding": [0, 0], "dilation": [1, 1], "groups": 1}
  %n3: f32[b,4,4,4] = batch_norm(%c3, %g, %beta, %mean, %var) {"eps": 1e-05}
  %y: f32[b,4,4,4] = add(%r1, %c3)
  %m: f32[b,4,4,4] = add(%y, %n3)
  %z: f32[b,4,6,6] = relu(%n2)
  return %m, %z
}""".replace("#D1", "#" + constant_digest(consts["w1"])).replace("#D3", "#" + constant_digest(consts["w3"]))
    res = run_case(golden, "bn_conv", text, constants=consts)
    g = res.graph
    assert res.stats["bn_folded"] == 2
    ops = [n.op for n in g.nodes]
    assert ops.count("batch_norm") == 1  # c3 has a second user: its batch_norm stays
    # the conv takes over the batch_norm's output; new weights are named after the conv weight
    conv1 = next(n for n in g.nodes if n.outputs == ("n1",))
    assert conv1.op == "conv2d" and conv1.inputs == ("x", "w1.weight_bn", "w1.bias_bn")
    assert "c1" not in g.values
    again = PASSES["constant_fold"](parse_graph(text, consts), PassContext())
    assert again.graph.structural_hash() == g.structural_hash()


def test_batch_norm_into_linear(golden):
    res = run_case(golden, "bn_linear", """
graph @t(%x: f32[b,3], %s3: f32[b,s,3]) -> (%y, %z) {
  param %w: f32[4,3] = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, -0.1, -0.2, -0.3, -0.4, -0.5, -0.6]
  param %bias: f32[4] = [0.5, -0.5, 1.0, 0.0]
  param %g: f32[4] = [1.0, 0.5, 2.0, -1.0]
  param %beta: f32[4] = [0.1, 0.2, 0.3, 0.4]
  param %mean: f32[4] = [0.0, 1.0, -1.0, 0.5]
  param %var: f32[4] = [1.0, 4.0, 0.25, 2.0]
  param %w3: f32[4,3] = [1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0]
  %l: f32[b,4] = linear(%x, %w, %bias)
  %y: f32[b,4] = batch_norm(%l, %g, %beta, %mean, %var) {"eps": 1e-05}
  %l3: f32[b,s,4] = linear(%s3, %w3)
  %l3t: f32[b,4,s] = permute(%l3) {"perm": [0, 2, 1]}
  %z: f32[b,4,s] = batch_norm(%l3t, %g, %beta, %mean, %var) {"eps": 1e-05}
  return %y, %z
}""")
    assert res.stats["bn_folded"] == 1
    assert [n.op for n in res.graph.nodes] == ["linear", "linear", "permute", "batch_norm"]


def test_folded_tensors_do_not_alias_inputs():
    g = parse_graph("""
graph @t(%x: f32[b,6]) -> (%y) {
  param %w: f32[2,3] = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
  %r: f32[6] = reshape(%w) {"shape": [6]}
  %y: f32[b,6] = add(%x, %r)
  return %y
}""")
    res = PASSES["constant_fold"](g, PassContext())
    r = res.graph.constants["r"]
    assert r.untyped_storage().data_ptr() != g.constants["w"].untyped_storage().data_ptr()
    assert r.is_contiguous()
