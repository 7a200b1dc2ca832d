"""End to end on Ray Serve (the serve-cluster extra): `graphmode serve --replicas 2` on a local
Ray cluster, loopback only. The driver compiles once into one `.gm` artifact; both replicas
load it (no kernel compile) and answer like eager; every replica records to the one KB file;
a replica killed under load is restarted by Ray from the artifact while the other keeps
answering. A local Ray cluster takes about a minute to start on 2 cores, so these tests are
`slow` and `cluster`: `make test-cluster` installs the extra and runs them.

Every wait is for an event (replica states, an answer from a given replica, a KB row) with a
generous ceiling, never a fixed sleep."""
from __future__ import annotations

import socket
import sqlite3
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

pytest.importorskip("ray.serve", reason="needs the serve-cluster extra: pip install 'graphmode[serve-cluster]'")

import graphmode  # noqa: E402
from graphmode.capture.spec import bundle_from_module  # noqa: E402
from graphmode.serve import ServeConfig  # noqa: E402
from graphmode.serve.cluster import ClusterConfig, ClusterServer, prepare  # noqa: E402
from graphmode.verify.numerics import rel_l2  # noqa: E402

from tiny_models import mlp, recipe  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.cluster]
RECIPE = recipe("mlp-cluster", [{"name": "input", "dtype": "f32", "shape": ["batch", 16]}],
                {"batch": {"buckets": [1, 2, 4]}}, sla={"p99_ms": 5000}, memory={"budget_mb": 64})
EVENT_S = 300


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _until(what: str, ok, timeout: float = EVENT_S, every: float = 0.1):
    deadline = time.monotonic() + timeout
    while True:
        got = ok()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:g} s: {what}")
        time.sleep(every)


def _kernels(cache: Path) -> set[str]:
    return {str(p.relative_to(cache)) for p in cache.rglob("*.so")}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cluster")
    m, ex = mlp()
    path = tmp / "mlp.gm"
    graphmode.compile(bundle_from_module(m, ex), RECIPE, cache_dir=tmp / "build").save(path)
    config = ServeConfig(cache_dir=tmp / "serve-cache", batch_window_ms=1, kb=tmp / "kb.sqlite", kb_period_s=0.5)
    served = prepare(str(path), None, config)           # the driver: checks and unpacks it once
    assert not served.compiled_by_driver and served.recipe is None
    server = ClusterServer(served, config, ClusterConfig(replicas=2, port=_free_port(), health_check_period_s=1))
    t0 = time.monotonic()
    with server:
        server.start_s = time.monotonic() - t0
        yield server, m, tmp


def _infer(client: httpx.Client, url: str, x: torch.Tensor) -> httpx.Response:
    return client.post(url + "/v1/infer", json={"inputs": {"input": x.tolist()}}, timeout=60)


def test_two_replicas_answer_like_eager_from_one_artifact(cluster):
    server, m, tmp = cluster
    print(f"local Ray cluster + 2 warm replicas in {server.start_s:.1f} s")
    assert server.replica_states() == {"RUNNING": 2} and len(server.replica_actors()) == 2
    seen: dict[str, dict] = {}
    with httpx.Client() as client:
        assert client.get(server.url + "/readyz").status_code == 200

        def both_answered():
            x = torch.randn(3, 16)
            r = _infer(client, server.url, x)
            assert r.status_code == 200, r.text
            with torch.inference_mode():
                want = m(x)
            got = torch.tensor(r.json()["outputs"]["output_0"] if "output_0" in r.json()["outputs"]
                               else next(iter(r.json()["outputs"].values())))
            assert r.json()["bucket"] == {"batch": 4} and rel_l2(got, want) < 1e-5
            seen.setdefault(r.headers["x-graphmode-replica"], {})
            return len(seen) == 2
        _until("both replicas answered", both_answered, every=0)
        for _ in range(40):                                 # each replica says what it loaded
            d = client.get(server.url + "/v1/replica").json()
            seen[d["replica"]] = d
        described = [d for d in seen.values() if d]
        assert described and all(d["artifact"]["path"].endswith("mlp.gm") and d["kernel_compiles"] == 0
                                 and d["state"] == "ready" for d in described), described
        assert len({d["pid"] for d in described}) == len(described)
        r = client.put(server.url + "/v1/recipe", json=RECIPE)
        assert r.status_code == 501 and "not supported across replicas" in r.json()["message"]
    # every replica records its summaries to the one KB file
    kb = tmp / "kb.sqlite"
    _until("KB rows", lambda: kb.exists() and sqlite3.connect(kb).execute(
        "SELECT count(*) FROM performance WHERE source = 'serve'").fetchone()[0] >= 1)


def test_a_replica_killed_under_load_is_restarted_from_the_artifact(cluster):
    import ray
    server, _, tmp = cluster
    kernels = _kernels(tmp)
    before = server.replica_actors()
    assert len(before) == 2
    victim = before[0]
    victim_id = victim.rsplit("#", 1)[1]
    results: list[tuple[int, str | None]] = []
    stop = threading.Event()

    def load():
        with httpx.Client() as client:
            while not stop.is_set():
                try:
                    r = _infer(client, server.url, torch.randn(1, 16))
                    results.append((r.status_code, r.headers.get("x-graphmode-replica")))
                except httpx.HTTPError as e:
                    results.append((-1, type(e).__name__))
    threads = [threading.Thread(target=load, daemon=True) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        _until("load on the victim", lambda: sum(1 for s, rid in results if rid == victim_id) >= 5)
        ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
        killed_at = len(results)
        new = _until("a new replica running", lambda: (set(server.replica_actors()) - set(before))
                     if server.replica_states() == {"RUNNING": 2} else None)
        new_id = next(iter(new)).rsplit("#", 1)[1]
        _until("the new replica answering", lambda: any(rid == new_id for _, rid in results[killed_at:]))
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    failed = [(s, rid) for s, rid in results if s != 200]
    answered = {rid for s, rid in results[killed_at:] if s == 200}
    print(f"{len(results)} requests, {len(failed)} failed around the kill: {failed[:8]}")
    assert len(failed) <= len(threads), failed             # at most the requests in flight on the victim
    # Ray's proxy answers them (no replica header): a client retries such an answer
    assert all(s in (500, 502, 503) and rid is None or s == -1 for s, rid in failed), failed
    assert new_id in answered and victim_id not in {rid for _, rid in results[killed_at + len(threads):]}
    with httpx.Client() as client:
        d = _until("the new replica describing itself", lambda: (lambda d: d if d["replica"] == new_id else None)(
            client.get(server.url + "/v1/replica").json()), every=0)
    assert d["artifact"]["path"].endswith("mlp.gm") and d["kernel_compiles"] == 0 and d["state"] == "ready"
    assert _kernels(tmp) == kernels                        # restarted from the artifact: nothing built
