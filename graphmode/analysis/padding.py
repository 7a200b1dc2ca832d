"""Padding safety: can a request padded up to its bucket change a real output value?

The runtime pads every input along the recipe's bucketed dims (with each input's
`pad_value`) and slices the outputs back. That is only sound when no real output position
reads a padded position in a way that changes it: a mean over `seq` divides by the padded
length, a softmax over padded keys spreads probability onto them, a `[:, -1]` picks a
padded position. This module proves it, per dim, by abstract interpretation of the IR.

For every value it tracks, per axis, whether the axis carries padding of a dim and what
the padded positions hold (when that axis is in padding and every other axis is real):
a known constant (the pad value, a mask's 0, a `finfo.min`), "hugely negative" (a masked
logit), "at least the real extent" (an `arange` past the end), or finite garbage. A
reduction, softmax, contraction or gather over a padded axis is safe only when that
content makes it a no-op: a sum over zeros, a softmax or max over masked logits,
attention whose keys are masked (or causal with padding at the end), a prefix scan.
Anything else *taints* the dim; a tainted dim reaching an output, or an output axis whose
padding cannot be sliced back, makes padding along that dim unsafe.

Which rule follows an op is a fact of the op table (`OpSpec.padding`); the rules live in
analysis/padding_rules/ (one per name), the abstract values in analysis/padding_lattice.py,
and this module drives them over the graph and writes the report.

Assumption (stated in the report): padded positions compute finite values. The analysis
is conservative where it cannot follow a value (unknown ops, reshapes that split a padded
axis, eager islands): it refuses rather than guess.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

import sympy
import torch

from graphmode.analysis.padding_lattice import (GARBAGE, UNKNOWN, Axis, Content, Factor, Finding, State, const, plain,
                                                is_one, prefix_offset, same_dim, symbols)
from graphmode.analysis.padding_rules import RULES
from graphmode.ir.graph import Graph, Node
from graphmode.ir.ops import get_op
from graphmode.ir.types import Dim, normalize_dim

# ---------------------------------------------------------------------------------- report


@dataclass
class DimVerdict:
    dim: str
    padded: bool
    findings: list[Finding] = field(default_factory=list)

    @property
    def safe(self) -> bool:
        return not self.findings

    @property
    def status(self) -> str:
        return "not padded" if not self.padded else ("safe" if self.safe else "unsafe")


@dataclass
class PaddingReport:
    dims: dict[str, DimVerdict]
    # safe dims whose proof rests on masked logits (a softmax or attention over masked padding):
    # it holds while every real row keeps a real unmasked position. A row masked whole (its mask
    # all zeros, or a query row of a query x key mask) spreads a softmax evenly over every
    # position, the padded ones too, so the runtime does not pad a request whose inputs already
    # hold their pad value along these dims (runtime/shaping.py `pad_hazard`)
    masked: list[str] = field(default_factory=list)
    # of those, dims along which a value computed from the masks alone has two padded axes (a
    # query x key mask, as DeBERTa builds), or a causal triangle masks a softmax written out: a
    # query row is masked whole wherever its mask is (before the first real token, under left
    # padding), so any pad value in a request's mask is a hazard, not only a row of them
    query_key: list[str] = field(default_factory=list)

    @property
    def unsafe_dims(self) -> list[str]:
        return [d for d, v in self.dims.items() if v.padded and not v.safe]

    @property
    def safe(self) -> bool:
        return not self.unsafe_dims

    def lines(self) -> list[str]:
        out = []
        for d, v in self.dims.items():
            out.append(f"{d}: {v.status}")
            out += [f"  {f.describe()}" for f in v.findings]
        return out

    def to_json(self) -> dict:
        return {d: {"status": v.status, "findings": [f.__dict__ for f in v.findings],
                    **({"masked": True} if d in self.masked else {})} for d, v in self.dims.items()}


# ---------------------------------------------------------------------------------- analysis


_KEEPS_TRUE = frozenset({"logical_and", "reshape", "expand", "identity", "permute", "cast"})
# integer index arithmetic and layout: a size used as a value may pass (b * seq + argmax indexes the padded tensor)
_INDEX_ARITHMETIC = frozenset({"add", "sub", "mul", "neg", "floor_divide", "remainder", "reshape", "expand",
                               "permute", "identity", "slice", "concat"})
_COMPARISONS = frozenset({"eq", "ne", "lt", "le", "gt", "ge"})
# products that sum over an axis (padding rules): one of data (scores q @ k, attention weights @ v,
# a projection of hidden states a softmax made) holds values, not a pattern of masked positions
_CONTRACTIONS = frozenset({"matmul", "linear", "einsum", "attention"})


def _keeps_values(op: str) -> bool:
    """An op that moves values or does arithmetic on them, making no new pattern of masked
    positions from values that hold none (a comparison, a triangle, a scan can)."""
    return op in ("reshape", "expand", "permute", "identity", "slice") or (
        get_op(op).padding == "pointwise" and op not in _COMPARISONS and op != "where")


def _lower_triangle(t: torch.Tensor) -> bool:
    """Ones (or True) on and below the diagonal of a square last two dims, zeros above; any
    leading dims of size 1 (a causal mask buffer, tril(ones(N, N)).view(1, 1, N, N))."""
    if t.dim() < 2 or t.shape[-1] != t.shape[-2] or t.shape[-1] < 2 or any(e != 1 for e in t.shape[:-2]) \
            or t.is_complex() or t.numel() > 1 << 22:
        return False
    m = t.reshape(t.shape[-2:])
    if m[0, -1] != 0 or m[-1, 0] != 1:     # most square weights fail here, before a full comparison
        return False
    tri = torch.ones(m.shape, dtype=torch.bool).tril()
    return bool((m[tri] == 1).all()) and bool((m[~tri] == 0).all())


def _always_true(n: Node, ins: Sequence[State]) -> bool:
    """`x >= c` (or `>`) where x's lower bound decides it: T5's mask keeps every query with
    arange(seq) >= 0, which masks nothing."""
    if n.op not in ("ge", "gt") or len(ins) != 2 or ins[0].lower is None:
        return False
    c = ins[1].uniform
    return isinstance(c, (int, float)) and not isinstance(c, bool) and (
        ins[0].lower >= c if n.op == "ge" else ins[0].lower > c)


def _twice_padded(states: Sequence[State], axes: Iterable[int] | None = None) -> set[str]:
    """Dims that pad two axes of one of `states` (a query x key or position x position value),
    counting only `axes` when given."""
    out: set[str] = set()
    for s in states:
        along = [f.dim for i, ax in enumerate(s.axes) for f in ax.padded if axes is None or i in axes]
        out.update(d for d in along if along.count(d) >= 2)
    return out


class _Analyzer:
    """The driver: states from types, findings, and one op at a time through its padding rule
    (analysis/padding_rules, named by the op table)."""

    def __init__(self, graph: Graph, padded: Sequence[str], lo: Mapping[str, int], locs: Mapping[str, str]):
        self.types = {}
        for g in [graph] + [n.body for n in graph.iter_nodes(True) if n.body is not None]:
            self.types.update({k: v.type for k, v in g.values.items()})
        self.padded = list(padded)
        self.masked: set[str] = set()      # dims made safe by masked logits (PaddingReport.masked)
        self.cut = False                   # positions_independent: the real rows may come after padded ones
        self.pure: set[str] = set()        # values computed from the mask inputs and constants alone
        self.varying: dict[str, frozenset[int]] = {}   # axes along which a value's masked pattern may vary
        self.always_true: set[str] = set()     # positional values true everywhere (T5's arange(seq) >= 0)
        self.sized: dict[str, set[str]] = {}   # padded dims whose size a value's real elements depend on
        # a lower-triangular constant (nanoGPT's `bias` buffer) and its slices from 0: the axes sliced
        self.triangles: dict[str, set[int]] = {}
        self.query_key: set[str] = set()   # dims a pure mask value has two padded axes along
        self.positional: set[str] = set()  # values computed from no input (aranges, their comparisons)
        self.triangle: set[str] = set()    # dims a positional value has two padded axes along (causal)
        self.softmax_masked: set[str] = set()   # dims a softmax written out is safe along by its mask
        self.softmax_qk: set[str] = set()   # ... whose masked pattern may vary along its rows too
        self.lo = dict(lo)
        self.locs = locs

    def shape(self, value: str) -> tuple[Dim, ...]:
        return self.types[value].shape

    def always_real(self, ax: Axis) -> int | None:
        """How many leading positions of `ax` are real for every admissible request (an axis
        padded at the end along one dim: its smallest size), or None (not such an axis)."""
        f = ax.single
        off = prefix_offset(f.extent, f.dim) if f is not None and f.prefix else None
        return None if off is None else self.lo.get(f.dim, 1) - off

    # -- construction of states from types
    def fresh_axis(self, extent: Dim, content: Content) -> Axis:
        """An axis that appears with a padded extent (expand, full, arange, slice of a param)."""
        dims = [d for d in self.padded if d in symbols(extent)]
        if not dims:
            return plain(extent)
        d = dims[0]
        if len(dims) == 1:      # c x d: its real positions are its first c x d_real, the layout of [d, c]
            sym = next(x for x in sympy.sympify(extent).free_symbols if x.name == d)
            c = sympy.sympify(extent) / sym                   # 4*batch / batch is 4 as built
            if c.is_Integer and int(c) > 1:   # (DeBERTa's position index expanded to batch x heads rows)
                return Axis((Factor(sym, d, content, True), Factor(int(c))))
        prefix = len(dims) == 1 and prefix_offset(extent, d) is not None
        return Axis((Factor(extent, d, content, prefix),))

    def from_type(self, shape: Sequence[Dim], content: Content = GARBAGE) -> tuple[Axis, ...]:
        return tuple(self.fresh_axis(e, content) for e in shape)

    def finding(self, dim: str, n: Node, reason: str) -> Finding:
        out = n.outputs[0] if n.outputs else "?"
        loc = self.locs.get(out) or (n.attrs.get("loc") if n.op == "fallback" else None)
        op = n.attrs.get("target", n.op) if n.op == "fallback" else n.op
        return Finding(dim, op, out, reason, loc)

    # -- driver
    def run(self, g: Graph, states: dict[str, State]) -> dict[str, State]:
        for n in g.nodes:
            ins = [states[i] for i in n.inputs]
            taint: dict[str, Finding] = {}
            for s in ins:
                for d, f in s.taint.items():
                    taint.setdefault(d, f)
            outs = self.node(n, ins, taint)
            positional = all(i in self.positional or i in g.constants for i in n.inputs) and n.op != "fallback"
            if positional and (_always_true(n, ins) or n.op in _KEEPS_TRUE and n.inputs and all(
                    i in self.always_true or states[i].uniform is True for i in n.inputs)):
                self.always_true.update(n.outputs)
            tracked = [i for i in n.inputs if i in self.varying]
            for o, st in zip(n.outputs, outs):
                if o in self.always_true or st.uniform is not UNKNOWN:
                    if tracked or positional:
                        self.varying[o] = frozenset()
                elif any(self.varying[i] for i in tracked):
                    self.varying[o] = self._varying(n, o, g)
                elif positional and not (tracked and _keeps_values(n.op)):
                    # made from positions (a triangle, a slice of a mask buffer, a comparison): a pattern
                    self.varying[o] = frozenset(i for i, e in enumerate(self.shape(o)) if not is_one(e))
                elif tracked:              # arithmetic on values that hold no pattern (a position bias)
                    self.varying[o] = frozenset()
            self._follow_sizes(n, taint)
            if n.inputs and all(i in self.pure or i in g.constants for i in n.inputs) and \
                    any(i in self.pure for i in n.inputs):
                self.pure.update(n.outputs)
                for o, st in zip(n.outputs, outs):      # two axes along which the mask itself varies
                    self.query_key.update(_twice_padded([st], self.varying.get(o, frozenset())))
            if positional:
                self.positional.update(n.outputs)
                self.triangle.update(_twice_padded(outs))
            for o, s in zip(n.outputs, outs):
                for d, f in taint.items():
                    s.taint.setdefault(d, f)
                self.check_gaps(n, o, s)
                states[o] = s
        return states

    def _follow_sizes(self, n: Node, taint: dict[str, Finding]) -> None:
        """A padded dim's size used as a value (`torch.full((B,), T)`, `arange(T - 1, -1, -1)`,
        `arange(T) == T - 1`, `T - arange(T)`) is the bucket's once padded: the value may move
        through integer index arithmetic and layout ops and index a tensor (its padded layout
        is the bucket's too), anything else that reads it (a comparison, a cast to float, an op
        of its own, an output) makes the dim unsafe to pad."""
        index_args = {"embedding": 1, "gather": 1, "index_select": 1, "index": 1}.get(n.op)
        data = n.inputs if index_args is None else n.inputs[:index_args]
        dims = set().union(*(self.sized.get(i, set()) for i in data)) if data else set()
        keeps = n.op in _INDEX_ARITHMETIC or (n.op == "cast" and n.attrs.get("dtype") in ("i64", "i32"))
        if dims and not keeps and index_args is None:
            for d in sorted(dims):
                taint.setdefault(d, self.finding(d, n, f"the size of padded dim {d} used as a value (padded, it "
                                                       "is the bucket's size, not the request's)"))
            return
        dims |= self._sizes_read(n)
        if dims:
            for o in n.outputs:
                self.sized[o] = dims

    def _sizes_read(self, n: Node) -> set[str]:
        """Padded dims an op reads as a value: an arange's start, a `$dim` argument of an
        eager island that is not a size list (full's fill value, arange's start)."""
        if n.op == "arange":
            return symbols(normalize_dim(n.attrs.get("start", 0))) & set(self.padded)
        if n.op != "fallback":
            return set()
        args = list(n.attrs.get("args", [])) + list(n.attrs.get("kwargs", {}).values())
        return {d for a in args if isinstance(a, dict) and "$dim" in a
                for d in symbols(normalize_dim(a["$dim"])) & set(self.padded)}

    def _varying(self, n: Node, out: str, g: Graph) -> frozenset[int]:
        """The axes of `out` along which the pattern of masked positions may vary (with a mask
        input, or with positions): through broadcasting elementwise ops, expand, permute and
        unsqueeze axis by axis (a mask over keys broadcast along queries and added to a position
        bias varies along the keys only); a lookup in a constant table of finite values that are
        no mask fill (T5's position bias picked by relative position buckets) holds none, nor does
        a product with the model's data (the hidden states after a masked attention: the next
        layer's scores are data again, and only what is added to them masks); every axis after
        any other op."""
        shape = self.shape(out)
        rank = len(shape)
        op = n.op
        table = g.constants.get(n.inputs[0]) if get_op(op).padding == "gather" else None
        if table is not None and table.is_floating_point() and bool(torch.isfinite(table).all()) and \
                float(table.min()) > -1e4:       # finite values picked by position: no masked entry among them
            return frozenset()
        if get_op(op).padding in _CONTRACTIONS and any(self._data(i, g) for i in n.inputs):
            return frozenset()
        if op == "permute":
            src = self.varying.get(n.inputs[0], frozenset())
            return frozenset(i for i, p in enumerate(n.attrs["perm"]) if p in src)
        if op == "reshape":                 # an unsqueeze or squeeze: the other axes keep their order
            src, ishape = self.varying.get(n.inputs[0], frozenset()), self.shape(n.inputs[0])
            kept_in = [j for j, e in enumerate(ishape) if not is_one(e)]
            kept_out = [i for i, e in enumerate(shape) if not is_one(e)]
            if len(kept_in) == len(kept_out) and all(same_dim(ishape[j], shape[i]) for j, i in zip(kept_in, kept_out)):
                return frozenset(i for j, i in zip(kept_in, kept_out) if j in src)
        if op == "expand" or get_op(op).padding == "pointwise":
            axes = set()
            for i in n.inputs if op != "expand" else n.inputs[:1]:
                src, ishape = self.varying.get(i, frozenset()), self.shape(i)
                lead = rank - len(ishape)
                axes |= {j + lead for j in src if not is_one(ishape[j]) or is_one(shape[j + lead])}
            return frozenset(axes)
        return frozenset(range(rank))

    def _data(self, name: str, g: Graph) -> bool:
        """A value computed from the model's data (not from the masks, positions and constants alone)."""
        return name not in self.pure and name not in self.positional and name not in g.constants

    def constant(self, g: Graph, name: str) -> State:
        t = g.constants[name]
        if _lower_triangle(t):
            self.triangles[name] = set()          # a causal mask buffer: slices of it are a triangle
        uniform = UNKNOWN
        if t.numel() == 1:
            v = t.reshape(()).item()
            uniform = bool(v) if t.dtype == torch.bool else float(v) if t.is_floating_point() else int(v)
        wide = t.to(torch.int64) if t.dtype in (torch.uint16, torch.uint32) else t   # no min() kernel for them
        ordered = 0 < t.numel() and not t.is_complex() and t.dtype != torch.uint64
        lower = float(wide.min()) if ordered else None
        upper = float(wide.max()) if ordered else None
        return State(tuple(plain(e) for e in t.shape), uniform=uniform, lower=lower, upper=upper)

    def check_gaps(self, n: Node, out: str, s: State) -> None:
        """Conservative net under every rule: an axis whose extent mentions a padded dim that no
        rule tracked (or a rank the rules got wrong) taints the dim."""
        shape = self.shape(out)
        if len(s.axes) != len(shape):
            s.axes = tuple(Axis((Factor(e, d, GARBAGE, False),)) if (d := next(
                (p for p in self.padded if p in symbols(e)), None)) else plain(e) for e in shape)
            for d in {f.dim for a in s.axes for f in a.padded}:
                s.taint.setdefault(d, self.finding(d, n, "graphmode cannot follow padding through this op"))
            return
        for axis, e in zip(s.axes, shape):
            missing = (symbols(e) & set(self.padded)) - {f.dim for f in axis.padded}
            for d in sorted(missing):
                s.taint.setdefault(d, self.finding(d, n, "graphmode cannot follow padding through this op"))

    def taint(self, taint: dict[str, Finding], n: Node, axes: Iterable[Axis], reason: str) -> None:
        for a in axes:
            for f in a.padded:
                taint.setdefault(f.dim, self.finding(f.dim, n, reason.format(dim=f.dim)))

    def node(self, n: Node, ins: list[State], taint: dict[str, Finding]) -> list[State]:
        """The op's padding rule, as its op table entry names it (an op that names none is opaque)."""
        return RULES[get_op(n.op).padding or "opaque"](self, n, ins, taint)

    def garbage(self, axes: Iterable[Axis]) -> tuple[Axis, ...]:
        return tuple(Axis(tuple(Factor(f.extent, f.dim, GARBAGE if f.dim else f.content, f.prefix)
                                for f in ax.factors)) for ax in axes)


def analyze_padding(graph: Graph, pad_values: Mapping[str, Any], padded_dims: Iterable[str], *,
                    locs: Mapping[str, str] | None = None, arbitrary: bool = False,
                    masks: Iterable[str] = (), unknown: Iterable[str] = ()) -> PaddingReport:
    """Per-dim verdict for padding the graph's inputs along `padded_dims` with `pad_values`.
    `arbitrary`: the padded positions hold any values, anywhere along the dim (not only after
    the real ones), and a request may have no real position at all (see `positions_independent`).
    `unknown`: inputs whose padded positions are taken to hold any value (verdict.py asks which
    inputs a masked verdict rests on: those the model builds its mask from)."""
    unknown = set(unknown)
    padded = [d for d in padded_dims]
    lo = {d: (0 if arbitrary and d in padded else r[0]) for d, r in graph.dims.items()}
    an = _Analyzer(graph, padded, lo, locs or {})
    an.cut = arbitrary
    an.pure = {m for m in masks if m in graph.inputs}
    an.varying = {m: frozenset(range(len(graph.values[m].type.shape))) for m in an.pure}
    states: dict[str, State] = {}
    for name in graph.inputs:
        ty = graph.values[name].type
        pv = pad_values.get(name, 0)
        if ty.dtype == "bool":
            pv = bool(pv)
        states[name] = State(tuple(
            Axis((Factor(e, e.name, GARBAGE if arbitrary or name in unknown else const(pv), True),))
            if not isinstance(e, int) and e.is_Symbol and e.name in padded
            else an.fresh_axis(e, GARBAGE) for e in ty.shape))
    for name in graph.constants:
        states[name] = an.constant(graph, name)
    an.run(graph, states)
    findings: dict[str, list[Finding]] = {d: [] for d in padded}
    for out in graph.outputs:
        s = states[out]
        for d in sorted(an.sized.get(out, ())):
            fd = Finding(d, "output", out, f"the output holds the size of padded dim {d} as a value (padded, it "
                                          "is the bucket's size, not the request's)", an.locs.get(out))
            if fd not in findings[d]:
                findings[d].append(fd)
        for d, f in s.taint.items():
            if d in findings and f not in findings[d]:
                findings[d].append(f)
        for i, ax in enumerate(s.axes):
            if not ax.padded:
                continue
            # cut along the dim (arbitrary), outputs are rejoined along an axis that is the dim alone
            if not (ax.single is not None and ax.single.prefix if arbitrary else ax.sliceable):
                for g in ax.padded:
                    why = (f"output axis {i} holds padding of {', '.join(sorted({p.dim for p in ax.padded}))} "
                           "in a layout that cannot be sliced back")
                    fd = Finding(g.dim, "output", out, why, an.locs.get(out))
                    if fd not in findings[g.dim]:
                        findings[g.dim].append(fd)
    all_dims = list(graph.dims) or padded
    report = PaddingReport({d: DimVerdict(d, d in padded, findings.get(d, [])) for d in all_dims})
    report.masked = [d for d in padded if d in an.masked and report.dims[d].safe]
    # a causal mask (a position triangle) under a softmax written out: a query row whose every
    # earlier position is padding (left padding) is masked whole, and with a finite fill
    # (finfo.min) eager spreads it over every key, the bucket's padded ones too; attention as
    # one sdpa gives such a row 0 either way under a bool mask (a float query x key mask: the
    # sdpa rule adds its dim to `query_key`). Only where the softmax's masked pattern varies along
    # its rows: T5's relative positions are a position x position value too, but looked up in a
    # table of finite biases and added to a key mask, its softmax rows are masked by keys alone
    report.query_key = [d for d in report.masked if d in an.query_key
                        or (d in an.triangle and d in an.softmax_qk)]
    return report


def positions_independent(graph: Graph, dim: str) -> bool:
    """Whether every output position along `dim` is computed from the inputs at that position
    alone (a batch whose rows never meet), so a request may be cut along `dim` into smaller
    buckets and its outputs concatenated. Proved as padding safety of `dim` where the padded
    positions hold arbitrary values, before the real ones as well as after (a later piece's
    rows come after an earlier piece's), and no position need be real: any op that reads
    across the dim — a reduction or contraction over it, a gather, a shift, a slice of fixed
    positions, a sum over padding that only zeros make harmless, a prefix scan or causal
    attention along it (safe for padding at the end, not for a cut) — then reads a position
    it knows nothing about and taints the dim."""
    if dim not in graph.dims:
        return False
    return analyze_padding(graph, {}, [dim], arbitrary=True).dims[dim].safe
