"""CompiledModel: callable like the original module, runs plans per shape bucket.

Per call: bind inputs -> check their values (index inputs against the model's tables, the
recipe's ranges: runtime/bounds.py) -> find the smallest admissible bucket -> pad -> run that bucket's
executable -> slice outputs back -> rebuild the module's output structure. A batch between
buckets of a model whose rows never meet may instead run as batches that fill buckets exactly,
whichever measured faster (runtime/split.py). A shape outside
the contract raises ContractViolation (or runs eagerly when `on_violation: eager`). Every
compile, fallback and violation is an event counted in `events` and logged.
"""
from __future__ import annotations

import inspect
import logging
import threading
import time
from collections import Counter
from typing import Any, Mapping

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree

from graphmode.backends.registry import DEFAULT_DEVICE
from graphmode.capture.source import constant_inputs
from graphmode.errors import ContractViolation, GraphmodeError, RecipeError
from graphmode.ir.graph import Graph
from graphmode.ir.types import eval_dim
from graphmode.progress import OnStage, stage
from graphmode.runtime.split import Chooser, chunks, output_axes

log = logging.getLogger("graphmode.runtime")
SPLIT_DIM = "batch"     # the dim a request between buckets may be cut along (runtime/split.py)


class CompiledModel:
    def __init__(self, source, recipe, target, captured: Graph | None, graph: Graph | None, reports,
                 *, mode: str = "graph", cache_dir=None, threads: int | None = None, verdict=None,
                 device: str = DEFAULT_DEVICE, on_stage: OnStage | None = None, lowered: Any = None):
        self.source = source
        # graphmode.compiler.Lowered when the driver lowered it: the proof, the facts it was
        # checked against and each stage's time (None for an eager model or a loaded artifact)
        self.lowered = lowered
        self.recipe = recipe
        self.target = target
        self.captured_graph = captured
        self.graph = graph
        self.capture_report, self.optimize_report = reports if reports else (None, None)
        self.mode = mode
        self.cache_dir = cache_dir
        self.threads = threads
        self.device = device     # the backend (backends/registry.py) that builds and runs the plans
        self.verdict = verdict
        # hears plan builds (graphmode/progress.py): warm-up's "bucket N of M", one on first use
        self.on_stage = on_stage
        # the decode API (graphmode/decode/api.py) that graphmode.compile attaches when the recipe
        # declares memory.kv_cache: `generate` and `stream` run it (decode builds on runtime, not
        # the other way round)
        self.decoding: Any = None
        # dims the verdict found unsafe to pad (on_violation: eager): off-bucket values run eagerly
        self.exact_dims = list(getattr(verdict, "exact_dims", []) or [])
        self.last_path: dict[str, Any] = {}      # how the last call ran: graph, or eager and why
        self.events: Counter[str] = Counter()
        self.event_log: list[dict] = []
        self.monitor = None   # graphmode.monitor.ContractMonitor (monitor.attach): sees every event
        self._executables: dict[str, Any] = {}
        self.constant_spill = None    # graphmode.hostmem.ConstantSpill once spill_constants ran
        self._compile_lock = threading.Lock()
        self.input_names = [i.name for i in recipe.inputs]
        self.pad_values = {i.name: i.pad_value for i in recipe.inputs}
        self._constants = constant_inputs(recipe)        # inputs the recipe declares constant (inputs[].value)
        self._dim_axes = {i.name: [(ax, d) for ax, d in enumerate(i.shape) if isinstance(d, str)]
                          for i in recipe.inputs}
        self._bounds: tuple[list, list] | None = None     # (value checks, dim checks), built on first use
        self._split_axes: dict[str, int] | None | bool = False    # False: not worked out yet (_splittable)
        self.split_chooser = Chooser()
        self._out_spec = None
        if self.capture_report is not None and getattr(self.capture_report, "out_spec", None):
            try:
                self._out_spec = pytree.treespec_loads(self.capture_report.out_spec)
            except Exception:  # noqa: BLE001 - fall back to a tuple of outputs
                self._out_spec = None
        # what eager returns (capture/outputs.py spec) and the inputs the model updates in place
        self.output_structure = getattr(self.capture_report, "output_structure", None)
        self.mutated_inputs = list(getattr(self.capture_report, "mutated_inputs", None) or [])
        self._signature = None
        if source.module is not None:
            try:
                self._signature = inspect.signature(source.module.forward)
            except (TypeError, ValueError):
                self._signature = None

    @classmethod
    def from_lowered(cls, low: Any, recipe: Any, target: Any, **kw: Any) -> "CompiledModel":
        """A model over the driver's result (graphmode.compiler.Lowered), which it keeps."""
        return cls(low.source, recipe, target, low.captured, low.graph, (low.capture_report, low.optimize_report),
                   verdict=low.verdict, lowered=low, **kw)

    @property
    def proof(self) -> Any:
        """The recipe's proof with the compiled graph's own facts (None when not lowered here)."""
        return self.lowered.proof if self.lowered is not None else None

    # ---- memory ----------------------------------------------------------------------------
    def spill_constants(self) -> None:
        """Move the constants the passes made (BN-folded, transposed: not the module's own
        parameters, which the module keeps, nor run-time state) to a file-backed mapping whose pages each bucket
        build releases once its kernels hold their prepared copies (graphmode/hostmem.py)."""
        from graphmode.hostmem import spill_constants
        from graphmode.paths import cache_layout
        if self.graph is None or self.constant_spill is not None:
            return
        module = self.source.module
        # run-time state (a decoder's paged KV pools) is written at every step: it stays in memory
        keep = {t.untyped_storage().data_ptr() for k, t in self.graph.constants.items()
                if self.graph.values[k].role == "state"}
        if module is not None:
            keep |= {t.untyped_storage().data_ptr() for t in (*module.parameters(), *module.buffers())}
        folder = None if self.cache_dir is False else cache_layout(self.cache_dir).spill
        self.graph.constants, self.constant_spill = spill_constants(self.graph.constants, folder, keep=keep)

    def memory_report(self) -> dict[str, Any]:
        """Bytes of the graph's constants, how many are spilled, and per built bucket what its
        executable holds (prepared weights, workspaces, arena)."""
        consts = sum(t.numel() * t.element_size() for t in (self.graph.constants.values() if self.graph else ()))
        out: dict[str, Any] = {"constants_bytes": consts,
                               **(self.constant_spill.report() if self.constant_spill is not None else {})}
        out["buckets"] = {k: exe.memory_report() for k, exe in self._executables.items()
                          if hasattr(exe, "memory_report")}
        return out

    # ---- events ----------------------------------------------------------------------------
    def _event(self, event: str, **info: Any) -> None:
        self.events[event] += 1
        rec = {"event": event, "time": time.time(), **info}
        self.event_log.append(rec)
        if len(self.event_log) > 10_000:
            del self.event_log[:5_000]
        log.info("graphmode event %s %s", event, info)
        if self.monitor is not None:
            self.monitor.on_event(event, rec)

    # ---- inputs ----------------------------------------------------------------------------
    def bind_inputs(self, args: tuple, kwargs: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        if self._signature is not None:
            try:
                bound = self._signature.bind_partial(*args, **kwargs)
                named = dict(bound.arguments)
            except TypeError as e:
                raise ContractViolation(f"arguments do not match the model's signature: {e}",
                                        fix=f"call with {', '.join(self.input_names)}") from None
        else:
            if len(args) > len(self.input_names):
                raise ContractViolation(f"got {len(args)} positional inputs, the recipe declares "
                                        f"{len(self.input_names)}", fix=f"inputs: {', '.join(self.input_names)}")
            named = dict(zip(self.input_names, args))
            named.update(kwargs)
        unknown = [k for k in named if k not in self.input_names]
        if unknown:
            raise ContractViolation(f"unknown inputs {unknown}", where="inputs",
                                    fix=f"the recipe declares {', '.join(self.input_names)}")
        missing = [k for k in self.input_names if k not in named]
        if missing:
            raise ContractViolation(f"missing inputs {missing}", where="inputs",
                                    fix=f"pass every declared input: {', '.join(self.input_names)}")
        out = {}
        for spec in self.recipe.inputs:
            t = named[spec.name]
            if not isinstance(t, torch.Tensor):
                raise ContractViolation(f"input {spec.name!r} must be a tensor", where=f"inputs.{spec.name}",
                                        value=type(t).__name__)
            from graphmode.ir.types import DTYPES
            if t.dtype != DTYPES[spec.dtype]:
                raise ContractViolation(f"input {spec.name!r} has dtype {t.dtype}, the recipe declares {spec.dtype}",
                                        where=f"inputs.{spec.name}.dtype", fix=f"convert it: x.to({DTYPES[spec.dtype]})")
            if t.dim() != len(spec.shape):
                raise ContractViolation(f"input {spec.name!r} has rank {t.dim()}, the recipe declares "
                                        f"{spec.shape}", where=f"inputs.{spec.name}.shape", value=tuple(t.shape),
                                        fix=f"send a {len(spec.shape)}-d tensor shaped {spec.shape}")
            if spec.value is not None and not torch.equal(t, self._constants[spec.name]):
                raise ContractViolation(f"input {spec.name!r} differs from the value the recipe declares constant "
                                        "(the model was compiled for that value)", where=f"inputs.{spec.name}.value",
                                        value=t.tolist() if t.numel() <= 16 else tuple(t.shape),
                                        fix=f"send {spec.value}, or compile with a recipe declaring the new value")
            out[spec.name] = t
        return out

    def bounds(self) -> tuple[list, list]:
        """(value checks, dim checks) of runtime/bounds.py, from the verdict's index analysis (or
        the graph's, for a model loaded from an artifact)."""
        if self._bounds is None:
            from graphmode.runtime.bounds import dim_checks, value_checks
            index = getattr(self.verdict, "index", None)
            graph = self.captured_graph if self.captured_graph is not None else self.graph
            if index is None and graph is not None:
                from graphmode.analysis.indices import analyze_indices
                index = analyze_indices(graph)
            self._bounds = (value_checks(self.recipe, index), dim_checks(index))
        return self._bounds

    def check_inputs(self, inputs: Mapping[str, torch.Tensor], dims: Mapping[str, int] | None = None) -> None:
        """Refuse (ContractViolation) values the model's tables or the recipe's ranges exclude,
        and dims past the model's positions: before any plan or eager fallback runs."""
        values, limits = self.bounds()
        if limits:
            from graphmode.runtime.bounds import check_dims
            check_dims(self.shape_of(inputs) if dims is None else dims, limits)
        if values:
            from graphmode.runtime.bounds import check_values
            check_values(inputs, values)

    def sample_inputs(self, env: Mapping[str, int], seed: int = 0) -> dict[str, torch.Tensor]:
        """The model source's sample inputs at `env`, index inputs drawn inside the model's tables."""
        from graphmode.runtime.bounds import draw_within
        return draw_within(self.source.make_inputs(dict(env), seed=seed), self.bounds()[0], seed)

    def shape_of(self, inputs: Mapping[str, torch.Tensor]) -> dict[str, int]:
        dims: dict[str, int] = {}
        for spec in self.recipe.inputs:
            t = inputs[spec.name]
            for ax, d in enumerate(spec.shape):
                size = int(t.shape[ax])
                if isinstance(d, int):
                    if size != d:
                        raise ContractViolation(f"input {spec.name!r} axis {ax} must be {d}",
                                                where=f"inputs.{spec.name}.shape[{ax}]", value=size,
                                                fix=f"send {spec.name} shaped {spec.shape}")
                elif dims.setdefault(d, size) != size:
                    raise ContractViolation(f"dim {d!r} is {dims[d]} in one input but {size} in {spec.name!r}",
                                            where=f"inputs.{spec.name}.shape[{ax}]", value=size,
                                            fix="inputs sharing a dim must agree on its size")
        return dims

    def bucket_for(self, dims: Mapping[str, int]) -> dict[str, int] | None:
        return self.recipe.bucket_for(dict(dims))

    def _violation(self, dims: Mapping[str, int]) -> ContractViolation:
        for d, v in dims.items():
            lo, hi = self.recipe.dim_range(d)
            if not lo <= v <= hi:
                return ContractViolation(f"dim {d!r} = {v} is outside the recipe's range [{lo}, {hi}]",
                                         where=f"dims.{d}", value=v,
                                         fix=f"send {d} within [{lo}, {hi}], widen dims.{d} in the recipe, "
                                             f"or set on_violation: eager")
        return ContractViolation(f"no bucket holds shape {dict(dims)}", where="dims", value=dict(dims),
                                 fix="add a bucket that covers it")

    # ---- plans -----------------------------------------------------------------------------
    @staticmethod
    def bucket_key(env: Mapping[str, int]) -> str:
        return ",".join(f"{k}={v}" for k, v in sorted(env.items()))

    def is_built(self, env: Mapping[str, int]) -> bool:
        """Whether the bucket's executable is built (a call to it then compiles nothing)."""
        return self.bucket_key(env) in self._executables

    def executable(self, env: Mapping[str, int], *, report_build: bool = True):
        """The bucket's executable, built now if it is not yet; `on_stage` hears the build as a
        one-step `plans` stage unless `report_build` is False (warm-up reports its own, N of M)."""
        key = self.bucket_key(env)
        exe = self._executables.get(key)
        if exe is not None:
            return exe
        with self._compile_lock:
            exe = self._executables.get(key)
            if exe is None:
                t0 = time.perf_counter()
                from graphmode.runtime.build import build_executable
                seen = len(getattr(self, "cache_events", []))
                if self.on_stage is not None and report_build:
                    with stage(self.on_stage, "plans", total=1, detail=key) as plans:
                        exe, cached = build_executable(self, dict(env))
                        plans.step(f"{key} ({'from the cache' if cached else 'built'})")
                else:
                    exe, cached = build_executable(self, dict(env))
                self._executables[key] = exe
                for ev in getattr(self, "cache_events", [])[seen:]:    # damage the cache found and repaired
                    if ev.get("event") in ("corrupt", "unusable", "unwritable"):
                        self._event(f"cache_{ev['event']}", bucket=key, **{k: v for k, v in ev.items() if k != "event"})
                self._event("compile" if not cached else "cache_hit", bucket=key,
                            seconds=round(time.perf_counter() - t0, 3))
        return exe

    def warmup(self) -> None:
        """Build every bucket's plan now; `on_stage` hears the `plans` stage, bucket N of M."""
        buckets = self.recipe.buckets()
        with stage(self.on_stage, "plans", total=len(buckets)) as plans:
            for env in buckets:
                built, hits = self.events["compile"], self.events["cache_hit"]
                self.executable(env, report_build=False)
                how = " (built)" if self.events["compile"] > built else \
                    " (from the cache)" if self.events["cache_hit"] > hits else ""
                plans.step(self.bucket_key(env) + how)

    # ---- calling ---------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        inputs = self.bind_inputs(args, kwargs)
        self.events["calls"] += 1
        dims = self.shape_of(inputs) if self.mode != "eager" else {}
        try:
            self.check_inputs(inputs, dims)
        except ContractViolation as e:
            self.events["violated_calls"] += 1
            self._event("violation", kind=e.kind, dims=dict(dims))
            raise
        if self.mode == "eager":
            self.last_path = {"path": "eager", "reason": "exe_mode eager"}
            return self._eager(inputs)
        bucket = self.bucket_for(dims)
        unsafe = [d for d in self.exact_dims if bucket is not None and dims[d] != bucket[d]]
        if bucket is None or unsafe:
            if bucket is None:
                err, kind, reason = self._violation(dims), "shape", "shape outside contract"
            else:
                d = unsafe[0]
                reason = f"unsafe padding on {d}"     # bounded: it labels a Prometheus series
                err, kind = ContractViolation(f"padding {d} from {dims[d]} to {bucket[d]} is unsafe for this model",
                                              where=f"dims.{d}", value=dims[d],
                                              fix=f"send {d} equal to a bucket value {self.recipe.dim_buckets()[d]}"
                                                  ", or see the compile report's padding verdict"), "padding"
            self.events["violated_calls"] += 1
            self._event("violation", kind=kind, dims=dict(dims))
            if self.recipe.on_violation == "eager":
                self._event("fallback", reason=reason, dims=dict(dims))
                self.last_path = {"path": "eager", "reason": reason}
                return self._eager(inputs)
            raise err
        parts = self._split_parts(dims, bucket)
        if parts:
            key = (dims[SPLIT_DIM], tuple(sorted(bucket.items())))
            way, built = self.split_chooser.choose(key), len(self._executables)
            t0 = time.perf_counter()
            flat = self._run_split(inputs, dims, parts) if way == "split" else self._run_bucket(inputs, dims, bucket)
            if len(self._executables) == built:        # a call that built a plan is no measure of either way
                self.split_chooser.record(key, way, time.perf_counter() - t0)
        else:
            way, flat = "pad", self._run_bucket(inputs, dims, bucket)
        self.last_bucket = bucket
        self.last_path = {"path": "graph", "bucket": dict(bucket)}
        if way == "split":
            self.last_path["split"] = list(parts)
        n_user = len(flat) - len(self.mutated_inputs)
        for name, new in zip(self.mutated_inputs, flat[n_user:]):
            with torch.no_grad():
                inputs[name].copy_(new)         # the caller's tensor, updated as eager updates it
        return self.structured(flat[:n_user])

    def _run_bucket(self, inputs: Mapping[str, torch.Tensor], dims: Mapping[str, int],
                    bucket: Mapping[str, int]) -> list[torch.Tensor]:
        """The flat outputs of one padded run of `bucket`'s executable."""
        padded = self._pad(inputs, bucket)
        exe = self.executable(bucket)
        index = {name: ix for name in self.graph.outputs if (ix := self._real_index(name, dims, bucket)) is not None}
        outs = exe.run(padded, index)        # the real rows only are copied out of the arena
        return [outs[name] for name in self.graph.outputs]

    def _split_parts(self, dims: Mapping[str, int], bucket: Mapping[str, int]) -> list[int]:
        """The batch sizes a request padded along SPLIT_DIM could run as instead (each a bucket
        value), or [] when it cannot: the dim is not padded, the model's rows meet, an output has
        no axis to concatenate along, the model updates an input in place, or the batch is no sum
        of bucket values."""
        if dims.get(SPLIT_DIM) == bucket.get(SPLIT_DIM) or not self._splittable():
            return []
        parts = chunks(dims[SPLIT_DIM], self.recipe.dim_buckets().get(SPLIT_DIM, []))
        return parts if len(parts) > 1 else []

    def _splittable(self) -> bool:
        if self._split_axes is False:
            from graphmode.analysis.padding import positions_independent
            ok = (self.graph is not None and SPLIT_DIM in self.recipe.dim_buckets() and SPLIT_DIM not in self.exact_dims
                  and not self.mutated_inputs
                  and all(sum(d == SPLIT_DIM for _, d in axes) <= 1 for axes in self._dim_axes.values()))
            axes = output_axes(self.graph, SPLIT_DIM) if ok else None
            self._split_axes = axes if axes is not None and positions_independent(self.graph, SPLIT_DIM) else None
        return self._split_axes is not None

    def _run_split(self, inputs: Mapping[str, torch.Tensor], dims: Mapping[str, int],
                   parts: list[int]) -> list[torch.Tensor]:
        """Run consecutive slices of the batch, `parts` rows each, in their own buckets and
        concatenate each output along its batch axis."""
        pieces, start = [], 0
        for n in parts:
            sub = {name: next((t.narrow(ax, start, n) for ax, d in self._dim_axes[name] if d == SPLIT_DIM), t)
                   for name, t in inputs.items()}
            sub_dims = {**dims, SPLIT_DIM: n}
            pieces.append(self._run_bucket(sub, sub_dims, self.bucket_for(sub_dims)))
            start += n
        axes = self._split_axes
        return [torch.cat([p[i] for p in pieces], dim=axes[name]) for i, name in enumerate(self.graph.outputs)]

    def structured(self, flat: list[torch.Tensor]) -> Any:
        """The flat outputs in the structure eager returns: a Tensor, tuple, dict or ModelOutput."""
        if self.output_structure is not None:
            from graphmode.capture.outputs import count, rebuild
            if count(self.output_structure) == len(flat):
                return rebuild(self.output_structure, flat)
        if self._out_spec is not None:
            try:
                return pytree.tree_unflatten(flat, self._out_spec)
            except Exception:  # noqa: BLE001 - structure mismatch: return the flat tuple
                pass
        return flat[0] if len(flat) == 1 else tuple(flat)

    @property
    def output_names(self) -> list[str]:
        """One name per output the model returns, named by its structure (capture/outputs.py)."""
        names = list(getattr(self.capture_report, "output_names", None) or getattr(self.source, "output_names", None)
                     or [])
        n_user = len(self.graph.outputs) - len(self.mutated_inputs) if self.graph is not None else len(names)
        return names if len(names) == n_user else (["output"] if n_user == 1 else
                                                   [f"output_{i}" for i in range(n_user)])

    def _eager(self, inputs: Mapping[str, torch.Tensor]) -> Any:
        if self.source.module is None:
            origin = "it was loaded from an artifact" if getattr(self, "artifact", None) else "it came from ONNX"
            raise ContractViolation(f"eager execution needs the original torch module ({origin})",
                                    fix="keep requests inside the recipe's dims")
        with torch.inference_mode():
            out = self.source.module(**inputs)
        if self.output_structure is not None and isinstance(out, tuple):    # the flattening wrapper's tuple
            return self.structured(list(out))
        return out

    def _pad(self, inputs: Mapping[str, torch.Tensor], bucket: Mapping[str, int]) -> dict[str, torch.Tensor]:
        out = {}
        for name, t in inputs.items():
            pads: list[int] = []
            need = False
            for ax in reversed(range(t.dim())):
                extra = 0
                for a, d in self._dim_axes[name]:
                    if a == ax:
                        extra = bucket[d] - int(t.shape[ax])
                pads += [0, extra]
                need |= extra > 0
            if need:
                t = F.pad(t, pads, value=self.pad_values[name])
            out[name] = t
        return out

    def _real_index(self, name: str, dims: Mapping[str, int], bucket: Mapping[str, int]) -> tuple | None:
        """The index that slices output `name` at the bucket's shape back to the real dims: every
        axis whose extent depends on a padded dim (the padding analysis proved such axes hold the
        real positions first); None when nothing is padded."""
        if dict(dims) == dict(bucket):
            return None
        ty = self.graph.values[name].type
        idx = []
        sliced = False
        for d in ty.shape:
            real = d if isinstance(d, int) else eval_dim(d, dims)
            if real != (d if isinstance(d, int) else eval_dim(d, bucket)):
                idx.append(slice(0, real))
                sliced = True
            else:
                idx.append(slice(None))
        return tuple(idx) if sliced else None

    # ---- decoding ----------------------------------------------------------------------------
    def generate(self, input_ids: Any, attention_mask: Any = None, **kw: Any) -> torch.Tensor:
        """Greedy or sampled decoding over the recipe's paged KV cache, like transformers'
        `generate` (max_new_tokens, do_sample, temperature, top_k, top_p, eos_token_id,
        pad_token_id, seed). See graphmode/decode/api.py."""
        return self._decoding().generate(self, input_ids, attention_mask, **kw)

    def stream(self, input_ids: Any, attention_mask: Any = None, **kw: Any):
        """`generate`, as {row: new tokens} after every decode step."""
        return self._decoding().stream(self, input_ids, attention_mask, **kw)

    def _decoding(self) -> Any:
        if self.decoding is not None:
            return self.decoding
        if getattr(self.recipe.memory, "kv_cache", None) is None:
            raise RecipeError("decoding needs a paged KV cache in the recipe", where="memory.kv_cache",
                              fix="add memory.kv_cache {page_size, max_pages_per_seq, layers, kv_heads, head_dim}")
        raise GraphmodeError("this model was not compiled for decoding", where="model",
                             fix="compile the causal LM with graphmode.compile under its decoder recipe (a loaded "
                                 "artifact holds plans, not the module decoding captures)")

    def save(self, path: Any) -> dict[str, Any]:
        """Write a deployable `.gm` artifact (every bucket built); `graphmode.load` reads it."""
        from graphmode.runtime.artifact import save
        return save(self, path)

    def metrics(self) -> dict[str, Any]:
        ops = self.events["calls"]
        bad = self.events["violated_calls"]
        out = {"events": dict(self.events), "health_score": 1.0 - bad / ops if ops else 1.0,
               "buckets_compiled": sorted(self._executables)}
        if self.monitor is not None:
            out["contract"] = self.monitor.snapshot()
        return out
