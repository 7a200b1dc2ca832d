"""An ONNX file's dynamic axes as a draft names them.

An exporter names each input's axes on its own (`torch.onnx.export(dynamic_axes={"ids": [0, 1],
"mask": [0, 1]})` writes `ids_dynamic_axes_1`, `mask_dynamic_axes_1`, ...), so two axes the
model ties (ids and mask of one sequence, added or masked together) are two dims that graphmode
cannot know are equal, while two it keeps apart (a query and a document of their own lengths)
must stay two. A recipe may name the file's axes as it likes (the importer maps them by
position), so a draft names them: the leading axes are one `batch`; every other exporter axis
starts as a dim of its own, and each pair the graph ties (the importer's "sizes A and B meet
here") becomes one dim (`tied`: `seq` for axis 1 of token ids) until the graph imports. The
same holds for torch.export's symbols (`s18`, `s43` in a dynamo export); names still made up
then take the axis's role (`named`: seq, samples, height, width).
`--dim batch=...` / `--dim seq=...` name the symbolic axes where `graphmode recipe init` puts
those dims for a PyTorch model.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any

from graphmode.errors import RecipeError

_EXPORTER_AXIS = re.compile(r"^(?P<input>.+)_dynamic_axes_(?P<k>\d+)$")
_SYMBOL = re.compile(r"^(s\d+|unk__\d+)$")       # torch.export's Dim.AUTO symbols; onnx shape inference's


def unified(bundle: Any) -> Any:
    """The bundle with the leading axes the exporter named (per input, or dynamo's `s18`, `s43`)
    as one `batch`; the other axes stay apart until the graph ties them (`tied`), then take
    names by what they are (`named`)."""
    axes = [a for a in _anonymous_axes(bundle) if a[1] == 0 and len(bundle.input_dims[a[0]]) >= 2]
    return _renamed(bundle, {a: "batch" for a in axes}) if axes else bundle


def tied(bundle: Any, error: Exception, shown: Any = None) -> Any | None:
    """The bundle with the two dims an import `error` says meet (`meeting`: two sizes the graph
    adds, masks or multiplies together) as one, where one of them is a name the exporter made up;
    None otherwise (the error stands). Both take the name that was not made up, else `seq` where
    they are axis 1 of inputs among which are token ids, else the first name. `shown`: the bundle the import saw (`named(bundle)`),
    whose names the error uses."""
    pair = getattr(error, "meeting", None)
    dims = bundle.input_dims
    if pair and shown is not None:          # the names the import saw, back to this bundle's
        back = [{dims[n][ax] for n, shape in shown.input_dims.items() for ax, d in enumerate(shape) if d == p}
                for p in pair]
        pair = tuple(next(iter(b)) for b in back) if all(len(b) == 1 for b in back) else None
    named = {d for shape in dims.values() for d in shape if isinstance(d, str)}
    if not pair or len(set(pair)) != 2 or not set(pair) <= named:
        return None
    ours = [a for a in _anonymous_axes(bundle) if dims[a[0]][a[1]] in pair]
    if not ours:
        return None
    every = [(n, ax) for n, shape in dims.items() for ax, d in enumerate(shape) if d in pair]
    tokens = all(ax == 1 for _, ax in every) and any(not _floating(bundle, n) for n, _ in every)
    kept = [p for p in pair if p not in {dims[n][ax] for n, ax in ours}]    # a name not made up stays
    name = kept[0] if kept else "seq" if tokens and "seq" not in named else pair[0]
    return _renamed(bundle, {a: name for a in every})


def named(bundle: Any) -> Any:
    """Names the exporter made up that are still there, by what the axis is where the inputs that
    have it agree: axis 1 of token ids `seq` (their float mask too), of a 2-d float signal
    `samples`, axes 2 and 3 of an image `height` and `width`; a name that would be taken, or
    meant for two axes the graph keeps apart, stays."""
    dims = bundle.input_dims
    taken = {d for shape in dims.values() for d in shape if isinstance(d, str)}
    signal = all(_floating(bundle, n) for n in dims)       # no token ids: a 2-d float input is a signal
    roles: dict[str, set[str]] = {}
    for n, ax in _anonymous_axes(bundle):
        shape, floating = dims[n], _floating(bundle, n)
        role = ("seq" if ax == 1 and len(shape) == 2 and not floating else
                "samples" if ax == 1 and len(shape) == 2 and signal else
                {2: "height", 3: "width"}.get(ax) if len(shape) == 4 and floating else None)
        roles.setdefault(shape[ax], set()).add(role)
    rename, given = {}, set()
    for old, rs in roles.items():
        role = "seq" if "seq" in rs else next(iter(rs)) if len(rs) == 1 else None    # ids and their float mask
        if role is None or role in taken or role in given or sum(role in r for r in roles.values()) > 1:
            continue
        given.add(role)
        rename.update({(n, ax): role for n, shape in dims.items() for ax, d in enumerate(shape) if d == old})
    return _renamed(bundle, rename) if rename else bundle


def _anonymous_axes(bundle: Any) -> list[tuple[str, int]]:
    """(input, axis) of each axis named by an exporter rather than a person: `<input>_dynamic_axes_<k>`
    on its own input, or a symbol (`s76`, `unk__3`)."""
    out = []
    for name, shape in bundle.input_dims.items():
        for ax, d in enumerate(shape):
            if not isinstance(d, str):
                continue
            m = _EXPORTER_AXIS.match(d)
            if (m and m.group("input") == name) or _SYMBOL.match(d):
                out.append((name, ax))
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
        elif "seq" in d or d in ("tokens", "length", "time", "frames", "samples"):
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
