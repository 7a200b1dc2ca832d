"""sympy -> Z3 integer arithmetic, exact.

`to_z3(expr, vars)` returns (z, d): a Z3 Int term and a positive Python int with
expr == z / d for every integer assignment of the symbols. Handled: integers, rationals,
floats (as their decimal value), symbols, +, *, -, integer powers, Max/Min, floor and
ceiling of anything converted (so `ceiling(seq/16)`, `floor((a+b)/3)` and `floor(-1/seq)`), Mod by a
positive constant, Abs, and rational division by constants. Anything else is a SmtError naming the node.
"""
from __future__ import annotations

import threading
from fractions import Fraction
from math import lcm

import sympy
import z3

# Z3's default context is one per process and not thread-safe: two threads proving at once
# crashed inside it (`Z3Exception: unreachable`, trial AC's concurrent compiles). Held around a
# whole recipe's proofs (constraints.prove_all).
Z3_LOCK = threading.RLock()


class SmtError(ValueError):
    """The expression uses something the converter cannot translate."""


def _int(v: int) -> z3.ArithRef:
    return z3.IntVal(v)


def _scale(z: z3.ArithRef, d: int, to: int) -> z3.ArithRef:
    k = to // d
    return z if k == 1 else z * k


def to_z3(expr, vars: dict[str, z3.ArithRef]) -> tuple[z3.ArithRef, int]:
    expr = sympy.sympify(expr)
    if expr.is_Integer:
        return _int(int(expr)), 1
    if expr.is_Rational:
        return _int(int(expr.p)), int(expr.q)
    if expr.is_Float:
        f = Fraction(str(expr))
        return _int(f.numerator), f.denominator
    if expr.is_Symbol:
        name = str(expr)
        if name not in vars:
            raise SmtError(f"symbol {name!r} is not a recipe dim (dims: {', '.join(vars)})")
        return vars[name], 1
    if isinstance(expr, sympy.Add):
        parts = [to_z3(a, vars) for a in expr.args]
        d = lcm(*[p[1] for p in parts])
        return sum((_scale(z, pd, d) for z, pd in parts[1:]), _scale(*parts[0], d)), d
    if isinstance(expr, sympy.Mul):
        z, d = None, 1
        for a in expr.args:
            az, ad = to_z3(a, vars)
            z = az if z is None else z * az
            d *= ad
        return z, d
    if isinstance(expr, sympy.Pow):
        base, exp = expr.args
        if not (exp.is_Integer and int(exp) >= 0):
            raise SmtError(f"only non-negative integer powers of dims are supported, not {expr}")
        bz, bd = to_z3(base, vars)
        n = int(exp)
        if n == 0:
            return _int(1), 1
        z = bz
        for _ in range(n - 1):
            z = z * bz
        return z, bd ** n
    if isinstance(expr, (sympy.floor, sympy.ceiling)):
        if _over_dims(expr.args[0]):
            return _floor_of_quotient(expr, vars), 1
        z, d = to_z3(expr.args[0], vars)
        if d == 1:
            return z, 1
        if isinstance(expr, sympy.floor):
            return z / d, 1                   # Z3 Int division: floor for a positive divisor
        return -((-z) / d), 1
    if isinstance(expr, (sympy.Max, sympy.Min)):
        parts = [to_z3(a, vars) for a in expr.args]
        d = lcm(*[p[1] for p in parts])
        terms = [_scale(z, pd, d) for z, pd in parts]
        acc = terms[0]
        for t in terms[1:]:
            acc = z3.If(t > acc, t, acc) if isinstance(expr, sympy.Max) else z3.If(t < acc, t, acc)
        return acc, d
    if isinstance(expr, sympy.Mod):
        a, m = expr.args
        if not (m.is_Rational and m > 0):
            raise SmtError(f"Mod needs a positive constant divisor, not {expr}")
        z, d = to_z3(a, vars)
        mz, md = int(m.p), int(m.q)                  # a mod m = (z*md mod mz*d) / (d*md)
        return (z * md) % (mz * d), d * md
    if isinstance(expr, sympy.Abs):
        z, d = to_z3(expr.args[0], vars)
        return z3.If(z < 0, -z, z), d
    raise SmtError(f"cannot translate {type(expr).__name__} ({expr}) to Z3; "
                   f"use + - * integer powers, Max/Min, floor/ceiling")


def _over_dims(arg) -> bool:
    return any(isinstance(p, sympy.Pow) and p.exp.is_negative and p.free_symbols for p in arg.atoms(sympy.Pow))


def _floor_of_quotient(expr, vars: dict[str, z3.ArithRef]) -> z3.ArithRef:
    """floor / ceiling of a quotient by dims, e.g. torch's arange(0, b*s, s) length
    floor((b*s + s - 1)/s), which sympy keeps as b + 1 + floor(-1/s): the argument as one
    fraction N/D and Z3's integer division, exact when D is positive for every positive dim."""
    num, den = sympy.fraction(sympy.together(expr.args[0]))
    den = sympy.expand(den)
    if not (den.is_polynomial() and all(c > 0 for c in sympy.Poly(den, *den.free_symbols).coeffs())):
        raise SmtError(f"the divisor of {expr} is not positive for every dim value")
    nz, nd = to_z3(sympy.expand(num), vars)
    dz, dd = to_z3(den, vars)
    top, bottom = nz * dd, dz * nd                   # N/D = (nz/nd) / (dz/dd)
    if isinstance(expr, sympy.floor):
        return top / bottom                          # Z3 Int division: floor for a positive divisor
    return -((-top) / bottom)


def evaluate(expr, values: dict[str, int]) -> sympy.Rational:
    """Exact value of `expr` at integer dim values (symbols matched by name)."""
    expr = sympy.sympify(expr)
    expr = expr.xreplace({f: sympy.Rational(str(f)) for f in expr.atoms(sympy.Float)})
    v = expr.xreplace({s: sympy.Integer(values[str(s)]) for s in expr.free_symbols})
    return sympy.Rational(v)
