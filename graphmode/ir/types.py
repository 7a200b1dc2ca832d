"""Value types: dtype, shape with symbolic dims, layout, role.

A dim is either an int or a sympy expression over the recipe's dim symbols (`batch`,
`seq`, `seq*12`...). Expressions are kept canonical (sympy-simplified) so that two equal
shapes print, hash and compare the same.
"""
from __future__ import annotations

import fractions
import functools
import itertools
import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Iterable, Mapping, Union

import sympy
import torch

from graphmode.errors import IRError

DTYPES: dict[str, torch.dtype] = {
    "f64": torch.float64, "f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16,
    "i64": torch.int64, "i32": torch.int32, "i16": torch.int16, "i8": torch.int8,
    "u64": torch.uint64, "u32": torch.uint32, "u16": torch.uint16, "u8": torch.uint8, "bool": torch.bool,
}
TORCH_TO_DTYPE: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
FLOAT_DTYPES = frozenset({"f64", "f32", "f16", "bf16"})
ITEMSIZE: dict[str, int] = {k: torch.empty((), dtype=v).element_size() for k, v in DTYPES.items()}

ROLES = ("input", "param", "const", "state", "intermediate", "output")   # state: mutable, outside the arena (KV pools)
LAYOUTS = ("row_major", "nchw", "nhwc", "packed")

Dim = Union[int, sympy.Expr]


@lru_cache(maxsize=4096)
def _parse_dim_text(text: str) -> Dim:
    try:
        expr = sympy.sympify(text, locals={n: sympy.Symbol(n, integer=True, positive=True)
                                           for n in _symbol_names(text)})
    except (sympy.SympifyError, SyntaxError, TypeError) as e:
        raise IRError(f"cannot parse dim expression {text!r}: {e}",
                      fix="use an int or an expression over dim names, e.g. 'seq*12'") from None
    return normalize_dim(expr)


def _symbol_names(text: str) -> list[str]:
    import re
    funcs = {"Max", "Min", "floor", "ceiling", "Mod", "FloorDiv", "CeilDiv"}
    return [t for t in re.findall(r"[A-Za-z_][A-Za-z_0-9]*", text) if t not in funcs]


def sym(name: str) -> sympy.Symbol:
    """The symbol for a recipe dim; all dims are positive integers."""
    return sympy.Symbol(name, integer=True, positive=True)


def normalize_dim(d) -> Dim:
    if isinstance(d, bool):
        raise IRError("a dim cannot be a bool", value=d)
    if isinstance(d, int):
        return d
    if isinstance(d, str):
        return _parse_dim_text(d.strip())
    if isinstance(d, sympy.Basic):
        d = _as_sympy_functions(d)
        e = sympy.expand(d) if not d.is_Symbol else d
        if e.is_Integer:
            return int(e)
        # make every free symbol an integer positive symbol, so equal expressions compare equal
        subs = {s: sym(s.name) for s in e.free_symbols if s != sym(s.name)}
        return e.xreplace(subs) if subs else e
    try:  # torch.SymInt / numpy ints
        return int(d)
    except (TypeError, ValueError):
        raise IRError(f"unsupported dim {d!r} of type {type(d).__name__}") from None


_TORCH_DIVISIONS = {"FloorDiv": sympy.floor, "CeilDiv": sympy.ceiling}


def _as_sympy_functions(d: sympy.Basic) -> sympy.Basic:
    """torch.export's own sympy functions (FloorDiv, CeilDiv: a strided conv's or a pool's
    output size) as sympy's floor / ceiling, so they compare equal to what the IR infers."""
    def torchy(x) -> bool:
        return type(x).__name__ in ("FloorDiv", "CeilDiv") and len(x.args) == 2

    def plain(x):
        return _TORCH_DIVISIONS[type(x).__name__](x.args[0] / x.args[1])
    def torch_minmax(x) -> bool:     # torch's own Min / Max (a linalg op's min(m, n) size): sympy's compare equal
        return type(x).__name__ in ("Min", "Max") and type(x).__module__.startswith("torch")

    if d.is_Atom or not (d.atoms(sympy.Function) or d.atoms(sympy.core.operations.LatticeOp)):
        return d
    d = d.replace(torchy, plain)
    d = _float_sizes(d)
    d = d.replace(torch_minmax, lambda x: (sympy.Min if type(x).__name__ == "Min" else sympy.Max)(*x.args))
    for _ in range(8):              # floors of floors (stacked strided convs, pools): flattened
        flat = d.replace(lambda x: isinstance(x, sympy.floor), _floor_of_floor)
        if flat == d:
            break
        d = flat
    return d


_TO_INT = {"TruncToInt": sympy.floor, "FloorToInt": sympy.floor, "CeilToInt": sympy.ceiling}


def exact_scale(v: float) -> sympy.Rational | None:
    """A positive double `v` as the fraction it is, when its denominator is at most 16: then
    size * v is exact in doubles, so torch's floor(size * v) is the exact floor. None otherwise
    (1/3 times 3 rounds to 1.0 before torch floors it)."""
    f = fractions.Fraction(float(v))
    return sympy.Rational(f.numerator, f.denominator) if 0 < f and f.denominator <= 16 else None


def _float_sizes(d: sympy.Basic) -> sympy.Basic:
    """torch's size of F.interpolate(scale_factor=1.5), TruncToInt(1.5 * ToFloat(H)), as
    floor(3 * H / 2): sizes are positive (trunc is floor), and a scale whose double is a
    fraction of 16 at most makes the same product exactly in doubles. Other floats (1/3) stay
    torch's, so they compare equal to nothing graphmode infers (the op stays an eager island)."""
    names = {type(x).__name__ for x in d.atoms(sympy.Function)}
    if "ToFloat" not in names or not names & set(_TO_INT):
        return d
    exact = {f: exact_scale(f) for f in d.atoms(sympy.Float)}
    if any(r is None for r in exact.values()):
        return d
    d = d.replace(lambda x: type(x).__name__ == "ToFloat" and len(x.args) == 1, lambda x: x.args[0])
    d = d.replace(lambda x: type(x).__name__ in _TO_INT and len(x.args) == 1,
                  lambda x: _TO_INT[type(x).__name__](x.args[0]))
    return d.xreplace(exact)


def _integral(t: sympy.Expr) -> bool:
    """An expression of integer dim symbols, floors and integers only (an integer for every value)."""
    return all(isinstance(a, (sympy.Symbol, sympy.floor, sympy.ceiling, sympy.Integer)) or
               (isinstance(a, sympy.Pow) and a.exp.is_Integer and a.exp > 0)
               for a in sympy.Mul.make_args(t)) and all(s.is_integer for s in t.free_symbols)


def _floor_of_floor(f: sympy.floor) -> sympy.Expr:
    """floor(floor(y) / c + k / c) = floor((y + k) / c) for a positive integer c and an integer
    k: the outer floor of a strided window over an inner one's output size."""
    terms = sympy.Add.make_args(sympy.expand(f.args[0]))
    inner = [(c, r) for c, r in (t.as_coeff_Mul() for t in terms) if isinstance(r, sympy.floor)]
    if len(inner) != 1 or not (inner[0][0].is_Rational and inner[0][0] > 0 and inner[0][0].p == 1):
        return f
    c, r = inner[0]
    rest = [t for t in terms if t.as_coeff_Mul() != (c, r)]
    if not all((t.as_coeff_Mul()[0] / c).is_Integer and _integral(t.as_coeff_Mul()[1]) for t in rest):
        return f
    return sympy.floor(r.args[0] * c + sympy.Add(*rest))


def dim_str(d: Dim) -> str:
    return str(d) if isinstance(d, int) else sympy.sstr(d).replace(" ", "")


def eval_dim(d: Dim, env: Mapping[str, int]) -> int:
    if isinstance(d, int):
        return d
    missing = [s.name for s in d.free_symbols if s.name not in env]
    if missing:
        raise IRError(f"dim {dim_str(d)} needs values for {missing}", fix="bind every recipe dim")
    v = sympy.sympify(d.xreplace({s: sympy.Integer(env[s.name]) for s in d.free_symbols}))
    if not v.is_Integer:
        v = sympy.simplify(v)
        if not v.is_Integer:
            raise IRError(f"dim {dim_str(d)} is not an integer at {dict(env)}: {v}")
    return int(v)


def dims_equal(a: Dim, b: Dim) -> bool:
    """Whether two dims are equal for every value of the dim symbols. Dims are canonical
    (expanded), so the difference of two polynomial dims is a polynomial that is zero only
    when they are equal; sympy.simplify (milliseconds) only runs for dims with functions
    (floor, Max, Mod...)."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    if a == b:
        return True
    diff = sympy.expand(sympy.sympify(a) - sympy.sympify(b))
    if diff == 0:
        return True
    if diff.is_polynomial():
        return False
    return sympy.simplify(diff) == 0 or _quasi_zero(diff)


QUASI_POINTS = 4096         # integer points a dim identity may take to decide (exact, by substitution)


def _quasi_zero(diff: sympy.Expr) -> bool:
    """Whether `diff`, of floors, ceilings and Mods over integer dims, is 0 at every integer
    point: sympy.simplify does not see ceiling(H/2) = floor(H/2 + 1/2) (a strided slice's
    length, a ceil-mode pool's). Such a dim is a quasi-polynomial: with L a multiple of its
    period (the product of its rationals' denominators), on each residue class mod L it is a
    polynomial in H of its degree d, which is zero everywhere when zero at d + 1 points, so
    (d + 1) * L consecutive values of each symbol decide it."""
    syms = sorted(diff.free_symbols, key=lambda x: x.name)
    if not syms or not all(x.is_integer for x in syms):
        return False
    steps = diff.has(sympy.floor, sympy.ceiling, sympy.Mod)
    flat = diff.replace(lambda x: isinstance(x, (sympy.floor, sympy.ceiling)), lambda x: x.args[0])
    flat = flat.replace(lambda x: isinstance(x, sympy.Mod), lambda x: x.args[0])
    if not steps or not flat.is_polynomial(*syms):
        return False
    period = math.prod(r.q for r in diff.atoms(sympy.Rational)) or 1
    period *= math.prod(int(m.args[1]) for m in diff.atoms(sympy.Mod) if m.args[1].is_Integer)
    spans = [(_degree(flat, x) + 1) * period for x in syms]
    if math.prod(spans) > QUASI_POINTS:
        return False
    return _holds_at(diff, syms, [range(1, n + 1) for n in spans], lambda v: v == 0)


def _degree(expr: sympy.Expr, x: sympy.Symbol) -> int:
    """The polynomial degree in x, 0 for an expression that is zero once expanded (sympy says -oo)."""
    d = sympy.degree(expr, x)
    return int(d) if d.is_finite else 0


def dims_equal_on(a: Dim, b: Dim, ranges: Mapping[str, tuple[int, int]]) -> bool:
    """`dims_equal`, or equal at every value of `ranges` its symbols take: torch.export
    specialises a size by the recipe's range (floor(H/32) is 1 for H in 32..63), which the
    IR's formula equals there only."""
    if dims_equal(a, b):
        return True
    diff = sympy.sympify(a) - sympy.sympify(b)
    syms = sorted(diff.free_symbols, key=lambda x: x.name)
    if not syms or any(x.name not in ranges for x in syms):
        return False
    spans = [range(ranges[x.name][0], ranges[x.name][1] + 1) for x in syms]
    if math.prod(len(r) for r in spans) > QUASI_POINTS:
        return False
    return _holds_at(diff, syms, spans, lambda v: v == 0)


def _holds_at(e: sympy.Expr, syms: list, spans: list, test: Any) -> bool:
    """`test` holds for `e` at every point of the grid (exact: integers substituted, no floats)."""
    return all(test(e.xreplace(dict(zip(syms, map(sympy.Integer, pt))))) for pt in itertools.product(*spans))


def settle_on(d: Dim, ranges: Mapping[str, tuple[int, int]]) -> Dim:
    """`d` with each Min / Max whose winner is the same at every value of `ranges` replaced by
    it: torch.export's length of x[..., -seq:] over a 128-row table is 128 - Max(0, 128 - seq),
    which is seq for seq <= 128, and only as seq does it broadcast against the model's other
    seq-long axes."""
    if isinstance(d, int) or not d.atoms(sympy.Min, sympy.Max):
        return d

    def pick(m: sympy.Expr) -> sympy.Expr:
        for a in m.args:
            if all(_nonneg_on(b - a if isinstance(m, sympy.Min) else a - b, ranges) for b in m.args if b is not a):
                return a
        return m
    return normalize_dim(d.replace(lambda x: isinstance(x, (sympy.Min, sympy.Max)), pick))


def constant_on(d: Dim, ranges: Mapping[str, tuple[int, int]]) -> int | None:
    """The one value a step function of one dim takes over its whole range (EfficientNet's pool of
    a whole map, floor(H/10240 - 1/320) + 1, is 1 for H in 64..128), else None."""
    if isinstance(d, int):
        return d
    if not d.has(sympy.floor, sympy.ceiling):
        return None
    return _constant_on(d, tuple(sorted((k, tuple(v)) for k, v in ranges.items())))


@functools.lru_cache(maxsize=4096)
def _constant_on(d: sympy.Expr, ranges: tuple) -> int | None:
    syms = list(d.free_symbols)
    span = dict(ranges).get(syms[0].name) if len(syms) == 1 else None
    if span is None or span[1] - span[0] >= QUASI_POINTS:
        return None
    x, (lo, hi) = syms[0], span
    lo = 1 if lo == 2 else lo      # torch.export's captures start at 2 (it specialises 1) and still serve 1
    first = d.xreplace({x: sympy.Integer(lo)})
    if not first.is_Integer or d.xreplace({x: sympy.Integer(hi)}) != first:
        return None           # the ends differ: not constant (the cheap test most dims stop at)
    return int(first) if _holds_at(d - first, [x], [range(lo, hi + 1)], lambda v: v == 0) else None


def _nonneg_on(e: sympy.Expr, ranges: Mapping[str, tuple[int, int]]) -> bool:
    """e >= 0 at every value of `ranges`: at the box's corners for a linear e, else at every point."""
    e = sympy.expand(e)
    syms = sorted(e.free_symbols, key=lambda x: x.name)
    if any(x.name not in ranges for x in syms):
        return False
    linear = e.is_polynomial(*syms) and all(sympy.degree(e, x) <= 1 for x in syms) if syms else True
    spans = [(ranges[x.name][0], ranges[x.name][1]) if linear else range(ranges[x.name][0], ranges[x.name][1] + 1)
             for x in syms]
    if not linear and math.prod(len(r) for r in spans) > QUASI_POINTS:
        return False
    return _holds_at(e, syms, spans, lambda v: v >= 0)


def same_dims(a: Iterable[Dim], b: Iterable[Dim], ranges: Mapping[str, tuple[int, int]] | None = None) -> bool:
    """Equal rank and pairwise equal dims (`dims_equal`; with `ranges`, `dims_equal_on` them)."""
    a, b = tuple(a), tuple(b)
    eq = dims_equal if ranges is None else (lambda x, y: dims_equal_on(x, y, ranges))
    return len(a) == len(b) and all(eq(x, y) for x, y in zip(a, b))


def dim_symbols(dims: Iterable[Dim]) -> set[str]:
    out: set[str] = set()
    for d in dims:
        if not isinstance(d, int):
            out |= {s.name for s in d.free_symbols}
    return out


@dataclass(frozen=True)
class TensorType:
    """dtype + shape (ints and symbolic expressions) + layout."""

    dtype: str
    shape: tuple[Dim, ...]
    layout: str = "row_major"

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise IRError(f"unknown dtype {self.dtype!r}", fix=f"one of {', '.join(DTYPES)}")
        if self.layout not in LAYOUTS:
            raise IRError(f"unknown layout {self.layout!r}", fix=f"one of {', '.join(LAYOUTS)}")
        object.__setattr__(self, "shape", tuple(normalize_dim(d) for d in self.shape))

    def matches(self, other: "TensorType", *, dtype: bool = True, layout: bool = True) -> bool:
        """The one type equality of the IR: same dims (symbolically, `same_dims`), same dtype
        and same layout. Layout is part of the type, not a hint: it fixes where each element
        lives, so a row-major and an NHWC tensor of the same dims are different values to a
        kernel, to a no-op test and to a fusion group. Each exception is explicit:
        `layout=False` only where one side comes from the op set's type inference, which
        does not track layouts (the verifier); `dtype=False` where only the element grid
        matters (the fusion groups' "same shape", which admits casts and comparisons)."""
        return ((not dtype or self.dtype == other.dtype) and (not layout or self.layout == other.layout)
                and same_dims(self.shape, other.shape))

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def is_static(self) -> bool:
        return all(isinstance(d, int) for d in self.shape)

    def numel(self) -> Dim:
        n: sympy.Expr | int = 1
        for d in self.shape:
            n = n * d
        return normalize_dim(n)

    def nbytes(self) -> Dim:
        return normalize_dim(self.numel() * ITEMSIZE[self.dtype])

    def concrete(self, env: Mapping[str, int]) -> tuple[int, ...]:
        return tuple(eval_dim(d, env) for d in self.shape)

    def specialize(self, env: Mapping[str, int]) -> "TensorType":
        return TensorType(self.dtype, self.concrete(env), self.layout)

    def with_shape(self, shape) -> "TensorType":
        return TensorType(self.dtype, tuple(shape), self.layout)

    def with_dtype(self, dtype: str) -> "TensorType":
        return TensorType(dtype, self.shape, self.layout)

    def text(self) -> str:
        dims = ",".join(dim_str(d) for d in self.shape)
        lay = "" if self.layout == "row_major" else f"@{self.layout}"
        return f"{self.dtype}[{dims}]{lay}"

    def to_json(self) -> dict:
        d = {"dtype": self.dtype, "shape": [d if isinstance(d, int) else dim_str(d) for d in self.shape]}
        if self.layout != "row_major":
            d["layout"] = self.layout
        return d

    @staticmethod
    def from_json(d: Mapping) -> "TensorType":
        return TensorType(d["dtype"], tuple(d["shape"]), d.get("layout", "row_major"))

    @staticmethod
    def of(t: torch.Tensor) -> "TensorType":
        if t.dtype not in TORCH_TO_DTYPE:
            raise IRError(f"unsupported tensor dtype {t.dtype}", fix=f"one of {', '.join(DTYPES)}")
        return TensorType(TORCH_TO_DTYPE[t.dtype], tuple(t.shape))


@dataclass(frozen=True)
class Value:
    name: str
    type: TensorType
    role: str = "intermediate"

    def __post_init__(self):
        if self.role not in ROLES:
            raise IRError(f"unknown role {self.role!r} for %{self.name}", fix=f"one of {', '.join(ROLES)}")
