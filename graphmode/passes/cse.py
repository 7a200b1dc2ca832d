"""cse: compute each value once.

- Two nodes with the same op, the same (already merged) inputs, the same attributes (the
  debug-only `loc` is ignored), the same output types and equal bodies are one node; the
  later one goes away and its uses read the earlier one's outputs. Inputs of commutative
  ops (add, mul, maximum, ...) are compared as a multiset. Fused bodies are compared up to
  the names of their inner values. Fallback nodes count as pure, except torch ops whose
  name says they draw random numbers.
- Small `const` constants (at most `max_const_numel` elements, default 4096) with the same
  dtype, shape and bytes are one constant: the first name in sorted order is kept, so the
  result does not depend on dict order. `param`s are left alone unless `dedupe_params` is
  set: their names are the weight file's contract, and two equal weights (a randomly
  initialised model's all-ones LayerNorm weights) merging into one name reads as a bug.

Graph outputs keep their names (the rewrite engine's `Rewriter.replace`). Options
(`CseOptions`): `max_const_numel`, `dedupe_params` (default False). One forward walk on the
engine's state: value numbering needs a table of everything seen, not a local pattern.
"""
from __future__ import annotations

import json

import torch

from graphmode.ir.graph import Graph, Node, constant_digest, constant_digests
from graphmode.ir.ops import ops_with
from graphmode.passes.base import PassContext, PassResult, register_pass
from graphmode.passes.rewrite import Rewriter

COMMUTATIVE = ops_with("commutative")
IGNORED_ATTRS = frozenset({"loc"})
_RANDOM_HINTS = ("rand", "dropout", "bernoulli", "normal", "uniform", "multinomial", "poisson", "exponential")


def _attrs_key(attrs) -> str:
    return json.dumps({k: v for k, v in attrs.items() if k not in IGNORED_ATTRS}, sort_keys=True, default=str)


def body_key(body: Graph) -> tuple:
    """A structural key of a region, independent of its inner value names."""
    local = {name: f"${i}" for i, name in enumerate(body.inputs)}
    counter = len(local)
    items = []
    for n in body.nodes:
        ins = tuple(local.get(i, f"%{i}") for i in n.inputs)
        for o in n.outputs:
            local[o] = f"${counter}"
            counter += 1
        outs = tuple((local[o], body.values[o].type.text()) for o in n.outputs)
        items.append((n.op, ins, _attrs_key(n.attrs), outs, body_key(n.body) if n.body is not None else None))
    return tuple(items), tuple(local.get(o, o) for o in body.outputs)


def _pure(n: Node) -> bool:
    if n.op != "fallback":
        return True
    target = str(n.attrs.get("target", "")).lower()
    return not any(h in target for h in _RANDOM_HINTS)


def node_key(rw: Rewriter, n: Node) -> tuple:
    ins = tuple(sorted(n.inputs)) if n.op in COMMUTATIVE else n.inputs
    types = tuple(rw.type_of(o).text() for o in n.outputs)
    return (n.op, ins, _attrs_key(n.attrs), types, body_key(n.body) if n.body is not None else None)


def _dedupable(rw: Rewriter, name: str, max_numel: int, params: bool) -> bool:
    role = rw.values[name].role
    # state (a KV pool) is mutable: equal bytes now are not equal values
    return not (rw.constants[name].numel() > max_numel or name in rw.outputs or role == "state"
                or (role == "param" and not params))


def _dedupe_constants(rw: Rewriter, max_numel: int, params: bool) -> int:
    groups: dict[tuple, list[str]] = {}
    cands = [name for name in sorted(rw.constants) if _dedupable(rw, name, max_numel, params)]
    constant_digests(rw.constants[name] for name in cands)
    for name in cands:
        t = rw.constants[name]
        key = (rw.values[name].role, str(t.dtype), tuple(t.shape), constant_digest(t))
        groups.setdefault(key, []).append(name)
    merged = 0
    for names in groups.values():
        keep = names[0]
        for other in names[1:]:
            if torch.equal(rw.constants[keep], rw.constants[other]):
                rw.replace(other, keep)
                del rw.constants[other]
                del rw.values[other]
                merged += 1
    return merged


@register_pass("cse")
def run(graph: Graph, ctx: PassContext) -> PassResult:
    opts = ctx.opts("cse")
    rw = Rewriter(graph)
    merged_consts = _dedupe_constants(rw, opts.max_const_numel, opts.dedupe_params)
    seen: dict[tuple, Node] = {}
    merged: dict[str, int] = {}
    kept = 0
    for n in graph.nodes:
        n = rw.resolved(n)
        if not _pure(n):
            rw.emit(n)
            continue
        key = node_key(rw, n)
        first = seen.get(key)
        if first is not None and all(rw.can_replace(o, f) for o, f in zip(n.outputs, first.outputs)):
            for o, f in zip(n.outputs, first.outputs):
                rw.replace(o, f)
            merged[n.op] = merged.get(n.op, 0) + 1
            continue
        if first is not None:
            kept += 1
        else:
            seen[key] = n
        rw.emit(n)
    stats = {"merged": sum(merged.values()), "merged_by_op": dict(sorted(merged.items())),
             "merged_constants": merged_consts}
    if kept:
        stats["kept_for_output"] = kept
    changed = bool(merged) or bool(merged_consts)
    return PassResult(rw.finish(), changed, stats)
