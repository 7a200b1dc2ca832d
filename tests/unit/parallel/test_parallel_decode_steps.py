"""Tensor-parallel decoding's pieces that need no rank processes: the one-tensor step message
rank 0 broadcasts (every input of a prefill and a decode step comes back exactly, and a stop),
the per-rank KV layout (kv_heads / N) and the refusal of heads that do not split, naming
parallel.tensor and the head count (the ranks end to end: tests/e2e/test_tensor_parallel_decode.py)."""
from __future__ import annotations

import pytest
import torch

from graphmode.decode.engine import kv_layout
from graphmode.decode.lm import INPUTS
from graphmode.decode.tensor_parallel import StepCodec
from graphmode.errors import RecipeError
from graphmode.recipe import load_recipe
from graphmode.recipe.semantics import check_semantics

CFG = {"layers": 2, "heads": 4, "kv_heads": 4, "head_dim": 8, "vocab": 100}


def recipe(tensor: int, kv_heads: int = 4) -> dict:
    r = {"version": 1, "name": "tp-decoder",
         "inputs": [{"name": "input_ids", "dtype": "i64", "shape": ["batch", "seq"]}],
         "dims": {"batch": {"buckets": [1, 2, 4]}, "seq": {"buckets": [8, 32], "min": 2}},
         "memory": {"kv_cache": {"page_size": 4, "max_pages_per_seq": 12, "layers": 2, "kv_heads": kv_heads,
                                 "head_dim": 8}}}
    if tensor > 1:
        r["parallel"] = {"tensor": tensor, "device_group": [f"rank{i}" for i in range(tensor)],
                         "links": {"loopback": {"bandwidth_gbps": 10, "latency_us": 20}}}
    return r


def step(b: int, s: int, max_pages: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(b * 100 + s)
    shapes = {"input_ids": (b, s), "position_ids": (b, s), "block_table": (b, max_pages), "start": (b,),
              "lens": (b,), "last": (b,)}
    return {k: torch.randint(0, 100, shape, generator=g) for k, shape in shapes.items()}


@pytest.mark.parametrize("b,s", [(4, 32), (1, 8), (2, 1), (4, 1)])
def test_a_step_crosses_in_one_fixed_size_tensor(b, s):
    codec = StepCodec(batch_max=4, seq_max=32, max_pages=12)
    inputs = step(b, s, 12)
    t = codec.encode({"batch": b, "seq": s}, inputs)
    assert t.dtype == torch.int64 and t.numel() == codec.size == 3 + 4 * (2 * 32 + 12 + 3)
    env, back = codec.decode(t.clone())
    assert env == {"batch": b, "seq": s} and list(back) == list(INPUTS)
    assert all(torch.equal(back[k], inputs[k]) for k in INPUTS)
    assert codec.decode(codec.encode(None)) is None


def test_each_rank_s_pool_holds_its_share_of_the_kv_heads():
    one, two = kv_layout(load_recipe(recipe(1)), CFG), kv_layout(load_recipe(recipe(2)), CFG, world=2)
    assert (one.kv_heads, two.kv_heads) == (4, 2) and two.bytes * 2 == one.bytes and two.pages == one.pages


def test_heads_that_do_not_split_are_refused_naming_parallel_tensor():
    with pytest.raises(RecipeError) as e:
        kv_layout(load_recipe(recipe(1)), CFG, world=3)
    assert e.value.where == "parallel.tensor" and "4 KV heads" in str(e.value) and e.value.value == 3
    res = check_semantics(load_recipe(recipe(3, kv_heads=4)))                     # the recipe check says it first
    assert any(err.where == "parallel.tensor" and "4 KV heads" in str(err) for err in res.errors)


@pytest.mark.parametrize("strategy,share", [("head", 2), ({"attention": "replicate", "mlp": "head"}, 1)])
def test_the_proof_splits_the_kv_pool_only_when_attention_is_split_by_heads(strategy, share):
    from graphmode.recipe import validate
    from graphmode.recipe.facts import kv_cache_bytes
    from graphmode.targets import get_target
    r = recipe(2)
    r["parallel"]["strategy"] = strategy
    r["model"] = {"kind": "decoder", "layers": 2, "hidden": 32, "heads": 4, "intermediate": 64, "vocab": 100}
    rec = load_recipe(r)
    rep = validate(rec, get_target("host"))
    assert rep.ok and rep.model.memory_terms["kv_cache"] * share == kv_cache_bytes(rec)
