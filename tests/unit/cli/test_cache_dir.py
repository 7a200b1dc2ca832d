"""GRAPHMODE_CACHE_DIR (read once, by the shared --cache-dir option) moves every cache a command
writes: compile's kernels, run's plans and kernels, the host probe; nothing lands under HOME."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import yaml
from typer.testing import CliRunner

from graphmode.cli.app import _register, app
from graphmode.paths import cache_layout

TINY = f"{Path(__file__).resolve().parents[2] / 'e2e' / 'tiny_models.py'}:mlp"
RECIPE = {"version": 1, "name": "mlp-cache", "inputs": [{"name": "input", "dtype": "f32", "shape": ["batch", 16]}],
          "dims": {"batch": {"buckets": [1, 2]}}, "codegen": {"kernel_selection": "heuristic"}}
_register()


def _files(d: Path) -> list[Path]:
    return [p for p in d.rglob("*") if p.is_file()] if d.exists() else []


def test_the_variable_moves_every_cache_a_command_writes(tmp_path, monkeypatch):
    root, home = tmp_path / "root", tmp_path / "home"
    probe = cache_layout().targets           # this machine's host probe: reused, it takes seconds
    if probe.is_dir():
        shutil.copytree(probe, root / "targets")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("GRAPHMODE_CACHE_DIR", str(root))
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(RECIPE))
    runner = CliRunner()

    res = runner.invoke(app, ["compile", "--model", TINY, "--recipe", str(recipe), "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["first_plan"]["generated_kernels"] > 0
    assert _files(root / "kernels"), "compile built its kernels outside the cache root"
    res = runner.invoke(app, ["run", "--model", TINY, "--recipe", str(recipe), "--shape", "2", "--iters", "1",
                              "--json"])
    assert res.exit_code == 0, res.output
    assert _files(root / "plans") and (root / "targets" / "host.json").is_file()
    # nothing else under HOME; the tactic selector (backends/cpu/tactics.py) still looks the host up
    # with no cache root: once it is handed the target, this becomes `assert not home.exists()`
    leaked = [str(p.relative_to(home)) for p in _files(home)]
    assert leaked in ([], [".cache/graphmode/targets/host.json"]), leaked
