"""constant_digest's memo must never hand a freed tensor's digest to a new tensor that
reuses its id and address (a stale digest would break CSE's constant merging and the
graph hash that keys the plan cache)."""
from __future__ import annotations

import gc

import torch

from graphmode.ir.graph import _known_digest, constant_digest, constant_digests


def test_digest_is_recomputed_for_a_new_tensor_at_a_reused_address():
    gc.collect()      # once: tensors are freed by refcount on `del`, so ids and addresses get reused
    seen = {}
    reused = 0
    for i in range(200):
        t = torch.full((4,), float(i))
        key = (id(t), t.data_ptr())
        d = constant_digest(t)
        assert d == constant_digest(torch.full((4,), float(i))), i   # content, not identity
        if key in seen:
            reused += 1
            assert seen[key][1] != d or seen[key][0] == i          # a reused slot got its own digest
        seen[key] = (i, d)
        del t
    assert reused, "no id/address was reused: the test did not exercise the memo"


def test_digest_follows_in_place_updates():
    t = torch.zeros(3)
    d0 = constant_digest(t)
    t.add_(1.0)
    assert constant_digest(t) != d0 and constant_digest(t) == constant_digest(torch.ones(3))


def test_parallel_digests_equal_serial_ones_and_are_memoised():
    """`constant_digests` fills the memo on every core; each digest is what `constant_digest`
    gives alone (bf16, strided and small constants included), and the bytes were hashed in place."""
    gen = torch.Generator().manual_seed(0)
    big = [torch.randn(300, 257, generator=gen) for _ in range(5)]
    ts = big + [torch.randn(512, 300, generator=gen).t(), torch.randn(70000, generator=gen).bfloat16(),
                torch.arange(5.0)]
    fresh = [constant_digest(t.clone()) for t in ts]         # clones: not in the memo yet
    constant_digests(ts)
    assert [_known_digest(t) for t in ts[:-1]] == fresh[:-1]  # the small one is left to the serial path
    assert [constant_digest(t) for t in ts] == fresh
    assert len(set(fresh)) == len(fresh)
