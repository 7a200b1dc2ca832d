"""Prepared (packed) weights shared between tactics contexts: found by the source's address,
shape and version, and used from another tensor object only while its bytes are the same."""
from __future__ import annotations

import torch

from graphmode.backends.cpu.gemm import GemmProblem, pack_b
from graphmode.backends.cpu.tactics.weights import PreparedWeights, _pack_memo_key, _packed_key


def _kept(ctx: PreparedWeights, w: torch.Tensor, p: GemmProblem, nr: int = 16) -> torch.Tensor:
    return ctx._kept(_packed_key(w, nr, p), w, _pack_memo_key(w, nr, p), lambda: pack_b(w, nr, transposed=True))


def test_a_second_context_shares_the_copy_of_the_same_bytes():
    p = GemmProblem("linear", 1, 4, 32, 16, b_packed=True)
    w = torch.randn(32, 16)
    one = PreparedWeights()                                  # holds its copy (the registry's is weak)
    first = _kept(one, w, p)
    again = _kept(PreparedWeights(), w.detach(), p)        # another tensor object over the same storage
    assert again is first


def test_bytes_written_through_data_are_packed_again():
    """`p.data.copy_` keeps the address and the version: the shared copy's CRC tells it apart."""
    p = GemmProblem("linear", 1, 4, 32, 16, b_packed=True)
    param = torch.nn.Parameter(torch.randn(32, 16))
    one = PreparedWeights()
    old = _kept(one, param.detach(), p)
    new_w = torch.randn(32, 16)
    param.data.copy_(new_w)
    fresh = _kept(PreparedWeights(), param.detach(), p)
    assert fresh is not old
    assert torch.equal(fresh, pack_b(new_w, 16, transposed=True))
    assert one.packed[_packed_key(param, 16, p)].t is old      # the first context keeps what it bound
