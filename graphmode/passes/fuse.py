"""The `fuse` pass: turn regions that one kernel can run into `fused` nodes, and decomposed
attention into one `sdpa` op.

Why these regions: between two unfused ops every intermediate tensor makes a round trip
through memory and the runtime pays one dispatch. A fused node's body is what a backend
generates one kernel for (or, for `gemm_epilogue`, one library GEMM plus one in-place
kernel over its output).

Order of the patterns (not the order of the `patterns` option, which only selects):
1. attention: the rules of attention.py rewrite matmul(q, k^T) [scale] [mask] -> softmax(-1)
   -> matmul(., v) into `sdpa(q, k, v[, mask]) {scale}` (per-rule counts in the stats).
2. reduction / norm: a row reduction (softmax, log_softmax, layer_norm, sum/mean/amax/amin
   over the last dim) with its pointwise prologue and epilogue. Runs before the GEMM
   epilogue so the residual add in `linear -> add(residual) -> layer_norm` goes to the norm:
   the norm kernel reads the GEMM result once, whereas an epilogue add would read and write
   it once more before the norm reads it again. A prologue value that is also used outside
   (GPT-2's residual stream) becomes a second output of the group.
3. gemm_epilogue: linear/matmul/conv2d, optionally viewed through reshapes, then pointwise
   ops (and inference batch_norm) of the output's shape, with one visible output: the
   last op's. Every intermediate, the GEMM result included, is used only inside.
4. elementwise: maximal connected sets of pointwise ops that all produce the same shape.

Groups are formed greedily in topological order over a contracted view of the graph
(`fusion_patterns.Dag`): a node joins a group only if no path leaves the group and comes
back, so the rewritten graph is acyclic. Groups smaller than `min_ops` stay unfused, but for
a lone layer_norm under the default `min_ops` (2): its generated row kernel spares
ATen's dispatch and thread team (ConvNeXt's layer_norm after a permute, 4096 values: 35 us in
ATen); none grows past `max_ops`. Members of a group share one element grid: their types match up
to dtype (`TensorType.matches(dtype=False)`).

Attention is a rewrite (attention.py, on the rewrite engine); grouping is a scheduler over
the result. Options: `FuseOptions` (options.py), which the recipe embeds as
`optimize.fusion`.
"""
from __future__ import annotations

import heapq

from graphmode.errors import PassError
from graphmode.ir.graph import Graph, Node
from graphmode.passes.attention import rules as attention_rules
from graphmode.passes.base import PassContext, PassResult, register_pass
from graphmode.passes.fusion_patterns import (
    EPILOGUE_EXTRA_OPS, GEMM_OPS, Dag, is_epilogue_op, is_pointwise, is_row_reduction,
)
from graphmode.passes.options import FuseOptions
from graphmode.passes.rewrite import rewrite_graph


def _drop_unreferenced(before: Graph, g: Graph) -> None:
    """Forget values (and constants) the rewrite stopped referring to (the attention blocks'
    scale constants): `g` is the pass's own copy."""
    used = set(g.inputs) | set(g.outputs)
    for n in g.nodes:
        used.update(n.inputs)
        used.update(n.outputs)
    for n in before.nodes:
        for v in (*n.inputs, *n.outputs):
            if v not in used:
                g.values.pop(v, None)
                g.constants.pop(v, None)


# -------------------------------------------------------------------------------- groups


# a lone softmax stays ATen's: it often feeds a top-k or an argmax (a router), where eager's
# own bits keep near-ties in eager's order
LONE_ROW_OPS = frozenset({"layer_norm"})


def _reduction_groups(dag: Dag, o: FuseOptions) -> list[tuple[str, list[int]]]:
    groups = []
    for i, n in enumerate(dag.nodes):
        if not dag.free(i) or not is_row_reduction(n, dag.g):
            continue
        in_t, out_t = dag.type_of(n.inputs[0]), dag.out_type(i)
        group = {i}
        # prologue: pointwise producers of the reduced input, nearest first
        heap = [-p for p in [dag.producer(n.inputs[0])] if p is not None]
        while heap and len(group) < o.max_ops:
            p = -heapq.heappop(heap)
            if p in group or not dag.free(p) or not is_pointwise(dag.nodes[p]):
                continue
            if not dag.out_type(p).matches(in_t, dtype=False) or not dag.convex(group | {p}):
                continue
            group.add(p)
            for v in dag.nodes[p].inputs:
                q = dag.producer(v)
                if q is not None and q not in group:
                    heapq.heappush(heap, -q)
        # epilogue: pointwise consumers of the result (and of each other), in order; a
        # keepdim reduction's row value may be broadcast back over the row (x - max(x))
        shapes = [out_t] + ([in_t] if in_t.rank == out_t.rank else [])
        heap = list(dag.users_of(n.outputs[0]))
        heapq.heapify(heap)
        while heap and len(group) < o.max_ops:
            u = heapq.heappop(heap)
            un = dag.nodes[u]
            if u in group or not dag.free(u) or not is_pointwise(un):
                continue
            if not any(dag.out_type(u).matches(t, dtype=False) for t in shapes) or not dag.convex(group | {u}):
                continue
            group.add(u)
            for w in dag.users_of(un.outputs[0]):
                heapq.heappush(heap, w)
        if len(group) >= o.min_ops or (n.op in LONE_ROW_OPS and o.min_ops <= 2):
            dag.merge(group)
            groups.append(("norm" if n.op == "layer_norm" else "reduction", sorted(group)))
    return groups


def _gemm_epilogue_groups(dag: Dag, o: FuseOptions) -> list[tuple[str, list[int]]]:
    groups = []
    for i, n in enumerate(dag.nodes):
        if n.op not in GEMM_OPS or n.body is not None or not dag.free(i):
            continue
        head = [i]
        cur = n.outputs[0]
        # reshapes of the (contiguous) GEMM result are views: the epilogue runs on the view
        while len(head) < o.max_ops - 1:
            us = dag.users_of(cur)
            if cur in dag.graph_outputs or len(us) != 1:
                break
            r = us[0]
            if dag.nodes[r].op != "reshape" or not dag.free(r):
                break
            head.append(r)
            cur = dag.nodes[r].outputs[0]
        ep_t = dag.type_of(cur)
        group = set(head)
        produced = {cur}
        heap = list(dag.users_of(cur))
        heapq.heapify(heap)
        while heap and len(group) < o.max_ops:
            u = heapq.heappop(heap)
            un = dag.nodes[u]
            if u in group or not dag.free(u) or not is_epilogue_op(un):
                continue
            if un.op in EPILOGUE_EXTRA_OPS and un.inputs[0] not in produced:
                continue
            if not dag.out_type(u).matches(ep_t, dtype=False) or not dag.convex(group | {u}):
                continue
            group.add(u)
            produced.add(un.outputs[0])
            for w in dag.users_of(un.outputs[0]):
                heapq.heappush(heap, w)
        members = sorted(group)
        # the largest prefix (in program order) whose only visible output is its last op's
        for k in range(len(members), len(head), -1):
            cand = members[:k]
            if k < o.min_ops:
                break
            if dag.external_outputs(cand) == list(dag.nodes[cand[-1]].outputs) and dag.convex(cand):
                dag.merge(cand)
                groups.append(("gemm_epilogue", cand))
                break
    return groups


def _elementwise_groups(dag: Dag, o: FuseOptions) -> list[tuple[str, list[int]]]:
    groups = []
    for i, n in enumerate(dag.nodes):
        if not dag.free(i) or not is_pointwise(n):
            continue
        shape_t = dag.out_type(i)
        group = {i}
        while len(group) < o.max_ops:
            near: set[int] = set()
            for j in group:
                m = dag.nodes[j]
                near.update(p for p in (dag.producer(v) for v in m.inputs) if p is not None)
                near.update(dag.users_of(m.outputs[0]))
            cands = sorted(c for c in near - group
                           if dag.free(c) and is_pointwise(dag.nodes[c]) and dag.out_type(c).matches(shape_t, dtype=False))
            pick = next((c for c in cands if dag.convex(group | {c})), None)
            if pick is None:
                break
            group.add(pick)
        if len(group) >= o.min_ops:
            dag.merge(group)
            groups.append(("elementwise", sorted(group)))
    return groups


# ------------------------------------------------------------------------------ rewrite


def _fused_node(g: Graph, dag: Dag, kind: str, members: list[int]) -> Node:
    nodes = [dag.nodes[i] for i in members]
    produced = {o for n in nodes for o in n.outputs}
    inputs = list(dict.fromkeys(v for n in nodes for v in n.inputs if v not in produced))
    outputs = dag.external_outputs(members)
    body = Graph(f"{g.name}.{outputs[0]}")
    for v in inputs:
        body.add_input(v, g.type_of(v))
    for n in nodes:
        for o in n.outputs:
            body.add_value(o, g.type_of(o))
    body.nodes = nodes
    body.outputs = outputs
    attrs = {"kind": kind, "pattern": "+".join(n.op for n in nodes)}
    return Node("fused", tuple(inputs), tuple(outputs), attrs, body)


def _topo_sort(items: list[tuple[int, Node]]) -> list[Node]:
    """Kahn's algorithm keeping program order where the dependencies allow (a fused node
    sits where its last member was)."""
    prod = {o: k for k, (_, n) in enumerate(items) for o in n.outputs}
    succ: list[set[int]] = [set() for _ in items]
    indeg = [0] * len(items)
    for k, (_, n) in enumerate(items):
        for p in {prod[v] for v in n.inputs if v in prod}:
            if p != k:
                succ[p].add(k)
                indeg[k] += 1
    heap = [(key, k) for k, (key, _) in enumerate(items) if indeg[k] == 0]
    heapq.heapify(heap)
    out = []
    while heap:
        _, k = heapq.heappop(heap)
        out.append(items[k][1])
        for s in succ[k]:
            indeg[s] -= 1
            if indeg[s] == 0:
                heapq.heappush(heap, (items[s][0], s))
    if len(out) != len(items):  # pragma: no cover - Dag.convex guards every group
        raise PassError("fusion produced a cyclic graph", where="pass fuse",
                        fix="this is a graphmode bug; remove 'fuse' from optimize.passes to work around it")
    return out


@register_pass("fuse")
def run(graph: Graph, ctx: PassContext) -> PassResult:
    o: FuseOptions = ctx.opts("fuse")
    if o.min_ops > o.max_ops:
        raise PassError("fuse.min_ops is larger than fuse.max_ops", where="optimize.fusion.min_ops",
                        value=(o.min_ops, o.max_ops), fix="set min_ops <= max_ops")
    stats: dict = {"groups": 0, "by_kind": {}, "ops_fused": 0, "largest_group": 0, "attention_rewrites": 0}
    if not o.enabled or not o.patterns:
        return PassResult(graph, False, stats)
    g = graph
    if "attention" in o.patterns:
        g, fired = rewrite_graph(graph, attention_rules())   # a new graph (own dicts) when it fired
        if g is not graph:
            _drop_unreferenced(graph, g)
        stats = {**fired, **stats, "attention_rewrites": sum(v for k, v in fired.items() if k != "kept_for_output")}
    g = g.clone() if g is graph else g
    dag = Dag(g, g.nodes)
    groups: list[tuple[str, list[int]]] = []
    if "reduction" in o.patterns:
        groups += _reduction_groups(dag, o)
    if "gemm_epilogue" in o.patterns:
        groups += _gemm_epilogue_groups(dag, o)
    if "elementwise" in o.patterns:
        groups += _elementwise_groups(dag, o)
    if not groups and not stats["attention_rewrites"]:
        return PassResult(graph, False, stats)

    in_group = {i for _, members in groups for i in members}
    items = [(i, n) for i, n in enumerate(dag.nodes) if i not in in_group]
    internal: set[str] = set()
    for kind, members in sorted(groups, key=lambda km: km[1][0]):
        node = _fused_node(g, dag, kind, members)
        items.append((members[-1], node))
        internal |= {v for i in members for v in dag.nodes[i].outputs} - set(node.outputs)
        stats["by_kind"][kind] = stats["by_kind"].get(kind, 0) + 1
        stats["ops_fused"] += len(members)
        stats["largest_group"] = max(stats["largest_group"], len(members))
    items.sort(key=lambda kn: kn[0])
    g.nodes = _topo_sort(items)
    for v in internal:
        del g.values[v]
    stats["groups"] = len(groups)
    stats["by_kind"] = dict(sorted(stats["by_kind"].items()))
    return PassResult(g, True, stats)
