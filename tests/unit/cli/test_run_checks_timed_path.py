"""`graphmode run` checks the outputs of the path its latency is of: a request off its bucket
whose padding is unsafe runs eagerly until its own plan is built (dims.D.exact_plans, on its
third call), so the first call's outputs (eager's, equal to the reference by construction) said
nothing about the plan that was then timed."""
from __future__ import annotations

import json
from pathlib import Path

import yaml
from typer.testing import CliRunner

from graphmode.cli.app import _register, app

POOL = f"{Path(__file__).resolve().parents[2] / 'e2e' / 'tiny_models.py'}:mean_pool"
RECIPE = {"version": 1, "name": "pool-exact",
          "inputs": [{"name": "ids", "dtype": "i64", "shape": ["batch", "seq"]},
                     {"name": "mask", "dtype": "i64", "shape": ["batch", "seq"]}],
          "dims": {"batch": {"buckets": [1, 2]}, "seq": {"buckets": [4, 16], "exact_plans": 1}},
          "on_violation": "eager", "codegen": {"kernel_selection": "heuristic"}}
_register()


def test_the_timed_plan_is_checked_not_only_the_first_eager_call(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(RECIPE))
    res = CliRunner().invoke(app, ["run", "--model", POOL, "--recipe", str(recipe), "--shape", "batch=1,seq=6",
                                   "--iters", "4", "--json", "--cache-dir", str(tmp_path / "cache")])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["path"]["path"] == "graph" and out["path"]["timed_calls"].get("eager"), out["path"]
    assert out["checked_paths"] == ["graph", "eager"] and out["numerics_ok"]
