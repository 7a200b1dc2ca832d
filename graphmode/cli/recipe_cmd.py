"""`graphmode recipe validate|show|diff`.

Exit codes: 0 valid; 1 refused (a constraint has a counter-example, or could not be
proved); 2 malformed (field-level errors, unknown target).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import typer
import yaml
from rich import box
from rich.table import Table

from graphmode.cli.app import app, console, err_console, fail
from graphmode.cli.options import CacheDir
from graphmode.cli.progress import progress
from graphmode.errors import ConstraintError, GraphmodeError, RecipeErrors

recipe_app = typer.Typer(name="recipe", no_args_is_help=True, add_completion=False,
                         help="Validate, show and diff recipes (the verified deployment contract).")
app.add_typer(recipe_app, name="recipe")

_TARGET_HELP = ("target name (registry), target YAML file, or inline spec name; "
                "default: the recipe's first target, else host")


def _target(recipe: Any, ref: Optional[str], cache_dir: Optional[Path]):
    from graphmode.paths import cache_layout
    from graphmode.recipe.targets import pick_target
    return pick_target(recipe, ref, cache_dir=cache_layout(cache_dir).targets)


def _table(title: str, *cols: str) -> Table:
    t = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    for c in cols:
        t.add_column(c, overflow="fold")
    return t


def _fmt_buckets(vals: list[int], limit: int = 12) -> str:
    if len(vals) <= limit:
        return ", ".join(map(str, vals))
    return ", ".join(map(str, vals[:limit // 2])) + f", ... ({len(vals)} total) ..., " + \
        ", ".join(map(str, vals[-2:]))


def _bucket_table(dims: dict) -> Table:
    t = _table("buckets", "dim", "range", "buckets", "count", "worst padding")
    for d, s in dims.items():
        at = f" at {d}={s.worst_value}" if s.worst_value is not None else ""
        t.add_row(d, f"{s.lo}..{s.hi}" + (f" step {s.step}" if s.step > 1 else ""), _fmt_buckets(s.buckets),
                  str(len(s.buckets)), f"{float(s.worst_padding):.3f}{at}")
    return t


def _print_report(rep) -> None:
    head = _table(f"recipe {rep.recipe.name}", "field", "value")
    head.add_row("source", str(rep.recipe.source or "-"))
    head.add_row("hash", rep.hash)
    head.add_row("target", f"{rep.target.name} ({rep.target.kind}, {rep.target.arch})")
    style = {"valid": "green", "malformed": "red", "refused": "red", "unproved": "yellow"}[rep.verdict]
    head.add_row("verdict", f"[bold {style}]{rep.verdict}[/]")
    if rep.dims:
        head.add_row("plans", f"{rep.plans} (warm-up compiles one per bucket)")
    if rep.model:
        head.add_row("model facts", rep.model.facts_source)
    console.print(head)
    layers = _table("verification", "layer", "status", "time", "summary")
    for layer in rep.layers:
        layers.add_row(layer.name, layer.status, f"{layer.seconds * 1e3:.0f} ms", layer.summary)
    console.print(layers)
    if rep.dims:
        console.print(_bucket_table(rep.dims))
    if rep.proofs:
        proofs = _table("proofs (Z3, every admissible shape)", "property", "status", "time", "result")
        for p in rep.proofs:
            st = {"proved": "green", "refuted": "red", "unproved": "yellow"}.get(p.status, "white")
            proofs.add_row(p.name, f"[{st}]{p.status}[/]", f"{p.seconds * 1e3:.0f} ms", p.message)
        console.print(proofs)
    if rep.requires:
        req = _table("requires", "package", "constraint", "found", "status")
        for r in rep.requires:
            req.add_row(r.key, r.constraint, r.found or "-", r.status + (f" ({r.reason})" if r.reason else ""))
        console.print(req)
    for n in rep.notes:
        console.print(f"note: {n}", markup=False, highlight=False)
    for w in rep.warnings:
        console.print(f"[yellow]warning:[/] {w}", highlight=False)


@recipe_app.command("validate")
def validate_cmd(path: Path = typer.Argument(..., help="recipe YAML file"),
                 target: Optional[str] = typer.Option(None, "--target", "-t", help=_TARGET_HELP),
                 as_json: bool = typer.Option(False, "--json", help="print JSON"),
                 timeout_ms: int = typer.Option(5000, "--timeout-ms", min=1,
                                                help="Z3 timeout per proof (all proofs share a few times this)"),
                 model: Optional[str] = typer.Option(None, "--model", help="prove with this model's real weights "
                                                     "and memory plan (minilm | gpt2 | resnet18 | .onnx | mod:fn)"),
                 calibration: Optional[Path] = typer.Option(None, "--calibration", help="cost-model calibration "
                                                            "JSON for the SLA proof (default: the one `graphmode "
                                                            "profile --calibrate` saved for the target)"),
                 cache_dir: Optional[Path] = CacheDir) -> None:
    """Check a recipe in three layers (schema, semantics, Z3 proofs): exit 0 valid, 1 refused, 2 malformed."""
    from graphmode.recipe import load_recipe, validate
    from graphmode.targets.cost import saved_calibration
    try:
        recipe = load_recipe(path)
        facts = _model_facts(model, recipe) if model else None
        tgt = _target(recipe, target, cache_dir)
        cal, cal_note = saved_calibration(tgt, cache_dir, calibration)
        rep = validate(recipe, tgt, facts, timeout_ms=timeout_ms, calibration=cal)
        if recipe.sla is not None and any(p.name.startswith("sla") for p in rep.proofs):
            rep.notes.append(cal_note)
        if rep.errors:
            raise RecipeErrors(rep.errors)
        if as_json:
            print(json.dumps(rep.to_dict(), indent=2, default=str))
        else:
            _print_report(rep)
        try:
            rep.raise_for_errors()
        except ConstraintError as e:
            if not as_json:
                if rep.verdict == "unproved":    # nothing refuted it; a proof lacked what it needs (exit 1 all the same)
                    err_console.print(f"[bold yellow]not proved[/] (nothing refuted; exit 1 as for a refusal): "
                                      f"{type(e).__name__}", highlight=False)
                else:
                    err_console.print(f"[bold red]refused:[/] {type(e).__name__}", highlight=False)
                err_console.print(e.render(), markup=False, highlight=False, soft_wrap=True)
            raise SystemExit(e.exit_code)
    except GraphmodeError as e:
        fail(e, as_json)


def _model_facts(model: str, recipe):
    """The driver up to the graph's facts (exact weight bytes, the planner's activation peak):
    the model must pass the same verdict as compile (mismatches, fallbacks, padding) first;
    the command then proves with its own timeout and calibration."""
    from graphmode.compiler import lower_model
    if recipe.memory.kv_cache is not None:      # a decoder recipe: what generate and serve refuse, refused here
        from graphmode.capture.source import resolve_model
        from graphmode.decode.api import causal_lm
        from graphmode.decode.engine import check_decoder_recipe
        model = resolve_model(model, recipe)
        check_decoder_recipe(causal_lm(model, "--model"), recipe)
    with progress() as on_stage:
        return lower_model(model, recipe, None, on_stage=on_stage, prove_graph=False).facts


def check_parallel_errors(recipe, target) -> list:
    """Semantic problems of the `parallel` section (a summary of a broken group would mislead)."""
    from graphmode.recipe.parallel_checks import check_parallel
    from graphmode.recipe.buckets import dim_buckets
    return check_parallel(recipe, target, dim_buckets(recipe)) if recipe.parallel is not None else []


def _print_parallel(par: dict) -> None:
    at = ", ".join(f"{k}={v}" for k, v in par["at"].items())
    link = par["link"]
    console.print(f"tensor parallel: {par['tensor']} ranks on {', '.join(par['ranks'])} ({par['backend']}), link "
                  f"{link['name']} {link['bandwidth_gbps']:g} GB/s + {link['latency_us']:g} us, comm "
                  f"{par['comm_dtype']}, timeout {par['timeout_s']:g} s", highlight=False, markup=False)
    console.print(f"model facts: {par['facts_source']}", highlight=False, markup=False)
    mem = _table(f"memory per device at {at}", "term", "MB")
    for k, v in par["memory_mb"].items():
        mem.add_row(k, f"{v:.1f}")
    budget = f" of {par['budget_mb']:.0f} MB" if par["budget_mb"] else ""
    mem.add_row("total", f"{par['memory_total_mb']:.1f}{budget}")
    console.print(mem)
    if not par["comm"]:          # the collectives come from the model's shapes: none known, none estimated
        console.print("communication per step: not estimated (no model: section in the recipe, whose shapes size "
                      "the collectives; `graphmode compile --dry-run --model M` shows the sharded graph's)",
                      highlight=False, markup=False)
        return
    comm = _table(f"communication per step at {at}", "collective", "what", "count", "MB each", "link", "ms")
    for c in par["comm"]:
        comm.add_row(c["collective"], c["what"], str(c["count"]), f"{c['bytes'] / 1e6:.3f}", c["link"],
                     f"{c['ms']:.2f}")
    comm.add_row("total", "", "", f"{par['comm_bytes_per_step'] / 1e6:.3f}", "", f"{par['comm_ms_per_step']:.2f}")
    console.print(comm)


@recipe_app.command("show")
def show_cmd(path: Path = typer.Argument(..., help="recipe YAML file"),
             target: Optional[str] = typer.Option(None, "--target", "-t", help=_TARGET_HELP),
             as_json: bool = typer.Option(False, "--json", help="print JSON"),
             cache_dir: Optional[Path] = CacheDir) -> None:
    """The recipe resolved on the target, its hash, buckets with worst-case padding and the plan count."""
    from graphmode.recipe import load_recipe, resolve
    from graphmode.recipe.buckets import count_plans, dim_buckets, dim_synthesis
    from graphmode.recipe.hashing import recipe_hash
    try:
        recipe = load_recipe(path)
        tgt = _target(recipe, target, cache_dir)
        resolved = resolve(recipe, tgt)
        per_dim = dim_buckets(resolved)          # RecipeError if a synthesis is infeasible
        plans = count_plans(per_dim)
        dims = {d: dim_synthesis(s) for d, s in resolved.dims.items()}
        data = resolved.model_dump(mode="json", exclude_none=True)
        stamp = recipe_hash(resolved)
        from graphmode.parallel.report import parallel_summary
        par = parallel_summary(resolved, tgt) if not check_parallel_errors(resolved, tgt) else None
        if as_json:
            print(json.dumps({"name": resolved.name, "hash": stamp, "target": tgt.name,
                              "recipe": data, "plans": plans, "parallel": par,
                              "buckets": {d: {"values": per_dim[d], "worst_padding": float(s.worst_padding),
                                              "worst_padding_at": s.worst_value} for d, s in dims.items()},
                              "notes": resolved.notes}, indent=2))
            return
        console.print(f"# {resolved.name}  hash {stamp}  resolved on {tgt.name}", markup=False,
                      highlight=False, soft_wrap=True)
        console.print(yaml.safe_dump(data, sort_keys=False, default_flow_style=None, width=100).rstrip(),
                      markup=False, highlight=False, soft_wrap=True)
        console.print(_bucket_table(dims))
        console.print(f"plans: {plans} (one per bucket; warm-up compiles all of them)",
                      highlight=False)
        if par is not None:
            _print_parallel(par)
        for n in resolved.notes:
            console.print(f"note: {n}", markup=False, highlight=False)
    except GraphmodeError as e:
        fail(e, as_json)


@recipe_app.command("diff")
def diff_cmd(a: Path = typer.Argument(..., help="old recipe"), b: Path = typer.Argument(..., help="new recipe"),
             as_json: bool = typer.Option(False, "--json", help="print JSON")) -> None:
    """Field paths that differ between two recipes, with old and new values."""
    from graphmode.recipe import diff_recipes, load_recipe, recipe_hash
    try:
        ra, rb = load_recipe(a), load_recipe(b)
        changes = diff_recipes(ra, rb)
        if as_json:
            print(json.dumps({"a": {"path": str(a), "hash": recipe_hash(ra)},
                              "b": {"path": str(b), "hash": recipe_hash(rb)},
                              "changes": [c.to_dict() for c in changes]}, indent=2, default=str))
            return
        console.print(f"{a}: {recipe_hash(ra)}\n{b}: {recipe_hash(rb)}", markup=False, highlight=False)
        if not changes:
            console.print("no differences")
            return
        t = _table(f"{len(changes)} change(s)", "field", "change", "old", "new")
        for c in changes:
            t.add_row(c.path, c.kind, "" if c.kind == "added" else json.dumps(c.old, default=str),
                      "" if c.kind == "removed" else json.dumps(c.new, default=str))
        console.print(t)
    except GraphmodeError as e:
        fail(e, as_json)
