"""to_paged needs the recipe's KV cache: without one it is refused naming memory.kv_cache (its
rewrite of real causal LMs is checked end to end in tests/e2e/test_decode.py, token for token
against transformers)."""
from __future__ import annotations

import pytest

from graphmode.errors import PassError
from graphmode.ir import parse_graph
from graphmode.passes import PassContext, PassManager
from graphmode.passes.registry import check_order


def test_without_a_kv_cache_it_is_refused():
    g = parse_graph("""
graph @t(%x: f32[b,4]) -> (%y) {
  %y: f32[b,4] = relu(%x)
  return %y
}""")
    with pytest.raises(PassError) as e:
        PassManager(["to_paged", "memory_plan"], PassContext()).run(g)
    assert e.value.where == "memory.kv_cache" and "kv_cache" in e.value.fix


def test_it_is_declared_to_run_first():
    assert check_order(["to_paged", "canonicalize", "fuse", "memory_plan"]) == []
