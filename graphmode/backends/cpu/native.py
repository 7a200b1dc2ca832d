"""Generated kernels for single core ops whose ATen CPU kernel is slow for the plan's layout.

Some ops are a small share of the FLOPs but a large share of the time when ATen runs them:
`max_pool2d` on contiguous NCHW (ATen's NCHW path is ~20x slower than its channels-last one
here), and `sdpa` at the sizes of a small encoder (its flash kernel reaches a quarter of the
roofline). For those the CPU provider generates a kernel with every shape baked in, exactly
as for fused groups; the executor then runs it in place of the ATen step.

A generator is registered per op with `@register_native("op")` in its own module (listed in
`_MODULES`) and returns a `KernelSource` whose `inputs` / `outputs` are the instruction's own
value names (contiguous buffers of the plan's slots), or None when it does not cover this
instance (the ATen step stays); a `BackendError` is reported as a fallback for that step.
"""
from __future__ import annotations

import importlib
from typing import Callable, Mapping, Sequence

import torch

from graphmode.backends.cpu.codegen import KernelSource

NativeGenerator = Callable[[Sequence[torch.Tensor], Sequence[torch.Tensor], Mapping, Mapping[str, int],
                            Sequence[str], Sequence[str]], "KernelSource | None"]

NATIVE: dict[str, NativeGenerator] = {}
_MODULES: tuple[str, ...] = ("pool", "attention")
_loaded = False


def register_native(op: str) -> Callable[[NativeGenerator], NativeGenerator]:
    def deco(fn: NativeGenerator) -> NativeGenerator:
        NATIVE[op] = fn
        return fn
    return deco


def _load() -> None:
    global _loaded
    if not _loaded:
        for m in _MODULES:
            importlib.import_module(f"graphmode.backends.cpu.{m}")
        _loaded = True


def native_ops() -> frozenset[str]:
    _load()
    return frozenset(NATIVE)


def native_source(op: str, ins_t: Sequence[torch.Tensor], outs: Sequence[torch.Tensor], attrs: Mapping,
                  env: Mapping[str, int], inputs: Sequence[str], outputs: Sequence[str]) -> KernelSource | None:
    """The generated kernel for one instruction, or None (ATen runs it). Only contiguous CPU
    buffers qualify: a kernel addresses its arguments as dense row-major arrays."""
    _load()
    gen = NATIVE.get(op)
    if gen is None:
        return None
    if any(not t.is_contiguous() or t.device.type != "cpu" for t in list(ins_t) + list(outs)):
        return None
    return gen(ins_t, outs, attrs, env, inputs, outputs)


__all__ = ["register_native", "native_source", "native_ops", "NATIVE"]
