"""An ONNX file's dynamic axes as a draft names them.

An exporter names each input's axes on its own (`torch.onnx.export(dynamic_axes={"ids": [0, 1],
"mask": [0, 1]})` writes `ids_dynamic_axes_1`, `mask_dynamic_axes_1`, ...), so the two axes a
model multiplies together are two dims that graphmode cannot know are equal, and a draft failed.
A recipe may name the file's axes as it likes (the importer maps them by position), so a draft
names them: the exporter's per-input names of one axis become one dim (`batch` for the leading
axis, `seq` for axis 1 where token ids have it), and `--dim batch=...` / `--dim seq=...` name the
symbolic axes where `graphmode recipe init` puts those dims for a PyTorch model.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any

from graphmode.errors import RecipeError

_EXPORTER_AXIS = re.compile(r"^(?P<input>.+)_dynamic_axes_(?P<k>\d+)$")


def unified(bundle: Any) -> Any:
    """The bundle with the exporter's per-input names of one axis index as one dim, where more
    than one input has that axis (a single input's names stay as the file has them)."""
    dims = bundle.input_dims
    groups: dict[int, list[tuple[str, int]]] = {}
    for name, shape in dims.items():
        for ax, d in enumerate(shape):
            m = _EXPORTER_AXIS.match(d) if isinstance(d, str) else None
            if m and m.group("input") == name:
                groups.setdefault(int(m.group("k")), []).append((name, ax))
    rename = {}
    for k, axes in groups.items():
        if len({n for n, _ in axes}) < 2:
            continue
        tokens = any(not _floating(bundle, n) for n, _ in axes)
        name = "batch" if k == 1 else "seq" if k == 2 and tokens else f"dynamic_axes_{k}"
        rename.update({a: name for a in axes})
    return _renamed(bundle, rename) if rename else bundle


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
