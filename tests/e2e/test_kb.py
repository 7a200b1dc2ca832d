"""The knowledge base end to end: what bench, profile, verify, serve and tune record; the `kb`
commands over it; a damaged file (the command keeps its result, the file is left alone); and
the worked example of docs/knowledge-base.md (recipe init -> tune -> kb recommend for a second
model of the same family). Real SQLite files, real compiles, real servers; no timing is asserted."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import yaml
from typer.testing import CliRunner

from graphmode.cli.app import _register, app
from graphmode.kb import KnowledgeBase
from graphmode.recipe import load_recipe, recipe_hash

from test_serve import EVENT_S, eventually

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "tests" / "unit" / "kb" / "kb_models.py"
MLP = f"{MODELS}:mlp"
runner = CliRunner()
_register()


def spec(name: str) -> str:
    return f"{MODELS}:{name}"


def invoke(*args: str):
    res = runner.invoke(app, list(args))
    assert "Traceback" not in (res.output or ""), res.output
    return res


def mlp_recipe(tmp_path: Path, name: str = "mlp", **over) -> Path:
    r = {"version": 1, "name": name, "inputs": [{"name": "x", "dtype": "f32", "shape": ["batch", 16]}],
         "dims": {"batch": {"buckets": [2, 8]}}, "codegen": {"kernel_selection": "heuristic"}, "targets": ["host"]}
    r.update(over)
    p = tmp_path / f"{name}.yaml"
    p.write_text(yaml.safe_dump(r))
    return p


def rows(kb: Path, where: str = "1 = 1") -> list[dict]:
    with KnowledgeBase(kb) as db:
        return db.rows("SELECT p.*, r.hash AS recipe_hash, r.origin, m.family, h.name AS hw FROM performance p "
                       "JOIN recipes r ON r.id = p.recipe JOIN models m ON m.id = p.model "
                       f"JOIN hardware h ON h.id = p.hardware WHERE {where} ORDER BY p.id")


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.getbasetemp() / "graphmode-kb-cache"       # shared with tests/unit/kb


def test_bench_records_the_graphmode_rows(tmp_path, cache):
    from graphmode.bench.harness import BenchConfig, run_bench
    from graphmode.bench.models import load_cases
    from graphmode.targets import get_target
    kb = tmp_path / "kb.sqlite"
    cfg = BenchConfig(engines=[("eager", None), ("graphmode", None)], threads=1, iters=5, min_iters=5, warmup=1,
                      rewarm=0, quick=True, cache_dir=cache, kb=kb)
    res = run_bench(load_cases([MLP], ["4x16"]), cfg, target=get_target("host", cache_dir=cache / "targets"))
    g = next(r for r in res.rows if r["engine"] == "graphmode")
    (row,) = rows(kb)
    assert row["source"] == "bench" and row["hw"] == "host" and row["family"] == "mlp"
    assert row["status"] == ("ok" if g["numerics_ok"] else "violates")
    assert row["p50_ms"] > 0 and row["p99_ms"] >= row["p50_ms"] and row["p99_over_p50"] >= 1.0
    assert row["throughput"] == pytest.approx(4 / (row["p50_ms"] / 1e3)) and row["peak_memory_mb"] > 0
    assert row["numerics_err"] == g["rel_l2_err"] and row["bucket"] == {"batch": 4}
    assert "eager" in row["extra"]["engines_median_ms"]


def test_profile_and_verify_record_and_the_kb_commands_read_them(tmp_path, cache):
    kb = tmp_path / "kb.sqlite"
    rec = mlp_recipe(tmp_path)
    res = invoke("profile", "--model", MLP, "--recipe", str(rec), "--shape", "8x16", "--runs", "3", "--threads", "1",
                 "--no-eager", "--kb", str(kb), "--cache-dir", str(cache), "--json")
    assert res.exit_code == 0, res.output
    res = invoke("verify", "--model", MLP, "--recipe", str(rec), "--kb", str(kb), "--cache-dir", str(cache), "--json")
    assert res.exit_code == 0, res.output
    prof, ver = rows(kb)
    assert prof["source"] == "profile" and prof["bucket"] == {"batch": 8} and prof["p50_ms"] > 0
    assert prof["threads"] == 1
    assert ver["source"] == "verify" and ver["status"] == "ok" and ver["numerics_err"] <= 1e-5
    assert prof["recipe_hash"] == ver["recipe_hash"]
    res = invoke("kb", "ls", "--kb", str(kb), "--json")
    (listed,) = json.loads(res.stdout)
    assert listed["hash"] == ver["recipe_hash"] and listed["measured"] == 2 and listed["machines"] == 1
    res = invoke("kb", "show", ver["recipe_hash"][:6], "--kb", str(kb))
    assert res.exit_code == 0 and "2 measurement(s) on 1 machine(s)" in res.output and "verify" in res.output
    res = invoke("kb", "query", "--kb", str(kb), "--source", "profile", "--where", "p50_ms>0", "--json")
    assert [r["source"] for r in json.loads(res.stdout)] == ["profile"]
    res = invoke("kb", "query", "--kb", str(kb), "--where", "p50 < 3")
    assert res.exit_code == 2 and "--where" in res.output and "p99_ms<20" in res.output
    res = invoke("kb", "show", "ffff", "--kb", str(kb))
    assert res.exit_code == 2 and "no recipe(s) whose hash starts with 'ffff'" in res.output
    out = tmp_path / "kb.jsonl"
    assert invoke("kb", "export", "--kb", str(kb), "--out", str(out)).exit_code == 0
    team = tmp_path / "team.sqlite"
    res = invoke("kb", "import", str(out), str(out), "--kb", str(team), "--json")
    d = json.loads(res.stdout)
    assert d["now"] == {"hardware": 1, "models": 1, "recipes": 1, "performance": 2}
    assert [(c["performance"], c["skipped"]) for c in d["imported"]] == [(2, 0), (0, 5)]   # the second: deduplicated


def test_a_damaged_kb_costs_no_result_and_is_left_alone(tmp_path, cache):
    kb = tmp_path / "kb.sqlite"
    kb.write_bytes(b"\x00garbage, not SQLite\n" * 100)
    before = kb.read_bytes()
    res = invoke("verify", "--model", MLP, "--recipe", str(mlp_recipe(tmp_path)), "--kb", str(kb),
                 "--cache-dir", str(cache), "--json")
    assert res.exit_code == 0, res.output                       # the verdict stands
    assert json.loads(res.stdout)["ok"] is True
    assert "not recorded" in res.output and str(kb) in " ".join(res.output.split())
    res = invoke("kb", "ls", "--kb", str(kb))
    text = " ".join(res.output.split())                         # rich wraps stderr at 80 columns here
    assert res.exit_code == 2 and "KbError" in text and "damaged" in text and f"mv {kb} {kb}.corrupt" in text
    assert kb.read_bytes() == before


@pytest.mark.slow     # ~7 s: a server with a reload
def test_serve_records_a_summary_per_recipe_version(tmp_path, cache):
    from graphmode.capture.spec import resolve_model_spec
    from graphmode.serve import ModelServer, ServeConfig, ServerThread
    kb = tmp_path / "kb.sqlite"
    first = yaml.safe_load(mlp_recipe(tmp_path).read_text())
    first["sla"] = {"p99_ms": 60000, "max_p99_over_p50": 1.0}         # any jitter at all breaks this bound
    second = dict(first, name="mlp-b", dims={"batch": {"buckets": [1, 2, 8]}})
    server = ModelServer(resolve_model_spec(MLP), first,
                         config=ServeConfig(cache_dir=cache, kb=kb, kb_period_s=0.2, batch_window_ms=0))
    running = ServerThread(server).start()
    try:
        running.wait_ready(EVENT_S)
        v1 = server.active.version
        with httpx.Client(base_url=running.url, timeout=EVENT_S) as client:
            for i in range(12):
                r = client.post("/v1/infer", json={"inputs": {"x": [[0.1 * i] * 16] * 2}})
                assert r.status_code == 200, r.text
            eventually(lambda: kb.exists() and rows(kb, f"r.hash = '{v1}'"), EVENT_S,
                       "a serve summary of the first version")
            r = client.put("/v1/recipe?wait=1", content=json.dumps(second),
                           headers={"content-type": "application/json"})
            assert r.status_code == 200 and r.json()["status"] == "swapped", r.text
            for i in range(3):
                assert client.post("/v1/infer", json={"inputs": {"x": [[1.0] * 16]}}).status_code == 200
    finally:
        running.stop()
    v2 = recipe_hash(load_recipe(second))
    got = rows(kb, "p.source = 'serve'")
    assert {r["recipe_hash"] for r in got} == {v1, v2}
    assert sum(r["extra"]["requests"] for r in got if r["recipe_hash"] == v1) == 12     # every answer, once
    assert sum(r["extra"]["requests"] for r in got if r["recipe_hash"] == v2) == 3      # flushed at stop
    for r in got:
        assert r["throughput"] > 0 and r["p50_ms"] > 0 and r["extra"]["health_score"] == 1.0
        broke = r["p99_over_p50"] > 1.0
        assert (r["status"] == "violates") == broke and (not broke or "max_p99_over_p50" in r["reason"])
    assert any(r["p99_over_p50"] > 1.0 for r in got if r["extra"]["requests"] > 2)


def _pool_recipe(tmp_path: Path) -> Path:
    """A recipe the verdict refuses for `mean_pool` (it pads seq; the model means over seq)."""
    r = {"version": 1, "name": "pool", "inputs": [{"name": "input_ids", "dtype": "i64", "shape": ["batch", "seq"]}],
         "dims": {"batch": {"buckets": [1, 2]}, "seq": {"min": 2, "max": 12, "max_padding": 0.5}},
         "codegen": {"kernel_selection": "heuristic"}, "targets": ["host"]}
    p = tmp_path / "pool.yaml"
    p.write_text(yaml.safe_dump(r, sort_keys=False))
    return p


def test_tune_writes_the_version_that_keeps_the_contract_and_shows_the_diff(tmp_path, cache):
    kb, rec = tmp_path / "kb.sqlite", _pool_recipe(tmp_path)
    args = ["tune", "--model", spec("mean_pool"), "--recipe", str(rec), "--budget-s", "600", "--only", "dims",
            "--threads", "1", "--measure-s", "0.2", "--kb", str(kb), "--cache-dir", str(cache)]
    res = invoke(*args)
    assert res.exit_code == 0, res.output
    out, text = tmp_path / "pool.v2.yaml", " ".join(res.output.split())
    assert out.is_file() and f"wrote {out}" in text and "no change improves the best" in text
    assert "Pareto set" in text and "dims.seq.max_padding changed 0.5 null" in text       # the recipe diff
    assert "trial 0: recipe as written: violates" in text and "padding seq" in text
    assert yaml.safe_load(out.read_text())["dims"]["seq"] == {"min": 2, "max": 12}
    assert invoke("recipe", "validate", str(out), "--model", spec("mean_pool")).exit_code == 0
    tuned = rows(kb, "p.source = 'tune'")
    assert tuned[0]["status"] == "violates" and "padding seq" in tuned[0]["reason"]
    assert any(r["status"] == "ok" for r in tuned)
    written = recipe_hash(load_recipe(rec))                  # the recipe as written is measured, not tune's
    assert all(r["origin"] == ("measured" if r["recipe_hash"] == written else "tune") for r in tuned)
    again = {r["extra"]["confirmation"]: r for r in tuned if r["extra"].get("confirmation")}   # measured again
    assert set(again) == {"best", "baseline"} and again["best"]["extra"]["held"] is True      # (kb recommend's)
    assert again["best"]["status"] == "ok" and again["baseline"]["status"] == "violates"
    assert (tmp_path / "pool.tune.jsonl").is_file()
    res = invoke(*[("bogus" if a == "dims" else a) for a in args])
    assert res.exit_code == 2 and "unknown knob" in res.output


@pytest.mark.slow
def test_tune_resumes_after_an_interrupt(tmp_path, cache):
    kb, rec = tmp_path / "kb.sqlite", _pool_recipe(tmp_path)
    cmd = [sys.executable, "-m", "graphmode", "tune", "--model", spec("mean_pool"), "--recipe", str(rec),
           "--budget-s", "600", "--only", "dims", "--only", "fusion.max_ops", "--threads", "1", "--measure-s", "0.2",
           "--kb", str(kb), "--cache-dir", str(cache)]
    journal = tmp_path / "pool.tune.jsonl"
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    eventually(lambda: proc.poll() is not None or (journal.exists() and journal.read_text().count('"trial": {') >= 3),
               EVENT_S, "three journaled trials")
    assert proc.poll() is None, proc.stdout.read()
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=EVENT_S)
    assert proc.returncode == 130 and "run the same command again to resume" in out
    done = journal.read_text().count('"trial": {')
    res = subprocess.run(cmd + ["--json"], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert res.returncode == 0, res.stdout + res.stderr
    d = json.loads(res.stdout)
    assert d["resumed"] == done and d["trials"][0]["status"] == "violates" and d["written"]
    res = subprocess.run(cmd + ["--json"], capture_output=True, text=True, timeout=600,    # once more: all replayed
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    again = json.loads(res.stdout)
    assert again["resumed"] == len(again["trials"]) == len(d["trials"]) and again["written"] == d["written"]
    assert not (tmp_path / "pool.v3.yaml").exists()


@pytest.mark.slow
def test_worked_example_init_tune_recommend(tmp_path, cache):
    """The example of docs/knowledge-base.md: draft a recipe for one encoder, tune it, then ask the knowledge
    base for a second, wider encoder of the same family."""
    kb = tmp_path / "kb.sqlite"
    common = ["--kb", str(kb), "--cache-dir", str(cache)]
    small = tmp_path / "small.yaml"
    res = invoke("recipe", "init", "--model", spec("encoder_small"), "--max-padding", "0.5", "--out", str(small),
                 *common)
    assert res.exit_code == 0, res.output
    assert "# " in small.read_text() and invoke("recipe", "validate", str(small)).exit_code == 0
    small.write_text(small.read_text().replace("latency_first", "heuristic"))   # kernel timing is tested elsewhere
    res = invoke("tune", "--model", spec("encoder_small"), "--recipe", str(small), "--budget-s", "40",
                 "--threads", "1", "--measure-s", "0.2", *common)
    assert res.exit_code == 0, res.output
    res = invoke("kb", "recommend", "--model", spec("encoder_large"), "--out", str(tmp_path / "large.yaml"),
                 "--json", *common)
    assert res.exit_code == 0, res.output
    d = json.loads(res.stdout)
    top = d["recommendations"][0]
    assert d["model"]["family"] == "tinyenc" and top["model"]["name"] == "encoder_small"
    assert top["model_distance"] < 1.0 and top["hardware_similarity"] == 1.0
    large = yaml.safe_load((tmp_path / "large.yaml").read_text())
    assert large["optimize"]["fusion"] == top["body"].get("optimize", {}).get("fusion", large["optimize"]["fusion"])
    assert invoke("recipe", "validate", str(tmp_path / "large.yaml")).exit_code == 0
