"""Values and requests at the edges, over the real HTTP server on loopback: index inputs out of
their tables in every protocol (JSON, safetensors, KServe v2) answer 422 naming the input, the
value, its position and the range, never 500; malformed KServe fields answer 400; requests no
route sees (a chunk announced over the limit, a huge URL or header, a HEAD) get a JSON answer
at once instead of a timeout or a connection reset."""
from __future__ import annotations

import json
import socket
import time
from types import SimpleNamespace

import httpx
import pytest
import torch
from safetensors.torch import save as st_save
from test_serve import EVENT_S, READY_S, serve_cache, strict_json
from tiny_models import INDEXED_INPUTS, recipe

from graphmode.serve import ModelServer, ServeConfig, ServerThread

SPEC_DIMS = {"batch": {"buckets": [1, 2]}, "seq": {"buckets": [4, 8], "min": 2}}
BODY_MB = 1
HEAD_LIMIT = 16 * 1024


@pytest.fixture(scope="module")
def indexed(tmp_path_factory):
    from pathlib import Path

    from graphmode.capture.spec import resolve_model_spec
    bundle = resolve_model_spec(f"{Path(__file__).parent / 'tiny_models.py'}:indexed")
    cfg = ServeConfig(batch_window_ms=5, max_body_mb=BODY_MB, cache_dir=serve_cache(tmp_path_factory),
                      header_timeout_s=EVENT_S, body_timeout_s=EVENT_S)
    server = ModelServer(bundle, recipe("indexed", INDEXED_INPUTS, SPEC_DIMS), config=cfg)
    running = ServerThread(server).start()
    try:
        running.wait_ready(READY_S)
        with httpx.Client(base_url=running.url, timeout=EVENT_S) as client:
            yield SimpleNamespace(server=server, url=running.url, port=running.port, client=client)
    finally:
        running.stop()


def _inputs(bad_name: str | None = None, bad: int = 0) -> dict[str, torch.Tensor]:
    x = {"ids": torch.tensor([[5, 6, 7, 8, 9], [1, 2, 3, 4, 5]]), "token_type_ids": torch.zeros(2, 5, dtype=torch.long),
         "mask": torch.ones(2, 5, dtype=torch.long)}
    if bad_name is not None:
        x[bad_name][1, 2] = bad
    return x


def _kserve(x: dict[str, torch.Tensor]) -> dict:
    return {"inputs": [{"name": k, "shape": list(v.shape), "datatype": "INT64", "data": v.reshape(-1).tolist()}
                       for k, v in x.items()]}


BAD = [("ids", 50), ("ids", -1), ("ids", 10**9), ("ids", 2**63 - 1), ("ids", -2**63), ("token_type_ids", 2)]


@pytest.mark.parametrize("name,bad", BAD)
def test_out_of_range_index_values_answer_422_in_every_protocol(indexed, name, bad):
    c = indexed.client
    x = _inputs(name, bad)
    answers = {"json": c.post("/v1/infer", json={"inputs": {k: v.tolist() for k, v in x.items()}}),
               "safetensors": c.post("/v1/infer", content=st_save(x),
                                     headers={"content-type": "application/octet-stream",
                                              "accept": "application/json"}),
               "kserve": c.post("/v2/models/indexed/infer", json=_kserve(x))}
    hi = 49 if name == "ids" else 1
    for proto, r in answers.items():
        assert r.status_code == 422, (proto, r.status_code, r.text)
        err = strict_json(r)
        kind = err["type"] if proto == "kserve" else err["error"]         # KServe: {"error": message}
        assert kind == "ContractViolation" and err["kind"] == "input", (proto, err)
        assert err["where"] == f"inputs.{name}" and err["value"] == str(bad), (proto, err)
        assert f"holds {bad} at position [1, 2]" in err["message"] and f"[0, {hi}]" in err["message"], (proto, err)
    ok = c.post("/v1/infer", json={"inputs": {k: v.tolist() for k, v in _inputs().items()}})
    assert ok.status_code == 200, ok.text


def test_a_missing_input_is_named_for_an_http_client(indexed):
    """The runtime's reason (forward's optional arguments, torch.zeros) was sent to HTTP clients (trial U)."""
    x = {k: v.tolist() for k, v in _inputs().items() if k != "token_type_ids"}
    r = indexed.client.post("/v1/infer", json={"inputs": x})
    err = strict_json(r)
    assert r.status_code == 422 and err["where"] == "inputs", r.text
    assert "missing inputs ['token_type_ids']" in err["message"] and "torch" not in err["message"] + err["fix"], err
    assert err["fix"].startswith("send the inputs the recipe declares: ids"), err


def test_kserve_fields_of_the_wrong_type_answer_400(indexed):
    c = indexed.client
    doc = _kserve(_inputs())
    doc["inputs"][0]["parameters"] = [1, 2]
    r = c.post("/v2/models/indexed/infer", json=doc)
    assert r.status_code == 400 and strict_json(r)["where"] == "inputs[0].parameters", r.text
    doc = _kserve(_inputs())
    doc["parameters"] = ["x"]
    r = c.post("/v2/models/indexed/infer", json=doc)
    assert r.status_code == 400 and strict_json(r)["where"] == "parameters", r.text


# ---- HTTP edges --------------------------------------------------------------------------------

def _raw(port: int, request: bytes, read_s: float = EVENT_S) -> tuple[bytes, float]:
    """Send `request` whole, then read until the server closes: (what came back, seconds)."""
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.settimeout(read_s)
        s.sendall(request)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out, time.monotonic() - t0


def _status_and_body(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    return int(lines[0].split()[1]), headers, body


@pytest.mark.parametrize("path,size", [("/v1/infer", "FFFFFFFFFF"), ("/v1/recipe", "200000")])
def test_a_chunk_announced_over_the_limit_is_answered_413_at_once(indexed, path, size):
    method = "PUT" if path == "/v1/recipe" else "POST"
    raw, took = _raw(indexed.port, f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                   f"Transfer-Encoding: chunked\r\n\r\n{size}\r\nabc".encode())
    status, headers, body = _status_and_body(raw)
    assert status == 413 and headers["connection"] == "close", raw[:300]
    assert json.loads(body)["where"] == "body"
    # at once: the server's body timeout here is EVENT_S (minutes), the answer did not wait for it
    assert took < EVENT_S / 2


@pytest.mark.parametrize("what,status", [("url", 414), ("header", 431), ("authorization", 431)])
def test_a_huge_url_or_header_gets_414_or_431_not_a_reset(indexed, what, status):
    big = "a" * (1 << 20)
    heads = {"url": {}, "header": {"x-filler": big}, "authorization": {"authorization": f"Bearer {big}"}}[what]
    req = (f"GET /{big if what == 'url' else 'healthz'} HTTP/1.1\r\nHost: x\r\n"
           + "".join(f"{k}: {v}\r\n" for k, v in heads.items()) + "\r\n").encode()
    raw, _ = _raw(indexed.port, req)
    got, headers, body = _status_and_body(raw)
    assert got == status and json.loads(body)["status"] == status, raw[:300]
    if what != "url":                                    # a client library sees the answer too
        r = httpx.get(f"{indexed.url}/healthz", headers=heads, timeout=EVENT_S)
        assert r.status_code == status and r.json()["error"] == "HeadersTooLarge"
    assert indexed.client.get("/healthz").status_code == 200


def test_every_answer_to_head_is_empty_with_the_get_headers(indexed):
    for path in ("/healthz", "/readyz", "/v1/recipe", "/v2", "/v2/health/ready", "/v1/models", "/nope", "/v1/infer"):
        get = indexed.client.get(path)
        raw, _ = _raw(indexed.port, f"HEAD {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        status, headers, body = _status_and_body(raw)
        assert status == get.status_code and body == b"", (path, raw[:300])
        assert headers["content-type"] == get.headers["content-type"], path
    raw, _ = _raw(indexed.port, b"HEAD /" + b"a" * (HEAD_LIMIT * 4) + b" HTTP/1.1\r\nHost: x\r\n\r\n")
    status, headers, body = _status_and_body(raw)
    assert status == 414 and body == b"" and int(headers["content-length"]) > 0


@pytest.mark.parametrize("token", ["", " "])
def test_an_empty_admin_token_is_refused_at_start_like_a_short_one(tmp_path, monkeypatch, capsys, token):
    """GRAPHMODE_ADMIN_TOKEN="" once meant "no token" (PUT open on loopback)."""
    import yaml
    from test_serve import cnn_recipe

    from graphmode.cli import main
    (tmp_path / "ok.yaml").write_text(yaml.safe_dump(cnn_recipe("ok")))
    monkeypatch.setenv("GRAPHMODE_ADMIN_TOKEN", token)
    with pytest.raises(SystemExit) as e:
        main(["serve", "--model", str(tmp_path / "no-such-model.py") + ":small", "--port", "0",
              "--recipe", str(tmp_path / "ok.yaml")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "at least 16" in err and "Traceback" not in err, err
