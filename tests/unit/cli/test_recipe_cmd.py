"""`graphmode recipe validate|show|diff`: exit codes 0 valid / 1 refused / 2 malformed, JSON output."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

import graphmode.cli.recipe_cmd  # noqa: F401  (registers the `recipe` sub-command)
from graphmode.cli.app import app

ROOT = Path(__file__).resolve().parents[3]
EX = ROOT / "examples" / "recipes"
DATA = Path(__file__).resolve().parents[1] / "data" / "recipes"
CPU = str(DATA / "cpu_target.yaml")
runner = CliRunner()


def run(*args):
    res = runner.invoke(app, ["recipe", *map(str, args)])
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exception
    return res


@pytest.fixture(scope="module")
def host_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


@pytest.mark.parametrize("name", ["minilm_cpu", "gpt2_decoder", "resnet18_cpu"])
def test_examples_validate_on_host(name, host_cache, monkeypatch):
    monkeypatch.setenv("GRAPHMODE_CACHE_DIR", str(host_cache))
    res = run("validate", EX / f"{name}.yaml")                 # default target: the recipe's `host`
    assert res.exit_code == 0, res.output
    assert "valid" in res.output and "host" in res.output and "proved" in res.output
    assert "worst padding" in res.output and "plans" in res.output


def test_validate_json_valid():
    res = run("validate", EX / "minilm_cpu.yaml", "--target", CPU, "--json")
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["verdict"] == "valid" and out["target"] == "test_cpu" and len(out["hash"]) == 16
    assert out["plans"] == 6 * len(out["buckets"]["seq"]["values"])
    assert [layer["name"] for layer in out["layers"]] == ["schema", "semantics", "constraints"]
    assert {p["status"] for p in out["proofs"]} == {"proved"}
    assert {r["key"]: r["status"] for r in out["requires"]} == {"torch": "ok", "python": "ok"}


def test_validate_refused_exit_1_with_counterexample():
    res = run("validate", DATA / "minilm_over_budget.yaml", "--target", CPU)
    assert res.exit_code == 1
    assert "batch=32, seq=512: needs 1263.1 MB > 1024 MB budget" in res.output
    res = run("validate", DATA / "minilm_over_budget.yaml", "--target", CPU, "--json")
    assert res.exit_code == 1
    out = json.loads(res.stdout)
    assert out["verdict"] == "refused"
    mem = next(p for p in out["proofs"] if p["name"] == "memory")
    assert mem["counterexample"] == {"batch": 32, "seq": 512}


def test_validate_says_not_proved_where_nothing_refuted_the_recipe(tmp_path):
    """An SLA without a FLOP count is unproved, and said "refused: ConstraintError" (trial U)."""
    r = tmp_path / "r.yaml"
    r.write_text("version: 1\nname: r\ninputs: [{name: x, dtype: f32, shape: [batch, 8]}]\n"
                 "dims: {batch: {buckets: [1, 2]}}\nsla: {p99_ms: 5}\n")
    res = run("validate", r, "--target", CPU)
    assert res.exit_code == 1 and "not proved (nothing refuted" in res.stderr and "refused:" not in res.stderr
    assert "no FLOP count" in res.stderr


def test_validate_malformed_exit_2(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text((EX / "minilm_cpu.yaml").read_text().replace("exe_mode: graph", "exe_mode: grpah")
                   .replace("budget_mb: 2048", "budget_mb: -1"))
    res = run("validate", bad, "--target", CPU)
    assert res.exit_code == 2
    assert "exe_mode" in res.output and "memory.budget_mb" in res.output and "Traceback" not in res.output
    res = run("validate", bad, "--target", CPU, "--json")
    out = json.loads(res.stdout)
    assert res.exit_code == 2 and out["error"] == "RecipeErrors"
    assert {e["where"] for e in out["errors"]} == {"exe_mode", "memory.budget_mb"}
    assert all(e["line"] for e in out["errors"])
    # semantic errors are malformed too
    sem = tmp_path / "sem.yaml"
    sem.write_text((EX / "resnet18_cpu.yaml").read_text().replace("buckets: [1, 2, 4, 8]", "buckets: [8, 4]"))
    assert run("validate", sem, "--target", CPU).exit_code == 2
    # YAML syntax error, missing file, unknown target
    syn = tmp_path / "syn.yaml"
    syn.write_text("version: 1\nname: [x\n")
    res = run("validate", syn)
    assert res.exit_code == 2 and "line 3" in res.output
    assert run("validate", tmp_path / "missing.yaml").exit_code == 2
    res = run("validate", EX / "resnet18_cpu.yaml", "--target", "no_such_chip")
    assert res.exit_code == 2 and "known targets" in res.output


def test_show_lists_buckets_and_plans():
    res = run("show", EX / "gpt2_decoder.yaml", "--target", CPU)
    assert res.exit_code == 0, res.output
    assert "worst padding" in res.output and "plans: 40" in res.output and "kv_cache" in res.output
    res = run("show", DATA / "symbolic.yaml", "--target", str(DATA / "gpu_target.yaml"), "--json")
    out = json.loads(res.stdout)
    assert out["recipe"]["memory"]["budget_mb"] == 4096 and out["recipe"]["memory"]["bank_affinity"] == list(
        range(4, 12))
    assert out["plans"] == 3 * len(out["buckets"]["seq"]["values"]) and out["target"] == "test_gpu"
    assert out["buckets"]["seq"]["worst_padding"] <= 0.5
    from graphmode.recipe import load_recipe
    assert load_recipe(out["recipe"]).hash() == out["hash"]          # the resolved recipe round-trips


def test_show_infeasible_synthesis_is_exit_2(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text((EX / "minilm_cpu.yaml").read_text().replace("max_padding: 0.25", "max_padding: 0.1"))
    res = run("show", p, "--target", CPU)
    assert res.exit_code == 2 and "max_buckets" in res.output


def test_diff(tmp_path):
    b = tmp_path / "b.yaml"
    b.write_text((EX / "minilm_cpu.yaml").read_text().replace("budget_mb: 2048", "budget_mb: 3072"))
    res = run("diff", EX / "minilm_cpu.yaml", b)
    assert res.exit_code == 0 and "memory.budget_mb" in res.output and "3072" in res.output
    out = json.loads(run("diff", EX / "minilm_cpu.yaml", b, "--json").stdout)
    assert out["changes"] == [{"path": "memory.budget_mb", "kind": "changed", "old": 2048.0, "new": 3072.0}]
    assert out["a"]["hash"] != out["b"]["hash"]
    assert "no differences" in run("diff", b, b).output


def test_python_m_graphmode_subprocess():
    proc = subprocess.run([sys.executable, "-m", "graphmode", "recipe", "validate",
                           str(DATA / "minilm_over_budget.yaml"), "--target", CPU, "--json"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert json.loads(proc.stdout)["proofs"][2]["counterexample"] == {"batch": 32, "seq": 512}
    assert "Traceback" not in proc.stderr


def test_a_dim_given_twice_for_two_inputs_goes_on_both_or_is_refused():
    """`--dim n=..@x:1 --dim n=..@mask:1` kept only the last, so the draft fixed x's axis (and
    refused every request of another length) or failed in torch."""
    import pytest
    from graphmode.cli.recipe_init_cmd import parse_ranges
    from graphmode.errors import GraphmodeError
    assert parse_ranges(["n=4:32@x:1", "n=4:32@mask:1", "b=1:4"]) == {"n": (4, 32, [("x", 1), ("mask", 1)]),
                                                                       "b": (1, 4)}
    for again in (["n=4:32@x:1", "n=4:16@mask:1"], ["n=4:32", "n=4:32"]):
        with pytest.raises(GraphmodeError, match="given twice") as e:
            parse_ranges(again)
        assert e.value.where == "--dim" and "@INPUT:AXIS,INPUT:AXIS" in e.value.fix


def test_the_sla_proof_uses_the_calibration_profile_saved_and_says_which(tmp_path):
    """The SLA proof ran on the uncalibrated roofline even after `graphmode profile --calibrate`
    had fitted this host: a bound 'proved' at 0.16 ms was measured at 0.6 ms."""
    from graphmode.paths import cache_layout
    from graphmode.targets.cost import Calibration
    res = run("validate", EX / "minilm_cpu.yaml", "--target", CPU, "--cache-dir", tmp_path, "--json")
    assert any("roofline, uncalibrated" in n for n in json.loads(res.stdout)["notes"]), res.output
    saved = cache_layout(tmp_path).calibration("test_cpu")
    saved.parent.mkdir(parents=True, exist_ok=True)
    saved.write_text(Calibration(target="test_cpu", model_efficiency=1e-6).model_dump_json())  # a very slow host
    res = run("validate", EX / "minilm_cpu.yaml", "--target", CPU, "--cache-dir", tmp_path, "--json")
    out = json.loads(res.stdout)
    assert res.exit_code == 1 and f"predicted with the calibration {saved}" in " ".join(out["notes"])
    assert next(p for p in out["proofs"] if p["name"] == "sla.p99_ms")["status"] == "refuted"


def test_compile_proves_the_sla_with_the_saved_calibration_as_validate_does(tmp_path):
    """compile proved the SLA on the uncalibrated roofline while `recipe validate` used the
    calibration `graphmode profile --calibrate` saved: one recipe, two verdicts."""
    import torch
    from graphmode.compiler import lower_model
    from graphmode.paths import cache_layout
    from graphmode.recipe import load_recipe
    from graphmode.targets.cost import Calibration
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).eval()
    recipe = load_recipe({"version": 1, "name": "r", "inputs": [{"name": "input", "dtype": "f32",
                                                                    "shape": ["batch", 16]}],
                          "dims": {"batch": {"buckets": [1, 4]}}, "sla": {"p99_ms": 1}})

    def sla_proof(cache):
        proof = lower_model(model, recipe, "host", refuse=False, cache_dir=cache).proof
        return next(p for p in proof.proofs if p.name == "sla.p99_ms").status, " ".join(proof.notes)
    status, notes = sla_proof(tmp_path)
    assert status == "proved" and "roofline, uncalibrated" in notes
    saved = cache_layout(tmp_path).calibration("host")
    saved.parent.mkdir(parents=True, exist_ok=True)
    saved.write_text(Calibration(target="host", model_efficiency=1e-9).model_dump_json())     # a very slow host
    status, notes = sla_proof(tmp_path)
    assert status == "refuted" and f"predicted with the calibration {saved}" in notes
