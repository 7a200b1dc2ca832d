"""Padding rules that read along axes: `reduce` (sum/mean/amax/amin over dims), `along`
(softmax, log_softmax, cumsum along one dim), `argreduce` (argmax/argmin) and `norm`
(layer_norm, batch_norm). Each is safe over a padded axis only when the padded content makes
it a no-op (zeros for a sum, masked logits for a max or softmax, padding at the end for a scan).
"""
from __future__ import annotations

from graphmode.analysis.padding_lattice import (GARBAGE, NEG_HUGE, UNKNOWN, Axis, Content, Factor, Finding, State,
                                                at_masked, falsy, neg_huge, plain)
from graphmode.analysis.padding_rules import rule
from graphmode.ir.graph import Node
from graphmode.ir.ops import get_op, norm_axis

# how a padded content is recognised as the identity the op table declares (OpSpec.pad_identity)
IDENTITY = {"zero": falsy, "masked": neg_huge,
            "one": lambda c: c.kind == "const" and not isinstance(c.value, bool) and c.value == 1}
IDENTITY_MISSING = {"zero": "whose padded positions are not zero", "masked": "whose padded positions are not masked",
                    "one": "whose padded positions are not one"}
_COUNTED = ("sum", "prod")       # their result depends on how many positions there are


def identity_test(op: str):
    """Whether a padded content leaves `op` unchanged: its declared identity (never without one)."""
    return IDENTITY.get(get_op(op).pad_identity, lambda c: False)


def why_unsafe(op: str) -> str:
    """The finding for `op` over a padded dim: the identity its padding lacks, or the op's own reason."""
    spec = get_op(op)
    why = IDENTITY_MISSING[spec.pad_identity] if spec.pad_identity else ""
    return " ".join(filter(None, (f"{op} over padded dim {{d}}", why, f"({spec.pad_why})" if spec.pad_why else "")))


def reduce(an, n: Node, x: State, taint: dict[str, Finding]) -> State:
    op, a = n.op, n.attrs
    rank = len(x.axes)
    dims = sorted({norm_axis(d, rank) for d in a.get("dims", range(rank))})
    safe = identity_test(op)
    any_padded = False
    for i in dims:
        for f in x.axes[i].padded:
            any_padded = True
            if not f.prefix or not safe(f.content):
                taint.setdefault(f.dim, an.finding(f.dim, n, why_unsafe(op).format(d=f.dim)))
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
    return State(tuple(axes), x.uniform if op not in _COUNTED else UNKNOWN)


def reduced_content(op: str, c: Content) -> Content:
    """What the reduction of padded positions holding `c` holds: a constant stays itself under a
    max, min or mean, under a sum only as 0, under a product as 0 or 1."""
    if c.kind == "const" and (op not in _COUNTED or falsy(c) or (op == "prod" and IDENTITY["one"](c))):
        return c
    if neg_huge(c) and get_op(op).pad_identity == "masked":     # a max of masked values stays masked
        return NEG_HUGE
    return GARBAGE


def along(an, n: Node, x: State, taint: dict[str, Finding]) -> State:
    """softmax / log_softmax (safe over masked padding: their `pad_identity`) and cumsum (a
    scan: safe over padding at the end) along one dim."""
    op = n.op
    masks = get_op(op).pad_identity == "masked"
    if not x.axes:
        return State(())
    dim = norm_axis(n.attrs["dim"], len(x.axes))
    axes = list(an.garbage(x.axes))
    ax = x.axes[dim]
    for f in ax.padded:
        if not masks:                   # a scan reads every earlier position: no cut along it
            ok = f.prefix and len(ax.factors) == 1 and not an.cut
            why = "scan over padded dim {d} whose padding is not at the end"
        else:
            ok = f.prefix and neg_huge(f.content)
            why = why_unsafe(op)
            if ok:
                an.masked.add(f.dim)        # safe while each real row keeps a real unmasked logit
                an.softmax_masked.add(f.dim)
                if _masked_by_row(an, n, x, dim, f.dim):
                    an.softmax_qk.add(f.dim)
        if not ok:
            taint.setdefault(f.dim, an.finding(f.dim, n, why.format(d=f.dim)))
    if masks and ax.padded:
        out = at_masked(op) or GARBAGE
        axes[dim] = Axis(tuple(Factor(f.extent, f.dim, out if f.dim else f.content, f.prefix) for f in ax.factors))
    return State(tuple(axes))


def _masked_by_row(an, n: Node, x: State, dim: int, d: str) -> bool:
    """Whether the masked pattern of a softmax's logits may vary along another axis padded along
    `d` (its rows, the queries: a causal triangle), not only along the softmax's own (a key mask
    broadcast over the queries, T5's beside its position bias): then a row is masked whole
    wherever the mask says so, not only where a mask row is all padding. True where the
    analysis did not follow the pattern."""
    varying = an.varying.get(n.inputs[0])
    if varying is None:
        return True
    return any(j != dim and any(f.dim == d for f in x.axes[j].padded) for j in varying if j < len(x.axes))


def argreduce(an, n: Node, x: State, taint: dict[str, Finding]) -> State:
    """argmax/argmin along a padded axis are safe when the padding can never win: argmax over
    padding no larger than any real value (ties resolve to the first, real, index)."""
    dim = norm_axis(n.attrs["dim"], len(x.axes))
    ax = x.axes[dim]
    bound = None
    for f in ax.padded:
        ok = (get_op(n.op).pad_identity == "masked" and f.prefix and ax.single is f and x.lower is not None and
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
