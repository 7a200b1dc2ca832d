"""A tensor-parallel decode graph whose attention the shard pass left whole (a projection it
has no rule to split by heads) has whole KV pools on each rank: refused naming parallel.tensor,
where it was a mismatch 'the pools and the cache must come from the same recipe'."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from graphmode.decode.engine import _check_pools_split
from graphmode.decode.kvcache import KVLayout
from graphmode.errors import RecipeError


def test_whole_pools_under_tensor_parallelism_are_refused_naming_the_degree():
    layout = KVLayout(layers=1, kv_heads=1, head_dim=4, page_size=4, pages=8, max_pages_per_seq=2)
    tp2 = SimpleNamespace(parallel=SimpleNamespace(tensor=2))
    split = ([torch.zeros(8, 4, 1, 4)], [torch.zeros(8, 4, 1, 4)])
    whole = ([torch.zeros(8, 4, 2, 4)], [torch.zeros(8, 4, 2, 4)])
    _check_pools_split(split, layout, tp2)
    _check_pools_split(whole, KVLayout(layers=1, kv_heads=2, head_dim=4, page_size=4, pages=8, max_pages_per_seq=2),
                       SimpleNamespace(parallel=None))
    with pytest.raises(RecipeError, match="not split by heads") as e:
        _check_pools_split(whole, layout, tp2)
    assert e.value.where == "parallel.tensor" and "parallel.tensor: 1" in e.value.fix


def test_pools_whole_in_some_layers_name_them_and_the_mlp_strategy():
    """Some layers' attention whole at TP=2 (a Llama whose MLP was 129 wide did that until the
    shard pass kept such a down projection whole): the refusal was "a KV pool is (8, 16, 2, 16),
    the layout needs ... (8, 16, 1, 16)"."""
    layout = KVLayout(layers=2, kv_heads=1, head_dim=4, page_size=4, pages=8, max_pages_per_seq=2)
    mixed = ([torch.zeros(8, 4, 1, 4), torch.zeros(8, 4, 2, 4)], [torch.zeros(8, 4, 1, 4), torch.zeros(8, 4, 2, 4)])
    with pytest.raises(RecipeError, match=r"layer\(s\) \[1\] of this model's attention is not split") as e:
        _check_pools_split(mixed, layout, SimpleNamespace(parallel=SimpleNamespace(tensor=2)))
    assert "an MLP intermediate size" in e.value.message and "mlp: replicate" in e.value.fix
