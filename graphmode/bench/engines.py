"""The engines the benchmark compares, each behind one small interface.

An engine is set up for one (model, shape) case, then called with no arguments: the inputs
are bound at setup so a timed call measures inference only (no input conversion).
`outputs(raw)` turns what a call returned into a flat list of tensors for the numerics.
Work shared by the shapes of one model (graphmode's capture + passes, the ONNX export)
lives in `ModelShared` and is charged to `setup_s` of every shape that uses it
(`setup_detail` tells which part was shared).

The decoders `graphmode bench decode` compares (`LMEngine` and its subclasses, below) are set
up once per model instead, then `run(prompts, new)` generates `new` greedy tokens
after each row of `prompts` ([batch, prompt] token ids, no padding, end-of-sequence never
stops a row) and returns a `Run`: the tokens and times measured from the call: when every
row's first token is in the caller's hands (TTFT, `vllm bench serve`'s definition: request
sent -> first streamed token), when the last of those first tokens was produced (decoding
is timed from there) and when the last token was. Engines:

- `eager`: `transformers` generate, dynamic cache (the numerics reference);
- `static_compile`: `transformers` generate with `cache_implementation="static"` and
  `torch.compile(model.forward)` (inductor, `dynamic=False`, so each prompt length and
  batch gets its own graphs: warm-up compiles them);
- `llama_cpp[f32|q8_0|q4_0|q4_K_M]`: llama.cpp through llama-cpp-python's C API on the same
  weights written as GGUF (gguf_export.py); q8_0, q4_0 and q4_K_M are quantized by llama.cpp
  from that file; its KV cache is its
  default f16, one stream per sequence; a prompt is one `llama_decode` call, a decode step
  one call for the whole batch;
- `graphmode`: the decode engine (`graphmode.decode`), requests added together and driven
  until done (`drive`); a step hands its tokens over when it returns, and the step that prefills a
  prompt also decodes its second token, so its TTFT includes one decode step;
  `graphmode[int8]` / `graphmode[bf16]` / `graphmode[int4]` store the linear weights narrow
  (recipe `precision.weights`; int4: symmetric, group 32, as q4_0's blocks),
  `graphmode[int4_q8]` too with `int4_activations: q8` (int8 activation blocks, as q4_0 x q8_0),
  `graphmode[batch_invariant]` (determinism: batch_invariant) prefills each prompt alone and
  batches decode steps over row-invariant kernels; `graphmode[kv_bf16]` / `graphmode[kv_f16]`
  keep the KV pool in bf16 / f16 (memory.kv_cache.dtype; f16 is llama.cpp's default cache);
  `graphmode[merged]` runs the default passes with merge_linears (q/k/v and gate/up as one
  GEMV each): the A/B of that opt-in pass;
- `ort_genai`, `openvino_genai`: reported "not installed" unless their package imports;
  the pipelines themselves are not wired up yet (reported as such).

An engine of either kind that cannot run here raises `EngineUnavailable` from `setup`: its
rows say why, and `--quick` does not count them as failures.
"""
from __future__ import annotations

import copy
import ctypes
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.utils._pytree as pytree

from graphmode.capture.onnx.runtime import ort_session
from graphmode.errors import GraphmodeError
from graphmode.ir.graph import declared_name

ENGINE_NAMES = ("eager", "torch_compile", "onnxruntime", "openvino", "graphmode")
TORCH_COMPILE_VARIANTS = ("default", "max-autotune", "freezing", "max-autotune+freezing")
# what `graphmode bench` runs without --engines: every engine, and torch.compile's max-autotune
# too (the speed goal is against the best of them); a --quick smoke run leaves the variant out
DEFAULT_ENGINES = (("eager", None), ("torch_compile", None), ("torch_compile", "max-autotune"),
                   ("onnxruntime", None), ("openvino", None), ("graphmode", None))


class EngineUnavailable(Exception):
    """The engine cannot run here at all (e.g. not installed): reported, never retried."""


def _reason(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    msg = lines[0] if lines else ""
    return f"{type(e).__name__}: {msg}"[:400] if not isinstance(e, EngineUnavailable) else msg


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
        # no spinning (harness.ENGINE_SETTINGS says why, in every report)
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        so.add_session_config_entry("session.inter_op.allow_spinning", "0")
        t0 = time.perf_counter()
        sess = ort_session(path, so)      # an external-data file ORT cannot parse: its data inlined
        names = [i.name for i in sess.get_inputs()]
        feed = {n: inputs[declared_name(n, inputs) or n].numpy() for n in names}   # the recipe's "x_0" is "x:0"
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
        feed = {n: inputs[declared_name(n, inputs) or n].numpy() for n in names}   # the recipe's "x_0" is "x:0"
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


def graphmode_model(shared: ModelShared, schedule: str | None = None):
    """(CompiledModel, recipe, compile seconds, compiled by this call) for the model,
    compiled once per model (and per loop schedule: `graphmode[dynamic]` compiles the recipe
    with codegen.schedule dynamic, for an A/B of schedules in the same rounds)."""
    key = "graphmode" if schedule in (None, "default") else f"graphmode[{schedule}]"
    got = shared.store.get(key)
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
        if key != "graphmode":
            rec = merge_recipes(rec, {"codegen": {"schedule": schedule}})
        cache = shared.cache_dir
        if cache is None:
            tmp = tempfile.TemporaryDirectory(prefix="graphmode-bench-")
            shared.store["tmp"] = tmp
            cache = tmp.name
        cm = graphmode.compile(shared.bundle, rec, "host", cache_dir=cache, threads=shared.threads,
                               on_stage=shared.on_stage)
        got = shared.store[key] = (cm, rec, time.perf_counter() - t0)
    except Exception as e:  # noqa: BLE001 - remembered so every shape reports the same reason
        shared.store[key] = e
        raise
    return (*got, True)


class GraphmodeEngine(Engine):
    """graphmode: the CompiledModel called like the module (bind, bucket, run, slice). A recipe
    with exe_mode eager is benchmarked too, and reported as the eager fallback it is. A variant
    is a loop schedule (`graphmode[dynamic]`: the recipe's codegen.schedule, omp_loops.SCHEDULES)."""

    name = "graphmode"

    def setup(self, shared, env, inputs):
        from graphmode.backends.cpu.omp_loops import SCHEDULES
        if self.variant not in (None, "default", "auto", *SCHEDULES):
            raise EngineUnavailable(f"unknown graphmode variant {self.variant!r} (a loop schedule: "
                                    f"auto, {', '.join(SCHEDULES)})")
        cm, rec, compile_s, now = graphmode_model(shared, self.variant)
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
        self._env = dict(env)

        def call():
            return cm(**inputs)
        self.call = call
        if cm.mode != "eager" and dict(bucket) != dict(env):
            t0 = time.perf_counter()
            self.setup_detail["settle_calls"] = self._settle(cm, call)
            self.setup_detail["settle_s"] = round(time.perf_counter() - t0, 3)
            self._after_settle(cm, bucket)
        self._calls0, self._fallbacks0 = cm.events["calls"], cm.events["fallback"] + cm.events["eager_choice"]

    def _settle(self, cm: Any, call: Callable[[], Any], most: int = 32) -> int:
        """Call a shape between buckets until its way is chosen and no call builds a plan (each
        way timed, a recurring value's own plans built: runtime/split.py, exact.py), so the
        timed rounds see what a recurring request sees; the calls are setup time. Returns them."""
        from graphmode.runtime.split import shape_key
        for n in range(1, most + 1):
            built = len(cm._executables)
            call()
            cm.wait_for_builds()            # what the call queued: a recurring value's plan, a split's (runtime/plans.py)
            key = shape_key(self._env, cm.last_bucket)
            ways, _ = cm._ways(self._env, cm.last_bucket)
            if len(cm._executables) == built and (len(ways) == 1 or cm.shape_chooser.settled(key, ways)):
                return n
        return most

    def _after_settle(self, cm: Any, bucket: Mapping[str, int]) -> None:
        """What the timed calls run once settled: a recurring value may have got a plan of its own
        (runtime/exact.py: built during the settle calls, setup time), so the request is no longer
        padded into the recipe's bucket; a split runs the buckets it fills."""
        ran = dict(cm.last_bucket or bucket)
        path = getattr(cm, "last_path", None) or {}
        graph = path.get("path") == "graph"
        self.setup_detail.update({"bucket": ran, "padded": graph and ran != self._env and "split" not in path,
                                  "exact_plan": graph and ran != dict(bucket)})
        if "split" in path:
            self.setup_detail["split"] = list(path["split"])

    def execution(self) -> dict[str, Any]:
        """From the CompiledModel's own events: calls that ran eager PyTorch (exe_mode eager, or
        a fallback outside the contract) and the eager islands of a hybrid graph."""
        from graphmode.runtime.split import key_label, shape_key
        cm = self._cm
        calls = cm.events["calls"] - self._calls0
        eager = calls if cm.mode == "eager" else cm.events["fallback"] + cm.events["eager_choice"] - self._fallbacks0
        islands = [] if cm.mode == "eager" or cm.graph is None else [n for n in cm.graph.nodes if n.op == "fallback"]
        reason = (getattr(cm, "last_path", None) or {}).get("reason") or ("exe_mode eager" if cm.mode == "eager"
                                                                           else "fallback event")
        # a shape between buckets: each way's best ms (padded, split, eager: runtime/split.py) and the chosen one
        ran_in = getattr(cm, "last_bucket", None)
        ways = cm.shape_chooser.report().get(key_label(shape_key(self._env, ran_in))) if ran_in else None
        return {"mode": cm.mode, "calls": calls, "eager_calls": eager, "eager_reason": reason if eager else None,
                "eager_islands": len(islands), "island_ops": sorted({str(n.attrs.get("target")) for n in islands}),
                "ways": ways, "ran_in": dict(ran_in) if ran_in else None}

    def close(self):
        self.call = None
        self._cm = None


ENGINES: dict[str, type[Engine]] = {"eager": EagerEngine, "torch_compile": TorchCompileEngine,
                                    "onnxruntime": OnnxRuntimeEngine, "openvino": OpenVinoEngine,
                                    "graphmode": GraphmodeEngine}


def make_engine(name: str, variant: str | None = None) -> Engine:
    return ENGINES[name](variant)


def _named(text: str, known: Any, names: Sequence[str], kind: str) -> list[tuple[str, str | None]]:
    """`a,b[v]` -> [(a, None), (b, v)]; a name not in `known` is refused naming --engines."""
    out = []
    for n in text.split(","):
        base, _, var = n.strip().partition("[")
        if not base:
            continue
        if base not in known:
            raise GraphmodeError(f"unknown {kind} {base!r}", where="--engines", value=text,
                                 fix=f"choose from {', '.join(names)}")
        out.append((base, var.rstrip("]") or None))
    if not out:
        raise GraphmodeError(f"no {kind} named", where="--engines", value=text,
                             fix=f"name at least one of {', '.join(names)} (or leave --engines out for the default)")
    return out


def parse_engines(text: str | None, extra: Sequence[str] = (), quick: bool = False) -> list[tuple[str, str | None]]:
    """`eager,onnxruntime,graphmode` (+ `--with max-autotune` adds torch_compile[max-autotune]);
    no text: DEFAULT_ENGINES (without torch.compile's variants when `quick`)."""
    out = _named(text, ENGINE_NAMES, ENGINE_NAMES, "engine") if text is not None else \
        [e for e in DEFAULT_ENGINES if not (quick and e[1])]
    for w in extra:
        if w not in TORCH_COMPILE_VARIANTS or w == "default":
            raise GraphmodeError(f"unknown --with {w!r}", where="--with",
                                 fix=f"one of {', '.join(v for v in TORCH_COMPILE_VARIANTS if v != 'default')}")
        out.append(("torch_compile", w))
    return list(dict.fromkeys(out))


# ---- decoders (`graphmode bench decode`) ----------------------------------------------------

DECODE_ENGINE_NAMES = ("eager", "static_compile", "llama_cpp", "ort_genai", "openvino_genai", "graphmode")
LLAMA_CPP_VARIANTS = ("f32", "q8_0", "q4_0", "q4_K_M")
WEIGHT_VARIANTS = ("bf16", "int8", "int4")            # graphmode[int8]: recipe precision.weights
INT4_Q8 = "int4_q8"                                    # int4 weights, precision.int4_activations q8
GRAPHMODE_VARIANTS = ("batch_invariant", "kv_bf16", "kv_f16", "merged") + WEIGHT_VARIANTS + (INT4_Q8,)
DECODE_LABELS = {"eager": "transformers eager", "static_compile": "transformers static+compile",
          "llama_cpp": "llama.cpp", "ort_genai": "ORT GenAI", "openvino_genai": "OpenVINO GenAI",
          "graphmode": "graphmode"}


@dataclass
class Run:
    tokens: list[list[int]]          # new tokens per row
    first_s: float                   # call -> every row's first token is in the caller's hands (TTFT)
    end_s: float                     # call -> every row has all its tokens
    produced_s: float | None = None  # call -> the last first token was produced (None: at first_s)

    @property
    def decode_from_s(self) -> float:
        """Where the decode interval starts: tokens 2..new of every row come after it."""
        return self.first_s if self.produced_s is None else self.produced_s


@dataclass
class DecodeShared:
    """What every engine of one model gets."""

    name: str
    bundle: Any
    lm: torch.nn.Module
    recipe: dict
    threads: int
    max_batch: int
    max_tokens: int
    cache_dir: Any = None            # graphmode artifacts (None: a fresh temp dir)
    work: Path | None = None         # scratch folder (GGUF files)
    on_stage: Any = None             # hears graphmode's decoder capture, passes and plans (graphmode/progress.py)


class LMEngine:
    name = "engine"
    dtype = "f32"                    # weights as the engine reads them
    kv_dtype = "f32"

    def __init__(self, variant: str | None = None) -> None:
        self.variant = variant
        self.setup_detail: dict[str, Any] = {}

    @property
    def label(self) -> str:
        base = DECODE_LABELS.get(self.name, self.name)
        return f"{base} {self.variant}" if self.variant else base

    def setup(self, shared: DecodeShared) -> None:
        raise NotImplementedError

    def run(self, prompts: torch.Tensor, new: int) -> Run:
        raise NotImplementedError

    def close(self) -> None:
        pass


class _Stamps:
    """A `transformers` streamer that only timestamps: generate calls `put` with the prompt,
    then with each step's new tokens."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.puts: list[float] = []

    def put(self, value) -> None:
        self.puts.append(time.perf_counter())

    def end(self) -> None:
        pass


class HFEngine(LMEngine):
    name = "eager"
    static = False

    def setup(self, shared):
        from transformers import GenerationConfig
        lm = shared.lm
        if self.static:
            lm = copy.deepcopy(lm)
            lm.forward = torch.compile(lm.forward, dynamic=False)
        self.lm = lm.eval()
        # eos_token_id [] (not None: generate fills None from the model's own config) so that
        # end-of-sequence stops no row, as in every other engine here
        self.gen = GenerationConfig(do_sample=False, use_cache=True, pad_token_id=0, eos_token_id=[],
                                    cache_implementation="static" if self.static else None, disable_compile=True)
        self.setup_detail = {"cache": "static" if self.static else "dynamic",
                             "torch_compile": "inductor, default mode, dynamic=False" if self.static else None}

    def run(self, prompts, new):
        import torch._dynamo
        self.gen.max_new_tokens = new
        st = _Stamps()
        with torch.inference_mode(), torch._dynamo.config.patch(recompile_limit=64):
            out = self.lm.generate(prompts, attention_mask=torch.ones_like(prompts), generation_config=self.gen,
                                   streamer=st)
        end = time.perf_counter()
        first = st.puts[1] if len(st.puts) > 1 else end
        return Run(out[:, prompts.shape[1]:].tolist(), first - st.t0, end - st.t0)

    def close(self):
        self.lm = None


class StaticCompileEngine(HFEngine):
    name = "static_compile"
    static = True


class GraphmodeLMEngine(LMEngine):
    name = "graphmode"

    def __init__(self, variant: str | None = None) -> None:
        super().__init__(variant)
        self.dtype = variant if variant in WEIGHT_VARIANTS else "int4" if variant == INT4_Q8 else "f32"
        self.kv_dtype = {"kv_bf16": "bf16", "kv_f16": "f16"}.get(variant or "", "f32")

    def setup(self, shared):
        import graphmode
        from graphmode.decode.api import engine_of
        cache = shared.cache_dir
        if cache is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="graphmode-bench-decode-")
            cache = self._tmp.name
        t0 = time.perf_counter()
        # exe_mode eager: no whole-sequence graph; the decode engine captures its own
        recipe = shared.recipe
        if self.variant == "batch_invariant":
            recipe = dict(recipe, determinism=self.variant)
        elif self.variant in WEIGHT_VARIANTS:
            recipe = dict(recipe, precision={"compute": "f32", "weights": self.variant})
        elif self.variant == INT4_Q8:
            recipe = dict(recipe, precision={"compute": "f32", "weights": "int4", "int4_activations": "q8"})
        elif self.variant in ("kv_bf16", "kv_f16"):
            recipe = dict(recipe, memory={"kv_cache": dict(recipe["memory"]["kv_cache"], dtype=self.kv_dtype)})
        elif self.variant == "merged":
            from graphmode.passes.registry import PRESETS, with_merged_linears
            recipe = dict(recipe, optimize={"passes": with_merged_linears(PRESETS["default"])})
        cm = graphmode.compile(shared.bundle, recipe, "host", mode="eager", cache_dir=cache,
                               threads=shared.threads, on_stage=shared.on_stage)
        self.eng = engine_of(cm)
        # the scenarios time cold prefills of prompts they repeat: no prefix cache, but for the
        # repeated-system-prompt scenario (bench/prefix.py), which switches it on and off
        self.eng.prefix_caching = False
        self.setup_detail = {"engine_build_s": round(time.perf_counter() - t0, 3),
                             "kv_pages": self.eng.layout.pages, "page_size": self.eng.layout.page_size,
                             "recipe": shared.recipe.get("name")}

    def run(self, prompts, new):
        from graphmode.decode.engine import drive
        from graphmode.decode.sampling import SamplingParams
        params = SamplingParams(max_new_tokens=new)          # greedy; no end-of-sequence token
        t0 = time.perf_counter()
        seqs = [self.eng.add(row, params) for row in prompts.tolist()]
        seen = None
        for _ in drive(self.eng, seqs):
            if seen is None and all(s.generated for s in seqs):
                seen = time.perf_counter()
        end = time.perf_counter()
        return Run([s.generated for s in seqs], seen - t0, end - t0, max(s.first_token_at for s in seqs) - t0)

    def close(self):
        self.eng = None
        tmp = getattr(self, "_tmp", None)
        if tmp is not None:
            tmp.cleanup()


@dataclass
class _LlamaCtx:
    ctx: Any
    batch: Any
    seqs: int


class LlamaCppEngine(LMEngine):
    name = "llama_cpp"
    kv_dtype = "f16"

    def __init__(self, variant=None):
        super().__init__(variant or "f32")
        self.dtype = self.variant
        self._ctxs: dict[int, _LlamaCtx] = {}
        self.model = None

    def setup(self, shared):
        try:
            import llama_cpp
        except ImportError:
            raise EngineUnavailable("not installed (pip install llama-cpp-python gguf; it builds llama.cpp from "
                                    "source, minutes on 2 cores)") from None
        if self.variant not in LLAMA_CPP_VARIANTS:
            raise EngineUnavailable(f"unknown llama.cpp variant {self.variant!r}")
        from graphmode.bench.gguf_export import timed_gguf
        from graphmode.bench.machine import _version
        self.ll = llama_cpp
        _quiet(llama_cpp)
        llama_cpp.llama_backend_init()
        path, gguf_s = timed_gguf(shared.lm, shared.work, shared.name, self.variant, shared.threads)
        self.model = llama_cpp.llama_model_load_from_file(str(path).encode(), llama_cpp.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        self.threads, self.max_tokens = shared.threads, shared.max_tokens
        self.setup_detail = {"gguf_s": round(gguf_s, 3), "gguf_mb": round(path.stat().st_size / 2**20, 1),
                             "weights": self.variant, "kv_cache": "f16 (llama.cpp default)",
                             "version": _version("llama_cpp_python")}

    def _ctx(self, seqs: int) -> _LlamaCtx:
        """One context per batch size: `seqs` KV streams of max_tokens each."""
        got = self._ctxs.get(seqs)
        if got is None:
            ll = self.ll
            p = ll.llama_context_default_params()
            p.n_seq_max = seqs
            p.n_ctx = seqs * self.max_tokens
            p.n_batch = p.n_ubatch = max(512, seqs)
            p.n_threads = p.n_threads_batch = self.threads
            p.kv_unified = False
            ctx = ll.llama_init_from_model(self.model, p)
            if not ctx:
                raise RuntimeError(f"llama.cpp could not create a context for {seqs} sequences")
            got = self._ctxs[seqs] = _LlamaCtx(ctx, ll.llama_batch_init(max(512, seqs, self.max_tokens), 0, 1), seqs)
        return got

    def _decode(self, c: _LlamaCtx, items: list[tuple[int, int, int, bool]]) -> None:
        """items: (token, position, sequence, wants logits)."""
        b = c.batch
        for i, (tok, pos, seq, out) in enumerate(items):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, out
            b.seq_id[i][0] = seq
        b.n_tokens = len(items)
        rc = self.ll.llama_decode(c.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def _argmax(self, c: _LlamaCtx, i: int) -> int:
        import numpy as np
        ptr = self.ll.llama_get_logits_ith(c.ctx, i)
        return int(np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).argmax())

    def run(self, prompts, new):
        rows = prompts.tolist()
        c = self._ctx(len(rows))
        self.ll.llama_memory_clear(self.ll.llama_get_memory(c.ctx), True)
        t0 = time.perf_counter()
        out: list[list[int]] = []
        for s, row in enumerate(rows):           # one prompt per call, logits at its last token only
            self._decode(c, [(t, p, s, p == len(row) - 1) for p, t in enumerate(row)])
            out.append([self._argmax(c, len(row) - 1)])
        first = time.perf_counter()
        for k in range(1, new):
            self._decode(c, [(out[s][-1], len(rows[s]) + k - 1, s, True) for s in range(len(rows))])
            for s in range(len(rows)):
                out[s].append(self._argmax(c, s))
        end = time.perf_counter()
        return Run(out, first - t0, end - t0)

    def close(self):
        ll = getattr(self, "ll", None)
        for c in self._ctxs.values():
            ll.llama_batch_free(c.batch)
            ll.llama_free(c.ctx)
        self._ctxs.clear()
        if self.model:
            ll.llama_model_free(self.model)
        self.model = None


_LOG_CB = None


def _quiet(llama_cpp) -> None:
    """llama.cpp logs every load and context to stderr; the benchmark's own log is enough."""
    global _LOG_CB
    if _LOG_CB is None:
        _LOG_CB = llama_cpp.llama_log_callback(lambda level, text, data: None)
        llama_cpp.llama_log_set(_LOG_CB, ctypes.c_void_p(0))


class _Unwired(LMEngine):
    """A runtime whose pipeline is not wired up yet: a row that says so, never a silent gap."""

    module = ""
    package = ""

    def setup(self, shared):
        import importlib.util
        if importlib.util.find_spec(self.module) is None:
            raise EngineUnavailable(f"not installed (pip install {self.package}); the benchmark does not drive it "
                                    "yet either")
        raise EngineUnavailable(f"{self.module} is installed, but the benchmark does not drive it yet")


class OrtGenAIEngine(_Unwired):
    name = "ort_genai"
    module = "onnxruntime_genai"
    package = "onnxruntime-genai"


class OpenVinoGenAIEngine(_Unwired):
    name = "openvino_genai"
    module = "openvino_genai"
    package = "openvino-genai"


DECODE_ENGINES: dict[str, type[LMEngine]] = {"eager": HFEngine, "static_compile": StaticCompileEngine,
                                          "llama_cpp": LlamaCppEngine, "ort_genai": OrtGenAIEngine,
                                          "openvino_genai": OpenVinoGenAIEngine, "graphmode": GraphmodeLMEngine}


def parse_decode_engines(text: str | None) -> list[tuple[str, str | None]]:
    """`eager,llama_cpp[q8_0],graphmode`; plain `llama_cpp` means every variant (f32, q8_0, q4_0,
    q4_K_M)."""
    out: list[tuple[str, str | None]] = []
    for base, var in _named(text if text is not None else ",".join(DECODE_ENGINE_NAMES), DECODE_ENGINES,
                            DECODE_ENGINE_NAMES, "decode engine"):
        n = f"{base}[{var}]" if var else base
        if base == "graphmode" and var is not None and var not in GRAPHMODE_VARIANTS:
            raise GraphmodeError(f"unknown graphmode variant {var!r}", where="--engines", value=n,
                                 fix="graphmode, graphmode[batch_invariant] (determinism: batch_invariant: its cost "
                                     "against graphmode), graphmode[int8], graphmode[bf16] or graphmode[int4] "
                                     "(precision.weights), graphmode[int4_q8] (int4_activations: q8), "
                                     "graphmode[kv_bf16] or graphmode[kv_f16] (memory.kv_cache.dtype), "
                                     "graphmode[merged]")
        if base == "llama_cpp" and var is not None and var not in LLAMA_CPP_VARIANTS:
            raise GraphmodeError(f"unknown llama.cpp weights {var!r}", where="--engines", value=n,
                                 fix=f"llama_cpp[{'] or llama_cpp['.join(LLAMA_CPP_VARIANTS)}]")
        out += [(base, v) for v in (LLAMA_CPP_VARIANTS if base == "llama_cpp" and var is None else (var,))]
    return list(dict.fromkeys(out))


def make_decode_engine(name: str, variant: str | None = None) -> LMEngine:
    return DECODE_ENGINES[name](variant)
