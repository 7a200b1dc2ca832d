"""An ONNX file's dynamic axes as a draft names them.

An exporter names each input's axes on its own (`torch.onnx.export(dynamic_axes={"ids": [0, 1],
"mask": [0, 1]})` writes `ids_dynamic_axes_1`, `mask_dynamic_axes_1`, ...), so two axes the
model ties (ids and mask of one sequence, added or masked together) are two dims that graphmode
cannot know are equal, while two it keeps apart (a query and a document of their own lengths)
must stay two. A recipe may name the file's axes as it likes (the importer maps them by
position), so a draft names them: the leading axes are one `batch`; every other exporter axis
starts as a dim of its own, and each pair the graph ties (the importer's "sizes A and B meet
here") becomes one dim (`tied`: `seq` for axis 1 of token ids) until the graph imports.
`--dim batch=...` / `--dim seq=...` name the symbolic axes where `graphmode recipe init` puts
those dims for a PyTorch model.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any

from graphmode.errors import RecipeError

_EXPORTER_AXIS = re.compile(r"^(?P<input>.+)_dynamic_axes_(?P<k>\d+)$")


def unified(bundle: Any) -> Any:
    """The bundle with the exporter's per-input names of the leading axis as one `batch`, where
    more than one input has one (the other axes stay apart until the graph ties them: `tied`)."""
    axes = [a for a, k in _exporter_axes(bundle).items() if k == 1]
    if len({n for n, _ in axes}) < 2:
        return bundle
    return _renamed(bundle, {a: "batch" for a in axes})


def tied(bundle: Any, error: Exception) -> Any | None:
    """The bundle with the two dims an import `error` says meet (`meeting`: two sizes the graph
    adds, masks or multiplies together) as one, where one of them is an exporter's axis name;
    None otherwise (the error stands). Both become `seq` where they are axis 1 of inputs among
    which are token ids, else the first name."""
    pair = getattr(error, "meeting", None)
    dims = bundle.input_dims
    named = {d for shape in dims.values() for d in shape if isinstance(d, str)}
    if not pair or len(set(pair)) != 2 or not set(pair) <= named:
        return None
    exporter = _exporter_axes(bundle)
    ours = {a: k for a, k in exporter.items() if dims[a[0]][a[1]] in pair}
    if not ours:
        return None
    tokens = all(k == 2 for k in ours.values()) and any(not _floating(bundle, n) for n, _ in ours)
    name = "seq" if tokens and len(ours) == sum(1 for s in dims.values() for d in s if d in pair) else pair[0]
    return _renamed(bundle, {(n, ax): name for n, shape in dims.items() for ax, d in enumerate(shape) if d in pair})


def _exporter_axes(bundle: Any) -> dict[tuple[str, int], int]:
    """(input, axis) -> k of each axis the exporter named `<input>_dynamic_axes_<k>`."""
    out = {}
    for name, shape in bundle.input_dims.items():
        for ax, d in enumerate(shape):
            m = _EXPORTER_AXIS.match(d) if isinstance(d, str) else None
            if m and m.group("input") == name:
                out[(name, ax)] = int(m.group("k"))
    return out


def placed(bundle: Any, new: dict[str, tuple]) -> Any:
    """The bundle with each --dim of `new` on the file's symbolic axes where it goes: the named
    (input, axis) pairs, else `batch` on every leading axis and a sequence dim on axis 1 of
    inputs of rank >= 2. An axis the file fixes stays as it is; a dim with no symbolic axis is
    refused (the file's sizes are what the model was exported for)."""
    dims = bundle.input_dims
    rename = {}
    for d, r in new.items():
        if len(r) > 2:
            axes = [(k, a % len(dims.get(k) or [1])) for k, a in r[2]]
        elif d == "batch":
            axes = [(k, 0) for k, v in dims.items() if v]
        elif "seq" in d or d in ("tokens", "length", "time", "frames"):
            axes = [(k, 1) for k, v in dims.items() if len(v) >= 2]
        else:
            axes = []
        symbolic = [(k, a) for k, a in axes if k in dims and a < len(dims[k]) and isinstance(dims[k][a], str)]
        if not symbolic:
            raise RecipeError(f"the ONNX model has no dynamic axis where dim {d!r} goes", where="--dim", value=d,
                              fix=f"its inputs: {', '.join(f'{k} {v}' for k, v in dims.items())}; name the axes "
                                  f"(--dim {d}={r[0]}:{r[1]}@INPUT:AXIS) or re-export the model with that axis dynamic")
        rename.update({a: d for a in symbolic})
    return _renamed(bundle, rename)


def _renamed(bundle: Any, rename: dict[tuple[str, int], str]) -> Any:
    dims = bundle.input_dims
    inputs = [dataclasses.replace(t, shape=[rename.get((t.name, ax), d) for ax, d in enumerate(dims[t.name])])
              for t in bundle.inputs]
    return dataclasses.replace(bundle, inputs=inputs)


def _floating(bundle: Any, name: str) -> bool:
    t = next((t for t in bundle.inputs if t.name == name), None)
    return t is not None and t.dtype.startswith(("float", "bfloat", "complex"))
