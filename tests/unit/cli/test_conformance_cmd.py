"""`graphmode conformance`: runs a suite, writes <suite>.json/.md (and a document section with
--publish), exits 1 when a case is wrong, crashes or hangs, 2 on a bad option."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from graphmode.cli.app import _register, app

_register()
TOY = "conformance_toy_suite:ToySuite"


@pytest.fixture(autouse=True)
def _toy_suite_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "conformance"))


def test_run_writes_reports_and_fails_on_a_wrong_case(tmp_path):
    doc = tmp_path / "conformance.md"
    res = CliRunner().invoke(app, ["conformance", TOY, "--only", "pass|wrong|refused", "--out", str(tmp_path),
                                   "--publish", str(doc), "--timeout", "30"])
    assert res.exit_code == 1, res.output
    assert "Toy suite: 4 cases: pass 2, wrong 1, refused 1, crash 0, hang 0 (50% pass)" in res.output
    data = json.loads((tmp_path / "toy.json").read_text())
    assert [c["outcome"] for c in data["cases"]] == ["pass", "wrong", "refused", "pass"]
    assert "| all | 4 | 2 (50%) |" in (tmp_path / "toy.md").read_text()
    assert "<!-- conformance:toy:begin -->" in doc.read_text()


def test_passing_and_refused_cases_exit_0(tmp_path):
    res = CliRunner().invoke(app, ["conformance", TOY, "--only", "pass|refused", "--sample", "2", "--out",
                                   str(tmp_path)])
    assert res.exit_code == 0, res.output


def test_bad_suite_and_bad_regex_are_typed_errors(tmp_path):
    res = CliRunner().invoke(app, ["conformance", "nosuch", "--out", str(tmp_path)])
    assert res.exit_code == 2 and "unknown conformance suite 'nosuch'" in res.output
    res = CliRunner().invoke(app, ["conformance", TOY, "--only", "(", "--out", str(tmp_path)])
    assert res.exit_code == 2 and "--only is not a valid regular expression" in res.output
