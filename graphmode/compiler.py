"""The pipeline as functions: capture -> optimize -> (plan per bucket) -> CompiledModel.

    graph, cap = graphmode.capture("minilm", recipe)
    graph, report = graphmode.optimize(graph, recipe, target)
    model = graphmode.compile("minilm", recipe)          # callable like the module
"""
from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from graphmode.capture.torch_import import CaptureReport, import_torch
from graphmode.errors import CaptureError, RecipeError
from graphmode.ir.graph import Graph
from graphmode.progress import OnStage, PassProgress, stage
from graphmode.recipe import Recipe, load_recipe
from graphmode.runtime.compiled import constant_inputs


@dataclass
class ModelSource:
    """What capture needs: a module with named example inputs, or an ONNX file."""

    name: str
    module: torch.nn.Module | None = None
    example_inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    input_dims: dict[str, list] = field(default_factory=dict)
    output_names: list[str] = field(default_factory=list)
    onnx_path: Path | None = None
    bundle: Any = None   # graphmode.capture.zoo.ModelBundle when built-in
    # a decoder's forward (graphmode/decode/engine.py): exported over these ranges rather than the
    # recipe's (a batch of one still exports dynamic), and padded only where its graph masks the
    # padding itself (paged attention reads each row's length, the head its last position), so
    # the verdict's padding analysis, which knows the captured graph, does not apply
    capture_dims: dict[str, tuple[int, int]] | None = None
    masks_padding: bool = False
    constants: dict[str, torch.Tensor] = field(default_factory=dict)   # inputs the recipe declares constant

    def make_inputs(self, env: dict[str, int], seed: int = 0) -> dict[str, torch.Tensor]:
        if self.bundle is not None:
            return {**self.bundle.make_inputs(env, seed=seed), **self.constants}
        raise CaptureError("no input generator for this model", where=f"model {self.name}",
                           fix="use a built-in model, an .onnx file or a ModelBundle (it has make_inputs)")

    def reference(self, inputs: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        """The ground truth outputs: eager PyTorch, or ONNX Runtime for an ONNX model."""
        if self.module is not None:
            with torch.inference_mode():
                out = self.module(**inputs)
            return list(out) if isinstance(out, (tuple, list)) else [out]
        import onnxruntime as ort
        try:
            if getattr(self, "_ort", None) is None:
                self._ort = ort.InferenceSession(str(self.onnx_path), providers=["CPUExecutionProvider"])
            res = self._ort.run(None, {k: v.numpy() for k, v in inputs.items()})
        except Exception as e:  # noqa: BLE001 - onnxruntime raises its own exception types
            raise CaptureError(f"ONNX Runtime cannot run this model for reference: {type(e).__name__}: "
                               f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}",
                               where=f"model {self.onnx_path}",
                               fix="check the model with onnx.checker and onnxruntime directly") from None
        return [torch.from_numpy(r) for r in res]


def as_recipe(recipe: Recipe | str | Path) -> Recipe:
    if isinstance(recipe, Recipe):
        return recipe
    return load_recipe(recipe)


def resolve_model(model: Any, recipe: Recipe) -> ModelSource:
    """Whatever the user passed (built-in name, .onnx path, 'pkg.mod:fn' spec, nn.Module,
    (module, example_inputs[, input_dims]), Hugging Face model, ModelBundle) -> ModelSource.
    A plain nn.Module takes its example inputs from the recipe's declared inputs."""
    from graphmode.capture.spec import OnnxModelSpec, as_model, bundle_from_module
    if isinstance(model, ModelSource):
        return model
    if isinstance(model, torch.nn.Module):
        ex = example_inputs_from_recipe(recipe, model)
        try:                                   # forward's order: the compiled model binds positional args like it
            params = list(inspect.signature(model.forward).parameters)
        except (TypeError, ValueError):
            params = []
        ex = dict(sorted(ex.items(), key=lambda kv: params.index(kv[0]) if kv[0] in params else len(params)))
        model = bundle_from_module(model, ex, {i.name: list(i.shape) for i in recipe.inputs})
    model = as_model(model)
    if isinstance(model, OnnxModelSpec):
        return ModelSource(model.path.stem, onnx_path=model.path,
                           input_dims={i.name: list(i.shape) for i in recipe.inputs},
                           output_names=list(model.output_names), bundle=model,
                           constants=constant_inputs(recipe))
    dims = {i.name: list(i.shape) for i in recipe.inputs}
    missing = [n for n in model.input_names if n not in dims]
    if missing:
        raise RecipeError(f"the model takes inputs {missing} that the recipe does not declare",
                          where="inputs", fix=f"declare every model input: {model.input_names}")
    from graphmode.verdict import ContractRefused, example_mismatches
    issues = example_mismatches(recipe, model.example_inputs, model.input_dims)
    if issues:
        raise ContractRefused(issues)
    if model.input_maker is None and {k: dims[k] for k in model.input_names} != model.input_dims:
        # the recipe's shapes are the contract: sample inputs (run, verify) follow them,
        # not the static shapes of the example the model was handed with
        import dataclasses
        model = dataclasses.replace(model, input_dims={k: dims[k] for k in model.input_names})
    from graphmode.capture.torch_import import example_sizes
    examples = model.make_inputs(example_sizes({d: recipe.dim_range(d) for d in recipe.dims}), seed=0)
    return ModelSource(model.name, model.module, examples, {k: dims[k] for k in model.input_names},
                       list(model.output_names), bundle=model)


def example_inputs_from_recipe(recipe: Recipe, module: Any = None) -> dict[str, torch.Tensor]:
    """One example per declared input at small sizes of the recipe's dims: floats random, masks
    ones, token types zeros, token ids inside the module's vocabulary (its config's), other
    integers ones."""
    from graphmode.capture.torch_import import example_sizes
    from graphmode.ir.types import DTYPES
    sizes = example_sizes({d: recipe.dim_range(d) for d in recipe.dims})
    vocab = getattr(getattr(module, "config", None), "vocab_size", None)
    g = torch.Generator().manual_seed(0)
    out = {}
    for spec in recipe.inputs:
        shape = [sizes[d] if isinstance(d, str) else d for d in spec.shape]
        dt = DTYPES[spec.dtype]
        if dt.is_floating_point:
            out[spec.name] = torch.randn(shape, generator=g).to(dt)
        elif "type" in spec.name:
            out[spec.name] = torch.zeros(shape, dtype=dt)
        elif spec.name.endswith("ids") and isinstance(vocab, int) and vocab > 3 and dt != torch.bool:
            out[spec.name] = torch.randint(3, vocab, shape, generator=g).to(dt)
        else:
            out[spec.name] = torch.ones(shape, dtype=dt)
    out.update(constant_inputs(recipe))
    return out


def checked_capture(model: Any, recipe: Recipe | str | Path, mode: str | None = None):
    """capture() plus the verdict every entry point shares: (graph, report, source, verdict)."""
    from graphmode.verdict import decide
    recipe = as_recipe(recipe)
    graph, rep, src = capture(model, recipe)
    return graph, rep, src, decide(recipe, graph, rep, src, mode or recipe.exe_mode)


def capture(model: Any, recipe: Recipe | str | Path) -> tuple[Graph, CaptureReport, ModelSource]:
    """Model -> IR graph with the recipe's dynamic dims and capture include/exclude lists."""
    recipe = as_recipe(recipe)
    src = resolve_model(model, recipe)
    dims = src.capture_dims or {d: recipe.dim_range(d) for d in recipe.dims}
    if src.onnx_path is not None:
        from graphmode.capture.onnx import import_onnx
        g, rep = import_onnx(src.onnx_path, dims=dims, input_dims=src.input_dims, name=src.name,
                             include_ops=recipe.capture.include_ops, exclude_ops=recipe.capture.exclude_ops,
                             input_values=constant_inputs(recipe))
        return g, rep, src
    g, rep = import_torch(src.module, src.example_inputs, src.input_dims, dims, name=src.name,
                          include_ops=recipe.capture.include_ops, exclude_ops=recipe.capture.exclude_ops,
                          output_names=src.output_names,
                          output_structure=getattr(src.bundle, "output_structure", None))
    return g, rep, src


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
               "quantize_weights": {"weights": recipe.precision.weights},
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


def prove(recipe: Recipe, target: Any, graph: Graph):
    """The recipe's three verification layers with the compiled graph's own facts (real weights,
    the memory planner's activation peak, FLOPs): the same proof `graphmode compile` prints."""
    from graphmode.compile_report import model_facts
    from graphmode.plan.memory import activation_peak_expr
    from graphmode.recipe import validate
    act = activation_peak_expr(graph, reuse=recipe.optimize.memory_reuse,
                               alias_groups=[list(g) for g in recipe.alias_groups])
    return validate(recipe, target, model_facts(graph, act))


@dataclass
class Lowered:
    """A model checked and optimised under a recipe: what every entry point builds plans from."""

    source: ModelSource
    captured: Graph
    capture_report: CaptureReport
    verdict: Any                  # graphmode.verdict.Verdict
    graph: Graph
    optimize_report: OptimizeReport
    proof: Any                    # graphmode.recipe.ValidationReport with the graph's own facts


def lower_model(model: Any, recipe: Recipe | str | Path, target: Any = None, *, mode: str | None = None,
                keep_snapshots: bool = False, on_stage: OnStage | None = None, rank: int = 0) -> Lowered:
    """capture -> verdict -> passes -> proof, refusing (typed errors) at the first that fails:
    the one path compile, verify, run, serve and `plan show` share. `on_stage` hears the
    capture, passes and proof stages (graphmode/progress.py). Under `parallel`, `rank`'s shard."""
    recipe = as_recipe(recipe)
    with stage(on_stage, "capture"):
        graph0, cap, src, verdict = checked_capture(model, recipe, mode)
    verdict.raise_for_refusal()
    graph, opt = optimize(graph0, recipe, target, buckets=[], keep_snapshots=keep_snapshots, on_stage=on_stage,
                          rank=rank)
    with stage(on_stage, "proof"):
        proof = prove(recipe, target, graph)
    proof.raise_for_errors()      # a recipe that is not proved is never loaded
    return Lowered(src, graph0, cap, verdict, graph, opt, proof)


def compile(model: Any, recipe: Recipe | str | Path | None = None, target: Any = "host", *, mode: str | None = None,
            cache_dir: str | Path | None = None, threads: int | None = None, warmup: bool = False,
            on_stage: OnStage | None = None, rank: int | None = None):
    """Capture, optimise and wrap a model; plans are built per bucket on first use (or warm-up).
    Without a recipe, one is drafted as `graphmode recipe init` does (said once, `cm.recipe`).
    `on_stage` hears the capture, passes, proof and plans stages (graphmode/progress.py).
    Under `parallel.tensor` N > 1: without `rank`, the N rank processes are started and the
    result is a `graphmode.parallel.launch.TensorParallelModel` (rank 0 answers); with `rank`,
    this process compiles that rank's shard only (its collectives need a bound communicator)."""
    from graphmode.runtime.compiled import CompiledModel
    tgt = _target(target)
    if recipe is None:
        from graphmode.kb.draft import drafted
        model, recipe = drafted(model, tgt)
    recipe = as_recipe(recipe)
    mode = mode or recipe.exe_mode
    if tensor_parallel(recipe) > 1 and rank is None and mode != "eager":
        from graphmode.parallel.launch import launch
        return launch(model, recipe, tgt, mode=mode, cache_dir=cache_dir, threads=threads)   # ranks warm up
    if mode == "eager":
        src = resolve_model(model, recipe)
        return _decoding(CompiledModel(src, recipe, tgt, None, None, None, mode="eager", cache_dir=cache_dir,
                                       threads=threads, on_stage=on_stage))
    low = lower_model(model, recipe, tgt, mode=mode, on_stage=on_stage, rank=rank or 0)
    cm = CompiledModel(low.source, recipe, tgt, low.captured, low.graph, (low.capture_report, low.optimize_report),
                       mode=mode, cache_dir=cache_dir, threads=threads, verdict=low.verdict, on_stage=on_stage)
    cm.spill_constants()
    if warmup:
        cm.warmup()
    return _decoding(cm)


def _decoding(cm: Any) -> Any:
    """A model under a recipe with a KV cache decodes: `cm.generate` / `cm.stream` (its decode
    engine is built on first use, graphmode/decode/api.py)."""
    if cm.recipe.memory.kv_cache is not None:
        from graphmode.decode import api
        cm.decoding = api
    return cm


def _target(target: Any):
    from graphmode.targets import get_target
    from graphmode.targets.schema import Target
    if target is None or isinstance(target, Target):
        return target
    return get_target(target)
