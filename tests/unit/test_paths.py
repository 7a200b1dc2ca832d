"""graphmode.paths: one layout under one root; the default root follows HOME when asked and
no library module reads GRAPHMODE_CACHE_DIR (only the CLI does)."""
from __future__ import annotations

import ast
from pathlib import Path

from graphmode.paths import cache_layout, default_root
from graphmode.targets import host


def test_layout_under_an_explicit_root(tmp_path):
    lay = cache_layout(str(tmp_path))
    assert lay.root == tmp_path
    assert (lay.plans, lay.kernels, lay.tactics, lay.targets, lay.onnx, lay.kb) == tuple(
        tmp_path / d for d in ("plans", "kernels", "tactics", "targets", "onnx", "kb"))
    assert lay.calibration("host") == tmp_path / "calibration" / "host.json"


def test_default_root_follows_home_and_ignores_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("GRAPHMODE_CACHE_DIR", str(tmp_path / "elsewhere"))
    assert default_root() == tmp_path / "home" / ".cache" / "graphmode" == cache_layout().root
    assert host.default_cache_dir() == cache_layout().targets        # the probe asks the layout


def test_only_the_cli_options_name_the_cache_variable():
    """Reading the variable takes its exact name as a string constant; only the shared option has it."""
    pkg = Path(host.__file__).resolve().parents[1]
    readers = sorted(str(p.relative_to(pkg)) for p in pkg.rglob("*.py")
                     if any(isinstance(n, ast.Constant) and n.value == "GRAPHMODE_CACHE_DIR"
                            for n in ast.walk(ast.parse(p.read_text()))))
    assert readers == ["cli/options.py"], readers
