"""A served ONNX model's inputs by the model's own names ("x:0", as ONNX Runtime and tf2onnx
clients send them) or by the recipe's ("x_0"), in every body format."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save

from graphmode.serve.codec import decode_json, decode_safetensors
from graphmode.serve.errors import BadRequest

DTYPES = {"x_0": "f32", "input.1": "i64"}


def test_json_and_safetensors_take_either_spelling():
    body = json.dumps({"inputs": {"x:0": [[1.0, 2.0]], "input.1": [3]}}).encode()
    got = decode_json(body, DTYPES)
    assert set(got) == {"x_0", "input.1"} and torch.equal(got["x_0"], torch.tensor([[1.0, 2.0]]))
    got = decode_safetensors(save({"x:0": torch.ones(2), "input.1": torch.tensor([1])}), DTYPES)
    assert set(got) == {"x_0", "input.1"}


def test_a_name_that_is_neither_is_refused_naming_the_recipes():
    with pytest.raises(BadRequest, match="x:1.*is not an input of the recipe"):
        decode_json(json.dumps({"inputs": {"x:1": [1.0]}}).encode(), DTYPES)


def test_a_json_only_endpoints_415_names_json_only():
    """completions and embeddings answered text/plain with 'send application/json or
    application/octet-stream', and octet-stream then with another 415."""
    import pytest
    from graphmode.serve.codec import body_kind
    from graphmode.serve.errors import BadRequest
    assert body_kind("application/octet-stream") == "safetensors"
    assert body_kind("application/json; charset=utf-8", json_only=True) == "json"
    for kind in ("text/plain", "application/octet-stream"):
        with pytest.raises(BadRequest) as e:
            body_kind(kind, json_only=True)
        assert e.value.status == 415 and e.value.fix == "send application/json"


def test_non_finite_values_in_an_integer_input_are_named_with_their_index():
    """They were refused as 'fractional numbers'; a float input already named NaN and its index."""
    import pytest
    import torch
    from graphmode.serve.codec import _json_tensor
    from graphmode.serve.errors import BadRequest
    for bad, shown in ((float("nan"), "nan"), (float("inf"), "inf")):
        with pytest.raises(BadRequest, match=f"holds {shown} at index \\[0, 1\\]"):
            _json_tensor("ids", [[1, bad]], torch.int64)
    for written in (2.5, 3.0):       # 3.0 was 'fractional' too: what is refused is how it is written
        with pytest.raises(BadRequest, match="numbers written with a decimal point or an exponent"):
            _json_tensor("ids", [[1, written]], torch.int64)
