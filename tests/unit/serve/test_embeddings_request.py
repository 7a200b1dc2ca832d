"""The OpenAI embeddings request (graphmode.serve.embeddings.parse_inputs) without a server:
texts through the tokenizer with its special tokens, token ids as given, and refusals that
name the field, the value and the fix."""
from __future__ import annotations

import json

import pytest

from graphmode.serve.embeddings import parse_inputs
from graphmode.serve.errors import BadRequest


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from graphmode.capture.zoo import minilm_path
    return AutoTokenizer.from_pretrained(str(minilm_path()), local_files_only=True)


def parse(doc, tokenizer=None):
    return parse_inputs(json.dumps(doc).encode(), tokenizer)


def test_inputs_and_options(tok):
    ids, opts = parse({"input": "hello world", "model": "minilm"}, tok)
    assert ids == [tok("hello world")["input_ids"]] and ids[0][0] == tok.cls_token_id
    assert opts == {"model": "minilm", "encoding_format": "float", "dimensions": None}
    assert parse({"input": ["a", "b c"]}, tok)[0] == [tok("a")["input_ids"], tok("b c")["input_ids"]]
    assert parse({"input": [101, 7592, 102], "encoding_format": "base64"})[0] == [[101, 7592, 102]]
    assert parse({"input": [[101, 102], [101, 7592, 102]], "dimensions": 384})[0] == [[101, 102], [101, 7592, 102]]


@pytest.mark.parametrize("doc,where", [
    ({"input": "text"}, "input"), ({"input": []}, "input"), ({"input": [[]]}, "input"), ({"input": [1.5]}, "input"),
    ({}, "input"), ({"input": [1], "encoding_format": "int8"}, "encoding_format"), ({"input": [1], "x": 1}, "body"),
    ({"input": [1], "model": 3}, "model"), ({"input": [1], "dimensions": "8"}, "dimensions"),
    ({"input": [[1]] * 257}, "input"), ([1], "body"),
])
def test_every_refusal_names_the_field_and_the_fix(doc, where):
    with pytest.raises(BadRequest) as e:
        parse(doc)
    assert e.value.status == 400 and e.value.where == where and e.value.fix, e.value.to_dict()
