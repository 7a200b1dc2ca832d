"""Elementwise ops: unary, binary (NumPy broadcasting, torch promotion), bitwise, where, clamp, cast."""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from graphmode.ir.ops.spec import OpSpec, Sample, broadcast_shapes, randn, register, result_dtype, same
from graphmode.ir.types import DTYPES, TensorType


def _positive(*shapes):
    return lambda g: [torch.rand(*s, generator=g) + 0.1 for s in shapes]


def _bools(*shapes):
    return lambda g: [torch.rand(*s, generator=g) > 0.5 for s in shapes]


_TO_ZERO = {"at_masked": 0.0, "value_floor": 0.0}      # never negative, 0 at a masked input

# name: (torch fn, flops per element, doc, sample maker, extra traits, ATen overloads[, value facts: OpSpec's
# at_masked (its value at a masked input) and value_floor (no output below it), read by the padding analysis])
_UNARY: dict[str, tuple] = {
    "neg": (torch.neg, 1, "-x", None, {"epilogue_safe"}, ("aten.neg.default",)),
    "exp": (torch.exp, 8, "e^x", None, {"precision_sensitive"}, ("aten.exp.default",), _TO_ZERO),
    "log": (torch.log, 8, "natural log", _positive, set(), ("aten.log.default",)),
    "sqrt": (torch.sqrt, 4, "square root", _positive, set(), ("aten.sqrt.default",), {"value_floor": 0.0}),
    "rsqrt": (torch.rsqrt, 4, "1/sqrt(x)", _positive, set(), ("aten.rsqrt.default",)),
    "reciprocal": (torch.reciprocal, 2, "1/x", _positive, set(), ("aten.reciprocal.default",)),
    "abs": (torch.abs, 1, "|x|", None, set(), ("aten.abs.default",), {"value_floor": 0.0}),
    "tanh": (torch.tanh, 10, "hyperbolic tangent", None, {"epilogue_safe"}, ("aten.tanh.default",),
             {"at_masked": -1.0}),
    "sigmoid": (torch.sigmoid, 10, "1/(1+e^-x)", None, {"epilogue_safe"}, ("aten.sigmoid.default",), _TO_ZERO),
    "relu": (torch.relu, 1, "max(x, 0)", None, {"epilogue_safe"}, ("aten.relu.default", "aten.relu_.default"),
             _TO_ZERO),
    "erf": (torch.erf, 10, "error function", None, {"epilogue_safe"}, ("aten.erf.default",), {"at_masked": -1.0}),
    "sin": (torch.sin, 10, "sine", None, set(), ("aten.sin.default",)),
    "cos": (torch.cos, 10, "cosine", None, set(), ("aten.cos.default",)),
    "silu": (F.silu, 12, "x*sigmoid(x)", None, {"epilogue_safe"}, ("aten.silu.default", "aten.silu_.default"),
             {"at_masked": -0.0}),
    "logical_not": (torch.logical_not, 1, "not x (bool)", _bools, set(),
                    ("aten.logical_not.default", "aten.bitwise_not.default"), {"value_floor": 0.0}),
    "identity": (lambda x: x.clone(), 0, "copy (clone/contiguous/alias after capture)", None, set(), ()),
    "floor": (torch.floor, 1, "round down", None, set(), ("aten.floor.default",)),
    "ceil": (torch.ceil, 1, "round up", None, set(), ("aten.ceil.default",)),
    "round": (torch.round, 1, "round half to even", None, set(), ("aten.round.default",)),
    "sign": (torch.sign, 1, "-1, 0 or 1", None, set(), ("aten.sign.default",)),
    "tan": (torch.tan, 10, "tangent", None, set(), ("aten.tan.default",)),
    "asin": (torch.asin, 10, "arc sine", lambda *s: _unit(*s), set(), ("aten.asin.default",)),
    "acos": (torch.acos, 10, "arc cosine", lambda *s: _unit(*s), set(), ("aten.acos.default",)),
    "atan": (torch.atan, 10, "arc tangent", None, set(), ("aten.atan.default",)),
    "sinh": (torch.sinh, 10, "hyperbolic sine", None, set(), ("aten.sinh.default",)),
    "cosh": (torch.cosh, 10, "hyperbolic cosine", None, set(), ("aten.cosh.default",)),
    "asinh": (torch.asinh, 10, "inverse hyperbolic sine", None, set(), ("aten.asinh.default",)),
    "acosh": (torch.acosh, 10, "inverse hyperbolic cosine", lambda *s: _above_one(*s), set(),
              ("aten.acosh.default",)),
    "atanh": (torch.atanh, 10, "inverse hyperbolic tangent", lambda *s: _unit(*s), set(), ("aten.atanh.default",)),
    "bitwise_not": (torch.bitwise_not, 1, "~x (integers)", lambda *s: _ints(*s), set(), ()),
}


def _unit(*shapes):
    return lambda g: [torch.rand(*s, generator=g) * 1.8 - 0.9 for s in shapes]


def _above_one(*shapes):
    return lambda g: [torch.rand(*s, generator=g) * 3 + 1.0 for s in shapes]


def _ints(*shapes):
    return lambda g: [torch.randint(-100, 100, s, generator=g) for s in shapes]


def _unary_ref(fn: Callable):
    return lambda ins, attrs, env: [fn(ins[0])]


for _name, (_fn, _cost, _doc, _make, _traits, _aten, *_values) in _UNARY.items():
    _infer = (lambda ins, attrs: [ins[0].with_dtype("bool")]) if _name == "logical_not" else same
    _maker = (_make or randn)((2, 3, 5))
    register(OpSpec(_name, "elementwise", (1, 1), _infer, _unary_ref(_fn), inplace=True, doc=_doc,
                    flops_per_elem=_cost, traits=frozenset(_traits), aten=_aten,
                    samples=(lambda m=_maker: [Sample(m)]), padding="pointwise", **(_values[0] if _values else {})))

register(OpSpec("gelu", "elementwise", (1, 1), same,
                lambda ins, a, env: [F.gelu(ins[0], approximate=a.get("approximate", "none"))],
                attrs=("approximate",), inplace=True, flops_per_elem=14, traits=frozenset({"epilogue_safe"}),
                doc="GELU; approximate='none' (erf) or 'tanh'",
                samples=lambda: [Sample(randn((2, 8))), Sample(randn((2, 8)), {"approximate": "tanh"})],
                padding="pointwise", at_masked=-0.0))
register(OpSpec("clamp", "elementwise", (1, 1), same,
                lambda ins, a, env: [torch.clamp(ins[0], a.get("min"), a.get("max"))],
                attrs=("min", "max"), inplace=True, traits=frozenset({"epilogue_safe"}),
                doc="clamp to [min, max] (either may be null); relu6 and hardtanh are clamps",
                samples=lambda: [Sample(randn((3, 7)), {"min": -0.5, "max": 0.5}), Sample(randn((4,)), {"min": 0.0})],
                padding="pointwise"))
register(OpSpec("cast", "elementwise", (1, 1), lambda ins, a: [ins[0].with_dtype(a["dtype"])],
                lambda ins, a, env: [ins[0].to(DTYPES[a["dtype"]])], attrs=("dtype",),
                doc="convert to dtype (torch .to semantics)",
                samples=lambda: [Sample(randn((2, 3)), {"dtype": "i64"}), Sample(_bools((5,)), {"dtype": "f32"})],
                padding="pointwise"))

# name: (torch fn, bool result, doc, traits, ATen overloads)
_BINARY: dict[str, tuple] = {
    "add": (torch.add, False, "a + b", {"commutative", "epilogue_safe"},
            ("aten.add.Tensor", "aten.add.Scalar", "aten.add_.Tensor")),
    "sub": (torch.sub, False, "a - b", {"epilogue_safe"}, ("aten.sub.Tensor", "aten.sub.Scalar")),
    "mul": (torch.mul, False, "a * b", {"commutative", "epilogue_safe"},
            ("aten.mul.Tensor", "aten.mul.Scalar", "aten.mul_.Tensor")),
    "div": (torch.div, False, "a / b (true division)", {"epilogue_safe"}, ("aten.div.Tensor", "aten.div.Scalar")),
    "pow": (torch.pow, False, "a ** b", {"precision_sensitive"},
            ("aten.pow.Tensor_Scalar", "aten.pow.Tensor_Tensor", "aten.pow.Scalar")),
    "remainder": (torch.remainder, False, "a mod b, the sign of b (Python's %)", set(),
                  ("aten.remainder.Tensor", "aten.remainder.Scalar")),
    "fmod": (torch.fmod, False, "a mod b, the sign of a (C's fmod)", set(), ("aten.fmod.Tensor", "aten.fmod.Scalar")),
    "maximum": (torch.maximum, False, "elementwise max", {"commutative", "epilogue_safe"}, ("aten.maximum.default",)),
    "minimum": (torch.minimum, False, "elementwise min", {"commutative", "epilogue_safe"},
                ("aten.minimum.default", "aten.min.other")),
    "eq": (torch.eq, True, "a == b", {"commutative"}, ("aten.eq.Tensor", "aten.eq.Scalar")),
    "ne": (torch.ne, True, "a != b", {"commutative"}, ("aten.ne.Tensor", "aten.ne.Scalar")),
    "lt": (torch.lt, True, "a < b", set(), ("aten.lt.Tensor", "aten.lt.Scalar")),
    "le": (torch.le, True, "a <= b", set(), ("aten.le.Tensor", "aten.le.Scalar")),
    "gt": (torch.gt, True, "a > b", set(), ("aten.gt.Tensor", "aten.gt.Scalar")),
    "ge": (torch.ge, True, "a >= b", set(), ("aten.ge.Tensor", "aten.ge.Scalar")),
    "logical_and": (torch.logical_and, True, "a and b", {"commutative"},
                    ("aten.logical_and.default", "aten.bitwise_and.Tensor", "aten.__and__.Tensor")),
    "logical_or": (torch.logical_or, True, "a or b", {"commutative"},
                   ("aten.logical_or.default", "aten.bitwise_or.Tensor", "aten.__or__.Tensor")),
    "bitwise_and": (torch.bitwise_and, False, "a & b (integers)", {"commutative"}, ()),
    "bitwise_or": (torch.bitwise_or, False, "a | b (integers)", {"commutative"}, ()),
    "bitwise_xor": (torch.bitwise_xor, False, "a ^ b (integers)", {"commutative"}, ()),
    "bitwise_left_shift": (torch.bitwise_left_shift, False, "a << b (integers)", set(),
                           ("aten.bitwise_left_shift.Tensor",)),
    "bitwise_right_shift": (torch.bitwise_right_shift, False, "a >> b (integers; arithmetic for signed)", set(),
                            ("aten.bitwise_right_shift.Tensor",)),
}


def _binary_infer(is_bool: bool, name: str):
    def infer(ins, attrs):
        shape = broadcast_shapes(ins[0].shape, ins[1].shape)
        dt = "bool" if is_bool else result_dtype(ins)
        if name == "div" and dt not in ("f32", "f64", "f16", "bf16"):
            dt = "f32"
        return [TensorType(dt, shape)]
    return infer


def _binary_ref(fn: Callable):
    return lambda ins, attrs, env: [fn(ins[0], ins[1])]


def _mod_grid(dtype: torch.dtype):
    """-9..9, the type's extremes and divisors of both signs (-1 included: INT_MIN % -1 traps
    on x86, so a kernel must not divide there)."""
    info = torch.iinfo(dtype)
    return lambda g: [torch.tensor(list(range(-9, 10)) + [info.min, info.max], dtype=dtype).reshape(21, 1),
                      torch.tensor([[-4, -3, -1, 1, 3, 4]], dtype=dtype)]


def _binary_samples(name: str):
    if name in ("logical_and", "logical_or"):
        return lambda: [Sample(_bools((2, 3), (2, 3))), Sample(_bools((4, 1), (1, 5)))]
    if name.startswith("bitwise_") and name.endswith("shift"):
        return lambda: [Sample(lambda g: [torch.randint(0, 200, (3, 4), generator=g, dtype=torch.uint8),
                                          torch.randint(0, 8, (3, 4), generator=g, dtype=torch.uint8)]),
                        Sample(lambda g: [torch.randint(0, 999, (5,), generator=g), torch.tensor(3)])]
    if name.startswith("bitwise_"):
        return lambda: [Sample(_ints((2, 3), (2, 3))), Sample(lambda g: [torch.randint(0, 255, (4, 1), generator=g,
                                                                                       dtype=torch.uint8),
                                                                         torch.tensor([[7, 240, 15]], dtype=torch.uint8)])]
    if name == "pow":
        return lambda: [Sample(lambda g: [torch.rand(3, 4, generator=g) + 0.5, torch.tensor(3.0)]),
                        Sample(lambda g: [torch.rand(2, 5, generator=g) + 0.5, torch.randn(2, 5, generator=g)])]
    if name == "div":
        return lambda: [Sample(lambda g: [torch.randn(3, 4, generator=g) * 4, torch.rand(3, 4, generator=g) + 0.5]),
                        Sample(lambda g: [torch.randint(-9, 9, (2, 5), generator=g), torch.tensor(4)])]
    if name in ("remainder", "fmod"):     # they differ only where the signs do: both signs, integers and floats
        return lambda: [Sample(lambda g: [torch.randn(3, 4, generator=g) * 4, (torch.rand(3, 4, generator=g) + 0.5)
                                          * (torch.randint(0, 2, (3, 4), generator=g) * 2 - 1)]),
                        Sample(_mod_grid(torch.int64)), Sample(_mod_grid(torch.int32)),
                        Sample(lambda g: [torch.arange(-9, 10).reshape(19, 1) / 2,
                                          torch.tensor([[-2.5, -1.5, -0.75, 0.75, 1.5, 2.5]])])]
    return lambda: [Sample(randn((2, 3, 4), (2, 3, 4))), Sample(randn((4, 1), (1, 5))),
                    Sample(lambda g: [torch.randn(3, 4, generator=g), torch.tensor(0.5)])]


for _name, (_fn, _is_bool, _doc, _traits, _aten) in _BINARY.items():
    register(OpSpec(_name, "elementwise", (2, 2), _binary_infer(_is_bool, _name), _binary_ref(_fn),
                    inplace=not _is_bool, doc=_doc + " (numpy broadcasting, torch type promotion)",
                    traits=frozenset(_traits), aten=_aten, samples=_binary_samples(_name), padding="pointwise"))


def _where_infer(ins, attrs):
    return [TensorType(result_dtype(ins[1:]), broadcast_shapes(*(t.shape for t in ins)))]


register(OpSpec("where", "elementwise", (3, 3), _where_infer,
                lambda ins, a, env: [torch.where(ins[0], ins[1], ins[2])], doc="cond ? a : b",
                aten=("aten.where.self",),
                samples=lambda: [Sample(lambda g: [torch.rand(3, 4, generator=g) > 0.5, torch.randn(3, 4, generator=g),
                                                   torch.randn(1, 4, generator=g)])], padding="pointwise"))
