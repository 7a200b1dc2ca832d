"""Collective ops (ir/ops/collective.py) on thread ranks: what every rank gets, on the wire dtypes;
a graph with a collective and no communicator is refused; a failing rank stops the others."""
from __future__ import annotations

import pytest
import torch

from graphmode.errors import IRError, RankFailure
from graphmode.ir.ops import get_op
from graphmode.ir.types import TensorType
from graphmode.parallel.comm import run_ranks


def parts(world: int, shape=(2, 3, 4)) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(*shape, generator=g) for _ in range(world)]


def on_ranks(op: str, xs: list[torch.Tensor], **attrs) -> list[torch.Tensor]:
    a = {"world": len(xs), "comm_dtype": "f32", **attrs}
    return run_ranks(len(xs), lambda r, c: get_op(op).ref([xs[r]], a, {})[0], timeout_s=30)


def test_all_reduce_sums_and_every_rank_gets_the_same_bits():
    xs = parts(3)
    got = on_ranks("all_reduce", xs)
    torch.testing.assert_close(got[0], xs[0] + xs[1] + xs[2])
    assert torch.equal(got[0], got[1]) and torch.equal(got[1], got[2])


def test_all_gather_and_reduce_scatter_by_axis():
    xs = parts(2)
    got = on_ranks("all_gather", xs, axis=1)
    assert torch.equal(got[1], torch.cat(xs, 1))
    got = on_ranks("reduce_scatter", xs, axis=2)
    torch.testing.assert_close(got[1], (xs[0] + xs[1])[..., 2:])
    t = get_op("all_gather").infer([TensorType.of(xs[0])], {"axis": 1, "world": 2})[0]
    assert t.shape == (2, 6, 4)
    with pytest.raises(IRError, match="does not split over 2 ranks"):
        get_op("reduce_scatter").infer([TensorType("f32", (2, 3, 4))], {"axis": 1, "world": 2})


@pytest.mark.parametrize("dtype, tol", [("bf16", 1e-2), ("int8", 2e-2)])
def test_narrow_wire_dtypes_round_but_agree(dtype, tol):
    xs = parts(2, (4, 64))
    got = on_ranks("all_reduce", xs, comm_dtype=dtype)
    want = xs[0] + xs[1]
    err = ((got[0] - want).norm() / want.norm()).item()
    assert 0 < err < tol and torch.equal(got[0], got[1])


@pytest.mark.parametrize("dtype, tol", [("bf16", 1e-2), ("int8", 2e-2)])
@pytest.mark.parametrize("axis", [0, 1, 2])
def test_narrow_all_gather_along_every_axis(dtype, tol, axis):
    """An int8 all_gather along the last axis (a column-parallel output) failed on every call:
    each rank's per-row scales were gathered beside the columns, not spread over them."""
    xs = parts(2, (3, 4, 64))
    got = on_ranks("all_gather", xs, axis=axis, comm_dtype=dtype)
    want = torch.cat(xs, axis)
    assert got[0].shape == want.shape and torch.equal(got[0], got[1])
    assert 0 < ((got[0] - want).norm() / want.norm()).item() < tol


def test_a_collective_without_a_communicator_is_refused():
    with pytest.raises(IRError, match="no communicator is bound"):
        get_op("all_reduce").ref([torch.ones(2)], {"world": 2, "comm_dtype": "f32"}, {})
    assert torch.equal(get_op("all_reduce").ref([torch.ones(2)], {"world": 1}, {})[0], torch.ones(2))


def test_a_rank_that_fails_stops_the_others():
    def body(rank, comm):
        if rank == 1:
            raise ValueError("rank 1 broke")
        return comm.all_reduce(torch.ones(2))
    with pytest.raises(ValueError, match="rank 1 broke"):
        run_ranks(2, body, timeout_s=30)
    err = []

    def waits(rank, comm):
        try:
            comm.all_reduce(torch.ones(2))
        except RankFailure as e:
            err.append(e)
            raise
    with pytest.raises(RankFailure, match="broken"):
        run_ranks(2, lambda r, c: waits(r, c) if r == 0 else c.abort())
    assert err


def test_a_timed_out_collective_names_the_ranks_it_waited_on_without_gloos_source_path():
    """A rank stopped by SIGSTOP: the others' error said "rank 0: all_reduce over 2 ranks failed
    after 30.0 s: [/__w/pytorch/pytorch/third_party/gloo/.../unbound_buffer.cc:78] Timed out ...",
    never which rank it waited on."""
    from graphmode.parallel.comm import TorchDistributed

    def hung():
        raise RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] "
                           "Timed out waiting 30000ms for recv operation to complete")
    for world, waited in ((2, "rank 1:"), (3, "ranks 1, 2:")):
        with pytest.raises(RankFailure) as e:
            TorchDistributed(0, world, 30.0)._run("all_reduce", torch.zeros(2), hung)
        assert f"waiting on {waited} Timed out waiting 30000ms" in e.value.message and "__w" not in e.value.message
