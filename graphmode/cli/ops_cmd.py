"""`graphmode ops`: which ops graphmode imports, interprets and lowers, and where the gaps are.

The table is read from the registries themselves (graphmode.coverage): the op database, the
torch and ONNX converter registries and the CPU backend's lowerings. `--markdown` prints
docs/ops.md exactly; `--op NAME` shows one op with its samples and which lowering takes each.
"""
from __future__ import annotations

import json
import sys
from typing import Any, Optional

import typer
from rich import box
from rich.markup import escape
from rich.table import Table

from graphmode.cli.app import app, console
from graphmode.errors import GraphmodeError


SHOWN = 3     # producers shown per cell in the terminal table (--json and --op list them all)


def _few(items, strip: str = "") -> str:
    names = [i[len(strip):] if strip and i.startswith(strip) else i for i in items]
    return ", ".join(names[:SHOWN]) + (f" +{len(names) - SHOWN}" if len(names) > SHOWN else "") if names else "-"


def _print_table(rows, gaps) -> None:
    table = Table(title="graphmode ops", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False,
                  padding=(0, 1), collapse_padding=True, show_edge=False)
    for col in ("op", "kind", "torch import", "ONNX import", "samples", "CPU lowering", "traits"):
        table.add_column(col, justify="right" if col == "samples" else "left", overflow="fold",
                         no_wrap=col in ("op", "kind", "samples"))
    for r in rows:
        table.add_row(r.op, r.kind, _few(r.torch, "aten."), _few(r.onnx), str(r.samples or "-"),
                      ", ".join(r.lowering) or "reference op", ", ".join(t for t in r.traits if t != r.kind) or "-")
    console.print(table)
    console.print("gaps:", highlight=False)
    for name, (what, ops) in gaps.items():
        console.print(f"  {name} ({len(ops)}): {', '.join(ops) or 'none'}", markup=False, highlight=False)
        console.print(f"    {what}", markup=False, highlight=False)
    console.print("`graphmode ops --op NAME` for one op's samples, claims and cost; --json for every field.",
                  markup=False, highlight=False)


def _print_op(d: dict[str, Any]) -> None:
    out = console.print
    out(f"[bold]{escape(d['op'])}[/] ({d['kind']}): {escape(d['doc'])}", highlight=False)
    lo, hi = d["arity"]
    fields = [("inputs", str(lo) if lo == hi else f"{lo}..{hi}"), ("attributes", ", ".join(d["attrs"]) or "-"),
              ("traits", ", ".join(d["traits"]) or "-"), ("interpreter", d["interpreter"]), ("torch import", ", ".join(d["torch"]) or "-"),
              ("ONNX import", ", ".join(d["onnx"]) or "-"),
              ("CPU lowering", ", ".join(d["lowering"]) or "reference op")]
    for k, v in fields:
        out(f"  {k:<13} {v}", markup=False, highlight=False)
    for low in d["lowerings"]:
        out(f"  {'':<13} {low['tier']}: {low['claim']}", markup=False, highlight=False)
    if not d["samples"]:
        out("  no samples", highlight=False)
    for i, s in enumerate(d["samples"]):
        attrs = json.dumps(s["attrs"]) if s["attrs"] else ""
        out(f"  sample {i}: ({', '.join(s['inputs'])}) {attrs} -> {', '.join(s['outputs'])}, "
            f"cost {s['flops']:g} FLOP, runs as {s['runs_as']}", markup=False, highlight=False)
        for tier, why in s["claims"].items():
            out(f"    {tier:<9} {why}", markup=False, highlight=False)


@app.command("ops")
def ops_cmd(op: Optional[str] = typer.Option(None, "--op", help="one op: samples, traits, cost, lowerings"),
            as_json: bool = typer.Option(False, "--json", help="print JSON"),
            markdown: bool = typer.Option(False, "--markdown", help="print docs/ops.md")) -> None:
    """The op coverage table: per op, torch and ONNX import, interpreter, CPU lowering, traits; then the gaps."""
    from graphmode.coverage.table import coverage, gaps, op_details, unresolved
    if markdown and (as_json or op is not None):
        raise GraphmodeError("--markdown prints the whole docs/ops.md", where="--markdown",
                             fix="use it alone; `--op NAME --json` gives one op as JSON")
    if markdown:
        from graphmode.coverage.markdown import render
        sys.stdout.write(render())
        return
    if op is not None:
        d = op_details(op)
        if as_json:
            print(json.dumps(d, indent=2))
        else:
            _print_op(d)
        return
    rows, found = coverage(), gaps()
    if as_json:
        print(json.dumps({"ops": [r.to_json() for r in rows],
                          "gaps": {k: {"what": what, "ops": list(ops)} for k, (what, ops) in found.items()},
                          "unresolved": unresolved()}, indent=2))
        return
    _print_table(rows, found)
