"""ModelServer: deployments of one model, dynamic batching, hot reload and renegotiation.

A *deployment* is one validated recipe version compiled and warmed up: its CompiledModel,
its ContractMonitor (Prometheus series labelled with its version) and its SLA probe. The
server serves the *active* deployment; a request is checked against the deployment that
was active when it arrived and runs on that deployment's plans, even if a newer one has
been swapped in meanwhile, so a swap never fails or drops a request.

Loading a recipe (at start, `PUT /v1/recipe`, or a renegotiation to a `--variant`):
  0. (`PUT /v1/recipe` only) the recipe text is parsed, resolved and validated in the
     recipe sandbox (sandbox.py), a worker process with CPU, memory and time limits: what
     the client wrote is never evaluated in the server process;
  1. schema + semantics (`load_recipe`, `validate`): field errors refuse it at once;
  2. constraints, proved with the running model's facts (its real weights, activation
     peak and FLOPs) so the refusal (counter-example) is answered synchronously;
  3. in the background: compile, re-prove with the new graph's own facts, warm up every
     bucket, check every plan against the memory budget, then swap atomically.
A recipe refused at any step leaves the running one untouched.

Serving never compiles: the one worker thread that runs model calls only runs buckets that
are built. A request whose bucket is not built yet (a decoder's whole-sequence buckets are
built on first use) waits for it off the serving path, on the build thread, while requests
for built buckets keep running; past `request_timeout_s` it answers 503 with Retry-After
(the build goes on). A merged batch whose bucket is not built runs request by request
while that bucket is built for the next time.

A retired deployment is released once its last in-flight request has finished: nothing
the server keeps (history, tickets, errors, metrics, the batcher) refers to it, and the
Prometheus series of versions retired long ago are dropped (`RETIRED_SERIES_KEPT`).
"""
from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import math
import threading
import time
import weakref
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
import torch.utils._pytree as pytree

from graphmode.errors import ConstraintError, ContractViolation, GraphmodeError, RecipeError
from graphmode.kb.record import ServeRecorder
from graphmode.monitor import (ContractMonitor, DriftEvent, PromMetrics, Renegotiator, SlaDriftProbe, TokenBucket,
                               bucket_label)
from graphmode.progress import OnStage, stage
from graphmode.serve.batching import Batcher, Pending, merge, split
from graphmode.serve.errors import NotReady, ReloadBusy, RequestTimeout, ServerFault, detach, error_dict
from graphmode.serve.sandbox import RecipeSandbox, checked

log = logging.getLogger("graphmode.serve")
MB = 2**20
RETIRED_SERIES_KEPT = 4      # retired versions whose Prometheus series stay exported
MIN_TOKEN_CHARS = 16


@dataclass
class ServeConfig:
    """Server options (the CLI flags of `graphmode serve`)."""
    target: Any = None                 # default: the recipe's first target, else host
    cache_dir: Any = None
    threads: int | None = None
    batch_window_ms: float = 5.0
    max_batch: int | None = None       # rows per model call (default: the largest admissible batch)
    max_body_mb: float = 16.0
    request_timeout_s: float = 60.0
    sla_window_s: float = 10.0
    sla_step_s: float | None = None
    sla_margin: float = 0.2
    sla_windows: int = 3
    sla_min_samples: int = 10
    renegotiate_burst: int = 1
    renegotiate_interval_s: float = 300.0
    admin_token: str | None = field(default=None, repr=False)   # Bearer token for state-changing endpoints
    insecure_no_auth: bool = False     # allow a non-loopback address without admin_token
    header_timeout_s: float = 10.0     # a request's headers must arrive within this
    body_timeout_s: float = 60.0       # ... and its body within this
    recipe_check_cpu_s: float = 10.0   # CPU seconds the recipe sandbox may spend on one PUT
    recipe_check_memory_mb: float = 1024.0
    max_plans: int = 1024              # buckets (plans) a recipe may ask for
    kb: Any = None                     # knowledge base file: a summary per recipe version every kb_period_s
    kb_period_s: float = 60.0
    shutdown_grace_s: float = 5.0      # on shutdown, open requests and generations get this long to finish

    def __post_init__(self) -> None:
        checks = [("batch_window_ms", _finite(self.batch_window_ms) and self.batch_window_ms >= 0),
                  ("max_body_mb", _finite(self.max_body_mb) and self.max_body_mb > 0),
                  ("request_timeout_s", _finite(self.request_timeout_s) and self.request_timeout_s > 0),
                  ("max_batch", self.max_batch is None or self.max_batch >= 1),
                  ("renegotiate_interval_s", _finite(self.renegotiate_interval_s) and self.renegotiate_interval_s > 0),
                  ("renegotiate_burst", self.renegotiate_burst >= 1),
                  ("header_timeout_s", _finite(self.header_timeout_s) and self.header_timeout_s > 0),
                  ("body_timeout_s", _finite(self.body_timeout_s) and self.body_timeout_s > 0),
                  ("recipe_check_cpu_s", _finite(self.recipe_check_cpu_s) and self.recipe_check_cpu_s >= 1),
                  ("recipe_check_memory_mb",
                   _finite(self.recipe_check_memory_mb) and self.recipe_check_memory_mb >= 64),
                  ("max_plans", self.max_plans >= 1),
                  ("kb_period_s", _finite(self.kb_period_s) and self.kb_period_s > 0),
                  ("shutdown_grace_s", _finite(self.shutdown_grace_s) and self.shutdown_grace_s >= 0)]
        for name, ok in checks:
            if not ok:
                raise GraphmodeError("invalid server option", where=f"--{name.replace('_', '-')}",
                                     value=getattr(self, name))
        tok = self.admin_token      # an empty one is refused like a short one: it must not mean "no token"
        if tok is not None and (len(tok) < MIN_TOKEN_CHARS or not tok.isascii() or not tok.isprintable()
                                or any(c.isspace() for c in tok)):
            raise GraphmodeError(f"the admin token must be at least {MIN_TOKEN_CHARS} printable ASCII characters "
                                 "without spaces", where="--admin-token / GRAPHMODE_ADMIN_TOKEN",
                                 fix="generate one: python -c 'import secrets; print(secrets.token_urlsafe(32))'")
        SlaDriftProbe(window_s=self.sla_window_s, step_s=self.sla_step_s, margin=self.sla_margin,
                      consecutive=self.sla_windows, min_samples=self.sla_min_samples)   # checks the probe options


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def _facts_key(recipe: Any) -> tuple:
    """Recipes with equal keys compile the model to graphs with the same weights and FLOPs."""
    return (tuple((i.name, i.dtype, tuple(i.shape)) for i in recipe.inputs), tuple(sorted(recipe.dims)),
            recipe.precision.compute, recipe.exe_mode == "eager")


class Deployment:
    """One recipe version, compiled and monitored."""

    def __init__(self, recipe: Any, cm: Any, monitor: ContractMonitor, *, origin: str, facts: Any,
                 max_batch: int | None):
        self.recipe = recipe
        self.version = recipe.hash()
        self.name = recipe.name
        self.cm = cm
        self.monitor = monitor
        self.origin = origin
        self.facts = facts
        self.facts_key = _facts_key(recipe)
        self.created = time.time()
        self.buckets = recipe.buckets()
        self.warmed = 0
        self.decoder: Any = None           # a DecodeLoop when the recipe has memory.kv_cache (completions)
        self.dtypes = {i.name: i.dtype for i in recipe.inputs}
        bd = recipe.model.batch_dim if recipe.model is not None else "batch"
        batchable = bd in recipe.dims and all(bd in i.shape for i in recipe.inputs)
        self.batch_dim = bd if batchable else None
        self.max_rows = 1
        if self.batch_dim is not None:
            self.max_rows = recipe.dim_range(bd)[1]
            if max_batch is not None:
                self.max_rows = max(1, min(self.max_rows, max_batch))
        g = cm.graph
        src_names = list(getattr(cm.source, "output_names", []) or [])
        if g is not None:     # the model's own outputs (the new values of inputs it updates in place follow them)
            users = g.outputs[:len(g.outputs) - len(getattr(cm, "mutated_inputs", []))]
            self.output_names = src_names if len(src_names) == len(users) else list(users)
            self.output_axes = [[_axis_name(d) for d in g.values[o].type.shape] for o in users]
        else:
            self.output_names = src_names or list(recipe.outputs)
            self.output_axes = [[d if isinstance(d, str) and d != "*" else None for d in recipe.outputs.get(n, [])]
                                for n in self.output_names]

    def describe(self) -> dict[str, Any]:
        return {"version": self.version, "name": self.name, "origin": self.origin,
                "created": self.created, "buckets": len(self.buckets), "warmed": self.warmed}

    # ---- requests ----------------------------------------------------------------------------
    def prepare(self, inputs: Mapping[str, torch.Tensor]) -> Pending:
        """Check a request against this recipe's contract; a refusal is counted, then raised."""
        cm = self.cm
        try:
            bound = cm.bind_inputs((), dict(inputs))
            dims = cm.shape_of(bound)
        except ContractViolation as e:
            e.kind = "shape" if ".shape" in (e.where or "") else "input"
            e.fix = e.fix or "send the inputs the recipe declares: " + ", ".join(
                f"{i.name} {list(i.shape)} {i.dtype}" for i in self.recipe.inputs)
            self.monitor.refused(e.kind)
            raise
        try:
            cm.check_inputs(bound, dims)        # index values, declared ranges, positions: before any queue
        except ContractViolation as e:
            self.monitor.refused(e.kind)
            raise
        rows = dims.get(self.batch_dim, 1) if self.batch_dim else 1
        if cm.mode == "eager":
            return Pending(self, bound, dims, rows, alone=self.batch_dim is None)
        if cm.bucket_for(dims) is None:
            if self.recipe.on_violation == "eager" and cm.source.module is not None:
                return Pending(self, bound, dims, rows, alone=True)   # the runtime counts it
            self.monitor.refused("shape")
            raise outside_contract(self.recipe, dims)
        if rows > self.max_rows:
            self.monitor.refused("shape")
            raise ContractViolation(f"{self.batch_dim} = {rows} is more than the server's --max-batch "
                                    f"{self.max_rows}", where=f"dims.{self.batch_dim}", value=rows,
                                    fix=f"split the request into parts of at most {self.max_rows} rows")
        return Pending(self, bound, dims, rows, alone=self.batch_dim is None)

    def flatten(self, out: Any) -> list[torch.Tensor]:
        return [t for t in pytree.tree_flatten(out)[0] if isinstance(t, torch.Tensor)]

    def names_for(self, n: int) -> list[str]:
        return self.output_names if len(self.output_names) == n else [f"output_{i}" for i in range(n)]


def _axis_name(d: Any) -> str | None:
    return d.name if getattr(d, "is_Symbol", False) else None


def outside_contract(recipe: Any, dims: Mapping[str, int]) -> ContractViolation:
    for d, v in dims.items():
        lo, hi = recipe.dim_range(d)
        if not lo <= v <= hi:
            return ContractViolation(f"dim {d!r} = {v} is outside the recipe's range [{lo}, {hi}]",
                                     where=f"dims.{d}", value=v, fix=f"send {d} within [{lo}, {hi}]")
    return ContractViolation(f"no bucket holds shape {dict(dims)}", where="dims", value=dict(dims),
                             fix="send a shape the recipe's buckets cover")


class ReloadTicket:
    """One background load of a recipe; `wait()` blocks until it swapped or failed."""

    _ids = itertools.count(1)

    def __init__(self, version: str, name: str, origin: str, previous: str | None, reason: str = ""):
        self.id = next(self._ids)
        self.version, self.name, self.origin, self.previous, self.reason = version, name, origin, previous, reason
        self.state = "compiling"
        self.error: BaseException | None = None
        self.started = time.time()
        self.finished: float | None = None
        self.progress = (0, 0)
        self._done = threading.Event()

    def finish(self, state: str, error: BaseException | None = None) -> None:
        self.state, self.error, self.finished = state, detach(error) if error is not None else None, time.time()
        self._done.set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)

    async def wait_async(self, timeout: float, give_up: Callable[[], bool] = lambda: False) -> bool:
        """`wait` for the event loop: polls, so no worker thread is held for the whole wait;
        False past `timeout` or as soon as `give_up()` (the server is stopping)."""
        deadline = time.monotonic() + timeout
        while not self._done.is_set():
            left = deadline - time.monotonic()
            if left <= 0 or give_up():
                return False
            await asyncio.sleep(min(0.05, left))
        return True

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "state": self.state, "version": self.version, "name": self.name,
                "origin": self.origin, "previous": self.previous, "reason": self.reason,
                "started": self.started, "finished": self.finished,
                "warmed": self.progress[0], "buckets": self.progress[1],
                "error": error_dict(self.error) if self.error is not None else None}


class ModelServer:
    """Owns the deployments; the HTTP app (graphmode.serve.app) is a thin layer over it."""

    def __init__(self, model: Any, recipe: Any, *, variants: list[Any] = (), config: ServeConfig | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 on_state: Callable[[str, GraphmodeError | None], None] | None = None,
                 on_stage: OnStage | None = None):
        """`on_state` hears the server's state changes; `on_stage` the progress of each recipe's
        build: capture, passes, proof, plans bucket N of M (graphmode/progress.py).

        `model` may be a `.gm` artifact (graphmode compile --save): it is loaded, not compiled
        (no capture, no kernel build), and it serves only the recipe it was compiled with
        (`recipe` None means that one; any other is refused, a hot reload included)."""
        from graphmode.recipe import load_recipe
        from graphmode.recipe.targets import pick_target
        from graphmode.runtime.artifact import recipe_of
        self.config = config or ServeConfig()
        self.clock = clock
        self.on_state = on_state
        self.on_stage = on_stage
        self.metrics = PromMetrics()
        self.artifact = artifact_path(model)
        # read (and checked, as untrusted input) once: every recipe this server is asked for must be it
        self.artifact_recipe = recipe_of(self.artifact) if self.artifact is not None else None
        first = load_recipe(recipe if recipe is not None or self.artifact is None else self.artifact_recipe)
        self.target = pick_target(first, self.config.target)
        self.target_name = getattr(self.target, "name", str(self.target))
        self.model = self._resolve_model(model)
        self.recipe = self._checked(first, "recipe")
        self.variants = [self._checked(load_recipe(v), f"variant[{i}]") for i, v in enumerate(variants)]
        self.active: Deployment | None = None
        self.state = "starting"          # starting -> warming -> ready | failed
        self.error: GraphmodeError | None = None
        self.started = time.time()
        self.history: list[dict[str, Any]] = []
        self.reload: ReloadTicket | None = None
        self._reload_lock = threading.Lock()
        self._prove_lock = threading.Lock()   # Z3's default context is not thread-safe: one prover at a time
        self._swap_lock = threading.Lock()
        self.renegotiator = Renegotiator(
            self.variants, self._renegotiate,
            bucket=TokenBucket(self.config.renegotiate_burst, 1.0 / self.config.renegotiate_interval_s, clock=clock))
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="graphmode-infer")
        self.builder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="graphmode-build")   # bucket builds
        self._builds: dict[tuple[str, str], Future] = {}
        self._builds_lock = threading.Lock()
        self.sandbox = RecipeSandbox(self.target, cpu_s=self.config.recipe_check_cpu_s,
                                     memory_mb=self.config.recipe_check_memory_mb, max_plans=self.config.max_plans)
        self._retired: deque[str] = deque()
        self._decoders: weakref.WeakSet[Any] = weakref.WeakSet()    # decode loops, retired ones included
        self.stopping = False
        self._background: list[threading.Thread] = []
        self.batcher: Batcher | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._ticker: asyncio.Task | None = None
        self.metrics.ready.labels(self.target_name).set(0)
        self.kb = ServeRecorder(self.config.kb, self.target, self.config.kb_period_s, clock) \
            if self.config.kb is not None else None

    @property
    def max_body_bytes(self) -> int:
        return int(self.config.max_body_mb * MB)

    # ---- loading ------------------------------------------------------------------------------
    def _resolve_model(self, model: Any) -> Any:
        if self.artifact is not None:
            return None                          # no module: the artifact holds the graph and its plans
        if isinstance(model, str):
            from graphmode.capture.spec import resolve_model_spec
            return resolve_model_spec(model)     # built once, reused by every reload
        return model

    def _checked(self, recipe: Any, what: str) -> Any:
        """Schema, semantics and the plan bound now (field errors refuse it before anything compiles)."""
        recipe = checked(recipe, self.target, what, self.config.max_plans)
        try:
            self.fits_model(recipe)
        except RecipeError as e:
            e.where = f"{what}: {e.where}" if e.where else what
            raise
        return recipe

    def _facts(self, cm: Any) -> Any:
        if cm.graph is None:
            return None
        from graphmode.compile_report import model_facts
        from graphmode.plan.memory import activation_peak_expr
        r = cm.recipe
        act = activation_peak_expr(cm.graph, reuse=r.optimize.memory_reuse,
                                   alias_groups=[list(g) for g in r.alias_groups])
        return model_facts(cm.graph, act)

    def _prove(self, recipe: Any, facts: Any) -> Any:
        from graphmode.recipe import validate
        report = validate(recipe, self.target, facts)
        if not report.ok:
            try:
                report.raise_for_errors()
            except ConstraintError as e:
                e.proofs = [p.to_dict() for p in report.proofs]  # type: ignore[attr-defined]
                raise
        return report

    def fits_model(self, recipe: Any) -> None:
        """The recipe must declare the model's inputs, with the model's rank and fixed dims
        (checked now, so the answer to PUT says it instead of a failed background compile)."""
        from graphmode.capture.source import resolve_model
        refuse_tensor_parallel(recipe)
        if self.artifact is not None:
            self._artifact_serves(recipe)
            return
        resolve_model(self.model, recipe)                  # names (RecipeError)
        dims = getattr(self.model, "input_dims", None)
        if not isinstance(dims, dict):
            return
        for spec in recipe.inputs:
            want = dims.get(spec.name)
            if want is None:
                continue
            fixed_ok = len(want) == len(spec.shape) and all(
                not isinstance(w, int) or not isinstance(g, int) or w == g for w, g in zip(want, spec.shape))
            if not fixed_ok:
                raise RecipeError(f"input {spec.name!r} has shape {list(spec.shape)} in the recipe but "
                                  f"{list(want)} in the model", where=f"inputs.{spec.name}.shape",
                                  line=recipe.line_of("inputs"), fix=f"declare shape {list(want)}")

    def _artifact_serves(self, recipe: Any) -> None:
        built = self.artifact_recipe
        if recipe.hash() != built.hash():
            raise RecipeError(f"the artifact {self.artifact.name} serves only the recipe it was compiled with "
                              f"({built.name} #{built.hash()}), not {recipe.name} #{recipe.hash()}", where="recipe",
                              fix="compile the new recipe into an artifact (graphmode compile --save) and serve "
                                  "that, or serve the model itself (--model SPEC) to hot-reload recipes")

    def precheck(self, recipe: Any) -> Any:
        """Layers 1-3 with the running model's facts; raises RecipeErrors / ConstraintError."""
        self.fits_model(recipe)
        dep = self.active
        facts = dep.facts if dep is not None and _facts_key(recipe) == dep.facts_key else None
        return self._prove(recipe, facts).recipe

    def _build(self, recipe: Any, origin: str, ticket: ReloadTicket | None = None) -> Deployment:
        """Compile, prove with the new graph's facts, warm up every bucket, check memory."""
        from graphmode.compiler import compile as gm_compile
        from graphmode.runtime.artifact import load as load_artifact
        t0 = time.perf_counter()
        if self.artifact is not None:
            cm = load_artifact(self.artifact, cache_dir=self.config.cache_dir, threads=self.config.threads,
                               on_stage=self.on_stage)
            self._artifact_serves(cm.recipe)         # the file replaced since it was read: refused
        else:
            cm = gm_compile(self.model, recipe, self.target, cache_dir=self.config.cache_dir,
                            threads=self.config.threads, on_stage=self.on_stage)
        self._unless_stopping()
        facts = self._facts(cm)
        recipe = self._prove(recipe, facts).recipe
        cfg = self.config
        probe = SlaDriftProbe(window_s=cfg.sla_window_s, step_s=cfg.sla_step_s, margin=cfg.sla_margin,
                              consecutive=cfg.sla_windows, min_samples=cfg.sla_min_samples, clock=self.clock)
        mon = ContractMonitor(recipe, version=recipe.hash(), target=self.target_name, metrics=self.metrics,
                              probe=probe)
        cm.monitor = mon
        dep = Deployment(recipe, cm, mon, origin=origin, facts=facts, max_batch=cfg.max_batch)
        if recipe.memory.kv_cache is not None and cm.mode != "eager":
            dep.decoder = self._decoder(dep)   # its prefill/decode plans, not the whole-sequence buckets
        elif cm.mode != "eager":
            with stage(self.on_stage, "plans", total=len(dep.buckets)) as plans:
                for i, env in enumerate(dep.buckets):
                    self._unless_stopping()
                    cm.executable(env, report_build=False)
                    dep.warmed = i + 1
                    if ticket is not None:
                        ticket.progress = (i + 1, len(dep.buckets))
                    plans.step(bucket_label(env))
            over = mon.check_memory(cm, dep.buckets)
            if over:
                log.warning("recipe %s: plans over the memory budget in buckets %s", dep.version, over)
        log.info("recipe %s (%s) compiled and warm: %d bucket(s) in %.1fs", recipe.name, dep.version,
                 len(dep.buckets), time.perf_counter() - t0)
        return dep

    def _decoder(self, dep: Deployment) -> Any:
        """The deployment's decode engine, warmed up, behind its decode thread (completions).

        The engine is one lowering of its own (graphmode/decode/engine.py: capture, verdict,
        `to_paged` and the recipe's passes, proof), besides the deployment's: /v1/infer and
        KServe answer the recipe's whole-sequence contract (input_ids and attention_mask ->
        logits at every position, no cache), completions run the paged graph (token ids and
        their positions over the KV pool -> logits at each sequence's last position). The two
        forwards take different inputs, so each is exported once; they share the weights (both
        graphs' parameters are the module's own tensors; the copies the passes transposed are
        spilled to disk per graph)."""
        from graphmode.decode.api import engine_of
        from graphmode.serve.generation import DecodeLoop
        eng = engine_of(dep.cm)
        self._unless_stopping()
        eng.warmup()
        loop = DecodeLoop(eng, self.metrics.decode_series(dep.version, self.target_name), name=f"decode-{dep.version}")
        self._decoders.add(loop)
        return loop

    def _unless_stopping(self) -> None:
        """Between the steps of a build: a stopping server abandons it (its thread ends soon)."""
        if self.stopping:
            raise NotReady("the server is shutting down", where="reload")

    def _spawn(self, target: Callable[..., None], *args: Any, name: str) -> None:
        """Run a build on a daemon thread (a shutdown does not wait for it), kept for `join_background`."""
        self._background = [t for t in self._background if t.is_alive()]
        t = threading.Thread(target=target, args=args, daemon=True, name=name)
        self._background.append(t)
        t.start()

    def join_background(self, timeout: float) -> bool:
        """Wait up to `timeout` s for the builds still running; True when none is left. A build
        cut off by the interpreter's exit while in native code can abort the process, so the
        CLI ends with `os._exit` when this is False."""
        deadline = time.monotonic() + timeout
        for t in list(self._background):
            t.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in self._background)

    def _activate(self, dep: Deployment) -> None:
        with self._swap_lock:
            old, self.active = self.active, dep
        if dep.version in self._retired:             # a version swapped back in keeps its series
            self._retired.remove(dep.version)
        dep.monitor.on_drift(functools.partial(self._on_drift, weakref.ref(dep)))   # no cycle through dep
        m = self.metrics
        if old is not None:
            m.recipe_active.labels(old.version, self.target_name, old.name, old.origin).set(0)
            if self.kb is not None:              # the last window of the version swapped out
                self.kb.tick(old, force=True)
        m.recipe_active.labels(dep.version, self.target_name, dep.name, dep.origin).set(1)
        m.ready.labels(self.target_name).set(1)
        self.history.append({"time": time.time(), "version": dep.version, "name": dep.name, "origin": dep.origin,
                             "previous": old.version if old is not None else None})
        del self.history[:-100]
        if old is not None and old.version != dep.version:
            self._retire(old.version)
        if old is not None and old.decoder is not None:
            old.decoder.retire()                     # its thread ends once its sequences have

    def _retire(self, version: str) -> None:
        """Keep the series of the last RETIRED_SERIES_KEPT retired versions (a dashboard
        still sees the swap), drop older ones: /metrics must not grow with every swap."""
        if version in self._retired:
            self._retired.remove(version)
        self._retired.append(version)
        while len(self._retired) > RETIRED_SERIES_KEPT:
            gone = self._retired.popleft()
            if self.active is None or gone != self.active.version:
                self.metrics.forget(gone)

    def _set_state(self, state: str, error: GraphmodeError | None = None) -> None:
        self.state, self.error = state, detach(error) if error is not None else None
        if self.on_state is not None:
            try:
                self.on_state(state, error)
            except Exception:  # noqa: BLE001 - a callback must not break the server
                log.exception("on_state callback failed")

    def _initial_deploy(self) -> None:
        self._set_state("warming")
        try:
            with self._prove_lock:
                dep = self._build(self.recipe, "initial")
                for i, v in enumerate(self.variants):
                    try:
                        self._prove(v, dep.facts if _facts_key(v) == dep.facts_key else None)
                    except GraphmodeError as e:
                        e.where = f"variant[{i}]: {e.where}" if e.where else f"variant[{i}]"
                        raise
            self._activate(dep)
            self.metrics.reloads.labels(self.target_name, "initial", "swapped").inc()
            self._set_state("ready")
            self.sandbox.prewarm()           # the first PUT /v1/recipe need not wait for its imports
        except GraphmodeError as e:
            if self.stopping:
                log.info("stopped while loading the recipe")
                return
            log.error("cannot load the recipe: %s", e)
            self.metrics.reloads.labels(self.target_name, "initial", _outcome(e)).inc()
            self._set_state("failed", e)
        except Exception as e:  # noqa: BLE001 - reported, not raised, from a thread
            log.exception("cannot load the recipe")
            self._set_state("failed", ServerFault(f"{type(e).__name__}: {e}", where="startup"))

    # ---- hot reload ---------------------------------------------------------------------------
    def check_recipe(self, body: bytes, kind: str, origin: str = "api") -> Any:
        """Untrusted recipe text (`kind` "json" or "yaml") -> its resolved Recipe, checked in the
        sandbox; a refusal is counted and raised (RecipeRefused). Blocks: call it off the loop."""
        try:
            return self.sandbox.check(body, kind)
        except RecipeError:
            if self.stopping:
                raise NotReady("the server is shutting down", where="recipe",
                               fix="send the recipe to the server that replaces this one") from None
            self.metrics.reloads.labels(self.target_name, origin, "refused").inc()
            raise

    def request_reload(self, recipe: Any, origin: str = "api") -> ReloadTicket | None:
        """Validate now (raises with the reasons), then compile, warm up and swap in the
        background. Returns the ticket, or None when that version is already serving."""
        from graphmode.recipe import load_recipe
        if self.active is None:
            raise NotReady("the server is still loading its first recipe", fix="retry when /readyz answers 200")
        # proofs share Z3's (thread-unsafe) context with a compile: none while one compiles
        if self._compiling() or not self._prove_lock.acquire(timeout=self.config.request_timeout_s):
            raise self._busy(origin)
        try:
            try:
                recipe = self.precheck(self._checked(load_recipe(recipe), "recipe"))
            except GraphmodeError as e:
                self.metrics.reloads.labels(self.target_name, origin, _outcome(e)).inc()
                raise
            if recipe.hash() == self.active.version:
                self.metrics.reloads.labels(self.target_name, origin, "unchanged").inc()
                return None
            ticket = self._start_reload(recipe, origin)
        finally:
            self._prove_lock.release()
        if ticket is None:
            raise self._busy(origin)
        return ticket

    def _compiling(self) -> bool:
        return self.reload is not None and self.reload.state == "compiling"

    def _busy(self, origin: str) -> ReloadBusy:
        busy = self.reload
        self.metrics.reloads.labels(self.target_name, origin, "busy").inc()
        return ReloadBusy(f"recipe {busy.version if busy else '?'} is still loading", where="recipe",
                          fix="wait until GET /v1/recipe shows reload.state != compiling, then retry")

    def _start_reload(self, recipe: Any, origin: str, reason: str = "") -> ReloadTicket | None:
        with self._reload_lock:
            if self._compiling():
                return None
            ticket = ReloadTicket(recipe.hash(), recipe.name, origin,
                                  self.active.version if self.active else None, reason)
            self.reload = ticket
        self._spawn(self._reload_worker, recipe, ticket, name=f"graphmode-reload-{ticket.id}")
        return ticket

    def _reload_worker(self, recipe: Any, ticket: ReloadTicket) -> None:
        try:
            with self._prove_lock:
                dep = self._build(recipe, ticket.origin, ticket)
            self._activate(dep)
            self.metrics.reloads.labels(self.target_name, _origin_label(ticket.origin), "swapped").inc()
            log.info("swapped to recipe %s (%s), was %s", dep.name, dep.version, ticket.previous)
            ticket.finish("swapped")
        except GraphmodeError as e:
            (log.info if self.stopping else log.error)("recipe %s not loaded: %s", ticket.version, e)
            self.metrics.reloads.labels(self.target_name, _origin_label(ticket.origin), _outcome(e)).inc()
            ticket.finish("failed", e)
        except Exception as e:  # noqa: BLE001 - reported on the ticket, the old recipe keeps serving
            log.exception("recipe %s not loaded", ticket.version)
            self.metrics.reloads.labels(self.target_name, _origin_label(ticket.origin), "failed").inc()
            ticket.finish("failed", ServerFault(f"{type(e).__name__}: {e}", where="reload"))

    # ---- drift -> renegotiation ---------------------------------------------------------------
    def _on_drift(self, ref: "weakref.ref[Deployment]", ev: DriftEvent) -> None:
        dep = ref()
        if dep is None or dep is not self.active:
            return                      # late samples of a retired version
        outcome = self.renegotiator.on_drift(ev)
        self.metrics.renegotiations.labels(dep.version, self.target_name, outcome).inc()
        log.warning("SLA drift on %s: %s -> %s", dep.version, ev.describe(), outcome)

    def _renegotiate(self, index: int, variant: Any, ev: DriftEvent) -> bool:
        return self._start_reload(variant, f"variant[{index}]", reason=ev.describe()) is not None

    # ---- serving ------------------------------------------------------------------------------
    def model_names(self) -> list[str]:
        """The names clients address the model by (OpenAI `model`, KServe `/v2/models/{name}`):
        the model's, then the serving recipe's."""
        names = [n for n in (getattr(self.model, "name", None), self.active.name if self.active else self.recipe.name)
                 if isinstance(n, str) and n]
        return list(dict.fromkeys(names))

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer (a ModelBundle's), or None: then prompts are token ids."""
        return getattr(self.model, "tokenizer", None)

    def current(self) -> Deployment:
        dep = self.active
        if dep is None:
            if self.state == "failed":
                raise NotReady(f"the recipe could not be loaded: {self.error.message if self.error else '?'}",
                               where="startup")
            raise NotReady("warming up: compiling the recipe's buckets", fix="retry when /readyz answers 200")
        return dep

    async def infer(self, dep: Deployment, inputs: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        p = dep.prepare(inputs)
        assert self.loop is not None and self.batcher is not None, "start() the server first"
        deadline = time.monotonic() + self.config.request_timeout_s
        bucket = dep.cm.bucket_for(p.dims) if dep.cm.mode != "eager" else None
        if bucket is not None and not dep.cm.is_built(bucket):
            await self._built(dep, bucket, deadline)
        p.future = self.loop.create_future()
        self.batcher.submit(p)
        try:
            return await asyncio.wait_for(p.future, max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            dep.monitor.request_status("timeout")
            raise RequestTimeout(f"no answer within {self.config.request_timeout_s:g} s", where="request",
                                 fix="raise --request-timeout-s or lower the load") from None

    async def _built(self, dep: Deployment, bucket: Mapping[str, int], deadline: float) -> None:
        """Wait (without holding the serving thread) until `bucket` is built; 503 past the deadline."""
        fut = self.build_in_background(dep, bucket)
        try:
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(fut)), max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            raise NotReady(f"the plan for bucket {bucket_label(bucket)} is still being built", where="bucket",
                           value=dict(bucket), fix="retry in a moment: the build goes on") from None

    def build_in_background(self, dep: Deployment, bucket: Mapping[str, int]) -> Future:
        """Build `bucket` of `dep` on the build thread (once, however many ask): the future of it."""
        key = (dep.version, dep.cm.bucket_key(bucket))
        with self._builds_lock:
            fut = self._builds.get(key)
            if fut is None:
                log.info("building bucket %s of %s off the serving path", key[1], dep.version)
                fut = self.builder.submit(dep.cm.executable, dict(bucket))
                self._builds[key] = fut
                fut.add_done_callback(functools.partial(self._build_done, key))
        return fut

    def _build_done(self, key: tuple[str, str], fut: Future) -> None:
        with self._builds_lock:
            self._builds.pop(key, None)
        if not fut.cancelled() and fut.exception() is not None:
            log.error("building bucket %s of %s failed: %s", key[1], key[0], fut.exception())

    def _max_rows(self, dep: Deployment) -> int:
        return dep.max_rows

    def _run_batch(self, batch: list[Pending]) -> list[Any]:
        """Worker thread: one model call for the batch; a failing batch is retried request
        by request so one bad request cannot fail its neighbours."""
        try:
            return self._execute(batch)
        except Exception as e:  # noqa: BLE001
            if len(batch) > 1:
                log.warning("batch of %d failed (%s: %s); running its requests one by one", len(batch),
                            type(e).__name__, e)
                return [r for p in batch for r in self._run_batch([p])]
            dep = batch[0].deployment
            if isinstance(e, ContractViolation):
                dep.monitor.request_status("contract")
            else:
                log.exception("request failed")
                dep.monitor.request_status("error")
            return [e]

    def _execute(self, batch: list[Pending]) -> list[dict[str, Any]]:
        dep = batch[0].deployment
        cm = dep.cm
        if len(batch) > 1:
            inputs, dims = merge(batch, dep.recipe.inputs, dep.batch_dim)
        else:
            inputs, dims = batch[0].inputs, batch[0].dims
        bucket = cm.bucket_for(dims) if cm.mode != "eager" else None
        if bucket is None and len(batch) > 1 and cm.mode != "eager":
            raise ContractViolation(f"no bucket holds the merged batch {dims}")   # retried one by one
        if bucket is not None and len(batch) > 1 and not cm.is_built(bucket):
            self.build_in_background(dep, bucket)      # merged shapes use it once it is built
            return [r for p in batch for r in self._run_batch([p])]
        t0 = time.perf_counter()
        with dep.monitor.collect() as kinds:
            try:
                with torch.inference_mode():
                    out = cm(**inputs)
            except ContractViolation:
                dep.monitor.record_operation(kinds or {"shape"})
                raise
        dt = time.perf_counter() - t0
        label = "eager" if bucket is None or "fallback" in kinds else bucket_label(bucket)
        flat = dep.flatten(out)
        parts = split(flat, dep.output_axes, batch, dep.batch_dim) if len(batch) > 1 else [flat]
        dep.monitor.model_call(dt, label, len(batch))
        done = time.perf_counter()
        results = []
        rows = dims.get(dep.batch_dim, 1) if dep.batch_dim else 1
        for p, outs in zip(batch, parts):
            latency = done - p.arrived
            dep.monitor.observe_request(latency, label, p.dims, kinds)
            results.append({"outputs": dict(zip(dep.names_for(len(outs)), outs)),
                            "bucket": bucket, "recipe_version": dep.version, "recipe_name": dep.name,
                            "batch": {"requests": len(batch), "rows": rows}, "request_dims": p.dims,
                            "latency_ms": round(latency * 1e3, 3), "model_ms": round(dt * 1e3, 3)})
        return results

    # ---- lifecycle (called from the ASGI lifespan, on the server's event loop) -----------------
    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        depth = self.metrics.queue_depth.labels(self.target_name)
        self.batcher = Batcher(self._run_batch, self._max_rows, window_s=self.config.batch_window_ms / 1e3,
                               executor=self.executor, on_depth=depth.set)
        self.batcher.start()
        self._ticker = self.loop.create_task(self._tick_loop(), name="graphmode-sla-ticker")
        self._spawn(self._initial_deploy, name="graphmode-warmup")

    def begin_stop(self) -> None:
        """Shutdown has begun: a recipe being checked, or a `PUT ?wait=1` waiting on a compile,
        answers now (503) instead of holding the shutdown up until it is cancelled."""
        self.stopping = True
        self.sandbox.close()

    def end_generations(self, timeout: float = 0.0) -> None:
        """The shutdown grace is over: every decode loop (a retired deployment's too) ends its
        sequences with a 503 error, which a stream sends as its last event before `[DONE]`."""
        for decoder in list(self._decoders):
            decoder.stop(timeout)

    async def stop(self) -> None:
        self.begin_stop()
        if self._ticker is not None:
            self._ticker.cancel()
        if self.batcher is not None:
            await self.batcher.stop()
        await asyncio.get_running_loop().run_in_executor(None, self.end_generations, 5.0)
        if self.kb is not None:                  # the last window of the serving version
            await asyncio.get_running_loop().run_in_executor(None, self.kb.tick, self.active, True)
        self.executor.shutdown(wait=False, cancel_futures=True)
        self.builder.shutdown(wait=False, cancel_futures=True)

    async def _tick_loop(self) -> None:
        step = self.config.sla_step_s or self.config.sla_window_s
        period = min(1.0, max(0.05, step / 4))
        while True:
            await asyncio.sleep(period)
            await self._tick()

    async def _tick(self) -> None:
        """One probe tick (its own frame: the deployment it ticked is not held while sleeping)."""
        monitor = self.active.monitor if self.active is not None else None
        if monitor is None:
            return
        try:
            await self.loop.run_in_executor(None, monitor.tick)  # drift handlers may compile-start
            if self.kb is not None:
                await self.loop.run_in_executor(None, self.kb.tick, self.active)
        except Exception:  # noqa: BLE001 - the ticker must survive
            log.exception("SLA probe tick failed")

    # ---- views --------------------------------------------------------------------------------
    def readiness(self) -> dict[str, Any]:
        dep = self.active
        out: dict[str, Any] = {"state": self.state, "target": self.target_name}
        if dep is not None:
            out.update(version=dep.version, name=dep.name, buckets=len(dep.buckets))
        if self.error is not None:
            out["error"] = error_dict(self.error)
        return out

    def recipe_view(self) -> dict[str, Any]:
        dep = self.active
        out: dict[str, Any] = {"state": self.state, "target": self.target_name,
                               "reload": self.reload.to_dict() if self.reload is not None else {"state": "idle"},
                               "variants": [{"index": i, "name": v.name, "version": v.hash(),
                                             "used": i <= self.renegotiator.position}
                                            for i, v in enumerate(self.variants)],
                               "renegotiation": {"position": self.renegotiator.position,
                                                 "tokens": round(self.renegotiator.bucket.tokens, 3),
                                                 "history": self.renegotiator.history[-10:]},
                               "history": self.history[-20:]}
        if dep is not None:
            out.update(version=dep.version, name=dep.name, origin=dep.origin,
                       buckets=dep.buckets, health_score=dep.monitor.health_score,
                       recipe=dep.recipe.model_dump(mode="json", exclude_none=True))
            if dep.decoder is not None:
                out["decoder"] = dep.decoder.describe()
        return out


def refuse_tensor_parallel(recipe: Any) -> None:
    """A served recipe runs in one process: `parallel.tensor` > 1 is refused (RecipeError)."""
    from graphmode.compiler import tensor_parallel
    if tensor_parallel(recipe) > 1:
        raise RecipeError(f"the server does not run tensor-parallel ranks yet (tensor {tensor_parallel(recipe)})",
                          where="parallel.tensor", line=recipe.line_of("parallel"),
                          fix="tensor: 1 to serve; graphmode.compile or `graphmode run` start the ranks "
                              "(docs/tensor-parallel.md)")


def artifact_path(model: Any) -> Path | None:
    """`model` as a `.gm` artifact's path, or None when it is anything else."""
    from graphmode.runtime.artifact import SUFFIX
    if isinstance(model, (str, Path)) and str(model).endswith(SUFFIX):
        return Path(model)
    return None


def _outcome(e: BaseException) -> str:
    return "refused" if isinstance(e, (RecipeError, ConstraintError)) else "failed"


def _origin_label(origin: str) -> str:
    return "variant" if origin.startswith("variant") else origin
