"""ContractMonitor: the probes of one deployed recipe version.

It counts *operations* (inference requests, and bucket plans checked against the memory
budget) and the contract violations among them, by kind:

  shape     the request's dims are outside the recipe (no bucket holds them)
  input     wrong input names, dtypes, ranks or fixed dims
  memory    a bucket's plan (weights + activation arena) is over the recipe's budget
  latency   a request took longer than its SLA entry's p99 bound
  fallback  the request ran eagerly instead of on a plan (`on_violation: eager`)

A request inside the contract that hybrid mode ran eagerly because eager measured faster at its
shape (runtime/split.py), or that the contract itself sends to eager (inside the recipe's range,
a value of a dim that is never padded, or inputs padding would change: `steered`), is counted in
`fallbacks` under its reason, not as a violation.

`health_score = 1 - violated operations / operations` (an operation with several
violations counts once). A CompiledModel carries its monitor as `cm.monitor`: the runtime
reports compile / cache_hit / violation / fallback events to it, and `cm.metrics()` gains
a `"contract"` entry with `snapshot()`. With a `PromMetrics` the same numbers are exported
as Prometheus series labelled with the recipe version and target. Latencies also feed an
optional `SlaDriftProbe`; drift events go to the handlers registered with `on_drift`.

In-process use:

    cm = graphmode.compile(bundle, recipe)
    model = graphmode.monitor.monitored(cm)      # attach + a timing wrapper
    model(**inputs)
    cm.metrics()["contract"]["health_score"]
"""
from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter, deque
from typing import Any, Callable, Iterator, Mapping

from graphmode.errors import ContractViolation
from graphmode.monitor.drift import DriftEvent, SlaDriftProbe, quantile, sla_target
from graphmode.monitor.prom import PromMetrics

MB = 2**20


def bucket_label(bucket: Mapping[str, int] | None) -> str:
    """The `bucket` label: `batch=4,seq=32` (CompiledModel.bucket_key), `none` without one."""
    if not bucket:
        return "none"
    return ",".join(f"{k}={v}" for k, v in sorted(bucket.items()))


def budget_bytes(recipe: Any, target: Any) -> int | None:
    """The recipe's memory budget in bytes (the target's memory when the recipe sets none)."""
    b = recipe.memory.budget_mb
    if isinstance(b, (int, float)) and not isinstance(b, bool):
        return int(b * MB)
    mem = getattr(target, "memory_bytes", None)
    return int(mem) if isinstance(mem, (int, float)) else None


class ContractMonitor:
    def __init__(self, recipe: Any, *, version: str | None = None, target: Any = None,
                 metrics: PromMetrics | None = None, probe: SlaDriftProbe | None = None,
                 keep_latencies: int = 4096, clock: Callable[[], float] = time.monotonic):
        self.recipe = recipe
        self.version = version or recipe.hash()
        self.target = target if isinstance(target, str) else getattr(target, "name", None) or "host"
        self.metrics = metrics
        self.probe = probe
        self.clock = clock
        self._lock = threading.RLock()
        self._local = threading.local()
        self._drift_handlers: list[Callable[[DriftEvent], Any]] = []
        self.operations = 0
        self.violated_operations = 0
        self.violations: Counter[str] = Counter()
        self.violations_by_bucket: Counter[tuple[str, str]] = Counter()
        self.requests: Counter[str] = Counter()
        self.compiles: Counter[str] = Counter()
        self.fallbacks: Counter[str] = Counter()
        self.latencies_ms: deque[float] = deque(maxlen=keep_latencies)
        self.arena_bytes: dict[str, int] = {}
        self.held_bytes: dict[str, int] = {}      # per bucket: arena + prepared weights + workspaces
        self.weights_bytes: int | None = None
        self.memory_budget_bytes: int | None = None
        self.drift_events: list[DriftEvent] = []
        if metrics is not None:
            # a version served again (a reload back to it) continues the operations its series counted,
            # so the score stays 1 - violated / operations of the exported counters
            self.operations = metrics.counted(metrics.operations, *self._base)
            self.violated_operations = metrics.counted(metrics.violated_operations, *self._base)
            metrics.health.labels(*self._base).set(self.health_score)
            metrics.operations.labels(*self._base)
            metrics.violated_operations.labels(*self._base)

    @property
    def _base(self) -> tuple[str, str]:
        return (self.version, self.target)

    # ---- counting --------------------------------------------------------------------------
    @contextlib.contextmanager
    def collect(self) -> Iterator[set[str]]:
        """Collect the violation kinds reported in this thread inside the block (they are
        counted as they come; the caller decides which operations they belong to)."""
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        kinds: set[str] = set()
        stack.append(kinds)
        try:
            yield kinds
        finally:
            stack.pop()

    def violation(self, kind: str, bucket: str = "none", n: int = 1) -> None:
        with self._lock:
            self.violations[kind] += n
            self.violations_by_bucket[(kind, bucket)] += n
        for kinds in getattr(self._local, "stack", None) or ():
            kinds.add(kind)
        if self.metrics is not None:
            self.metrics.violations.labels(*self._base, bucket, kind).inc(n)

    def record_operation(self, kinds: set[str] | frozenset[str] = frozenset(), n: int = 1) -> None:
        with self._lock:
            self.operations += n
            if kinds:
                self.violated_operations += n
            health = self.health_score
        if self.metrics is not None:
            self.metrics.operations.labels(*self._base).inc(n)
            if kinds:
                self.metrics.violated_operations.labels(*self._base).inc(n)
            self.metrics.health.labels(*self._base).set(health)

    @property
    def health_score(self) -> float:
        return 1.0 - self.violated_operations / self.operations if self.operations else 1.0

    def refused(self, kind: str, bucket: str = "none") -> None:
        """A request the contract turned away (counted as a violated operation)."""
        self.violation(kind, bucket)
        self.record_operation({kind})
        self.request_status("contract", bucket)

    def request_status(self, status: str, bucket: str = "none") -> None:
        """A request's outcome. One that failed (a 5xx: `error`, or `timeout`) is an operation
        that did not hold, so health falls with it: a model whose every request fails is not healthy."""
        if status in ("error", "timeout"):
            self.record_operation({status})
        with self._lock:
            self.requests[status] += 1
        if self.metrics is not None:
            self.metrics.requests.labels(*self._base, bucket, status).inc()

    def observe_request(self, latency_s: float, bucket: str, dims: Mapping[str, int] | None,
                        kinds: set[str] | frozenset[str] = frozenset()) -> set[str]:
        """A request that got its answer: latency (vs its SLA entry's p99), the operation with
        the violation `kinds` seen while it ran, the drift probe. Returns all its kinds."""
        ms = latency_s * 1e3
        kinds = set(kinds)
        tgt = sla_target(self.recipe, dict(dims) if dims is not None else None)
        if tgt is not None and tgt.p99_ms is not None and ms > tgt.p99_ms:
            self.violation("latency", bucket)
            kinds.add("latency")
        with self._lock:
            self.latencies_ms.append(ms)
        if self.metrics is not None:
            self.metrics.latency.labels(*self._base, bucket).observe(latency_s)
        self.record_operation(kinds)
        self.request_status("ok", bucket)
        if self.probe is not None:
            self._drifted(self.probe.observe(ms, tgt))
        return kinds

    def model_call(self, seconds: float, bucket: str, requests: int = 1) -> None:
        """One call into the model (one batch of `requests` requests)."""
        if self.metrics is not None:
            self.metrics.model_latency.labels(*self._base, bucket).observe(seconds)
            self.metrics.batch_requests.labels(*self._base, bucket).observe(requests)

    def tick(self) -> list[DriftEvent]:
        """Let the drift probe close windows that ended without traffic."""
        if self.probe is None:
            return []
        events = self.probe.tick()
        self._drifted(events)
        return events

    # ---- runtime events (CompiledModel._event) ---------------------------------------------
    def on_event(self, event: str, info: Mapping[str, Any]) -> None:
        if event in ("compile", "cache_hit"):
            bucket = str(info.get("bucket") or "none")
            with self._lock:
                self.compiles[event] += 1
            if self.metrics is not None:
                self.metrics.compiles.labels(*self._base, bucket, event).inc()
        elif event == "violation":
            self.violation(str(info.get("kind") or "shape"), "none")
        elif event == "fallback":
            reason = str(info.get("reason") or "unknown")
            with self._lock:
                self.fallbacks[reason] += 1
            if self.metrics is not None:
                self.metrics.fallbacks.labels(*self._base, "eager", reason).inc()
            if not info.get("steered"):
                self.violation("fallback", "eager")
        elif event == "eager_choice":       # hybrid: eager measured faster at a shape inside the contract
            reason = str(info.get("reason") or "faster at this shape")
            with self._lock:
                self.fallbacks[reason] += 1
            if self.metrics is not None:
                self.metrics.fallbacks.labels(*self._base, "eager", reason).inc()

    # ---- memory ----------------------------------------------------------------------------
    def check_memory(self, cm: Any, buckets: list[Mapping[str, int]] | None = None) -> list[str]:
        """Check every bucket's plan against the budget: one operation per plan; a plan whose
        weights + what its executable holds beyond them (arena, prepared weight copies, conv
        workspaces: the static proof's terms, measured) exceed the budget is a `memory`
        violation. Builds missing plans. Returns the buckets over budget."""
        if getattr(cm, "graph", None) is None:
            return []                                 # eager: no plans to check
        if self.weights_bytes is None:
            self.weights_bytes = int(sum(t.numel() * t.element_size() for t in cm.graph.constants.values()))
        self.memory_budget_bytes = budget_bytes(cm.recipe, cm.target)
        if self.metrics is not None:
            self.metrics.weights_bytes.labels(*self._base).set(self.weights_bytes)
            if self.memory_budget_bytes is not None:
                self.metrics.memory_budget.labels(*self._base).set(self.memory_budget_bytes)
        over = []
        for env in (buckets if buckets is not None else cm.recipe.buckets()):
            label = bucket_label(env)
            exe = cm.executable(env)
            arena = int(exe.plan.arena_bytes)
            held = getattr(exe, "memory_report", dict)()
            beyond = max(arena, int(held.get("arena_bytes", 0))) + int(held.get("prepared_weights_bytes", 0)) \
                + int(held.get("workspace_bytes", 0))
            with self._lock:
                self.arena_bytes[label] = arena
                self.held_bytes[label] = beyond
            if self.metrics is not None:
                self.metrics.arena_bytes.labels(*self._base, label).set(arena)
            bad = self.memory_budget_bytes is not None and self.weights_bytes + beyond > self.memory_budget_bytes
            if bad:
                self.violation("memory", label)
                over.append(label)
            self.record_operation({"memory"} if bad else set())
        return over

    # ---- drift -------------------------------------------------------------------------------
    def on_drift(self, handler: Callable[[DriftEvent], Any]) -> None:
        self._drift_handlers.append(handler)

    def _drifted(self, events: list[DriftEvent]) -> None:
        for ev in events:
            with self._lock:
                self.drift_events.append(ev)
                del self.drift_events[:-100]
            if self.metrics is not None:
                self.metrics.drift.labels(*self._base, ev.sla, ev.quantile).inc()
            for h in list(self._drift_handlers):
                h(ev)

    # ---- reading -----------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            lat = sorted(self.latencies_ms)
            return {
                "version": self.version, "target": self.target,
                "operations": self.operations, "violated_operations": self.violated_operations,
                "health_score": self.health_score,
                "violations": dict(self.violations),
                "requests": dict(self.requests),
                "compiles": dict(self.compiles),
                "fallbacks": dict(self.fallbacks),
                "latency_ms": {"count": len(lat), "p50": quantile(lat, 0.5) if lat else None,
                               "p99": quantile(lat, 0.99) if lat else None, "max": lat[-1] if lat else None},
                "arena_bytes": dict(self.arena_bytes), "held_bytes": dict(self.held_bytes),
                "weights_bytes": self.weights_bytes,
                "memory_budget_bytes": self.memory_budget_bytes,
                "sla_streak": self.probe.streak if self.probe is not None else None,
                "drift_events": [e.to_dict() for e in self.drift_events[-10:]],
            }


def attach(cm: Any, *, metrics: PromMetrics | bool | None = None, probe: SlaDriftProbe | None = None,
           version: str | None = None) -> ContractMonitor:
    """Give `cm` a ContractMonitor (`cm.monitor`); `metrics=True` makes a fresh PromMetrics."""
    if metrics is True:
        metrics = PromMetrics()
    mon = ContractMonitor(cm.recipe, version=version, target=cm.target, metrics=metrics or None, probe=probe)
    cm.monitor = mon
    return mon


class MonitoredModel:
    """Callable like the CompiledModel; times every call and counts it as an operation."""

    def __init__(self, cm: Any, monitor: ContractMonitor | None = None):
        self.cm = cm
        self.monitor = monitor or getattr(cm, "monitor", None) or attach(cm)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.cm, name)

    def metrics(self) -> dict[str, Any]:
        return self.cm.metrics()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        mon, cm = self.monitor, self.cm
        try:
            dims = cm.shape_of(cm.bind_inputs(args, kwargs)) if cm.mode != "eager" else None
            bucket = cm.bucket_for(dims) if dims is not None else None
        except ContractViolation:
            dims = bucket = None
        t0 = time.perf_counter()
        with mon.collect() as kinds:
            try:
                out = cm(*args, **kwargs)
            except ContractViolation as e:
                if not kinds:      # refused before the runtime's bucket dispatch saw it
                    mon.violation("shape" if ".shape" in (e.where or "") else "input")
                mon.record_operation(kinds)
                mon.request_status("contract")
                raise
        dt = time.perf_counter() - t0
        label = "eager" if "fallback" in kinds or bucket is None else bucket_label(bucket)
        mon.model_call(dt, label)
        mon.observe_request(dt, label, dims, kinds)
        return out


def monitored(cm: Any, **kw: Any) -> MonitoredModel:
    """`attach(cm, **kw)` and wrap it so each call is timed and counted."""
    return MonitoredModel(cm, attach(cm, **kw))
