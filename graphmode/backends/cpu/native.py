"""Single-op kernels: what the native lowerings (pool.py, movement.py, attention.py) share.

Some ops are a small share of the FLOPs but a large share of the time when ATen runs them:
`max_pool2d` on contiguous NCHW (ATen's NCHW path is ~20x slower than its channels-last one
here), `sdpa` at the sizes of a small encoder (its flash kernel reaches a quarter of the
roofline), data movement whose bytes take less time than ATen's dispatch. For those a
NATIVE lowering (lowering.py) claims the instruction and generates a kernel with every shape
baked in, over the instruction's own value names; the executor runs it in place of the ATen
step. A kernel addresses its arguments as dense row-major arrays: `precheck` refuses other
buffers for every native lowering alike.
"""
from __future__ import annotations

import math
from typing import Sequence

from graphmode.backends.cpu.abi import KernelSource, entry_point, kernel_source
from graphmode.backends.cpu.lowering import Claim, OpCall, refused
from graphmode.backends.cpu.omp_loops import omp_for
from graphmode.backends.cpu.tensors import dtype_of
from graphmode.ir.types import TensorType


def precheck(call: OpCall) -> Claim | None:
    """Why no native kernel can take `call`'s buffers (not contiguous CPU memory, or a dtype
    the IR has no name for), or None."""
    for t in list(call.ins) + list(call.outs):
        if not t.is_contiguous() or t.device.type != "cpu":
            return refused("a native kernel needs contiguous CPU buffers", value=tuple(t.stride()))
        if dtype_of(t) is None:
            return refused(f"no IR dtype for {t.dtype}", value=str(t.dtype))
    return None


def lin(names: Sequence[str], strides: Sequence[int], base: int = 0) -> str:
    """`sum names[i] * strides[i] + base` as C (long arithmetic)."""
    terms = [f"{n} * {s}L" if s != 1 else n for n, s in zip(names, strides) if s != 0]
    if base:
        terms.append(f"{base}L")
    return " + ".join(terms) if terms else "0L"


def loop_nest(nest: Sequence[tuple[str, int, int]], body: Sequence[str], *, par: bool, indent: str = "  ",
              work: float | None = None) -> list[str]:
    """Perfectly nested `for` loops `(var, bound, step)` around `body`; with `par` the nest is
    one OpenMP loop (collapsed), so every level's iterations are shared between threads
    (`work`: the nest's work units, omp_loops.chunk_for)."""
    out = []
    if par and nest:
        trips = math.prod(-(-n // s) for _v, n, s in nest)
        out.append(indent + omp_for(trips, work, collapse=len(nest)))
    for k, (v, n, s) in enumerate(nest):
        inc = f"++{v}" if s == 1 else f"{v} += {s}"
        out.append(f"{indent}{'  ' * k}for (long {v} = 0; {v} < {n}L; {inc})")
    pad = indent + "  " * len(nest)
    out.append(pad + "{")
    out += [pad + "  " + b for b in body]
    out.append(pad + "}")
    return out


def finish(op: str, call: OpCall, body: Sequence[str], *, header: str = "", pre: str = "", parallel: bool = False,
           pattern: str = "", status: str = "") -> KernelSource:
    """The kernel of one instruction: `header` (static C++ of a template), `pre` (its own
    helpers), the entry point around `body` over `p0..pN` (inputs then outputs). Named by a
    hash of the text, so identical instructions share one compiled kernel."""
    names = list(call.inputs) + list(call.outputs)
    types = {name: TensorType(dtype_of(t), tuple(int(d) for d in t.shape))
             for name, t in zip(names, list(call.ins) + list(call.outs))}
    lines = ([header] if header else []) + [pre, *entry_point(len(names), body), ""]
    return kernel_source(f"native_{op}", "\n".join(lines), inputs=tuple(call.inputs), outputs=tuple(call.outputs),
                         types=types, kind="native", parallel=parallel, pattern=pattern or op, status=status)


__all__ = ["precheck", "finish", "lin", "loop_nest"]
