"""Numeric comparison helpers shared by tests, `graphmode verify` and the benchmark."""
from __future__ import annotations

from typing import Mapping

import torch

from graphmode.ir.graph import Graph
from graphmode.ir.types import DTYPES

# relative L2 error bounds by dtype (fp32: the project's contract)
TOLERANCE = {"f64": 1e-10, "f32": 1e-5, "bf16": 2e-2, "f16": 5e-3}

# Weight-only quantization (recipe precision.weights) changes answers by the weights' rounding
# by design, so its contract against the f32 model is a bound on the relative L2 error of the
# outputs and, for logits, the share of positions whose arg-max (top-1 token or class) agrees.
# Measured: tiny GPT-2 bf16 6.5e-3 / 99.2 %, int8 2.2e-2 / 96.1 %.
WEIGHT_ONLY = {"bf16": (2e-2, 0.98), "int8": (6e-2, 0.95)}


def top1_agreement(actual: torch.Tensor, expected: torch.Tensor) -> float | None:
    """Share of rows (all but the last axis) whose arg-max over the last axis agrees; None for
    what has no classes to pick (integers, scalars, a last axis of one)."""
    if (actual.shape != expected.shape or not torch.is_floating_point(expected) or expected.dim() < 1
            or expected.shape[-1] < 2 or expected.numel() == 0):
        return None
    return float((actual.argmax(-1) == expected.argmax(-1)).double().mean())


def rel_l2(actual: torch.Tensor, expected: torch.Tensor) -> float:
    a = actual.detach().double()
    e = expected.detach().double()
    if a.shape != e.shape:
        return float("inf")
    if not torch.is_floating_point(expected):
        return 0.0 if torch.equal(a, e) else 1.0
    den = e.norm().item()
    num = (a - e).norm().item()
    return num / den if den > 0 else num


def random_inputs(g: Graph, env: Mapping[str, int], seed: int = 0, int_high: int = 2) -> dict[str, torch.Tensor]:
    """Random tensors for a graph's inputs at concrete dims (ints drawn from [0, int_high))."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name in g.inputs:
        ty = g.values[name].type
        shape = ty.concrete(env)
        dt = DTYPES[ty.dtype]
        if dt.is_floating_point:
            out[name] = torch.randn(shape, generator=gen, dtype=torch.float32).to(dt)
        elif dt == torch.bool:
            out[name] = torch.randint(0, 2, shape, generator=gen).bool()
        else:
            out[name] = torch.randint(0, int_high, shape, generator=gen, dtype=dt)
    return out
