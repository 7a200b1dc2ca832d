"""Paged key/value cache attention: the op a causal LM's attention becomes for decoding.

The cache is a pool of fixed-size pages per layer, `k_pool`/`v_pool` of shape
[pages, page_size, kv_heads, head_dim], that lives outside the arena (the decode graphs hold
it as `state` values). A sequence's positions map to pages through its row of
`block_table` ([batch, max_pages], page ids). One op serves prefill, chunked prefill and
decode: it writes the new keys/values of each sequence (positions start[i] .. start[i] +
lens[i] - 1) into its pages, then lets each new query attend causally to every cached
position up to its own. Query rows past lens[i] (bucket padding) produce zeros.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from graphmode.errors import IRError
from graphmode.ir.ops.spec import OpSpec, Sample, register
from graphmode.ir.types import TensorType


def _infer(ins, a):
    q, k, v, kp, vp, table, start, lens = ins
    if q.rank != 4 or k.rank != 4 or v.rank != 4:
        raise IRError("paged_attention: q, k, v must be [batch, heads, seq, head_dim]")
    if kp.rank != 4 or vp.rank != 4:
        raise IRError("paged_attention: pools must be [pages, page_size, kv_heads, head_dim]")
    return [TensorType(q.dtype, q.shape[:-1] + (v.shape[-1],))]


def write_kv(k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
             table: torch.Tensor, start: torch.Tensor, lens: torch.Tensor) -> None:
    """Scatter each sequence's new keys/values ([heads, seq, dim] -> pool pages) in place."""
    page = k_pool.shape[1]
    for i in range(k.shape[0]):
        n, s0 = int(lens[i]), int(start[i])
        if n <= 0:
            continue
        pos = torch.arange(s0, s0 + n)
        pages, slots = table[i, pos // page].long(), pos % page
        k_pool[pages, slots] = k[i, :, :n].transpose(0, 1).to(k_pool.dtype)
        v_pool[pages, slots] = v[i, :, :n].transpose(0, 1).to(v_pool.dtype)


def attend(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor,
           start: torch.Tensor, lens: torch.Tensor, scale: float | None) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its cached positions."""
    b, h, s, _ = q.shape
    page, kvh = k_pool.shape[1], k_pool.shape[2]
    out = torch.zeros(b, h, s, v_pool.shape[-1], dtype=q.dtype)
    for i in range(b):
        n, s0 = int(lens[i]), int(start[i])
        if n <= 0:
            continue
        ctx = s0 + n
        pos = torch.arange(ctx)
        pages, slots = table[i, pos // page].long(), pos % page
        keys = k_pool[pages, slots].transpose(0, 1).to(q.dtype)          # [kv_heads, ctx, dim]
        vals = v_pool[pages, slots].transpose(0, 1).to(q.dtype)
        if h != kvh:
            keys, vals = keys.repeat_interleave(h // kvh, 0), vals.repeat_interleave(h // kvh, 0)
        mask = torch.arange(ctx)[None, :] <= (s0 + torch.arange(n))[:, None]     # query t sees <= s0 + t
        out[i, :, :n] = F.scaled_dot_product_attention(q[i:i + 1, :, :n], keys[None], vals[None],
                                                       attn_mask=mask[None, None], scale=scale)[0]
    return out


def _ref(ins, a, env):
    q, k, v, k_pool, v_pool, table, start, lens = ins
    write_kv(k, v, k_pool, v_pool, table, start, lens)
    return [attend(q, k_pool, v_pool, table, start, lens, a.get("scale"))]


def _samples():
    def make(g):
        pages, page, kvh, d = 6, 4, 2, 8
        q = torch.randn(2, 4, 3, d, generator=g)
        k, v = torch.randn(2, kvh, 3, d, generator=g), torch.randn(2, kvh, 3, d, generator=g)
        kp, vp = torch.randn(pages, page, kvh, d, generator=g), torch.randn(pages, page, kvh, d, generator=g)
        table = torch.tensor([[0, 2, 4], [1, 3, 5]])
        return [q, k, v, kp, vp, table, torch.tensor([5, 0]), torch.tensor([3, 2])]
    return [Sample(make, {"scale": 1 / math.sqrt(8)})]


register(OpSpec("paged_attention", "attention", (8, 8), _infer, _ref, attrs=("scale",),
                traits=frozenset({"precision_sensitive", "index_dependent", "side_effect"}),
                doc="paged KV-cache attention: writes k/v (positions start..start+lens-1 of each sequence) into "
                    "k_pool/v_pool [pages, page_size, kv_heads, dim] through block_table, then causal attention of "
                    "the new queries over the cache; inputs q, k, v, k_pool, v_pool, block_table, start, lens",
                samples=_samples, padding="opaque"))
