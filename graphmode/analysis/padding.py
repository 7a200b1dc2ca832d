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

Assumption (stated in the report): padded positions compute finite values. The analysis
is conservative where it cannot follow a value (unknown ops, reshapes that split a padded
axis, eager islands): it refuses rather than guess.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

import sympy
import torch

from graphmode.ir.graph import Graph, Node
from graphmode.ir.ops import get_op, norm_axis
from graphmode.ir.types import DTYPES, Dim, normalize_dim

NEG_THRESHOLD = -1e4      # exp(x - max) underflows to exactly 0 in f32 (and is < 1e-4000 relative below it)
_UNKNOWN = object()

# ---------------------------------------------------------------------------------- lattice


@dataclass(frozen=True)
class Content:
    """What padded positions hold. `real`/`lt_real` only describe an operand that is not padded
    along the axis in question (its real values broadcast onto the padded positions)."""

    kind: str           # const | neg_huge | ge_real | garbage | real | lt_real
    value: Any = None   # const: the scalar; ge_real / lt_real: the dim

    def __str__(self) -> str:
        return {"const": f"{self.value!r}", "neg_huge": "masked (<= -1e4)", "ge_real": f">= real {self.value}",
                "garbage": "unknown", "real": "real data", "lt_real": f"< real {self.value}"}[self.kind]


GARBAGE = Content("garbage")
NEG_HUGE = Content("neg_huge")
REAL = Content("real")


def const(v: Any) -> Content:
    if isinstance(v, float) and math.isinf(v) and v < 0:
        return NEG_HUGE
    return Content("const", v)


@dataclass(frozen=True)
class Factor:
    """One factor of an axis extent. `dim` set: this factor carries that dim's padding."""

    extent: Dim
    dim: str | None = None
    content: Content = GARBAGE
    prefix: bool = True        # the real positions are exactly the first extent(real dims) ones


@dataclass(frozen=True)
class Axis:
    factors: tuple[Factor, ...]    # more than one only after a reshape merged axes

    @property
    def padded(self) -> list[Factor]:
        return [f for f in self.factors if f.dim is not None]

    @property
    def single(self) -> Factor | None:
        """The axis's one padded factor when it is the whole axis (sliceable, reducible)."""
        return self.factors[0] if len(self.factors) == 1 and self.factors[0].dim is not None else None


def plain(extent: Dim) -> Axis:
    return Axis((Factor(extent),))


@dataclass(frozen=True)
class Finding:
    """Why padding along `dim` is unsafe: the op and value where it happens."""

    dim: str
    op: str
    value: str
    reason: str
    loc: str | None = None

    def describe(self) -> str:
        at = f" at {self.loc}" if self.loc else ""
        return f"{self.op} -> %{self.value}{at}: {self.reason}"


@dataclass
class State:
    axes: tuple[Axis, ...]
    uniform: Any = _UNKNOWN                    # every element equals this scalar
    # value == sum of coeff * (index along axis): an arange, or a flattened index built from them
    affine: tuple[tuple[int, Any], ...] | None = None
    taint: dict[str, Finding] = field(default_factory=dict)
    lower: float | None = None                 # no real element is smaller (bools count as 0/1)
    bound: str | None = None                   # every real element indexes a real position of this dim
    offset: str | None = None                  # affine index plus a term bounded like `bound` (b*seq + argmax)

    def real_content(self) -> Content:
        """This value seen from the padded positions of an axis it does not pad."""
        if self.uniform is not _UNKNOWN:
            return const(self.uniform)
        d = self.iota_dim()
        if d is not None:
            return Content("lt_real", d)
        return REAL

    def iota_dim(self) -> str | None:
        """The padded dim when this value is exactly the index along one of its padded axes."""
        if self.affine and len(self.affine) == 1 and self.affine[0][1] == 1:
            f = self.axes[self.affine[0][0]].single
            return f.dim if f is not None else None
        return None


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
        return {d: {"status": v.status, "findings": [f.__dict__ for f in v.findings]} for d, v in self.dims.items()}


# ---------------------------------------------------------------------------------- helpers


def _is_one(d: Dim) -> bool:
    return isinstance(d, int) and d == 1


def _mul(a: Dim, b: Dim) -> Dim:
    return normalize_dim(sympy.sympify(a) * sympy.sympify(b))


def _eq(a: Dim, b: Dim) -> bool:
    """Dims are kept expanded (ir.types.normalize_dim), so expansion decides equality cheaply."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return a == b or sympy.expand(sympy.sympify(a) - sympy.sympify(b)) == 0


def _divides(part: Dim, whole: Dim) -> bool:
    """`whole / part` is a positive integer (or a polynomial in the dims)."""
    r = sympy.sympify(whole) / sympy.sympify(part)
    if r.is_Integer:
        return int(r) >= 1
    num, den = sympy.fraction(r)
    return den == 1 and not r.is_Rational


def _symbols(d: Dim) -> set[str]:
    return set() if isinstance(d, int) else {s.name for s in d.free_symbols}


def _offset(extent: Dim, d: str) -> int | None:
    """`extent == d - k` for an integer k >= 0: the axis keeps a prefix layout."""
    diff = sympy.expand(sympy.Symbol(d, integer=True, positive=True) - sympy.sympify(extent))
    return int(diff) if diff.is_Integer and int(diff) >= 0 else None


def _is_const(c: Content, v: Any) -> bool:
    return c.kind == "const" and not isinstance(c.value, bool) and c.value == v


def _falsy(c: Content) -> bool:
    """Zero, 0.0, -0.0 or False: the content that makes sums and contractions no-ops."""
    return c.kind == "const" and (c.value is False or (not isinstance(c.value, bool) and c.value == 0))


def _truthy(c: Content) -> bool:
    return c.kind == "const" and (c.value is True or (not isinstance(c.value, bool) and c.value not in (0,)
                                                      and not (isinstance(c.value, float) and math.isnan(c.value))))


def _neg_huge(c: Content) -> bool:
    return c.kind == "neg_huge" or (c.kind == "const" and not isinstance(c.value, bool)
                                    and isinstance(c.value, (int, float)) and c.value <= NEG_THRESHOLD)


def _finite(c: Content) -> bool:
    """Finite and not hugely positive (garbage is assumed finite)."""
    if c.kind == "const":
        return isinstance(c.value, bool) or (isinstance(c.value, (int, float)) and math.isfinite(c.value)
                                             and c.value < -NEG_THRESHOLD)
    return c.kind != "neg_huge"


def _padded_view(c: Content) -> Content:
    """A content taken from a non-padded operand becomes plain padded-position content."""
    return GARBAGE if c.kind in ("real", "lt_real") else c


def _scalar(op: str, *vals: Any) -> Any:
    ts = [torch.tensor(v, dtype=torch.bool if isinstance(v, bool) else torch.float64) for v in vals]
    out = get_op(op).ref(ts, {}, {})[0]
    v = out.item()
    return bool(v) if out.dtype == torch.bool else float(v)


_CMP = {"ge": (True, True, False), "gt": (True, True, False), "le": (False, False, True),
        "lt": (False, False, True), "eq": (False, False, False), "ne": (True, True, True)}


def _compare(op: str, a: Content, b: Content, lo: Mapping[str, int]) -> Content:
    """Comparisons where one side is past the real end (arange in padding) and the other
    is known below it. The table gives `a > b`-style truth for ge/gt, and le/lt; eq false, ne true."""
    def above(x: Content, y: Content) -> bool:   # every x > every y at these positions
        if x.kind != "ge_real":
            return False
        if y.kind == "lt_real":
            return y.value == x.value
        return (y.kind == "const" and isinstance(y.value, (int, float)) and not isinstance(y.value, bool)
                and y.value < lo.get(x.value, 1))
    if above(a, b):
        return const(op in ("ge", "gt", "ne"))
    if above(b, a):
        return const(op in ("le", "lt", "ne"))
    return GARBAGE


def _binary(op: str, a: Content, b: Content, lo: Mapping[str, int]) -> Content:
    if a.kind == "const" and b.kind == "const":
        try:
            return const(_scalar(op, a.value, b.value))
        except Exception:  # noqa: BLE001 - an op the scalar path cannot evaluate
            return GARBAGE
    if op in _CMP:
        return _compare(op, a, b, lo)
    if op == "add":
        if (_neg_huge(a) and (_finite(b) or _neg_huge(b))) or (_neg_huge(b) and _finite(a)):
            return NEG_HUGE
        if _is_const(a, 0):
            return _padded_view(b)
        if _is_const(b, 0):
            return _padded_view(a)
    if op == "sub":
        if _neg_huge(a) and _finite(b):
            return NEG_HUGE
        if _is_const(b, 0):
            return _padded_view(a)
    if op == "mul":
        for x, y in ((a, b), (b, a)):
            if _falsy(x) and _finite(y):
                return const(0.0)
            if x.kind == "const" and x.value == 1:
                return _padded_view(y)
            if _neg_huge(x) and y.kind == "const" and not isinstance(y.value, bool) and y.value >= 1e-2:
                return NEG_HUGE
    if op == "div":
        if b.kind == "const" and not isinstance(b.value, bool):
            if b.value == 1:
                return _padded_view(a)
            if _falsy(a) and b.value != 0:
                return const(0.0)
            if _neg_huge(a) and 0 < b.value <= 1e2:
                return NEG_HUGE
    if op == "logical_and":
        if _falsy(a) or _falsy(b):
            return const(False)
        if _truthy(a):
            return _padded_view(b)
        if _truthy(b):
            return _padded_view(a)
    if op == "logical_or":
        if _truthy(a) or _truthy(b):
            return const(True)
        if _falsy(a):
            return _padded_view(b)
        if _falsy(b):
            return _padded_view(a)
    return GARBAGE


_UNARY_HUGE = {"exp": 0.0, "sigmoid": 0.0, "relu": 0.0, "tanh": -1.0, "erf": -1.0, "gelu": -0.0, "silu": -0.0}


def _unary(op: str, c: Content, attrs: Mapping[str, Any]) -> Content:
    if op == "identity":
        return c
    if c.kind == "const":
        try:
            if op == "cast":
                return const(torch.tensor(c.value).to(DTYPES[attrs["dtype"]]).item())
            t = torch.tensor(c.value, dtype=torch.bool if isinstance(c.value, bool) else torch.float64)
            out = get_op(op).ref([t], attrs, {})[0]
            return const(bool(out.item()) if out.dtype == torch.bool else float(out.item()))
        except Exception:  # noqa: BLE001
            return GARBAGE
    if _neg_huge(c):
        if op in _UNARY_HUGE:
            return const(_UNARY_HUGE[op])
        if op == "cast" and attrs.get("dtype") in ("f32", "f64", "f16", "bf16"):
            return NEG_HUGE
        if op == "clamp":
            return const(float(attrs["min"])) if attrs.get("min") is not None else NEG_HUGE
    if c.kind == "ge_real" and op == "cast" and attrs.get("dtype") in ("i64", "i32", "f32", "f64"):
        return c
    return GARBAGE


def _join(cs: Iterable[Content]) -> Content:
    cs = list(cs)
    return cs[0] if cs and all(c == cs[0] for c in cs) else GARBAGE


# ---------------------------------------------------------------------------------- analysis


# ATen ops that treat each sample (axis 0) independently and mix only the other axes
_PER_SAMPLE_ATEN = {"max_pool2d", "max_pool2d_with_indices", "avg_pool2d", "adaptive_avg_pool2d",
                    "adaptive_max_pool2d", "conv1d", "conv2d", "conv3d", "convolution", "conv_transpose2d",
                    "layer_norm", "native_layer_norm", "group_norm", "native_group_norm", "instance_norm",
                    "upsample_nearest2d", "upsample_bilinear2d", "pixel_shuffle", "_native_batch_norm_legit_no_training"}


def _island_dims(target: str, args: list, kwargs: Mapping[str, Any], rank: int) -> tuple[bool, list[int] | None]:
    """What an eager island's ATen op does to axes, from the op's own tags and schema:
    (pointwise, dims it works along). dims None: unknown (the op takes no `dim`/`dims`)."""
    from graphmode.ir.fallback import resolve_target
    try:
        op = resolve_target(target)
    except Exception:  # noqa: BLE001 - not an ATen op we can look up
        return False, None
    if torch.Tag.pointwise in op.tags:
        return True, []
    for i, arg in enumerate(op._schema.arguments):
        if arg.name not in ("dim", "dims"):
            continue
        v = args[i] if i < len(args) else kwargs.get(arg.name, arg.default_value)
        vals = v if isinstance(v, (list, tuple)) else [v]
        if not vals or not all(isinstance(d, int) and -rank <= d < max(rank, 1) for d in vals):
            return False, None
        return False, sorted({d % rank for d in vals}) if rank else []
    return False, None


class _Analyzer:
    def __init__(self, graph: Graph, padded: Sequence[str], lo: Mapping[str, int], locs: Mapping[str, str]):
        self.types = {}
        for g in [graph] + [n.body for n in graph.iter_nodes(True) if n.body is not None]:
            self.types.update({k: v.type for k, v in g.values.items()})
        self.padded = list(padded)
        self.lo = dict(lo)
        self.locs = locs

    def shape(self, value: str) -> tuple[Dim, ...]:
        return self.types[value].shape

    # -- construction of states from types
    def fresh_axis(self, extent: Dim, content: Content) -> Axis:
        """An axis that appears with a padded extent (expand, full, arange, slice of a param)."""
        dims = [d for d in self.padded if d in _symbols(extent)]
        if not dims:
            return plain(extent)
        d = dims[0]
        prefix = len(dims) == 1 and _offset(extent, d) is not None
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
            if n.op == "fused":
                body = self.run(n.body, {**{k: states[k] for k in n.inputs},
                                         **{k: self.constant(n.body, k) for k in n.body.constants}})
                outs = [body[o] for o in n.outputs]
            else:
                outs = self.node(n, ins, taint)
            for o, s in zip(n.outputs, outs):
                for d, f in taint.items():
                    s.taint.setdefault(d, f)
                self.check_gaps(n, o, s)
                states[o] = s
        return states

    def constant(self, g: Graph, name: str) -> State:
        t = g.constants[name]
        uniform = _UNKNOWN
        if t.numel() == 1:
            v = t.reshape(()).item()
            uniform = bool(v) if t.dtype == torch.bool else float(v) if t.is_floating_point() else int(v)
        lower = float(t.min()) if 0 < t.numel() and not t.is_complex() else None
        return State(tuple(plain(e) for e in t.shape), uniform=uniform, lower=lower)

    def check_gaps(self, n: Node, out: str, s: State) -> None:
        """Conservative net under every rule: an axis whose extent mentions a padded dim that no
        rule tracked (or a rank the rules got wrong) taints the dim."""
        shape = self.shape(out)
        if len(s.axes) != len(shape):
            s.axes = tuple(Axis((Factor(e, d, GARBAGE, False),)) if (d := next(
                (p for p in self.padded if p in _symbols(e)), None)) else plain(e) for e in shape)
            for d in {f.dim for a in s.axes for f in a.padded}:
                s.taint.setdefault(d, self.finding(d, n, "graphmode cannot follow padding through this op"))
            return
        for axis, e in zip(s.axes, shape):
            missing = (_symbols(e) & set(self.padded)) - {f.dim for f in axis.padded}
            for d in sorted(missing):
                s.taint.setdefault(d, self.finding(d, n, "graphmode cannot follow padding through this op"))

    def taint(self, taint: dict[str, Finding], n: Node, axes: Iterable[Axis], reason: str) -> None:
        for a in axes:
            for f in a.padded:
                taint.setdefault(f.dim, self.finding(f.dim, n, reason.format(dim=f.dim)))

    # -- one node
    def node(self, n: Node, ins: list[State], taint: dict[str, Finding]) -> list[State]:  # noqa: C901 - one table
        op, a = n.op, n.attrs
        kind = get_op(op).kind
        out_shape = self.shape(n.outputs[0])
        if op == "fallback":
            return self.fallback(n, ins, taint)
        if kind == "elementwise" and op != "where" and len(ins) == 1:
            s = ins[0]
            axes = tuple(Axis(tuple(Factor(f.extent, f.dim, _unary(op, f.content, a) if f.dim else f.content, f.prefix)
                                    for f in ax.factors)) for ax in s.axes)
            uniform = _UNKNOWN
            if s.uniform is not _UNKNOWN:
                c = _unary(op, const(s.uniform), a)
                uniform = c.value if c.kind == "const" else _UNKNOWN
            keep = op == "identity" or (op == "cast" and a.get("dtype") in ("i64", "i32"))
            return [State(axes, uniform, s.affine if keep else None, lower=self.unary_lower(op, a, s),
                          bound=s.bound if keep else None, offset=s.offset if keep else None)]
        if kind == "elementwise":
            return [self.elementwise(n, ins)]
        if op in ("sum", "mean", "amax", "amin"):
            return [self.reduce(n, ins[0], taint)]
        if op in ("softmax", "log_softmax", "cumsum"):
            return [self.along(n, ins[0], taint)]
        if op in ("layer_norm", "batch_norm"):
            x = ins[0]
            k = a.get("normalized_rank", 1) if op == "layer_norm" else None
            reduced = x.axes[len(x.axes) - k:] if op == "layer_norm" else x.axes[1:2]
            self.taint(taint, n, reduced, "normalisation over padded dim {dim}")
            self.taint(taint, n, [ax for s in ins[1:] for ax in s.axes], "padded normalisation parameters")
            return [State(self.garbage(x.axes))]
        if op == "linear":
            return [self.linear(n, ins, taint)]
        if op == "matmul":
            return [self.matmul(n, ins, taint)]
        if op == "sdpa":
            return [self.sdpa(n, ins, taint)]
        if kind in ("conv", "pool"):
            x = ins[0]
            self.taint(taint, n, x.axes[1:], "convolution/pooling window over padded dim {dim}")
            self.taint(taint, n, [ax for s in ins[1:] for ax in s.axes], "padded convolution weights")
            return [State((self.garbage(x.axes[:1]) + self.from_type(out_shape[1:])))]
        if op == "reshape":
            return [self.reshape(n, ins[0], out_shape, taint)]
        if op == "permute":
            s = ins[0]
            perm = list(a["perm"])
            affine = tuple((perm.index(ax), c) for ax, c in s.affine) if s.affine else None
            return [State(tuple(s.axes[p] for p in perm), s.uniform, affine, bound=s.bound, offset=s.offset)]
        if op == "expand":
            return [self.expand(ins[0], out_shape)]
        if op == "slice":
            return [self.slice(n, ins[0], out_shape, taint)]
        if op == "concat":
            return [self.concat(n, ins, out_shape)]
        if op in ("embedding", "index_select", "index", "gather"):
            return [self.gather(n, ins, out_shape, taint)]
        if op in ("argmax", "argmin"):
            return [self.argreduce(n, ins[0], taint)]
        if op in ("pad", "roll"):
            return [self.shift(n, ins[0], out_shape, taint)]
        if op in ("triu", "tril"):
            return [self.triangle(n, ins[0])]
        if op == "full":
            v = a["value"]
            v = bool(v) if a.get("dtype") == "bool" else v
            return [State(self.from_type(out_shape, const(v)), uniform=v,
                          lower=float(v) if isinstance(v, (int, float)) else None)]
        if op == "arange":
            return [self.arange(a, out_shape)]
        # an op without a rule: conservative
        for s in ins:
            self.taint(taint, n, s.axes, f"no padding rule for {op} over padded dim {{dim}}")
        return [State(self.from_type(self.shape(o))) for o in n.outputs]

    @staticmethod
    def unary_lower(op: str, a: Mapping[str, Any], s: State) -> float | None:
        """A lower bound on real values, kept where an op keeps it (argmax over a padded axis
        is safe when the padding is at most the smallest real value)."""
        if op in ("relu", "abs", "exp", "sigmoid", "sqrt", "logical_not"):
            return 0.0
        if op == "clamp" and a.get("min") is not None:
            return float(a["min"]) if s.lower is None else max(float(a["min"]), s.lower)
        if op in ("identity", "cast"):
            return s.lower
        return None

    def garbage(self, axes: Iterable[Axis]) -> tuple[Axis, ...]:
        return tuple(Axis(tuple(Factor(f.extent, f.dim, GARBAGE if f.dim else f.content, f.prefix)
                                for f in ax.factors)) for ax in axes)

    def fallback(self, n: Node, ins: list[State], taint: dict[str, Finding]) -> list[State]:
        """Eager islands: pointwise ops broadcast like elementwise ones; an op along `dim` keeps
        the other axes independent (same shape in and out); anything else is opaque."""
        target = str(n.attrs.get("target", ""))
        shapes = [self.shape(o) for o in n.outputs]
        if len(shapes) == 1 and ins:
            rank = len(shapes[0])
            pointwise, along = _island_dims(target, list(n.attrs.get("args", [])), n.attrs.get("kwargs", {}), rank)
            same_shape = pointwise or (along is not None and all(len(s.axes) == rank for s in ins))
            if same_shape:
                axes = []
                for i, e in enumerate(shapes[0]):
                    src = next((s.axes[j] for s in ins if (j := i - (rank - len(s.axes))) >= 0
                                and s.axes[j].padded), None)
                    if src is not None and i in (along or []):
                        self.taint(taint, n, [src], f"eager island {target} along padded dim {{dim}}")
                    axes.append(self.garbage([src])[0] if src is not None and i not in (along or [])
                                else self.fresh_axis(e, GARBAGE))
                return [State(tuple(axes))]
        short = target.split(".")[1] if target.startswith("aten.") and "." in target else target
        if short in _PER_SAMPLE_ATEN and ins and ins[0].axes:
            for s in ins:
                self.taint(taint, n, s.axes[1:] if s is ins[0] else s.axes,
                           f"eager island {target} mixes positions along padded dim {{dim}}")
            lead = self.garbage(ins[0].axes[:1])
            return [State(lead + self.from_type(sh[1:])) if sh else State(()) for sh in shapes]
        for s in ins:
            self.taint(taint, n, s.axes, f"eager island {target} over padded dim {{dim}}: graphmode cannot see "
                                         "how it uses padded positions")
        return [State(self.from_type(sh)) for sh in shapes]

    # -- elementwise with broadcasting
    def elementwise(self, n: Node, ins: list[State]) -> State:
        out_shape = self.shape(n.outputs[0])
        rank = len(out_shape)
        axes = []
        for i, e in enumerate(out_shape):
            present = []
            for s in ins:
                j = i - (rank - len(s.axes))
                ax = s.axes[j] if j >= 0 else None
                present.append(ax if ax is not None and ax.padded else None)
            shaped = next((ax for ax in present if ax is not None), None)
            if shaped is None:
                axes.append(plain(e) if not (_symbols(e) & set(self.padded)) else self.fresh_axis(e, GARBAGE))
                continue
            factors = []
            for k, f in enumerate(shaped.factors):
                if f.dim is None:
                    factors.append(f)
                    continue
                contents = []
                prefix = f.prefix
                for s, ax in zip(ins, present):
                    if ax is None:
                        contents.append(s.real_content())
                    elif len(ax.factors) == len(shaped.factors) and ax.factors[k].dim == f.dim:
                        contents.append(ax.factors[k].content)
                        prefix = prefix and ax.factors[k].prefix
                    else:
                        contents.append(GARBAGE)
                        prefix = False
                factors.append(Factor(f.extent, f.dim, _padded_view(self.combine(n, contents)), prefix))
            axes.append(Axis(tuple(factors)))
        uniform = _UNKNOWN
        if all(s.uniform is not _UNKNOWN for s in ins):
            c = self.combine(n, [const(s.uniform) for s in ins])
            uniform = c.value if c.kind == "const" else _UNKNOWN
        lower = None
        if self.types[n.outputs[0]].dtype == "bool":
            lower = 0.0
        elif n.op in ("add", "mul", "maximum") and all(x.lower is not None for x in ins) and (
                n.op != "mul" or all(x.lower >= 0 for x in ins)):
            lower = {"add": ins[0].lower + ins[1].lower, "mul": 0.0,
                     "maximum": max(ins[0].lower, ins[1].lower)}[n.op]
        affine, offset = self.affine_of(n.op, ins, rank), None
        if affine is None and n.op == "add":      # flat index into a merged axis: b * seq + (a bounded seq index)
            for a_, b_ in ((ins[0], ins[1]), (ins[1], ins[0])):
                if a_.affine is not None and a_.offset is None and b_.bound is not None and b_.affine is None:
                    lead = rank - len(a_.axes)
                    affine, offset = tuple(sorted((ax + lead, c) for ax, c in a_.affine)), b_.bound
        elif affine is not None and n.op in ("add", "sub", "mul"):
            offset = next((x.offset for x in ins if x.offset), None) if n.op != "mul" else None
            if n.op == "mul" and any(x.offset for x in ins):
                affine = None
        return State(tuple(axes), uniform, affine, lower=lower, offset=offset)

    @staticmethod
    def affine_of(op: str, ins: list[State], rank: int) -> tuple[tuple[int, Any], ...] | None:
        """Index arithmetic: a + b, a * c and a - 0 of affine indices stay affine (row-major
        flattening is `b * seq + s`)."""
        def shifted(s: State) -> dict[int, Any] | None:
            if s.affine is None:
                return None
            lead = rank - len(s.axes)
            return {ax + lead: c for ax, c in s.affine}
        if len(ins) != 2:
            return None
        a, b = ins
        fa, fb = shifted(a), shifted(b)
        zero = lambda s: s.uniform is not _UNKNOWN and not isinstance(s.uniform, bool) and s.uniform == 0  # noqa: E731
        if op == "add" and fa is not None and fb is not None:
            out = dict(fa)
            for ax, c in fb.items():
                out[ax] = normalize_dim(sympy.sympify(out.get(ax, 0)) + c)
            return tuple(sorted(out.items()))
        if op in ("add", "sub") and fa is not None and zero(b):
            return tuple(sorted(fa.items()))
        if op == "add" and fb is not None and zero(a):
            return tuple(sorted(fb.items()))
        if op == "mul":
            for f, other in ((fa, b), (fb, a)):
                u = other.uniform
                if f is not None and u is not _UNKNOWN and not isinstance(u, (bool, float)):
                    return tuple(sorted((ax, normalize_dim(sympy.sympify(c) * u)) for ax, c in f.items()))
        return None

    def combine(self, n: Node, cs: list[Content]) -> Content:
        if n.op == "where":
            cond, x, y = cs
            if _truthy(cond):
                return x
            if _falsy(cond):
                return y
            return x if x == y and x.kind not in ("real", "lt_real") else GARBAGE
        if len(cs) != 2:              # three-input pointwise ops (addcmul, lerp): nothing known
            return GARBAGE
        return _binary(n.op, cs[0], cs[1], self.lo)

    # -- reductions
    def reduce(self, n: Node, x: State, taint: dict[str, Finding]) -> State:
        op, a = n.op, n.attrs
        rank = len(x.axes)
        dims = sorted({norm_axis(d, rank) for d in a.get("dims", range(rank))})
        safe = {"sum": _falsy, "amax": _neg_huge,
                "mean": lambda c: False, "amin": lambda c: False}[op]
        any_padded = False
        for i in dims:
            for f in x.axes[i].padded:
                any_padded = True
                if not f.prefix or not safe(f.content):
                    why = {"sum": "sum over padded dim {d} whose padded positions are not zero",
                           "mean": "mean over padded dim {d} (the padded length changes the divisor)",
                           "amax": "max over padded dim {d} whose padded positions are not masked",
                           "amin": "min over padded dim {d}"}[op]
                    taint.setdefault(f.dim, self.finding(f.dim, n, why.format(d=f.dim)))
        keep = a.get("keepdim", False)
        axes = []
        for i, ax in enumerate(x.axes):
            if i in dims:
                if keep:
                    axes.append(plain(1))
                continue
            if any_padded:
                axes.append(self.garbage([ax])[0])
            else:
                axes.append(Axis(tuple(Factor(f.extent, f.dim, self.reduced_content(op, f.content) if f.dim
                                              else f.content, f.prefix) for f in ax.factors)))
        return State(tuple(axes), x.uniform if op != "sum" else _UNKNOWN)

    @staticmethod
    def reduced_content(op: str, c: Content) -> Content:
        if c.kind == "const" and (op != "sum" or _falsy(c)):
            return c
        if op == "amax" and _neg_huge(c):
            return NEG_HUGE
        return GARBAGE

    def along(self, n: Node, x: State, taint: dict[str, Finding]) -> State:
        """softmax / log_softmax / cumsum along one dim."""
        op = n.op
        if not x.axes:
            return State(())
        dim = norm_axis(n.attrs["dim"], len(x.axes))
        axes = list(self.garbage(x.axes))
        ax = x.axes[dim]
        for f in ax.padded:
            if op == "cumsum":
                ok = f.prefix and len(ax.factors) == 1
                why = "scan over padded dim {d} whose padding is not at the end"
            else:
                ok = f.prefix and _neg_huge(f.content)
                why = f"{op} over padded dim {{d}} whose padded positions are not masked"
            if not ok:
                taint.setdefault(f.dim, self.finding(f.dim, n, why.format(d=f.dim)))
        if op != "cumsum" and ax.padded:
            out = const(0.0) if op == "softmax" else NEG_HUGE
            axes[dim] = Axis(tuple(Factor(f.extent, f.dim, out if f.dim else f.content, f.prefix) for f in ax.factors))
        return State(tuple(axes))

    # -- contractions
    def linear(self, n: Node, ins: list[State], taint: dict[str, Finding]) -> State:
        x = ins[0]
        k = x.axes[-1]
        for f in k.padded:
            if not (_falsy(f.content) and f.prefix):
                taint.setdefault(f.dim, self.finding(f.dim, n, f"contraction over padded dim {f.dim} "
                                                               "whose padded positions are not zero"))
        self.taint(taint, n, [ax for s in ins[1:] for ax in s.axes], "padded weights")
        return State(self.garbage(x.axes[:-1]) + (plain(self.shape(n.outputs[0])[-1]),))

    def matmul(self, n: Node, ins: list[State], taint: dict[str, Finding]) -> State:
        a, b = ins
        for side, other in ((a.axes[-1], b.axes[-2]), (b.axes[-2], a.axes[-1])):
            for f in side.padded:
                zero_other = any(_falsy(g.content) and g.prefix for g in other.padded if g.dim == f.dim)
                if not ((_falsy(f.content) and f.prefix) or zero_other):
                    taint.setdefault(f.dim, self.finding(f.dim, n, f"contraction over padded dim {f.dim} "
                                                                   "whose padded positions are not zero"))
        out_shape = self.shape(n.outputs[0])
        batch = self.broadcast_batch([a.axes[:-2], b.axes[:-2]], out_shape[:-2])

        def keep_zero(ax: Axis) -> Axis:
            return Axis(tuple(Factor(f.extent, f.dim, f.content if _falsy(f.content) else GARBAGE, f.prefix)
                              if f.dim else f for f in ax.factors))
        return State(batch + (keep_zero(a.axes[-2]), keep_zero(b.axes[-1])))

    def broadcast_batch(self, groups: list[Sequence[Axis]], out: Sequence[Dim]) -> tuple[Axis, ...]:
        axes = []
        for i, e in enumerate(out):
            src = None
            for grp in groups:
                j = i - (len(out) - len(grp))
                if j >= 0 and grp[j].padded:
                    src = grp[j]
                    break
            axes.append(self.garbage([src])[0] if src is not None else self.fresh_axis(e, GARBAGE))
        return tuple(axes)

    def sdpa(self, n: Node, ins: list[State], taint: dict[str, Finding]) -> State:
        q, k, v = ins[:3]
        mask = ins[3] if len(ins) > 3 else None
        self.taint(taint, n, [q.axes[-1], k.axes[-1]], "attention head dim {dim} is padded")
        keys = {f.dim: f for ax in (k.axes[-2], v.axes[-2]) for f in ax.padded}
        for d, f in keys.items():
            covered = False
            if mask is not None and mask.axes and mask.axes[-1].single is not None:
                m = mask.axes[-1].single
                covered = m.dim == d and m.prefix and (_falsy(m.content) if m.content.kind == "const"
                                                       and isinstance(m.content.value, bool) else _neg_huge(m.content))
            if not covered and n.attrs.get("is_causal"):
                qf = q.axes[-2].single
                covered = (qf is not None and qf.dim == d and qf.prefix and f.prefix
                           and _eq(qf.extent, f.extent))
            if not covered:
                taint.setdefault(d, self.finding(d, n, f"attention over padded keys ({d}) that no mask covers: "
                                                       "declare the attention mask input, or use causal attention"))
        out_shape = self.shape(n.outputs[0])
        groups = [q.axes[:-2], k.axes[:-2], v.axes[:-2]] + ([mask.axes[:-2]] if mask is not None else [])
        batch = self.broadcast_batch(groups, out_shape[:-2])
        return State(batch + self.garbage([q.axes[-2]]) + (plain(out_shape[-1]),))

    # -- shapes
    def reshape(self, n: Node, x: State, out_shape: Sequence[Dim], taint: dict[str, Finding]) -> State:
        queue = [f for ax in x.axes for f in ax.factors if not (_is_one(f.extent) and f.dim is None)]
        axes: list[Axis] = []
        ok = True
        for e in out_shape:
            if _is_one(e):
                axes.append(plain(1))
                continue
            taken: list[Factor] = []
            prod: Dim = 1
            while ok and not _eq(prod, e):
                if not queue:
                    ok = False
                    break
                f = queue.pop(0)
                if _divides(_mul(prod, f.extent), e):
                    taken.append(f)
                    prod = _mul(prod, f.extent)
                    continue
                need = normalize_dim(sympy.sympify(e) / sympy.sympify(prod))
                if f.dim is None and _divides(need, f.extent):      # an unpadded factor splits freely
                    taken.append(Factor(need))
                    queue.insert(0, Factor(normalize_dim(sympy.sympify(f.extent) / sympy.sympify(need))))
                    prod = _mul(prod, need)
                    continue
                ok = False
            if not ok:
                break
            axes.append(Axis(tuple(taken)) if any(f.dim for f in taken) else plain(e))
        if ok and any(f.dim for f in queue):
            ok = False
        if not ok:
            self.taint(taint, n, x.axes, "reshape splits padded dim {dim} in a way graphmode cannot follow")
            return State(self.from_type(out_shape), x.uniform)
        affine = None
        if x.affine is not None:      # follow axes that survive whole (unsqueeze/squeeze-like reshapes)
            moved = {}
            for ax, c in x.affine:
                src = x.axes[ax]
                hits = [i for i, out in enumerate(axes) if out.factors == src.factors and not _is_one(out.factors[0].extent)]
                if len(hits) != 1:
                    moved = None
                    break
                moved[hits[0]] = c
            affine = tuple(sorted(moved.items())) if moved else None
        return State(tuple(axes), x.uniform, affine, bound=x.bound, offset=x.offset)

    def expand(self, x: State, out_shape: Sequence[Dim]) -> State:
        lead = len(out_shape) - len(x.axes)
        axes = []
        for i, e in enumerate(out_shape):
            j = i - lead
            if j >= 0 and not (_is_one(x.axes[j].factors[0].extent) and len(x.axes[j].factors) == 1 and not _is_one(e)):
                axes.append(x.axes[j])
            else:
                axes.append(self.fresh_axis(e, _padded_view(x.real_content())))
        affine = tuple((ax + lead, c) for ax, c in x.affine) if x.affine else None
        return State(tuple(axes), x.uniform, affine, bound=x.bound, offset=x.offset)

    def slice(self, n: Node, x: State, out_shape: Sequence[Dim], taint: dict[str, Finding]) -> State:
        a = n.attrs
        dim = norm_axis(a["dim"], len(x.axes))
        ax = x.axes[dim]
        start, step = a.get("start", 0), a.get("step", 1)
        end = normalize_dim(a.get("end", 2 ** 62))
        axes = list(x.axes)
        out_e = out_shape[dim]
        if not ax.padded:
            axes[dim] = self.fresh_axis(out_e, _padded_view(x.real_content()))
            return State(tuple(axes), x.uniform)
        f = ax.single
        if f is None or not f.prefix or not isinstance(start, int) or start < 0 or step < 1:
            self.taint(taint, n, [ax], "slice of padded dim {dim} that does not keep the padding at the end")
            axes[dim] = self.fresh_axis(out_e, GARBAGE)
            return State(tuple(axes), x.uniform)
        off = _offset(f.extent, f.dim)
        to_end = (isinstance(end, int) and (end >= 2 ** 31 or end < 0)) or (
            not isinstance(end, int) and _offset(end, f.dim) is not None) or _eq(end, f.extent)
        if to_end:
            axes[dim] = Axis((Factor(out_e, f.dim, f.content, True),))
        elif isinstance(end, int) and off is not None and end <= self.lo.get(f.dim, 1) - off:
            axes[dim] = plain(out_e)      # every position read is real for every admissible request
        else:
            taint.setdefault(f.dim, self.finding(f.dim, n, f"slice end {end} reaches past the smallest admissible "
                                                           f"{f.dim} ({self.lo.get(f.dim, 1)}): it can read padding"))
            axes[dim] = self.fresh_axis(out_e, GARBAGE)
        return State(tuple(axes), x.uniform)

    def concat(self, n: Node, ins: list[State], out_shape: Sequence[Dim]) -> State:
        dim = norm_axis(n.attrs["dim"], len(out_shape))
        axes = []
        for i, e in enumerate(out_shape):
            srcs = [s.axes[i] for s in ins]
            padded = [ax for ax in srcs if ax.padded]
            if not padded:
                axes.append(plain(e) if not (_symbols(e) & set(self.padded)) else self.fresh_axis(e, GARBAGE))
            elif i == dim:   # padding lands in the middle of the result
                d = padded[0].padded[0].dim
                axes.append(Axis((Factor(e, d, GARBAGE, False),)))
            else:
                f = padded[0].factors
                same = all(ax.factors == f for ax in srcs)
                axes.append(Axis(f) if same else self.garbage([padded[0]])[0])
        return State(tuple(axes))

    def gather(self, n: Node, ins: list[State], out_shape: Sequence[Dim], taint: dict[str, Finding]) -> State:
        op = n.op
        if op == "embedding":
            table, ids = ins
            self.taint(taint, n, table.axes, "embedding table padded along {dim}")
            return State(self.garbage(ids.axes) + (plain(out_shape[-1]),))
        x = ins[0]
        if not x.axes:               # a 0-d source: every index reads its one element
            return State(self.from_type(out_shape))
        if op == "gather":           # out[..i..] = x[.. idx[..i..] ..] along dim; other axes line up 1:1
            dim = norm_axis(n.attrs["dim"], len(x.axes))
            idx = ins[1]
            for f in x.axes[dim].padded:
                if idx.bound != f.dim:
                    taint.setdefault(f.dim, self.finding(f.dim, n, f"data-dependent gather over padded dim {f.dim}"))
            return State(self.garbage(idx.axes))
        if op == "index_select":
            dim = norm_axis(n.attrs["dim"], len(x.axes))
            idx = ins[1]
            pairs = [(dim, idx, 0)]
        else:
            dims = [norm_axis(d, len(x.axes)) for d in n.attrs["dims"]]
            idx_states = ins[1:]
            pairs = [(d, s, None) for d, s in zip(dims, idx_states)]
        # which output axis of the index broadcast each index runs along, and the content it reads
        bshape_rank = max(len(s.axes) for _, s, _ in pairs)
        content_of: dict[int, Content] = {}
        for d, s, _ in pairs:
            data_ax = x.axes[d]
            if not data_ax.padded:
                continue
            reads = self.unflatten(data_ax, s)
            if reads is None and data_ax.single is not None and s.bound == data_ax.single.dim:
                continue              # the index only names real positions (e.g. an argmax over them)
            if reads is None:
                first = data_ax.padded[0].dim
                taint.setdefault(first, self.finding(first, n, f"data-dependent gather over padded dim {first}"))
                continue
            for ax, c in reads.items():
                content_of[ax + (bshape_rank - len(s.axes))] = c
        b_axes = []
        for i in range(bshape_rank):
            src = None
            for _, s, _ in pairs:
                j = i - (bshape_rank - len(s.axes))
                if j >= 0 and s.axes[j].padded:
                    src = s.axes[j]
                    break
            if src is None:
                b_axes.append(None)
            elif i in content_of and src.single is not None:
                b_axes.append(Axis((Factor(src.single.extent, src.single.dim, content_of[i], src.single.prefix),)))
            else:
                b_axes.append(self.garbage([src])[0])
        if op == "index_select":
            axes = list(self.garbage(x.axes))
            axes[pairs[0][0]] = b_axes[0] or plain(out_shape[pairs[0][0]])
        else:
            dims = [d for d, _, _ in pairs]
            rest = [self.garbage([ax])[0] for i, ax in enumerate(x.axes) if i not in dims]
            if dims == list(range(dims[0], dims[0] + len(dims))):
                before = [self.garbage([ax])[0] for ax in x.axes[:dims[0]]]
                after = [self.garbage([ax])[0] for ax in x.axes[dims[-1] + 1:]]
                mid_start = len(before)
                axes = before + [None] * bshape_rank + after
            else:
                mid_start = 0
                axes = [None] * bshape_rank + rest
            for i, ax in enumerate(b_axes):
                axes[mid_start + i] = ax
            axes = [ax if ax is not None else self.fresh_axis(out_shape[i], GARBAGE) for i, ax in enumerate(axes)]
        return State(tuple(axes))

    def argreduce(self, n: Node, x: State, taint: dict[str, Finding]) -> State:
        """argmax/argmin along a padded axis are safe when the padding can never win: argmax over
        padding no larger than any real value (ties resolve to the first, real, index)."""
        dim = norm_axis(n.attrs["dim"], len(x.axes))
        ax = x.axes[dim]
        bound = None
        for f in ax.padded:
            ok = (n.op == "argmax" and f.prefix and ax.single is f and x.lower is not None and
                  ((f.content.kind == "const" and isinstance(f.content.value, (int, float))
                    and float(f.content.value) <= x.lower) or _neg_huge(f.content)))
            if ok:
                bound = f.dim
            else:
                taint.setdefault(f.dim, self.finding(f.dim, n, f"{n.op} over padded dim {f.dim} could pick a "
                                                               "padded position"))
        axes = [a for i, a in enumerate(self.garbage(x.axes)) if i != dim]
        if n.attrs.get("keepdim"):
            axes.insert(dim, plain(1))
        return State(tuple(axes), lower=0.0, bound=bound)

    def shift(self, n: Node, x: State, out_shape: Sequence[Dim], taint: dict[str, Finding]) -> State:
        """pad / roll move positions along their axes: on a padded axis that breaks the prefix
        layout (roll) or appends after the padding (pad); other axes are untouched."""
        rank = len(x.axes)
        if n.op == "roll":
            moved = {norm_axis(d, rank) for d in n.attrs["dims"]}
        else:
            pads = list(n.attrs["pads"])
            moved = {rank - 1 - i for i in range(len(pads) // 2) if pads[2 * i] or pads[2 * i + 1]}
        axes = list(x.axes)
        for i in moved:
            if axes[i].padded:
                self.taint(taint, n, [axes[i]], f"{n.op} along padded dim {{dim}} moves the padding")
            axes[i] = self.fresh_axis(out_shape[i], GARBAGE)
        return State(tuple(axes), lower=x.lower if n.op == "roll" else None)

    @staticmethod
    def unflatten(data_ax: Axis, idx: State) -> dict[int, Content] | None:
        """When index `idx` reads data axis `data_ax` at exactly the positions its own axes name
        (an arange, or `b * seq + s` into a flattened [batch*seq] axis), the gather only relabels
        axes: index axis -> the padded content it reads. None when it could read anything."""
        if idx.affine is None:
            return None
        coeffs = dict(idx.affine)
        factors = [f for f in data_ax.factors if not _is_one(f.extent)]
        out: dict[int, Content] = {}
        stride: Dim = 1
        if idx.offset is not None:    # the bounded term reads real positions of the innermost factor only
            if not factors or factors[-1].dim != idx.offset or not factors[-1].prefix:
                return None
            stride = factors[-1].extent
            factors = factors[:-1]
        for f in reversed(factors):
            hits = [ax for ax, c in coeffs.items() if _eq(c, stride)]
            if len(hits) != 1:
                return None
            ax = hits[0]
            own = idx.axes[ax]
            if not _eq(own.factors[0].extent if len(own.factors) == 1 else 0, f.extent) or (
                    f.dim is not None and (not f.prefix or own.single is None or own.single.dim != f.dim)):
                return None
            if f.dim is not None:
                out[ax] = f.content
            del coeffs[ax]
            stride = _mul(stride, f.extent)
        return out if not coeffs else None

    def triangle(self, n: Node, x: State) -> State:
        """triu/tril keep or zero positions by index only; real positions stay real. With rows
        and columns padded by one dim (a causal mask), padded columns of real rows are known."""
        k = n.attrs.get("diagonal", 0)
        axes = list(self.garbage(x.axes))
        r, c = x.axes[-2].single, x.axes[-1].single
        if r is not None and c is not None and r.dim == c.dim and r.prefix and c.prefix:
            zero = const(False) if x.uniform is not _UNKNOWN and isinstance(x.uniform, bool) else const(0.0)
            if n.op == "tril":           # keeps j <= i + k
                col = zero if k <= 0 else GARBAGE
                row = r.content if k >= 0 else GARBAGE
            else:                          # triu keeps j >= i + k
                col = c.content if k <= 1 else GARBAGE
                row = zero if k >= 0 else GARBAGE
            axes[-1] = Axis((Factor(c.extent, c.dim, col, True),))
            axes[-2] = Axis((Factor(r.extent, r.dim, row, True),))
        return State(tuple(axes))

    def arange(self, a: Mapping[str, Any], out_shape: Sequence[Dim]) -> State:
        end = normalize_dim(a["end"])
        start, step = a.get("start", 0), a.get("step", 1)
        e = out_shape[0]
        start_d = normalize_dim(start)
        if _eq(e, 1):            # one element: the value `start` (e.g. arange(seq, seq + 1) is `seq`)
            return State((plain(1),), uniform=start_d)
        d = next((p for p in self.padded if not isinstance(end, int) and _eq(end, sympy.Symbol(
            p, integer=True, positive=True))), None)
        if d is not None and start_d == 0 and step == 1:
            return State((Axis((Factor(e, d, Content("ge_real", d), True),)),), affine=((0, 1),), lower=0.0)
        affine = ((0, 1),) if start_d == 0 and step == 1 else None
        lower = float(start_d) if isinstance(start_d, int) and step > 0 else None
        return State((self.fresh_axis(e, GARBAGE),), affine=affine, lower=lower)


def analyze_padding(graph: Graph, pad_values: Mapping[str, Any], padded_dims: Iterable[str], *,
                    locs: Mapping[str, str] | None = None, arbitrary: bool = False) -> PaddingReport:
    """Per-dim verdict for padding the graph's inputs along `padded_dims` with `pad_values`.
    `arbitrary`: the padded positions hold any values and a request may have no real position
    at all (see `positions_independent`)."""
    padded = [d for d in padded_dims]
    lo = {d: (0 if arbitrary and d in padded else r[0]) for d, r in graph.dims.items()}
    an = _Analyzer(graph, padded, lo, locs or {})
    states: dict[str, State] = {}
    for name in graph.inputs:
        ty = graph.values[name].type
        pv = pad_values.get(name, 0)
        if ty.dtype == "bool":
            pv = bool(pv)
        states[name] = State(tuple(
            Axis((Factor(e, e.name, GARBAGE if arbitrary else const(pv), True),))
            if not isinstance(e, int) and e.is_Symbol and e.name in padded
            else an.fresh_axis(e, GARBAGE) for e in ty.shape))
    for name in graph.constants:
        states[name] = an.constant(graph, name)
    an.run(graph, states)
    findings: dict[str, list[Finding]] = {d: [] for d in padded}
    for out in graph.outputs:
        s = states[out]
        for d, f in s.taint.items():
            if d in findings and f not in findings[d]:
                findings[d].append(f)
        for i, ax in enumerate(s.axes):
            if not ax.padded:
                continue
            f = ax.single
            if f is None or not f.prefix:
                for g in ax.padded:
                    why = (f"output axis {i} holds padding of {', '.join(sorted({p.dim for p in ax.padded}))} "
                           "in a layout that cannot be sliced back")
                    fd = Finding(g.dim, "output", out, why)
                    if fd not in findings[g.dim]:
                        findings[g.dim].append(fd)
    all_dims = list(graph.dims) or padded
    return PaddingReport({d: DimVerdict(d, d in padded, findings.get(d, [])) for d in all_dims})


def positions_independent(graph: Graph, dim: str) -> bool:
    """Whether every output position along `dim` is computed from the inputs at that position
    alone (a batch whose rows never meet), so a request may be cut along `dim` into smaller
    buckets and its outputs concatenated. Proved as padding safety of `dim` where the padded
    positions hold arbitrary values and no position need be real: any op that reads across
    the dim — a reduction or contraction over it, a gather, a shift, a slice of fixed
    positions, a sum over padding that only zeros make harmless — then reads a position it
    knows nothing about and taints the dim."""
    if dim not in graph.dims:
        return False
    return analyze_padding(graph, {}, [dim], arbitrary=True).dims[dim].safe
