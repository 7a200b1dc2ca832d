"""Tensor-parallel decoding end to end: graphmode starts 2 rank processes for a decoder recipe
(GPT-2, a Llama with grouped-query attention, one whose MLP does not split over the ranks, and
a Phi-3 whose grouped heads come through one fused qkv_proj); each builds the paged decode graph of its
shard, its KV pools holding half the KV heads (the proof's per-rank KV term, to the byte); rank 0
schedules and samples, one broadcast a step carries the step's inputs to rank 1. Greedy tokens
equal one process's and transformers' generate, token for token, with a pool small enough that
the scheduler preempts (the same decisions as one process); streams, abandoned streams, refused
prompts and a killed rank behave as in one process or fail fast (RankFailure)."""
from __future__ import annotations

import os
import signal
import sys
import warnings
from pathlib import Path

import pytest
import torch

import graphmode
from graphmode.decode.api import causal_lm, engine_of
from graphmode.errors import ContractViolation, RankFailure
from graphmode.recipe import load_recipe
from graphmode.recipe.facts import kv_cache_bytes

sys.path.insert(0, str(Path(__file__).parent))
import tiny_tp  # noqa: E402

SPEC = str(Path(__file__).with_name("tiny_tp.py"))
KV_HEADS = {"gpt2": 4, "llama": 2, "llama_odd_mlp": 2, "phi3": 2}
PROMPTS = torch.tensor([[0, 0, 0, 5, 6, 7], [9, 10, 11, 12, 13, 14], [0, 0, 0, 0, 21, 22]])
MASK = (PROMPTS != 0).long()


def recipe(name: str, tensor: int) -> dict:
    """3 batch buckets, prompts up to 8 tokens, 4-token pages; a pool of 7 pages (28 tokens)
    for three sequences growing to 18 tokens (5 pages) each: someone is preempted."""
    r = tiny_tp.recipe(f"{name}-decode-tp{tensor}", tensor, dims={"batch": {"buckets": [1, 2, 4]},
                                                                   "seq": {"buckets": [8], "min": 2}})
    r["memory"] = {"kv_cache": {"page_size": 4, "max_pages_per_seq": 6, "pages": 7, "layers": 2,
                                "kv_heads": KV_HEADS[name], "head_dim": 8}}
    return r


@pytest.fixture(scope="module", params=["gpt2", "llama", "llama_odd_mlp", "phi3"])
def models(request, tmp_path_factory):
    cache = tmp_path_factory.mktemp("tp-decode")
    name = request.param
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        one = graphmode.compile(f"{SPEC}:{name}", recipe(name, 1), cache_dir=cache)
        tp = graphmode.compile(f"{SPEC}:{name}", recipe(name, 2), cache_dir=cache)
    yield name, one, tp
    tp.close()


@pytest.mark.slow     # two rank processes compile a decoder each: minutes on 2 busy cores
def test_greedy_tokens_equal_one_process_and_transformers(models):
    name, one, tp = models
    want = one.generate(PROMPTS, MASK, max_new_tokens=12, pad_token_id=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = causal_lm(one.source).generate(PROMPTS, attention_mask=MASK, max_new_tokens=12, do_sample=False,
                                             pad_token_id=0)
    got = tp.generate(PROMPTS, MASK, max_new_tokens=12, pad_token_id=0)
    assert torch.equal(got, want) and torch.equal(got, ref), (got.tolist(), want.tolist(), ref.tolist())
    # the same scheduling on rank 0 as in one process, preemption included (same pages on both ranks)
    assert tp.last_stats["preemptions"] >= 1 and tp.last_stats == engine_of(one).stats, tp.last_stats


@pytest.mark.slow
def test_each_rank_s_pool_holds_half_the_kv_heads_as_the_proof_counts(models):
    name, one, tp = models
    whole = kv_cache_bytes(load_recipe(recipe(name, 1)))
    assert engine_of(one).cache.bytes == whole
    for r in tp.ranks:
        assert r["kv_heads"] == KV_HEADS[name] // 2
        assert r["kv_pool_bytes"] == r["kv_bytes"] == r["proof_kv_bytes"] == whole // 2, r
    weights = sum(t.numel() * t.element_size() for k, t in engine_of(one).lowered.graph.constants.items()
                  if engine_of(one).lowered.graph.values[k].role != "state")
    share = 0.8 if name == "llama_odd_mlp" else 0.75       # its MLPs are whole on every rank
    assert all(r["weights_bytes"] < share * weights for r in tp.ranks), (tp.ranks, weights)


@pytest.mark.slow
def test_one_broadcast_a_step_and_rank_1_runs_every_step(models):
    _, _, tp = models
    tp.generate(PROMPTS[1:2], MASK[1:2], max_new_tokens=5)
    steps = tp.last_stats["prefill_steps"] + tp.last_stats["decode_steps"]
    c0, c1 = tp.last_comm
    assert c0["per_op"]["broadcast"]["calls"] == c1["per_op"]["broadcast"]["calls"] == steps + 1   # + the stop
    assert c1["steps"] == steps
    assert all(c0["per_op"][op][k] == c1["per_op"][op][k] for op in ("all_reduce", "all_gather")
               for k in ("calls", "bytes"))


@pytest.mark.slow
def test_streams_refusals_and_an_abandoned_stream_leave_the_group_working(models):
    _, one, tp = models
    want = one.generate(PROMPTS, MASK, max_new_tokens=6)
    first = next(tp.stream(PROMPTS, MASK, max_new_tokens=6))     # abandoned after one step: cancelled
    assert first and all(toks == want[i, 6:6 + len(toks)].tolist() for i, toks in first.items()), first
    with pytest.raises(ContractViolation, match=r"token ids must be in \[0, 100\)"):
        tp.generate([[1, 2, 300]], max_new_tokens=3)
    steps: dict[int, list[int]] = {}
    for out in tp.stream(PROMPTS, MASK, max_new_tokens=6):
        for i, toks in out.items():
            steps.setdefault(i, []).extend(toks)
    assert steps == {i: want[i, 6:].tolist() for i in range(3)}
    with pytest.raises(graphmode.errors.GraphmodeError, match="generate / stream"):
        tp(input_ids=PROMPTS)


@pytest.mark.slow
def test_a_killed_rank_fails_the_generate_at_once(models):
    """Last in the module: it stops the group. Rank 0's broadcast fails at once, and the cause
    named is rank 1's death (seen once its exit is; a generate racing the exit names rank 0's
    failed broadcast instead, also a RankFailure)."""
    _, _, tp = models
    os.kill(tp.pids[1], signal.SIGKILL)
    tp.procs[1].join(30)
    with pytest.raises(RankFailure, match=r"rank 1 \(pid \d+\) was killed by signal 9"):
        tp.generate(PROMPTS, MASK, max_new_tokens=4)
    with pytest.raises(RankFailure, match="group is down"):
        tp.generate(PROMPTS, MASK, max_new_tokens=4)
