"""One verdict everywhere: the Python API, compile, verify and run refuse (or accept) the same
models for the same reasons — unsafe padding, ops the exe_mode cannot run, recipe/model
mismatches — and a padded request either matches eager or runs eagerly, never silently wrong."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

import graphmode
from graphmode.capture.spec import bundle_from_module
from graphmode.cli.app import _register, app
from graphmode.monitor.contract import attach
from graphmode.verdict import ContractRefused
from graphmode.verify.numerics import rel_l2

from tiny_models import POOL_DIMS, POOL_INPUTS, masked_mean_pool, mean_pool, mlp, recipe, rrelu

TINY = str(Path(__file__).with_name("tiny_models.py"))
runner = CliRunner()
_register()


def bundle(fn):
    m, ex, *dims = fn()
    return bundle_from_module(m, ex, dims[0] if dims else None)


def first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def write(tmp_path: Path, r: dict, name: str = "r.yaml") -> str:
    p = tmp_path / name
    p.write_text(yaml.safe_dump(r))
    return str(p)


def invoke(*args: str):
    res = runner.invoke(app, list(args))
    assert "Traceback" not in (res.output or ""), res.output
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    return res


def test_unsafe_padding_is_refused_with_the_op_and_source_line(tmp_path):
    with pytest.raises(ContractRefused) as e:
        graphmode.compile(bundle(mean_pool), recipe("mean", POOL_INPUTS, POOL_DIMS), cache_dir=tmp_path)
    issue = e.value.issues[0]
    assert e.value.exit_code == 1 and issue.kind == "padding" and issue.where == "dims.seq"
    assert "mean" in issue.message and issue.loc and "tiny_models.py:" in issue.loc
    assert "exact buckets" in issue.fix and "on_violation: eager" in issue.fix


def test_unsafe_dim_with_eager_fallback_never_pads_it(tmp_path):
    cm = graphmode.compile(bundle(mean_pool), recipe("mean", POOL_INPUTS, POOL_DIMS, on_violation="eager"),
                           cache_dir=tmp_path)
    assert cm.verdict.exact_dims == ["seq"]
    ids, mask = torch.randint(0, 50, (3, 5)), torch.ones(3, 5, dtype=torch.long)
    out = cm(ids=ids, mask=mask)
    assert cm.last_path["path"] == "eager" and "seq" in cm.last_path["reason"]
    assert torch.equal(first(out), cm.source.reference({"ids": ids, "mask": mask})[0])
    ids, mask = torch.randint(0, 50, (3, 8)), torch.ones(3, 8, dtype=torch.long)
    out = cm(ids=ids, mask=mask)          # seq is a bucket value; batch 3 -> 4 is safe to pad
    assert cm.last_path == {"path": "graph", "bucket": {"batch": 4, "seq": 8}}
    want = cm.source.reference({"ids": ids, "mask": mask})[0]
    assert rel_l2(first(out), want) < 1e-5
    m = cm.metrics()       # the contract itself sends an off-bucket seq to eager: a fallback, not a violation
    assert m["events"]["fallback"] == 1 and not m["events"].get("violation") and m["health_score"] == 1.0
    from graphmode.monitor import monitored
    served = monitored(cm)                  # the server's monitor counts it the same way
    served(ids=torch.randint(0, 50, (3, 5)), mask=torch.ones(3, 5, dtype=torch.long))
    snap = cm.metrics()["contract"]
    assert snap["health_score"] == 1.0 and snap["violations"] == {} and sum(snap["fallbacks"].values()) == 1


def test_safe_padding_runs_in_graph_mode_and_matches_eager(tmp_path):
    cm = graphmode.compile(bundle(masked_mean_pool), recipe("masked", POOL_INPUTS, POOL_DIMS), cache_dir=tmp_path)
    assert cm.verdict.padding.dims["seq"].status == "safe"
    ids, mask = torch.randint(0, 50, (3, 5)), torch.ones(3, 5, dtype=torch.long)
    mask[1, 3:] = 0
    out = cm(ids=ids, mask=mask)
    assert cm.last_path["bucket"] == {"batch": 4, "seq": 8}
    got = first(out)
    assert rel_l2(got, cm.source.reference({"ids": ids, "mask": mask})[0]) < 1e-5


@pytest.mark.parametrize("change,where", [
    ({"inputs": [{"name": "input", "dtype": "f16", "shape": ["batch", 16]}]}, "inputs[0].dtype"),
    ({"inputs": [{"name": "input", "dtype": "f32", "shape": ["batch", 15]}]}, "inputs[0].shape[1]"),
    ({"outputs": {"logits": ["batch", 4]}}, "outputs.logits"),
    ({"outputs": {"output": ["batch", 5]}}, "outputs.output[1]"),
])
def test_recipe_model_mismatch_is_a_field_error(tmp_path, change, where):
    r = recipe("mlp", [{"name": "input", "dtype": "f32", "shape": ["batch", 16]}], {"batch": {"buckets": [1, 2, 4]}})
    r.update(change)
    with pytest.raises(ContractRefused) as e:
        graphmode.compile(bundle(mlp), r, cache_dir=tmp_path)
    assert e.value.exit_code == 2 and any(i.where == where for i in e.value.issues), e.value.render()
    res = invoke("compile", "--model", f"{TINY}:mlp", "--recipe", write(tmp_path, r), "--dry-run")
    assert res.exit_code == 2 and where in res.output


def test_fallback_in_graph_mode_points_at_the_model_code(tmp_path):
    r = recipe("rrelu", [{"name": "x", "dtype": "f32", "shape": ["batch", 8]}], {"batch": {"buckets": [1, 4]}})
    with pytest.raises(ContractRefused) as e:
        graphmode.compile(bundle(rrelu), r, cache_dir=tmp_path)
    issue = e.value.issues[0]
    assert issue.kind == "fallback" and "rrelu" in issue.message
    assert "tiny_models.py:" in issue.loc and "torch" not in issue.loc.split("tiny_models.py")[0].rsplit("/", 3)[-2:]
    assert "exe_mode: hybrid" in issue.fix and "exclude_ops" not in issue.fix
    cm = graphmode.compile(bundle(rrelu), {**r, "exe_mode": "hybrid"}, cache_dir=tmp_path)
    x = torch.randn(3, 8)
    assert rel_l2(first(cm(x=x)), cm.source.reference({"x": x})[0]) < 1e-5
    res = invoke("verify", "--model", f"{TINY}:rrelu", "--recipe", write(tmp_path, r))
    assert res.exit_code == 1 and "exe_mode: hybrid" in res.output


def test_compile_report_shows_the_padding_verdict(tmp_path):
    res = invoke("compile", "--model", f"{TINY}:mean_pool", "--recipe",
                 write(tmp_path, recipe("mean", POOL_INPUTS, POOL_DIMS)), "--json", "--dry-run")
    assert res.exit_code == 1
    rep = json.loads(res.stdout)
    assert rep["contract"]["padding"]["seq"]["status"] == "unsafe"
    assert rep["contract"]["padding"]["batch"]["status"] == "safe"
    assert rep["contract"]["refusals"][0]["where"] == "dims.seq"


def test_verify_runs_padded_shapes_and_the_smallest_one(tmp_path):
    path = write(tmp_path, recipe("masked", POOL_INPUTS, POOL_DIMS))
    res = invoke("verify", "--model", f"{TINY}:masked_mean_pool", "--recipe", path, "--json")
    assert res.exit_code == 0, res.output
    cases = json.loads(res.stdout)["cases"]
    shapes = [(c["shape"], c["bucket"]) for c in cases]
    assert ({"batch": 3, "seq": 5}, {"batch": 4, "seq": 8}) in shapes          # strictly inside a bucket
    assert ({"batch": 1, "seq": 2}, {"batch": 1, "seq": 4}) in shapes          # the smallest admissible
    assert all(c["ok"] and c["path"] == "graph" for c in cases)
    eager = write(tmp_path, recipe("mean", POOL_INPUTS, POOL_DIMS, on_violation="eager"), "e.yaml")
    res = invoke("verify", "--model", f"{TINY}:mean_pool", "--recipe", eager, "--json")
    assert res.exit_code == 0, res.output
    paths = {(c["shape"]["seq"], c["path"]) for c in json.loads(res.stdout)["cases"]}
    assert (5, "eager") in paths and (8, "graph") in paths


def test_run_follows_the_recipe_shapes_and_reports_eager_fallback_honestly(tmp_path):
    r = recipe("mlp", [{"name": "input", "dtype": "f32", "shape": ["batch", 16]}], {"batch": {"buckets": [1, 2, 4]}})
    res = invoke("run", "--model", f"{TINY}:mlp", "--recipe", write(tmp_path, r), "--shape", "3", "--json",
                 "--iters", "2")
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["outputs"][0]["shape"] == [3, 4] and out["bucket"] == {"batch": 4} and out["numerics_ok"]
    eager = write(tmp_path, recipe("mean", POOL_INPUTS, POOL_DIMS, on_violation="eager"), "e.yaml")
    res = invoke("run", "--model", f"{TINY}:mean_pool", "--recipe", eager, "--shape", "2x5", "--iters", "2")
    assert res.exit_code == 0, res.output
    assert "ran in eager PyTorch" in res.output and "graphmode / eager" not in res.output


@pytest.mark.parametrize("shape,needle", [("-1", "positive"), ("1000000000", "outside"), ("1e20", "cannot parse"),
                                          ("batch=2,foo=1", "unknown dim"), ("2x3", "exactly once")])
def test_run_refuses_bad_shapes_before_compiling(tmp_path, shape, needle):
    r = recipe("mlp", [{"name": "input", "dtype": "f32", "shape": ["batch", 16]}], {"batch": {"buckets": [1, 2, 4]}})
    res = invoke("run", "--model", f"{TINY}:mlp", "--recipe", write(tmp_path, r), "--shape", shape)
    assert res.exit_code == 2 and needle in res.output, res.output


def test_run_exits_1_when_numerics_fail(tmp_path, monkeypatch):
    from graphmode.passes import base
    real = base.PASSES["dce"]

    def broken(graph, ctx):          # scales the first output: a wrong answer the run must not hide
        res = real(graph, ctx)
        g = res.graph.clone()
        out = g.outputs[0]
        ty = g.values[out].type
        k = g.add_constant(g.fresh_name("k"), torch.tensor(1.5), role="const")
        y, = g.add_node("mul", [out, k], [ty])
        g.outputs[0] = y
        return base.PassResult(g, True)
    monkeypatch.setitem(base.PASSES, "dce", broken)
    r = recipe("mlp", [{"name": "input", "dtype": "f32", "shape": ["batch", 16]}], {"batch": {"buckets": [1, 2]}})
    res = invoke("run", "--model", f"{TINY}:mlp", "--recipe", write(tmp_path, r), "--iters", "1",
                 "--shape", "2")
    assert res.exit_code == 1 and "numerics check failed" in res.output, res.output


def test_recipe_validate_with_the_model_reaches_the_same_verdict(tmp_path):
    path = write(tmp_path, recipe("mean", POOL_INPUTS, POOL_DIMS))
    res = invoke("recipe", "validate", path, "--model", f"{TINY}:mean_pool")
    assert res.exit_code == 1 and "dims.seq" in res.output and "mean" in res.output, res.output
    res = invoke("recipe", "validate", path, "--model", f"{TINY}:masked_mean_pool")
    assert res.exit_code == 0, res.output


def _cnn():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU(),
                               torch.nn.Conv2d(16, 32, 3, stride=2, padding=1), torch.nn.ReLU()).eval()


def test_conv_tactics_keep_their_workspace_inside_the_memory_budget(tmp_path):
    """graphmode's own CNN draft (budget = weights, prepared copies and the batch-32 arena,
    +25%) ran an im2col conv with a 3.3 MB workspace: 6.5 MB held against 4 MB, which only
    the monitor's metrics said (trial S). Under a budget the workspace cannot fit in, the
    plan holds no more than the budget; a budget with room keeps the faster tactic."""
    m, x = _cnn(), torch.randn(32, 3, 32, 32)
    r = {"version": 1, "name": "cnn", "exe_mode": "graph", "codegen": {"kernel_selection": "heuristic"},
         "inputs": [{"name": "input", "dtype": "f32", "shape": ["batch", 3, 32, 32]}],
         "dims": {"batch": {"buckets": [32]}}, "memory": {"budget_mb": 4}}
    held = {}
    for mb in (4, 24):
        r["memory"]["budget_mb"] = mb
        cm = graphmode.compile(m, r, example_inputs=(x,), cache_dir=tmp_path / "cache")
        assert rel_l2(cm(x), m(x)) < 1e-5
        held[mb] = cm.executable({"batch": 32}).memory_report()
        monitor = attach(cm)                  # as `graphmode serve` and `run --metrics` count it
        assert monitor.check_memory(cm) == [], monitor.snapshot()
        assert monitor.weights_bytes + monitor.held_bytes["batch=32"] <= mb * 2**20
    assert held[4]["arena_bytes"] > 2 << 20 and held[24]["workspace_bytes"] > held[4]["workspace_bytes"]
