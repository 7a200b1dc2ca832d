"""canonicalize: remove no-op ops and merge view chains so later passes see one form.

Rules (one forward walk; each node sees already-canonical producers, so chains collapse
in a single pass):

- identity ops disappear: `identity`, `cast` to the same dtype, `reshape`/`expand` to the
  same shape, `permute` by the identity perm, `slice` with step 1 that keeps the whole dim;
- `reshape(reshape(x))` -> `reshape(x)` (and disappears when it gives x's shape back);
- `permute(permute(x, p), q)` -> `permute(x, [p[i] for i in q])` (disappears when identity);
- algebraic identities with an all-ones/all-zeros constant: x*1, 1*x, x+0, 0+x, x-0, x/1,
  only when the result has exactly x's type (so broadcasting or type promotion by the
  constant keeps the node), and only for `const` literals: a `param` that happens to be
  zero today (a freshly initialised bias) is data, not program structure.

Nodes a rule makes unused (the inner reshape of a chain, say) are left for `dce`. Fused
regions and fallback nodes are not looked into. Dims are compared with `dims_equal`, so
rules hold on symbolic shapes.

A graph output keeps its name: when the node that produced it goes away, the value that
replaces it is renamed to the output's name (if that value is produced by a node and is
not itself an output); otherwise the node is kept. The runtime looks outputs up by name.

`Rewrite` below is the shared substitute-and-rename machinery the other rewriting passes
(constant_fold, cse, layout) use too.
"""
from __future__ import annotations

from typing import Iterable, Mapping

import torch

from graphmode.ir.graph import Graph, Node
from graphmode.ir.types import TensorType, Value, dims_equal
from graphmode.passes.base import PassContext, PassResult, register_pass


# ------------------------------------------------------------------------------ shared helpers

def types_equal(a: TensorType, b: TensorType) -> bool:
    """Same dtype, rank, layout and (symbolically) equal dims."""
    if a.dtype != b.dtype or a.rank != b.rank or a.layout != b.layout:
        return False
    return all(x == y or dims_equal(x, y) for x, y in zip(a.shape, b.shape))


def shapes_equal(a: Iterable, b: Iterable) -> bool:
    a, b = tuple(a), tuple(b)
    return len(a) == len(b) and all(x == y or dims_equal(x, y) for x, y in zip(a, b))


def rename_body(body: Graph, mapping: Mapping[str, str]) -> Graph:
    """A copy of a fused body with its boundary/inner names renamed (body inputs mirror the
    outer node's inputs, so an outer substitution has to reach inside)."""
    if not any(k in body.values for k in mapping):
        return body
    values: dict[str, Value] = {}
    for name, v in body.values.items():
        new = mapping.get(name, name)
        if new not in values:
            values[new] = Value(new, v.type, v.role)
    nodes = [rename_node(n, mapping) for n in body.nodes]
    return Graph(body.name, values, [mapping.get(i, i) for i in body.inputs],
                 [mapping.get(o, o) for o in body.outputs], nodes, dict(body.constants), dict(body.dims))


def rename_node(n: Node, mapping: Mapping[str, str]) -> Node:
    ins = tuple(mapping.get(i, i) for i in n.inputs)
    outs = tuple(mapping.get(o, o) for o in n.outputs)
    if ins == n.inputs and outs == n.outputs:
        return n
    body = rename_body(n.body, mapping) if n.body is not None else None
    return n.with_(inputs=ins, outputs=outs, body=body)


class Rewrite:
    """One forward walk over a graph that drops nodes in favour of existing values.

    `replace(o, x)` says "uses of %o read %x from now on". Uses are rewritten as nodes are
    emitted; graph outputs keep their names by renaming the replacing value (`finish`).
    The input graph is never touched: `finish` returns a new Graph.
    """

    def __init__(self, graph: Graph):
        self.graph = graph
        self.values: dict[str, Value] = dict(graph.values)
        self.constants: dict[str, torch.Tensor] = dict(graph.constants)
        self.outputs = set(graph.outputs)
        self.subst: dict[str, str] = {}
        self.rename: dict[str, str] = {}          # value -> graph output name it takes over
        self.nodes: list[Node] = []
        self.producer: dict[str, Node] = {}       # current producer of a (pre-rename) name
        self.changed = False

    def resolve(self, name: str) -> str:
        seen = 0
        while name in self.subst:
            name = self.subst[name]
            seen += 1
            if seen > 1_000_000:  # a cycle would be a bug in a pass
                raise RuntimeError(f"substitution cycle at %{name}")
        return name

    def resolved(self, n: Node) -> Node:
        ins = tuple(self.resolve(i) for i in n.inputs)
        if ins == n.inputs:
            return n
        body = rename_body(n.body, dict(zip(n.inputs, ins))) if n.body is not None else None
        return n.with_(inputs=ins, body=body)

    def type_of(self, name: str) -> TensorType:
        return self.values[name].type

    def emit(self, n: Node) -> Node:
        self.nodes.append(n)
        for o in n.outputs:
            self.producer[o] = n
        return n

    def can_replace(self, old: str, new: str) -> bool:
        if old not in self.outputs:
            return True
        return (new not in self.outputs and new not in self.rename and new in self.producer
                and not self.graph.is_constant(new) and new not in self.graph.inputs)

    def replace(self, old: str, new: str) -> bool:
        """Drop value `old` for `new` (same type). False: `old` is a graph output that cannot
        take over `new`'s name, and the caller must keep its node."""
        new = self.resolve(new)
        if not self.can_replace(old, new):
            return False
        if old in self.outputs:
            self.rename[new] = old
            self.producer[old] = self.producer[new]
        else:
            self.subst[old] = new
        self.changed = True
        return True

    def finish(self, *, nodes: list[Node] | None = None) -> Graph:
        nodes = self.nodes if nodes is None else nodes
        if self.rename:
            nodes = [rename_node(n, self.rename) for n in nodes]
        values = live_values(self.values, self.graph.inputs, self.constants, nodes)
        return Graph(self.graph.name, values, list(self.graph.inputs), list(self.graph.outputs),
                     nodes, self.constants, dict(self.graph.dims))


def live_values(values: Mapping[str, Value], inputs, constants, nodes: list[Node]) -> dict[str, Value]:
    """The values something still defines (inputs, constants, node outputs): a dropped
    node's outputs must not linger as typed-but-undefined names."""
    defined = set(inputs) | set(constants)
    for n in nodes:
        defined.update(n.outputs)
    return {k: v for k, v in values.items() if k in defined}


def is_identity_perm(perm) -> bool:
    return list(perm) == list(range(len(perm)))


def const_all(t: torch.Tensor, value: float) -> bool:
    if t.numel() == 0:
        return False
    return bool(torch.all(t == value).item())


# ------------------------------------------------------------------------------ the pass

_ALGEBRA = {  # op -> [(constant operand index, constant value)]
    "mul": [(1, 1), (0, 1)], "add": [(1, 0), (0, 0)], "sub": [(1, 0)], "div": [(1, 1)],
}


def _rule(rw: Rewrite, n: Node) -> tuple[str | None, Node, str | None]:
    """(rule name, possibly rewritten node, value that replaces the node's output or None)."""
    t_out = rw.type_of(n.outputs[0]) if n.outputs else None
    if n.op in ("fused", "fallback") or len(n.outputs) != 1:
        return None, n, None
    src = n.inputs[0] if n.inputs else None
    if n.op == "identity":
        return "identity", n, src
    if n.op == "cast" and types_equal(rw.type_of(src), t_out):
        return "cast_noop", n, src
    if n.op == "reshape":
        rule = None
        p = rw.producer.get(src)
        if p is not None and p.op == "reshape":
            n = n.with_(inputs=(p.inputs[0],))
            src = p.inputs[0]
            rule = "reshape_chain"
        if types_equal(rw.type_of(src), t_out):
            return "reshape_noop", n, src
        return rule, n, None
    if n.op == "permute":
        rule = None
        perm = list(n.attrs["perm"])
        p = rw.producer.get(src)
        if p is not None and p.op == "permute":
            inner = list(p.attrs["perm"])
            perm = [inner[i] for i in perm]
            src = p.inputs[0]
            n = n.with_(inputs=(src,), attrs={**n.attrs, "perm": perm})
            rule = "permute_chain"
        if is_identity_perm(perm):
            return "permute_noop", n, src
        return rule, n, None
    if n.op == "expand" and types_equal(rw.type_of(src), t_out):
        return "expand_noop", n, src
    if n.op == "slice" and n.attrs.get("step", 1) == 1 and types_equal(rw.type_of(src), t_out):
        return "slice_noop", n, src
    for idx, value in _ALGEBRA.get(n.op, ()):
        c = rw.constants.get(n.inputs[idx])
        other = n.inputs[1 - idx]
        if c is not None and rw.values[n.inputs[idx]].role == "const" \
                and types_equal(rw.type_of(other), t_out) and const_all(c, value):
            return f"{n.op}_{value}", n, other
    return None, n, None


@register_pass("canonicalize")
def run(graph: Graph, ctx: PassContext) -> PassResult:
    rw = Rewrite(graph)
    stats: dict[str, int] = {}
    for n in graph.nodes:
        n = rw.resolved(n)
        rule, new, repl = _rule(rw, n)
        if repl is not None and rw.replace(n.outputs[0], repl):
            stats[rule] = stats.get(rule, 0) + 1
            continue
        if repl is not None:  # a no-op that defines a graph output: kept (in its merged form)
            stats["kept_for_output"] = stats.get("kept_for_output", 0) + 1
        elif rule is not None:
            stats[rule] = stats.get(rule, 0) + 1
        if new is not n:
            rw.changed = True
        rw.emit(new)
    g = rw.finish()
    return PassResult(g, rw.changed, dict(sorted(stats.items())))
