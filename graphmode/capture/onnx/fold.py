"""Import-time evaluation of ONNX shape code: known values (tensors whose elements are ints,
floats, bools or sympy expressions over the recipe dims) and the folds over them."""
from __future__ import annotations


import itertools
import math
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import numpy as np
import sympy
import torch

from graphmode.ir.ops import broadcast_shapes, get_op
from graphmode.ir.types import DTYPES, Dim, dim_str, normalize_dim

if TYPE_CHECKING:
    from graphmode.capture.onnx.importer import _Importer


KNOWN_LIMIT = 4096          # tensors up to this many elements are tracked as known values
BIG_END = 2 ** 62           # the IR's "to the end" slice bound
DEFAULT_RANGE = (1, 4096)   # dim range when neither `dims` nor the zoo defaults name the dim

_INT_DTYPES = frozenset({"u8", "u16", "u32", "u64", "i8", "i16", "i32", "i64"})
_FLOAT_DTYPES = frozenset({"f16", "bf16", "f32", "f64"})


# the recipe's dim ranges while a model is imported under one: a comparison of dims that positivity
# alone leaves open (an If on `batch > 2`) is decided where it holds over the whole range, as the
# contract keeps every request inside it (ranges the import guessed decide nothing)
DIM_RANGES: ContextVar[Mapping[str, tuple[int, int]] | None] = ContextVar("onnx_dim_ranges", default=None)
MAX_DECIDE_POINTS = 4096


class _Unfoldable(Exception):
    """A known-value fold that cannot be decided at import time (run the op instead)."""


# ------------------------------------------------------------------------------ known values


def _objarr(values: Sequence, shape: Sequence[int] | None = None) -> np.ndarray:
    vals = list(values)
    a = np.empty(len(vals), dtype=object)
    for i, v in enumerate(vals):
        a[i] = v
    return a.reshape(tuple(shape) if shape is not None else (len(vals),))


def _py(v: Any) -> Any:
    """One element in canonical form: python int/float/bool or a canonical sympy expr."""
    if isinstance(v, (bool, np.bool_)):
        return bool(v)
    if isinstance(v, (int, np.integer)):
        return int(v)
    if isinstance(v, (float, np.floating)):
        return float(v)
    if isinstance(v, sympy.Basic):
        if v is sympy.true or v is sympy.false:
            return bool(v)
        if v.is_Integer:
            return int(v)
        if v.is_Number:
            return float(v)
        return normalize_dim(v)
    return v


def _is_sym(v: Any) -> bool:
    return isinstance(v, sympy.Basic)


@dataclass
class _Known:
    """A tensor whose elements are known at import time (possibly symbolic)."""

    arr: np.ndarray          # dtype=object, elements from `_py`
    dtype: str
    source: str | None = None  # initializer name when this is an unchanged initializer

    def __post_init__(self):
        if not isinstance(self.arr, np.ndarray):      # numpy returns bare elements for 0-d results
            self.arr = _objarr([self.arr], ())
        elif self.arr.dtype != object:
            self.arr = _objarr(list(self.arr.flat), self.arr.shape)

    @staticmethod
    def of(t: torch.Tensor, source: str | None = None) -> "_Known":
        from graphmode.ir.types import TORCH_TO_DTYPE
        return _Known(_objarr([_py(v) for v in t.flatten().tolist()], tuple(t.shape)), TORCH_TO_DTYPE[t.dtype],
                      source)

    @property
    def concrete(self) -> bool:
        return not any(_is_sym(v) for v in self.arr.flat)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.arr.shape)

    def tensor(self) -> torch.Tensor:
        vals = list(self.arr.flat)
        if self.dtype == "bool":
            vals = [bool(v) for v in vals]
        return torch.tensor(vals, dtype=DTYPES[self.dtype]).reshape(self.shape)

    def ints(self, what: str) -> list[int]:
        out = []
        for v in self.arr.flat:
            if _is_sym(v) or isinstance(v, float) and not float(v).is_integer():
                raise _Unfoldable(f"{what} must be concrete integers, got {[dim_str(x) if _is_sym(x) else x for x in self.arr.flat]}")
            out.append(int(v))
        return out

    def dims(self) -> list[Dim]:
        """Elements as dims (ints or sympy expressions)."""
        return [v if _is_sym(v) else int(v) for v in self.arr.flat]


def _ufunc(fn: Callable, *arrs: np.ndarray) -> np.ndarray:
    """Elementwise `fn` over object arrays with broadcasting (0-d results stay arrays)."""
    r = np.frompyfunc(fn, len(arrs), 1)(*arrs)
    return r if isinstance(r, np.ndarray) else _objarr([r], ())


def _trunc_div(a: int, b: int) -> int:
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b >= 0) else -q


def _decide(expr, kind: str) -> bool:
    """Decide `expr == 0` / `< 0` / `<= 0` with every dim symbol positive."""
    e = sympy.sympify(expr)
    if e.is_Number:
        v = float(e)
        return {"eq": v == 0, "lt": v < 0, "le": v <= 0}[kind]
    res = {"eq": e.is_zero, "lt": e.is_negative, "le": e.is_nonpositive}[kind]
    if res is None:
        res = _decide_over_ranges(e, kind)
    if res is None:
        ranges = DIM_RANGES.get() or {}
        over = ", ".join(f"{s} in [{ranges[str(s)][0]}, {ranges[str(s)][1]}]" for s in sorted(e.free_symbols, key=str)
                         if str(s) in ranges)
        raise _Unfoldable(f"cannot decide {dim_str(normalize_dim(e))} {'==' if kind == 'eq' else '<' if kind == 'lt' else '<='} 0 "
                          f"for every dim value{f' ({over})' if over else ''}")
    return bool(res)


def _decide_over_ranges(e, kind: str) -> bool | None:
    """The comparison at every point of the recipe's dim ranges, where it is the same at all
    (at most MAX_DECIDE_POINTS of them); None where it varies or no range is known."""
    ranges = DIM_RANGES.get()
    syms = sorted(e.free_symbols, key=str)
    if not ranges or not syms or any(str(x) not in ranges for x in syms):
        return None
    grids = [range(ranges[str(x)][0], ranges[str(x)][1] + 1) for x in syms]
    if math.prod(len(g) for g in grids) > MAX_DECIDE_POINTS:
        return None
    f = sympy.lambdify(syms, e, modules="math")
    test = {"eq": lambda v: v == 0, "lt": lambda v: v < 0, "le": lambda v: v <= 0}[kind]
    try:
        seen = {bool(test(f(*pt))) for pt in itertools.product(*grids)}
    except (ArithmeticError, ValueError, TypeError):      # 1 / (seq - 1) at seq 1: undecided, not a crash
        return None
    return seen.pop() if len(seen) == 1 else None


def _smax(a, b):
    if not _is_sym(a) and not _is_sym(b):
        return max(a, b)
    try:
        return b if _decide(a - b, "le") else a
    except _Unfoldable:
        return sympy.Max(a, b)


def _smin(a, b):
    if not _is_sym(a) and not _is_sym(b):
        return min(a, b)
    try:
        return a if _decide(a - b, "le") else b
    except _Unfoldable:
        return sympy.Min(a, b)


def _smod(a, b):
    """Python-style modulo (ONNX Mod with fmod=0); symbolic when the dims make it so."""
    if not _is_sym(a) and not _is_sym(b):
        return a % b
    return sympy.Mod(sympy.sympify(a), sympy.sympify(b))     # e.g. (7 - seq % 7) % 7 over a symbolic dim


def _sym_div(is_int: bool):
    def div(a, b):
        if not _is_sym(a) and not _is_sym(b):
            return _trunc_div(int(a), int(b)) if is_int else a / b
        if is_int:
            return _sym_trunc_div(sympy.sympify(a), sympy.sympify(b))
        return sympy.sympify(a) / b
    return div


def _sym_trunc_div(a, b):
    """ONNX's integer a / b (rounded toward zero) over dims. A floor, which is the truncation
    wherever the numerator is not negative (sizes made from dims, whose sign the symbols may not
    decide: seq - 2); a numerator the dims make negative (-seq / 2) rounds up instead."""
    try:
        if _decide(b, "lt"):
            a, b = -a, -b
        if _decide(a, "lt"):
            return -sympy.floor(-a / b)
    except _Unfoldable:
        pass
    return sympy.floor(a / b)


_SYM_BINARY: dict[str, Callable[[bool], Callable]] = {
    "Add": lambda i: (lambda a, b: a + b),
    "Sub": lambda i: (lambda a, b: a - b),
    "Mul": lambda i: (lambda a, b: a * b),
    "Div": _sym_div,
    "Mod": lambda i: _smod,
    "Max": lambda i: _smax,
    "Min": lambda i: _smin,
    "Equal": lambda i: (lambda a, b: _decide(a - b, "eq")),
    "Less": lambda i: (lambda a, b: _decide(a - b, "lt")),
    "LessOrEqual": lambda i: (lambda a, b: _decide(a - b, "le")),
    "Greater": lambda i: (lambda a, b: _decide(b - a, "lt")),
    "GreaterOrEqual": lambda i: (lambda a, b: _decide(b - a, "le")),
}



_SYM_UNARY = {"Neg": lambda v: -v, "Abs": lambda v: abs(v) if not _is_sym(v) else sympy.Abs(v),
              "Sqrt": lambda v: math.sqrt(v) if not _is_sym(v) else sympy.sqrt(v)}


def _torch_eval(op: str, ts: list[torch.Tensor], attrs: dict, int_div: bool = False) -> torch.Tensor:
    if int_div:
        return torch.div(ts[0], ts[1], rounding_mode="trunc")
    return get_op(op).ref(ts, attrs, {})[0]


def _fold_elementwise(imp: _Importer, n, irop: str, ins: list[str], out_dtype: str) -> bool:
    """Evaluate at import time when every input is known; False when it must run."""
    ks = [imp.kn(i) for i in ins]
    if any(k is None for k in ks):
        return False
    is_int = ks[0].dtype in _INT_DTYPES
    if all(k.concrete for k in ks):
        ts = [k.tensor() for k in ks]
        r = ts[0] if len(ts) > 1 else _torch_eval(irop, ts, {})
        for t in ts[1:]:   # variadic Sum/Max/Min fold pairwise
            r = _torch_eval(irop, [r, t], {}, int_div=(n.op_type == "Div" and is_int))
        imp.set_tensor(n.output[0], r.to(DTYPES[out_dtype]))
        return True
    shape = broadcast_shapes(*(k.shape for k in ks))
    if math.prod(int(s) for s in shape) > KNOWN_LIMIT:
        return False
    try:
        if len(ks) == 1:
            fn = _SYM_UNARY.get(n.op_type)
            if fn is None:
                return False
            res = _ufunc(fn, ks[0].arr)
        else:
            mk = _SYM_BINARY.get(n.op_type if n.op_type not in ("Sum",) else "Add")
            if mk is None:
                return False
            f = mk(is_int)
            res = ks[0].arr
            for k in ks[1:]:
                res = _ufunc(f, res, k.arr)
    except _Unfoldable as e:              # said where a node needs the value known, in the file's terms
        shown = [dim_str(normalize_dim(v)) if _is_sym(v) else v for k in ks for v in k.arr.flat][:8]
        imp.undecided[n.output[0]] = f"{n.op_type}({', '.join(map(str, shown))}): {e}"
        return False
    res = res.reshape(tuple(int(s) for s in shape))
    imp.set_known(n.output[0], _Known(res, out_dtype))
    return True
