"""merge_linears: linears that read the same input become one GEMM over their concatenated weights.

A decode step at batch 1 is a chain of GEMVs, each bound by reading its weight; the q, k and v
projections of an attention block (and the gate and up projections of a gated MLP) read the
same activations, so as three (two) kernels they pay three (two) dispatches, three ramp-ups of
the weight stream and three thread fork/joins for one pass over the data. Here every group of
`linear(x, W_i[, b_i])` with the same input `x`, constant weights of one dtype and the same
`in`, and all with or all without a bias becomes

    linear(x, concat(W_i)[, concat(b_i)])  ->  slice along the last axis, one per W_i

with each slice keeping its linear's output name, so every user is unchanged. Row n of the
merged weight is row n' of one W_i, so each output column is computed from the same weight row
and input as before. It runs after constant_fold (weights are constants then) and after `shard`
(a rank's q/k/v are then its own heads' rows, merged locally), and before quantize_weights, so
int8 (a scale per output row) and int4 (groups along `in`) quantize the merged weight exactly
as they would the parts. GPT-2's c_attn is already one matmul: nothing to merge there.
"""
from __future__ import annotations

import torch

from graphmode.ir.graph import Graph, Node
from graphmode.passes.base import PassContext, PassResult, register_pass


def _key(g: Graph, n: Node) -> tuple | None:
    """What linears must share to merge: input, weight dtype, `in`, bias or not; None if `n` cannot."""
    if n.op != "linear" or len(n.inputs) < 2:
        return None
    w = n.inputs[1]
    if not g.is_constant(w) or g.type_of(w).rank != 2:
        return None
    bias = len(n.inputs) > 2
    if bias and (not g.is_constant(n.inputs[2]) or g.type_of(n.inputs[2]).dtype != g.type_of(w).dtype):
        return None
    out = g.type_of(n.outputs[0]).shape[-1]
    if not isinstance(out, int):
        return None
    return n.inputs[0], g.type_of(w).dtype, g.type_of(w).shape[1], bias


def _merged_name(names: list[str]) -> str:
    """`a.q_proj.weight`, `a.k_proj.weight` -> `a.q_proj_k_proj.weight`: the parts that differ, joined."""
    parts = [n.split(".") for n in names]
    head = 0
    while all(len(p) > head + 1 and p[head] == parts[0][head] for p in parts):
        head += 1
    tail = 0
    while all(len(p) > head + tail + 1 and p[-1 - tail] == parts[0][-1 - tail] for p in parts):
        tail += 1
    mids = ["_".join(p[head:len(p) - tail]) for p in parts]
    if len(set(mids)) < len(mids):
        return f"{names[0]}.merged"
    return ".".join(parts[0][:head] + ["_".join(mids)] + (parts[0][len(parts[0]) - tail:] if tail else []))


def _merged(g: Graph, group: list[Node]) -> list[Node]:
    """One linear over the concatenated weights and the slices that give back each output."""
    first = group[0]
    wname = g.fresh_name(_merged_name([n.inputs[1] for n in group]))
    w = g.add_constant(wname, torch.cat([g.constants[n.inputs[1]] for n in group], dim=0).contiguous())
    inputs = [first.inputs[0], w]
    if len(first.inputs) > 2:
        inputs.append(g.add_constant(g.fresh_name(f"{wname}.bias"),
                                     torch.cat([g.constants[n.inputs[2]] for n in group]).contiguous()))
    t = g.type_of(first.outputs[0])
    widths = [g.type_of(n.outputs[0]).shape[-1] for n in group]
    whole = g.add_value(g.fresh_name(f"{first.outputs[0]}.merged"), t.with_shape(t.shape[:-1] + (sum(widths),)))
    nodes = [Node("linear", tuple(inputs), (whole,), {})]
    start = 0
    for n, width in zip(group, widths):
        nodes.append(Node("slice", (whole,), n.outputs, {"dim": t.rank - 1, "start": start, "end": start + width,
                                                          "step": 1}))
        start += width
    return nodes


@register_pass("merge_linears")
def run(graph: Graph, ctx: PassContext) -> PassResult:
    groups: dict[tuple, list[Node]] = {}
    for n in graph.nodes:
        key = _key(graph, n)
        if key is not None:
            groups.setdefault(key, []).append(n)
    groups = {k: v for k, v in groups.items() if len(v) > 1}
    if not groups:
        return PassResult(graph, False, {"merged": 0, "linears_before": 0})
    g = graph.clone()
    first = {id(v[0]): v for v in groups.values()}
    gone = {id(n) for v in groups.values() for n in v[1:]}
    nodes: list[Node] = []
    for n in graph.nodes:          # the merged linear where its group's first member was: x is computed by then
        if id(n) in first:
            nodes.extend(_merged(g, first[id(n)]))
        elif id(n) not in gone:
            nodes.append(n)
    g.nodes = nodes
    g.prune_values()
    return PassResult(g, True, {"merged": len(groups), "linears_before": sum(len(v) for v in groups.values()),
                                "parts": sorted({len(v) for v in groups.values()})})


__all__ = ["run"]
