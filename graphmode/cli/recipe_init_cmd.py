"""`graphmode recipe init`: draft a complete, valid recipe for a model nobody wrote one for.

Registered on the `recipe` sub-command. The drafting itself is `graphmode.kb.draft` (the same
one `graphmode.compile(model)` uses without a recipe); this module only reads the options,
writes the file and says what came from where.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, List, Optional

import typer

from graphmode.cli.app import console, err_console
from graphmode.cli.options import MODEL_SPEC_HELP, KbPath, kb_file
from graphmode.cli.options import CacheDir
from graphmode.cli.progress import progress
from graphmode.cli.recipe_cmd import recipe_app
from graphmode.progress import stage


def parse_ranges(items: List[str]) -> dict[str, tuple]:
    """`--dim seq=2:128` options as {dim: (min, max)}; `--dim seq=2:128@input_ids:1,mask:1` names
    the input axes the dim goes on: {dim: (min, max, [(input, axis), ...])}."""
    from graphmode.errors import GraphmodeError
    out: dict[str, tuple] = {}
    for it in items:
        spec, _, at = it.partition("@")
        name, _, rng = spec.partition("=")
        lo, _, hi = rng.partition(":")
        axes = []
        try:
            lo_i, hi_i = int(lo), int(hi)
            for a in filter(None, at.split(",")):
                inp, _, ax = a.rpartition(":")
                axes.append((inp.strip(), int(ax)))
        except ValueError:
            lo_i = hi_i = 0
        if not name.strip() or not 1 <= lo_i <= hi_i or any(not inp for inp, _ in axes):
            raise GraphmodeError("expected NAME=MIN:MAX[@INPUT:AXIS,...] with 1 <= MIN <= MAX", where="--dim",
                                 value=it, fix="e.g. --dim seq=2:128, or --dim seq=2:128@input_ids:1 to add the dim "
                                               "on axis 1 of input_ids")
        name = name.strip()
        if name in out:               # the same dim again: its axes join, its range must agree
            before = out[name]
            if before[:2] != (lo_i, hi_i) or len(before) == 2 or not axes:
                raise GraphmodeError(f"--dim {name} is given twice, with different ranges or without the axes it "
                                     "goes on", where="--dim", value=it,
                                     fix=f"give it once with every axis: --dim {name}={lo_i}:{hi_i}@INPUT:AXIS,INPUT:AXIS")
            out[name] = (lo_i, hi_i, before[2] + [a for a in axes if a not in before[2]])
            continue
        out[name] = (lo_i, hi_i, axes) if axes else (lo_i, hi_i)
    return out


@recipe_app.command("draft", hidden=True, help="the same as `graphmode recipe init` (drafts a recipe)")
@recipe_app.command("init")
def init_cmd(model: str = typer.Option(..., "--model", help=MODEL_SPEC_HELP),
             target: Optional[str] = typer.Option(None, "--target", "-t", help="target name or file (default host)"),
             p99_ms: Optional[float] = typer.Option(None, "--p99-ms", help="latency bound for sla.p99_ms (proved "
                                                    "with the target's cost model)"),
             memory_mb: Optional[float] = typer.Option(None, "--memory-mb", help="memory.budget_mb (default: the "
                                                       "compiled graph's need at the largest bucket + 25%)"),
             max_p99_over_p50: Optional[float] = typer.Option(None, "--max-p99-over-p50",
                                                              help="determinism bound sla.max_p99_over_p50"),
             max_padding: Optional[float] = typer.Option(None, "--max-padding", help="padding bound for bucket "
                                                         "synthesis (default 0.25)"),
             max_buckets: Optional[int] = typer.Option(None, "--max-buckets", min=1, help="bucket limit per dim"),
             dim: List[str] = typer.Option([], "--dim", help="a dim's admissible range, e.g. --dim seq=2:128; a dim the "
                                           "model does not have goes on the input axes named after @, e.g. "
                                           "--dim seq=2:128@x:1 (repeatable; default: the model's config or "
                                           "graphmode's defaults)"),
             objective: str = typer.Option("latency", "--objective", help="latency | throughput"),
             tensor: int = typer.Option(1, "--tensor", min=1, help="tensor-parallel ranks on this machine: writes "
                                        "the parallel section (strategy, device group, loopback link)"),
             name: Optional[str] = typer.Option(None, "--name", help="recipe name (default <model>-draft)"),
             out: Optional[Path] = typer.Option(None, "--out", "-o", help="write the recipe here (default stdout)"),
             force: bool = typer.Option(False, "--force", help="overwrite --out if it exists"),
             kb: Optional[Path] = KbPath, cache_dir: Optional[Path] = CacheDir,
             as_json: bool = typer.Option(False, "--json", help="print the recipe, its notes and the verdict as JSON")
             ) -> None:
    """Draft a recipe for a model: inputs and dims from its signature and config, buckets under a
    padding bound, precision and fusion from the knowledge base's nearest entries; validated,
    with a comment on every value saying where it came from."""
    from graphmode.errors import GraphmodeError
    from graphmode.kb.draft import draft_recipe
    from graphmode.kb.draft_parallel import with_tensor
    from graphmode.kb.recommend import check_objective
    from graphmode.paths import cache_layout
    from graphmode.recipe import recipe_hash
    check_objective(objective)
    if out is not None and out.exists() and not force:
        raise GraphmodeError("the output file exists", where="--out", value=str(out),
                             fix="pass --force to overwrite it, or another --out")
    if out is not None:
        from graphmode.paths import writable_output
        writable_output(out, "--out")
    try:
        with progress() as on_stage, stage(on_stage, "draft", detail=f"{model}: capture, passes, proof"):
            draft = draft_recipe(model, target=target or "host", p99_ms=p99_ms, memory_mb=memory_mb,
                                 ranges=parse_ranges(dim), max_p99_over_p50=max_p99_over_p50, max_padding=max_padding,
                                 max_buckets=max_buckets, kb_path=kb_file(kb, cache_dir), objective=objective,
                                 name=name, target_cache_dir=cache_layout(cache_dir).targets)
            draft = with_tensor(draft, tensor, draft.report.target)
    except GraphmodeError as e:
        raise _in_flags(e, memory_mb) from None
    text = draft.yaml()
    if out is not None:
        out.write_text(text, encoding="utf-8")
    for w in draft.warnings:
        err_console.print(f"warning: {w}", markup=False, highlight=False, style="yellow", soft_wrap=True)
    if as_json:
        print(json.dumps({"recipe": draft.data, "notes": draft.notes, "hash": recipe_hash(draft.recipe),
                          "verdict": draft.report.verdict, "target": draft.report.target.name,
                          "plans": draft.report.plans, "padding": draft.verdict.lines(),
                          "model": {k: draft.model[k] for k in ("name", "family", "fingerprint", "params")},
                          "knowledge_base": [r.to_json(objective) for r in draft.recommendations[:3]],
                          "written": str(out) if out else None}, indent=1, default=str))
        return
    if out is None:
        console.print(text, markup=False, highlight=False, soft_wrap=True, end="")
    summary = (f"{'wrote ' + str(out) + ': ' if out else ''}recipe {draft.recipe.name} ({recipe_hash(draft.recipe)}), "
               f"{draft.report.verdict} on {draft.report.target.name}, {draft.report.plans} plan(s)"
               + "".join(f"; {line}" for line in draft.verdict.lines()))
    err_console.print(summary, markup=False, highlight=False, soft_wrap=True)


def _in_flags(e: Any, memory_mb: Optional[float]) -> Any:
    """A refusal of the drafted recipe's fields, its fix said in this command's flags (the user
    wrote --memory-mb and --dim, not memory.budget_mb and dims.seq); each field error of several."""
    for err in getattr(e, "errors", None) or [e]:
        where, fix = err.where or "", err.fix or ""
        if "memory.budget_mb" in where + fix:
            err.fix = (f"{fix} (here: --memory-mb)" if memory_mb is not None else
                       "the draft sizes memory.budget_mb for the largest request its dims admit: lower a --dim's "
                       "MAX (or pass --memory-mb)")
        elif where.endswith((".max_padding", ".max_buckets")) and ": " not in fix:   # the flag's value itself
            flag = "--max-padding" if where.endswith(".max_padding") else "--max-buckets"
            err.fix = f"{fix} (here: {flag})"
        elif where.startswith("dims."):
            said = fix.replace("max_buckets: ", "--max-buckets ").replace("max_padding: ", "--max-padding ")
            err.fix = (f"{said}, or --dim {where.split('.')[1]}=MIN:MAX" if said != fix else
                       f"{fix or 'change its range'} (here: --dim {where.split('.')[1]}=MIN:MAX)")
        err.args = (err.render(),)
    e.args = (e.render(),)
    return e
