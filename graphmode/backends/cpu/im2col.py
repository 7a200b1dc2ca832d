"""Generated im2col convolution: any ungrouped fp32 conv2d as one GEMM on the micro-kernel.

Why: ATen's direct convolutions reach 25-80% of the FMA peak on the convs Winograd does not
cover (ResNet's 7x7 stem, its stride-2 3x3 and 1x1 downsampling convs); as a GEMM over a
patch matrix they run on the same register-blocked micro-kernel as the transformer GEMMs,
with the weight packed once at bind time.

Layout (per plan step, shapes baked in):
1. NCHW input -> zero-padded NHWC scratch (conv.py's pack: channels innermost, writes the zero border);
2. patch matrix A [N*Ho*Wo, K], K = kh*kw*C ordered (ky, kx, c): each (ky, kx) is one run of
   C contiguous floats of the NHWC scratch (copied so: one run of kw*C floats per ky, where
   the window is undilated, was 8% slower on the 7x7 stem);
3. C' [N*Ho*Wo, Cout] = A @ W' (+ bias) with W'[(ky, kx, c), co] = w[co, c, ky, kx] packed as a
   linear weight (so bias is the accumulator's initial value, as for `linear`);
4. C' (NHWC) -> y (NCHW) through 16x16 stack tiles.
A 1x1 stride-1 unpadded conv skips the patch matrix (the NHWC scratch is A).
The batch runs in blocks of images (`images_per_block`) whose scratch fits COL_BLOCK_BYTES:
ResNet-18's 7x7 stem at batch 8 has a 59 MB patch matrix, and its workspace (90 MB) set the
size of the one every conv of the plan shares.

The row-blocked schedule (`chunk` > 0, as Winograd's tile-blocked one): steps 2-4 run per
block of `chunk` output pixels, each thread on its own patch rows and GEMM rows, which stay in
its L2, instead of three passes over a whole patch matrix and result that do not: the stem's
at batch 1 are 7.4 MB and 3.2 MB, written once and read back once each.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace

import torch

from graphmode.backends.cpu.abi import KernelSource, entry_point, kernel_source
from graphmode.backends.cpu.conv import ConvArgs, ConvProblem, epilogue_store, epilogue_types, conv_args, \
    nhwc_pack_lines
from graphmode.backends.cpu.gemm import GemmConfig, GemmProblem, generate_gemm, pack_b, packed_numel
from graphmode.backends.cpu.omp_loops import omp_for
from graphmode.errors import BackendError
from graphmode.ir.types import TensorType


@dataclass(frozen=True)
class Im2colConfig:
    """An im2col candidate: the blocking of its GEMM, and the row-blocked schedule's block of
    output pixels (`chunk`, a multiple of the GEMM's mr) and threads (one scratch block each)."""

    gemm: GemmConfig
    chunk: int = 0
    nt: int = 1

    def __post_init__(self):
        if self.chunk and (self.chunk % self.gemm.mr or self.nt < 1 or self.gemm.par != "serial"):
            raise BackendError(f"bad row-blocked im2col: {self.chunk} rows, {self.nt} threads, {self.gemm.name}",
                               value=self.chunk, fix="a chunk that is a multiple of mr, a serial GEMM blocking")

    @property
    def name(self) -> str:
        c = f"c{self.chunk}x{self.nt}" if self.chunk else ""
        return f"im2col{c}_{self.gemm.name}"

    @staticmethod
    def parse(name: str) -> "Im2colConfig":
        head, _, rest = name.partition("_")
        mt = re.fullmatch(r"im2col(?:c(\d+)x(\d+))?", head)
        if mt is None or not rest:
            raise BackendError(f"not an im2col candidate name: {name!r}", value=name)
        return Im2colConfig(GemmConfig.parse(rest), int(mt.group(1) or 0), int(mt.group(2) or 1))

    def applies(self, p: ConvProblem) -> bool:
        return p.groups == 1 and p.dtype == "f32" and p.ho > 0 and p.wo > 0 and not (self.chunk and _direct(p))

    def prepare_weight(self, w: torch.Tensor) -> torch.Tensor:
        """W' [Cout, K] in (ky, kx, c) order, packed like a linear weight."""
        cout = w.shape[0]
        return pack_b(w.permute(0, 2, 3, 1).reshape(cout, -1).contiguous(), self.gemm.nr, transposed=True)

    def weight_key(self) -> tuple:
        return ("im2col", self.gemm.nr)

    def workspace_numel(self, p: ConvProblem) -> int:
        if self.chunk:
            return _per_image(p)[0] * images_per_block(p, blocked=True) + self.nt * self.chunk * (_k(p) + p.cout)
        xp, col, cbuf = _sizes(p)
        return xp + col + cbuf

    def generate(self, p: ConvProblem, threads: int) -> KernelSource:
        return generate_im2col(p, self, threads)


def _direct(p: ConvProblem) -> bool:
    """1x1, stride 1, no padding: the NHWC input is already the patch matrix."""
    return (p.kh, p.kw) == (1, 1) and p.stride == (1, 1) and p.padding == (0, 0)


def _k(p: ConvProblem) -> int:
    return p.kh * p.kw * p.cin


COL_BLOCK_BYTES = 16 << 20     # scratch (padded input, patch matrix, GEMM result) of one block of images


def _per_image(p: ConvProblem) -> tuple[int, int, int]:
    hp, wp = p.h + 2 * p.padding[0], p.w + 2 * p.padding[1]
    rows = p.ho * p.wo
    return hp * wp * p.cin, (0 if _direct(p) else rows * _k(p)), rows * p.cout


def images_per_block(p: ConvProblem, blocked: bool = False) -> int:
    """The largest divisor of the batch whose block's scratch fits COL_BLOCK_BYTES (at least 1):
    one GEMM over the whole batch where it fits (small maps keep their long GEMM), image by
    image where one image's patch matrix is already large. `blocked`: the row-blocked
    schedule, whose per-image scratch is the padded input alone."""
    per = (_per_image(p)[0] if blocked else sum(_per_image(p))) * 4
    return next(nb for nb in range(p.n, 0, -1) if p.n % nb == 0 and (nb * per <= COL_BLOCK_BYTES or nb == 1))


def _sizes(p: ConvProblem) -> tuple[int, int, int]:
    nb = images_per_block(p)
    return tuple(nb * x for x in _per_image(p))


def gemm_problem(p: ConvProblem, chunk: int = 0) -> GemmProblem:
    rows = chunk or images_per_block(p) * p.ho * p.wo
    return GemmProblem("linear", 1, rows, p.cout, _k(p), bias=p.bias, b_packed=True)


def blocked_rows(p: ConvProblem) -> int:
    """Output pixels of one block of images of the row-blocked schedule."""
    return images_per_block(p, blocked=True) * p.ho * p.wo


def chunk_for(p: ConvProblem, mr: int, threads: int, l2_bytes: int = 512 << 10) -> int:
    """Output pixels per block of the row-blocked schedule: one block's patch rows and GEMM
    rows in about half of a core's L2, as many blocks as that needs rounded up to a multiple
    of `threads` (every thread the same share), a multiple of the micro-kernel's rows."""
    rows = blocked_rows(p)
    fit = max(mr, l2_bytes // ((_k(p) + p.cout) * 4))
    blocks = -(-rows // fit)
    blocks = -(-blocks // max(1, threads)) * max(1, threads)
    return -(-(-(-rows // blocks)) // mr) * mr


def prepared_numel(p: ConvProblem, nr: int) -> int:
    return packed_numel(p.cout, _k(p), nr)


def _cols_lines(p: ConvProblem, hp: int, wp: int) -> list[str]:
    """`@SYM@_cols(xp, col, r0, r1)`: patch rows [r0, r1) (output pixels of the image block,
    flattened) into col rows 0.."""
    (sy, sx), (dy, dx) = p.stride, p.dilation
    k = _k(p)
    return [
        "void @SYM@_cols(const float* __restrict xp, float* __restrict col, long r0, long r1) {",
        f"  constexpr long HO = {p.ho}, WO = {p.wo}, C = {p.cin}, HP = {hp}, WP = {wp}, K = {k};",
        "  for (long r = r0; r < r1; ++r) {",
        "    const long n = r / (HO * WO), oy = (r / WO) % HO, ox = r % WO;",
        "    float* dst = col + (r - r0) * K;",
        f"    for (long ky = 0; ky < {p.kh}; ++ky)",
        f"      for (long kx = 0; kx < {p.kw}; ++kx) {{",
        f"        const float* src = xp + ((n * HP + oy * {sy} + ky * {dy}) * WP + ox * {sx} + kx * {dx}) * C;",
        f"        float* d = dst + (ky * {p.kw} + kx) * C;",
        "        for (long c = 0; c < C; ++c) d[c] = src[c];",
        "      }",
        "  }",
        "}",
    ]


def _forward(p: ConvProblem) -> str:
    """The epilogue operands `, e0, ...` passed on from a stage that takes them to another."""
    return "".join(f", e{i}" for i in range(len(p.epi.kinds) if p.epi is not None else 0))


def _unpack_lines(p: ConvProblem, ca: ConvArgs) -> list[str]:
    """`@SYM@_unpack(cb, y, ..., n0, r0, r1)`: GEMM rows [r0, r1) of the image block starting at
    image n0 (cb's row 0 is r0), NHWC -> NCHW through 16x16 stack tiles, through the epilogue."""
    hw = p.ho * p.wo
    return [
        f"void @SYM@_unpack(const float* __restrict cb, float* y{ca.stage_params}, long n0, long r0, long r1) {{",
        f"  constexpr long HW = {hw}, CO = {p.cout};",
        "  for (long q0 = r0, qn = 0; q0 < r1; q0 += qn) {     // runs of <= 16 pixels of one image",
        "    const long n = n0 + q0 / HW, pix = q0 % HW;",
        "    qn = r1 - q0 < 16 ? r1 - q0 : 16;",
        "    qn = HW - pix < qn ? HW - pix : qn;",
        "    for (long c0 = 0; c0 < CO; c0 += 16) {",
        "      const long cn = CO - c0 < 16 ? CO - c0 : 16;",
        "      float tile[16][16];",
        "      for (long i = 0; i < qn; ++i)",
        "        for (long c = 0; c < cn; ++c) tile[c][i] = cb[(q0 - r0 + i) * CO + c0 + c];",
        "      for (long c = 0; c < cn; ++c)",
        "        for (long i = 0; i < qn; ++i) {",
        "          const long co = c0 + c, idx = (n * CO + co) * HW + pix + i;",
        "          (void)co;",
        *epilogue_store(p, "y[idx]", "tile[c][i]", "          "),
        "        }",
        "    }",
        "  }",
        "}",
    ]


def _whole_lines(p: ConvProblem, ca: ConvArgs, nb: int, par: bool) -> list[str]:
    """The whole-block schedule's stages over a block of `nb` images: `@SYM@_cols_all(xp, col)`
    (parallel over output rows; none where the NHWC scratch is the patch matrix) and
    `@SYM@_unpack_all(cb, y, ..., n0)` (parallel over runs of 16 pixels of one image)."""
    hw, k = p.ho * p.wo, _k(p)
    groups = -(-hw // 16)
    cols = [] if _direct(p) else [
        "void @SYM@_cols_all(const float* __restrict xp, float* __restrict col) {",
        ("  " + omp_for(nb * p.ho, nb * hw * k)) if par else "",
        f"  for (long q = 0; q < {nb * p.ho}; ++q) @SYM@_cols(xp, col + q * {p.wo * k}L, q * {p.wo}, (q + 1) * {p.wo});",
        "}",
    ]
    return cols + [
        f"void @SYM@_unpack_all(const float* __restrict cb, float* y{ca.stage_params}, long n0) {{",
        ("  " + omp_for(nb * groups, nb * hw * p.cout)) if par else "",
        f"  for (long q = 0; q < {nb * groups}; ++q) {{",
        f"    const long end = (q / {groups} + 1) * {hw}, r0 = q / {groups} * {hw} + q % {groups} * 16;",
        "    const long r1 = r0 + 16 < end ? r0 + 16 : end;",
        f"    @SYM@_unpack(cb + r0 * {p.cout}L, y{_forward(p)}, n0, r0, r1);",
        "  }",
        "}",
    ]


def _blocked_step(p: ConvProblem, cfg: Im2colConfig, ca: ConvArgs, nb: int, bias: str) -> list[str]:
    """The row-blocked schedule over the block of `nb` images packed at `xp`: each thread
    claims blocks of `chunk` output pixels and runs cols, the GEMM (serial) and unpack on its
    own scratch rows at `scr`. The last block's rows past the end multiply stale patch rows
    and are never stored."""
    k, rows = _k(p), blocked_rows(p)
    blocks = -(-rows // cfg.chunk)
    return [
        f"    #pragma omp parallel num_threads({cfg.nt})",
        "    {",
        "      const long me = gm_thread_num();",
        f"      float* colb = scr + me * {cfg.chunk * (k + p.cout)}L;",
        f"      float* cbb = colb + {cfg.chunk * k}L;",
        "      " + omp_for(blocks, region=False),
        f"      for (long blk = 0; blk < {blocks}; ++blk) {{",
        f"        const long r0 = blk * {cfg.chunk}, r1 = r0 + {cfg.chunk} < {rows} ? r0 + {cfg.chunk} : {rows};",
        "        @SYM@_cols(xp, colb, r0, r1);",
        f"        @SYM@_g(colb, p1, {bias}cbb);",
        f"        @SYM@_unpack(cbb, {ca.out}{ca.stage_args}, b * {nb}L, r0, r1);",
        "      }",
        "    }",
    ]


def generate_im2col(p: ConvProblem, cfg: Im2colConfig, threads: int) -> KernelSource:
    """`symbol(x, w', [bias,] ws, y)`: w' from `cfg.prepare_weight(w)`, ws a float
    workspace of at least `cfg.workspace_numel(p)` (any contents: every call writes it)."""
    if not cfg.applies(p):
        raise BackendError(f"im2col covers ungrouped f32 convs (row-blocked: with a patch matrix), not {p.text}",
                           where=p.text, fix="the ATen tactic runs it")
    chunked = cfg.chunk > 0
    gsrc = generate_gemm(gemm_problem(p, cfg.chunk), cfg.gemm, 1 if chunked else threads)
    gemm_text = gsrc.source.replace(gsrc.symbol, "@SYM@_g")
    hp, wp = p.h + 2 * p.padding[0], p.w + 2 * p.padding[1]
    nb = images_per_block(p, blocked=chunked)
    xp_n = nb * _per_image(p)[0]
    par = threads != 1
    ca = conv_args(p, "w")
    lines = ["namespace {", *nhwc_pack_lines(replace(p, n=nb), p.cin, hp, wp, par),
             *([] if _direct(p) else _cols_lines(p, hp, wp)), *_unpack_lines(p, ca),
             *([] if chunked else _whole_lines(p, ca, nb, par)), "}  // namespace"]
    bias = "p2, " if p.bias else ""
    if chunked:
        head = [f"  float* xp = (float*){ca.ws};", f"  float* scr = xp + {xp_n}L;"]
        step = _blocked_step(p, cfg, ca, nb, bias)
    else:
        _, col_n, _ = _sizes(p)
        head = [f"  float* xp = (float*){ca.ws};", f"  float* col = xp + {xp_n}L;", f"  float* cb = col + {col_n}L;"]
        step = [*([] if _direct(p) else ["    @SYM@_cols_all(xp, col);"]),
                f"    @SYM@_g({'xp' if _direct(p) else 'col'}, p1, {bias}cb);",
                f"    @SYM@_unpack_all(cb, {ca.out}{ca.stage_args}, b * {nb}L);"]
    lines += entry_point(ca.nargs, [
        *head,
        f"  for (long b = 0; b < {p.n // nb}; ++b) {{",
        f"    @SYM@_pack((const float*)p0 + b * {nb * p.cin * p.h * p.w}L, xp);",
        *step,
        "  }",
    ])
    types = {"x": TensorType("f32", (p.n, p.cin, p.h, p.w)), "w": TensorType("f32", (prepared_numel(p, cfg.gemm.nr),)),
             "ws": TensorType("f32", (cfg.workspace_numel(p),)), "y": TensorType("f32", (p.n, p.cout, p.ho, p.wo))}
    if p.bias:
        types["bias"] = TensorType("f32", (p.cout,))
    types.update(epilogue_types(p))
    return kernel_source("im2col", gemm_text + "\n".join(lines) + "\n", inputs=ca.inputs, outputs=("y",), types=types,
                         kind="im2col", parallel=threads != 1, pattern=f"{p.text} [{cfg.name}]")


__all__ = ["COL_BLOCK_BYTES", "Im2colConfig", "generate_im2col", "gemm_problem", "images_per_block", "prepared_numel",
           "chunk_for", "blocked_rows"]
