"""dce: drop what the outputs do not need.

A node stays when one of its outputs reaches a graph output (walking uses backwards);
everything else goes, fallback nodes included (they are pure: the runtime runs them only
for their results). Values and constants no remaining node, input or output mentions are
pruned (`Graph.prune_values`); graph inputs always stay, they are the runtime's contract.
Inside fused regions, inner nodes that do not reach the region's outputs are dropped too.
"""
from __future__ import annotations

from graphmode.ir.graph import Graph, Node
from graphmode.passes.base import PassContext, PassResult, register_pass


def live_nodes(nodes: list[Node], roots) -> list[Node]:
    live = set(roots)
    keep: list[Node] = []
    for n in reversed(nodes):
        if any(o in live for o in n.outputs):
            keep.append(n)
            live.update(n.inputs)
    keep.reverse()
    return keep


def _dce_body(n: Node) -> tuple[Node, int]:
    if n.body is None:
        return n, 0
    inner = [_dce_body(m) for m in n.body.nodes]
    nodes = [m for m, _ in inner]
    removed = sum(r for _, r in inner)
    keep = live_nodes(nodes, n.body.outputs)
    removed += len(nodes) - len(keep)
    if not removed:
        return n, 0
    body = n.body.clone(nodes=keep).prune_values()
    return n.with_(body=body), removed


@register_pass("dce")
def run(graph: Graph, ctx: PassContext) -> PassResult:
    keep = live_nodes(graph.nodes, graph.outputs)
    removed_by_op: dict[str, int] = {}
    kept_ids = {id(n) for n in keep}
    for n in graph.nodes:
        if id(n) not in kept_ids:
            removed_by_op[n.op] = removed_by_op.get(n.op, 0) + 1
    inner_removed = 0
    nodes = []
    for n in keep:
        m, r = _dce_body(n)
        inner_removed += r
        nodes.append(m)
    g = graph.clone(nodes=nodes).prune_values()
    pruned_consts = len(graph.constants) - len(g.constants)
    removed = sum(removed_by_op.values())
    stats = {"removed": removed, "removed_by_op": dict(sorted(removed_by_op.items())),
             "pruned_constants": pruned_consts, "pruned_values": len(graph.values) - len(g.values)}
    if inner_removed:
        stats["removed_in_bodies"] = inner_removed
    changed = bool(removed or inner_removed or len(g.values) != len(graph.values))
    return PassResult(g, changed, stats)
