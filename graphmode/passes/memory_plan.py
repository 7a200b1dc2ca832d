"""memory_plan: schedule + liveness + arena offsets for every bucket (an analysis; the graph
is returned unchanged). Leaves a MemoryPlanSet in ctx.analyses["memory_plan"]: one
MemoryPlan per bucket (keyed "batch=1,seq=16") and the symbolic activation peak the
recipe's memory proof uses. One schedule serves every bucket, so the symbolic peak equals
each bucket's lower bound.
"""
from __future__ import annotations

from graphmode.ir.graph import Graph
from graphmode.passes.base import PassContext, PassResult, register_pass
from graphmode.plan.liveness import analyze_liveness
from graphmode.plan.memory import MemoryPlanSet, check_alignment, activation_peak_expr, bucket_key, plan_memory
from graphmode.plan.schedule import schedule

MB = 1e6


@register_pass("memory_plan")
def run(graph: Graph, ctx: PassContext) -> PassResult:
    opts = ctx.opts("memory_plan")
    reuse = opts.reuse
    alignment = check_alignment(opts.alignment)
    groups = [list(g) for g in opts.alias_groups]
    order = schedule(graph)
    liv = analyze_liveness(graph, order, reuse=reuse, alias_groups=groups)   # shared: env-independent
    expr = activation_peak_expr(graph, order=order, liveness=liv)
    plans = {}
    for env in ctx.buckets:
        plan = plan_memory(graph, env, reuse=reuse, alignment=alignment, alias_groups=groups, order=order,
                           liveness=liv)
        plans[bucket_key(env)] = plan
    ctx.analyses["memory_plan"] = MemoryPlanSet(plans, expr, order, list(liv.notes))
    stats: dict = {"steps": len(order), "buffers": len(liv.buffers()),
                   "views": sum(1 for k in liv.alias_kind.values() if k == "view"),
                   "inplace": sum(1 for k in liv.alias_kind.values() if k == "inplace"),
                   "activation_expr": str(expr)}
    if groups:
        stats["alias_groups_honoured"] = f"{len(liv.honoured)}/{len(groups)}"
    if plans:
        stats["max_arena_mb"] = round(max(p.arena_bytes for p in plans.values()) / MB, 3)
        stats["worst_ratio"] = round(max(p.ratio for p in plans.values()), 4)
        stats["buckets"] = {k: {"arena_mb": round(p.arena_bytes / MB, 3),
                                "lower_bound_mb": round(p.lower_bound_bytes / MB, 3),
                                "ratio": round(p.ratio, 4)} for k, p in plans.items()}
    if liv.notes:
        stats["notes"] = list(liv.notes)
    return PassResult(graph, modified=False, stats=stats)
