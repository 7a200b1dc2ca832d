"""IR invariants, checked after every pass: defined-before-use, single definition,
declared types equal the op set's inferred types, fused bodies consistent."""
from __future__ import annotations

from graphmode.errors import IRError
from graphmode.ir.graph import Graph, Node
from graphmode.ir.ops import get_op
from graphmode.ir.types import TORCH_TO_DTYPE, same_dims

COMMON_ATTRS = frozenset({"loc", "precision"})




def _check_node(g: Graph, n: Node, defined: set[str], where: str) -> None:
    spec = get_op(n.op)
    lo, hi = spec.arity
    if not lo <= len(n.inputs) <= hi:
        raise IRError(f"{n.op} takes {lo}..{hi} inputs, got {len(n.inputs)}", where=where)
    unknown = set(n.attrs) - set(spec.attrs) - COMMON_ATTRS
    if unknown and spec.kind not in ("fused", "fallback"):
        raise IRError(f"{n.op} has unknown attributes {sorted(unknown)}", where=where,
                      fix=f"{n.op} understands {list(spec.attrs)}")
    for i in n.inputs:
        if i not in defined:
            raise IRError(f"%{i} is used before it is defined", where=where,
                          fix="nodes must be topologically ordered")
    for o in n.outputs:
        if o in defined:
            raise IRError(f"%{o} is defined twice", where=where)
        if o not in g.values:
            raise IRError(f"%{o} has no type", where=where)
    declared = [g.values[o].type for o in n.outputs]
    if n.op == "fused":
        if n.body is None:
            raise IRError("fused node without a body", where=where)
        if list(n.body.inputs) != list(n.inputs) or list(n.body.outputs) != list(n.outputs):
            raise IRError("fused body inputs/outputs differ from the node's", where=where)
        verify_graph(n.body, _outer={i: g.values[i].type for i in n.inputs}, _ranges=g.dims)
        for o in n.outputs:
            if not n.body.values[o].type.matches(g.values[o].type):
                raise IRError(f"fused output %{o} type differs from its body", where=where)
    elif n.op != "fallback":
        try:
            inferred = spec.infer([g.values[i].type for i in n.inputs], n.attrs)
        except IRError as e:
            raise IRError(e.message, where=where, fix=e.fix) from None
        except (KeyError, IndexError, TypeError, ValueError) as e:
            raise IRError(f"{n.op}: bad attributes or inputs ({type(e).__name__}: {e})", where=where) from None
        if len(inferred) != len(declared) or not all(_agree(a, b, g.dims) for a, b in zip(inferred, declared)):
            raise IRError(f"declared type {[t.text() for t in declared]} differs from inferred "
                          f"{[t.text() for t in inferred]}", where=where)
    defined.update(n.outputs)


def _agree(inferred, declared, ranges) -> bool:
    """The op set's type and the declared one: equal, or equal over the graph's dim ranges
    (torch.export specialises a size the range fixes: floor(H/32) is 1 for H in 32..63)."""
    return inferred.matches(declared, layout=False) or bool(ranges) and inferred.dtype == declared.dtype \
        and same_dims(inferred.shape, declared.shape, ranges)


def verify_graph(g: Graph, _outer: dict | None = None, _ranges: dict | None = None) -> None:
    """Raise IRError naming the first broken invariant (node index, op and outputs)."""
    if _ranges and not g.dims:
        g = _with_dims(g, _ranges)
    defined: set[str] = set(g.inputs)
    for name, t in g.constants.items():
        v = g.values.get(name)
        if v is None or v.role not in ("param", "const", "state"):
            raise IRError(f"constant %{name} must have role param, const or state", where=f"graph @{g.name}")
        if TORCH_TO_DTYPE.get(t.dtype) != v.type.dtype or tuple(t.shape) != tuple(v.type.shape):
            raise IRError(f"constant %{name} data {tuple(t.shape)} {t.dtype} differs from its type {v.type.text()}",
                          where=f"graph @{g.name}")
        defined.add(name)
    if _outer:
        defined.update(_outer)
    for i in g.inputs:
        if i not in g.values:
            raise IRError(f"input %{i} has no type", where=f"graph @{g.name}")
    for idx, n in enumerate(g.nodes):
        _check_node(g, n, defined, f"@{g.name} node #{idx} {n.op} -> {', '.join('%' + o for o in n.outputs)}")
    for o in g.outputs:
        if o not in defined:
            raise IRError(f"output %{o} is never defined", where=f"graph @{g.name}")


def _with_dims(g: Graph, ranges: dict) -> Graph:
    """A fused body checked over its parent's dim ranges (a shallow copy: the body is unchanged)."""
    import dataclasses
    return dataclasses.replace(g, dims=dict(ranges))
