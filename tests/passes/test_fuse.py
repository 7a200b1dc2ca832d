"""The `fuse` pass: golden IR per pattern on hand-built graphs, the rewrite's invariants
(no cycles, visible values stay outputs, option limits), numerics before/after, and the
groups it finds on the captured MiniLM, GPT-2 and ResNet-18."""
from __future__ import annotations

import collections

import pytest
import torch

from graphmode.errors import PassError
from graphmode.ir import interpret, parse_graph, verify_graph
from graphmode.ir.graph import Graph
from graphmode.passes import PASSES, PassContext
from graphmode.verify.numerics import TOLERANCE, random_inputs, rel_l2

ENVS = [{"batch": 1, "seq": 3}, {"batch": 3, "seq": 7}]


def fuse(g: Graph, **opts):
    r = PASSES["fuse"](g, PassContext(options={"fuse": opts}))
    verify_graph(r.graph)
    return r


def assert_same_numerics(before: Graph, after: Graph, envs=ENVS, inputs=None) -> None:
    for k, env in enumerate(envs):
        ins = inputs(env, k) if inputs else random_inputs(before, env, seed=k)
        want = interpret(before, ins)
        got = interpret(after, ins)
        assert list(got) == list(want)
        for name in want:
            err = rel_l2(got[name], want[name])
            assert err < TOLERANCE["f32"], f"{name} at {env}: rel L2 {err}"


def fused_nodes(g: Graph):
    return [n for n in g.nodes if n.op == "fused"]


def top_ops(g: Graph) -> collections.Counter:
    return collections.Counter(n.op for n in g.nodes)


# ------------------------------------------------------------------------ hand-built graphs

# GPT-2's tanh GELU as torch.export writes it, behind a broadcast bias add
TANH_GELU = """
graph @tanh_gelu(%x: f32[batch,seq,8], %b: f32[8]) -> (%r) {
  dims batch=1..4 seq=1..16
  const %c1: f32[] = 0.5
  const %c2: f32[] = 3.0
  const %c3: f32[] = 0.044715
  const %c4: f32[] = 0.7978845834732056
  const %c5: f32[] = 1.0
  %h: f32[batch,seq,8] = add(%x, %b)
  %m1: f32[batch,seq,8] = mul(%h, %c1)
  %p: f32[batch,seq,8] = pow(%h, %c2)
  %m2: f32[batch,seq,8] = mul(%p, %c3)
  %a1: f32[batch,seq,8] = add(%h, %m2)
  %m3: f32[batch,seq,8] = mul(%a1, %c4)
  %t: f32[batch,seq,8] = tanh(%m3)
  %a2: f32[batch,seq,8] = add(%t, %c5)
  %g: f32[batch,seq,8] = mul(%m1, %a2)
  %r: f32[batch*seq,8] = reshape(%g) {"shape": ["batch*seq", 8]}
  return %r
}
"""

# linear -> bias -> gelu -> residual add; a second linear whose result is also returned
# (its relu must not be fused: the GEMM result has a user outside the epilogue)
GEMM_LINEAR = """
graph @gemm_linear(%x: f32[batch,8], %w: f32[8,8], %b: f32[8], %w2: f32[8,8]) -> (%y, %z, %u) {
  dims batch=1..4 seq=1..16
  %l: f32[batch,8] = linear(%x, %w)
  %lb: f32[batch,8] = add(%l, %b)
  %g: f32[batch,8] = gelu(%lb) {"approximate": "none"}
  %y: f32[batch,8] = add(%g, %x)
  %z: f32[batch,8] = linear(%y, %w2, %b)
  %u: f32[batch,8] = relu(%z)
  return %y, %z, %u
}
"""

# ResNet's basic-block tail (conv -> bn -> add(identity) -> relu) and its stem (conv -> bn -> relu)
GEMM_CONV = """
graph @gemm_conv(%x: f32[batch,4,5,5], %w1: f32[4,4,3,3], %w2: f32[4,4,3,3]) -> (%out) {
  dims batch=1..4 seq=1..16
  param %bn_w: f32[4] = [1.0, 0.5, 2.0, 1.5]
  param %bn_b: f32[4] = [0.1, -0.2, 0.0, 0.3]
  param %bn_m: f32[4] = [0.0, 0.5, -0.5, 0.25]
  param %bn_v: f32[4] = [1.0, 2.0, 0.5, 1.5]
  %c1: f32[batch,4,5,5] = conv2d(%x, %w1) {"padding": [1, 1]}
  %n1: f32[batch,4,5,5] = batch_norm(%c1, %bn_w, %bn_b, %bn_m, %bn_v) {"eps": 1e-05}
  %r1: f32[batch,4,5,5] = relu(%n1)
  %c2: f32[batch,4,5,5] = conv2d(%r1, %w2) {"padding": [1, 1]}
  %n2: f32[batch,4,5,5] = batch_norm(%c2, %bn_w, %bn_b, %bn_m, %bn_v) {"eps": 1e-05}
  %s: f32[batch,4,5,5] = add(%n2, %x)
  %out: f32[batch,4,5,5] = relu(%s)
  return %out
}
"""

# scale -> mask -> softmax -> scale: a softmax with prologue and epilogue (no matmul: not attention)
REDUCTION_SOFTMAX = """
graph @reduction_softmax(%s: f32[batch,2,seq,seq], %mask: f32[batch,1,1,seq]) -> (%y) {
  dims batch=1..4 seq=1..16
  const %scale: f32[] = 0.125
  const %two: f32[] = 2.0
  %a: f32[batch,2,seq,seq] = mul(%s, %scale)
  %b: f32[batch,2,seq,seq] = add(%a, %mask)
  %p: f32[batch,2,seq,seq] = softmax(%b) {"dim": -1}
  %y: f32[batch,2,seq,seq] = mul(%p, %two)
  return %y
}
"""

# RMSNorm: a keepdim mean over the last dim whose result is broadcast back over the row
REDUCTION_RMSNORM = """
graph @reduction_rmsnorm(%x: f32[batch,seq,8], %w: f32[8]) -> (%y) {
  dims batch=1..4 seq=1..16
  const %two: f32[] = 2.0
  const %eps: f32[] = 1e-06
  %sq: f32[batch,seq,8] = pow(%x, %two)
  %ms: f32[batch,seq,1] = mean(%sq) {"dims": [-1], "keepdim": true}
  %me: f32[batch,seq,1] = add(%ms, %eps)
  %rs: f32[batch,seq,1] = rsqrt(%me)
  %xn: f32[batch,seq,8] = mul(%x, %rs)
  %y: f32[batch,seq,8] = mul(%xn, %w)
  return %y
}
"""

# GPT-2's pre-LN residual stream: the residual sum feeds the norm AND the next residual add,
# so it stays an output of the norm group
NORM_RESIDUAL = """
graph @norm_residual(%x: f32[batch,seq,8], %h: f32[batch,seq,8], %g: f32[8], %b: f32[8], %w: f32[8,8]) -> (%r2) {
  dims batch=1..4 seq=1..16
  %hc: f32[batch,seq,8] = identity(%h)
  %r: f32[batch,seq,8] = add(%x, %hc)
  %ln: f32[batch,seq,8] = layer_norm(%r, %g, %b) {"eps": 1e-05, "normalized_rank": 1}
  %y: f32[batch,seq,8] = linear(%ln, %w, %b)
  %r2: f32[batch,seq,8] = add(%r, %y)
  return %r2
}
"""

# eager attention as HF/ONNX write it: k transposed by a permute, divided by sqrt(d), additive mask
ATTENTION_MASKED = """
graph @attention_masked(%q: f32[batch,2,seq,4], %k: f32[batch,2,seq,4], %v: f32[batch,2,seq,4], %mask: f32[batch,1,1,seq]) -> (%o) {
  dims batch=1..4 seq=1..16
  const %sqrt_d: f32[] = 2.0
  %kt: f32[batch,2,4,seq] = permute(%k) {"perm": [0, 1, 3, 2]}
  %s: f32[batch,2,seq,seq] = matmul(%q, %kt)
  %sd: f32[batch,2,seq,seq] = div(%s, %sqrt_d)
  %sm: f32[batch,2,seq,seq] = add(%sd, %mask)
  %p: f32[batch,2,seq,seq] = softmax(%sm) {"dim": -1}
  %a: f32[batch,2,seq,4] = matmul(%p, %v)
  %t: f32[batch,seq,2,4] = permute(%a) {"perm": [0, 2, 1, 3]}
  %o: f32[batch,seq,8] = reshape(%t) {"shape": ["batch", "seq", 8]}
  return %o
}
"""

# k^T arrives already transposed (a permute back is inserted), scale on the left of the mul,
# causal mask as where(mask, s, -inf); an existing sdpa node is kept as is
ATTENTION_CAUSAL = """
graph @attention_causal(%q: f32[batch,seq,4], %kt: f32[batch,4,seq], %v: f32[batch,seq,4]) -> (%o, %o2) {
  dims batch=1..4 seq=1..16
  const %scale: f32[] = 0.25
  const %ninf: f32[] = "-inf"
  %i: i64[seq] = arange() {"dtype": "i64", "end": "seq", "start": 0, "step": 1}
  %rows: i64[seq,1] = reshape(%i) {"shape": ["seq", 1]}
  %cols: i64[1,seq] = reshape(%i) {"shape": [1, "seq"]}
  %causal: bool[seq,seq] = le(%cols, %rows)
  %s: f32[batch,seq,seq] = matmul(%q, %kt)
  %ss: f32[batch,seq,seq] = mul(%scale, %s)
  %sm: f32[batch,seq,seq] = where(%causal, %ss, %ninf)
  %p: f32[batch,seq,seq] = softmax(%sm) {"dim": 2}
  %pc: f32[batch,seq,seq] = identity(%p)
  %o: f32[batch,seq,4] = matmul(%pc, %v)
  %o2: f32[batch,seq,4] = sdpa(%q, %v, %v) {"is_causal": false, "scale": 0.5}
  return %o, %o2
}
"""

# the attention probabilities are returned too: the block cannot become one sdpa op, and the
# softmax is fused with its scale prologue instead
ATTENTION_PROBS_USED = """
graph @attention_probs_used(%q: f32[batch,seq,4], %k: f32[batch,seq,4], %v: f32[batch,seq,4]) -> (%o, %p) {
  dims batch=1..4 seq=1..16
  const %scale: f32[] = 0.5
  %kt: f32[batch,4,seq] = permute(%k) {"perm": [0, 2, 1]}
  %s: f32[batch,seq,seq] = matmul(%q, %kt)
  %ss: f32[batch,seq,seq] = mul(%s, %scale)
  %p: f32[batch,seq,seq] = softmax(%ss) {"dim": -1}
  %o: f32[batch,seq,4] = matmul(%p, %v)
  return %o, %p
}
"""

# the scale on q (mul) and on k before its transpose (div): both fold into sdpa's scale
ATTENTION_QK_SCALED = """
graph @attention_qk_scaled(%q: f32[batch,2,seq,4], %k: f32[batch,2,seq,4], %v: f32[batch,2,seq,4]) -> (%o) {
  dims batch=1..4 seq=1..16
  const %qs: f32[] = 0.5
  const %ks: f32[] = 2.0
  %qq: f32[batch,2,seq,4] = mul(%q, %qs)
  %kk: f32[batch,2,seq,4] = div(%k, %ks)
  %kt: f32[batch,2,4,seq] = permute(%kk) {"perm": [0, 1, 3, 2]}
  %s: f32[batch,2,seq,seq] = matmul(%qq, %kt)
  %p: f32[batch,2,seq,seq] = softmax(%s) {"dim": -1}
  %o: f32[batch,2,seq,4] = matmul(%p, %v)
  return %o
}
"""
# GPT-2/HF eager: where(keep, scores, finfo.min) with a keep mask that leaves some rows empty
# (random inputs): the additive mask where(keep, 0, finfo.min) is exact on those rows too
ATTENTION_FILL_MIN = """
graph @attention_fill_min(%q: f32[batch,2,seq,4], %k: f32[batch,2,seq,4], %v: f32[batch,2,seq,4], %keep: bool[batch,1,seq,seq]) -> (%o) {
  dims batch=1..4 seq=1..16
  const %sqrt_d: f32[] = 2.0
  const %min: f32[] = -3.4028234663852886e+38
  %kt: f32[batch,2,4,seq] = permute(%k) {"perm": [0, 1, 3, 2]}
  %s: f32[batch,2,seq,seq] = matmul(%q, %kt)
  %sd: f32[batch,2,seq,seq] = div(%s, %sqrt_d)
  %sm: f32[batch,2,seq,seq] = where(%keep, %sd, %min)
  %p: f32[batch,2,seq,seq] = softmax(%sm) {"dim": -1}
  %o: f32[batch,2,seq,4] = matmul(%p, %v)
  return %o
}
"""
# masked_fill(pad == 0, -1e9) as torch.export writes it: where(drop, fill, scores)
ATTENTION_MASKED_FILL = """
graph @attention_masked_fill(%q: f32[batch,seq,4], %k: f32[batch,seq,4], %v: f32[batch,seq,4], %pad: i64[batch,1,seq]) -> (%o) {
  dims batch=1..4 seq=1..16
  const %zero: i64[] = 0
  const %big: f32[] = -1000000000.0
  const %scale: f32[] = 0.5
  %drop: bool[batch,1,seq] = eq(%pad, %zero)
  %kt: f32[batch,4,seq] = permute(%k) {"perm": [0, 2, 1]}
  %s: f32[batch,seq,seq] = matmul(%q, %kt)
  %ss: f32[batch,seq,seq] = mul(%s, %scale)
  %sm: f32[batch,seq,seq] = where(%drop, %big, %ss)
  %p: f32[batch,seq,seq] = softmax(%sm) {"dim": -1}
  %o: f32[batch,seq,4] = matmul(%p, %v)
  return %o
}
"""
# two layers share a causal mask and a -10000 fill: one additive mask serves both
ATTENTION_CAUSAL_10000 = """
graph @attention_causal_10000(%x: f32[batch,seq,4]) -> (%o2) {
  dims batch=1..4 seq=1..16
  const %fill: f32[] = -10000.0
  %i: i64[seq] = arange() {"dtype": "i64", "end": "seq", "start": 0, "step": 1}
  %rows: i64[seq,1] = reshape(%i) {"shape": ["seq", 1]}
  %cols: i64[1,seq] = reshape(%i) {"shape": [1, "seq"]}
  %causal: bool[seq,seq] = le(%cols, %rows)
  %xt: f32[batch,4,seq] = permute(%x) {"perm": [0, 2, 1]}
  %s1: f32[batch,seq,seq] = matmul(%x, %xt)
  %m1: f32[batch,seq,seq] = where(%causal, %s1, %fill)
  %p1: f32[batch,seq,seq] = softmax(%m1) {"dim": -1}
  %o1: f32[batch,seq,4] = matmul(%p1, %x)
  %ot: f32[batch,4,seq] = permute(%o1) {"perm": [0, 2, 1]}
  %s2: f32[batch,seq,seq] = matmul(%o1, %ot)
  %m2: f32[batch,seq,seq] = where(%causal, %s2, %fill)
  %p2: f32[batch,seq,seq] = softmax(%m2) {"dim": -1}
  %o2: f32[batch,seq,4] = matmul(%p2, %o1)
  return %o2
}
"""
# multi-query attention: k and v have one head, broadcast to q's four
ATTENTION_MQA = """
graph @attention_mqa(%q: f32[batch,4,seq,8], %k: f32[batch,1,seq,8], %v: f32[batch,1,seq,8], %mask: f32[batch,1,1,seq]) -> (%o) {
  dims batch=1..4 seq=1..16
  const %scale: f32[] = 0.35355339059327373
  %kt: f32[batch,1,8,seq] = permute(%k) {"perm": [0, 1, 3, 2]}
  %s: f32[batch,4,seq,seq] = matmul(%q, %kt)
  %ss: f32[batch,4,seq,seq] = mul(%s, %scale)
  %sm: f32[batch,4,seq,seq] = add(%ss, %mask)
  %p: f32[batch,4,seq,seq] = softmax(%sm) {"dim": -1}
  %o: f32[batch,4,seq,8] = matmul(%p, %v)
  return %o
}
"""
# grouped-query attention as HF's repeat_kv writes it: k and v repeated to q's heads
ATTENTION_GQA_REPEAT = """
graph @attention_gqa_repeat(%q: f32[batch,4,seq,8], %k: f32[batch,2,seq,8], %v: f32[batch,2,seq,8]) -> (%o) {
  dims batch=1..4 seq=1..16
  const %scale: f32[] = 0.35355339059327373
  %k5: f32[batch,2,1,seq,8] = reshape(%k) {"shape": ["batch", 2, 1, "seq", 8]}
  %ke: f32[batch,2,2,seq,8] = expand(%k5) {"shape": ["batch", 2, 2, "seq", 8]}
  %kr: f32[batch,4,seq,8] = reshape(%ke) {"shape": ["batch", 4, "seq", 8]}
  %v5: f32[batch,2,1,seq,8] = reshape(%v) {"shape": ["batch", 2, 1, "seq", 8]}
  %ve: f32[batch,2,2,seq,8] = expand(%v5) {"shape": ["batch", 2, 2, "seq", 8]}
  %vr: f32[batch,4,seq,8] = reshape(%ve) {"shape": ["batch", 4, "seq", 8]}
  %kt: f32[batch,4,8,seq] = permute(%kr) {"perm": [0, 1, 3, 2]}
  %s: f32[batch,4,seq,seq] = matmul(%q, %kt)
  %ss: f32[batch,4,seq,seq] = mul(%s, %scale)
  %p: f32[batch,4,seq,seq] = softmax(%ss) {"dim": -1}
  %o: f32[batch,4,seq,8] = matmul(%p, %vr)
  return %o
}
"""

# a fill of -5 does not mask (exp(-5) is not 0): not attention as sdpa knows it
ATTENTION_SMALL_FILL = """
graph @attention_small_fill(%q: f32[batch,seq,4], %k: f32[batch,seq,4], %v: f32[batch,seq,4], %keep: bool[batch,seq,seq]) -> (%o) {
  dims batch=1..4 seq=1..16
  const %fill: f32[] = -5.0
  %kt: f32[batch,4,seq] = permute(%k) {"perm": [0, 2, 1]}
  %s: f32[batch,seq,seq] = matmul(%q, %kt)
  %sm: f32[batch,seq,seq] = where(%keep, %s, %fill)
  %p: f32[batch,seq,seq] = softmax(%sm) {"dim": -1}
  %o: f32[batch,seq,4] = matmul(%p, %v)
  return %o
}
"""

CHAIN5 = """
graph @chain5(%x: f32[batch,seq]) -> (%e) {
  dims batch=1..4 seq=1..16
  %a: f32[batch,seq] = neg(%x)
  %b: f32[batch,seq] = exp(%a)
  %c: f32[batch,seq] = tanh(%b)
  %d: f32[batch,seq] = abs(%c)
  %e: f32[batch,seq] = sigmoid(%d)
  return %e
}
"""

# %e -> %d directly and through a reshape round trip: fusing %e with %d would swallow the path
# through the reshapes and need it both before and after the group (a cycle)
DIAMOND = """
graph @diamond(%x: f32[batch,seq]) -> (%y) {
  dims batch=1..4 seq=1..16
  %n: f32[batch,seq] = neg(%x)
  %e: f32[batch,seq] = exp(%n)
  %f: f32[batch*seq] = reshape(%e) {"shape": ["batch*seq"]}
  %back: f32[batch,seq] = reshape(%f) {"shape": ["batch", "seq"]}
  %d: f32[batch,seq] = add(%e, %back)
  %y: f32[batch,seq] = tanh(%d)
  return %y
}
"""

# values used outside the group (%a by a non-fusable reduction, %b as a graph output) stay
# outputs of the fused node; a different-shape op (%row) is not pulled in
OUTPUT_KEPT = """
graph @output_kept(%x: f32[batch,seq], %s: f32[seq]) -> (%b, %c, %total) {
  dims batch=1..4 seq=1..16
  %a: f32[batch,seq] = exp(%x)
  %b: f32[batch,seq] = neg(%a)
  %row: f32[seq] = mul(%s, %s)
  %c: f32[batch,seq] = add(%b, %row)
  %total: f32[seq] = sum(%a) {"dims": [0]}
  return %b, %c, %total
}
"""

# an sdpa as BERT / GPT-2 call it: heads split by reshape + permute [0,2,1,3] on q, k and v, the
# result permuted back; the second layer's v is not permuted (it stays bhsd), the third's
# result is read as heads-first too (its permute back stays and the sdpa stays bhsd)
ATTENTION_HEADS = """
graph @attention_heads(%x: f32[batch,seq,8], %mask: bool[batch,1,seq,seq], %vh: f32[batch,2,seq,4]) -> (%o, %o2, %a3, %o3) {
  dims batch=1..4 seq=1..16
  %x4: f32[batch,seq,2,4] = reshape(%x) {"shape": ["batch", "seq", 2, 4]}
  %q: f32[batch,2,seq,4] = permute(%x4) {"perm": [0, 2, 1, 3]}
  %k: f32[batch,2,seq,4] = permute(%x4) {"perm": [0, 2, 1, 3]}
  %v: f32[batch,2,seq,4] = permute(%x4) {"perm": [0, 2, 1, 3]}
  %a: f32[batch,2,seq,4] = sdpa(%q, %k, %v, %mask) {"is_causal": false, "scale": 0.5}
  %t: f32[batch,seq,2,4] = permute(%a) {"perm": [0, 2, 1, 3]}
  %o: f32[batch,seq,8] = reshape(%t) {"shape": ["batch", "seq", 8]}
  %a2: f32[batch,2,seq,4] = sdpa(%q, %k, %vh) {"is_causal": true, "scale": null}
  %t2: f32[batch,seq,2,4] = permute(%a2) {"perm": [0, 2, 1, -1]}
  %o2: f32[batch,seq,8] = reshape(%t2) {"shape": ["batch", "seq", 8]}
  %a3: f32[batch,2,seq,4] = sdpa(%q, %k, %v) {"is_causal": true}
  %o3: f32[batch,seq,2,4] = permute(%a3) {"perm": [0, 2, 1, 3]}
  return %o, %o2, %a3, %o3
}
"""

# (case name, IR text, fuse options)
CASES = [
    ("elementwise_tanh_gelu", TANH_GELU, {}),
    ("gemm_epilogue_linear", GEMM_LINEAR, {}),
    ("gemm_epilogue_conv", GEMM_CONV, {}),
    ("elementwise_only_patterns", GEMM_LINEAR, {"patterns": ["elementwise"]}),
    ("reduction_softmax", REDUCTION_SOFTMAX, {}),
    ("reduction_rmsnorm", REDUCTION_RMSNORM, {}),
    ("norm_residual", NORM_RESIDUAL, {}),
    ("attention_masked", ATTENTION_MASKED, {}),
    ("attention_causal", ATTENTION_CAUSAL, {}),
    ("attention_probs_used", ATTENTION_PROBS_USED, {}),
    ("attention_qk_scaled", ATTENTION_QK_SCALED, {}),
    ("attention_fill_min", ATTENTION_FILL_MIN, {}),
    ("attention_masked_fill", ATTENTION_MASKED_FILL, {}),
    ("attention_causal_10000", ATTENTION_CAUSAL_10000, {}),
    ("attention_mqa", ATTENTION_MQA, {}),
    ("attention_gqa_repeat", ATTENTION_GQA_REPEAT, {}),
    ("attention_small_fill", ATTENTION_SMALL_FILL, {}),
    ("attention_heads", ATTENTION_HEADS, {}),
    ("max_ops_2", CHAIN5, {"max_ops": 2}),
    ("diamond", DIAMOND, {}),
    ("output_kept", OUTPUT_KEPT, {}),
]


@pytest.mark.parametrize("name,text,opts", CASES, ids=[c[0] for c in CASES])
def test_golden(name, text, opts, golden):
    g = parse_graph(text)
    verify_graph(g)
    before = g.text()
    r = fuse(g, **opts)
    assert g.text() == before, "fuse mutated its input graph"
    golden(f"fuse/{name}", r.graph.text())
    # the text form is an API: the fused graph parses back to itself
    assert parse_graph(r.graph.text(), r.graph.constants).text() == r.graph.text()


@pytest.mark.parametrize("name,text,opts", CASES, ids=[c[0] for c in CASES])
def test_numerics_preserved(name, text, opts):
    g = parse_graph(text)
    assert_same_numerics(g, fuse(g, **opts).graph)


def test_tanh_gelu_is_one_group():
    r = fuse(parse_graph(TANH_GELU))
    (node,) = fused_nodes(r.graph)
    assert node.attrs == {"kind": "elementwise", "pattern": "add+mul+pow+mul+add+mul+tanh+add+mul"}
    assert node.outputs == ("g",) and node.body.inputs == list(node.inputs)
    assert r.stats == {"groups": 1, "by_kind": {"elementwise": 1}, "ops_fused": 9, "largest_group": 9,
                       "attention_rewrites": 0}
    # internal values vanish from the outer graph, constants the body reads are node inputs
    assert "m1" not in r.graph.values and "c1" in node.inputs and "c1" in r.graph.constants


def test_gemm_epilogue_needs_single_use_result():
    r = fuse(parse_graph(GEMM_LINEAR))
    kinds = [(n.attrs["kind"], n.attrs["pattern"], n.outputs) for n in fused_nodes(r.graph)]
    assert kinds == [("gemm_epilogue", "linear+add+gelu+add", ("y",))]
    assert [n.op for n in r.graph.nodes] == ["fused", "linear", "relu"]


def test_conv_epilogues():
    r = fuse(parse_graph(GEMM_CONV))
    assert [n.attrs["pattern"] for n in fused_nodes(r.graph)] == ["conv2d+batch_norm+relu",
                                                                  "conv2d+batch_norm+add+relu"]
    assert all(n.body.nodes[0].op == "conv2d" for n in fused_nodes(r.graph))


def test_norm_keeps_residual_as_output():
    r = fuse(parse_graph(NORM_RESIDUAL))
    norm, epi = fused_nodes(r.graph)
    assert norm.attrs["kind"] == "norm" and norm.outputs == ("r", "ln")
    assert norm.attrs["pattern"] == "identity+add+layer_norm"
    assert epi.attrs == {"kind": "gemm_epilogue", "pattern": "linear+add"} and "r" in epi.inputs


# ConvNeXt's norm: channels last by a permute, a layer_norm alone, then the MLP's linear
LONE_NORM = """
graph @lone_norm(%x: f32[batch,8,4,4], %g: f32[8], %b: f32[8], %w: f32[16,8]) -> (%y) {
  dims batch=1..4
  %p: f32[batch,4,4,8] = permute(%x) {"perm": [0, 2, 3, 1]}
  %ln: f32[batch,4,4,8] = layer_norm(%p, %g, %b) {"eps": 1e-06, "normalized_rank": 1}
  %y: f32[batch,4,4,16] = linear(%ln, %w)
  return %y
}
"""


def test_a_lone_layer_norm_is_a_group_of_its_own_under_the_default_min_ops():
    """Its generated row kernel spares ATen's dispatch and thread team (ConvNeXt's 35 us each);
    a recipe that asks for groups of 3 or more keeps it ATen's."""
    r = fuse(parse_graph(LONE_NORM))
    assert [(n.attrs["kind"], n.attrs["pattern"]) for n in fused_nodes(r.graph)] == [("norm", "layer_norm")]
    assert not fused_nodes(fuse(parse_graph(LONE_NORM), min_ops=3).graph)


def test_attention_reads_heads_in_place():
    """The head permutes around an sdpa fold into its `bshd` layout: the first sdpa's (in and out),
    not the second's (its v arrives heads-first) nor the third's (its result is an output too)."""
    r = fuse(parse_graph(ATTENTION_HEADS))
    sd = [n for n in r.graph.nodes if n.op == "sdpa"]
    assert [n.attrs.get("layout", "bhsd") for n in sd] == ["bshd", "bhsd", "bhsd"]
    assert sd[0].inputs == ("x4", "x4", "x4", "mask") and sd[0].outputs == ("t",)
    assert r.stats["attention_heads_layout"] == 1
    # q, k and v are still read by the other two sdpa: their permutes stay
    assert {"q", "k", "v"} <= {i for n in r.graph.nodes for i in n.inputs}


def test_attention_becomes_sdpa():
    r = fuse(parse_graph(ATTENTION_MASKED))
    sd = [n for n in r.graph.nodes if n.op == "sdpa"]
    assert len(sd) == 1 and sd[0].inputs == ("q", "k", "v", "mask") and sd[0].outputs == ("a",)
    assert sd[0].attrs["scale"] == 0.5
    assert top_ops(r.graph) == {"sdpa": 1, "permute": 1, "reshape": 1}
    assert not {"kt", "s", "sd", "sm", "p", "sqrt_d"} & set(r.graph.values)
    assert r.stats["attention_rewrites"] == 1


def test_attention_causal_where_mask_and_transposed_key():
    r = fuse(parse_graph(ATTENTION_CAUSAL))
    sd = [n for n in r.graph.nodes if n.op == "sdpa"]
    assert len(sd) == 2
    new, kept = sorted(sd, key=lambda n: n.outputs[0])
    assert kept.inputs == ("q", "v", "v") and kept.attrs == {"is_causal": False, "scale": 0.5}
    assert new.inputs[0] == "q" and new.inputs[2:] == ("v", "causal") and new.attrs["scale"] == 0.25
    assert new.attrs["nan_empty_rows"]            # made from a softmax written out: its NaN rows
    k = new.inputs[1]
    (perm,) = [n for n in r.graph.nodes if n.outputs == (k,)]
    assert perm.op == "permute" and perm.inputs == ("kt",) and perm.attrs == {"perm": [0, 2, 1]}
    assert r.graph.values[k].type.text() == "f32[batch,seq,4]"


def test_attention_not_rewritten_when_probs_are_used():
    r = fuse(parse_graph(ATTENTION_PROBS_USED))
    assert "sdpa" not in top_ops(r.graph) and r.stats["attention_rewrites"] == 0
    (node,) = fused_nodes(r.graph)
    assert node.attrs == {"kind": "reduction", "pattern": "mul+softmax"} and node.outputs == ("p",)


def sdpa_nodes(g: Graph):
    return [n for n in g.nodes if n.op == "sdpa"]


def test_attention_scales_on_q_and_k_fold_into_sdpa():
    r = fuse(parse_graph(ATTENTION_QK_SCALED))
    (sd,) = sdpa_nodes(r.graph)
    assert sd.inputs == ("q", "k", "v") and sd.attrs == {"is_causal": False, "scale": 0.25, "nan_empty_rows": True}
    assert top_ops(r.graph) == {"sdpa": 1} and r.stats["attention"] == 1
    # a scaled q that is also read elsewhere stays, and sdpa reads it unscaled by the rule
    g = parse_graph(ATTENTION_QK_SCALED.replace("-> (%o)", "-> (%o, %qq)").replace("return %o", "return %o, %qq"))
    (sd,) = sdpa_nodes(fuse(g).graph)
    assert sd.inputs == ("qq", "k", "v") and sd.attrs["scale"] == 0.5


def test_attention_finite_fills_become_additive_masks():
    r = fuse(parse_graph(ATTENTION_FILL_MIN))
    (sd,) = sdpa_nodes(r.graph)
    (mask,) = [n for n in r.graph.nodes if n.outputs == (sd.inputs[3],)]
    assert mask.op == "where" and mask.inputs == ("keep", "keep_zero", "min") and sd.attrs["scale"] == 0.5
    assert r.graph.values[sd.inputs[3]].type.text() == "f32[batch,1,seq,seq]"
    assert r.stats["attention_where_mask"] == 1
    r = fuse(parse_graph(ATTENTION_MASKED_FILL), patterns=["attention"])
    (sd,) = sdpa_nodes(r.graph)
    (mask,) = [n for n in r.graph.nodes if n.outputs == (sd.inputs[3],)]
    assert mask.op == "where" and mask.inputs == ("drop", "big", "drop_zero") and r.stats["attention_masked_fill"] == 1


def test_attention_layers_share_one_built_mask():
    r = fuse(parse_graph(ATTENTION_CAUSAL_10000), patterns=["attention"])
    masks = {n.inputs[3] for n in sdpa_nodes(r.graph)}
    assert len(sdpa_nodes(r.graph)) == 2 and masks == {"causal_additive"}
    assert [n.op for n in r.graph.nodes].count("where") == 1 and r.stats["attention_where_mask"] == 2


def test_attention_with_fewer_kv_heads():
    (sd,) = sdpa_nodes(fuse(parse_graph(ATTENTION_MQA)).graph)
    assert sd.inputs == ("q", "k", "v", "mask")
    r = fuse(parse_graph(ATTENTION_GQA_REPEAT))
    (sd,) = sdpa_nodes(r.graph)
    assert sd.inputs == ("q", "kr", "vr") and r.graph.values["kr"].type.text() == "f32[batch,4,seq,8]"


def test_attention_small_fill_is_not_a_mask():
    r = fuse(parse_graph(ATTENTION_SMALL_FILL))
    assert not sdpa_nodes(r.graph) and r.stats["attention_rewrites"] == 0


def test_max_and_min_ops():
    g = parse_graph(CHAIN5)
    r = fuse(g, max_ops=2)
    assert [n.attrs["pattern"] for n in fused_nodes(r.graph)] == ["neg+exp", "tanh+abs"]
    assert r.stats["largest_group"] == 2
    assert [n.op for n in r.graph.nodes] == ["fused", "fused", "sigmoid"]
    assert fuse(g, max_ops=5).stats["largest_group"] == 5
    r = fuse(g, min_ops=6, max_ops=16)
    assert not r.modified and r.graph.text() == g.text()
    # a group of two under min_ops=3 stays unfused, the larger one does not
    r = fuse(parse_graph(GEMM_CONV), min_ops=4)
    assert [n.attrs["pattern"] for n in fused_nodes(r.graph)] == ["conv2d+batch_norm+add+relu"]


def test_diamond_does_not_create_a_cycle():
    r = fuse(parse_graph(DIAMOND))
    groups = [set(n.body.values) - set(n.inputs) for n in fused_nodes(r.graph)]
    assert groups == [{"n", "e"}, {"d", "y"}]
    assert [n.op for n in r.graph.nodes] == ["fused", "reshape", "reshape", "fused"]


def test_values_used_outside_stay_outputs():
    r = fuse(parse_graph(OUTPUT_KEPT))
    (node,) = fused_nodes(r.graph)
    assert node.attrs["pattern"] == "exp+neg+add" and node.outputs == ("a", "b", "c")
    assert "row" not in node.body.values or "row" in node.inputs
    assert r.graph.outputs == ["b", "c", "total"]


@pytest.mark.parametrize("opts", [{"enabled": False}, {"patterns": []}])
def test_disabled(opts):
    g = parse_graph(GEMM_LINEAR)
    r = fuse(g, **opts)
    assert not r.modified and r.graph.text() == g.text() and r.stats["groups"] == 0


def test_pattern_selection():
    g = parse_graph(ATTENTION_MASKED)
    assert top_ops(fuse(g, patterns=["elementwise", "reduction"]).graph)["matmul"] == 2
    r = fuse(parse_graph(GEMM_CONV), patterns=["elementwise"])
    assert [n.attrs["pattern"] for n in fused_nodes(r.graph)] == ["add+relu"]


def test_idempotent():
    for _, text, opts in CASES:
        once = fuse(parse_graph(text), **opts).graph
        twice = fuse(once, **opts)
        assert not twice.modified and twice.graph.text() == once.text()


@pytest.mark.parametrize("opts,where", [
    ({"patterns": ["elementwise", "loops"]}, "optimize.fusion.patterns"),
    ({"patterns": "elementwise"}, "optimize.fusion.patterns"),
    ({"patterns": None}, "optimize.fusion.patterns"),
    ({"min_ops": 0}, "optimize.fusion.min_ops"),
    ({"max_ops": "8"}, "optimize.fusion.max_ops"),
    ({"min_ops": 5, "max_ops": 3}, "optimize.fusion.min_ops"),
    ({"enabled": "yes"}, "optimize.fusion.enabled"),
    ({"max_op": 3}, "optimize.fusion.max_op"),
])
def test_bad_options(opts, where):
    with pytest.raises(PassError) as e:
        fuse(parse_graph(CHAIN5), **opts)
    assert e.value.where == where


# ------------------------------------------------------------------------------ real models

PREPASSES = ("canonicalize", "constant_fold", "dce")
BUCKETS = {"minilm": [{"batch": 1, "seq": 9}, {"batch": 2, "seq": 5}],
           "gpt2": [{"batch": 1, "seq": 9}, {"batch": 2, "seq": 5}],
           "resnet18": [{"batch": 1}, {"batch": 2}]}


def _prepared(captured, name: str) -> Graph:
    """The capture after whichever cleanup passes exist (they never mutate their input)."""
    g, _ = captured(name)
    ctx = PassContext()
    for p in PREPASSES:
        if p in PASSES:
            g = PASSES[p](g, ctx).graph
    return g


def _groups(g: Graph) -> list:
    return [(n.attrs["kind"], n.attrs["pattern"].split("+")) for n in fused_nodes(g)]


@pytest.fixture(scope="module")
def fused_models(captured):
    out = {}
    for name in BUCKETS:
        g = _prepared(captured, name)
        text = g.text()
        r = fuse(g)
        assert g.text() == text
        out[name] = (g, r)
    return out


def test_minilm_groups(fused_models, bundle):
    g, r = fused_models["minilm"]
    assert r.stats["by_kind"]["norm"] == 13
    groups = _groups(r.graph)
    # every erf-GELU rides on its linear, every layer norm is fused with its residual/embedding add
    assert [p for k, p in groups if "gelu" in p] == [["linear", "gelu"]] * 6
    assert top_ops(r.graph)["gelu"] == 0 and top_ops(r.graph)["layer_norm"] == 0
    assert all("add" in p for k, p in groups if k == "norm")
    assert_same_numerics(g, r.graph, BUCKETS["minilm"], lambda env, k: bundle("minilm").make_inputs(env, seed=k))


def test_gpt2_groups(fused_models, bundle):
    g, r = fused_models["gpt2"]
    groups = _groups(r.graph)
    gelu = ["mul", "pow", "mul", "add", "mul", "tanh", "add", "mul"]
    tanh_groups = [p for k, p in groups if "tanh" in p]
    assert len(tanh_groups) == 12 and all("+".join(gelu) in "+".join(p) for p in tanh_groups)
    for op in ("tanh", "pow", "mul", "layer_norm"):
        assert top_ops(r.graph)[op] == 0, op
    norms = [p for k, p in groups if k == "norm"]
    assert len(norms) == 25 and all("add" in p for p in norms)
    # the pre-LN residual sum is both the norm's input and the next residual's operand
    assert sum(len(n.outputs) == 2 for n in fused_nodes(r.graph) if n.attrs["kind"] == "norm") >= 24
    assert_same_numerics(g, r.graph, BUCKETS["gpt2"], lambda env, k: bundle("gpt2").make_inputs(env, seed=k))


def test_resnet18_groups(fused_models, bundle):
    g, r = fused_models["resnet18"]
    groups = _groups(r.graph)
    assert top_ops(r.graph)["relu"] == 0 and top_ops(r.graph)["add"] == 0
    assert all(k == "gemm_epilogue" and p[0] == "conv2d" for k, p in groups)
    assert sum(p[-2:] == ["add", "relu"] for _, p in groups) == 8        # one per basic block
    assert sum(p[-1] == "relu" for _, p in groups) == 17                  # stem + 2 per block
    assert_same_numerics(g, r.graph, BUCKETS["resnet18"],
                         lambda env, k: bundle("resnet18").make_inputs(env, seed=k))


class _LastHidden(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask):
        return (self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state,)


def _eager_model(kind: str) -> torch.nn.Module:
    import transformers as T
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        if kind == "llama":       # grouped-query: 4 query heads share 2 key/value heads (repeat_kv)
            cfg = T.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, use_cache=False,
                                attn_implementation="eager")
            return _LastHidden(T.LlamaModel(cfg).eval())
        cfg = T.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, use_cache=False, attn_implementation="eager")
        return _LastHidden(T.GPT2Model(cfg).eval())


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_eager_attention_of_captured_models_becomes_sdpa(kind):
    """transformers' eager attention (scaled scores, additive masks, repeat_kv) captured by
    torch.export: every layer's block becomes one sdpa, and the result still matches eager."""
    from graphmode.capture.torch_import import import_torch
    model = _eager_model(kind)
    example = {"input_ids": torch.randint(0, 64, (2, 8)), "attention_mask": torch.ones(2, 8, dtype=torch.int64)}
    dims = {"input_ids": ["batch", "seq"], "attention_mask": ["batch", "seq"]}
    g, _ = import_torch(model, example, dims, {"batch": (1, 4), "seq": (2, 32)}, name=kind, output_names=["h"])
    for p in PREPASSES:
        g = PASSES[p](g, PassContext()).graph
    r = fuse(g)
    assert top_ops(r.graph)["sdpa"] == 2 and r.stats["attention_rewrites"] == 2
    assert "softmax" not in {n.op for n in r.graph.iter_nodes(recursive=True)}
    for env in ({"batch": 1, "seq": 5}, {"batch": 2, "seq": 7}):
        ids = torch.randint(0, 64, (env["batch"], env["seq"]))
        mask = torch.ones_like(ids)
        mask[-1, -2:] = 0                        # a padded row
        want = model(input_ids=ids, attention_mask=mask)[0]
        got = interpret(r.graph, {"input_ids": ids, "attention_mask": mask})[g.outputs[0]]
        assert rel_l2(got, want) < TOLERANCE["f32"]
