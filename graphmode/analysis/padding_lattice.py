"""The padding analysis's abstract values: what padded positions hold, per axis of a value.

`Content` is what the padded positions of one axis hold; `Factor`/`Axis` say which padded
dims an axis carries (more than one factor after a reshape merged axes); `State` is one
value's abstract state (axes, plus the facts some rules keep: a uniform scalar, an affine
index, a lower bound, the dim an index is bounded by). The helpers below decide what an
elementwise op makes of padded content. See analysis/padding.py for the analysis itself.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import sympy
import torch

from graphmode.ir.ops import OPS, get_op
from graphmode.ir.types import DTYPES, Dim, normalize_dim

NEG_THRESHOLD = -1e4      # exp(x - max) underflows to exactly 0 in f32 (and is < 1e-4000 relative below it)
UNKNOWN = object()

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
    def sliceable(self) -> bool:
        """The real positions are the axis's first ones, so slicing it to its real extent keeps
        them: one padded factor with its real positions first, outermost where reshape merged
        axes (batch-major `[b * t]` with only b padded; a padded inner factor interleaves)."""
        f = self.factors[0]
        return f.dim is not None and f.prefix and all(g.dim is None for g in self.factors[1:])

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
    uniform: Any = UNKNOWN                    # every element equals this scalar
    # value == sum of coeff * (index along axis): an arange, or a flattened index built from them
    affine: tuple[tuple[int, Any], ...] | None = None
    taint: dict[str, Finding] = field(default_factory=dict)
    lower: float | None = None                 # no real element is smaller (bools count as 0/1)
    upper: float | None = None                 # no element is larger (known for constants only)
    bound: str | None = None                   # every real element indexes a real position of this dim
    offset: str | None = None                  # affine index plus a term bounded like `bound` (b*seq + argmax)

    def real_content(self) -> Content:
        """This value seen from the padded positions of an axis it does not pad."""
        if self.uniform is not UNKNOWN:
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


# ---------------------------------------------------------------------------------- helpers


def is_one(d: Dim) -> bool:
    return isinstance(d, int) and d == 1


def mul_dims(a: Dim, b: Dim) -> Dim:
    return normalize_dim(sympy.sympify(a) * sympy.sympify(b))


def same_dim(a: Dim, b: Dim) -> bool:
    """Dims are kept expanded (ir.types.normalize_dim), so expansion decides equality cheaply."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return a == b or sympy.expand(sympy.sympify(a) - sympy.sympify(b)) == 0


def divides(part: Dim, whole: Dim) -> bool:
    """`whole / part` is a positive integer (or a polynomial in the dims)."""
    r = sympy.sympify(whole) / sympy.sympify(part)
    if r.is_Integer:
        return int(r) >= 1
    num, den = sympy.fraction(r)
    return den == 1 and not r.is_Rational


def symbols(d: Dim) -> set[str]:
    return set() if isinstance(d, int) else {s.name for s in d.free_symbols}


def prefix_offset(extent: Dim, d: str) -> int | None:
    """`extent == d - k` for an integer k >= 0: the axis keeps a prefix layout."""
    diff = sympy.expand(sympy.Symbol(d, integer=True, positive=True) - sympy.sympify(extent))
    return int(diff) if diff.is_Integer and int(diff) >= 0 else None


def is_const(c: Content, v: Any) -> bool:
    return c.kind == "const" and not isinstance(c.value, bool) and c.value == v


def falsy(c: Content) -> bool:
    """Zero, 0.0, -0.0 or False: the content that makes sums and contractions no-ops."""
    return c.kind == "const" and (c.value is False or (not isinstance(c.value, bool) and c.value == 0))


def truthy(c: Content) -> bool:
    return c.kind == "const" and (c.value is True or (not isinstance(c.value, bool) and c.value not in (0,)
                                                      and not (isinstance(c.value, float) and math.isnan(c.value))))


def neg_huge(c: Content) -> bool:
    return c.kind == "neg_huge" or (c.kind == "const" and not isinstance(c.value, bool)
                                    and isinstance(c.value, (int, float)) and c.value <= NEG_THRESHOLD)


def finite(c: Content) -> bool:
    """Finite and not hugely positive (garbage is assumed finite)."""
    if c.kind == "const":
        return isinstance(c.value, bool) or (isinstance(c.value, (int, float)) and math.isfinite(c.value)
                                             and c.value < -NEG_THRESHOLD)
    return c.kind != "neg_huge"


def padded_view(c: Content) -> Content:
    """A content taken from a non-padded operand becomes plain padded-position content."""
    return GARBAGE if c.kind in ("real", "lt_real") else c


def scalar(op: str, *vals: Any) -> Any:
    ts = [torch.tensor(v, dtype=torch.bool if isinstance(v, bool) else torch.float64) for v in vals]
    out = get_op(op).ref(ts, {}, {})[0]
    v = out.item()
    return bool(v) if out.dtype == torch.bool else float(v)


CMP = {"ge": (True, True, False), "gt": (True, True, False), "le": (False, False, True),
       "lt": (False, False, True), "eq": (False, False, False), "ne": (True, True, True)}


def compare(op: str, a: Content, b: Content, lo: Mapping[str, int]) -> Content:
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


def binary(op: str, a: Content, b: Content, lo: Mapping[str, int]) -> Content:
    if a.kind == "const" and b.kind == "const":
        try:
            return const(scalar(op, a.value, b.value))
        except Exception:  # noqa: BLE001 - an op the scalar path cannot evaluate
            return GARBAGE
    if op in CMP:
        return compare(op, a, b, lo)
    if op == "add":
        if (neg_huge(a) and (finite(b) or neg_huge(b))) or (neg_huge(b) and finite(a)):
            return NEG_HUGE
        if is_const(a, 0):
            return padded_view(b)
        if is_const(b, 0):
            return padded_view(a)
    if op == "sub":
        if neg_huge(a) and finite(b):
            return NEG_HUGE
        if is_const(b, 0):
            return padded_view(a)
    if op == "mul":
        for x, y in ((a, b), (b, a)):
            if falsy(x) and finite(y):
                return const(0.0)
            if x.kind == "const" and x.value == 1:
                return padded_view(y)
            if neg_huge(x) and y.kind == "const" and not isinstance(y.value, bool) and y.value >= 1e-2:
                return NEG_HUGE
    if op == "div":
        if b.kind == "const" and not isinstance(b.value, bool):
            if b.value == 1:
                return padded_view(a)
            if falsy(a) and b.value != 0:
                return const(0.0)
            if neg_huge(a) and 0 < b.value <= 1e2:
                return NEG_HUGE
    if op == "logical_and":
        if falsy(a) or falsy(b):
            return const(False)
        if truthy(a):
            return padded_view(b)
        if truthy(b):
            return padded_view(a)
    if op == "logical_or":
        if truthy(a) or truthy(b):
            return const(True)
        if falsy(a):
            return padded_view(b)
        if falsy(b):
            return padded_view(a)
    return GARBAGE


def at_masked(op: str) -> Content | None:
    """What `op` makes of masked (hugely negative) positions, from its OpSpec (`at_masked`):
    exp or softmax 0, tanh -1, log_softmax still masked; None where the op table says nothing."""
    spec = OPS.get(op)
    v = spec.at_masked if spec is not None else None
    return None if v is None else NEG_HUGE if v == -math.inf else const(v)


def unary(op: str, c: Content, attrs: Mapping[str, Any]) -> Content:
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
    if neg_huge(c):
        masked = at_masked(op)
        if masked is not None:
            return masked
        if op == "cast" and attrs.get("dtype") in ("f32", "f64", "f16", "bf16"):
            return NEG_HUGE
        if op == "clamp":
            return const(float(attrs["min"])) if attrs.get("min") is not None else NEG_HUGE
    if c.kind == "ge_real" and op == "cast" and attrs.get("dtype") in ("i64", "i32", "f32", "f64"):
        return c
    return GARBAGE


def join(cs: Iterable[Content]) -> Content:
    cs = list(cs)
    return cs[0] if cs and all(c == cs[0] for c in cs) else GARBAGE
