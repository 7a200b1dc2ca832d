"""Per-device memory and per-step communication of a tensor-parallel recipe, at its largest
bucket: what `graphmode recipe show` prints and `--json` returns. Reads the same constraint
model the proofs use, so the numbers shown are the numbers proved."""
from __future__ import annotations

from typing import Any

from graphmode.recipe.facts import MB


def parallel_summary(recipe: Any, target: Any, facts: Any = None) -> dict[str, Any] | None:
    """None without a `parallel` section; else {tensor, strategy, link, at, memory_mb, comm}."""
    from graphmode.recipe.buckets import dim_buckets
    from graphmode.recipe.constraints import build_constraint_model
    from graphmode.recipe.smt import evaluate
    p = recipe.parallel
    if p is None:
        return None
    cm = build_constraint_model(recipe, target, facts)
    at = {d: max(v) for d, v in dim_buckets(recipe).items()}
    terms = {k: float(evaluate(v, at)) / MB for k, v in cm.memory_terms.items()}
    name, link = p.link_for() if p.link_for() else ("-", None)
    comm = [{"collective": t.collective.op, "what": t.collective.what, "count": t.collective.count,
             "bytes": float(evaluate(t.nbytes, at)), "link": t.link, "ms": float(evaluate(t.seconds, at)) * 1e3}
            for t in cm.comm]
    return {"tensor": p.tensor, "ranks": p.ranks(), "strategy": dict(p.strategy), "backend": p.backend,
            "comm_dtype": p.comm.dtype, "timeout_s": p.comm.timeout_s,
            "link": {"name": name, "bandwidth_gbps": getattr(link, "bandwidth_gbps", None),
                     "latency_us": getattr(link, "latency_us", None)},
            "at": at, "memory_mb": terms, "memory_total_mb": sum(terms.values()),
            "budget_mb": (cm.budget_bytes / MB) if cm.budget_bytes else None,
            "comm": comm, "comm_bytes_per_step": sum(c["bytes"] * c["count"] for c in comm),
            "comm_ms_per_step": sum(c["ms"] for c in comm), "facts_source": cm.facts_source}
