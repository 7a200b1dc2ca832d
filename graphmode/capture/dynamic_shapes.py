"""torch.export's `dynamic_shapes` read as graphmode's input dims, so `graphmode.compile(model,
example_inputs=..., dynamic_shapes=...)` takes what a torch.export user already wrote.

Per input (by name, or by position as the example tuple is), `{axis: Dim}` or a list with one
entry per axis: a `Dim("seq", min=1, max=512)` names the axis (its bounds become the dim's range
when given; unbounded, the draft chooses one as for any dim), `Dim.AUTO` / `Dim.DYNAMIC` name it
as graphmode would (`batch` on axis 0, `seq` on axis 1, else `<input>_<axis>`; such axes of the
same position and example size share one name, as a mask's and its ids' do), a string names it, `None` / `Dim.STATIC` keeps the example's size. A derived
dim (`2 * s`) has no counterpart: graphmode's dims are free variables over buckets.
"""
from __future__ import annotations

from typing import Any

import torch

from graphmode.errors import RecipeError

WHERE = "graphmode.compile(dynamic_shapes=...)"


def _examples_by_name(module: torch.nn.Module, example_inputs: Any) -> dict[str, torch.Tensor]:
    from graphmode.capture.spec import _input_names_for
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    if isinstance(example_inputs, dict):
        return dict(example_inputs)
    return dict(zip(_input_names_for(module, len(example_inputs)), example_inputs))


def _per_input(spec: Any, names: list[str]) -> dict[str, Any]:
    if isinstance(spec, dict):
        unknown = [k for k in spec if k not in names]
        if unknown:
            raise RecipeError(f"dynamic_shapes names inputs the examples do not have: {unknown}", where=WHERE,
                              value=unknown, fix=f"name these inputs: {names}")
        return dict(spec)
    if isinstance(spec, (tuple, list)):
        if len(spec) != len(names):
            raise RecipeError(f"dynamic_shapes has {len(spec)} entries for {len(names)} example inputs", where=WHERE,
                              value=len(spec), fix=f"one entry per input, in order: {names}")
        return dict(zip(names, spec))
    raise RecipeError("dynamic_shapes is a dict by input name or a tuple by position (torch.export's form)",
                      where=WHERE, value=type(spec).__name__, fix="e.g. {'ids': {0: Dim('batch'), 1: Dim('seq')}}")


def _axis_name(entry: Any, name: str, axis: int, example: torch.Tensor,
               hinted: dict[tuple[int, int], str]) -> tuple[str | None, tuple | None]:
    """(dim name or None for a static axis, (lo, hi) where the entry bounds it). `hinted`: the
    names given to Dim.AUTO axes so far by (axis, size), which a mask's axis shares with its ids'."""
    from torch.export.dynamic_shapes import _DerivedDim, _DimHint
    if entry is None or (isinstance(entry, _DimHint) and "STATIC" in str(entry)):
        return None, None
    if isinstance(entry, str):
        return entry, None
    if isinstance(entry, _DimHint):
        key = (axis, int(example.shape[axis]))
        if key not in hinted:
            hinted[key] = "batch" if axis == 0 else "seq" if axis == 1 and "seq" not in hinted.values() \
                else f"{name}_{axis}"
        return hinted[key], None
    if isinstance(entry, _DerivedDim):
        raise RecipeError(f"a derived dim ({entry.__name__}) on {name} axis {axis}: graphmode's dims are free "
                          "variables over buckets", where=WHERE, value=entry.__name__,
                          fix="give the axis its own Dim (or a recipe whose inputs[].shape names it)")
    if hasattr(entry, "__name__") and hasattr(entry, "min"):
        lo, hi = int(entry.min), entry.max
        bounded = lo > 0 or hi.__class__ is int
        return entry.__name__, ((max(lo, 1), int(hi)) if bounded and hi.__class__ is int else None)
    raise RecipeError(f"dynamic_shapes[{name!r}][{axis}] is a {type(entry).__name__}", where=WHERE,
                      value=repr(entry), fix="a torch.export Dim, Dim.AUTO / Dim.STATIC, a dim name or None")


def input_dims_from(module: torch.nn.Module, example_inputs: Any, dynamic_shapes: Any
                    ) -> tuple[dict[str, list], dict[str, tuple]]:
    """(input_dims for `(module, example_inputs, input_dims)`, {dim: (lo, hi)} the Dims bound)."""
    ex = _examples_by_name(module, example_inputs)
    spec = _per_input(dynamic_shapes, list(ex))
    dims: dict[str, list] = {k: list(v.shape) for k, v in ex.items()}
    ranges: dict[str, tuple] = {}
    hinted: dict[tuple[int, int], str] = {}
    for name, axes in spec.items():
        if axes is None:
            continue
        rank = ex[name].dim()
        items = axes.items() if isinstance(axes, dict) else enumerate(axes)
        if not isinstance(axes, (dict, tuple, list)):
            raise RecipeError(f"dynamic_shapes[{name!r}] is a {type(axes).__name__}", where=WHERE,
                              value=repr(axes), fix="{axis: Dim} or a list with one entry per axis")
        for axis, entry in items:
            if not isinstance(axis, int) or not -rank <= axis < rank:
                raise RecipeError(f"{name} has no axis {axis} (rank {rank})", where=WHERE, value=axis,
                                  fix=f"an axis in 0..{rank - 1}")
            dim, bounds = _axis_name(entry, name, axis % rank, ex[name], hinted)
            if dim is None:
                continue
            dims[name][axis % rank] = dim
            if bounds is not None:
                if ranges.get(dim, bounds) != bounds:
                    raise RecipeError(f"dim {dim!r} is bounded twice, {ranges[dim]} and {bounds}", where=WHERE,
                                      value=dim, fix="give one Dim object to every axis it names")
                ranges[dim] = bounds
    return dims, ranges
