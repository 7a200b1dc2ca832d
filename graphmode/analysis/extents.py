"""Dim values too small for the graph: extents that an admissible request makes empty or negative.

A convolution or pool whose window is wider than its (padded) input has no output position:
eager raises ("Output size is too small", "Kernel size can't be greater than actual input
size"), while the IR's shape formula, floor((h + 2p - k) / s) + 1, just evaluates to 0 or
less. torch.export proves a range that avoids it for a torch model (its "Constraints violated"
names the range); an ONNX file's dynamic axes carry no such range, so a recipe or a draft
could admit 1x1 images into a network of 3x3 convolutions. Each extent here is checked at the
recipe's smallest dim values (the formulas grow with their dims), and the smallest value that
fits is searched, so the refusal and the drafter can both say where the model starts to run.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import sympy

from graphmode.ir.graph import Graph
from graphmode.ir.ops import OPS
from graphmode.ir.types import dim_str, sym

SEARCH = 4096          # dim values tried above the minimum for the smallest that fits


@dataclass(frozen=True)
class ShortExtent:
    """A node whose output `extent` is `value` < `floor` at `dim`'s minimum; `fits` is the smallest
    dim value (others at their minimum) where it reaches `floor`, or None."""

    dim: str
    op: str
    output: str
    extent: str
    value: int
    floor: int
    fits: int | None

    def reason(self, lo: int) -> str:
        what = ("its window is wider than the padded input there (eager raises: output size too small)"
                if self.floor == 1 else "a negative size" if self.floor == 0 else
                "torch.export keeps no extent of 1 dynamic")
        return (f"{self.op} -> %{self.output} has {self.extent} = {self.value} positions along an axis "
                f"at {self.dim} = {lo}: {what}")


def short_extents(graph: Graph, ranges: Mapping[str, tuple[int, int]], export: bool = False) -> list[ShortExtent]:
    """One ShortExtent per dim whose minimum some node cannot take: a windowed op's (padding rule
    'window': convolutions, pools) output extent under 1, any other op's under 0. It names the
    node that binds: the one whose smallest fitting value is the largest (every node fits there).
    `export` asks every extent derived from the dims to be 2 or more: torch.export specialises
    one that may be 1 (a graph for a model it refused over the whole range)."""
    lows = {d: lo for d, (lo, _) in ranges.items()}
    checked: set[tuple[Any, int]] = set()
    out: dict[str, ShortExtent] = {}
    for n in graph.nodes:
        spec = OPS.get(n.op)
        floor = 2 if export else 1 if spec is not None and spec.padding == "window" else 0
        for v in n.outputs:
            for size in graph.type_of(v).shape:
                if isinstance(size, (int, sympy.Symbol)) or (size, floor) in checked:
                    continue                   # a dim itself is at least its minimum, >= 1
                checked.add((size, floor))
                expr = sympy.sympify(size)
                free = sorted(s.name for s in expr.free_symbols)
                if not free or any(f not in lows for f in free):
                    continue
                at_low = expr.subs({sym(f): lows[f] for f in free})
                if not at_low.is_Integer or int(at_low) >= floor:
                    continue
                d = free[0]
                lo, hi = ranges[d]
                others = {sym(f): lows[f] for f in free if f != d}

                def at(x: int) -> Any:
                    return expr.subs({**others, sym(d): x})
                fits = next((x for x in range(lo + 1, min(hi, lo + SEARCH) + 1)
                             if at(x).is_Integer and int(at(x)) >= floor), None)
                seen = out.get(d)               # the node that binds: the largest minimum (None: none fits)
                if seen is None or (seen.fits is not None and (fits is None or fits > seen.fits)):
                    out[d] = ShortExtent(d, n.op, v, dim_str(size), int(at_low), floor, fits)
    return list(out.values())


@dataclass(frozen=True)
class ShortSlice:
    """A slice with constant bounds over an axis of `extent` positions that needs `need` of them,
    which `dim`'s minimum leaves at `at_low`; `fits` is the smallest dim value where it holds."""

    dim: str
    output: str
    start: int
    end: int
    extent: str
    need: int
    at_low: int
    fits: int | None


def slice_needs(start: int, end: Any) -> int | None:
    """The extent a slice [start:end] needs for the length the IR gives it (`end - start`, or
    `extent - start`, ...) to be python's: a constant end or a start from the end assumes the
    axis holds at least that many positions (torch.export proves it for its example's range,
    from 2 up; a recipe may admit 1)."""
    big = isinstance(end, int) and end >= 2 ** 31
    if not isinstance(end, int):
        return None                           # a symbolic end (x[:, :seq]): its own dim
    if start >= 0 and big:
        return start or None
    if start >= 0 and end >= 0:
        return end
    if start >= 0:
        return start - end
    if end >= 0 and not big:                  # x[:, -2:1000]: from the end, up to a constant end
        return max(end, -start)
    return -start


def short_slices(graph: Graph, ranges: Mapping[str, tuple[int, int]]) -> list[ShortSlice]:
    """Slices with constant bounds over an axis of one dim that the dim's minimum makes shorter
    than the bound (x[:, -2] at seq 1): the plan would read past the axis. One per dim: the one
    that binds (the largest smallest value that fits; None, no value fits, binds most)."""
    out: dict[str, ShortSlice] = {}
    for n in graph.nodes:
        if n.op != "slice":
            continue
        t = graph.type_of(n.inputs[0])
        size = t.shape[n.attrs["dim"] % t.rank]
        need = slice_needs(int(n.attrs.get("start", 0)), n.attrs.get("end", 2 ** 62))
        if isinstance(size, int) or need is None:
            continue
        expr = sympy.sympify(size)
        free = [s.name for s in expr.free_symbols]
        if len(free) != 1 or free[0] not in ranges:
            continue                              # one dim: its smallest value decides
        d = free[0]
        lo, hi = ranges[d]

        def at(v: int) -> Any:
            return expr.subs(sym(d), v)
        if not at(lo).is_Integer or int(at(lo)) >= need:
            continue
        fits = next((v for v in range(lo, min(hi, lo + SEARCH) + 1) if at(v).is_Integer and int(at(v)) >= need),
                    None)
        seen = out.get(d)
        if seen is None or (seen.fits is not None and (fits is None or fits > seen.fits)):
            out[d] = ShortSlice(d, n.outputs[0], int(n.attrs.get("start", 0)), n.attrs.get("end", 2 ** 62),
                                dim_str(size), need, int(at(lo)), fits)
    return list(out.values())


__all__ = ["ShortExtent", "ShortSlice", "short_extents", "short_slices", "slice_needs"]
