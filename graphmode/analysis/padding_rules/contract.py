"""Padding rules of contractions: `linear`, `matmul` (safe over a padded contracted dim whose
padded positions are zero on one side), `attention` (sdpa: padded keys must be masked, or causal
with the padding at the end) and `window` (convolution and pooling mix every axis but the batch).
"""
from __future__ import annotations

from typing import Sequence

from graphmode.analysis.padding_lattice import (GARBAGE, Axis, Factor, Finding, State, falsy, finite, neg_huge, plain,
                                                same_dim)
from graphmode.analysis.padding_rules import rule
from graphmode.ir.graph import Node
from graphmode.ir.ops.spec import pair
from graphmode.ir.types import Dim


def linear(an, n: Node, ins: list[State], taint: dict[str, Finding]) -> State:
    x = ins[0]
    k = x.axes[-1]
    for f in k.padded:
        if not (falsy(f.content) and f.prefix):
            taint.setdefault(f.dim, an.finding(f.dim, n, f"contraction over padded dim {f.dim} "
                                                         "whose padded positions are not zero"))
    an.taint(taint, n, [ax for s in ins[1:] for ax in s.axes], "padded weights")
    return State(an.garbage(x.axes[:-1]) + (plain(an.shape(n.outputs[0])[-1]),))


def matmul(an, n: Node, ins: list[State], taint: dict[str, Finding]) -> State:
    a, b = ins
    for side, other in ((a.axes[-1], b.axes[-2]), (b.axes[-2], a.axes[-1])):
        for f in side.padded:
            facing = [g for g in other.padded if g.dim == f.dim]
            # zeros on one side mask the other only where it is finite there (0 * NaN, 0 * inf are NaN)
            zero_other = any(falsy(g.content) and g.prefix for g in facing) and finite(f.content)
            zero_here = falsy(f.content) and f.prefix and all(finite(g.content) for g in facing)
            if not (zero_here or zero_other):
                taint.setdefault(f.dim, an.finding(f.dim, n, f"contraction over padded dim {f.dim} "
                                                             "whose padded positions are not zero (times a finite "
                                                             "value on the other side)"))
    out_shape = an.shape(n.outputs[0])
    batch = broadcast_batch(an, [a.axes[:-2], b.axes[:-2]], out_shape[:-2])

    def keep_zero(ax: Axis) -> Axis:
        return Axis(tuple(Factor(f.extent, f.dim, f.content if falsy(f.content) else GARBAGE, f.prefix)
                          if f.dim else f for f in ax.factors))
    return State(batch + (keep_zero(a.axes[-2]), keep_zero(b.axes[-1])))


def einsum(an, n: Node, ins: list[State], taint: dict[str, Finding]) -> State:
    """A letter kept in the output passes its padding through (a batch, the tokens); a letter
    summed over is safe where some operand holds zeros at its padded positions, as matmul's
    contraction; a repeated letter (a diagonal), an ellipsis or a letter padded by two dims is
    refused along its dims."""
    out_shape = an.shape(n.outputs[0])
    eq = str(n.attrs.get("equation", "")).replace(" ", "")
    lhs, arrow, rhs = eq.partition("->")
    terms = lhs.split(",")
    if not arrow or "." in eq or len(terms) != len(ins) or len(rhs) != len(out_shape) or \
            any(len(t) != len(s.axes) for t, s in zip(terms, ins)):
        for s in ins:
            an.taint(taint, n, s.axes, "einsum over padded dim {dim} in a form graphmode does not follow")
        return State(an.from_type(out_shape))
    seen: dict[str, list[Axis]] = {}
    for t, s in zip(terms, ins):
        for ch, ax in zip(t, s.axes):
            if ax.padded:
                seen.setdefault(ch, []).append(ax)
    kept: dict[str, Axis] = {}
    for ch, axes in seen.items():
        facs = [ax.single for ax in axes]
        one_dim = all(f is not None and f.prefix for f in facs) and len({f.dim for f in facs}) == 1
        diagonal = any(t.count(ch) > 1 for t in terms)
        if ch in rhs and one_dim and not diagonal:
            kept[ch] = axes[0]
        elif ch not in rhs and one_dim and not diagonal and any(falsy(f.content) for f in facs) and \
                all(falsy(f.content) or finite(f.content) for f in facs):
            continue                        # summed over zeros times finite values: the real sums are eager's
        else:
            an.taint(taint, n, axes, "einsum sums over padded dim {dim} whose padded positions are not zero"
                     if ch not in rhs else "einsum reads padded dim {dim} along a diagonal or with another dim")
    return State(tuple(an.garbage([kept[ch]])[0] if ch in kept else an.fresh_axis(e, GARBAGE)
                       for ch, e in zip(rhs, out_shape)))


def broadcast_batch(an, groups: list[Sequence[Axis]], out: Sequence[Dim]) -> tuple[Axis, ...]:
    axes = []
    for i, e in enumerate(out):
        src = None
        for grp in groups:
            j = i - (len(out) - len(grp))
            if j >= 0 and grp[j].padded:
                src = grp[j]
                break
        axes.append(an.garbage([src])[0] if src is not None else an.fresh_axis(e, GARBAGE))
    return tuple(axes)


def _heads_first(s: State) -> State:
    """[batch, seq, heads, dim] axes as [batch, heads, seq, dim] (sdpa's `bshd` layout)."""
    a = s.axes
    return State((a[0], a[2], a[1], a[3]))


def sdpa(an, n: Node, ins: list[State], taint: dict[str, Finding]) -> State:
    if n.attrs.get("layout", "bhsd") == "bshd":       # the same attention with the head permutes folded in
        qkv = [_heads_first(s) for s in ins[:3]]
        b, sq, h, e = an.shape(n.outputs[0])
        return _heads_first(_sdpa(an, n, qkv + list(ins[3:]), taint, (b, h, sq, e)))
    return _sdpa(an, n, ins, taint, None)


def _sdpa(an, n: Node, ins: list[State], taint: dict[str, Finding], out_shape: tuple | None) -> State:
    q, k, v = ins[:3]
    mask = ins[3] if len(ins) > 3 else None
    an.taint(taint, n, [q.axes[-1], k.axes[-1]], "attention head dim {dim} is padded")
    keys = {f.dim: f for ax in (k.axes[-2], v.axes[-2]) for f in ax.padded}
    for f in v.axes[-2].padded:            # a masked key's weight is 0, and 0 * NaN or inf is NaN
        if not finite(f.content):
            taint.setdefault(f.dim, an.finding(f.dim, n, f"attention values at padded keys ({f.dim}) are not "
                                                         "finite, which a mask's zero weight does not cancel"))
    for d, f in keys.items():
        covered = False
        if mask is not None and mask.axes and mask.axes[-1].single is not None:
            m = mask.axes[-1].single
            covered = m.dim == d and m.prefix and (falsy(m.content) if m.content.kind == "const"
                                                   and isinstance(m.content.value, bool) else neg_huge(m.content))
            if covered:
                an.masked.add(d)            # safe while each real query keeps a real unmasked key
                qm = mask.axes[-2].single if len(mask.axes) >= 2 else None
                by_query = len(mask.axes) - 2 in an.varying.get(n.inputs[3], range(len(mask.axes)))
                if not isinstance(m.content.value, bool) and qm is not None and qm.dim == d and by_query:
                    # a query x key mask with a finite fill (Falcon's ALiBi bias): a query row masked
                    # whole (left padding) is not 0 but spread over every key, the bucket's padded ones too;
                    # not where only the keys are masked (T5: a key mask plus a position bias)
                    an.query_key.add(d)
        if not covered and n.attrs.get("is_causal") and not an.cut:    # a later row reads the earlier ones
            qf = q.axes[-2].single
            covered = (qf is not None and qf.dim == d and qf.prefix and f.prefix
                       and same_dim(qf.extent, f.extent))
        if not covered:
            taint.setdefault(d, an.finding(d, n, f"attention over padded keys ({d}) that no mask covers: "
                                                 "declare the attention mask input, or use causal attention"))
    out_shape = an.shape(n.outputs[0]) if out_shape is None else out_shape
    groups = [q.axes[:-2], k.axes[:-2], v.axes[:-2]] + ([mask.axes[:-2]] if mask is not None else [])
    batch = broadcast_batch(an, groups, out_shape[:-2])
    return State(batch + an.garbage([q.axes[-2]]) + (plain(out_shape[-1]),))


@rule("window")
def window(an, n: Node, ins: list[State], taint: dict[str, Finding]) -> list[State]:
    """Convolution and pooling: each sample (axis 0) on its own, a window over every other axis,
    except a convolution's spatial axis of kernel 1, stride 1 and no padding (SqueezeBERT's
    position-wise conv1d), where each output position reads its own input position only."""
    x = ins[0]
    own = {0} | _one_by_one(an, n)
    an.taint(taint, n, [ax for i, ax in enumerate(x.axes) if i not in own], "convolution/pooling window over "
                                                                             "padded dim {dim}")
    an.taint(taint, n, [ax for s in ins[1:] for ax in s.axes], "padded convolution weights")
    return [State(tuple(an.garbage([x.axes[i]])[0] if i in own else an.from_type([d])[0]
                        for i, d in enumerate(an.shape(o)))) for o in n.outputs]      # and indices


def _one_by_one(an, n: Node) -> set[int]:
    """The spatial axes of a conv2d that map each position to itself (kernel 1, stride 1, no padding)."""
    if n.op != "conv2d" or len(n.inputs) < 2:
        return set()
    w = an.shape(n.inputs[1])
    stride, pad = pair(n.attrs.get("stride", 1)), pair(n.attrs.get("padding", 0))
    return {2 + i for i in range(2) if w[2 + i] == 1 and stride[i] == 1 and pad[i] == 0}


rule("linear")(lambda an, n, ins, taint: [linear(an, n, ins, taint)])
rule("matmul")(lambda an, n, ins, taint: [matmul(an, n, ins, taint)])
rule("einsum")(lambda an, n, ins, taint: [einsum(an, n, ins, taint)])
rule("attention")(lambda an, n, ins, taint: [sdpa(an, n, ins, taint)])
