"""Pass infrastructure: a pass is a name (its `PassInfo` in registry.py) and `run(graph, ctx)`.

Passes never mutate their input graph: they return a new one in `PassResult`. Analyses a
pass computes (e.g. the memory plan) go into `ctx.analyses`, keyed by name.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol

from graphmode.ir.graph import Graph
from graphmode.passes.registry import PASS_INFOS, PassInfo


@dataclass
class PassResult:
    graph: Graph
    modified: bool
    stats: dict[str, Any] = field(default_factory=dict)   # e.g. {"removed": 12, "groups": 30}


class Instrument(Protocol):
    """Hooks around every pass (print/dump IR, timing, monitoring)."""

    def before_pass(self, name: str, index: int, graph: Graph, ctx: "PassContext") -> None: ...

    def after_pass(self, name: str, index: int, result: PassResult, seconds: float, ctx: "PassContext") -> None: ...


@dataclass
class PassContext:
    """Everything a pass may read besides the graph. Passed explicitly, never global.

    - `options`: per-pass settings from the recipe, e.g. options["fuse"] = {"enabled": True,
      "patterns": ["elementwise", "gemm_epilogue", "attention", "reduction"], "min_ops": 2, "max_ops": 16},
      options["memory_plan"] = {"reuse": True, "alias_groups": [...], "alignment": 64}.
    - `buckets`: concrete dim values a plan will be built for, e.g. [{"batch": 1, "seq": 16}, ...].
    - `target`: a graphmode.targets.schema.Target or None (layout preferences, cache sizes).
    - `analyses`: results computed by passes (e.g. analyses["memory_plan"] -> MemoryPlanSet).
    """

    options: dict[str, dict[str, Any]] = field(default_factory=dict)
    buckets: list[dict[str, int]] = field(default_factory=list)
    target: Any = None
    instruments: list[Instrument] = field(default_factory=list)
    verify: bool = True
    analyses: dict[str, Any] = field(default_factory=dict)

    def opts(self, pass_name: str) -> Mapping[str, Any]:
        return self.options.get(pass_name, {})


PassFn = Callable[[Graph, PassContext], PassResult]
PASSES: dict[str, PassFn] = {}


def register_pass(name: str) -> Callable[[PassFn], PassFn]:
    """Attach a run function to a pass declared in registry.PASS_INFOS."""
    if name not in PASS_INFOS:
        raise KeyError(f"pass {name!r} is not declared in graphmode/passes/registry.py")

    def deco(fn: PassFn) -> PassFn:
        PASSES[name] = fn
        return fn
    return deco


def info(name: str) -> PassInfo:
    return PASS_INFOS[name]
