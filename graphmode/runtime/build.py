"""Build one bucket's executable: memory plan -> ExecutionPlan -> backend executable,
through the artifact cache (a hit skips planning and lowering)."""
from __future__ import annotations

from typing import Any

from graphmode.backends.cpu.executor import CpuExecutable, KernelProvider  # noqa: F401 - re-exported
from graphmode.plan.execution import ExecutionPlan, lower
from graphmode.runtime.cache import ArtifactCache, make_key


def build_plan(graph, recipe, env: dict[str, int]) -> ExecutionPlan:
    from graphmode.plan.memory import plan_memory
    mp = plan_memory(graph, env, reuse=recipe.optimize.memory_reuse,
                     alias_groups=[list(g) for g in recipe.alias_groups])
    return lower(graph, mp)


def attach_bodies(plan: ExecutionPlan, graph) -> ExecutionPlan:
    """Fused bodies are not serialised in the plan: take them from the graph it was built from."""
    plan.body_graphs = {i.node_index: graph.nodes[i.node_index] for i in plan.instructions if i.kind == "kernel"}
    return plan


def kernel_provider(cache_dir=None, threads: int | None = None) -> KernelProvider:
    from graphmode.backends.cpu.provider import GeneratedKernels
    return GeneratedKernels(cache_dir=cache_dir, threads=threads)


def cache_key(cm, env: dict[str, int]) -> dict[str, str]:
    if getattr(cm, "_graph_hash", None) is None:
        cm._graph_hash = cm.graph.structural_hash()
    return make_key(cm._graph_hash, cm.recipe.hash(), getattr(cm.target, "name", "host"), env)


def build_executable(cm, env: dict[str, int]) -> tuple[Any, bool]:
    """(executable, came_from_cache)."""
    cache = ArtifactCache(cm.cache_dir) if cm.cache_dir is not False else None
    plan = None
    if cache is not None:
        key = cache_key(cm, env)
        data = cache.get(key)
        cm.cache_events = getattr(cm, "cache_events", []) + cache.events
        if data is not None:
            try:
                plan = attach_bodies(ExecutionPlan.from_json(data), cm.graph)
            except (KeyError, IndexError, TypeError, ValueError):
                plan = None
    cached = plan is not None
    if plan is None:
        plan = build_plan(cm.graph, cm.recipe, env)
        if cache is not None:
            cache.put(key, plan.to_json())
    kdir = (cache.root / "kernels") if cache is not None else None
    exe = CpuExecutable(plan, cm.graph.constants, kernels=kernel_provider(kdir, cm.threads), threads=cm.threads,
                        tactics=cm.recipe.codegen.kernel_selection)
    return exe, cached
