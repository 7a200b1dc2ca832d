"""Shape ops: reshape (a view), permute, expand, slice, concat, pad, roll."""
from __future__ import annotations

import sympy
import torch
import torch.nn.functional as F

from graphmode.errors import IRError
from graphmode.ir.ops.spec import OpSpec, Sample, broadcast_shapes, eval_shape, norm_axis, randn, register, result_dtype
from graphmode.ir.types import Dim, TensorType, dims_equal, eval_dim, normalize_dim


def resolve_reshape(in_shape, target) -> tuple[Dim, ...]:
    target = [normalize_dim(d) for d in target]
    if sum(1 for d in target if isinstance(d, int) and d == -1) > 1:
        raise IRError("reshape: at most one -1 allowed")
    if any(isinstance(d, int) and d == -1 for d in target):
        total = sympy.Integer(1)
        for d in in_shape:
            total *= d
        known = sympy.Integer(1)
        for d in target:
            if not (isinstance(d, int) and d == -1):
                known *= d
        rest = normalize_dim(sympy.simplify(total / known))
        target = [rest if (isinstance(d, int) and d == -1) else d for d in target]
    return tuple(target)


def _reshape_infer(ins, a):
    out = resolve_reshape(ins[0].shape, a["shape"])
    n_in, n_out = ins[0].numel(), TensorType(ins[0].dtype, out).numel()
    if not dims_equal(n_in, n_out):
        raise IRError(f"reshape {ins[0].text()} to {[str(d) for d in out]} changes the element count")
    return [ins[0].with_shape(out)]


register(OpSpec("reshape", "shape", (1, 1), _reshape_infer,
                lambda ins, a, env: [ins[0].reshape(eval_shape(a["shape"], env))], attrs=("shape",), view=True,
                doc="reshape (view semantics, contiguous row-major); shape entries int, -1 or dim expressions",
                samples=lambda: [Sample(randn((2, 3, 4)), {"shape": [6, 4]}), Sample(randn((2, 12)), {"shape": [2, -1, 3]})],
                padding="reshape"))
register(OpSpec("permute", "shape", (1, 1),
                lambda ins, a: [ins[0].with_shape(tuple(ins[0].shape[p] for p in a["perm"]))],
                lambda ins, a, env: [ins[0].permute(a["perm"])], attrs=("perm",),
                doc="permute dims (materialised as a copy by backends)",
                samples=lambda: [Sample(randn((2, 3, 4)), {"perm": [2, 0, 1]})], padding="permute"))


def _expand_infer(ins, a):
    shape = [normalize_dim(d) for d in a["shape"]]
    x = ins[0].shape
    lead = len(shape) - len(x)
    out = []
    for i, d in enumerate(shape):
        src = x[i - lead] if i >= lead else None
        out.append(src if (isinstance(d, int) and d == -1) else d)
    broadcast_shapes(x, out)
    return [ins[0].with_shape(out)]


register(OpSpec("expand", "shape", (1, 1), _expand_infer,
                lambda ins, a, env: [ins[0].expand(eval_shape(a["shape"], env))], attrs=("shape",),
                doc="broadcast to shape (-1 keeps the dim)",
                samples=lambda: [Sample(randn((3, 1)), {"shape": [2, 3, 4]})], padding="expand"))


def _slice_len(size: Dim, start: int, end, step: int) -> Dim:
    end_d = normalize_dim(end)
    if isinstance(size, int) and isinstance(end_d, int):
        return len(range(*slice(start, end_d, step).indices(size)))
    if isinstance(end_d, int) and end_d >= 2 ** 31:
        end_d = size
    if isinstance(end_d, int) and end_d < 0:
        end_d = normalize_dim(size + end_d)
    s = start if start >= 0 else normalize_dim(size + start)
    stop = sympy.Min(sympy.sympify(end_d), sympy.sympify(size))
    if isinstance(stop, sympy.Min):
        # undecidable without the dim ranges: export guards guaranteed end <= size
        stop = sympy.sympify(end_d)
    return normalize_dim(sympy.ceiling((stop - s) / step))


def _slice_infer(ins, a):
    t = ins[0]
    dim = norm_axis(a["dim"], t.rank)
    shape = list(t.shape)
    shape[dim] = _slice_len(shape[dim], a.get("start", 0), a.get("end", 2 ** 62), a.get("step", 1))
    return [t.with_shape(shape)]


def _slice_ref(ins, a, env):
    x = ins[0]
    dim = a["dim"]
    end = eval_dim(normalize_dim(a.get("end", 2 ** 62)), env)
    idx = [slice(None)] * x.dim()
    idx[dim] = slice(a.get("start", 0), end, a.get("step", 1))
    return [x[tuple(idx)]]


register(OpSpec("slice", "shape", (1, 1), _slice_infer, _slice_ref, attrs=("dim", "start", "end", "step"),
                doc="x[start:end:step] along dim (python slice clipping)",
                samples=lambda: [Sample(randn((4, 9)), {"dim": 1, "start": 1, "end": 8, "step": 2}),
                                 Sample(randn((5, 3)), {"dim": 0, "start": -2, "end": 2 ** 62, "step": 1})],
                padding="slice"))


def _concat_infer(ins, a):
    dim = norm_axis(a["dim"], ins[0].rank)
    total = sum((t.shape[dim] for t in ins), start=0)
    shape = list(ins[0].shape)
    shape[dim] = normalize_dim(total)
    return [TensorType(result_dtype(ins), shape)]


register(OpSpec("concat", "shape", (1, 64), _concat_infer,
                lambda ins, a, env: [torch.cat(list(ins), a["dim"])], attrs=("dim",), doc="concatenate along dim",
                aten=("aten.cat.default",),
                samples=lambda: [Sample(randn((2, 3), (2, 5)), {"dim": 1}),
                                 Sample(randn((1, 3, 2), (4, 3, 2), (2, 3, 2)), {"dim": 0})], padding="concat"))


def _pad_infer(ins, a):
    t = ins[0]
    pads = list(a["pads"])
    shape = list(t.shape)
    for i in range(len(pads) // 2):      # F.pad order: last dim first, (before, after) pairs
        ax = t.rank - 1 - i
        shape[ax] = normalize_dim(shape[ax] + pads[2 * i] + pads[2 * i + 1])
    return [t.with_shape(shape)]


register(OpSpec("pad", "shape", (1, 1), _pad_infer,
                lambda ins, a, env: [F.pad(ins[0], list(a["pads"]), mode="constant", value=a.get("value", 0.0))],
                attrs=("pads", "value"), traits=frozenset({"index_dependent"}),
                doc="constant padding, F.pad order: (last-dim before, after, next-dim before, after, ...); "
                    "negative amounts crop",
                samples=lambda: [Sample(randn((2, 3, 4)), {"pads": [1, 2], "value": 0.5}),
                                 Sample(randn((1, 2, 5, 5)), {"pads": [0, 1, 0, 1], "value": 0.0}),
                                 Sample(randn((3, 5)), {"pads": [-1, 2, 1, -1], "value": 1.0})], padding="shift"))


def _roll_ref(ins, a, env):
    return [torch.roll(ins[0], list(a["shifts"]), list(a["dims"]))]


register(OpSpec("roll", "shape", (1, 1), lambda ins, a: [ins[0]], _roll_ref, attrs=("shifts", "dims"),
                traits=frozenset({"index_dependent"}), aten=(),
                doc="circular shift by shifts[i] along dims[i] (torch.roll)",
                samples=lambda: [Sample(randn((2, 5, 6)), {"shifts": [2, -1], "dims": [1, 2]})], padding="shift"))
