"""ATen converters of elementwise ops: arithmetic, clamps, bitwise/logical, rounding,
activations, masked fills and casts."""
from __future__ import annotations

import torch

from graphmode.capture.aten.emit import axis, emit_aten_reference, emit_checked
from graphmode.capture.aten.registry import converts
from graphmode.errors import GraphmodeError
from graphmode.ir.ops import OPS
from graphmode.ir.types import DTYPES, TORCH_TO_DTYPE


@converts("aten.add.Tensor", "aten.add.Scalar", "aten.add_.Tensor", "aten.sub.Tensor", "aten.sub.Scalar",
          "aten.sub_.Tensor", "aten.subtract.Tensor", "aten.subtract.Scalar")
def _add_sub(imp, node, a):
    op = "add" if "add" in str(node.target) else "sub"
    lhs, rhs = imp.operand(a["self"]), imp.operand(a["other"])
    if a.get("alpha", 1) != 1:
        ty = imp.g.type_of(rhs)
        rhs, = imp.g.add_node("mul", [rhs, imp.const(a["alpha"])], [ty])
    imp.emit(node, op, [lhs, rhs])
    return True


@converts("aten.rsub.Scalar", "aten.rsub.Tensor")
def _rsub(imp, node, a):
    """other - alpha * self."""
    x = imp.operand(a["self"])
    if a.get("alpha", 1) != 1:
        x, = imp.g.add_node("mul", [x, imp.const(a["alpha"])], [imp.g.type_of(x)])
    return emit_checked(imp, node, "sub", [imp.operand(a["other"]), x])


@converts("aten.max.other", "aten.min.other")
def _max_min_other(imp, node, a):
    """torch.max(a, b) / torch.min(a, b): the elementwise maximum / minimum (NaN propagates)."""
    op = "maximum" if node.target._overloadpacket.__name__ == "max" else "minimum"
    return emit_checked(imp, node, op, [imp.operand(a["self"]), imp.operand(a["other"])])


@converts("aten.div.Tensor", "aten.div.Scalar", "aten.div.Tensor_mode", "aten.div_.Tensor", "aten.divide.Tensor",
          "aten.divide.Scalar", "aten.true_divide.Tensor", "aten.true_divide.Scalar")
def _div(imp, node, a):
    """True division; rounding 'floor' is ATen's floor_divide (its very kernel, exact where
    floor(a / b) is not), 'trunc' of floats trunc(a / b) as ATen computes it, of integers the
    floor division of a - fmod(a, b), which b divides exactly."""
    x, y = imp.operand(a["self"]), imp.operand(a["other"])
    mode = a.get("rounding_mode")
    if mode is None:
        imp.emit(node, "div", [x, y])
        return True
    call = {"overload": "default", "args": [{"$in": 0}, {"$in": 1}], "kwargs": {}}
    if mode == "floor":
        return emit_aten_reference(imp, node, "floor_divide", [x, y], call)
    want = TORCH_TO_DTYPE[node.meta["val"].dtype]
    if mode != "trunc":
        return False
    if want not in ("f32", "f64", "f16", "bf16"):     # integers: (a - fmod(a, b)) is a multiple of b
        types = [imp.g.type_of(x), imp.g.type_of(y)]
        r, = imp.g.add_node("fmod", [x, y], OPS["fmod"].infer(types, {}))
        m, = imp.g.add_node("sub", [x, r], OPS["sub"].infer([types[0], imp.g.type_of(r)], {}))
        return emit_aten_reference(imp, node, "floor_divide", [m, y], call)
    q, = imp.g.add_node("div", [x, y], OPS["div"].infer([imp.g.type_of(x), imp.g.type_of(y)], {}))
    if imp.g.type_of(q).dtype != want:
        return False
    return emit_aten_reference(imp, node, "trunc", [q], dict(call, args=[{"$in": 0}]))


@converts("aten.gelu.default", "aten.gelu_.default")
def _gelu(imp, node, a):
    imp.emit(node, "gelu", [imp.operand(a["self"])], {"approximate": a["approximate"]})
    return True


@converts("aten.clamp.default", "aten.clamp_.default", "aten.clamp_min.default", "aten.clamp_max.default",
          "aten.hardtanh.default", "aten.hardtanh_.default", "aten.relu6.default")
def _clamp(imp, node, a):
    name = str(node.target).split(".")[1].rstrip("_")
    lo = {"clamp": a.get("min"), "clamp_min": a.get("min"), "hardtanh": a.get("min_val"), "relu6": 0.0}.get(name)
    hi = {"clamp": a.get("max"), "clamp_max": a.get("max"), "hardtanh": a.get("max_val"), "relu6": 6.0}.get(name)
    if isinstance(lo, torch.fx.Node) or isinstance(hi, torch.fx.Node):
        return False
    x = imp.operand(a["self"])
    want = imp.ttype(node.meta["val"])
    if want.dtype != imp.g.type_of(x).dtype:     # an integer tensor to float bounds: torch promotes it first
        x, = imp.g.add_node("cast", [x], [imp.g.type_of(x).with_dtype(want.dtype)], {"dtype": want.dtype})
    imp.emit(node, "clamp", [x], {"min": lo, "max": hi})
    return True


def _hard_sigmoid(imp, x: str) -> str:
    """relu6(x + 3) / 6, in core ops (so it fuses and generates like any elementwise chain)."""
    ty = imp.g.type_of(x)
    t, = imp.g.add_node("add", [x, imp.const(3.0)], [ty])
    t, = imp.g.add_node("clamp", [t], [ty], {"min": 0.0, "max": 6.0})
    out, = imp.g.add_node("div", [t, imp.const(6.0)], [ty])
    return out


@converts("aten.clamp.Tensor", "aten.clamp_min.Tensor", "aten.clamp_max.Tensor")
def _clamp_tensor(imp, node, a):
    """clamp with tensor bounds = minimum(maximum(x, min), max): NaN propagates and min > max
    gives max, as torch.clamp does."""
    name = str(node.target).split(".")[1]
    lo = a.get("min") if name != "clamp_max" else None
    hi = a.get("max") if name != "clamp_min" else None
    x = imp.operand(a["self"])
    if lo is not None and hi is not None:
        lo_v = imp.operand(lo)
        m, = imp.g.add_node("maximum", [x, lo_v], OPS["maximum"].infer([imp.g.type_of(x), imp.g.type_of(lo_v)], {}))
        imp.emit(node, "minimum", [m, imp.operand(hi)])
    elif lo is not None or hi is not None:
        imp.emit(node, "maximum" if lo is not None else "minimum", [x, imp.operand(lo if lo is not None else hi)])
    else:
        return False
    return True


def _scalar_in(imp, v, dtype: str) -> str | None:
    """A Python scalar operand as a 0-d constant of the call's result dtype (None where the value
    does not fit it), a traced value as itself."""
    if isinstance(v, torch.fx.Node):
        return imp.operand(v)
    t = DTYPES[dtype]
    if t == torch.bool:
        return imp.const(v, dtype) if v in (0, 1) else None
    if not t.is_floating_point:
        info = torch.iinfo(t)
        if not (isinstance(v, int) and info.min <= v <= info.max):
            return None
    return imp.const(v, dtype)


_BITWISE_OPS = ("bitwise_not", "bitwise_and", "bitwise_or", "bitwise_xor", "bitwise_left_shift", "bitwise_right_shift")
_DUNDER = {"__and__": "bitwise_and", "__or__": "bitwise_or", "__xor__": "bitwise_xor",
           "__lshift__": "bitwise_left_shift", "__rshift__": "bitwise_right_shift"}
_LOGICAL = {"bitwise_not": "logical_not", "bitwise_and": "logical_and", "bitwise_or": "logical_or"}


@converts("aten.bitwise_not.default",
          *(f"aten.{op}.{o}" for op in _BITWISE_OPS[1:4] for o in ("Tensor", "Scalar", "Scalar_Tensor")),
          *(f"aten.{op}.{o}" for op in _BITWISE_OPS[4:] for o in ("Tensor", "Tensor_Scalar", "Scalar_Tensor")),
          *(f"aten.{d}.{o}" for d in _DUNDER for o in ("Tensor", "Scalar")))
def _bitwise(imp, node, a):
    """The core bitwise ops (integers, and bools for and/or/xor/not), with a Python scalar operand
    as a constant of the result dtype; and/or/not of bools as the logical ops. Whatever the core
    op would type differently from the ATen call stays an eager island."""
    name = str(node.target).split(".")[1]
    op = _DUNDER.get(name, name)
    want = imp.ttype(node.meta["val"]).dtype
    ins = [_scalar_in(imp, a[k], want) for k in ("self", "other") if k in a]
    if any(i is None for i in ins):
        return False
    if op in _LOGICAL and want == "bool" and all(imp.g.type_of(i).dtype == "bool" for i in ins):
        return emit_checked(imp, node, _LOGICAL[op], ins)
    return emit_checked(imp, node, op, ins)


@converts("aten.round.decimals")
def _round_decimals(imp, node, a):
    """torch.round(x, decimals=d) as ATen computes it on floats: round(x * 10^d) / 10^d, for d < 0
    round(x / 10^-d) * 10^-d, with 10^|d| in x's dtype (so the core ops give the same bits)."""
    x, d = imp.operand(a["self"]), int(a["decimals"])
    dt = imp.g.type_of(x).dtype
    if dt not in ("f32", "f64") or abs(d) > 300:
        return False
    if d == 0:
        return emit_checked(imp, node, "round", [x])
    ten = imp.const(float(10.0 ** abs(d)), dt)
    t = imp.g.type_of(x)
    scaled, = imp.g.add_node("mul" if d > 0 else "div", [x, ten], [t])
    rounded, = imp.g.add_node("round", [scaled], [t])
    return emit_checked(imp, node, "div" if d > 0 else "mul", [rounded, ten])


@converts("aten.prod.default", "aten.prod.dim_int")
def _prod(imp, node, a):
    """The core prod over every dim or one, on the input cast to the call's result dtype first
    (a `dtype` argument, or torch's promotion of integers and bools to int64)."""
    x = imp.operand(a["self"])
    xt, want = imp.g.type_of(x), imp.ttype(node.meta["val"]).dtype
    if xt.dtype != want:
        x, = imp.g.add_node("cast", [x], [xt.with_dtype(want)], {"dtype": want})
    if xt.rank == 0:        # the product over a 0-d tensor's one element (dim 0 or -1) is itself
        return emit_checked(imp, node, "identity", [x])
    if node.target._overloadname == "default":
        dims, keep = list(range(xt.rank)), False
    else:
        dims, keep = [axis(a["dim"], xt.rank)], bool(a["keepdim"])
    return emit_checked(imp, node, "prod", [x], {"dims": dims, "keepdim": keep})


@converts("aten.einsum.default")
def _einsum(imp, node, a):
    """torch.einsum as the core einsum (a contraction `path` only orders the work)."""
    return emit_checked(imp, node, "einsum", [imp.operand(t) for t in a["tensors"]], {"equation": a["equation"]})


@converts("aten.conv_transpose2d.input")
def _conv_transpose2d(imp, node, a):
    """The core conv_transpose2d; an unbatched (3-d) input runs as a batch of one and is viewed
    back, as ATen runs it (the core op takes 4-d inputs only)."""
    x, w = imp.operand(a["input"]), imp.operand(a["weight"])
    rest = [w] + ([imp.operand(a["bias"])] if a["bias"] is not None else [])
    attrs = {k: [int(v) for v in a[k]] for k in ("stride", "padding", "output_padding", "dilation")}
    attrs["groups"] = int(a["groups"])
    xt = imp.g.type_of(x)
    if xt.rank != 3:
        return emit_checked(imp, node, "conv_transpose2d", [x] + rest, attrs)
    x4, = imp.g.add_node("reshape", [x], [xt.with_shape((1,) + tuple(xt.shape))],
                         {"shape": [1] + [imp.attr_dim(d) for d in xt.shape]})
    try:
        yt, = OPS["conv_transpose2d"].infer([imp.g.type_of(i) for i in [x4] + rest], attrs)
    except GraphmodeError:
        return False
    y4, = imp.g.add_node("conv_transpose2d", [x4] + rest, [yt], attrs)
    return emit_checked(imp, node, "reshape", [y4], {"shape": [imp.attr_dim(d) for d in yt.shape[1:]]})


@converts("aten.hardsigmoid.default", "aten.hardsigmoid_.default")
def _hardsigmoid(imp, node, a):
    imp.env[node] = _hard_sigmoid(imp, imp.operand(a["self"]))
    return True


@converts("aten.hardswish.default", "aten.hardswish_.default")
def _hardswish(imp, node, a):
    x = imp.operand(a["self"])                  # x * relu6(x + 3) / 6 in ATen's order: x * 6 may overflow
    ty = imp.g.type_of(x)
    t, = imp.g.add_node("add", [x, imp.const(3.0)], [ty])
    t, = imp.g.add_node("clamp", [t], [ty], {"min": 0.0, "max": 6.0})
    t, = imp.g.add_node("mul", [x, t], [ty])
    imp.emit(node, "div", [t, imp.const(6.0)])
    return True


@converts("aten.masked_fill.Scalar", "aten.masked_fill.Tensor", "aten.masked_fill_.Scalar")
def _masked_fill(imp, node, a):
    src = imp.operand(a["self"])
    fill = imp.const(a["value"], imp.g.type_of(src).dtype) if not isinstance(a["value"], torch.fx.Node) \
        else imp.operand(a["value"])
    imp.emit(node, "where", [imp.operand(a["mask"]), fill, src])
    return True


@converts("aten.where.ScalarOther", "aten.where.ScalarSelf", "aten.where.Scalar")
def _where_scalar(imp, node, a):
    dtype = TORCH_TO_DTYPE[node.meta["val"].dtype]
    x = imp.operand(a["self"]) if isinstance(a["self"], torch.fx.Node) else imp.const(a["self"], dtype)
    y = imp.operand(a["other"]) if isinstance(a["other"], torch.fx.Node) else imp.const(a["other"], dtype)
    imp.emit(node, "where", [imp.operand(a["condition"]), x, y])
    return True


@converts("aten.to.dtype", "aten._to_copy.default", "aten.to.dtype_layout", "aten.type_as.default")
def _cast(imp, node, a):
    imp.emit(node, "cast", [imp.operand(a["self"])], {"dtype": TORCH_TO_DTYPE[node.meta["val"].dtype]})
    return True
