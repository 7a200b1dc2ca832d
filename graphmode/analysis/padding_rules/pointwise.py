"""Padding rule `pointwise`: each output position reads the same position of its (broadcast)
inputs, so padding stays padding and its content is what the op makes of the inputs' contents.
"""
from __future__ import annotations

from typing import Any, Mapping

import sympy

from graphmode.analysis.padding_lattice import (GARBAGE, UNKNOWN, Axis, Content, Factor, Finding, State, binary, const,
                                                falsy, padded_view, symbols, truthy, unary, plain)
from graphmode.analysis.padding_rules import rule
from graphmode.ir.graph import Node
from graphmode.ir.ops import OPS
from graphmode.ir.types import FLOAT_DTYPES, normalize_dim


@rule("pointwise")
def pointwise(an, n: Node, ins: list[State], taint: dict[str, Finding]) -> list[State]:
    """One input: what the op makes of each padded content (and of a uniform value, a lower
    bound, an index kept through identity or an integer cast); more: elementwise with broadcasting."""
    op, a = n.op, n.attrs
    if op != "where" and len(ins) == 1:
        s = ins[0]
        axes = tuple(Axis(tuple(Factor(f.extent, f.dim, unary(op, f.content, a) if f.dim else f.content, f.prefix)
                                for f in ax.factors)) for ax in s.axes)
        uniform = UNKNOWN
        if s.uniform is not UNKNOWN:
            c = unary(op, const(s.uniform), a)
            uniform = c.value if c.kind == "const" else UNKNOWN
        keep = op == "identity" or (op == "cast" and a.get("dtype") in ("i64", "i32"))
        return [State(axes, uniform, s.affine if keep else None, lower=unary_lower(op, a, s),
                      upper=s.upper if keep else None, bound=s.bound if keep else None,
                      offset=s.offset if keep else None)]
    if an.types[n.outputs[0]].dtype in FLOAT_DTYPES:
        # a padded dim's size as a number in float arithmetic (x.sum(1) / x.shape[1]): padded, the
        # size is the bucket's, not the request's (index arithmetic with it stays: it indexes the
        # padded tensor)
        for d in sorted({d for x in ins if isinstance(x.uniform, sympy.Expr) for d in symbols(x.uniform)}
                        & set(an.padded)):
            taint.setdefault(d, an.finding(d, n, f"the size of padded dim {d} used as a value"))
    elif op in INTEGER_DIVISIONS and len(ins) == 2:
        _divides_by_padding(an, n, ins[1], taint)
    return [elementwise(an, n, ins)]


# integer division raises on a zero divisor (ZeroDivisionError; UB in C): padding must not put one there
INTEGER_DIVISIONS = frozenset({"remainder", "fmod", "floor_divide"})


def _divides_by_padding(an, n: Node, divisor: State, taint: dict[str, Finding]) -> None:
    """An integer division whose divisor's padded positions may hold 0 (the pad value 0, or
    unknown values): a padded run would raise where eager, without the padding, answers."""
    for ax in divisor.axes:
        for f in ax.padded:
            c = f.content
            if not (c.kind == "const" and not isinstance(c.value, bool) and c.value != 0):
                taint.setdefault(f.dim, an.finding(
                    f.dim, n, f"integer {n.op} divides by padded positions holding {c}: a zero divisor raises "
                              "(give the divisor's input a nonzero pad_value, e.g. 1)"))


def unary_lower(op: str, a: Mapping[str, Any], s: State) -> float | None:
    """A lower bound on real values, kept where an op keeps it (argmax over a padded axis
    is safe when the padding is at most the smallest real value): the op's own floor
    (`OpSpec.value_floor`: relu, exp, ... 0), a clamp's min, or the input's through a copy."""
    spec = OPS.get(op)
    if spec is not None and spec.value_floor is not None:
        return spec.value_floor
    if op == "clamp" and a.get("min") is not None:
        return float(a["min"]) if s.lower is None else max(float(a["min"]), s.lower)
    if op in ("identity", "cast"):
        return s.lower
    return None


def elementwise(an, n: Node, ins: list[State]) -> State:
    out_shape = an.shape(n.outputs[0])
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
            axes.append(plain(e) if not (symbols(e) & set(an.padded)) else an.fresh_axis(e, GARBAGE))
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
            factors.append(Factor(f.extent, f.dim, padded_view(combine(an, n, contents)), prefix))
        axes.append(Axis(tuple(factors)))
    uniform = UNKNOWN
    if all(s.uniform is not UNKNOWN for s in ins):
        c = combine(an, n, [const(s.uniform) for s in ins])
        uniform = c.value if c.kind == "const" else UNKNOWN
    lower = None
    if an.types[n.outputs[0]].dtype == "bool":
        lower = 0.0
    elif n.op in ("add", "mul", "maximum") and all(x.lower is not None for x in ins) and (
            n.op != "mul" or all(x.lower >= 0 for x in ins)):
        lower = {"add": ins[0].lower + ins[1].lower, "mul": 0.0,
                 "maximum": max(ins[0].lower, ins[1].lower)}[n.op]
    affine, offset = affine_of(n.op, ins, rank), None
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
    zero = lambda s: s.uniform is not UNKNOWN and not isinstance(s.uniform, bool) and s.uniform == 0  # noqa: E731
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
            if f is not None and u is not UNKNOWN and not isinstance(u, (bool, float)):
                return tuple(sorted((ax, normalize_dim(sympy.sympify(c) * u)) for ax, c in f.items()))
    return None


def combine(an, n: Node, cs: list[Content]) -> Content:
    if n.op == "where":
        cond, x, y = cs
        if truthy(cond):
            return x
        if falsy(cond):
            return y
        return x if x == y and x.kind not in ("real", "lt_real") else GARBAGE
    if len(cs) != 2:              # three-input pointwise ops (addcmul, lerp): nothing known
        return GARBAGE
    return binary(n.op, cs[0], cs[1], an.lo)
