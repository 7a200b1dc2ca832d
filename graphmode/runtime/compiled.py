"""CompiledModel: callable like the original module, runs plans per shape bucket.

Per call: bind inputs -> check their values (index inputs against the model's tables, the
recipe's ranges: runtime/bounds.py) -> find the smallest admissible bucket -> pad -> run that bucket's
executable -> slice outputs back -> rebuild the module's output structure. A batch between
buckets of a model whose rows never meet may instead run as batches that fill buckets exactly,
and in hybrid mode a request between buckets may run eager PyTorch at its own shape, whichever
measured fastest for that shape (runtime/split.py). A shape outside
the contract raises ContractViolation (or runs eagerly when `on_violation: eager`). Every
compile, fallback and violation is an event counted in `events` and logged. The plans, one
per bucket, are runtime/plans.py's (on first use, at warm-up, or in the background for a
value that recurs).
"""
from __future__ import annotations

import inspect
import logging
import time
import warnings
from collections import Counter
from typing import Any, Mapping

import torch
import torch.utils._pytree as pytree

from graphmode.backends.registry import DEFAULT_DEVICE
from graphmode.capture.source import constant_inputs
from graphmode.errors import ContractViolation, GraphmodeError, RecipeError
from graphmode.ir.graph import Graph
from graphmode.openmp import ForkSafeLock
from graphmode.progress import OnStage
from graphmode.runtime.contract import InputContract
from graphmode.runtime.shaping import SPLIT_DIM, Shaping, fallback_engine
from graphmode.runtime.exact import ExactValues
from graphmode.runtime.habits import TorchHabits
from graphmode.runtime.plans import Plans
from graphmode.runtime.split import Chooser, shape_key
from graphmode.runtime.weights import FrozenWeights
from graphmode.runtime.tail import model_outputs

log = logging.getLogger("graphmode.runtime")


class OutsideDraft(UserWarning):
    """A request outside the ranges of a recipe graphmode drafted ran uncompiled."""


def _say_outside_draft(cm: Any, err: ContractViolation, bucket: Any) -> None:
    """Once per dim: a request outside a recipe graphmode drafted itself (`cm.drafted`, set by
    graphmode.compile) ran uncompiled. A draft's ranges are guesses where the model states none:
    an ONNX file's free axes got 1..64, and every real request fell back without a word."""
    if bucket is not None or not getattr(cm, "drafted", False):
        return
    said = cm.__dict__.setdefault("_said_outside", set())
    where = err.where or "dims"
    if where in said:
        return
    said.add(where)
    engine = fallback_engine(cm)
    d = where.removeprefix("dims.")
    warnings.warn(f"graphmode: {err.message}, so it ran in {engine}, not compiled (said once per dim); give "
                  f"a recipe whose dims cover such requests, e.g. `graphmode recipe init --dim {d}=LO:HI`",
                  OutsideDraft, stacklevel=3)


def _no_eager_model() -> ContractViolation:
    return ContractViolation("this request needs the eager model (on_violation: eager), and a model loaded from an "
                             "artifact has none", fix="send shapes at the recipe's bucket values, or serve the model "
                             "from its source (the torch module or the ONNX file)")


def _runs_eagerly(cm: Any) -> bool:
    """Whether on_violation: eager has a model to run: a loaded artifact holds plans only."""
    return cm.source.module is not None or getattr(cm, "artifact", None) is None


def _fallback(cm: Any, inputs: Mapping[str, torch.Tensor], err: ContractViolation, reason: str) -> Any:
    """The eager answer of a request the plans do not take (on_violation: eager). ONNX Runtime
    failing there is not the request's fault alone: graphmode's own plan may run it. A loaded
    artifact has no eager model: the request's refusal names what the plans do not take."""
    if not _runs_eagerly(cm):
        source = "serve the model from its source (the torch module or the ONNX file)"
        if err.fix and "on_violation" not in err.fix:
            fix = f"{err.fix}; or {source}"
        elif err.kind == "padding" and err.where:      # inside the range: only the padding is the matter
            d = err.where.removeprefix("dims.")
            fix = (f"send {d} equal to a bucket value {cm.recipe.dim_buckets().get(d)} (nothing is padded there), "
                   f"or {source}")
        elif err.where:          # (the request's own fix offers on_violation: eager, which this artifact has)
            fix = (f"send a request {err.where} admits, or compile the model again from its source with "
                   f"{err.where} widened and save it again, or {source}")
        else:
            fix = f"send shapes at the recipe's bucket values, or {source}"
        raise ContractViolation(f"{err.message}; on_violation: eager would run it on the eager model, and a model "
                                "loaded from an artifact has none", kind=err.kind, where=err.where, value=err.value,
                                fix=fix)
    try:
        return cm._eager(inputs)
    except (RuntimeError, ValueError, IndexError, TypeError) as e:
        if cm.source.module is None:
            raise
        first = (str(e).strip().splitlines() or [""])[0]    # the model's own refusal, said as what it is
        raise ContractViolation(f"{err.message}; run eagerly (on_violation: eager), the model itself fails on it: "
                                f"{type(e).__name__}: {first}", where=err.where,
                                fix="send a request inside the recipe's contract (the eager model refuses this one "
                                    "too)") from e
    except GraphmodeError as e:
        if cm.source.module is not None or getattr(cm, "artifact", None) is not None:
            raise
        raise GraphmodeError(f"this request left the compiled plans ({reason}: {err.message}) and ran in ONNX Runtime "
                             f"(on_violation: eager), which failed on it: {e.message}", where=err.where or "dims",
                             fix="give a recipe whose buckets hold this shape exactly (a bucket value per size you "
                                 "send, or dims.<d>.exact_plans), so graphmode's own plan runs it") from None


class CompiledModel(Plans, InputContract, Shaping, TorchHabits):
    def __init__(self, source, recipe, target, captured: Graph | None, graph: Graph | None, reports,
                 *, mode: str = "graph", cache_dir=None, threads: int | None = None, verdict=None,
                 device: str = DEFAULT_DEVICE, on_stage: OnStage | None = None, lowered: Any = None):
        self.source, self.recipe, self.target, self.mode = source, recipe, target, mode
        self.cache_dir, self.threads = cache_dir, threads
        self.device = device     # the backend (backends/registry.py) that builds and runs the plans
        # hears plan builds (graphmode/progress.py): warm-up's "bucket N of M", one on first use
        self.on_stage = on_stage
        # the decode API (graphmode/decode/api.py) that graphmode.compile attaches when the recipe
        # declares memory.kv_cache: `generate` and `stream` run it (decode builds on runtime, not
        # the other way round)
        self.decoding: Any = None
        self.draft_notes: dict[str, str] = {}    # a drafted recipe's notes (kb/draft.py): where values came from
        self.last_path: dict[str, Any] = {}      # how the last call ran: graph, or eager and why
        self.events: Counter[str] = Counter()
        self.event_log: list[dict] = []
        self.monitor = None   # graphmode.monitor.ContractMonitor (monitor.attach): sees every event
        self._executables: dict[str, Any] = {}
        self.constant_spill = None    # graphmode.hostmem.ConstantSpill once spill_constants ran
        self._compile_lock = ForkSafeLock()
        self.input_names = [i.name for i in recipe.inputs]
        self.pad_values = {i.name: i.pad_value for i in recipe.inputs}
        self._constants = constant_inputs(recipe)        # inputs the recipe declares constant (inputs[].value)
        self._dim_axes = {i.name: [(ax, d) for ax, d in enumerate(i.shape) if isinstance(d, str)]
                          for i in recipe.inputs}
        self._bounds: tuple[list, list] | None = None     # (value checks, dim checks), built on first use
        self._split_axes: dict[str, int] | None | bool = False    # False: not worked out yet (_splittable)
        self.shape_chooser = Chooser()
        self.exact_values = ExactValues(recipe)     # dims.D.exact_plans: recurring values as buckets
        self._signature = None
        # the module's weights as compiled: a call refuses once they were updated in place (weights.py)
        self.frozen_weights = FrozenWeights(source.module, captured.constants if captured is not None else None) \
            if source.module is not None else None
        if source.module is not None:
            try:
                self._signature = inspect.signature(source.module.forward)
            except (TypeError, ValueError):
                self._signature = None
        self._adopt(captured, graph, reports, verdict, lowered)

    def _adopt(self, captured: Graph | None, graph: Graph | None, reports: Any, verdict: Any, lowered: Any) -> None:
        """Take the lowering's results: the graphs, reports, verdict and what they say about
        the model's outputs (a DeferredModel, runtime/deferred.py, takes them on first use)."""
        # graphmode.compiler.Lowered when the driver lowered it: the proof, the facts it was
        # checked against and each stage's time (None for an eager model or a loaded artifact)
        self.lowered = lowered
        self.captured_graph = captured
        self.graph = graph
        capture_report, self.optimize_report = reports if reports else (None, None)
        self.capture_report = capture_report
        self.verdict = verdict
        # the verdict's dims unsafe to pad (off-bucket values run eagerly), and padded unless a request masks
        self.exact_dims, self.masked_dims, self.query_key_dims = (list(getattr(verdict, k, []) or []) for k in
                                                                  ("exact_dims", "masked_dims", "query_key_dims"))
        self.mask_sources = getattr(verdict, "mask_sources", None)       # None: the inputs named like masks
        out_spec = None
        if capture_report is not None and getattr(capture_report, "out_spec", None):
            try:
                out_spec = pytree.treespec_loads(capture_report.out_spec)
            except Exception:  # noqa: BLE001 - fall back to a tuple of outputs
                out_spec = None
        self._out_spec = out_spec
        # what eager returns (capture/outputs.py spec) and the inputs the model updates in place
        self.output_structure = getattr(capture_report, "output_structure", None) or \
            getattr(getattr(self.source, "bundle", None), "output_structure", None)     # exe_mode eager: no capture
        self.mutated_inputs = list(getattr(capture_report, "mutated_inputs", None) or [])
        self.tail = getattr(capture_report, "tail", None)     # ops on sizes only the data decides: tail.py

    @classmethod
    def from_lowered(cls, low: Any, recipe: Any, target: Any, **kw: Any) -> "CompiledModel":
        """A model over the driver's result (graphmode.compiler.Lowered), which it keeps."""
        return cls(low.source, recipe, target, low.captured, low.graph, (low.capture_report, low.optimize_report),
                   verdict=low.verdict, lowered=low, **kw)

    pending = False    # a DeferredModel (runtime/deferred.py) whose graph is not lowered yet

    def lower_now(self) -> None:
        """Lower the graph now if it is not yet (it is, here: a DeferredModel waits for this)."""

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
            keep |= {t.untyped_storage().data_ptr() for t in (*module.parameters(), *module.buffers())
                     if t.layout is torch.strided}      # a sparse buffer has no storage of its own
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

    # ---- calling ---------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if torch.is_autocast_enabled("cpu"):
            return self._call_without_autocast(args, kwargs)
        if (getattr(self, "artifact", None) or {}).get("decoder") is not None:
            from graphmode.runtime.artifact import not_a_forward
            raise not_a_forward(self.artifact["path"])
        if "return_dict" in kwargs and self.takes_return_dict():
            return self.call_with_return_dict(args, kwargs)
        inputs = self.bind_inputs(args, kwargs)
        if self.frozen_weights is not None:
            self.frozen_weights.check()
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
        if bucket is not None and getattr(self, "artifact", None) is None:    # a .gm's plans are frozen: no more
            bucket = self.refined_bucket(dims, bucket)
        unsafe = [d for d in self.exact_dims if bucket is not None and dims[d] != bucket[d]]
        hazard = None if unsafe else self.pad_hazard(inputs, dims, bucket)
        if bucket is None or unsafe or hazard:
            err, kind, reason = (self._violation(dims), "shape", "shape outside contract") if bucket is None else \
                self.padding_violation(dims, bucket, unsafe[0] if unsafe else None, hazard)
            steered = bucket is not None and self.recipe.on_violation == "eager" and _runs_eagerly(self)   # by contract
            if not steered:
                self.events["violated_calls"] += 1
                self._event("violation", kind=kind, dims=dict(dims))
            if self.recipe.on_violation == "eager" and _runs_eagerly(self):
                self._event("fallback", reason=reason, dims=dict(dims), steered=steered)
                self.last_path = {"path": "eager", "reason": reason}
                _say_outside_draft(self, err, bucket)
                return _fallback(self, inputs, err, reason)
            if self.recipe.on_violation == "eager":     # a loaded artifact: no eager model, and no fallback counted
                _fallback(self, inputs, err, reason)     # raises, naming what the plans do not take
            raise err
        ways, parts = self._ways(dims, bucket)
        if len(ways) > 1:
            key = shape_key(dims, bucket)
            way, built = self.shape_chooser.choose(key, ways), len(self._executables)
            t0 = time.perf_counter()
            out = self._run_way(way, inputs, dims, bucket, parts)
            if len(self._executables) == built:        # a call that built a plan is no measure of any way
                self.shape_chooser.record(key, way, time.perf_counter() - t0)
            return out
        return self._run_way("padded", inputs, dims, bucket, parts)

    def _run_way(self, way: str, inputs: dict[str, torch.Tensor], dims: Mapping[str, int],
                 bucket: Mapping[str, int], parts: list[int]) -> Any:
        """The request's outputs, run `way` (padded, split or eager)."""
        if way == "eager":
            self._event("eager_choice", reason="faster at this shape", dims=dict(dims), bucket=dict(bucket))
            self.last_bucket = bucket
            self.last_path = {"path": "eager", "reason": "faster at this shape", "bucket": dict(bucket)}
            return self._eager(inputs)
        flat = (self._run_split(inputs, dims, bucket, parts) if way == "split"
                else self._run_bucket(inputs, dims, bucket))
        self.last_bucket = bucket
        self.last_path = {"path": "graph", "bucket": dict(bucket)}
        if way == "split":
            self.last_path["split"] = list(parts)
        n_user = len(flat) - len(self.mutated_inputs)
        # the tail reads the inputs as the model received them (the captured graph is functional)
        user = model_outputs(self, flat, inputs, dims)
        for name, new in zip(self.mutated_inputs, flat[n_user:]):
            with torch.no_grad():
                inputs[name].copy_(new)         # the caller's tensor, updated as eager updates it
        return self.structured(user)

    def _run_bucket(self, inputs: Mapping[str, torch.Tensor], dims: Mapping[str, int],
                    bucket: Mapping[str, int]) -> list[torch.Tensor]:
        """The flat outputs of one padded run of `bucket`'s executable."""
        padded = self._pad(inputs, bucket)
        exe = self.executable(bucket)
        index = {name: ix for name in self.graph.outputs if (ix := self._real_index(name, dims, bucket)) is not None}
        outs = exe.run(padded, index)        # the real rows only are copied out of the arena
        return [outs[name] for name in self.graph.outputs]

    def _eager(self, inputs: Mapping[str, torch.Tensor]) -> Any:
        if self.source.module is None and self.source.onnx_path is not None and getattr(self, "artifact", None) is None:
            return self.structured(self.source.reference(dict(inputs), optimized=True))   # ONNX Runtime, as it ships
        if self.source.module is None:
            raise _no_eager_model()
        with torch.no_grad():              # not inference mode: the caller may update the outputs in place
            out = self.source.module(**inputs)
        if self.frozen_weights is not None:
            self.frozen_weights.eager_ran()
        if self.output_structure is not None and isinstance(out, tuple):    # the flattening wrapper's tuple
            return self.structured(list(out))
        return out

    # ---- decoding ----------------------------------------------------------------------------
    def generate(self, input_ids: Any, attention_mask: Any = None, **kw: Any) -> torch.Tensor:
        """Greedy or sampled decoding over the recipe's paged KV cache, like transformers'
        `generate` (max_new_tokens, do_sample, temperature, top_k, top_p, eos_token_id,
        pad_token_id, seed). See graphmode/decode/api.py."""
        return _decoder(self).generate(self, input_ids, attention_mask, **kw)

    def stream(self, input_ids: Any, attention_mask: Any = None, **kw: Any):
        """`generate`, as {row: new tokens} after every decode step."""
        return _decoder(self).stream(self, input_ids, attention_mask, **kw)

    def save(self, path: Any, *, rank: int | None = None, **kw: Any) -> dict[str, Any]:
        """Write a deployable `.gm` artifact (every bucket built); `graphmode.load` reads it.
        `rank`: this is that rank's shard, saved by its group (runtime/rank_artifacts.py). A
        decoder saves its decode engine's paged graph (graphmode/decode/saved.py; `tokenizer=`)."""
        if self.decoding is not None:
            return self.decoding.save(self, path, rank=rank, **kw)
        from graphmode.runtime.tokenizer_files import save_model
        return save_model(self, path, rank=rank, **kw)

    def metrics(self) -> dict[str, Any]:
        ops, bad = self.events["calls"], self.events["violated_calls"]
        out = {"events": dict(self.events), "health_score": 1.0 - bad / ops if ops else 1.0,
               "buckets_compiled": sorted(self._executables)}
        ways = self.shape_chooser.report()
        if ways:        # per request shape between buckets: each way's best ms and the one it runs
            out["between_buckets"] = ways
        if self.exact_values.caps:
            out["exact_values"] = self.exact_values.report()
            out["plans_building"] = self.building()      # their plans, building in the background
        if self.monitor is not None:
            out["contract"] = self.monitor.snapshot()
        return out


def _decoder(cm: CompiledModel) -> Any:
    if cm.decoding is None:
        raise _why_no_decoding(cm)
    return cm.decoding


def _why_no_decoding(cm: CompiledModel) -> GraphmodeError:
    """Why `cm` cannot generate: its recipe has no KV cache (a drafted one says why the drafter
    left it out), or it was not compiled for decoding (a loaded artifact holds plans only)."""
    if getattr(cm.recipe.memory, "kv_cache", None) is None:
        why = cm.draft_notes.get("memory.kv_cache", "")
        if why.startswith("none:"):
            return RecipeError(f"decoding needs a paged KV cache, and the drafted recipe has none: "
                               f"{why[len('none:'):].strip()}", where="memory.kv_cache",
                               fix="call the compiled model for its forward pass (logits), or run generate on the "
                                   "eager model; where the note names a narrower range, draft with it")
        return RecipeError("decoding needs a paged KV cache in the recipe", where="memory.kv_cache",
                           fix="add memory.kv_cache {page_size, max_pages_per_seq, layers, kv_heads, head_dim}")
    return GraphmodeError("this model was not compiled for decoding", where="model",
                          fix="compile the causal LM with graphmode.compile under its decoder recipe (a loaded "
                              "artifact holds plans, not the module decoding captures)")
