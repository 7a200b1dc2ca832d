"""Generated depthwise convolution: a conv2d whose groups equal its input channels.

Why: ATen's depthwise path on CPU reaches about 1% of the FMA peak on the small maps of
ConvNeXt and MobileNet (a 7x7 over 16 channels of 16x16: 0.13 ms for 0.4 MFLOP), where ONNX
Runtime runs the whole block in about as long. Im2col and Winograd cover ungrouped convs only;
a depthwise conv has one input channel per output channel, so it is no GEMM.

Layout (per plan step, shapes baked in): one output plane (image, output channel) per task,
parallel over planes. A task copies its input plane once into a zero-padded plane on its
stack (the padding materialised: computing the in-image columns of each tap instead made the
loop run short and scalar, 3 GFLOP/s on ConvNeXt's 7x7), with each row's columns split by
phase of the stride, so that every tap reads a contiguous run. Per output row, a row of
accumulators starts at the bias and each tap adds its weight times its run: the innermost loop
has the output width as its fixed trip count and vectorises. The row goes out through the
epilogue. Planes whose padded copy would not fit `PLANE_BYTES` stay ATen.
A channel multiplier (output channels = multiplier x groups) reads input channel co / M.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from graphmode.backends.cpu.abi import KernelSource, entry_point, kernel_source, template
from graphmode.backends.cpu.attention import vector_traits
from graphmode.backends.cpu.conv import (ConvProblem, WholeWeightConfig, conv_args, epilogue_store,
                                         epilogue_types)
from graphmode.backends.cpu.omp_loops import omp_for
from graphmode.errors import BackendError
from graphmode.ir.types import TensorType

PAR_FLOPS = 1 << 18     # below this one thread: a team's wake-up costs more than the planes
PLANE_BYTES = 128 << 10  # a plane's padded copy lives on the thread's stack: larger maps stay ATen


def _rows(p: ConvProblem) -> int:
    """Padded input rows the taps read."""
    return (p.ho - 1) * p.stride[0] + (p.kh - 1) * p.dilation[0] + 1


def _cols(p: ConvProblem) -> int:
    """Padded input columns the taps read."""
    return (p.wo - 1) * p.stride[1] + (p.kw - 1) * p.dilation[1] + 1


def is_depthwise(p: ConvProblem) -> bool:
    """A conv the depthwise kernel covers: groups = input channels, its padded plane on the stack."""
    if not (p.groups == p.cin and p.groups > 1 and p.cout % p.groups == 0 and p.dtype == "f32"
            and p.ho > 0 and p.wo > 0):
        return False
    sx = p.stride[1]
    return (_rows(p) * sx * -(-_cols(p) // sx) + p.wo) * 4 <= PLANE_BYTES


@dataclass(frozen=True)
class DepthwiseConfig(WholeWeightConfig):
    """The depthwise candidate (one schedule: a plane per task; weight [Cout, 1, kh, kw])."""

    NAME: ClassVar[str] = "dw"
    WHAT: ClassVar[str] = "depthwise"

    def applies(self, p: ConvProblem) -> bool:
        return is_depthwise(p)

    def generate(self, p: ConvProblem, threads: int) -> KernelSource:
        return generate_depthwise(p, threads)


@dataclass(frozen=True)
class DepthwiseTiledConfig(DepthwiseConfig):
    """The same plane per task, its output in register tiles (`_tiles`): a second candidate,
    since which body wins depends on the map's width (timing picks)."""

    NAME: ClassVar[str] = "dwt"
    WHAT: ClassVar[str] = "depthwise (register tiles)"

    def weight_key(self) -> tuple:
        return (DepthwiseConfig.NAME,)          # the weight as it is: one prepared copy for both

    def generate(self, p: ConvProblem, threads: int) -> KernelSource:
        return generate_depthwise(p, threads, tiled=True)


def _row_copy(p: ConvProblem) -> list[str]:
    """C++ filling one padded row `xpr` from image row `xr`: per phase, the run of columns
    inside the image copied (a strided read for stride > 1), zeros on either side; the
    bounds are the problem's, worked out here."""
    sx, px, w = p.stride[1], p.padding[1], p.w
    rp = -(-_cols(p) // sx)
    out = []
    for ph in range(sx):
        # column c = j * sx + ph is image column c - px: inside for j in [lo, hi)
        lo = min(rp, max(0, -(-(px - ph) // sx)))
        hi = max(lo, min(rp, -(-(w + px - ph) // sx)))
        base = ph * rp
        if lo:
            out.append(f"    for (long j = 0; j < {lo}; ++j) xpr[{base} + j] = 0.0f;")
        if hi > lo:
            out.append(f"    for (long j = {lo}; j < {hi}; ++j) xpr[{base} + j] = xr[j * {sx} + {ph - px}];")
        if rp > hi:
            out.append(f"    for (long j = {hi}; j < {rp}; ++j) xpr[{base} + j] = 0.0f;")
    return out


def _rows_body(p: ConvProblem) -> list[str]:
    """Per output row, a row of accumulators in memory, each tap's weight times its run added
    along it (the innermost loop vectorises over the width): fast on wide maps (56 columns: 53
    GFLOP/s a thread), a load and a store per multiply-add on narrow ones."""
    return [
        "  float acc[WO];",
        "  for (long oy = 0; oy < HO; ++oy) {",
        "    for (long ox = 0; ox < WO; ++ox) acc[ox] = b0;",
        "    for (long ky = 0; ky < KH; ++ky) {",
        "      const long r = oy * SY + ky * DY;",
        "      if (r < PY || r - PY >= H) continue;             // a padding row adds nothing",
        "      const float* __restrict xpr = xp + r * SX * RP;",
        "      for (long kx = 0; kx < KW; ++kx) {",
        "        const float wv = wk[ky * KW + kx];",
        "        const float* __restrict src = xpr + ((kx * DX) % SX) * RP + (kx * DX) / SX;",
        "        #pragma omp simd        // along the row (unasked, GCC vectorised the taps 4 wide)",
        "        for (long ox = 0; ox < WO; ++ox) acc[ox] += wv * src[ox];",
        "      }",
        "    }",
        "    for (long ox = 0; ox < WO; ++ox) {",
        "      const long idx = (q * HO + oy) * WO + ox;",
        *epilogue_store(p, "y[idx]", "acc[ox]", "      "),
        "    }",
        "  }",
    ]


def _tiles(p: ConvProblem) -> list[str]:
    """A tile of RB output rows x VB vectors of columns: RB x VB accumulators in registers, each
    tap's weight broadcast once and run over them (attention.h's vector traits): 1.4-1.7x the
    accumulator row on 28- and 7-column maps, 0.65x on 56 columns (timing picks per shape)."""
    return [
        "  constexpr long L = VT::L, NV = (WO + L - 1) / L, WT = WO % L;",
        "  constexpr long VB = NV < 4 ? NV : 4, RB = VB >= 4 ? 2 : VB >= 2 ? 4 : 8;",
        "  alignas(64) float out[RB][VB * L];",
        "  for (long oy0 = 0; oy0 < HO; oy0 += RB) {",
        "    const long nr = HO - oy0 < RB ? HO - oy0 : RB;",
        "    for (long v0 = 0; v0 < NV; v0 += VB) {",
        "      VT::V acc[RB][VB];",
        "      GM_ATTN_UNROLL for (long r = 0; r < RB; ++r)",
        "        GM_ATTN_UNROLL for (long v = 0; v < VB; ++v) acc[r][v] = VT::set1(b0);",
        "      for (long ky = 0; ky < KH; ++ky)",
        "        for (long kx = 0; kx < KW; ++kx) {",
        "          const VT::V wv = VT::set1(wk[ky * KW + kx]);",
        "          const long col = ((kx * DX) % SX) * RP + (kx * DX) / SX + v0 * L;",
        "          GM_ATTN_UNROLL for (long r = 0; r < RB; ++r) {",
        "            const long row = (oy0 + r) * SY + ky * DY;",
        "            if (r >= nr || row < PY || row - PY >= H) continue;     // a padding row adds nothing",
        "            const float* __restrict src = xp + row * SX * RP + col;",
        "            GM_ATTN_UNROLL for (long v = 0; v < VB; ++v) {",
        "              if (v0 + v >= NV) break;",
        "              const VT::V xv = (WT && v0 + v == NV - 1) ? VT::template loadn<WT ? WT : 1>(src + v * L)",
        "                                                        : VT::load(src + v * L);",
        "              acc[r][v] = VT::fma(wv, xv, acc[r][v]);",
        "            }",
        "          }",
        "        }",
        "      const long x1 = (v0 + VB) * L < WO ? (v0 + VB) * L : WO;",
        "      for (long r = 0; r < nr; ++r) {",
        "        GM_ATTN_UNROLL for (long v = 0; v < VB; ++v) VT::store(out[r] + v * L, acc[r][v]);",
        "        const long oy = oy0 + r;",
        "        for (long ox = v0 * L; ox < x1; ++ox) {",
        "          const long idx = (q * HO + oy) * WO + ox;",
        "          const float a = out[r][ox - v0 * L];",
        *epilogue_store(p, "y[idx]", "a", "          "),
        "        }",
        "      }",
        "    }",
        "  }",
    ]


def generate_depthwise(p: ConvProblem, threads: int, tiled: bool = False) -> KernelSource:
    """`symbol(x, w, [bias,] e0.., ws, y)`: w from `prepare_weight`, ws unused; `tiled`: the
    register-tile body (`dwt`), else the accumulator row (`dw`)."""
    if not is_depthwise(p):
        raise BackendError(f"the depthwise kernel covers f32 convs whose groups equal the input channels, not {p.text}",
                           where=p.text, fix="the ATen tactic runs it")
    (sy, sx), (py, px), (dy, dx) = p.stride, p.padding, p.dilation
    ca = conv_args(p, "w")
    planes = p.n * p.cout
    par = threads != 1 and p.flops >= PAR_FLOPS
    bias = "bias[co]" if p.bias else "0.0f"
    lines = [
        "namespace {",
        *(vector_traits() if tiled else []),
        f"void @SYM@_plane(const float* __restrict x, const float* __restrict w, const float* __restrict bias, "
        f"float* __restrict y{ca.stage_params}, long q) {{",
        f"  constexpr long C = {p.cin}, H = {p.h}, W = {p.w}, CO = {p.cout}, HO = {p.ho}, WO = {p.wo};",
        f"  constexpr long KH = {p.kh}, KW = {p.kw}, SY = {sy}, SX = {sx}, PY = {py}, PX = {px}, DY = {dy}, "
        f"DX = {dx}, M = CO / C;",
        f"  constexpr long HP = {_rows(p)}, RW = {_cols(p)}, RP = (RW + SX - 1) / SX;",
        "  const long n = q / CO, co = q % CO;",
        "  const float* __restrict xs = x + (n * C + co / M) * H * W;",
        "  const float* __restrict wk = w + co * KH * KW;",
        f"  const float b0 = {bias};",
        "  (void)bias;",
        "  // the padded plane the taps read, its columns split by phase (column c at [c % SX][c / SX]):",
        "  // every tap then reads a contiguous run, whatever the stride; rows outside the image are",
        "  // never read (their taps add nothing), columns outside it are zeros",
        "  float xp[HP * SX * RP];",
        "  for (long r = PY; r < PY + H && r < HP; ++r) {",
        "    const float* __restrict xr = xs + (r - PY) * W;",
        "    float* __restrict xpr = xp + r * SX * RP;",
        *_row_copy(p),
        "  }",
        *(_tiles(p) if tiled else _rows_body(p)),
        "}",
        "}  // namespace",
    ]
    lines += entry_point(ca.nargs, [
        ("  " + omp_for(planes, p.flops)) if par else "",
        f"  for (long q = 0; q < {planes}; ++q)",
        f"    @SYM@_plane((const float*)p0, (const float*)p1, {ca.bias}, {ca.out}{ca.stage_args}, q);",
    ])
    types = {"x": TensorType("f32", (p.n, p.cin, p.h, p.w)), "w": TensorType("f32", (p.cout * p.kh * p.kw,)),
             "ws": TensorType("f32", (1,)), "y": TensorType("f32", (p.n, p.cout, p.ho, p.wo))}
    if p.bias:
        types["bias"] = TensorType("f32", (p.cout,))
    types.update(epilogue_types(p))
    head = template("attention.h") if tiled else ""
    return kernel_source("depthwise", head + "\n".join(lines) + "\n", inputs=ca.inputs, outputs=("y",), types=types,
                         kind="depthwise", parallel=par, pattern=f"{p.text} [{'dwt' if tiled else 'dw'}]")


__all__ = ["DepthwiseConfig", "DepthwiseTiledConfig", "generate_depthwise", "is_depthwise"]
