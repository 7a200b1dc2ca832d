"""Padding rules of layout ops: `reshape` (follows padded factors through merges; a split of a
padded axis taints), `permute`, `expand`, `slice` (keeps padding only at the end), `concat`,
`shift` (pad, roll: moving positions along a padded axis taints) and `triangle` (triu, tril).
"""
from __future__ import annotations

from typing import Sequence

import sympy

from graphmode.analysis.padding_lattice import (GARBAGE, UNKNOWN, Axis, Factor, Finding, State, const, divides, is_one,
                                                mul_dims, padded_view, plain, prefix_offset, same_dim, symbols)
from graphmode.analysis.padding_rules import rule
from graphmode.ir.graph import Node
from graphmode.ir.ops import norm_axis
from graphmode.ir.types import Dim, normalize_dim


def reshape(an, n: Node, x: State, out_shape: Sequence[Dim], taint: dict[str, Finding]) -> State:
    queue = [f for ax in x.axes for f in ax.factors if not (is_one(f.extent) and f.dim is None)]
    axes: list[Axis] = []
    ok = True
    pending: list[Factor] = []            # the factors of the output axis being matched, when it fails
    for e in out_shape:
        if is_one(e):
            axes.append(plain(1))
            continue
        taken: list[Factor] = []
        pending = taken
        prod: Dim = 1
        while ok and not same_dim(prod, e):
            if not queue:
                ok = False
                break
            f = queue.pop(0)
            if divides(mul_dims(prod, f.extent), e):
                taken.append(f)
                prod = mul_dims(prod, f.extent)
                continue
            need = normalize_dim(sympy.sympify(e) / sympy.sympify(prod))
            if f.dim is None and divides(need, f.extent):      # an unpadded factor splits freely
                taken.append(Factor(need))
                queue.insert(0, Factor(normalize_dim(sympy.sympify(f.extent) / sympy.sympify(need))))
                prod = mul_dims(prod, need)
                continue
            queue.insert(0, f)                 # not followed: it is among what the failure taints
            ok = False
        if not ok:
            break
        axes.append(Axis(tuple(taken)) if any(f.dim for f in taken) else plain(e))
        pending = []
    if ok and any(f.dim for f in queue):
        ok = False
    if not ok:
        # the output axes before the one it could not follow keep the leading factors whole, in order
        # (SegFormer's flatten(2) of [batch, C, h, w]: batch stays a row), so only the rest is tainted
        rest = pending + queue
        an.taint(taint, n, [Axis(tuple(rest))] if rest else x.axes,
                 "reshape splits padded dim {dim} in a way graphmode cannot follow")
        return State(tuple(axes) + an.from_type(out_shape)[len(axes):], x.uniform)
    affine = None
    if x.affine is not None:      # follow axes that survive whole (unsqueeze/squeeze-like reshapes)
        moved = {}
        for ax, c in x.affine:
            src = x.axes[ax]
            hits = [i for i, out in enumerate(axes) if out.factors == src.factors and not is_one(out.factors[0].extent)]
            if len(hits) != 1:
                moved = None
                break
            moved[hits[0]] = c
        affine = tuple(sorted(moved.items())) if moved else None
    return State(tuple(axes), x.uniform, affine, bound=x.bound, offset=x.offset, lower=x.lower,   # same values
                 upper=x.upper)


@rule("permute")
def permute(an, n: Node, ins: list[State], taint: dict[str, Finding]) -> list[State]:
    s = ins[0]
    perm = list(n.attrs["perm"])
    affine = tuple((perm.index(ax), c) for ax, c in s.affine) if s.affine else None
    return [State(tuple(s.axes[p] for p in perm), s.uniform, affine, bound=s.bound, offset=s.offset,
                  lower=s.lower, upper=s.upper)]


def expand(an, x: State, out_shape: Sequence[Dim]) -> State:
    lead = len(out_shape) - len(x.axes)
    axes = []
    for i, e in enumerate(out_shape):
        j = i - lead
        if j >= 0 and not (is_one(x.axes[j].factors[0].extent) and len(x.axes[j].factors) == 1 and not is_one(e)):
            axes.append(x.axes[j])
        else:
            axes.append(an.fresh_axis(e, padded_view(x.real_content())))
    affine = tuple((ax + lead, c) for ax, c in x.affine) if x.affine else None
    return State(tuple(axes), x.uniform, affine, bound=x.bound, offset=x.offset, lower=x.lower, upper=x.upper)


def slice_axis(an, n: Node, x: State, out_shape: Sequence[Dim], taint: dict[str, Finding]) -> State:
    a = n.attrs
    dim = norm_axis(a["dim"], len(x.axes))
    ax = x.axes[dim]
    start, step = a.get("start", 0), a.get("step", 1)
    end = normalize_dim(a.get("end", 2 ** 62))
    axes = list(x.axes)
    out_e = out_shape[dim]
    tri = _causal_buffer(an, n, x, dim, out_e) if start == 0 and step == 1 and not ax.padded else None
    if tri is not None:
        return tri
    if not ax.padded:
        axes[dim] = an.fresh_axis(out_e, padded_view(x.real_content()))
        return State(tuple(axes), x.uniform)
    f = ax.single
    if f is None or not f.prefix or not isinstance(start, int) or start < 0 or step < 1:
        an.taint(taint, n, [ax], "slice of padded dim {dim} that does not keep the padding at the end")
        axes[dim] = an.fresh_axis(out_e, GARBAGE)
        return State(tuple(axes), x.uniform)
    off = prefix_offset(f.extent, f.dim)
    to_end = (isinstance(end, int) and (end >= 2 ** 31 or end < 0)) or (
        not isinstance(end, int) and prefix_offset(end, f.dim) is not None) or same_dim(end, f.extent)
    end_off = prefix_offset(end, f.dim) if not isinstance(end, int) else None
    shortened = (isinstance(end, int) and -2 ** 31 < end < 0) or (
        end_off is not None and off is not None and end_off > off)       # (offsets count back from d)
    if to_end and shortened:
        # an end counted from the padded size (x[:, :-1], x[:, :T - 1]): the padded run keeps real
        # positions past the request's end in the result's padding, which then holds real values
        axes[dim] = Axis((Factor(out_e, f.dim, GARBAGE, True),))
    elif to_end:
        axes[dim] = Axis((Factor(out_e, f.dim, f.content, True),))
    elif isinstance(end, int) and off is not None and end <= an.lo.get(f.dim, 1) - off:
        axes[dim] = plain(out_e)      # every position read is real for every admissible request
    else:
        taint.setdefault(f.dim, an.finding(f.dim, n, f"slice end {end} reaches past the smallest admissible "
                                                     f"{f.dim} ({an.lo.get(f.dim, 1)}): it can read padding"))
        axes[dim] = an.fresh_axis(out_e, GARBAGE)
    return State(tuple(axes), x.uniform)


def _causal_buffer(an, n: Node, x: State, dim: int, out_e: Dim) -> State | None:
    """`buffer[..., :T, :T]` of a lower-triangular constant (a causal mask kept as a buffer)
    sliced by one padded dim: the first slice is remembered, the second is the triangle that
    tril(ones(T, T)) makes (padded columns of real rows 0)."""
    src = an.triangles.get(n.inputs[0])
    rank = len(x.axes)
    if src is not None and same_dim(out_e, an.shape(n.inputs[0])[dim]):
        an.triangles[n.outputs[0]] = set(src)          # a slice that keeps the whole axis (bias[:, :, ...])
        return None
    d = next((p for p in an.padded if same_dim(out_e, sympy.Symbol(p, integer=True, positive=True))), None)
    if src is None or d is None or dim not in (rank - 2, rank - 1) or dim in src or an.cut:
        return None
    if not src:                              # the first slice: rows or columns
        an.triangles[n.outputs[0]] = {dim}
        return None
    other = x.axes[(rank - 2) if dim == rank - 1 else rank - 1].single
    if other is None or other.dim != d or not other.prefix:
        return None
    bool_mask = an.types[n.outputs[0]].dtype == "bool"
    one, zero = const(True if bool_mask else 1.0), const(False if bool_mask else 0.0)
    axes = list(an.garbage(x.axes))
    axes[rank - 2] = Axis((Factor(out_e if dim == rank - 2 else other.extent, d, one, True),))   # padded rows
    axes[rank - 1] = Axis((Factor(out_e if dim == rank - 1 else other.extent, d, zero, True),))  # padded columns
    return State(tuple(axes))


def concat(an, n: Node, ins: list[State], out_shape: Sequence[Dim]) -> State:
    dim = norm_axis(n.attrs["dim"], len(out_shape))
    ins = [s for s in ins if len(s.axes) == len(out_shape)]   # torch.cat skips 1-d empty inputs of any rank
    axes = []
    for i, e in enumerate(out_shape):
        srcs = [s.axes[i] for s in ins]
        padded = [ax for ax in srcs if ax.padded]
        if not padded:
            axes.append(plain(e) if not (symbols(e) & set(an.padded)) else an.fresh_axis(e, GARBAGE))
        elif i == dim and _padding_last(an, srcs):   # fixed-size parts, then the padded one: padding stays last
            f = srcs[-1].single                       # (torch.diff with prepend: cat([x[:, :1] - 1, x], 1))
            axes.append(Axis((Factor(e, f.dim, f.content, True),)))
        elif i == dim:   # padding lands in the middle of the result
            d = padded[0].padded[0].dim
            axes.append(Axis((Factor(e, d, GARBAGE, False),)))
        else:
            f = padded[0].factors
            same = all(ax.factors == f for ax in srcs)
            axes.append(Axis(f) if same else an.garbage([padded[0]])[0])
    return State(tuple(axes))


def _padding_last(an, srcs: list[Axis]) -> bool:
    """Only the last part is padded along the concat dim, whole (its real positions first), and
    every part before it has a size no padded dim changes: the result's real positions come first."""
    last = srcs[-1].single
    if last is None or not last.prefix or len(srcs[-1].factors) != 1:
        return False
    fixed = [f.extent for ax in srcs[:-1] for f in ax.factors]
    return all(not ax.padded for ax in srcs[:-1]) and not any(symbols(e) & set(an.padded) for e in fixed)


def shift(an, n: Node, x: State, out_shape: Sequence[Dim], taint: dict[str, Finding]) -> State:
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
            an.taint(taint, n, [axes[i]], f"{n.op} along padded dim {{dim}} moves the padding")
        axes[i] = an.fresh_axis(out_shape[i], GARBAGE)
    return State(tuple(axes), lower=x.lower if n.op == "roll" else None)


def triangle(an, n: Node, x: State) -> State:
    """triu/tril keep or zero positions by index only; real positions stay real. With rows
    and columns padded by one dim (a causal mask), padded columns of real rows are known."""
    k = n.attrs.get("diagonal", 0)
    axes = list(an.garbage(x.axes))
    r, c = x.axes[-2].single, x.axes[-1].single
    if r is not None and c is not None and r.dim == c.dim and r.prefix and c.prefix and not an.cut:
        zero = const(False) if x.uniform is not UNKNOWN and isinstance(x.uniform, bool) else const(0.0)
        if n.op == "tril":           # keeps j <= i + k
            col = zero if k <= 0 else GARBAGE
            row = r.content if k >= 0 else GARBAGE
        else:                          # triu keeps j >= i + k
            col = c.content if k <= 1 else GARBAGE
            row = zero if k >= 0 else GARBAGE
        axes[-1] = Axis((Factor(c.extent, c.dim, col, True),))
        axes[-2] = Axis((Factor(r.extent, r.dim, row, True),))
    return State(tuple(axes))


rule("reshape")(lambda an, n, ins, taint: [reshape(an, n, ins[0], an.shape(n.outputs[0]), taint)])
rule("expand")(lambda an, n, ins, taint: [expand(an, ins[0], an.shape(n.outputs[0]))])
rule("slice")(lambda an, n, ins, taint: [slice_axis(an, n, ins[0], an.shape(n.outputs[0]), taint)])
rule("concat")(lambda an, n, ins, taint: [concat(an, n, ins, an.shape(n.outputs[0]))])
rule("shift")(lambda an, n, ins, taint: [shift(an, n, ins[0], an.shape(n.outputs[0]), taint)])
rule("triangle")(lambda an, n, ins, taint: [triangle(an, n, ins[0])])
