"""The data-dependent tail: what a model computes after a size only its data decides.

`x[mask]`, `nonzero`, `unique` and `masked_select` make tensors whose length is known only once
the op has run (torch.export calls it an unbacked symbol, u0). graphmode plans every buffer from
the recipe's dims, so such an op, and every op after it that reads what it made, cannot be in a
plan. In `exe_mode: hybrid` they become the tail: an IR graph of eager ATen calls (`fallback`
nodes; an ONNX tail, `split_tail`, also core ops, run by their reference) that runs after the
plan, on the plan's unpadded outputs and the request's own inputs (graphmode/runtime/tail.py). Its types name each data-dependent length `data_u0`, `data_u1`, ...;
the run binds each from the first tensor that has it as an axis. Everything before the first
such op (the model's heavy part, as a rule) stays in the plan; graph mode refuses a tail.

The tail reads plan outputs only after they are sliced back to the request's real sizes, so
padding reaches it exactly as it reaches the model's outputs: the padding analysis checks the
values the tail reads like any output.
"""
from __future__ import annotations

import operator
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import sympy
import torch
import torch.utils._pytree as pytree

from graphmode.errors import CaptureError
from graphmode.ir.graph import Graph

if TYPE_CHECKING:
    from graphmode.capture.torch_import import _Importer

PREFIX = "data_"      # data_u0: torch's unbacked u0 as a tail dim (apart from any recipe dim)
_UNBACKED = re.compile(r"u\d+")
_DATA_DIM = re.compile(PREFIX + r"u\d+")


def is_data_dim(name: str) -> bool:
    """A tail's data-dependent length (data_u0, ...), told apart from a recipe dim named data_*."""
    return bool(_DATA_DIM.fullmatch(name))


def unbacked(expr: Any) -> list[sympy.Symbol]:
    """torch's data-dependent symbols (u0, u1, ...) in a size expression."""
    return [s for s in getattr(expr, "free_symbols", ()) if _UNBACKED.fullmatch(s.name)]


def as_tail_dim(expr: sympy.Expr) -> sympy.Expr:
    return expr.xreplace({s: sympy.Symbol(PREFIX + s.name, integer=True, positive=True) for s in unbacked(expr)})


def makes_data_sizes(node: torch.fx.Node) -> bool:
    """The node makes a tensor with an extent that is one of torch's unbacked symbols. (A number
    read out of the data, `t.max().item()`, only checked by an assert, stays in the plan.)"""
    return any(isinstance(v, torch.Tensor) and any(isinstance(s, torch.SymInt) and unbacked(s.node.expr)
                                                   for s in v.shape)
               for v in pytree.tree_leaves(node.meta.get("val")))


@dataclass(frozen=True)
class DataNumber:
    """A number read out of tensor data (`t.max().item()`): an assert may check it (torch.export
    keeps the check, graphmode drops it), but no size or argument may be computed from it."""

    op: str
    loc: str

    def refusal(self) -> CaptureError:
        return CaptureError(f"op {self.op} at {self.loc} turns tensor data into a Python number: graphmode "
                            "computes every size and argument from the recipe's dims and the tensors, not from a "
                            "number read out of the data", where="model",
                            fix="keep the value a tensor (x * t.sum() instead of x * t.sum().item()), or run the "
                                "model with exe_mode: eager")


class TailGraph:
    """The tail's IR graph, built beside the head it reads from."""

    def __init__(self, head: Graph):
        self.graph = Graph(head.name + "_tail")
        self.graph.dims = dict(head.dims)
        self.reads: list[str] = []       # head values the tail reads: the plan's outputs, in this order
        self.inputs: list[str] = []      # model inputs the tail reads (the request's own tensors)

    def _from_head(self, name: str, head: Graph) -> None:
        """A value the tail reads that the head makes: a constant copied, else a tail input (a
        plan output, or a model input the request carries)."""
        if name in self.graph.values:
            return
        v = head.values[name]
        if name in head.constants:
            self.graph.add_constant(name, head.constants[name], role=v.role)
        else:
            self.graph.add_input(name, v.type)
            (self.inputs if name in head.inputs else self.reads).append(name)

    def finish(self, user: list[str], head: Graph) -> list[str]:
        """The tail's outputs are the model's; returns what the plan must output for it."""
        for name in user:
            self._from_head(name, head)
        self.graph.inputs = self.reads + self.inputs
        self.graph.outputs = list(user)
        self._check_bound()
        self.graph.prune_values()
        return list(self.reads)

    def _check_bound(self) -> None:
        """Every data-dependent length a call or a size uses is an axis of a tensor made before it."""
        bound: set[str] = set()
        for node in self.graph.nodes:
            used = {s for s in _dim_names(node.attrs) if _DATA_DIM.fullmatch(s)}
            if used - bound:
                what = f"{node.attrs.get('target')} at {node.attrs.get('loc')}" if node.op == "fallback" else node.op
                raise CaptureError(f"{what} uses the data-dependent size {sorted(used - bound)[0]}, which no tensor "
                                   "made before it has as an axis", where="model",
                                   fix="compute it from a tensor's shape after x[mask], nonzero or unique, or run "
                                       "the model with exe_mode: eager")
            for o in node.outputs:
                bound |= {d.name for d in self.graph.values[o].type.shape
                          if isinstance(d, sympy.Symbol) and is_data_dim(d.name)}


def data_symbols(n: Any, g: Graph) -> set[str]:
    """The data-dependent lengths node `n` uses: in its attributes (a size as a value, an arange's
    end) or its outputs' types."""
    used = {s for s in _dim_names(n.attrs) if _DATA_DIM.fullmatch(s)}
    for o in n.outputs:
        used |= {x.name for d in g.values[o].type.shape if not isinstance(d, int) for x in d.free_symbols
                 if _DATA_DIM.fullmatch(x.name)}
    return used


def binds(n: Any, g: Graph) -> set[str]:
    """The data-dependent lengths node `n` makes: its outputs' axes that are one alone."""
    return {d.name for o in n.outputs for d in g.values[o].type.shape
            if isinstance(d, sympy.Symbol) and _DATA_DIM.fullmatch(d.name)}


def split_tail(g: Graph) -> Graph | None:
    """Move every node of `g` that makes a data-dependent extent, or reads what such a node made,
    into a tail graph (None when there is none); `g` keeps the rest and outputs what the tail
    reads. For an importer that types data-dependent extents as it goes (ONNX's NonZero)."""
    moved: set[str] = set()
    nodes = []
    for n in g.nodes:
        if any(i in moved for i in n.inputs) or data_symbols(n, g):
            nodes.append(n)
            moved.update(n.outputs)
    if not nodes:
        return None
    tail = TailGraph(g)
    producer = {o: n for n in g.nodes for o in n.outputs}
    free = set(g.constants)     # values computed from the weights and the dims alone (a size as a value)
    for n in g.nodes:
        if all(i in free for i in n.inputs):
            free.update(n.outputs)

    def add(n: Any) -> None:
        for i in n.inputs:
            if i in free and i not in g.constants and i not in moved:
                moved.add(i)        # computed again in the tail at the request's own dims, not read padded
                add(producer[i])
            elif i not in moved:
                tail._from_head(i, g)
        tail.graph.nodes.append(n)
        for o in n.outputs:
            tail.graph.values[o] = g.values[o].__class__(o, g.values[o].type, "intermediate")
    for n in nodes:
        add(n)
    moved = {o for n in nodes for o in n.outputs}
    keep = [n for n in g.nodes if not any(o in moved for o in n.outputs)]
    user = list(g.outputs)
    g.outputs = tail.finish(user, g)
    g.nodes[:] = keep
    g.prune_values()
    return tail.graph


class Tail(TailGraph):
    """The FX nodes that go to the tail, in order, and the IR graph built from them."""

    def __init__(self, imp: "_Importer"):
        super().__init__(imp.g)
        self.imp = imp
        self.nodes: list[torch.fx.Node] = []
        self.members: set[torch.fx.Node] = set()

    def takes(self, node: torch.fx.Node) -> bool:
        """Put `node` in the tail when it reads a tail value or makes a data-dependent size."""
        if any(a in self.members for a in node.all_input_nodes) or makes_data_sizes(node):
            self.nodes.append(node)
            self.members.add(node)
            return True
        return False

    def __bool__(self) -> bool:
        return bool(self.nodes)

    def translate(self) -> None:
        """Each tail node as an eager ATen call (sizes symbolically, as in the head)."""
        from graphmode.capture.torch_import import _SKIP, _control_flow, _source_loc
        imp = self.imp
        head, imp.g = imp.g, self.graph
        islands = dict(imp.fallbacks)      # the tail is not eager islands of the plan: reported on its own
        imp.unbacked_ok = True
        try:
            for n in self.nodes:
                imp._node = n
                target, tname = n.target, str(n.target)
                if tname in _SKIP:
                    continue
                if target is operator.getitem:
                    src, idx = n.args
                    imp.env[n] = imp.env[src][idx]
                elif isinstance(target, torch._ops.HigherOrderOperator):
                    raise _control_flow(n, tname)
                elif not isinstance(target, torch._ops.OpOverload):
                    imp._sym_op(n)
                elif not any(isinstance(v, torch.Tensor) for v in pytree.tree_leaves(n.meta.get("val"))):
                    self._size(n, tname, _source_loc(n))
                else:
                    self._call(n, head)
        finally:
            imp.g, imp.unbacked_ok, imp.fallbacks = head, False, islands

    def _size(self, n: torch.fx.Node, tname: str, loc: str) -> None:
        val = n.meta.get("val")
        if isinstance(val, torch.SymInt) and tname.startswith("aten.sym_"):
            self.imp.env[n] = self.imp.dim(val)       # the size of a tail tensor: bound when it is made
        else:
            self.imp.env[n] = DataNumber(tname, loc)

    def _call(self, n: torch.fx.Node, head: Graph) -> None:
        ins, _, _ = self.imp.encode_call(n)
        for name in ins:
            self._from_head(name, head)
        self.imp._fallback(n, "its output size depends on the data: it runs after the plan (exe_mode hybrid)")


def _dim_names(args: Any) -> set[str]:
    """The names in a node's attributes' size expressions (a fallback's {"$dim": ...}, a core op's
    dim strings)."""
    if isinstance(args, str):
        return set(re.findall(r"[A-Za-z_][A-Za-z_0-9]*", args))
    if isinstance(args, dict):        # a fallback's target and source line name no size
        return set().union(set(), *(_dim_names(v) for k, v in args.items() if k not in ("target", "loc")))
    if isinstance(args, (list, tuple)):
        return set().union(set(), *map(_dim_names, args))
    return set()
