"""ATen steps for ATen-reference ops with an `out=` variant (ATEN lowerings): topk, sort,
scatter, scatter_add, scatter_reduce, and conv_transpose1d / 3d through
`aten.convolution.out`.

The reference op calls the functional overload and copies its fresh result into the
planned slots; these call the op's out variant on those slots, so nothing is allocated or
copied (a generated kernel is not worth it here: the work is ATen's sort / scatter loops or
oneDNN's deconvolution). The variant is the functional schema plus its written-to
keyword arguments, found by schema; an instance whose planned outputs are not exactly
ATen's result (shape, dtype) is refused, as ATen would resize them.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from graphmode.backends.cpu.attrs import int_attr
from graphmode.backends.cpu.layout_kernels import aten_args, is_input
from graphmode.backends.cpu.lowering import ATEN, Claim, OpCall, claimed, lowers, refused
from graphmode.backends.cpu.tensors import overlaps
from graphmode.ir.ops.aten_meta import arguments, call as aten_call, overload

OUT_VARIANT_OPS = ("topk", "sort", "scatter", "scatter_add", "scatter_reduce")


def out_variant(op: str, name: str):
    """The overload of `op` that is overload `name` plus written-to keyword outputs, and the
    names of those outputs in order; None when ATen has none."""
    fn = overload(op, name)
    want = [(a.name, str(a.type)) for a in fn._schema.arguments]
    for other in getattr(torch.ops.aten, op).overloads():
        sch = overload(op, other)._schema
        args = sch.arguments
        outs = [a.name for a in args if a.alias_info is not None and a.alias_info.is_write and a.kwarg_only]
        if outs and [(a.name, str(a.type)) for a in args if a.name not in outs] == want:
            return overload(op, other), outs
    return None


def _matches_aten(call: OpCall) -> Claim | None:
    """Why the planned outputs are not exactly ATen's result for these arguments, or None."""
    if overlaps(call.ins, call.outs):
        return refused("an output shares memory with an input")
    try:
        metas = aten_call(call.op, [torch.empty(t.shape, dtype=t.dtype, device="meta") for t in call.ins], call.attrs)
    except Exception as e:  # noqa: BLE001 - ATen refuses the arguments: the reference op raises it
        return refused(f"ATen refuses the arguments: {type(e).__name__}", value=call.attrs.get("args"))
    if [(tuple(m.shape), m.dtype) for m in metas] != [(tuple(t.shape), t.dtype) for t in call.outs]:
        return refused("the planned outputs are not ATen's result", value=[tuple(t.shape) for t in call.outs])
    return None


@lowers(*OUT_VARIANT_OPS, tier=ATEN)
def out_step(call: OpCall) -> Claim:
    found = out_variant(call.op, call.attrs.get("overload", "default"))
    if found is None:
        return refused(f"ATen has no out variant of {call.op}.{call.attrs.get('overload', 'default')}")
    why = _matches_aten(call)
    if why is not None:
        return why
    fn, names = found
    if len(names) != len(call.outs):
        return refused("the out variant writes another number of outputs", value=names)
    args, kwargs = arguments(list(call.ins), call.attrs)
    kwargs.update(zip(names, call.outs))
    return claimed(lambda: lambda: fn(*args, **kwargs))


def _per_dim(v: Any, n: int) -> list[int] | None:
    """An int or a list of ints as `n` ints (one value repeats, as ATen expands it)."""
    v = [v] if not isinstance(v, (list, tuple)) else list(v)
    v = v * n if len(v) == 1 else v
    return [int(x) for x in v] if len(v) == n and all(int_attr(x) is not None for x in v) else None


@lowers("conv_transpose1d", "conv_transpose3d", tier=ATEN)
def conv_transpose(call: OpCall) -> Claim:
    a = aten_args(call)
    if a is None or not is_input(a.get("input"), 0) or not is_input(a.get("weight"), 1):
        return refused("the arguments do not bind to the op's schema", value=call.attrs.get("args"))
    n = 1 if call.op == "conv_transpose1d" else 3
    s, p, op, d = (_per_dim(a.get(k), n) for k in ("stride", "padding", "output_padding", "dilation"))
    groups = int_attr(a.get("groups"))
    bias = a.get("bias")
    if None in (s, p, op, d) or groups is None or not (bias is None or is_input(bias, 2)):
        return refused("stride, padding, output_padding, dilation or groups is not ints", value=call.attrs.get("args"))
    why = _matches_aten(call)
    if why is not None:
        return why
    x, w, y = call.ins[0], call.ins[1], call.outs[0]
    if x.dim() == w.dim() - 1:     # an unbatched input (F.conv_transpose*d takes one): a batch of 1, as views
        x, y = x.unsqueeze(0), y.unsqueeze(0)
    b = call.ins[2] if bias is not None else None
    conv = torch.ops.aten.convolution.out

    def make() -> Callable[[], None]:
        return lambda: conv(x, w, b, s, p, d, True, op, groups, out=y)
    return claimed(make)


__all__ = ["OUT_VARIANT_OPS", "out_variant", "out_step", "conv_transpose"]
