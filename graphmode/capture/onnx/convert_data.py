"""ONNX ops whose output size only the data decides: NonZero and Compress.

Each is an eager ATen call (a `fallback` node) whose output type names the data-dependent
length `data_u<k>`; after import, `capture/tail.py`'s `split_tail` moves them and every node
that reads what they made into the tail, which runs after the plan (exe_mode hybrid; graph
mode refuses it by name). Until such an op, the model is planned as any other.
"""
from __future__ import annotations

import sympy

from graphmode.capture.onnx.importer import _Importer, _handles
from graphmode.capture.tail import PREFIX
from graphmode.ir.ops import norm_axis
from graphmode.ir.types import TensorType, normalize_dim

_IN = [{"$in": i} for i in range(2)]
DATA_SIZED_OPS = ("NonZero", "Compress")       # what the handlers below register


def _data_dim(imp: _Importer) -> sympy.Symbol:
    """A fresh data-dependent length for this model."""
    k = getattr(imp, "data_dims", 0)
    imp.data_dims = k + 1
    return sympy.Symbol(f"{PREFIX}u{k}", integer=True, positive=True)


def _call(imp: _Importer, target: str, inputs: list[str], args: list, otype: TensorType, hint: str,
          out: str | None = None) -> str:
    """One eager ATen call with an explicit output type (what the op table cannot infer)."""
    n = imp.node
    name = imp.g.fresh_name(hint.replace(".", "_").replace(":", "_") or "v")
    imp.g.add_node("fallback", inputs, [otype], {"target": target, "args": args, "kwargs": {},
                                                 "loc": n.name or n.output[0]}, names=[name])
    imp.op_map[n.op_type][target] += 1
    if out is not None:
        imp.ir[out] = name
        imp.check_declared(out)
    return name


def _nonzero(imp: _Importer, x: str, hint: str) -> str:
    """torch.nonzero: i64[count, rank], the positions in row-major order."""
    rank = imp.g.type_of(x).rank
    return _call(imp, "aten.nonzero.default", [x], [_IN[0]], TensorType("i64", (_data_dim(imp), rank)), hint)


@_handles("NonZero")
def _nonzero_op(imp: _Importer, n) -> None:
    """ONNX's positions are [rank, count]: torch's transposed."""
    x = imp.operand(n.input[0])
    if imp.g.type_of(x).rank == 0:
        raise imp.fail("NonZero of a 0-d tensor is not supported", fix="reshape the input to [1] first")
    nz = _nonzero(imp, x, f"{n.output[0]}_rows")
    imp.emit("permute", [nz], {"perm": [1, 0]}, out=n.output[0])


@_handles("Compress")
def _compress(imp: _Importer, n) -> None:
    """The slices along `axis` (of the flattened input without one) where the 1-d condition is
    true; a condition shorter than the axis selects among its first positions."""
    x, cond = imp.operand(n.input[0]), imp.operand(n.input[1])
    xt, ct = imp.g.type_of(x), imp.g.type_of(cond)
    if ct.rank != 1:
        raise imp.fail(f"Compress condition must be 1-d, got {ct.text()}", fix="flatten the condition")
    axis = imp.attr(n, "axis", None)
    if axis is None:
        flat = normalize_dim(sympy.Mul(*[sympy.sympify(d) for d in xt.shape]))
        x = _call(imp, "aten.reshape.default", [x], [_IN[0], [-1]], TensorType(xt.dtype, (flat,)),
                  f"{n.output[0]}_flat")
        xt, axis = imp.g.type_of(x), 0
    axis = norm_axis(int(axis), xt.rank)
    nz = _nonzero(imp, cond, f"{n.output[0]}_picked")
    count = imp.g.type_of(nz).shape[0]
    idx = _call(imp, "aten.select.int", [nz], [_IN[0], 1, 0], TensorType("i64", (count,)), f"{n.output[0]}_idx")
    shape = list(xt.shape)
    shape[axis] = count
    _call(imp, "aten.index_select.default", [x, idx], [_IN[0], axis, _IN[1]], TensorType(xt.dtype, tuple(shape)),
          n.output[0], out=n.output[0])
