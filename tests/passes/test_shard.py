"""shard: golden IR per rank (tests/golden/shard/<case>.rank<r>.txt), the verifier on every rank's
graph, and numerics: the ranks' graphs run together (thread ranks, the reference interpreter with
the collectives' own semantics) equal the unsharded graph at several buckets."""
from __future__ import annotations

import re

import pytest
import torch

from graphmode.errors import PassError
from graphmode.ir import interpret, parse_graph, verify_graph
from graphmode.ir.graph import constant_digest
from graphmode.parallel.comm import run_ranks
from graphmode.passes import PASSES, PassContext
from graphmode.verify.numerics import random_inputs, rel_l2

BUCKETS = ({"b": 1, "s": 3}, {"b": 2, "s": 5})
HEAD = {c: "head" for c in ("attention", "mlp", "embedding", "conv")}


def weights(**shapes) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {k: torch.randn(*s, generator=g) * 0.5 for k, s in shapes.items()}


def ir(text: str, consts: dict[str, torch.Tensor]) -> str:
    """`param %w: f32[...] #?` lines get the digest of consts['w']."""
    return re.sub(r"param %([\w.]+): (\S+) #\?", lambda m: f"param %{m[1]}: {m[2]} #{constant_digest(consts[m[1]])}",
                  text)


def ctx(rank: int, world: int = 2, strategy: dict | None = None, **kw) -> PassContext:
    return PassContext(options={"shard": {"rank": rank, "world": world, "strategy": strategy or HEAD, **kw}})


def shard_case(golden, case, text, consts, *, strategy=None, buckets=BUCKETS, world=2, int_high=2, **opts):
    g = parse_graph(ir(text, consts), consts)
    verify_graph(g)
    before = g.structural_hash()
    results = [PASSES["shard"](g, ctx(r, world, strategy, **opts)) for r in range(world)]
    assert g.structural_hash() == before, "the pass mutated its input graph"
    for r, res in enumerate(results):
        verify_graph(res.graph)
        assert res.graph.inputs == g.inputs and res.graph.outputs == g.outputs
        if golden is not None:
            golden(f"shard/{case}.rank{r}", res.graph.text())
    for seed, env in enumerate(buckets):
        inputs = random_inputs(g, env, seed, int_high=int_high)
        want = interpret(g, inputs)
        got = run_ranks(world, lambda r, comm: interpret(results[r].graph, inputs), timeout_s=30)
        for r in range(world):
            for name in g.outputs:
                assert rel_l2(got[r][name], want[name]) < 1e-5, (case, env, r, name)
    return results


MLP = """
graph @mlp(%x: f32[b,s,8]) -> (%y) {
  param %w1: f32[16,8] #?
  param %b1: f32[16] #?
  param %w2: f32[8,16] #?
  param %b2: f32[8] #?
  %h: f32[b,s,16] = linear(%x, %w1, %b1)
  %a: f32[b,s,16] = gelu(%h)
  %y: f32[b,s,8] = linear(%a, %w2, %b2)
  return %y
}"""


def test_mlp_column_then_row(golden):
    res = shard_case(golden, "mlp", MLP, weights(w1=(16, 8), b1=(16,), w2=(8, 16), b2=(8,)))
    s = res[0].stats
    assert (s["column_parallel"], s["row_parallel"], s["collectives"]) == (1, 1, {"all_reduce": 1})
    assert res[0].graph.values["w1.rank0"].type.shape == (8, 8)          # half the rows per rank
    assert not torch.equal(res[0].graph.constants["w1.rank0"], res[1].graph.constants["w1.rank1"])


RESIDUAL = """
graph @residual(%x: f32[b,s,8]) -> (%y) {
  param %w1: f32[9,8] #?
  param %w2: f32[8,9] #?
  param %w3: f32[16,8] #?
  param %w4: f32[8,16] #?
  %h: f32[b,s,9] = linear(%x, %w1)
  %a: f32[b,s,9] = gelu(%h)
  %d: f32[b,s,8] = linear(%a, %w2)
  %r: f32[b,s,8] = add(%x, %d)
  %h2: f32[b,s,16] = linear(%r, %w3)
  %a2: f32[b,s,16] = gelu(%h2)
  %d2: f32[b,s,8] = linear(%a2, %w4)
  %y: f32[b,s,8] = add(%r, %d2)
  return %y
}"""


def test_an_mlp_that_does_not_split_keeps_the_residual_stream_whole():
    """An intermediate size of 9 over two ranks: the first MLP runs whole, and its down projection
    too. Split column-parallel, it cut the residual stream, so the next MLP ran row-parallel then
    whole (a Llama's next attention kept every KV head, and TP decoding was refused)."""
    res = shard_case(None, "residual", RESIDUAL, weights(w1=(9, 8), w2=(8, 9), w3=(16, 8), w4=(8, 16)))
    s = res[0].stats
    assert (s["column_parallel"], s["row_parallel"], s["collectives"]) == (1, 1, {"all_reduce": 1})
    assert not s["gathered_for"]


ATTENTION = """
graph @attn(%x: f32[b,s,8], %mask: bool[b,1,s,s]) -> (%y) {
  param %wq: f32[8,8] #?
  param %wk: f32[8,8] #?
  param %wv: f32[8,8] #?
  param %wo: f32[8,8] #?
  %q0: f32[b,s,8] = linear(%x, %wq)
  %q1: f32[b,s,4,2] = reshape(%q0) {"shape": ["b", "s", 4, 2]}
  %q: f32[b,4,s,2] = permute(%q1) {"perm": [0, 2, 1, 3]}
  %k0: f32[b,s,8] = linear(%x, %wk)
  %k1: f32[b,s,4,2] = reshape(%k0) {"shape": ["b", "s", 4, 2]}
  %k: f32[b,4,s,2] = permute(%k1) {"perm": [0, 2, 1, 3]}
  %v0: f32[b,s,8] = linear(%x, %wv)
  %v1: f32[b,s,4,2] = reshape(%v0) {"shape": ["b", "s", 4, 2]}
  %v: f32[b,4,s,2] = permute(%v1) {"perm": [0, 2, 1, 3]}
  %o: f32[b,4,s,2] = sdpa(%q, %k, %v, %mask) {"scale": 0.7}
  %o1: f32[b,s,4,2] = permute(%o) {"perm": [0, 2, 1, 3]}
  %o2: f32[b,s,8] = reshape(%o1) {"shape": ["b", "s", 8]}
  %y: f32[b,s,8] = linear(%o2, %wo)
  return %y
}"""


def test_attention_split_by_heads(golden):
    res = shard_case(golden, "attention", ATTENTION, weights(wq=(8, 8), wk=(8, 8), wv=(8, 8), wo=(8, 8)))
    g = res[1].graph
    (sdpa,) = [n for n in g.nodes if n.op == "sdpa"]
    assert g.values[sdpa.outputs[0]].type.text() == "f32[b,2,s,2]"           # two of the four heads
    assert res[1].stats["collectives"] == {"all_reduce": 1} and not res[1].stats["gathered_for"]


def test_heads_that_do_not_split_are_gathered_not_wrong():
    """Three heads over two ranks: the reshape cannot split them, so the rank gathers the
    projection first (communication in the stats), and the result is still exact."""
    text = ATTENTION.replace("4, 2]", "3, 2]").replace(",4,2]", ",3,2]").replace("[b,4,", "[b,3,") \
        .replace("f32[b,s,8]", "f32[b,s,6]").replace("8, 8", "6, 6").replace('"s", 8]', '"s", 6]') \
        .replace("f32[8,8]", "f32[6,6]").replace("%x: f32[b,s,6]", "%x: f32[b,s,6]")
    res = shard_case(None, "odd_heads", text, weights(wq=(6, 6), wk=(6, 6), wv=(6, 6), wo=(6, 6)))
    assert res[0].stats["gathered_for"].get("reshape", 0) == 3


PAGED = """
graph @paged(%x: f32[b,s,8], %table: i64[b,3], %start: i64[b], %lens: i64[b]) -> (%y) {
  param %wq: f32[8,8] #?
  param %wk: f32[4,8] #?
  param %wv: f32[4,8] #?
  param %wo: f32[8,8] #?
  state %kv.k.0: f32[6,2,2,2] #0
  state %kv.v.0: f32[6,2,2,2] #0
  %q0: f32[b,s,8] = linear(%x, %wq)
  %q1: f32[b,s,4,2] = reshape(%q0) {"shape": ["b", "s", 4, 2]}
  %q: f32[b,4,s,2] = permute(%q1) {"perm": [0, 2, 1, 3]}
  %k0: f32[b,s,4] = linear(%x, %wk)
  %k1: f32[b,s,2,2] = reshape(%k0) {"shape": ["b", "s", 2, 2]}
  %k: f32[b,2,s,2] = permute(%k1) {"perm": [0, 2, 1, 3]}
  %v0: f32[b,s,4] = linear(%x, %wv)
  %v1: f32[b,s,2,2] = reshape(%v0) {"shape": ["b", "s", 2, 2]}
  %v: f32[b,2,s,2] = permute(%v1) {"perm": [0, 2, 1, 3]}
  %o: f32[b,4,s,2] = paged_attention(%q, %k, %v, %kv.k.0, %kv.v.0, %table, %start, %lens) {"scale": 0.7}
  %o1: f32[b,s,4,2] = permute(%o) {"perm": [0, 2, 1, 3]}
  %o2: f32[b,s,8] = reshape(%o1) {"shape": ["b", "s", 8]}
  %y: f32[b,s,8] = linear(%o2, %wo)
  return %y
}"""


def test_paged_attention_keeps_the_rank_s_kv_heads_in_its_pools(golden):
    """A decoder's attention on the paged cache (grouped-query: 4 query heads over 2 KV heads):
    each rank's pools keep one KV head, under the names the decode engine pages; a prefill then
    a decode step (the pools carry the first step's K/V into the second) on both ranks together
    equal the unsharded graph's."""
    w = weights(wq=(8, 8), wk=(4, 8), wv=(4, 8), wo=(8, 8))
    pools = {k: torch.zeros(6, 2, 2, 2) for k in ("kv.k.0", "kv.v.0")}
    g = parse_graph(ir(PAGED, w), {**w, **pools})
    verify_graph(g)
    res = [PASSES["shard"](g, ctx(r)) for r in range(2)]
    for r, rg in enumerate(res):
        verify_graph(rg.graph)
        golden(f"shard/paged_attention.rank{r}", rg.graph.text())
        assert [tuple(rg.graph.constants[k].shape) for k in pools] == [(6, 2, 1, 2)] * 2
        assert rg.graph.values["kv.k.0"].role == "state" and not rg.stats["gathered_for"]
    table = torch.tensor([[0, 2, 4], [1, 3, 5]])
    x = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(0))
    steps = [{"x": x, "table": table, "start": torch.tensor([0, 0]), "lens": torch.tensor([3, 2])},
             {"x": x[:, :1], "table": table, "start": torch.tensor([3, 2]), "lens": torch.tensor([1, 1])}]
    for feed in steps:
        want = interpret(g, feed)["y"]
        got = run_ranks(2, lambda r, comm: interpret(res[r].graph, feed)["y"], timeout_s=30)
        assert all(rel_l2(got[r], want) < 1e-5 for r in range(2))
    assert pools["kv.k.0"].abs().sum() > 0                                      # the first step wrote the pool


FUSED_QKV = """
graph @qkv(%x: f32[b,s,8]) -> (%y) {
  param %w: f32[24,8] #?
  param %bias: f32[24] #?
  param %wo: f32[8,8] #?
  %qkv: f32[b,s,24] = linear(%x, %w, %bias)
  %q: f32[b,s,8] = slice(%qkv) {"dim": 2, "start": 0, "end": 8, "step": 1}
  %k: f32[b,s,8] = slice(%qkv) {"dim": 2, "start": 8, "end": 16, "step": 1}
  %v: f32[b,s,8] = slice(%qkv) {"dim": 2, "start": 16, "end": 24, "step": 1}
  %qk: f32[b,s,8] = mul(%q, %k)
  %h: f32[b,s,8] = add(%qk, %v)
  %y: f32[b,s,8] = linear(%h, %wo)
  return %y
}"""


def test_fused_qkv_splits_each_block(golden):
    res = shard_case(golden, "fused_qkv", FUSED_QKV, weights(w=(24, 8), bias=(24,), wo=(8, 8)))
    g = res[1].graph
    torch.testing.assert_close(g.constants["w.rank1"],
                               torch.cat([weights(w=(24, 8))["w"][i:i + 4] for i in (4, 12, 20)]))
    assert [n.attrs["start"] for n in g.nodes if n.op == "slice"] == [0, 4, 8]


GQA_QKV = """
graph @gqa(%x: f32[b,s,8]) -> (%y) {
  param %w: f32[16,8] #?
  param %wo: f32[8,8] #?
  param %wkv: f32[8,4] #?
  %qkv: f32[b,s,16] = linear(%x, %w)
  %q: f32[b,s,8] = slice(%qkv) {"dim": -1, "start": 0, "end": 8, "step": 1}
  %k: f32[b,s,4] = slice(%qkv) {"dim": -1, "start": 8, "end": 12, "step": 1}
  %v: f32[b,s,4] = slice(%qkv) {"dim": -1, "start": -4, "end": 16, "step": 1}
  %kv: f32[b,s,4] = mul(%k, %v)
  %yq: f32[b,s,8] = linear(%q, %wo)
  %ykv: f32[b,s,8] = linear(%kv, %wkv)
  %y: f32[b,s,8] = add(%yq, %ykv)
  return %y
}"""


def test_fused_qkv_of_unequal_blocks_splits_each_block(golden):
    """Grouped KV heads through one projection (Phi-3's qkv_proj): q 8 | k 4 | v 4 wide. Each
    rank keeps its rows of every block (4 | 2 | 2) and reads its blocks at the local offsets."""
    w = weights(w=(16, 8), wo=(8, 8), wkv=(8, 4))
    res = shard_case(golden, "gqa_qkv", GQA_QKV, w)
    g = res[1].graph
    torch.testing.assert_close(g.constants["w.rank1"], torch.cat([w["w"][4:8], w["w"][10:12], w["w"][14:16]]))
    assert [(n.attrs["start"], n.attrs["end"]) for n in g.nodes if n.op == "slice"] == [(0, 4), (4, 6), (6, 8)]
    assert res[1].stats["collectives"] == {"all_reduce": 2} and not res[1].stats["gathered_for"]


def test_a_gathered_projection_of_unequal_blocks_is_in_the_original_order():
    """Where a split projection must be whole (here: it is a graph output), the gathered
    [rank][block] columns are put back in [block][rank] order, exactly the unsharded value."""
    from graphmode.passes.shard import _Sharder
    text = GQA_QKV.replace("-> (%y)", "-> (%y, %qkv)").replace("return %y", "return %y, %qkv")
    w = weights(w=(16, 8), wo=(8, 8), wkv=(8, 4))
    g = parse_graph(ir(text, w), w)
    ranks = [_Sharder(g, r, 2, HEAD, "f32", "b") for r in range(2)]
    graphs = [s.run() for s in ranks]
    assert all(s.place["qkv"].blocks == (8, 4, 4) for s in ranks)
    inputs = random_inputs(g, {"b": 2, "s": 3}, 0)
    want = interpret(g, inputs)
    got = run_ranks(2, lambda r, comm: interpret(graphs[r], inputs), timeout_s=30)
    for r in range(2):
        verify_graph(graphs[r])
        assert all(rel_l2(got[r][o], want[o]) < 1e-6 for o in ("y", "qkv")), r


VOCAB = """
graph @lm(%ids: i64[b,s]) -> (%logits) {
  param %table: f32[16,8] #?
  param %head: f32[16,8] #?
  %e: f32[b,s,8] = embedding(%table, %ids)
  %h: f32[b,s,8] = tanh(%e)
  %logits: f32[b,s,16] = linear(%h, %head)
  return %logits
}"""


def test_vocab_parallel_embedding_and_lm_head(golden):
    res = shard_case(golden, "vocab", VOCAB, weights(table=(16, 8), head=(16, 8)), int_high=16)
    s = res[0].stats
    assert s["vocab_parallel"] == 1 and s["column_parallel"] == 1
    assert s["collectives"] == {"all_reduce": 1, "all_gather": 1} and s["gathered_for"] == {"graph output": 1}


ODD_VOCAB = """
graph @lm(%ids: i64[b,s]) -> (%logits, %next) {
  param %table: f32[17,8] #?
  param %bias: f32[17] #?
  %e: f32[b,s,8] = embedding(%table, %ids)
  %h: f32[b,s,8] = tanh(%e)
  %l: f32[b,s,17] = linear(%h, %table)
  %logits: f32[b,s,17] = add(%l, %bias)
  %next: i64[b,s] = argmax(%logits) {"dim": -1}
  return %logits, %next
}"""


def test_an_odd_vocabulary_is_padded_not_kept_whole(golden):
    """17 rows over 2 ranks: 9 a rank, the last rank's 9th a zero row. The tied table is split
    once for embedding and LM head; the logits are gathered 18 wide and sliced to 17 before the
    output and the argmax. The bias makes every real logit negative, so a padding column (0)
    that leaked would win the argmax."""
    consts = weights(table=(17, 8), bias=(17,))
    consts["bias"] = consts["bias"] - 10.0
    res = shard_case(golden, "odd_vocab", ODD_VOCAB, consts, int_high=17)
    s = res[1].stats
    assert s["vocab_parallel"] == 1 and s["column_parallel"] == 1
    assert s["collectives"] == {"all_reduce": 1, "all_gather": 1}
    g0, g1 = res[0].graph, res[1].graph
    torch.testing.assert_close(g0.constants["table.rank0"], consts["table"][:9])
    torch.testing.assert_close(g1.constants["table.rank1"], torch.cat([consts["table"][9:], torch.zeros(1, 8)]))
    assert [n.op for n in g1.nodes].count("embedding") == 1 and len([c for c in g1.constants if "table" in c]) == 1
    (cut,) = [n for n in g1.nodes if n.op == "slice"]
    assert (cut.attrs["start"], cut.attrs["end"]) == (0, 17) and g1.values["logits"].type.text() == "f32[b,s,17]"
    ids = torch.tensor([[16, 0, 8, 9]])          # the last real row on the last rank, both ranks' first rows
    want = interpret(parse_graph(ir(ODD_VOCAB, consts), consts), {"ids": ids})
    got = run_ranks(2, lambda r, comm: interpret(res[r].graph, {"ids": ids}), timeout_s=30)
    assert torch.equal(got[1]["next"], want["next"]) and rel_l2(got[1]["logits"], want["logits"]) < 1e-6


def test_an_odd_vocabulary_over_three_ranks():
    consts = weights(table=(17, 8), bias=(17,))
    res = shard_case(None, "odd_vocab3", ODD_VOCAB, consts, world=3, int_high=17)
    assert [r.graph.values[f"table.rank{i}"].type.shape for i, r in enumerate(res)] == [(6, 8)] * 3


CNN = """
graph @cnn(%x: f32[b,3,8,8]) -> (%y) {
  param %w: f32[4,3,3,3] #?
  param %fc: f32[5,16] #?
  %c: f32[b,4,8,8] = conv2d(%x, %w) {"padding": [1, 1]}
  %r: f32[b,4,8,8] = relu(%c)
  %p: f32[b,4,2,2] = max_pool2d(%r) {"kernel": [4, 4]}
  %f: f32[b,16] = reshape(%p) {"shape": ["b", 16]}
  %y: f32[b,5] = linear(%f, %fc)
  return %y
}"""


def test_batch_strategy_splits_the_batch(golden):
    res = shard_case(golden, "batch_cnn", CNN, weights(w=(4, 3, 3, 3), fc=(5, 16)),
                     strategy={c: "batch" for c in HEAD}, buckets=({"b": 2}, {"b": 4}), batch_dim="b")
    g = res[0].graph
    assert g.values["c"].type.text() == "f32[b/2,4,8,8]"
    assert res[0].stats["collectives"] == {"all_gather": 1} and res[0].stats["batch_inputs"] == 1
    assert torch.equal(g.constants["w"], weights(w=(4, 3, 3, 3))["w"])       # every rank holds every weight


def test_replicate_and_world_one_leave_the_work_whole():
    consts = weights(w1=(16, 8), b1=(16,), w2=(8, 16), b2=(8,))
    g = parse_graph(ir(MLP, consts), consts)
    res = PASSES["shard"](g, ctx(0, 2, {c: "replicate" for c in HEAD}))
    assert not res.stats["collectives"] and res.stats["column_parallel"] == 0
    assert [n.op for n in res.graph.nodes] == [n.op for n in g.nodes]
    assert not PASSES["shard"](g, ctx(0, 1)).modified


def test_a_rank_outside_the_group_is_refused():
    consts = weights(w1=(16, 8), b1=(16,), w2=(8, 16), b2=(8,))
    with pytest.raises(PassError, match="rank 2 is outside a group of 2"):
        PASSES["shard"](parse_graph(ir(MLP, consts), consts), ctx(2, 2))


def test_narrow_comm_dtype_is_on_the_collectives():
    consts = weights(w1=(16, 8), b1=(16,), w2=(8, 16), b2=(8,))
    g = parse_graph(ir(MLP, consts), consts)
    res = PASSES["shard"](g, ctx(0, 2, comm_dtype="bf16"))
    (ar,) = [n for n in res.graph.nodes if n.op == "all_reduce"]
    assert ar.attrs["comm_dtype"] == "bf16"
    inputs = random_inputs(g, {"b": 2, "s": 5})
    want = interpret(g, inputs)["y"]
    graphs = [PASSES["shard"](g, ctx(r, 2, comm_dtype="bf16")).graph for r in range(2)]
    got = run_ranks(2, lambda r, c: interpret(graphs[r], inputs)["y"])
    assert 1e-6 < rel_l2(got[0], want) < 1e-2 and torch.equal(got[0], got[1])     # rounded, same on both ranks


def test_the_recipe_puts_shard_after_folding_and_the_proof_counts_the_rank_s_collectives():
    from graphmode.compile_report import graph_collectives
    from graphmode.compiler import pass_context, pipeline
    from graphmode.recipe import load_recipe
    par = {"tensor": 2, "device_group": ["a", "b"], "links": {"lo": {"bandwidth_gbps": 1}}, "comm": {"dtype": "bf16"}}
    base = {"version": 1, "name": "tp", "inputs": [{"name": "x", "dtype": "f32", "shape": ["b", "s", 8]}],
            "dims": {"b": {"buckets": [1, 2]}, "s": {"buckets": [4]}}}
    assert "shard" not in pipeline(load_recipe(base))
    rec = load_recipe({**base, "parallel": par})
    names = pipeline(rec)
    assert names[names.index("constant_fold") + 1] == "shard"
    opts = pass_context(rec, rank=1).opts("shard")
    assert (opts.rank, opts.world, opts.comm_dtype) == (1, 2, "bf16")
    consts = weights(w1=(16, 8), b1=(16,), w2=(8, 16), b2=(8,))
    sharded = PASSES["shard"](parse_graph(ir(MLP, consts), consts), ctx(0)).graph
    (c,) = graph_collectives(sharded)
    assert (c.op, str(c.elems), c.row, c.count) == ("all_reduce", "8*b*s", 8, 1)
