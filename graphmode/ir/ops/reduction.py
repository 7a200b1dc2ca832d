"""Reductions, scans and normalisations along axes."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from graphmode.ir.ops.spec import OpSpec, Sample, norm_axis, randn, register, same


def _reduce_infer(ins, attrs):
    t = ins[0]
    dims = sorted({norm_axis(d, t.rank) for d in attrs.get("dims", range(t.rank))})
    keep = attrs.get("keepdim", False)
    shape = [(1 if i in dims else d) for i, d in enumerate(t.shape)] if keep else \
        [d for i, d in enumerate(t.shape) if i not in dims]
    return [t.with_shape(shape)]


_INTEGRAL = ("bool", "u8", "u16", "u32", "i8", "i16", "i32")


def _sum_infer(ins, attrs):
    """torch.sum and prod widen bool and every integer type to int64 (counting a mask is a sum)."""
    out = _reduce_infer(ins, attrs)[0]
    return [out.with_dtype("i64") if ins[0].dtype in _INTEGRAL else out]


def _mk_reduce(fn):
    def ref(ins, a, env):
        dims = a.get("dims", list(range(ins[0].dim())))
        return [fn(ins[0], dim=list(dims), keepdim=a.get("keepdim", False))]
    return ref


def _reduce_samples():
    return [Sample(randn((2, 3, 5)), {"dims": [2]}), Sample(randn((2, 3, 5)), {"dims": [0, 2], "keepdim": True}),
            Sample(randn((4, 6)), {"dims": [1]})]


# name: (torch fn, traits, ATen overloads, doc word, pad_identity: the padding that leaves it unchanged)
_REDUCE = {"sum": (torch.sum, {"precision_sensitive"}, ("aten.sum.dim_IntList",), "sum", "zero"),
           "mean": (torch.mean, {"precision_sensitive"}, ("aten.mean.dim",), "mean", None),   # see pad_why below
           "amax": (torch.amax, set(), ("aten.amax.default",), "max", "masked"),
           "amin": (torch.amin, set(), ("aten.amin.default",), "min", None)}
for _name, (_fn, _traits, _aten, _what, _identity) in _REDUCE.items():
    register(OpSpec(_name, "reduction", (1, 1), _sum_infer if _name == "sum" else _reduce_infer, _mk_reduce(_fn),
                    attrs=("dims", "keepdim"),
                    doc=f"{_what} over dims", traits=frozenset(_traits | {"row_reduction"}), aten=_aten,
                    samples=_reduce_samples, padding="reduce", pad_identity=_identity,
                    pad_why="the padded length changes the divisor" if _name == "mean" else ""))


def _prod(x: torch.Tensor, dim: list[int], keepdim: bool) -> torch.Tensor:
    for d in sorted((d % max(x.dim(), 1) for d in dim), reverse=True):
        x = torch.prod(x, d, keepdim=keepdim)
    return x


register(OpSpec("prod", "reduction", (1, 1), _sum_infer, _mk_reduce(_prod), attrs=("dims", "keepdim"),
                doc="product over dims (1 over an empty axis)", traits=frozenset({"precision_sensitive"}),
                aten=("aten.prod.dim_int",), samples=lambda: [Sample(randn((2, 3, 5)), {"dims": [2]}),
                                                              Sample(randn((2, 3, 4)), {"dims": [0, 2],
                                                                                        "keepdim": True})],
                padding="reduce", pad_identity="one"))


def _arg_infer(ins, attrs):
    t = ins[0]
    dim = norm_axis(attrs["dim"], t.rank)
    keep = attrs.get("keepdim", False)
    shape = [(1 if i == dim else d) for i, d in enumerate(t.shape)] if keep else \
        [d for i, d in enumerate(t.shape) if i != dim]
    return [t.with_shape(shape).with_dtype("i64")]


for _name, _fn in (("argmax", torch.argmax), ("argmin", torch.argmin)):
    register(OpSpec(_name, "reduction", (1, 1), _arg_infer,
                    (lambda fn: lambda ins, a, env: [fn(ins[0], dim=a["dim"], keepdim=a.get("keepdim", False))])(_fn),
                    attrs=("dim", "keepdim"), traits=frozenset({"index_dependent"}),
                    doc=f"index of the {_name[3:]} along dim (the first one on ties), i64",
                    samples=lambda: [Sample(randn((3, 7)), {"dim": 1}), Sample(randn((2, 3, 4)), {"dim": 0,
                                                                                               "keepdim": True})],
                    padding="argreduce", pad_identity="masked" if _name == "argmax" else None))

register(OpSpec("softmax", "reduction", (1, 1), same,
                lambda ins, a, env: [torch.softmax(ins[0], a["dim"])], attrs=("dim",), flops_per_elem=5,
                traits=frozenset({"row_reduction", "precision_sensitive", "keep_f32"}), doc="softmax along dim",
                samples=lambda: [Sample(randn((2, 4, 6)), {"dim": -1}), Sample(randn((5, 3)), {"dim": 0})],
                padding="along", pad_identity="masked", at_masked=0.0))
register(OpSpec("log_softmax", "reduction", (1, 1), same,
                lambda ins, a, env: [torch.log_softmax(ins[0], a["dim"])], attrs=("dim",), flops_per_elem=5,
                traits=frozenset({"row_reduction", "precision_sensitive"}), doc="log-softmax along dim",
                samples=lambda: [Sample(randn((2, 4, 6)), {"dim": -1})], padding="along", pad_identity="masked",
                at_masked=float("-inf")))
register(OpSpec("cumsum", "reduction", (1, 1),
                lambda ins, a: [ins[0].with_dtype("i64" if ins[0].dtype in ("bool", "u8", "i8", "i16", "i32")
                                                  else ins[0].dtype)],
                lambda ins, a, env: [torch.cumsum(ins[0], a["dim"])], attrs=("dim",),
                traits=frozenset({"index_dependent"}),
                doc="inclusive prefix sum along dim (integer inputs accumulate in i64)",
                samples=lambda: [Sample(randn((3, 6)), {"dim": 1}),
                                 Sample(lambda g: [torch.randint(0, 3, (2, 5), generator=g)], {"dim": 1})],
                padding="along"))


def _layer_norm_ref(ins, a, env):
    x = ins[0]
    n = a.get("normalized_rank", 1)
    w = ins[1] if len(ins) > 1 else None
    b = ins[2] if len(ins) > 2 else None
    return [F.layer_norm(x, tuple(x.shape[-n:]), w, b, a.get("eps", 1e-5))]


register(OpSpec("layer_norm", "norm", (1, 3), same, _layer_norm_ref, attrs=("normalized_rank", "eps"),
                flops_per_elem=8, traits=frozenset({"row_reduction", "precision_sensitive", "keep_f32"}),
                doc="layer norm over the last `normalized_rank` dims; inputs x, [weight, [bias]]",
                samples=lambda: [Sample(randn((2, 3, 8), (8,), (8,)), {"eps": 1e-5}),
                                 Sample(randn((2, 4, 6)), {"normalized_rank": 2, "eps": 1e-6})], padding="norm"))
register(OpSpec("batch_norm", "norm", (5, 5), same,
                lambda ins, a, env: [F.batch_norm(ins[0], ins[3], ins[4], ins[1], ins[2], False, 0.0,
                                                  a.get("eps", 1e-5))],
                attrs=("eps",), flops_per_elem=4,
                doc="inference batch norm over channel dim 1; inputs x, weight, bias, running_mean, running_var",
                samples=lambda: [Sample(lambda g: [torch.randn(2, 3, 4, 4, generator=g), torch.randn(3, generator=g),
                                                   torch.randn(3, generator=g), torch.randn(3, generator=g),
                                                   torch.rand(3, generator=g) + 0.5], {"eps": 1e-5})], padding="norm"))
