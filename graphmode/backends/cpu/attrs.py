"""Op attributes as the CPU kernels read them: plain ints, and 2-d window attributes."""
from __future__ import annotations


def int_attr(v) -> int | None:
    """`v` if it is an int (not a bool), else None."""
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def pair(v) -> tuple[int, int] | None:
    """A 2-d attribute (kernel, stride, padding, dilation, output size) as (h, w): an int is
    both, a one-element list both, a two-element list itself; None when it is not ints."""
    v = list(v) if isinstance(v, (list, tuple)) else [v, v]
    if len(v) == 1:
        v = v * 2
    return (v[0], v[1]) if len(v) == 2 and all(int_attr(x) is not None for x in v) else None


__all__ = ["int_attr", "pair"]
