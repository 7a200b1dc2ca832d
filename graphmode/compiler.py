"""The pipeline as functions: capture -> optimize -> (plan per bucket) -> CompiledModel.

    graph, cap = graphmode.capture("minilm", recipe)
    graph, report = graphmode.optimize(graph, recipe, target)
    model = graphmode.compile("minilm", recipe)          # callable like the module
"""
from __future__ import annotations

import dataclasses
import functools
import re
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from graphmode.capture.source import (ModelSource, constant_inputs, example_inputs_from_recipe,  # noqa: F401
                                     resolve_model)
from graphmode.capture.torch_import import CaptureReport, import_torch
from graphmode.compile_report import graph_facts
from graphmode.ir.graph import Graph
from graphmode.progress import OnStage, PassProgress, stage
from graphmode.errors import CaptureError, RecipeErrors
from graphmode.recipe import Recipe, load_recipe


def as_recipe(recipe: Recipe | str | Path) -> Recipe:
    if isinstance(recipe, Recipe):
        return recipe
    return load_recipe(recipe)


def checked_capture(model: Any, recipe: Recipe | str | Path, mode: str | None = None):
    """capture() plus the verdict every entry point shares: (graph, report, source, verdict)."""
    from graphmode.verdict import decide
    recipe = as_recipe(recipe)
    graph, rep, src = capture(model, recipe)
    return graph, rep, src, decide(recipe, graph, rep, src, mode or recipe.exe_mode)


def capture(model: Any, recipe: Recipe | str | Path) -> tuple[Graph, CaptureReport, ModelSource]:
    """Model -> IR graph with the recipe's dynamic dims and capture include/exclude lists."""
    from graphmode.errors import RecipeErrors
    from graphmode.recipe.shape_checks import shape_errors
    recipe = as_recipe(recipe)
    errors = shape_errors(recipe)
    if errors:                       # before the model is loaded: export would blame the model
        raise RecipeErrors(errors)
    src = resolve_model(model, recipe)
    dims = src.capture_dims or {d: recipe.dim_range(d) for d in recipe.dims}
    if src.onnx_path is not None:
        from graphmode.capture.onnx import import_onnx
        g, rep = import_onnx(src.onnx_path, dims=dims, input_dims=src.input_dims, name=src.name,
                             include_ops=recipe.capture.include_ops, exclude_ops=recipe.capture.exclude_ops,
                             input_values=constant_inputs(recipe))
        _warn_unmatched_excludes(rep, src)
        return g, rep, src
    def imported(examples, ranges):
        return import_torch(src.module, examples, src.input_dims, ranges, name=src.name,
                            include_ops=recipe.capture.include_ops, exclude_ops=recipe.capture.exclude_ops,
                            output_names=src.output_names,
                            output_structure=getattr(src.bundle, "output_structure", None))
    try:
        g, rep = imported(src.example_inputs, dims)
    except CaptureError as e:
        raise (_where_export_holds(e, src, recipe, dims, imported) or e) from None
    _warn_unmatched_excludes(rep, src)
    return g, rep, src


def _warn_unmatched_excludes(rep: CaptureReport, src: ModelSource) -> None:
    """capture.exclude_ops entries that met no op: nothing runs as that eager island (an ONNX
    file writes GELU as Erf and a few Mul/Add; torch names ops by ATen's names)."""
    if rep.unmatched_excludes:
        from graphmode.capture.spec import GraphmodeNotice
        names = "ONNX op types (Softmax) or graphmode's core ops (softmax)" if src.onnx_path is not None else \
            "ATen names (softmax, aten.softmax.int)"
        warnings.warn(GraphmodeNotice(f"capture.exclude_ops {rep.unmatched_excludes} matched no op of the model, so "
                                      f"nothing runs eagerly for them; ops are matched by {names}"), stacklevel=3)


# torch's convolutions and pools refuse a symbolic input their window may not fit, at trace time;
# a size that may be 1 (a strided conv's (H - 1) // 2 + 1) is a guard torch.export names no range for
_SMALL_SIZES = re.compile(r"Kernel size can't be greater than actual input size|Output size is too small"
                          r"|Constraints violated")


def _where_export_holds(e: CaptureError, src: Any, recipe: Recipe, dims: dict, imported: Any) -> Any:
    """A CaptureError naming the smallest dim values one graph holds from, when torch.export
    refused the recipe's range for sizes it may make too small (a window wider than its input,
    an extent that may be 1), or None. torch.export's own suggestion is a range around
    graphmode's small examples (3, 5, 7...): a model that takes H from 5 on was told "H max 4".
    So the model is captured again near the top of the range, and the sizes that graph derives
    from the dims are read for where each is 2 or more (analysis/extents.py)."""
    suggested = getattr(e, "suggested_ranges", None) or {}
    if not _SMALL_SIZES.search(str(e)):
        return None
    if any(lo is not None for lo, _ in suggested.values()):   # torch.export's own answer: the part
        parts = _two_parts(e, src, recipe, dims, imported)   # around the example, maybe with one above it
        if parts is not None:
            return parts
    # no part above holds one graph either (three stride-2 convs: H 5..8 ends at an extent of 1,
    # and torch's "H min 3, max 4" ruled out every bucket; trial AE): where do the sizes hold?
    g = _captured_near_top(src, recipe, dims, imported, near=True)
    if isinstance(g, CaptureError):     # no dynamic dim near the top either: that is the answer, if it names a dim
        if not (g.where and g.where.startswith("dims.") and "cannot prove" in g.message):
            return None
        return CaptureError(f"{e.message.removesuffix('.')}, at the small sizes of the recipe's range; and near its "
                            f"top: {g.message.removeprefix('torch.export failed: ')}", where=g.where, value=g.value,
                            fix=g.fix)
    from graphmode.analysis.extents import short_extents
    short = [s for s in short_extents(g, dims, export=True) if s.fits is not None]
    if not short:
        return None
    s = short[0]
    err = CaptureError(f"torch.export holds one graph of this model only where the sizes it derives from the dims "
                       f"are 2 or more: at {s.dim} = {dims[s.dim][0]}, {s.op} -> %{s.output} has {s.extent} = "
                       f"{s.value} positions" + ("" if len(short) == 1 else
                                                 f" (and {', '.join(x.dim for x in short[1:])} likewise)"),
                       where=f"dims.{s.dim}.min", value=dims[s.dim][0],
                       fix="; ".join(f"dims.{x.dim}.min: {x.fits}" for x in short)
                           + " (and no smaller bucket), or run the model with exe_mode: eager")
    err.suggested_ranges = {x.dim: (x.fits, None) for x in short}   # the drafter starts its dims there
    return err


def _captured_near_top(src: Any, recipe: Recipe, ranges: dict, imported: Any, near: bool = False) -> Any:
    """The graph torch.export captures from examples at the top of `ranges` (distinct values, not
    merged, and 2 or more: torch.export specialises a size of 1), over `ranges` or, `near`, over
    each range from just below its example; its CaptureError when it refuses that too."""
    top = {d: max(lo, min(2, hi), hi - i) for i, (d, (lo, hi)) in enumerate(sorted(ranges.items()))}
    over = {d: (max(ranges[d][0], v - 1), ranges[d][1]) for d, v in top.items()} if near else ranges
    examples = (src.bundle.make_inputs(top, seed=0) if src.bundle is not None
                else example_inputs_from_recipe(recipe, src.module, sizes=top))
    try:
        g, _ = imported(examples, over)
    except CaptureError as e:
        return e
    return g


def _two_parts(e: CaptureError, src: Any, recipe: Recipe, dims: dict, imported: Any) -> Any:
    """torch.export's range ends below the recipe's max (ConvNeXt's H 48..63, where the last
    stage's extent is 1, which torch.export specialises): a second capture near the top tells
    whether the sizes above hold one graph of their own. If so the refusal names both parts, and
    the drafter takes the one holding the model's example size; else None (torch.export's)."""
    lower = {d: r for d, r in e.suggested_ranges.items() if d in dims}
    for d, r in dims.items():        # a dim over the same range as one named (W beside H) is taken alike
        same = next((lower[k] for k in sorted(lower) if dims[k] == r), None)
        if d not in lower and same is not None:
            lower[d] = same
    upper = {d: (hi + 1, dims[d][1]) for d, (_, hi) in lower.items() if hi is not None and hi < dims[d][1]}
    if not upper:
        return None
    if isinstance(_captured_near_top(src, recipe, {**dims, **upper}, imported), CaptureError):
        return None

    def part(r: dict) -> str:
        return ", ".join(f"{d} {lo if lo is not None else dims[d][0]}..{hi if hi is not None else dims[d][1]}"
                         for d, (lo, hi) in sorted(r.items()))
    example = src.bundle.example_shape() if src.bundle is not None else {}
    above = all(lo <= example.get(d, -1) <= hi for d, (lo, hi) in upper.items())
    err = CaptureError(f"torch.export holds one graph of this model for {part(lower)} and another for {part(upper)} "
                       "(at the smaller sizes the model takes another path, e.g. an extent of 1 torch.export "
                       "specialises): the recipe's range spans both, and one compiled model serves one graph",
                       where=f"dims.{sorted(upper)[0]}",
                       fix=f"narrow the recipe's dims to one part: {part(upper)}, or {part(lower)} (a recipe, and a "
                           "compiled model, for each part serves both), or run the model with exe_mode: eager")
    err.suggested_ranges = upper if above else lower
    return err


@dataclass
class OptimizeReport:
    passes: Any                     # PassReport
    memory: Any = None              # MemoryPlanSet (per-bucket plans + symbolic activation peak)
    dump_files: list[Path] = field(default_factory=list)
    seconds: float = 0.0

    def fused_groups(self, graph: Graph) -> list[dict]:
        return [{"outputs": list(n.outputs), "kind": n.attrs.get("kind"), "ops": [m.op for m in n.body.nodes]}
                for n in graph.nodes if n.op == "fused"]


def _paged_options(recipe: Recipe) -> dict[str, Any]:
    """The `to_paged` pass's pool: the recipe's memory.kv_cache at the size its proof counts."""
    from graphmode.recipe.facts import kv_params, kv_pool_pages
    p = kv_params(recipe)
    if p is None or "to_paged" not in recipe.pipeline():
        return {}
    return {"page_size": int(p["page_size"]), "pages": int(kv_pool_pages(recipe)),
            "max_pages_per_seq": int(p["max_pages_per_seq"]), "layers": p["layers"], "kv_heads": p["kv_heads"],
            "head_dim": p["head_dim"], "dtype": str(p["dtype"])}


def tensor_parallel(recipe: Recipe) -> int:
    """The recipe's tensor-parallel degree (1: one process, no `shard` pass)."""
    return recipe.parallel.tensor if recipe.parallel is not None else 1


def pipeline(recipe: Recipe) -> list[str]:
    """The recipe's passes; under `parallel.tensor` > 1 with `shard` after constant folding (it
    splits constant linear weights, which folding has already pre-transposed into place)."""
    names = recipe.pipeline()
    if tensor_parallel(recipe) <= 1 or "shard" in names:
        return names
    after = max((i + 1 for i, n in enumerate(names) if n in ("canonicalize", "precision", "constant_fold")), default=0)
    return names[:after] + ["shard"] + names[after:]


def pass_context(recipe: Recipe, target: Any = None, buckets: Sequence[dict] | None = None, *, rank: int = 0):
    from graphmode.passes import PassContext
    fusion = recipe.optimize.fusion
    options = {"fuse": {"enabled": fusion.enabled, "patterns": list(fusion.patterns), "min_ops": fusion.min_ops,
                        "max_ops": fusion.max_ops},
               "precision": {"compute": recipe.precision.compute,
                             "overrides": dict(recipe.precision.overrides)},
               "quantize_weights": {"weights": recipe.precision.weights,
                                    "group_size": recipe.precision.group_size,
                                    "int4_scheme": recipe.precision.int4_scheme,
                                    "int4_activations": recipe.precision.int4_activations},
               "memory_plan": {"reuse": recipe.optimize.memory_reuse,
                               "alias_groups": [list(g) for g in recipe.alias_groups]},
               "to_paged": _paged_options(recipe)}
    par = recipe.parallel
    if par is not None:
        options["shard"] = {"rank": rank, "world": par.tensor, "strategy": dict(par.strategy),
                            "comm_dtype": par.comm.dtype,
                            "batch_dim": recipe.model.batch_dim if recipe.model is not None else "batch"}
    return PassContext(options=options, buckets=list(buckets) if buckets is not None else recipe.buckets(),
                       target=target)


def optimize(graph: Graph, recipe: Recipe | str | Path, target: Any = None, *,
             buckets: Sequence[dict] | None = None, dump_dir: str | Path | None = None,
             dump_before: Sequence[str] | str = (), dump_after: Sequence[str] | str = (),
             keep_snapshots: bool = False, on_stage: OnStage | None = None, rank: int = 0
             ) -> tuple[Graph, OptimizeReport]:
    """Run the recipe's pass pipeline (verifier after every pass); `on_stage` hears the `passes`
    stage, one step per pass (graphmode/progress.py). Under `parallel`, the graph is `rank`'s shard."""
    from graphmode.passes import DumpIR, KeepSnapshots, PassManager
    recipe = as_recipe(recipe)
    ctx = pass_context(recipe, target, buckets, rank=rank)
    dump = None
    if dump_dir is not None and (dump_before or dump_after):
        norm = (lambda s: s if s == "all" else set(s))  # noqa: E731
        dump = DumpIR(dump_dir, norm(dump_before), norm(dump_after))
        ctx.instruments.append(dump)
    snaps = KeepSnapshots() if keep_snapshots else None
    if snaps:
        ctx.instruments.append(snaps)
    t0 = time.perf_counter()
    names = pipeline(recipe)
    with stage(on_stage, "passes", total=len(names)) as passes:
        ctx.instruments.append(PassProgress(passes))
        out, report = PassManager(names, ctx).run(graph)
    rep = OptimizeReport(report, ctx.analyses.get("memory_plan"), dump.files if dump else [],
                         time.perf_counter() - t0)
    if snaps:
        rep.snapshots = snaps.snapshots  # type: ignore[attr-defined]
    return out, rep


def prove(recipe: Recipe, target: Any, graph: Graph | None, facts: Any = None, cache_dir: str | Path | None = None):
    """The recipe's three verification layers with the compiled graph's own facts: the same
    proof `graphmode compile` prints, its SLA predicted with the calibration `graphmode profile
    --calibrate` saved under `cache_dir` for the target, as `recipe validate` predicts it."""
    from graphmode.recipe import validate
    from graphmode.recipe.validate import SAVED
    if facts is None and graph is not None:
        facts = graph_facts(recipe, graph)
    return validate(recipe, target, facts, calibration=SAVED, cache_dir=cache_dir)


@dataclass
class Lowered:
    """A model checked and optimised under a recipe: what every entry point builds plans from,
    and what a CompiledModel keeps (so a server or the CLI reads the proof, never proves again)."""

    source: ModelSource
    captured: Graph
    capture_report: CaptureReport
    verdict: Any                  # graphmode.verdict.Verdict
    graph: Graph
    optimize_report: OptimizeReport
    proof: Any                    # graphmode.recipe.ValidationReport with the graph's own facts
    facts: Any = None             # graphmode.recipe.ModelFacts the proof was checked against
    timings: dict[str, float] = field(default_factory=dict)   # seconds per stage: capture, passes, proof
    recipe: Any = None            # the Recipe it was lowered (and proved) under


def lower_model(model: Any, recipe: Recipe | str | Path, target: Any = None, *, mode: str | None = None,
                keep_snapshots: bool = False, on_stage: OnStage | None = None, rank: int = 0,
                refuse: bool = True, prove_graph: bool = True, dump_dir: str | Path | None = None,
                dump_before: Sequence[str] | str = (), dump_after: Sequence[str] | str = (),
                cache_dir: str | Path | None = None) -> Lowered:
    """capture -> verdict -> passes -> proof: the one path compile, verify, run, serve, decode,
    `recipe validate --model` and `plan show` share. With `refuse` (the default) it refuses
    (typed errors) at the first that fails; without, a report reads how far it got: a refused
    verdict stops before the passes (`graph` and `proof` None), an unproved recipe keeps its
    proof. `prove_graph=False` stops after the graph's facts (the caller proves with its own
    options). `on_stage` hears the capture, passes and proof stages (graphmode/progress.py);
    `dump_*` write the IR around passes (`optimize`). Under `parallel`, `rank`'s shard.
    `cache_dir`: where the proof finds a saved SLA calibration (`prove`)."""
    recipe = as_recipe(recipe)
    return _lower(capture_model(model, recipe, mode=mode, on_stage=on_stage), recipe, target, refuse=refuse,
                  prove_graph=prove_graph, keep_snapshots=keep_snapshots, on_stage=on_stage, rank=rank,
                  dump_dir=dump_dir, dump_before=dump_before, dump_after=dump_after, cache_dir=cache_dir)


def capture_model(model: Any, recipe: Recipe | str | Path, *, mode: str | None = None,
                  on_stage: OnStage | None = None) -> Lowered:
    """The driver's first stage alone: the model captured and judged by the verdict (`graph`,
    `proof` None). `relower` runs the rest from it for as many recipes as a caller tries, so
    tuning and drafting capture a model once."""
    recipe = as_recipe(recipe)
    t0 = time.perf_counter()
    with stage(on_stage, "capture"):
        graph0, cap, src, verdict = checked_capture(model, recipe, mode)
    return Lowered(src, graph0, cap, verdict, None, None, None, None, {"capture": time.perf_counter() - t0},
                   recipe)


def relower(captured: Lowered, recipe: Recipe | str | Path, target: Any = None, *, mode: str | None = None,
            refuse: bool = True, prove_graph: bool = True, on_stage: OnStage | None = None,
            rank: int = 0) -> Lowered:
    """verdict -> passes -> proof of a model captured once (`capture_model`, or any Lowered)
    under another `recipe`, as `lower_model` would lower it. The recipe must capture alike
    (its dims' ranges and capture op lists are what the captured graph holds): what `tune`
    and the drafter vary (precision, fusion, kernels, buckets, budgets) keeps that true."""
    from graphmode.verdict import decide
    recipe = as_recipe(recipe)
    verdict = decide(recipe, captured.captured, captured.capture_report, captured.source, mode or recipe.exe_mode)
    start = Lowered(captured.source, captured.captured, captured.capture_report, verdict, None, None, None, None,
                    {"capture": captured.timings.get("capture", 0.0)}, recipe)
    return _lower(start, recipe, target, refuse=refuse, prove_graph=prove_graph, on_stage=on_stage, rank=rank)


def reprove(lowered: Lowered, recipe: Recipe | str | Path, target: Any = None, *, refuse: bool = True) -> Lowered:
    """The proof of an already lowered graph under `recipe`, a recipe that lowers to the same
    graph (same passes, same pass options: it differs in what only the proof reads, such as
    `memory.budget_mb`); the drafter sizes the budget from the graph, then proves with it.
    A recipe that would change the passes is refused: relower it instead."""
    from graphmode.errors import RecipeError
    recipe = as_recipe(recipe)
    before = lowered.recipe
    if lowered.graph is None or before is None:
        raise RecipeError("reprove needs a lowered graph (lower_model or relower with an accepted verdict)",
                          where="lowered", value=None, fix="lower the model first")
    if (pipeline(recipe), pass_context(recipe, buckets=[]).options) != \
            (pipeline(before), pass_context(before, buckets=[]).options):
        raise RecipeError(f"recipe {recipe.name!r} changes the passes the graph was lowered with "
                          f"(recipe {before.name!r}): its proof would not be of this graph", where="recipe",
                          value=recipe.name, fix="relower the model under this recipe (graphmode.compiler.relower)")
    t0 = time.perf_counter()
    proof = prove(recipe, target, lowered.graph, lowered.facts)
    if refuse:
        proof.raise_for_errors()
    return dataclasses.replace(lowered, proof=proof, recipe=recipe,
                               timings={**lowered.timings, "proof": time.perf_counter() - t0})


def _warn_if_no_weight_narrowed(opt: OptimizeReport) -> None:
    """A recipe asking for narrow weights (precision.weights) whose model had no linear to
    narrow would otherwise run f32 without a word."""
    from graphmode.capture.spec import GraphmodeNotice
    from graphmode.passes.quantize_weights import weights_summary
    said = weights_summary(opt.passes.stats_of("quantize_weights"))
    if said is not None and said[1]:
        warnings.warn(GraphmodeNotice(said[0]), stacklevel=3)


def refuse_inconsistent(recipe: Recipe, target: Any) -> None:
    """RecipeErrors for the recipe's cross-field errors (what `recipe validate` refuses without a
    model), raised before the passes: else a pass meets the combination first and reports it as
    its own bug."""
    from graphmode.recipe import check_semantics
    errors = check_semantics(recipe, target).errors
    if errors:
        raise RecipeErrors(errors)


def _lower(start: Lowered, recipe: Recipe, target: Any, *, refuse: bool, prove_graph: bool,
           keep_snapshots: bool = False, on_stage: OnStage | None = None, rank: int = 0,
           dump_dir: str | Path | None = None, dump_before: Sequence[str] | str = (),
           dump_after: Sequence[str] | str = (), cache_dir: str | Path | None = None) -> Lowered:
    """passes -> proof after a verdict decided for `recipe` (`start` holds it)."""
    timings = dict(start.timings)
    if refuse:
        start.verdict.raise_for_refusal()
        refuse_inconsistent(recipe, target)
    elif not start.verdict.ok:
        return start
    t1 = time.perf_counter()
    graph, opt = optimize(start.captured, recipe, target, buckets=[], keep_snapshots=keep_snapshots,
                          on_stage=on_stage, rank=rank, dump_dir=dump_dir, dump_before=dump_before,
                          dump_after=dump_after)
    t2 = time.perf_counter()
    timings["passes"] = t2 - t1
    _warn_if_no_weight_narrowed(opt)
    facts = graph_facts(recipe, graph)
    low = dataclasses.replace(start, graph=graph, optimize_report=opt, facts=facts, timings=timings)
    if not prove_graph:
        return low
    with stage(on_stage, "proof"):
        proof = prove(recipe, target, graph, facts, cache_dir)
    timings["proof"] = time.perf_counter() - t2
    if refuse:
        proof.raise_for_errors()      # a recipe that is not proved is never loaded
    return dataclasses.replace(low, proof=proof)


def compile(model: Any, recipe: Recipe | str | Path, target: Any = "host", *, mode: str | None = None,
            cache_dir: str | Path | None = None, threads: int | None = None, warmup: bool = False,
            on_stage: OnStage | None = None, rank: int | None = None):
    """Lower a model under its recipe and wrap it; plans are built per bucket on first use (or
    warm-up). `on_stage` hears the capture, passes, proof and plans stages (graphmode/progress.py).
    Under `parallel.tensor` N > 1: without `rank`, the N rank processes are started and the
    result is a `graphmode.parallel.launch.TensorParallelModel` (rank 0 answers); with `rank`,
    this process compiles that rank's shard only (its collectives need a bound communicator).
    Under a decoder recipe (memory.kv_cache) the whole-sequence graph is lowered on the first
    forward call, not here (runtime/deferred.py): decoding lowers a paged graph of its own.
    `graphmode.compile` (graphmode/api.py) drafts a missing recipe and adds decoding."""
    from graphmode.runtime.compiled import CompiledModel
    tgt = resolve_target(target)
    recipe = as_recipe(recipe)
    mode = mode or recipe.exe_mode
    if tensor_parallel(recipe) > 1 and rank is None and mode != "eager":
        from graphmode.parallel.launch import launch
        return launch(model, recipe, tgt, driver=rank_driver(), mode=mode, cache_dir=cache_dir,
                      threads=threads, on_stage=on_stage)  # warm
    if mode == "eager":
        src = resolve_model(model, recipe)
        # the passes narrow weights; eager runs the module as it is (said where the recipe asks for eager: the
        # decode engine's own eager model of a hybrid recipe is not the user's choice)
        if recipe.precision.weights != "f32" and recipe.exe_mode == "eager":
            from graphmode.capture.spec import GraphmodeNotice
            warnings.warn(GraphmodeNotice(f"precision.weights {recipe.precision.weights} applies to graph and hybrid "
                                          "mode: exe_mode eager runs the module with its f32 weights"), stacklevel=2)
        return CompiledModel(src, recipe, tgt, None, None, None, mode="eager", cache_dir=cache_dir,
                             threads=threads, on_stage=on_stage)
    if recipe.memory.kv_cache is not None and not warmup:
        # a decoder: its decode engine lowers the paged graph it runs; the whole-sequence graph
        # waits for a forward call (runtime/deferred.py)
        from graphmode.runtime.deferred import DeferredModel
        src = resolve_model(model, recipe)
        lower = functools.partial(lower_model, src, recipe, tgt, mode=mode, on_stage=on_stage, rank=rank or 0,
                                  cache_dir=cache_dir)
        return DeferredModel(src, recipe, tgt, lower, mode=mode, cache_dir=cache_dir, threads=threads,
                             on_stage=on_stage)
    low = lower_model(model, recipe, tgt, mode=mode, on_stage=on_stage, rank=rank or 0, cache_dir=cache_dir)
    cm = CompiledModel.from_lowered(low, recipe, tgt, mode=mode, cache_dir=cache_dir, threads=threads,
                                    on_stage=on_stage)
    cm.spill_constants()
    if warmup:
        cm.warmup()
    return cm


def rank_driver():
    """What a rank process needs from this driver (graphmode/parallel/launch.py `RankDriver`):
    the launcher and torchrun's ranks sit below it in the layers."""
    from graphmode.compile_report import facts_of, graph_collectives
    from graphmode.parallel.launch import RankDriver
    from graphmode.runtime.rank_artifacts import save_group
    return RankDriver(compile=compile, resolve_model=resolve_model, collectives=graph_collectives, save=save_group,
                      facts=facts_of)


def resolve_target(target: Any):
    """A Target, a registry name (`host`, a shipped or user target) or None (no target)."""
    from graphmode.targets import get_target
    from graphmode.targets.schema import Target
    if target is None or isinstance(target, Target):
        return target
    return get_target(target)
