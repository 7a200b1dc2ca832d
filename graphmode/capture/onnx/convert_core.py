"""ONNX converters: constants, elementwise ops, activations, softmax, norms, reductions."""
from __future__ import annotations


import math

import numpy as np
import sympy
import torch

from graphmode.capture.onnx.checks import ONNX_DTYPES as _ONNX_DTYPES
from graphmode.capture.onnx.checks import SUPPORTED_TYPES, CheckedNode, axis_check, check_axes, check_epsilon, type_name
from graphmode.ir.ops import broadcast_shapes, get_op, norm_axis
from graphmode.ir.types import DTYPES, normalize_dim

from graphmode.capture.onnx.fold import KNOWN_LIMIT, _FLOAT_DTYPES, _INT_DTYPES, _Known, _Unfoldable, _decide, _fold_elementwise, _is_sym, _objarr, _smax, _smin, _ufunc
from graphmode.capture.onnx.importer import _Importer, _attr_dim, _handles, _shape_attr, _to_tensor
from graphmode.capture.onnx.values import _data_sized


def _check_constant(nd: CheckedNode) -> None:
    t = nd.attrs.get("value")
    if t is not None and t.data_type not in _ONNX_DTYPES:
        raise nd.fail(f"value has element type {type_name(t.data_type)}, which graphmode has no dtype for",
                      type_name(t.data_type), f"use one of {SUPPORTED_TYPES}, or remove the constant")


@_handles("Constant", check=_check_constant)
def _constant(imp: _Importer, n) -> None:
    from onnx import numpy_helper
    out = n.output[0]
    for a in n.attribute:
        if a.name == "value":
            arr = numpy_helper.to_array(a.t)
            break
        if a.name == "value_float":
            arr = np.array(a.f, dtype=np.float32)
            break
        if a.name == "value_floats":
            arr = np.array(list(a.floats), dtype=np.float32)
            break
        if a.name == "value_int":
            arr = np.array(a.i, dtype=np.int64)
            break
        if a.name == "value_ints":
            arr = np.array(list(a.ints), dtype=np.int64)
            break
    else:
        raise imp.fail("Constant with a string or sparse value is not supported",
                       fix="only numeric tensor constants can be imported")
    t = _to_tensor(arr, a.t.data_type if a.name == "value" else None)
    if t.numel() <= KNOWN_LIMIT:
        imp.set_known(out, _Known.of(t))
    else:
        imp.big[out] = (t, "const")
        imp.check_declared(out)


@_handles("Identity")
def _identity(imp: _Importer, n) -> None:
    imp.alias(n.output[0], n.input[0])


@_handles("Dropout")
def _dropout(imp: _Importer, n) -> None:
    """Inference: the input unchanged and an all-true mask. In training mode Dropout draws a
    random mask, which inference does not reproduce: refused unless the ratio is 0."""
    mode_n, ratio_n = imp.opt_in(n, 2), imp.opt_in(n, 1)
    training = False
    if mode_n:
        k = imp.need_known(mode_n, "Dropout training_mode")
        training = bool(k.tensor().reshape(-1)[0].item()) if k.concrete and k.arr.size == 1 else None
        if training is None:
            raise imp.fail("Dropout training_mode must be a constant scalar", fix="declare it constant")
    if training:
        ratio = 0.5
        if ratio_n:
            k = imp.need_known(ratio_n, "Dropout ratio")
            ratio = float(k.tensor().reshape(-1)[0].item()) if k.concrete and k.arr.size == 1 else 0.5
        if ratio != 0.0:
            raise imp.fail(f"Dropout with training_mode=True and ratio {ratio} drops random elements; graphmode "
                           "compiles inference, which cannot reproduce that draw",
                           fix="export the model in eval mode (training_mode False), or set the ratio to 0")
    imp.alias(n.output[0], n.input[0])
    if len(n.output) > 1 and n.output[1]:
        t = imp.type_of(n.input[0])
        imp.emit("full", [], {"shape": _shape_attr(t.shape), "value": True, "dtype": "bool"}, out=n.output[1])


@_handles("Shape")
def _shape(imp: _Importer, n) -> None:
    t = imp.type_of(n.input[0])
    dims = list(t.shape)
    start, end = imp.attr(n, "start", 0), imp.attr(n, "end", None)
    dims = dims[slice(start, end)]
    imp.set_known(n.output[0], _Known(_objarr(dims), "i64"))


@_handles("Size")
def _size(imp: _Importer, n) -> None:
    imp.set_known(n.output[0], _Known(_objarr([imp.type_of(n.input[0]).numel()], ()), "i64"))


# ---- elementwise

_UNARY = {"Neg": "neg", "Abs": "abs", "Sqrt": "sqrt", "Reciprocal": "reciprocal", "Exp": "exp", "Log": "log",
          "Tanh": "tanh", "Erf": "erf", "Relu": "relu", "Sigmoid": "sigmoid", "Sin": "sin", "Cos": "cos",
          "Not": "logical_not", "Floor": "floor", "Ceil": "ceil", "Round": "round", "Sign": "sign", "Tan": "tan",
          "Asin": "asin", "Acos": "acos", "Atan": "atan", "Sinh": "sinh", "Cosh": "cosh", "Asinh": "asinh",
          "Acosh": "acosh", "Atanh": "atanh", "BitwiseNot": "bitwise_not"}
_BINARY = {"Add": "add", "Sub": "sub", "Mul": "mul", "Div": "div", "Pow": "pow", "Equal": "eq", "Less": "lt",
           "LessOrEqual": "le", "Greater": "gt", "GreaterOrEqual": "ge", "And": "logical_and",
           "Or": "logical_or", "Xor": "ne", "Max": "maximum", "Min": "minimum", "Sum": "add", "Mod": "remainder",
           "BitwiseAnd": "bitwise_and", "BitwiseOr": "bitwise_or", "BitwiseXor": "bitwise_xor",
           "BitShift": "bitwise_left_shift"}
_BOOL_OUT = {"Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "And", "Or", "Xor", "Not", "IsNaN",
             "IsInf"}

@_handles(*_UNARY, *_BINARY, "IsNaN", "IsInf")
def _elementwise(imp: _Importer, n) -> None:
    op = n.op_type
    ins = [i for i in n.input if i]
    in_dtype = imp.type_of(ins[0]).dtype
    out_dtype = "bool" if op in _BOOL_OUT else in_dtype
    if op in ("IsNaN", "IsInf"):
        x = imp.operand(ins[0])
        if op == "IsNaN":
            imp.emit("ne", [x, x], {}, out=n.output[0])
            return
        pos, neg = imp.attr(n, "detect_positive", 1), imp.attr(n, "detect_negative", 1)
        if pos and neg:
            x = imp.emit("abs", [x], {}, hint=f"{n.output[0]}_abs")
        inf = imp.materialise(_Known(_objarr([math.inf if pos else -math.inf], ()), in_dtype), "inf")
        if pos or neg:
            imp.emit("eq", [x, inf], {}, out=n.output[0])
        else:
            imp.emit("ne", [x, x], {}, hint=f"{n.output[0]}_nan")
            imp.emit("full", [], {"shape": _shape_attr(imp.g.type_of(x).shape), "value": False, "dtype": "bool"},
                     out=n.output[0])
        return
    if op == "Sign" and in_dtype in _FLOAT_DTYPES:
        _sign(imp, n)
        return
    irop = _UNARY.get(op) or _BINARY[op]
    if op == "Mod" and imp.attr(n, "fmod", 0):
        irop = "fmod"
    if op == "BitShift":
        direction = imp.attr_text(n, "direction", "")
        if direction not in ("LEFT", "RIGHT"):
            raise imp.fail(f"BitShift direction {direction!r}", fix="LEFT or RIGHT")
        irop = "bitwise_left_shift" if direction == "LEFT" else "bitwise_right_shift"
    if _fold_elementwise(imp, n, irop, ins, out_dtype):
        return
    if len(ins) == 1 and op in _UNARY:
        imp.emit(irop, [imp.operand(ins[0])], {}, out=n.output[0])
        return
    if op == "Div" and in_dtype in _INT_DTYPES:
        _int_div(imp, n, ins, in_dtype)
        return
    vals = [imp.operand(i) for i in ins]
    if len(vals) == 1:   # variadic Sum/Max/Min with one input
        imp.alias(n.output[0], ins[0])
        return
    cur = vals[0]
    for v in vals[1:-1]:
        cur = imp.emit(irop, [cur, v], {}, hint=n.output[0])
    last_dtype = get_op(irop).infer([imp.g.type_of(cur), imp.g.type_of(vals[-1])], {})[0].dtype
    if last_dtype == out_dtype:
        imp.emit(irop, [cur, vals[-1]], {}, out=n.output[0])
    else:   # torch promotion differs from ONNX (e.g. int ** float): cast back to ONNX's type
        cur = imp.emit(irop, [cur, vals[-1]], {}, hint=n.output[0])
        imp.emit("cast", [cur], {"dtype": out_dtype}, out=n.output[0])


def _sign(imp: _Importer, n) -> None:
    """Sign of a float: ONNX (and ONNX Runtime) give NaN at NaN, torch.sign gives 0 there, so NaN
    passes through around the core op."""
    k = imp.kn(n.input[0])
    if k is not None and k.concrete:
        t = k.tensor()
        imp.set_tensor(n.output[0], torch.where(t.isnan(), t, t.sign()))
        return
    x, h = imp.operand(n.input[0]), n.output[0]
    nan = imp.emit("ne", [x, x], {}, hint=f"{h}_nan")
    imp.emit("where", [nan, x, imp.emit("sign", [x], {}, hint=h)], {}, out=h)


def _int_div(imp: _Importer, n, ins: list[str], dtype: str) -> None:
    """ONNX integer Div truncates toward zero (C's `/`, what ONNX Runtime computes), for every value:
    the core `div` is true division, and a float detour rounds quotients above 2**53."""
    h = n.output[0]
    a, b = (imp.operand(i) for i in ins)
    if dtype == "u64":
        a, b = (imp.emit("cast", [v], {"dtype": "i64"}, hint=f"{h}_bits") for v in (a, b))
        imp.emit("cast", [_u64_div(imp, a, b, h)], {"dtype": dtype}, out=h)
        return
    if dtype in ("u16", "u32"):       # torch has no floor_divide for them; their values fit int64
        a, b = (imp.emit("cast", [v], {"dtype": "i64"}, hint=f"{h}_i64") for v in (a, b))
        q = _trunc_div(imp, a, b, h)
        imp.emit("cast", [q], {"dtype": dtype}, out=h)
        return
    _bind(imp, h, _trunc_div(imp, a, b, h))


def _u64_div(imp: _Importer, a: str, b: str, h: str) -> str:
    """uint64 a // b on their int64 bit patterns (torch has no uint64 division, and int64's differs
    above 2**63): halve a (a logical shift, which fits int64), divide, double, and add the one the
    halving may have lost (r = a - q * b, wrapping, is below 2 * b); a divisor of 2**63 or more
    gives 0 or 1. Unsigned order is signed order after adding -2**63 to both sides."""
    top = imp.scalar(-2 ** 63, "i64", f"{h}_2p63")

    def at_least(x: str, y: str) -> str:      # x >= y as unsigned, 0 or 1
        ge = imp.emit("ge", [imp.emit("add", [x, top], {}, hint=h), imp.emit("add", [y, top], {}, hint=h)], {},
                      hint=f"{h}_ge")
        return imp.emit("cast", [ge], {"dtype": "i64"}, hint=f"{h}_ge")
    half = imp.emit("bitwise_and", [imp.emit("bitwise_right_shift", [a, imp.scalar(1, "i64", f"{h}_one")], {},
                                             hint=h), imp.scalar(2 ** 63 - 1, "i64", f"{h}_low")], {}, hint=h)
    q = imp.emit_aten("floor_divide", [half, b], [{"$in": 0}, {"$in": 1}], hint=f"{h}_q")[0]
    q = imp.emit("add", [q, q], {}, hint=f"{h}_q")
    r = imp.emit("sub", [a, imp.emit("mul", [q, b], {}, hint=h)], {}, hint=f"{h}_r")
    q = imp.emit("add", [q, at_least(r, b)], {}, hint=f"{h}_q")
    big = imp.emit("lt", [b, imp.scalar(0, "i64", f"{h}_zero")], {}, hint=f"{h}_big")
    return imp.emit("where", [big, at_least(a, b), q], {}, hint=f"{h}_q")


def _trunc_div(imp: _Importer, a: str, b: str, hint: str) -> str:
    """a / b rounded toward zero, exact for integers: taking off the remainder with a's sign (fmod)
    leaves a multiple of b, whose floor division is exact and equals the truncated quotient."""
    exact = imp.emit("sub", [a, imp.emit("fmod", [a, b], {}, hint=f"{hint}_rem")], {}, hint=f"{hint}_exact")
    return imp.emit_aten("floor_divide", [exact, b], [{"$in": 0}, {"$in": 1}], hint=f"{hint}_q")[0]


def _bind(imp: _Importer, onnx_name: str, v: str) -> None:
    """ONNX value `onnx_name` is IR value `v` (checked against the model's declared type)."""
    imp.ir[onnx_name] = v
    imp.check_declared(onnx_name)


@_handles("BitCast")
def _bitcast(imp: _Importer, n) -> None:
    """The input's bytes read as another element type of the same width (opset 26): a copy that
    reinterprets, never converts."""
    x = imp.operand(n.input[0])
    src, to = imp.type_of(n.input[0]).dtype, _ONNX_DTYPES.get(imp.attr(n, "to"))
    if to is None:
        raise imp.fail(f"BitCast to element type {imp.attr(n, 'to')} is not supported",
                       fix=f"use one of {sorted(set(_ONNX_DTYPES.values()))}")
    width = DTYPES[src].itemsize, DTYPES[to].itemsize
    if width[0] != width[1]:
        raise imp.fail(f"BitCast from {src} to {to} changes the element width ({width[0]} to {width[1]} bytes)",
                       value=to, fix="BitCast needs types of one bit width; use Cast to convert values")
    if src == to:
        imp.alias(n.output[0], n.input[0])
        return
    _bind(imp, n.output[0], imp.emit_aten("view_copy", [x], [{"$in": 0}, {"$dtype": to}], overload="dtype",
                                          hint=n.output[0])[0])


@_handles("Cast", "CastLike")
def _cast(imp: _Importer, n) -> None:
    src = n.input[0]
    if n.op_type == "Cast":
        to = _ONNX_DTYPES.get(imp.attr(n, "to"))
    else:
        to = imp.type_of(n.input[1]).dtype
    if to is None:
        raise imp.fail(f"Cast to element type {imp.attr(n, 'to')} is not supported",
                       fix=f"use one of {sorted(set(_ONNX_DTYPES.values()))}")
    k = imp.kn(src)
    if k is not None:
        if k.concrete:
            imp.set_tensor(n.output[0], k.tensor().to(DTYPES[to]))
            return
        try:
            def conv(v):
                if not _is_sym(v):
                    return torch.tensor(v).to(DTYPES[to]).item()
                if to in _INT_DTYPES:
                    return v if v.is_integer else sympy.floor(v)
                if to in _FLOAT_DTYPES:
                    return v
                return not _decide(v, "eq")
            imp.set_known(n.output[0], _Known(_ufunc(conv, k.arr), to))
            return
        except _Unfoldable:
            pass
    if imp.type_of(src).dtype == to:
        imp.alias(n.output[0], src)
        return
    c = imp.const_source(src)
    if c is not None:   # e.g. f16 weights cast to f32: convert once, not per call
        imp.set_big(n.output[0], c[0].to(DTYPES[to]), c[1])
        return
    imp.emit("cast", [imp.operand(src)], {"dtype": to}, out=n.output[0])


@_handles("Where")
def _where(imp: _Importer, n) -> None:
    c, a, b = (imp.kn(i) for i in n.input)
    if c is not None and a is not None and b is not None and c.concrete:
        if a.concrete and b.concrete:
            imp.set_tensor(n.output[0], torch.where(c.tensor(), a.tensor(), b.tensor()))
            return
        shape = broadcast_shapes(c.shape, a.shape, b.shape)
        res = np.where(c.arr.astype(bool), a.arr, b.arr)
        imp.set_known(n.output[0], _Known(np.asarray(res, dtype=object).reshape(tuple(int(s) for s in shape)), a.dtype))
        return
    imp.emit("where", [imp.operand(i) for i in n.input], {}, out=n.output[0])


@_handles("Clip")
def _clip(imp: _Importer, n) -> None:
    """min(max(x, lo), hi): constant bounds become a clamp, run-time ones maximum/minimum. A
    bound left out is the type's lowest / largest value (ONNX's default), which on floats takes
    -inf and inf to the largest finite values, as ONNX Runtime does; on integers it is none."""
    lo_n, hi_n = imp.opt_in(n, 1), imp.opt_in(n, 2)
    dt = DTYPES.get(imp.type_of(n.input[0]).dtype)
    fin = torch.finfo(dt) if dt is not None and dt.is_floating_point else None
    if not lo_n and not hi_n and fin is None:
        imp.alias(n.output[0], n.input[0])
        return
    bounds: dict[str, float | int | None] = {"min": None if lo_n or fin is None else float(fin.min),
                                             "max": None if hi_n or fin is None else float(fin.max)}
    runtime: list[tuple[str, str]] = []
    for which, nm in (("min", lo_n), ("max", hi_n)):
        if not nm:
            continue
        k = imp.kn(nm)
        if k is not None and k.concrete and k.arr.size == 1:
            bounds[which] = k.tensor().reshape(-1)[0].item()
        else:
            runtime.append(("maximum" if which == "min" else "minimum", nm))
    x = imp.operand(n.input[0])
    if not runtime:
        imp.emit("clamp", [x], bounds, out=n.output[0])
        return
    if bounds["min"] is not None or bounds["max"] is not None:
        x = imp.emit("clamp", [x], bounds, hint=n.output[0])
    for i, (op, nm) in enumerate(runtime):
        x = imp.emit(op, [x, imp.operand(nm)], {}, out=n.output[0] if i == len(runtime) - 1 else None,
                     hint=n.output[0])


@_handles("Gelu")
def _gelu(imp: _Importer, n) -> None:
    approx = imp.attr_text(n, "approximate", "none")
    if approx not in ("none", "tanh"):
        raise imp.fail(f"Gelu approximate={approx!r}", fix="use 'none' or 'tanh'")
    x = imp.operand(n.input[0])
    if approx == "tanh":
        imp.emit("gelu", [x], {"approximate": approx}, out=n.output[0])
        return
    # ONNX's x * Phi(x) is +inf at +inf (ONNX Runtime); torch's exact GELU kernel gives NaN there
    h = n.output[0]
    dt = imp.g.type_of(x).dtype
    y = imp.emit("gelu", [x], {"approximate": approx}, hint=h)
    top = imp.emit("eq", [x, imp.scalar(float("inf"), dt, f"{h}_inf")], {}, hint=h)
    imp.emit("where", [top, x, y], {}, out=h)


@_handles("LeakyRelu", "HardSigmoid", "HardSwish", "Softplus")
def _activations(imp: _Importer, n) -> None:
    x = imp.operand(n.input[0])
    dt = imp.g.type_of(x).dtype
    out = n.output[0]

    def c(v):
        return imp.materialise(_Known(_objarr([float(v)], ()), dt), f"{out}_c")
    if n.op_type == "LeakyRelu":
        zero = c(0.0)
        pos = imp.emit("gt", [x, zero], {}, hint=f"{out}_pos")
        neg = imp.emit("mul", [x, c(imp.attr(n, "alpha", 0.01))], {}, hint=f"{out}_neg")
        imp.emit("where", [pos, x, neg], {}, out=out)
    elif n.op_type in ("HardSigmoid", "HardSwish"):
        alpha = imp.attr(n, "alpha", 0.2) if n.op_type == "HardSigmoid" else 1 / 6
        beta = imp.attr(n, "beta", 0.5)
        t = imp.emit("mul", [x, c(alpha)], {}, hint=f"{out}_a")
        t = imp.emit("add", [t, c(beta)], {}, hint=f"{out}_b")
        if n.op_type == "HardSigmoid":
            imp.emit("clamp", [t], {"min": 0.0, "max": 1.0}, out=out)
        else:
            t = imp.emit("clamp", [t], {"min": 0.0, "max": 1.0}, hint=f"{out}_hs")
            imp.emit("mul", [x, t], {}, out=out)
    else:  # Softplus: log(exp(x) + 1) overflows to inf above x ~ 88.7 in f32; torch's softplus is
        # log1p(exp(x)) below 20 and x above, accurate for large and very negative x alike
        _bind(imp, out, imp.emit_aten("softplus", [x], [{"$in": 0}], hint=out)[0])


# ---- softmax / norms / reductions


@_handles("Softmax", "LogSoftmax", check=axis_check(default=-1))
def _softmax(imp: _Importer, n) -> None:
    op = "softmax" if n.op_type == "Softmax" else "log_softmax"
    x = imp.operand(n.input[0])
    t = imp.g.type_of(x)
    axis = norm_axis(imp.attr(n, "axis", -1 if imp.opset >= 13 else 1), t.rank)
    if imp.opset >= 13 or axis == t.rank - 1:
        imp.emit(op, [x], {"dim": axis}, out=n.output[0])
        return
    s = imp.emit(op, [coerced_2d(imp, x, axis, n.output[0])], {"dim": 1}, hint=f"{n.output[0]}_sm")
    imp.emit("reshape", [s], {"shape": _shape_attr(t.shape)}, out=n.output[0])


def coerced_2d(imp: _Importer, x: str, axis: int, hint: str) -> str:
    """`x` as [prod(shape[:axis]), prod(shape[axis:])]: how Softmax, LogSoftmax and Hardmax before
    opset 13 read their axis (the op then runs over dim 1)."""
    t = imp.g.type_of(x)
    lead = normalize_dim(math.prod(t.shape[:axis]) if all(isinstance(d, int) for d in t.shape[:axis])
                         else sympy.Mul(*t.shape[:axis]))
    return imp.emit("reshape", [x], {"shape": [_attr_dim(lead), -1]}, hint=f"{hint}_2d")


def _check_layer_norm(nd: CheckedNode) -> None:
    x = nd.dims(0)
    nd.axis("axis", -1, len(x) if x is not None else None)
    check_epsilon(nd)
    if x is None:
        return
    axis = nd.attrs.get("axis", -1) % len(x)
    want = x[axis:]
    for i, what in ((1, "Scale"), (2, "B")):
        d = nd.dims(i)
        if d is not None and (len(d) != len(want) or any(isinstance(p, int) and isinstance(q, int) and p != q
                                                         for p, q in zip(d, want))):
            raise nd.fail(f"input {what} {nd.input(i)!r} has shape {d}; graphmode needs exactly the normalized "
                          f"shape {want} (axis {nd.attrs.get('axis', -1)})", d,
                          f"store {what} with shape {want} (expand it in the model if it was broadcast)")


@_handles("LayerNormalization", check=_check_layer_norm)
def _layer_norm(imp: _Importer, n) -> None:
    for extra in n.output[1:]:
        if extra and imp.consumers.get(extra):
            raise imp.fail("the Mean/InvStdDev outputs of LayerNormalization are used",
                           fix="only the normalized output is supported")
    x = imp.operand(n.input[0])
    t = imp.g.type_of(x)
    axis = norm_axis(imp.attr(n, "axis", -1), t.rank)
    ins = [x] + [imp.operand(i) for i in n.input[1:] if i]
    imp.emit("layer_norm", ins, {"normalized_rank": t.rank - axis, "eps": float(imp.attr(n, "epsilon", 1e-5))},
             out=n.output[0])


def _check_batch_norm(nd: CheckedNode) -> None:
    x = nd.dims(0)
    ch = x[1] if x is not None and len(x) >= 2 else None
    for i, what in ((1, "scale"), (2, "B"), (3, "mean"), (4, "var")):
        d = nd.dims(i)
        if d is not None and (len(d) != 1 or isinstance(ch, int) and isinstance(d[0], int) and d[0] != ch):
            raise nd.fail(f"input {what} {nd.input(i)!r} has shape {d}; it needs one value per channel ({ch})", d,
                          f"give {what} the shape [{ch}]")
    check_epsilon(nd)


@_handles("BatchNormalization", check=_check_batch_norm)
def _batch_norm(imp: _Importer, n) -> None:
    if imp.attr(n, "training_mode", 0):
        _batch_norm_training(imp, n)
        return
    for extra in n.output[1:]:
        if extra and imp.consumers.get(extra):
            raise imp.fail("BatchNormalization running-stat outputs are used", fix="export in eval mode")
    imp.emit("batch_norm", [imp.operand(i) for i in n.input[:5]], {"eps": float(imp.attr(n, "epsilon", 1e-5))},
             out=n.output[0])


def _batch_norm_training(imp: _Importer, n) -> None:
    """Training mode (ONNX's definition, no randomness): normalise with this batch's per-channel
    mean and biased variance; the running-stat outputs blend the inputs' stats with them by
    `momentum`."""
    x, scale, bias, run_mean, run_var = (imp.operand(i) for i in n.input[:5])
    t = imp.g.type_of(x)
    h, dt = n.output[0], t.dtype
    eps, momentum = float(imp.attr(n, "epsilon", 1e-5)), float(imp.attr(n, "momentum", 0.9))
    dims = [0] + list(range(2, t.rank))
    per_channel = {"shape": _shape_attr([t.shape[1]] + [1] * (t.rank - 2))}
    mean = imp.emit("mean", [x], {"dims": dims, "keepdim": True}, hint=f"{h}_mean")
    centred = imp.emit("sub", [x, mean], {}, hint=h)
    var = imp.emit("mean", [imp.emit("mul", [centred, centred], {}, hint=h)], {"dims": dims, "keepdim": True},
                   hint=f"{h}_var")
    std = imp.emit("sqrt", [imp.emit("add", [var, imp.scalar(eps, dt, f"{h}_eps")], {}, hint=h)], {}, hint=h)
    y = imp.emit("div", [centred, std], {}, hint=h)
    y = imp.emit("mul", [y, imp.emit("reshape", [scale], per_channel, hint=h)], {}, hint=h)
    imp.emit("add", [y, imp.emit("reshape", [bias], per_channel, hint=h)], {}, out=h)
    for i, (stat, running) in enumerate(((mean, run_mean), (var, run_var)), start=1):
        if len(n.output) > i and n.output[i]:
            flat = imp.emit("reshape", [stat], {"shape": _shape_attr([t.shape[1]])}, hint=n.output[i])
            old = imp.emit("mul", [running, imp.scalar(momentum, dt, f"{h}_momentum")], {}, hint=n.output[i])
            new = imp.emit("mul", [flat, imp.scalar(1.0 - momentum, dt, f"{h}_blend")], {}, hint=n.output[i])
            imp.emit("add", [old, new], {}, out=n.output[i])


_REDUCE = {"ReduceMean": "mean", "ReduceSum": "sum", "ReduceMax": "amax", "ReduceMin": "amin",
           "ReduceProd": "prod", "ReduceL2": None, "ReduceSumSquare": None, "ReduceL1": None}
# element terms before the sum: |x| (L1), x * x (SumSquare, L2)
_ABS_TERMS, _SQUARE_TERMS = ("ReduceL1",), ("ReduceSumSquare", "ReduceL2")
_TERMS = ("ReduceL1", "ReduceSumSquare", "ReduceL2")
_INT_ARITH = frozenset({"ReduceSum", "ReduceProd", "ReduceMean", "ReduceL1", "ReduceSumSquare", "ReduceL2"})


def _reduce_axes(imp: _Importer, n, rank: int) -> list[int] | None:
    """The sorted axes a Reduce* node reduces; None where empty axes mean no reduction at all."""
    axes_in = imp.opt_in(n, 1)
    if axes_in:
        axes = imp.ints_of(axes_in, f"{n.op_type} axes")
    else:
        axes = imp.attr(n, "axes", None)
        axes = list(axes) if axes is not None else []
    if not axes:
        if imp.attr(n, "noop_with_empty_axes", 0):
            return None
        axes = list(range(rank))
    return sorted({norm_axis(a, rank) for a in axes})


@_handles(*_REDUCE, check=check_axes)
def _reduce(imp: _Importer, n) -> None:
    x_name = n.input[0]
    t = imp.type_of(x_name)
    keep = bool(imp.attr(n, "keepdims", 1))
    axes = _reduce_axes(imp, n, t.rank)
    if axes is None:
        _reduce_noop(imp, n, t)
        return
    if _fold_reduce(imp, n, t, axes, keep):
        return
    if n.op_type in _INT_ARITH and t.dtype in _INT_DTYPES:
        _int_reduce(imp, n, t, axes, keep)
        return
    attrs = {"dims": axes, "keepdim": keep}
    op = _REDUCE[n.op_type]
    if op in ("amax", "amin") and any(t.shape[a] == 0 for a in axes):
        # over an empty axis: the identity of max / min (torch refuses to reduce it)
        out_t = get_op(op).infer([t], attrs)[0]
        imp.emit("full", [], {"shape": _shape_attr(out_t.shape), "value": _empty_extreme(t.dtype, op == "amax"),
                              "dtype": t.dtype}, out=n.output[0])
        return
    x = imp.operand(x_name)
    data_axes = [a for a in axes if _data_sized(t.shape[a])]
    if op in ("amax", "amin") and data_axes:
        # over a length only the data decides (the max score of what a mask kept): one element of the
        # identity appended, so an empty selection answers it as ONNX does and a real one is unchanged
        shape = list(t.shape)
        shape[data_axes[0]] = 1
        fill = imp.emit("full", [], {"shape": _shape_attr(shape), "value": _empty_extreme(t.dtype, op == "amax"),
                                     "dtype": t.dtype}, hint=f"{n.output[0]}_identity")
        x = imp.emit("concat", [x, fill], {"dim": data_axes[0]}, hint=f"{n.output[0]}_or_identity")
    if op is not None:
        imp.emit(op, [x], attrs, out=n.output[0])
        return
    s = imp.emit("sum", [_reduce_terms(imp, n.op_type, x, n.output[0])], attrs,
                 out=n.output[0] if n.op_type != "ReduceL2" else None, hint=f"{n.output[0]}_sum")
    if n.op_type == "ReduceL2":
        imp.emit("sqrt", [s], {}, out=n.output[0])


def _reduce_terms(imp: _Importer, op_type: str, x: str, hint: str) -> str:
    """What a Reduce* sums: |x| for L1, x * x for SumSquare and L2, else x."""
    if op_type in _ABS_TERMS:
        return imp.emit("abs", [x], {}, hint=f"{hint}_abs")
    if op_type in _SQUARE_TERMS:
        return imp.emit("mul", [x, x], {}, hint=f"{hint}_sq")
    return x


def _reduce_noop(imp: _Importer, n, t) -> None:
    """noop_with_empty_axes=1 with no axes: nothing is reduced, but the per-element part still applies
    (onnx.reference and ONNX Runtime: x * x for SumSquare, sqrt(x * x) for L2, |x| for L1)."""
    op = n.op_type           # (one name a line: the coverage table reads which ops each ONNX op emits)
    h = n.output[0]
    if op not in _TERMS:
        imp.alias(h, n.input[0])
        return
    if t.dtype in _INT_DTYPES:
        _int_reduce(imp, n, t, [], False)
        return
    v = _reduce_terms(imp, op, imp.operand(n.input[0]), h)
    _bind(imp, h, imp.emit("sqrt", [v], {}, hint=h) if op == "ReduceL2" else v)


def _fold_reduce(imp: _Importer, n, t, axes: list[int], keep: bool) -> bool:
    """Reduce a value known at import time (shape arithmetic): symbolic sums, products and extremes
    of dims (exact); concrete tensors as the emitted ops would (integers as `_int_reduce` does)."""
    k = imp.kn(n.input[0])
    if k is None:
        return False
    if not k.concrete:
        if n.op_type not in ("ReduceSum", "ReduceProd", "ReduceMax", "ReduceMin"):
            return False
        fn = {"ReduceSum": lambda a, b: a + b, "ReduceProd": lambda a, b: a * b,
              "ReduceMax": _smax, "ReduceMin": _smin}[n.op_type]
        arr = k.arr
        for ax in reversed(axes):
            arr = np.frompyfunc(fn, 2, 1).reduce(arr, axis=ax, keepdims=keep)
            arr = arr if isinstance(arr, np.ndarray) else _objarr([arr], ())
        imp.set_known(n.output[0], _Known(np.asarray(arr, dtype=object), k.dtype))
        return True
    tt = k.tensor()
    if n.op_type in _INT_ARITH and t.dtype in _INT_DTYPES:
        if t.dtype in ("u16", "u32", "u64"):
            return False       # torch has few kernels for them: the emitted ops run instead
        imp.set_tensor(n.output[0], _int_reduce_now(n.op_type, tt, axes, keep))
        return True

    def total(v: torch.Tensor) -> torch.Tensor:
        return v.sum(axes, keepdim=keep).to(tt.dtype)
    fns = {"ReduceMean": lambda: tt.mean(axes, keepdim=keep), "ReduceSum": lambda: total(tt),
           "ReduceL1": lambda: total(tt.abs()), "ReduceSumSquare": lambda: total(tt * tt),
           "ReduceMax": lambda: tt.amax(axes, keepdim=keep), "ReduceMin": lambda: tt.amin(axes, keepdim=keep),
           "ReduceProd": lambda: _prod(tt, axes, keep), "ReduceL2": lambda: total(tt * tt).sqrt()}
    imp.set_tensor(n.output[0], fns[n.op_type]())
    return True


def _int_reduce(imp: _Importer, n, t, axes: list[int], keep: bool) -> None:
    """Integer Sum/Prod/Mean/L1/SumSquare/L2 as ONNX Runtime computes them: in double, the result
    truncated toward zero and saturated at the input dtype's bounds (an int32 sum of 2**30 three times
    is 2**31 - 1, not a wrapped value; torch would also widen the result to int64). Exact wherever the
    partial results stay below 2**53; above, ONNX Runtime's own double sums round by their order."""
    op = n.op_type
    h = n.output[0]
    if t.dtype == "u64":
        raise imp.fail(f"{op} of uint64 values is not supported (ONNX Runtime has no kernel for it either)",
                       value=t.dtype, fix="cast the values to int64 in the model where they fit")
    v = _reduce_terms(imp, op, imp.emit("cast", [imp.operand(n.input[0])], {"dtype": "f64"}, hint=f"{h}_f64"), h)
    if axes:
        attrs = {"dims": axes, "keepdim": keep}
        v = imp.emit("prod" if op == "ReduceProd" else "mean" if op == "ReduceMean" else "sum", [v], attrs, hint=h)
    if op == "ReduceL2":
        v = imp.emit("sqrt", [v], {}, hint=h)
    _bind(imp, h, _saturate(imp, v, t.dtype, h))


def _int_reduce_now(op: str, t: torch.Tensor, axes: list[int], keep: bool) -> torch.Tensor:
    """`_int_reduce` at import time, for a known input: the same double arithmetic and saturation."""
    v = t.double()
    v = v.abs() if op in _ABS_TERMS else v * v if op in _SQUARE_TERMS else v
    if axes:
        v = _prod(v, axes, keep) if op == "ReduceProd" else v.mean(axes, keepdim=keep) if op == "ReduceMean" \
            else v.sum(axes, keepdim=keep)
    v = v.sqrt() if op == "ReduceL2" else v
    info = torch.iinfo(t.dtype)
    q = v.clamp(float(info.min), _top(info)).to(t.dtype)
    return torch.where(v >= 2.0 ** 63, info.max, q) if info.bits == 64 else q


def _top(info) -> float:
    """The largest double an integer type holds (below 2**63 for the 64-bit types)."""
    return float(info.max) if info.bits < 64 else float(2 ** 63 - 1024)


def _saturate(imp: _Importer, v: str, dtype: str, hint: str) -> str:
    """f64 `v` as integer `dtype`, truncated toward zero and saturated at the type's bounds (a plain
    cast wraps, or is undefined, out of range)."""
    info = torch.iinfo(DTYPES[dtype])
    q = imp.emit("clamp", [v], {"min": float(info.min), "max": _top(info)}, hint=f"{hint}_sat")
    q = imp.emit("cast", [q], {"dtype": dtype}, hint=hint)
    if info.bits < 64:
        return q
    over = imp.emit("ge", [v, imp.scalar(2.0 ** 63, "f64", f"{hint}_2p63")], {}, hint=f"{hint}_over")
    return imp.emit("where", [over, imp.scalar(info.max, dtype, f"{hint}_max"), q], {}, hint=hint)


@_handles("ReduceLogSumExp", check=check_axes)
def _reduce_log_sum_exp(imp: _Importer, n) -> None:
    """log(sum(exp(x))) shifted by the maximum (torch.logsumexp), as ONNX Runtime computes it: ONNX's
    function body, Log(ReduceSum(Exp(x))), overflows to inf once an element passes ~88 in f32. Integer
    inputs are left to that body (refused here, the importer falls back to it)."""
    t = imp.type_of(n.input[0])
    if t.dtype not in _FLOAT_DTYPES:
        raise imp.fail(f"ReduceLogSumExp of {t.dtype} values: only float inputs have a converter",
                       fix="the importer imports it through ONNX's function body")
    axes, h = _reduce_axes(imp, n, t.rank), n.output[0]
    if axes is None:        # log(exp(x)) = x, element by element
        imp.alias(h, n.input[0])
        return
    keep = bool(imp.attr(n, "keepdims", 1))
    _bind(imp, h, imp.emit_aten("logsumexp", [imp.operand(n.input[0])], [{"$in": 0}, axes, keep], hint=h)[0])


def _empty_extreme(dtype: str, is_max: bool):
    """ONNX's max (min) over no element: the dtype's lowest (highest) value."""
    if dtype == "bool":
        return not is_max
    if dtype in _FLOAT_DTYPES:
        return -math.inf if is_max else math.inf
    info = torch.iinfo(DTYPES[dtype])
    return info.min if is_max else info.max


def _prod(t: torch.Tensor, axes: list[int], keep: bool) -> torch.Tensor:
    for ax in reversed(axes):
        t = t.prod(ax, keepdim=keep)
    return t
