"""Buffers and their lifetimes over a schedule.

A *buffer* is one region of the arena; several values may live in it (`alias_of`): a view
(reshape) of a non-constant value re-reads its input's bytes, and an in-place capable node
may write its output over an input that dies at that node. Every decision here is made on
the symbolic types, never on one bucket's sizes, so the live sets are the same for every
bucket and the symbolic activation peak (memory.activation_peak_expr) equals each bucket's
lower bound exactly.

Steps are positions in the schedule (0..n-1), not node indices. A value lives from the step
that defines it (graph inputs: step 0) to the last step that reads it (graph outputs: the
last step); a buffer lives from its first member's definition to its members' last use.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

import sympy

from graphmode.errors import PlanError
from graphmode.ir.graph import Graph, Node
from graphmode.ir.ops import OPS
from graphmode.ir.types import Dim

INPLACE_FUSED_KINDS = frozenset({"elementwise", "gemm_epilogue"})


@dataclass
class Liveness:
    order: list[int]
    values: list[str]                      # arena values in definition order (graph inputs first)
    first: dict[str, int]                  # value -> step that defines it
    last: dict[str, int]                   # value -> last step that reads it (outputs: the last step)
    alias_of: dict[str, str]               # value -> the value whose buffer it uses (a direct input)
    alias_kind: dict[str, str]             # value -> "view" | "inplace"
    root: dict[str, str]                   # value -> the value that owns its buffer
    slots: list[list[str]] = field(default_factory=list)   # roots sharing one offset (alias_groups)
    honoured: list[list[str]] = field(default_factory=list)  # alias_groups placed at one offset
    notes: list[str] = field(default_factory=list)          # alias_groups that could not be honoured

    @property
    def n_steps(self) -> int:
        return len(self.order)

    def members(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for v in self.values:
            out.setdefault(self.root[v], []).append(v)
        return out

    def buffers(self) -> dict[str, tuple[int, int]]:
        """root -> (first step, last step) of the buffer (union over its members)."""
        out: dict[str, tuple[int, int]] = {}
        for v in self.values:
            r = self.root[v]
            s, e = out.get(r, (self.first[v], self.last[v]))
            out[r] = (min(s, self.first[v]), max(e, self.last[v]))
        return out

    def live_steps(self, size_of: Mapping[str, int]) -> list[int]:
        """Bytes of buffers live at each step (a buffer's size: the largest of its members)."""
        n = max(self.n_steps, 1)
        delta = [0] * (n + 1)
        size = self.buffer_sizes(size_of)
        for r, (s, e) in self.buffers().items():
            delta[s] += size[r]
            delta[e + 1] -= size[r]
        out, cur = [], 0
        for s in range(n):
            cur += delta[s]
            out.append(cur)
        return out

    def buffer_sizes(self, size_of: Mapping[str, int]) -> dict[str, int]:
        size: dict[str, int] = {}
        for v in self.values:
            r = self.root[v]
            size[r] = max(size.get(r, 0), size_of[v])
        return size


def validate_order(graph: Graph, order: Sequence[int]) -> None:
    """Every node exactly once, every non-constant input defined at an earlier step."""
    n = len(graph.nodes)
    if sorted(order) != list(range(n)):
        missing = sorted(set(range(n)) - set(order))
        dup = sorted({i for i in order if list(order).count(i) > 1}) if len(order) != len(set(order)) else []
        raise PlanError(f"schedule must list each of the {n} nodes once", where=f"graph @{graph.name}",
                        value={"missing": missing[:8], "duplicated": dup[:8], "out_of_range":
                               [i for i in order if not 0 <= i < n][:8]},
                        fix="use graphmode.plan.schedule(graph)")
    defined = set(graph.inputs) | set(graph.constants)
    for s, idx in enumerate(order):
        node = graph.nodes[idx]
        for i in node.inputs:
            if i not in defined:
                raise PlanError(f"%{i} is read at step {s} before any step defines it",
                                where=f"node #{idx} {node.op} -> %{node.outputs[0] if node.outputs else '?'}",
                                fix="the schedule must be topological (use graphmode.plan.schedule)")
        defined.update(node.outputs)


def same_size(a: Dim, b: Dim) -> bool:
    """Symbolic equality of two sizes (for all dims, not just one bucket)."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    d = sympy.expand(sympy.sympify(a) - sympy.sympify(b))
    if d == 0:
        return True
    if d.is_number or not d.has(sympy.floor, sympy.ceiling, sympy.Min, sympy.Max, sympy.Mod):
        return False
    return sympy.simplify(d) == 0


def _group_index(graph: Graph, alias_groups: Iterable[Sequence[str]],
                 notes: list[str]) -> tuple[dict[str, int], list[list[str]]]:
    """value -> group id (groups sharing a value are merged); unknown names are an error."""
    parent: dict[int, int] = {}

    def find(x: int) -> int:
        while parent.setdefault(x, x) != x:
            x = parent[x]
        return x

    groups = [list(g) for g in alias_groups]
    owner: dict[str, int] = {}
    for gi, g in enumerate(groups):
        find(gi)
        for v in g:
            if v not in graph.values:
                near = difflib.get_close_matches(v, list(graph.values), n=3)
                raise PlanError(f"alias group {g} names %{v}, which the graph does not have",
                                where=f"alias_groups[{gi}]", value=v,
                                fix=(f"did you mean {', '.join(near)}? " if near else "") +
                                    "name values of the optimised graph (see `graphmode compile --dump-after`)")
            if v in graph.constants:
                notes.append(f"alias group {g}: %{v} is a constant; constants are not in the arena, "
                             f"so it is left out of the group")
                continue
            if v in owner:
                parent[find(gi)] = find(owner[v])
            owner[v] = gi
    return {v: find(gi) for v, gi in owner.items()}, groups


def _position_wise(body: Graph, v: str, seen: set[str] | None = None) -> bool:
    """Every read of `v` in the fused body is elementwise (through reshapes), so element i of
    the output depends only on element i of `v`: writing the output over `v` is safe."""
    seen = seen if seen is not None else set()
    if v in seen:
        return True
    seen.add(v)
    for m in body.nodes:
        if v not in m.inputs:
            continue
        spec = OPS.get(m.op)
        if spec is None:
            return False
        if spec.view:
            if not _position_wise(body, m.outputs[0], seen):
                return False
        elif spec.kind != "elementwise":
            return False
    return True


def _made_elementwise(body: Graph, o: str) -> bool:
    prod = {x: m for m in body.nodes for x in m.outputs}
    m = prod.get(o)
    while m is not None and OPS.get(m.op) is not None and OPS[m.op].view:
        m = prod.get(m.inputs[0])
    return m is not None and OPS.get(m.op) is not None and OPS[m.op].kind == "elementwise"


def inplace_candidates(graph: Graph, node: Node, out: str, root: Mapping[str, str]) -> list[str]:
    """Inputs of `node` whose buffer `out` could be written over (dtype and byte size equal,
    every read of that buffer by this node position-wise), in input order."""
    spec = OPS.get(node.op)
    if spec is None:
        return []
    fused = node.op == "fused"
    if fused:
        if node.attr("kind") not in INPLACE_FUSED_KINDS or node.body is None:
            return []
        if not _made_elementwise(node.body, out):
            return []
    elif not spec.inplace:
        return []
    ot = graph.values[out].type
    out_bytes = ot.nbytes()
    cands: list[str] = []
    for i in dict.fromkeys(node.inputs):
        if i in graph.constants or i not in root:
            continue
        it = graph.values[i].type
        if it.dtype != ot.dtype or not same_size(it.nbytes(), out_bytes):
            continue
        if fused:
            same_buf = [j for j in dict.fromkeys(node.inputs) if root.get(j) == root[i]]
            if not all(_position_wise(node.body, j) for j in same_buf):
                continue
        cands.append(i)
    return cands


def analyze_liveness(graph: Graph, order: Sequence[int], *, reuse: bool = True,
                     alias_groups: Iterable[Sequence[str]] = ()) -> Liveness:
    """Resolve aliases (views, in-place writes, alias_groups) and lifetimes over `order`."""
    order = list(order)
    validate_order(graph, order)
    n = len(order)
    end = max(n - 1, 0)
    consts = graph.constants
    values: list[str] = []
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    for v in dict.fromkeys(graph.inputs):
        if v not in consts:
            values.append(v)
            first[v] = last[v] = 0
    for s, idx in enumerate(order):
        node = graph.nodes[idx]
        for i in node.inputs:
            if i not in consts:
                last[i] = s
        for o in node.outputs:
            values.append(o)
            first[o] = last[o] = s
    outputs = {o for o in graph.outputs if o not in consts}
    for o in outputs:
        last[o] = end
    inputs = set(graph.inputs)

    notes: list[str] = []
    group_of, groups = _group_index(graph, alias_groups, notes)

    root = {v: v for v in values}
    alias_of: dict[str, str] = {}
    kind: dict[str, str] = {}
    cls_last = {v: last[v] for v in values}
    cls_pinned = {v: v in outputs for v in values}

    def join(o: str, i: str, k: str) -> None:
        r = root[i]
        alias_of[o], kind[o], root[o] = i, k, r
        cls_last[r] = max(cls_last[r], last[o])
        cls_pinned[r] = cls_pinned[r] or cls_pinned[o]

    for s, idx in enumerate(order):
        node = graph.nodes[idx]
        spec = OPS.get(node.op)
        if spec is not None and spec.view and node.inputs and len(node.outputs) == 1 \
                and node.inputs[0] not in consts:
            join(node.outputs[0], node.inputs[0], "view")
            continue
        taken: set[str] = set()
        for o in node.outputs:
            for i in inplace_candidates(graph, node, o, root):
                r = root[i]
                requested = i in group_of and group_of.get(o) == group_of[i]
                if r in taken or not (reuse or requested):
                    continue
                if r in inputs and not requested:
                    continue          # the request's bytes are never overwritten unless a group asks
                if cls_pinned[r] or cls_last[r] > s:
                    continue          # another alias of that buffer is read later
                join(o, i, "inplace")
                taken.add(r)
                break

    liv = Liveness(order, values, first, last, alias_of, kind, root, notes=notes)
    _share_slots(liv, group_of, groups)
    return liv


def _share_slots(liv: Liveness, group_of: Mapping[str, int], groups: list[list[str]]) -> None:
    """Put each alias group's buffers at one offset when their lifetimes do not overlap."""
    if not group_of:
        return
    bufs = liv.buffers()
    slot_of: dict[str, int] = {}
    slots: list[list[str]] = []
    by_group: dict[int, list[str]] = {}
    for v, gid in group_of.items():
        by_group.setdefault(gid, []).append(v)
    for gid in sorted(by_group):
        members = [v for v in by_group[gid] if v in liv.root]
        req = [v for g in groups if any(group_of.get(x) == gid for x in g) for v in g]
        roots = list(dict.fromkeys(liv.root[v] for v in members))
        if len(roots) <= 1:
            liv.honoured.append(list(dict.fromkeys(req)))
            continue
        cand: list[str] = []
        for r in roots:
            cand.extend(slots[slot_of[r]] if r in slot_of else [r])
        cand = list(dict.fromkeys(cand))
        clash = None
        for a_i, a in enumerate(cand):
            for b in cand[a_i + 1:]:
                (s1, e1), (s2, e2) = bufs[a], bufs[b]
                if s1 <= e2 and s2 <= e1:
                    clash = (a, b)
                    break
            if clash:
                break
        if clash:
            a, b = clash
            who = {r: [v for v in members if liv.root[v] == r] for r in clash}
            liv.notes.append(
                f"alias group {list(dict.fromkeys(req))} not honoured: the buffer of {_names(who.get(a, [a]))} "
                f"lives over steps {bufs[a][0]}..{bufs[a][1]} and the buffer of {_names(who.get(b, [b]))} over "
                f"steps {bufs[b][0]}..{bufs[b][1]}; they overlap, so they cannot share one offset "
                f"(an output can take an input's buffer only if the input's last read is the node that "
                f"writes the output and that node works element by element)")
            continue
        new = len(slots)
        slots.append(cand)
        for r in cand:
            slot_of[r] = new
        liv.honoured.append(list(dict.fromkeys(req)))
    liv.slots = [slots[i] for i in sorted(set(slot_of.values()))]


def _names(vs: list[str]) -> str:
    return ", ".join(f"%{v}" for v in vs)
