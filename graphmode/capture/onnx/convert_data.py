"""ONNX ops whose output size only the data decides: NonZero, Compress, Unique and NonMaxSuppression.

Each is an eager ATen call (a `fallback` node) whose output type names the data-dependent
length `data_u<k>`; after import, `capture/tail.py`'s `split_tail` moves them and every node
that reads what they made into the tail, which runs after the plan (exe_mode hybrid; graph
mode refuses it by name). Until such an op, the model is planned as any other.
"""
from __future__ import annotations

import sympy

from graphmode.capture.onnx.importer import _Importer, _handles
from graphmode.capture.onnx.values import _vname
from graphmode.capture.tail import PREFIX
from graphmode.ir import eager_ops  # noqa: F401 - registers torch.ops.graphmode.non_max_suppression
from graphmode.ir.ops import norm_axis
from graphmode.ir.types import TensorType, dim_str, normalize_dim

_IN = [{"$in": i} for i in range(3)]
DATA_SIZED_OPS = ("NonZero", "Compress", "Unique", "NonMaxSuppression")       # what the handlers below register


def _data_dim(imp: _Importer) -> sympy.Symbol:
    """A fresh data-dependent length for this model."""
    k = getattr(imp, "data_dims", 0)
    imp.data_dims = k + 1
    return sympy.Symbol(f"{PREFIX}u{k}", integer=True, positive=True)


def _calls(imp: _Importer, target: str, inputs: list[str], args: list, otypes: list[TensorType], hint: str,
           kwargs: dict | None = None) -> list[str]:
    """One eager ATen call with explicit output types (what the op table cannot infer)."""
    n = imp.node
    names = [imp.g.fresh_name(_vname(f"{hint}_{k}" if k else hint)) for k in range(len(otypes))]
    outs = imp.g.add_node("fallback", inputs, otypes, {"target": target, "args": args, "kwargs": kwargs or {},
                                                       "loc": n.name or n.output[0]}, names=names)
    imp.op_map[n.op_type][target] += 1
    return list(outs)


def _call(imp: _Importer, target: str, inputs: list[str], args: list, otype: TensorType, hint: str,
          out: str | None = None, kwargs: dict | None = None) -> str:
    name, = _calls(imp, target, inputs, args, [otype], hint, kwargs)
    if out is not None:
        imp.ir[out] = name
        imp.check_declared(out)
    return name


def _nonzero(imp: _Importer, x: str, hint: str) -> str:
    """torch.nonzero: i64[count, rank], the positions in row-major order. Two NonZero of one value
    (the TorchScript exporter writes one per x[m], y[m]) count the same: one length, so what they
    select broadcasts together."""
    rank = imp.g.type_of(x).rank
    counts = imp.__dict__.setdefault("nonzero_counts", {})
    count = counts.setdefault(x, _data_dim(imp))
    return _call(imp, "aten.nonzero.default", [x], [_IN[0]], TensorType("i64", (count, rank)), hint)


def _flat(imp: _Importer, x: str, hint: str) -> str:
    """`x` as one axis: a core reshape, so the plan keeps it and the padding analysis follows it."""
    flat = normalize_dim(sympy.Mul(*[sympy.sympify(d) for d in imp.g.type_of(x).shape]))
    return imp.emit("reshape", [x], {"shape": [flat if isinstance(flat, int) else dim_str(flat)]}, hint=hint)


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
        x, axis = _flat(imp, x, f"{n.output[0]}_flat"), 0
        xt = imp.g.type_of(x)
    axis = norm_axis(int(axis), xt.rank)
    nz = _nonzero(imp, cond, f"{n.output[0]}_picked")
    count = imp.g.type_of(nz).shape[0]
    idx = _call(imp, "aten.select.int", [nz], [_IN[0], 1, 0], TensorType("i64", (count,)), f"{n.output[0]}_idx")
    shape = list(xt.shape)
    shape[axis] = count
    _call(imp, "aten.index_select.default", [x, idx], [_IN[0], axis, _IN[1]], TensorType(xt.dtype, tuple(shape)),
          n.output[0], out=n.output[0])


@_handles("Unique")
def _unique(imp: _Importer, n) -> None:
    """The distinct values (or slices along `axis`), ascending or (sorted=0) in order of first
    occurrence, with each one's first index, each element's index among them and their counts:
    torch.unique's sorted answer, the first indices a scatter-min of positions, and for sorted=0
    everything reordered by those first indices."""
    x = imp.operand(n.input[0])
    xt = imp.g.type_of(x)
    axis = imp.attr(n, "axis", None)
    h = n.output[0] or "unique"
    if axis is None:
        x, axis = _flat(imp, x, f"{h}_flat"), 0
        xt = imp.g.type_of(x)
        target, args = "aten._unique2.default", [_IN[0], True, True, True]
    else:
        axis = norm_axis(int(axis), xt.rank)
        target, args = "aten.unique_dim.default", [_IN[0], axis, True, True, True]
    u, length = _data_dim(imp), xt.shape[axis]
    shape = list(xt.shape)
    shape[axis] = u
    y, inv, counts = _calls(imp, target, [x], args, [TensorType(xt.dtype, tuple(shape)), TensorType("i64", (length,)),
                                                     TensorType("i64", (u,))], h)
    size = {"$dim": dim_str(length)}
    i64 = {"dtype": {"$dtype": "i64"}}
    pos = _call(imp, "aten.arange.default", [], [size], TensorType("i64", (length,)), f"{h}_pos", kwargs=i64)
    top = _call(imp, "aten.full.default", [], [[{"$dim": dim_str(u)}], size], TensorType("i64", (u,)), f"{h}_top",
                kwargs=i64)
    first = _call(imp, "aten.scatter_reduce.two", [top, inv, pos], [_IN[0], 0, _IN[1], _IN[2], "amin"],
                  TensorType("i64", (u,)), f"{h}_first")
    if not int(imp.attr(n, "sorted", 1)):
        order = _call(imp, "aten.argsort.default", [first], [_IN[0]], TensorType("i64", (u,)), f"{h}_order")
        y = _call(imp, "aten.index_select.default", [y, order], [_IN[0], axis, _IN[1]], imp.g.type_of(y), f"{h}_y")
        counts, first = (_call(imp, "aten.index_select.default", [v, order], [_IN[0], 0, _IN[1]],
                               TensorType("i64", (u,)), f"{h}_{k}") for k, v in (("counts", counts), ("first", first)))
        rank = _call(imp, "aten.argsort.default", [order], [_IN[0]], TensorType("i64", (u,)), f"{h}_rank")
        inv = _call(imp, "aten.index_select.default", [rank, inv], [_IN[0], 0, _IN[1]], TensorType("i64", (length,)),
                    f"{h}_inverse")
    for out, v in zip(n.output, (y, first, inv, counts)):
        if out:
            imp.emit("identity", [v], {}, out=out)


@_handles("NonMaxSuppression")
def _nms(imp: _Importer, n) -> None:
    """[num_selected, 3] (batch, class, box) per ir/eager_ops.py's non_max_suppression."""
    ins: list[str] = []
    args: list = []
    for k in range(5):
        v = imp.opt_in(n, k)
        if v is not None:
            ins.append(imp.operand(v))
        args.append({"$in": len(ins) - 1} if v is not None else None)
    args.append(int(imp.attr(n, "center_point_box", 0)))
    _call(imp, "graphmode.non_max_suppression.default", ins, args, TensorType("i64", (_data_dim(imp), 3)),
          n.output[0], out=n.output[0])
