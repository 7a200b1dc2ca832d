"""Which sequences run in the next decode step, over the pages of the KV cache (vLLM's shape).

A waiting queue and a running list. Admission takes waiting sequences in order while the
running batch has room (the largest batch bucket) and the pool has pages for their tokens
plus the first new one; they are prefilled together. Then every running sequence with a
token not yet in the cache gets a slot for it: when the pool is empty, the youngest other
running sequence is preempted — its pages go back and it waits at the head of the queue, to
be recomputed later from its tokens so far (prompt and generated: the recompute policy). The
pool never grows and never holds more than the recipe's memory proof counted.

`batch_invariant`: a sequence holds the pages of its whole answer from admission, so it is
never preempted and recomputed under another shape, and its prompt is prefilled alone (a
one-sequence batch: its prefill shape never depends on the others'). Decode steps stay
batched: the model runner batches them where the plans' kernels give every row the same bits
at any batch size, and runs them one sequence at a time where they may not (runner.py).

Prefix caching plugs in through `PrefixCache`: at admission `match` names the pages that
already hold a sequence's leading full blocks; the sequence starts with them (shared, counted
once in the pool), its `cached` tokens need no prefill, and only the rest of its pages are
reserved. After its prefill, and whenever a decode step fills a page, `insert` offers its
full blocks for reuse. `PagedPrefixCache` (prefix_cache.py) is the automatic prefix cache;
`NoPrefixCache` matches nothing: every prompt is prefilled whole. `prefix_queries` and
`prefix_hits` count the tokens looked up at admission and those found (vLLM's stats; none
while caching is off).

The scheduler never runs the model: the engine (engine.py) hands its batches to the model
runner and the sampled tokens back through `prefilled`, `decoded` and `finish`.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from graphmode.decode.kvcache import PagedKVCache
from graphmode.decode.sampling import SamplingParams
from graphmode.errors import GraphmodeError


@dataclass
class Sequence_:
    id: int
    prompt: list[int]
    params: SamplingParams
    generated: list[int] = field(default_factory=list)
    state: str = "waiting"                       # waiting | running | finished
    finish_reason: str | None = None
    gen: torch.Generator | None = None
    arrived: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    cached: int = 0                              # tokens whose K/V are in the cache
    on_token: Callable[[int, int], None] | None = None
    logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)   # per generated token

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.generated

    @property
    def done(self) -> bool:
        return self.state == "finished"


class PrefixCache(Protocol):
    """Reuse of KV pages across sequences that share a prefix."""

    def match(self, seq: Sequence_) -> list[int]:
        """Pages holding `seq`'s leading full blocks, computed already (never all its tokens:
        the last one is prefilled for its logits). Nothing is taken yet."""
        ...

    def insert(self, seq: Sequence_) -> None:
        """`seq`'s first `seq.cached` tokens are in its pages: offer their full blocks."""
        ...


class NoPrefixCache:
    """No reuse: every prompt is prefilled whole."""

    def match(self, seq: Sequence_) -> list[int]:
        return []

    def insert(self, seq: Sequence_) -> None:
        pass


class Scheduler:
    def __init__(self, cache: PagedKVCache, max_batch: int, *, invariant: bool = False,
                 prefix_cache: PrefixCache | None = None):
        self.cache = cache
        self.max_batch = max_batch
        self.invariant = invariant
        self.prefix_cache = prefix_cache or NoPrefixCache()
        self.waiting: deque[Sequence_] = deque()
        self.running: list[Sequence_] = []
        self.preemptions = 0
        self.prefix_queries = 0                  # tokens looked up in the prefix cache at admission
        self.prefix_hits = 0                     # of them, found in cached pages

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence_) -> None:
        self.waiting.append(seq)


    # ---- prefill ------------------------------------------------------------------------
    def admit(self) -> list[list[Sequence_]]:
        """Waiting sequences that fit now, their pages reserved: the step's prefill batches."""
        out: list[Sequence_] = []
        room = self.max_batch - len(self.running)
        while self.waiting and len(out) < room:
            s = self.waiting[0]
            need = len(s.tokens) + 1
            if self.invariant:                    # the whole answer's pages, now
                need = min(len(s.prompt) + s.params.max_new_tokens, self.cache.layout.max_tokens)
            shared = self.prefix_cache.match(s)
            if not self.cache.can_hold(s.id, need, shared):
                break
            self.waiting.popleft()
            self.cache.share(s.id, shared)
            self.cache.reserve(s.id, need)
            s.cached = len(shared) * self.cache.layout.page_size
            if not isinstance(self.prefix_cache, NoPrefixCache):
                self.prefix_queries += len(s.tokens)
                self.prefix_hits += s.cached
            out.append(s)
        if not out:
            return []
        return [[s] for s in out] if self.invariant else [out]

    def prefilled(self, seqs: list[Sequence_]) -> None:
        """Their tokens are in the cache: they run."""
        for s in seqs:
            s.cached = len(s.tokens)
            s.state = "running"
            self.running.append(s)
            self.prefix_cache.insert(s)

    # ---- decode -------------------------------------------------------------------------
    def decoding(self) -> list[list[Sequence_]]:
        """Running sequences with a token not in the cache, each with a slot reserved for it
        (preempting the youngest others while the pool is out of pages): the decode batches."""
        seqs = [s for s in self.running if not s.done and s.cached < len(s.tokens)]
        for s in list(seqs):                     # the new token needs a slot: maybe a new page
            if s.state != "running":             # preempted for an earlier one in this loop
                continue
            while not self.cache.can_hold(s.id, len(s.tokens)):
                victim = self._preempt(exclude=s)
                if victim is None:
                    raise GraphmodeError("the KV pool cannot hold one running sequence", where="memory.kv_cache")
                if victim in seqs:
                    seqs.remove(victim)
            self.cache.reserve(s.id, len(s.tokens))
        return [seqs] if seqs else []

    def decoded(self, seqs: list[Sequence_]) -> None:
        for s in seqs:
            s.cached += 1
            if s.cached % self.cache.layout.page_size == 0:     # a page filled: its block is reusable
                self.prefix_cache.insert(s)

    def _preempt(self, exclude: Sequence_) -> Sequence_ | None:
        """Recompute policy: the youngest running sequence gives its pages back and waits at
        the head of the queue with its tokens so far as its prompt."""
        cands = [s for s in self.running if s is not exclude and not s.done]
        if not cands:
            return None
        victim = max(cands, key=lambda s: s.arrived)
        self.cache.release(victim.id)
        self.running.remove(victim)
        victim.state, victim.cached = "waiting", 0
        self.waiting.appendleft(victim)
        self.preemptions += 1
        return victim

    # ---- the end of a sequence ------------------------------------------------------------
    def finish(self, s: Sequence_, reason: str) -> None:
        """`s` ended (a stop, its length, or cancelled): its pages go back now."""
        if s in self.waiting:
            self.waiting.remove(s)
        if s in self.running:
            self.running.remove(s)
        self.cache.release(s.id)
        s.state, s.finish_reason = "finished", s.finish_reason or reason
