"""Ray Serve replicas refuse every `parallel` recipe and say why (one server serves any recipe
under `parallel.tensor: 2` on rank processes, from the model or a saved group's file: end to end
in tests/e2e/test_serve_tensor_parallel.py and test_decode_artifact_tp.py)."""
from __future__ import annotations

import pytest

from graphmode.errors import RecipeError
from graphmode.recipe import load_recipe
from graphmode.serve.loading import refuse_tensor_parallel


def recipe(tensor: int, decoder: bool) -> object:
    r = {"version": 1, "name": "tp",
         "inputs": [{"name": "input_ids", "dtype": "i64", "shape": ["batch", "seq"]}],
         "dims": {"batch": {"buckets": [1, 2]}, "seq": {"buckets": [8], "min": 2}}}
    if decoder:
        r["memory"] = {"kv_cache": {"page_size": 4, "max_pages_per_seq": 4, "layers": 2, "kv_heads": 4,
                                    "head_dim": 8}}
    if tensor > 1:
        r["parallel"] = {"tensor": tensor, "device_group": [f"rank{i}" for i in range(tensor)],
                         "links": {"loopback": {"bandwidth_gbps": 10, "latency_us": 20}}}
    return load_recipe(r)


def test_ray_serve_replicas_refuse_every_parallel_recipe_saying_why():
    refuse_tensor_parallel(recipe(1, decoder=True))
    with pytest.raises(RecipeError, match="Ray Serve replicas do not run tensor-parallel ranks") as e:
        refuse_tensor_parallel(recipe(2, decoder=True))
    assert e.value.where == "parallel.tensor" and "graphmode serve" in e.value.fix
