"""Max / average pooling of any rank, padding, dilation and ceil mode, from strided slices.

torch's pools (what `max_pool2d` / `avg_pool2d` run) take 2-d windows with symmetric pads of at
most half the window, and no dilation for averages. ONNX pools take more: 1-d to 3-d, any pads,
dilations. This writes such a pool as core ops: the input padded (with -inf for max, 0 for
average) up to where the last window ends, one strided slice per kernel offset, combined with
`maximum` or `add`; an average divides by a constant that counts, per output position, the
window positions ONNX counts (the padding too with count_include_pad, never the ceil overhang).
The work is kernel-volume slices of the output's size: meant for the shapes torch's pools do
not take, not for the hot path.
"""
from __future__ import annotations

import itertools
import math

import numpy as np
import torch

from graphmode.capture.onnx.convert_core import _empty_extreme
from graphmode.capture.onnx.importer import _Importer
from graphmode.ir.types import DTYPES

MAX_WINDOW = 1024     # kernel positions, one slice each: beyond this the graph grows too large


def _out_size(size: int, k: int, s: int, d: int, pb: int, pe: int, ceil: bool) -> int:
    span = size + pb + pe - ((k - 1) * d + 1)
    out = (-(-span // s) if ceil else span // s) + 1
    if ceil and (out - 1) * s >= size + pb:        # the last window must start inside the input
        out -= 1
    return out


def pool_by_windows(imp: _Importer, n, x: str, kind: str, kernel: list[int], strides: list[int], dil: list[int],
                    pads: list[int], ceil: bool, count_pad: bool) -> str:
    """`kind` max, avg or sum (LpPool's window sum) of IR value `x`; the pooled IR value."""
    is_max = kind == "max"
    xt = imp.g.type_of(x)
    rank = xt.rank - 2
    sizes = list(xt.shape[2:])
    if not all(isinstance(v, int) for v in sizes):
        raise imp.fail(f"{n.op_type} of {xt.text()}: this window needs static spatial extents",
                       fix="pin the spatial dims in the recipe")
    volume = math.prod(kernel)
    if volume > MAX_WINDOW:
        raise imp.fail(f"{n.op_type} kernel_shape={kernel} has {volume} window positions; pools torch cannot run "
                       f"are written as one slice per position, at most {MAX_WINDOW}", value=kernel,
                       fix="use a smaller kernel, or symmetric pads of at most half the window on a 1-d or 2-d input")
    begin, end = pads[:rank], pads[rank:]
    outs = [_out_size(sizes[i], kernel[i], strides[i], dil[i], begin[i], end[i], ceil) for i in range(rank)]
    reach = [(outs[i] - 1) * strides[i] + (kernel[i] - 1) * dil[i] + 1 for i in range(rank)]
    extra = [max(end[i], reach[i] - sizes[i] - begin[i]) for i in range(rank)]
    fill = _empty_extreme(xt.dtype, True) if is_max else 0.0
    h = n.output[0]
    order = [v for i in reversed(range(rank)) for v in (begin[i], extra[i])]     # F.pad order: last dim first
    xp = imp.emit("pad", [x], {"pads": order, "value": fill}, hint=h) if any(order) else x
    acc = None
    for offs in itertools.product(*(range(k) for k in kernel)):
        part = xp
        for i, o in enumerate(offs):
            start = o * dil[i]
            part = imp.emit("slice", [part], {"dim": 2 + i, "start": start, "end": start + strides[i] * (outs[i] - 1) + 1,
                                              "step": strides[i]}, hint=h)
        acc = part if acc is None else imp.emit("maximum" if is_max else "add", [acc, part], {}, hint=h)
    if kind == "avg":
        counted = np.zeros([sizes[i] + begin[i] + extra[i] for i in range(rank)])
        inner = tuple(slice(0 if count_pad else begin[i], begin[i] + sizes[i] + (end[i] if count_pad else 0))
                      for i in range(rank))
        counted[inner] = 1.0
        count = np.zeros(outs)
        for offs in itertools.product(*(range(k) for k in kernel)):
            count += counted[tuple(slice(o * dil[i], o * dil[i] + strides[i] * (outs[i] - 1) + 1, strides[i])
                                   for i, o in enumerate(offs))]
        c = torch.from_numpy(np.maximum(count, 1.0).reshape([1, 1] + outs)).to(DTYPES[xt.dtype])
        acc = imp.emit("div", [acc, imp.g.add_constant(imp.g.fresh_name(f"{h}_count"), c, role="const")], {},
                       hint=h)
    return acc
