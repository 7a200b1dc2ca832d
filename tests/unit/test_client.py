"""graphmode.client's wire helpers, without a server (tests/e2e/test_serve_decoder.py runs the
client against real servers): server-sent event lines, an error event as ServerError with
the server's status, field and fix, KServe v2 request bodies cast to the model's datatypes."""
from __future__ import annotations

import json

import numpy as np
import pytest

from graphmode.client import ServerError, completion_body, parse_completion, parse_event, v2_outputs, v2_request


def test_event_lines_and_the_error_event():
    chunk = parse_event('data: {"choices": [{"index": 1, "text": " w5", "token_ids": [5], "finish_reason": null}]}')
    assert chunk.text == " w5" and chunk.token_ids == [5] and chunk.choices[0].index == 1 and chunk.usage is None
    assert parse_event("data: [DONE]") is True
    assert parse_event("") is None and parse_event(": keep-alive") is None
    err = {"error": {"error": "NotReady", "message": "the server shut down", "where": "request", "fix": "retry",
                     "status": 503}}
    with pytest.raises(ServerError) as e:
        parse_event("data: " + json.dumps(err))
    assert (e.value.status, e.value.where, e.value.fix) == (503, "request", "retry")
    assert "the server shut down" in str(e.value) and e.value.exit_code == 1


def test_server_error_reads_both_error_forms():
    v1 = ServerError(422, {"error": "ContractViolation", "message": "too long", "where": "prompt", "fix": "shorter"})
    v2 = ServerError(422, {"error": "too long", "type": "BadRequest", "where": "inputs[0].shape", "fix": "f"})
    assert "too long" in str(v1) and v1.where == "prompt" and v1.fix == "shorter"
    assert "too long" in str(v2) and v2.where == "inputs[0].shape"
    assert "HTTP 502" in str(ServerError(502, "bad gateway"))
    oa = ServerError(400, {"error": {"message": "top_k: bad (got -2); fix: f", "type": "invalid_request_error",
                                     "param": "top_k", "code": "bad_parameter", "detail": "bad", "where": "top_k",
                                     "fix": "f"}})
    assert "HTTP 400: bad" in str(oa) and oa.where == "top_k" and oa.fix == "f"


def test_request_bodies():
    assert completion_body([5, 6], stream=True, max_tokens=3, temperature=None) == \
        {"prompt": [5, 6], "max_tokens": 3, "stream": True}
    doc = parse_completion({"id": "c", "model": "m", "system_fingerprint": "v1", "usage": {"total_tokens": 3},
                            "choices": [{"index": 0, "text": "a", "token_ids": [1], "finish_reason": "stop"}]})
    assert (doc.text, doc.token_ids, doc.finish_reason, doc.recipe_version) == ("a", [1], "stop", "v1")
    body = v2_request({"x": [[1, 2]], "ids": np.array([[1.5]]), "y": np.ones(2, np.float64)},
                      {"x": "FP32", "ids": "INT64", "y": "FP32"}, ["out"])
    x, ids, y = body["inputs"]
    assert (x["datatype"], x["shape"], x["data"]) == ("FP32", [1, 2], [1.0, 2.0])      # ints widen to floats
    assert ids["datatype"] == "FP64" and ids["data"] == [1.5]                       # never truncated: sent as is
    assert y["datatype"] == "FP32" and body["outputs"] == [{"name": "out"}]
    out = v2_outputs({"outputs": [{"name": "o", "datatype": "INT64", "shape": [2, 1], "data": [3, 4]}]})
    assert out["o"].dtype == np.int64 and out["o"].tolist() == [[3], [4]]
