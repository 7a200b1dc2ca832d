"""The pattern language of the rewrite engine (rewrite.py), after tinygrad's `UPat` and
MLIR's declarative rewrite patterns: a rule says what a value must look like instead of
walking producers by hand.

A `Pat` describes a value:

- `Pat.var("x")` matches any value (an input, a constant, a node's output) and binds it;
- `Pat.const("c", where=...)` matches a value that holds constant data;
- `Pat("mul", a, b, commute=True)` matches the output of a `mul` node whose operands match
  `a` and `b` (in either order with `commute`); `Pat(("add", "sub"), ...)` takes several ops;
- `Pat.either(p, q, ..., name=...)` tries each alternative in order.

Every pattern may carry a `name` (the value is bound under it, and for node patterns the
node too: `m.node(name)`), a predicate `where(m) -> bool` that runs once the pattern's
operands are bound, and `single_use`: the value has no reader but the node matched just
above it and is not a graph output. A name bound twice must bind the same value, so
`Pat("add", Pat.var("x"), Pat.var("x"))` matches `x + x` only.

Single-use also says who owns a node: a node matched `single_use` on a path of single-use
nodes from the root is *consumed* by the rule, and the driver erases it once the rewrite
leaves it without readers. Anything else the rule matched stays (for `dce` to judge).
"""
from __future__ import annotations

from typing import Callable, Iterable, Iterator, Protocol

import torch

from graphmode.ir.graph import Node
from graphmode.ir.types import TensorType


class GraphView(Protocol):
    """What matching reads from the graph being rewritten (`rewrite.Rewriter`)."""

    def producer(self, value: str) -> Node | None: ...

    def single_use(self, value: str) -> bool: ...

    def type_of(self, value: str) -> TensorType: ...

    def constant(self, value: str) -> torch.Tensor | None: ...

    def role(self, value: str) -> str: ...


class Pat:
    """A value pattern (see the module doc). Build node patterns with `Pat(op, *operands, ...)`
    (no operand patterns: any operands), the others with `var`, `const` and `either`."""

    __slots__ = ("ops", "src", "name", "where", "single_use", "commute", "constant", "alts")

    def __init__(self, ops: str | Iterable[str] | None, *src: "Pat", name: str | None = None,
                 where: Callable[["Match"], bool] | None = None, single_use: bool = False,
                 commute: bool = False):
        if commute and len(src) != 2:
            raise ValueError("commute needs exactly two operand patterns")
        self.ops = frozenset([ops]) if isinstance(ops, str) else (frozenset(ops) if ops is not None else None)
        self.src = tuple(src) or None
        self.name = name
        self.where = where
        self.single_use = single_use
        self.commute = commute
        self.constant = False
        self.alts: tuple[Pat, ...] = ()

    @staticmethod
    def var(name: str | None = None, where: Callable[["Match"], bool] | None = None) -> "Pat":
        return Pat(None, name=name, where=where)

    @staticmethod
    def const(name: str | None = None, where: Callable[["Match"], bool] | None = None) -> "Pat":
        p = Pat(None, name=name, where=where)
        p.constant = True
        return p

    @staticmethod
    def either(*alternatives: "Pat", name: str | None = None) -> "Pat":
        p = Pat(None, name=name)
        p.alts = tuple(alternatives)
        return p

    @property
    def root_ops(self) -> frozenset[str] | None:
        """The ops a value matched by this pattern can come from (None: any)."""
        if self.alts:
            sets = [a.root_ops for a in self.alts]
            return None if any(s is None for s in sets) else frozenset().union(*sets)
        return self.ops


class Match:
    """The bindings of one match: value names, the nodes of node patterns, and the nodes the
    rule consumes. Immutable: each binding step makes a new Match, so backtracking is free."""

    __slots__ = ("view", "root", "_values", "_nodes", "consumed")

    def __init__(self, view: GraphView, root: Node, values=None, nodes=None, consumed=()):
        self.view = view
        self.root = root
        self._values: dict[str, str] = values or {}
        self._nodes: dict[str, Node] = nodes or {}
        self.consumed: tuple[Node, ...] = consumed

    def _bind(self, name: str | None, value: str, node: Node | None, consumed: bool) -> "Match | None":
        if name is not None and self._values.get(name, value) != value:
            return None
        if name is None and not consumed:
            return self
        values = self._values if name is None else {**self._values, name: value}
        nodes = self._nodes if name is None or node is None else {**self._nodes, name: node}
        return Match(self.view, self.root, values, nodes, self.consumed + ((node,) if consumed else ()))

    # ---- what rules read ----------------------------------------------------------------
    def __getitem__(self, name: str) -> str:
        return self._values[name]

    def __contains__(self, name: str) -> bool:
        return name in self._values

    def get(self, name: str) -> str | None:
        return self._values.get(name)

    def node(self, name: str) -> Node | None:
        return self._nodes.get(name)

    def type(self, name: str) -> TensorType:
        return self.view.type_of(self._values[name])

    def const(self, name: str) -> torch.Tensor:
        t = self.view.constant(self._values[name])
        assert t is not None, f"{name} is not bound to a constant"
        return t

    def role(self, name: str) -> str:
        return self.view.role(self._values[name])

    def scalar(self, name: str) -> float | None:
        """The value of a one-element numeric constant bound to `name`, else None."""
        t = self.view.constant(self._values[name]) if name in self._values else None
        if t is None or t.numel() != 1 or t.dtype.is_complex or t.dtype == torch.bool:
            return None
        return float(t.reshape(()).item())


def match_root(pat: Pat, node: Node, view: GraphView) -> Iterator[Match]:
    """Every way `pat` matches the (single) output of `node`, in the patterns' order."""
    yield from _match(pat, node.outputs[0], Match(view, node), None, True)


def _match(p: Pat, value: str, m: Match, user: Node | None, owned: bool) -> Iterator[Match]:
    if p.alts:
        for alt in p.alts:
            for m2 in _match(alt, value, m, user, owned):
                m2 = m2._bind(p.name, value, None, False)
                if m2 is not None:
                    yield m2
        return
    view = m.view
    node = None
    if p.ops is not None:
        node = m.root if user is None else view.producer(value)
        if node is None or node.op not in p.ops or node.body is not None or len(node.outputs) != 1:
            return
    if p.constant and view.constant(value) is None:
        return
    if user is not None and p.single_use and not view.single_use(value):
        return
    consumed = user is not None and owned and p.single_use and node is not None
    m = m._bind(p.name, value, node, consumed)
    if m is None:
        return
    if node is None or p.src is None:
        if p.where is None or p.where(m):
            yield m
        return
    if len(node.inputs) != len(p.src):
        return
    orders = [p.src, p.src[::-1]] if p.commute else [p.src]
    for src in orders:
        for done in _operands(src, node.inputs, 0, m, node, user is None or consumed):
            if p.where is None or p.where(done):
                yield done


def _operands(src: tuple[Pat, ...], inputs: tuple[str, ...], i: int, m: Match, node: Node,
              owned: bool) -> Iterator[Match]:
    if i == len(src):
        yield m
        return
    for m2 in _match(src[i], inputs[i], m, node, owned):
        yield from _operands(src, inputs, i + 1, m2, node, owned)
