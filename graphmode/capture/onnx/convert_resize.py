"""ONNX Resize (and the Upsample it replaced) as one linear map per resized axis.

Why matrices: with static input and output extents, every Resize mode (nearest with each
rounding rule, linear, cubic, antialiased, every coordinate transformation, crop-and-resize
with an extrapolation value) is separable: along one axis the output is `W @ x + b`, with `W`
(out x in) and `b` known at import time. They are computed with onnx's own reference
coefficients (onnx.reference.ops.op_resize, the code the node tests' expected outputs come
from), by resizing the identity, so graphmode's Resize means exactly what ONNX's does. A
selection matrix (nearest) becomes an `index_select`, the rest a `matmul` over the axis moved
last (`b` is nonzero only where crop-and-resize extrapolates).
"""
from __future__ import annotations

import math

import numpy as np
import torch

from graphmode.capture.onnx.importer import STATIC_AXIS_FIX, _Importer, _handles
from graphmode.capture.onnx.fold import _FLOAT_DTYPES, _Known
from graphmode.capture.onnx.values import _deq
from graphmode.ir.types import DTYPES, Dim, dim_str

_MODES = ("nearest", "linear", "cubic")
_TRANSFORMS = ("half_pixel", "half_pixel_symmetric", "pytorch_half_pixel", "align_corners", "asymmetric",
               "tf_crop_and_resize")


def _s(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _floats(imp: _Importer, name: str | None, what: str) -> list[float] | None:
    if not name:
        return None
    k = imp.need_known(name, f"Resize {what}")
    if not k.concrete:
        raise imp.fail(f"Resize {what} must be constant numbers")
    vals = [float(v) for v in k.arr.flat]
    return vals or None


def _coeffs(mode: str, nearest_mode: str, antialias: bool, a: float):
    from onnx.reference.ops import op_resize as ref
    if mode == "nearest":
        return lambda x, scale: ref._nearest_coeffs(x, mode=nearest_mode)
    if mode == "cubic":
        f = ref._cubic_coeffs_antialias if antialias else ref._cubic_coeffs
        return lambda x, scale: f(x, scale, A=a)
    return ref._linear_coeffs_antialias if antialias else ref._linear_coeffs


def _axis_map(length: int, out_len: int, scale: float, coeffs, roi, extrapolation: float, transform: str,
              exclude_outside: bool) -> tuple[np.ndarray, np.ndarray]:
    """(W, b) with resize(x) == W @ x + b along one axis of `length` elements."""
    from onnx.reference.ops import op_resize as ref
    kw = dict(roi=roi, coordinate_transformation_mode=transform, exclude_outside=exclude_outside)
    w = ref._interpolate_1d_along_axis(np.eye(length), 0, scale, out_len, coeffs, extrapolation_value=0.0, **kw)
    b = ref._interpolate_1d_along_axis(np.zeros((length, 1)), 0, scale, out_len, coeffs,
                                       extrapolation_value=extrapolation, **kw)
    return w, b[:, 0]


def _plan(imp: _Importer, n, shape: list[Dim]) -> tuple[list[Dim], list[float], list[int], list | None]:
    """Per axis of the input: output extent and scale, the axes resized, and the roi pairs (as
    onnx.reference's _interpolate_nd computes them). An axis left at its extent (scale 1, or a
    size equal to the input's) may be symbolic: a dynamic batch passes through unresized."""
    r = len(shape)
    roi = _floats(imp, imp.opt_in(n, 1), "roi")
    scales = _floats(imp, imp.opt_in(n, 2), "scales")
    sizes_n = imp.opt_in(n, 3)
    sizes = imp.need_known(sizes_n, "Resize sizes").dims() if sizes_n else None
    sizes = sizes or None
    axes = imp.attr(n, "axes", None)
    axes = [a + r if a < 0 else a for a in axes] if axes is not None else list(range(r))
    if (scales is None) == (sizes is None):
        raise imp.fail("Resize needs exactly one of scales and sizes")
    full_scales = [1.0] * r
    out = list(shape)
    if scales is not None:
        for a, s in zip(axes, scales):
            full_scales[a] = s
        out = [shape[i] if full_scales[i] == 1.0 else
               int(math.floor(full_scales[i] * _static(imp, shape, i))) for i in range(r)]
    else:
        for a, s in zip(axes, sizes):
            out[a] = s
        full_scales = [1.0 if _deq(out[i], shape[i]) else _size_scale(imp, shape, out, i) for i in range(r)]
        policy = _s(imp.attr(n, "keep_aspect_ratio_policy", b"stretch"))
        if policy != "stretch":
            pick = min if policy == "not_larger" else max
            scale = pick(full_scales[a] for a in axes)
            full_scales = [scale if i in axes else 1.0 for i in range(r)]
            out = [int(scale * _static(imp, shape, i) + 0.5) if i in axes and scale != 1.0 else shape[i]
                   for i in range(r)]
    rois = None
    if roi is not None:
        full = [0.0] * r + [1.0] * r
        for i, a in enumerate(axes):
            full[a], full[r + a] = roi[i], roi[len(axes) + i]
        rois = [[full[a], full[r + a]] for a in range(r)]
    return out, full_scales, axes, rois


def _static(imp: _Importer, shape: list[Dim], axis: int) -> int:
    """The extent of an axis Resize changes: the interpolation weights are built at import time for
    one input length, so a resized axis must have a static extent (an unresized one need not)."""
    if not isinstance(shape[axis], int):
        raise imp.fail(f"Resize of {list(map(dim_str, shape))} resizes axis {axis}, whose extent "
                       f"{dim_str(shape[axis])} is symbolic: the resized extents must be static",
                       value=dim_str(shape[axis]), fix=STATIC_AXIS_FIX)
    return shape[axis]


def _size_scale(imp: _Importer, shape: list[Dim], out: list[Dim], axis: int) -> float:
    size = out[axis]
    if not isinstance(size, int):
        raise imp.fail(f"Resize sizes gives axis {axis} the symbolic extent {dim_str(size)}, not its input's "
                       f"{dim_str(shape[axis])}: graphmode resizes to static extents only", value=dim_str(size),
                       fix="give Resize constant sizes (or scales) for the axes it resizes")
    length = _static(imp, shape, axis)
    return size / length if length else 1.0


@_handles("Resize")
def _resize(imp: _Importer, n) -> None:
    x_name = n.input[0]
    xt = imp.type_of(x_name)
    shape = list(xt.shape)
    mode = _s(imp.attr(n, "mode", b"nearest"))
    transform = _s(imp.attr(n, "coordinate_transformation_mode", b"half_pixel"))
    if mode not in _MODES or transform not in _TRANSFORMS:
        raise imp.fail(f"Resize mode {mode!r} with coordinate_transformation_mode {transform!r}",
                       fix=f"mode one of {_MODES}, transformation one of {_TRANSFORMS}")
    antialias = bool(imp.attr(n, "antialias", 0))
    if antialias and mode == "nearest":
        raise imp.fail("Resize antialias with mode nearest is not defined", fix="antialias 0, or mode linear/cubic")
    coeffs = _coeffs(mode, _s(imp.attr(n, "nearest_mode", b"round_prefer_floor")), antialias,
                     float(imp.attr(n, "cubic_coeff_a", -0.75)))
    out, scales, axes, rois = _plan(imp, n, shape)
    extrapolation = float(imp.attr(n, "extrapolation_value", 0.0))
    exclude = bool(imp.attr(n, "exclude_outside", 0))
    dt = xt.dtype
    work = dt if dt in _FLOAT_DTYPES else "f32"
    x = imp.operand(x_name)
    maps = []
    for a in axes:
        roi = rois[a] if rois is not None else None
        if math.isclose(scales[a], 1.0) and _deq(out[a], shape[a]) and \
                (roi is None or (math.isclose(roi[0], 0.0) and math.isclose(roi[1], 1.0))):
            continue
        length = _static(imp, shape, a)
        maps.append((a, *_axis_map(length, out[a], scales[a], coeffs, roi, extrapolation, transform, exclude)))
    hint = n.output[0]
    cast_back = False
    for a, w, b in maps:
        rows = (w != 0).sum(axis=1)
        if not b.any() and np.all(rows == 1) and np.allclose(w[w != 0], 1.0):
            idx = torch.from_numpy(np.argmax(w, axis=1).astype(np.int64))
            x = imp.emit("index_select", [x, imp.materialise(_Known.of(idx), f"{hint}_idx{a}")], {"dim": a},
                         hint=hint)
            continue
        if imp.g.type_of(x).dtype != work:
            x = imp.emit("cast", [x], {"dtype": work}, hint=f"{hint}_f")
            cast_back = True
        r = len(shape)
        perm = [i for i in range(r) if i != a] + [a]
        inv = [perm.index(i) for i in range(r)]
        moved = imp.emit("permute", [x], {"perm": perm}, hint=hint) if a != r - 1 else x
        wt = imp.g.add_constant(imp.g.fresh_name(f"{hint}_w{a}"),
                                torch.from_numpy(np.ascontiguousarray(w.T)).to(DTYPES[work]), role="const")
        y = imp.emit("matmul", [moved, wt], {}, hint=hint)
        if b.any():
            bt = imp.g.add_constant(imp.g.fresh_name(f"{hint}_b{a}"), torch.from_numpy(b).to(DTYPES[work]),
                                    role="const")
            y = imp.emit("add", [y, bt], {}, hint=hint)
        x = imp.emit("permute", [y], {"perm": inv}, hint=hint) if a != r - 1 else y
    if cast_back:
        # onnx's reference rounds (half to even) and saturates before it casts back to an integer type
        info = torch.iinfo(DTYPES[dt])
        x = imp.emit("round", [x], {}, hint=f"{hint}_round")
        x = imp.emit("clamp", [x], {"min": float(info.min), "max": float(info.max)}, hint=f"{hint}_sat")
        x = imp.emit("cast", [x], {"dtype": dt}, hint=hint)
    if not maps:
        imp.alias(n.output[0], x_name)
        return
    imp.ir[n.output[0]] = x
    imp.check_declared(n.output[0])
