"""Generated weight-only quantized linear (`qlinear`: int8 or bf16 weights, f32 activations).

Why: at decode batch sizes a linear layer reads each weight once and does two FLOPs with it,
so its time is the weight bytes over the memory bandwidth. ATen has no CPU GEMM that reads
int8 or bf16 weights with f32 activations, and widening the weight to f32 first would read
the narrow copy, write a wide one and read it again. This kernel reads the stored bytes once:
the micro-kernels (templates/wgemm.h) widen NR weight rows a vector at a time inside the dot
products with MR rows of x. Threads split the output columns into contiguous ranges, so each
weight byte is read by one thread; rows go in chunks of 32 so a chunk of x stays in L2.

Tiles per ISA (registers: MR x NR accumulators + NR widened weights + one x vector):
AVX-512 4 x 4 (21 of 32), AVX2 and portable 2 x 4 (13 of 16). Every size is baked in; the
code path follows the compiler's ISA macros as in gemm.py and attention.py.
"""
from __future__ import annotations

import math

import torch

from graphmode.backends.cpu.abi import KernelSource, template
from graphmode.backends.cpu.lowering import NATIVE, Claim, OpCall, claimed, lowers, refused
from graphmode.backends.cpu.native import finish
from graphmode.backends.cpu.weight_only import PANEL_ROWS, PAR_FLOPS, isa_lines, split_columns

TILES = {"avx512": (4, 4), "avx2": (2, 4), "portable": (2, 4)}       # (MR, NR)
_TRAITS = {"avx512": "gm_wq_v512", "avx2": "gm_wq_v256", "portable": "gm_wq_vc"}
_WTYPE = {torch.int8: "int8_t", torch.bfloat16: "gm_bf16_t"}

def qlinear_source(call: OpCall, m: int, n: int, k: int) -> KernelSource:
    w = call.ins[1]
    bias = len(call.ins) > 3
    par = 2.0 * m * n * k >= PAR_FLOPS
    panel = m >= PANEL_ROWS
    wt = _WTYPE[w.dtype]
    out = f"p{len(call.ins)}"
    pre = "\n".join(["namespace @SYM@_ns {", *isa_lines(n, TILES, _TRAITS),
                     f"constexpr long M = {m}, N = {n}, K = {k};",
                     "constexpr long COLS = " + ("PK::NV * PK::L" if panel else "NR") + ", NB = (N + COLS - 1) / COLS;",
                     f"typedef {wt} W;", "}"])
    body = ["  using namespace @SYM@_ns;",
            "  const float* x = (const float*)p0; const W* w = (const W*)p1; const float* sc = (const float*)p2;",
            f"  const float* b = {'(const float*)p3' if bias else '(const float*)0'}; float* y = (float*){out};"]
    if panel:
        run = ["    float* pbuf = (float*)malloc(K * COLS * sizeof(float));",
               "    gm_wq_panels<PK, TV, TLAST, W>(x, w, sc, b, y, M, N, K, n0, n1 < N ? n1 : N, pbuf);",
               "    free(pbuf);"]
    else:
        run = ["    gm_wq_cols<VT, MR, NR, W>(x, w, sc, b, y, M, N, K, n0, n1 < N ? n1 : N);"]
    body += split_columns(run, par)
    kind = "int8" if w.dtype == torch.int8 else "bf16"
    return finish("qlinear", call, body, header=template("wgemm.h"), pre=pre, parallel=par,
                  pattern=f"qlinear {kind} [{m}x{k}] x [{n}x{k}]^T{' + bias' if bias else ''}"
                          f"{' (panels)' if panel else ''}")


@lowers("qlinear", tier=NATIVE)
def qlinear(call: OpCall) -> Claim:
    if len(call.ins) not in (3, 4) or len(call.outs) != 1:
        return refused("qlinear takes x, weight, scale[, bias]")
    x, w, scale = call.ins[:3]
    y = call.outs[0]
    if w.dtype == torch.uint8:                     # packed int4 codes: q4gemm.py's kernels
        from graphmode.backends.cpu.q4gemm import qlinear_int4
        return qlinear_int4(call)
    if w.dtype not in _WTYPE or w.dim() != 2:
        return refused("the weight is not a 2-d int8 or bf16 tensor", value=(str(w.dtype), tuple(w.shape)))
    n, k = (int(d) for d in w.shape)
    if x.dtype != torch.float32 or x.dim() < 1 or int(x.shape[-1]) != k:
        return refused("the input is not f32 [..., in]", value=(str(x.dtype), tuple(x.shape)))
    m = math.prod(int(d) for d in x.shape[:-1])
    extra = [scale] + list(call.ins[3:])
    if any(t.dtype != torch.float32 or tuple(t.shape) != (n,) for t in extra):
        return refused("scale and bias must be f32 [out]", value=[tuple(t.shape) for t in extra])
    if y.dtype != torch.float32 or tuple(y.shape) != tuple(x.shape[:-1]) + (n,):
        return refused("the output is not f32 [..., out]", value=tuple(y.shape))
    return claimed(lambda: qlinear_source(call, m, n, k))


__all__ = ["PANEL_ROWS", "PAR_FLOPS", "TILES", "qlinear", "qlinear_source"]
