"""Generated group normalisation (NATIVE lowering): group_norm and native_group_norm on
contiguous fp32.

One task per (sample, group): two passes over its C/G x HxW values for the moments (sums in
double, so the mean and variance are exact to fp32; SIMD reductions, lanes summed at the end),
then ATen's own output form, per
channel `scale = rstd * gamma[c]`, `bias = beta[c] - scale * mean`, `y = x * scale + bias`.
ATen computes the moments in fp32 (Welford), so the two agree to fp32 rounding, not bit for
bit. Other dtypes and shapes are refused (the reference op runs them).
"""
from __future__ import annotations

import math

import torch

from graphmode.backends.cpu.abi import KernelSource
from graphmode.backends.cpu.attrs import int_attr
from graphmode.backends.cpu.cexpr import lit
from graphmode.backends.cpu.emit import PAR_THRESHOLD
from graphmode.backends.cpu.layout_kernels import aten_args, is_input
from graphmode.backends.cpu.lowering import NATIVE, Claim, OpCall, claimed, lowers, refused
from graphmode.backends.cpu.native import finish
from graphmode.backends.cpu.omp_loops import omp_for
from graphmode.backends.cpu.tensors import overlaps, shape_text


@lowers("group_norm", "native_group_norm", tier=NATIVE)
def group_norm(call: OpCall) -> Claim:
    a = aten_args(call)
    if a is None:
        return refused("the arguments do not bind to the op's schema", value=call.attrs.get("args"))
    x = call.ins[0]
    groups = int_attr(a.get("num_groups", a.get("group")))
    eps = a.get("eps")
    if not is_input(a.get("input"), 0) or groups is None or groups <= 0 or not isinstance(eps, (int, float)):
        return refused("input, the group count or eps is not what the kernel takes", value=call.attrs.get("args"))
    slots = {}
    for name in ("weight", "bias"):
        v = a.get(name)
        if v is not None and not (isinstance(v, dict) and isinstance(v.get("$in"), int) and 0 < v["$in"] < len(call.ins)):
            return refused(f"{name} is not an input tensor or None", value=v)
        slots[name] = None if v is None else v["$in"]
    if any(t.dtype != torch.float32 for t in list(call.ins) + list(call.outs)) or x.dim() < 2:
        return refused("group norm of other than fp32 tensors of rank >= 2", value=str(x.dtype))
    n, c = int(x.shape[0]), int(x.shape[1])
    hw = math.prod(int(d) for d in x.shape[2:])
    if c % groups or any(slots[k] is not None and tuple(call.ins[slots[k]].shape) != (c,) for k in slots):
        return refused("channels do not divide into the groups, or weight / bias is not one per channel",
                       value=(c, groups))
    if call.op == "native_group_norm" and [int_attr(a.get(k)) for k in ("N", "C", "HxW")] != [n, c, hw]:
        return refused("N, C, HxW are not the input's", value=[a.get(k) for k in ("N", "C", "HxW")])
    stats = call.op == "native_group_norm"
    if call.outs[0].shape != x.shape or (stats and any(tuple(t.shape) != (n, groups) for t in call.outs[1:])):
        return refused("the outputs are not the group norm's shapes", value=[tuple(t.shape) for t in call.outs])
    if overlaps(call.ins, call.outs) or n * c * hw == 0:
        return refused("an output shares memory with an input, or the input is empty")

    def make() -> KernelSource:
        cg, d = c // groups, (c // groups) * hw
        k = len(call.ins)
        lines = ["  const float* __restrict x = (const float*)p0;", f"  float* __restrict y = (float*)p{k};"]
        for name, slot in slots.items():
            lines.append(f"  const float* __restrict {name} = (const float*)p{slot};" if slot is not None else
                         f"  const float* {name} = 0; (void){name};")
        if stats:
            lines += [f"  float* __restrict mean_out = (float*)p{k + 1};", f"  float* __restrict rstd_out = (float*)p{k + 2};"]
        par = x.numel() * 4 >= PAR_THRESHOLD and n * groups > 1
        if par:
            lines.append("  " + omp_for(n * groups, 4 * x.numel()))
        scale = "rstd * weight[ch]" if slots["weight"] is not None else "rstd"
        shift = "bias[ch] - sc * mean" if slots["bias"] is not None else "-sc * mean"
        lines += [f"  for (long t = 0; t < {n * groups}L; ++t) {{",
                  f"    const float* __restrict xs = x + t * {d}L;",
                  f"    float* __restrict ys = y + t * {d}L;",
                  "    double s = 0.0, v = 0.0;",
                  # a reduction the compiler may split into lanes: in source order, one double add per
                  # value (its latency a step) ran at 0.5 GFLOP/s, 14-20x ATen's group norm
                  "    #pragma omp simd reduction(+:s)",
                  f"    for (long i = 0; i < {d}L; ++i) s += (double)xs[i];",
                  f"    const double m = s / {d}.0;",
                  "    #pragma omp simd reduction(+:v)",
                  f"    for (long i = 0; i < {d}L; ++i) {{ const double e = (double)xs[i] - m; v += e * e; }}",
                  "    const float mean = (float)m;",
                  f"    const float rstd = 1.0f / __builtin_sqrtf((float)(v / {d}.0) + {lit(float(eps), 'f32')});",
                  *(["    mean_out[t] = mean; rstd_out[t] = rstd;"] if stats else []),
                  f"    for (long j = 0; j < {cg}L; ++j) {{",
                  f"      const long ch = (t % {groups}L) * {cg}L + j; (void)ch;",
                  f"      const float sc = {scale};",
                  f"      const float sh = {shift};",
                  f"      for (long i = j * {hw}L; i < (j + 1) * {hw}L; ++i) ys[i] = xs[i] * sc + sh;",
                  "    }",
                  "  }"]
        return finish(call.op, call, lines, parallel=par,
                      pattern=f"{call.op} {shape_text(x)} groups={groups}")
    return claimed(make)


__all__ = ["group_norm"]
