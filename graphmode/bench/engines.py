"""The engines the benchmark compares, each behind one small interface.

An engine is set up for one (model, shape) case, then called with no arguments: the inputs
are bound at setup so a timed call measures inference only (no input conversion).
`outputs(raw)` turns what a call returned into a flat list of tensors for the numerics.
Work shared by the shapes of one model (graphmode's capture + passes, the ONNX export)
lives in `ModelShared` and is charged to `setup_s` of every shape that uses it
(`setup_detail` tells which part was shared).
"""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree

ENGINE_NAMES = ("eager", "torch_compile", "onnxruntime", "openvino", "graphmode")
TORCH_COMPILE_VARIANTS = ("default", "max-autotune", "freezing", "max-autotune+freezing")
# what `graphmode bench` runs without --engines: every engine, and torch.compile's max-autotune
# too (the speed goal is against the best of them); a --quick smoke run leaves the variant out
DEFAULT_ENGINES = (("eager", None), ("torch_compile", None), ("torch_compile", "max-autotune"),
                   ("onnxruntime", None), ("openvino", None), ("graphmode", None))


class EngineUnavailable(Exception):
    """The engine cannot run here at all (e.g. not installed): reported, never retried."""


@dataclass
class ModelShared:
    """Per-model state the engines reuse across shapes."""

    bundle: Any
    envs: list[dict[str, int]]
    threads: int
    recipe: Any = None                 # --recipe path/dict, else an auto recipe at the shapes
    cache_dir: Any = None              # graphmode artifact cache (None: a fresh temp dir, cold)
    onnx_cache_dir: Any = None
    isa: str | None = None             # --isa: the recipe's codegen.isa replaced (None: as it is)
    on_stage: Any = None               # hears graphmode's compile stages (graphmode/progress.py)
    store: dict[str, Any] = field(default_factory=dict)


def flat_tensors(out: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]


class Engine:
    name = "engine"

    def __init__(self, variant: str | None = None) -> None:
        self.variant = variant
        self.setup_detail: dict[str, Any] = {}
        self.extra_s = 0.0        # shared setup paid outside this setup() call, charged to this shape
        self.call: Callable[[], Any] | None = None

    @property
    def label(self) -> str:
        return self.name if not self.variant or self.variant == "default" else f"{self.name}[{self.variant}]"

    def setup(self, shared: ModelShared, env: dict[str, int], inputs: dict[str, torch.Tensor]) -> None:
        raise NotImplementedError

    def __call__(self) -> Any:
        assert self.call is not None, "setup() first"
        return self.call()

    def outputs(self, raw: Any) -> list[torch.Tensor]:
        return flat_tensors(raw)

    def execution(self) -> dict[str, Any] | None:
        """How the calls since setup ran, for an engine that may not run what its name says
        (graphmode's eager fallback); None: it always runs itself."""
        return None

    def close(self) -> None:
        self.call = None


class EagerEngine(Engine):
    """The module as written, under torch.inference_mode (the numerics reference)."""

    name = "eager"

    def setup(self, shared, env, inputs):
        module = shared.bundle.module.eval()

        def call():
            with torch.inference_mode():
                return module(**inputs)
        self.call = call
        self.setup_detail = {"note": "module built at model load (see meta.models[].load_s)"}


class TorchCompileEngine(Engine):
    """torch.compile (inductor) of a fresh deep copy per shape, static shapes.

    A fresh copy because compiling the same module twice with identical options reuses the
    first compile (torch 2.13); `dynamic=False` so the second shape of a model does not get
    a dynamic-shape kernel; freezing through `torch._inductor.config.patch` because
    `options={"freezing": True}` does not freeze in 2.13; the on-disk compile caches are off
    during the compile so `setup_s` is a cold compile."""

    name = "torch_compile"

    def setup(self, shared, env, inputs):
        from torch._dynamo.utils import counters
        variant = self.variant or "default"
        if variant not in TORCH_COMPILE_VARIANTS:
            raise EngineUnavailable(f"unknown torch.compile variant {variant!r}")
        mode = "max-autotune" if "max-autotune" in variant else None
        freezing = "freezing" in variant
        module = copy.deepcopy(shared.bundle.module).eval()
        compiled = torch.compile(module, backend="inductor", mode=mode, dynamic=False)
        graphs0 = counters["stats"]["unique_graphs"]
        import torch._functorch.config as functorch_config
        import torch._inductor.config as inductor_config
        # a cold compile, like graphmode's: no on-disk FX-graph / AOTAutograd cache hits from earlier runs
        patch = {"fx_graph_cache": False, "autotune_local_cache": False}
        if freezing:
            patch["freezing"] = True
        t0 = time.perf_counter()
        with inductor_config.patch(patch), functorch_config.patch(enable_autograd_cache=False), \
                torch.inference_mode():
            compiled(**inputs)
        compiled_graphs = counters["stats"]["unique_graphs"] - graphs0
        if compiled_graphs <= 0:
            raise RuntimeError("dynamo compiled no graph (it fell back to eager: recompile limit or "
                               "an unsupported model)")
        self.setup_detail = {"first_call_compile_s": round(time.perf_counter() - t0, 3), "mode": mode or "default",
                             "freezing": freezing, "dynamic": False, "graphs": compiled_graphs}
        self._module = compiled

        def call():
            with torch.inference_mode():
                return compiled(**inputs)
        self.call = call

    def close(self):
        self.call = None
        self._module = None


def _onnx_path(shared: ModelShared) -> tuple[str, dict[str, Any], float]:
    """(path, detail, export seconds paid outside this call): the export runs once per model
    (and is cached on disk across runs); its recorded time is charged to every shape."""
    rec = shared.store.get("onnx")
    fresh = False
    if rec is None:
        fresh = True
        from graphmode.capture.onnx_export import export_onnx
        t0 = time.perf_counter()
        try:
            r = export_onnx(shared.bundle, cache_dir=shared.onnx_cache_dir)
        except Exception as e:  # noqa: BLE001 - remembered so other shapes report the same reason
            shared.store["onnx"] = e
            raise
        rec = shared.store["onnx"] = (r, time.perf_counter() - t0)
    if isinstance(rec, Exception):
        raise rec
    r, wall = rec
    paid_now = fresh and not r.cached
    return r.path, {"onnx_export_s": round(r.seconds, 3), "onnx_cached": bool(r.cached),
                    "onnx_exporter": r.exporter, "onnx_opset": r.opset}, (0.0 if paid_now else float(r.seconds))


class OnnxRuntimeEngine(Engine):
    """ONNX Runtime CPU: ORT_ENABLE_ALL, intra_op_num_threads = threads, sequential, no spinning
    pool threads (they would slow down the engine timed next)."""

    name = "onnxruntime"

    def setup(self, shared, env, inputs):
        try:
            import onnxruntime as ort
        except ImportError:
            raise EngineUnavailable("not installed") from None
        path, detail, self.extra_s = _onnx_path(shared)
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        so.intra_op_num_threads = shared.threads
        so.inter_op_num_threads = 1
        so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        so.log_severity_level = 3
        # ORT's pool threads spin for a while after each run; interleaved with the other engines in
        # one process they would steal the cores from whichever engine runs next (eager measured
        # 2.1x slower right after ORT on 2 cores). Without spinning every engine gets the machine.
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        so.add_session_config_entry("session.inter_op.allow_spinning", "0")
        t0 = time.perf_counter()
        sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
        names = [i.name for i in sess.get_inputs()]
        feed = {n: inputs[n].numpy() for n in names}
        self.setup_detail = {**detail, "session_s": round(time.perf_counter() - t0, 3),
                             "setup_includes": "onnx export (from its cache record) + session + first call"}
        self._sess = sess
        self.call = lambda: sess.run(None, feed)

    def outputs(self, raw):
        return [torch.from_numpy(a) for a in raw]

    def close(self):
        self.call = None
        self._sess = None


class OpenVinoEngine(Engine):
    """OpenVINO CPU from the same ONNX file (reported as not installed when absent)."""

    name = "openvino"

    def setup(self, shared, env, inputs):
        try:
            import openvino as ov
        except ImportError:
            raise EngineUnavailable("not installed") from None
        path, detail, self.extra_s = _onnx_path(shared)
        core = ov.Core()
        t0 = time.perf_counter()
        # fp32 like every other engine: OpenVINO's CPU plugin otherwise computes in bf16 where the CPU has it
        compiled = core.compile_model(path, "CPU", {"INFERENCE_NUM_THREADS": shared.threads,
                                                    "PERFORMANCE_HINT": "LATENCY", "INFERENCE_PRECISION_HINT": "f32"})
        names = [p.get_any_name() for p in compiled.inputs]
        feed = {n: inputs[n].numpy() for n in names}
        req = compiled.create_infer_request()
        self.setup_detail = {**detail, "compile_s": round(time.perf_counter() - t0, 3)}
        self._req = req

        def call():
            res = req.infer(feed)
            return [res[o] for o in compiled.outputs]
        self.call = call

    def outputs(self, raw):
        import numpy as np
        return [torch.from_numpy(np.asarray(a)) for a in raw]

    def close(self):
        self.call = None
        self._req = None


def graphmode_model(shared: ModelShared):
    """(CompiledModel, recipe, compile seconds, compiled by this call) for the model,
    compiled once per model."""
    got = shared.store.get("graphmode")
    if isinstance(got, Exception):
        raise got
    if got is not None:
        return (*got, False)
    import tempfile

    import graphmode
    from graphmode.bench.models import auto_recipe
    from graphmode.recipe import load_recipe, merge_recipes
    try:
        t0 = time.perf_counter()
        rec = load_recipe(shared.recipe if shared.recipe is not None else auto_recipe(shared.bundle, shared.envs))
        if shared.isa is not None:
            rec = merge_recipes(rec, {"codegen": {"isa": shared.isa}})
        cache = shared.cache_dir
        if cache is None:
            tmp = tempfile.TemporaryDirectory(prefix="graphmode-bench-")
            shared.store["tmp"] = tmp
            cache = tmp.name
        cm = graphmode.compile(shared.bundle, rec, "host", cache_dir=cache, threads=shared.threads,
                               on_stage=shared.on_stage)
        got = shared.store["graphmode"] = (cm, rec, time.perf_counter() - t0)
    except Exception as e:  # noqa: BLE001 - remembered so every shape reports the same reason
        shared.store["graphmode"] = e
        raise
    return (*got, True)


class GraphmodeEngine(Engine):
    """graphmode: the CompiledModel called like the module (bind, bucket, run, slice). A recipe
    with exe_mode eager is benchmarked too, and reported as the eager fallback it is."""

    name = "graphmode"

    def setup(self, shared, env, inputs):
        cm, rec, compile_s, now = graphmode_model(shared)
        bucket = rec.bucket_for(dict(env))
        if bucket is None:
            raise RuntimeError(f"shape {env} is outside the recipe's dims {rec.dim_buckets()}")
        t0 = time.perf_counter()
        exe = cm.executable(bucket) if cm.mode != "eager" else None     # eager mode has no plans
        build_s = time.perf_counter() - t0
        self.extra_s = 0.0 if now else compile_s
        self.setup_detail = {"compile_s": round(compile_s, 3), "compile_shared_by_shapes": len(shared.envs),
                             "bucket": dict(bucket), "padded": dict(bucket) != dict(env), "exe_mode": cm.mode,
                             "bucket_build_s": round(build_s, 3), "steps": len(exe.steps) if exe else 0,
                             "generated_kernels": getattr(exe, "generated", 0),
                             "recipe": rec.name}
        self.bucket = dict(bucket)
        self._cm = cm
        self._calls0, self._fallbacks0 = cm.events["calls"], cm.events["fallback"]

        def call():
            return cm(**inputs)
        self.call = call

    def execution(self) -> dict[str, Any]:
        """From the CompiledModel's own events: calls that ran eager PyTorch (exe_mode eager, or
        a fallback outside the contract) and the eager islands of a hybrid graph."""
        cm = self._cm
        calls = cm.events["calls"] - self._calls0
        eager = calls if cm.mode == "eager" else cm.events["fallback"] - self._fallbacks0
        islands = [] if cm.mode == "eager" or cm.graph is None else [n for n in cm.graph.nodes if n.op == "fallback"]
        reason = (getattr(cm, "last_path", None) or {}).get("reason") or ("exe_mode eager" if cm.mode == "eager"
                                                                           else "fallback event")
        return {"mode": cm.mode, "calls": calls, "eager_calls": eager, "eager_reason": reason if eager else None,
                "eager_islands": len(islands), "island_ops": sorted({str(n.attrs.get("target")) for n in islands})}

    def close(self):
        self.call = None
        self._cm = None


ENGINES: dict[str, type[Engine]] = {"eager": EagerEngine, "torch_compile": TorchCompileEngine,
                                    "onnxruntime": OnnxRuntimeEngine, "openvino": OpenVinoEngine,
                                    "graphmode": GraphmodeEngine}


def make_engine(name: str, variant: str | None = None) -> Engine:
    return ENGINES[name](variant)
