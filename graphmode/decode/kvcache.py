"""The paged KV cache: a fixed pool of pages per layer and a block table per sequence.

The pool is allocated once, at the size the recipe's memory proof counted
(`bytes` == `graphmode.recipe.facts.kv_pool_bytes(recipe)`), and never grows: a sequence
that needs a page when none is free waits (or is preempted by the scheduler) instead of
allocating. Pages are returned to the free list when a sequence ends.

Pages are reference-counted: with prefix caching (prefix_cache.py) a page holding a full
block of a computed prompt prefix is in the block tables of every sequence that shares it,
counted once in the pool. A page whose last holder lets go goes to the free list, unless a
`Reclaimer` (the prefix cache) keeps it: then it stays evictable, counted free, and is taken
back from the reclaimer (least recently used first) when the free list is empty.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from graphmode.errors import ContractViolation, GraphmodeError
from graphmode.ir.types import DTYPES, ITEMSIZE


@dataclass(frozen=True)
class KVLayout:
    layers: int
    kv_heads: int
    head_dim: int
    page_size: int
    pages: int                 # pool size, shared by all sequences
    max_pages_per_seq: int
    dtype: str = "f32"

    @property
    def page_bytes(self) -> int:
        """K and V of one page across every layer."""
        return 2 * self.layers * self.page_size * self.kv_heads * self.head_dim * ITEMSIZE[self.dtype]

    @property
    def bytes(self) -> int:
        return self.pages * self.page_bytes

    @property
    def max_tokens(self) -> int:
        return self.page_size * self.max_pages_per_seq

    @property
    def sequence_tokens(self) -> int:
        """The tokens one sequence can reach: its pages, within a pool that may hold fewer."""
        return self.page_size * min(self.max_pages_per_seq, self.pages)


class Reclaimer(Protocol):
    """Keeps pages no sequence holds but that still hold reusable K/V (the prefix cache)."""

    @property
    def evictable(self) -> int:
        """Pages kept now (free to take)."""
        ...

    def keep(self, page: int) -> bool:
        """`page` has no holder left: whether it is kept (evictable) rather than freed."""
        ...

    def claim(self, page: int) -> None:
        """A kept `page` is held again (shared): it is no longer evictable."""
        ...

    def evict(self) -> int:
        """A kept page given up (its contents forgotten), least recently used first."""
        ...


class PagedKVCache:
    """Pool tensors `k[layer]`, `v[layer]` of [pages, page_size, kv_heads, head_dim]; a free list;
    a block table (list of page ids) per sequence id."""

    def __init__(self, layout: KVLayout, pools: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None):
        """`pools`: the K and V pools to page (the decode graph's own, which the `to_paged` pass
        allocated), checked against `layout`; None allocates them here."""
        self.layout = layout
        shape = (layout.pages, layout.page_size, layout.kv_heads, layout.head_dim)
        dt = DTYPES[layout.dtype]
        if pools is None:
            pools = ([torch.zeros(shape, dtype=dt) for _ in range(layout.layers)],
                     [torch.zeros(shape, dtype=dt) for _ in range(layout.layers)])
        wrong = len(pools[0]) != layout.layers or len(pools[1]) != layout.layers
        for t in (*pools[0], *pools[1]):
            if wrong or tuple(t.shape) != shape or t.dtype != dt:
                raise GraphmodeError(f"a KV pool is {tuple(t.shape)} {t.dtype}, the layout needs {layout.layers} "
                                     f"layer(s) of {shape} {dt}", where="memory.kv_cache",
                                     fix="the pools and the cache must come from the same recipe")
        self.k, self.v = list(pools[0]), list(pools[1])
        self._free = list(range(layout.pages - 1, -1, -1))      # pop() hands out low page ids first
        self.tables: dict[int, list[int]] = {}
        self.tokens: dict[int, int] = {}                        # tokens each sequence holds
        self.refs = [0] * layout.pages                          # block tables holding each page
        self.reclaimer: Reclaimer | None = None

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    @property
    def free_pages(self) -> int:
        """Pages a sequence can take now: free, or kept by the reclaimer and evictable."""
        return len(self._free) + (self.reclaimer.evictable if self.reclaimer is not None else 0)

    @property
    def used_pages(self) -> int:
        return self.layout.pages - self.free_pages

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.layout.page_size)

    def can_hold(self, seq: int, tokens: int, shared: Sequence[int] = ()) -> bool:
        """Whether `seq` can grow to `tokens` tokens with the pages free now, after taking
        the `shared` pages (held ones cost nothing; evictable ones stop being free)."""
        have = len(self.tables.get(seq, [])) + len(shared)
        idle = sum(1 for p in shared if self.refs[p] == 0)
        return self.pages_for(tokens) - have <= self.free_pages - idle

    def share(self, seq: int, pages: list[int]) -> None:
        """`seq`, holding no page yet, starts with `pages` (full blocks computed already)."""
        if self.tables.get(seq):
            raise GraphmodeError(f"sequence {seq} already holds pages", where="memory.kv_cache",
                                 fix="a graphmode bug: shared pages start a block table")
        for p in pages:
            if self.refs[p] == 0:
                self.reclaimer.claim(p)
            self.refs[p] += 1
        self.tables[seq] = list(pages)
        self.tokens[seq] = len(pages) * self.layout.page_size

    def _take(self) -> int:
        return self._free.pop() if self._free else self.reclaimer.evict()

    def reserve(self, seq: int, tokens: int) -> None:
        """Grow `seq`'s block table to hold `tokens` tokens (ContractViolation past its page limit;
        GraphmodeError when the pool is out of pages: the scheduler checks `can_hold` first)."""
        if tokens > self.layout.max_tokens:
            raise ContractViolation(f"a sequence of {tokens} tokens needs more than max_pages_per_seq "
                                    f"{self.layout.max_pages_per_seq} pages of {self.layout.page_size}",
                                    where="memory.kv_cache.max_pages_per_seq", value=tokens,
                                    fix="send a shorter prompt or fewer new tokens, or raise max_pages_per_seq")
        table = self.tables.setdefault(seq, [])
        need = self.pages_for(tokens) - len(table)
        if need > self.free_pages:
            raise GraphmodeError(f"the KV pool has {self.free_pages} free page(s), sequence {seq} needs {need}",
                                 where="memory.kv_cache", fix="the scheduler must wait for pages (can_hold)")
        for _ in range(max(0, need)):
            p = self._take()
            self.refs[p] = 1
            table.append(p)
        self.tokens[seq] = max(self.tokens.get(seq, 0), tokens)

    def trim(self, seq: int, tokens: int) -> None:
        """Shrink `seq` to `tokens` tokens: pages past them go back (speculative decoding's
        rejected drafts; the slots past `tokens` in its last page are overwritten before read)."""
        table = self.tables.get(seq)
        if table is None:
            return
        keep = self.pages_for(tokens)
        while len(table) > keep:
            p = table.pop()
            self.refs[p] -= 1
            if self.refs[p] == 0 and not (self.reclaimer is not None and self.reclaimer.keep(p)):
                self._free.append(p)
        self.tokens[seq] = min(self.tokens.get(seq, tokens), tokens)

    def release(self, seq: int) -> None:
        """`seq`'s pages go back, last first (a kept prompt's tail is evicted before its head)."""
        for p in reversed(self.tables.pop(seq, [])):
            self.refs[p] -= 1
            if self.refs[p] == 0 and not (self.reclaimer is not None and self.reclaimer.keep(p)):
                self._free.append(p)
        self.tokens.pop(seq, None)

    def block_table(self, seqs: list[int], rows: int | None = None) -> torch.Tensor:
        """[rows, max_pages_per_seq] page ids (rows past len(seqs) and unused slots: page 0,
        never read: `lens` is 0 there and positions past a sequence's length are not attended)."""
        rows = len(seqs) if rows is None else rows
        t = torch.zeros(rows, self.layout.max_pages_per_seq, dtype=torch.int64)
        for i, s in enumerate(seqs):
            pages = self.tables.get(s, [])
            t[i, :len(pages)] = torch.tensor(pages, dtype=torch.int64)
        return t
