"""Generated kernels for single ops whose ATen step costs far more than their work here.

Two kinds of op lose to a generated kernel with every shape baked in:

- pooling on contiguous NCHW fp32. ATen's channels-first max_pool2d walks each output's
  window with scalar code and bounds checks (3 ms for ResNet-18's stem pool, 20x its own
  channels-last path), and adaptive_avg_pool2d pays a full reduction dispatch for 512
  sums of 49. Here the window loop is fixed and the interior columns (no tap in the
  padding) run as branch-free vector blocks of 16 outputs.
- small data-movement ops (permute, slice, index, cast, logical_and/or, arange): a
  microsecond or less of bytes behind several microseconds of dispatch, view construction
  and `copy_` (tens inside a plan run, with cold caches). A ctypes call into a fixed loop
  nest costs well under one.

Results are ATen's bit for bit, except the global average pool (ATen's `mean` sums in
its own vector order; ours differs by rounding only). Max pooling keeps ATen's order
(rows then columns, `v > m || isnan(v)`), so NaN and the sign of a zero maximum come out as
ATen's. A generator returns None for whatever it does not cover (another dtype, a layout,
an attribute ATen would reject): the ATen step then runs as before.

Index values are read at run time: one out of range (ATen raises IndexError) makes its
output block zeros instead of reading outside the tensor.
"""
from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from graphmode.backends.cpu.codegen import PAR_THRESHOLD, KernelSource
from graphmode.backends.cpu.native import register_native
from graphmode.ir.types import TORCH_TO_DTYPE, TensorType, eval_dim, normalize_dim

_CTYPE = {"f64": "double", "f32": "float", "i64": "int64_t", "i32": "int32_t", "i16": "int16_t",
          "i8": "int8_t", "u8": "uint8_t", "bool": "uint8_t"}
_INT = ("i64", "i32", "i16", "i8", "u8")
_BITS = {1: "int8_t", 2: "int16_t", 4: "int32_t", 8: "int64_t"}   # element moves by item size
TILE = 16          # transpose tile edge (elements): a 16x16 fp32 tile is 1 KiB of each side
# Copies run on all threads only from PAR_THRESHOLD elements, as fused elementwise nests do.
# Measured here (inputs just written by another op, quiet machine): a 196-393 KB head permute
# or qkv slice took 5-13 us on one thread and the same on two (ATen's two-thread copy_:
# 10-17 us), and every parallel region stalls for milliseconds when other processes hold
# the other core.
COPY_PAR_ELEMS = PAR_THRESHOLD

_COMMON = r"""
#ifndef GM_NATIVE_POOL_H
#define GM_NATIVE_POOL_H
// ATen's max-pool update: a later value replaces the running max only when strictly greater
// or NaN, so the first of equal maxima (the sign of a zero) and the last NaN win, as there.
// `|`, not `||`: both compares always run, so the select compiles to a blend, not branches.
GM_INLINE float gm_pool_max(float m, float v) { return ((v > m) | (v != v)) ? v : m; }
// 16 floats as a GCC vector: one AVX-512 register, two AVX2 ones, four SSE ones.
typedef float gm_v16f __attribute__((vector_size(64)));
GM_INLINE gm_v16f gm_v16_load(const float* p) { gm_v16f v; __builtin_memcpy(&v, p, 64); return v; }
GM_INLINE void gm_v16_store(float* p, gm_v16f v) { __builtin_memcpy(p, &v, 64); }
// p[0], p[2], ..., p[30]: reads p[0..30] only (the second load starts at p[15]), so a block
// ending at the last element of a buffer never reads past it
GM_INLINE gm_v16f gm_v16_load_s2(const float* p) {
  const gm_v16f a = gm_v16_load(p), b = gm_v16_load(p + 15);
  return __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14, 17, 19, 21, 23, 25, 27, 29, 31);
}
GM_INLINE gm_v16f gm_v16_pool_max(gm_v16f m, gm_v16f v) { return ((v > m) | (v != v)) ? v : m; }
typedef float gm_v8f __attribute__((vector_size(32)));
typedef float gm_v4f __attribute__((vector_size(16)));
GM_INLINE float gm_v16_sum(gm_v16f v) {
  const gm_v8f a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                   __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const gm_v4f b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}
#endif
"""


# ----------------------------------------------------------------------------------- helpers

def _dtype(t: torch.Tensor) -> str | None:
    return TORCH_TO_DTYPE.get(t.dtype)


def _overlaps(ins_t: Sequence[torch.Tensor], outs: Sequence[torch.Tensor]) -> bool:
    """A kernel reads its inputs while writing its outputs: shared bytes would be read after
    being overwritten (no op here is declared in-place)."""
    def span(t):
        p = t.data_ptr()
        return p, p + t.numel() * t.element_size()
    for o in outs:
        if o.numel() == 0:
            continue
        a0, a1 = span(o)
        for i in ins_t:
            if i.numel() == 0:
                continue
            b0, b1 = span(i)
            if a0 < b1 and b0 < a1:
                return True
    return False


def _strides(shape: Sequence[int]) -> list[int]:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= int(n)
    return out[::-1]


def _lin(names: Sequence[str], strides: Sequence[int], base: int = 0) -> str:
    terms = [f"{n} * {s}L" if s != 1 else n for n, s in zip(names, strides) if s != 0]
    if base:
        terms.append(f"{base}L")
    return " + ".join(terms) if terms else "0L"


def _loops(loops: Sequence[tuple[str, int, int]], body: Sequence[str], *, par: bool, indent: str = "  ") -> list[str]:
    """Perfectly nested `for` loops `(var, bound, step)` around `body`; with `par` the nest is
    one OpenMP loop (collapsed), so every level's iterations are shared between threads."""
    out = []
    if par and loops:
        c = f" collapse({len(loops)})" if len(loops) > 1 else ""
        out.append(f"{indent}#pragma omp parallel for{c} schedule(static) num_threads(gm_nt())")
    for k, (v, n, s) in enumerate(loops):
        inc = f"++{v}" if s == 1 else f"{v} += {s}"
        out.append(f"{indent}{'  ' * k}for (long {v} = 0; {v} < {n}L; {inc})")
    pad = indent + "  " * len(loops)
    out.append(pad + "{")
    out += [pad + "  " + b for b in body]
    out.append(pad + "}")
    return out


def _finish(op: str, body: Sequence[str], ins_t: Sequence[torch.Tensor], outs: Sequence[torch.Tensor],
            inputs: Sequence[str], outputs: Sequence[str], *, pre: str = "", parallel: bool = False,
            pattern: str = "", status: str = "") -> KernelSource | None:
    """Wrap a kernel body over `p0..pN` (inputs then outputs) into an exported symbol named by
    a hash of the text, so identical instructions share one compiled kernel."""
    types: dict[str, TensorType] = {}
    for name, t in zip(list(inputs) + list(outputs), list(ins_t) + list(outs)):
        dt = _dtype(t)
        if dt is None:
            return None
        types[name] = TensorType(dt, tuple(int(d) for d in t.shape))
    n = len(inputs) + len(outputs)
    params = ", ".join(f"void* p{i}" for i in range(n))
    call = ", ".join(f"p[{i}]" for i in range(n))
    lines = [_COMMON, pre, f"GM_EXPORT void @SYM@({params}) {{", *body, "}",
             f"GM_EXPORT void @SYM@_packed(void** p) {{ @SYM@({call}); }}", ""]
    text = "\n".join(lines)
    symbol = f"gm_native_{op}_{hashlib.sha256(text.encode()).hexdigest()[:16]}"
    return KernelSource(symbol=symbol, source=text.replace("@SYM@", symbol), inputs=tuple(inputs),
                        outputs=tuple(outputs), types=types, kind="native", parallel=parallel,
                        pattern=pattern or op, status=status)


def _shape_text(t: torch.Tensor) -> str:
    return "x".join(str(int(d)) for d in t.shape) or "scalar"


def _int(v) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _pair(v) -> list | None:
    v = list(v) if isinstance(v, (list, tuple)) else [v, v]
    if len(v) == 1:
        v = v * 2
    return v if len(v) == 2 and all(_int(x) is not None for x in v) else None


# ----------------------------------------------------------------------------------- pooling

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
    k = _pair(attrs.get("kernel"))
    s = _pair(attrs.get("stride") or attrs.get("kernel"))
    p = _pair(attrs.get("padding", 0))
    d = _pair(attrs.get("dilation", 1)) if dilation else [1, 1]
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
        lines.append("  #pragma omp parallel for schedule(static) num_threads(gm_nt())")
    lines.append(f"  for (long t = 0; t < {planes * ah_out}L; ++t) "
                 f"{body_row}(x + (t / {ah_out}L) * {hw}L, y + t * {ow}L, t % {ah_out}L);")
    return lines


VBLOCK = 16        # interior columns per vector block (gm_v16f)


@register_native("max_pool2d")
def max_pool2d(ins_t, outs, attrs, env, inputs, outputs) -> KernelSource | None:
    """Per output row: the border columns (a tap in the padding) one by one with bounds
    checks, the interior in blocks of VBLOCK columns held in one vector across the whole
    window (strides 1 and 2; other strides column by column). A row whose interior is not a
    multiple of VBLOCK ends with a block shifted back over columns already done: it rewrites
    the same values."""
    x, y = ins_t[0], outs[0]
    if x.dtype != torch.float32 or y.dtype != torch.float32 or _overlaps(ins_t, outs):
        return None
    axes = _pool_axes(attrs, x, y, dilation=True)
    if axes is None:
        return None
    ah, aw = axes
    planes = int(x.shape[0]) * int(x.shape[1])
    taps = ("for (long kh = 0; kh < KH; ++kh) { const long ih = ih0 + kh * DH; if (ih < 0 || ih >= H) continue; "
            "const float* __restrict xr = xp + ih * W; ")
    edge = ("{ float m = -GM_INF; " + taps + "for (long kw = 0; kw < KW; ++kw) { const long iw = ow * SW - PW + kw * DW; "
            "if (iw >= 0 && iw < W) m = gm_pool_max(m, xr[iw]); } } yr[ow] = m; }")
    if aw.s in (1, 2) and aw.hi - aw.lo >= VBLOCK:
        load = "gm_v16_load" if aw.s == 1 else "gm_v16_load_s2"
        interior = (f"  for (long ob = OWL; ob < OWR; ob += {VBLOCK}) {{\n"
                    f"    const long o0 = ob + {VBLOCK} <= OWR ? ob : OWR - {VBLOCK};\n"
                    "    gm_v16f m = -GM_INF - (gm_v16f){};\n"
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
    return _finish("max_pool2d", body, ins_t, outs, inputs, outputs, pre=pre, parallel=par,
                   pattern=f"max_pool2d {_shape_text(x)} k{ah.k}x{aw.k} s{ah.s}x{aw.s} p{ah.p}x{aw.p}")


@register_native("avg_pool2d")
def avg_pool2d(ins_t, outs, attrs, env, inputs, outputs) -> KernelSource | None:
    """ATen's channels-first average: the window clipped to the padded input sets the count
    (count_include_pad) or to the input itself, the sum runs rows then columns in fp32."""
    x, y = ins_t[0], outs[0]
    if x.dtype != torch.float32 or y.dtype != torch.float32 or _overlaps(ins_t, outs):
        return None
    if attrs.get("divisor_override") is not None:
        return None
    cip = attrs.get("count_include_pad", True)
    if not isinstance(cip, bool):
        return None
    axes = _pool_axes(attrs, x, y, dilation=False)
    if axes is None:
        return None
    ah, aw = axes
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
    return _finish("avg_pool2d", body, ins_t, outs, inputs, outputs, pre=pre, parallel=par,
                   pattern=f"avg_pool2d {_shape_text(x)} k{ah.k}x{aw.k} s{ah.s}x{aw.s} p{ah.p}x{aw.p}")


@register_native("adaptive_avg_pool2d")
def adaptive_avg_pool2d(ins_t, outs, attrs, env, inputs, outputs) -> KernelSource | None:
    """A global pool (output 1x1) is ATen's `mean` over each plane: a vector sum (order
    differs from ATen's only by rounding) over one division. Other sizes follow ATen's
    adaptive kernel exactly: windows [floor(o*I/O), ceil((o+1)*I/O)), sum / kh / kw."""
    x, y = ins_t[0], outs[0]
    if x.dtype != torch.float32 or y.dtype != torch.float32 or _overlaps(ins_t, outs):
        return None
    size = _pair(attrs.get("output_size"))
    if x.dim() != 4 or y.dim() != 4 or size is None or tuple(x.shape[:2]) != tuple(y.shape[:2]):
        return None
    oh, ow = size
    h, w = int(x.shape[2]), int(x.shape[3])
    if [oh, ow] != [int(y.shape[2]), int(y.shape[3])] or oh < 1 or ow < 1 or h < 1 or w < 1:
        return None
    planes = int(x.shape[0]) * int(x.shape[1])
    hw = h * w
    par = x.numel() >= PAR_THRESHOLD and planes * oh > 1
    if oh == 1 and ow == 1:
        body = ["  const float* x = (const float*)p0;", "  float* y = (float*)p1;"]
        if par:
            body.append("  #pragma omp parallel for schedule(static) num_threads(gm_nt())")
        nv = hw // 16
        body += [f"  for (long c = 0; c < {planes}L; ++c) {{",
                 f"    const float* __restrict xp = x + c * {hw}L;",
                 "    float s = 0.0f;"]
        if nv:    # 16 lane sums, then the lanes pairwise, then the tail
            body += ["    gm_v16f acc = gm_v16_load(xp);",
                     f"    for (long i = 16; i < {nv * 16}L; i += 16) acc += gm_v16_load(xp + i);",
                     "    s = gm_v16_sum(acc);"]
        body += [f"    for (long i = {nv * 16}L; i < {hw}L; ++i) s += xp[i];",
                 f"    y[c] = s / {float(hw)!r}f;",
                 "  }"]
        return _finish("adaptive_avg_pool2d", body, ins_t, outs, inputs, outputs, parallel=par,
                       pattern=f"global_avg_pool {_shape_text(x)}")
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
    return _finish("adaptive_avg_pool2d", body, ins_t, outs, inputs, outputs, pre=pre, parallel=par,
                   pattern=f"adaptive_avg_pool2d {_shape_text(x)} -> {oh}x{ow}")


# ------------------------------------------------------------------------------ dense copies

def _copy_body(shape: Sequence[int], strides: Sequence[int], base: int, item: int) -> tuple[list[str], bool]:
    """Copy the strided view (`shape`, element `strides`, element offset `base`) of `p0` into
    the contiguous `p1`. Unit dims are dropped and dims that stay adjacent in both are merged,
    so MiniLM's head permute [1,16,12,32] -> [1,12,16,32] becomes rows of 32 contiguous
    floats (one inlined memcpy each); a true transpose runs in TILE x TILE tiles so that both
    sides stay in cache lines."""
    dims: list[list[int]] = []
    for n, s in zip(shape, strides):
        n = int(n)
        if n == 1:
            continue
        if dims and dims[-1][1] == s * n:
            dims[-1] = [dims[-1][0] * n, s]
        else:
            dims.append([n, s])
    numel = math.prod(int(n) for n in shape)
    lines = ["  const char* __restrict src = (const char*)p0;", "  char* __restrict dst = (char*)p1;"]
    if numel == 0:
        return lines, False
    par = numel >= COPY_PAR_ELEMS
    ostr = _strides([n for n, _ in dims])
    if not dims:
        return lines + [f"  __builtin_memcpy(dst, src + {base * item}L, {item});"], False
    et = _BITS[item]
    if dims[-1][1] == 1:                    # contiguous rows
        run = dims[-1][0]
        outer = dims[:-1]
        names = [f"i{k}" for k in range(len(outer))]
        src_off = _lin(names, [s for _, s in outer], base)
        dst_off = _lin(names, ostr[:-1])
        body = [f"__builtin_memcpy(dst + ({dst_off}) * {item}L, src + ({src_off}) * {item}L, {run * item});"]
        loops = [(v, n, 1) for v, (n, _) in zip(names, outer)]
        par = par and bool(loops)
        if not loops:
            return lines + ["  " + body[0]], False
        return lines + _loops(loops, body, par=par), par
    unit = next((k for k, (_, s) in enumerate(dims) if s == 1), None)
    last = len(dims) - 1
    if unit is None:                        # a strided gather (slice with step > 1): element loop
        names = [f"i{k}" for k in range(len(dims))]
        src_off = _lin(names, [s for _, s in dims], base)
        dst_off = _lin(names, ostr)
        body = [f"(({et}*)dst)[{dst_off}] = ((const {et}*)src)[{src_off}];"]
        loops = [(v, n, 1) for v, (n, _) in zip(names, dims)]
        return lines + _loops(loops, body, par=par), par
    # transpose: tiles over (unit-stride input dim, last output dim)
    others = [k for k in range(len(dims)) if k not in (unit, last)]
    names = {k: f"i{k}" for k in others}
    nu, nl = dims[unit][0], dims[last][0]
    sl = dims[last][1]
    src_off = _lin([names[k] for k in others], [dims[k][1] for k in others], base)
    dst_off = _lin([names[k] for k in others], [ostr[k] for k in others])
    body = [f"const {et}* __restrict s = (const {et}*)src + {src_off};",
            f"{et}* __restrict d = ({et}*)dst + {dst_off};",
            f"const long ae = ta + {TILE}L < {nu}L ? ta + {TILE}L : {nu}L;",
            f"const long be = tb + {TILE}L < {nl}L ? tb + {TILE}L : {nl}L;",
            "for (long a = ta; a < ae; ++a)",
            f"  for (long b = tb; b < be; ++b) d[a * {ostr[unit]}L + b] = s[a + b * {sl}L];"]
    loops = [(names[k], dims[k][0], 1) for k in others] + [("ta", nu, TILE), ("tb", nl, TILE)]
    return lines + _loops(loops, body, par=par), par


def _copy_kernel(op: str, ins_t, outs, inputs, outputs, shape, strides, base, pattern) -> KernelSource | None:
    x, y = ins_t[0], outs[0]
    item = x.element_size()
    if x.dtype != y.dtype or item not in _BITS or _overlaps(ins_t, outs):
        return None
    if tuple(int(d) for d in y.shape) != tuple(int(d) for d in shape):
        return None
    body, par = _copy_body(shape, strides, base, item)
    return _finish(op, body, ins_t, outs, inputs, outputs, parallel=par, pattern=pattern)


@register_native("permute")
def permute(ins_t, outs, attrs, env, inputs, outputs) -> KernelSource | None:
    x = ins_t[0]
    r = x.dim()
    perm = attrs.get("perm")
    if not isinstance(perm, (list, tuple)) or len(perm) != r or any(_int(p) is None for p in perm):
        return None
    perm = [p + r if p < 0 else p for p in perm]
    if sorted(perm) != list(range(r)):
        return None
    xs = _strides(x.shape)
    return _copy_kernel("permute", ins_t, outs, inputs, outputs, [int(x.shape[p]) for p in perm],
                        [xs[p] for p in perm], 0, f"permute {_shape_text(x)} {list(perm)}")


@register_native("slice")
def slice_(ins_t, outs, attrs, env, inputs, outputs) -> KernelSource | None:
    x = ins_t[0]
    r = x.dim()
    dim, start, step = _int(attrs.get("dim")), _int(attrs.get("start", 0)), _int(attrs.get("step", 1))
    if dim is None or start is None or step is None or step <= 0 or not -r <= dim < r:
        return None
    dim = dim + r if dim < 0 else dim
    try:
        end = eval_dim(normalize_dim(attrs.get("end", 2 ** 62)), env)
    except Exception:  # noqa: BLE001 - an end we cannot evaluate here: ATen's step evaluates it
        return None
    idx = range(*slice(start, end, step).indices(int(x.shape[dim])))
    shape = [int(d) for d in x.shape]
    shape[dim] = len(idx)
    xs = _strides(x.shape)
    strides = list(xs)
    strides[dim] *= step
    base = idx.start * xs[dim] if len(idx) else 0
    return _copy_kernel("slice", ins_t, outs, inputs, outputs, shape, strides, base,
                        f"slice {_shape_text(x)} dim{dim} [{idx.start}:{idx.stop}:{step}]")


@register_native("index")
def index(ins_t, outs, attrs, env, inputs, outputs) -> KernelSource | None:
    """x[..., i0, i1, ...] with integer index tensors on consecutive dims (torch puts the
    broadcast index shape in their place). An index out of range is never read: its block is
    zeroed, counted, and the bound step raises (as ATen raises IndexError)."""
    x, idx, y = ins_t[0], list(ins_t[1:]), outs[0]
    dims = attrs.get("dims")
    r = x.dim()
    if not isinstance(dims, (list, tuple)) or len(dims) != len(idx) or not idx or any(_int(d) is None for d in dims):
        return None
    dims = [d + r if d < 0 else d for d in dims]
    if dims != list(range(dims[0], dims[0] + len(dims))) or dims[-1] >= r or dims[0] < 0:
        return None
    if x.dtype != y.dtype or x.element_size() not in _BITS or _overlaps(ins_t, outs):
        return None
    if any(t.dtype not in (torch.int64, torch.int32) for t in idx):
        return None
    try:
        bshape = list(torch.broadcast_shapes(*(tuple(t.shape) for t in idx)))
    except RuntimeError:
        return None
    pre_shape = [int(d) for d in x.shape[:dims[0]]]
    post_shape = [int(d) for d in x.shape[dims[-1] + 1:]]
    if [int(d) for d in y.shape] != pre_shape + bshape + post_shape:
        return None
    item = x.element_size()
    xs = _strides(x.shape)
    inner = math.prod(post_shape) * item
    npre, nb = math.prod(pre_shape), math.prod(bshape)
    if y.numel() == 0:
        return _finish("index", ["  (void)p0;"], ins_t, outs, inputs, outputs)
    bst = _strides(bshape)
    lines = ["  const char* __restrict src = (const char*)p0;",
             f"  char* __restrict dst = (char*)p{len(ins_t)};"]
    for k, t in enumerate(idx):
        lines.append(f"  const {_CTYPE[_dtype(t)]}* __restrict x{k} = (const {_CTYPE[_dtype(t)]}*)p{k + 1};")
    body = ["long off = 0;", "bool ok = true;"]
    for k, t in enumerate(idx):
        # the index tensor's element for broadcast position b: its own (right-aligned) dims,
        # stride 0 where it broadcasts
        tshape = [1] * (len(bshape) - t.dim()) + [int(d) for d in t.shape]
        tst = _strides(tshape)
        terms = []
        for j, (n, bs) in enumerate(zip(bshape, bst)):
            if tshape[j] == 1 or tst[j] == 0:
                continue
            coord = f"(b / {bs}L)" if bs != 1 else "b"
            coord = f"({coord} % {n}L)" if j > 0 else coord
            terms.append(f"{coord} * {tst[j]}L" if tst[j] != 1 else coord)
        pos = " + ".join(terms) or "0"
        size = int(x.shape[dims[k]])
        body += [f"long v{k} = (long)x{k}[{pos}];",
                 f"if (v{k} < 0) v{k} += {size}L;",
                 f"ok = ok && v{k} >= 0 && v{k} < {size}L;",
                 f"off += v{k} * {xs[dims[k]]}L;"]
    pre_stride = xs[dims[0]] * int(x.shape[dims[0]]) if dims[0] > 0 else 0
    body += [f"char* d = dst + (p * {nb}L + b) * {inner}L;",
             f"if (ok) __builtin_memcpy(d, src + (p * {pre_stride}L + off) * {item}L, {inner});",
             f"else {{ __builtin_memset(d, 0, {inner}); __atomic_fetch_add(&@SYM@_bad, 1L, __ATOMIC_RELAXED); }}"]
    par = y.numel() >= COPY_PAR_ELEMS and npre * nb > 1
    lines += _loops([("p", npre, 1), ("b", nb, 1)], body, par=par)
    pre = ("static long @SYM@_bad = 0;\n"
           "GM_EXPORT long @SYM@_status(void) { return __atomic_exchange_n(&@SYM@_bad, 0L, __ATOMIC_RELAXED); }")
    return _finish("index", lines, ins_t, outs, inputs, outputs, pre=pre, parallel=par,
                   pattern=f"index {_shape_text(x)} dims{dims} -> {_shape_text(y)}",
                   status="index out of range")


# ------------------------------------------------------------------------- small elementwise

def _convert(src: str, dst: str, v: str) -> str | None:
    """C for torch's `.to(dst)` of one value, or None where C's conversion is not torch's
    (float -> int is undefined out of range; half types have no C type here)."""
    if src not in _CTYPE or dst not in _CTYPE:
        return None
    if dst == "bool":
        return f"(uint8_t)({v} != 0)"
    if src == "bool":
        return f"({_CTYPE[dst]})({v} != 0)"
    if src in ("f32", "f64") and dst in _INT:
        return None
    return f"({_CTYPE[dst]}){v}"


@register_native("cast")
def cast(ins_t, outs, attrs, env, inputs, outputs) -> KernelSource | None:
    x, y = ins_t[0], outs[0]
    sd, dd = _dtype(x), _dtype(y)
    if sd is None or dd is None or attrs.get("dtype") != dd or x.shape != y.shape or _overlaps(ins_t, outs):
        return None
    expr = _convert(sd, dd, "x[i]")
    if expr is None:
        return None
    n = x.numel()
    par = n >= PAR_THRESHOLD
    body = [f"  const {_CTYPE[sd]}* __restrict x = (const {_CTYPE[sd]}*)p0;",
            f"  {_CTYPE[dd]}* __restrict y = ({_CTYPE[dd]}*)p1;"]
    body.append("  #pragma omp parallel for simd schedule(static) num_threads(gm_nt())" if par else "  #pragma omp simd")
    body.append(f"  for (long i = 0; i < {n}L; ++i) y[i] = {expr};")
    return _finish("cast", body, ins_t, outs, inputs, outputs, parallel=par,
                   pattern=f"cast {_shape_text(x)} {sd}->{dd}")


def _broadcast_loops(out_shape: Sequence[int], operands: Sequence[Sequence[int]]):
    """Loop dims (size, stride per operand) of a broadcast over a contiguous output: unit dims
    dropped, dims merged where every operand stays contiguous across them."""
    r = len(out_shape)
    per = []
    for shp in operands:
        shp = [1] * (r - len(shp)) + [int(d) for d in shp]
        st = _strides(shp)
        per.append([0 if shp[j] == 1 else st[j] for j in range(r)])
    ost = _strides(out_shape)
    dims: list[list] = []
    for j in range(r):
        n = int(out_shape[j])
        if n == 1:
            continue
        ss = [p[j] for p in per] + [ost[j]]
        if dims and all(a == b * n for a, b in zip(dims[-1][1], ss)):
            dims[-1] = [dims[-1][0] * n, ss]
        else:
            dims.append([n, ss])
    return dims


def _logical(op: str, c: str):
    def gen(ins_t, outs, attrs, env, inputs, outputs) -> KernelSource | None:
        a, b = ins_t
        y = outs[0]
        dts = [_dtype(a), _dtype(b)]
        if y.dtype != torch.bool or any(d not in _CTYPE for d in dts) or _overlaps(ins_t, outs):
            return None
        try:
            if list(torch.broadcast_shapes(a.shape, b.shape)) != list(y.shape):
                return None
        except RuntimeError:
            return None
        dims = _broadcast_loops([int(d) for d in y.shape], [a.shape, b.shape])
        names = [f"i{k}" for k in range(len(dims))]
        ia = _lin(names, [s[0] for _, s in dims])
        ib = _lin(names, [s[1] for _, s in dims])
        iy = _lin(names, [s[2] for _, s in dims])
        lines = [f"  const {_CTYPE[dts[0]]}* __restrict a = (const {_CTYPE[dts[0]]}*)p0;",
                 f"  const {_CTYPE[dts[1]]}* __restrict b = (const {_CTYPE[dts[1]]}*)p1;",
                 "  uint8_t* __restrict y = (uint8_t*)p2;"]
        body = [f"y[{iy}] = (uint8_t)((a[{ia}] != 0) {c} (b[{ib}] != 0));"]
        par = y.numel() >= PAR_THRESHOLD and len(dims) > 0
        lines += _loops([(v, n, 1) for v, (n, _) in zip(names, dims)], body, par=par)
        return _finish(op, lines, ins_t, outs, inputs, outputs, parallel=par,
                       pattern=f"{op} {_shape_text(a)}, {_shape_text(b)}")
    return gen


register_native("logical_and")(_logical("logical_and", "&"))
register_native("logical_or")(_logical("logical_or", "|"))


@register_native("arange")
def arange(ins_t, outs, attrs, env, inputs, outputs) -> KernelSource | None:
    """Integer dtypes only: a float arange rounds per ATen's vector code path."""
    y = outs[0]
    dt = _dtype(y)
    if dt not in _INT or y.dim() != 1 or ins_t:
        return None
    try:
        start = eval_dim(normalize_dim(attrs.get("start", 0)), env)
        end = eval_dim(normalize_dim(attrs["end"]), env)
    except Exception:  # noqa: BLE001 - ATen's step evaluates what we cannot
        return None
    step = _int(attrs.get("step", 1))
    if step is None or step == 0 or len(range(start, end, step)) != int(y.shape[0]):
        return None
    ct = _CTYPE[dt]
    body = [f"  {ct}* __restrict y = ({ct}*)p0;",
            "  #pragma omp simd",
            f"  for (long i = 0; i < {int(y.shape[0])}L; ++i) y[i] = ({ct})({start}L + i * {step}L);"]
    return _finish("arange", body, ins_t, outs, inputs, outputs, pattern=f"arange {start}:{end}:{step} {dt}")


__all__ = ["COPY_PAR_ELEMS", "TILE", "VBLOCK", "adaptive_avg_pool2d", "arange", "avg_pool2d", "cast", "index",
           "max_pool2d", "permute", "slice_"]
