"""`graphmode run`: compile, run sample inputs, print outputs summary, bucket and timing vs eager."""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
import torch.utils._pytree as pytree
import typer
from rich.table import Table

from graphmode.cli.app import app, console, err_console
from graphmode.cli.options import MODEL_SPEC_HELP, THREADS_HELP, CacheDir, recipe_or_draft
from graphmode.cli.progress import progress
from graphmode.errors import ContractViolation, GraphmodeError
from graphmode.verify.bisect import top1_cell
from graphmode.verify.eager import run_reference


def parse_shape(text: str, dims: list[str], flag: str = "--shape", first: Sequence[Any] = ()) -> dict[str, int]:
    """'batch=2,seq=16' or '2x16' (in the recipe's dim order) -> {dim: value}, every dim given once;
    with `first` (the first input's declared shape), also that input's whole shape, as `bench` and
    `profile` take it ('3x3x64x64' for [batch, 3, h, w]). Errors name `flag`, the option the
    text came from."""
    text = text.strip()
    example = f"{'x'.join(['2'] * len(dims))} or {','.join(f'{d}=2' for d in dims)}"
    try:
        if "=" in text:
            pairs = [p.split("=") for p in text.split(",")]
            if any(len(p) != 2 for p in pairs):
                raise ValueError
            names = [k.strip() for k, _ in pairs]
            vals = [int(v.strip()) for _, v in pairs]
        else:
            names, vals = list(dims), [int(v) for v in text.lower().split("x")]
            if len(vals) != len(dims) and len(vals) == len(first):
                names, vals = _whole_shape(text, vals, first, dims, flag)
    except ValueError:
        raise GraphmodeError(f"cannot parse shape {text!r}", where=flag, fix=f"write e.g. {example}") from None
    unknown = [n for n in names if n not in dims]
    if unknown:
        raise GraphmodeError(f"unknown dim(s) {unknown}", where=flag, value=text,
                             fix=f"the recipe's dims are {dims}")
    if len(vals) != len(dims) or len(set(names)) != len(names):
        raise GraphmodeError(f"shape {text!r} must give each of the recipe's dims {dims} exactly once",
                             where=flag, fix=f"write e.g. {example}")
    bad = {n: v for n, v in zip(names, vals) if v < 1}
    if bad:
        raise GraphmodeError("dims must be positive", where=flag, value=bad, fix=f"write e.g. {example}")
    return dict(zip(names, vals))


def _whole_shape(text: str, vals: list[int], first: Sequence[Any], dims: list[str],
                 flag: str) -> tuple[list[str], list[int]]:
    """The dims of the first input's whole shape: its named axes; its fixed ones must match."""
    names, got = [], []
    for axis, (want, v) in enumerate(zip(first, vals)):
        if isinstance(want, int):
            if want != v:
                raise GraphmodeError(f"shape {text!r} must give each of the recipe's dims {dims} exactly once, or "
                                     f"be the first input's whole shape {list(first)}, whose axis {axis} is {want}, "
                                     f"not {v}", where=flag, fix=f"write e.g. {','.join(f'{d}=2' for d in dims)}")
        elif want not in names:
            names.append(str(want))
            got.append(v)
    return names, got


MAX_EAGER_INPUT_BYTES = 2**32    # a request outside the contract still has to fit in memory to run eagerly


def check_request(rec, env: dict[str, int]) -> None:
    """Refuse before allocating anything: outside the contract, or too large to run eagerly."""
    from graphmode.errors import ContractViolation
    from graphmode.recipe.buckets import bucket_for, dim_range
    from graphmode.recipe.limits import DTYPE_SIZES
    if bucket_for(rec, env) is not None:
        return
    if rec.on_violation != "eager":
        bad = [f"{d}={v} outside [{lo}, {hi}]" for d, v in env.items() for lo, hi in [dim_range(rec.dims[d])]
               if not lo <= v <= hi]
        raise ContractViolation(f"request {env} is outside the recipe's contract ({'; '.join(bad) or 'no bucket'})",
                                where="--shape", value=env,
                                fix="send a shape inside dims, or set on_violation: eager to run it eagerly (in eager "
                                    "PyTorch, or ONNX Runtime for an ONNX file)")
    total = 0
    for spec in rec.inputs:
        n = 1
        for d in spec.shape:
            n *= env[d] if isinstance(d, str) else d
        total += n * DTYPE_SIZES[spec.dtype]
    if total > MAX_EAGER_INPUT_BYTES:
        raise ContractViolation(f"request {env} is outside the contract and its inputs alone would take "
                                f"{total / 2**30:.1f} GiB", where="--shape", value=env,
                                fix="send a smaller shape")


def sla_misses(recipe: Any, dims: dict[str, int], times_ms: list[float]) -> list[dict[str, Any]]:
    """The SLA bounds this shape's measured calls missed (p50 against the median, p99 against the
    nearest-rank p99 of the calls): the proof's cost model is a prediction, this is the host."""
    from graphmode.monitor.drift import quantile, sla_target
    target = sla_target(recipe, dims)
    if target is None or not times_ms:
        return []
    ordered = sorted(times_ms)
    out = []
    for which, bound in (("p50", target.p50_ms), ("p99", target.p99_ms)):
        got = quantile(ordered, 0.5 if which == "p50" else 0.99)
        if bound is not None and got > bound:
            out.append({"field": f"{target.key}.{which}_ms", "which": which, "bound_ms": bound, "measured_ms": got})
    return out


def _way(p: dict) -> str:
    """How one call ran: its path, and for a plan the bucket it ran ("graph batch=4,seq=84"): a
    request between buckets runs padded until the plan of its own values is built."""
    b = p.get("bucket") if p.get("path") == "graph" else None
    return str(p.get("path")) + (" " + ",".join(f"{k}={v}" for k, v in sorted(b.items())) if b else "")


def _timed_path(first: dict, took: list[dict]) -> dict:
    """The way the timed calls ran (what the latency reported is of): the most common one, with
    how many took each when they differ (a hybrid model learns eager is faster at a shape)."""
    if not took:
        return first
    counts = Counter(map(_way, took))
    most = counts.most_common(1)[0][0]
    out = dict(next(p for p in took if _way(p) == most))
    if len(counts) > 1 or _way(first) != most:
        out["timed_calls"] = dict(counts)
    return out


def _same_recipe(path: str, own: Any) -> bool:
    from graphmode.recipe import load_recipe
    try:
        return load_recipe(path).hash() == own.hash()
    except GraphmodeError:            # unreadable: refused below as a recipe that does not apply
        return False


def _artifact(model: str, recipe: str | None, mode: str | None, cache_dir: Path | None, threads: int | None):
    """The loaded artifact when --model is a .gm file (nothing compiled), else None."""
    from graphmode.runtime.artifact import is_artifact, recipe_of
    from graphmode.runtime.artifact import load as load_artifact
    if not is_artifact(model):
        return None
    if recipe is not None and _same_recipe(recipe, recipe_of(model)):
        recipe = None                   # the recipe it was compiled with, as `generate` takes it
    for flag, value in (("--recipe", recipe), ("--mode", mode)):
        if value is not None:
            raise GraphmodeError(f"{flag} does not apply to an artifact: it carries the recipe and mode it was "
                                 "compiled with", where=flag, value=value,
                                 fix=f"drop {flag}, or compile the model again with it (graphmode compile --save)")
    return load_artifact(model, cache_dir=cache_dir, threads=threads)


def _reference(cm):
    """(what the outputs are checked against, its name): eager PyTorch, ONNX Runtime for an ONNX
    model, or for an artifact (no model in it) the reference interpreter of its graph: the ops'
    eager definitions over the artifact's own weights, so its kernels and plans are what is checked."""
    src = cm.source
    if src.module is not None or src.onnx_path is not None:
        return src.reference, ("eager" if src.module is not None else "onnxruntime")
    if getattr(cm, "world", 1) > 1:           # a saved group: each rank interprets its own shard
        return (lambda inputs: cm.interpret(**inputs)), "reference interpreter on the ranks"
    from graphmode.ir.interpreter import bind_dims, interpret

    def interpreted(inputs):
        res = interpret(cm.graph, inputs)
        outs = [res[o] for o in cm.graph.outputs]
        from graphmode.runtime.tail import model_outputs     # the model's outputs: after the plan, its tail
        updates = outs[len(outs) - len(cm.mutated_inputs):]
        return model_outputs(cm, outs, inputs, bind_dims(cm.graph, inputs)) + updates
    return interpreted, "reference interpreter"


def _reference_outputs(cm, inputs: dict, env: dict | None) -> tuple[Any, str, Any]:
    """(the reference, its name, its outputs on `inputs`), or run_reference's error when the model
    itself fails on them (the samples graphmode drew, at a shape the recipe admits)."""
    reference, ref_name = _reference(cm)
    return reference, ref_name, run_reference(reference, inputs, env or {}, {
        "eager": "eager PyTorch", "onnxruntime": "ONNX Runtime"}.get(ref_name, f"the {ref_name}"))


@app.command("run")
def run_cmd(
    model: str = typer.Option(..., "--model", help=MODEL_SPEC_HELP
                                                   + " | FILE.gm (an artifact: graphmode compile --save)"),
    recipe: Optional[str] = typer.Option(None, "--recipe", help="default: a .gm file's own; for a model, the "
                                                              "recipe graphmode.compile would draft"),
    mode: Optional[str] = typer.Option(None, "--mode", help="eager | graph | hybrid (default: the recipe's)"),
    shape: Optional[str] = typer.Option(None, "--shape", help="the dims, e.g. 2x16 or batch=2,seq=16, or the "
                                                               "first input's whole shape (2x3x224x224)"),
    iters: int = typer.Option(10, "--iters", min=1, help="timed calls per engine"),
    threads: Optional[int] = typer.Option(None, "--threads", min=1, max=1024, help=THREADS_HELP),
    metrics: bool = typer.Option(False, "--metrics", help="print the runtime contract metrics"),
    warmup: bool = typer.Option(False, "--warmup", help="build every bucket's plan first"),
    cache_dir: Optional[Path] = CacheDir,
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Run sample inputs through the compiled model and compare with eager PyTorch (a .gm
    artifact, which holds no model, with graphmode's reference interpreter of its graph)."""
    from graphmode.compiler import compile as gm_compile
    from graphmode.paths import cache_layout
    from graphmode.recipe.buckets import all_buckets
    from graphmode.runtime.timing import median, time_ms
    from graphmode.targets import get_target
    from graphmode.verify.bisect import checked_precision, compare_outputs, logit_outputs, output_labels

    if mode not in (None, "eager", "graph", "hybrid"):
        raise GraphmodeError(f"unknown mode {mode!r}", where="--mode", fix="eager, graph or hybrid")
    if threads:
        torch.set_num_threads(threads)
    loaded = _artifact(model, recipe, mode, cache_dir, threads)
    rec = loaded.recipe if loaded is not None else recipe_or_draft(
        recipe, model, lambda text: err_console.print(text, markup=False, highlight=False, soft_wrap=True))
    ranks = rec.parallel.tensor if rec.parallel is not None else 1
    if metrics and ranks > 1:
        raise GraphmodeError("--metrics reads one process's contract monitor; this recipe runs "
                             f"{ranks} rank processes", where="--metrics", fix="drop --metrics, or run with tensor: 1")
    env = parse_shape(shape, list(rec.dims), first=rec.inputs[0].shape if rec.inputs else ()) if shape \
        else dict(all_buckets(rec)[0])
    check_request(rec, env)      # before compiling or allocating anything
    host = get_target("host", cache_dir=cache_layout(cache_dir).targets)
    with progress() as on_stage:
        cm = loaded or gm_compile(model, rec, host, mode=mode, cache_dir=cache_dir, threads=threads, on_stage=on_stage)
        if warmup and cm.mode != "eager":
            cm.warmup()
        inputs = cm.sample_inputs(env, seed=0)
        try:
            with torch.inference_mode():
                out = cm(**inputs)           # builds the request's bucket unless warm-up did
        except ContractViolation as e:
            if e.kind == "input":            # an op refused the samples: when eager does too, say it is the model's
                _reference_outputs(cm, inputs, env)
            raise
        if metrics:   # the contract monitor times and counts the timed calls (as the server's, once warm)
            from graphmode.monitor import monitored
            cm = monitored(cm)
        if metrics and cm.graph is not None and getattr(cm, "last_bucket", None):
            cm.monitor.check_memory(cm.cm, [dict(cm.last_bucket)])   # its plan's arena vs memory.budget_mb
    path = dict(getattr(cm, "last_path", {}) or {"path": cm.mode})
    reference, ref_name, refs = _reference_outputs(cm, inputs, env)
    took: list[dict] = []          # how each call ran: a hybrid model may choose eager after its first calls
    ran: dict[Any, Any] = {_way(path): out}          # each way's last output: the one checked

    def timed_call():
        o = cm(**inputs)
        took.append(dict(getattr(cm, "last_path", {}) or {"path": cm.mode}))
        ran[_way(took[-1])] = o
    for _ in range(2):          # warm-up; a recurring shape's own plan (exact_plans) builds in the background:
        timed_call()            # the timed calls are what a request sees once it is built
    getattr(cm, "wait_for_builds", lambda: True)()
    warm = len(took)
    graph_ms = time_ms(timed_call, iters=iters, warmup=0)
    t_graph = median(graph_ms)
    path = _timed_path(path, took[warm:])
    ran_graph = path.get("path") == "graph"
    # the outputs of the way the latency is of (the first calls may have run another: a request off
    # its bucket runs padded or eagerly until its own plan is built), and the others' too
    judged = [ran.get(_way(path), out)] + [o for w, o in ran.items() if w != _way(path)]
    labels = output_labels(cm.source, cm.graph, len(pytree.tree_leaves(out)))
    every = [compare_outputs(labels, pytree.tree_leaves(o), refs, *checked_precision(rec),
                             logits=logit_outputs(cm.graph, len(labels))) for o in judged]
    outs, checks = pytree.tree_leaves(judged[0]), every[0]
    tol = max([c.tolerance for c in checks], default=0.0)
    rows = []
    for label, o, c in zip(labels, outs, checks):
        rows.append({"output": label, "shape": list(o.shape), "dtype": str(o.dtype).replace("torch.", ""),
                     "mean": float(o.float().mean()) if o.numel() else 0.0,
                     "std": float(o.float().std()) if o.numel() > 1 else 0.0,
                     "rel_l2_vs_eager": c.rel_l2,
                     **({"eager_nonfinite": c.eager_nonfinite} if c.eager_nonfinite else {}),
                     **({"top1_vs_eager": c.to_json()["top1"]} if c.top1 is not None else {})})
    numerics_ok = all(len(pytree.tree_leaves(o)) == len(refs) and all(c.ok for c in cs) for o, cs in zip(judged, every))
    timed = (lambda: cm.source.reference(inputs, optimized=True)) if ref_name == "onnxruntime" else \
        (lambda: reference(inputs))          # ONNX Runtime timed as it ships (checked node by node)
    t_eager = median(time_ms(timed, iters=iters))
    parallel = None
    if ranks > 1:                 # graphmode.parallel.launch.TensorParallelModel: rank 0 answered
        parallel = {"ranks": ranks, "weights_bytes_per_rank": [r["weights_bytes"] for r in cm.ranks],
                    "collectives_per_call": cm.last_comm[0]["collectives"],
                    "comm_bytes_per_call": cm.last_comm[0]["comm_bytes"]}
        cm.close()
    result = {"model": model, "mode": cm.mode, "shape": env, "bucket": path.get("bucket"), "path": path,
              "outputs": rows, "tolerance": tol, "numerics_ok": numerics_ok,
              "checked_paths": [_way(path)] + [w for w in ran if w != _way(path)],
              "median_ms": {"graphmode" if ran_graph else "graphmode (eager fallback)": t_graph, ref_name: t_eager},
              "speedup_vs_eager": (t_eager / t_graph if t_graph else None) if ran_graph else None}
    if metrics:
        result["metrics"] = cm.metrics()
    if parallel:
        result["parallel"] = parallel
    over = sla_misses(cm.recipe, env, graph_ms)
    if over:
        result["sla_missed"] = over
    if as_json:
        print(json.dumps(result, indent=2))
    else:
        if ran_graph:
            console.print(f"[bold]{model}[/] mode {cm.mode}, request {env} -> bucket {result['bucket']}")
        else:
            console.print(f"[bold]{model}[/] mode {cm.mode}, request {env} [yellow]ran in {'ONNX Runtime' if ref_name == 'onnxruntime' else 'eager PyTorch'}[/]: "
                          f"{path.get('reason', 'exe_mode eager')}", highlight=False)
        t = Table()
        top = any("top1_vs_eager" in r for r in rows)      # narrow weights: logits also judged on top-1
        for c in ("output", "shape", "dtype", "mean", "std", f"rel L2 vs {ref_name}", "tolerance") + (
                ("top-1 agree",) if top else ()):
            t.add_column(c, overflow="fold")
        for r, c in zip(rows, checks):
            t1 = r.get("top1_vs_eager")
            t.add_row(str(r["output"]), str(r["shape"]), r["dtype"], f"{r['mean']:.4g}", f"{r['std']:.4g}",
                      f"{r['rel_l2_vs_eager']:.2e}", f"{c.tolerance:.0e}",
                      *((top1_cell(t1) if t1 and t1.get("judged")
                         else "- (not logits)",) if top else ()))
        console.print(t)
        if len(result["checked_paths"]) > 1:
            console.print(f"checked: the outputs of the way timed ({_way(path)}), shown, and of the first "
                          f"calls' ({', '.join(result['checked_paths'][1:])})", highlight=False)
        if ran_graph:
            console.print(f"median latency: graphmode {t_graph:.2f} ms, {ref_name} {t_eager:.2f} ms "
                          f"(graphmode / {ref_name} = {t_graph / t_eager:.2f}x)")
        else:
            console.print(f"median latency: {t_graph:.2f} ms through the eager fallback ({ref_name} alone "
                          f"{t_eager:.2f} ms); no graph-mode time to report for this request")
        if metrics:
            console.print(f"metrics: {json.dumps(result['metrics'])}")
        if parallel:
            console.print(f"tensor parallel: {ranks} ranks, weights per rank "
                          f"{', '.join(f'{b / 1e6:.2f} MB' for b in parallel['weights_bytes_per_rank'])}; "
                          f"{parallel['collectives_per_call']} collectives, {parallel['comm_bytes_per_call']} bytes "
                          "sent by rank 0 per call")
        for m in over:
            console.print(f"[yellow]{m['field']} {m['bound_ms']:g} ms missed[/]: measured {m['which']} "
                          f"{m['measured_ms']:.3g} ms over {len(graph_ms)} calls at this shape. The recipe's SLA "
                          "proof predicts with the target's cost model; `graphmode profile` calibrates it on this "
                          "host, so that the proof judges the bound by this host's speed", highlight=False)
        empty = next((c.name for cs in every for c in cs if c.vacuous), None)
        if empty is not None:
            console.print(f"[red]numerics not checked[/]: {ref_name}'s own output {empty!r} is NaN or inf throughout, "
                          "so nothing was compared: look for NaN/inf in the model's weights or inputs")
        elif not numerics_ok:
            console.print(f"[red]numerics check failed[/]: an output differs from {ref_name} by more than "
                          f"rel L2 {tol:.0e}; run `graphmode verify` to find where")
    raise typer.Exit(0 if numerics_ok else 1)
