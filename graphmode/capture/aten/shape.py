"""ATen converters of shape and data ops: views, permutes, slices, splits, concatenation,
padding, indexing, ranges, fills and repeats."""
from __future__ import annotations

import sympy
import torch

from graphmode.capture.aten.emit import emit_aten_reference, repeat_axis
from graphmode.capture.aten.registry import converts
from graphmode.ir.graph import clean_name
from graphmode.ir.types import TORCH_TO_DTYPE, constant_on, dim_str, dims_equal


# ---------------------------------------------------------------------------------- shape

@converts("aten.clone.default", "aten.contiguous.default", "aten.alias.default", "aten.detach.default",
          "aten.lift_fresh_copy.default")
def _identity(imp, node, a):
    imp.emit(node, "identity", [imp.operand(a["self"])])
    return True


@converts("aten.dropout.default", "aten.feature_dropout.default", "aten.alpha_dropout.default",
          "aten.feature_alpha_dropout.default", "aten.native_dropout.default")
def _dropout(imp, node, a):
    """Dropout outside training (or with p = 0) is the identity; in training it is random (an
    eager island). native_dropout's second output, the keep mask, is then all true."""
    if a["train"] is not False and a["p"] != 0:     # native_dropout's train=None means training
        return False
    src = imp.operand(a["input"])
    val = node.meta["val"]
    if not isinstance(val, (tuple, list)):
        imp.emit(node, "identity", [src])
        return True
    out, = imp.g.add_node("identity", [src], [imp.ttype(val[0])], names=[clean_name(node.name)])
    mask, = imp.g.add_node("full", [], [imp.ttype(val[1])], {"shape": [imp.attr_dim(d) for d in val[1].shape],
                                                             "value": True, "dtype": "bool"},
                           names=[clean_name(node.name + "_mask")])
    imp.env[node] = (out, mask)
    return True


def _settled(imp, x: str) -> str:
    """`x` sliced to the one value each axis takes over the dims' ranges, where its formula alone
    does not say it (EfficientNet's pool of a whole map: floor(H/10240 - 1/320) + 1 is 1 for every
    H of the recipe's range): a slice [0:c] of an axis of c positions is the axis itself."""
    for ax, d in enumerate(imp.g.type_of(x).shape):
        c = None if isinstance(d, int) else constant_on(d, imp.g.dims)
        if c is not None:
            xt = imp.g.type_of(x)
            x, = imp.g.add_node("slice", [x], [xt.with_shape(xt.shape[:ax] + (c,) + xt.shape[ax + 1:])],
                                {"dim": ax, "start": 0, "end": c, "step": 1})
    return x


@converts("aten.view.default", "aten.reshape.default", "aten._unsafe_view.default", "aten.unsqueeze.default",
          "aten.squeeze.dim", "aten.squeeze.dims", "aten.squeeze.default", "aten.flatten.using_ints",
          "aten.unflatten.int", "aten.view_as.default")
def _view(imp, node, a):
    x = imp.operand(a["self"])
    xt, out = imp.g.type_of(x), imp.ttype(node.meta["val"])
    if not dims_equal(xt.numel(), out.numel()):
        x = _settled(imp, x)
        xt = imp.g.type_of(x)
    if not dims_equal(xt.numel(), out.numel()):
        # torch.export kept a size computed from the example's shape (DPT: int(n ** 0.5) for a square
        # grid) while leaving the dims free: the view holds at the example only, and a reshape that
        # moves elements between rows at other shapes must never reach a plan
        from graphmode.capture.torch_import import _source_loc
        from graphmode.errors import CaptureError
        raise CaptureError(f"the view at {_source_loc(node)} reshapes {xt.text()} to {out.text()}, which holds at "
                           "the example's shape only: the model computes a size there from its input's shape that "
                           "torch.export fixed at the example's value", where=f"node {node.name}",
                           fix="fix the dims this view reads at the example's sizes in the recipe (inputs[].shape), "
                               "or send only shapes for which the model's own size computation holds (e.g. square "
                               "images) as separate recipes")
    imp.emit(node, "reshape", [x], {"shape": [imp.attr_dim(s) for s in node.meta["val"].shape]})
    return True


@converts("aten.permute.default")
def _permute(imp, node, a):
    rank = len(node.meta["val"].shape)
    imp.emit(node, "permute", [imp.operand(a["self"])], {"perm": [int(p) % rank for p in a["dims"]]})
    return True


@converts("aten.transpose.int", "aten.t.default")
def _transpose(imp, node, a):
    rank = len(node.meta["val"].shape)
    if rank <= 1:                   # t / transpose(0, -1) of a 0-d or 1-d tensor is the tensor itself
        return _view(imp, node, a)
    d0, d1 = (a["dim0"], a["dim1"]) if "dim0" in a else (0, 1)
    perm = list(range(rank))
    perm[d0 % rank], perm[d1 % rank] = perm[d1 % rank], perm[d0 % rank]
    imp.emit(node, "permute", [imp.operand(a["self"])], {"perm": perm})
    return True


@converts("aten.expand.default", "aten.expand_as.default")
def _expand(imp, node, a):
    imp.emit(node, "expand", [imp.operand(a["self"])], {"shape": [imp.attr_dim(s) for s in node.meta["val"].shape]})
    return True


def from_end(index, size) -> int | None:
    """An index computed from its axis's size (`x[:, x.shape[1] - 1]`, `x[:, T - 2:]`) as the
    negative index the IR counts from the end (-1, -2), or None when it is not size - k."""
    if isinstance(index, int):
        return index
    try:
        d = sympy.simplify(sympy.sympify(index) - sympy.sympify(size))
    except (sympy.SympifyError, TypeError):
        return None
    return int(d) if d.is_Integer and int(d) < 0 else None


@converts("aten.slice.Tensor")
def _slice(imp, node, a):
    start = a["start"] if a["start"] is not None else 0
    end = a["end"] if a["end"] is not None else 2 ** 62
    src_type = imp.g.type_of(imp.operand(a["self"]))
    start_d = from_end(imp.dim(start), src_type.shape[int(a["dim"]) % src_type.rank])
    if start_d is None:
        return False
    end_d = imp.dim(end) if not (isinstance(end, int) and end >= 2 ** 62) else 2 ** 62
    imp.emit(node, "slice", [imp.operand(a["self"])],
             {"dim": int(a["dim"]) % len(node.meta["val"].shape), "start": start_d,
              "end": end_d if isinstance(end_d, int) else dim_str(end_d), "step": int(a["step"])})
    return True


@converts("aten.select.int")
def _select(imp, node, a):
    src = imp.operand(a["self"])
    st = imp.g.type_of(src)
    dim = int(a["dim"]) % st.rank
    idx = from_end(imp.dim(a["index"]), st.shape[dim])
    if idx is None:
        return False
    shape = list(st.shape)
    shape[dim] = 1
    end = (idx + 1 if idx != -1 else 2 ** 62) if idx < 0 else idx + 1
    s, = imp.g.add_node("slice", [src], [st.with_shape(shape)], {"dim": dim, "start": idx, "end": end, "step": 1})
    imp.emit(node, "reshape", [s], {"shape": [imp.attr_dim(v) for v in node.meta["val"].shape]})
    return True


@converts("aten.split.Tensor", "aten.split_with_sizes.default", "aten.chunk.default", "aten.unbind.int")
def _split(imp, node, a):
    src = imp.operand(a["self"])
    st = imp.g.type_of(src)
    dim = int(a["dim"]) % st.rank
    outs, start = [], 0
    unbind = str(node.target) == "aten.unbind.int"
    for i, piece in enumerate(node.meta["val"]):
        length = 1 if unbind else imp.dim(piece.shape[dim])
        if not isinstance(length, int):
            return False
        shape = list(st.shape)
        shape[dim] = length
        name = clean_name(f"{node.name}_{i}")
        o, = imp.g.add_node("slice", [src], [st.with_shape(shape)],
                            {"dim": dim, "start": start, "end": start + length, "step": 1},
                            names=[name if not unbind else name + "_s"])
        if unbind:
            o, = imp.g.add_node("reshape", [o], [imp.ttype(piece)], {"shape": [imp.attr_dim(v) for v in piece.shape]},
                                names=[name])
        outs.append(o)
        start += length
    imp.env[node] = tuple(outs)
    return True


@converts("aten.cat.default")
def _cat(imp, node, a):
    rank = len(node.meta["val"].shape)
    # torch.cat skips 1-d empty tensors beside tensors of another rank (legacy; XLM concatenates one)
    parts = [t for t in a["tensors"] if not (rank != 1 and _legacy_empty(t))]
    imp.emit(node, "concat", [imp.operand(t) for t in parts], {"dim": int(a["dim"]) % rank})
    return True


def _legacy_empty(t) -> bool:
    val = getattr(t, "meta", {}).get("val") if hasattr(t, "meta") else None
    return val is not None and tuple(val.shape) == (0,)


@converts("aten.stack.default")
def _stack(imp, node, a):
    """stack = each tensor with a unit axis at `dim`, concatenated there (GPT-J's rotary)."""
    out = node.meta["val"]
    dim = int(a.get("dim", 0)) % len(out.shape)
    parts = []
    for t in a["tensors"]:
        x = imp.operand(t)
        xt = imp.g.type_of(x)
        shape = list(xt.shape[:dim]) + [1] + list(xt.shape[dim:])
        p, = imp.g.add_node("reshape", [x], [xt.with_shape(tuple(shape))], {"shape": [imp.attr_dim(d) for d in shape]})
        parts.append(p)
    imp.emit(node, "concat", parts, {"dim": dim})
    return True


@converts("aten.sym_size.int")
def _sym_size(imp, node, a):
    imp.env[node] = imp.dim(node.meta["val"])
    return True


@converts("aten.pad.default", "aten.constant_pad_nd.default")
def _pad(imp, node, a):
    pads = [imp.dim(p) for p in a["pad"]]
    if not all(isinstance(p, int) for p in pads):
        return False
    mode = a.get("mode", "constant")
    if mode != "constant":      # the ATen op F.pad dispatches to for the mode, with its own arguments
        n = len(pads) // 2
        if mode not in ("reflect", "replicate", "circular") or not 1 <= n <= 3 or a.get("value") is not None:
            return False
        op = ("_pad_circular" if mode == "circular" else
              ("reflection_pad1d" if n == 1 else "reflection_pad2d" if n == 2 else "reflection_pad3d")
              if mode == "reflect" else
              ("replication_pad1d" if n == 1 else "replication_pad2d" if n == 2 else "replication_pad3d"))
        return emit_aten_reference(imp, node, op, [imp.operand(a["self"])],
                                   {"overload": "default", "args": [{"$in": 0}, pads], "kwargs": {}})
    value = a.get("value")
    imp.emit(node, "pad", [imp.operand(a["self"])], {"pads": pads, "value": float(value or 0.0)})
    return True


@converts("aten.roll.default")
def _roll(imp, node, a):
    shifts, dims = list(a["shifts"]), list(a["dims"])
    if not dims or len(shifts) != len(dims) or not all(isinstance(s, int) for s in shifts):
        return False
    rank = len(node.meta["val"].shape)
    imp.emit(node, "roll", [imp.operand(a["self"])], {"shifts": shifts, "dims": [int(d) % rank for d in dims]})
    return True


# ---------------------------------------------------------------------------------- data

@converts("aten.index.Tensor")
def _index(imp, node, a):
    idx = list(a["indices"])
    dims = [i for i, t in enumerate(idx) if t is not None]
    if not dims or any(imp.g.type_of(imp.operand(idx[d])).dtype == "bool" for d in dims):
        return False
    imp.emit(node, "index", [imp.operand(a["self"])] + [imp.operand(idx[d]) for d in dims], {"dims": dims})
    return True


@converts("aten.index_select.default")
def _index_select(imp, node, a):
    imp.emit(node, "index_select", [imp.operand(a["self"]), imp.operand(a["index"])], {"dim": int(a["dim"])})
    return True


@converts("aten.arange.default", "aten.arange.start", "aten.arange.start_step")
def _arange(imp, node, a):
    start, end, step = (0, a["end"], 1) if "start" not in a else (a["start"], a["end"], a.get("step", 1))
    s, e = imp.dim(start), imp.dim(end)
    if not isinstance(s, int) or not isinstance(step, int):
        return False
    imp.emit(node, "arange", [], {"start": s, "end": e if isinstance(e, int) else dim_str(e), "step": step,
                                  "dtype": TORCH_TO_DTYPE[node.meta["val"].dtype]})
    return True


_FILL = {"zeros": 0, "new_zeros": 0, "zeros_like": 0, "zero": 0, "ones": 1, "new_ones": 1, "ones_like": 1}


@converts("aten.full.default", "aten.zeros.default", "aten.ones.default", "aten.new_ones.default",
          "aten.new_zeros.default", "aten.new_full.default", "aten.ones_like.default", "aten.zeros_like.default",
          "aten.full_like.default", "aten.scalar_tensor.default", "aten.empty.memory_format", "aten.zero.default",
          "aten.fill.Scalar", "aten.empty_like.default", "aten.new_empty.default", "aten.empty_permuted.default")
def _full(imp, node, a):
    short = str(node.target).split(".")[1]
    if short in ("empty", "empty_like", "new_empty", "empty_permuted"):
        value = 0                    # uninitialised in eager: any value is as good; zeros keep results finite
    else:
        value = _FILL.get(short, a.get("fill_value", a.get("s", a.get("value"))))
    if isinstance(value, torch.fx.Node) or value is None:
        return False
    val = node.meta["val"]
    dt = TORCH_TO_DTYPE[val.dtype]
    value = bool(value) if dt == "bool" else (int(value) if dt.startswith(("i", "u")) else float(value))
    imp.emit(node, "full", [], {"shape": [imp.attr_dim(s) for s in val.shape], "value": value, "dtype": dt})
    return True


@converts("aten.fill.Tensor", "aten.copy.default")
def _fill_from(imp, node, a):
    """x.fill_(v) with a 0-d tensor v (`x[:, -1] = 7.0`) and copy(x, src) (a write into a slice):
    the source broadcast to x's shape, in x's dtype."""
    src = a["value"] if "value" in a else a["src"]
    if not isinstance(src, torch.fx.Node):
        return False
    val = node.meta["val"]
    s = imp.operand(src)
    st = imp.g.type_of(s)
    dt = TORCH_TO_DTYPE[val.dtype]
    if st.dtype != dt:
        s, = imp.g.add_node("cast", [s], [st.with_dtype(dt)], {"dtype": dt})
    if st.rank == val.dim() and all(dims_equal(x, imp.dim(y)) for x, y in zip(st.shape, val.shape)):
        imp.emit(node, "identity", [s])
    else:
        imp.emit(node, "expand", [s], {"shape": [imp.attr_dim(d) for d in val.shape]})
    return True


@converts("aten.eye.default", "aten.eye.m")
def _eye(imp, node, a):
    """torch.eye at fixed sizes: a constant (at a symbolic size it stays an eager island)."""
    val = node.meta["val"]
    if not all(isinstance(s, int) for s in val.shape):
        return False
    eye = torch.eye(*val.shape, dtype=val.dtype) if val.dim() == 2 else None
    if eye is None:
        return False
    name = imp.g.add_constant(imp.g.fresh_name(clean_name(node.name)), eye, role="const")
    imp.env[node] = name
    return True


@converts("aten.diff.default")
def _diff(imp, node, a):
    """diff(x, n=1, dim, prepend, append) = y[1:] - y[:-1] with y = cat(prepend, x, append)."""
    if a["n"] != 1:
        return False
    x = imp.operand(a["self"])
    xt = imp.g.type_of(x)
    dim = int(a["dim"]) % xt.rank
    parts = [imp.operand(t) for t in (a["prepend"], a["self"], a["append"]) if t is not None]
    y = x
    if len(parts) > 1:
        shape = list(xt.shape)
        shape[dim] = sum((imp.g.type_of(p).shape[dim] for p in parts), start=0)
        y, = imp.g.add_node("concat", parts, [xt.with_shape(shape)], {"dim": dim})
    yt = imp.g.type_of(y)
    shape = list(yt.shape)
    shape[dim] = yt.shape[dim] - 1
    hi, = imp.g.add_node("slice", [y], [yt.with_shape(shape)], {"dim": dim, "start": 1, "end": 2 ** 62, "step": 1})
    lo, = imp.g.add_node("slice", [y], [yt.with_shape(shape)], {"dim": dim, "start": 0, "end": -1, "step": 1})
    imp.emit(node, "sub", [hi, lo])
    return True


@converts("aten.repeat_interleave.self_int")
def _repeat_interleave(imp, node, a):
    """x.repeat_interleave(r, dim) = unsqueeze after dim, expand r, merge (GQA's repeat_kv)."""
    if a.get("output_size") is not None and not isinstance(a["output_size"], int):
        return False
    x = imp.operand(a["self"])
    xt = imp.g.type_of(x)
    if a["dim"] is None or not isinstance(a["repeats"], int):
        return False
    dim = int(a["dim"]) % xt.rank
    imp.env[node] = repeat_axis(imp, x, dim, int(a["repeats"]), clean_name(node.name))
    return True
