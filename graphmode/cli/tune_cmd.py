"""`graphmode tune`: search a recipe's knobs against its SLA and memory budget, within a time budget.

Every trial is verified against eager and recorded (journal beside the recipe, knowledge
base); the result is a Pareto table and, when a configuration beats the recipe as written,
its next version written beside it with `recipe diff` shown. Interrupted, the same command
resumes: finished trials are replayed from the journal.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, List, Optional

import typer
from rich import box
from rich.table import Table

from graphmode.cli.app import app, console, err_console
from graphmode.cli.options import MODEL_SPEC_HELP, KbPath, kb_file
from graphmode.cli.options import CacheDir
from graphmode.kb.render import shown



def _threads(text: Optional[str]) -> list[int]:
    from graphmode.errors import GraphmodeError
    from graphmode.targets.host import usable_cores
    cores = usable_cores()
    if text is None:
        return list(dict.fromkeys([cores, 1]))
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        vals = []
    if vals and any(v < 1 for v in vals):
        raise GraphmodeError("a thread count must be at least 1", where="--threads", value=text,
                             fix=f"e.g. --threads {cores},1 (the first is the recipe's baseline)")
    if not vals:
        raise GraphmodeError("expected a comma list of thread counts", where="--threads", value=text,
                             fix=f"e.g. --threads {cores},1 (the first is the recipe's baseline)")
    return list(dict.fromkeys(vals))


def _trial_table(title: str, trials: list, base_cfg: dict) -> Table:
    from graphmode.tune.space import describe
    t = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    for c in ("#", "change", "status", "p50 ms", "p99 ms", "p99/p50", "items/s", "mem MB", "compile s", "rel L2"):
        t.add_column(c, overflow="fold")
    for r in trials:
        m = r.metrics
        st = {"ok": "green", "violates": "yellow", "failed": "red"}[r.status]
        t.add_row(str(r.index), describe(r.config, base_cfg), f"[{st}]{r.status}[/]", shown(m.get("p50_ms")),
                  shown(m.get("p99_ms")), shown(m.get("p99_over_p50")), shown(m.get("throughput")),
                  shown(m.get("peak_memory_mb")), shown(m.get("compile_s")),
                  "-" if m.get("numerics_err") is None else f"{m['numerics_err']:.1e}")
    return t


@app.command("tune")
def tune_cmd(model: str = typer.Option(..., "--model", help=MODEL_SPEC_HELP),
             recipe: Optional[Path] = typer.Option(None, "--recipe", help="the recipe to tune (its next version is "
                                                   "written beside it; default: a draft, as `recipe init` writes it, "
                                                   "in ./<model>-draft.yaml)"),
             budget_s: float = typer.Option(..., "--budget-s", min=1, help="wall-clock budget: no trial starts that "
                                            "would end past it"),
             objective: str = typer.Option("latency", "--objective", help="latency (p99 first) | throughput"),
             target: Optional[str] = typer.Option(None, "--target", help="target name or file (default: the "
                                                  "recipe's)"),
             tol: Optional[float] = typer.Option(None, "--tol", min=0, help="rel L2 vs eager a trial may reach "
                                                 "(default: the recipe's compute dtype's; bf16 is tried from 2e-2)"),
             max_buckets: Optional[int] = typer.Option(None, "--max-buckets", min=1, help="bucket limit per dim "
                                                       "(default: the recipe's max_buckets, else 32)"),
             threads: Optional[str] = typer.Option(None, "--threads", help="thread counts to try, e.g. 2,1 "
                                                   "(default: all usable cores, then 1)"),
             measure_s: Optional[float] = typer.Option(None, "--measure-s", min=0.01, help="timing per trial (default "
                                                       "budget/20, 0.3..3 s)"),
             out: Optional[Path] = typer.Option(None, "--out", help="where to write the tuned recipe (default "
                                                "<recipe>.vN.yaml beside it)"),
             only: List[str] = typer.Option([], "--only", help="search only these knobs (repeatable): dims, fusion, "
                                            "precision, threads, kernel_selection, or one axis like dims.seq"),
             fresh: bool = typer.Option(False, "--fresh", help="ignore the journal: measure every trial again"),
             kb: Optional[Path] = KbPath, cache_dir: Optional[Path] = CacheDir,
             as_json: bool = typer.Option(False, "--json")) -> None:
    """Tune a recipe: bucket sets, fusion, kernel selection, threads and precision, against its SLA,
    memory budget and numerics, latency-first or throughput-first."""
    from graphmode.kb.fingerprint import digest, hardware_of, model_of, recipe_inputs
    from graphmode.kb.record import Subject, perf, record
    from graphmode.kb.recommend import check_objective
    from graphmode.paths import cache_layout
    from graphmode.recipe import load_recipe, parse_yaml, recipe_hash
    from graphmode.recipe.targets import pick_target
    from graphmode.tune.journal import Journal
    from graphmode.tune.search import run_search
    from graphmode.tune.space import baseline, describe, search_space, select_axes
    from graphmode.tune.trial import TrialRunner
    from graphmode.verify.numerics import TOLERANCE

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    t_start = time.monotonic()
    check_objective(objective)
    layout = cache_layout(cache_dir)
    log = (lambda s: None) if as_json else (lambda s: err_console.print(s, markup=False, highlight=False))
    if recipe is None:
        recipe = _draft_to_start(model, target, kb_file(kb, cache_dir), objective, layout, log)
    base = load_recipe(recipe)
    base_data, _, _ = parse_yaml(recipe.read_bytes(), str(recipe))
    tgt = pick_target(base, target, cache_dir=layout.targets)
    tol = tol if tol is not None else TOLERANCE.get(base.precision.compute, TOLERANCE["f32"])
    measure = measure_s if measure_s is not None else min(3.0, max(0.3, budget_s / 20))
    kb_path = kb_file(kb, cache_dir)
    axes = select_axes(search_space(base, tgt, objective=objective, tol=tol, max_buckets=max_buckets,
                                    threads=_threads(threads)), only)
    log(f"capturing {model} ...")
    runner = TrialRunner(model, base_data, tgt, tol=tol, measure_s=measure, cache_dir=layout.root)
    base_cfg = baseline(axes)
    model_row = model_of(runner.graph0, runner.src, recipe_inputs(base))
    run_key = digest({"recipe": recipe_hash(base), "model": model_row["fingerprint"], "hardware": hardware_of(tgt)
                      ["fingerprint"], "objective": objective, "tol": tol, "axes": [[a.name, a.values] for a in axes],
                      "workload": runner.shapes})
    journal = Journal(recipe.with_name(recipe.stem + ".tune.jsonl"), run_key)
    journal.hold()
    session = journal.session(fresh)           # the knowledge base's comparison: this run, resumed or not
    journal.start({"recipe": str(recipe), "hash": recipe_hash(base), "model": model, "objective": objective,
                   "budget_s": budget_s, "target": tgt.name, "time": time.time(), "fresh": fresh, "session": session})
    for a in axes:
        for n in a.notes:
            log(f"search space: {a.name}: {n}")
    if base.memory.kv_cache is not None:
        log("note: a decoder recipe: trials time its whole-sequence forward pass (the prefill), not the decode "
            "steps generate and serve run token by token (graphmode bench decode measures those)")
    warned: list[str] = []

    def remember(r, **extra) -> None:
        written = (r.recipe_hash or recipe_hash(r.recipe or base)) == recipe_hash(base)    # the recipe as written
        subj = Subject(r.recipe or base, tgt, runner.src, runner.graph0, r.ir_hash,
                       origin="measured" if written else "tune", parent=None if written else recipe_hash(base))
        row = perf("tune", status=r.status, reason=r.reason, threads=r.config.get("threads"),
                   extra={"run": session, "trial": r.index, "change": describe(r.config, base_cfg),
                          "samples": r.samples, **extra}, **r.metrics)
        w = record(kb_path, subj, [row])
        if w and not warned:
            warned.append(w)
            err_console.print(f"warning: {w}", markup=False, highlight=False, style="yellow", soft_wrap=True)

    def on_trial(r) -> None:
        if not r.replayed and r.same_as is None:     # (a copy of another trial's numbers is no measurement)
            remember(r)
        if bar is not None:
            bar.update(task, completed=min(budget_s, time.monotonic() - t_start),
                       description=f"trial {r.index} ({'replayed' if r.replayed else r.status}): "
                                   f"{describe(r.config, base_cfg)}")
        m = r.metrics
        log(f"trial {r.index}{' (journal)' if r.replayed else ''}: {describe(r.config, base_cfg)}: {r.status}"
            + (f", p99 {shown(m.get('p99_ms'))} ms, {shown(m.get('throughput'))} items/s" if m else "")
            + (f" ({r.reason.splitlines()[0][:200]})" if r.reason else "")
            + (f" (the compiled graph and plan of trial {r.same_as}: not timed again)" if r.same_as is not None
               else ""))

    bar = task = None
    try:
        if not as_json:
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
            bar = Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(), console=err_console,
                           transient=True)
            bar.start()
            task = bar.add_task("tuning", total=budget_s)
        result = run_search(runner.run, axes, budget_s=budget_s, objective=objective, journal=journal,
                            on_trial=on_trial, start=t_start)
    except KeyboardInterrupt:
        if bar is not None:
            bar.stop()
        again = "run the same command without --fresh to resume" if fresh else "run the same command again to resume"
        err_console.print(f"interrupted: the finished trials are in {journal.path}; {again}", markup=False,
                          highlight=False)
        raise SystemExit(130)
    finally:
        if bar is not None:
            bar.stop()
    if result.confirmation is not None:      # measured again side by side: what kb recommend ranks them by
        for which in ("best", "baseline"):
            remember(result.confirmation[which], confirmation=which, held=bool(result.confirmation["held"]))
    if journal.skipped:
        log(f"{journal.path}: {journal.skipped} line(s) are not trials graphmode wrote (cut off, or edited); "
            "they were not replayed")
    _report(result, base_cfg, recipe, base_data, objective, tgt, as_json, out, journal)
    journal.release()


def _draft_to_start(model: str, target: Optional[str], kb_path: Path, objective: str, layout: Any,
                    log: Any) -> Path:
    """The recipe a tune without --recipe starts from: the draft `recipe init` would write, in
    ./<name>.yaml (kept there, so the same command resumes from its journal)."""
    from graphmode.kb.draft import draft_recipe
    draft = draft_recipe(model, target=target or "host", kb_path=kb_path, objective=objective,
                         target_cache_dir=layout.targets)
    path = Path(f"{draft.recipe.name}.yaml")
    if path.exists():
        log(f"tuning {path} (the draft written by an earlier tune of {model})")
        return path
    path.write_text(draft.yaml(), encoding="utf-8")
    log(f"no --recipe: drafted {path} ({draft.report.plans} plan(s), {draft.report.verdict} on "
        f"{draft.report.target.name}); tuning it")
    return path


def _confirmation_json(c: Optional[dict]) -> Optional[dict]:
    if c is None:
        return None
    return {"held": c["held"], "best": c["best"].to_json(), "baseline": c["baseline"].to_json(),
            "kept_contract_again": c.get("contract", False)}


def _print_confirmation(c: Optional[dict], describe: Any, base_cfg: dict) -> None:
    """The best and the recipe as written, measured again one after the other: the change is
    kept only where it wins again."""
    if c is None:
        return
    b, a = c["best"].metrics, c["baseline"].metrics
    said = (f"measured again: {describe(c['best'].config, base_cfg)} p99 {shown(b.get('p99_ms'))} ms, "
            f"{shown(b.get('throughput'))} items/s; the recipe as written p99 {shown(a.get('p99_ms'))} ms, "
            f"{shown(a.get('throughput'))} items/s")
    if c.get("contract"):       # the recipe as written broke its contract: the best had to keep it again
        verdict = "confirmed: it keeps the contract" if c["held"] else \
            f"it broke the contract this time ({c['best'].reason}), so no version is written"
    else:
        verdict = "confirmed" if c["held"] else "the gain did not repeat, so the recipe as written stays"
    console.print(f"{said}: {verdict}", markup=False, highlight=False, soft_wrap=True)


def _report(result: Any, base_cfg: dict, recipe: Path, base_data: dict, objective: str, tgt: Any, as_json: bool,
            out: Optional[Path], journal: Any) -> None:
    from graphmode.errors import ConstraintError
    from graphmode.recipe import diff_recipes, load_recipe
    from graphmode.tune.space import describe
    from graphmode.tune.version import write_version
    written, new = None, False
    best = result.best
    knobs = {k for k, v in (best.config if best else {}).items() if result.baseline.config.get(k) != v}
    if best is not None and best.key != result.baseline.key and knobs != {"threads"}:
        c = result.confirmation          # the header states the numbers measured again, one after the other
        written, _, new = write_version(recipe, base_data, c["baseline"] if c else result.baseline,
                                        c["best"] if c else best, objective=objective,
                                        hardware=tgt.name, trials=len(result.trials), out=out)
    counts = {s: sum(t.status == s for t in result.trials) for s in ("ok", "violates", "failed")}
    if as_json:
        changes = diff_recipes(load_recipe(recipe), load_recipe(written)) if written else []
        print(json.dumps({"stopped": result.stopped, "resumed": result.resumed, "journal": str(journal.path),
                          "counts": counts, "trials": [dict(t.to_json(), change=describe(t.config, base_cfg))
                                                       for t in result.trials],
                          "pareto": [t.index for t in result.pareto], "best": best.index if best else None,
                          "cut_off": describe(result.cut_off, base_cfg) if result.cut_off else None,
                          "written": str(written) if written else None,
                          "confirmation": _confirmation_json(result.confirmation),
                          "diff": [c.to_dict() for c in changes]}, indent=1, default=str))
    else:
        console.print(_trial_table(f"Pareto set: {len(result.pareto)} of {counts['ok']} trial(s) that kept the "
                                   "contract (p99, throughput, memory, compile time)", result.pareto, base_cfg))
        bad = [t for t in result.trials if t.status != "ok"]
        if bad:
            console.print(_trial_table(f"{len(bad)} trial(s) that violated the contract or failed", bad, base_cfg))
            for t in bad:
                console.print(f"  trial {t.index}: {t.status}: {t.reason}", markup=False, highlight=False,
                              soft_wrap=True)
        if result.cut_off is not None:
            console.print(f"the budget ended inside the trial {describe(result.cut_off, base_cfg)}: it is not a result "
                          "(not journaled); run the same command again to measure it", markup=False, highlight=False,
                          soft_wrap=True)
        console.print(f"{len(result.trials)} trial(s) ({result.resumed} from the journal {journal.path}), "
                      f"{counts['ok']} ok, {counts['violates']} violate, {counts['failed']} failed; stopped: "
                      f"{'budget spent' if result.stopped == 'budget' else 'no change improves the best'}",
                      markup=False, highlight=False, soft_wrap=True)
        _print_confirmation(result.confirmation, describe, base_cfg)
        if knobs == {"threads"}:
            console.print(f"best (trial {best.index}, {objective}-first): {describe(best.config, base_cfg)}, not a "
                          f"recipe field: the recipe as written stays; run and serve it with --threads "
                          f"{best.config['threads']}", markup=False, highlight=False, soft_wrap=True)
        elif written:
            console.print(f"best (trial {best.index}, {objective}-first): {describe(best.config, base_cfg)}; "
                          f"{'wrote' if new else 'already written as'} {written}", markup=False, highlight=False,
                          soft_wrap=True)
            from graphmode.cli.recipe_cmd import diff_cmd
            diff_cmd(recipe, written, as_json=False)
        elif best is not None:
            from graphmode.tune.search import MIN_GAIN
            console.print(f"the recipe as written is the best configuration found: no trial beat it by more than "
                          f"{MIN_GAIN:.0%} on the {objective} objective (and kept that gain measured again); no new "
                          "version written", markup=False, highlight=False, soft_wrap=True)
    if best is None:
        raise ConstraintError("no configuration kept the contract", where=str(recipe),
                              fix=f"the recipe as written: {result.baseline.status}: {result.baseline.reason}; relax "
                                  "its SLA or memory budget, or raise --tol / --budget-s")
