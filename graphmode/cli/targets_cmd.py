"""`graphmode targets list|show`: the hardware targets graphmode knows, and the detected host.

The host probe is kept in <cache root>/targets/host.json (`--cache-dir`, see graphmode.paths).
"""
from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any, Optional

import typer
from rich import box
from rich.table import Table

from graphmode.cli.app import app, console, err_console
from graphmode.cli.options import CacheDir
from graphmode.cli.progress import progress
from graphmode.paths import cache_layout
from graphmode.progress import stage
from graphmode.targets import Target, get_target, list_targets, load_target_file
from graphmode.targets.host import probe_note

targets_app = typer.Typer(name="targets", no_args_is_help=True, add_completion=False,
                          help="List and inspect hardware targets (shipped description files and the detected host).")
app.add_typer(targets_app, name="targets")


def _get(name: str, cache_dir: Optional[Path], reprobe: bool = False) -> Target:
    if name.endswith((".yaml", ".yml")) or os.sep in name:
        return load_target_file(name)
    probing = reprobe and name == "host"          # seconds of measurements: say so
    with warnings.catch_warnings(record=True) as caught, progress() as on_stage, \
            stage(on_stage if probing else None, "host probe", detail="bandwidth, FMA peak, GEMM rate"):
        warnings.simplefilter("always")
        t = get_target(name, cache_dir=cache_layout(cache_dir).targets, reprobe=reprobe)
    for w in caught:
        err_console.print(f"warning: {w.message}", markup=False, highlight=False, soft_wrap=True)
    return t


def _si(v: float, unit: str) -> str:
    for p, s in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(v) >= p:
            return f"{v / p:.4g} {s}{unit}"
    return f"{v:.4g} {unit}"


def _bytes(v: int, digits: int = 4) -> str:
    for p, s in ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if v >= p:
            return f"{v / p:.{digits}g} {s}"
    return f"{v} B"


def _row(t: Target) -> dict[str, Any]:
    return {"name": t.name, "kind": t.kind, "vendor": t.vendor, "arch": t.arch, "compute_units": t.compute_units,
            "memory_bytes": t.memory_bytes, "memory_bandwidth_gbps": t.memory_bandwidth_gbps,
            "peak_f32_flops": t.peak_flops.get("f32"), "peak_bf16_flops": t.peak_flops.get("bf16"),
            "dtypes": t.dtypes, "measured": t.measured}


@targets_app.command("list")
def list_cmd(as_json: bool = typer.Option(False, "--json", help="print JSON"),
             cache_dir: Optional[Path] = CacheDir) -> None:
    """Every known target: name, kind, arch, units, memory, bandwidth, peak f32/bf16."""
    rows = [_row(_get(n, cache_dir)) for n in list_targets()]
    if as_json:
        print(json.dumps(rows, indent=2))
        return
    table = Table(title="graphmode targets", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False,
                  padding=(0, 1), collapse_padding=True, show_edge=False)
    for col in ("name", "kind", "arch", "units", "memory", "bandwidth", "peak f32", "peak bf16"):
        table.add_column(col, justify="left" if col in ("name", "kind", "arch") else "right", no_wrap=True,
                         overflow="fold")
    for r in rows:
        table.add_row(r["name"] + (" *" if r["measured"] else ""), r["kind"], r["arch"], str(r["compute_units"]),
                      _bytes(r["memory_bytes"], 3).replace(" ", ""), f"{r['memory_bandwidth_gbps']:.4g}GB/s",
                      _si(r["peak_f32_flops"], "").replace(" ", "") if r["peak_f32_flops"] else "-",
                      _si(r["peak_bf16_flops"], "").replace(" ", "") if r["peak_bf16_flops"] else "-")
    console.print(table)
    console.print("peaks in FLOP/s (dense); * detected on this machine: bandwidth measured, peaks theoretical.\n"
                  "`graphmode targets show NAME` for every field.", highlight=False)


def _print_group(name: str, entries: dict[str, Any]) -> None:
    console.print(f"[bold]{name}[/]")
    for k, v in entries.items():
        if isinstance(v, dict):
            parts = []
            for kk, vv in v.items():
                if kk == "peak_flops" and isinstance(vv, dict):
                    vv = "{" + ", ".join(f"{d}: {_si(x, 'FLOP/s')}" for d, x in vv.items()) + "}"
                elif (kk == "bytes" or kk.endswith("_bytes")) and isinstance(vv, int):
                    vv = _bytes(vv)
                parts.append(f"{kk}={vv}")
            console.print(f"  {k}: " + ", ".join(parts), markup=False, highlight=False)
        else:
            console.print(f"  {k}: {v}", markup=False, highlight=False)


@targets_app.command("show")
def show_cmd(name: str = typer.Argument(..., help="target name (see `graphmode targets list`) or a .yaml file"),
             as_json: bool = typer.Option(False, "--json", help="print JSON"),
             reprobe: bool = typer.Option(False, "--reprobe", help="host only: measure again, ignoring the cache"),
             cache_dir: Optional[Path] = CacheDir) -> None:
    """All fields of one target, groups included; for `host` the detected values and probe numbers."""
    t = _get(name, cache_dir, reprobe=reprobe)
    if as_json:
        print(t.model_dump_json(indent=2))
        return
    console.print(f"[bold]{t.name}[/]  {t.description}", highlight=False)
    fields = [("kind", t.kind), ("vendor", t.vendor), ("arch", t.arch), ("compute units", t.compute_units),
              ("vector width", f"{t.vector_width_bits} bits"), ("registers/core", t.registers_per_core),
              ("L1 (per unit)", _bytes(t.l1_bytes)), ("L2", _bytes(t.l2_bytes)), ("LLC", _bytes(t.llc_bytes)),
              ("memory", _bytes(t.memory_bytes)),
              ("bandwidth", f"{t.memory_bandwidth_gbps:.4g} GB/s" + (" (measured)" if t.measured else "")),
              ("dtypes", ", ".join(t.dtypes)), ("interconnect", t.interconnect or "-"),
              ("launch overhead", f"{t.launch_overhead_us:.3g} us")]
    if t.simd:
        fields.insert(5, ("simd", " ".join(t.simd)))
    for k, v in fields:
        console.print(f"  {k:<16} {v}", markup=False, highlight=False)
    console.print("  peak FLOP/s" + (" (theoretical)" if t.measured else ""), highlight=False)
    for dt, v in t.peak_flops.items():
        console.print(f"    {dt:<10} {_si(v, 'FLOP/s')}", markup=False, highlight=False)
    for g, entries in t.groups.items():
        _print_group(g, entries)
    m = t.groups.get("measured", {})
    if t.measured and probe_note(t):
        console.print(f"note: {probe_note(t)}.", markup=False, highlight=False)
    if t.measured and m.get("loadavg_1m", 0) > 0.5 * t.compute_units:
        console.print(f"note: the probe ran at load average {m['loadavg_1m']} on {t.compute_units} core(s); "
                      "numbers may be low. Re-measure on an idle machine with --reprobe.", highlight=False)
