"""Facts about the plan's buffers that kernels and steps check before they bind to them."""
from __future__ import annotations

from typing import Sequence

import torch

from graphmode.ir.types import TORCH_TO_DTYPE


def dtype_of(t: torch.Tensor) -> str | None:
    """The IR dtype name of `t` (None for a dtype the IR has no name for)."""
    return TORCH_TO_DTYPE.get(t.dtype)


def overlaps(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> bool:
    """Whether any tensor of `a` shares bytes with any tensor of `b`: a kernel that reads one
    while writing the other would read what it already overwrote."""
    def span(t: torch.Tensor) -> tuple[int, int]:
        p = t.data_ptr()
        return p, p + t.numel() * t.element_size()
    for x in a:
        if x.numel() == 0:
            continue
        a0, a1 = span(x)
        for y in b:
            if y.numel() == 0:
                continue
            b0, b1 = span(y)
            if a0 < b1 and b0 < a1:
                return True
    return False


def row_major_strides(shape: Sequence[int]) -> list[int]:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= int(n)
    return out[::-1]


def shape_text(t: torch.Tensor) -> str:
    return "x".join(str(int(d)) for d in t.shape) or "scalar"


__all__ = ["dtype_of", "overlaps", "row_major_strides", "shape_text"]
