"""`graphmode ops`: the coverage table read from the registries, docs/ops.md generated from it
(so the document cannot drift), one op's details, and typed errors for bad input."""
from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from graphmode.cli.app import _register, app
from graphmode.coverage.converters import onnx_emits, torch_emits
from graphmode.ir.ops import OPS, ops_with

DOC = Path(__file__).resolve().parents[3] / "docs" / "ops.md"
_register()


def _run(*args: str):
    return CliRunner().invoke(app, ["ops", *args])


def test_docs_ops_md_is_exactly_the_markdown_output():
    res = _run("--markdown")
    assert res.exit_code == 0, res.output
    assert res.output == DOC.read_text(), "docs/ops.md is stale: run `graphmode ops --markdown > docs/ops.md`"


def test_json_has_one_row_per_op_and_the_gaps():
    res = _run("--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    rows = {r["op"]: r for r in data["ops"]}
    assert set(rows) == set(OPS)
    assert {"torch", "onnx", "interpreter", "samples", "lowering", "traits", "kind"} <= set(rows["add"])
    assert "aten.min.other" in rows["minimum"]["torch"] and "aten.relu6.default" in rows["clamp"]["torch"]
    assert "native" in rows["max_pool2d"]["lowering"] and "generated" in rows["softmax"]["lowering"]
    assert rows["remainder"]["lowering"] == ["generated"] and "Mod" in rows["remainder"]["onnx"]
    assert data["unresolved"] == {"torch": [], "onnx": []}, "a converter's op argument could not be read"
    gaps = data["gaps"]
    assert "paged_attention" in gaps["not_imported"]["ops"] and "fused" in gaps["no_samples"]["ops"]
    assert set(gaps["elementwise_not_generated"]["ops"]) == ops_with("aten_reference") & ops_with("elementwise")


def test_converter_reading_follows_the_key():
    """Branches and lookups on the registry key are evaluated, not merged across keys."""
    t, o = torch_emits(), onnx_emits()
    assert t["aten.add.Tensor"].ops == {"add", "mul"}        # mul: only when alpha != 1
    assert t["aten.sub.Tensor"].ops == {"sub", "mul"}
    # reshape: a 0-d input runs on its [1] view (argmin: also dim=None, on the flattened tensor); cast: a dtype argument
    assert t["aten.mean.dim"].ops == {"cast", "mean", "reshape"} and t["aten.argmin.default"].ops == {"argmin", "reshape"}
    assert t["aten.hardswish.default"].ops == {"add", "clamp", "div", "mul"}     # through its helper
    assert o["MaxPool"].ops >= {"max_pool2d"} and "avg_pool2d" not in o["MaxPool"].ops
    assert {"remainder", "fmod"} <= o["Mod"].ops and "fmod" not in o["Add"].ops
    # ArgMin's select_last_index flips a static axis (index_select); the shared flip also reads a dynamic one
    assert o["ArgMin"].ops == {"argmin", "index_select", "sub", "arange", "index"}
    assert o["Trilu"].ops == {"tril", "triu"}


def test_one_op_in_full():
    res = _run("--op", "remainder", "--json")
    assert res.exit_code == 0, res.output
    d = json.loads(res.stdout)
    assert d["op"] == "remainder" and d["arity"] == [2, 2] and "Python's %" in d["doc"]
    assert len(d["samples"]) == len(OPS["remainder"].samples())
    s = d["samples"][0]
    assert s["claims"]["generated"] == "claimed" and s["runs_as"] == "reference"
    assert s["claims"]["aten"].startswith("refused: no aten lowering") and s["flops"] > 0
    res = _run("--op", "max_pool2d")
    assert res.exit_code == 0, res.output
    assert "native: graphmode.backends.cpu.pool.max_pool2d" in res.output and "runs as native" in res.output


def test_the_terminal_table_ends_with_the_gaps():
    res = _run()
    assert res.exit_code == 0, res.output
    assert "not_imported" in res.output and "paged_attention" in res.output and "--op NAME" in res.output


def test_bad_input_is_a_typed_error_with_exit_2():
    res = _run("--op", "remaindr")
    assert res.exit_code == 2 and "unknown op 'remaindr'" in res.output and "did you mean remainder" in res.output
    res = _run("--markdown", "--json")
    assert res.exit_code == 2 and '"where": "--markdown"' in res.output
    res = _run("--markdown", "--op", "add")
    assert res.exit_code == 2 and "use it alone" in res.output
