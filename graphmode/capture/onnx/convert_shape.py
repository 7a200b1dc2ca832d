"""ONNX converters: reshapes, transposes, slices, gathers, pads, concat/split, ranges."""
from __future__ import annotations


import math
from typing import Any, Sequence

import numpy as np
import sympy
import torch

from graphmode.errors import IRError
from graphmode.ir.ops import broadcast_shapes, norm_axis, resolve_reshape
from graphmode.ir.types import DTYPES, Dim, dim_str, normalize_dim

from graphmode.capture.onnx.checks import CheckedNode, axis_check, check_axes
from graphmode.capture.onnx.fold import BIG_END, KNOWN_LIMIT, _INT_DTYPES, _decide, _Known, _is_sym, _Unfoldable
from graphmode.capture.onnx.importer import STATIC_AXIS_FIX, _Importer, _attr_dim, _handles, _same_shape, _shape_attr
from graphmode.capture.onnx.values import _data_sized, data_length_error


# ---- shape / data movement


def _emit_reshape(imp: _Importer, src: str, shape: Sequence[Dim], out: str) -> None:
    t = imp.type_of(src)
    if _same_shape(t.shape, shape):
        imp.alias(out, src)
        return
    k = imp.kn(src)
    static = all(isinstance(d, int) for d in shape)
    if k is not None and static:
        imp.set_known(out, _Known(k.arr.reshape(tuple(shape)), k.dtype))
        return
    c = imp.const_source(src)
    if c is not None and static:
        imp.set_big(out, c[0].reshape(tuple(shape)), c[1])
        return
    imp.emit("reshape", [imp.operand(src)], {"shape": _shape_attr(shape)}, out=out)


def _resolve_reshape(in_shape: Sequence[Dim], target: Sequence[Dim]) -> tuple[Dim, ...]:
    """The op table's resolve_reshape, with a cheap exact division for the usual polynomial dims."""
    target = [normalize_dim(d) for d in target]
    holes = [i for i, d in enumerate(target) if isinstance(d, int) and d == -1]
    if not holes:
        return tuple(target)
    if len(holes) == 1:
        total = sympy.Mul(*in_shape) if in_shape else sympy.Integer(1)
        known = sympy.Mul(*[d for d in target if not (isinstance(d, int) and d == -1)])
        q = sympy.cancel(sympy.sympify(total) / known)
        if q.is_polynomial() and not q.has(sympy.Function):
            if sympy.fraction(sympy.together(q))[1] == 1:
                target[holes[0]] = normalize_dim(q)
                return tuple(target)
    return resolve_reshape(in_shape, target)


def _check_reshape(nd: CheckedNode) -> None:
    s = nd.const(1)
    if s is None:
        return
    vals = [int(v) for v in s.reshape(-1)]
    if sum(v == -1 for v in vals) > 1 or any(v < -1 for v in vals) or \
            (nd.attrs.get("allowzero", 0) and 0 in vals and -1 in vals):
        raise nd.fail(f"shape {nd.input(1)!r} = {vals} is invalid: at most one -1, no value below -1 (and with "
                      "allowzero=1 no 0 next to a -1)", vals, "re-export the model with a valid target shape")


@_handles("Reshape", check=_check_reshape)
def _reshape(imp: _Importer, n) -> None:
    src = n.input[0]
    t = imp.type_of(src)
    target = imp.need_known(n.input[1], "Reshape shape").dims()
    allowzero = imp.attr(n, "allowzero", 0)
    if not allowzero:
        target = [t.shape[i] if isinstance(d, int) and d == 0 else d for i, d in enumerate(target)]
    try:
        shape = _resolve_reshape(t.shape, target)
    except IRError as e:
        raise imp.fail(f"Reshape: {e.message}") from None
    _emit_reshape(imp, src, shape, n.output[0])


@_handles("Flatten", check=axis_check(extra=1, default=1))
def _flatten(imp: _Importer, n) -> None:
    t = imp.type_of(n.input[0])
    axis = imp.attr(n, "axis", 1)
    axis = axis + t.rank if axis < 0 else axis

    def prod(ds):
        p: Any = 1
        for d in ds:
            p = p * d
        return normalize_dim(p)
    _emit_reshape(imp, n.input[0], [prod(t.shape[:axis]), prod(t.shape[axis:])], n.output[0])


def _axes_arg(imp: _Importer, n, what: str) -> list[int] | None:
    ax_in = imp.opt_in(n, 1)
    if ax_in:
        return imp.ints_of(ax_in, f"{what} axes")
    a = imp.attr(n, "axes", None)
    return list(a) if a is not None else None


@_handles("Unsqueeze", check=check_axes)
def _unsqueeze(imp: _Importer, n) -> None:
    t = imp.type_of(n.input[0])
    axes = _axes_arg(imp, n, "Unsqueeze") or []
    r = t.rank + len(axes)
    axes = sorted(norm_axis(a, r) for a in axes)
    shape = list(t.shape)
    for a in axes:
        shape.insert(a, 1)
    _emit_reshape(imp, n.input[0], shape, n.output[0])


@_handles("Squeeze", check=check_axes)
def _squeeze(imp: _Importer, n) -> None:
    t = imp.type_of(n.input[0])
    axes = _axes_arg(imp, n, "Squeeze")
    if axes is None:
        dynamic = [dim_str(d) for d in t.shape if not isinstance(d, int)]
        if dynamic:       # ONNX squeezes every axis of size 1 at run time: the output's rank follows the sizes
            raise imp.fail(f"Squeeze without axes of an input with dynamic dim(s) {', '.join(dynamic)}: each of them "
                           "is squeezed too when it is 1, so the output's rank depends on the request",
                           fix="give Squeeze its axes (an `axes` input from opset 13, the attribute before), or fix "
                               f"{dynamic[0]} in the model (or export it with a static size)")
        axes = [i for i, d in enumerate(t.shape) if isinstance(d, int) and d == 1]
    axes = {norm_axis(a, t.rank) for a in axes}
    for a in axes:
        if not (isinstance(t.shape[a], int) and t.shape[a] == 1):
            raise imp.fail(f"Squeeze of dim {a} of size {dim_str(t.shape[a]) if not isinstance(t.shape[a], int) else t.shape[a]}, not 1")
    _emit_reshape(imp, n.input[0], [d for i, d in enumerate(t.shape) if i not in axes], n.output[0])


def _check_transpose(nd: CheckedNode) -> None:
    perm, x = nd.attrs.get("perm"), nd.dims(0)
    if perm is not None and x is not None and sorted(perm) != list(range(len(x))):
        raise nd.fail(f"attribute perm={perm} is not a permutation of the input's {len(x)} axes", perm,
                      f"give perm as an ordering of {list(range(len(x)))}")


@_handles("Transpose", check=_check_transpose)
def _transpose(imp: _Importer, n) -> None:
    t = imp.type_of(n.input[0])
    perm = list(imp.attr(n, "perm", list(range(t.rank))[::-1]))
    if perm == list(range(t.rank)):
        imp.alias(n.output[0], n.input[0])
        return
    k = imp.kn(n.input[0])
    if k is not None:
        imp.set_known(n.output[0], _Known(np.transpose(k.arr, perm), k.dtype))
        return
    c = imp.const_source(n.input[0])
    if c is not None:   # e.g. the dynamo exporter's Transpose(wte) feeding the LM head MatMul
        imp.set_big(n.output[0], c[0].permute(perm), c[1])
        return
    imp.emit("permute", [imp.operand(n.input[0])], {"perm": perm}, out=n.output[0])


@_handles("Concat", check=axis_check(default=None))
def _concat(imp: _Importer, n) -> None:
    ins = [i for i in n.input if i]
    t0 = imp.type_of(ins[0])
    axis = norm_axis(imp.attr(n, "axis"), t0.rank)
    ks = [imp.kn(i) for i in ins]
    if all(k is not None for k in ks):
        imp.set_known(n.output[0], _Known(np.concatenate([k.arr for k in ks], axis=axis), ks[0].dtype))
        return
    # drop empty pieces (static 0-size along axis), they are legal in ONNX
    ins = [i for i in ins if not (isinstance(imp.type_of(i).shape[axis], int) and imp.type_of(i).shape[axis] == 0)]
    if len(ins) == 1:
        imp.alias(n.output[0], ins[0])
        return
    imp.emit("concat", [imp.operand(i) for i in ins], {"dim": axis}, out=n.output[0])


def _check_split(nd: CheckedNode) -> None:
    x = nd.dims(0)
    rank = len(x) if x is not None else None
    nd.axis("axis", 0, rank)
    sizes = nd.attrs.get("split")
    if sizes is None and nd.const(1) is not None:
        sizes = [int(v) for v in nd.const(1).reshape(-1)]
    if sizes is None or rank is None:
        return
    dim = x[nd.attrs.get("axis", 0) % rank]
    if any(s < 0 for s in sizes) or isinstance(dim, int) and sum(sizes) != dim or len(sizes) != len(nd.n.output):
        raise nd.fail(f"split sizes {sizes} must be >= 0, one per output ({len(nd.n.output)}), and sum to the "
                      f"split dim ({dim})", sizes, "fix the split sizes in the model")
    if not isinstance(dim, int):       # eager and ONNX Runtime refuse any other extent; a plan would not
        raise nd.fail(f"split sizes {sizes} fix the split axis at {sum(sizes)}, which the recipe leaves dynamic "
                      f"({dim_str(dim)})", sizes, f"declare that axis as the fixed size {sum(sizes)} in the recipe's "
                      "inputs, or export the model without a dynamic axis there")


@_handles("Split", check=_check_split)
def _split(imp: _Importer, n) -> None:
    t = imp.type_of(n.input[0])
    axis = norm_axis(imp.attr(n, "axis", 0), t.rank)
    outs = list(n.output)
    sp_in = imp.opt_in(n, 1)
    if sp_in:
        sizes = imp.ints_of(sp_in, "Split sizes")
    elif imp.attr(n, "split", None) is not None:
        sizes = list(imp.attr(n, "split"))
    else:
        size = t.shape[axis]
        if not isinstance(size, int):
            raise imp.fail(f"Split of symbolic dim {dim_str(size)} into equal parts",
                           fix="give explicit split sizes in the model")
        parts = imp.attr(n, "num_outputs", len(outs))
        chunk = -(-size // parts)
        sizes = [min(chunk, size - i * chunk) for i in range(parts)]
    k = imp.kn(n.input[0])
    start = 0
    for o, s in zip(outs, sizes):
        if o:
            if k is not None:
                idx = [slice(None)] * t.rank
                idx[axis] = slice(start, start + s)
                imp.set_known(o, _Known(k.arr[tuple(idx)], k.dtype))
            else:
                imp.emit("slice", [imp.operand(n.input[0])], {"dim": axis, "start": start, "end": start + s, "step": 1},
                         out=o)
        start += s


@_handles("Slice")
def _slice(imp: _Importer, n) -> None:
    src = n.input[0]
    t = imp.type_of(src)
    starts = imp.need_known(n.input[1], "Slice starts").dims()
    ends = imp.need_known(n.input[2], "Slice ends").dims()
    axes = imp.ints_of(n.input[3], "Slice axes") if imp.opt_in(n, 3) else list(range(len(starts)))
    steps = imp.ints_of(n.input[4], "Slice steps") if imp.opt_in(n, 4) else [1] * len(starts)
    k = imp.kn(src)
    specs = []
    for s, e, a, st in zip(starts, ends, axes, steps):
        a = norm_axis(a, t.rank)
        if st == 0:
            raise imp.fail("Slice step 0")
        if not isinstance(s, int):
            raise imp.fail(f"Slice start {dim_str(s)} is symbolic", fix="only the end of a slice may be symbolic")
        if isinstance(e, int) and e >= BIG_END:
            e = BIG_END
        if isinstance(e, int) and e <= -BIG_END:
            e = -BIG_END
        s, e = _clamped_over_ranges(t.shape[a], s, e, st)
        specs.append((a, s, e, st))
    if k is not None and all(isinstance(e, int) for _, _, e, _ in specs):
        idx = [slice(None)] * t.rank
        for a, s, e, st in specs:
            idx[a] = slice(s, e, st)
        imp.set_known(n.output[0], _Known(k.arr[tuple(idx)], k.dtype))
        return
    cur = imp.operand(src)
    todo = [sp for sp in specs if not (sp[1] == 0 and sp[3] == 1 and isinstance(sp[2], int) and sp[2] >= BIG_END)]
    if not todo:
        imp.alias(n.output[0], src)
        return
    for j, (a, s, e, st) in enumerate(todo):
        last = j == len(todo) - 1
        if st < 0:      # the positions Python's slicing picks (ONNX clamps the same way), gathered
            size = imp.type_of(src).shape[a]
            if not isinstance(size, int) and _data_sized(size):
                raise data_length_error(imp, "Slice with a negative step", size)
            if not isinstance(size, int) or not isinstance(e, int):
                raise imp.fail("Slice with a negative step over a symbolic extent",
                               fix=STATIC_AXIS_FIX)
            picks = imp.materialise(_Known.of(torch.arange(size)[list(range(size))[s:e:st]]), f"{n.output[0]}_picks")
            cur = imp.emit("index_select", [cur, picks], {"dim": a}, out=n.output[0] if last else None,
                           hint=n.output[0])
            continue
        cur = imp.emit("slice", [cur], {"dim": a, "start": s, "end": _attr_dim(e), "step": st},
                       out=n.output[0] if last else None, hint=n.output[0])


def _clamped_over_ranges(size: Dim, start: int, end: Dim, step: int) -> tuple[int, Dim]:
    """ONNX clamps a slice's bounds to the axis; the IR's slice over a symbolic axis takes a
    constant end as the end and a negative start as counted from the end, which holds only where
    the axis reaches them. Where the recipe's ranges put a bound past the axis at every dim value
    (x[:, 1:1000] with seq <= 512, x[:, -8:] with seq <= 8), it is the axis's own end (start),
    as ONNX Runtime reads it; where they leave it open, the recipe's proof refuses the dims that
    would read past the axis (analysis/extents.py)."""
    if isinstance(size, int) or step < 0:
        return start, end

    def always(expr: Any) -> bool:
        try:
            return _decide(expr, "le")
        except _Unfoldable:
            return False
    if isinstance(end, int) and 0 <= end < BIG_END and always(size - end):
        end = BIG_END
    if start < 0 and always(size + start):
        start = 0
    return start, end


_INDEX_MOVES = ("reshape", "expand", "slice", "permute", "index_select", "concat", "identity", "cast")


def _nonnegative(imp: _Importer, v: str, depth: int = 0) -> bool:
    """`v` is known to hold no negative value: an `arange` counting up from >= 0, an arg-max/min,
    sums and products of those, or those moved around (the position ids and the flattened mask
    indices of exported transformers)."""
    if v in imp.g.constants:
        return bool((imp.g.constants[v] >= 0).all())
    node = imp.g.producers().get(v) if depth < 8 else None
    if node is None:
        return False
    if node.op == "arange":
        start, step = node.attrs.get("start", 0), node.attrs.get("step", 1)
        return isinstance(step, int) and step > 0 and (not isinstance(start, int) or start >= 0)
    if node.op in ("argmax", "argmin"):
        return True
    return node.op in _INDEX_MOVES + ("add", "mul") and all(_nonnegative(imp, i, depth + 1) for i in node.inputs)


def _wrap_negative(imp: _Importer, idx: str, size, hint: str) -> str:
    """ONNX indices count from the end when negative: `where(idx < 0, idx + size, idx)` (left out
    where the indices cannot be negative)."""
    if _nonnegative(imp, idx):
        return idx
    dt = imp.g.type_of(idx).dtype
    neg = imp.emit("lt", [idx, imp.scalar(0, dt, f"{hint}_zero")], {}, hint=f"{hint}_neg")
    shifted = imp.emit("add", [idx, imp.scalar(size, dt, f"{hint}_size")], {}, hint=f"{hint}_wrapped")
    return imp.emit("where", [neg, shifted, idx], {}, hint=f"{hint}_idx")


def _check_gather(nd: CheckedNode) -> None:
    x = nd.dims(0)
    rank = len(x) if x is not None else None
    nd.axis("axis", 0, rank)
    idx = nd.const(1)
    if idx is None or rank is None or not np.issubdtype(idx.dtype, np.integer):
        return
    size = x[nd.attrs.get("axis", 0) % rank]
    if isinstance(size, int) and idx.size and (int(idx.min()) < -size or int(idx.max()) >= size):
        bad = int(idx.max()) if int(idx.max()) >= size else int(idx.min())
        raise nd.fail(f"constant indices {nd.input(1)!r} hold {bad}, out of range for a dim of size {size} "
                      f"(valid: {-size}..{size - 1})", bad, "fix the indices in the model")


@_handles("Gather", check=_check_gather)
def _gather(imp: _Importer, n) -> None:
    data, idx = n.input[0], n.input[1]
    dt, it = imp.type_of(data), imp.type_of(idx)
    axis = norm_axis(imp.attr(n, "axis", 0), dt.rank)
    kd, ki = imp.kn(data), imp.kn(idx)
    size = dt.shape[axis]
    if kd is not None and ki is not None and ki.concrete:
        ids = np.array([int(v) + (size if int(v) < 0 else 0) for v in ki.arr.flat], dtype=np.int64).reshape(ki.shape)
        imp.set_known(n.output[0], _Known(np.take(kd.arr, ids, axis=axis), kd.dtype))
        return
    out = n.output[0]
    if axis == 0 and dt.rank == 2 and imp.is_const(data) and it.dtype in ("i64", "i32") and \
            not (ki is not None and ki.concrete):
        imp.emit("embedding", [imp.operand(data), _wrap_negative(imp, imp.operand(idx), size, out)], {}, out=out)
        return
    x = imp.operand(data)
    if ki is not None and ki.concrete and it.rank == 0:
        i = int(ki.arr.flat[0])
        if i < 0 and not isinstance(size, int):
            end = i + 1 if i != -1 else BIG_END
        else:
            i = i + size if i < 0 else i
            end = i + 1
        s = imp.emit("slice", [x], {"dim": axis, "start": i, "end": end, "step": 1}, hint=f"{out}_sel")
        shape = [d for j, d in enumerate(dt.shape) if j != axis]
        imp.emit("reshape", [s], {"shape": _shape_attr(shape)}, out=out)
        return
    if ki is not None and ki.concrete and isinstance(size, int):
        ids = torch.tensor([int(v) + (size if int(v) < 0 else 0) for v in ki.arr.flat], dtype=torch.int64)
        if it.rank == 1:
            imp.emit("index_select", [x, imp.materialise(_Known.of(ids), f"{out}_idx")], {"dim": axis}, out=out)
            return
        i_v = imp.materialise(_Known.of(ids.reshape(ki.shape)), f"{out}_idx")
    else:
        i_v = _wrap_negative(imp, imp.operand(idx), size, out)
    if it.rank == 1:
        imp.emit("index_select", [x, i_v], {"dim": axis}, out=out)
    else:
        imp.emit("index", [x, i_v], {"dims": [axis]}, out=out)


@_handles("GatherND")
def _gather_nd(imp: _Importer, n) -> None:
    """x[i_0, ..., i_k-1] with the index tuples along the indices' last axis; each of the first
    batch_dims axes is indexed by its own position (an arange), shared by data and indices."""
    batch = int(imp.attr(n, "batch_dims", 0))
    x = imp.operand(n.input[0])
    xt, it = imp.type_of(n.input[0]), imp.type_of(n.input[1])
    depth = it.shape[-1]
    if not isinstance(depth, int):
        raise imp.fail("GatherND with a symbolic index depth")
    ind = imp.operand(n.input[1])
    lead = list(it.shape[:-1])
    idx = []
    for j in range(batch):
        pos = imp.emit("arange", [], {"start": 0, "end": _attr_dim(lead[j]), "step": 1, "dtype": "i64"},
                       hint=f"{n.output[0]}_b{j}")
        pos = imp.emit("reshape", [pos], {"shape": _shape_attr([1] * j + [lead[j]] + [1] * (len(lead) - j - 1))},
                       hint=f"{n.output[0]}_b{j}")
        idx.append(imp.emit("expand", [pos], {"shape": _shape_attr(lead)}, hint=f"{n.output[0]}_b{j}"))
    columns = _concat_columns(imp, ind, it.rank - 1, depth)
    for j in range(depth):
        s = columns[j] if columns else imp.emit("slice", [ind], {"dim": it.rank - 1, "start": j, "end": j + 1,
                                                                 "step": 1}, hint=f"{n.output[0]}_i{j}")
        i_j = imp.emit("reshape", [s], {"shape": _shape_attr(lead)}, hint=f"{n.output[0]}_i{j}")
        if imp.g.type_of(i_j).dtype != "i64":
            i_j = imp.emit("cast", [i_j], {"dtype": "i64"}, hint=f"{n.output[0]}_i{j}")
        idx.append(_wrap_negative(imp, i_j, xt.shape[batch + j], f"{n.output[0]}_i{j}"))
    imp.emit("index", [x] + idx, {"dims": list(range(batch + depth))}, out=n.output[0])


def _concat_columns(imp: _Importer, ind: str, axis: int, depth: int) -> list[str] | None:
    """The index tuples' columns as they were built, where the indices are a concat of `depth`
    one-wide columns along their last axis (dynamo's `x[arange(B)[:, None], arange(S)]`): indexing
    by the columns themselves keeps what the padding analysis knows of them (an arange over a
    padded dim), which a slice of the concat loses."""
    node = imp.g.producers().get(ind)
    if node is None or node.op != "concat" or node.attrs.get("dim") not in (axis, -1) or len(node.inputs) != depth:
        return None
    cols = list(node.inputs)
    return cols if all(imp.g.type_of(c).shape[-1] == 1 for c in cols) else None


@_handles("Expand")
def _expand(imp: _Importer, n) -> None:
    src = n.input[0]
    t = imp.type_of(src)
    target = imp.need_known(n.input[1], "Expand shape").dims()
    try:
        shape = broadcast_shapes(t.shape, target)
    except IRError as e:
        raise imp.fail(f"Expand: {e.message}") from None
    if _same_shape(shape, t.shape):
        imp.alias(n.output[0], src)
        return
    k = imp.kn(src)
    if k is not None and all(isinstance(d, int) for d in shape) and math.prod(shape) <= KNOWN_LIMIT:
        imp.set_known(n.output[0], _Known(np.broadcast_to(k.arr, tuple(shape)).copy(), k.dtype))
        return
    imp.emit("expand", [imp.operand(src)], {"shape": _shape_attr(shape)}, out=n.output[0])


@_handles("ConstantOfShape")
def _constant_of_shape(imp: _Importer, n) -> None:
    from onnx import numpy_helper
    shape = imp.need_known(n.input[0], "ConstantOfShape shape").dims()
    v = imp.attr(n, "value", None)
    val = torch.from_numpy(numpy_helper.to_array(v).copy()).reshape(-1) if v is not None else torch.zeros(1)
    if all(isinstance(d, int) for d in shape) and math.prod(shape) <= KNOWN_LIMIT:
        imp.set_tensor(n.output[0], val.expand(*shape).clone() if shape else val.reshape(()).clone())
        return
    from graphmode.ir.types import TORCH_TO_DTYPE
    dt = TORCH_TO_DTYPE[val.dtype]
    scalar = val.item()
    imp.emit("full", [], {"shape": _shape_attr(shape), "value": scalar, "dtype": dt}, out=n.output[0])


@_handles("Range")
def _range(imp: _Importer, n) -> None:
    ks = [imp.need_known(i, f"Range {w}") for i, w in zip(n.input, ("start", "limit", "delta"))]
    start, limit, delta = (k.arr.flat[0] for k in ks)
    dtype = ks[0].dtype
    if all(not _is_sym(v) for v in (start, limit, delta)):
        imp.set_tensor(n.output[0], torch.arange(start, limit, delta, dtype=DTYPES[dtype]))
        return
    if dtype in ("f32", "f64"):
        start, limit, delta = _whole_range(imp, start, limit, delta)
    elif _is_sym(delta) or dtype not in _INT_DTYPES or int(delta) != delta:
        raise imp.fail("Range with a symbolic or non-integer step is not supported")
    imp.emit("arange", [], {"start": _attr_dim(normalize_dim(start)), "end": _attr_dim(normalize_dim(limit)),
                            "step": int(delta), "dtype": dtype}, out=n.output[0])


def _whole_range(imp: _Importer, start, limit, delta) -> tuple:
    """A float Range over a dim (torch.arange(x.shape[1], dtype=float): Cast(size) as its limit) as
    the integer arange it is: ONNX Runtime counts ceil((limit - start) / delta) elements and adds
    delta to start one at a time, which for whole-number start and delta and a limit made of dims
    gives exactly the integers arange makes (below 2**24, far past any dim). Any other float Range
    (a fractional step, a size scaled by 0.5) rounds in ways the IR's arange does not repeat."""
    whole = all(not _is_sym(v) and float(v).is_integer() for v in (start, delta)) and int(delta) != 0
    if not (whole and _dim_expr(limit)):
        shown = [_show(v) for v in (start, limit, delta)]
        raise imp.fail(f"a float Range from {shown[0]} to {shown[1]} by {shown[2]} over a size the dims decide: "
                       "graphmode imports one whose start and delta are whole numbers and whose limit is a size "
                       "(Cast of a Shape element), which ONNX Runtime counts exactly", value=shown,
                       fix="compute the range as int64 (torch.arange(n)) and Cast the result to float, or scale it "
                           "after the Range (torch.arange(n).float() * 0.5)")
    return int(start), normalize_dim(sympy.sympify(limit)), int(delta)


def _dim_expr(v) -> bool:
    """A size expression of the recipe's dims: a whole number at every dim value."""
    return _is_sym(v) and bool(sympy.sympify(v).is_integer)


def _show(v) -> str:
    return dim_str(normalize_dim(v)) if _dim_expr(v) else str(v)


@_handles("Trilu")
def _trilu(imp: _Importer, n) -> None:
    k = imp.ints_of(n.input[1], "Trilu k")[0] if imp.opt_in(n, 1) else 0
    op = "triu" if imp.attr(n, "upper", 1) else "tril"
    imp.emit(op, [imp.operand(n.input[0])], {"diagonal": k}, out=n.output[0])


@_handles("Pad")
def _pad(imp: _Importer, n) -> None:
    mode = imp.attr_text(n, "mode", "constant")
    if mode not in ("constant", "edge", "reflect", "wrap"):
        raise imp.fail(f"Pad mode {mode!r} is not supported", fix="constant, edge, reflect or wrap")
    t = imp.type_of(n.input[0])
    pads = imp.ints_of(n.input[1], "Pad pads")
    axes = imp.ints_of(n.input[3], "Pad axes") if imp.opt_in(n, 3) else list(range(t.rank))
    axes = [a % t.rank for a in axes]
    if mode != "constant":
        _pad_by_index(imp, n, mode, t, {a: (pads[i], pads[i + len(axes)]) for i, a in enumerate(axes)})
        return
    value = 0.0
    if imp.opt_in(n, 2):
        k = imp.need_known(n.input[2], "Pad constant_value")
        value = float(k.tensor().reshape(-1)[0]) if k.tensor().numel() else 0.0
    per_axis = {a: (pads[i], pads[i + len(axes)]) for i, a in enumerate(axes)}
    if not any(b or e for b, e in per_axis.values()):
        imp.alias(n.output[0], n.input[0])
        return
    if any(isinstance(t.shape[a], int) and t.shape[a] + min(b, 0) + min(e, 0) < 0 for a, (b, e) in per_axis.items()):
        # a negative pad crops past the whole axis: only the pad value is left (torch's pad refuses that)
        shape = [normalize_dim(d + sum(per_axis.get(a, (0, 0)))) for a, d in enumerate(t.shape)]
        imp.emit("full", [], {"shape": _shape_attr(shape), "value": value, "dtype": t.dtype}, out=n.output[0])
        return
    first = min(a for a, (b, e) in per_axis.items() if b or e)      # F.pad order: last axis first
    order = [v for a in range(t.rank - 1, first - 1, -1) for v in per_axis.get(a, (0, 0))]
    imp.emit("pad", [imp.operand(n.input[0])], {"pads": order, "value": value}, out=n.output[0])


def _pad_by_index(imp: _Importer, n, mode: str, t, per_axis: dict[int, tuple[int, int]]) -> None:
    """edge / reflect / wrap padding: along each padded axis, an index_select of the source
    position every output position copies. As ONNX Runtime does it, negative pads crop first and
    the positive pads then edge / reflect / wrap the cropped extent ([0 1 2 3 4] with pads (2, -1)
    wraps to [2 3 0 1 2 3]); what it refuses is refused here too."""
    x = imp.operand(n.input[0])
    for a, (b, e) in sorted(per_axis.items()):
        if not b and not e:
            continue
        size = t.shape[a]
        if not isinstance(size, int) or size < 1:
            raise imp.fail(f"Pad mode {mode!r} along a symbolic or empty axis {a}",
                           fix=STATIC_AXIS_FIX)
        lo = max(-b, 0)
        idx = [lo + j for j in _pad_positions(imp, mode, a, size - lo - max(-e, 0), max(b, 0), max(e, 0))]
        x = imp.emit("index_select", [x, imp.materialise(_Known.of(torch.tensor(idx)), f"{n.output[0]}_idx{a}")],
                     {"dim": a}, hint=n.output[0])
    if x == imp.operand(n.input[0]):
        imp.alias(n.output[0], n.input[0])
        return
    imp.ir[n.output[0]] = x
    imp.check_declared(n.output[0])


def _pad_positions(imp: _Importer, mode: str, axis: int, kept: int, before: int, after: int) -> list[int]:
    """The position in the cropped extent (`kept` elements) each output position copies."""
    if kept < 1 and (before or after):
        raise imp.fail(f"Pad mode {mode!r} crops axis {axis} to {kept} elements and then pads it: there is "
                       "nothing left to copy (ONNX Runtime refuses it too)", value=kept,
                       fix="make the negative pads of that axis leave at least one element")
    if mode == "reflect" and max(before, after) >= kept:
        raise imp.fail(f"Pad mode 'reflect' pads axis {axis} by {max(before, after)}, but only {kept} elements are "
                       "left to reflect (after any negative pad): a reflection needs pads smaller than the extent "
                       "(ONNX Runtime refuses it, and its reference implementation reflects again)",
                       value=max(before, after), fix="pad by less than the axis's extent, or use mode 'edge' or "
                                                      "'wrap'")
    period = max(2 * kept - 2, 1)
    out = []
    for i in range(-before, kept + after):
        if mode == "edge":
            j = min(max(i, 0), kept - 1)
        elif mode == "wrap":
            j = i % kept
        else:
            j = i % period
            j = j if j < kept else period - j
        out.append(j)
    return out


@_handles("GatherElements")
def _gather_elements(imp: _Importer, n) -> None:
    t = imp.type_of(n.input[0])
    axis = norm_axis(imp.attr(n, "axis", 0), t.rank)
    idx = _wrap_negative(imp, imp.operand(n.input[1]), t.shape[axis], n.output[0])
    imp.emit("gather", [imp.operand(n.input[0]), idx], {"dim": axis}, out=n.output[0])


def _block_args(imp: _Importer, n) -> tuple[int, list[Dim]]:
    t = imp.type_of(n.input[0])
    b = imp.attr(n, "blocksize", None)
    if t.rank != 4 or not isinstance(b, int) or b < 1:
        raise imp.fail(f"{n.op_type} takes a rank-4 [N, C, H, W] input and a positive blocksize (got rank {t.rank}, "
                       f"blocksize {b})", fix="give a 4-D NCHW input and blocksize >= 1")
    return b, list(t.shape)


@_handles("DepthToSpace")
def _depth_to_space(imp: _Importer, n) -> None:
    """[N, C, H, W] -> [N, C / b^2, H * b, W * b]: a reshape, a transpose and a reshape, in DCR
    (depth-column-row, the default) or CRD order, at every opset (opset 28's function body only
    from there)."""
    b, (N, C, H, W) = _block_args(imp, n)
    mode = imp.attr_text(n, "mode", "DCR")
    if not isinstance(C, int) or C % (b * b) or mode not in ("DCR", "CRD"):
        raise imp.fail(f"DepthToSpace of {dim_str(C) if not isinstance(C, int) else C} channels by blocksize {b} "
                       f"in mode {mode}", fix=f"channels a multiple of {b * b}, mode DCR or CRD")
    c = C // (b * b)
    split, perm = ([N, b, b, c, H, W], [0, 3, 4, 1, 5, 2]) if mode == "DCR" else ([N, c, b, b, H, W], [0, 1, 4, 2, 5, 3])
    x = imp.emit("reshape", [imp.operand(n.input[0])], {"shape": _shape_attr(split)}, hint=n.output[0])
    x = imp.emit("permute", [x], {"perm": perm}, hint=n.output[0])
    imp.emit("reshape", [x], {"shape": _shape_attr([N, c, normalize_dim(H * b), normalize_dim(W * b)])},
             out=n.output[0])


@_handles("SpaceToDepth")
def _space_to_depth(imp: _Importer, n) -> None:
    """[N, C, H, W] -> [N, C * b^2, H / b, W / b], DepthToSpace's inverse in its mode (DCR, or
    CRD from opset 28)."""
    b, (N, C, H, W) = _block_args(imp, n)
    mode = imp.attr_text(n, "mode", "DCR")
    if mode not in ("DCR", "CRD"):
        raise imp.fail(f"SpaceToDepth mode {mode!r}", fix="mode DCR or CRD")
    if not all(isinstance(d, int) and d % b == 0 for d in (H, W)):
        raise imp.fail(f"SpaceToDepth of H, W = {dim_str(H)}, {dim_str(W)} by blocksize {b}: each must be a fixed "
                       f"multiple of {b}", fix=f"export the model with static H and W, multiples of {b}")
    x = imp.emit("reshape", [imp.operand(n.input[0])], {"shape": _shape_attr([N, C, H // b, b, W // b, b])},
                 hint=n.output[0])
    x = imp.emit("permute", [x], {"perm": [0, 3, 5, 1, 2, 4] if mode == "DCR" else [0, 1, 3, 5, 2, 4]},
                 hint=n.output[0])
    imp.emit("reshape", [x], {"shape": _shape_attr([N, normalize_dim(C * b * b), H // b, W // b])},
             out=n.output[0])
