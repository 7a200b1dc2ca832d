"""The server against hostile and careless clients, over the real HTTP server on loopback:
the admin token, recipes that would freeze an in-process validator, bad query strings that
must refuse the whole request, slow and oversized requests, non-finite numbers, the
recipe sandbox's limits, and a seeded fuzz of malformed requests (a fast slice by default,
a bigger sweep with -m slow). Targets: no 5xx, no invalid JSON, no traceback, no hang."""
from __future__ import annotations

import base64
import json
import contextlib
import logging
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import torch
import yaml
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from test_serve import (EVENT_S, IMG, READY_S, ROOT, cnn_recipe, current_version, eventually, image, post_json,
                        post_st, serve_cache, strict_json)

from graphmode.serve import ModelServer, ServeConfig, ServerThread
from graphmode.serve.app import check_exposure

TOKEN = "hardening-admin-token-0123456789"
AUTH = {"authorization": f"Bearer {TOKEN}"}
SLOW_S = 2.0                      # the server's header and body timeouts here
BOMBS = {   # recipes whose checking once froze the server (evaluated in-process, holding the GIL)
    "power tower": {"memory": {"budget_mb": "${((((9**64)**64)**64)**64)**64}"}},
    "bucket range": {"dims": {"batch": {"min": 1, "max": 100000000, "max_buckets": 100000000}}},
    "huge grid": {"dims": {"batch": {"min": 1, "max": 10**15}}},
}


class Tracebacks(logging.Handler):
    """Collects log records that carry an exception (a traceback the server printed)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info or record.levelno >= logging.ERROR:
            self.records.append(record)


@contextlib.contextmanager
def serving(server):
    """`server` on loopback, warm, with a client; log records carrying a traceback (or an
    error) are collected in the list yielded third. Stopped and unhooked on exit."""
    seen = Tracebacks()
    loggers = [logging.getLogger(n) for n in ("graphmode", "uvicorn", "uvicorn.error", "starlette")]
    for lg in loggers:
        lg.addHandler(seen)
    running = ServerThread(server).start()
    try:
        running.wait_ready(READY_S)
        with httpx.Client(base_url=running.url, timeout=EVENT_S) as client:
            yield running, client, seen.records
    finally:
        running.stop()
        for lg in loggers:
            lg.removeHandler(seen)


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    from test_serve import tiny_model_spec

    from graphmode.capture.spec import resolve_model_spec
    tiny = resolve_model_spec(tiny_model_spec(tmp_path_factory))
    cfg = ServeConfig(batch_window_ms=5, max_body_mb=1, cache_dir=serve_cache(tmp_path_factory), admin_token=TOKEN,
                      header_timeout_s=SLOW_S, body_timeout_s=SLOW_S, recipe_check_cpu_s=2)
    server = ModelServer(tiny, cnn_recipe("cnn-guarded"), config=cfg)
    with serving(server) as (running, client, tracebacks):
        yield SimpleNamespace(server=server, url=running.url, port=running.port, client=client, bundle=tiny,
                              tracebacks=tracebacks)


def no_tracebacks(g) -> None:
    assert not g.tracebacks, [f"{r.name}: {r.getMessage()}" for r in g.tracebacks[:5]]


# ---- access control --------------------------------------------------------------------------------

def test_admin_token_guards_state_changes_and_reads_stay_open(guarded):
    c = guarded.client
    v = current_version(c)
    running = c.get("/v1/recipe").json()
    for headers in ({}, {"authorization": "Bearer nope"}, {"authorization": f"Basic {TOKEN}"},
                    {"authorization": TOKEN}, {"authorization": f"Bearer {TOKEN}x"}):
        r = c.put("/v1/recipe", json=running, headers=headers)
        assert r.status_code == 401 and r.json()["error"] == "Unauthorized", (headers, r.text)
        assert r.headers["www-authenticate"].startswith("Bearer")
    r = c.put("/v1/recipe", json=running, headers=AUTH)
    assert r.status_code == 200 and r.json()["status"] == "unchanged", r.text
    for path in ("/healthz", "/readyz", "/metrics", "/v1/recipe"):
        assert c.get(path).status_code == 200, path
    assert post_json(c, image(1, 1, guarded.bundle)).status_code == 200
    assert current_version(c) == v
    no_tracebacks(guarded)


def test_a_non_loopback_address_needs_a_token_or_an_explicit_opt_out():
    for host in ("127.0.0.1", "localhost", "::1", "127.0.0.2"):
        check_exposure(host, ServeConfig())
    for host in ("0.0.0.0", "::", "192.0.2.1"):
        with pytest.raises(Exception, match="without an admin token"):
            check_exposure(host, ServeConfig())
        check_exposure(host, ServeConfig(admin_token=TOKEN))
        check_exposure(host, ServeConfig(insecure_no_auth=True))
    with pytest.raises(Exception, match="at least 16"):
        ServeConfig(admin_token="short")


# ---- recipes, queries ------------------------------------------------------------------------------

def test_bad_query_refuses_the_whole_put_before_any_side_effect(guarded):
    c, server = guarded.client, guarded.server
    v, ticket = current_version(c), server.reload
    new = cnn_recipe("cnn-never", buckets=(1, 2))                 # valid: only its query is wrong
    for query in ("wait=1&timeout=abc", "wait=1&timeout=inf", "wait=1&timeout=1e308", "wait=1&timeout=nan",
                  "wait=1&timeout=-1", "wait=1&timeout=0", "wait=maybe", "wait=1&wait=0", "wiat=1",
                  "wait=1&timeout=" + "9" * 5000):
        r = c.put(f"/v1/recipe?{query}", json=new, headers=AUTH)
        assert r.status_code == 400 and r.json()["where"].startswith("query"), (query, r.text)
    assert server.reload is ticket and current_version(c) == v   # nothing was checked, compiled or swapped
    no_tracebacks(guarded)


def test_recipe_bombs_are_refused_while_the_server_keeps_answering(guarded):
    """Each recipe is checked in the sandbox (its own process, CPU-limited); meanwhile the
    server answers /healthz and /v1/infer promptly, and nothing is swapped."""
    c, b = guarded.client, guarded.bundle
    v = current_version(c)
    for what, over in BOMBS.items():
        answer: dict[str, Any] = {}

        def put() -> None:
            with httpx.Client(base_url=guarded.url, timeout=READY_S) as cl:
                answer["r"] = cl.put("/v1/recipe", json=cnn_recipe("bomb", **over), headers=AUTH)

        t = threading.Thread(target=put)
        t.start()
        slowest = 0.0
        while t.is_alive():
            t0 = time.monotonic()
            assert c.get("/healthz").status_code == 200
            assert post_json(c, image(1, 2, b)).status_code == 200
            slowest = max(slowest, time.monotonic() - t0)
            time.sleep(0.1)
        t.join()
        r = answer["r"]
        assert 400 <= r.status_code < 500 and strict_json(r)["error"], (what, r.status_code, r.text[:300])
        assert slowest < 10, (what, slowest)      # it froze for minutes when checked in-process
    for body, kind in ((b'{"version": 1, "budget": ' + b"9" * 5000 + b"}", "application/json"),
                       (b"[1, 2, 3]", "application/json"),
                       (b"version: 1\nname: x\nsla: {p99_ms: .nan}\n", "application/yaml"),
                       (json.dumps(cnn_recipe("inf", sla={"p99_ms": 1e999})).encode(), "application/json")):
        r = c.put("/v1/recipe", content=body, headers={**AUTH, "content-type": kind})
        assert r.status_code == 422 and strict_json(r)["error"], (body[:60], r.text[:300])
    assert current_version(c) == v
    no_tracebacks(guarded)


def test_sandbox_limits_stop_a_runaway_check():
    """The worker's own limits (RLIMIT_CPU, RLIMIT_DATA), on a real process: past its CPU
    budget the kernel ends it; past its memory budget an allocation fails."""
    burn = ("from graphmode.serve.sandbox import _limit\n_limit(1, 256)\nwhile True:\n    pass\n")
    p = subprocess.run([sys.executable, "-c", burn], cwd=ROOT, timeout=EVENT_S)
    assert p.returncode == -signal.SIGXCPU, p.returncode
    grab = ("from graphmode.serve.sandbox import _limit\n_limit(60, 64)\n"
            "try:\n    x = bytearray(1 << 30)\nexcept MemoryError:\n    raise SystemExit(3)\n")
    p = subprocess.run([sys.executable, "-c", grab], cwd=ROOT, timeout=EVENT_S)
    assert p.returncode == 3


# ---- slow and oversized requests ---------------------------------------------------------------------

def raw(port: int, data: bytes) -> bytes:
    """Send `data` and read until the server closes the connection (ceiling EVENT_S)."""
    with socket.create_connection(("127.0.0.1", port), timeout=EVENT_S) as s:
        s.sendall(data)
        out = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                return out
            out += chunk


def test_slow_requests_get_408_and_oversized_ones_413_at_once(guarded):
    port = guarded.port
    slow = [b"POST /v1/infer HTTP/1.1\r\nHost: x\r\nContent-Type: app",                      # headers never end
            b"POST /v1/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n\r\n{\"inputs\"",                                       # body never ends
            b"PUT /v1/recipe HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer " + TOKEN.encode() + b"\r\nContent-Length: 10\r\n\r\n{"]
    with ThreadPoolExecutor(len(slow)) as pool:
        got = list(pool.map(lambda data: raw(port, data), slow))
    assert got[0].startswith(b"HTTP/1.1 408") and b"headers" in got[0], got[0][:200]
    assert got[1].startswith(b"HTTP/1.1 408") and b"body" in got[1], got[1][:300]
    assert got[2].startswith(b"HTTP/1.1 408"), got[2][:300]
    # a Content-Length far over the limit is answered from the header, before any body
    got = raw(port, b"POST /v1/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Content-Length: 1000000000000\r\n\r\n")
    assert got.startswith(b"HTTP/1.1 413"), got[:300]
    got = raw(port, b"PUT /v1/recipe HTTP/1.1\r\nHost: x\r\nContent-Type: application/yaml\r\n"
                    b"Authorization: Bearer " + TOKEN.encode() + b"\r\nContent-Length: 1000000000000\r\n\r\n")
    assert got.startswith(b"HTTP/1.1 413"), got[:300]
    c = guarded.client
    r = c.post("/v1/infer", content=b"[" + b"0," * 700_000 + b"0]", headers={"content-type": "application/json"})
    assert r.status_code == 413                            # a client that writes it all still reads the 413
    assert post_json(c, image(2, 3, guarded.bundle)).status_code == 200
    no_tracebacks(guarded)


# ---- numbers ------------------------------------------------------------------------------------------

def test_non_finite_numbers_are_refused_in_and_spelled_out_in_strict_json(guarded):
    c = guarded.client
    shape = [1, 3, IMG, IMG]

    def flat(token: bytes) -> bytes:
        data = b",".join([b"0.5"] * (IMG * IMG * 3 - 1) + [token])
        return b'{"inputs": {"pixel_values": {"data": [' + data + b'], "shape": ' + json.dumps(shape).encode() + b"}}}"

    for token, status in ((b"NaN", 422), (b"Infinity", 422), (b"-Infinity", 422), (b"1e308", 422), (b"1e999", 422),
                          (b"true", 422), (b"9" * 400, 422), (b"9" * 5000, 400)):
        r = c.post("/v1/infer", content=flat(token), headers={"content-type": "application/json"})
        body = strict_json(r)
        assert r.status_code == status, (token[:20], r.text[:300])
        if status == 422:
            assert body["where"].startswith("inputs.pixel_values"), body
            assert body["value"] is not None or token in (b"true", b"9" * 400), body      # the value, not null
    # KServe v2 reads them as /v1/infer does: refused at the input and index (it said "malformed JSON")
    v2 = b'{"inputs": [{"name": "pixel_values", "datatype": "FP32", "shape": ' + json.dumps(shape).encode() + \
        b', "data": [' + b",".join([b"0.5"] * (IMG * IMG * 3 - 1) + [b"NaN"]) + b"]}]}"
    r = c.post("/v2/models/cnn-guarded/infer", content=v2, headers={"content-type": "application/json"})
    body = strict_json(r)
    assert r.status_code == 422 and body["where"] == "inputs[0]", body
    assert "'pixel_values' holds NaN at index [767]" in body["message"], body
    # finite inputs whose outputs overflow: the JSON answer spells the non-finite values out
    big = torch.full(shape, 3e38)
    r = post_json(c, big)
    assert r.status_code == 200
    logits = strict_json(r)["outputs"]["logits"][0]
    assert logits and all(v in ("NaN", "Infinity", "-Infinity") or isinstance(v, float) for v in logits)
    assert any(isinstance(v, str) for v in logits), logits
    r = post_st(c, {"pixel_values": big})                          # safetensors carries them bit-exact
    assert r.status_code == 200 and not torch.isfinite(st_load(r.content)["logits"]).all()
    no_tracebacks(guarded)


def test_a_key_given_twice_is_refused_not_resolved_silently(guarded):
    """{"inputs": {"x": a, "x": b}} kept b, and its error named a shape mismatch with another input (trial U)."""
    row = json.dumps(image(1, 5, guarded.bundle).tolist()).encode()
    body = b'{"inputs": {"pixel_values": ' + row + b', "pixel_values": ' + row + b"}}"
    r = guarded.client.post("/v1/infer", content=body, headers={"content-type": "application/json"})
    err = strict_json(r)
    assert r.status_code == 400 and "'pixel_values' appears twice" in err["message"] and err["where"] == "body", err


# ---- fuzz ----------------------------------------------------------------------------------------------

JUNK: list[Any] = [None, True, False, 0, -1, 1.5, 1e308, -1e308, 2**64, "x", "", "${1/0}", "${target.nope}",
                   "${" + "9**9**9" + "}", [], {}, [1, [2]], {"a": 1}, "\u0000", "\ud7ff" * 3]
TOKENS = [b"NaN", b"Infinity", b"-Infinity", b"1e999", b"-0", b"9" * 4400, b"true", b"null", b'"s"', b"[]", b"{}"]


def _mutate(rng: random.Random, doc: Any, depth: int = 0) -> Any:
    """`doc` with one value replaced, one key dropped or added, somewhere inside."""
    if isinstance(doc, dict) and doc and depth < 6 and rng.random() < 0.7:
        k = rng.choice(sorted(doc))
        out = dict(doc)
        roll = rng.random()
        if roll < 0.15:
            del out[k]
        elif roll < 0.25:
            out[rng.choice(["extra", "dimz", "budget_mb", "p99_ms", "max_buckets", "buckets"])] = rng.choice(JUNK)
        else:
            out[k] = _mutate(rng, doc[k], depth + 1)
        return out
    if isinstance(doc, list) and doc and depth < 6 and rng.random() < 0.7:
        i = rng.randrange(len(doc))
        return doc[:i] + [_mutate(rng, doc[i], depth + 1)] + doc[i + 1:]
    return rng.choice(JUNK)


def _bytes_mutate(rng: random.Random, data: bytes) -> bytes:
    roll = rng.random()
    if roll < 0.3:
        return data[:rng.randrange(len(data) + 1)]                      # truncated
    if roll < 0.6:
        i = rng.randrange(len(data))
        return data[:i] + rng.choice(TOKENS) + data[i + 1:]            # a token spliced in
    b = bytearray(data)
    for _ in range(rng.randint(1, 8)):
        b[rng.randrange(len(b))] = rng.randrange(256)                   # flipped bytes
    return bytes(b)


def fuzz_requests(rng: random.Random, bundle: Any, n: int) -> list[dict[str, Any]]:
    """`n` seeded malformed requests (method, path, query, headers, body) for every endpoint."""
    x = image(1, 5, bundle)
    good_infer = {"inputs": {"pixel_values": x.tolist()}}
    good_st = st_save({"pixel_values": x})
    recipe = cnn_recipe("cnn-guarded")
    out = []
    for _ in range(n):
        kind = rng.choice(["infer_json", "infer_json", "infer_bytes", "infer_st", "put_json", "put_yaml",
                           "put_bytes", "query", "method"])
        headers: dict[str, str] = {}
        method, path, query, body = "POST", "/v1/infer", "", b""
        if kind == "infer_json":
            body = json.dumps(_mutate(rng, good_infer)).encode()
            headers["content-type"] = rng.choice(["application/json", "", "text/json", "application/x+json"])
        elif kind == "infer_bytes":
            body = _bytes_mutate(rng, json.dumps(good_infer).encode())
            headers["content-type"] = "application/json"
        elif kind == "infer_st":
            body = _bytes_mutate(rng, good_st)
            headers["content-type"] = rng.choice(["application/octet-stream", "application/vnd.safetensors"])
        elif kind.startswith("put"):
            method, path = "PUT", "/v1/recipe"
            if rng.random() < 0.9:
                headers.update(AUTH)
            if kind == "put_json":
                body = json.dumps(_mutate(rng, recipe), allow_nan=True).encode()
                headers["content-type"] = "application/json"
            elif kind == "put_yaml":
                body = yaml.safe_dump(_mutate(rng, recipe)).encode()
                headers["content-type"] = rng.choice(["application/yaml", "text/plain", ""])
            else:
                body = _bytes_mutate(rng, yaml.safe_dump(recipe).encode())
                headers["content-type"] = rng.choice(["application/yaml", "application/json", "image/png"])
            if rng.random() < 0.3:
                query = rng.choice(["wait=1&timeout=abc", "wait=1&timeout=inf", "wait=2", "timeout=1e308",
                                    "wait=1&timeout=" + "9" * 400, "x=%zz", "wait=1&wait=1"])
        elif kind == "query":
            method, path = rng.choice([("GET", "/healthz"), ("GET", "/readyz"), ("GET", "/metrics"),
                                       ("GET", "/v1/recipe"), ("POST", "/v1/infer")])
            query = rng.choice(["a=%ff%fe", "wait=" + "1" * 3000, "&&&==", "x=\u00e9", "timeout=nan"])
            body = json.dumps(good_infer).encode() if method == "POST" else b""
            headers["content-type"] = "application/json"
        else:
            method = rng.choice(["GET", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD", "POST"])
            path = rng.choice(["/v1/infer", "/v1/recipe", "/healthz", "/nope", "/v1/infer/x", "/%ff", "//"])
            body = base64.b64encode(rng.randbytes(rng.randrange(64)))
        out.append({"kind": kind, "method": method, "url": path + ("?" + query if query else ""),
                    "headers": headers, "content": body})
    return out


def run_fuzz(guarded, seed: int, n: int) -> None:
    c = guarded.client
    v = current_version(c)
    failures: list[tuple] = []
    accepted = 0
    for req in fuzz_requests(random.Random(seed), guarded.bundle, n):
        kind = req.pop("kind")
        try:
            r = c.request(**req)
        except httpx.HTTPError as e:          # a hang (client timeout) or a dropped connection
            failures.append((kind, req["method"], req["url"][:60], repr(e)))
            continue
        ok = r.status_code < 500
        if ok and r.headers.get("content-type", "").startswith("application/json") and req["method"] != "HEAD":
            try:
                body = strict_json(r)
                ok = r.status_code < 400 or bool(body.get("error"))
            except (AssertionError, ValueError):
                ok = False
        if not ok:
            failures.append((kind, req["method"], req["url"][:60], r.status_code, r.text[:200]))
        accepted += r.status_code == 202      # a mutation that is a valid recipe: it compiles meanwhile
    assert failures == [], failures[:10]
    assert c.get("/healthz").status_code == 200
    assert post_json(c, image(1, 6, guarded.bundle)).status_code == 200
    eventually(lambda: c.get("/v1/recipe").json()["reload"]["state"] != "compiling", READY_S, "the last swap")
    assert current_version(c) == v or accepted        # only an accepted recipe changes what runs
    no_tracebacks(guarded)


@pytest.mark.slow     # ~6 s; malformed requests are tests/unit/fuzz's http sample
def test_fuzzed_malformed_requests_get_4xx_and_strict_json(guarded):
    run_fuzz(guarded, seed=20261201, n=120)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_fuzzed_malformed_requests_sweep(guarded, seed):
    run_fuzz(guarded, seed=seed, n=1000)
