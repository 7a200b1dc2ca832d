"""Generated 2-d resampling kernels (NATIVE lowerings): upsample_nearest2d and
upsample_bilinear2d on contiguous NCHW.

Every source index and weight depends on the output position only, so they are computed
once at claim time and baked into the kernel as tables; the run is one gather (nearest) or
four loads and six flops (bilinear) per output element. Nearest takes its index table from
ATen itself (the op run on a probe whose values are their own flat positions), so it is
ATen's bit for bit. Bilinear follows ATen's `area_pixel_compute_scale` /
`area_pixel_compute_source_index` (one FMA, as ATen's build contracts it) /
`guard_index_and_lambda` in fp32 and its
`h0 * (w0 * x00 + w1 * x01) + h1 * (w0 * x10 + w1 * x11)`: equal to ATen within a rounding
of the weights (ATen's compiler may contract them into FMAs). Other dtypes and ranks are
refused (the reference op runs them).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from graphmode.backends.cpu.abi import KernelSource
from graphmode.backends.cpu.cexpr import STYPE, lit
from graphmode.backends.cpu.layout_kernels import aten_args, is_input
from graphmode.backends.cpu.lowering import NATIVE, Claim, OpCall, claimed, lowers, refused
from graphmode.backends.cpu.movement import COPY_PAR_ELEMS
from graphmode.backends.cpu.native import finish, loop_nest
from graphmode.backends.cpu.tensors import dtype_of, overlaps, shape_text
from graphmode.ir.ops.aten_meta import call as aten_call

_F32 = np.float32


def _scales(a: dict[str, Any]) -> list[float | None] | None:
    """The per-dim (H, W) scale arguments ATen's kernel receives (None where not given)."""
    if "scale_factors" in a:                               # the .vec overload
        sf = a["scale_factors"]
        return [None, None] if sf is None else [float(s) for s in sf] if len(sf) == 2 else None
    return [a.get("scales_h"), a.get("scales_w")]


def _resample_args(call: OpCall, dtypes: tuple[str, ...]) -> tuple[dict[str, Any], list[float | None]] | Claim:
    a = aten_args(call)
    x, y = call.ins[0], call.outs[0]
    if a is None or len(call.ins) != 1 or not is_input(a.get("input", a.get("self")), 0):
        return refused("the arguments do not bind to the op's schema", value=call.attrs.get("args"))
    dt = dtype_of(x)
    if dt not in dtypes or y.dtype != x.dtype or x.dim() != 4:
        return refused(f"{call.op} of a {x.dim()}-d {dt} tensor ({', '.join(dtypes)} NCHW only)", value=dt)
    scales = _scales(a)
    if scales is None or any(s is not None and not isinstance(s, (int, float)) for s in scales):
        return refused("scale factors are not two numbers", value=scales)
    if y.shape[:2] != x.shape[:2] or overlaps(call.ins, call.outs):
        return refused("the output is not the resample of the input (or shares its memory)", value=tuple(y.shape))
    return a, scales


def _table(name: str, ctype: str, values) -> str:
    return f"static const {ctype} {name}[{len(values)}] = {{{', '.join(values)}}};"


@lowers("upsample_nearest2d", tier=NATIVE)
def upsample_nearest2d(call: OpCall) -> Claim:
    got = _resample_args(call, ("f32", "f64"))
    if isinstance(got, Claim):
        return got
    x, y = call.ins[0], call.outs[0]
    h, w, oh, ow = (int(d) for d in (*x.shape[2:], *y.shape[2:]))
    if h * w >= 1 << 24:
        return refused("more input positions than the probe's floats name exactly", value=(h, w))
    probe = torch.arange(h * w, dtype=x.dtype).view(1, 1, h, w)
    try:
        src = aten_call(call.op, [probe], call.attrs)[0]
    except Exception as e:  # noqa: BLE001 - ATen refuses these arguments: the reference op raises it
        return refused(f"ATen refuses the arguments: {type(e).__name__}", value=call.attrs.get("args"))
    if tuple(src.shape[2:]) != (oh, ow):
        return refused("the output shape is not ATen's", value=tuple(y.shape))
    src = src.view(oh, ow).to(torch.int64)
    ih, iw = src[:, 0] // w, src[0, :] % w
    if oh * ow and not torch.equal(src, ih[:, None] * w + iw[None, :]):
        return refused("ATen's source positions are not one row index times one column index")

    def make() -> KernelSource:
        ct = STYPE[dtype_of(x)]
        pre = "\n".join([_table("@SYM@_ih", "long", [f"{int(v) * w}L" for v in ih] or ["0"]),
                         _table("@SYM@_iw", "int", [str(int(v)) for v in iw] or ["0"])])
        lines = [f"  const {ct}* __restrict x = (const {ct}*)p0;", f"  {ct}* __restrict y = ({ct}*)p1;"]
        nc = int(x.shape[0]) * int(x.shape[1])
        body = [f"const {ct}* s = x + c * {h * w}L + @SYM@_ih[i];", f"{ct}* d = y + (c * {oh}L + i) * {ow}L;",
                f"for (long j = 0; j < {ow}L; ++j) d[j] = s[@SYM@_iw[j]];"]
        par = y.numel() >= COPY_PAR_ELEMS and nc * oh > 1
        lines += loop_nest([("c", nc, 1), ("i", oh, 1)], body, par=par) if y.numel() else ["  (void)x; (void)y;"]
        return finish(call.op, call, lines, pre=pre, parallel=par,
                      pattern=f"upsample_nearest2d {shape_text(x)} -> {oh}x{ow}")
    return claimed(make)


def linear_weights(in_size: int, out_size: int, align_corners: bool, scale: float | None):
    """ATen's (index0, index1, lambda0, lambda1) per output position of one dim, in fp32."""
    if out_size == in_size:
        idx = np.arange(out_size)
        return idx, idx, np.ones(out_size, _F32), np.zeros(out_size, _F32)
    if align_corners:
        ratio = _F32(_F32(in_size - 1) / _F32(out_size - 1)) if out_size > 1 else _F32(0)
    elif scale is not None and scale > 0:
        ratio = _F32(1.0 / scale)
    else:
        ratio = _F32(_F32(in_size) / _F32(out_size))
    dst = np.arange(out_size).astype(_F32)
    if align_corners:
        real = (ratio * dst).astype(_F32)
    else:
        # ATen's `scale * (dst + 0.5) - 0.5` is contracted into one FMA where it is built:
        # the product of two floats is exact in double, so one rounding at the end
        real = (np.float64(ratio) * (dst + _F32(0.5)).astype(np.float64) - 0.5).astype(_F32)
        real = np.where(real < 0, _F32(0), real).astype(_F32)
    i0 = np.minimum(np.floor(real).astype(np.int64), in_size - 1)
    l1 = np.clip((real - i0.astype(_F32)).astype(_F32), _F32(0), _F32(1)).astype(_F32)
    i1 = i0 + (i0 < in_size - 1)
    return i0, i1, (_F32(1) - l1).astype(_F32), l1


@lowers("upsample_bilinear2d", tier=NATIVE)
def upsample_bilinear2d(call: OpCall) -> Claim:
    got = _resample_args(call, ("f32",))
    if isinstance(got, Claim):
        return got
    a, (sh, sw) = got
    align = a.get("align_corners")
    if not isinstance(align, bool):
        return refused("align_corners is not a bool", value=align)
    x, y = call.ins[0], call.outs[0]
    h, w, oh, ow = (int(d) for d in (*x.shape[2:], *y.shape[2:]))
    try:
        want = aten_call(call.op, [torch.empty(x.shape, device="meta")], call.attrs)[0].shape
    except Exception as e:  # noqa: BLE001 - ATen refuses these arguments: the reference op raises it
        return refused(f"ATen refuses the arguments: {type(e).__name__}", value=call.attrs.get("args"))
    if tuple(want) != tuple(y.shape) or min(h, w) == 0:
        return refused("the output shape is not ATen's (or the input is empty)", value=tuple(y.shape))

    def make() -> KernelSource:
        hi0, hi1, hl0, hl1 = linear_weights(h, oh, align, sh)
        wi0, wi1, wl0, wl1 = linear_weights(w, ow, align, sw)
        pre = "\n".join([_table("@SYM@_h0", "long", [f"{int(v) * w}L" for v in hi0] or ["0"]),
                         _table("@SYM@_h1", "long", [f"{int(v) * w}L" for v in hi1] or ["0"]),
                         _table("@SYM@_hl0", "float", [lit(float(v), "f32") for v in hl0] or ["0"]),
                         _table("@SYM@_hl1", "float", [lit(float(v), "f32") for v in hl1] or ["0"]),
                         _table("@SYM@_w0", "int", [str(int(v)) for v in wi0] or ["0"]),
                         _table("@SYM@_w1", "int", [str(int(v)) for v in wi1] or ["0"]),
                         _table("@SYM@_wl0", "float", [lit(float(v), "f32") for v in wl0] or ["0"]),
                         _table("@SYM@_wl1", "float", [lit(float(v), "f32") for v in wl1] or ["0"])])
        lines = ["  const float* __restrict x = (const float*)p0;", "  float* __restrict y = (float*)p1;"]
        nc = int(x.shape[0]) * int(x.shape[1])
        body = ["const float* r0 = x + c * " f"{h * w}L + @SYM@_h0[i];",
                f"const float* r1 = x + c * {h * w}L + @SYM@_h1[i];",
                "const float a0 = @SYM@_hl0[i], a1 = @SYM@_hl1[i];",
                f"float* d = y + (c * {oh}L + i) * {ow}L;",
                f"for (long j = 0; j < {ow}L; ++j) {{",
                "  const int j0 = @SYM@_w0[j], j1 = @SYM@_w1[j];",
                "  const float b0 = @SYM@_wl0[j], b1 = @SYM@_wl1[j];",
                "  d[j] = a0 * (b0 * r0[j0] + b1 * r0[j1]) + a1 * (b0 * r1[j0] + b1 * r1[j1]);",
                "}"]
        par = y.numel() * 8 >= COPY_PAR_ELEMS and nc * oh > 1
        lines += loop_nest([("c", nc, 1), ("i", oh, 1)], body, par=par) if y.numel() else ["  (void)x; (void)y;"]
        return finish(call.op, call, lines, pre=pre, parallel=par,
                      pattern=f"upsample_bilinear2d {shape_text(x)} -> {oh}x{ow} align_corners={align}")
    return claimed(make)


__all__ = ["upsample_nearest2d", "upsample_bilinear2d", "linear_weights"]
