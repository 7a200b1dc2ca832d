"""C scalar expressions: the one table of C types and the C for each elementwise op.

Fused-group kernels (codegen.py), the epilogues fused into GEMM and conv stores
(epilogue.py) and the single-op kernels (pool.py, movement.py) all write values of IR
dtypes as C; they share these tables so that an op means the same thing everywhere.
`op_refusal` says up front which (op, dtypes) `op_expr` cannot write: code generators
claim a group only when it says nothing, so `op_expr` never refuses what was claimed.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from graphmode.errors import BackendError
from graphmode.ir.graph import Node
from graphmode.ir.ops import OPS, _result_dtype
from graphmode.ir.types import TensorType

CTYPE = {"f32": "float", "f64": "double", "i64": "int64_t", "i32": "int32_t", "i16": "int16_t",
         "i8": "int8_t", "u8": "uint8_t", "bool": "bool"}     # a value's type in expressions
STYPE = dict(CTYPE, bool="uint8_t")                          # how a dtype is stored in memory
FLOATS = ("f32", "f64")
INTS = ("i64", "i32", "i16", "i8", "u8")

FLOAT_UNARY = ("exp", "log", "sqrt", "rsqrt", "reciprocal", "tanh", "sigmoid", "erf", "sin", "cos",
               "silu", "gelu", "floor", "ceil", "round", "tan", "asin", "acos", "atan", "sinh", "cosh", "asinh",
               "acosh", "atanh")
OTHER_UNARY = ("neg", "abs", "relu", "logical_not", "identity", "clamp", "cast", "sign")
BITWISE = {"bitwise_and": "&", "bitwise_or": "|", "bitwise_xor": "^"}
SHIFTS = ("bitwise_left_shift", "bitwise_right_shift")
ARITH = ("add", "sub", "mul", "div", "pow", "maximum", "minimum")
MOD = ("remainder", "fmod")      # remainder: the divisor's sign (Python's %); fmod: the dividend's (C's fmod)
CMP = {"eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">="}
LOGIC = {"logical_and": "&", "logical_or": "|"}
ELEMENTWISE_OPS = frozenset(FLOAT_UNARY + OTHER_UNARY + ARITH + MOD + tuple(CMP) + tuple(LOGIC) + tuple(BITWISE)
                            + SHIFTS + ("where", "bitwise_not"))
_LIBM = ("floor", "ceil", "tan", "asin", "acos", "atan", "sinh", "cosh", "asinh", "acosh", "atanh")

_MATH = {  # name -> (f32 function, f64 function)
    "exp": ("gm_expf", "__builtin_exp"), "log": ("__builtin_logf", "__builtin_log"),
    "sqrt": ("__builtin_sqrtf", "__builtin_sqrt"), "tanh": ("gm_tanhf", "__builtin_tanh"),
    "erf": ("gm_erff", "__builtin_erf"), "sin": ("__builtin_sinf", "__builtin_sin"),
    "cos": ("__builtin_cosf", "__builtin_cos"), "sigmoid": ("gm_sigmoidf", "gm_sigmoid"),
    "pow": ("__builtin_powf", "__builtin_pow"), "fabs": ("__builtin_fabsf", "__builtin_fabs"),
    "max": ("gm_maxf", "gm_max"), "min": ("gm_minf", "gm_min"), "fmod": ("__builtin_fmodf", "__builtin_fmod"),
    "round": ("__builtin_nearbyintf", "__builtin_nearbyint"),    # half to even, as torch.round
    **{f: (f"__builtin_{f}f", f"__builtin_{f}") for f in _LIBM},
}


def lit(v, dtype: str) -> str:
    """A C literal of exactly `v` in `dtype` (floats in hex: no decimal round trip)."""
    if dtype == "bool":
        return "true" if bool(v) else "false"
    if dtype in FLOATS:
        v = float(v)
        if math.isnan(v):
            return "GM_NAN" if dtype == "f32" else "((double)GM_NAN)"
        if math.isinf(v):
            s = "GM_INF" if dtype == "f32" else "((double)GM_INF)"
            return s if v > 0 else f"(-{s})"
        if dtype == "f32":
            v = float(torch.tensor(v, dtype=torch.float32).item())
            return f"{v.hex()}f"
        return v.hex()
    v = int(v)
    if v == -(1 << 63):
        return "((int64_t)(-9223372036854775807LL - 1))"
    return f"(({CTYPE[dtype]}){v}LL)"


@dataclass
class CValue:
    """A C expression (a variable name or a literal) holding a value of `dtype`."""

    expr: str
    dtype: str
    ttype: TensorType
    value: float | int | bool | None = None   # known scalar value


def cv(o: CValue, dt: str) -> str:
    """`o` as a value of `dt`."""
    if o.dtype == dt:
        return o.expr
    if o.value is not None:
        return lit(o.value, dt)
    if dt == "bool":
        return f"({o.expr} != 0)"
    return f"(({CTYPE[dt]}){o.expr})"


def fn(name: str, dt: str) -> str:
    """The prelude's (or the compiler's) function `name` for `dt` (f32 or f64)."""
    return _MATH[name][0 if dt == "f32" else 1]


def convert(src: str, dst: str, v: str) -> str | None:
    """C for torch's `.to(dst)` of stored value `v` of `src`, or None where C's conversion is
    not torch's (float -> int is undefined out of range; half types have no C type here)."""
    if src not in STYPE or dst not in STYPE:
        return None
    if dst == "bool":
        return f"(uint8_t)({v} != 0)"
    if src == "bool":
        return f"({STYPE[dst]})({v} != 0)"
    if src in FLOATS and dst in INTS:
        return None
    return f"({STYPE[dst]}){v}"


def op_refusal(n: Node, in_types: Sequence[TensorType], out_dt: str) -> str | None:
    """Why `op_expr` cannot write node `n` over inputs of `in_types` into `out_dt`, or None."""
    op, a = n.op, n.attrs
    spec = OPS.get(op)
    if spec is not None and not spec.arity[0] <= len(in_types) <= spec.arity[1]:
        return f"{op} with {len(in_types)} inputs (it takes {spec.arity[0]}..{spec.arity[1]})"
    if op in FLOAT_UNARY:
        if out_dt not in FLOATS:
            return f"op {op} producing {out_dt} is not generated (float only)"
        if op == "gelu" and a.get("approximate", "none") not in ("none", "tanh"):
            return f"gelu approximate={a.get('approximate')!r}"
        return None
    if op == "cast" and in_types and in_types[0].dtype in FLOATS and out_dt in INTS:
        # C's float -> int is undefined out of range, where torch wraps (300.0 -> uint8 44): in a fused
        # chain the value stayed a float (x.to(uint8).float() gave 300)
        return f"cast {in_types[0].dtype} -> {out_dt}: C's conversion is not torch's out of range"
    if op in ("identity", "cast", "logical_not", "abs", "sign") or op in LOGIC or op == "where":
        return None
    if op in BITWISE or op in SHIFTS or op == "bitwise_not":
        if out_dt not in INTS and not (out_dt == "bool" and op not in SHIFTS):
            return f"{op} producing {out_dt} (integers only)"
        return None
    if op in ("neg", "relu", "clamp"):
        if out_dt == "bool":
            return f"{op} of a bool tensor"
        if op == "clamp" and out_dt not in FLOATS:
            for b in (a.get("min"), a.get("max")):
                if b is not None and float(b) != int(b):
                    return f"clamp of an integer tensor to a fractional bound {b}"
        return None
    if op in ARITH:
        if op == "div" and out_dt not in FLOATS:
            return f"div producing {out_dt}"
        if out_dt == "bool" and op in ("sub", "div", "pow"):
            return f"{op} of bool tensors"
        return None
    if op in MOD:
        if out_dt not in FLOATS:       # eager raises on a zero divisor; a kernel cannot, so it would answer 0
            return f"integer {op} ({out_dt}): a zero divisor must raise as in eager PyTorch, which a generated " \
                   "kernel cannot"
        return None
    if op in CMP:
        dt = _result_dtype(list(in_types[:2]))
        return None if dt in CTYPE else f"comparison in {dt}"
    return f"op {op!r} is not supported by the CPU code generator"


def op_expr(n: Node, ins: list[CValue], out_dt: str, where: str) -> str:
    """The C expression of elementwise node `n` over `ins`, of type `out_dt` (a claimed node:
    `op_refusal` said nothing against it)."""
    why = op_refusal(n, [i.ttype for i in ins], out_dt)
    if why is not None:
        raise BackendError(f"internal: {why} reached the code generator", where=where, value=n.op,
                           fix="claim nodes with op_refusal before generating them")
    op, a = n.op, n.attrs
    if op in FLOAT_UNARY:
        x = cv(ins[0], out_dt)
        one, half = lit(1, out_dt), lit(0.5, out_dt)
        if op in ("exp", "log", "sqrt", "tanh", "erf", "sin", "cos", "sigmoid", "round") or op in _LIBM:
            return f"{fn(op, out_dt)}({x})"
        if op == "rsqrt":
            return f"({one} / {fn('sqrt', out_dt)}({x}))"
        if op == "reciprocal":
            return f"({one} / {x})"
        if op == "silu":
            return f"({x} / ({one} + {fn('exp', out_dt)}(-{x})))"
        # gelu
        if a.get("approximate", "none") == "tanh":   # torch: 0.5*x*(1+tanh(sqrt(2/pi)*(x+0.044715*x^3)))
            beta = lit(math.sqrt(2.0) * (2.0 / math.sqrt(math.pi)) * 0.5, out_dt)
            kappa = lit(0.044715, out_dt)
            return (f"(({half} * {x}) * ({one} + {fn('tanh', out_dt)}({beta} * ({x} + {kappa} * "
                    f"({x} * {x} * {x})))))")
        return f"(({x} * {half}) * ({one} + {fn('erf', out_dt)}({x} * {lit(math.sqrt(0.5), out_dt)})))"
    if op in ("identity", "cast"):
        return cv(ins[0], out_dt)
    if op == "logical_not":
        return f"(!{cv(ins[0], 'bool')})"
    if op == "neg":
        return f"(-{cv(ins[0], out_dt)})"
    if op == "sign":     # torch: 0 for zeros and NaN
        x = cv(ins[0], out_dt)
        if out_dt == "bool":
            return x
        return f"({x} > {lit(0, out_dt)} ? {lit(1, out_dt)} : ({x} < {lit(0, out_dt)} ? {lit(-1, out_dt)} : " \
               f"{lit(0, out_dt)}))"
    if op == "bitwise_not":
        x = cv(ins[0], out_dt)
        return f"(!{x})" if out_dt == "bool" else f"(({CTYPE[out_dt]})(~{x}))"
    if op in BITWISE:
        return f"(({CTYPE[out_dt]})({cv(ins[0], out_dt)} {BITWISE[op]} {cv(ins[1], out_dt)}))"
    if op in SHIFTS:
        return _shift(op, cv(ins[0], out_dt), cv(ins[1], out_dt), out_dt)
    if op == "abs":
        x = cv(ins[0], out_dt)
        if out_dt in FLOATS:
            return f"{fn('fabs', out_dt)}({x})"
        return x if out_dt in ("bool", "u8") else f"({x} < 0 ? -{x} : {x})"
    if op == "relu":
        x = cv(ins[0], out_dt)
        return f"({x} < {lit(0, out_dt)} ? {lit(0, out_dt)} : {x})"
    if op == "clamp":
        e = cv(ins[0], out_dt)
        lo, hi = a.get("min"), a.get("max")
        if lo is not None:
            e = f"({e} < {lit(lo, out_dt)} ? {lit(lo, out_dt)} : {e})"
        if hi is not None:
            e = f"({e} > {lit(hi, out_dt)} ? {lit(hi, out_dt)} : {e})"
        return e
    if op in ARITH:
        return _arith(op, ins, out_dt)
    if op in MOD:
        return _mod(op, cv(ins[0], out_dt), cv(ins[1], out_dt), out_dt)
    if op in CMP:
        dt = _result_dtype([ins[0].ttype, ins[1].ttype])
        return f"({cv(ins[0], dt)} {CMP[op]} {cv(ins[1], dt)})"
    if op in LOGIC:
        return f"({cv(ins[0], 'bool')} {LOGIC[op]} {cv(ins[1], 'bool')})"
    return f"({cv(ins[0], 'bool')} ? {cv(ins[1], out_dt)} : {cv(ins[2], out_dt)})"   # where


def _arith(op: str, ins: list[CValue], out_dt: str) -> str:
    x, y = cv(ins[0], out_dt), cv(ins[1], out_dt)
    if op in ("add", "sub", "mul", "div"):
        if out_dt == "bool":   # torch: bool + bool = or, bool * bool = and
            return f"({x} {'|' if op == 'add' else '&'} {y})"
        return f"({x} {dict(add='+', sub='-', mul='*', div='/')[op]} {y})"
    if op in ("maximum", "minimum"):
        if out_dt in FLOATS:
            return f"{fn('max' if op == 'maximum' else 'min', out_dt)}({x}, {y})"
        return f"({x} {'>' if op == 'maximum' else '<'} {y} ? {x} : {y})"
    # pow
    if out_dt in FLOATS:
        e = ins[1].value
        if e is not None and not isinstance(e, bool):
            e = float(e)
            one = lit(1, out_dt)
            special = {1.0: f"{x}", 2.0: f"({x} * {x})", 3.0: f"({x} * {x} * {x})",
                       4.0: f"(({x} * {x}) * ({x} * {x}))", 0.0: one,
                       0.5: f"{fn('sqrt', out_dt)}({x})", -0.5: f"({one} / {fn('sqrt', out_dt)}({x}))",
                       -1.0: f"({one} / {x})", -2.0: f"({one} / ({x} * {x}))"}
            if e in special:
                return special[e]
        return f"{fn('pow', out_dt)}({x}, {y})"
    return f"(({CTYPE[out_dt]})gm_ipow((int64_t){x}, (int64_t){y}))"


def _shift(op: str, x: str, y: str, dt: str) -> str:
    """torch's shifts: a shift by a negative amount or past the width gives 0 (or the sign, for
    a signed right shift); a left shift runs on the unsigned type (no undefined behaviour)."""
    ct, bits = CTYPE[dt], 8 * {"i64": 8, "i32": 4, "i16": 2, "i8": 1, "u8": 1}[dt]
    if op == "bitwise_left_shift":
        body = f"return ((int64_t)b < 0 || b >= {bits}) ? ({ct})0 : ({ct})((unsigned long long)a << b);"
    elif dt == "u8":
        body = f"return b >= {bits} ? ({ct})0 : ({ct})(a >> b);"
    else:
        body = f"return (b < 0 || b >= {bits}) ? ({ct})(a < 0 ? -1 : 0) : ({ct})(a >> b);"
    return f"([]({ct} a, {ct} b) -> {ct} {{ {body} }}({x}, {y}))"


def _mod(op: str, x: str, y: str, dt: str) -> str:
    """torch.remainder / torch.fmod of floats `x` by `y`, following ATen's CPU kernel: C's
    fmod, and for remainder a nonzero result whose sign differs from the divisor's moves by
    one divisor (an immediately called lambda: each operand evaluated once). Integer mod is
    refused in `op_refusal`: eager raises on a zero divisor, a kernel cannot."""
    if op == "fmod":
        return f"{fn('fmod', dt)}({x}, {y})"
    ct = CTYPE[dt]
    body = f"const {ct} m = {fn('fmod', dt)}(a, b); return (m != 0 && ((b < 0) != (m < 0))) ? m + b : m;"
    return f"([]({ct} a, {ct} b) -> {ct} {{ {body} }}({x}, {y}))"


__all__ = ["CTYPE", "STYPE", "FLOATS", "INTS", "ELEMENTWISE_OPS", "CValue", "lit", "cv", "fn", "convert",
           "op_refusal", "op_expr"]
