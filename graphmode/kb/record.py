"""Recording measurements: the one call every measuring command makes (`record`), and how
each of them turns its own results into knowledge-base rows.

Recording never costs the user a result: a knowledge base that cannot be written (damaged,
locked too long, unwritable) turns into one warning line returned to the caller, and the
bench table, the verify verdict or the served answer are unaffected.
"""
from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from graphmode.kb.fingerprint import digest, hardware_of, model_of, recipe_inputs
from graphmode.kb.measure import batch_rows, judge, latency_summary, plan_memory_mb
from graphmode.kb.store import KbError, KnowledgeBase

log = logging.getLogger("graphmode.kb")


@dataclass
class Subject:
    """What a measurement is about: a recipe, the model as captured, the hardware it ran on."""

    recipe: Any
    target: Any
    source: Any                  # graphmode.compiler.ModelSource
    graph: Any                   # the captured IR (None for an eager-only model)
    ir_hash: str | None
    origin: str = "measured"     # measured | init | tune
    parent: str | None = None    # the recipe hash this one was derived from

    @classmethod
    def of(cls, cm: Any, target: Any = None, **kw: Any) -> "Subject":
        """A decoder's whole-sequence graph not lowered yet stays so (the model is described by its
        parameters): reading it lowered the graph, minutes on a real model, at every server's
        first knowledge-base tick and at its shutdown, though no request needed it."""
        target = target if target is not None else cm.target
        if getattr(cm, "pending", False):
            return cls(cm.recipe, target, cm.source, None, None, **kw)
        ir = getattr(cm, "_graph_hash", None) or (cm.graph.structural_hash() if cm.graph is not None else None)
        return cls(cm.recipe, target, cm.source, cm.captured_graph, ir, **kw)

    def entities(self) -> tuple[dict, dict, dict]:
        import torch

        from graphmode.version import __version__
        from graphmode.recipe import recipe_hash
        hw = hardware_of(self.target)
        model = model_of(self.graph, self.source, recipe_inputs(self.recipe))
        recipe = {"hash": recipe_hash(self.recipe), "name": self.recipe.name,
                  "body": self.recipe.model_dump(mode="json", exclude_defaults=True), "ir_hash": self.ir_hash,
                  "graphmode_version": __version__, "torch_version": torch.__version__,
                  "origin": self.origin, "parent": self.parent, "created": time.time()}
        return hw, model, recipe


def perf(source: str, *, status: str = "ok", reason: str | None = None, bucket: Mapping[str, int] | None = None,
         threads: int | None = None, extra: Mapping[str, Any] | None = None, **metrics: Any) -> dict[str, Any]:
    """One performance row (before its uid, which `record` derives from its content)."""
    import torch

    from graphmode.version import __version__
    row = {"source": source, "status": status, "reason": reason, "bucket": dict(bucket) if bucket else None,
           "threads": threads, "graphmode_version": __version__, "torch_version": torch.__version__,
           "extra": dict(extra or {}), "created": time.time()}
    for k in ("p50_ms", "p99_ms", "p99_over_p50", "throughput", "peak_memory_mb", "compile_s", "numerics_err"):
        v = metrics.pop(k, None)
        row[k] = None if v is None else float(v)
        if row[k] is not None and not math.isfinite(row[k]):     # (a verify whose outputs went NaN: inf error)
            row[k] = None               # stored, it read back as a damaged row and was skipped with a warning
            row["extra"].setdefault("not_finite", []).append(k)
    if metrics:
        raise TypeError(f"unknown metrics {sorted(metrics)}")
    return row


def record(kb_path: str | Path | None, subject: Subject, perfs: Sequence[dict[str, Any]]) -> str | None:
    """Write the subject (and each measurement) to the knowledge base at `kb_path` (None: off).
    Returns a warning line when it could not, else None."""
    if kb_path is None:
        return None
    try:
        hw, model, recipe = subject.entities()
        with KnowledgeBase(kb_path) as kb:
            if not perfs:
                kb.add_recipe(hw, model, recipe)
            for p in perfs:
                uid = digest([hw["fingerprint"], model["fingerprint"], recipe["hash"], p])
                kb.add(hw, model, recipe, dict(p, uid=uid))
    except KbError as e:
        return f"knowledge base: not recorded: {e.render()}"
    return None


# ---- per command ---------------------------------------------------------------------------------

def bench_perfs(rows: Sequence[Mapping[str, Any]], cm: Any, recipe: Any) -> list[dict[str, Any]]:
    """The graphmode rows of one benchmarked model, with the other engines' medians as context."""
    out = []
    for r in rows:
        if r["engine"] != "graphmode":
            continue
        others = {o["label"]: o["median_ms"] for o in rows
                  if o["engine"] != "graphmode" and o["dims"] == r["dims"] and o["median_ms"]}
        extra = {"shape": r["shape"], "engines_median_ms": others, "ratio_vs_eager": r.get("ratio_vs_eager"),
                 "ratio_vs_best_other": r.get("ratio_vs_best_other"), "flags": r.get("flags") or [],
                 "iters": r.get("iters"), "eager_fallback": r.get("eager_fallback")}
        bucket = (r.get("setup_detail") or {}).get("bucket")
        if r["status"] != "ok":
            out.append(perf("bench", status="failed", reason=r.get("reason"), bucket=bucket, threads=r["threads"],
                            extra=extra, compile_s=r.get("setup_s")))
            continue
        m = dict(latency_summary(r.get("rounds_ms") or []), numerics_err=r.get("rel_l2_err"),
                 compile_s=r.get("setup_s"), peak_memory_mb=plan_memory_mb(cm, [bucket]) if bucket else None)
        if r.get("median_ms") and m["p99_ms"]:     # the median the table printed (nearest rank took the lower middle)
            m.update(p50_ms=round(r["median_ms"], 4), p99_over_p50=round(m["p99_ms"] / r["median_ms"], 4))
        if m["p50_ms"]:
            m["throughput"] = batch_rows(recipe, r["dims"]) / (m["p50_ms"] / 1e3)
        status, reason = judge(recipe, r["dims"], m, tol=r.get("tol"))
        if r.get("eager_fallback"):
            status, reason = "violates", f"ran eager PyTorch: {r['eager_fallback']}"
        out.append(perf("bench", status=status, reason=reason, bucket=bucket, threads=r["threads"], extra=extra, **m))
    return out


def profile_perf(prof: Any, recipe: Any) -> dict[str, Any]:
    """A profiled bucket: median plan time (p50), throughput, the run spread (p90/p50)."""
    p50 = prof.run_s * 1e3
    return perf("profile", bucket=prof.bucket, threads=prof.threads, p50_ms=p50,
                throughput=batch_rows(recipe, prof.bucket) / prof.run_s if prof.run_s > 0 else None,
                extra={"p90_over_p50": prof.spread, "steps": prof.n_steps, "runs": prof.runs,
                       "eager_ms": prof.eager_s * 1e3 if prof.eager_s is not None else None,
                       "executor_overhead_us": prof.executor_overhead_us})


def verify_perf(results: Sequence[Mapping[str, Any]], failure: str | None) -> dict[str, Any]:
    """A verify run: the worst rel L2 over every checked shape; `violates` on a mismatch."""
    errs = [o["rel_l2"] for r in results for o in r["outputs"]]
    return perf("verify", status="violates" if failure else "ok", reason=failure,
                numerics_err=max(errs) if errs else None,
                extra={"shapes": len(results), "buckets": sorted({str(r["bucket"]) for r in results})})


def record_bench(kb_path: Any, compiled: Any, rows: Sequence[Mapping[str, Any]], target: Any) -> str | None:
    """The hook of `graphmode bench`, per model: `compiled` is what the graphmode engine built
    ((CompiledModel, recipe, seconds), or the exception it raised)."""
    if kb_path is None or target is None or not any(r["engine"] == "graphmode" for r in rows):
        return None
    if not isinstance(compiled, tuple):
        return f"knowledge base: nothing recorded for {rows[0]['model']}: graphmode did not compile it ({compiled})"
    cm, recipe, _ = compiled
    return record(kb_path, Subject.of(cm, target), bench_perfs(rows, cm, recipe))


def record_profiles(kb_path: Any, cm: Any, recipe: Any, profiles: Sequence[Any], target: Any) -> str | None:
    """The hook of `graphmode profile`, per model."""
    return record(kb_path, Subject.of(cm, target), [profile_perf(p, recipe) for p in profiles]) if profiles else None


def record_verify(kb_path: Any, cm: Any, target: Any, results: Sequence[Mapping[str, Any]],
                  failure: Mapping[str, Any] | None) -> str | None:
    """The hook of `graphmode verify`."""
    reason = f"mismatch at {failure['shape']}: {failure['divergence'].describe()}" if failure else None
    return record(kb_path, Subject.of(cm, target), [verify_perf(results, reason)])


class ServeRecorder:
    """Periodic summaries of a serving deployment, one row per recipe version and period:
    p50, p99, P99/P50 over the requests answered since the last one, requests per second,
    health, and `violates` when the SLA or `sla.max_p99_over_p50` is broken (also logged:
    this is how serve monitors determinism)."""

    def __init__(self, kb_path: str | Path, target: Any, period_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic):
        self.kb_path, self.target, self.period_s, self.clock = kb_path, target, period_s, clock
        self._seen: dict[str, tuple[int, float]] = {}      # version -> (ok requests, time) at the last summary
        self._lock = threading.Lock()

    def tick(self, dep: Any, force: bool = False) -> str | None:
        """Summarise `dep` when a period has passed (or `force`, at shutdown); returns a warning."""
        if dep is None:
            return None
        with self._lock:
            now = self.clock()
            mon = dep.monitor
            ok = mon.requests["ok"]
            seen, since = self._seen.setdefault(dep.version, (0, now))
            if ok <= seen or (now - since < self.period_s and not force):
                return None
            self._seen[dep.version] = (ok, now)
            lat = list(mon.latencies_ms)[-(ok - seen):]
        m = dict(latency_summary(lat), throughput=(ok - seen) / max(now - since, 1e-9),
                 peak_memory_mb=(mon.weights_bytes + max(mon.arena_bytes.values())) / 2**20
                 if mon.weights_bytes is not None and mon.arena_bytes else None)
        status, reason = judge(dep.recipe, None, m)
        if status != "ok":
            log.warning("recipe %s (%s) over %d request(s): %s", dep.name, dep.version, ok - seen, reason)
        row = perf("serve", status=status, reason=reason, threads=dep.cm.threads,
                   extra={"requests": ok - seen, "window_s": round(now - since, 3), "health_score": mon.health_score,
                          "violations": dict(mon.violations), "origin": dep.origin}, **m)
        warning = record(self.kb_path, Subject.of(dep.cm, self.target), [row])
        if warning:
            log.warning("%s", warning)
        return warning
