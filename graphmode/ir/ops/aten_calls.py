"""Each core op's eager ATen equivalent: the `torch.ops.aten` call that computes what the op
computes, stored on its `OpSpec` as `aten_call`. A backend that cannot run an op, or a
recipe that excludes it, keeps it as an eager `fallback` node making this call (the ONNX
importer does, for excluded ops); the op coverage test runs every sample through it and
checks it against the op's reference.

A call is `(target, args, kwargs)` encoded as a `fallback` node's attributes are
(graphmode/ir/fallback.py): `{"$in": i}` for input i, `{"$dim": "seq"}` for a symbolic
size, `{"$dtype": "f32"}` for a dtype. Ops without one (quantized, paged, collective,
region ops) cannot fall back to eager.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

from graphmode.ir.ops.spec import OPS, pair
from graphmode.ir.types import TensorType, dim_str

AtenCall = tuple[str, list, dict]
CallFn = Callable[[Mapping[str, Any], Sequence[TensorType]], AtenCall]
SLICE_TO_END = 2 ** 62         # the IR's "to the end" slice bound


def _dim(d) -> Any:
    return d if isinstance(d, int) else {"$dim": d if isinstance(d, str) else dim_str(d)}


def _ins(types: Sequence[TensorType]) -> list[dict]:
    return [{"$in": i} for i in range(len(types))]


def declare(*ops: str) -> Callable[[CallFn], CallFn]:
    """Attach `fn` as the ATen call of `ops` (their `OpSpec.aten_call`)."""
    def deco(fn: CallFn) -> CallFn:
        for op in ops:
            object.__setattr__(OPS[op], "aten_call", fn)
        return fn
    return deco


def aten_call(op: str, attrs: Mapping[str, Any], types: Sequence[TensorType]) -> AtenCall | None:
    """The eager ATen call equivalent to one node of `op` with these attributes and input types, or None."""
    fn = OPS[op].aten_call
    return fn(attrs, types) if fn is not None else None


# ---------------------------------------------------------------------------------- pointwise

def _same_name(overload: str) -> Callable[[str], CallFn]:
    return lambda op: lambda a, t: (f"aten.{op}.{overload}", _ins(t), {})


for _op in ("neg", "exp", "log", "sqrt", "rsqrt", "reciprocal", "abs", "tanh", "sigmoid", "relu", "erf", "sin", "cos",
            "silu", "logical_not", "floor", "ceil", "round", "sign", "tan", "asin", "acos", "atan", "sinh", "cosh",
            "asinh", "acosh", "atanh", "bitwise_not", "maximum", "minimum", "logical_and", "logical_or"):
    declare(_op)(_same_name("default")(_op))
for _op in ("add", "sub", "mul", "div", "eq", "ne", "lt", "le", "gt", "ge", "remainder", "fmod", "bitwise_and",
            "bitwise_or", "bitwise_xor", "bitwise_left_shift", "bitwise_right_shift"):
    declare(_op)(_same_name("Tensor")(_op))
declare("pow")(lambda a, t: ("aten.pow.Tensor_Tensor", _ins(t), {}))
declare("identity")(lambda a, t: ("aten.clone.default", _ins(t), {}))
declare("where")(lambda a, t: ("aten.where.self", _ins(t), {}))
declare("gelu")(lambda a, t: ("aten.gelu.default", _ins(t), {"approximate": a.get("approximate", "none")}))
declare("cast")(lambda a, t: ("aten._to_copy.default", _ins(t), {"dtype": {"$dtype": a["dtype"]}}))
declare("clamp")(lambda a, t: ("aten.clamp.default", _ins(t) + [a.get("min"), a.get("max")], {}))

# ---------------------------------------------------------------------------------- reductions and norms

declare("softmax")(lambda a, t: ("aten._softmax.default", _ins(t) + [a["dim"], False], {}))
declare("log_softmax")(lambda a, t: ("aten._log_softmax.default", _ins(t) + [a["dim"], False], {}))
for _op, _target in (("sum", "sum.dim_IntList"), ("mean", "mean.dim"), ("amax", "amax.default"),
                     ("amin", "amin.default")):
    declare(_op)((lambda target: lambda a, t: (f"aten.{target}", _ins(t) + [list(a["dims"]), a.get("keepdim", False)],
                                               {}))(_target))
declare("cumsum")(lambda a, t: ("aten.cumsum.default", _ins(t) + [a["dim"]], {}))
for _op in ("argmax", "argmin"):
    declare(_op)((lambda op: lambda a, t: (f"aten.{op}.default", _ins(t) + [a["dim"], a.get("keepdim", False)],
                                           {}))(_op))


@declare("layer_norm")
def _layer_norm(a, t):
    k = a.get("normalized_rank", 1)
    ins = _ins(t)
    return ("aten.layer_norm.default", [ins[0], [_dim(d) for d in t[0].shape[len(t[0].shape) - k:]],
                                        ins[1] if len(ins) > 1 else None, ins[2] if len(ins) > 2 else None,
                                        a.get("eps", 1e-5)], {})


@declare("batch_norm")
def _batch_norm(a, t):
    ins = _ins(t)
    return "aten.batch_norm.default", [*ins[:5], False, 0.0, a.get("eps", 1e-5), False], {}


# ---------------------------------------------------------------------------------- contractions and windows

declare("matmul")(lambda a, t: ("aten.matmul.default", _ins(t), {}))
declare("linear")(lambda a, t: ("aten.linear.default", _ins(t), {}))


@declare("conv2d")
def _conv2d(a, t):
    ins = _ins(t)
    return ("aten.conv2d.default", [ins[0], ins[1], ins[2] if len(ins) > 2 else None, pair(a.get("stride", 1)),
                                    pair(a.get("padding", 0)), pair(a.get("dilation", 1)), a.get("groups", 1)], {})


@declare("conv_transpose2d")
def _conv_transpose2d(a, t):
    ins = _ins(t)
    return ("aten.conv_transpose2d.input", [ins[0], ins[1], ins[2] if len(ins) > 2 else None, pair(a.get("stride", 1)),
                                            pair(a.get("padding", 0)), pair(a.get("output_padding", 0)),
                                            a.get("groups", 1), pair(a.get("dilation", 1))], {})


declare("max_pool2d")(lambda a, t: ("aten.max_pool2d.default", _ins(t) + [
    pair(a["kernel"]), pair(a.get("stride") or a["kernel"]), pair(a.get("padding", 0)), pair(a.get("dilation", 1)),
    a.get("ceil_mode", False)], {}))
declare("avg_pool2d")(lambda a, t: ("aten.avg_pool2d.default", _ins(t) + [
    pair(a["kernel"]), pair(a.get("stride") or a["kernel"]), pair(a.get("padding", 0)), a.get("ceil_mode", False),
    a.get("count_include_pad", True)], {}))
declare("adaptive_avg_pool2d")(lambda a, t: ("aten.adaptive_avg_pool2d.default",
                                             _ins(t) + [pair(a["output_size"])], {}))
# torch's sdpa gives 0 on a row attending no key; it has no [batch, seq, heads, dim] layout
declare("sdpa")(lambda a, t: None if a.get("nan_empty_rows") or a.get("layout", "bhsd") != "bhsd" else (
    "aten.scaled_dot_product_attention.default",
    _ins(t)[:3] + [_ins(t)[3] if len(t) > 3 else None, 0.0, a.get("is_causal", False)], {"scale": a.get("scale")}))
declare("einsum")(lambda a, t: ("aten.einsum.default", [a["equation"], _ins(t)], {}))

# ---------------------------------------------------------------------------------- layout and data

declare("reshape")(lambda a, t: ("aten.reshape.default", _ins(t) + [[_dim(d) for d in a["shape"]]], {}))
declare("permute")(lambda a, t: ("aten.permute.default", _ins(t) + [list(a["perm"])], {}))
declare("expand")(lambda a, t: ("aten.expand.default", _ins(t) + [[_dim(d) for d in a["shape"]]], {}))
declare("slice")(lambda a, t: ("aten.slice.Tensor", _ins(t) + [a["dim"], a.get("start", 0),
                                                               _dim(a.get("end", SLICE_TO_END)), a.get("step", 1)], {}))
declare("pad")(lambda a, t: ("aten.constant_pad_nd.default", _ins(t) + [list(a["pads"]), a.get("value", 0.0)], {}))
declare("roll")(lambda a, t: ("aten.roll.default", _ins(t) + [list(a["shifts"]), list(a["dims"])], {}))
declare("concat")(lambda a, t: ("aten.cat.default", [_ins(t), a["dim"]], {}))
declare("embedding")(lambda a, t: ("aten.embedding.default", _ins(t), {}))
declare("index_select")(lambda a, t: ("aten.index_select.default", [{"$in": 0}, a["dim"], {"$in": 1}], {}))
declare("index")(lambda a, t: ("aten.index.Tensor", [{"$in": 0}, [{"$in": 1 + a["dims"].index(d)} if d in a["dims"]
                                                                  else None for d in range(max(a["dims"]) + 1)]], {}))
declare("gather")(lambda a, t: ("aten.gather.default", [{"$in": 0}, a["dim"], {"$in": 1}], {}))
declare("arange")(lambda a, t: ("aten.arange.start_step", [_dim(a.get("start", 0)), _dim(a["end"]), a.get("step", 1)],
                                {"dtype": {"$dtype": a.get("dtype", "i64")}}))
declare("full")(lambda a, t: ("aten.full.default", [[_dim(d) for d in a["shape"]], a["value"]],
                              {"dtype": {"$dtype": a.get("dtype", "f32")}}))
for _op in ("triu", "tril"):
    declare(_op)((lambda op: lambda a, t: (f"aten.{op}.default", _ins(t) + [a.get("diagonal", 0)], {}))(_op))
