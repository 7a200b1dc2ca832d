"""Automatic prefix caching (vLLM's): the KV pages of a computed prompt prefix are reused by
later sequences that start with the same tokens, so their prefill starts after it.

A block is the `page_size` tokens of one page of a sequence. Its key is the sha256 of its
parent block's key and its own tokens: a key names the whole prefix up to the block's end,
positions included, and two different prefixes never share a key in practice (vLLM moved
from Python's hash to sha256 for the same reason: a collision would be a wrong answer).

Only full blocks are keyed, and a page is never written once its block is full (a sequence
writes at positions from its `cached` on): the pages a sequence shares are read-only for
every holder, so sharing needs no copy on write, and a sequence's last, partial page is
always its own. A match stops one token short of the sequence (the last token is always
prefilled: its logits give the first new token), so a prompt that ends exactly on a page
boundary recomputes its last block into a page of its own.

Pages stay in the one pool the recipe's memory proof counts: a matched page joins the new
sequence's block table (`PagedKVCache.share`, reference-counted, counted once). When its
last holder lets go, a keyed page is kept here (the cache's `Reclaimer`), evictable and
counted free; the pool takes kept pages back, least recently released first (a sequence's
tail before its head), when its free list is empty, and their keys are forgotten.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from typing import TYPE_CHECKING, Sequence

from graphmode.decode.kvcache import PagedKVCache
from graphmode.errors import GraphmodeError

if TYPE_CHECKING:
    from graphmode.decode.scheduler import Sequence_


def block_keys(tokens: Sequence[int], page_size: int, blocks: int) -> list[bytes]:
    """Keys of the first `blocks` full blocks of `tokens`: each the sha256 of its parent's key
    and its tokens (as int64)."""
    keys: list[bytes] = []
    parent = b""
    for i in range(blocks):
        h = hashlib.sha256(parent)
        h.update(array("q", tokens[i * page_size:(i + 1) * page_size]).tobytes())
        parent = h.digest()
        keys.append(parent)
    return keys


class PagedPrefixCache:
    """The keyed pages of one paged KV cache: the scheduler's `PrefixCache` (match, insert) and
    the cache's `Reclaimer` (pages with no holder kept, evicted LRU)."""

    def __init__(self, cache: PagedKVCache):
        if cache.reclaimer is not None:
            raise GraphmodeError("the KV cache already has a prefix cache", where="memory.kv_cache",
                                 fix="a graphmode bug: one prefix cache per KV pool")
        self.cache = cache
        self.page_size = cache.layout.page_size
        self._page: dict[bytes, int] = {}               # block key -> the page holding it
        self._key: dict[int, bytes] = {}                # page -> its block key
        self._idle: OrderedDict[int, None] = OrderedDict()   # keyed pages no sequence holds, oldest first
        cache.reclaimer = self

    @property
    def keyed_pages(self) -> int:
        return len(self._key)

    # ---- the scheduler's side ------------------------------------------------------------
    def match(self, seq: "Sequence_") -> list[int]:
        """Pages holding `seq`'s leading full blocks, computed already (at most all its tokens
        but the last); taking them is the caller's (`PagedKVCache.share`)."""
        tokens = seq.tokens
        pages: list[int] = []
        for key in block_keys(tokens, self.page_size, (len(tokens) - 1) // self.page_size):
            page = self._page.get(key)
            if page is None:
                break
            pages.append(page)
        return pages

    def insert(self, seq: "Sequence_") -> None:
        """The full blocks among `seq`'s first `seq.cached` tokens are in its pages: key them.
        A block another page holds already (computed twice, in one batch) stays unkeyed here."""
        table = self.cache.tables.get(seq.id, [])
        blocks = min(seq.cached // self.page_size, len(table))
        for page, key in zip(table, block_keys(seq.tokens, self.page_size, blocks)):
            if key not in self._page and page not in self._key:
                self._page[key] = page
                self._key[page] = key

    # ---- the pool's side (kvcache.Reclaimer) -----------------------------------------------
    @property
    def evictable(self) -> int:
        return len(self._idle)

    def keep(self, page: int) -> bool:
        if page not in self._key:
            return False
        self._idle[page] = None
        return True

    def claim(self, page: int) -> None:
        del self._idle[page]

    def evict(self) -> int:
        if not self._idle:
            raise GraphmodeError("the KV pool has no free or evictable page", where="memory.kv_cache",
                                 fix="a graphmode bug: the scheduler checks can_hold first")
        page, _ = self._idle.popitem(last=False)
        del self._page[self._key.pop(page)]
        return page
