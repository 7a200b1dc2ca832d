"""The numbers a knowledge-base entry holds, computed the same way by every recorder, and the
recipe's contract applied to them (so bench, tune and serve call a run "violates" alike).

Determinism is a quality dimension: P99/P50 of a run's latencies, bounded by the recipe's
`sla.max_p99_over_p50` when it sets one (the seed gates recipes on it).
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

from graphmode.monitor.drift import quantile, sla_target

MB = 2**20


def latency_summary(samples_ms: Sequence[float]) -> dict[str, float | None]:
    """p50, p99 (nearest rank) and their ratio; all None without samples."""
    s = sorted(float(x) for x in samples_ms)
    if not s:
        return {"p50_ms": None, "p99_ms": None, "p99_over_p50": None}
    p50, p99 = quantile(s, 0.5), quantile(s, 0.99)
    return {"p50_ms": round(p50, 4), "p99_ms": round(p99, 4),
            "p99_over_p50": round(p99 / p50, 4) if p50 > 0 else None}


def max_p99_over_p50(recipe: Any) -> float | None:
    """The recipe's determinism bound (`sla.max_p99_over_p50`), None when it sets none."""
    sla = getattr(recipe, "sla", None)
    v = getattr(sla, "max_p99_over_p50", None) if sla is not None else None
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def batch_rows(recipe: Any, dims: Mapping[str, int] | None) -> int:
    """Items per call: the batch dim's value (the recipe's `model.batch_dim`, else `batch`), else 1."""
    bd = recipe.model.batch_dim if getattr(recipe, "model", None) is not None else "batch"
    return int(dims.get(bd, 1)) if dims else 1


def plan_memory_mb(cm: Any, buckets: Sequence[Mapping[str, int]]) -> float | None:
    """Weights + the largest arena over `buckets` (their plans are built if missing): the
    memory the recipe's budget is about, independent of what else the process holds."""
    if getattr(cm, "graph", None) is None or not buckets:
        return None
    weights = sum(t.numel() * t.element_size() for t in cm.graph.constants.values())
    arena = max(int(cm.executable(dict(b)).plan.arena_bytes) for b in buckets)
    return round((weights + arena) / MB, 3)


def judge(recipe: Any, dims: Mapping[str, int] | None, m: Mapping[str, Any], *,
          tol: float | None = None) -> tuple[str, str | None]:
    """("ok", None) or ("violates", why) for measured numbers `m` (p50_ms, p99_ms, p99_over_p50,
    peak_memory_mb, numerics_err) against the recipe's SLA entry for `dims`, its memory
    budget, its determinism bound and the numerics tolerance `tol`."""
    why = []
    tgt = sla_target(recipe, dict(dims) if dims is not None else None)
    if tgt is not None:
        for q in ("p50", "p99"):
            bound, got = getattr(tgt, f"{q}_ms"), m.get(f"{q}_ms")
            if bound is not None and got is not None and got > bound:
                why.append(f"{tgt.key}.{q}_ms: measured {got:.4g} ms > {bound:g} ms")
    bound = max_p99_over_p50(recipe)
    if bound is not None and m.get("p99_over_p50") is not None and m["p99_over_p50"] > bound:
        why.append(f"sla.max_p99_over_p50: measured {m['p99_over_p50']:.3g} > {bound:g}")
    budget = recipe.memory.budget_mb
    if isinstance(budget, (int, float)) and m.get("peak_memory_mb") is not None and m["peak_memory_mb"] > budget:
        why.append(f"memory.budget_mb: plan needs {m['peak_memory_mb']:.1f} MB > {budget:g} MB")
    if tol is not None and m.get("numerics_err") is not None and not m["numerics_err"] <= tol:
        why.append(f"numerics: rel L2 vs eager {m['numerics_err']:.2e} > tolerance {tol:.0e}")
    return ("violates", "; ".join(why)) if why else ("ok", None)
