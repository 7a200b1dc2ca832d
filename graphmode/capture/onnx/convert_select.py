"""ONNX ops that select, reorder or write elements by index: TopK, ScatterElements / Scatter,
ScatterND, TensorScatter, ReverseSequence, Tile, CumProd and Det.

Where a core op fits they are written as core ops (Tile as reshape + expand, ReverseSequence
as a gather of computed positions, ScatterND as a scatter along the flattened index axes);
the rest become ATen-reference ops (`ir/ops/aten_ref.py`: `sort`, `scatter`, `scatter_reduce`,
`cumprod`, `linalg_det`), whose reference is the ATen op itself and whose output types are
derived for static shapes (a symbolic dim there is refused by name).
"""
from __future__ import annotations

import math

import sympy
import torch

from graphmode.capture.onnx.convert_composite import _bind, _const, _static
from graphmode.capture.onnx.convert_shape import _wrap_negative
from graphmode.capture.onnx.fold import _FLOAT_DTYPES, _Unfoldable, _decide
from graphmode.capture.onnx.importer import _Importer, _handles, _shape_attr
from graphmode.capture.onnx.values import _data_sized
from graphmode.ir.ops import norm_axis
from graphmode.ir.types import TensorType, dim_str, normalize_dim

_IN = [{"$in": i} for i in range(4)]
# ONNX reduction attribute -> scatter_reduce's reduce argument
_REDUCE = {"add": "sum", "mul": "prod", "max": "amax", "min": "amin"}


def _no_unsigned(imp: _Importer, v: str, what: str) -> None:
    dt = imp.g.type_of(v).dtype
    if dt in ("u16", "u32", "u64"):
        raise imp.fail(f"{what} on {dt} values is not supported: torch has no {dt} kernels for it",
                       fix="cast the values to int64 in the model where they fit")


@_handles("TopK")
def _topk(imp: _Importer, n) -> None:
    """A stable sort along the axis, its first K: ties keep the lower index first, as ONNX asks
    (torch.topk leaves the order of ties unspecified)."""
    x = imp.operand(n.input[0])
    xt = imp.g.type_of(x)
    _no_unsigned(imp, x, "TopK")
    axis = norm_axis(int(imp.attr(n, "axis", -1)), xt.rank)
    largest = bool(imp.attr(n, "largest", 1))
    h = n.output[0] or n.output[1]
    if _data_sized(xt.shape[axis]):
        _topk_of_data(imp, n, x, axis, largest, h)
        return
    k = imp.ints_of(n.input[1], "TopK K")[0]
    size = xt.shape[axis]
    if isinstance(size, int) and not 0 <= k <= size:
        raise imp.fail(f"TopK K={k} is outside 0..{size} (the axis' extent)", value=k)
    if not isinstance(size, int) and not _at_least(k, size):
        lo = imp.g.dims.get(dim_str(size), (None,))[0]
        named = dim_str(size).isidentifier()
        err = imp.fail(f"TopK K={k} along {dim_str(size)}, which the recipe lets be shorter than K"
                       + (f" (down to {lo})" if lo is not None else "") + ": ONNX Runtime fails there", value=k,
                       fix=f"dims.{dim_str(size)}.min: {k} or more in the recipe (`graphmode recipe init --dim "
                           f"{dim_str(size)}={k}:MAX` drafts one)" if named else
                       f"give the dims of {dim_str(size)} ranges that keep it at least {k} (raise their min)")
        if named:       # a draft starts the dim there (kb/draft.py)
            err.suggested_ranges = {dim_str(size): (k, None)}
        raise err
    vals, idx = imp.emit_aten("sort", [x], [_IN[0]], {"stable": True, "dim": axis, "descending": largest},
                          overload="stable", hint=h)
    for out, v in zip(n.output, (vals, idx)):
        if out:
            imp.emit("slice", [v], {"dim": axis, "start": 0, "end": k, "step": 1}, out=out)


def _at_least(k: int, size) -> bool:
    """Whether a symbolic extent is >= k at every point of the recipe's ranges."""
    if k < 0:
        return False
    try:
        return _decide(k - sympy.sympify(size), "le")
    except _Unfoldable:
        return False


def _topk_of_data(imp: _Importer, n, x: str, axis: int, largest: bool, h: str) -> None:
    """TopK along a length only the data decides (sorting what a mask kept; its K the length
    itself, a constant, or torchvision's min(k, length)): the same stable sort and first K, as
    eager calls in the tail (capture/tail.py)."""
    from graphmode.capture.onnx.convert_data import _calls
    kk = imp.kn(n.input[1])
    if kk is None or kk.arr.size != 1:
        raise imp.fail("TopK K along a data-dependent length must be known at import (a constant, or a "
                       "size of the model's tensors)", fix="compute K from shapes, not from tensor values")
    k = normalize_dim(kk.arr.flat[0])
    xt = imp.g.type_of(x)
    vals, idx = _calls(imp, "aten.sort.stable", [x], [_IN[0]], [xt, TensorType("i64", xt.shape)], f"{h}_sorted",
                       kwargs={"stable": True, "dim": axis, "descending": largest})
    # a constant K is that many (ONNX Runtime refuses a K past the length: so does the tail's run)
    shape = list(xt.shape)
    shape[axis] = k
    end = {"$dim": dim_str(k)} if not isinstance(k, int) else k
    for out, v, dt in zip(n.output, (vals, idx), (xt.dtype, "i64")):
        if out:
            r, = _calls(imp, "aten.slice.Tensor", [v], [_IN[0], axis, 0, end], [TensorType(dt, tuple(shape))], out)
            imp.ir[out] = r


@_handles("ScatterElements", "Scatter")
def _scatter_elements(imp: _Importer, n) -> None:
    """data with updates written (or reduced) in at indices along axis: scatter / scatter_reduce
    (include_self: the data's own value takes part, as ONNX's reductions define)."""
    data, upd = imp.operand(n.input[0]), imp.operand(n.input[2])
    dt = imp.g.type_of(data)
    _no_unsigned(imp, data, n.op_type)
    axis = norm_axis(int(imp.attr(n, "axis", 0)), dt.rank)
    h = n.output[0]
    idx = _wrap_negative(imp, imp.operand(n.input[1]), dt.shape[axis], h)
    if imp.g.type_of(idx).dtype != "i64":
        idx = imp.emit("cast", [idx], {"dtype": "i64"}, hint=f"{h}_idx")
    y = _scatter(imp, n, data, axis, idx, upd, h)
    _bind(imp, h, y)


def _scatter(imp: _Importer, n, data: str, axis: int, idx: str, upd: str, h: str) -> str:
    reduction = imp.attr_text(n, "reduction", "none")
    if reduction == "none":
        return imp.emit_aten("scatter", [data, idx, upd], [_IN[0], axis, _IN[1], _IN[2]], overload="src", hint=h)[0]
    if reduction not in _REDUCE:
        raise imp.fail(f"{n.op_type} reduction={reduction!r} is not one of none, add, mul, max, min", value=reduction)
    if imp.g.type_of(data).dtype == "bool":
        raise imp.fail(f"{n.op_type} reduction={reduction!r} on bool data is not supported",
                       fix="cast the data to an integer type in the model")
    return imp.emit_aten("scatter_reduce", [data, idx, upd], [_IN[0], axis, _IN[1], _IN[2], _REDUCE[reduction]],
                     {"include_self": True}, overload="two", hint=h)[0]


@_handles("ScatterND")
def _scatter_nd(imp: _Importer, n) -> None:
    """data[indices[..., :]] = updates (or reduced in): the k indexed axes of data flattened into
    one, each index tuple turned into its position there (negative entries count from the end),
    then a scatter along that axis."""
    data, idx, upd = imp.operand(n.input[0]), imp.operand(n.input[1]), imp.operand(n.input[2])
    dt, it = imp.g.type_of(data), imp.g.type_of(idx)
    _no_unsigned(imp, data, "ScatterND")
    h = n.output[0]
    k = _static(imp, it.shape[-1], "ScatterND index depth")
    lead = [_static(imp, d, "ScatterND indexed axes") for d in dt.shape[:k]]
    rest = list(dt.shape[k:])
    count = math.prod(_static(imp, d, "ScatterND index count") for d in it.shape[:-1])
    if imp.g.type_of(idx).dtype != "i64":
        idx = imp.emit("cast", [idx], {"dtype": "i64"}, hint=f"{h}_idx")
    sizes = _const(imp, torch.tensor(lead, dtype=torch.int64), f"{h}_sizes")
    strides = _const(imp, torch.tensor([math.prod(lead[j + 1:]) for j in range(k)], dtype=torch.int64),
                     f"{h}_strides")
    neg = imp.emit("lt", [idx, imp.scalar(0, "i64", f"{h}_zero")], {}, hint=f"{h}_neg")
    idx = imp.emit("where", [neg, imp.emit("add", [idx, sizes], {}, hint=f"{h}_wrapped"), idx], {}, hint=f"{h}_idx")
    pos = imp.emit("sum", [imp.emit("mul", [idx, strides], {}, hint=f"{h}_pos")], {"dims": [it.rank - 1],
                                                                                   "keepdim": False}, hint=f"{h}_pos")
    pos = imp.emit("reshape", [pos], {"shape": _shape_attr([count] + [1] * len(rest))}, hint=f"{h}_pos")
    if rest:
        pos = imp.emit("expand", [pos], {"shape": _shape_attr([count] + rest)}, hint=f"{h}_pos")
    flat = imp.emit("reshape", [data], {"shape": _shape_attr([math.prod(lead)] + rest)}, hint=f"{h}_flat")
    upd = imp.emit("reshape", [upd], {"shape": _shape_attr([count] + rest)}, hint=f"{h}_upd")
    y = _scatter(imp, n, flat, 0, pos, upd, h)
    imp.emit("reshape", [y], {"shape": _shape_attr(list(dt.shape))}, out=h)


@_handles("TensorScatter")
def _tensor_scatter(imp: _Importer, n) -> None:
    """A KV-cache write (opset 24): `update`'s steps along `axis` written into the cache from each
    batch row's write index on (0 without write_indices), wrapped modulo the cache length in
    circular mode: a scatter along `axis` at `write_indices[b] + t`. An index past the cache in
    linear mode is never written around: the scatter step raises, as the op's contract asks."""
    cache, upd = imp.operand(n.input[0]), imp.operand(n.input[1])
    ct, ut = imp.g.type_of(cache), imp.g.type_of(upd)
    axis = norm_axis(int(imp.attr(n, "axis", -2)), ct.rank)
    mode = imp.attr_text(n, "mode", "linear")
    if mode not in ("linear", "circular"):
        raise imp.fail(f"TensorScatter mode={mode!r} is not linear or circular", value=mode)
    if axis == 0:
        raise imp.fail("TensorScatter axis 0 is the batch axis; the sequence axis must be another", value=0,
                       fix="set axis to the cache's sequence axis (default -2)")
    _no_unsigned(imp, cache, "TensorScatter")
    h = n.output[0]
    steps = _static(imp, ut.shape[axis], "TensorScatter update length")
    length = _static(imp, ct.shape[axis], "TensorScatter cache length")
    if steps > length:
        raise imp.fail(f"TensorScatter writes {steps} steps into a cache of {length}", value=steps,
                       fix="the update's sequence length must not exceed the cache's")
    pos = _along(imp, imp.emit("arange", [], {"start": 0, "end": steps, "step": 1, "dtype": "i64"}, hint=f"{h}_t"),
                 axis, ct.rank, f"{h}_t")
    if len(n.input) > 2 and n.input[2]:
        start = imp.operand(n.input[2])
        if imp.g.type_of(start).dtype != "i64":
            start = imp.emit("cast", [start], {"dtype": "i64"}, hint=f"{h}_start")
        pos = imp.emit("add", [_along(imp, start, 0, ct.rank, f"{h}_start"), pos], {}, hint=f"{h}_pos")
    if mode == "circular":
        pos = imp.emit("remainder", [pos, imp.scalar(length, "i64", f"{h}_len")], {}, hint=f"{h}_pos")
    pos = imp.emit("expand", [pos], {"shape": _shape_attr(list(ut.shape))}, hint=f"{h}_pos")
    _bind(imp, h, imp.emit_aten("scatter", [cache, pos, upd], [_IN[0], axis, _IN[1], _IN[2]], overload="src",
                                hint=h)[0])


def _along(imp: _Importer, v: str, axis: int, rank: int, hint: str) -> str:
    """A 1-d value reshaped to rank `rank`, its extent on `axis` and 1 on the other axes."""
    shape = [1] * rank
    shape[axis] = imp.g.type_of(v).shape[0]
    return imp.emit("reshape", [v], {"shape": _shape_attr(shape)}, hint=hint)


@_handles("ReverseSequence")
def _reverse_sequence(imp: _Importer, n) -> None:
    x = imp.operand(n.input[0])
    xt = imp.g.type_of(x)
    t_ax = norm_axis(int(imp.attr(n, "time_axis", 0)), xt.rank)
    b_ax = norm_axis(int(imp.attr(n, "batch_axis", 1)), xt.rank)
    _bind(imp, n.output[0], reversed_by_length(imp, x, imp.operand(n.input[1]), t_ax, b_ax, n.output[0]))


def reversed_by_length(imp: _Importer, x: str, lens: str, t_ax: int, b_ax: int, h: str) -> str:
    """Per batch entry b, the first lens[b] steps along the time axis reversed, the rest kept:
    a gather along time of `lens[b] - 1 - t` where t < lens[b], else t."""
    xt = imp.g.type_of(x)
    if imp.g.type_of(lens).dtype != "i64":
        lens = imp.emit("cast", [lens], {"dtype": "i64"}, hint=f"{h}_lens")
    steps = imp.emit("arange", [], {"start": 0, "end": _shape_attr([xt.shape[t_ax]])[0], "step": 1, "dtype": "i64"},
                     hint=f"{h}_t")
    t = _along(imp, steps, t_ax, xt.rank, f"{h}_t")
    lens = _along(imp, lens, b_ax, xt.rank, f"{h}_lens")
    rev = imp.emit("sub", [imp.emit("sub", [lens, imp.scalar(1, "i64", f"{h}_one")], {}, hint=f"{h}_last"), t], {},
                   hint=f"{h}_rev")
    idx = imp.emit("where", [imp.emit("lt", [t, lens], {}, hint=f"{h}_in"), rev, t], {}, hint=f"{h}_idx")
    idx = imp.emit("expand", [idx], {"shape": _shape_attr(list(xt.shape))}, hint=f"{h}_idx")
    return imp.emit("gather", [x, idx], {"dim": t_ax}, hint=h)


@_handles("Tile")
def _tile(imp: _Importer, n) -> None:
    """x repeated `repeats[i]` times along axis i: each axis gets a new one of the repeat count
    in front of it, broadcast there (expand), then each pair merged (reshape)."""
    x = imp.operand(n.input[0])
    xt = imp.g.type_of(x)
    # a count may be computed from a dim (DeBERTa's relative positions repeated batch times)
    reps = [r if isinstance(r, int) else normalize_dim(r) for r in imp.need_known(n.input[1], "Tile repeats").dims()]
    if len(reps) != xt.rank or any(isinstance(r, int) and r < 0 for r in reps):
        raise imp.fail(f"Tile repeats {reps} must give one count >= 0 per axis of {xt.text()}", value=reps)
    h = n.output[0]
    if all(isinstance(r, int) and r == 1 for r in reps):
        imp.alias(h, n.input[0])
        return
    split = [d for s in xt.shape for d in (1, s)]
    wide = [d for r, s in zip(reps, xt.shape) for d in (r, s)]
    y = imp.emit("reshape", [x], {"shape": _shape_attr(split)}, hint=f"{h}_split")
    y = imp.emit("expand", [y], {"shape": _shape_attr(wide)}, hint=f"{h}_wide")
    imp.emit("reshape", [y], {"shape": _shape_attr([normalize_dim(r * s) for r, s in zip(reps, xt.shape)])}, out=h)


@_handles("CumProd")
def _cumprod(imp: _Importer, n) -> None:
    """cumprod along axis (ONNX opset 26); reverse runs it on the flipped axis, exclusive on the
    input shifted by one step with a 1 in front."""
    x = imp.operand(n.input[0])
    xt = imp.g.type_of(x)
    _no_unsigned(imp, x, "CumProd")
    ax = norm_axis(imp.ints_of(n.input[1], "CumProd axis")[0], xt.rank)
    reverse, exclusive = bool(imp.attr(n, "reverse", 0)), bool(imp.attr(n, "exclusive", 0))
    h = n.output[0]
    size = _static(imp, xt.shape[ax], "CumProd")
    src = imp.emit_aten("flip", [x], [_IN[0], [ax]], hint=f"{h}_rev")[0] if reverse else x
    if exclusive and size > 0:
        one = list(xt.shape)
        one[ax] = 1
        ones = imp.emit("full", [], {"shape": _shape_attr(one), "value": 1, "dtype": xt.dtype}, hint=f"{h}_one")
        head = imp.emit("slice", [src], {"dim": ax, "start": 0, "end": size - 1, "step": 1}, hint=f"{h}_head")
        src = imp.emit("concat", [ones, head], {"dim": ax}, hint=f"{h}_shifted")
    y = imp.emit_aten("cumprod", [src], [_IN[0], ax], {"dtype": {"$dtype": xt.dtype}}, hint=h)[0]
    if reverse:
        y = imp.emit_aten("flip", [y], [_IN[0], [ax]], hint=h)[0]
    _bind(imp, h, y)


@_handles("Det")
def _det(imp: _Importer, n) -> None:
    """The determinant of each trailing square matrix (linalg_det, float inputs only)."""
    x = imp.operand(n.input[0])
    dt = imp.g.type_of(x).dtype
    if dt not in _FLOAT_DTYPES or dt in ("f16", "bf16"):
        raise imp.fail(f"Det of {dt} values is not supported: torch computes determinants in f32 and f64",
                       fix="cast the input to float32 in the model")
    _bind(imp, n.output[0], imp.emit_aten("linalg_det", [x], [_IN[0]], hint=n.output[0])[0])
