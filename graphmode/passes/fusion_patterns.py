"""Building blocks of the `fuse` pass: op classes, a contracted view of the graph that
answers "would merging these nodes create a cycle?", and the attention rewrite.

Kept apart from fuse.py so the pattern matchers stay small and testable on their own.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

from graphmode.ir.graph import Graph, Node
from graphmode.ir.ops import OPS
from graphmode.ir.types import FLOAT_DTYPES, TensorType, dims_equal

GEMM_OPS = frozenset({"linear", "matmul", "conv2d"})
# Inference batch norm is a per-channel affine map of x: pointwise once its four parameter
# tensors are loaded, so a conv's epilogue kernel can apply it (constant_fold, when it
# runs first, folds it into the conv weights instead).
EPILOGUE_EXTRA_OPS = frozenset({"batch_norm"})
ROW_REDUCTIONS = frozenset({"softmax", "log_softmax", "layer_norm", "sum", "mean", "amax", "amin"})


# ------------------------------------------------------------------------------- predicates


def is_pointwise(n: Node) -> bool:
    spec = OPS.get(n.op)
    return spec is not None and spec.kind == "elementwise" and n.body is None and len(n.outputs) == 1


def is_epilogue_op(n: Node) -> bool:
    return is_pointwise(n) or (n.op in EPILOGUE_EXTRA_OPS and len(n.outputs) == 1)


def same_shape(a: TensorType, b: TensorType) -> bool:
    if a.rank != b.rank:
        return False
    for x, y in zip(a.shape, b.shape):
        if x == y:
            continue
        if isinstance(x, int) and isinstance(y, int):
            return False
        if not dims_equal(x, y):
            return False
    return True


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


def scalar_constant(g: Graph, name: str) -> float | None:
    """The value of a one-element floating/int constant, else None."""
    t = g.constants.get(name)
    if t is None or t.numel() != 1 or t.dtype == torch.bool:
        return None
    return float(t.reshape(()).item())


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


# -------------------------------------------------------------------------- attention


@dataclass
class AttentionMatch:
    q: str
    kt: str            # the transposed key the first matmul consumed
    v: str
    mask: str | None
    scale: float
    out: str           # the second matmul's output (kept as the sdpa output name)
    mm1: int           # the node index of matmul(q, k^T)
    removed: list[int]  # node indices the sdpa node replaces


def _single_use(dag: Dag, v: str, user: int) -> bool:
    return v not in dag.graph_outputs and dag.users_of(v) == [user]


def _scores(dag: Dag, v: str, consumer: int) -> tuple[int, float, list[int]] | None:
    """Walk up from the softmax input: [mul/div by a scalar constant] <- matmul(q, k^T)."""
    p = dag.producer(v)
    if p is None or not _single_use(dag, v, consumer):
        return None
    n = dag.nodes[p]
    if n.op == "matmul":
        return p, 1.0, [p]
    if n.op in ("mul", "div"):
        for data, const in ((0, 1), (1, 0)) if n.op == "mul" else ((0, 1),):
            c = scalar_constant(dag.g, n.inputs[const])
            if c is None or c == 0 or not same_shape(dag.type_of(n.inputs[data]), dag.type_of(v)):
                continue
            mp = dag.producer(n.inputs[data])
            if mp is not None and dag.nodes[mp].op == "matmul" and _single_use(dag, n.inputs[data], p):
                return mp, (c if n.op == "mul" else 1.0 / c), [mp, p]
    return None


def match_attention(dag: Dag, sm: int) -> AttentionMatch | None:
    """softmax(matmul(q, k^T) [* s | / s] [+ mask | where(mask, ., -inf)], -1) @ v."""
    g = dag.g
    n = dag.nodes[sm]
    if n.op != "softmax" or not is_row_reduction(n, g):
        return None
    probs = n.outputs[0]
    us = dag.users_of(probs)
    removed = [sm]
    if len(us) == 1 and dag.nodes[us[0]].op == "identity" and _single_use(dag, probs, us[0]):
        removed.append(us[0])
        probs = dag.nodes[us[0]].outputs[0]
        us = dag.users_of(probs)
    if len(us) != 1 or probs in dag.graph_outputs:
        return None
    mm2 = dag.nodes[us[0]]
    if mm2.op != "matmul" or mm2.inputs[0] != probs or mm2.inputs[1] == probs:
        return None
    removed.append(us[0])

    x = n.inputs[0]
    mask, found = None, None
    xp = dag.producer(x)
    xn = dag.nodes[xp] if xp is not None else None
    if xn is not None and _single_use(dag, x, sm):
        if xn.op == "add":
            for s_in, m_in in ((0, 1), (1, 0)):
                found = _scores(dag, xn.inputs[s_in], xp)
                if found is not None and dag.type_of(xn.inputs[m_in]).dtype == dag.type_of(x).dtype \
                        and same_shape(dag.type_of(xn.inputs[s_in]), dag.type_of(x)):
                    mask = xn.inputs[m_in]
                    removed.append(xp)
                    break
                found = None
        elif xn.op == "where":
            fill = scalar_constant(g, xn.inputs[2])
            if fill == -math.inf and dag.type_of(xn.inputs[0]).dtype == "bool" \
                    and same_shape(dag.type_of(xn.inputs[1]), dag.type_of(x)):
                found = _scores(dag, xn.inputs[1], xp)
                if found is not None:
                    mask = xn.inputs[0]
                    removed.append(xp)
    if found is None and mask is None:
        found = _scores(dag, x, sm)
    if found is None:
        return None
    mm1_idx, scale, chain = found
    removed += chain
    mm1 = dag.nodes[mm1_idx]
    q, kt = mm1.inputs
    v = mm2.inputs[1]
    if mask is not None and mask in (q, kt, v):
        return None
    tq, tkt, tv, tout = dag.type_of(q), dag.type_of(kt), dag.type_of(v), dag.type_of(mm2.outputs[0])
    if not (tq.rank == tkt.rank == tv.rank >= 2):
        return None
    if not (tq.dtype == tkt.dtype == tv.dtype == tout.dtype and tq.dtype in FLOAT_DTYPES):
        return None
    batch_ok = all(same_shape(TensorType(tq.dtype, tq.shape[:-2]), TensorType(t.dtype, t.shape[:-2]))
                   for t in (tkt, tv))
    if not batch_ok:
        return None
    k_type = tkt.with_shape(tkt.shape[:-2] + (tkt.shape[-1], tkt.shape[-2]))
    ins = [tq, k_type, tv] + ([dag.type_of(mask)] if mask is not None else [])
    try:
        inferred = OPS["sdpa"].infer(ins, {"scale": scale})[0]
    except Exception:  # noqa: BLE001 - any shape mismatch means "does not fit sdpa"
        return None
    if inferred.dtype != tout.dtype or not same_shape(inferred, tout):
        return None
    return AttentionMatch(q, kt, v, mask, scale, mm2.outputs[0], mm1_idx, sorted(removed))


def key_from_transposed(dag: Dag, kt: str, mm1: int) -> tuple[str | None, list[int], Node | None]:
    """How to get k ([.., Lk, D]) from k^T: reuse the tensor a transposing permute read
    (dropping that permute when the attention was its only user), or permute k^T back.

    Returns (k value or None if a new node makes it, removed node indices, new permute node
    without output name filled in: the caller names it)."""
    p = dag.producer(kt)
    rank = dag.type_of(kt).rank
    swap = list(range(rank - 2)) + [rank - 1, rank - 2]
    if p is not None and dag.nodes[p].op == "permute":
        perm = list(dag.nodes[p].attr("perm"))
        perm = [d + rank if d < 0 else d for d in perm]
        back = perm[:-2] + [perm[-1], perm[-2]]
        src = dag.nodes[p].inputs[0]
        removed = [p] if _single_use(dag, kt, mm1) else []
        if back == list(range(rank)):
            return src, removed, None
        return None, removed, Node("permute", (src,), (), {"perm": back})
    return None, [], Node("permute", (kt,), (), {"perm": swap})
