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

A decoder lowers one graph at load, its decode engine's; its whole-sequence graph (/v1/infer,
KServe) is lowered on the build thread for the first request that needs it.

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
import logging
import math
import threading
import time
import weakref
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

from graphmode.errors import GraphmodeError
from graphmode.kb.record import ServeRecorder
from graphmode.monitor import PromMetrics, Renegotiator, SlaDriftProbe, TokenBucket, sla_bounds, window_misses
from graphmode.progress import OnStage
from graphmode.serve.batching import Batcher
# the server's concerns, one module each; their names stay importable from here
from graphmode.serve.deployment import Deployment, ReloadTicket, outside_contract  # noqa: F401
from graphmode.serve.errors import NotReady, error_dict
from graphmode.serve.loading import Loading, artifact_path, refuse_tensor_parallel, served_group  # noqa: F401
from graphmode.serve.reload import Reloading
from graphmode.serve.sandbox import RecipeSandbox
from graphmode.serve.serving import Serving

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
        at_least = "a finite number >= {}"
        above = "a finite number > {}"
        checks = [("batch_window_ms", _finite(self.batch_window_ms) and self.batch_window_ms >= 0, at_least, 0),
                  ("max_body_mb", _finite(self.max_body_mb) and self.max_body_mb > 0, above, 0),
                  ("request_timeout_s", _finite(self.request_timeout_s) and self.request_timeout_s > 0, above, 0),
                  ("max_batch", self.max_batch is None or self.max_batch >= 1, "an integer >= {}", 1),
                  ("renegotiate_interval_s", _finite(self.renegotiate_interval_s) and self.renegotiate_interval_s > 0,
                   above, 0),
                  ("renegotiate_burst", self.renegotiate_burst >= 1, "an integer >= {}", 1),
                  ("header_timeout_s", _finite(self.header_timeout_s) and self.header_timeout_s > 0, above, 0),
                  ("body_timeout_s", _finite(self.body_timeout_s) and self.body_timeout_s > 0, above, 0),
                  ("recipe_check_cpu_s", _finite(self.recipe_check_cpu_s) and self.recipe_check_cpu_s >= 1,
                   at_least, 1),
                  ("recipe_check_memory_mb",
                   _finite(self.recipe_check_memory_mb) and self.recipe_check_memory_mb >= 64, at_least, 64),
                  ("max_plans", self.max_plans >= 1, "an integer >= {}", 1),
                  ("kb_period_s", _finite(self.kb_period_s) and self.kb_period_s > 0, above, 0),
                  ("shutdown_grace_s", _finite(self.shutdown_grace_s) and self.shutdown_grace_s >= 0, at_least, 0)]
        for name, ok, want, bound in checks:
            if not ok:
                raise GraphmodeError("invalid server option",
                                     where=f"--{name.replace('_', '-')}", value=getattr(self, name),
                                     fix=f"pass {want.format(bound)}")
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


class ModelServer(Loading, Reloading, Serving):
    """Owns the deployments; the HTTP app (graphmode.serve.app) is a thin layer over it."""

    def __init__(self, model: Any, recipe: Any, *, variants: list[Any] = (), config: ServeConfig | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 on_state: Callable[[str, GraphmodeError | None], None] | None = None,
                 on_stage: OnStage | None = None, group: Any = None):
        """`on_state` hears the server's state changes; `on_stage` the progress of each recipe's
        build: capture, passes, proof, plans bucket N of M (graphmode/progress.py).

        `model` may be a `.gm` artifact (graphmode compile --save): it is loaded, not compiled
        (no capture, no kernel build), and it serves only the recipe it was compiled with
        (`recipe` None means that one; any other is refused, a hot reload included).

        `group` is a tensor-parallel group started before the server (torchrun's ranks, from
        `graphmode rank --serve-port`: graphmode/parallel/torchrun.py): it is served as it is,
        with its recipe only, and never started or compiled here."""
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
        self.model_spec = model if isinstance(model, str) else None     # what rank processes resolve again
        self.group = group
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
        self._ending: asyncio.Event | None = None         # set when the shutdown grace is over
        self.metrics.ready.labels(self.target_name).set(0)
        self.kb = ServeRecorder(self.config.kb, self.target, self.config.kb_period_s, clock) \
            if self.config.kb is not None else None

    @property
    def max_body_bytes(self) -> int:
        return int(self.config.max_body_mb * MB)

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
        late = window_misses(dep.recipe, self.config.batch_window_ms)
        if late:
            log.warning("recipe %s: %s", dep.version, late)
        for entry, q, ms in sla_bounds(dep.recipe):
            self.metrics.sla_bound.labels(dep.version, self.target_name, entry, q).set(ms / 1e3)
        if dep.version in self._retired:             # a version swapped back in keeps its series
            self._retired.remove(dep.version)
        dep.monitor.on_drift(functools.partial(self._on_drift, weakref.ref(dep)))   # no cycle through dep
        m = self.metrics
        if old is not None:
            m.recipe_active.labels(old.version, self.target_name, old.name, old.origin).set(0)
            if self.kb is not None:              # the last window of the version swapped out
                self.kb.tick(old, force=True)
        for smp in [x for fam in m.recipe_active.collect() for x in fam.samples]:   # one series per version:
            lab = smp.labels                                     # a version swapped back in by another origin
            if lab.get("version") == dep.version and (lab.get("name"), lab.get("origin")) != (dep.name, dep.origin):
                m.recipe_active.remove(dep.version, lab["target"], lab["name"], lab["origin"])
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

    # ---- serving ------------------------------------------------------------------------------
    def model_names(self) -> list[str]:
        """The names clients address the model by (OpenAI `model`, KServe `/v2/models/{name}`):
        the model's, then the serving recipe's."""
        saved = getattr(getattr(getattr(self.active, "cm", None), "source", None), "name", None) \
            if self.artifact is not None else None        # a .gm keeps the name of the model it was saved from
        names = [n for n in (getattr(self.model, "name", None), saved,
                             self.active.name if self.active else self.recipe.name) if isinstance(n, str) and n]
        return list(dict.fromkeys(names))

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer (a ModelBundle's, or the one a decoder's .gm was saved with), or
        None: then prompts are token ids."""
        if self.artifact is not None:
            dep = self.active
            return getattr(dep.cm, "tokenizer", None) if dep is not None else None
        return getattr(self.model, "tokenizer", None)

    def current(self) -> Deployment:
        dep = self.active
        if dep is None:
            if self.state == "failed":
                raise NotReady(f"the recipe could not be loaded: {self.error.message if self.error else '?'}",
                               where="startup")
            raise NotReady("warming up: " + ("loading the artifact's plans" if self.artifact is not None else
                                             "compiling the recipe's buckets"), fix="retry when /readyz answers 200")
        return dep

    # ---- lifecycle (called from the ASGI lifespan, on the server's event loop) -----------------
    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._ending = asyncio.Event()
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
        if self.batcher is not None:
            self.batcher.flush()

    def end_requests(self) -> None:
        """The shutdown grace is over: every request still waiting (for a batch, a build, its model
        call) answers 503 now, where uvicorn would cancel it into a bare 500 and a traceback."""
        if self._ending is not None:
            self._ending.set()
        self.end_generations()

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
        if self.active is not None and served_group(self.active.cm):
            await asyncio.get_running_loop().run_in_executor(None, self.active.cm.close)   # its rank processes

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
    def group_health(self) -> dict[str, Any] | None:
        """The serving deployment's tensor-parallel ranks: {"down": why or None, "ranks": [{rank,
        pid, alive}]}; None when it decodes in this process."""
        dep = self.active
        dec = dep.decoder if dep is not None else None
        if dec is not None and hasattr(dec.engine, "ranks"):
            group: Any = dec.engine
        elif dep is not None and served_group(dep.cm):      # an encoder's forward on the ranks
            group = dep.cm
        else:
            return None
        down = group.health()
        ranks = group.ranks()
        self.metrics.ranks_up.labels(self.target_name).set(sum(r["alive"] for r in ranks))
        return {"down": down, "ranks": ranks}

    def readiness(self) -> dict[str, Any]:
        dep = self.active
        out: dict[str, Any] = {"state": self.state, "target": self.target_name}
        if dep is not None:
            out.update(version=dep.version, name=dep.name, buckets=dep.plans)
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
