"""graphmode.paths: one layout under one root. The root is the explicit argument, else
GRAPHMODE_CACHE_DIR, else the platform cache folder (XDG_CACHE_HOME, else ~/.cache), resolved
per call; `cache_root` is the only library code that names the variable."""
from __future__ import annotations

import ast
from pathlib import Path

from graphmode.paths import cache_layout, cache_root, shown
from graphmode.targets import host


def test_layout_under_an_explicit_root(tmp_path):
    lay = cache_layout(str(tmp_path))
    assert lay.root == tmp_path
    assert (lay.plans, lay.kernels, lay.tactics, lay.targets, lay.onnx, lay.kb, lay.artifacts, lay.spill) == tuple(
        tmp_path / d for d in ("plans", "kernels", "tactics", "targets", "onnx", "kb", "artifacts", "spill"))
    assert lay.kb_file == tmp_path / "kb" / "kb.sqlite"
    assert lay.calibration("host") == tmp_path / "calibration" / "host.json"


def test_the_root_is_argument_then_variable_then_platform_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.delenv("GRAPHMODE_CACHE_DIR", raising=False)
    assert cache_root() == tmp_path / "home" / ".cache" / "graphmode" == cache_layout().root
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")          # invalid under the XDG spec: ignored
    assert cache_root() == tmp_path / "home" / ".cache" / "graphmode"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "graphmode"
    monkeypatch.setenv("GRAPHMODE_CACHE_DIR", str(tmp_path / "chosen"))
    assert cache_root() == tmp_path / "chosen" == cache_layout().root
    assert host.default_cache_dir() == tmp_path / "chosen" / "targets"    # the probe asks the layout
    assert cache_root(tmp_path / "explicit") == tmp_path / "explicit" == cache_layout(tmp_path / "explicit").root
    monkeypatch.setenv("GRAPHMODE_CACHE_DIR", "")                       # empty: as if unset
    assert cache_root() == tmp_path / "xdg" / "graphmode"


def test_only_the_paths_module_names_the_cache_variables():
    """Reading a variable takes its exact name as a string constant: only graphmode/paths.py has
    them, so the CLI and the Python API cannot disagree about the root."""
    pkg = Path(host.__file__).resolve().parents[1]
    names = {"GRAPHMODE_CACHE_DIR", "XDG_CACHE_HOME"}
    readers = sorted(str(p.relative_to(pkg)) for p in pkg.rglob("*.py")
                     if any(isinstance(n, ast.Constant) and n.value in names
                            for n in ast.walk(ast.parse(p.read_text()))))
    assert readers == ["paths.py"], readers


def test_output_shows_paths_relative_to_the_working_folder_or_home(tmp_path, monkeypatch):
    """What bench and profile print is saved as results: it must not carry this machine's folders."""
    home, work = tmp_path / "home", tmp_path / "checkout"
    (home / ".cache").mkdir(parents=True)
    work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    assert shown(work / "bench" / "results" / "bench.json") == str(Path("bench/results/bench.json"))
    assert shown(home / ".cache" / "graphmode" / "calibration" / "host.json") == \
        str(Path("~/.cache/graphmode/calibration/host.json"))
    elsewhere = tmp_path / "results" / "bench.md"
    assert shown(elsewhere) == str(elsewhere)                   # outside both: as given
    assert shown("bench.md") == "bench.md"
