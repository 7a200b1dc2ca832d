"""Generated gathers for ATen-reference ops whose output is the input read at per-dim
source indices (NATIVE lowering): reflection / replication / circular padding, flip,
nearest resampling in 1-d and 3-d and nearest-exact in 1-3 d.

The source indices come from ATen itself: at claim time the op runs once per dim on a probe
whose values are their own coordinate along that dim, and what comes out is that dim's
index table. An op is taken only where every probe's output depends on its own output dim
alone and holds whole in-range indices (a gather separable by dim); the kernel then reads
`x[t0[i0], ..., tn[in]]`, ATen's result bit for bit. Anything else is refused (the
reference op runs it).
"""
from __future__ import annotations

import math

import torch

from graphmode.backends.cpu.abi import KernelSource
from graphmode.backends.cpu.lowering import NATIVE, Claim, OpCall, claimed, lowers, refused
from graphmode.backends.cpu.movement import COPY_PAR_ELEMS, ELEM_TYPES
from graphmode.backends.cpu.native import finish, lin, loop_nest
from graphmode.backends.cpu.tensors import overlaps, row_major_strides, shape_text
from graphmode.ir.ops.aten_meta import call as aten_call

INDEX_MAP_OPS = ("reflection_pad1d", "reflection_pad2d", "reflection_pad3d", "replication_pad1d",
                 "replication_pad2d", "replication_pad3d", "_pad_circular", "flip", "upsample_nearest1d",
                 "upsample_nearest3d", "_upsample_nearest_exact1d", "_upsample_nearest_exact2d",
                 "_upsample_nearest_exact3d")
PROBE_ELEMS = 1 << 24      # the claim runs the op on probes of the input's size: at most this many elements


def index_tables(call: OpCall) -> list[torch.Tensor] | Claim:
    """Per output dim, the input index ATen reads there (int64), or why the op is not a
    gather separable by dim on this instance."""
    x, y = call.ins[0], call.outs[0]
    r = x.dim()
    tables = []
    for k in range(r):
        view = [-1 if j == k else 1 for j in range(r)]
        probe = torch.arange(int(x.shape[k]), dtype=x.dtype).view(view).expand(x.shape).contiguous()
        try:
            out = aten_call(call.op, [probe], call.attrs)
        except Exception as e:  # noqa: BLE001 - ATen refuses the arguments: the reference op raises it
            return refused(f"ATen refuses the arguments: {type(e).__name__}", value=call.attrs.get("args"))
        if len(out) != 1 or tuple(out[0].shape) != tuple(y.shape):
            return refused("ATen's output is not the planned output's shape", value=tuple(y.shape))
        t = out[0][tuple(slice(None) if j == k else 0 for j in range(r))]
        if not torch.equal(out[0], t.view([-1 if j == k else 1 for j in range(r)]).expand(y.shape)) or \
                not torch.equal(t, t.round()) or bool((t < 0).any()) or bool((t >= int(x.shape[k])).any()):
            return refused(f"output dim {k} does not read one input index along dim {k}")
        tables.append(t.to(torch.int64))
    return tables


@lowers(*INDEX_MAP_OPS, tier=NATIVE)
def index_map(call: OpCall) -> Claim:
    x, y = call.ins[0], call.outs[0]
    if len(call.ins) != 1 or len(call.outs) != 1 or x.dtype not in (torch.float32, torch.float64) or \
            y.dtype != x.dtype or x.dim() == 0 or y.dim() != x.dim():
        return refused(f"{call.op} of {x.dtype} into {y.dtype} (f32 / f64, one input, same rank)", value=str(x.dtype))
    if overlaps(call.ins, call.outs) or x.numel() == 0 or y.numel() == 0 or x.numel() > PROBE_ELEMS:
        return refused("the output shares memory with the input, or a size the probe does not take",
                       value=tuple(x.shape))
    tables = index_tables(call)
    if isinstance(tables, Claim):
        return tables

    def make() -> KernelSource:
        r, et = x.dim(), ELEM_TYPES[x.element_size()]
        xs, ys = row_major_strides(x.shape), row_major_strides(y.shape)
        pre = "\n".join(f"static const long @SYM@_t{k}[{len(t)}] = {{{', '.join(f'{int(v) * xs[k]}L' for v in t)}}};"
                        for k, t in enumerate(tables))
        names = [f"i{k}" for k in range(r - 1)]
        base = " + ".join(f"@SYM@_t{k}[{v}]" for k, v in enumerate(names)) or "0L"
        last = int(y.shape[-1])
        lines = [f"  const {et}* __restrict src = (const {et}*)p0;", f"  {et}* __restrict dst = ({et}*)p1;"]
        body = [f"const {et}* s = src + {base};", f"{et}* d = dst + {lin(names, ys[:-1])};",
                f"for (long j = 0; j < {last}L; ++j) d[j] = s[@SYM@_t{r - 1}[j]];"]
        par = y.numel() >= COPY_PAR_ELEMS and math.prod(int(d) for d in y.shape[:-1]) > 1
        lines += loop_nest([(v, int(n), 1) for v, n in zip(names, y.shape[:-1])], body, par=par)
        return finish(call.op, call, lines, pre=pre, parallel=par, pattern=f"{call.op} {shape_text(x)} -> {shape_text(y)}")
    return claimed(make)


__all__ = ["INDEX_MAP_OPS", "PROBE_ELEMS", "index_tables", "index_map"]
