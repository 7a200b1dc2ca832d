"""End to end on Ray Serve (the serve-cluster extra): `graphmode serve --replicas 2` on a local
Ray cluster, loopback only. The driver compiles once; an encoder's replicas load one `.gm`
artifact, a decoder's the shared plan cache, and none compiles a kernel; both answer like
eager (transformers' greedy tokens, whole and streamed, for the decoder, through the CLI);
every replica records to the one KB file; a replica killed under load is restarted by Ray from
the artifact while the other keeps answering (a request it held is retried once on the other
by graphmode's front, never answered a bare 500); a replica that cannot load the artifact fails
the start with the artifact's error; autoscaling on the recipe's SLA adds a replica under load and removes it after. A local Ray cluster takes about a minute to start on 2
cores, so these tests are `slow` and `cluster`: `make test-cluster` installs the extra and runs
them (one local cluster at a time: the tests without the module's cluster come first).

Every wait is for an event (replica states, an answer from a given replica, a KB row, a line
of output) with a generous ceiling, never a fixed sleep."""
from __future__ import annotations

import json
import os
import queue
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path

import httpx
import pytest
import torch
import yaml

pytest.importorskip("ray.serve", reason="needs the serve-cluster extra: pip install 'graphmode[serve-cluster]'")

import graphmode  # noqa: E402
from graphmode.capture.spec import bundle_from_module  # noqa: E402
from graphmode.serve import ServeConfig  # noqa: E402
from graphmode.errors import GraphmodeError  # noqa: E402
from graphmode.serve.cluster import ClusterConfig, ClusterServer, Served, prepare, replica_config  # noqa: E402
from graphmode.verify.numerics import rel_l2  # noqa: E402

from tiny_models import mlp, recipe  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.cluster]
RECIPE = recipe("mlp-cluster", [{"name": "input", "dtype": "f32", "shape": ["batch", 16]}],
                {"batch": {"buckets": [1, 2, 4]}}, sla={"p99_ms": 5000}, memory={"budget_mb": 64})
EVENT_S = 300
HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


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


def _infer(client: httpx.Client, url: str, x: torch.Tensor) -> httpx.Response:
    return client.post(url + "/v1/infer", json={"inputs": {"input": x.tolist()}}, timeout=60)


def _kernels(cache: Path) -> set[str]:
    return {str(p.relative_to(cache)) for p in cache.rglob("*.so")}


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cluster")
    m, ex = mlp()
    path = tmp / "mlp.gm"
    graphmode.compile(bundle_from_module(m, ex), RECIPE, cache_dir=tmp / "build").save(path)
    return path, m, tmp


def test_a_replica_that_cannot_load_the_artifact_fails_the_start_with_its_error(artifact, monkeypatch):
    """What a replica on a node with another CPU sees: the artifact's refusal, reported by Ray
    as the deployment's failure and raised by the driver (here the driver's own host check,
    made as it reads the artifact's recipe, is skipped, as it would pass on the driver's host;
    the replicas are other processes and check)."""
    from graphmode.runtime import artifact as artifact_module
    monkeypatch.setattr(artifact_module, "check_manifest", lambda *args, **kwargs: None)
    path, _, tmp = artifact
    with zipfile.ZipFile(path) as z:
        manifest = json.loads(z.read("manifest.json"))
    other = tmp / "other-cpu.gm"
    with zipfile.ZipFile(path) as zin, zipfile.ZipFile(other, "w") as zout:
        for info in zin.infolist():
            data = zin.read(info.filename)
            if info.filename == "manifest.json":
                edited = dict(manifest, host={**manifest["host"], "arch": "riscv64"})
                data = json.dumps(dict(edited, digest=artifact_module.manifest_digest(edited))).encode()
            zout.writestr(info, data)
    config = ServeConfig(cache_dir=tmp / "other-cache")
    server = ClusterServer(Served(str(other), None, False, 0.0), config,
                           ClusterConfig(replicas=1, port=_free_port(), health_check_period_s=1))
    with pytest.raises(GraphmodeError, match="the replicas did not start") as e:
        server.start()
    assert "built for riscv64" in e.value.message and "compile again on this host" in e.value.fix
    assert not server.started_ray                         # start() stopped what it started


def _lines(proc: subprocess.Popen) -> "queue.Queue[str | None]":
    q: queue.Queue[str | None] = queue.Queue()

    def pump():
        for line in proc.stdout:
            q.put(line)
        q.put(None)
    threading.Thread(target=pump, daemon=True).start()
    return q


def _wait_line(q: "queue.Queue[str | None]", needle: str, seen: list[str], timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    while True:
        line = q.get(timeout=max(0.1, deadline - time.monotonic()))
        if line is None:
            raise AssertionError("the server ended:\n" + "".join(seen[-40:]))
        seen.append(line)
        if needle in line:
            return


@pytest.mark.parametrize("when", ["starting 2 replica", "replica(s) on http"])    # while starting; once ready
def test_sigterm_to_the_process_group_stops_the_server_cleanly(artifact, tmp_path, when):
    """A signal to the whole process group (Ctrl-C in a terminal, `kill -- -PGID`, a container's
    stop) reaches the local Ray cluster's processes too. While the replicas started, Ray's own
    SIGTERM handler aborted the process (exit 134, a C++ stack); once ready, the stop waited a
    minute on the dead cluster and exited 1. Both now stop at once with exit 0."""
    path, _, _ = artifact
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "graphmode", "serve", "--model", str(path), "--replicas", "2",
                             "--port", str(port), "--cache-dir", str(tmp_path / "cache")], env=env, cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    seen: list[str] = []
    try:
        q = _lines(proc)
        _wait_line(q, when, seen)
        os.killpg(proc.pid, signal.SIGTERM)
        rc = proc.wait(120)
        while (line := q.get(timeout=30)) is not None:
            seen.append(line)
        assert rc == 0 and "graphmode serve: stopped" in "".join(seen), "".join(seen[-40:])
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)


def test_cli_serves_a_decoder_on_two_replicas_from_the_shared_cache(tmp_path):
    """`graphmode serve --replicas 2` on the tiny GPT-2: compiled and warmed once by the driver
    into the shared cache; both replicas answer transformers' greedy tokens, whole and streamed
    (SSE), having compiled no kernel; SIGTERM stops the replicas and the local Ray cluster."""
    import tiny_decoders
    from graphmode.capture.spec import resolve_model_spec
    spec = f"{HERE / 'tiny_decoders.py'}:gpt2_words"
    rec = tmp_path / "rec.yaml"
    rec.write_text(yaml.safe_dump(tiny_decoders.recipe()))
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "graphmode", "serve", "--model", spec, "--recipe", str(rec),
                             "--replicas", "2", "--port", str(port), "--cache-dir", str(tmp_path / "cache"),
                             "--log-level", "warning"], env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    seen: list[str] = []
    try:
        q = _lines(proc)
        _wait_line(q, "ready", seen)
        url = f"http://127.0.0.1:{port}"
        lm = resolve_model_spec(spec).raw_module
        prompt = [5, 6, 7]
        with torch.inference_mode():
            ids = torch.tensor([prompt])
            out = lm.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                              pad_token_id=0)
        want = out[0, len(prompt):].tolist()
        want = want[:want.index(tiny_decoders.EOS) + 1] if tiny_decoders.EOS in want else want
        replicas: dict[str, dict] = {}
        with httpx.Client(timeout=120) as client:
            def both_answered():
                r = client.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 6, "temperature": 0})
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["token_ids"] == want
                replicas.setdefault(r.headers["x-graphmode-replica"], {})
                return len(replicas) == 2
            _until("both replicas answered", both_answered, every=0)
            with client.stream("POST", url + "/v1/completions",
                               json={"prompt": prompt, "max_tokens": 6, "temperature": 0, "stream": True}) as r:
                assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
                assert r.headers["x-graphmode-replica"] in replicas
                events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            streamed = [t for e in events[:-1] for c in json.loads(e)["choices"] for t in c.get("token_ids") or []]
            assert streamed == want
            for _ in range(40):
                d = client.get(url + "/v1/replica").json()
                replicas[d["replica"]] = d
        described = [d for d in replicas.values() if d]
        assert described and all(d["kernel_compiles"] == 0 and d["artifact"] is None for d in described), \
        [(d["replica"], d["kernel_compiles"]) for d in described]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0, "".join(seen[-40:])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    with socket.socket() as s:                  # Ray's proxy is gone with the local cluster
        assert s.connect_ex(("127.0.0.1", port)) != 0


def test_autoscaling_on_the_sla_adds_a_replica_under_load_and_removes_it_after(artifact):
    """--min-replicas 1 --max-replicas 2 with a recipe whose sla.p99_ms (2 ms) its proof meets
    but a 20 ms batch window does not: under load from 4 clients the p99 each replica pushes is
    over the SLA for 2 windows, graphmode's policy asks Ray Serve for a second replica (the
    queue bound is out of reach: the p99 decides), which answers; GET /v1/recipe shows why.
    Once the load stops, 3 calm windows bring it back to one replica."""
    _, _, tmp = artifact
    tight = recipe("mlp-sla", [{"name": "input", "dtype": "f32", "shape": ["batch", 16]}],
                   {"batch": {"buckets": [1, 2, 4]}}, sla={"p99_ms": 2})
    config = ServeConfig(cache_dir=tmp / "sla-cache", batch_window_ms=20)
    cluster = ClusterConfig(replicas=1, min_replicas=1, max_replicas=2, scale_queue_depth=1000, scale_window_s=1,
                            scale_up_windows=2, scale_down_windows=3, port=_free_port(), health_check_period_s=1)
    served = prepare(f"{HERE / 'tiny_models.py'}:mlp", tight, replica_config(config, cluster))
    seen: set[str] = set()
    failed: list[str] = []
    stop = threading.Event()

    def load():
        with httpx.Client() as client:
            while not stop.is_set():
                r = _infer(client, server.url, torch.randn(1, 16))
                if r.status_code != 200:
                    failed.append(r.text)
                seen.add(r.headers.get("x-graphmode-replica"))

    def autoscaler(client):
        return client.get(server.url + "/v1/recipe", timeout=60).json()["autoscaler"]
    with ClusterServer(served, config, cluster) as server, httpx.Client() as client:
        assert server.replica_states() == {"RUNNING": 1}
        assert autoscaler(client)["rule"]["sla_p99_ms"] == 2.0
        threads = [threading.Thread(target=load, daemon=True) for _ in range(4)]
        for t in threads:
            t.start()
        try:
            _until("a second replica answering under load",
                   lambda: len(seen - {None}) == 2 and server.replica_states() == {"RUNNING": 2}, every=0.5)
        finally:
            stop.set()
            for t in threads:
                t.join(60)
        state = autoscaler(client)
        assert state["state"] == "on" and state["desired"] == 2, state
        assert state["changed"].startswith("up to 2: p99 ") and "> sla.p99_ms 2 ms + 20%" in state["changed"], state
        _until("one replica again once the load stopped", lambda: server.replica_states() == {"RUNNING": 1}, every=0.5)
        state = autoscaler(client)
        assert state["desired"] == 1 and state["changed"].startswith("down to 1: "), state
    assert not failed, failed[:3]


@pytest.fixture(scope="module")
def cluster(artifact):
    path, m, tmp = artifact
    config = ServeConfig(cache_dir=tmp / "serve-cache", batch_window_ms=1, kb=tmp / "kb.sqlite", kb_period_s=0.5)
    cluster = ClusterConfig(replicas=2, port=_free_port(), health_check_period_s=1)
    # the driver compiles the model once into one artifact, and again for each reloaded recipe
    served = prepare(f"{HERE / 'tiny_models.py'}:mlp", RECIPE, replica_config(config, cluster))
    assert served.compiled_by_driver and served.recipe is None and served.model.endswith(".gm")
    server = ClusterServer(served, config, cluster)
    t0 = time.monotonic()
    with server:
        server.start_s = time.monotonic() - t0
        yield server, m, tmp


def test_two_replicas_answer_like_eager_from_one_artifact(cluster):
    server, m, tmp = cluster
    print(f"local Ray cluster + 2 warm replicas in {server.start_s:.1f} s")
    assert server.replica_states() == {"RUNNING": 2} and len(server.replica_actors()) == 2
    seen: dict[str, dict] = {}
    with httpx.Client(timeout=60) as client:          # a busy host: the proxy may take seconds
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
        assert described and all(d["artifact"]["path"] == server.served.model and d["kernel_compiles"] == 0
                                 and d["state"] == "ready" for d in described), described
        assert len({d["pid"] for d in described}) == len(described)
    # every replica records its summaries to the one KB file
    kb = tmp / "kb.sqlite"
    _until("KB rows", lambda: _serve_rows(kb) >= 1)


def _serve_rows(kb: Path) -> int:
    """The KB's rows from serving; 0 until a replica has created the file and its tables."""
    if not kb.exists():
        return 0
    db = sqlite3.connect(kb)
    try:
        return db.execute("SELECT count(*) FROM performance WHERE source = 'serve'").fetchone()[0]
    except sqlite3.OperationalError:            # the schema not written yet (another process creates it)
        return 0
    finally:
        db.close()


def test_a_replica_killed_under_load_is_restarted_from_the_artifact(cluster):
    import ray
    server, _, tmp = cluster
    kernels = _kernels(tmp)
    before = server.replica_actors()
    assert len(before) == 2
    victim = before[0]
    victim_id = victim.rsplit("#", 1)[1]
    results: list[tuple[int, str | None]] = []
    refused: list[httpx.Response] = []          # what a client got instead of an answer
    stop = threading.Event()

    def load():
        with httpx.Client() as client:
            while not stop.is_set():
                try:
                    r = _infer(client, server.url, torch.randn(1, 16))
                    results.append((r.status_code, r.headers.get("x-graphmode-replica")))
                    if r.status_code != 200:
                        refused.append(r)
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
    # the front retries each once on the other replica; one that died twice is a retryable 503, never a bare 500
    assert all(s == 503 for s, _ in failed), failed
    assert all(r.headers["retry-after"] and r.json()["error"] == "NotReady" and r.json()["fix"] for r in refused)
    assert new_id in answered and victim_id not in {rid for _, rid in results[killed_at + len(threads):]}
    with httpx.Client() as client:
        d = _until("the new replica describing itself", lambda: (lambda d: d if d["replica"] == new_id else None)(
            client.get(server.url + "/v1/replica").json()), every=0)
    assert d["artifact"]["path"] == server.served.model and d["kernel_compiles"] == 0 and d["state"] == "ready"
    assert _kernels(tmp) == kernels                        # restarted from the artifact: nothing built


def _metric_replicas(text: str, family: str) -> set[str]:
    from prometheus_client.parser import text_string_to_metric_families
    return {s.labels["replica"] for f in text_string_to_metric_families(text) if f.name == family
            for s in f.samples if s.labels.get("status") == "ok" and s.value > 0}


def test_metrics_show_every_replicas_series(cluster):
    """After requests answered by both replicas, /metrics (whichever replica answers it) holds
    both replicas' request counters, each labelled with its replica beside the recipe version."""
    server, _, _ = cluster
    answered: set[str] = set()
    with httpx.Client() as client:
        def both_answered():
            r = _infer(client, server.url, torch.randn(1, 16))
            assert r.status_code == 200, r.text
            answered.add(r.headers["x-graphmode-replica"])
            return len(answered) == 2
        _until("both replicas answered", both_answered, every=0)
        # the other replica's series arrive with its next push (every second)
        text = _until("both replicas' series in /metrics", lambda: (lambda t: t if _metric_replicas(
            t, "graphmode_requests") >= answered else None)(client.get(server.url + "/metrics").text))
    from prometheus_client.parser import text_string_to_metric_families

    from graphmode.recipe import load_recipe
    versions = {s.labels["version"] for f in text_string_to_metric_families(text) if f.name == "graphmode_requests"
                for s in f.samples}
    assert versions == {load_recipe(RECIPE).hash()}


NEW_RECIPE = {**RECIPE, "name": "mlp-cluster-2", "dims": {"batch": {"buckets": [1, 2, 4, 8]}}}


def test_a_reload_rolls_replica_by_replica_under_load_with_no_request_lost(cluster):
    """PUT /v1/recipe under load from a few clients: a recipe that fails its checks is refused
    with its error and changes nothing; a good one is compiled once by the coordinator, the
    replicas are replaced one at a time (a replacement warm before an old one stops), no
    request fails, and every replica then serves the new version."""
    from graphmode.recipe import load_recipe
    server, _, tmp = cluster
    old, new = load_recipe(RECIPE).hash(), load_recipe(NEW_RECIPE).hash()
    results: list[tuple[int, str | None, str | None]] = []
    stop = threading.Event()

    def load():
        with httpx.Client() as client:
            while not stop.is_set():
                try:
                    r = _infer(client, server.url, torch.randn(1, 16))
                    version = r.json().get("recipe_version") if r.status_code == 200 else r.text[:200]
                    results.append((r.status_code, r.headers.get("x-graphmode-replica"), version))
                except httpx.HTTPError as e:
                    results.append((-1, None, type(e).__name__))
    threads = [threading.Thread(target=load, daemon=True) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        with httpx.Client(timeout=600) as client:
            bad = client.put(server.url + "/v1/recipe", json={**NEW_RECIPE, "memory": {"budget_mb": 0.001}})
            assert bad.status_code == 422, bad.text
            assert bad.json()["error"] == "ConstraintError" and "memory" in bad.text, bad.json()
            assert client.get(server.url + "/v1/recipe").json()["version"] == old
            r = client.put(server.url + "/v1/recipe", json=NEW_RECIPE)
            assert r.status_code == 202 and r.json()["version"] == new and r.json()["previous"] == old, r.text
            busy = client.put(server.url + "/v1/recipe", json=RECIPE)
            assert busy.status_code == 409, busy.text                 # one rollout at a time
            _until("the rollout done", lambda: client.get(server.url + "/v1/recipe").json()["rollout"]["state"]
                   not in ("checking", "rolling"), every=0.5)
            assert client.get(server.url + "/v1/recipe").json()["rollout"]["state"] == "done"
            # Ray's proxies hear of the replaced replicas within moments: then only the new recipe answers
            _until("20 answers in a row from the new recipe",
                   lambda: len(results) >= 20 and all(v == new for _, _, v in results[-20:]))
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    failed = [r for r in results if r[0] != 200]
    print(f"{len(results)} requests across the reload, {len(failed)} failed: {failed[:5]}")
    assert not failed, failed[:5]
    assert {v for _, _, v in results[:5]} == {old}
    assert server.replica_states() == {"RUNNING": 2}
    seen: dict[str, dict] = {}
    with httpx.Client() as client:
        for _ in range(40):
            d = client.get(server.url + "/v1/replica").json()
            seen[d["replica"]] = d
    assert len(seen) == 2 and all(d["version"] == new and d["kernel_compiles"] == 0 for d in seen.values()), seen

