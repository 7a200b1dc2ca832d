"""The tokens a request may hold, as /v1/models and /tokenize report it."""
from __future__ import annotations


def test_an_encoders_max_model_len_is_known_while_it_warms_up():
    """/v1/models said max_model_len null until the first recipe was warm."""
    from types import SimpleNamespace

    from graphmode.recipe import load_recipe
    from graphmode.serve.tokenize import max_model_len
    enc = load_recipe({"version": 1, "name": "e", "inputs": [{"name": "ids", "dtype": "i64", "shape": ["batch", "seq"]}],
                       "dims": {"batch": {"buckets": [1, 2]}, "seq": {"min": 1, "max": 48, "max_padding": 0.5}}})
    assert max_model_len(SimpleNamespace(active=None, recipe=enc)) == 48
