"""Padding rules of data ops: `gather` (embedding, index_select, index, gather: safe where the
index reads real positions only), `full` and `arange` (values made with a padded extent),
`island` (eager `fallback` nodes, read from the ATen op's tags and schema; `aten`: the
ATen-reference ops kept in the graph, read the same way), `region` (a fused
body) and `opaque` (refuses every padded dim that reaches the op).
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import sympy
import torch

from graphmode.analysis.padding_lattice import (GARBAGE, Axis, Content, Factor, Finding, State, const, is_one,
                                                mul_dims, plain, same_dim, symbols)
from graphmode.analysis.padding_rules import rule
from graphmode.ir.graph import Node
from graphmode.ir.ops import norm_axis
from graphmode.ir.types import Dim, normalize_dim

_PER_SAMPLE_ATEN = {"max_pool2d", "max_pool2d_with_indices", "avg_pool2d", "adaptive_avg_pool2d",
                    "adaptive_max_pool2d", "conv1d", "conv2d", "conv3d", "convolution", "conv_transpose2d",
                    "layer_norm", "native_layer_norm", "group_norm", "native_group_norm", "instance_norm",
                    "upsample_nearest2d", "upsample_bilinear2d", "pixel_shuffle",
                    "_native_batch_norm_legit_no_training",
                    # padding, pooling, resizing and patches over the axes after the leading one
                    "reflection_pad1d", "reflection_pad2d", "reflection_pad3d", "replication_pad1d",
                    "replication_pad2d", "replication_pad3d", "avg_pool1d", "max_pool1d", "max_pool1d_with_indices",
                    "avg_pool3d", "max_pool3d", "max_pool3d_with_indices", "adaptive_avg_pool1d", "adaptive_max_pool1d",
                    "adaptive_avg_pool3d", "adaptive_max_pool3d", "upsample_nearest1d", "upsample_linear1d",
                    "upsample_bicubic2d", "upsample_nearest3d", "upsample_trilinear3d", "_upsample_nearest_exact1d",
                    "_upsample_nearest_exact2d", "_upsample_nearest_exact3d", "_upsample_bilinear2d_aa",
                    "_upsample_bicubic2d_aa", "im2col", "col2im", "pixel_unshuffle", "channel_shuffle", "pad"}
_SCANS = {"cumsum", "cumprod", "logcumsumexp", "cummax", "cummin"}     # prefix scans along `dim`
# ATen ops that map each element of their first input on its own, appending this many axes
# (one_hot's classes; bucketize's boundaries are a second input that is not padded)
_PER_ELEMENT = {"one_hot": 1, "bucketize": 0}
# ops along `dim` that take a 1-d index along it (rank 1 whatever self's rank): self and the
# source line up position for position on every other axis
_INDEXED_ALONG = {"index_add", "index_copy", "index_fill", "index_reduce"}
# ops whose `dim` names the one axis kept apart while every other axis is mixed (renorm normalises
# each x.select(dim, i) over all the rest): not "along dim" ops
# norms over the trailing len(normalized_shape) axes (args[1]); every leading axis is a row of its own
_NORMALIZED_LAST = {"layer_norm", "native_layer_norm", "rms_norm", "_fused_rms_norm"}
_MIXES_OTHER_DIMS = {"renorm", "_weight_norm", "_weight_norm_interface", "norm_except_dim", "unique_dim",
                     "unique_consecutive", "unique_dim_consecutive"}


def _island_dims(target: str, args: list, kwargs: Mapping[str, Any], rank: int) -> tuple[bool, list[int] | None]:
    """What an eager island's ATen op does to axes, from the op's own tags and schema:
    (pointwise, dims it works along). dims None: unknown (the op takes no `dim`/`dims`)."""
    from graphmode.ir.fallback import resolve_target
    try:
        op = resolve_target(target)
    except Exception:  # noqa: BLE001 - not an ATen op we can look up
        return False, None
    if torch.Tag.pointwise in op.tags:
        return True, []
    for i, arg in enumerate(op._schema.arguments):
        if arg.name not in ("dim", "dims"):
            continue
        v = args[i] if i < len(args) else kwargs.get(arg.name, arg.default_value)
        vals = v if isinstance(v, (list, tuple)) else [v]
        if not vals or not all(isinstance(d, int) and -rank <= d < max(rank, 1) for d in vals):
            return False, None
        return False, sorted({d % rank for d in vals}) if rank else []
    return False, None


def gather(an, n: Node, ins: list[State], out_shape: Sequence[Dim], taint: dict[str, Finding]) -> State:
    op = n.op
    if op == "embedding":
        table, ids = ins
        an.taint(taint, n, table.axes, "embedding table padded along {dim}")
        return State(an.garbage(ids.axes) + (plain(out_shape[-1]),))
    x = ins[0]
    if not x.axes:               # a 0-d source: every index reads its one element
        return State(an.from_type(out_shape))
    if op == "gather":           # out[..i..] = x[.. idx[..i..] ..] along dim; other axes line up 1:1
        dim = norm_axis(n.attrs["dim"], len(x.axes))
        idx = ins[1]
        for f in x.axes[dim].padded:
            if idx.bound != f.dim and not _below_smallest(an, x.axes[dim], idx):
                taint.setdefault(f.dim, an.finding(f.dim, n, f"gather over padded dim {f.dim} at indices that can "
                                                             "name padded positions"))
        return State(an.garbage(idx.axes))
    if op == "index_select":
        dim = norm_axis(n.attrs["dim"], len(x.axes))
        idx = ins[1]
        pairs = [(dim, idx, 0)]
    else:
        dims = [norm_axis(d, len(x.axes)) for d in n.attrs["dims"]]
        idx_states = ins[1:]
        pairs = [(d, s, None) for d, s in zip(dims, idx_states)]
    # which output axis of the index broadcast each index runs along, and the content it reads
    bshape_rank = max(len(s.axes) for _, s, _ in pairs)
    content_of: dict[int, Content] = {}
    for d, s, _ in pairs:
        data_ax = x.axes[d]
        if not data_ax.padded:
            continue
        reads = unflatten(data_ax, s)
        if reads is None and data_ax.single is not None and s.bound == data_ax.single.dim:
            continue              # the index only names real positions (e.g. an argmax over them)
        if reads is None and _below_smallest(an, data_ax, s):
            continue              # constant indices every admissible size holds
        if reads is None:         # every padded factor: on a flattened axis an inner one moves the rows
            for f in data_ax.padded:
                taint.setdefault(f.dim, an.finding(f.dim, n, f"gather over padded dim {f.dim} at indices that can "
                                                             "name padded positions"))
            continue
        for ax, c in reads.items():
            content_of[ax + (bshape_rank - len(s.axes))] = c
    b_axes = []
    for i in range(bshape_rank):
        src = None
        for _, s, _ in pairs:
            j = i - (bshape_rank - len(s.axes))
            if j >= 0 and s.axes[j].padded:
                src = s.axes[j]
                break
        if src is None:
            b_axes.append(None)
        elif i in content_of and src.single is not None:
            b_axes.append(Axis((Factor(src.single.extent, src.single.dim, content_of[i], src.single.prefix),)))
        else:
            b_axes.append(an.garbage([src])[0])
    if op == "index_select":
        axes = list(an.garbage(x.axes))
        axes[pairs[0][0]] = b_axes[0] or plain(out_shape[pairs[0][0]])
    else:
        dims = [d for d, _, _ in pairs]
        rest = [an.garbage([ax])[0] for i, ax in enumerate(x.axes) if i not in dims]
        if dims == list(range(dims[0], dims[0] + len(dims))):
            before = [an.garbage([ax])[0] for ax in x.axes[:dims[0]]]
            after = [an.garbage([ax])[0] for ax in x.axes[dims[-1] + 1:]]
            mid_start = len(before)
            axes = before + [None] * bshape_rank + after
        else:
            mid_start = 0
            axes = [None] * bshape_rank + rest
        for i, ax in enumerate(b_axes):
            axes[mid_start + i] = ax
        axes = [ax if ax is not None else an.fresh_axis(out_shape[i], GARBAGE) for i, ax in enumerate(axes)]
        affine = _relabelled_affine(x, pairs, mid_start + bshape_rank)
        if affine is not None:
            return State(tuple(axes), affine=affine, lower=x.lower)
    return State(tuple(axes))


def _relabelled_affine(x: State, pairs: list, end: int) -> tuple[tuple[int, Any], ...] | None:
    """x[arange, arange] of a position index (an arange broadcast to [batch, seq], indexed as
    transformers' mask functions do) is that index again, along the output axes the aranges
    run along: keep its affine form so position comparisons (k <= q) stay known."""
    if not x.affine:
        return None
    along = {}
    for d, s, _ in pairs:
        if s.affine is None or len(s.affine) != 1 or s.affine[0][1] != 1 or s.offset is not None:
            return None
        along[d] = end - len(s.axes) + s.affine[0][0]
    if any(ax not in along for ax, _ in x.affine):
        return None
    return tuple(sorted((along[ax], c) for ax, c in x.affine))


def unflatten(data_ax: Axis, idx: State) -> dict[int, Content] | None:
    """When index `idx` reads data axis `data_ax` at exactly the positions its own axes name
    (an arange, or `b * seq + s` into a flattened [batch*seq] axis), the gather only relabels
    axes: index axis -> the padded content it reads. None when it could read anything."""
    if idx.affine is None:
        return None
    coeffs = dict(idx.affine)
    factors = [f for f in data_ax.factors if not is_one(f.extent)]
    out: dict[int, Content] = {}
    stride: Dim = 1
    if idx.offset is not None:    # the bounded term reads real positions of the innermost factor only
        if not factors or factors[-1].dim != idx.offset or not factors[-1].prefix:
            return None
        stride = factors[-1].extent
        factors = factors[:-1]
    for f in reversed(factors):
        hits = [ax for ax, c in coeffs.items() if same_dim(c, stride)]
        if len(hits) != 1:
            return None
        ax = hits[0]
        own = idx.axes[ax]
        if not same_dim(own.factors[0].extent if len(own.factors) == 1 else 0, f.extent) or (
                f.dim is not None and (not f.prefix or own.single is None or own.single.dim != f.dim)):
            return None
        if f.dim is not None:
            out[ax] = f.content
        del coeffs[ax]
        stride = mul_dims(stride, f.extent)
    return out if not coeffs else None


@rule("full")
def full(an, n: Node, ins: list[State], taint: dict[str, Finding]) -> list[State]:
    v = n.attrs["value"]
    v = bool(v) if n.attrs.get("dtype") == "bool" else v
    return [State(an.from_type(an.shape(n.outputs[0]), const(v)), uniform=v,
                  lower=float(v) if isinstance(v, (int, float)) else None)]


def arange(an, n: Node, out_shape: Sequence[Dim], taint: dict[str, Finding]) -> State:
    a = n.attrs
    end = normalize_dim(a["end"])
    start, step = a.get("start", 0), a.get("step", 1)
    e = out_shape[0]
    start_d = normalize_dim(start)
    if same_dim(e, 1):            # one element: the value `start` (e.g. arange(seq, seq + 1) is `seq`)
        return State((plain(1),), uniform=start_d)     # pointwise.py taints it where it meets data
    d = next((p for p in an.padded if not isinstance(end, int) and same_dim(end, sympy.Symbol(
        p, integer=True, positive=True))), None)
    if d is not None and start_d == 0 and step == 1:
        return State((Axis((Factor(e, d, Content("ge_real", d), True),)),), affine=((0, 1),), lower=0.0)
    affine = ((0, 1),) if start_d == 0 and step == 1 else None
    lower = float(start_d) if isinstance(start_d, int) and step > 0 else None
    return State((an.fresh_axis(e, GARBAGE),), affine=affine, lower=lower)


def fallback(an, n: Node, ins: list[State], taint: dict[str, Finding]) -> list[State]:
    """Eager islands: read from the ATen op they call (`aten_call`)."""
    return aten_call(an, n, ins, taint, str(n.attrs.get("target", "")), list(n.attrs.get("args", [])),
                     n.attrs.get("kwargs", {}), "eager island ")


def aten_reference(an, n: Node, ins: list[State], taint: dict[str, Finding]) -> list[State]:
    """ATen-reference ops kept in the graph as themselves (sort, topk, cummax, ...): read as the
    island calling the same ATen op would be."""
    return aten_call(an, n, ins, taint, f"aten.{n.op}.{n.attrs.get('overload', 'default')}",
                     list(n.attrs.get("args", [])), n.attrs.get("kwargs", {}), "")


def aten_call(an, n: Node, ins: list[State], taint: dict[str, Finding], target: str, args: list,
              kwargs: Mapping[str, Any], label: str) -> list[State]:
    """A node that calls ATen op `target`: pointwise ops broadcast like elementwise ones; an op
    along `dim` keeps the other axes independent (`_along_dim`); anything else is opaque."""
    shapes = [an.shape(o) for o in n.outputs]
    short = target.split(".")[1] if target.startswith("aten.") and "." in target else target
    if len(shapes) == 1 and ins:
        rank = len(shapes[0])
        pointwise, _ = _island_dims(target, args, kwargs, rank)
        if pointwise:                       # broadcasting: each output position reads the same of its inputs
            srcs = [next((s.axes[j] for s in ins if (j := i - (rank - len(s.axes))) >= 0 and s.axes[j].padded),
                         None) for i in range(rank)]
            return [State(tuple(an.garbage([src])[0] if src is not None else an.fresh_axis(e, GARBAGE)
                                for src, e in zip(srcs, shapes[0])))]
    if short == "repeat" and len(ins) == 1 and len(shapes) == 1 and len(args) > 1 and isinstance(args[1], list):
        return [_repeat(an, n, ins[0], args[1], shapes[0], f"{label}{target}", taint)]
    if short == "select_scatter" and len(ins) == 2 and len(args) > 2 and isinstance(args[2], int) \
            and ins[0].axes and len(ins[1].axes) == len(ins[0].axes) - 1:
        index = args[3] if len(args) > 3 and isinstance(args[3], int) else -1
        return [_select_scatter(an, n, ins[0], ins[1], args[2] % len(ins[0].axes), index, f"{label}{target}", taint)]
    if short in _NORMALIZED_LAST and ins and len(args) > 1 and args[0] == {"$in": 0} \
            and isinstance(args[1], list) and 0 < len(args[1]) <= len(ins[0].axes):
        return _normalized_last(an, n, ins, shapes, len(args[1]), f"{label}{target}", taint)
    along_dim = _along_dim(an, n, ins, shapes, target, args, kwargs, label, taint) \
        if short not in _MIXES_OTHER_DIMS else None
    if along_dim is not None:
        return along_dim
    if short in _PER_ELEMENT and ins and len(shapes) == 1 and not any(ax.padded for s in ins[1:] for ax in s.axes) \
            and _valid_padding(short, ins[0], args):
        rank = len(ins[0].axes)             # each element of the first input on its own (+ trailing new axes)
        if len(shapes[0]) == rank + _PER_ELEMENT[short]:
            return [State(an.garbage(ins[0].axes) + an.from_type(shapes[0][rank:]))]
    if short in _PER_SAMPLE_ATEN and ins and ins[0].axes:
        for s in ins:
            an.taint(taint, n, s.axes[1:] if s is ins[0] else s.axes,
                     f"{label}{target} mixes positions along padded dim {{dim}}")
        lead = an.garbage(ins[0].axes[:1])
        return [State(lead + an.from_type(sh[1:])) if sh else State(()) for sh in shapes]
    for s in ins:
        an.taint(taint, n, s.axes, f"{label}{target} over padded dim {{dim}}: graphmode cannot see "
                                   "how it uses padded positions")
    return [State(an.from_type(sh)) for sh in shapes]


def _normalized_last(an, n: Node, ins: list[State], shapes: list, k: int, what: str,
                     taint: dict[str, Finding]) -> list[State]:
    """A layer or RMS norm: each row's statistics over its last k axes, so a padded axis among
    those is mixed into real rows, and every other axis passes through position for position
    (its padded rows hold what padding computes). The statistics outputs (native_layer_norm's
    mean and rstd) keep the leading axes too."""
    x = ins[0]
    rank = len(x.axes)
    an.taint(taint, n, x.axes[rank - k:], f"{what} normalises over padded dim {{dim}}")
    for s in ins[1:]:                   # weight and bias: padded, they would scale by padding
        an.taint(taint, n, s.axes, f"{what} with weights padded along {{dim}}")
    lead = an.garbage(x.axes[:rank - k])
    return [State(lead + an.from_type(sh[rank - k:])) if len(sh) == rank else State(an.from_type(sh))
            for sh in shapes]


def _below_smallest(an, ax: Axis, index: State) -> bool:
    """Every index is a known constant in [0, the dim's smallest admissible size): it names
    real positions whatever the request (x.index_select(1, tensor([1, 3])) with seq >= 4)."""
    real = an.always_real(ax)
    return (real is not None and index.lower is not None and index.upper is not None and index.lower >= 0
            and index.upper < real)


def _repeat(an, n: Node, x: State, repeats: list, shape: Sequence[Dim], what: str,
            taint: dict[str, Finding]) -> State:
    """x.repeat(r): an axis repeated once keeps its positions (and padding); one tiled puts
    the padding in the middle of the copies (unsafe); leading new axes are plain."""
    lead = len(repeats) - len(x.axes)
    axes = list(an.from_type(shape[:lead])) if lead > 0 else []
    for i, ax in enumerate(x.axes):
        if repeats[lead + i] == 1:
            axes.append(an.garbage([ax])[0])
            continue
        an.taint(taint, n, [ax], f"{what} tiles padded dim {{dim}}")
        axes.append(an.fresh_axis(shape[lead + i], GARBAGE))
    return State(tuple(axes))


def _select_scatter(an, n: Node, x: State, src: State, dim: int, index: int, what: str,
                    taint: dict[str, Finding]) -> State:
    """x with x.select(dim, index) replaced by src (`x[:, 0] = v`): every other axis of x lines
    up with src's, position for position; along `dim` the write stays real where the index is
    below the dim's smallest admissible size (0 is; -1 names a padded position)."""
    real = an.always_real(x.axes[dim])
    if real is None or not 0 <= index < real:
        an.taint(taint, n, [x.axes[dim]], f"{what} writes at index {index} along padded dim {{dim}}")
    axes = []
    for i, ax in enumerate(x.axes):
        if i == dim:
            axes.append(an.garbage([ax])[0])
            continue
        other = src.axes[i if i < dim else i - 1]
        axes.append(an.garbage([ax if ax.padded or not other.padded else other])[0])
    return State(tuple(axes))


def _valid_padding(short: str, x: State, args: list) -> bool:
    """one_hot raises on a class outside [0, num_classes): padded positions must hold one (the
    input's pad value, not values computed from padding)."""
    if short != "one_hot":
        return True
    classes = args[1] if len(args) > 1 else -1
    return isinstance(classes, int) and classes > 0 and all(
        f.content.kind == "const" and isinstance(f.content.value, int) and 0 <= f.content.value < classes
        for ax in x.axes for f in ax.padded)


def _along_dim(an, n: Node, ins: list[State], shapes: list, target: str, args: list, kwargs: Mapping[str, Any],
               label: str, taint: dict[str, Finding]) -> list[State] | None:
    """An island working along `dim` of inputs of one rank, whose outputs keep every axis (sort,
    topk, max.dim with keepdim) or drop the `dim` axes (var, median, argmax, select, unbind):
    the other axes pass through position for position. None when the op is not of that kind."""
    if not ins or not ins[0].axes:
        return None
    rank = len(ins[0].axes)
    pointwise, along = _island_dims(target, args, kwargs, rank)
    if target.startswith("aten.") and target.split(".")[1] in _INDEXED_ALONG and along and len(along) == 1 \
            and rank > 1:
        index = [s for s in ins if len(s.axes) == 1]        # their 1-d index runs along `dim` only
        for s in index:       # padded, it could name padded positions
            an.taint(taint, n, s.axes, f"{label}{target} with an index padded along {{dim}}")
        ins = [s for s in ins if len(s.axes) != 1]
    if pointwise or not along or any(len(s.axes) not in (0, rank) for s in ins):
        return None
    kept = [i for i in range(rank) if i not in along]
    if not shapes or any(len(sh) not in (rank, len(kept)) for sh in shapes):
        return None
    srcs = [next((s.axes[i] for s in ins if s.axes and s.axes[i].padded), None) for i in range(rank)]
    scan = target.split(".")[1] in _SCANS and len(ins) == 1 and all(len(sh) == rank for sh in shapes)
    scanned = set()                      # a scan reads earlier positions only: padding at the end stays there
    for i in along:
        if srcs[i] is None:
            continue
        if scan and srcs[i].single is not None and srcs[i].single.prefix and not an.cut:
            scanned.add(i)
        else:
            an.taint(taint, n, [srcs[i]], f"{label}{target} along padded dim {{dim}}")
    outs = []
    for sh in shapes:
        axes = range(rank) if len(sh) == rank else kept
        outs.append(State(tuple(an.garbage([srcs[i]])[0] if srcs[i] is not None and (i not in along or i in scanned)
                                else an.fresh_axis(e, GARBAGE) for i, e in zip(axes, sh))))
    return outs


@rule("region")
def region(an, n: Node, ins: list[State], taint: dict[str, Finding]) -> list[State]:
    """A fused region: its body, analysed op by op over the region's inputs."""
    body = an.run(n.body, {**dict(zip(n.inputs, ins)), **{k: an.constant(n.body, k) for k in n.body.constants}})
    return [body[o] for o in n.outputs]


@rule("opaque")
def opaque(an, n: Node, ins: list[State], taint: dict[str, Finding]) -> list[State]:
    """An op whose use of positions graphmode does not model: a padded dim reaching it is unsafe."""
    for s in ins:
        an.taint(taint, n, s.axes, f"no padding rule for {n.op} over padded dim {{dim}}")
    return [State(an.from_type(an.shape(o))) for o in n.outputs]


rule("gather")(lambda an, n, ins, taint: [gather(an, n, ins, an.shape(n.outputs[0]), taint)])
rule("arange")(lambda an, n, ins, taint: [arange(an, n, an.shape(n.outputs[0]), taint)])
rule("island")(fallback)
rule("aten")(aten_reference)
