"""Generated int4 weight-only linear (`qlinear` over a packed u8 weight, ir/ops/int4.py).

Why: decode at small batch streams every weight once per token, so 4-bit codes (about a
fifth of the f32 bytes with an f32 scale per 32) make it that much less memory-bound. The
kernel reads the packed bytes once: the micro-kernels (templates/q4gemm.h) turn L bytes of
a weight row into two vectors of f32 weights in registers, exactly the reference's
(q - z) * s, and FMA them with MR rows of x. Activations stay f32 (no int8 dot products of
quantized activations), so the kernel equals dequantize-then-matmul to f32 rounding.

Threads split the output columns into contiguous ranges as wgemm.py does; from PANEL_ROWS
rows (prefill) a block of columns is dequantized once into an f32 panel for gemm.h's
micro-kernels. Tiles per ISA (registers: MR x NR accumulators + 2 NR dequantized weights +
2 x vectors + NR scales and zero points): AVX-512 4 x 4, AVX2 and portable 2 x 2.

With the qlinear attribute act q8 (recipe `precision.int4_activations: q8`; symmetric group-32
codes only, llama.cpp q4_0 x q8_0) x is quantized to int8 per block of 32 once per call and
the block sums are integer dot products (templates/q4q8.h: VNNI vpdpbusd where present, else
vpmaddubsw), about half the instructions a weight of the f32 path; every row count takes this
path (no f32 panels), so prefill and decode share its numerics (int4.q8_linear).
"""
from __future__ import annotations

import math

import torch

from graphmode.backends.cpu.abi import KernelSource, template
from graphmode.backends.cpu.isa import ISA_GUARD
from graphmode.backends.cpu.lowering import Claim, OpCall, claimed, refused
from graphmode.backends.cpu.native import finish
from graphmode.backends.cpu.weight_only import PANEL_ROWS, PAR_FLOPS, isa_lines, split_columns
from graphmode.ir.ops import int4

TILES = {"avx512": (4, 4), "avx2": (2, 2), "portable": (2, 2)}       # (MR, NR)
_TRAITS = {"avx512": "gm_q4_v512", "avx2": "gm_q4_v256", "portable": "gm_q4_vc"}
Q8_TILES = {"avx512": (4, 4), "avx2": (2, 2), "portable": (2, 2)}    # (MR, NR) of the act q8 path
_Q8_PATHS = [(ISA_GUARD["avx512"] + " && defined(__AVX512BW__)", "gm_q8_v512", Q8_TILES["avx512"]),
             (ISA_GUARD["avx2"], "gm_q8_v256", Q8_TILES["avx2"]), (None, "gm_q8_vc", Q8_TILES["portable"])]


def q4linear_source(call: OpCall, m: int, n: int, k: int, group: int, asym: bool) -> KernelSource:
    bias = len(call.ins) > 3
    par = 2.0 * m * n * k >= PAR_FLOPS
    panel = m >= PANEL_ROWS
    out = f"p{len(call.ins)}"
    pre = "\n".join(["namespace @SYM@_ns {", *isa_lines(n, TILES, _TRAITS),
                     f"constexpr long M = {m}, N = {n}, K = {k};",
                     f"constexpr int G = {group}; constexpr bool ASYM = {'true' if asym else 'false'};",
                     "constexpr long COLS = " + ("PK::NV * PK::L" if panel else "NR") + ", NB = (N + COLS - 1) / COLS;",
                     "}"])
    body = ["  using namespace @SYM@_ns;",
            "  const float* x = (const float*)p0; const uint8_t* w = (const uint8_t*)p1;",
            "  const float* sc = (const float*)p2;",
            f"  const float* b = {'(const float*)p3' if bias else '(const float*)0'}; float* y = (float*){out};"]
    if panel:
        run = ["    float* pbuf = (float*)malloc(K * COLS * sizeof(float));",
               "    gm_q4_panels<PK, TV, TLAST, G, ASYM>(x, w, sc, b, y, M, N, K, n0, n1 < N ? n1 : N, pbuf);",
               "    free(pbuf);"]
    else:
        run = ["    gm_q4_cols<VT, MR, NR, G, ASYM>(x, w, sc, b, y, M, N, K, n0, n1 < N ? n1 : N);"]
    body += split_columns(run, par)
    scheme = "asymmetric" if asym else "symmetric"
    return finish("qlinear", call, body, header=template("q4gemm.h"), pre=pre, parallel=par,
                  pattern=f"qlinear int4 {scheme} g{group} [{m}x{k}] x [{n}x{k}]^T{' + bias' if bias else ''}"
                          f"{' (panels)' if panel else ''}")


def q4q8_source(call: OpCall, m: int, n: int, k: int) -> KernelSource:
    """qlinear over symmetric group-32 codes with x quantized to q8 blocks (act q8)."""
    bias = len(call.ins) > 3
    par = 2.0 * m * n * k >= PAR_FLOPS
    out = f"p{len(call.ins)}"
    pre = ["namespace @SYM@_ns {"]
    for i, (guard, traits, (mr, nr)) in enumerate(_Q8_PATHS):
        pre += [f"#if {guard}" if i == 0 else f"#elif {guard}" if guard else "#else",
                f"typedef {traits} QT; constexpr int MR = {mr}, NR = {nr};"]
    pre += ["#endif", f"constexpr long M = {m}, N = {n}, K = {k};",
            "constexpr long COLS = NR, NB = (N + COLS - 1) / COLS;", "}"]
    body = ["  using namespace @SYM@_ns;",
            "  const float* x = (const float*)p0; const uint8_t* w = (const uint8_t*)p1;",
            "  const float* sc = (const float*)p2;",
            f"  const float* b = {'(const float*)p3' if bias else '(const float*)0'}; float* y = (float*){out};",
            "  gm_q8_act qa = gm_q8_quantize<QT::STEP, QT::SWZ>(x, M, K);"]
    body += split_columns(["    gm_q8_cols<QT, MR, NR, K>(qa, w, sc, b, y, M, N, n0, n1 < N ? n1 : N);"], par)
    body += ["  gm_q8_free(qa);"]
    return finish("qlinear", call, body, header=template("q4q8.h"), pre="\n".join(pre), parallel=par,
                  pattern=f"qlinear int4 symmetric g32 x q8 [{m}x{k}] x [{n}x{k}]^T{' + bias' if bias else ''}")


def qlinear_int4(call: OpCall) -> Claim:
    """The claim on a qlinear over packed int4 (wgemm.qlinear hands those over)."""
    x, w, scale = call.ins[:3]
    y = call.outs[0]
    if w.dtype != torch.uint8 or w.dim() != 2:
        return refused("the weight is not packed int4 (u8 [out, in / 2])", value=(str(w.dtype), tuple(w.shape)))
    n, k = int(w.shape[0]), 2 * int(w.shape[1])
    if x.dtype != torch.float32 or x.dim() < 1 or int(x.shape[-1]) != k:
        return refused("the input is not f32 [..., in]", value=(str(x.dtype), tuple(x.shape)))
    if scale.dtype != torch.float32 or scale.dim() not in (2, 3) or int(scale.shape[0]) != n \
            or (scale.dim() == 3 and int(scale.shape[2]) != 2) or int(scale.shape[1]) == 0 \
            or k % int(scale.shape[1]) or int4.group_of(w.shape, scale.shape) not in int4.GROUPS:
        return refused("the scale is not f32 [out, in / G] or [out, in / G, 2] with G in "
                       + "/".join(map(str, int4.GROUPS)), value=tuple(scale.shape))
    if len(call.ins) > 3 and (call.ins[3].dtype != torch.float32 or tuple(call.ins[3].shape) != (n,)):
        return refused("the bias is not f32 [out]", value=tuple(call.ins[3].shape))
    if y.dtype != torch.float32 or tuple(y.shape) != tuple(x.shape[:-1]) + (n,):
        return refused("the output is not f32 [..., out]", value=tuple(y.shape))
    m = math.prod(int(d) for d in x.shape[:-1])
    group = int4.group_of(w.shape, scale.shape)
    act = call.attrs.get("act", "f32")
    if act == "q8":
        if scale.dim() != 2 or group != int4.Q8_BLOCK:
            return refused("act q8 needs symmetric group-32 codes", value=tuple(scale.shape))
        return claimed(lambda: q4q8_source(call, m, n, k))
    if act != "f32":
        return refused("act is not f32 or q8", value=act)
    return claimed(lambda: q4linear_source(call, m, n, k, group, scale.dim() == 3))


__all__ = ["Q8_TILES", "TILES", "q4linear_source", "q4q8_source", "qlinear_int4"]
