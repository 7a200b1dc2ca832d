"""Generated Winograd convolution for 3x3 stride-1 conv2d (fp32, NCHW).

Why: a 3x3 convolution computed directly costs 9 multiply-adds per input channel and output
pixel. Winograd's minimal filtering F(m x m, 3 x 3) computes an m x m output tile from an
(m+2) x (m+2) input patch with (m+2)^2 multiplies per channel pair instead of 9 m^2: 2.25x
fewer for F(2x2), 4x fewer for F(4x4). ResNet-18's 3x3 stride-1 convolutions are ~80% of its
FLOPs and already run near the FMA peak directly, so only fewer FLOPs make them faster.

The algorithm as four phases of one kernel (Lavin & Gray, 2015), with T = N * ceil(Ho/m) *
ceil(Wo/m) tiles, alpha = m + 2, channels padded to multiples of 16 (CP, COP):

1. NCHW input -> zero-padded NHWC scratch (channels innermost, so that 16 channels are one
   vector and the patch of a tile needs no bounds checks: the pack writes the zero border);
2. input transform V[xi][t][c] = (B^T d B)[xi] per tile and channel vector;
3. alpha^2 independent GEMMs M[xi] = V[xi] @ U[xi] ([T, CP] @ [CP, COP]) on the generated
   micro-kernel of gemm.py, U being the transformed weight G g G^T, computed once at bind
   time in float64 and packed into the micro-kernel's panels like any constant weight;
4. output transform y = A^T M A (+ bias), written back to NCHW (partial edge tiles masked).

The transforms are straight-line code generated from the matrices below over GCC vector
types of 16 floats, which the compiler lowers to the host's widest ISA (AVX-512, 2x AVX2,
or scalar code), so one generator serves every host. Numerics: F(2x2) loses nothing
measurable; F(4x4)'s transforms amplify rounding by a small factor (rel L2 ~1e-6 vs direct
fp32 on random data) and tactic selection checks every candidate against ATen before it
may win. The workspace (padded input, V, M) holds nothing between calls: every conv of a
plan shares one.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction as Fr
from typing import Sequence

import torch

from graphmode.backends.cpu.abi import KernelSource, entry_point, kernel_source, template
from graphmode.backends.cpu.conv import (ConvArgs, ConvProblem, conv_args, epilogue_store, epilogue_types,
                                         nhwc_pack_lines)
from graphmode.backends.cpu.gemm import GemmConfig, GemmProblem, generate_gemm, packed_numel
from graphmode.backends.cpu.omp_loops import omp_for
from graphmode.errors import BackendError
from graphmode.ir.types import TensorType

VEC = 16          # channels per vector of the transforms (GCC vector type; split on narrower ISAs)
# The transforms mix a tile's values with + and -, and its weight transform has zeros: one inf
# in a patch makes inf - inf and inf * 0, NaN over the whole tile, where eager's direct sum
# gives inf at the inputs' 3x3 neighbours. The kernel flags a call where the sum of a tile's
# transformed input is not finite (an inf or NaN in it, or a finite overflow: either way eager's
# answer is the direct sum's) (in its own workspace, so plans running at once keep their own), and the
# step runs its ATen default for that call (backends/cpu/kernels.py).
FLAG_FLOATS = 16    # the workspace's last floats: the flag (an int) the kernel sets for such a call
TILES = (2, 4)    # supported output tile sizes m of F(m x m, 3 x 3)

# F(m, 3) matrices: B^T (alpha x alpha), G (alpha x 3), A^T (m x alpha); points 0, +-1, +-2, inf
_MATRICES: dict[int, tuple[list[list[Fr]], list[list[Fr]], list[list[Fr]]]] = {
    2: ([[Fr(1), Fr(0), Fr(-1), Fr(0)],
         [Fr(0), Fr(1), Fr(1), Fr(0)],
         [Fr(0), Fr(-1), Fr(1), Fr(0)],
         [Fr(0), Fr(1), Fr(0), Fr(-1)]],
        [[Fr(1), Fr(0), Fr(0)],
         [Fr(1, 2), Fr(1, 2), Fr(1, 2)],
         [Fr(1, 2), Fr(-1, 2), Fr(1, 2)],
         [Fr(0), Fr(0), Fr(1)]],
        [[Fr(1), Fr(1), Fr(1), Fr(0)],
         [Fr(0), Fr(1), Fr(-1), Fr(-1)]]),
    4: ([[Fr(4), Fr(0), Fr(-5), Fr(0), Fr(1), Fr(0)],
         [Fr(0), Fr(-4), Fr(-4), Fr(1), Fr(1), Fr(0)],
         [Fr(0), Fr(4), Fr(-4), Fr(-1), Fr(1), Fr(0)],
         [Fr(0), Fr(-2), Fr(-1), Fr(2), Fr(1), Fr(0)],
         [Fr(0), Fr(2), Fr(-1), Fr(-2), Fr(1), Fr(0)],
         [Fr(0), Fr(4), Fr(0), Fr(-5), Fr(0), Fr(1)]],
        [[Fr(1, 4), Fr(0), Fr(0)],
         [Fr(-1, 6), Fr(-1, 6), Fr(-1, 6)],
         [Fr(-1, 6), Fr(1, 6), Fr(-1, 6)],
         [Fr(1, 24), Fr(1, 12), Fr(1, 6)],
         [Fr(1, 24), Fr(-1, 12), Fr(1, 6)],
         [Fr(0), Fr(0), Fr(1)]],
        [[Fr(1), Fr(1), Fr(1), Fr(1), Fr(1), Fr(0)],
         [Fr(0), Fr(1), Fr(-1), Fr(2), Fr(-2), Fr(0)],
         [Fr(0), Fr(1), Fr(1), Fr(4), Fr(4), Fr(0)],
         [Fr(0), Fr(1), Fr(-1), Fr(8), Fr(-8), Fr(1)]]),
}


# ------------------------------------------------------------------------------ configuration

@dataclass(frozen=True)
class WinogradConfig:
    """A Winograd candidate: the output tile m and the blocking of its batched GEMM."""

    m: int
    gemm: GemmConfig
    chunk: int = 0     # > 0: tiles per block of the tile-blocked schedule (see generate_winograd)
    nt: int = 1        # the tile-blocked schedule's threads (one scratch block each)

    def __post_init__(self):
        if self.m not in TILES:
            raise BackendError(f"unsupported Winograd tile F({self.m}x{self.m}, 3x3)", value=self.m,
                               fix=f"one of {TILES}")
        if self.chunk and (self.chunk % self.gemm.mr or self.nt < 1 or self.gemm.par != "serial"):
            raise BackendError(f"bad tile-blocked Winograd: {self.chunk} tiles, {self.nt} threads, {self.gemm.name}",
                               value=self.chunk, fix="a chunk that is a multiple of mr, a serial GEMM blocking")

    @property
    def name(self) -> str:
        c = f"c{self.chunk}x{self.nt}" if self.chunk else ""
        return f"wino{self.m}{c}_{self.gemm.name}"

    def applies(self, p: ConvProblem) -> bool:
        return p.winograd_ok

    def prepare_weight(self, w: torch.Tensor) -> torch.Tensor:
        return transform_weight(w, self.m, self.gemm.nr)

    def weight_key(self) -> tuple:
        return ("wino", self.m, self.gemm.nr)

    def workspace_numel(self, p: ConvProblem) -> int:
        return workspace_numel(p, self)

    def generate(self, p: ConvProblem, threads: int) -> KernelSource:
        return generate_winograd(p, self, threads)

    @staticmethod
    def parse(name: str) -> "WinogradConfig":
        import re
        head, _, rest = name.partition("_")
        mt = re.fullmatch(r"wino(\d+)(?:c(\d+)x(\d+))?", head)
        if mt is None:
            raise BackendError(f"not a Winograd candidate name: {name!r}", value=name)
        return WinogradConfig(int(mt.group(1)), GemmConfig.parse(rest), int(mt.group(2) or 0), int(mt.group(3) or 1))


@dataclass(frozen=True)
class _Geometry:
    m: int
    alpha: int
    th: int
    tw: int
    t: int
    cp: int
    cop: int
    hp: int
    wp: int

    def sizes(self, n: int) -> tuple[int, int, int]:
        """Floats of the padded input, V and M."""
        a2 = self.alpha * self.alpha
        return n * self.hp * self.wp * self.cp, a2 * self.t * self.cp, a2 * self.t * self.cop


def geometry(p: ConvProblem, m: int) -> _Geometry:
    alpha = m + 2
    th, tw = math.ceil(p.ho / m), math.ceil(p.wo / m)
    cp, cop = math.ceil(p.cin / VEC) * VEC, math.ceil(p.cout / VEC) * VEC
    return _Geometry(m, alpha, th, tw, p.n * th * tw, cp, cop, th * m + 2, tw * m + 2)


def workspace_numel(p: ConvProblem, cfg: WinogradConfig) -> int:
    """Floats of the workspace: padded input, V and M, then the call's non-finite flag."""
    g = geometry(p, cfg.m)
    xp, v, mm = g.sizes(p.n)
    if cfg.chunk:          # per thread: V and M of one block of tiles
        a2 = g.alpha * g.alpha
        return xp + cfg.nt * a2 * cfg.chunk * (g.cp + g.cop) + FLAG_FLOATS
    return xp + v + mm + FLAG_FLOATS


def gemm_problem(p: ConvProblem, m: int, chunk: int = 0) -> GemmProblem:
    g = geometry(p, m)
    return GemmProblem("matmul", g.alpha * g.alpha, chunk or g.t, g.cop, g.cp, b_packed=True, b_batched=True)


def chunk_for(p: ConvProblem, m: int, mr: int, l2_bytes: int = 512 << 10) -> int:
    """Tiles per block so that one block's V and M (alpha^2 x tiles x (CP + COP) floats) stay
    in about half of a core's L2; a multiple of the micro-kernel's rows."""
    g = geometry(p, m)
    per_tile = g.alpha * g.alpha * (g.cp + g.cop) * 4
    return max(mr, (l2_bytes // per_tile) // mr * mr)


# ------------------------------------------------------------------------------ the weights

TRANSFORM_BLOCK = 1 << 20    # float64 bytes of one block of the weight transform (its transients are ~3x)


def transform_weight(w: torch.Tensor, m: int, nr: int) -> torch.Tensor:
    """U = G g G^T per (out, in) channel pair, computed in float64, laid out [alpha^2, CP, COP]
    (zero-padded channels) and packed per tile position for panels of `nr` columns: the
    packing of `pack_b` ([ceil(COP/nr), CP, nr] per position), written a block of whole panels
    of output channels at a time. (Transforming the whole weight at once in float64 took 7x
    the result's size: 260 MB at the peak for a 512x512 F(4x4) weight.)"""
    if w.dim() != 4 or tuple(w.shape[2:]) != (3, 3):
        raise BackendError("Winograd needs a 3x3 conv weight", value=tuple(w.shape))
    _, gm, _ = _MATRICES[m]
    alpha = m + 2
    cout, cin = w.shape[0], w.shape[1]
    cp, cop = math.ceil(cin / VEC) * VEC, math.ceil(cout / VEC) * VEC
    npan = math.ceil(cop / nr)
    g = torch.tensor([[float(v) for v in row] for row in gm], dtype=torch.float64)
    out = torch.zeros(alpha * alpha, npan, cp, nr, dtype=torch.float32)
    per = max(1, TRANSFORM_BLOCK // (cin * alpha * alpha * 8 * nr))     # panels per block
    for p0 in range(0, npan, per):
        p1 = min(npan, p0 + per)
        c0, c1 = p0 * nr, min(cout, p1 * nr)
        if c0 >= cout:
            break
        u = (g @ w[c0:c1].detach().to(torch.float64) @ g.t()).permute(2, 3, 1, 0)   # [alpha, alpha, cin, cc]
        cols = torch.zeros(alpha * alpha, cin, (p1 - p0) * nr, dtype=torch.float32)
        cols[:, :, :c1 - c0] = u.reshape(alpha * alpha, cin, c1 - c0)
        out[:, p0:p1, :cin, :] = cols.view(alpha * alpha, cin, p1 - p0, nr).permute(0, 2, 1, 3)
    return out.reshape(-1)


def transformed_numel(p: ConvProblem, m: int, nr: int) -> int:
    g = geometry(p, m)
    return g.alpha * g.alpha * packed_numel(g.cop, g.cp, nr)


# ------------------------------------------------------------------------------ generation



def _lin(coefs: Sequence[Fr], terms: Sequence[str]) -> str:
    """sum_i coefs[i] * terms[i] as C, skipping zeros and multiplies by +-1."""
    out: list[str] = []
    for c, t in zip(coefs, terms):
        if c == 0:
            continue
        mag = abs(c)
        mul = t if mag == 1 else f"{t} * {float(mag)!r}f"
        if not out:
            out.append(mul if c > 0 else f"-({mul})")
        else:
            out.append(f"{'+' if c > 0 else '-'} {mul}")
    return " ".join(out) if out else "gm_v16{}"


def _transform(mat: Sequence[Sequence[Fr]], src: str, dst: str, n_in: int) -> list[str]:
    """dst = mat @ src @ mat^T over a 2-D array of vectors `src[n_in][n_in]` (straight-line)."""
    rows = len(mat)
    lines = [f"gm_v16 {dst}_t[{rows}][{n_in}];", f"gm_v16 {dst}[{rows}][{rows}];"]
    for i in range(rows):
        for c in range(n_in):
            lines.append(f"{dst}_t[{i}][{c}] = {_lin(mat[i], [f'{src}[{r}][{c}]' for r in range(n_in)])};")
    for i in range(rows):
        for j in range(rows):
            lines.append(f"{dst}[{i}][{j}] = {_lin(mat[j], [f'{dst}_t[{i}][{c}]' for c in range(n_in)])};")
    return lines


def _blocked_body(cfg: WinogradConfig, g: _Geometry, ca: ConvArgs) -> list[str]:
    """The tile-blocked schedule: each thread claims blocks of `chunk` tiles and runs input
    transform, the alpha^2 GEMMs (serial) and output transform on its own V/M block, which
    stays in its L2, instead of three passes over whole-image V and M buffers. The last
    block's rows past T compute on stale V rows and are never stored."""
    a2 = g.alpha * g.alpha
    per = a2 * cfg.chunk * (g.cp + g.cop)
    return [
        f"  constexpr long NB = (@SYM@_T + {cfg.chunk} - 1) / {cfg.chunk};",
        f"  #pragma omp parallel num_threads({cfg.nt})",
        "  {",
        "    const long me = gm_thread_num();",
        f"    float* Vb = V + me * {per}L;",
        f"    float* Mb = Vb + {a2 * cfg.chunk * g.cp}L;",
        "    " + omp_for(-(-g.t // cfg.chunk), region=False),
        "    for (long b = 0; b < NB; ++b) {",
        f"      const long t0 = b * {cfg.chunk}, t1 = t0 + {cfg.chunk} < @SYM@_T ? t0 + {cfg.chunk} : @SYM@_T;",
        "      @SYM@_in(xp, Vb, t0, t1, bad);",
        "      @SYM@_g(Vb, p1, Mb);",
        f"      @SYM@_out(Mb, {ca.bias}, {ca.out}, t0, t1{ca.stage_args});",
        "    }",
        "  }",
    ]


def generate_winograd(p: ConvProblem, cfg: WinogradConfig, threads: int) -> KernelSource:
    """`symbol(x, u, [bias,] ws, y)`: u from `transform_weight(w, cfg.m, cfg.gemm.nr)`, ws a
    float workspace of at least `workspace_numel(p, cfg)` (any contents: every call writes it)."""
    if not p.winograd_ok:
        raise BackendError(f"Winograd F(mx3) covers 3x3 stride-1 undilated ungrouped f32 convs, not {p.text}",
                           where=p.text, fix="the ATen tactic runs it")
    g = geometry(p, cfg.m)
    bt, _, at = _MATRICES[cfg.m]
    chunked = cfg.chunk > 0
    gp = gemm_problem(p, cfg.m, cfg.chunk)
    gsrc = generate_gemm(gp, cfg.gemm, 1 if chunked else threads)
    gemm_text = gsrc.source.replace(gsrc.symbol, "@SYM@_g")
    xp_n, v_n, _ = g.sizes(p.n)
    a = g.alpha
    par = threads != 1
    # blocks are the parallel loop of the tile-blocked schedule
    stage_par = "" if chunked or not par else "  " + omp_for(g.t, g.t * a * a * (g.cp + g.cop))
    stride = cfg.chunk if chunked else g.t       # rows of one tile position's V / M
    ca = conv_args(p, "u")
    in_tr = _transform(bt, "d", "v", a)
    out_tr = _transform(at, "q", "o", a)
    lines = [
        "namespace {",
        f"constexpr long @SYM@_N = {p.n}, @SYM@_C = {p.cin}, @SYM@_H = {p.h}, @SYM@_W = {p.w}, "
        f"@SYM@_CO = {p.cout}, @SYM@_HO = {p.ho}, @SYM@_WO = {p.wo};",
        f"constexpr long @SYM@_PH = {p.padding[0]}, @SYM@_PW = {p.padding[1]}, @SYM@_TH = {g.th}, "
        f"@SYM@_TW = {g.tw}, @SYM@_T = {g.t}, @SYM@_S = {stride};",
        f"constexpr long @SYM@_CP = {g.cp}, @SYM@_COP = {g.cop}, @SYM@_HP = {g.hp}, @SYM@_WP = {g.wp};",
        *nhwc_pack_lines(p, g.cp, g.hp, g.wp, par),
        # 2. input transform of tiles [t0, t1) into V rows t - t0
        "void @SYM@_in(const float* __restrict xp, float* __restrict V, long t0, long t1, int* bad) {",
        stage_par,
        "  for (long t = t0; t < t1; ++t) {",
        "    const long n = t / (@SYM@_TH * @SYM@_TW), ty = (t / @SYM@_TW) % @SYM@_TH, tx = t % @SYM@_TW;",
        f"    const float* base = xp + ((n * @SYM@_HP + ty * {g.m}) * @SYM@_WP + tx * {g.m}) * @SYM@_CP;",
        "    gm_v16 chk{};     // the sum of the tile's transformed values: not finite if one is not",
        "    for (long cv = 0; cv < @SYM@_CP; cv += 16) {",
        f"      gm_v16 d[{a}][{a}];",
        f"      for (int r = 0; r < {a}; ++r)",
        f"        for (int c = 0; c < {a}; ++c) d[r][c] = gm_ld16(base + (r * @SYM@_WP + c) * @SYM@_CP + cv);",
        *("      " + ln for ln in in_tr),
        f"      for (int i = 0; i < {a}; ++i)",
        f"        for (int j = 0; j < {a}; ++j) {{",
        f"          gm_st16(V + ((i * {a} + j) * @SYM@_S + t - t0) * @SYM@_CP + cv, v[i][j]);",
        "          chk += v[i][j];",
        "        }",
        "    }",
        "    float cb[16];",
        "    gm_st16(cb, chk);",
        "    for (int l = 0; l < 16; ++l)",
        "      if (cb[l] - cb[l] != 0.0f) { __atomic_store_n(bad, 1, __ATOMIC_RELAXED); break; }",
        "  }",
        "}",
        # 4. output transform (+ bias, epilogue) of tiles [t0, t1) back to NCHW
        f"void @SYM@_out(const float* __restrict M, const float* __restrict bias, float* y, long t0, long t1"
        f"{ca.stage_params}) {{",
        stage_par,
        "  for (long t = t0; t < t1; ++t) {",
        "    const long n = t / (@SYM@_TH * @SYM@_TW), ty = (t / @SYM@_TW) % @SYM@_TH, tx = t % @SYM@_TW;",
        f"    const long vi = @SYM@_HO - ty * {g.m} < {g.m} ? @SYM@_HO - ty * {g.m} : {g.m};",
        f"    const long vj = @SYM@_WO - tx * {g.m} < {g.m} ? @SYM@_WO - tx * {g.m} : {g.m};",
        "    for (long cv = 0; cv < @SYM@_COP; cv += 16) {",
        f"      gm_v16 q[{a}][{a}];",
        f"      for (int r = 0; r < {a}; ++r)",
        f"        for (int c = 0; c < {a}; ++c) q[r][c] = gm_ld16(M + ((r * {a} + c) * @SYM@_S + t - t0) * @SYM@_COP + cv);",
        *("      " + ln for ln in out_tr),
        "      const long cn = @SYM@_CO - cv < 16 ? @SYM@_CO - cv : 16;",
        "      float bb[16];",
        "      for (int l = 0; l < 16; ++l) bb[l] = (bias && l < cn) ? bias[cv + l] : 0.0f;",
        "      const gm_v16 bv = gm_ld16(bb);",
        f"      float buf[{g.m * g.m}][16];",
        f"      for (int i = 0; i < {g.m}; ++i)",
        f"        for (int j = 0; j < {g.m}; ++j) gm_st16(buf[i * {g.m} + j], o[i][j] + bv);",
        "      for (long l = 0; l < cn; ++l) {",
        "        const long co = cv + l;",
        f"        const long y0 = ((n * @SYM@_CO + co) * @SYM@_HO + ty * {g.m}) * @SYM@_WO + tx * {g.m};",
        "        (void)co;",
        "        for (long i = 0; i < vi; ++i)",
        "          for (long j = 0; j < vj; ++j) {",
        "            const long idx = y0 + i * @SYM@_WO + j;",
        *epilogue_store(p, "y[idx]", f"buf[i * {g.m} + j][l]", "            "),
        "          }",
        "      }",
        "    }",
        "  }",
        "}",
        "}  // namespace",
    ]
    lines += entry_point(ca.nargs, [
        f"  float* xp = (float*){ca.ws};",
        f"  float* V = xp + {xp_n}L;",
        *([] if chunked else [f"  float* M = V + {v_n}L;"]),
        f"  int* bad = (int*)((float*){ca.ws} + {workspace_numel(p, cfg) - FLAG_FLOATS}L);",
        "  *bad = 0;",
        "  @SYM@_pack((const float*)p0, xp);",
        *(_blocked_body(cfg, g, ca) if chunked else [
            "  @SYM@_in(xp, V, 0, @SYM@_T, bad);",
            "  @SYM@_g(V, p1, M);",
            f"  @SYM@_out(M, {ca.bias}, {ca.out}, 0, @SYM@_T{ca.stage_args});"]),
    ])
    types = {"x": TensorType("f32", (p.n, p.cin, p.h, p.w)),
             "u": TensorType("f32", (transformed_numel(p, cfg.m, cfg.gemm.nr),)),
             "ws": TensorType("f32", (workspace_numel(p, cfg),)),
             "y": TensorType("f32", (p.n, p.cout, p.ho, p.wo))}
    if p.bias:
        types["bias"] = TensorType("f32", (p.cout,))
    types.update(epilogue_types(p))
    return kernel_source("wino", gemm_text + template("winograd.h") + "\n".join(lines) + "\n", inputs=ca.inputs,
                         outputs=("y",), types=types, kind="winograd", parallel=threads != 1,
                         pattern=f"{p.text} [{cfg.name}]", fallback_flag=("ws", workspace_numel(p, cfg) - FLAG_FLOATS))


__all__ = ["WinogradConfig", "generate_winograd", "transform_weight",
           "workspace_numel", "transformed_numel", "gemm_problem", "geometry", "TILES"]
