"""The cluster's coordinator without Ray: /metrics merges the replicas' series, each labelled
with its replica (nothing summed), and a reload that fails its checks (the sandbox's, or the
driver's one compile and proof) is answered with its error and deploys nothing."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from graphmode.monitor.prom import PromMetrics
from graphmode.recipe import load_recipe
from graphmode.serve import cluster
from graphmode.serve.cluster import ClusterConfig, Served
from graphmode.serve.cluster_control import Coordinator, merge_metrics
from graphmode.serve.server import ServeConfig

ROOT = Path(__file__).resolve().parents[3]
MODEL = f"{ROOT / 'tests/e2e/tiny_models.py'}:mlp"
RECIPE = {"version": 1, "name": "mlp", "inputs": [{"name": "input", "dtype": "f32", "shape": ["batch", 16]}],
          "dims": {"batch": {"buckets": [1, 2]}}, "codegen": {"kernel_selection": "heuristic"}}


def test_metrics_of_two_replicas_keep_both_series_labelled():
    a, b = PromMetrics(), PromMetrics()
    a.requests.labels("v1", "cpu", "batch=1", "ok").inc()
    b.requests.labels("v1", "cpu", "batch=1", "ok").inc(3)
    b.latency.labels("v1", "cpu", "batch=1").observe(0.02)
    text = merge_metrics({"r1": a.text(), "r2": b.text()}).decode()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    ok = {s.labels["replica"]: s.value for s in fams["graphmode_requests"].samples if s.name.endswith("_total")}
    assert ok == {"r1": 1.0, "r2": 3.0}
    assert all(s.labels["version"] == "v1" for s in fams["graphmode_requests"].samples)
    assert {s.labels["replica"] for s in fams["graphmode_request_latency_seconds"].samples} == {"r2"}
    assert text.count("# TYPE graphmode_requests_total counter") == 1


@pytest.fixture
def coordinator(tmp_path, monkeypatch):
    """A coordinator serving the eager recipe; `deploy` records instead of calling Ray."""
    deployed: list[Served] = []
    monkeypatch.setattr(cluster, "deploy", lambda served, recipe, config, c: deployed.append(served))
    served = Served(MODEL, load_recipe(dict(RECIPE, exe_mode="eager")), False, 0.0, MODEL)
    c = Coordinator(served, served.recipe, ServeConfig(cache_dir=tmp_path / "cache"), ClusterConfig(replicas=2))
    yield c, deployed
    c.sandbox.close()


def test_a_recipe_refused_by_its_checks_deploys_nothing(coordinator):
    c, deployed = coordinator
    status, body = c.reload(json.dumps(dict(RECIPE, dims={"batch": {"buckets": [0]}})).encode(), "json")
    assert status == 422 and body["status"] == 422 and body["errors"][0]["where"] == "dims.batch.buckets[0]", body
    status, body = c.reload(b"  ", "yaml")
    assert status == 422 and body["message"] == "empty recipe"
    assert deployed == [] and c.status()["state"] == "none"


def test_a_recipe_over_its_memory_budget_is_refused_by_the_drivers_proof(coordinator):
    c, deployed = coordinator
    status, body = c.reload(json.dumps(dict(RECIPE, memory={"budget_mb": 0.001})).encode(), "json")
    assert status == 422 and body["error"] == "ConstraintError" and "memory" in json.dumps(body), body
    assert deployed == [] and c.status()["state"] == "none"


def test_the_recipe_already_served_is_unchanged(coordinator):
    c, deployed = coordinator
    status, body = c.reload(json.dumps(dict(RECIPE, exe_mode="eager")).encode(), "json")
    assert (status, body["status"]) == (200, "unchanged") and deployed == []


def test_an_artifact_given_as_the_model_serves_only_its_recipe(coordinator):
    c, deployed = coordinator
    c.served = Served(MODEL, c.served.recipe, False, 0.0, None)
    status, body = c.reload(json.dumps(RECIPE).encode(), "json")
    assert status == 422 and "--model SPEC" in body["fix"] and deployed == []


def test_a_good_recipe_is_compiled_once_by_the_driver_then_rolled(coordinator):
    c, deployed = coordinator
    status, body = c.reload(json.dumps(RECIPE).encode(), "json")
    assert status == 202 and body["version"] == load_recipe(RECIPE).hash(), body
    assert c.wait(timeout_s=600)["state"] == "done"
    assert len(deployed) == 1 and deployed[0].model.endswith(".gm") and deployed[0].source == MODEL
    assert c.recipe.hash() == body["version"]
