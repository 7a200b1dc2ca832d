"""A compiled model's plans, one executable per bucket: built on first use, at warm-up, or in
the background for a value that recurs.

A bucket's plan is built when a call first needs it (a `compile` or `cache_hit` event), or all
at once by `warmup()`. A request between buckets whose value just earned plans of its own
(`dims.D.exact_plans`, runtime/exact.py) does not wait for them: building one takes 0.2-5 s (the
passes, the kernels, the tactics timed), which the third request at a new sequence length paid
inline. It runs padded in the recipe's bucket as before, while one background thread builds the
queued plans one at a time (so a request that must build a plan itself waits for one at most);
requests run there once it is built. A split's parts (runtime/shaping.py) are queued alike.
Only a dim whose padding is unsafe (`exact_dims`) still builds inline: its recipe bucket cannot
answer the request. A background build that fails is an event (`compile_failed`) and a warning,
once: the value keeps its recipe bucket and the plan is not queued again.
`wait_for_builds()` returns when none is in flight (tests and the benchmark's setup wait on it).
At interpreter exit the queued builds are dropped and the one in flight is waited for: a daemon
thread still inside a kernel build while the interpreter tore down aborted the process ("terminate
called without an active exception", exit 134) after a script had printed its results.
"""
from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from typing import Any, Mapping

from graphmode.progress import stage

log = logging.getLogger("graphmode.runtime")


class Plans:
    """The plans part of CompiledModel (a mixin): `_executables`, `_compile_lock`, `on_stage`,
    `exact_values`, `exact_dims` and `_event` are the model's."""

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

    # ---- a recurring value's plans ------------------------------------------------------------
    def refined_bucket(self, dims: Mapping[str, int], bucket: Mapping[str, int]) -> dict[str, int]:
        """The bucket a request runs in: its value's own (exact_values.refine) once built; the
        recipe's `bucket` while it builds in the background, unless padding is unsafe there."""
        refined = self.exact_values.refine(dims, bucket, self.exact_dims)
        if refined == dict(bucket) or self.is_built(refined) or any(dims[d] != bucket[d] for d in self.exact_dims):
            return refined
        self._build_later(refined)
        return dict(bucket)

    def _builds(self) -> "_Background":
        state = self.__dict__.get("_background")
        if state is None:
            state = self.__dict__.setdefault("_background", _Background(self))
        return state

    def _build_later(self, env: Mapping[str, int]) -> None:
        """Queue `env`'s plan for the background builder (a loaded artifact's plans are frozen: none)."""
        if getattr(self, "artifact", None) is None and not self.is_built(env):
            self._builds().put(dict(env))

    def building(self) -> list[str]:
        """The buckets whose plans are queued or building in the background now."""
        return self._builds().pending()

    def wait_for_builds(self, timeout: float | None = None) -> bool:
        """Wait until no plan is queued or building in the background (or `timeout` seconds);
        True when none is."""
        return self._builds().wait(timeout)


class _Background:
    """One thread building queued plans one at a time, so a request that must build a plan
    inline waits for at most one of them (16 threads, one per promoted value, took the compile
    lock in turn ahead of a server's request for 27 s)."""

    def __init__(self, model: Any):
        self.model = model
        self.cond = threading.Condition()
        self.queue: list[dict[str, int]] = []
        self.current: str | None = None
        self.thread: threading.Thread | None = None
        self.failed: set[str] = set()        # buckets whose build failed: not queued again (said once)
        self.closed = False
        _BUILDERS.add(self)

    def put(self, env: dict[str, int]) -> None:
        key = self.model.bucket_key(env)
        with self.cond:
            if self.closed or key == self.current or key in self.failed or \
                    any(self.model.bucket_key(e) == key for e in self.queue):
                return
            self.queue.append(env)
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, daemon=True, name="graphmode-plans")
                self.thread.start()

    def pending(self) -> list[str]:
        with self.cond:
            return sorted({*(self.model.bucket_key(e) for e in self.queue), *([self.current] if self.current else [])})

    def wait(self, timeout: float | None) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: not self.queue and self.current is None, timeout)

    def close(self, timeout: float) -> None:
        """Drop what is queued and wait (up to `timeout` s) for the build in flight."""
        with self.cond:
            self.closed = True
            self.queue.clear()
            self.cond.wait_for(lambda: self.current is None, timeout)

    def _run(self) -> None:
        while True:
            with self.cond:
                if not self.queue:
                    self.thread = None
                    self.cond.notify_all()
                    return
                env = self.queue.pop(0)
                self.current = self.model.bucket_key(env)
            try:
                self._build(env)
            finally:
                with self.cond:
                    self.current = None
                    self.cond.notify_all()

    def _build(self, env: dict[str, int]) -> None:
        m, key = self.model, self.model.bucket_key(env)
        try:
            m.executable(env, report_build=False)
        except Exception as e:  # noqa: BLE001 - requests keep their recipe bucket; the failure is said
            log.warning("the plan of recurring shape %s did not build (%s: %s); its requests stay padded in "
                        "their recipe bucket", key, type(e).__name__, e)
            m._event("compile_failed", bucket=key, error=f"{type(e).__name__}: {e}")
            m.exact_values.forget(env)
            with self.cond:
                self.failed.add(key)


_BUILDERS: "weakref.WeakSet[_Background]" = weakref.WeakSet()
EXIT_WAIT_S = 300.0          # one plan's build at most; past it the process exits as it would have


@atexit.register
def _finish_builds_at_exit() -> None:
    for b in list(_BUILDERS):
        b.close(EXIT_WAIT_S)


__all__ = ["Plans"]
