"""Generated im2col convolution: any ungrouped fp32 conv2d as one GEMM on the micro-kernel.

Why: ATen's direct convolutions reach 25-80% of the FMA peak on the convs Winograd does not
cover (ResNet's 7x7 stem, its stride-2 3x3 and 1x1 downsampling convs); as a GEMM over a
patch matrix they run on the same register-blocked micro-kernel as the transformer GEMMs,
with the weight packed once at bind time.

Layout (per plan step, shapes baked in):
1. NCHW input -> zero-padded NHWC scratch (conv.py's pack: channels innermost, writes the zero border);
2. patch matrix A [N*Ho*Wo, K], K = kh*kw*C ordered (ky, kx, c): each (ky, kx) is one run of
   C contiguous floats of the NHWC scratch;
3. C' [N*Ho*Wo, Cout] = A @ W' (+ bias) with W'[(ky, kx, c), co] = w[co, c, ky, kx] packed as a
   linear weight (so bias is the accumulator's initial value, as for `linear`);
4. C' (NHWC) -> y (NCHW) through 16x16 stack tiles.
A 1x1 stride-1 unpadded conv skips the patch matrix (the NHWC scratch is A).
The batch runs in blocks of images (`images_per_block`) whose scratch fits COL_BLOCK_BYTES:
ResNet-18's 7x7 stem at batch 8 has a 59 MB patch matrix, and its workspace (90 MB) set the
size of the one every conv of the plan shares.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from graphmode.backends.cpu.abi import KernelSource, entry_point, kernel_source
from graphmode.backends.cpu.conv import ConvProblem, epilogue_store, epilogue_types, conv_args, nhwc_pack_lines
from graphmode.backends.cpu.gemm import GemmConfig, GemmProblem, generate_gemm, pack_b, packed_numel
from graphmode.backends.cpu.omp_loops import omp_for
from graphmode.errors import BackendError
from graphmode.ir.types import TensorType


@dataclass(frozen=True)
class Im2colConfig:
    """An im2col candidate: the blocking of its GEMM."""

    gemm: GemmConfig

    @property
    def name(self) -> str:
        return f"im2col_{self.gemm.name}"

    @staticmethod
    def parse(name: str) -> "Im2colConfig":
        if not name.startswith("im2col_"):
            raise BackendError(f"not an im2col candidate name: {name!r}", value=name)
        return Im2colConfig(GemmConfig.parse(name[len("im2col_"):]))

    def applies(self, p: ConvProblem) -> bool:
        return p.groups == 1 and p.dtype == "f32" and p.ho > 0 and p.wo > 0

    def prepare_weight(self, w: torch.Tensor) -> torch.Tensor:
        """W' [Cout, K] in (ky, kx, c) order, packed like a linear weight."""
        cout = w.shape[0]
        return pack_b(w.permute(0, 2, 3, 1).reshape(cout, -1).contiguous(), self.gemm.nr, transposed=True)

    def weight_key(self) -> tuple:
        return ("im2col", self.gemm.nr)

    def workspace_numel(self, p: ConvProblem) -> int:
        xp, col, cbuf = _sizes(p)
        return xp + col + cbuf

    def generate(self, p: ConvProblem, threads: int) -> KernelSource:
        return generate_im2col(p, self, threads)


def _direct(p: ConvProblem) -> bool:
    """1x1, stride 1, no padding: the NHWC input is already the patch matrix."""
    return (p.kh, p.kw) == (1, 1) and p.stride == (1, 1) and p.padding == (0, 0)


COL_BLOCK_BYTES = 16 << 20     # scratch (padded input, patch matrix, GEMM result) of one block of images


def _per_image(p: ConvProblem) -> tuple[int, int, int]:
    hp, wp = p.h + 2 * p.padding[0], p.w + 2 * p.padding[1]
    rows, k = p.ho * p.wo, p.kh * p.kw * p.cin
    return hp * wp * p.cin, (0 if _direct(p) else rows * k), rows * p.cout


def images_per_block(p: ConvProblem) -> int:
    """The largest divisor of the batch whose block's scratch fits COL_BLOCK_BYTES (at least 1):
    one GEMM over the whole batch where it fits (small maps keep their long GEMM), image by
    image where one image's patch matrix is already large."""
    per = sum(_per_image(p)) * 4
    return next(nb for nb in range(p.n, 0, -1) if p.n % nb == 0 and (nb * per <= COL_BLOCK_BYTES or nb == 1))


def _sizes(p: ConvProblem) -> tuple[int, int, int]:
    nb = images_per_block(p)
    return tuple(nb * x for x in _per_image(p))


def gemm_problem(p: ConvProblem) -> GemmProblem:
    return GemmProblem("linear", 1, images_per_block(p) * p.ho * p.wo, p.cout, p.kh * p.kw * p.cin, bias=p.bias,
                       b_packed=True)


def prepared_numel(p: ConvProblem, nr: int) -> int:
    return packed_numel(p.cout, p.kh * p.kw * p.cin, nr)


def generate_im2col(p: ConvProblem, cfg: Im2colConfig, threads: int) -> KernelSource:
    """`symbol(x, w', [bias,] ws, y)`: w' from `cfg.prepare_weight(w)`, ws a float
    workspace of at least `cfg.workspace_numel(p)` (any contents: every call writes it)."""
    if not cfg.applies(p):
        raise BackendError(f"im2col covers ungrouped f32 convs, not {p.text}", where=p.text,
                           fix="the ATen tactic runs it")
    gp = gemm_problem(p)
    gsrc = generate_gemm(gp, cfg.gemm, threads)
    gemm_text = gsrc.source.replace(gsrc.symbol, "@SYM@_g")
    hp, wp = p.h + 2 * p.padding[0], p.w + 2 * p.padding[1]
    xp_n, col_n, _ = _sizes(p)
    nb = images_per_block(p)
    k = p.kh * p.kw * p.cin
    hw = p.ho * p.wo
    par = threads != 1
    (sy, sx), (dy, dx) = p.stride, p.dilation
    ca = conv_args(p, "w")
    lines = ["namespace {", *nhwc_pack_lines(replace(p, n=nb), p.cin, hp, wp, par)]
    if not _direct(p):
        lines += [
            "void @SYM@_cols(const float* __restrict xp, float* __restrict col) {",
            f"  constexpr long HO = {p.ho}, WO = {p.wo}, C = {p.cin}, HP = {hp}, WP = {wp}, K = {k};",
            "  " + omp_for(nb * p.ho, nb * p.ho * p.wo * k) if par else "",
            f"  for (long r = 0; r < {nb} * HO; ++r) {{",
            "    const long n = r / HO, oy = r % HO;",
            "    for (long ox = 0; ox < WO; ++ox) {",
            "      float* dst = col + (r * WO + ox) * K;",
            f"      for (long ky = 0; ky < {p.kh}; ++ky)",
            f"        for (long kx = 0; kx < {p.kw}; ++kx) {{",
            f"          const float* src = xp + ((n * HP + oy * {sy} + ky * {dy}) * WP + ox * {sx} + kx * {dx}) * C;",
            f"          float* d = dst + (ky * {p.kw} + kx) * C;",
            "          for (long c = 0; c < C; ++c) d[c] = src[c];",
            "        }",
            "    }",
            "  }",
            "}",
        ]
    lines += [
        # NHWC GEMM result -> NCHW output
        f"void @SYM@_unpack(const float* __restrict cb, float* y{ca.stage_params}, long n0) {{",
        f"  constexpr long HW = {hw}, CO = {p.cout};",
        "  " + omp_for(nb * -(-hw // 16), nb * hw * p.cout) if par else "",
        f"  for (long r = 0; r < {nb} * ((HW + 15) / 16); ++r) {{",
        "    const long nl = r / ((HW + 15) / 16), n = n0 + nl, p0 = (r % ((HW + 15) / 16)) * 16;",
        "    const long pn = HW - p0 < 16 ? HW - p0 : 16;",
        "    for (long c0 = 0; c0 < CO; c0 += 16) {",
        "      const long cn = CO - c0 < 16 ? CO - c0 : 16;",
        "      float tile[16][16];",
        "      for (long i = 0; i < pn; ++i)",
        "        for (long c = 0; c < cn; ++c) tile[c][i] = cb[(nl * HW + p0 + i) * CO + c0 + c];",
        "      for (long c = 0; c < cn; ++c)",
        "        for (long i = 0; i < pn; ++i) {",
        "          const long co = c0 + c, idx = (n * CO + co) * HW + p0 + i;",
        "          (void)co;",
        *epilogue_store(p, "y[idx]", "tile[c][i]", "          "),
        "        }",
        "    }",
        "  }",
        "}",
        "}  // namespace",
    ]
    a_ptr = "xp" if _direct(p) else "col"
    lines += entry_point(ca.nargs, [
        f"  float* xp = (float*){ca.ws};",
        f"  float* col = xp + {xp_n}L;",
        f"  float* cb = col + {col_n}L;",
        f"  for (long b = 0; b < {p.n // nb}; ++b) {{",
        f"    @SYM@_pack((const float*)p0 + b * {nb * p.cin * p.h * p.w}L, xp);",
        *([] if _direct(p) else ["    @SYM@_cols(xp, col);"]),
        f"    @SYM@_g({a_ptr}, p1, {'p2, ' if p.bias else ''}cb);",
        f"    @SYM@_unpack(cb, {ca.out}{ca.stage_args}, b * {nb}L);",
        "  }",
    ])
    types = {"x": TensorType("f32", (p.n, p.cin, p.h, p.w)), "w": TensorType("f32", (prepared_numel(p, cfg.gemm.nr),)),
             "ws": TensorType("f32", (cfg.workspace_numel(p),)), "y": TensorType("f32", (p.n, p.cout, p.ho, p.wo))}
    if p.bias:
        types["bias"] = TensorType("f32", (p.cout,))
    types.update(epilogue_types(p))
    return kernel_source("im2col", gemm_text + "\n".join(lines) + "\n", inputs=ca.inputs, outputs=("y",), types=types,
                         kind="im2col", parallel=threads != 1, pattern=f"{p.text} [{cfg.name}]")


__all__ = ["COL_BLOCK_BYTES", "Im2colConfig", "generate_im2col", "gemm_problem", "images_per_block", "prepared_numel"]
