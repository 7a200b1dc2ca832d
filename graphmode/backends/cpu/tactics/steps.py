"""The plan steps tactic selection hands the executor, and the problem each one computes.

A GEMM or conv step starts as its ATen closure and is switched to the winning generated
kernel when the context is finalized; until then (and when ATen wins) it runs ATen. A step
offered a fused epilogue (`FusedEpilogue`) runs the group's epilogue itself: the generated
kernels apply it at their store, the ATen default runs its GEMM and then the group's own
epilogue kernel.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping, Sequence

import torch

from graphmode.backends.cpu.aten import conv_closure, gemm_closure
from graphmode.backends.cpu.conv import ConvConfig, ConvProblem, conv_problem_of
from graphmode.backends.cpu.depthwise import is_depthwise
from graphmode.backends.cpu.epilogue import Epilogue
from graphmode.backends.cpu.gemm import GemmProblem
from graphmode.backends.cpu.tensors import overlaps

ATEN = "aten"     # the name of the ATen candidate of every shape


@dataclass
class FusedEpilogue:
    """An epilogue offered to a GEMM/conv step (by the binding of a gemm_epilogue group): the
    generated candidates apply `epi` at their store and write `out`; ATen runs its GEMM and
    then `run` (the group's own epilogue kernel over the GEMM buffer)."""

    epi: Epilogue
    operands: list[torch.Tensor]
    out: torch.Tensor
    run: Callable[[], None]

    def fits(self, numel: int) -> bool:
        """Whether a generated kernel can apply it: contiguous fp32 buffers, `out` of the
        GEMM's `numel` elements."""
        out = self.out
        return (out.dtype == torch.float32 and out.is_contiguous() and out.numel() == numel
                and all(t.dtype == torch.float32 and t.is_contiguous() for t in self.operands))


class GemmStep:
    """A plan step for one GEMM. Runs `fn`: ATen until tuning switches it to the winner.
    With a fused epilogue `c` is the group's output, `ops` the epilogue operands, and the
    ATen default runs the GEMM and then the epilogue kernel."""

    __slots__ = ("fn", "default", "problem", "a", "b", "bias", "c", "keep", "tactic", "ops", "epilogue_run")

    def __init__(self, default: Callable[[], None], problem: GemmProblem, a, b, bias, c,
                 fused: FusedEpilogue | None = None):
        self.problem = problem
        self.a, self.b, self.bias, self.c = a, b, bias, c
        self.keep: tuple = ()
        self.tactic = ATEN
        self.ops: list[torch.Tensor] = list(fused.operands) if fused is not None else []
        self.epilogue_run = fused.run if fused is not None else None
        if fused is not None:
            run = fused.run

            def default_then_epilogue() -> None:
                default()
                run()
            self.fn = self.default = default_then_epilogue
        else:
            self.fn = self.default = default

    @property
    def fused_epilogue(self) -> bool:
        return self.epilogue_run is not None

    def __call__(self) -> None:
        self.fn()


class ConvStep(GemmStep):
    """A plan step for one conv2d (a `ConvProblem`; `a` the input, `b` the constant weight,
    `c` the output): ATen until tuning switches it to a generated kernel."""

    __slots__ = ()


def problem_of(op: str, ins_t: Sequence[torch.Tensor], outs: Sequence[torch.Tensor],
               constant_ptrs: Mapping[int, Any] | set[int] | None = None) -> GemmProblem | None:
    """The GEMM an executor step computes, or None when only ATen can run it (non-f32,
    non-contiguous buffers, broadcast batch dims, a linear weight that is not a constant)."""
    y = outs[0]
    tensors = list(ins_t) + [y]
    if any(t.dtype != torch.float32 or not t.is_contiguous() or t.device.type != "cpu" for t in tensors):
        return None
    consts = constant_ptrs or ()
    if op == "linear":
        x, w = ins_t[0], ins_t[1]
        if w.dim() != 2 or x.dim() < 1 or w.data_ptr() not in consts:
            return None
        n, k = w.shape
        if x.shape[-1] != k or k == 0 or n == 0 or x.numel() == 0 or y.numel() != x.numel() // k * n:
            return None
        if len(ins_t) > 2 and (ins_t[2].dim() != 1 or ins_t[2].shape[0] != n):
            return None
        return GemmProblem("linear", 1, x.numel() // k, n, k, bias=len(ins_t) > 2, b_packed=True)
    if op == "matmul" and len(ins_t) == 2:
        x, w = ins_t
        if x.dim() < 2 or w.dim() < 2:
            return None
        k, n = w.shape[-2], w.shape[-1]
        if x.shape[-1] != k or 0 in (k, n) or x.numel() == 0:
            return None
        if w.dim() == 2:
            m = x.numel() // k
            if y.numel() != m * n:
                return None
            return GemmProblem("matmul", 1, m, n, k, b_packed=w.data_ptr() in consts)
        if x.dim() == w.dim() and x.shape[:-2] == w.shape[:-2]:
            batch = math.prod(x.shape[:-2])
            m = x.shape[-2]
            if tuple(y.shape) != tuple(x.shape[:-1]) + (n,):
                return None
            return GemmProblem("matmul", batch, m, n, k, b_packed=False, b_batched=True)
    return None


def gemm_step(op: str, ins_t: Sequence[torch.Tensor], outs: Sequence[torch.Tensor], default: Callable[[], None],
              epilogue: FusedEpilogue | None, constant_ptrs: set[int]) -> GemmStep | None:
    """The tunable step of an executor's GEMM, or None when only ATen can run it. With
    `epilogue`, a step that takes it has `fused_epilogue` set (it then runs the epilogue too);
    one that cannot comes back without it."""
    p = problem_of(op, ins_t, outs, constant_ptrs)
    if p is None:
        return None
    bias = ins_t[2] if op == "linear" and len(ins_t) > 2 else None
    c = outs[0]
    if epilogue is not None and p.batch == 1 and epilogue.fits(p.m * p.n):
        p = replace(p, epi=epilogue.epi, c_aliases_operand=overlaps([epilogue.out], epilogue.operands))
        c = epilogue.out
    else:
        epilogue = None
    return GemmStep(default, p, ins_t[0], ins_t[1], bias, c, epilogue)


def conv_step(ins_t: Sequence[torch.Tensor], outs: Sequence[torch.Tensor], attrs: Mapping,
              default: Callable[[], None], epilogue: FusedEpilogue | None, constant_ptrs: set[int]) -> ConvStep | None:
    """The tunable step of an executor's conv2d, or None when no generated kernel covers it."""
    p = conv_problem_of(ins_t, outs, attrs, constant_ptrs)
    if p is None or p.groups != 1 and not is_depthwise(p):
        return None
    bias = ins_t[2] if len(ins_t) > 2 else None
    c = outs[0]
    if epilogue is not None and epilogue.fits(c.numel()):
        p = replace(p, epi=epilogue.epi)     # conv kernels read each operand element before writing it
        c = epilogue.out
    else:
        epilogue = None
    return ConvStep(default, p, ins_t[0], ins_t[1], bias, c, epilogue)


def random_step(p: GemmProblem, seed: int, b: torch.Tensor | None = None) -> GemmStep:
    """A step of problem `p` over random operands (B is `b` when given): a shape tuned on its
    own, without an executor (tests and tools)."""
    gen = torch.Generator().manual_seed(seed)
    if b is None:
        if p.op == "linear":
            b = torch.randn(p.n, p.k, generator=gen)
        elif p.b_batched:
            b = torch.randn(p.batch, p.k, p.n, generator=gen)
        else:
            b = torch.randn(p.k, p.n, generator=gen)
    a = torch.randn(p.batch, p.m, p.k, generator=gen)
    c = torch.empty(p.batch, p.m, p.n)
    bias = torch.randn(p.n, generator=gen) if p.bias else None
    return GemmStep(aten_gemm(p, a, b, bias, c), p, a if p.batch > 1 else a.view(p.m, p.k), b, bias,
                    c if p.batch > 1 else c.view(p.m, p.n))


def b_shape(p: GemmProblem) -> tuple[int, ...]:
    """A runtime B as the kernel sees it (leading batch dims flattened)."""
    return (p.batch, p.k, p.n) if p.b_batched else (p.k, p.n)


def aten_gemm(p: GemmProblem, a: torch.Tensor, b: torch.Tensor, bias, c: torch.Tensor) -> Callable[[], None]:
    """The ATen closure of problem `p` over A [batch, m, k], B, bias and C [batch, m, n] (what
    a step of that shape runs as its `aten` tactic)."""
    batched = p.op == "matmul" and p.batch > 1
    x = a if batched else a.view(p.batch * p.m, p.k)
    y = c if batched else c.view(p.batch * p.m, p.n)
    return gemm_closure(p.op, [x, b] + ([bias] if bias is not None else []), y)


def aten_conv(p: ConvProblem, x: torch.Tensor, w: torch.Tensor, bias, y: torch.Tensor) -> Callable[[], None]:
    """The ATen closure of conv problem `p` (the `aten` tactic)."""
    return conv_closure(x, w, bias, y, p.stride, p.padding, p.dilation, p.groups)


def conv_args(step: ConvStep, cfg: ConvConfig, x, u, ws, y, ops=()) -> list[int]:
    """The buffer addresses a generated conv kernel takes (conv.ConvArgs' order)."""
    extra = [step.bias.data_ptr()] if step.problem.bias else []
    return [x.data_ptr(), u.data_ptr(), *extra, *(t.data_ptr() for t in ops), ws.data_ptr(), y.data_ptr()]


__all__ = ["ATEN", "FusedEpilogue", "GemmStep", "ConvStep", "problem_of", "gemm_step", "conv_step", "random_step",
           "b_shape", "aten_gemm", "aten_conv", "conv_args"]
