"""shard: rewrite a graph into what one rank of a tensor-parallel group computes.

Every value gets a placement on the rank: whole (`R`, every rank holds all of it) or split
(`S(axis, blocks)`: the rank holds 1/world of `axis`; with blocks the axis is made of blocks of
those widths, each split, as a fused QKV projection's output is: q | k | v, the key and value
blocks narrower than the query's under grouped KV heads). Walking the graph in order:

- `linear` with a whole input and a constant weight is column-parallel (Megatron): the rank
  keeps its rows of the weight (per block), so its output is split on the last axis.
- `linear` with an input split on the last axis is row-parallel: the rank keeps its columns of
  the weight, computes a partial sum, and an `all_reduce` makes it whole; the bias is added after.
- the heads follow: reshapes, permutes, slices, expands and elementwise ops carry a split axis
  through (a reshape [b,s,H] -> [b,s,heads,d] splits the heads), `sdpa` runs on the rank's heads,
  and a decoder's `paged_attention` too, over K/V pools that keep the rank's KV heads only.
- the embedding with the largest table is vocab-parallel (each rank looks up its rows, zero
  elsewhere, then `all_reduce`); the LM head (a linear onto the vocabulary) is column-parallel
  and its logits are gathered. A vocabulary V that does not divide by the ranks is padded: each
  rank holds ceil(V/world) rows, the last rank's shard ends in zero rows, and the gathered
  logits are sliced back to exactly V (a padding column never reaches an output or an argmax).
- `batch` (CNNs): every input is cut to the rank's share of the batch; every op keeps it; the
  outputs are gathered.
- anything else that cannot take a split value gets it whole first (`all_gather`): correct
  always, and counted in the stats, so a missing rule shows up as communication, not as a bug.

Which layer classes split follows the recipe's strategy (attention, mlp, embedding: head or
replicate; batch). Graph outputs are whole on every rank. Collectives are ops like any other
(`ir/ops/collective.py`): typed, costed, interpreted.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import sympy
import torch

from graphmode.errors import PassError
from graphmode.ir.graph import Graph, Node
from graphmode.ir.ops import get_op, norm_axis
from graphmode.ir.types import Dim, TensorType, dim_str, dims_equal, normalize_dim
from graphmode.passes.base import PassContext, PassResult, register_pass

# ops that move or combine values without mixing positions along an axis they do not name
_ATTENTION_OPS = frozenset({"sdpa", "softmax", "paged_attention"})
_WALK_OPS = frozenset({"reshape", "permute", "slice", "expand", "identity", "cast", "concat"})
_BATCH_WISE = frozenset({"conv2d", "max_pool2d", "avg_pool2d", "adaptive_avg_pool2d", "batch_norm", "embedding"})
_LOOKAHEAD = 8


@dataclass(frozen=True)
class Split:
    axis: int
    blocks: tuple[int, ...] = ()     # the widths of the blocks `axis` is made of; () = one block
    cls: str = ""
    pad: int = 0          # padding entries at the end of the gathered axis (a padded vocabulary)


class _ShardWalk:
    """The walk over the graph and the placements: what every rule builds on (the rules are the
    mixins below, by concern; `_Sharder` joins them)."""

    def __init__(self, g: Graph, rank: int, world: int, strategy: dict[str, str], comm_dtype: str, batch_dim: str):
        self.g, self.rank, self.n, self.comm_dtype = g, rank, world, comm_dtype
        self.strategy = {c: strategy.get(c, "head") for c in ("attention", "mlp", "embedding", "conv")}
        self.batch = "batch" in self.strategy.values()
        self.batch_dim = batch_dim
        self.out = Graph(g.name, {}, [], [], [], {}, dict(g.dims))
        self.place: dict[str, Split | None] = {}       # original value -> placement (None = whole)
        self.local: dict[str, str] = {}                 # original value -> its name in self.out
        self.whole: dict[str, str] = {}                 # original value -> a gathered whole copy
        self.sliced: dict[tuple, str] = {}              # (constant, how) -> sliced constant
        self.users = g.users()
        self.producers = g.producers()
        self.vocab_table = self._vocab_table()
        self.stats: dict[str, Any] = {"column_parallel": 0, "row_parallel": 0, "vocab_parallel": 0,
                                      "batch_inputs": 0, "gathered_for": {}, "collectives": {}}

    # ------------------------------------------------------------------ emitting
    def type_of(self, local: str) -> TensorType:
        return self.out.type_of(local)

    def emit(self, op: str, inputs: list[str], attrs: dict, hint: str) -> str:
        types = get_op(op).infer([self.type_of(i) for i in inputs], attrs)
        (name,) = self.out.add_node(op, inputs, types, attrs, names=[self.out.fresh_name(hint)])
        if get_op(op).has("collective"):
            self.stats["collectives"][op] = self.stats["collectives"].get(op, 0) + 1
        return name

    def const(self, hint: str, t: torch.Tensor) -> str:
        return self.out.add_constant(self.out.fresh_name(hint), t, "const" if t.dim() == 0 else "param")

    def collective(self, op: str, x: str, hint: str, **attrs) -> str:
        comm = self.comm_dtype if self.type_of(x).dtype.startswith("f") else "f32"
        return self.emit(op, [x], {**attrs, "world": self.n, "comm_dtype": comm}, hint)

    def constant_of(self, name: str) -> str:
        """The whole constant in the output graph (copied over once)."""
        if name not in self.local:
            v = self.g.values[name]
            self.out.add_value(name, v.type, v.role)
            self.out.constants[name] = self.g.constants[name]
            self.local[name] = name
            self.place[name] = None
        return self.local[name]

    def slice_constant(self, name: str, axis: int, blocks: tuple[int, ...] = ()) -> str:
        """The rank's part of a constant split along `axis` (each of the blocks split). One
        block that does not divide is padded: ceil(extent / world) entries a rank, the last
        rank's part ending in zeros (a padded vocabulary)."""
        key = (name, axis, blocks)
        if key not in self.sliced:
            t = self.g.constants[name]
            if blocks:
                parts = [b.chunk(self.n, axis)[self.rank] for b in t.split(list(blocks), axis)]
                local = torch.cat(parts, axis).contiguous()
            else:
                local = _padded_part(t, axis, self.rank, self.n)
            self.sliced[key] = self.out.add_constant(self.out.fresh_name(f"{name}.rank{self.rank}"), local,
                                                     self.g.values[name].role)
        return self.sliced[key]

    # ------------------------------------------------------------------ placements
    def split_extent(self, full: Dim, blocks: tuple[int, ...] = ()) -> bool:
        """Whether `full` splits evenly (each of its blocks): ints by arithmetic; a symbolic extent
        only under the batch strategy (the recipe proves every batch bucket a multiple of the
        group size)."""
        if blocks:
            return isinstance(full, int) and sum(blocks) == full and all(w % self.n == 0 for w in blocks)
        if isinstance(full, int):
            return full % self.n == 0
        return self.batch

    def get_whole(self, name: str, why: str) -> str:
        """`name` whole on this rank: a split value is gathered (once)."""
        if name in self.g.constants:
            return self.constant_of(name)
        p = self.place[name]
        if p is None:
            return self.local[name]
        if name not in self.whole:
            self.stats["gathered_for"][why] = self.stats["gathered_for"].get(why, 0) + 1
            x = self.collective("all_gather", self.local[name], f"{name}.padded" if p.pad else f"{name}.whole",
                                axis=p.axis)
            if p.pad:                                # a padded vocabulary: the padding columns cut off
                full = self.type_of(x).shape[p.axis]
                x = self.emit("slice", [x], {"dim": p.axis, "start": 0, "end": full - p.pad, "step": 1},
                              f"{name}.whole")
            if p.blocks:
                x = self.blocks_in_order(x, p, name)
            self.whole[name] = x
        return self.whole[name]

    def blocks_in_order(self, x: str, p: Split, name: str) -> str:
        """A gathered value of blocks, [rank][block][part], put back in [block][rank][part] order:
        seen as [ranks, local extent], each block's columns of every rank are one slice, which
        reshapes to the whole block; the blocks then concatenate."""
        t = self.type_of(x)
        pre, post = list(t.shape[:p.axis]), list(t.shape[p.axis + 1:])
        local = sum(p.blocks) // self.n
        x = self.emit("reshape", [x], {"shape": _attr_shape(pre + [self.n, local] + post)}, f"{name}.ranks")
        parts, at = [], 0
        for j, w in enumerate(p.blocks):
            cols = self.emit("slice", [x], {"dim": p.axis + 1, "start": at, "end": at + w // self.n, "step": 1},
                             f"{name}.block{j}")
            parts.append(self.emit("reshape", [cols], {"shape": _attr_shape(pre + [w] + post)}, f"{name}.whole{j}"))
            at += w // self.n
        return self.emit("concat", parts, {"dim": p.axis}, f"{name}.whole")

    def local_split(self, name: str, axis: int, blocks: tuple[int, ...] = ()) -> str | None:
        """A whole value cut to this rank's part of `axis`: constants by slicing their data, other
        values by a slice node; None when that is not possible (the caller gathers instead)."""
        if name in self.g.constants:
            if not self.split_extent(self.g.values[name].type.shape[axis], blocks):
                return None
            return self.slice_constant(name, axis, blocks)
        if blocks:
            return None
        t = self.type_of(self.local[name])
        full = t.shape[axis]
        if not self.split_extent(full):
            return None
        return self.cut(self.local[name], axis, f"{name}.part")

    def cut(self, local: str, axis: int, hint: str) -> str:
        """This rank's part of `axis` of a whole value: a slice, or for a symbolic extent a reshape
        to [..., world, extent / world, ...], a slice of one entry and a reshape back."""
        t = self.type_of(local)
        full = t.shape[axis]
        if isinstance(full, int):
            part = full // self.n
            return self.emit("slice", [local], {"dim": axis, "start": self.rank * part,
                                                "end": (self.rank + 1) * part, "step": 1}, hint)
        part = _part(full, self.n)
        pre, post = list(t.shape[:axis]), list(t.shape[axis + 1:])
        x = self.emit("reshape", [local], {"shape": _attr_shape(pre + [self.n, part] + post)}, f"{hint}.ranks")
        x = self.emit("slice", [x], {"dim": axis, "start": self.rank, "end": self.rank + 1, "step": 1},
                      f"{hint}.mine")
        return self.emit("reshape", [x], {"shape": _attr_shape(pre + [part] + post)}, hint)

    def placement(self, name: str) -> Split | None:
        return None if name in self.g.constants else self.place[name]

    def operand(self, name: str) -> str:
        return self.constant_of(name) if name in self.g.constants else self.local[name]

    def bind(self, n: Node, local: str, p: Split | None) -> None:
        self.local[n.outputs[0]], self.place[n.outputs[0]] = local, p

    # ------------------------------------------------------------------ the walk
    def run(self) -> Graph:
        g = self.g
        for name in g.inputs:
            self.out.add_input(name, g.values[name].type)
            self.local[name], self.place[name] = name, None
            if self.batch:
                self.batch_input(name)
        for n in g.nodes:
            handler = getattr(self, f"on_{n.op}", None)
            if handler is None:
                spec = get_op(n.op)
                handler = self.on_elementwise if spec.kind == "elementwise" else (
                    self.on_reduction if spec.kind in ("reduction", "norm") else None)
            if handler is None or not handler(n):
                self.replicate(n)
        outs = []
        for o in g.outputs:
            outs.append(self.get_whole(o, "graph output") if o not in g.constants else self.constant_of(o))
        self.out.outputs = outs
        return _rename_outputs(self.out, g.outputs)

    def replicate(self, n: Node) -> None:
        """Run the node whole: every input gathered first where split."""
        ins = [self.get_whole(i, n.op) for i in n.inputs]
        types = [self.g.values[o].type for o in n.outputs]
        outs = self.out.add_node(n.op, ins, types, dict(n.attrs), names=[self.out.fresh_name(o) for o in n.outputs],
                                 body=n.body)
        for o, lo in zip(n.outputs, outs):
            self.local[o], self.place[o] = lo, None

    def same(self, n: Node, inputs: list[str], attrs: dict, p: Split | None) -> bool:
        self.bind(n, self.emit(n.op, inputs, attrs, n.outputs[0]), p)
        return True

    # ---- batch strategy
    def batch_input(self, name: str) -> None:
        t = self.g.values[name].type
        if not t.rank or isinstance(t.shape[0], int) or str(t.shape[0]) != self.batch_dim:
            return
        x = self.cut(name, 0, f"{name}.rank{self.rank}")
        self.local[name], self.place[name] = x, Split(0, (), "batch")
        self.stats["batch_inputs"] += 1


class _LayerRules(_ShardWalk):
    """Rules of the layers that split: column- and row-parallel linears and matmuls, the
    vocab-parallel embedding, attention on the rank's heads."""

    # ---- linears
    def on_linear(self, n: Node) -> bool:
        x, w = n.inputs[0], n.inputs[1]
        bias = n.inputs[2] if len(n.inputs) > 2 else None
        if w not in self.g.constants or (bias is not None and bias not in self.g.constants):
            return False
        px = self.placement(x)
        xt = self.g.values[x].type
        out_f, in_f = self.g.values[w].type.shape
        if px is not None and px.axis != xt.rank - 1:        # batch (or another leading axis): rows stay apart
            return self.same(n, [self.local[x], self.constant_of(w)] + ([self.constant_of(bias)] if bias else []),
                             dict(n.attrs), px)
        if px is None:
            cls = self.classify(n)
            blocks = self.blocks(n)
            pad = 0
            if self.strategy[cls] != "head" or self.would_cut_a_whole_stream(n):
                return False
            if not self.split_extent(out_f, blocks):
                if cls != "embedding" or blocks or not isinstance(out_f, int):
                    return False
                pad = _padding(out_f, self.n)                   # the LM head over a padded vocabulary
            ins = [self.operand(x), self.slice_constant(w, 0, blocks)]
            if bias:
                ins.append(self.slice_constant(bias, 0, blocks))
            self.stats["column_parallel"] += 1
            return self.same(n, ins, dict(n.attrs), Split(xt.rank - 1, blocks, cls, pad))
        if not self.split_extent(in_f, px.blocks):
            return False
        part = self.emit("linear", [self.local[x], self.slice_constant(w, 1, px.blocks)], {}, f"{n.outputs[0]}.partial")
        y = self.collective("all_reduce", part, f"{n.outputs[0]}.sum" if bias else n.outputs[0])
        if bias:
            y = self.emit("add", [y, self.constant_of(bias)], {}, n.outputs[0])
        self.stats["row_parallel"] += 1
        self.bind(n, y, None)
        return True

    def would_cut_a_whole_stream(self, n: Node) -> bool:
        """Whether the linear's output, split column-parallel, would meet a whole value of full
        width in an elementwise op (a residual add) before anything consumes the split: the
        residual stream would be cut, and every later layer would see its input split (its
        projections row-parallel, its attention and KV heads whole). A down projection whose
        MLP did not split (an intermediate size the ranks do not divide) runs whole instead."""
        frontier = [n.outputs[0]]
        for _ in range(_LOOKAHEAD):
            nxt = []
            for v in frontier:
                for u in self.users.get(v, []):
                    if u.op not in ("identity", "cast") and get_op(u.op).kind != "elementwise":
                        continue
                    for other in u.inputs:
                        t = self.g.values[other].type
                        if (other != v and other not in self.g.constants and self.place.get(other, 0) is None
                                and t.rank and not (isinstance(t.shape[-1], int) and t.shape[-1] == 1)):
                            return True
                    nxt.append(u.outputs[0])
            frontier = nxt
        return False

    def on_matmul(self, n: Node) -> bool:
        a, b = n.inputs
        pa, pb = self.placement(a), self.placement(b)
        ra, rb = self.g.values[a].type.rank, self.g.values[b].type.rank
        if pa is not None and pb is not None and pa == pb and ra == rb and pa.axis < ra - 2:
            return self.same(n, [self.local[a], self.local[b]], dict(n.attrs), pa)       # batched over a split axis
        if pa is not None and pb is None and pa.axis < ra - 2 and rb == 2:
            return self.same(n, [self.local[a], self.operand(b)], dict(n.attrs), pa)
        return False

    def classify(self, n: Node) -> str:
        """attention | embedding | mlp, by what the linear's output reaches (or its weight)."""
        w = n.inputs[1]
        if self.vocab_table is not None and (w == self.vocab_table[0] or
                                             self.g.values[w].type.shape[0] == self.vocab_table[1]):
            return "embedding"
        seen, frontier = set(), [n.outputs[0]]
        for _ in range(_LOOKAHEAD):
            nxt = []
            for v in frontier:
                for u in self.users.get(v, []):
                    if u.op in _ATTENTION_OPS:
                        return "attention"
                    if (u.op in _WALK_OPS or get_op(u.op).kind == "elementwise") and u.outputs[0] not in seen:
                        seen.add(u.outputs[0])
                        nxt.append(u.outputs[0])
            frontier = nxt
        return "mlp"

    def blocks(self, n: Node) -> tuple[int, ...]:
        """The widths of the blocks the linear's output is read as, when (through reshapes keeping
        the last axis) it is only read as slices of the last axis that tile it (a fused QKV
        projection: q | k | v); () otherwise."""
        out_f = self.g.values[n.outputs[0]].type.shape[-1]
        frontier, slices = [n.outputs[0]], set()
        while frontier:
            v = frontier.pop()
            for u in self.users.get(v, []):
                ut = self.g.values[u.outputs[0]].type
                if u.op == "reshape" and ut.rank and dims_equal(ut.shape[-1], out_f):
                    frontier.append(u.outputs[0])
                elif (u.op == "slice" and norm_axis(u.attrs["dim"], ut.rank) == ut.rank - 1
                      and u.attrs.get("step", 1) == 1 and isinstance(ut.shape[-1], int)):
                    slices.add((_slice_start(u, out_f), ut.shape[-1]))
                else:
                    return ()
        if len(slices) < 2 or not isinstance(out_f, int):
            return ()
        at = 0
        for start, width in sorted(slices):              # the slices tile [0, out_f): no gap, no overlap
            if start != at or width <= 0:
                return ()
            at += width
        return tuple(w for _, w in sorted(slices)) if at == out_f else ()

    # ---- embeddings
    def _vocab_table(self) -> tuple[str, int] | None:
        tables = [(n.inputs[0], self.g.values[n.inputs[0]].type.shape[0]) for n in self.g.nodes
                  if n.op == "embedding" and n.inputs[0] in self.g.constants]
        return max(tables, key=lambda t: t[1]) if tables else None

    def on_embedding(self, n: Node) -> bool:
        table, ids = n.inputs
        pids = self.placement(ids)
        if pids is not None and pids.axis < self.g.values[ids].type.rank:      # rows of ids stay apart
            return self.same(n, [self.operand(table), self.local[ids]], {}, pids)
        if (self.vocab_table is None or table != self.vocab_table[0] or self.strategy["embedding"] != "head"
                or not isinstance(self.vocab_table[1], int)):
            return False
        vocab = self.vocab_table[1]
        rows = -(-vocab // self.n)                   # padded: the last rank's shard ends in zero rows
        lo = self.rank * rows
        mine = max(0, min(rows, vocab - lo))         # its real rows: an id in the padding is nobody's
        idt = self.type_of(self.local[ids]).dtype
        name = n.outputs[0]
        shifted = self.emit("sub", [self.local[ids], self.const(f"{name}.first_row", torch.tensor(lo, dtype=_dt(idt)))],
                            {}, f"{name}.row")
        inside = self.emit("logical_and", [
            self.emit("ge", [shifted, self.const(f"{name}.zero", torch.tensor(0, dtype=_dt(idt)))], {}, f"{name}.ge"),
            self.emit("lt", [shifted, self.const(f"{name}.rows", torch.tensor(mine, dtype=_dt(idt)))], {}, f"{name}.lt")],
            {}, f"{name}.mine")
        safe = self.emit("where", [inside, shifted, self.const(f"{name}.zero_row", torch.tensor(0, dtype=_dt(idt)))],
                         {}, f"{name}.index")
        looked = self.emit("embedding", [self.slice_constant(table, 0), safe], {}, f"{name}.rows")
        t = self.type_of(self.local[ids])
        mask = self.emit("reshape", [inside], {"shape": _attr_shape(list(t.shape) + [1])}, f"{name}.mask")
        zero = self.const(f"{name}.zero_f", torch.tensor(0.0, dtype=_dt(self.type_of(looked).dtype)))
        part = self.emit("where", [mask, looked, zero], {}, f"{name}.partial")
        self.bind(n, self.collective("all_reduce", part, name), None)
        self.stats["vocab_parallel"] += 1
        return True

    # ---- attention
    def on_sdpa(self, n: Node) -> bool:
        q, k, v = n.inputs[:3]
        ps = [self.placement(x) for x in (q, k, v)]
        rank = self.g.values[q].type.rank
        if ps[0] is None or any(p is None or p.axis != ps[0].axis or p.blocks for p in ps):
            return False
        ax = ps[0].axis
        if ax >= rank - 2:                                   # split along the sequence or head_dim: not by head
            return False
        ins = [self.local[q], self.local[k], self.local[v]]
        if len(n.inputs) > 3:
            m = self.mask_for(n.inputs[3], ax, rank)
            if m is None:
                return False
            ins.append(m)
        return self.same(n, ins, dict(n.attrs), ps[0])

    def on_paged_attention(self, n: Node) -> bool:
        """A decoder's attention on the paged KV cache (`to_paged`): the rank's query heads over
        its KV heads, so its K/V pools keep only those heads ([pages, page_size, kv_heads/world,
        head_dim], under their own names: the decode engine pages them). The block table and
        positions are whole: every rank's pool has the same pages."""
        q, k, v, kp, vp = n.inputs[:5]
        ps = [self.placement(x) for x in (q, k, v)]
        if ps[0] is None or any(p is None or p.axis != 1 or p.blocks or p.pad for p in ps):
            return False
        if any(x not in self.g.constants or x in self.local or
               not self.split_extent(self.g.values[x].type.shape[2]) for x in (kp, vp)):
            return False
        pools = []
        for x in (kp, vp):
            part = self.g.constants[x].chunk(self.n, 2)[self.rank].clone()
            pools.append(self.out.add_constant(x, part, self.g.values[x].role))
            self.local[x], self.place[x] = x, Split(2, (), "attention")
        rest = [self.operand(x) if self.placement(x) is None else self.get_whole(x, n.op) for x in n.inputs[5:]]
        return self.same(n, [self.local[q], self.local[k], self.local[v], *pools, *rest], dict(n.attrs), ps[0])

    def mask_for(self, name: str, ax: int, rank: int) -> str | None:
        """A whole operand broadcast against a value split on `ax`: as is when it broadcasts
        along that axis (extent 1 or missing), else cut to this rank's part."""
        t = self.g.values[name].type
        p = self.placement(name)
        lead = rank - t.rank
        if p is not None:
            return self.local[name] if p.axis + lead == ax else None
        if ax < lead or (isinstance(t.shape[ax - lead], int) and t.shape[ax - lead] == 1):
            return self.operand(name)
        return self.local_split(name, ax - lead)


class _ShapeRules(_ShardWalk):
    """Rules that carry a split through: elementwise ops, reductions, reshapes, permutes,
    expands, slices, concats, and the batch-wise ops of the batch strategy."""

    # ---- elementwise and reductions
    def on_elementwise(self, n: Node) -> bool:
        out_rank = self.g.values[n.outputs[0]].type.rank
        split = None
        for i in n.inputs:
            p = self.placement(i)
            if p is None:
                continue
            q = replace(p, axis=p.axis + out_rank - self.g.values[i].type.rank)
            if split is not None and (q.axis, q.blocks, q.pad) != (split.axis, split.blocks, split.pad):
                return False
            split = split or q
        if split is None:
            return False
        ins = []
        for i in n.inputs:
            if self.placement(i) is not None:
                ins.append(self.local[i])
                continue
            t = self.g.values[i].type
            lead = out_rank - t.rank
            if split.axis < lead or (isinstance(t.shape[split.axis - lead], int) and t.shape[split.axis - lead] == 1):
                ins.append(self.operand(i))
                continue
            cut = (self.slice_constant(i, split.axis - lead, split.blocks)
                   if i in self.g.constants and (split.pad or self.split_extent(t.shape[split.axis - lead],
                                                                                 split.blocks))
                   else self.local_split(i, split.axis - lead, split.blocks))
            if cut is None:
                return False
            ins.append(cut)
        return self.same(n, ins, dict(n.attrs), split)

    def on_reduction(self, n: Node) -> bool:
        x = n.inputs[0]
        p = self.placement(x)
        if p is None or any(self.placement(i) is not None for i in n.inputs[1:]):
            return False
        rank = self.g.values[x].type.rank
        a = n.attrs
        if n.op == "layer_norm":
            reduced = set(range(rank - a.get("normalized_rank", 1), rank))
        elif "dims" in a:
            reduced = {norm_axis(d, rank) for d in a["dims"]}
        elif "dim" in a:
            reduced = {norm_axis(a["dim"], rank)}
        elif n.op == "batch_norm":
            reduced = {1}
        else:
            reduced = set(range(rank))
        if p.axis in reduced:
            return False
        shrinks = n.op not in ("softmax", "log_softmax", "cumsum", "layer_norm", "batch_norm")
        keep = a.get("keepdim", False) if shrinks else True
        axis = p.axis - (0 if keep else sum(1 for d in reduced if d < p.axis))
        ins = [self.local[x]] + [self.operand(i) for i in n.inputs[1:]]
        return self.same(n, ins, dict(a), replace(p, axis=axis))

    # ---- shape ops
    def on_permute(self, n: Node) -> bool:
        p = self.placement(n.inputs[0])
        if p is None:
            return False
        axis = list(n.attrs["perm"]).index(p.axis)
        return self.same(n, [self.local[n.inputs[0]]], dict(n.attrs), replace(p, axis=axis))

    def on_reshape(self, n: Node) -> bool:
        x = n.inputs[0]
        p = self.placement(x)
        if p is None:
            return False
        src, dst = self.g.values[x].type.shape, self.g.values[n.outputs[0]].type.shape
        o = _reshape_axis(src, dst, p.axis)
        if o is None or not (dims_equal(src[p.axis], dst[o]) if p.blocks else self.split_extent(dst[o])):
            return False
        shape = list(dst)
        shape[o] = _part(dst[o], self.n)
        return self.same(n, [self.local[x]], {"shape": _attr_shape(shape)}, replace(p, axis=o))

    def on_expand(self, n: Node) -> bool:
        x = n.inputs[0]
        p = self.placement(x)
        if p is None:
            return False
        src, dst = self.g.values[x].type.shape, self.g.values[n.outputs[0]].type.shape
        ax = p.axis + len(dst) - len(src)
        if not dims_equal(src[p.axis], dst[ax]):
            return False
        shape = [d if not (isinstance(d, int) and d == -1) else dst[i] for i, d in
                 enumerate(normalize_dim(d) for d in n.attrs["shape"])]
        shape[ax] = _part(dst[ax], self.n) if not p.pad else self.type_of(self.local[x]).shape[p.axis]
        return self.same(n, [self.local[x]], {"shape": _attr_shape(shape)}, replace(p, axis=ax))

    def on_slice(self, n: Node) -> bool:
        x = n.inputs[0]
        p = self.placement(x)
        if p is None:
            return False
        t = self.g.values[x].type
        d = norm_axis(n.attrs["dim"], t.rank)
        if d != p.axis:
            return self.same(n, [self.local[x]], dict(n.attrs), p)
        width = self.g.values[n.outputs[0]].type.shape[d]
        if not p.blocks or p.pad or n.attrs.get("step", 1) != 1 or not isinstance(width, int):
            return False
        start = _slice_start(n, t.shape[d])
        offsets = [sum(p.blocks[:j]) for j in range(len(p.blocks))]
        if (start, width) not in zip(offsets, p.blocks):   # exactly one block: the rank's part of it
            return False
        return self.same(n, [self.local[x]], {"dim": d, "start": start // self.n, "end": (start + width) // self.n,
                                              "step": 1}, Split(d, (), p.cls))

    def on_concat(self, n: Node) -> bool:
        ps = [self.placement(i) for i in n.inputs]
        split = next((p for p in ps if p is not None), None)
        if split is None or split.blocks or split.pad:
            return False
        rank = self.g.values[n.outputs[0]].type.rank
        if norm_axis(n.attrs["dim"], rank) == split.axis:
            return False
        ins = []
        for i, p in zip(n.inputs, ps):
            if p is not None:
                if p.axis != split.axis or p.blocks:
                    return False
                ins.append(self.local[i])
            else:
                cut = self.local_split(i, split.axis)
                if cut is None:
                    return False
                ins.append(cut)
        return self.same(n, ins, dict(n.attrs), split)

    def on_conv2d(self, n: Node) -> bool:
        return self.batch_wise(n)

    on_max_pool2d = on_avg_pool2d = on_adaptive_avg_pool2d = on_batch_norm = on_conv2d

    def batch_wise(self, n: Node) -> bool:
        p = self.placement(n.inputs[0])
        if p is None or p.axis != 0 or any(self.placement(i) is not None for i in n.inputs[1:]):
            return False
        return self.same(n, [self.local[n.inputs[0]]] + [self.operand(i) for i in n.inputs[1:]], dict(n.attrs), p)


class _Sharder(_LayerRules, _ShapeRules):
    """One rank's rewrite (module doc): `_Sharder(...).run()`."""


def _dt(dtype: str) -> torch.dtype:
    from graphmode.ir.types import DTYPES
    return DTYPES[dtype]


def _padding(extent: int, n: int) -> int:
    """How many entries pad `extent` to a multiple of `n`."""
    return -extent % n


def _padded_part(t: torch.Tensor, axis: int, rank: int, n: int) -> torch.Tensor:
    """`rank`'s ceil(extent / n) entries of `axis`, zeros past the end of the tensor."""
    full = t.shape[axis]
    part = -(-full // n)
    lo = min(rank * part, full)
    local = t.narrow(axis, lo, min(part, full - lo))
    if local.shape[axis] < part:
        shape = list(t.shape)
        shape[axis] = part - local.shape[axis]
        local = torch.cat([local, t.new_zeros(shape)], axis)
    return local.contiguous()


def _slice_start(n: Node, full: Dim) -> Any:
    """A slice's first index, a negative one counted from the end of the axis."""
    start = n.attrs.get("start", 0)
    return start + full if isinstance(start, int) and start < 0 and isinstance(full, int) else start


def _part(d: Dim, n: int) -> Dim:
    return d // n if isinstance(d, int) else normalize_dim(sympy.sympify(d) / n)


def _attr_shape(shape: list) -> list:
    return [d if isinstance(d, int) else dim_str(normalize_dim(d)) for d in shape]


def _divides(a: Any, b: Any) -> bool:
    """b / a is a product of dims (a divides b as a monomial, or as integers)."""
    _num, den = sympy.fraction(sympy.together(sympy.sympify(b) / sympy.sympify(a)))
    return den == 1


def _reshape_axis(src: tuple, dst: tuple, axis: int) -> int | None:
    """The output axis a split of input `axis` lands on: the input and output axes are grouped
    into runs of equal element count; the split axis must lead its run (axes of extent 1 aside)
    and lands on the leading non-1 axis of the matching output run."""
    i = j = 0
    while i < len(src) and j < len(dst):
        gi, gj = [i], [j]
        pi, pj = sympy.sympify(src[i]), sympy.sympify(dst[j])
        i, j = i + 1, j + 1
        guard = 0
        while not dims_equal(normalize_dim(pi), normalize_dim(pj)):
            guard += 1
            if guard > len(src) + len(dst):
                return None
            if j < len(dst) and _divides(pj, pi) and not dims_equal(normalize_dim(pj), normalize_dim(pi)):
                pj = pj * dst[j]
                gj.append(j)
                j += 1
            elif i < len(src) and _divides(pi, pj):
                pi = pi * src[i]
                gi.append(i)
                i += 1
            else:
                return None
        while i < len(src) and j >= len(dst) and src[i] == 1:         # trailing ones
            gi.append(i)
            i += 1
        if axis in gi:
            lead_in = [a for a in gi if src[a] != 1]
            lead_out = [b for b in gj if dst[b] != 1]
            if not lead_in or lead_in[0] != axis or not lead_out:
                return None
            return lead_out[0]
    return None


def _rename_outputs(g: Graph, want: list[str]) -> Graph:
    """Give the graph's outputs their original names: a gathered output was built under another
    name while the original one held the rank's part (which becomes `<name>.local`)."""
    from graphmode.ir.types import Value
    from graphmode.passes.rewrite import rename_node
    mapping: dict[str, str] = {}
    for have, name in zip(g.outputs, want):
        if have != name:
            if name in g.values:
                mapping[name] = g.fresh_name(f"{name}.local")
            mapping[have] = name
    if mapping:
        g.nodes = [rename_node(nd, mapping) for nd in g.nodes]
        g.values = {mapping.get(k, k): Value(mapping.get(k, k), v.type, v.role) for k, v in g.values.items()}
        g.constants = {mapping.get(k, k): t for k, t in g.constants.items()}
    g.outputs = list(want)
    return g


@register_pass("shard")
def run(graph: Graph, ctx: PassContext) -> PassResult:
    opts = ctx.opts("shard")
    if opts.world <= 1:
        return PassResult(graph, False, {})
    if not 0 <= opts.rank < opts.world:
        raise PassError(f"rank {opts.rank} is outside a group of {opts.world}", where="shard",
                        fix=f"a rank in 0..{opts.world - 1}")
    s = _Sharder(graph, opts.rank, opts.world, dict(opts.strategy), opts.comm_dtype, opts.batch_dim)
    out = s.run()
    return PassResult(out, True, s.stats)
