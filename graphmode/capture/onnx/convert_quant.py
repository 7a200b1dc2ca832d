"""ONNX's quantization ops (QuantizeLinear, DequantizeLinear, QLinearMatMul, MatMulInteger,
ConvInteger) written as core ops: the scale and zero point broadcast per tensor, per axis or
per block, arithmetic in floating point (integers up to 2**24 are exact there; the integer
matmuls run in f64), rounding half to even and saturation exactly as ONNX defines them. INT4 /
UINT4 initializers (4-bit QDQ weights and zero points) are read one value a byte (int8 / uint8);
other types graphmode has no dtype for (a 4-bit graph input, float8, ...) are refused when the
model is validated. (ONNX Runtime's own 4-bit kernels round: its MatMul over 4-bit QDQ weights
differs from the exact dequantization by up to ~1e-2 relative; graphmode's is exact.)
"""
from __future__ import annotations

import torch

from graphmode.capture.onnx.fold import _FLOAT_DTYPES, _Known
from graphmode.capture.onnx.importer import _Importer, _handles, _shape_attr
from graphmode.capture.onnx.checks import ONNX_DTYPES
from graphmode.ir.ops import norm_axis
from graphmode.ir.types import DTYPES


def _param(imp: _Importer, n, name: str, xt, axis: int, block: int, hint: str, dtype: str) -> str:
    """A scale or zero point as a tensor broadcasting against x (cast to `dtype`)."""
    v = imp.operand(name)
    t = imp.g.type_of(v)
    if t.dtype != dtype:
        v = imp.emit("cast", [v], {"dtype": dtype}, hint=hint)
    if t.rank == 0 or (t.rank == 1 and t.shape[0] == 1 and not block):
        return v
    axis = norm_axis(axis, xt.rank)
    if block:
        size = xt.shape[axis]
        if not isinstance(size, int):
            raise imp.fail(f"{n.op_type} block_size over a symbolic axis")
        idx = torch.arange(size) // block
        return imp.emit("index_select", [v, imp.materialise(_Known.of(idx), f"{hint}_blocks")], {"dim": axis},
                        hint=hint)
    if t.rank != 1:
        raise imp.fail(f"{n.op_type} {name!r} of rank {t.rank}: per-tensor, per-axis (1-d) or blocked is supported")
    shape = [1] * xt.rank
    shape[axis] = t.shape[0]
    return imp.emit("reshape", [v], {"shape": _shape_attr(shape)}, hint=hint)


def _quantize(imp: _Importer, x: str, scale: str, zp: str | None, out_dtype: str, hint: str, out: str | None):
    """saturate(round_half_even(x / scale) + zero_point) into `out_dtype`."""
    q = imp.emit("round", [imp.emit("div", [x, scale], {}, hint=hint)], {}, hint=hint)
    if zp is not None:
        q = imp.emit("add", [q, zp], {}, hint=hint)
    info = torch.iinfo(DTYPES[out_dtype])
    q = imp.emit("clamp", [q], {"min": float(info.min), "max": float(info.max)}, hint=hint)
    return imp.emit("cast", [q], {"dtype": out_dtype}, out=out, hint=hint)


def _int_dtype(imp: _Importer, n, to: int | None, zp: str | None) -> str:
    if zp is not None:
        dt = imp.type_of(zp).dtype
    elif to:
        dt = ONNX_DTYPES.get(to)
    else:
        dt = "u8"
    if dt is None or dt in _FLOAT_DTYPES or dt == "bool":
        raise imp.fail(f"{n.op_type} into {dt or to}: integer outputs graphmode has a dtype for are supported")
    return dt


def _axis_block(imp: _Importer, n, rank: int) -> tuple[int, int]:
    """The axis (normalised where it is used: per-axis or blocked parameters) and block size."""
    return int(imp.attr(n, "axis", 1)), int(imp.attr(n, "block_size", 0))


@_handles("QuantizeLinear")
def _quantize_linear(imp: _Importer, n) -> None:
    x = imp.operand(n.input[0])
    xt = imp.g.type_of(x)
    zp_n = imp.opt_in(n, 2)
    out_dt = _int_dtype(imp, n, imp.attr(n, "output_dtype", 0), zp_n)
    axis, block = _axis_block(imp, n, xt.rank)
    h = n.output[0]
    work = xt.dtype if xt.dtype in ("f32", "f64") else "f32"
    if xt.dtype != work:
        x = imp.emit("cast", [x], {"dtype": work}, hint=h)
    scale = _param(imp, n, n.input[1], xt, axis, block, f"{h}_scale", work)
    zp = _param(imp, n, zp_n, xt, axis, block, f"{h}_zp", work) if zp_n else None
    _quantize(imp, x, scale, zp, out_dt, h, n.output[0])


@_handles("DynamicQuantizeLinear")
def _dynamic_quantize_linear(imp: _Importer, n) -> None:
    """uint8 quantization with parameters from the data, as ONNX Runtime computes them: the range
    [min(x, 0), max(x, 0)] over 255 steps, and a scale of 1 where that range is empty (an all-zero
    input: ONNX's function body divides by a zero scale there, and everything after reads inf / NaN).
    The zero point (qmin - min / scale, clamped to [0, 255], rounded half to even) is 255 where that
    quotient is NaN (a range of denormals whose scale underflows to 0), as ONNX Runtime's clamp makes it."""
    x = imp.operand(n.input[0])
    xt = imp.g.type_of(x)
    if any(d == 0 for d in xt.shape):
        raise imp.fail(f"DynamicQuantizeLinear of an empty tensor {xt.text()} has no range to quantize",
                       value=xt.text(), fix="skip the node for empty inputs in the model")
    h, dt = n.output[0], xt.dtype
    everything = {"dims": list(range(xt.rank)), "keepdim": False}
    zero = imp.scalar(0.0, dt, f"{h}_zero")
    lo = imp.emit("minimum", [imp.emit("amin", [x], everything, hint=f"{h}_min"), zero], {}, hint=f"{h}_min")
    hi = imp.emit("maximum", [imp.emit("amax", [x], everything, hint=f"{h}_max"), zero], {}, hint=f"{h}_max")
    steps = imp.emit("div", [imp.emit("sub", [hi, lo], {}, hint=f"{h}_range"), imp.scalar(255.0, dt, f"{h}_255")],
                     {}, hint=f"{h}_scale")
    empty = imp.emit("eq", [hi, lo], {}, hint=f"{h}_empty")
    scale = imp.emit("where", [empty, imp.scalar(1.0, dt, f"{h}_one"), steps], {}, out=n.output[1] or None,
                     hint=f"{h}_scale")
    zp = imp.emit("sub", [zero, imp.emit("div", [lo, scale], {}, hint=f"{h}_zp")], {}, hint=f"{h}_zp")
    zp = imp.emit("clamp", [zp], {"min": 0.0, "max": 255.0}, hint=f"{h}_zp")
    zp = imp.emit("where", [imp.emit("ne", [zp, zp], {}, hint=f"{h}_zp_nan"), imp.scalar(255.0, dt, f"{h}_top"),
                            imp.emit("round", [zp], {}, hint=f"{h}_zp")], {}, hint=f"{h}_zp")
    if len(n.output) > 2 and n.output[2]:
        imp.emit("cast", [zp], {"dtype": "u8"}, out=n.output[2])
    q = imp.emit("add", [imp.emit("round", [imp.emit("div", [x, scale], {}, hint=h)], {}, hint=h), zp], {}, hint=h)
    q = imp.emit("clamp", [q], {"min": 0.0, "max": 255.0}, hint=h)
    # x / scale is NaN only at 0 / 0 (a zero input over an underflowed scale): ONNX Runtime writes 0 there
    q = imp.emit("where", [imp.emit("ne", [q, q], {}, hint=f"{h}_nan"), zero, q], {}, hint=h)
    imp.emit("cast", [q], {"dtype": "u8"}, out=n.output[0])


@_handles("DequantizeLinear")
def _dequantize_linear(imp: _Importer, n) -> None:
    x = imp.operand(n.input[0])
    xt = imp.g.type_of(x)
    scale_t = imp.type_of(n.input[1])
    out = ONNX_DTYPES.get(imp.attr(n, "output_dtype", 0)) or scale_t.dtype
    axis, block = _axis_block(imp, n, xt.rank)
    h = n.output[0]
    work = "f64" if out == "f64" else "f32"
    v = imp.emit("cast", [x], {"dtype": work}, hint=h)
    zp_n = imp.opt_in(n, 2)
    if zp_n:
        v = imp.emit("sub", [v, _param(imp, n, zp_n, xt, axis, block, f"{h}_zp", work)], {}, hint=h)
    y = imp.emit("mul", [v, _param(imp, n, n.input[1], xt, axis, block, f"{h}_scale", work)], {}, hint=h)
    if out != work:
        imp.emit("cast", [y], {"dtype": out}, out=n.output[0])
    else:
        imp.ir[n.output[0]] = y
        imp.check_declared(n.output[0])


def _dequant(imp: _Importer, n, x_n: str, scale_n: str, zp_n: str | None, axis_of, hint: str) -> str:
    """(x - zero_point) * scale in f32, the scale per tensor or along `axis_of(rank)`."""
    xt = imp.type_of(x_n)
    v = imp.emit("cast", [imp.operand(x_n)], {"dtype": "f32"}, hint=hint)
    axis = axis_of(xt.rank)
    if zp_n:
        v = imp.emit("sub", [v, _param(imp, n, zp_n, xt, axis, 0, f"{hint}_zp", "f32")], {}, hint=hint)
    return imp.emit("mul", [v, _param(imp, n, scale_n, xt, axis, 0, f"{hint}_scale", "f32")], {}, hint=hint)


@_handles("QLinearMatMul")
def _qlinear_matmul(imp: _Importer, n) -> None:
    """quantize(dequantize(a) @ dequantize(b)): a's scale per row, b's per column."""
    h = n.output[0]
    a = _dequant(imp, n, n.input[0], n.input[1], n.input[2], lambda r: r - 2, f"{h}_a")
    b = _dequant(imp, n, n.input[3], n.input[4], n.input[5], lambda r: r - 1, f"{h}_b")
    y = imp.emit("matmul", [a, b], {}, hint=h)
    yt = imp.g.type_of(y)
    out_dt = _int_dtype(imp, n, None, n.input[7])
    scale = _param(imp, n, n.input[6], yt, yt.rank - 1, 0, f"{h}_scale", "f32")
    zp = _param(imp, n, n.input[7], yt, yt.rank - 1, 0, f"{h}_zp", "f32")
    _quantize(imp, y, scale, zp, out_dt, h, n.output[0])


def _centred(imp: _Importer, n, x_n: str, zp_n: str | None, axis: int | None, hint: str) -> str:
    v = imp.emit("cast", [imp.operand(x_n)], {"dtype": "f64"}, hint=hint)
    if not zp_n:
        return v
    xt = imp.type_of(x_n)
    zp = _param(imp, n, zp_n, xt, axis if axis is not None else 0, 0, f"{hint}_zp", "f64")
    return imp.emit("sub", [v, zp], {}, hint=hint)


@_handles("MatMulInteger")
def _matmul_integer(imp: _Importer, n) -> None:
    h = n.output[0]
    a = _centred(imp, n, n.input[0], imp.opt_in(n, 2), imp.type_of(n.input[0]).rank - 2, f"{h}_a")
    b = _centred(imp, n, n.input[1], imp.opt_in(n, 3), imp.type_of(n.input[1]).rank - 1, f"{h}_b")
    y = imp.emit("matmul", [a, b], {}, hint=h)
    imp.emit("cast", [y], {"dtype": "i32"}, out=n.output[0])


@_handles("ConvInteger")
def _conv_integer(imp: _Importer, n) -> None:
    """conv2d of the zero-point-centred operands in f64 (exact for 8-bit values), as int32."""
    from graphmode.capture.onnx.convert_nn import _emit_window, _window
    h = n.output[0]
    x = _centred(imp, n, n.input[0], imp.opt_in(n, 2), None, f"{h}_x")
    w = _centred(imp, n, n.input[1], imp.opt_in(n, 3), 0, f"{h}_w")
    wt = imp.g.type_of(w)
    kernel = list(imp.attr(n, "kernel_shape", wt.shape[2:]))
    x, kernel, strides, dil, pads, lifted = _window(imp, n, x, kernel, 0.0)
    if lifted:
        w = imp.emit("reshape", [w], {"shape": _shape_attr(list(wt.shape[:2]) + [1, wt.shape[2]])}, hint=f"{h}_w2d")
    y = imp.emit("conv2d", [x, w], {"stride": strides, "padding": pads, "dilation": dil,
                                    "groups": int(imp.attr(n, "group", 1))}, hint=h)
    out = imp.emit("cast", [y], {"dtype": "i32"}, hint=h)
    _emit_window(imp, n, "identity", [out], {}, lifted)
