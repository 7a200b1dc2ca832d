"""ONNX Resize (and the Upsample it replaced) as one linear map per resized axis.

Why matrices: with static input and output extents, every Resize mode (nearest with each
rounding rule, linear, cubic, antialiased, every coordinate transformation, crop-and-resize
with an extrapolation value) is separable: along one axis the output is `W @ x + b`, with `W`
(out x in) and `b` known at import time. The source coordinates are computed as ONNX
Runtime computes them (and PyTorch, whose F.interpolate most Resize nodes come from), the
kernel coefficients with onnx's own reference functions (onnx.reference.ops.op_resize, the
code the node tests' expected outputs come from), so graphmode's Resize means what ONNX's does. A
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


_TWO_READINGS_FIX = ("give the Resize node sizes instead of scales, which every reading agrees on (from PyTorch: "
                     "F.interpolate(size=...) rather than scale_factor=, or compile the PyTorch module itself)")
# the modes whose coordinates divide by the resized length (onnx/onnx#2462): the output's integer
# length for ONNX Runtime and PyTorch, the unfloored scale * length for onnx's reference
_BY_RESIZED_LENGTH = ("align_corners", "tf_crop_and_resize")


def _source_coords(transform: str, out_len: int, length: int, scale: float, roi,
                   resized: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Where each output position samples the input, and which positions extrapolate. Computed
    in float32 as ONNX Runtime does (onnx's reference computes in float64, and at scale 0.6 its
    nearest picked another pixel than ONNX Runtime and PyTorch, whose F.interpolate most Resize
    nodes come from). `resized` is the length align_corners and tf_crop_and_resize divide by:
    the output's own unless given."""
    f = np.float32
    y = np.arange(out_len, dtype=f)
    s, n, one, half = f(scale), f(length), f(1), f(0.5)
    m = f(out_len if resized is None else resized)
    outside = np.zeros(out_len, dtype=bool)
    if transform == "align_corners":
        x = y * (n - one) / (m - one) if m != one else np.zeros_like(y)
    elif transform == "asymmetric":
        x = y / s
    elif transform == "pytorch_half_pixel":
        x = (y + half) / s - half if out_len > 1 else np.zeros_like(y)
    elif transform == "half_pixel":
        x = (y + half) / s - half
    elif transform == "half_pixel_symmetric":
        offset = n / f(2) * (one - m / (s * n))
        x = offset + (y + half) / s - half
    else:                                   # tf_crop_and_resize
        r0, r1 = (f(0), f(1)) if roi is None else (f(roi[0]), f(roi[1]))
        x = r0 * (n - one) + y * (r1 - r0) * (n - one) / (m - one) if m != one else \
            np.full_like(y, half * (r0 + r1) * (n - one))
        outside = (x < 0) | (x > n - one)
    return x.astype(np.float64), outside


def _axis_map(length: int, out_len: int, scale: float, coeffs, roi, extrapolation: float, transform: str,
              exclude_outside: bool, resized: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(W, b) with resize(x) == W @ x + b along one axis of `length` elements: each output takes
    the kernel's n taps nearest its source coordinate (ties to the left, as onnx's reference
    picks them), taps past an edge reading the edge element."""
    x, outside = _source_coords(transform, out_len, length, scale, roi, resized)
    w = np.zeros((out_len, length))
    b = np.where(outside, extrapolation, 0.0)
    for i, xi in enumerate(x):
        if outside[i]:
            continue
        base = math.floor(xi)
        c = np.asarray(coeffs(1.0 if xi == base else xi - base, scale), dtype=np.float64)
        k = len(c)
        if k % 2 == 0:
            start = base - k // 2 + (0 if xi == base else 1)
        else:
            start = base - (k - 1) // 2 + (0 if xi - base <= 0.5 else 1)
        taps = np.arange(start, start + k)
        if exclude_outside:
            c = np.where((taps < 0) | (taps >= length), 0.0, c)
            c = c / (c.sum() or 1.0)
        np.add.at(w[i], np.clip(taps, 0, length - 1), c)
    return w, b


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
        out = [shape[i] if full_scales[i] == 1.0 else _scaled_length(imp, full_scales[i], _static(imp, shape, i), i)
               for i in range(r)]
    else:
        for a, s in zip(axes, sizes):
            out[a] = s
        full_scales = [1.0 if _deq(out[i], shape[i]) else _size_scale(imp, shape, out, i) for i in range(r)]
        policy = imp.attr_text(n, "keep_aspect_ratio_policy", "stretch")
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


def _scaled_length(imp: _Importer, scale: float, length: int, axis: int) -> int:
    """floor(scale x length), which ONNX Runtime computes in float32 and onnx (its shape inference
    and reference) in float64: for the float32 scale 0.7 on 10 rows that is 7 (as PyTorch says)
    against 6, and a file that means two sizes is refused rather than answered with one."""
    f32 = int(np.float32(scale) * np.float32(length))
    f64 = math.floor(scale * length)
    if f32 != f64:
        raise imp.fail(f"Resize at scale {scale:g} on axis {axis} of length {length} reads two ways: ONNX Runtime "
                       f"and PyTorch compute {f32} rows (in float32), onnx's shape inference and reference {f64}",
                       value=f"{scale:g}", fix=_TWO_READINGS_FIX)
    return f32


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


def _one_reading(imp: _Importer, n, axis: int, length: int, out_len: int, scale: float, ours: np.ndarray,
                 spec: np.ndarray) -> None:
    """Refuse a Resize that reads two ways: align_corners or tf_crop_and_resize at a scale whose
    output length is not scale x length. ONNX Runtime and PyTorch divide by the output's length,
    onnx's reference (the node tests' expected outputs; its authors' intent, onnx/onnx#2462) by
    the unfloored product: a file exported from F.interpolate(scale_factor=1.7, align_corners=True)
    means one thing to its source and another to the spec, and either answer is wrong to someone."""
    gap = float(np.abs(ours - spec).max())
    if gap <= 1e-6:
        return
    mode = imp.attr_text(n, "coordinate_transformation_mode", "half_pixel")
    who = "ONNX Runtime and PyTorch divide" if mode == "align_corners" else "ONNX Runtime divides"
    raise imp.fail(f"Resize with coordinate_transformation_mode {mode!r} at scale {scale:g} on axis {axis} "
                   f"({length} -> {out_len}) reads two ways: {who} by the output "
                   f"length {out_len} - 1, the ONNX reference by {scale * length:g} - 1 (onnx/onnx#2462); "
                   f"their weights differ by up to {gap:.3g}", value=f"{scale:g}",
                   fix=_TWO_READINGS_FIX)


@_handles("Resize")
def _resize(imp: _Importer, n) -> None:
    x_name = n.input[0]
    xt = imp.type_of(x_name)
    shape = list(xt.shape)
    mode = imp.attr_text(n, "mode", "nearest")
    transform = imp.attr_text(n, "coordinate_transformation_mode", "half_pixel")
    if mode not in _MODES or transform not in _TRANSFORMS:
        what = f"mode {mode!r}" if mode not in _MODES else f"coordinate_transformation_mode {transform!r}"
        raise imp.fail(f"Resize {what} is not one graphmode imports (mode {mode!r}, coordinate_transformation_mode "
                       f"{transform!r})", fix=f"mode one of {_MODES}, transformation one of {_TRANSFORMS}")
    antialias = bool(imp.attr(n, "antialias", 0))
    if antialias and mode == "nearest":
        raise imp.fail("Resize antialias with mode nearest is not defined", fix="antialias 0, or mode linear/cubic")
    coeffs = _coeffs(mode, imp.attr_text(n, "nearest_mode", "round_prefer_floor"), antialias,
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
        w, b = _axis_map(length, out[a], scales[a], coeffs, roi, extrapolation, transform, exclude)
        if transform in _BY_RESIZED_LENGTH and scales[a] * length != out[a]:
            _one_reading(imp, n, a, length, out[a], scales[a], w,
                         _axis_map(length, out[a], scales[a], coeffs, roi, extrapolation, transform, exclude,
                                   resized=scales[a] * length)[0])
        maps.append((a, w, b))
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
