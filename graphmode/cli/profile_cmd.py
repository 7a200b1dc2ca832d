"""`graphmode profile`: per-instruction timing of a compiled plan, the executor's overhead next
to eager PyTorch's dispatch cost, and calibration of the `host` cost model.

Calibration files: <cache root>/calibration/<target>.json (the fitted Calibration) and
<target>.samples.json beside it (every profiled bucket, so one calibration covers every
model profiled on the machine). Cache root: --cache-dir (graphmode.paths); --calibration PATH
overrides the file.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import List, Optional

import typer
from rich import box
from rich.table import Table

from graphmode.cli.app import app, console, err_console
from graphmode.cli.options import KbPath, kb_file
from graphmode.cli.options import CacheDir
from graphmode.cli.progress import progress
from graphmode.paths import shown
from graphmode.progress import stage



def _pct(e: Optional[float]) -> str:
    return "-" if e is None else f"{e * 100:+.0f}%"


def _ms(s: Optional[float]) -> str:
    if s is None:
        return "-"
    ms = s * 1e3
    return f"{ms:.3f}" if ms < 1 else (f"{ms:.2f}" if ms < 100 else f"{ms:.1f}")


def _shapes(s) -> str:
    ins = ", ".join("x".join(map(str, x)) or "scalar" for x in s.in_shapes[:3]) + (" …" if len(s.in_shapes) > 3 else "")
    outs = ", ".join("x".join(map(str, x)) for x in s.out_shapes)
    return f"{ins} -> {outs}"


def print_profile(prof, top: int) -> None:
    b = ",".join(f"{k}={v}" for k, v in prof.bucket.items())
    load = f", machine load {prof.loadavg[0]:.2f}" if prof.loadavg else ""
    console.print(f"\n[bold]{prof.model}[/] bucket {b}: {prof.n_steps} steps, {prof.threads} thread(s), "
                  f"median of {prof.runs} runs{load}", highlight=False)
    # medians of different samples: they need not add up (the run's median is not steps' + executor's)
    line = (f"  plan run {_ms(prof.run_s)} ms (median run); steps {_ms(prof.steps_sum_s)} ms (sum of each step's "
            f"median); executor {_ms(prof.gap_s)} ms (median of a run less its steps: input copies "
            f"{_ms(prof.copy_in_s)}, output clones {_ms(prof.clone_out_s)})")
    if prof.call_s is not None:
        line += f"; CompiledModel call {_ms(prof.call_s)} ms"
        if prof.check_s is not None:
            line += (f" (of it, input value checks {_ms(prof.check_s)} ms"
                     + (f" on {', '.join(prof.checked_inputs)})" if prof.checked_inputs else ": none needed)"))
    if prof.eager_s is not None:
        line += f"; eager {_ms(prof.eager_s)} ms"
    console.print(line, highlight=False)
    t = Table(title=f"top {top} instructions by time", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False,
              padding=(0, 1))
    for c in ("#", "instruction", "shapes (in -> out)", "ms", "share", "GFLOP/s", "GB/s", "roofline ms", "bound",
              "of roof"):
        t.add_column(c, justify="left" if c in ("instruction", "shapes (in -> out)", "bound") else "right",
                     overflow="fold")
    above = {b["step"] for b in prof.above_roofline}
    for s in prof.top(top):
        body = f" [{'+'.join(s.body_ops)}]" if s.body_ops else ""
        t.add_row(str(s.index), s.name + body, _shapes(s), _ms(s.time_s), f"{s.share * 100:.1f}%",
                  "-" if s.gflops is None else f"{s.gflops:.1f}", "-" if s.gbps is None else f"{s.gbps:.1f}",
                  _ms(s.roofline_s), s.bound, "-" if s.roofline_frac is None else
                  f"{s.roofline_frac * 100:.0f}%" + ("!" if s.index in above else ""))
    console.print(t)
    print_breaches(prof.above_roofline)
    k = Table(title="time by instruction kind", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False,
              padding=(0, 1))
    for c in ("kind:op", "count", "ms", "share", "GFLOP/s", "roofline ms"):
        k.add_column(c, justify="left" if c == "kind:op" else "right", overflow="fold")
    for a in prof.by_kind():
        gf = a["flops"] / a["time_s"] / 1e9 if a["time_s"] > 0 and a["flops"] else None
        k.add_row(a["name"], str(a["count"]), _ms(a["time_s"]), f"{a['share'] * 100:.1f}%",
                  "-" if gf is None else f"{gf:.1f}", _ms(a["roofline_s"]))
    console.print(k)
    floor = prof.dispatch_floor_us()
    console.print(f"  executor overhead: {prof.gap_per_instruction_us:.1f} µs per instruction (executor / "
                  f"{prof.n_steps} steps); {prof.executor_overhead_us:.1f} µs without input copies and output clones"
                  + (f"; dispatch floor of a step with no work {floor:.1f} µs" if floor is not None else ""),
                  highlight=False)
    if prof.dispatch_us is not None:
        est = f", {prof.eager_ops} ATen ops per eager forward ≈ {prof.eager_ops * prof.dispatch_us / 1e3:.2f} ms " \
              f"of dispatch" if prof.eager_ops else ""
        console.print(f"  eager PyTorch dispatch: {prof.dispatch_us:.1f} µs per tiny torch.add "
                      f"({prof.dispatch_out_us:.1f} µs with out=){est}; graphmode: {prof.n_steps} steps",
                      highlight=False)
    if prof.noisy:
        console.print(f"  [yellow]warning:[/] the run totals spread {prof.spread:.2f}x (p90 / median): other work "
                      f"disturbed this measurement; profile it again on a quiet machine before calibrating",
                      highlight=False)
    for n in prof.notes:
        console.print(f"  note: {n}", highlight=False, markup=False)


def print_breaches(breaches, shown: int = 8) -> None:
    """Steps above their roofline ('!' in the table): a roofline is an upper bound, so each is a
    measurement problem to name, not an efficiency to print. Probe and peak problems one line
    each; steps that ran on cached data in one line, indexed reads in another."""
    loud = [b for b in breaches if b["cause"] not in ("cache", "gather")]
    cached = [b for b in breaches if b["cause"] == "cache"]
    gathers = [b for b in breaches if b["cause"] == "gather"]
    if loud:
        console.print(f"  [yellow]warning:[/] {len(loud)} instruction(s) ran above the host's roofline, so the probe "
                      "under-measured it; their 'of roof' is not an efficiency:", highlight=False)
        for b in loud[:shown]:
            console.print(f"    {b['why']}", markup=False, highlight=False, soft_wrap=True)
        if len(loud) > shown:
            console.print(f"    ... and {len(loud) - shown} more (--json lists every one)", highlight=False)
    if cached:
        steps = ", ".join(f"#{b['step']}" for b in cached[:shown]) + (" ..." if len(cached) > shown else "")
        console.print(f"  note: {len(cached)} instruction(s) ran above the memory roofline on data in cache ({steps}; "
                      f"e.g. {cached[0]['why']})", markup=False, highlight=False, soft_wrap=True)
    if gathers:
        steps = ", ".join(f"#{b['step']}" for b in gathers[:shown]) + (" ..." if len(gathers) > shown else "")
        console.print(f"  note: {len(gathers)} indexed read(s) count every row they could pick ({steps}; "
                      f"e.g. {gathers[0]['why']})", markup=False, highlight=False, soft_wrap=True)


def print_predictions(rows, cal, source: str) -> None:
    t = Table(title="predicted vs measured plan latency per bucket (err = predicted / measured - 1)",
              title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1))
    prev = any(r.previous_s is not None for r in rows)
    cols = ["model", "bucket", "measured ms", "roofline ms", "err", "calibrated ms", "err", "leave-model-out err",
            "recipe model err", "recipe model cal. err"]
    if prev:
        cols.append("previous cal. err")
    for c in cols:
        t.add_column(c, justify="left" if c in ("model", "bucket") else "right", overflow="fold")
    for r in rows:
        bucket = ",".join(f"{k}={v}" for k, v in r.bucket.items()) + (" (noisy)" if r.noisy else "")
        cells = [r.model, bucket, _ms(r.measured_s), _ms(r.roofline_s),
                 _pct(r.err(r.roofline_s, r.measured_s)), _ms(r.calibrated_s), _pct(r.err(r.calibrated_s, r.measured_s)),
                 _pct(r.err(r.loo_s, r.measured_s)), _pct(r.err(r.recipe_model_s, r.measured_s)),
                 _pct(r.err(r.recipe_model_cal_s, r.measured_s))]
        if prev:
            cells.append(_pct(r.err(r.previous_s, r.measured_s)))
        t.add_row(*cells)
    console.print(t)
    eff = ", ".join(f"{k} {v:.3g}" for k, v in sorted(cal.op_efficiency.items()) if "|" not in k)
    refined = sum("|" in k for k in cal.op_efficiency)
    eff += f" (+{refined} refined keys in the file)" if refined else ""
    console.print(f"  calibration ({source}): overhead {cal.overhead_us} µs/instruction, efficiency {eff}, default "
                  f"{cal.default_efficiency:.3g}, whole-model {cal.model_efficiency}", highlight=False)
    if "capped at efficiency 1" in (cal.note or ""):
        err_console.print(f"[yellow]note[/]: {cal.note.split('; ', 1)[-1]}", highlight=False)


def _decode_shape(text: str) -> tuple[int, int]:
    from graphmode.errors import GraphmodeError
    try:
        b, c = (int(v) for v in text.lower().split("x"))
        if b >= 1 and c >= 1:
            return b, c
    except ValueError:
        pass
    raise GraphmodeError("a decode shape is BATCHxCONTEXT with both >= 1", where="--decode", value=text,
                         fix="e.g. --decode 1x128")


def _profile_decode(case, rec, steps, target, runs: int, threads: int, cache: str, on_stage) -> list:
    """The decode engine's step of `case` under decoder recipe `rec` at each (batch, context)."""
    import graphmode
    from graphmode.bench.profile import profile_executable
    from graphmode.decode.api import engine_of
    cm = graphmode.compile(case.bundle, rec, "host", mode="eager", cache_dir=cache, threads=threads,
                           on_stage=on_stage)
    eng = engine_of(cm)
    out = []
    with stage(on_stage, "profile", total=len(steps), detail=f"{case.name} decode") as profiling:
        for b, c in steps:
            with eng.decode_probe(b, c) as (exe, inputs):
                prof = profile_executable(exe, inputs, target, runs=runs, model=f"{case.name}-decode",
                                          threads=threads)
            prof.bucket = {"batch": b, "context": c}
            out.append(prof)
            profiling.step(f"{case.name} decode batch={b} context={c}")
    return out


@app.command("profile")
def profile_cmd(
    model: Optional[List[str]] = typer.Option(None, "--model", help="minilm | gpt2 | resnet18 | "
                                              "path/file.py:function | package.module:function (repeatable)"),
    recipe: Optional[Path] = typer.Option(None, "--recipe", help="recipe (default: buckets exactly at the shapes)"),
    shape: Optional[List[str]] = typer.Option(None, "--shape", help="first-input shape, e.g. 1x128 (repeatable; "
                                              "default: the model's benchmark shapes)"),
    runs: int = typer.Option(20, "--runs", min=1, help="timed runs (median per instruction)"),
    threads: int = typer.Option(2, "--threads", min=1, max=1024),
    top: int = typer.Option(15, "--top", min=1, help="instructions to list"),
    calibrate: bool = typer.Option(False, "--calibrate", help="add these measurements to the target's samples, "
                                   "refit and save its calibration"),
    calibration: Optional[Path] = typer.Option(None, "--calibration", help="calibration JSON (default "
                                               "<cache>/calibration/host.json)"),
    cache_dir: Optional[Path] = CacheDir,
    kb: Optional[Path] = KbPath,
    no_eager: bool = typer.Option(False, "--no-eager", help="skip the eager timing and dispatch measurements"),
    refit: bool = typer.Option(False, "--refit", help="refit and save the calibration from the stored samples "
                               "(after a host re-probe or a cost-model change); with no --model nothing is measured"),
    decode: Optional[List[str]] = typer.Option(None, "--decode", help="profile the decode engine's step at "
                                               "BATCHxCONTEXT instead, e.g. 1x128 (repeatable; needs a decoder "
                                               "--recipe with memory.kv_cache)"),
    as_json: bool = typer.Option(False, "--json", help="print JSON"),
) -> None:
    """Time every instruction of a compiled plan (or of the decode engine's step, --decode);
    calibrate the host cost model from it."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    import graphmode
    from graphmode.bench.models import auto_recipe, load_cases
    from graphmode.bench.profile import (SampleStore, fit_calibration, prediction_table, profile_bucket, within)
    from graphmode.errors import GraphmodeError, TargetError
    from graphmode.kb.record import record_profiles
    from graphmode.paths import cache_layout
    from graphmode.recipe import load_recipe
    from graphmode.runtime.compiled import CompiledModel
    from graphmode.targets import get_target
    from graphmode.targets.cost import Calibration

    if not model and not refit:
        raise GraphmodeError("nothing to profile", where="--model",
                             fix="give --model NAME (repeatable), or --refit to refit the stored calibration")
    layout = cache_layout(cache_dir)
    torch.set_num_threads(threads)
    target = get_target("host", cache_dir=layout.targets)
    cal_path = calibration or layout.calibration(target.name)
    if calibrate or refit:        # checked before measuring: a place it cannot save lost the measurements
        from graphmode.paths import writable_output
        writable_output(cal_path, "--calibration" if calibration else "--cache-dir")
    log = (lambda s: err_console.print(s, markup=False, highlight=False)) if not as_json else (lambda s: None)
    profiles, tp_profiles = [], []
    with tempfile.TemporaryDirectory(prefix="graphmode-profile-") as tmp, progress(measuring=True) as on_stage:
        if decode and (recipe is None or shape):
            raise GraphmodeError("--decode profiles the decode engine of a decoder recipe", where="--decode",
                                 value=list(decode), fix="give --recipe with memory.kv_cache, and no --shape")
        steps = [_decode_shape(d) for d in decode or []]
        for case in load_cases(model or [], shape or [], recipe=load_recipe(recipe) if recipe else None) \
                if model else []:
            rec = load_recipe(recipe if recipe is not None else auto_recipe(case.bundle, case.envs))
            if rec.parallel is not None and rec.parallel.tensor > 1 and not steps:
                from graphmode.bench.tensor_parallel import profile_tp
                tp_profiles += profile_tp(case, rec, target, runs, max(1, threads // rec.parallel.tensor), tmp,
                                          on_stage)
                continue
            if steps:
                profiles += _profile_decode(case, rec, steps, target, runs, threads, tmp, on_stage)
                continue
            cm = graphmode.compile(case.bundle, rec, "host", cache_dir=tmp, threads=threads, on_stage=on_stage)
            first = len(profiles)
            with stage(on_stage, "profile", total=len(case.envs), detail=case.name) as profiling:
                for env in case.envs:
                    bucket = rec.bucket_for(env)
                    if bucket is None:
                        raise GraphmodeError(f"shape {env} is outside the recipe's dims", where="--shape",
                                             value=env, fix=f"the recipe's buckets: {rec.dim_buckets()}")
                    profiles.append(profile_bucket(cm, rec, bucket, target, runs=runs, model=case.name,
                                                   threads=threads, eager=not no_eager))
                    profiling.step(f"{case.name} {CompiledModel.bucket_key(bucket)}")
            note = record_profiles(kb_file(kb, cache_dir), cm, rec, profiles[first:], target)
            if note:
                log(note)
    if tp_profiles and not profiles:      # a tensor-parallel group: its communication, no plan to calibrate
        from graphmode.cli.bench_tp import print_tp_profile
        if as_json:
            print(json.dumps({"target": target.name, "tensor_parallel": tp_profiles}, indent=1, default=str))
        else:
            print_tp_profile(tp_profiles)
        return
    previous = None
    if cal_path.is_file():
        try:
            previous = Calibration.load(cal_path)
        except TargetError as e:
            log(f"ignoring the unreadable calibration {cal_path}: {e}")
    store = SampleStore(SampleStore.path_for(cal_path), target.name)
    calibrate = calibrate or refit
    if calibrate:
        for p in profiles:
            store.add(p)
        if not store.buckets:
            raise GraphmodeError("no stored samples to refit from", where=str(store.path),
                                 fix="profile with --calibrate first")
        cal = fit_calibration(target, store.buckets.values())
        cal.save(cal_path)
        store.save()
        buckets = store.buckets
    else:
        buckets = {p.key: p.samples() for p in profiles}
        cal = previous if previous is not None else fit_calibration(target, buckets.values())
    source = (f"saved to {shown(cal_path)}" if calibrate else f"loaded from {shown(cal_path)}" if previous is not None
              else "fitted on these buckets only, not saved: --calibrate saves it")
    rows = prediction_table(target, buckets, cal, previous if calibrate else None)
    if as_json:
        print(json.dumps({"target": target.name, "profiles": [p.to_json(top) for p in profiles],
                          "calibration": cal.model_dump(), "calibration_path": str(cal_path), "saved": calibrate,
                          "predictions": [r.to_json() for r in rows], "calibrated_within_25pct": within(rows)},
                         indent=1, default=str))
        return
    for p in profiles:
        print_profile(p, top)
    console.print()
    print_predictions(rows, cal, source)
