"""ATen lowerings: plain ops as ATen closures writing straight into their output slot.

Each closure is bound once to the plan's fixed buffers, so a run calls it with no argument
handling: `out=` variants where ATen has them (no allocation, no copy), oneDNN/MKL for GEMM
and conv. linear / matmul / conv2d go through tactic selection when the call carries a
tactics context (`OpCall.tactics`, passed by whoever binds the step): the step then runs
ATen until tuning switches it to a generated kernel. The closures themselves
(`gemm_closure`, `conv_closure`) are also the `aten` candidate tactics/ times.
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

import torch

from graphmode.backends.cpu.attrs import pair
from graphmode.backends.cpu.lowering import ATEN, Claim, OpCall, claimed, lowers, refused

_BINARY_OUT = {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div,
               "maximum": torch.maximum, "minimum": torch.minimum, "pow": torch.pow}
_UNARY_OUT = {"exp": torch.exp, "tanh": torch.tanh, "sqrt": torch.sqrt, "rsqrt": torch.rsqrt, "neg": torch.neg,
              "sigmoid": torch.sigmoid, "erf": torch.erf, "log": torch.log, "abs": torch.abs}


def gemm_closure(op: str, ins: Sequence[torch.Tensor], y: torch.Tensor) -> Callable[[], None]:
    """The ATen GEMM for `linear` / `matmul` into `y` (what runs without tactics, and the
    `aten` tactic)."""
    if op == "linear":
        x, w = ins[0], ins[1]
        k, n = w.shape[1], w.shape[0]
        rows = math.prod(x.shape[:-1])      # not view(-1, k): an empty k or n leaves -1 ambiguous
        x2, y2, wt = x.view(rows, k), y.view(rows, n), w.t()
        if len(ins) > 2:
            b = ins[2]
            return lambda: torch.addmm(b, x2, wt, out=y2)
        return lambda: torch.mm(x2, wt, out=y2)
    x, w = ins
    if x.dim() == 3 and w.dim() == 3 and x.shape[0] == w.shape[0]:
        return lambda: torch.bmm(x, w, out=y)
    want = torch.matmul(x.to("meta"), w.to("meta")).shape
    if want != y.shape and y.is_contiguous() and math.prod(want) == y.numel():
        y = y.view(want)        # a slot whose unit axes differ from matmul's result: torch would resize `out`
    return lambda: torch.matmul(x, w, out=y)


def conv_closure(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor, stride, padding,
                 dilation, groups: int) -> Callable[[], None]:
    """The ATen convolution into `y` (what runs without tactics, and the `aten` tactic)."""
    conv = torch.ops.aten.convolution.out
    s, p, d = list(stride), list(padding), list(dilation)
    return lambda: conv(x, w, bias, s, p, d, False, [0, 0], groups, out=y)


@lowers("linear", "matmul", tier=ATEN)
def gemm(call: OpCall) -> Claim:
    def make() -> Callable[[], None]:
        default = gemm_closure(call.op, call.ins, call.outs[0])
        if call.tactics is None:
            return default
        return call.tactics.request(call.op, call.ins, call.outs, default, call.epilogue)
    return claimed(make)


@lowers("conv2d", tier=ATEN)
def conv2d(call: OpCall) -> Claim:
    a = call.attrs
    s, p, d = pair(a.get("stride", 1)), pair(a.get("padding", 0)), pair(a.get("dilation", 1))
    if s is None or p is None or d is None:
        return refused("stride, padding or dilation is not ints", value=(a.get("stride"), a.get("padding")))

    def make() -> Callable[[], None]:
        x, w = call.ins[0], call.ins[1]
        b = call.ins[2] if len(call.ins) > 2 else None
        default = conv_closure(x, w, b, call.outs[0], s, p, d, a.get("groups", 1))
        if call.tactics is None:
            return default
        return call.tactics.request_conv(call.ins, call.outs, a, default, call.epilogue)
    return claimed(make)


@lowers("conv_transpose2d", tier=ATEN)
def conv_transpose2d(call: OpCall) -> Claim:
    a = call.attrs
    s, p, d = pair(a.get("stride", 1)), pair(a.get("padding", 0)), pair(a.get("dilation", 1))
    op = pair(a.get("output_padding", 0))
    if s is None or p is None or d is None or op is None:
        return refused("stride, padding, dilation or output_padding is not ints", value=(a.get("stride"),
                                                                                         a.get("padding")))
    x, w, y = call.ins[0], call.ins[1], call.outs[0]
    b = call.ins[2] if len(call.ins) > 2 else None
    conv, groups = torch.ops.aten.convolution.out, a.get("groups", 1)
    return claimed(lambda: lambda: conv(x, w, b, list(s), list(p), list(d), True, list(op), groups, out=y))


@lowers(*_BINARY_OUT, tier=ATEN)
def binary(call: OpCall) -> Claim:
    y, (x0, x1) = call.outs[0], call.ins
    if y.dtype != torch.result_type(x0, x1):
        return refused(f"{call.op} into {y.dtype}: ATen's out= would cast", value=str(y.dtype))
    f = _BINARY_OUT[call.op]
    if call.op == "pow" and x1.dim() == 0 and x1.dtype.is_floating_point and x0.dtype == x1.dtype:
        # x.pow(0.5) is captured with a 0-d exponent: eager's scalar path takes sqrt (and its other
        # special exponents), so pow(-inf, 0.5) is NaN there, +inf through the tensor-tensor kernel
        return claimed(lambda: lambda: f(x0, x1.item(), out=y))
    return claimed(lambda: lambda: f(x0, x1, out=y))


@lowers(*_UNARY_OUT, tier=ATEN)
def unary(call: OpCall) -> Claim:
    f, x0, y = _UNARY_OUT[call.op], call.ins[0], call.outs[0]
    return claimed(lambda: lambda: f(x0, out=y))


@lowers("relu", tier=ATEN)
def relu(call: OpCall) -> Claim:
    x0, y = call.ins[0], call.outs[0]
    return claimed(lambda: lambda: torch.clamp_min(x0, 0, out=y))


@lowers("embedding", tier=ATEN)
def embedding(call: OpCall) -> Claim:
    (w, idx), y = call.ins, call.outs[0]

    def make() -> Callable[[], None]:
        y2, flat = y.view(-1, w.shape[1]), idx.view(-1)
        return lambda: torch.index_select(w, 0, flat, out=y2)
    return claimed(make)


@lowers("softmax", tier=ATEN)
def softmax(call: OpCall) -> Claim:
    x0, y, dim = call.ins[0], call.outs[0], call.attrs["dim"]
    if y.dtype != x0.dtype:
        return refused(f"softmax into {y.dtype}", value=str(y.dtype))
    return claimed(lambda: lambda: torch._softmax(x0, dim, False, out=y))


@lowers("gelu", tier=ATEN)
def gelu(call: OpCall) -> Claim:
    x0, y, approx = call.ins[0], call.outs[0], call.attrs.get("approximate", "none")
    return claimed(lambda: lambda: torch._C._nn.gelu(x0, approximate=approx, out=y))


@lowers("permute", tier=ATEN)
def permute(call: OpCall) -> Claim:
    x0, y, perm = call.ins[0], call.outs[0], call.attrs["perm"]
    return claimed(lambda: lambda: y.copy_(x0.permute(perm)))


@lowers("reshape", tier=ATEN)
def reshape(call: OpCall) -> Claim:
    x0, y = call.ins[0], call.outs[0]
    return claimed(lambda: lambda: y.copy_(x0.reshape(y.shape)))


__all__ = ["gemm_closure", "conv_closure", "gemm", "conv2d", "binary", "unary", "relu", "embedding", "softmax",
           "gelu", "permute", "reshape"]
