"""Generated 1x1 convolution on NCHW as it is: out[n, co, p] = bias[co] + sum_ci w[co, ci] x[n, ci, p].

Why: im2col runs a 1x1 conv as a GEMM over NHWC rows, so the input goes through an NCHW ->
NHWC copy and the result through the copy back: for MobileNet's pointwise convs, few
channels over many pixels (16 -> 24 over 4 x 64 x 64), the two copies cost more than the
multiply-adds, and the conv took 0.37 ms where ONNX Runtime runs the whole network in 0.35.
In NCHW a channel's pixels are contiguous already, so the conv is a sum of scaled rows.

Layout (per plan step, shapes baked in): one task per (image, block of PB pixels), parallel
over tasks. A task holds CR output channels x PB pixels of accumulators (registers: 4 x 32
floats), starting at the bias; for each input channel it reads the block's PB pixels once
(contiguous, from L1 after the first channel block) and adds each output channel's weight
times them. The rows go out through the epilogue. A pixel tail and a channel tail are the same
tile at their own sizes (templates: every trip count is a constant the compiler unrolls).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from graphmode.backends.cpu.abi import KernelSource, entry_point, kernel_source
from graphmode.backends.cpu.conv import (ConvProblem, WholeWeightConfig, conv_args, epilogue_store,
                                         epilogue_types)
from graphmode.backends.cpu.omp_loops import omp_for
from graphmode.errors import BackendError
from graphmode.ir.types import TensorType

CR = 4              # output channels per tile
PB = 32             # pixels per tile (and per task)
PAR_FLOPS = 1 << 18


def is_pointwise(p: ConvProblem) -> bool:
    """A conv this kernel covers: ungrouped f32 1x1, stride 1, no padding."""
    return (p.groups == 1 and p.dtype == "f32" and (p.kh, p.kw) == (1, 1) and p.stride == (1, 1)
            and p.padding == (0, 0) and p.ho > 0 and p.wo > 0)


@dataclass(frozen=True)
class PointwiseConfig(WholeWeightConfig):
    """The 1x1 candidate (one schedule: tiles of CR channels x PB pixels; weight [Cout, Cin])."""

    NAME: ClassVar[str] = "pw"
    WHAT: ClassVar[str] = "1x1 conv"

    def applies(self, p: ConvProblem) -> bool:
        return is_pointwise(p)

    def generate(self, p: ConvProblem, threads: int) -> KernelSource:
        return generate_pointwise(p, threads)


def generate_pointwise(p: ConvProblem, threads: int) -> KernelSource:
    """`symbol(x, w, [bias,] e0.., ws, y)`: w from `prepare_weight`, ws unused."""
    if not is_pointwise(p):
        raise BackendError(f"the 1x1 kernel covers ungrouped f32 1x1 convs of stride 1 without padding, not {p.text}",
                           where=p.text, fix="im2col or the ATen tactic runs it")
    ca = conv_args(p, "w")
    hw = p.h * p.w
    blocks = -(-hw // PB)
    tasks = p.n * blocks
    par = threads != 1 and p.flops >= PAR_FLOPS
    bias = "bias[co0 + r]" if p.bias else "0.0f"
    full, tail = p.cout // CR * CR, p.cout % CR
    names = "".join(f", e{i}" for i in range(len(p.epi.kinds) if p.epi is not None else 0))
    lines = [
        "namespace {",
        "template <long R, long P>",
        f"inline void @SYM@_tile(const float* __restrict x, const float* __restrict w, const float* __restrict bias, "
        f"float* __restrict y{ca.stage_params}, long n, long co0, long p0) {{",
        f"  constexpr long C = {p.cin}, CO = {p.cout}, HW = {hw};",
        "  float acc[R][P];",
        "  for (long r = 0; r < R; ++r) {",
        f"    const float b0 = {bias};",
        "    for (long j = 0; j < P; ++j) acc[r][j] = b0;",
        "  }",
        "  (void)bias;",
        "  const float* __restrict xs = x + n * C * HW + p0;",
        "  for (long ci = 0; ci < C; ++ci) {",
        "    const float* __restrict xr = xs + ci * HW;",
        "    for (long r = 0; r < R; ++r) {",
        "      const float wv = w[(co0 + r) * C + ci];",
        "      #pragma omp simd",
        "      for (long j = 0; j < P; ++j) acc[r][j] += wv * xr[j];",
        "    }",
        "  }",
        "  for (long r = 0; r < R; ++r) {",
        "    const long co = co0 + r;",
        "    for (long j = 0; j < P; ++j) {",
        "      const long idx = (n * CO + co) * HW + p0 + j;",
        *epilogue_store(p, "y[idx]", "acc[r][j]", "      "),
        "    }",
        "  }",
        "}",
        "template <long P>",
        f"inline void @SYM@_pixels(const float* __restrict x, const float* __restrict w, const float* __restrict bias, "
        f"float* __restrict y{ca.stage_params}, long n, long p0) {{",
        f"  for (long co0 = 0; co0 < {full}; co0 += {CR})",
        f"    @SYM@_tile<{CR}, P>(x, w, bias, y{names}, n, co0, p0);",
        *([f"  @SYM@_tile<{tail}, P>(x, w, bias, y{names}, n, {full}, p0);"] if tail else []),
        "}",
        "}  // namespace",
    ]
    body = [
        ("  " + omp_for(tasks, p.flops)) if par else "",
        f"  for (long q = 0; q < {tasks}; ++q) {{",
        f"    const long n = q / {blocks}, px0 = (q % {blocks}) * {PB};",
        f"    if (px0 + {PB} <= {hw}) @SYM@_pixels<{PB}>((const float*)p0, (const float*)p1, {ca.bias}, {ca.out}"
        f"{ca.stage_args}, n, px0);",
    ]
    if hw % PB:
        body.append(f"    else @SYM@_pixels<{hw % PB}>((const float*)p0, (const float*)p1, {ca.bias}, {ca.out}"
                    f"{ca.stage_args}, n, px0);")
    body.append("  }")
    lines += entry_point(ca.nargs, body)
    types = {"x": TensorType("f32", (p.n, p.cin, p.h, p.w)), "w": TensorType("f32", (p.cout * p.cin,)),
             "ws": TensorType("f32", (1,)), "y": TensorType("f32", (p.n, p.cout, p.ho, p.wo))}
    if p.bias:
        types["bias"] = TensorType("f32", (p.cout,))
    types.update(epilogue_types(p))
    return kernel_source("pointwise", "\n".join(lines) + "\n", inputs=ca.inputs, outputs=("y",), types=types,
                         kind="pointwise", parallel=par, pattern=f"{p.text} [pw]")


__all__ = ["PointwiseConfig", "generate_pointwise", "is_pointwise"]
