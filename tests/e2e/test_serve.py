"""End to end: the real HTTP server (uvicorn on a free loopback port, in a thread) over a
small CNN (conv, relu, pool, linear on 16x16 images) and, once, MiniLM. Concurrent
clients, dynamic batching checked against eager per request, a hot recipe swap under load
with zero failed requests, retired deployments released, refused recipes, malformed
requests that all get 4xx, /metrics checked against what was sent, SLA drift
renegotiating to a variant, and `graphmode serve` as a subprocess (admin token, SIGTERM).

Every wait is for an event (ready, swapped, a count of answers) with a generous ceiling,
never a fixed sleep: a slow or loaded host only makes the tests slower. Recipes use
`kernel_selection: heuristic` (kernel timing is not what is tested here) and every server
of the session shares one artifact cache (`serve_cache`), so only the first compiles."""
from __future__ import annotations

import gc
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from graphmode.recipe import load_recipe
from graphmode.serve import ModelServer, ServeConfig, ServerThread
from graphmode.serve import server as server_module
from graphmode.serve.batching import Pending, merge, split
from graphmode.verify.numerics import rel_l2

ROOT = Path(__file__).resolve().parents[2]
IMG = 16
READY_S = 600          # ceilings: a compile on a slow, loaded 2-core host
EVENT_S = 300
TINY_MODEL = f"""
import torch
from graphmode.capture.spec import bundle_from_module


class TinyCNN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(8, 16, 3, stride=2, padding=1)
        self.fc = torch.nn.Linear(16, 10)

    def forward(self, pixel_values):
        x = torch.relu(self.conv1(pixel_values))
        x = torch.relu(self.conv2(x))
        return self.fc(x.mean(dim=(2, 3)))


def small():
    torch.manual_seed(0)
    return bundle_from_module(TinyCNN(), {{"pixel_values": torch.randn(1, 3, {IMG}, {IMG})}},
                              {{"pixel_values": ["batch", 3, {IMG}, {IMG}]}}, name="tinycnn", output_names=["logits"])
"""


def cnn_recipe(name: str = "cnn-a", buckets=(1, 2, 4), **over) -> dict:
    r = {"version": 1, "name": name,
         "inputs": [{"name": "pixel_values", "dtype": "f32", "shape": ["batch", 3, IMG, IMG]}],
         "dims": {"batch": {"buckets": list(buckets)}}, "exe_mode": "graph", "targets": ["host"],
         "codegen": {"kernel_selection": "heuristic"}, "sla": {"p99_ms": 5000}}
    r.update(over)
    return r


def version_of(r: dict) -> str:
    return load_recipe(r).hash()


def eventually(cond: Callable[[], Any], ceiling_s: float, what: str, every_s: float = 0.05) -> Any:
    """Poll `cond` until it is truthy; fail (saying what was awaited) past the ceiling."""
    deadline = time.monotonic() + ceiling_s
    while True:
        got = cond()
        if got:
            return got
        assert time.monotonic() < deadline, f"gave up after {ceiling_s:g} s waiting for {what}"
        time.sleep(every_s)


def serve_cache(tmp_path_factory) -> Path:
    """One artifact cache for every server of the session (and of the other test_serve_*
    modules): the same shapes compile once."""
    return tmp_path_factory.getbasetemp() / "graphmode-serve-cache"


def tiny_model_spec(tmp_path_factory) -> str:
    """`path/models.py:small`: the tiny CNN as `graphmode serve --model` takes it."""
    path = tmp_path_factory.getbasetemp() / "graphmode-serve-models.py"
    if not path.exists():
        path.write_text(TINY_MODEL)
    return f"{path}:small"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from graphmode.capture.spec import resolve_model_spec
    return resolve_model_spec(tiny_model_spec(tmp_path_factory))


@pytest.fixture(scope="module")
def served(tiny, tmp_path_factory):
    cfg = ServeConfig(batch_window_ms=30, max_body_mb=1, cache_dir=serve_cache(tmp_path_factory))
    server = ModelServer(tiny, cnn_recipe(), config=cfg)
    running = ServerThread(server).start()
    try:
        running.wait_ready(READY_S)
        with httpx.Client(base_url=running.url, timeout=EVENT_S) as client:
            yield SimpleNamespace(server=server, url=running.url, client=client, bundle=tiny)
    finally:
        running.stop()


def eager(bundle, x: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return bundle.module(pixel_values=x)[0]


def image(batch: int, seed: int, bundle) -> torch.Tensor:
    return bundle.make_inputs({"batch": batch}, seed=seed)["pixel_values"]


def post_json(client, x: torch.Tensor, **kw) -> httpx.Response:
    return client.post("/v1/infer", json={"inputs": {"pixel_values": x.tolist()}}, **kw)


def post_st(client, tensors: dict, **headers) -> httpx.Response:
    return client.post("/v1/infer", content=st_save(tensors),
                       headers={"content-type": "application/octet-stream", **headers})


def scrape(client) -> dict[tuple[str, tuple], float]:
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def total(metrics: dict, name: str, **labels) -> float:
    return sum(v for (n, ls), v in metrics.items()
               if n == name and all(dict(ls).get(k) == w for k, w in labels.items()))


def current_version(client) -> str:
    return client.get("/v1/recipe").json()["version"]


def strict_json(r: httpx.Response) -> Any:
    """The body, parsed as RFC 8259 JSON (no NaN / Infinity tokens)."""
    def refuse(token: str) -> None:
        raise AssertionError(f"invalid JSON token {token} in {r.text[:200]}")
    return json.loads(r.content, parse_constant=refuse)


# ---- batching primitives (no server) ---------------------------------------------------------------

def test_merge_pads_with_the_recipe_pad_values_and_split_cuts_back():
    rec = load_recipe({"version": 1, "name": "tok",
                       "inputs": [{"name": "input_ids", "dtype": "i64", "shape": ["batch", "seq"], "pad_value": 7},
                                  {"name": "attention_mask", "dtype": "i64", "shape": ["batch", "seq"],
                                   "pad_value": 0, "role": "attention_mask"}],
                       "dims": {"batch": {"buckets": [1, 2, 4]}, "seq": {"buckets": [4, 8]}}})
    a = Pending(None, {"input_ids": torch.tensor([[1, 2, 3]]), "attention_mask": torch.ones(1, 3, dtype=torch.long)},
                {"batch": 1, "seq": 3}, 1)
    b = Pending(None, {"input_ids": torch.arange(10).reshape(2, 5),
                       "attention_mask": torch.ones(2, 5, dtype=torch.long)},
                {"batch": 2, "seq": 5}, 2)
    inputs, dims = merge([a, b], rec.inputs, "batch")
    assert dims == {"batch": 3, "seq": 5}
    assert inputs["input_ids"].tolist()[0] == [1, 2, 3, 7, 7]            # the recipe's pad value
    assert inputs["attention_mask"].tolist()[0] == [1, 1, 1, 0, 0]       # the mask's pad value: masked out
    assert inputs["input_ids"][1:].equal(torch.arange(10).reshape(2, 5))
    hidden = torch.arange(3 * 5 * 2).reshape(3, 5, 2)
    pooled = torch.arange(3 * 4).reshape(3, 4)
    parts = split([hidden, pooled], [["batch", "seq", None], ["batch", None]], [a, b], "batch")
    assert parts[0][0].equal(hidden[:1, :3]) and parts[0][1].equal(pooled[:1])
    assert parts[1][0].equal(hidden[1:, :5]) and parts[1][1].equal(pooled[1:])


def test_requests_never_merge_across_sizes_of_a_dim_unsafe_to_pad():
    from types import SimpleNamespace

    from graphmode.serve.batching import compatible
    dep = SimpleNamespace(cm=SimpleNamespace(exact_dims=["seq"]))
    x = {"ids": torch.zeros(1, 3, dtype=torch.long)}
    a, b, c = (Pending(dep, x, {"batch": 1, "seq": s}, 1) for s in (3, 5, 3))
    assert not compatible(a, b) and compatible(a, c)
    safe = SimpleNamespace(cm=SimpleNamespace(exact_dims=[]))
    assert compatible(Pending(safe, x, {"batch": 1, "seq": 3}, 1), Pending(safe, x, {"batch": 1, "seq": 5}, 1))


# ---- inference ---------------------------------------------------------------------------------------

def test_health_readiness_and_recipe_endpoints(served):
    c = served.client
    assert c.get("/healthz").json()["status"] == "live"
    ready = c.get("/readyz")
    assert ready.status_code == 200 and ready.json()["status"] == "ready"
    view = c.get("/v1/recipe").json()
    assert view["version"] == ready.json()["version"] == served.server.active.version
    assert view["recipe"]["name"] == view["name"] and view["buckets"]
    assert load_recipe(view["recipe"]).hash() == view["version"]        # GET's recipe round-trips


def test_json_and_safetensors_answers_match_eager(served):
    c, b = served.client, served.bundle
    x = image(2, 1, b)
    r = post_json(c, x)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["bucket"] == {"batch": 2} and body["recipe_version"] == current_version(c)
    assert body["shapes"] == {"logits": [2, 10]} and body["dtypes"] == {"logits": "f32"}
    assert rel_l2(torch.tensor(body["outputs"]["logits"]), eager(b, x)) < 1e-5

    x3 = image(3, 2, b)                                   # padded up to bucket 4, sliced back
    r = post_st(c, {"pixel_values": x3})
    assert r.status_code == 200 and r.headers["content-type"] == "application/octet-stream"
    assert json.loads(r.headers["x-graphmode-bucket"]) == {"batch": 4}
    out = st_load(r.content)["logits"]
    assert out.shape == (3, 10) and rel_l2(out, eager(b, x3)) < 1e-5

    r = post_st(c, {"pixel_values": x3}, accept="application/json")   # binary in, JSON out
    assert r.status_code == 200 and r.json()["shapes"]["logits"] == [3, 10]

    flat = {"inputs": {"pixel_values": {"data": x.flatten().tolist(), "shape": list(x.shape), "dtype": "float32"}}}
    r = c.post("/v1/infer", json=flat)                    # the object form: flat data + shape
    assert r.status_code == 200 and rel_l2(torch.tensor(r.json()["outputs"]["logits"]), eager(b, x)) < 1e-5


def test_concurrent_requests_are_batched_and_split_back_per_request(served):
    b = served.bundle
    xs = [image(1 + i % 2, 100 + i, b) for i in range(4)]      # 1, 2, 1, 2 rows
    merged = False
    for attempt in range(3):
        gate = threading.Barrier(len(xs))
        res: list = [None] * len(xs)

        def go(i: int) -> None:
            with httpx.Client(base_url=served.url, timeout=EVENT_S) as cl:
                gate.wait()
                res[i] = post_st(cl, {"pixel_values": xs[i]}, accept="application/json").json()

        threads = [threading.Thread(target=go, args=(i,)) for i in range(len(xs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(EVENT_S)
        for x, r in zip(xs, res):
            assert rel_l2(torch.tensor(r["outputs"]["logits"]), eager(b, x)) < 1e-5
            assert r["batch"]["rows"] <= 4 and r["bucket"]["batch"] >= r["batch"]["rows"]
        merged = any(r["batch"]["requests"] >= 2 for r in res)
        if merged:
            break
    assert merged, "no two requests were batched within the 30 ms window"


# ---- bad requests -------------------------------------------------------------------------------------

def test_malformed_requests_all_get_4xx_and_are_counted(served):
    c, b = served.client, served.bundle
    before = scrape(c)
    ok = image(1, 3, b)
    big = b'{"inputs": {"pixel_values": [' + b",".join([b"0.123456789"] * 120_000) + b"]}}"   # > 1 MB
    assert len(big) > 2**20
    cases = [
        ("malformed json", dict(content=b'{"inputs": [1,', headers={"content-type": "application/json"}), 400, None),
        ("not an object", dict(json=[1, 2]), 400, None),
        ("no inputs key", dict(json={"pixel": 1}), 400, None),
        ("deep nesting", dict(content=b"[" * 200_000, headers={"content-type": "application/json"}), 400, None),
        ("unknown name", dict(json={"inputs": {"pixels": ok.tolist()}}), 422, "input"),
        ("missing input", dict(json={"inputs": {}}), 422, "input"),
        ("strings", dict(json={"inputs": {"pixel_values": [["a"]]}}), 422, "input"),
        ("booleans for floats", dict(json={"inputs": {"pixel_values": [[[[True]]]]}}), 422, "input"),
        ("booleans among floats", dict(json={"inputs": {"pixel_values": [[[[0.5, True]]]]}}), 422, "input"),
        ("NaN", dict(content=b'{"inputs": {"pixel_values": [[[[0.5, NaN]]]]}}'), 422, "input"),
        ("Infinity", dict(content=b'{"inputs": {"pixel_values": [[[[-Infinity]]]]}}'), 422, "input"),
        ("above f32", dict(content=b'{"inputs": {"pixel_values": [[[[1e308]]]]}}'), 422, "input"),
        ("5000-digit integer", dict(content=b'{"inputs": {"pixel_values": [[[[' + b"7" * 5000 + b']]]]}}'), 400,
         None),
        ("NaN tensor", dict(content=st_save({"pixel_values": torch.full((1, 3, IMG, IMG), float("nan"))}),
                            headers={"content-type": "application/octet-stream"}), 422, "input"),
        ("ragged", dict(json={"inputs": {"pixel_values": [[1.0, 2.0], [3.0]]}}), 422, "input"),
        ("wrong rank", dict(json={"inputs": {"pixel_values": [[1.0, 2.0]]}}), 422, "shape"),
        ("wrong image size", dict(content=st_save({"pixel_values": torch.zeros(1, 3, 8, 8)}),
                                  headers={"content-type": "application/octet-stream"}), 422, "shape"),
        ("batch above the contract", dict(content=st_save({"pixel_values": torch.zeros(5, 3, IMG, IMG)}),
                                          headers={"content-type": "application/octet-stream"}), 422, "shape"),
        ("empty batch", dict(content=st_save({"pixel_values": torch.zeros(0, 3, IMG, IMG)}),
                             headers={"content-type": "application/octet-stream"}), 422, "shape"),
        ("wrong dtype", dict(content=st_save({"pixel_values": ok.double()}),
                             headers={"content-type": "application/octet-stream"}), 422, "input"),
        ("garbage safetensors", dict(content=b"\x00\x01garbage", headers={"content-type": "application/octet-stream"}),
         400, None),
        ("empty body", dict(content=b"", headers={"content-type": "application/octet-stream"}), 400, None),
        ("media type", dict(content=b"hello", headers={"content-type": "text/plain"}), 415, None),
        ("too large", dict(content=big, headers={"content-type": "application/json"}), 413, None),
    ]
    for what, kw, status, _ in cases:
        r = c.post("/v1/infer", **kw)
        assert r.status_code == status, (what, r.status_code, r.text[:300])
        body = strict_json(r)
        assert body["error"] and body["message"], what
        if status == 422:
            assert body["where"].startswith("inputs") or body["where"].startswith("dims"), (what, body)
    assert c.get("/v1/infer").status_code == 405
    assert c.get("/nope").status_code == 404 and "endpoints" in c.get("/nope").json()["fix"]
    r = post_st(c, {"pixel_values": image(5, 5, b)})
    assert "outside the recipe's range [1, 4]" in r.json()["message"] and r.json()["where"] == "dims.batch"

    r = post_json(c, ok)                                  # the worker is alive and well
    assert r.status_code == 200
    after = scrape(c)
    v = current_version(c)
    for kind in ("shape", "input"):
        sent = sum(1 for _, _, _, k in cases if k == kind) + (kind == "shape")
        got = (total(after, "graphmode_contract_violations_total", version=v, kind=kind)
               - total(before, "graphmode_contract_violations_total", version=v, kind=kind))
        assert got == sent, kind
    refused = sum(1 for _, _, s, _ in cases if s == 422) + 1
    assert (total(after, "graphmode_requests_total", version=v, status="contract")
            - total(before, "graphmode_requests_total", version=v, status="contract")) == refused
    assert (total(after, "graphmode_bad_requests_total") - total(before, "graphmode_bad_requests_total")
            == sum(1 for _, _, s, _ in cases if s != 422) + 3)          # + the 405 and the two 404s
    assert total(after, "graphmode_bad_requests_total", reason="too_large") >= 1
    for reason, n in (("method_not_allowed", 1), ("not_found", 2)):
        assert (total(after, "graphmode_bad_requests_total", reason=reason)
                - total(before, "graphmode_bad_requests_total", reason=reason)) == n, reason
    health = total(after, "graphmode_health_score", version=v)
    ops = total(after, "graphmode_operations_total", version=v)
    bad = total(after, "graphmode_violated_operations_total", version=v)
    assert 0 < health < 1 and health == pytest.approx(1 - bad / ops)
    # the bound alerts compare with (the recipe's sla.p99_ms 5000): exported, not copied into the alert
    assert total(after, "graphmode_sla_bound_seconds", version=v, entry="sla", quantile="p99") == 5.0


def test_refused_recipes_leave_the_running_one_untouched(served):
    c = served.client
    v = current_version(c)
    r = c.put("/v1/recipe", json=cnn_recipe("tiny-budget", memory={"budget_mb": 0.01}))
    assert r.status_code == 422
    body = r.json()
    assert body["error"] == "ConstraintError" and body["counterexample"] and "MB" in body["message"]
    assert any(p["status"] == "refuted" for p in body["proofs"])
    r = c.put("/v1/recipe", content=b"version: 1\nname: x\ninputs: [\n", headers={"content-type": "application/yaml"})
    assert r.status_code == 422 and r.json()["line"] is not None and "YAML" in r.json()["message"]
    bad_key = cnn_recipe("typo")
    bad_key["dimz"] = bad_key.pop("dims")
    r = c.put("/v1/recipe", json=bad_key)
    assert r.status_code == 422 and r.json()["error"] == "RecipeErrors"
    assert any(e["where"].endswith("dimz") for e in r.json()["errors"])
    wrong_model = cnn_recipe("wrong-size")
    wrong_model["inputs"][0]["shape"] = ["batch", 3, 224, 224]
    r = c.put("/v1/recipe", json=wrong_model)
    assert r.status_code == 422 and "shape" in r.text and "224" in r.text, r.text   # names the field and value
    r = c.put("/v1/recipe", content=b"\x00", headers={"content-type": "image/png"})
    assert r.status_code == 415
    r = c.put("/v1/recipe", content=b"[1, 2]", headers={"content-type": "application/json"})
    assert r.status_code == 422 and "must be an object" in r.json()["message"]
    r = c.put("/v1/recipe", json=c.get("/v1/recipe").json())     # the running recipe again
    assert r.status_code == 200 and r.json()["status"] == "unchanged"
    assert current_version(c) == v
    assert post_json(c, image(1, 6, served.bundle)).json()["recipe_version"] == v


def test_hot_swap_under_concurrent_load_fails_no_request(served):
    c, b = served.client, served.bundle
    old = current_version(c)
    old_deployment = weakref.ref(served.server.active)
    new_recipe = cnn_recipe("cnn-b", buckets=(1, 2, 4, 8), sla={"p99_ms": 4000})
    new = version_of(new_recipe)
    before = scrape(c)
    xs = [image(1 + i % 2, 200 + i, b) for i in range(4)]
    stop = threading.Event()
    results: list[tuple[float, int, str | None, str]] = []    # (start time, status, version, error)
    lock = threading.Lock()

    def client(k: int) -> None:
        rng = random.Random(k)
        with httpx.Client(base_url=served.url, timeout=EVENT_S) as cl:
            while not stop.is_set():
                x = xs[rng.randrange(len(xs))]
                t0 = time.monotonic()
                try:
                    r = post_st(cl, {"pixel_values": x}) if rng.random() < 0.5 else post_json(cl, x)
                    ver = (r.headers.get("x-graphmode-recipe-version") if r.headers["content-type"].startswith(
                        "application/octet") else r.json().get("recipe_version"))
                    rec = (t0, r.status_code, ver, "" if r.status_code == 200 else r.text[:200])
                except Exception as e:  # noqa: BLE001 - a transport failure is a failed request too
                    rec = (t0, -1, None, repr(e))
                with lock:
                    results.append(rec)

    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(6)]
    for t in threads:
        t.start()
    try:
        eventually(lambda: len(results) >= 12, EVENT_S, "12 answers before the swap")
        r = c.put("/v1/recipe", json=new_recipe)                   # accepted: compiles in the background
        assert r.status_code == 202, r.text
        assert r.json()["version"] == new and r.json()["previous"] == old
        busy = c.put("/v1/recipe", json=cnn_recipe("cnn-c", buckets=(1, 2)))
        assert busy.status_code == 409 and "still loading" in busy.json()["message"]
        eventually(lambda: c.get("/v1/recipe").json()["reload"]["state"] != "compiling", READY_S, "the swap")
        swapped_at = time.monotonic()
        view = c.get("/v1/recipe").json()
        assert view["reload"]["state"] == "swapped" and view["version"] == new, view["reload"]
        n_before_swap = len(results)
        eventually(lambda: len(results) >= n_before_swap + 12, EVENT_S, "12 answers after the swap")
    finally:
        stop.set()
        for t in threads:
            t.join(EVENT_S)
    assert not any(t.is_alive() for t in threads)

    failures = [r for r in results if r[1] != 200]
    assert failures == [], failures[:5]
    versions = {r[2] for r in results}
    assert versions == {old, new}
    assert all(r[2] == new for r in results if r[0] > swapped_at)   # new requests run on the new plans

    after = scrape(c)
    for ver in (old, new):
        sent = sum(1 for r in results if r[2] == ver)
        counted = (total(after, "graphmode_requests_total", version=ver, status="ok")
                   - total(before, "graphmode_requests_total", version=ver, status="ok"))
        assert counted == sent, ver
        hist = (total(after, "graphmode_request_latency_seconds_count", version=ver)
                - total(before, "graphmode_request_latency_seconds_count", version=ver))
        assert hist == sent
    compiled = total(after, "graphmode_compile_events_total", version=new)
    assert compiled == 4                                         # every bucket warmed before the swap
    assert total(after, "graphmode_recipe_active", version=new) == 1
    assert total(after, "graphmode_recipe_active", version=old) == 0
    for outcome, n in (("swapped", 1), ("busy", 1)):
        assert (total(after, "graphmode_recipe_reloads_total", origin="api", outcome=outcome)
                - total(before, "graphmode_recipe_reloads_total", origin="api", outcome=outcome)) == n, outcome
    cm = served.server.active.cm
    for env in cm.recipe.buckets():                              # arena gauges = the plans' arenas
        label = ",".join(f"{k}={v}" for k, v in sorted(env.items()))
        assert total(after, "graphmode_arena_bytes", version=new, bucket=label) == cm.executable(env).plan.arena_bytes
    assert cm.metrics()["contract"]["version"] == new            # the same numbers in-process
    assert cm.metrics()["contract"]["requests"]["ok"] == sum(1 for r in results if r[2] == new)
    r = post_st(c, {"pixel_values": image(7, 7, b)})            # the new recipe's bigger bucket
    assert r.status_code == 200 and json.loads(r.headers["x-graphmode-bucket"]) == {"batch": 8}
    eventually(lambda: gc.collect() >= 0 and old_deployment() is None, EVENT_S,
               "the retired deployment to be released", every_s=0.2)


def test_retired_deployments_are_released_and_their_series_dropped(served, monkeypatch):
    """Several swaps: each retired deployment (its CompiledModel, graph, plans with their
    packed weights, monitor) is freed as soon as its last request is done, by reference
    counting alone (the cyclic collector is off here: a reference cycle would keep hundreds
    of MB until a full collection happens to run); only the last retired version keeps its
    Prometheus series (RETIRED_SERIES_KEPT, here 1)."""
    monkeypatch.setattr(server_module, "RETIRED_SERIES_KEPT", 1)
    c, b = served.client, served.bundle
    versions = [current_version(c)]
    retired: list[weakref.ref] = []
    gc.collect()
    gc.disable()
    try:
        for i, p99 in enumerate((3000, 2500)):
            dep = served.server.active
            retired += [weakref.ref(dep), weakref.ref(dep.cm), weakref.ref(dep.cm.graph), weakref.ref(dep.monitor)]
            retired += [weakref.ref(dep.cm.executable(env)) for env in dep.buckets]
            del dep
            assert post_json(c, image(1, 30 + i, b)).status_code == 200
            r = c.put(f"/v1/recipe?wait=1&timeout={READY_S}", json=cnn_recipe(f"cnn-gc{i}", sla={"p99_ms": p99}))
            assert r.status_code == 200 and r.json()["status"] == "swapped", r.text
            versions.append(r.json()["version"])
            assert post_json(c, image(1, 40 + i, b)).json()["recipe_version"] == versions[-1]
        eventually(lambda: all(ref() is None for ref in retired), EVENT_S,
                   "the retired deployments to be freed without the cyclic collector", every_s=0.2)
    finally:
        gc.enable()
    exported = {dict(labels).get("version") for (_, labels) in scrape(c)}
    assert versions[0] not in exported                     # retired before the last one: series dropped
    assert versions[1] in exported and versions[2] in exported


# ---- a small custom module: eager fallback outside the contract ------------------------------------------

class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 4)

    def forward(self, x):
        return torch.relu(self.fc(x))


def test_on_violation_eager_serves_outside_the_contract_and_counts_the_fallback(tmp_path_factory):
    torch.manual_seed(0)
    mlp = MLP().eval()
    rec = {"version": 1, "name": "mlp", "inputs": [{"name": "x", "dtype": "f32", "shape": ["batch", 8]}],
           "dims": {"batch": {"buckets": [1, 2, 4]}}, "on_violation": "eager", "targets": ["host"],
           "codegen": {"kernel_selection": "heuristic"}}
    server = ModelServer(mlp, rec, config=ServeConfig(batch_window_ms=0, cache_dir=serve_cache(tmp_path_factory)))
    with ServerThread(server) as running:
        running.wait_ready(READY_S)
        with httpx.Client(base_url=running.url, timeout=EVENT_S) as c:
            x = torch.randn(6, 8)                         # batch 6 > 4: no plan, runs eagerly
            r = c.post("/v1/infer", json={"inputs": {"x": x.tolist()}})
            assert r.status_code == 200 and r.json()["bucket"] is None
            (out,) = r.json()["outputs"].values()
            assert rel_l2(torch.tensor(out), mlp(x)) < 1e-5
            r = c.post("/v1/infer", json={"inputs": {"x": torch.randn(3, 8).tolist()}})
            assert r.status_code == 200 and r.json()["bucket"] == {"batch": 4}
            m = scrape(c)
    v = version_of(rec)
    assert total(m, "graphmode_fallback_events_total", version=v, bucket="eager") == 1
    assert total(m, "graphmode_contract_violations_total", version=v, kind="fallback") == 1
    assert total(m, "graphmode_contract_violations_total", version=v, kind="shape") == 1
    assert total(m, "graphmode_requests_total", version=v, bucket="eager", status="ok") == 1
    assert total(m, "graphmode_requests_total", version=v, bucket="batch=4", status="ok") == 1
    ops = total(m, "graphmode_operations_total", version=v)          # 2 requests + 3 bucket plans
    assert ops == 5 and total(m, "graphmode_health_score", version=v) == pytest.approx(1 - 1 / 5)


# ---- SLA drift -> renegotiation ------------------------------------------------------------------------

def test_sustained_sla_drift_renegotiates_to_the_next_variant_once(tiny, tmp_path_factory):
    # the cost model proves 5 ms for batch <= 2; the 40 ms batching window alone breaks it
    tight = cnn_recipe("cnn-tight", buckets=(1, 2), sla={"p99_ms": 5})
    relaxed = cnn_recipe("cnn-relaxed", buckets=(1, 2), sla={"p99_ms": 5000})
    cfg = ServeConfig(batch_window_ms=40, cache_dir=serve_cache(tmp_path_factory), sla_window_s=0.4, sla_windows=2,
                      sla_min_samples=3, sla_margin=0.2, renegotiate_interval_s=3600)
    server = ModelServer(tiny, tight, variants=[relaxed], config=cfg)
    with ServerThread(server) as running:
        with httpx.Client(base_url=running.url, timeout=EVENT_S) as c:
            if server.state != "ready":                  # compiling: live, not ready, infer says retry
                assert c.get("/healthz").status_code == 200
                early = post_st(c, {"pixel_values": image(1, 0, tiny)})
                assert early.status_code in (503, 200)
                if early.status_code == 503:
                    assert early.headers["retry-after"] and "warming up" in early.json()["message"]
            running.wait_ready(READY_S)
            view = c.get("/v1/recipe").json()
            assert view["version"] == version_of(tight)
            assert view["variants"] == [{"index": 0, "name": "cnn-relaxed", "version": version_of(relaxed),
                                         "used": False}]
            x = image(1, 9, tiny)

            def switched() -> bool:
                assert post_st(c, {"pixel_values": x}).status_code == 200
                return c.get("/v1/recipe").json()["version"] == version_of(relaxed)

            eventually(switched, READY_S, "the renegotiation to the relaxed variant", every_s=0)
            for _ in range(10):                              # more slow requests: no further switch
                assert post_st(c, {"pixel_values": x}).status_code == 200
            m = scrape(c)
            view = c.get("/v1/recipe").json()
    tight_v = version_of(tight)
    assert total(m, "graphmode_sla_drift_events_total", version=tight_v, quantile="p99") >= 1
    assert total(m, "graphmode_renegotiations_total", version=tight_v, outcome="renegotiated") == 1
    assert total(m, "graphmode_renegotiations_total", outcome="renegotiated") == 1
    assert total(m, "graphmode_contract_violations_total", version=tight_v, kind="latency") >= 3
    assert total(m, "graphmode_health_score", version=tight_v) < 1
    assert total(m, "graphmode_recipe_reloads_total", origin="variant", outcome="swapped") == 1
    assert view["origin"] == "variant[0]" and view["variants"][0]["used"]
    assert view["renegotiation"]["history"][0]["outcome"] == "renegotiated"


# ---- MiniLM: different sequence lengths batched together ----------------------------------------------

def test_minilm_requests_of_different_lengths_batch_and_match_eager(bundle, tmp_path_factory):
    b = bundle("minilm")
    rec = {"version": 1, "name": "minilm-serve",
           "inputs": [{"name": n, "dtype": "i64", "shape": ["batch", "seq"]}
                      for n in ("input_ids", "attention_mask", "token_type_ids")],
           "dims": {"batch": {"buckets": [4]}, "seq": {"buckets": [16]}}, "targets": ["host"],
           "codegen": {"kernel_selection": "heuristic"}}      # one plan: (4, 16)
    server = ModelServer(b, rec, config=ServeConfig(batch_window_ms=300, cache_dir=serve_cache(tmp_path_factory)))
    reqs = [b.make_inputs({"batch": 1, "seq": 5}, seed=1), b.make_inputs({"batch": 2, "seq": 12}, seed=2)]
    with ServerThread(server) as running:
        running.wait_ready(READY_S)
        for attempt in range(3):                 # two threads must reach the 300 ms window together
            gate = threading.Barrier(2)
            res: list = [None, None]

            def go(i: int) -> None:
                with httpx.Client(base_url=running.url, timeout=EVENT_S) as cl:
                    gate.wait()
                    res[i] = cl.post("/v1/infer",
                                     json={"inputs": {k: v.tolist() for k, v in reqs[i].items()}}).json()

            threads = [threading.Thread(target=go, args=(i,)) for i in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(EVENT_S)
            if res[0]["batch"]["requests"] == 2:
                break
    assert res[0]["batch"] == {"requests": 2, "rows": 3} and res[0]["bucket"] == {"batch": 4, "seq": 16}
    for inputs, r in zip(reqs, res):
        with torch.inference_mode():
            ref = b.module(**inputs)
        seq = inputs["input_ids"].shape[1]
        assert r["shapes"] == {"last_hidden_state": [inputs["input_ids"].shape[0], seq, 384],
                               "pooler_output": [inputs["input_ids"].shape[0], 384]}
        assert rel_l2(torch.tensor(r["outputs"]["last_hidden_state"]), ref[0]) < 1e-4
        assert rel_l2(torch.tensor(r["outputs"]["pooler_output"]), ref[1]) < 1e-4


class _RowsMeet(torch.nn.Module):
    """Each row minus the sum of every row: a request's answer depends on the rows beside it."""

    def forward(self, x):
        return x - x.sum(0)


def test_requests_are_not_merged_where_the_models_rows_meet(tmp_path_factory):
    """Merging two requests along batch gave each the other's rows in its answer (40 of 40
    concurrent answers wrong); the server merges only where the rows never meet
    (analysis.padding.positions_independent)."""
    from graphmode.capture.spec import bundle_from_module
    b = bundle_from_module(_RowsMeet().eval(), {"x": torch.randn(2, 4)}, {"x": ["batch", 4]})
    rec = {"version": 1, "name": "rows-meet", "inputs": [{"name": "x", "dtype": "f32", "shape": ["batch", 4]}],
           "dims": {"batch": {"buckets": [1, 2, 4], "exact_plans": None}}, "targets": ["host"]}
    server = ModelServer(b, rec, config=ServeConfig(batch_window_ms=300, cache_dir=serve_cache(tmp_path_factory)))
    reqs = [torch.randn(1, 4), torch.randn(2, 4)]
    with ServerThread(server) as running:
        running.wait_ready(READY_S)
        assert not running.server.current().merges
        gate, res = threading.Barrier(2), [None, None]

        def go(i: int) -> None:
            with httpx.Client(base_url=running.url, timeout=EVENT_S) as cl:
                gate.wait()
                res[i] = cl.post("/v1/infer", json={"inputs": {"x": reqs[i].tolist()}}).json()

        threads = [threading.Thread(target=go, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(EVENT_S)
    for x, r in zip(reqs, res):
        assert r["batch"]["requests"] == 1 and rel_l2(torch.tensor(r["outputs"]["output"]), x - x.sum(0)) < 1e-6


# ---- the command -----------------------------------------------------------------------------------------

ADMIN_TOKEN = "test-admin-token-0123456789"


def serve_process(tmp_path, tmp_path_factory, name: str, *args: str, **env: str) -> tuple[subprocess.Popen, list[str]]:
    """`graphmode serve` of the tiny CNN under recipe `name` on a free port (and `args`), and the lines it prints."""
    import yaml
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(cnn_recipe(name)))
    proc = subprocess.Popen([sys.executable, "-m", "graphmode", "serve", "--model", tiny_model_spec(tmp_path_factory),
                             "--recipe", str(tmp_path / "r.yaml"), "--port", "0",
                             "--cache-dir", str(serve_cache(tmp_path_factory)), "--log-level", "warning", *args],
                            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), **env}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    return proc, lines


def killed(proc: subprocess.Popen) -> None:
    """A server a test leaves running is killed (a failed assertion must not leak it)."""
    if proc.poll() is None:
        proc.kill()
        proc.wait(30)


def listening_url(proc: subprocess.Popen, lines: list[str]) -> str:
    """The address `graphmode serve` printed it listens on (once it has)."""
    def url() -> str | None:
        assert proc.poll() is None, "".join(lines)
        m = re.search(r"http://127\.0\.0\.1:(\d+)", "".join(lines))
        return m and f"http://127.0.0.1:{m.group(1)}"
    return eventually(url, READY_S, "the listening line")


def test_graphmode_serve_command(tmp_path, tmp_path_factory):
    """The command over the tiny CNN: ready, infer, /metrics; the admin token (from the
    environment) guards PUT; SIGTERM while a `PUT ?wait=1` is waiting on a compile stops
    the server at once (nothing waits on the compile) and exits 0."""
    proc, lines = serve_process(tmp_path, tmp_path_factory, "cnn-cli", GRAPHMODE_ADMIN_TOKEN=ADMIN_TOKEN)
    put: dict[str, Any] = {}
    try:
        base = listening_url(proc, lines)
        with httpx.Client(base_url=base, timeout=EVENT_S) as c:
            def ready() -> bool:
                assert proc.poll() is None, "".join(lines)
                return c.get("/readyz").status_code == 200

            eventually(ready, READY_S, "/readyz", every_s=0.1)
            x = torch.randn(2, 3, IMG, IMG)
            r = post_json(c, x)
            assert r.status_code == 200 and r.json()["shapes"] == {"logits": [2, 10]}
            text = c.get("/metrics").text
            assert "graphmode_requests_total" in text and "_created" not in text     # (half the lines)
            new = cnn_recipe("cnn-cli-b", buckets=tuple(range(33, 41)))   # 8 new plans: seconds of compiling
            r = c.put("/v1/recipe", json=new)
            assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Bearer")
            r = c.put("/v1/recipe", json=new, headers={"authorization": "Bearer wrong-token-0123456789"})
            assert r.status_code == 401
            assert "ready" in "".join(lines) and "needs the admin token" in "".join(lines)

        def put_and_wait() -> None:
            with httpx.Client(base_url=base, timeout=READY_S) as cl:
                try:
                    put["r"] = cl.put(f"/v1/recipe?wait=1&timeout={READY_S}", json=new,
                                      headers={"authorization": f"Bearer {ADMIN_TOKEN}"})
                except httpx.HTTPError as e:
                    put["r"] = e

        waiter = threading.Thread(target=put_and_wait, daemon=True)
        waiter.start()
        with httpx.Client(base_url=base, timeout=EVENT_S) as c:
            def compiling() -> bool:
                assert waiter.is_alive(), put          # answered before it compiled: say what it got
                return c.get("/v1/recipe").json()["reload"]["state"] == "compiling"

            eventually(compiling, EVENT_S, "the authorized PUT to start compiling")
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(60)                   # ceiling: uvicorn's graceful shutdown is 5 s
        stopped_in = time.monotonic() - t0
    finally:
        killed(proc)
    assert rc == 0, "".join(lines)
    assert stopped_in < 60 and "stopped" in "".join(lines), "".join(lines)
    waiter.join(EVENT_S)
    assert "r" in put and "Traceback" not in "".join(lines), "".join(lines)


@pytest.mark.slow     # ~6 s: a server process of its own
def test_a_second_signal_during_shutdown_still_stops_the_server_and_prints_no_traceback(tmp_path, tmp_path_factory):
    """SIGTERM then Ctrl-C is uvicorn's forced exit: it skipped the app's lifespan shutdown (the
    ModelServer's stop: its rank processes, the last knowledge-base window), asyncio cancelled
    that task on the way out, and starlette printed the CancelledError as an ERROR traceback."""
    proc, lines = serve_process(tmp_path, tmp_path_factory, "cnn-force")
    try:
        def ready() -> bool:
            assert proc.poll() is None, "".join(lines)
            return any(line.startswith("ready") for line in lines)

        eventually(ready, READY_S, "the ready line", every_s=0.1)
        proc.send_signal(signal.SIGTERM)
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(60)
    finally:
        killed(proc)
    out = "".join(lines)
    assert rc == 0 and "stopped" in out, out
    assert "Traceback" not in out and "CancelledError" not in out, out


def test_sigterm_answers_the_requests_waiting_for_a_batch_at_once(tmp_path, tmp_path_factory):
    """A request waiting for its batch to fill (--batch-window-ms 60000) at SIGTERM waited out the
    window past the shutdown grace; uvicorn then cancelled it into a plain-text 500 and printed a
    traceback (trial U). Shutdown stops waiting for batches: it runs at once and answers 200."""
    proc, lines = serve_process(tmp_path, tmp_path_factory, "cnn-term", "--batch-window-ms", "60000",
                                "--shutdown-grace-s", "30")
    got: dict[str, Any] = {}
    try:
        base = listening_url(proc, lines)
        with httpx.Client(base_url=base, timeout=READY_S) as c:
            eventually(lambda: c.get("/readyz").status_code == 200, READY_S, "/readyz", every_s=0.1)

            def send() -> None:
                with httpx.Client(base_url=base, timeout=READY_S) as cl:
                    got["r"] = post_json(cl, torch.randn(1, 3, IMG, IMG))
            sender = threading.Thread(target=send, daemon=True)
            sender.start()
            eventually(lambda: re.search(r"^graphmode_queue_depth\{[^}]*\} 1\.0$", c.get("/metrics").text, re.M),
                       EVENT_S, "the request to wait for its batch")
        proc.send_signal(signal.SIGTERM)
        sender.join(EVENT_S)
        rc = proc.wait(60)
    finally:
        killed(proc)
    out = "".join(lines)
    assert got["r"].status_code == 200 and got["r"].json()["shapes"] == {"logits": [1, 10]}, out
    assert rc == 0 and "Traceback" not in out, out


def test_graphmode_serve_refuses_bad_settings_before_listening(tmp_path, tmp_path_factory, monkeypatch, capsys):
    """Refused before the model is built or a socket bound (exit 2, no traceback): a bad
    recipe, a non-loopback address without an admin token, a weak admin token."""
    import yaml

    from graphmode.cli import main
    monkeypatch.delenv("GRAPHMODE_ADMIN_TOKEN", raising=False)
    bad = cnn_recipe("bad")
    bad["dims"]["batch"]["bucketz"] = [1]
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(bad))
    (tmp_path / "ok.yaml").write_text(yaml.safe_dump(cnn_recipe("ok")))
    never = str(tmp_path / "no-such-model.py") + ":small"          # building it would fail differently
    cases = [(["--recipe", str(tmp_path / "bad.yaml")], "bucketz"),
             (["--recipe", str(tmp_path / "ok.yaml"), "--host", "0.0.0.0"], "without an admin token"),
             (["--recipe", str(tmp_path / "ok.yaml"), "--host", "0.0.0.0", "--admin-token", "short"],
              "at least 16"),
             (["--recipe", str(tmp_path / "ok.yaml"), "--batch-window-ms", "-5"], "fix: pass a finite number >= 0")]
    for args, expect in cases:
        with pytest.raises(SystemExit) as exit_:
            main(["serve", "--model", never, "--port", "0", *args])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and expect in err and "Traceback" not in err, (args, err)
    import socket
    with socket.socket() as taken:               # a port in use: said before the model loads (minutes for a real one)
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        with pytest.raises(SystemExit) as exit_:
            main(["serve", "--model", never, "--recipe", str(tmp_path / "ok.yaml"), "--port",
                  str(taken.getsockname()[1])])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "cannot listen on 127.0.0.1" in err and "no-such-model" not in err, err
