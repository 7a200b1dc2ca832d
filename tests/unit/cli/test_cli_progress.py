"""How the CLI shows progress and tables: plain lines on stderr when piped (a rich display on a
terminal), never on stdout, so --json stays clean; piped tables and lists keep the op names and
source lines a fix needs whole. An artifact `compile --save` wrote under GRAPHMODE_CACHE_DIR is
loaded by `graphmode.load` under the same root, bucket N of M."""
from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pytest
import yaml
from rich.console import Console
from rich.table import Table
from typer.testing import CliRunner

import graphmode
from graphmode.cli.app import CliConsole, _register, app
from graphmode.cli.progress import LiveDisplay, PlainLines, _settings
from graphmode.paths import cache_layout
from graphmode.progress import Stage

TINY = Path(__file__).resolve().parents[2] / "e2e" / "tiny_models.py"
RECIPE = {"version": 1, "name": "mlp-progress", "inputs": [{"name": "input", "dtype": "f32", "shape": ["batch", 16]}],
          "dims": {"batch": {"buckets": [1, 2, 4]}}, "codegen": {"kernel_selection": "heuristic"}}
_register()


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_plain_lines_say_start_steps_at_most_once_a_second_and_end():
    lines: list[str] = []
    clock = Clock()
    show = PlainLines(lines.append, every_s=1.0, clock=clock)
    show(Stage("plans", 0, 4))
    for i, t in enumerate((0.5, 1.2, 1.5, 3.0), 1):
        clock.now = t
        show(Stage("plans", i, 4, f"batch={i}", seconds=t))
    show(Stage("plans", 4, 4, finished=True, seconds=3.0))
    show(Stage("capture"))
    show(Stage("capture", finished=True, seconds=65.0))
    show(Stage("plans", 0, 1, "batch=2"))                     # a plan built on first use: its end says which
    show(Stage("plans", 1, 1, "batch=2 (from the cache)", seconds=0.2))
    show(Stage("plans", 1, 1, "batch=2", finished=True, seconds=0.2))
    assert lines == ["graphmode: plans 0 of 4 ...",
                     "graphmode: plans 2 of 4: batch=2 [1.2s, ETA 1.2s]",
                     "graphmode: plans 4 of 4: batch=4 [3.0s]",
                     "graphmode: plans done in 3.0s (4 of 4)",
                     "graphmode: capture ...",
                     "graphmode: capture done in 1m05s",
                     "graphmode: plans batch=2 ...",
                     "graphmode: plans batch=2 (from the cache) done in 0.2s"]


def test_the_live_display_leaves_a_line_per_finished_stage():
    buf = io.StringIO()
    with LiveDisplay(Console(file=buf, force_terminal=True, width=100)) as show:
        show(Stage("plans", 0, 3))
        show(Stage("plans", 1, 3, "batch=1"))
        show(Stage("plans", 3, 3, finished=True, seconds=2.0))
    assert "plans (3 of 3)" in buf.getvalue() and "2.0s" in buf.getvalue()


def test_no_progress_turns_it_off():
    runner = CliRunner()
    assert runner.invoke(app, ["--no-progress", "version"]).exit_code == 0 and not _settings["enabled"]
    assert runner.invoke(app, ["version"]).exit_code == 0 and _settings["enabled"]


@pytest.mark.parametrize("columns", [None, "80"])
def test_a_piped_table_keeps_its_cells_whole(columns, monkeypatch):
    """rich's 80-column default for a pipe would cut a long cell with an ellipsis; so would a
    COLUMNS=80 inherited from a CI runner, which describes a terminal, not this pipe."""
    if columns is None:
        monkeypatch.delenv("COLUMNS", raising=False)
    else:
        monkeypatch.setenv("COLUMNS", columns)
    loc = "projects/" + "a_rather_long_folder_name/" * 6 + "modeling_something.py:1234"
    t = Table(title="fallbacks")
    for c in ("op", "reason", "source location"):
        t.add_column(c)
    t.add_row("aten._some_rather_long_operator_name.default", "no converter for this overload", loc)
    buf = io.StringIO()
    CliConsole(file=buf).print(t)
    assert loc in buf.getvalue() and "aten._some_rather_long_operator_name.default" in buf.getvalue()
    narrow = io.StringIO()
    CliConsole(file=narrow, width=80).print(t)          # an explicit width is still honoured
    assert max(len(line) for line in narrow.getvalue().splitlines()) <= 80


def test_compile_save_shows_progress_on_stderr_and_keeps_json_clean(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    if cache_layout().targets.is_dir():              # this machine's host probe: reused, it takes seconds
        shutil.copytree(cache_layout().targets, root / "targets")
    monkeypatch.setenv("GRAPHMODE_CACHE_DIR", str(root))
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(RECIPE))
    res = CliRunner().invoke(app, ["compile", "--model", f"{TINY}:mlp", "--recipe", str(recipe),
                                   "--save", str(tmp_path / "m.gm"), "--json"])
    assert res.exit_code == 0, res.output
    seen: list[Stage] = []
    cm = graphmode.load(tmp_path / "m.gm", on_stage=seen.append)      # extracted under the same root
    assert len([d for d in (root / "artifacts").iterdir() if (d / "complete").is_file()]) == 1
    assert [(s.done, s.total) for s in seen if s.name == "plans" and s.done and not s.finished] == [(1, 3), (2, 3),
                                                                                                   (3, 3)]
    assert cm.events["artifact_load"] == 3
    assert json.loads(res.stdout)["verdict"] == "valid"          # stdout: the JSON and nothing else
    err = res.stderr.splitlines()
    for line in ("graphmode: capture ...", "graphmode: passes 0 of 10 ...", "graphmode: memory plans 0 of 3 ...",
                 "graphmode: proof ...", "graphmode: first plan batch=1 ...", "graphmode: plans 0 of 3 ..."):
        assert line in err, res.stderr
    assert any(ln.startswith("graphmode: plans done in ") and ln.endswith("(3 of 3)") for ln in err), res.stderr
    assert any(ln.startswith("graphmode: write ") for ln in err), res.stderr


def test_a_long_source_line_of_a_fallback_survives_piping(tmp_path):
    folder = tmp_path / ("a_model_folder_with_a_name_long_enough_to_overflow_eighty_columns_" * 2)
    folder.mkdir()
    (folder / "model.py").write_text(TINY.read_text())
    r = {**RECIPE, "name": "rrelu", "exe_mode": "hybrid", "inputs": [{"name": "x", "dtype": "f32", "shape": ["batch", 8]}]}
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(r))
    res = CliRunner().invoke(app, ["compile", "--model", f"{folder / 'model.py'}:rrelu", "--recipe", str(recipe),
                                   "--dry-run", "--cache-dir", str(tmp_path / "cache")])
    assert res.exit_code == 0, res.output
    lines = res.stdout.splitlines()
    assert any(ln.strip().startswith("aten.rrelu.default x1:") for ln in lines), res.stdout
    loc = next(ln.strip()[len("at "):] for ln in lines if ln.strip().startswith("at "))
    assert loc.startswith(str(folder / "model.py") + ":") and loc.split(":")[-1].isdigit(), loc
