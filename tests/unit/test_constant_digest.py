"""constant_digest's memo must never hand a freed tensor's digest to a new tensor that
reuses its id and address (a stale digest would break CSE's constant merging and the
graph hash that keys the plan cache)."""
from __future__ import annotations

import gc

import torch

from graphmode.ir.graph import constant_digest


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
