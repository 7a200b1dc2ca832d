"""ONNX ops with no core op of their own, written as a few core ops (the way their ONNX
definitions read): Mean, Shrink, Hardmax, LpNormalization, InstanceNormalization, LRN,
LpPool, EyeLike, OneHot, reversed / exclusive CumSum, ArgMax/ArgMin with
select_last_index, and Einsum (one core op). Each handler refuses, naming the attribute, what it does not cover.
"""
from __future__ import annotations

from typing import Any

import torch

from graphmode.capture.onnx.convert_core import _bind, coerced_2d
from graphmode.capture.onnx.convert_nn import _pads
from graphmode.capture.onnx.fold import _FLOAT_DTYPES, _Known
from graphmode.capture.onnx.importer import STATIC_AXIS_FIX, _Importer, _handles, _shape_attr
from graphmode.capture.onnx.values import _data_sized, data_length_error
from graphmode.capture.onnx.pooling import pool_by_windows
from graphmode.capture.onnx.checks import ONNX_DTYPES, CheckedNode
from graphmode.ir.ops import norm_axis
from graphmode.ir.types import DTYPES, normalize_dim


def _const(imp: _Importer, t: torch.Tensor, hint: str) -> str:
    return imp.materialise(_Known.of(t), hint)


def _static(imp: _Importer, size, what: str) -> int:
    if not isinstance(size, int) and _data_sized(size):
        raise data_length_error(imp, what, size)
    if not isinstance(size, int):
        raise imp.fail(f"{what} over a symbolic extent", fix=STATIC_AXIS_FIX)
    return size


@_handles("Mean")
def _mean(imp: _Importer, n) -> None:
    ins = [imp.operand(i) for i in n.input if i]
    acc = ins[0]
    for v in ins[1:]:
        acc = imp.emit("add", [acc, v], {}, hint=n.output[0])
    if len(ins) == 1:
        imp.alias(n.output[0], n.input[0])
        return
    dt = imp.g.type_of(acc).dtype
    imp.emit("div", [acc, imp.scalar(float(len(ins)), dt, f"{n.output[0]}_count")], {}, out=n.output[0])


@_handles("Shrink")
def _shrink(imp: _Importer, n) -> None:
    """x + bias below -lambd, x - bias above lambd, 0 between."""
    x = imp.operand(n.input[0])
    dt = imp.g.type_of(x).dtype
    lambd, bias = float(imp.attr(n, "lambd", 0.5)), float(imp.attr(n, "bias", 0.0))
    if dt not in _FLOAT_DTYPES and not (lambd.is_integer() and bias.is_integer()):
        raise imp.fail(f"Shrink of {dt} values with fractional lambd {lambd} or bias {bias}")
    h = n.output[0]
    lo = imp.emit("lt", [x, imp.scalar(-lambd, dt, f"{h}_lo")], {}, hint=h)
    hi = imp.emit("gt", [x, imp.scalar(lambd, dt, f"{h}_hi")], {}, hint=h)
    b = imp.scalar(bias, dt, f"{h}_bias")
    up = imp.emit("add", [x, b], {}, hint=h)
    down = imp.emit("sub", [x, b], {}, hint=h)
    inner = imp.emit("where", [hi, down, imp.scalar(0, dt, f"{h}_zero")], {}, hint=h)
    imp.emit("where", [lo, up, inner], {}, out=n.output[0])


def _arange_along(imp: _Importer, size: int, axis: int, rank: int, hint: str) -> str:
    """0..size-1 shaped to broadcast along `axis` of a rank-`rank` tensor."""
    shape = [1] * rank
    shape[axis] = size
    return _const(imp, torch.arange(size).reshape(shape), hint)


@_handles("Hardmax")
def _hardmax(imp: _Importer, n) -> None:
    """1 at the first maximum along axis, 0 elsewhere; before opset 13 over the input coerced to
    2-d at axis (default 1), as Softmax then."""
    x = imp.operand(n.input[0])
    xt = imp.g.type_of(x)
    h = n.output[0]
    axis = norm_axis(imp.attr(n, "axis", -1 if imp.opset >= 13 else 1), xt.rank)
    if imp.opset >= 13 or axis == xt.rank - 1:
        _first_max(imp, x, axis, out=h)
        return
    flat = _first_max(imp, coerced_2d(imp, x, axis, h), 1, hint=h)
    imp.emit("reshape", [flat], {"shape": _shape_attr(xt.shape)}, out=h)


def _first_max(imp: _Importer, x: str, axis: int, **where: str) -> str:
    """One-hot of the first maximum along `axis` (`where`: out= or hint=)."""
    xt = imp.g.type_of(x)
    size = _static(imp, xt.shape[axis], "Hardmax")
    h = where.get("out") or where["hint"]
    idx = imp.emit("argmax", [x], {"dim": axis, "keepdim": True}, hint=h)
    hit = imp.emit("eq", [idx, _arange_along(imp, size, axis, xt.rank, f"{h}_pos")], {}, hint=h)
    return imp.emit("cast", [hit], {"dtype": xt.dtype}, **where)


@_handles("LpNormalization")
def _lp_normalization(imp: _Importer, n) -> None:
    x = imp.operand(n.input[0])
    xt = imp.g.type_of(x)
    p = int(imp.attr(n, "p", 2))
    if p not in (1, 2):
        raise imp.fail(f"LpNormalization p={p}", fix="p 1 or 2")
    axis = norm_axis(imp.attr(n, "axis", -1), xt.rank)
    h = n.output[0]
    mag = imp.emit("abs", [x], {}, hint=h) if p == 1 else imp.emit("mul", [x, x], {}, hint=h)
    norm = imp.emit("sum", [mag], {"dims": [axis], "keepdim": True}, hint=h)
    if p == 2:
        norm = imp.emit("sqrt", [norm], {}, hint=h)
    zero = imp.scalar(0, xt.dtype, f"{h}_zero")
    is_zero = imp.emit("eq", [norm, zero], {}, hint=h)
    q = imp.emit("div", [x, norm], {}, hint=h)
    imp.emit("where", [is_zero, zero, q], {}, out=n.output[0])     # onnx: 0 where the norm is 0


@_handles("InstanceNormalization")
def _instance_norm(imp: _Importer, n) -> None:
    x, scale, bias = (imp.operand(i) for i in n.input[:3])
    xt = imp.g.type_of(x)
    eps = float(imp.attr(n, "epsilon", 1e-5))
    axes = list(range(2, xt.rank))
    h = n.output[0]
    mean = imp.emit("mean", [x], {"dims": axes, "keepdim": True}, hint=h)
    centred = imp.emit("sub", [x, mean], {}, hint=h)
    var = imp.emit("mean", [imp.emit("mul", [centred, centred], {}, hint=h)], {"dims": axes, "keepdim": True}, hint=h)
    std = imp.emit("sqrt", [imp.emit("add", [var, imp.scalar(eps, xt.dtype, f"{h}_eps")], {}, hint=h)], {}, hint=h)
    shape = [xt.shape[1]] + [1] * (xt.rank - 2)
    s = imp.emit("reshape", [scale], {"shape": _shape_attr(shape)}, hint=f"{h}_scale")
    b = imp.emit("reshape", [bias], {"shape": _shape_attr(shape)}, hint=f"{h}_bias")
    y = imp.emit("mul", [imp.emit("div", [centred, std], {}, hint=h), s], {}, hint=h)
    imp.emit("add", [y, b], {}, out=n.output[0])


@_handles("LRN")
def _lrn(imp: _Importer, n) -> None:
    """x / (bias + alpha / size * sum of x^2 over the `size` channels around c) ** beta."""
    x = imp.operand(n.input[0])
    xt = imp.g.type_of(x)
    size = int(imp.attr(n, "size"))
    alpha, beta, bias = (float(imp.attr(n, k, d)) for k, d in (("alpha", 1e-4), ("beta", 0.75), ("bias", 1.0)))
    c = _static(imp, xt.shape[1], "LRN")
    h = n.output[0]
    sq = imp.emit("mul", [x, x], {}, hint=h)
    before, after = (size - 1) // 2, size - 1 - (size - 1) // 2
    pads = [0, 0] * (xt.rank - 2) + [before, after]
    padded = imp.emit("pad", [sq], {"pads": pads, "value": 0.0}, hint=h)
    total = None
    for j in range(size):
        part = imp.emit("slice", [padded], {"dim": 1, "start": j, "end": j + c, "step": 1}, hint=h)
        total = part if total is None else imp.emit("add", [total, part], {}, hint=h)
    dt = xt.dtype
    scaled = imp.emit("mul", [total, imp.scalar(alpha / size, dt, f"{h}_alpha")], {}, hint=h)
    base = imp.emit("add", [scaled, imp.scalar(bias, dt, f"{h}_bias")], {}, hint=h)
    den = imp.emit("pow", [base, imp.scalar(beta, dt, f"{h}_beta")], {}, hint=h)
    imp.emit("div", [x, den], {}, out=n.output[0])


@_handles("LpPool")
def _lp_pool(imp: _Importer, n) -> None:
    """(sum over the window of |x|^p)^(1/p). The window sum is a depthwise convolution with a kernel
    of ones on 1-d and 2-d inputs (pads, strides and dilations as given); 3-d inputs and ceil mode
    (whose last-window rule the convolution does not follow) sum strided slices instead."""
    x = imp.operand(n.input[0])
    xt = imp.g.type_of(x)
    rank = xt.rank - 2
    kernel = list(imp.attr(n, "kernel_shape"))
    strides = list(imp.attr(n, "strides", [1] * rank))
    dil = list(imp.attr(n, "dilations", [1] * rank))
    p = float(imp.attr(n, "p", 2))
    pads = _pads(imp, n, xt, kernel, strides, dil)
    ceil = bool(imp.attr(n, "ceil_mode", 0))
    h, dt = n.output[0], xt.dtype
    mag = imp.emit("abs", [x], {}, hint=h)
    powed = mag if p == 1 else imp.emit("pow", [mag, imp.scalar(p, dt, f"{h}_p")], {}, hint=h)
    if rank not in (1, 2) or ceil:
        total = pool_by_windows(imp, n, powed, "sum", kernel, strides, dil, pads, ceil, True)
    else:
        c = _static(imp, xt.shape[1], "LpPool")
        if rank == 1:
            powed = imp.emit("reshape", [powed], {"shape": _shape_attr(list(xt.shape[:2]) + [1, xt.shape[2]])},
                             hint=f"{h}_2d")
            kernel, strides, dil, pads = [1] + kernel, [1] + strides, [1] + dil, [0, pads[0], 0, pads[1]]
        padded = imp.emit("pad", [powed], {"pads": [pads[1], pads[3], pads[0], pads[2]], "value": 0.0}, hint=h)
        ones = _const(imp, torch.ones([c, 1] + kernel, dtype=DTYPES[dt]), f"{h}_ones")
        total = imp.emit("conv2d", [padded, ones], {"stride": strides, "padding": [0, 0], "dilation": dil,
                                                    "groups": c}, hint=h)
        if rank == 1:
            t = imp.g.type_of(total)
            total = imp.emit("reshape", [total], {"shape": _shape_attr(list(t.shape[:2]) + [t.shape[3]])}, hint=h)
    y = total if p == 1 else imp.emit("pow", [total, imp.scalar(1.0 / p, dt, f"{h}_inv_p")], {}, hint=h)
    _bind(imp, n.output[0], y)


@_handles("EyeLike")
def _eye_like(imp: _Importer, n) -> None:
    xt = imp.type_of(n.input[0])
    rows, cols = (_static(imp, d, "EyeLike") for d in xt.shape)
    to = imp.attr(n, "dtype", None)
    dt = ONNX_DTYPES.get(to) if to is not None else xt.dtype
    if dt is None:
        raise imp.fail(f"EyeLike dtype {to} has no graphmode dtype")
    k = int(imp.attr(n, "k", 0))
    eye = torch.zeros(rows, cols, dtype=DTYPES[dt])
    for i in range(rows):
        if 0 <= i + k < cols:
            eye[i, i + k] = 1
    imp.set_tensor(n.output[0], eye)


@_handles("OneHot")
def _one_hot(imp: _Importer, n) -> None:
    """values[1] where the index (negative counts from the end) equals the position along the new
    axis, values[0] elsewhere (an index out of range gives a row of values[0])."""
    idx = imp.operand(n.input[0])
    it = imp.g.type_of(idx)
    k = imp.need_known(n.input[1], "OneHot depth")
    depth = float(k.tensor().reshape(-1)[0].item())
    if not depth.is_integer() or depth < 1:
        raise imp.fail(f"OneHot depth {depth}: a positive integer is needed")
    depth = int(depth)
    values = imp.operand(n.input[2])
    if imp.g.type_of(values).rank != 1:
        raise imp.fail("OneHot values must be a 1-d [off, on] pair")
    axis = imp.attr(n, "axis", -1)
    rank = it.rank + 1
    axis = axis + rank if axis < 0 else axis
    h = n.output[0]
    if it.dtype in _FLOAT_DTYPES:
        idx = imp.emit("cast", [imp.emit("floor", [idx], {}, hint=h)], {"dtype": "i64"}, hint=h)
    else:
        idx = imp.emit("cast", [idx], {"dtype": "i64"}, hint=h)
    neg = imp.emit("lt", [idx, imp.scalar(0, "i64", f"{h}_zero")], {}, hint=h)
    idx = imp.emit("where", [neg, imp.emit("add", [idx, imp.scalar(depth, "i64", f"{h}_depth")], {}, hint=h), idx],
                   {}, hint=h)
    shape = list(it.shape)
    shape.insert(axis, 1)
    idx = imp.emit("reshape", [idx], {"shape": _shape_attr(shape)}, hint=h)
    hit = imp.emit("eq", [idx, _arange_along(imp, depth, axis, rank, f"{h}_pos")], {}, hint=h)
    off = imp.emit("slice", [values], {"dim": 0, "start": 0, "end": 1, "step": 1}, hint=f"{h}_off")
    on = imp.emit("slice", [values], {"dim": 0, "start": 1, "end": 2, "step": 1}, hint=f"{h}_on")
    off = imp.emit("reshape", [off], {"shape": []}, hint=f"{h}_off")
    on = imp.emit("reshape", [on], {"shape": []}, hint=f"{h}_on")
    imp.emit("where", [hit, on, off], {}, out=n.output[0])


def _reverse(imp: _Importer, x: str, axis: int, size: Any, hint: str) -> str:
    """`x` flipped along `axis`; over a symbolic extent by the indices -1, -2, ... -size, which
    `index` counts from the end as torch does."""
    if isinstance(size, int):
        return imp.emit("index_select", [x, _const(imp, torch.arange(size - 1, -1, -1), f"{hint}_rev")],
                        {"dim": axis}, hint=hint)
    steps = imp.emit("arange", [], {"start": 0, "end": _shape_attr([size])[0], "step": 1, "dtype": "i64"},
                     hint=f"{hint}_rev")
    back = imp.emit("sub", [imp.scalar(-1, "i64", f"{hint}_minus_one"), steps], {}, hint=f"{hint}_rev")
    return imp.emit("index", [x, back], {"dims": [axis]}, hint=hint)


def _check_cumsum(nd: CheckedNode) -> None:
    x, a = nd.dims(0), nd.const(1)
    if x is not None and a is not None and a.size == 1 and not -len(x) <= int(a.reshape(-1)[0]) < len(x):
        raise nd.fail(f"axis {nd.input(1)!r} = {int(a.reshape(-1)[0])} is out of range for a rank-{len(x)} input",
                      int(a.reshape(-1)[0]), f"use an axis in {-len(x)}..{len(x) - 1}")


@_handles("CumSum", check=_check_cumsum)
def _cumsum(imp: _Importer, n) -> None:
    """cumsum along axis; reverse runs it on the flipped axis, exclusive subtracts each element."""
    x = imp.operand(n.input[0])
    xt = imp.g.type_of(x)
    ax = norm_axis(imp.ints_of(n.input[1], "CumSum axis")[0], xt.rank)
    reverse, exclusive = bool(imp.attr(n, "reverse", 0)), bool(imp.attr(n, "exclusive", 0))
    h = n.output[0]
    size = xt.shape[ax]
    if reverse and not isinstance(size, int) and _data_sized(size):
        raise data_length_error(imp, "CumSum reverse", size)
    src = _reverse(imp, x, ax, size, h) if reverse else x
    y = imp.emit("cumsum", [src], {"dim": ax}, hint=h)
    if imp.g.type_of(y).dtype != xt.dtype:    # ONNX keeps the input's integer type; torch accumulates in i64
        y = imp.emit("cast", [y], {"dtype": xt.dtype}, hint=h)
    if exclusive:
        y = imp.emit("sub", [y, src], {}, hint=h)
    if reverse:
        y = _reverse(imp, y, ax, size, h)
    _bind(imp, n.output[0], y)


@_handles("ArgMax", "ArgMin")
def _arg(imp: _Importer, n) -> None:
    """select_last_index: the first extreme of the flipped axis, counted from the end."""
    x = imp.operand(n.input[0])
    xt = imp.g.type_of(x)
    axis = norm_axis(imp.attr(n, "axis", 0), xt.rank)
    keep = bool(imp.attr(n, "keepdims", 1))
    op = n.op_type.lower()
    if not imp.attr(n, "select_last_index", 0):
        imp.emit(op, [x], {"dim": axis, "keepdim": keep}, out=n.output[0])
        return
    h = n.output[0]
    size = _static(imp, xt.shape[axis], f"{n.op_type} select_last_index")
    i = imp.emit(op, [_reverse(imp, x, axis, size, h)], {"dim": axis, "keepdim": keep}, hint=h)
    imp.emit("sub", [imp.scalar(size - 1, "i64", f"{h}_last"), i], {}, out=n.output[0])


@_handles("Einsum")
def _einsum(imp: _Importer, n) -> None:
    eq = imp.attr_text(n, "equation")
    imp.emit("einsum", [imp.operand(i) for i in n.input], {"equation": eq}, out=n.output[0])


@_handles("DeformConv")
def _deform_conv(imp: _Importer, n) -> None:
    """A 2-d convolution whose taps read the input at learned fractional offsets (opset 19): each
    tap's samples are one bilinear grid_sampler call per offset group (zeros outside, corners
    aligned, as ONNX defines it: (H - 1) and (W - 1) map to the far edges), weighted by the mask,
    then a grouped matmul with the weights. Static channels, kernel and spatial sizes."""
    h = n.output[0]
    x, w, off = (imp.operand(n.input[i]) for i in range(3))
    xt, wt, ot = imp.g.type_of(x), imp.g.type_of(w), imp.g.type_of(off)
    if xt.rank != 4:
        raise imp.fail(f"DeformConv over {xt.text()}: 2-d images are supported", value=xt.rank)
    c, ih, iw = (_static(imp, d, "DeformConv input") for d in xt.shape[1:])
    oc, cpg, kh, kw = (_static(imp, d, "DeformConv weight") for d in wt.shape)
    oh, ow = (_static(imp, d, "DeformConv offset") for d in ot.shape[2:])
    group, og = int(imp.attr(n, "group", 1)), int(imp.attr(n, "offset_group", 1))
    sh, sw = imp.attr(n, "strides", [1, 1])
    dh, dw = imp.attr(n, "dilations", [1, 1])
    pads = list(imp.attr(n, "pads", [0, 0, 0, 0]))
    k = kh * kw
    geometry = ((ih + pads[0] + pads[2] - (kh - 1) * dh - 1) // sh + 1, (iw + pads[1] + pads[3] - (kw - 1) * dw - 1) // sw + 1)
    if geometry != (oh, ow):
        raise imp.fail(f"DeformConv offset {ot.text()} is laid out for an output of {oh} x {ow}, but the window, "
                       f"strides and pads make {geometry[0]} x {geometry[1]}", value=ot.text(),
                       fix="give the offset (and mask) the convolution's output size")
    if ih < 2 or iw < 2 or c != cpg * group or oc % group or c % og or ot.shape[1] != 2 * og * k:
        raise imp.fail(f"DeformConv shapes do not fit: input {xt.text()}, weight {wt.text()}, offset {ot.text()}, "
                       f"group {group}, offset_group {og} (and an image of at least 2 x 2)", value=xt.text())

    def shape(*dims) -> list:
        return _shape_attr([normalize_dim(d) for d in dims])

    def emit(op: str, ins: list[str], attrs: dict | None = None, tag: str = "") -> str:
        return imp.emit(op, ins, attrs or {}, hint=f"{h}_{tag or op}")
    nb = xt.shape[0]
    # where tap (a, b) of output (i, j) reads before its offset
    ys = torch.arange(oh).reshape(1, oh, 1) * sh - pads[0] + torch.arange(kh).repeat_interleave(kw).reshape(k, 1, 1) * dh
    xs = torch.arange(ow).reshape(1, 1, ow) * sw - pads[1] + torch.arange(kw).repeat(kh).reshape(k, 1, 1) * dw
    parts = emit("reshape", [off], {"shape": shape(nb, og, k, 2, oh, ow)}, "offsets")
    grid = []
    for axis, base, size in ((1, xs, iw), (0, ys, ih)):       # grid_sampler takes (x, y), -1..1 over 0..size-1
        d = emit("slice", [parts], {"dim": 3, "start": axis, "end": axis + 1, "step": 1}, "d")
        pos = emit("add", [emit("reshape", [d], {"shape": shape(nb, og, k, oh, ow, 1)}, "d"),
                           _const(imp, base.expand(k, oh, ow).to(DTYPES[xt.dtype]).reshape(1, 1, k, oh, ow, 1),
                                                     f"{h}_base")], tag="pos")
        grid.append(emit("sub", [emit("mul", [pos, imp.scalar(2.0 / (size - 1), xt.dtype, f"{h}_scale")], tag="scaled"),
                                 imp.scalar(1.0, xt.dtype, f"{h}_one")], tag="grid"))
    grid = emit("reshape", [emit("concat", grid, {"dim": 5}, "grid")], {"shape": shape(nb * og, k * oh, ow, 2)}, "grid")
    planes = emit("reshape", [x], {"shape": shape(nb * og, c // og, ih, iw)}, "planes")
    taps = emit("grid_sampler", [planes, grid], {"mode": "bilinear", "padding_mode": "zeros", "align_corners": True},
                "taps")
    taps = emit("reshape", [taps], {"shape": shape(nb, og, c // og, k, oh, ow)}, "taps")
    if imp.opt_in(n, 4):
        taps = emit("mul", [taps, emit("reshape", [imp.operand(n.input[4])], {"shape": shape(nb, og, 1, k, oh, ow)},
                                       "mask")], tag="masked")
    cols = emit("reshape", [taps], {"shape": shape(nb, group, cpg * k, oh * ow)}, "cols")
    weights = emit("reshape", [w], {"shape": [group, oc // group, cpg * k]}, "w")
    y = emit("reshape", [emit("matmul", [weights, cols], tag="mm")], {"shape": shape(nb, oc, oh, ow)}, "y")
    if imp.opt_in(n, 3):
        y = emit("add", [y, emit("reshape", [imp.operand(n.input[3])], {"shape": [1, oc, 1, 1]}, "b")], tag="biased")
    _bind(imp, h, y)
