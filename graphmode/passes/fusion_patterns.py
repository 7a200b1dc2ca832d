"""Building blocks of the `fuse` pass's grouping: op classes and a contracted view of the
graph that answers "would merging these nodes create a cycle?". (Attention is a rewrite,
not a grouping: attention.py.)
"""
from __future__ import annotations

import heapq
from typing import Iterable, Sequence

from graphmode.ir.graph import Graph, Node
from graphmode.ir.ops import OPS, ops_with
from graphmode.ir.types import TensorType

GEMM_OPS = ops_with("gemm")
# Inference batch norm is a per-channel affine map of x: pointwise once its four parameter
# tensors are loaded, so a conv's epilogue kernel can apply it (constant_fold, when it
# runs first, folds it into the conv weights instead).
EPILOGUE_EXTRA_OPS = frozenset({"batch_norm"})
ROW_REDUCTIONS = ops_with("row_reduction")


# ------------------------------------------------------------------------------- predicates


def is_pointwise(n: Node) -> bool:
    spec = OPS.get(n.op)
    return spec is not None and spec.kind == "elementwise" and n.body is None and len(n.outputs) == 1


def is_epilogue_op(n: Node) -> bool:
    return is_pointwise(n) or (n.op in EPILOGUE_EXTRA_OPS and len(n.outputs) == 1)


def is_row_reduction(n: Node, g: Graph) -> bool:
    """A reduction whose kernel handles one row (the last dim(s)) at a time, so pointwise
    work before and after it can run inside the same row loop."""
    if n.op not in ROW_REDUCTIONS or n.body is not None or len(n.outputs) != 1:
        return False
    rank = g.type_of(n.inputs[0]).rank
    if n.op == "layer_norm":
        return True
    if rank == 0:
        return False
    if n.op in ("softmax", "log_softmax"):
        return n.attr("dim") in (-1, rank - 1)
    dims = n.attr("dims")
    if dims is None:
        return rank == 1
    dims = list(dims)
    return len(dims) == 1 and dims[0] in (-1, rank - 1)


# ------------------------------------------------------------------- contracted graph


class Dag:
    """The node list seen as a DAG of super nodes (a fused group counts as one node).

    `convex(nodes)` tells whether a candidate group can become one node without a cycle:
    no path may leave the group and come back, through single nodes or earlier groups.
    Ranks are a topological order of the super nodes, so a search only walks the ranks
    between the group's lowest and highest member.
    """

    def __init__(self, g: Graph, nodes: Sequence[Node]):
        self.g = g
        self.nodes = list(nodes)
        self.prod: dict[str, int] = {}
        self.users: dict[str, list[int]] = {}
        for i, n in enumerate(self.nodes):
            for o in n.outputs:
                self.prod[o] = i
            for v in dict.fromkeys(n.inputs):
                self.users.setdefault(v, []).append(i)
        self.graph_outputs = set(g.outputs)
        self.gid = list(range(len(self.nodes)))
        self.members: dict[int, list[int]] = {i: [i] for i in range(len(self.nodes))}
        self.succ: dict[int, set[int]] = {i: set() for i in range(len(self.nodes))}
        self.pred: dict[int, set[int]] = {i: set() for i in range(len(self.nodes))}
        for i, n in enumerate(self.nodes):
            for v in n.inputs:
                p = self.prod.get(v)
                if p is not None and p != i:
                    self.succ[p].add(i)
                    self.pred[i].add(p)
        self.rank: dict[int, int] = {i: i for i in range(len(self.nodes))}
        self.grouped: set[int] = set()

    # ---- queries ----------------------------------------------------------------------
    def type_of(self, v: str) -> TensorType:
        return self.g.type_of(v)

    def out_type(self, i: int) -> TensorType:
        return self.g.type_of(self.nodes[i].outputs[0])

    def producer(self, v: str) -> int | None:
        return self.prod.get(v)

    def users_of(self, v: str) -> list[int]:
        return self.users.get(v, [])

    def free(self, i: int) -> bool:
        return i not in self.grouped

    def external_outputs(self, group: Iterable[int]) -> list[str]:
        """Values the group must still produce: used outside it, graph outputs, or unused
        (dead values are kept so fusion never hides work from dce)."""
        members = set(group)
        outs = []
        for i in sorted(members):
            for o in self.nodes[i].outputs:
                us = self.users_of(o)
                if o in self.graph_outputs or not us or any(u not in members for u in us):
                    outs.append(o)
        return outs

    def convex(self, group: Iterable[int]) -> bool:
        gids = {self.gid[i] for i in group}
        top = max(self.rank[x] for x in gids)
        stack = [s for x in gids for s in self.succ[x] if s not in gids]
        seen = set(stack)
        while stack:
            w = stack.pop()
            if self.rank[w] >= top:
                continue  # ranks only grow along edges: w cannot reach back into the group
            for s in self.succ[w]:
                if s in gids:
                    return False
                if s not in seen:
                    seen.add(s)
                    stack.append(s)
        return True

    # ---- updates -----------------------------------------------------------------------
    def merge(self, group: Iterable[int]) -> None:
        idx = sorted(set(group))
        gids = {self.gid[i] for i in idx}
        new = min(gids)
        members = sorted(m for x in gids for m in self.members[x])
        succ = set().union(*(self.succ[x] for x in gids)) - gids
        pred = set().union(*(self.pred[x] for x in gids)) - gids
        for x in gids:
            del self.members[x], self.succ[x], self.pred[x], self.rank[x]
        for p in pred:
            self.succ[p] = (self.succ[p] - gids) | {new}
        for s in succ:
            self.pred[s] = (self.pred[s] - gids) | {new}
        self.members[new] = members
        self.succ[new] = succ
        self.pred[new] = pred
        for m in members:
            self.gid[m] = new
        self.grouped.update(members)
        self._rerank()

    def _rerank(self) -> None:
        indeg = {x: len(self.pred[x]) for x in self.members}
        heap = [(self.members[x][0], x) for x, d in indeg.items() if d == 0]
        heapq.heapify(heap)
        r = 0
        while heap:
            _, x = heapq.heappop(heap)
            self.rank[x] = r
            r += 1
            for s in self.succ[x]:
                indeg[s] -= 1
                if indeg[s] == 0:
                    heapq.heappush(heap, (self.members[s][0], s))
        if r != len(self.members):  # pragma: no cover - convex() guards every merge
            raise AssertionError("fusion created a cycle")
