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
    assert out["path"]["path"] == "graph" and list(out["path"]["timed_calls"]) == ["graph batch=1,seq=6"], out["path"]
    assert out["checked_paths"] == ["graph batch=1,seq=6", "eager"], out
    assert out["numerics_ok"]


def test_run_takes_the_first_input_s_whole_shape_as_bench_and_profile_do():
    """`bench --shape 3x3x64x64` and `profile --shape` take the first input's whole shape; `run`
    refused it ("must give each of the recipe's dims ['batch'] exactly once")."""
    import pytest

    from graphmode.cli.run_cmd import parse_shape
    from graphmode.errors import GraphmodeError
    first = ["batch", 3, "h", "w"]
    assert parse_shape("3x3x64x48", ["batch", "h", "w"], first=first) == {"batch": 3, "h": 64, "w": 48}
    assert parse_shape("3x3x64x64", ["batch"], first=["batch", 3, 64, 64]) == {"batch": 3}
    assert parse_shape("2x16", ["batch", "seq"], first=["batch", "seq"]) == {"batch": 2, "seq": 16}
    with pytest.raises(GraphmodeError, match="exactly once, or be the first input's whole shape .* axis 1 is 3, not 4"):
        parse_shape("3x4x64x64", ["batch"], first=["batch", 3, 64, 64])
