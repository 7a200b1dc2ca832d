"""Padding rules that read along axes: `reduce` (sum/mean/amax/amin over dims), `along`
(softmax, log_softmax, cumsum along one dim), `argreduce` (argmax/argmin) and `norm`
(layer_norm, batch_norm). Each is safe over a padded axis only when the padded content makes
it a no-op (zeros for a sum, masked logits for a max or softmax, padding at the end for a scan).
"""
from __future__ import annotations

from graphmode.analysis.padding_lattice import (GARBAGE, NEG_HUGE, UNKNOWN, Axis, Content, Factor, Finding, State,
                                                const, falsy, neg_huge, plain)
from graphmode.analysis.padding_rules import rule
from graphmode.ir.graph import Node
from graphmode.ir.ops import norm_axis


def reduce(an, n: Node, x: State, taint: dict[str, Finding]) -> State:
    op, a = n.op, n.attrs
    rank = len(x.axes)
    dims = sorted({norm_axis(d, rank) for d in a.get("dims", range(rank))})
    safe = {"sum": falsy, "amax": neg_huge,
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
                taint.setdefault(f.dim, an.finding(f.dim, n, why.format(d=f.dim)))
    keep = a.get("keepdim", False)
    axes = []
    for i, ax in enumerate(x.axes):
        if i in dims:
            if keep:
                axes.append(plain(1))
            continue
        if any_padded:
            axes.append(an.garbage([ax])[0])
        else:
            axes.append(Axis(tuple(Factor(f.extent, f.dim, reduced_content(op, f.content) if f.dim
                                          else f.content, f.prefix) for f in ax.factors)))
    return State(tuple(axes), x.uniform if op != "sum" else UNKNOWN)


def reduced_content(op: str, c: Content) -> Content:
    if c.kind == "const" and (op != "sum" or falsy(c)):
        return c
    if op == "amax" and neg_huge(c):
        return NEG_HUGE
    return GARBAGE


def along(an, n: Node, x: State, taint: dict[str, Finding]) -> State:
    """softmax / log_softmax / cumsum along one dim."""
    op = n.op
    if not x.axes:
        return State(())
    dim = norm_axis(n.attrs["dim"], len(x.axes))
    axes = list(an.garbage(x.axes))
    ax = x.axes[dim]
    for f in ax.padded:
        if op == "cumsum":
            ok = f.prefix and len(ax.factors) == 1
            why = "scan over padded dim {d} whose padding is not at the end"
        else:
            ok = f.prefix and neg_huge(f.content)
            why = f"{op} over padded dim {{d}} whose padded positions are not masked"
        if not ok:
            taint.setdefault(f.dim, an.finding(f.dim, n, why.format(d=f.dim)))
    if op != "cumsum" and ax.padded:
        out = const(0.0) if op == "softmax" else NEG_HUGE
        axes[dim] = Axis(tuple(Factor(f.extent, f.dim, out if f.dim else f.content, f.prefix) for f in ax.factors))
    return State(tuple(axes))


def argreduce(an, n: Node, x: State, taint: dict[str, Finding]) -> State:
    """argmax/argmin along a padded axis are safe when the padding can never win: argmax over
    padding no larger than any real value (ties resolve to the first, real, index)."""
    dim = norm_axis(n.attrs["dim"], len(x.axes))
    ax = x.axes[dim]
    bound = None
    for f in ax.padded:
        ok = (n.op == "argmax" and f.prefix and ax.single is f and x.lower is not None and
              ((f.content.kind == "const" and isinstance(f.content.value, (int, float))
                and float(f.content.value) <= x.lower) or neg_huge(f.content)))
        if ok:
            bound = f.dim
        else:
            taint.setdefault(f.dim, an.finding(f.dim, n, f"{n.op} over padded dim {f.dim} could pick a "
                                                         "padded position"))
    axes = [a for i, a in enumerate(an.garbage(x.axes)) if i != dim]
    if n.attrs.get("keepdim"):
        axes.insert(dim, plain(1))
    return State(tuple(axes), lower=0.0, bound=bound)


@rule("norm")
def norm(an, n: Node, ins: list[State], taint: dict[str, Finding]) -> list[State]:
    """layer_norm over its trailing `normalized_rank` axes, batch_norm over channels (axis 1)."""
    x = ins[0]
    k = n.attrs.get("normalized_rank", 1) if n.op == "layer_norm" else None
    reduced = x.axes[len(x.axes) - k:] if n.op == "layer_norm" else x.axes[1:2]
    an.taint(taint, n, reduced, "normalisation over padded dim {dim}")
    an.taint(taint, n, [ax for s in ins[1:] for ax in s.axes], "padded normalisation parameters")
    return [State(an.garbage(x.axes))]


rule("reduce")(lambda an, n, ins, taint: [reduce(an, n, ins[0], taint)])
rule("along")(lambda an, n, ins, taint: [along(an, n, ins[0], taint)])
rule("argreduce")(lambda an, n, ins, taint: [argreduce(an, n, ins[0], taint)])
