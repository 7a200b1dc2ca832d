"""The compile report: what capture, each pass and the memory planner did, and the proof."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import sympy

from graphmode.ir.graph import Graph
from graphmode.ir.ops import flops_of
from graphmode.ir.types import normalize_dim


def symbolic_flops(graph: Graph) -> sympy.Expr:
    """Total FLOPs as an expression over the dims (flops_of works on symbolic shapes)."""
    total: Any = 0
    for n in graph.iter_nodes():
        nodes = n.body.nodes if n.op == "fused" else [n]
        scope = n.body if n.op == "fused" else graph
        for m in nodes:
            ins = [scope.values[i].type.shape for i in m.inputs]
            outs = [scope.values[o].type.shape for o in m.outputs]
            try:
                total = total + flops_of(m.op, ins, outs, m.attrs)
            except TypeError:
                continue
    return normalize_dim(total) if not isinstance(total, int) else total


def graph_collectives(graph: Graph) -> tuple:
    """The collectives one run of a rank's sharded graph makes, for the proof's communication
    term (`recipe/parallel_cost.py`): the all_reduce's and reduce_scatter's operand, the all_gather's
    result, in elements over the dims; identical ones counted together."""
    from graphmode.recipe.parallel_cost import Collective
    counts: dict[tuple, int] = {}
    for n in graph.iter_nodes():
        if n.op not in ("all_reduce", "all_gather", "reduce_scatter"):
            continue
        shape = graph.values[n.outputs[0] if n.op == "all_gather" else n.inputs[0]].type.shape
        elems: Any = 1
        for d in shape:
            elems = elems * normalize_dim(d)
        row = shape[-1] if shape and isinstance(shape[-1], int) else 1
        key = (n.op, normalize_dim(elems), row)
        counts[key] = counts.get(key, 0) + 1
    return tuple(Collective(op, elems, row, c, f"{c} in the sharded graph") for (op, elems, row), c in counts.items())


def model_facts(graph: Graph, activation_expr) -> Any:
    """The compiler's terms for the recipe's Z3 proof: real weights, planner's activation peak;
    for a rank's sharded graph, that rank's own (sharded) terms and its collectives. Run-time
    state (a decoder's KV pools) is not a weight: the proof counts the KV cache itself."""
    from graphmode.analysis.indices import lookup_only_constants
    from graphmode.recipe import ModelFacts
    weights = sum(t.numel() * t.element_size() for k, t in graph.constants.items()
                  if graph.values[k].role != "state")
    tables = sum(graph.constants[k].numel() * graph.constants[k].element_size() for k in lookup_only_constants(graph)
                 if graph.values[k].role != "state")
    n_ops = sum(1 for n in graph.nodes if n.op != "reshape")
    comm = graph_collectives(graph)
    return ModelFacts(weights_bytes=int(weights), prepared_from_bytes=int(weights - tables),
                      activation_bytes=activation_expr,
                      flops=symbolic_flops(graph), n_ops=n_ops, source="compiler" + (", one rank" if comm else ""),
                      collectives=comm, sharded=bool(comm))


@dataclass
class BucketMemory:
    bucket: dict[str, int]
    arena_bytes: int
    lower_bound_bytes: int

    @property
    def ratio(self) -> float:
        return self.arena_bytes / self.lower_bound_bytes if self.lower_bound_bytes else 1.0


def graph_facts(recipe: Any, graph: Graph):
    """The optimized graph's own facts (real weights, the memory planner's symbolic activation
    peak, FLOPs): what the recipe's proofs are checked against once the graph exists."""
    from graphmode.plan.memory import activation_peak_expr
    act = activation_peak_expr(graph, reuse=recipe.optimize.memory_reuse,
                               alias_groups=[list(g) for g in recipe.alias_groups])
    return model_facts(graph, act)


def facts_of(cm: Any) -> Any:
    """The facts a compiled model's proof rests on: its lowering's, or a loaded artifact's graph's
    own (None for an eager model: no graph). A tensor-parallel rank's: its shard's."""
    low = getattr(cm, "lowered", None)
    if low is not None and low.facts is not None:
        return low.facts
    if getattr(cm, "graph", None) is None:
        return None
    return graph_facts(cm.recipe, cm.graph)


def bucket_memory(graph: Graph, recipe: Any, on_stage: Any = None) -> list[BucketMemory]:
    """Each bucket's memory plan against the planner's lower bound (`on_stage` hears "memory
    plans", bucket N of M)."""
    from graphmode.monitor.contract import bucket_label
    from graphmode.plan.memory import plan_memory
    from graphmode.progress import stage
    out = []
    buckets = recipe.buckets()
    with stage(on_stage, "memory plans", total=len(buckets)) as plans:
        for env in buckets:
            mp = plan_memory(graph, env, reuse=recipe.optimize.memory_reuse,
                             alias_groups=[list(g) for g in recipe.alias_groups])
            out.append(BucketMemory(dict(env), mp.arena_bytes, mp.lower_bound_bytes))
            plans.step(bucket_label(env))
    return out


def report_of(low: Any, recipe: Any, target_name: str, memory: list[BucketMemory] = (),
              seconds: dict[str, float] | None = None) -> "CompileReport":
    """The compile report of the driver's result (graphmode.compiler.Lowered), as far as it got:
    a refused verdict has no passes, memory plans or proof."""
    g0 = low.captured
    secs = dict(seconds if seconds is not None else low.timings)
    if low.graph is None:
        return CompileReport(low.source.name, recipe.name, recipe.hash(), target_name, g0.structural_hash(),
                             low.capture_report, None, len(g0.nodes), len(g0.nodes), seconds=secs,
                             contract=low.verdict)
    g = low.graph
    fused = [{"kind": n.attrs.get("kind"), "ops": [m.op for m in n.body.nodes], "outputs": list(n.outputs)}
             for n in g.nodes if n.op == "fused"]
    act = low.facts.activation_bytes if low.facts is not None else ""
    rep = CompileReport(low.source.name, recipe.name, recipe.hash(), target_name, g.structural_hash(),
                        low.capture_report, low.optimize_report.passes, len(g0.nodes), len(g.nodes), fused,
                        list(memory), str(act), low.proof, secs, low.verdict)
    rep.dump_files = low.optimize_report.dump_files  # type: ignore[attr-defined]
    return rep


@dataclass
class CompileReport:
    model: str
    recipe_name: str
    recipe_hash: str
    target: str
    graph_hash: str
    capture: Any
    passes: Any
    nodes_captured: int
    nodes_optimized: int
    fused_groups: list[dict] = field(default_factory=list)
    memory: list[BucketMemory] = field(default_factory=list)
    activation_expr: str = ""
    validation: Any = None
    seconds: dict[str, float] = field(default_factory=dict)
    contract: Any = None            # graphmode.verdict.Verdict: mismatches, fallbacks, padding per dim

    def to_json(self) -> dict:
        v = self.validation
        return {
            "model": self.model, "recipe": self.recipe_name, "recipe_hash": self.recipe_hash,
            "target": self.target, "graph_hash": self.graph_hash,
            "capture": self.capture.to_json() if self.capture else None,
            "passes": self.passes.to_json() if self.passes else [],
            "nodes": {"captured": self.nodes_captured, "optimized": self.nodes_optimized},
            "fused_groups": self.fused_groups,
            "memory": [{"bucket": m.bucket, "arena_bytes": m.arena_bytes, "lower_bound_bytes": m.lower_bound_bytes,
                        "ratio": round(m.ratio, 4)} for m in self.memory],
            "activation_peak_bytes_expr": self.activation_expr,
            "verdict": v.verdict if v is not None else None,
            "proofs": [p.to_dict() for p in (v.proofs if v else [])],
            "contract": self.contract.to_json() if self.contract is not None else None,
            "seconds": {k: round(s, 3) for k, s in self.seconds.items()},
        }
