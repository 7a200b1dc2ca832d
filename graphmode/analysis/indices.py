"""Index bounds: which model inputs index a table, and which dims count positions of one.

An integer input that reaches the index operand of `embedding`, `index_select`, `gather` or
`index` picks rows of a table whose size is fixed by the model (a vocabulary, a type
vocabulary, a position table), and one that reaches the index of a write (`scatter`,
`index_copy`, ...: a KV cache's write positions) picks the rows it writes: a value outside
it fails deep inside a kernel. This module
finds those inputs in the IR, so the runtime can check them against the table *before* a
plan runs (one vectorised range check per input) and name the input, the bad value, its
position and the valid range.

A value is followed from an input only through ops that keep its values: views (reshape,
permute, expand, identity), integer casts, and the addition or subtraction of an integer
scalar constant (which shifts the valid range), the addition of a fixed run of integers that
every value meets (`w[:, None] + arange(S)` over broadcast axes: each write index starts S
steps, so the valid range ends S - 1 earlier), and the ONNX importer's wrap of negative
indices, `where(x < 0, x + n, x)` (then -n..n-1 is valid for a table of n rows). On the
input's own axes (before any reshape or permute), a static slice of a fixed axis (`x[:, i]`:
one table per column, as a recommender's sparse features) and the addition of a constant
vector along it (`x + offsets`: one shared table, each column its own range of rows) bound each
column on its own. Anything else ends the trail: an input
whose index use cannot be proved this way gets no check (never a check that could refuse a
valid request).

The same trail from `arange(start, end=dim)` gives *dim limits*: positions 0..seq-1 that
index a position table of N rows bound `seq` by N, so a shape past the model's positions
is refused before anything (an eager fallback included) runs it. A count along seq of 0/1
values (`cumsum` of a bool cast, times those values: RoBERTa's positions from its ids) holds
0..seq and bounds seq the same way.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Mapping

import sympy
import torch

from graphmode.ir.graph import Graph, Node
from graphmode.ir.ops import norm_axis
from graphmode.ir.types import normalize_dim
from graphmode.recipe.limits import INT_LIMITS

# ops whose output holds exactly the values of their first input (rearranged or repeated)
_VIEWS = frozenset({"reshape", "permute", "expand", "identity"})
_INDEX_OPS = frozenset({"embedding", "index_select", "gather", "index", "embedding_bag"})
LOOKUPS = frozenset({"embedding", "index_select", "gather", "index"})     # the table is input 0


def lookup_only_constants(graph: Graph) -> list[str]:
    """Constants read only as the table of an indexed read (a token embedding): a request reads
    the rows it picks, and no kernel prepares a copy of them (only GEMM and conv weights are
    packed or transformed), so neither a bandwidth floor nor the prepared-weights term counts
    them whole. A table also read otherwise (an LM head tied to it) is not one."""
    users = graph.users()
    return [k for k in graph.constants
            if users.get(k) and all(n.op in LOOKUPS and n.inputs[0] == k and k not in n.inputs[1:] for n in users[k])]
# ATen-reference writes: (self, dim, index, ...) with the index at args[2] (index_fill's too)
_WRITE_OPS = frozenset({"scatter", "scatter_add", "scatter_reduce", "index_copy", "index_add", "index_fill",
                        "index_reduce"})


@dataclass(frozen=True)
class IndexUse:
    """One op that reads rows of `table` at positions given by an input (shifted by `offset`)."""

    op: str
    output: str            # the op's output value (names the node)
    table: str
    axis: int
    rows: int
    lo: int                # valid range of the *input's* values for this use: [lo, hi]
    hi: int
    negative_ok: bool      # `index` takes -rows..-1 (counted from the end) like torch

    def describe(self) -> str:
        axis = f" along axis {self.axis}" if self.axis else ""
        verb = "writes into" if self.op in _WRITE_OPS else "picks from"
        return f"{self.op} %{self.output} {verb} the {self.rows} rows of %{self.table}{axis}"


@dataclass
class InputBound:
    """The values an index input may hold: [lo, hi] (inclusive), the tightest of its uses; with
    `column` (axis, index), only that column's values."""

    name: str
    lo: int
    hi: int
    uses: list[IndexUse] = field(default_factory=list)
    column: tuple[int, int] | None = None

    def describe(self) -> str:
        u = min(self.uses, key=lambda u: u.hi - u.lo)
        return f"{u.describe()}" + (f", shifted by {u.lo}" if u.lo and not u.negative_ok else "")

    def label(self) -> str:
        return self.name if self.column is None else f"{self.name} column {self.column[1]} of axis {self.column[0]}"


@dataclass(frozen=True)
class DimLimit:
    """`dim` may be at most `max`: positions arange(.., dim) index a table of `rows` rows."""

    dim: str
    max: int
    table: str
    rows: int
    op: str
    output: str

    def describe(self) -> str:
        if self.op == "slice":
            return (f"slice %{self.output} takes its first {self.dim}-long run of the {self.rows} positions of "
                    f"%{self.table}")
        return f"its positions pick from the {self.rows} rows of %{self.table} ({self.op} %{self.output})"


@dataclass
class IndexReport:
    inputs: dict[str, InputBound] = field(default_factory=dict)
    columns: dict[tuple[str, int, int], InputBound] = field(default_factory=dict)    # (input, axis, index)
    dims: dict[str, DimLimit] = field(default_factory=dict)
    empty_tables: list[IndexUse] = field(default_factory=list)    # 0 rows: every index is out of range

    def to_json(self) -> dict[str, Any]:
        return {"inputs": {n: {"range": [b.lo, b.hi], "uses": [u.describe() for u in b.uses]}
                           for n, b in self.inputs.items()},
                "columns": [{"input": b.name, "axis": b.column[0], "index": b.column[1], "range": [b.lo, b.hi],
                             "uses": [u.describe() for u in b.uses]} for b in self.columns.values()],
                "dims": {d: {"max": v.max, "why": v.describe()} for d, v in self.dims.items()},
                "empty_tables": [u.describe() for u in self.empty_tables]}


@dataclass(frozen=True)
class _Trail:
    """A value that holds `source`'s values plus `offset` (source: an input, or a dim via arange)."""

    source: str
    offset: int
    kind: str          # input | positions
    start: int = 0     # positions: arange's start
    wrap: int | None = None   # where(x < 0, x + wrap, x): negative values count from the end of `wrap` rows
    spread: int = 0    # input: each value also reaches value + offset + 1 .. value + offset + spread
    aligned: bool = True    # input: its axes are still the input's (no reshape, permute or expand yet)
    # input: only some columns of one axis, each also shifted: (axis, ((input's column, shift), ...)), one
    # entry per position along that axis now
    columns: tuple[int, tuple[tuple[int, int], ...]] | None = None


def analyze_indices(graph: Graph) -> IndexReport:
    """Index inputs and position dims of `graph` (a captured or optimized graph; fused
    regions are searched too, with their operands mapped to the outer values)."""
    report = IndexReport()
    trails: dict[str, _Trail] = {}
    for name in graph.inputs:
        dt = graph.values[name].type.dtype
        if dt in INT_LIMITS and dt != "bool":
            trails[name] = _Trail(name, 0, "input")
    _walk(graph, trails, report)
    return report


def _walk(graph: Graph, trails: dict[str, _Trail], report: IndexReport) -> None:
    for node in graph.nodes:
        if node.body is not None:                     # a fused region: its inputs are node.inputs in order
            inner = {b: trails[o] for b, o in zip(node.body.inputs, node.inputs) if o in trails}
            _walk(node.body, inner, report)
            trails.update({o: inner[b] for b, o in zip(node.body.outputs, node.outputs) if b in inner})
            continue
        if node.op in _INDEX_OPS or node.op in _WRITE_OPS:
            _index_use(graph, node, trails, report)
        if node.op == "slice":
            _slice_limit(graph, node, report)
        t = _follow(graph, node, trails)
        if t is not None and t.aligned and t.kind == "input" \
                and any(graph.values[i].type.rank != graph.values[node.outputs[0]].type.rank
                        for i in node.inputs if i in trails):      # broadcast to more axes: not the input's
            t = replace(t, aligned=False)
        if t is not None:
            trails[node.outputs[0]] = t


def _follow(graph: Graph, node: Node, trails: Mapping[str, _Trail]) -> _Trail | None:
    """The trail of `node`'s output, when it holds a traced value's values plus a constant."""
    if node.op == "arange":
        return _arange(node)
    if node.op == "cast" and node.inputs and graph.values[node.inputs[0]].type.dtype == "bool" \
            and graph.values[node.outputs[0]].type.dtype in INT_LIMITS:
        return _INDICATOR
    if not node.inputs or not any(i in trails for i in node.inputs):
        return None
    out_dt = graph.values[node.outputs[0]].type.dtype
    if out_dt not in INT_LIMITS or out_dt == "bool":
        return None
    if node.op == "cast" or node.op == "identity":
        return trails.get(node.inputs[0])
    if node.op in _VIEWS:
        t = trails.get(node.inputs[0])
        return replace(t, aligned=False) if t is not None and t.kind == "input" else t
    if node.op == "slice":
        return _column_slice(graph, node, trails.get(node.inputs[0]))
    if node.op == "where":
        return _wrapped(graph, node, trails)
    if node.op == "cumsum":
        return _counted(graph, node, trails.get(node.inputs[0]))
    if node.op == "mul" and len(node.inputs) == 2:
        return _masked_count(node, trails)
    if node.op in ("add", "sub") and len(node.inputs) == 2:
        a, b = node.inputs
        if _INDICATOR in (trails.get(a), trails.get(b)):
            return None                        # no longer 0 or 1
        if a in trails and (c := _int_scalar(graph, b)) is not None:
            t = trails[a]
            return replace(t, offset=t.offset + (c if node.op == "add" else -c))
        if node.op == "add" and b in trails and (c := _int_scalar(graph, a)) is not None:
            t = trails[b]
            return replace(t, offset=t.offset + c)
        if a in trails and (v := _folded(graph, b)) is not None:
            return _column_shift(graph, a, trails[a], v, -1 if node.op == "sub" else 1)
        if node.op == "add" and b in trails and (v := _folded(graph, a)) is not None:
            return _column_shift(graph, b, trails[b], v, 1)
        if node.op == "add":
            return _spread(graph, node, trails)
    return None


def _column_slice(graph: Graph, node: Node, t: _Trail | None) -> _Trail | None:
    """`x[:, s:e]` on an input's own fixed axis: the columns s..e-1 of that axis (a slice of any
    other axis leaves some values out of a use, which then bounds only them: the trail ends)."""
    if t is None or t.kind != "input" or not t.aligned:
        return None
    shape = graph.values[node.inputs[0]].type.shape
    axis, start, end = node.attr("dim", 0), node.attr("start", 0), node.attr("end")
    if not isinstance(axis, int) or not -len(shape) <= axis < len(shape) or node.attr("step", 1) != 1:
        return None
    axis = norm_axis(axis, len(shape))
    extent = shape[axis]
    if not isinstance(extent, int) or not isinstance(start, int) or not isinstance(end, int):
        return None
    picked = range(extent)[start:end]
    if t.columns is None:
        return replace(t, columns=(axis, tuple((c, 0) for c in picked)))
    if t.columns[0] != axis:
        return None
    return replace(t, columns=(axis, tuple(t.columns[1][c] for c in picked)))


def _column_shift(graph: Graph, x: str, t: _Trail, const: torch.Tensor, sign: int) -> _Trail | None:
    """An input plus a constant that varies along one of its fixed axes (`ids + offsets`): each
    column shifted by its own amount."""
    shape = graph.values[x].type.shape
    vector = _int_vector(const)
    if vector is None or t.kind != "input" or not t.aligned or t.wrap is not None or const.dim() > len(shape):
        return None
    axis_from_end, values = vector
    axis = len(shape) - axis_from_end
    if shape[axis] != len(values):
        return None
    cols = t.columns[1] if t.columns is not None and t.columns[0] == axis else None
    if t.columns is not None and cols is None:
        return None
    cols = cols or tuple((c, 0) for c in range(len(values)))
    return replace(t, columns=(axis, tuple((c, s + sign * v) for (c, s), v in zip(cols, values))))


def _folded(graph: Graph, name: str) -> torch.Tensor | None:
    """The value of a constant, or of a constant reshaped to a static shape (`offsets[None]`)."""
    made = graph.producers().get(name)
    if made is not None and made.op == "reshape" and all(isinstance(d, int) for d in made.attr("shape", [None])):
        t = _folded(graph, made.inputs[0])
        return t.reshape(made.attr("shape")) if t is not None and t.numel() == graph.values[name].type.numel() \
            else None
    return graph.constants.get(name)


def _int_vector(t: torch.Tensor) -> tuple[int, tuple[int, ...]] | None:
    """An integer tensor of more than one element that varies along one axis only (1 on the
    others): (that axis counted from the end, 1-based; its values)."""
    if t.numel() < 2 or t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        return None
    long = [i for i, n in enumerate(t.shape) if n != 1]
    if len(long) != 1:
        return None
    return t.dim() - long[0], tuple(int(v) for v in t.reshape(-1).tolist())


def _spread(graph: Graph, node: Node, trails: Mapping[str, _Trail]) -> _Trail | None:
    """An input's trail plus a static arange(lo, hi) that every one of its values meets: the
    two broadcast against each other on disjoint axes (where one has extent > 1 the other has
    1), so each value v becomes v + lo .. v + hi - 1, all of them read."""
    a, b = node.inputs
    t, run = (trails.get(a), b) if a in trails else (trails.get(b), a)
    if t is None or t.kind != "input" or t.wrap is not None or run in trails:
        return None
    producers = graph.producers()
    made = producers.get(run)
    while made is not None and made.op in _VIEWS:          # arange(S) reshaped onto its axis
        made = producers.get(made.inputs[0])
    if made is None or made.op != "arange" or made.attr("step", 1) != 1:
        return None
    lo, hi = made.attr("start", 0), made.attr("end")
    if not isinstance(lo, int) or not isinstance(hi, int) or hi <= lo:
        return None
    src = graph.values[a if run == b else b].type.shape
    other = graph.values[run].type.shape
    width = max(len(src), len(other))
    src, other = (1,) * (width - len(src)) + tuple(src), (1,) * (width - len(other)) + tuple(other)
    if any(x != 1 and y != 1 for x, y in zip(src, other)):
        return None
    return replace(t, offset=t.offset + lo, spread=t.spread + hi - 1 - lo, aligned=False)


_INDICATOR = _Trail("", 0, "indicator")      # a bool cast to an integer: 0 or 1


def _counted(graph: Graph, node: Node, t: _Trail | None) -> _Trail | None:
    """cumsum of 0/1 values along an axis of dim D: counts 0..D, a positions trail on D (RoBERTa
    numbers its positions so: cumsum(ids != pad) * (ids != pad) + pad)."""
    if t is None or t.kind != "indicator":
        return None
    shape = graph.values[node.inputs[0]].type.shape
    axis = node.attr("dim", 0)
    if not isinstance(axis, int) or not -len(shape) <= axis < len(shape):
        return None
    trail = _positions_of(shape[axis], 0)
    if trail is None:
        return None
    # arange's trail on D + k holds 0 .. D + k - 1; a count holds 0 .. D + k: one more, from 0
    return _Trail(trail.source, trail.offset + 1, "positions", -(trail.offset + 1))


def _masked_count(node: Node, trails: Mapping[str, _Trail]) -> _Trail | None:
    """A count from 0 times 0/1 values: still 0 .. its largest."""
    a, b = (trails.get(i) for i in node.inputs)
    for t, other in ((a, b), (b, a)):
        if t is not None and t.kind == "positions" and t.start + t.offset == 0 and other == _INDICATOR:
            return t
    return None


def _wrapped(graph: Graph, node: Node, trails: Mapping[str, _Trail]) -> _Trail | None:
    """`where(x < 0, x + n, x)` on an unshifted trail x: x's values, negatives counted from n; on
    positions that start at 0 or above, x itself."""
    if len(node.inputs) != 3:
        return None
    cond, shifted, x = node.inputs
    t = trails.get(x)
    made = graph.producers()
    lt, add = made.get(cond), made.get(shifted)
    if t is not None and t.kind == "positions" and t.start + t.offset >= 0 and lt is not None \
            and lt.op == "lt" and list(lt.inputs[:1]) == [x] and _int_scalar(graph, lt.inputs[1]) == 0:
        return t
    if t is None or t.kind != "input" or t.offset or t.wrap is not None or lt is None or add is None:
        return None
    if lt.op != "lt" or list(lt.inputs[:1]) != [x] or _int_scalar(graph, lt.inputs[1]) != 0:
        return None
    if add.op != "add" or list(add.inputs[:1]) != [x] or (n := _int_scalar(graph, add.inputs[1])) is None or n <= 0:
        return None
    return replace(t, wrap=n)


def _arange(node: Node) -> _Trail | None:
    """arange(start, end=dim, step 1): positions start..dim-1 of one recipe dim."""
    start, step = node.attr("start", 0), node.attr("step", 1)
    if not isinstance(start, int) or step != 1:
        return None
    return _positions_of(node.attr("end"), start)


def _positions_of(end: Any, start: int) -> _Trail | None:
    """The trail of start .. end - 1 where `end` is one recipe dim plus an integer."""
    try:
        end = normalize_dim(end)
    except Exception:  # noqa: BLE001 - an end the IR cannot read: not a position trail
        return None
    if isinstance(end, int) or len(end.free_symbols) != 1:
        return None
    sym = next(iter(end.free_symbols))
    shift = sympy.simplify(end - sym)
    if not shift.is_Integer:
        return None
    # values start .. sym + shift - 1: a trail on `sym` whose largest value is sym - 1 + offset
    return _Trail(sym.name, int(shift), "positions", start)


def _int_scalar(graph: Graph, name: str) -> int | None:
    t = graph.constants.get(name)
    if t is None or t.numel() != 1 or t.dtype.is_floating_point or t.dtype.is_complex:
        return None
    return int(t.reshape(()).item())


def _index_use(graph: Graph, node: Node, trails: Mapping[str, _Trail], report: IndexReport) -> None:
    table = node.inputs[0]
    shape = graph.values[table].type.shape
    if node.op == "embedding":
        pairs = [(node.inputs[1], 0)] if len(node.inputs) > 1 else []
    elif node.op == "embedding_bag":        # ATen-reference (weight, indices, offsets, ...): rows of the weight
        args = list(node.attr("args", []))
        index = args[1] if len(args) > 1 else None
        if args[:1] != [{"$in": 0}] or not isinstance(index, dict) or not isinstance(index.get("$in"), int) \
                or not 0 < index["$in"] < len(node.inputs):
            return
        pairs = [(node.inputs[index["$in"]], 0)]
    elif node.op in _WRITE_OPS:
        args = list(node.attr("args", []))
        index = args[2] if len(args) > 2 else None
        if not isinstance(index, dict) or not isinstance(index.get("$in"), int) or not isinstance(args[1], int) \
                or args[0] != {"$in": 0} or not 0 < index["$in"] < len(node.inputs):
            return
        pairs = [(node.inputs[index["$in"]], norm_axis(args[1], len(shape)))]
    elif node.op in ("index_select", "gather"):
        pairs = [(node.inputs[1], norm_axis(node.attr("dim", 0), len(shape)))]
    else:  # index: input k + 1 indexes axis dims[k]
        pairs = list(zip(node.inputs[1:], node.attr("dims", [])))
    for idx, axis in pairs:
        if not 0 <= axis < len(shape) or not isinstance(shape[axis], int):
            continue
        rows = shape[axis]
        negative_ok = node.op == "index"
        lo, hi = (-rows if negative_ok else 0), rows - 1
        trail = trails.get(idx)
        if rows == 0:
            report.empty_tables.append(IndexUse(node.op, node.outputs[0], table, axis, 0, 0, -1, negative_ok))
            continue
        if trail is None or trail.kind == "indicator":
            continue
        if trail.wrap is not None:            # negatives counted from the end: only provable for its own table
            if trail.wrap != rows:
                continue
            lo, negative_ok = -rows, True
        use = IndexUse(node.op, node.outputs[0], table, axis, rows, lo - trail.offset,
                       hi - trail.offset - trail.spread, negative_ok)
        if trail.kind == "input" and trail.columns is not None:
            col_axis, cols = trail.columns
            for c, shift in cols:
                shifted = replace(use, lo=use.lo - shift, hi=use.hi - shift)
                _bound(report.columns, (trail.source, col_axis, c), shifted, trail.source, (col_axis, c))
        elif trail.kind == "input":
            _bound(report.inputs, trail.source, use, trail.source, None)
        elif trail.start + trail.offset >= lo:
            # positions start+offset .. dim-1+offset must stay <= rows-1
            limit = DimLimit(trail.source, hi - trail.offset + 1, table, rows, node.op, node.outputs[0])
            old = report.dims.get(limit.dim)
            if old is None or limit.max < old.max:
                report.dims[limit.dim] = limit


def _bound(table: dict, key: Any, use: IndexUse, name: str, column: tuple[int, int] | None) -> None:
    b = table.get(key)
    if b is None:
        table[key] = InputBound(name, use.lo, use.hi, [use], column)
    else:
        b.lo, b.hi = max(b.lo, use.lo), min(b.hi, use.hi)
        b.uses.append(use)


def _slice_limit(graph: Graph, node: Node, report: IndexReport) -> None:
    """A slice whose end counts a dim (pos[:seq], a buffer's position_ids[:, :seq]) over an axis
    of N positions: the IR's length is end - start, python's min(end, N) - start, so the graph
    holds only while end <= N. torch.export guards it; an ONNX file does not (dynamo writes the
    length as Min(N, seq)), so it bounds the dim like a position table does."""
    t = graph.values[node.inputs[0]].type
    axis = node.attr("dim", 0)
    if not isinstance(axis, int) or not -t.rank <= axis < t.rank or not isinstance(t.shape[axis], int):
        return
    if node.attr("step", 1) != 1 or not isinstance(node.attr("start", 0), int):
        return
    trail = _positions_of(node.attr("end"), 0)
    if trail is None:
        return
    rows = t.shape[axis]
    limit = DimLimit(trail.source, rows - trail.offset, node.inputs[0], rows, "slice", node.outputs[0])
    old = report.dims.get(limit.dim)
    if old is None or limit.max < old.max:
        report.dims[limit.dim] = limit
