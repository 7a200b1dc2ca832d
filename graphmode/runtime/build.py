"""Build one bucket's executable: memory plan -> ExecutionPlan -> the model's backend
(backends/registry.py) -> its executable, through the artifact cache (a hit skips planning).

A cached plan is used only after `load_plan` has re-derived and checked it against the graph
and the key it was looked up under; one that fails is a `corrupt` cache event, removed and
rebuilt. A cache folder that cannot be read or written is one warning, and the model then
runs uncached (kernels in a private temporary folder): a cache is never a reason to fail.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

from graphmode.backends import Executable, get_backend
from graphmode.errors import CacheError, PlanError
from graphmode.hostmem import trim_heap
from graphmode.plan.execution import ExecutionPlan, load_plan, lower
from graphmode.paths import cache_layout
from graphmode.runtime.cache import ArtifactCache, make_key

_SCRATCH: list[tempfile.TemporaryDirectory] = []


def build_plan(graph, recipe, env: dict[str, int], *, graph_hash: str | None = None) -> ExecutionPlan:
    from graphmode.plan.memory import plan_memory
    mp = plan_memory(graph, env, reuse=recipe.optimize.memory_reuse,
                     alias_groups=[list(g) for g in recipe.alias_groups])
    return lower(graph, mp, graph_hash=graph_hash)


def attach_bodies(plan: ExecutionPlan, graph) -> ExecutionPlan:
    """Fused bodies are not serialised in the plan: take them from the graph it was built from."""
    plan.body_graphs = {i.node_index: graph.nodes[i.node_index] for i in plan.instructions if i.kind == "kernel"}
    return plan


def cache_key(cm, env: dict[str, int]) -> dict[str, str]:
    if getattr(cm, "_graph_hash", None) is None:
        cm._graph_hash = cm.graph.structural_hash()
    return plan_key(cm._graph_hash, cm.recipe, getattr(cm.target, "name", "host"), env)


def plan_key(graph_hash: str, recipe, target: str, env: dict[str, int]) -> dict[str, str]:
    """The plan cache's key of bucket `env` (also `graphmode compile`'s first plan, read by the runtime)."""
    return make_key(graph_hash, recipe.hash(), target, env, isa=recipe.codegen.isa)


def _open_cache(cm) -> ArtifactCache | None:
    """The model's cache, or None when it is off (cache_dir=False) or unusable (said once)."""
    if cm.cache_dir is False or getattr(cm, "_cache_unusable", None):
        return None
    cache = ArtifactCache(cm.cache_dir)
    why = cache.unusable()
    if why is not None:
        cm._cache_unusable = why
        cm.cache_events = getattr(cm, "cache_events", []) + cache.events
        return None
    return cache


def _scratch_dir() -> Path:
    """This process's kernel folder while the cache is unusable (removed at exit)."""
    if not _SCRATCH:
        _SCRATCH.append(tempfile.TemporaryDirectory(prefix="graphmode-uncached-"))
    return Path(_SCRATCH[0].name) / "kernels"


def backend_options(backend, recipe) -> dict:
    """The recipe's optional backend arguments (see Backend): `isa` only when a recipe sets
    one, `weight_growth`, `memory_budget_bytes` when the budget is a number (and `schedule`,
    when a recipe sets one) only to a backend that generates kernels (it prepares weights and
    conv workspaces, its loops have a schedule), `batch_invariant` only
    to one with tactics and only when set, so a backend without them may leave them out of its
    signature."""
    out = {} if recipe.codegen.isa == "auto" else {"isa": recipe.codegen.isa}
    caps = getattr(backend, "capabilities", None)
    if getattr(caps, "generates_kernels", False):
        out["weight_growth"] = recipe.memory.weight_growth
        budget = recipe.memory.budget_mb
        if isinstance(budget, (int, float)) and not isinstance(budget, bool):
            out["memory_budget_bytes"] = int(budget * 2**20)     # as the contract monitor counts it
        if recipe.codegen.schedule != "auto":
            out["schedule"] = recipe.codegen.schedule
    if getattr(caps, "kernel_selection", ()) and getattr(recipe, "determinism", "default") == "batch_invariant":
        out["batch_invariant"] = True
    return out


def build_executable(cm, env: dict[str, int]) -> tuple[Executable, bool]:
    """(executable, came_from_cache). The backend is the one registered as `cm.device`; its
    compiled kernels go to the artifact cache's kernel folder."""
    from graphmode.openmp import check_fork_safe, ran_parallel
    check_fork_safe(f"building the plan of bucket {env}")
    ran_parallel()
    cache = _open_cache(cm)
    plan = None
    key = cache_key(cm, env)
    spill = getattr(cm, "constant_spill", None)
    if spill is not None:
        spill.release()          # hashing the graph read every constant
    recipe = cm.recipe
    if cache is not None:
        data = cache.get(key)
        if data is not None:
            try:
                plan = load_plan(data, cm.graph, env, built_for=key, reuse=recipe.optimize.memory_reuse,
                                 alias_groups=[list(g) for g in recipe.alias_groups])
            except PlanError as e:
                cache.invalidate(key, ": ".join(x for x in (e.where, e.message) if x))
    cached = plan is not None
    writable = cache is not None
    if plan is None:
        plan = build_plan(cm.graph, recipe, env, graph_hash=cm._graph_hash)
        plan.built_for = key
        if cache is not None and not cache.read_only:
            try:
                cache.put(key, plan.to_json())
            except CacheError as e:       # a full disk: said once, then this model runs uncached
                cache.report("unwritable", path=str(cache.plans), reason=e.message,
                             fix="free disk space; running uncached meanwhile")
                cm._cache_unusable = e.message
                writable = False
    if writable:
        kdir = cache.kernels
    elif cm.cache_dir is False:
        kdir = cache_layout().kernels
    else:
        kdir = _scratch_dir()
    backend = get_backend(cm.device)
    exe = backend.executable(plan, cm.graph.constants, kernel_dir=kdir, threads=cm.threads,
                             kernel_selection=recipe.codegen.kernel_selection, **backend_options(backend, recipe))
    if spill is not None:
        spill.release()       # the kernels hold their prepared copies; what else reads a constant refaults it
    trim_heap()
    events = (cache.events if cache is not None else []) + exe.events
    if any(e["event"] == "unwritable" for e in exe.events):    # the builder said so: no second warning
        cm._cache_unusable = next(e["reason"] for e in exe.events if e["event"] == "unwritable")
    cm.cache_events = getattr(cm, "cache_events", []) + events
    return exe, cached
