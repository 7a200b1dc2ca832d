"""The execution order: one topological order of the graph's nodes, shared by every bucket.

The order does not depend on the bucket: the live sets (and so the symbolic activation peak
the recipe's proof uses) are then the same polynomial for every shape. Two candidates are
built — the program order (the capture's order, made topological if needed) and a greedy
memory-aware list schedule (run the ready node that frees the most bytes net of what it
allocates) — and the one with the lower peak at the largest admissible shape wins; ties
keep the program order. A fused node is one step like any other node.
"""
from __future__ import annotations

from typing import Mapping

import sympy

from graphmode.errors import PlanError
from graphmode.ir.graph import Graph
from graphmode.ir.ops import OPS
from graphmode.ir.types import eval_dim
from graphmode.plan.liveness import analyze_liveness

DEFAULT_DIM = 64   # for a symbolic dim the graph gives no range


def reference_env(graph: Graph) -> dict[str, int]:
    """The largest admissible value of every dim (the shape the memory proof cares about)."""
    env = {d: int(hi) for d, (lo, hi) in graph.dims.items()}
    for v in graph.values.values():
        for d in v.type.shape:
            if not isinstance(d, int):
                for s in d.free_symbols:
                    env.setdefault(s.name, DEFAULT_DIM)
    return env


def _deps(graph: Graph) -> list[list[int]]:
    prod = {o: i for i, n in enumerate(graph.nodes) for o in n.outputs}
    out = []
    for n in graph.nodes:
        ds = []
        for v in n.inputs:
            if v in prod:
                ds.append(prod[v])
            elif v not in graph.constants and v not in graph.inputs:
                raise PlanError(f"%{v} is read but no node, graph input or constant defines it",
                                where=f"node {n.op} -> %{n.outputs[0] if n.outputs else '?'}",
                                fix="run the verifier (graphmode.ir.verifier.verify_graph) on the graph")
        out.append(sorted(set(ds)))
    return out


def _kahn(graph: Graph, deps: list[list[int]], pick) -> list[int]:
    n = len(graph.nodes)
    users: list[list[int]] = [[] for _ in range(n)]
    indeg = [len(d) for d in deps]
    for i, ds in enumerate(deps):
        for d in ds:
            users[d].append(i)
    ready = [i for i in range(n) if indeg[i] == 0]
    order: list[int] = []
    while ready:
        i = pick(ready)
        order.append(i)
        for u in users[i]:
            indeg[u] -= 1
            if indeg[u] == 0:
                ready.append(u)
    if len(order) != n:
        stuck = sorted(set(range(n)) - set(order))[:5]
        raise PlanError("the graph has a cycle: no topological order exists", where=f"graph @{graph.name}",
                        value=[f"#{i} {graph.nodes[i].op}" for i in stuck],
                        fix="a value must not (indirectly) depend on itself")
    return order


def program_order(graph: Graph) -> list[int]:
    """The node list itself when it is topological, else the topological order closest to it."""
    deps = _deps(graph)
    if all(d < i for i, ds in enumerate(deps) for d in ds):
        return list(range(len(graph.nodes)))

    def pick(ready: list[int]) -> int:
        ready.sort(reverse=True)
        return ready.pop()
    return _kahn(graph, deps, pick)


def greedy_order(graph: Graph, size_of: Mapping[str, int]) -> list[int]:
    """List scheduling: among ready nodes run the one with the largest (bytes freed - bytes
    allocated), ties by node index. Views allocate nothing and keep their input's buffer alive."""
    deps = _deps(graph)
    consts = graph.constants
    parent: dict[str, str] = {}

    def find(v: str) -> str:
        while parent.get(v, v) != v:
            v = parent[v]
        return v

    for n in graph.nodes:
        spec = OPS.get(n.op)
        if spec is not None and spec.view and n.inputs and len(n.outputs) == 1 and n.inputs[0] not in consts:
            parent[find(n.outputs[0])] = find(n.inputs[0])
    csize: dict[str, int] = {}
    for v, b in size_of.items():
        c = find(v)
        csize[c] = max(csize.get(c, 0), b)
    pinned = {find(o) for o in graph.outputs if o not in consts}
    in_cls = [sorted({find(i) for i in n.inputs if i not in consts}) for n in graph.nodes]
    remaining: dict[str, int] = {}
    for cs in in_cls:
        for c in cs:
            remaining[c] = remaining.get(c, 0) + 1
    alloc = []
    for n in graph.nodes:
        spec = OPS.get(n.op)
        view = spec is not None and spec.view and n.inputs and n.inputs[0] not in consts
        alloc.append(0 if view else sum(size_of.get(o, 0) for o in n.outputs))

    def score(i: int) -> int:
        freed = sum(csize.get(c, 0) for c in in_cls[i] if remaining[c] == 1 and c not in pinned)
        return freed - alloc[i]

    def pick(ready: list[int]) -> int:
        best = max(ready, key=lambda i: (score(i), -i))
        ready.remove(best)
        for c in in_cls[best]:
            remaining[c] -= 1
        return best
    return _kahn(graph, deps, pick)


def value_sizes(graph: Graph, env: Mapping[str, int]) -> dict[str, int]:
    """Concrete byte size of every non-constant top-level value at `env`."""
    out = {}
    for name, v in graph.values.items():
        if name in graph.constants:
            continue
        nb = v.type.nbytes()
        out[name] = nb if isinstance(nb, int) else eval_dim(nb, env)
    return out


def peak_of(graph: Graph, order: list[int], size_of: Mapping[str, int]) -> int:
    liv = analyze_liveness(graph, order)
    return max(liv.live_steps(size_of), default=0)


def schedule(graph: Graph, *, strategy: str = "auto") -> list[int]:
    """Node indices in execution order. strategy: "auto" (lower peak of the two), "program", "greedy"."""
    if strategy not in ("auto", "program", "greedy"):
        raise PlanError(f"unknown schedule strategy {strategy!r}", fix="one of auto, program, greedy")
    prog = program_order(graph)
    if strategy == "program" or not graph.nodes:
        return prog
    try:
        sizes = value_sizes(graph, reference_env(graph))
    except (sympy.SympifyError, TypeError, ValueError) as e:
        raise PlanError(f"cannot size the graph's values: {e}", where=f"graph @{graph.name}") from None
    greedy = greedy_order(graph, sizes)
    if strategy == "greedy":
        return greedy
    return greedy if peak_of(graph, greedy, sizes) < peak_of(graph, prog, sizes) else prog


__all__ = ["schedule", "program_order", "greedy_order", "reference_env", "value_sizes", "peak_of"]
