"""Data ops: gathers (embedding, index_select, index, gather), constructors, triangles."""
from __future__ import annotations

import sympy
import torch
import torch.nn.functional as F

from graphmode.ir.ops.spec import OpSpec, Sample, broadcast_shapes, eval_shape, norm_axis, randn, register, same
from graphmode.ir.types import DTYPES, TensorType, eval_dim, normalize_dim


def _ints(high: int, *shapes):
    return lambda g: [torch.randint(0, high, s, generator=g) for s in shapes]


register(OpSpec("embedding", "data", (2, 2),
                lambda ins, a: [TensorType(ins[0].dtype, ins[1].shape + (ins[0].shape[1],))],
                lambda ins, a, env: [F.embedding(ins[1], ins[0])], traits=frozenset({"index_dependent"}),
                aten=("aten.embedding.default",), doc="rows of table (input 0) at indices (input 1)",
                samples=lambda: [Sample(lambda g: [torch.randn(10, 4, generator=g),
                                                   torch.randint(0, 10, (2, 5), generator=g)])], padding="gather"))
register(OpSpec("index_select", "data", (2, 2),
                lambda ins, a: [ins[0].with_shape(tuple(ins[1].shape[0] if i == norm_axis(a["dim"], ins[0].rank) else d
                                                        for i, d in enumerate(ins[0].shape)))],
                lambda ins, a, env: [torch.index_select(ins[0], a["dim"], ins[1])], attrs=("dim",),
                traits=frozenset({"index_dependent"}), doc="select entries along dim by a 1-d index",
                samples=lambda: [Sample(lambda g: [torch.randn(4, 6, generator=g),
                                                   torch.randint(0, 6, (3,), generator=g)], {"dim": 1}),
                                 Sample(lambda g: [torch.randn(3, 4, 5, generator=g),
                                                   torch.randint(0, 4, (7,), generator=g)], {"dim": 1})],
                padding="gather"))


def _index_infer(ins, a):
    x, idx = ins[0], ins[1:]
    dims = list(a["dims"])
    bshape = broadcast_shapes(*(t.shape for t in idx))
    rest = [d for i, d in enumerate(x.shape) if i not in dims]
    consecutive = dims == list(range(dims[0], dims[0] + len(dims)))
    if consecutive:
        shape = list(x.shape[:dims[0]]) + list(bshape) + list(x.shape[dims[-1] + 1:])
    else:
        shape = list(bshape) + rest
    return [x.with_shape(shape)]


def _index_ref(ins, a, env):
    key: list = [slice(None)] * ins[0].dim()
    for d, t in zip(a["dims"], ins[1:]):
        key[d] = t
    return [ins[0][tuple(key)]]


register(OpSpec("index", "data", (2, 9), _index_infer, _index_ref, attrs=("dims",),
                traits=frozenset({"index_dependent"}),
                doc="advanced indexing x[..., i0, ..., i1] with integer index tensors on `dims` (torch rules)",
                samples=lambda: [Sample(lambda g: [torch.randn(3, 5, 4, generator=g),
                                                   torch.randint(0, 5, (2, 3), generator=g)], {"dims": [1]}),
                                 Sample(lambda g: [torch.randn(3, 5, generator=g), torch.arange(3),
                                                   torch.randint(0, 5, (3,), generator=g)], {"dims": [0, 1]})],
                padding="gather"))


def _gather_infer(ins, a):
    return [ins[0].with_shape(ins[1].shape)]


register(OpSpec("gather", "data", (2, 2), _gather_infer,
                lambda ins, a, env: [torch.gather(ins[0], a["dim"], ins[1])], attrs=("dim",),
                traits=frozenset({"index_dependent"}), aten=("aten.gather.default",),
                doc="out[i][j] = x[i][index[i][j]] along dim (torch.gather)",
                samples=lambda: [Sample(lambda g: [torch.randn(3, 6, generator=g),
                                                   torch.randint(0, 6, (3, 4), generator=g)], {"dim": 1}),
                                 Sample(lambda g: [torch.randn(5, 4, generator=g),
                                                   torch.randint(0, 5, (2, 3), generator=g)], {"dim": 0})],
                padding="gather"))


def _arange_infer(ins, a):
    start, end, step = normalize_dim(a.get("start", 0)), normalize_dim(a["end"]), a.get("step", 1)
    n = normalize_dim(sympy.ceiling((sympy.sympify(end) - start) / step))
    return [TensorType(a.get("dtype", "i64"), (n,))]


register(OpSpec("arange", "data", (0, 0), _arange_infer,
                lambda ins, a, env: [torch.arange(eval_dim(normalize_dim(a.get("start", 0)), env),
                                                  eval_dim(normalize_dim(a["end"]), env), a.get("step", 1),
                                                  dtype=DTYPES[a.get("dtype", "i64")])],
                attrs=("start", "end", "step", "dtype"), doc="[start, end) by step; end may be symbolic",
                samples=lambda: [Sample(lambda g: [], {"start": 1, "end": 9, "step": 2, "dtype": "i64"})],
                padding="arange"))
register(OpSpec("full", "data", (0, 0), lambda ins, a: [TensorType(a.get("dtype", "f32"), tuple(a["shape"]))],
                lambda ins, a, env: [torch.full(eval_shape(a["shape"], env), a["value"],
                                                dtype=DTYPES[a.get("dtype", "f32")])],
                attrs=("shape", "value", "dtype"), doc="a tensor filled with value; shape may be symbolic",
                samples=lambda: [Sample(lambda g: [], {"shape": [2, 3], "value": 1.5, "dtype": "f32"})],
                padding="full"))
register(OpSpec("triu", "data", (1, 1), same, lambda ins, a, env: [torch.triu(ins[0], a.get("diagonal", 0))],
                attrs=("diagonal",), traits=frozenset({"index_dependent"}), aten=("aten.triu.default",),
                doc="upper triangle (last two dims)",
                samples=lambda: [Sample(randn((4, 4)), {"diagonal": 1})], padding="triangle"))
register(OpSpec("tril", "data", (1, 1), same, lambda ins, a, env: [torch.tril(ins[0], a.get("diagonal", 0))],
                attrs=("diagonal",), traits=frozenset({"index_dependent"}), aten=("aten.tril.default",),
                doc="lower triangle (last two dims)",
                samples=lambda: [Sample(randn((2, 4, 4)))], padding="triangle"))
