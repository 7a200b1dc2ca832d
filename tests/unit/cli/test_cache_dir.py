"""GRAPHMODE_CACHE_DIR (resolved by graphmode.paths.cache_root for the CLI and the Python API
alike) moves every cache a command writes: compile's kernels, run's plans and kernels, the host
probe; nothing lands under HOME. Plans the CLI built are hits for `graphmode.compile` and the
other way round; an explicit cache_dir wins over the variable."""
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
    if (probe / "host.json").is_file():      # the record only: a peer's half-written temporary may come and go
        (root / "targets").mkdir(parents=True)
        shutil.copyfile(probe / "host.json", root / "targets" / "host.json")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("GRAPHMODE_CACHE_DIR", str(root))
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(RECIPE))
    runner = CliRunner()

    res = runner.invoke(app, ["compile", "--model", TINY, "--recipe", str(recipe), "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["first_plan"]["generated_kernels"] > 0
    assert _files(root / "kernels"), "compile built its kernels outside the cache root"
    res = runner.invoke(app, ["run", "--model", TINY, "--recipe", str(recipe), "--shape", "2", "--iters", "1",
                              "--json"])
    assert res.exit_code == 0, res.output
    assert _files(root / "plans") and (root / "targets" / "host.json").is_file()
    assert not _files(home), [str(p.relative_to(home)) for p in _files(home)]


def _events(cm) -> dict:
    return {k: v for k, v in cm.events.items() if k in ("compile", "cache_hit")}


def test_the_cli_and_the_python_api_share_one_root_and_an_explicit_one_wins(tmp_path, monkeypatch):
    import graphmode
    root, home = tmp_path / "root", tmp_path / "home"
    probe = cache_layout().targets
    if probe.is_dir():
        shutil.copytree(probe, root / "targets")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("GRAPHMODE_CACHE_DIR", str(root))
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(RECIPE))
    runner = CliRunner()
    res = runner.invoke(app, ["run", "--model", TINY, "--recipe", str(recipe), "--shape", "2", "--iters", "1",
                              "--json"])
    assert res.exit_code == 0, res.output

    cm = graphmode.compile(TINY, str(recipe))             # no cache_dir: the variable's root, as the CLI
    cm.warmup()
    assert _events(cm) == {"cache_hit": 1, "compile": 1}   # batch=2 from the CLI's run, batch=1 built here

    res = runner.invoke(app, ["run", "--model", TINY, "--recipe", str(recipe), "--shape", "1", "--iters", "1",
                              "--metrics", "--json"])
    assert res.exit_code == 0, res.output
    events = json.loads(res.stdout)["metrics"]["events"]
    assert events.get("cache_hit") and not events.get("compile"), events    # the Python API's plan

    other = tmp_path / "explicit"
    cm = graphmode.compile(TINY, str(recipe), cache_dir=other)
    cm.warmup()
    assert _events(cm) == {"compile": 2}
    assert len(list((other / "plans").iterdir())) == 2 and len(list((root / "plans").iterdir())) == 2
    assert not _files(home)


def test_compile_without_a_recipe_compiles_the_draft(tmp_path):
    """compile alone required --recipe, where run, verify and generate draft one (trial Y)."""
    _register()
    res = CliRunner().invoke(app, ["compile", "--model", TINY, "--dry-run", "--json", "--cache-dir", str(tmp_path)])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout[res.stdout.index("{"):])
    assert rep["recipe"].endswith("-draft") and "no --recipe: drafted" in res.stderr
