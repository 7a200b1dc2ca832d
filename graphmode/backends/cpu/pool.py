"""Generated pooling kernels (NATIVE lowerings): ATen's results with every shape baked in.

On contiguous NCHW fp32, ATen's channels-first max_pool2d walks each output's window with
scalar code and bounds checks (3 ms for ResNet-18's stem pool, 20x its own channels-last
path), and adaptive_avg_pool2d pays a full reduction dispatch for 512 sums of 49. Here the
window loop is fixed and the interior columns (no tap in the padding) run as branch-free
vector blocks of 16 outputs (templates/pool.h).

Results are ATen's bit for bit, except the global average pool (ATen's `mean` sums in its
own vector order; ours differs by rounding only). Max pooling keeps ATen's order (rows then
columns, `v > m || isnan(v)`), so NaN and the sign of a zero maximum come out as ATen's.
What a claim refuses (another dtype, a layout, an attribute ATen would reject) runs with ATen.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from graphmode.backends.cpu.abi import KernelSource, template
from graphmode.backends.cpu.attrs import pair
from graphmode.backends.cpu.emit import PAR_THRESHOLD
from graphmode.backends.cpu.lowering import NATIVE, Claim, OpCall, claimed, lowers, refused
from graphmode.backends.cpu.native import finish
from graphmode.backends.cpu.omp_loops import omp_for
from graphmode.backends.cpu.tensors import overlaps, shape_text

VBLOCK = 16        # interior columns per vector block (gm_v16f)


def _fp32_refusal(call: OpCall) -> Claim | None:
    x, y = call.ins[0], call.outs[0]
    if x.dtype != torch.float32 or y.dtype != torch.float32:
        return refused(f"{call.op} of {x.dtype}", value=str(x.dtype))
    if overlaps(call.ins, call.outs):
        return refused("the output shares memory with the input")
    return None


@dataclass(frozen=True)
class _Axis:
    """One spatial axis of a pooling window: input size, output size, kernel, stride, pad,
    dilation; `lo`..`hi` are the outputs whose every tap is inside the input."""

    size: int
    out: int
    k: int
    s: int
    p: int
    d: int

    @property
    def lo(self) -> int:
        return min(-(-self.p // self.s), self.out)

    @property
    def hi(self) -> int:
        num = self.size - 1 - (self.k - 1) * self.d + self.p
        hi = num // self.s + 1 if num >= 0 else 0
        return max(self.lo, min(self.out, hi))


def _pool_out(size: int, k: int, s: int, p: int, d: int, ceil: bool) -> int:
    """ATen's pooling_output_shape (including the ceil-mode rule that the last window must
    start inside the input or its left padding)."""
    num = size + 2 * p - d * (k - 1) - 1 + (s - 1 if ceil else 0)
    out = num // s + 1
    if ceil and (out - 1) * s >= size + p:
        out -= 1
    return out


def _pool_axes(attrs: Mapping, x: torch.Tensor, y: torch.Tensor, *, dilation: bool) -> tuple[_Axis, _Axis] | None:
    """Both axes of a 4-d NCHW pooling, or None where ATen would reject the attributes or the
    plan's output shape is not ATen's."""
    if x.dim() != 4 or y.dim() != 4 or tuple(x.shape[:2]) != tuple(y.shape[:2]):
        return None
    k = pair(attrs.get("kernel"))
    s = pair(attrs.get("stride") or attrs.get("kernel"))
    p = pair(attrs.get("padding", 0))
    d = pair(attrs.get("dilation", 1)) if dilation else (1, 1)
    ceil = attrs.get("ceil_mode", False)
    if k is None or s is None or p is None or d is None or not isinstance(ceil, bool):
        return None
    axes = []
    for i in range(2):
        if k[i] <= 0 or s[i] <= 0 or d[i] <= 0 or p[i] < 0:
            return None
        if p[i] > k[i] // 2 or p[i] > ((k[i] - 1) * d[i] + 1) // 2:
            return None
        size = int(x.shape[2 + i])
        out = _pool_out(size, k[i], s[i], p[i], d[i], ceil)
        if out < 1 or out != int(y.shape[2 + i]):
            return None
        axes.append(_Axis(size, out, k[i], s[i], p[i], d[i]))
    return axes[0], axes[1]


def _pool_entry(body_row: str, planes: int, ah_out: int, ow: int, hw: int, par: bool) -> list[str]:
    """The exported body: one task per (plane, output row)."""
    lines = ["  const float* x = (const float*)p0;", "  float* y = (float*)p1;"]
    if par:
        lines.append("  " + omp_for(planes * ah_out))
    lines.append(f"  for (long t = 0; t < {planes * ah_out}L; ++t) "
                 f"{body_row}(x + (t / {ah_out}L) * {hw}L, y + t * {ow}L, t % {ah_out}L);")
    return lines


@lowers("max_pool2d", tier=NATIVE)
def max_pool2d(call: OpCall) -> Claim:
    """Per output row: the border columns (a tap in the padding) one by one with bounds
    checks, the interior in blocks of VBLOCK columns held in one vector across the whole
    window (strides 1 and 2; other strides column by column). A row whose interior is not a
    multiple of VBLOCK ends with a block shifted back over columns already done: it rewrites
    the same values."""
    x, y = call.ins[0], call.outs[0]
    why = _fp32_refusal(call)
    if why is not None:
        return why
    axes = _pool_axes(call.attrs, x, y, dilation=True)
    if axes is None:
        return refused("a window or output shape ATen would not make", value=dict(call.attrs))
    return claimed(lambda: _max_pool(call, *axes))


def _max_pool(call: OpCall, ah: _Axis, aw: _Axis) -> KernelSource:
    x, y = call.ins[0], call.outs[0]
    planes = int(x.shape[0]) * int(x.shape[1])
    taps = ("for (long kh = 0; kh < KH; ++kh) { const long ih = ih0 + kh * DH; if (ih < 0 || ih >= H) continue; "
            "const float* __restrict xr = xp + ih * W; ")
    edge = ("{ float m = -GM_INF; " + taps + "for (long kw = 0; kw < KW; ++kw) { const long iw = ow * SW - PW + kw * DW; "
            "if (iw >= 0 && iw < W) m = gm_pool_max(m, xr[iw]); } } yr[ow] = m; }")
    if aw.s in (1, 2) and aw.hi - aw.lo >= VBLOCK:
        load = "gm_v16_load" if aw.s == 1 else "gm_v16_load_s2"
        interior = (f"  for (long ob = OWL; ob < OWR; ob += {VBLOCK}) {{\n"
                    f"    const long o0 = ob + {VBLOCK} <= OWR ? ob : OWR - {VBLOCK};\n"
                    "    gm_v16f m = gm_v16_fill(-GM_INF);\n"
                    f"    {taps}\n"
                    "      _Pragma(\"GCC unroll 16\") for (long kw = 0; kw < KW; ++kw)\n"
                    f"        m = gm_v16_pool_max(m, {load}(xr + o0 * SW - PW + kw * DW));\n"
                    "    }\n    gm_v16_store(yr + o0, m);\n  }")
    else:
        interior = ("  for (long ow = OWL; ow < OWR; ++ow) { float m = -GM_INF; " + taps +
                    "_Pragma(\"GCC unroll 16\") for (long kw = 0; kw < KW; ++kw) "
                    "m = gm_pool_max(m, xr[ow * SW - PW + kw * DW]); } yr[ow] = m; }")
    pre = f"""namespace {{
void @SYM@_row(const float* __restrict xp, float* __restrict yr, long oh) {{
  constexpr long H = {ah.size}, W = {aw.size}, OW = {aw.out}, KH = {ah.k}, KW = {aw.k};
  constexpr long SH = {ah.s}, SW = {aw.s}, PH = {ah.p}, PW = {aw.p}, DH = {ah.d}, DW = {aw.d};
  constexpr long OWL = {aw.lo}, OWR = {aw.hi};
  const long ih0 = oh * SH - PH;
  for (long ow = 0; ow < OWL; ++ow) {edge}
  for (long ow = OWR; ow < OW; ++ow) {edge}
{interior}
}}
}}  // namespace
"""
    work = y.numel() * ah.k * aw.k
    par = work >= PAR_THRESHOLD and planes * ah.out > 1
    body = _pool_entry("@SYM@_row", planes, ah.out, aw.out, ah.size * aw.size, par)
    return finish("max_pool2d", call, body, header=template("pool.h"), pre=pre, parallel=par,
                  pattern=f"max_pool2d {shape_text(x)} k{ah.k}x{aw.k} s{ah.s}x{aw.s} p{ah.p}x{aw.p}")


@lowers("avg_pool2d", tier=NATIVE)
def avg_pool2d(call: OpCall) -> Claim:
    """ATen's channels-first average: the window clipped to the padded input sets the count
    (count_include_pad) or to the input itself, the sum runs rows then columns in fp32."""
    x, y = call.ins[0], call.outs[0]
    why = _fp32_refusal(call)
    if why is not None:
        return why
    if call.attrs.get("divisor_override") is not None:
        return refused("divisor_override", value=call.attrs.get("divisor_override"))
    cip = call.attrs.get("count_include_pad", True)
    if not isinstance(cip, bool):
        return refused("count_include_pad is not a bool", value=cip)
    axes = _pool_axes(call.attrs, x, y, dilation=False)
    if axes is None:
        return refused("a window or output shape ATen would not make", value=dict(call.attrs))
    return claimed(lambda: _avg_pool(call, *axes, cip))


def _avg_pool(call: OpCall, ah: _Axis, aw: _Axis, cip: bool) -> KernelSource:
    x, y = call.ins[0], call.outs[0]
    planes = int(x.shape[0]) * int(x.shape[1])
    pre = f"""namespace {{
void @SYM@_row(const float* __restrict xp, float* __restrict yr, long oh) {{
  constexpr long H = {ah.size}, W = {aw.size}, OW = {aw.out}, KH = {ah.k}, KW = {aw.k};
  constexpr long SH = {ah.s}, SW = {aw.s}, PH = {ah.p}, PW = {aw.p};
  long ih0 = oh * SH - PH;
  long ih1 = ih0 + KH < H + PH ? ih0 + KH : H + PH;
  const long rows_padded = ih1 - ih0;
  ih0 = ih0 > 0 ? ih0 : 0;
  ih1 = ih1 < H ? ih1 : H;
  for (long ow = 0; ow < OW; ++ow) {{
    long iw0 = ow * SW - PW;
    long iw1 = iw0 + KW < W + PW ? iw0 + KW : W + PW;
    const long pool = rows_padded * (iw1 - iw0);
    iw0 = iw0 > 0 ? iw0 : 0;
    iw1 = iw1 < W ? iw1 : W;
    if (ih0 >= ih1 || iw0 >= iw1) {{ yr[ow] = 0.0f; continue; }}
    float s = 0.0f;
    for (long ih = ih0; ih < ih1; ++ih)
      for (long iw = iw0; iw < iw1; ++iw) s += xp[ih * W + iw];
    const long div = {"pool" if cip else "(ih1 - ih0) * (iw1 - iw0)"};
    yr[ow] = s / (float)div;
  }}
}}
}}  // namespace
"""
    par = y.numel() * ah.k * aw.k >= PAR_THRESHOLD and planes * ah.out > 1
    body = _pool_entry("@SYM@_row", planes, ah.out, aw.out, ah.size * aw.size, par)
    return finish("avg_pool2d", call, body, header=template("pool.h"), pre=pre, parallel=par,
                  pattern=f"avg_pool2d {shape_text(x)} k{ah.k}x{aw.k} s{ah.s}x{aw.s} p{ah.p}x{aw.p}")


@lowers("adaptive_avg_pool2d", tier=NATIVE)
def adaptive_avg_pool2d(call: OpCall) -> Claim:
    """A global pool (output 1x1) is ATen's `mean` over each plane: a vector sum (order
    differs from ATen's only by rounding) over one division. Other sizes follow ATen's
    adaptive kernel exactly: windows [floor(o*I/O), ceil((o+1)*I/O)), sum / kh / kw."""
    x, y = call.ins[0], call.outs[0]
    why = _fp32_refusal(call)
    if why is not None:
        return why
    size = pair(call.attrs.get("output_size"))
    if x.dim() != 4 or y.dim() != 4 or size is None or tuple(x.shape[:2]) != tuple(y.shape[:2]):
        return refused("not a 4-d NCHW pooling to an output size", value=call.attrs.get("output_size"))
    oh, ow = size
    h, w = int(x.shape[2]), int(x.shape[3])
    if [oh, ow] != [int(y.shape[2]), int(y.shape[3])] or oh < 1 or ow < 1 or h < 1 or w < 1:
        return refused("the output shape is not the output size", value=tuple(y.shape))
    return claimed(lambda: _adaptive_avg_pool(call, oh, ow))


def _adaptive_avg_pool(call: OpCall, oh: int, ow: int) -> KernelSource:
    x = call.ins[0]
    h, w = int(x.shape[2]), int(x.shape[3])
    planes = int(x.shape[0]) * int(x.shape[1])
    hw = h * w
    par = x.numel() >= PAR_THRESHOLD and planes * oh > 1
    if oh == 1 and ow == 1:
        body = ["  const float* x = (const float*)p0;", "  float* y = (float*)p1;"]
        if par:
            body.append("  " + omp_for(planes, x.numel()))
        nv = hw // 16
        body += [f"  for (long c = 0; c < {planes}L; ++c) {{",
                 f"    const float* __restrict xp = x + c * {hw}L;",
                 "    float s = 0.0f;"]
        if nv:    # 16 lane sums, then the lanes pairwise, then the tail
            body += ["    gm_v16f acc = gm_v16_load(xp);",
                     f"    for (long i = 16; i < {nv * 16}L; i += 16) acc = gm_v16_add(acc, gm_v16_load(xp + i));",
                     "    s = gm_v16_sum(acc);"]
        body += [f"    for (long i = {nv * 16}L; i < {hw}L; ++i) s += xp[i];",
                 f"    y[c] = s / {float(hw)!r}f;",
                 "  }"]
        return finish("adaptive_avg_pool2d", call, body, header=template("pool.h"), parallel=par,
                      pattern=f"global_avg_pool {shape_text(x)}")
    pre = f"""namespace {{
void @SYM@_row(const float* __restrict xp, float* __restrict yr, long oh) {{
  constexpr long H = {h}, W = {w}, OH = {oh}, OW = {ow};
  const long ih0 = (oh * H) / OH, ih1 = ((oh + 1) * H + OH - 1) / OH;
  for (long ow = 0; ow < OW; ++ow) {{
    const long iw0 = (ow * W) / OW, iw1 = ((ow + 1) * W + OW - 1) / OW;
    float s = 0.0f;
    for (long ih = ih0; ih < ih1; ++ih)
      for (long iw = iw0; iw < iw1; ++iw) s += xp[ih * W + iw];
    yr[ow] = s / (float)(ih1 - ih0) / (float)(iw1 - iw0);
  }}
}}
}}  // namespace
"""
    body = _pool_entry("@SYM@_row", planes, oh, ow, hw, par)
    return finish("adaptive_avg_pool2d", call, body, header=template("pool.h"), pre=pre, parallel=par,
                  pattern=f"adaptive_avg_pool2d {shape_text(x)} -> {oh}x{ow}")


__all__ = ["VBLOCK", "adaptive_avg_pool2d", "avg_pool2d", "max_pool2d"]
