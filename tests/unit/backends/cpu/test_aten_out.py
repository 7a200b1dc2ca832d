"""ATen out-variant steps (graphmode/backends/cpu/aten_out.py): each writes the op's result
straight into the planned output buffers (their addresses do not change), equal to the
op's reference (the functional ATen call) exactly; outputs that are not ATen's result, and
overlapping ones, are refused so the reference op runs."""
from __future__ import annotations

import pytest
import torch

from graphmode.backends.cpu.catalog import op_step
from graphmode.backends.cpu.lowering import ATEN, OpCall, claim
from graphmode.ir.ops import get_op

G = torch.Generator().manual_seed(0)


def T(i):
    return {"$in": i}


def aten(overload, *args, **kwargs):
    return {"overload": overload, "args": list(args), "kwargs": kwargs}


def randn(*shape):
    return torch.randn(*shape, generator=G)


def idx(high, *shape):
    return torch.randint(0, high, shape, generator=G)


CASES = {
    "topk": ("topk", [randn(4, 9)], aten("default", T(0), 3, 1)),
    "topk_smallest_dim0": ("topk", [randn(6, 5)], aten("default", T(0), 2, 0, False)),
    "sort": ("sort", [randn(3, 7)], aten("default", T(0), 1)),
    "sort_stable_desc": ("sort", [torch.randint(0, 3, (5, 6), generator=G).float()],
                         aten("stable", T(0), stable=True, dim=0, descending=True)),
    "scatter_src": ("scatter", [randn(3, 5), idx(5, 3, 2), randn(3, 2)], aten("src", T(0), 1, T(1), T(2))),
    "scatter_value": ("scatter", [randn(3, 5), idx(3, 1, 5)], aten("value", T(0), 0, T(1), 2.0)),
    "scatter_add": ("scatter_add", [randn(3, 5), idx(5, 3, 4), randn(3, 4)], aten("default", T(0), 1, T(1), T(2))),
    "scatter_reduce_amax": ("scatter_reduce", [randn(3, 5), idx(5, 3, 4), randn(3, 4)],
                            aten("two", T(0), 1, T(1), T(2), "amax")),
    "scatter_reduce_mean": ("scatter_reduce", [randn(3, 5), idx(3, 2, 5), randn(2, 5)],
                            aten("two", T(0), 0, T(1), T(2), "mean", include_self=False)),
    "conv_t1d": ("conv_transpose1d", [randn(2, 3, 6), randn(3, 2, 3), randn(2)], aten("default", T(0), T(1), T(2), [2], [1])),
    "conv_t1d_groups": ("conv_transpose1d", [randn(1, 4, 5), randn(4, 1, 3)],
                        aten("default", T(0), T(1), None, [2], [1], [1], 2, [2])),
    "conv_t3d": ("conv_transpose3d", [randn(1, 2, 3, 4, 3), randn(2, 2, 2, 2, 2)], aten("input", T(0), T(1))),
    # unbatched inputs, which F.conv_transpose*d take (aten.convolution.out asked for a batch)
    "conv_t1d_unbatched": ("conv_transpose1d", [randn(4, 5), randn(4, 8, 3)], aten("default", T(0), T(1))),
    "conv_t3d_unbatched": ("conv_transpose3d", [randn(4, 5, 5, 5), randn(4, 8, 3, 3, 3)], aten("input", T(0), T(1))),
}


def _call(op, ins, attrs, outs=None):
    want = get_op(op).ref([t.clone() for t in ins], attrs, {})
    outs = outs if outs is not None else [torch.empty_like(t) for t in want]
    return OpCall(op, ins, outs, attrs, {}, [f"x{i}" for i in range(len(ins))], [f"y{i}" for i in range(len(outs))]), want


@pytest.mark.parametrize("name", list(CASES))
def test_writes_into_the_planned_outputs_and_matches_the_reference(name):
    op, ins, attrs = CASES[name]
    call, want = _call(op, ins, attrs)
    _low, c = claim(ATEN, op, call)
    assert c, c.why
    ptrs = [t.data_ptr() for t in call.outs]
    step = op_step(call)
    step()
    assert [t.data_ptr() for t in call.outs] == ptrs
    for got, w in zip(call.outs, want):
        assert got.dtype == w.dtype and torch.equal(got, w), name


def test_refuses_outputs_that_are_not_atens_result():
    op, ins, attrs = CASES["topk"]
    call, _ = _call(op, ins, attrs, [torch.empty(4, 2), torch.empty(4, 2, dtype=torch.int64)])   # k = 3
    assert not claim(ATEN, op, call)[1]
    x = randn(3, 5)
    call, _ = _call("scatter_add", [x, idx(5, 3, 4), randn(3, 4)], CASES["scatter_add"][2], [x])   # in place
    assert "shares memory" in claim(ATEN, "scatter_add", call)[1].why
    call, _ = _call("conv_transpose1d", *CASES["conv_t1d"][1:])
    call.attrs["args"] = [T(0), T(1), T(2), [2, 2], [1]]                                         # 2 strides in 1-d
    assert not claim(ATEN, "conv_transpose1d", call)[1]


def test_an_index_out_of_range_raises_as_the_reference_does():
    x = randn(3, 5)
    call, _ = _call("scatter_add", [x, idx(5, 3, 4), randn(3, 4)], CASES["scatter_add"][2])
    call.ins[1][0, 0] = 5
    with pytest.raises(RuntimeError, match="out of bounds"):
        op_step(call)()
