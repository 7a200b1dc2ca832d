"""ATen -> core IR converters: one small registered function per ATen overload.

Arguments are normalised once against the overload's own schema (`bind`), so a converter
reads `a["dim"]` whether the model passed it by position, by keyword or left the default —
never `node.args[3]`. Ops captured one-to-one are converted from the op database
(`OpSpec.aten`): tensor arguments become inputs, arguments named like the op's attributes
become attributes, and any other argument must be at its default or the op is not
converted (it becomes an explicit fallback, listed with its source line). A converter
returns False when it does not cover this instance (same outcome).
"""
from __future__ import annotations

import operator
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree

from graphmode.errors import GraphmodeError
from graphmode.ir.graph import clean_name
from graphmode.ir.ops import OPS, aten_table, pair
from graphmode.ir.types import DTYPES, TORCH_TO_DTYPE, dim_str, dims_equal

Converter = Callable[[Any, torch.fx.Node, dict], bool]
CONVERTERS: dict[str, Converter] = {}
_MISSING = object()

# arguments that do not change what an inference forward computes
_INERT = {"layout", "device", "pin_memory", "memory_format", "non_blocking", "copy", "sparse_grad", "scale_grad_by_freq",
          "sparse", "padding_idx", "cudnn_enabled", "momentum"}


def converts(*overloads: str) -> Callable[[Converter], Converter]:
    def deco(fn: Converter) -> Converter:
        for o in overloads:
            CONVERTERS[o] = fn
        return fn
    return deco


def bind(node: torch.fx.Node) -> dict[str, Any]:
    """{argument name: value} for an ATen call, defaults filled in from the schema."""
    out: dict[str, Any] = {}
    schema = node.target._schema
    for i, arg in enumerate(schema.arguments):
        if not arg.kwarg_only and i < len(node.args):
            out[arg.name] = node.args[i]
        elif arg.name in node.kwargs:
            out[arg.name] = node.kwargs[arg.name]
        elif arg.has_default_value():
            out[arg.name] = arg.default_value
        else:
            out[arg.name] = _MISSING
    return out


def is_default(node: torch.fx.Node, name: str, value: Any) -> bool:
    for arg in node.target._schema.arguments:
        if arg.name == name:
            return arg.has_default_value() and value == arg.default_value or value is None
    return False


def convert(imp, node: torch.fx.Node, tname: str) -> bool:
    """Convert one ATen call; False: no converter covers it (the importer records a fallback)."""
    fn = CONVERTERS.get(tname)
    if fn is not None:
        return fn(imp, node, bind(node))
    op = aten_table().get(tname)
    if op is not None:
        return one_to_one(imp, node, op)
    return False


def one_to_one(imp, node: torch.fx.Node, op: str) -> bool:
    spec = OPS[op]
    if spec.has("aten_reference"):
        return aten_reference(imp, node, op)
    a = bind(node)
    inputs: list[str] = []
    attrs: dict[str, Any] = {}
    for arg in node.target._schema.arguments:
        v = a[arg.name]
        ty = str(arg.type)
        if arg.name in spec.attrs:
            attrs[arg.name] = v
        elif ty.startswith("List[Tensor]") or ty == "Tensor[]":
            inputs += [imp.operand(t) for t in v]
        elif ty.startswith(("Tensor", "Optional[Tensor]")):
            if v is not None and v is not _MISSING:
                inputs.append(imp.operand(v))
        elif ty in ("Scalar", "number") and arg.name in ("self", "other", "exponent"):
            inputs.append(imp.operand(v))
        elif arg.name not in _INERT and not is_default(node, arg.name, v):
            return False                    # an argument the core op does not model
    if "dim" in attrs and isinstance(attrs["dim"], int):
        attrs["dim"] = int(attrs["dim"])
    imp.emit(node, op, inputs, attrs)
    return True


def axis(d, rank: int) -> int:
    """A dim argument as an index in [0, rank); a 0-d tensor takes dim 0 or -1 (as torch does)."""
    return int(d) % rank if rank else 0


def emit_on_rank1(imp, node, op: str, x: str, attrs: dict) -> None:
    """An op along a dim of a 0-d tensor, run on its [1] view and viewed back as 0-d (torch
    treats a 0-d tensor as one element along dim 0), so no later stage meets a dim op on rank 0."""
    xt = imp.g.type_of(x)
    x1, = imp.g.add_node("reshape", [x], [xt.with_shape((1,))], {"shape": [1]})
    out_t = imp.ttype(node.meta["val"])
    y1, = imp.g.add_node(op, [x1], [out_t.with_shape((1,))], attrs)
    imp.emit(node, "reshape", [y1], {"shape": []})


def aten_reference(imp, node: torch.fx.Node, op: str) -> bool:
    """An ATen-reference op (ir/ops/aten_ref.py) with the call's own arguments as attributes."""
    ins, args, kwargs = imp.encode_call(node)
    return emit_aten_reference(imp, node, op, ins, {"overload": node.target._overloadname, "args": args,
                                                    "kwargs": kwargs})


def emit_aten_reference(imp, node: torch.fx.Node, op: str, ins: list[str], attrs: dict) -> bool:
    """Emit ATen-reference op `op` for `node` once the types its inference derives match
    torch.export's (any difference, a symbolic size argument, or an inference that refuses
    keeps the op an eager island: False)."""
    if "$dim" in str((attrs["args"], attrs["kwargs"])):
        return False
    vals = [v for v in pytree.tree_leaves(node.meta["val"]) if isinstance(v, torch.Tensor)]
    want = [imp.ttype(v) for v in vals]
    try:
        got = OPS[op].infer([imp.g.type_of(i) for i in ins], attrs)
    except GraphmodeError:
        return False
    if len(got) != len(want) or not all(g.dtype == w.dtype and len(g.shape) == len(w.shape)
                                        and all(dims_equal(x, y) for x, y in zip(g.shape, w.shape))
                                        for g, w in zip(got, want)):
        return False
    outs = imp.g.add_node(op, ins, want, attrs,
                          names=[clean_name(node.name if i == 0 else f"{node.name}_{i}") for i in range(len(want))])
    imp.env[node] = outs[0] if len(outs) == 1 and not isinstance(node.meta["val"], (tuple, list)) else tuple(outs)
    return True


# ---------------------------------------------------------------------------------- elementwise

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
    if a.get("alpha", 1) != 1:
        return False
    imp.emit(node, "sub", [imp.operand(a["other"]), imp.operand(a["self"])])
    return True


@converts("aten.div.Tensor", "aten.div.Scalar", "aten.div.Tensor_mode", "aten.div_.Tensor", "aten.divide.Tensor",
          "aten.divide.Scalar", "aten.true_divide.Tensor", "aten.true_divide.Scalar")
def _div(imp, node, a):
    if a.get("rounding_mode") is not None:
        return False
    imp.emit(node, "div", [imp.operand(a["self"]), imp.operand(a["other"])])
    return True


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
    imp.emit(node, "clamp", [imp.operand(a["self"])], {"min": lo, "max": hi})
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


def emit_checked(imp, node: torch.fx.Node, op: str, ins: list[str], attrs: dict | None = None) -> bool:
    """Emit core op `op` for `node` only where its inferred output type is torch.export's (dtype
    and shape): where the core op's type rules differ from the ATen call's, False keeps the call
    an eager island instead of a different answer."""
    want = imp.ttype(node.meta["val"])
    try:
        got, = OPS[op].infer([imp.g.type_of(i) for i in ins], attrs or {})
    except GraphmodeError:
        return False
    if got.dtype != want.dtype or len(got.shape) != len(want.shape) or \
            not all(dims_equal(x, y) for x, y in zip(got.shape, want.shape)):
        return False
    imp.emit(node, op, ins, attrs)
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
    x = imp.operand(a["self"])
    imp.emit(node, "mul", [x, _hard_sigmoid(imp, x)])
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


# ---------------------------------------------------------------------------------- reductions

def _operand_as(imp, a) -> str | None:
    """`self`, cast to the call's `dtype` argument where it has one (sum/mean/cumsum(x, dtype=d)
    compute on x.to(d), as eager does); None for a dtype graphmode has not."""
    x = imp.operand(a["self"])
    dt = a.get("dtype")
    if dt is None:
        return x
    if dt not in TORCH_TO_DTYPE:
        return None
    x, = imp.g.add_node("cast", [x], [imp.g.type_of(x).with_dtype(TORCH_TO_DTYPE[dt])], {"dtype": TORCH_TO_DTYPE[dt]})
    return x


@converts("aten.mean.dim", "aten.sum.dim_IntList", "aten.amax.default", "aten.amin.default")
def _reduce(imp, node, a):
    op = str(node.target).split(".")[1]
    x = _operand_as(imp, a)
    if x is None:
        return False
    rank = imp.g.type_of(x).rank
    if rank == 0:
        emit_on_rank1(imp, node, op, x, {"dims": [0], "keepdim": True})
        return True
    dims = a["dim"]
    dims = [axis(d, rank) for d in (dims if isinstance(dims, (list, tuple)) else [dims])] if dims not in (None, [], ()) \
        else list(range(rank))        # dim=None or [] reduces every axis (torch semantics)
    imp.emit(node, op, [x], {"dims": dims, "keepdim": bool(a["keepdim"])})
    return True


@converts("aten.sum.default", "aten.mean.default")
def _reduce_all(imp, node, a):
    x = _operand_as(imp, a)
    if x is None:
        return False
    if imp.g.type_of(x).rank == 0:
        emit_on_rank1(imp, node, str(node.target).split(".")[1], x, {"dims": [0], "keepdim": True})
        return True
    imp.emit(node, str(node.target).split(".")[1], [x], {"dims": list(range(imp.g.type_of(x).rank)),
                                                         "keepdim": False})
    return True


@converts("aten.argmax.default", "aten.argmin.default")
def _arg(imp, node, a):
    x = imp.operand(a["self"])
    op = str(node.target).split(".")[1]
    if a["dim"] is None:            # over the flattened tensor (keepdim: a shape of ones)
        xt = imp.g.type_of(x)
        flat, = imp.g.add_node("reshape", [x], [xt.with_shape((xt.numel(),))], {"shape": [-1]})
        out_t = imp.ttype(node.meta["val"])
        y, = imp.g.add_node(op, [flat], [out_t.with_shape(())], {"dim": 0, "keepdim": False})
        imp.emit(node, "reshape", [y], {"shape": [1] * out_t.rank})
        return True
    if imp.g.type_of(x).rank == 0:
        emit_on_rank1(imp, node, op, x, {"dim": 0, "keepdim": True})
        return True
    imp.emit(node, op, [x], {"dim": axis(a["dim"], imp.g.type_of(x).rank), "keepdim": bool(a["keepdim"])})
    return True


@converts("aten.softmax.int", "aten._softmax.default", "aten.log_softmax.int", "aten._log_softmax.default")
def _softmax(imp, node, a):
    op = "log_softmax" if "log_softmax" in str(node.target) else "softmax"
    x = imp.operand(a["self"])
    if a.get("half_to_float"):
        return False
    if a.get("dtype") is not None and TORCH_TO_DTYPE.get(a["dtype"]) != imp.g.type_of(x).dtype:
        if a["dtype"] not in TORCH_TO_DTYPE:
            return False
        x, = imp.g.add_node("cast", [x], [imp.g.type_of(x).with_dtype(TORCH_TO_DTYPE[a["dtype"]])],
                            {"dtype": TORCH_TO_DTYPE[a["dtype"]]})     # softmax(x, dtype=d) = softmax(x.to(d))
    rank = imp.g.type_of(x).rank
    if rank == 0:
        emit_on_rank1(imp, node, op, x, {"dim": 0})
    else:
        imp.emit(node, op, [x], {"dim": axis(a["dim"], rank)})
    return True


@converts("aten._safe_softmax.default")
def _safe_softmax(imp, node, a):
    """softmax, except that a row with every entry -inf gives zeros (not NaN): where(amax == -inf, 0, softmax)."""
    x = imp.operand(a["self"])
    xt = imp.g.type_of(x)
    if a.get("dtype") is not None and TORCH_TO_DTYPE.get(a["dtype"]) != xt.dtype or xt.rank == 0:
        return False
    dim = axis(a["dim"], xt.rank)
    row = xt.with_shape(tuple(1 if i == dim else d for i, d in enumerate(xt.shape)))
    top, = imp.g.add_node("amax", [x], [row], {"dims": [dim], "keepdim": True})
    masked, = imp.g.add_node("eq", [top, imp.const(float("-inf"), xt.dtype)], [row.with_dtype("bool")])
    sm, = imp.g.add_node("softmax", [x], [xt], {"dim": dim})
    imp.emit(node, "where", [masked, imp.const(0.0, xt.dtype), sm])
    return True


@converts("aten.cumsum.default")
def _cumsum(imp, node, a):
    x = _operand_as(imp, a)
    if x is None:
        return False
    rank = imp.g.type_of(x).rank
    if rank == 0:
        emit_on_rank1(imp, node, "cumsum", x, {"dim": 0})
    else:
        imp.emit(node, "cumsum", [x], {"dim": axis(a["dim"], rank)})
    return True


@converts("aten.layer_norm.default")
def _layer_norm(imp, node, a):
    ins = [imp.operand(a["input"])] + [imp.operand(t) for t in (a["weight"], a["bias"]) if t is not None]
    if a["weight"] is None and a["bias"] is not None:
        return False
    imp.emit(node, "layer_norm", ins, {"normalized_rank": len(a["normalized_shape"]), "eps": float(a["eps"])})
    return True


@converts("aten.native_layer_norm.default")
def _native_layer_norm(imp, node, a):
    if a["weight"] is None and a["bias"] is not None:
        return False
    ins = [imp.operand(a["input"])] + [imp.operand(t) for t in (a["weight"], a["bias"]) if t is not None]
    out, = imp.g.add_node("layer_norm", ins, [imp.ttype(node.meta["val"][0])],
                          {"normalized_rank": len(a["normalized_shape"]), "eps": float(a["eps"])},
                          names=[clean_name(node.name)])
    imp.env[node] = (out, None, None)
    return True


@converts("aten.batch_norm.default", "aten._native_batch_norm_legit_no_training.default")
def _batch_norm(imp, node, a):
    if a.get("training"):
        return False
    ins = [imp.operand(a[k]) for k in ("input", "weight", "bias", "running_mean", "running_var")]
    val = node.meta["val"]
    out, = imp.g.add_node("batch_norm", ins, [imp.ttype(val[0] if isinstance(val, (tuple, list)) else val)],
                          {"eps": float(a["eps"])}, names=[clean_name(node.name)])
    imp.env[node] = (out, None, None) if isinstance(val, (tuple, list)) else out
    return True


# ---------------------------------------------------------------------------------- GEMM / conv / attention

@converts("aten.linear.default")
def _linear(imp, node, a):
    ins = [imp.operand(a["input"]), imp.operand(a["weight"])] + ([imp.operand(a["bias"])] if a["bias"] is not None
                                                                 else [])
    imp.emit(node, "linear", ins)
    return True


@converts("aten.matmul.default")
def _matmul(imp, node, a):
    """torch.matmul: a 1-d operand is a row (left) or a column (right) vector whose unit axis
    is dropped from the result; rank >= 2 operands are the IR's batched matmul."""
    x, y = imp.operand(a["self"]), imp.operand(a["other"])
    xt, yt = imp.g.type_of(x), imp.g.type_of(y)
    if xt.rank == 0 or yt.rank == 0:
        return False
    if xt.rank == 1:
        x, = imp.g.add_node("reshape", [x], [xt.with_shape((1, xt.shape[0]))], {"shape": [1, imp.attr_dim(xt.shape[0])]})
    if yt.rank == 1:
        y, = imp.g.add_node("reshape", [y], [yt.with_shape((yt.shape[0], 1))], {"shape": [imp.attr_dim(yt.shape[0]), 1]})
    if xt.rank > 1 and yt.rank > 1:
        imp.emit(node, "matmul", [x, y])
        return True
    out_t, = OPS["matmul"].infer([imp.g.type_of(x), imp.g.type_of(y)], {})
    z, = imp.g.add_node("matmul", [x, y], [out_t])
    imp.emit(node, "reshape", [z], {"shape": [imp.attr_dim(d) for d in node.meta["val"].shape]})
    return True


@converts("aten.addmm.default")
def _addmm(imp, node, a):
    if a["beta"] != 1 or a["alpha"] != 1:
        return False
    w = imp.operand(a["mat2"])
    wt = imp.g.type_of(w)
    w_t, = imp.g.add_node("permute", [w], [wt.with_shape((wt.shape[1], wt.shape[0]))], {"perm": [1, 0]})
    imp.emit(node, "linear", [imp.operand(a["mat1"]), w_t, imp.operand(a["self"])])
    return True


def _conv(imp, node, a, spatial: int) -> bool:
    """conv1d/conv2d (`a`: the schema-normalised args of any conv overload) with int or
    'same'/'valid' padding -> conv2d (1-d over a height of 1), asymmetric 'same' padding as
    an explicit pad."""
    x, w = imp.operand(a["input"]), imp.operand(a["weight"])
    b = imp.operand(a["bias"]) if a["bias"] is not None else None
    stride, padding, dilation, groups = a["stride"], a["padding"], a["dilation"], a["groups"]
    xt, wt = imp.g.type_of(x), imp.g.type_of(w)
    if xt.rank != spatial + 2 or wt.rank != spatial + 2:
        return False
    stride, dilation = pair(stride, spatial), pair(dilation, spatial)
    k = [wt.shape[2 + i] for i in range(spatial)]
    if not all(isinstance(v, int) for v in k):
        return False
    pre = None
    if isinstance(padding, str):
        if padding == "valid":
            padding = [0] * spatial
        elif padding == "same":
            if any(s != 1 for s in stride):
                return False
            total = [d * (kk - 1) for d, kk in zip(dilation, k)]
            lo = [t // 2 for t in total]
            if any(t - l != l for t, l in zip(total, lo)):       # asymmetric: pad explicitly first
                pre = [v for i in reversed(range(spatial)) for v in (lo[i], total[i] - lo[i])]
                padding = [0] * spatial
            else:
                padding = lo
        else:
            return False
    padding = pair(padding, spatial)
    if pre is not None:
        shape = list(xt.shape)
        for i in range(spatial):
            shape[2 + i] = shape[2 + i] + pre[2 * (spatial - 1 - i)] + pre[2 * (spatial - 1 - i) + 1]
        x, = imp.g.add_node("pad", [x], [xt.with_shape(shape)], {"pads": pre, "value": 0.0})
        xt = imp.g.type_of(x)
    if spatial == 1:      # [N, C, L] -> [N, C, 1, L]; weight [O, C/g, K] -> [O, C/g, 1, K]
        x, = imp.g.add_node("reshape", [x], [xt.with_shape(xt.shape[:2] + (1,) + xt.shape[2:])],
                            {"shape": [imp.attr_dim(d) for d in xt.shape[:2]] + [1, imp.attr_dim(xt.shape[2])]})
        w, = imp.g.add_node("reshape", [w], [wt.with_shape(wt.shape[:2] + (1,) + wt.shape[2:])],
                            {"shape": list(wt.shape[:2]) + [1, wt.shape[2]]})
        stride, padding, dilation = [1] + stride, [0] + padding, [1] + dilation
    ins = [x, w] + ([b] if b is not None else [])
    attrs = {"stride": list(stride), "padding": list(padding), "dilation": list(dilation), "groups": int(groups)}
    if spatial == 1:
        out_t = imp.ttype(node.meta["val"])
        y, = imp.g.add_node("conv2d", ins, [out_t.with_shape(out_t.shape[:2] + (1,) + out_t.shape[2:])], attrs)
        imp.emit(node, "reshape", [y], {"shape": [imp.attr_dim(d) for d in out_t.shape]})
    else:
        imp.emit(node, "conv2d", ins, attrs)
    return True


@converts("aten.conv2d.default", "aten.conv2d.padding", "aten.conv1d.default", "aten.conv1d.padding")
def _conv_nd(imp, node, a):
    return _conv(imp, node, a, 1 if "conv1d" in str(node.target) else 2)


@converts("aten.convolution.default")
def _convolution(imp, node, a):
    if a["transposed"]:
        return False
    spatial = len(a["stride"])
    if spatial not in (1, 2):
        return False
    return _conv(imp, node, a, spatial)


@converts("aten.scaled_dot_product_attention.default")
def _sdpa(imp, node, a):
    if a["dropout_p"]:
        return False
    q, k, v = imp.operand(a["query"]), imp.operand(a["key"]), imp.operand(a["value"])
    if a.get("enable_gqa"):
        k, v = (repeat_heads(imp, t, imp.g.type_of(q)) for t in (k, v))
        if k is None or v is None:
            return False
    ins = [q, k, v] + ([imp.operand(a["attn_mask"])] if a["attn_mask"] is not None else [])
    attrs = {"is_causal": bool(a["is_causal"])}
    if a["scale"] is not None:
        attrs["scale"] = float(a["scale"])
    imp.emit(node, "sdpa", ins, attrs)
    return True


# ---------------------------------------------------------------------------------- pools

def _unbatched(imp, node, op: str, x: str, attrs: dict) -> None:
    """A 2-d window op on an unbatched [C, H, W] input, run on its [1, C, H, W] view."""
    xt = imp.g.type_of(x)
    x4, = imp.g.add_node("reshape", [x], [xt.with_shape((1,) + xt.shape)], {"shape": [1] + [imp.attr_dim(d) for d in
                                                                                           xt.shape]})
    out_t = OPS[op].infer([imp.g.type_of(x4)], attrs)[0]
    y4, = imp.g.add_node(op, [x4], [out_t], attrs)
    imp.emit(node, "reshape", [y4], {"shape": [imp.attr_dim(d) for d in out_t.shape[1:]]})


@converts("aten.max_pool2d.default", "aten.max_pool2d_with_indices.default")
def _max_pool(imp, node, a):
    val = node.meta["val"]
    if isinstance(val, (tuple, list)) and any(u.target is operator.getitem and u.args[1] == 1 for u in node.users):
        return aten_reference(imp, node, "max_pool2d_with_indices")     # the indices are used
    k = pair(a["kernel_size"])
    attrs = {"kernel": k, "stride": pair(a["stride"]) if a["stride"] else k, "padding": pair(a["padding"]),
             "dilation": pair(a["dilation"]), "ceil_mode": bool(a["ceil_mode"])}
    x = imp.operand(a["self"])
    if imp.g.type_of(x).rank == 3 and not isinstance(val, (tuple, list)):
        _unbatched(imp, node, "max_pool2d", x, attrs)
        return True
    if imp.g.type_of(x).rank != 4:
        return False
    ty = imp.ttype(val[0] if isinstance(val, (tuple, list)) else val)
    out, = imp.g.add_node("max_pool2d", [x], [ty], attrs, names=[clean_name(node.name)])
    imp.env[node] = (out, None) if isinstance(val, (tuple, list)) else out
    return True


@converts("aten.avg_pool2d.default")
def _avg_pool(imp, node, a):
    if a.get("divisor_override") is not None:
        return False
    k = pair(a["kernel_size"])
    attrs = {"kernel": k, "stride": pair(a["stride"]) if a["stride"] else k, "padding": pair(a["padding"]),
             "ceil_mode": bool(a["ceil_mode"]), "count_include_pad": bool(a["count_include_pad"])}
    x = imp.operand(a["self"])
    if imp.g.type_of(x).rank == 3:
        _unbatched(imp, node, "avg_pool2d", x, attrs)
        return True
    if imp.g.type_of(x).rank != 4:
        return False
    imp.emit(node, "avg_pool2d", [x], attrs)
    return True


@converts("aten.adaptive_avg_pool2d.default", "aten._adaptive_avg_pool2d.default")
def _adaptive_pool(imp, node, a):
    imp.emit(node, "adaptive_avg_pool2d", [imp.operand(a["self"])], {"output_size": [int(v) for v in a["output_size"]]})
    return True


@converts("aten.adaptive_avg_pool1d.default")
def _adaptive_pool1d(imp, node, a):
    """[N, C, L] -> adaptive_avg_pool2d over [N, C, 1, L] to [1, out] -> [N, C, out]."""
    x = imp.operand(a["self"])
    xt = imp.g.type_of(x)
    if xt.rank != 3:
        return False
    out = int(a["output_size"][0])
    x4, = imp.g.add_node("reshape", [x], [xt.with_shape(xt.shape[:2] + (1, xt.shape[2]))],
                         {"shape": [imp.attr_dim(d) for d in xt.shape[:2]] + [1, imp.attr_dim(xt.shape[2])]})
    y, = imp.g.add_node("adaptive_avg_pool2d", [x4], [xt.with_shape(xt.shape[:2] + (1, out))],
                        {"output_size": [1, out]})
    imp.emit(node, "reshape", [y], {"shape": [imp.attr_dim(d) for d in xt.shape[:2]] + [out]})
    return True


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


@converts("aten.view.default", "aten.reshape.default", "aten._unsafe_view.default", "aten.unsqueeze.default",
          "aten.squeeze.dim", "aten.squeeze.dims", "aten.squeeze.default", "aten.flatten.using_ints",
          "aten.unflatten.int", "aten.view_as.default")
def _view(imp, node, a):
    imp.emit(node, "reshape", [imp.operand(a["self"])], {"shape": [imp.attr_dim(s) for s in node.meta["val"].shape]})
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


@converts("aten.slice.Tensor")
def _slice(imp, node, a):
    start = a["start"] if a["start"] is not None else 0
    end = a["end"] if a["end"] is not None else 2 ** 62
    start_d = imp.dim(start)
    if not isinstance(start_d, int):
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
    idx = imp.dim(a["index"])
    if not isinstance(idx, int):
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
    imp.emit(node, "concat", [imp.operand(t) for t in a["tensors"]], {"dim": int(a["dim"]) % len(node.meta["val"].shape)})
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
          "aten.fill.Scalar")
def _full(imp, node, a):
    short = str(node.target).split(".")[1]
    if short == "empty":
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


def repeat_axis(imp, x: str, dim: int, r: int, name: str | None = None) -> str:
    """Each slice along `dim` repeated r times in place: reshape [.., n, 1, ..], expand r, merge."""
    xt = imp.g.type_of(x)
    shape = list(xt.shape)
    wide = shape[:dim + 1] + [1] + shape[dim + 1:]
    y, = imp.g.add_node("reshape", [x], [xt.with_shape(wide)], {"shape": [imp.attr_dim(d) for d in wide]})
    wide[dim + 1] = r
    y, = imp.g.add_node("expand", [y], [xt.with_shape(wide)], {"shape": [imp.attr_dim(d) for d in wide]})
    shape[dim] = shape[dim] * r
    out, = imp.g.add_node("reshape", [y], [xt.with_shape(shape)], {"shape": [imp.attr_dim(d) for d in shape]},
                          names=[name] if name else None)
    return out


def repeat_heads(imp, kv: str, q_type) -> str | None:
    """Grouped-query attention: kv heads repeated to q's head count (axis -3)."""
    kt = imp.g.type_of(kv)
    hq, hk = q_type.shape[-3], kt.shape[-3]
    if not isinstance(hq, int) or not isinstance(hk, int) or hq % hk:
        return None
    return kv if hq == hk else repeat_axis(imp, kv, kt.rank - 3, hq // hk)
