"""Automatic prefix caching over a real paged KV cache, driven through the engine with a fake
runner that keeps each sequence's tokens in its pages and computes its next token from what
it reads back (a page shared wrongly, overwritten or evicted while held changes the answer):
block keys, sharing and reference counts, a prefix that ends on a page boundary, concurrent
sharers, LRU eviction under a small pool, preemption of a sequence whose pages are shared,
and a pool that never holds more pages than it has."""
from __future__ import annotations

import pytest
import torch

from graphmode.decode.engine import DecodeEngine, drive, prefix_caching
from graphmode.decode.kvcache import KVLayout, PagedKVCache
from graphmode.decode.prefix_cache import PagedPrefixCache, block_keys
from graphmode.decode.runner import bucket
from graphmode.decode.sampling import SamplingParams
from graphmode.decode.scheduler import NoPrefixCache, Scheduler
from graphmode.errors import RecipeError

VOCAB = 97
BATCHES = [1, 2, 4]
PAGE = 4


def next_token(tokens: list[int]) -> int:
    """The fake model: the next token depends on every token and its position."""
    return sum((p + 1) * t for p, t in enumerate(tokens)) % VOCAB


def alone(prompt: list[int], n: int) -> list[int]:
    toks = list(prompt)
    for _ in range(n):
        toks.append(next_token(toks))
    return toks[len(prompt):]


class PagedFakeRunner:
    """Writes each new token (and its position) into the sequence's page slot, as the paged
    graph writes K/V, then reads the whole context back from the pages. Checks that it only
    ever writes pages this sequence alone holds and that no prefix cache has keyed."""

    batch_buckets = BATCHES

    def __init__(self, cache: PagedKVCache):
        self.cache = cache
        self.prefilled: list[tuple[int, int, int]] = []     # (sequence id, start, tokens computed)

    def _write(self, s, pos: int, tok: int) -> None:
        page = self.cache.tables[s.id][pos // PAGE]
        assert self.cache.refs[page] == 1, f"sequence {s.id} writes page {page} that others hold"
        rec = self.cache.reclaimer
        assert rec is None or page not in rec._key, f"sequence {s.id} writes keyed page {page}"
        self.cache.k[0][page, pos % PAGE, 0] = torch.tensor([float(tok), float(pos)])

    def _read(self, s, n: int) -> list[int]:
        out = []
        for pos in range(n):
            tok, at = self.cache.k[0][self.cache.tables[s.id][pos // PAGE], pos % PAGE, 0].tolist()
            assert at == pos, (s.id, pos, at)
            out.append(int(tok))
        return out

    def _logits(self, seqs) -> torch.Tensor:
        out = torch.zeros(bucket(BATCHES, len(seqs), "batch"), VOCAB)
        for i, s in enumerate(seqs):
            out[i, next_token(self._read(s, len(s.tokens)))] = 1.0
        return out

    def prefill(self, seqs):
        for s in seqs:
            self.prefilled.append((s.id, s.cached, len(s.tokens) - s.cached))
            for pos in range(s.cached, len(s.tokens)):
                self._write(s, pos, s.tokens[pos])
        return self._logits(seqs)

    def decode(self, seqs):
        for s in seqs:
            self._write(s, s.cached, s.tokens[-1])
        return self._logits(seqs)


def engine(pages: int, *, cached: bool = True, max_pages: int = 8):
    cache = PagedKVCache(KVLayout(layers=1, kv_heads=1, head_dim=2, page_size=PAGE, pages=pages,
                                  max_pages_per_seq=max_pages))
    sched = Scheduler(cache, BATCHES[-1], prefix_cache=PagedPrefixCache(cache) if cached else None)
    return DecodeEngine(PagedFakeRunner(cache), sched, {"vocab": VOCAB, "eos": None}, max_prompt=24)


def check_pool(eng) -> None:
    """Every page is held (counted once, refs = the block tables naming it), kept, or free."""
    cache = eng.cache
    held: dict[int, int] = {}
    for table in cache.tables.values():
        for p in table:
            held[p] = held.get(p, 0) + 1
    assert all(cache.refs[p] == n for p, n in held.items())
    assert all(cache.refs[p] == 0 for p in range(cache.layout.pages) if p not in held)
    kept = set(cache.reclaimer._idle) if cache.reclaimer is not None else set()
    free = set(cache._free)
    assert not (kept & free) and not (kept & held.keys()) and not (free & held.keys())
    assert len(held) + len(kept) + len(free) == cache.layout.pages
    assert cache.used_pages == len(held)


def run(eng, prompts, n, *, after_each=None):
    seqs = [eng.add(p, SamplingParams(max_new_tokens=n)) for p in prompts]
    for _ in drive(eng, seqs):
        check_pool(eng)
        if after_each:
            after_each()
    return seqs


SYSTEM = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]          # 10 tokens: two full pages and a half


def test_block_keys_name_the_whole_prefix():
    a = block_keys(list(range(12)), 4, 3)
    assert len(a) == 3 and a == block_keys(list(range(12)) + [99], 4, 3)
    b = block_keys([100] + list(range(1, 12)), 4, 3)           # the first block differs: every key does
    assert not set(a) & set(b)
    c = block_keys(list(range(8)) + [0, 0, 0, 0], 4, 3)         # the third block differs: only its key
    assert c[:2] == a[:2] and c[2] != a[2]
    assert block_keys([1, 2, 3], 4, 0) == []


def test_a_shared_system_prompt_is_prefilled_once_and_answers_are_unchanged():
    eng = engine(pages=24)
    prompts = [SYSTEM + [30 + i, 40 + i] for i in range(3)]
    first = run(eng, prompts[:1], 6)[0]
    rest = run(eng, prompts[1:], 6)
    assert [s.generated for s in [first, *rest]] == [alone(p, 6) for p in prompts]
    assert eng.runner.prefilled == [(0, 0, 12), (1, 8, 4), (2, 8, 4)]   # the two full system pages shared
    assert eng.stats["prefix_cache_queries"] == 36 and eng.stats["prefix_cache_hits"] == 16
    off = engine(pages=24, cached=False)
    assert [s.generated for s in run(off, prompts, 6)] == [alone(p, 6) for p in prompts]
    assert [start for _, start, _ in off.runner.prefilled] == [0, 0, 0]
    assert off.stats["prefix_cache_hits"] == off.stats["prefix_cache_queries"] == 0


def test_a_prefix_ending_on_a_page_boundary_recomputes_its_last_block():
    """A prompt of exactly two pages seen before matches one page: its last token (and so its
    last block) is prefilled again, into a page of its own, for its logits."""
    eng = engine(pages=24)
    prompt = SYSTEM[:8]
    a = run(eng, [prompt], 5)[0]
    b = run(eng, [prompt], 5)[0]
    longer = run(eng, [prompt + [50, 51]], 5)[0]               # the whole 8-token prefix is reused
    assert a.generated == b.generated == alone(prompt, 5) and longer.generated == alone(prompt + [50, 51], 5)
    assert eng.runner.prefilled == [(0, 0, 8), (1, 4, 4), (2, 8, 2)]


def test_concurrent_sequences_share_pages_counted_once():
    eng = engine(pages=24)
    leader = eng.add(SYSTEM + [1], SamplingParams(max_new_tokens=12))
    eng.step()                                                  # prefilled: its system pages are keyed
    followers = [eng.add(SYSTEM + [2 + i], SamplingParams(max_new_tokens=4)) for i in range(2)]
    eng.step()
    shared = eng.cache.tables[leader.id][:2]
    assert all(eng.cache.tables[s.id][:2] == shared for s in followers)
    assert [eng.cache.refs[p] for p in shared] == [3, 3]
    assert eng.cache.used_pages == 4 + 1 + 1                    # 14 tokens, 13 and 13: 10 pages unshared
    check_pool(eng)
    for _ in drive(eng, [leader, *followers]):
        check_pool(eng)
    assert leader.generated == alone(SYSTEM + [1], 12)
    assert [s.generated for s in followers] == [alone(SYSTEM + [2 + i], 4) for i in range(2)]
    assert eng.cache.free_pages == 24 and eng.cache.used_pages == 0


def test_eviction_under_a_small_pool_takes_the_least_recently_released_pages():
    """6 pages. A 9-token prompt keys two blocks; released, they are kept (counted free), its
    tail block first in line. A prompt that fits the free list evicts nothing; one that needs
    5 pages takes the tail; the head still serves the first prompt's prefix after that."""
    eng = engine(pages=6)
    prompt = SYSTEM[:8] + [1]
    run(eng, [prompt], 1)
    r = eng.cache.reclaimer
    keys = block_keys(prompt, PAGE, 2)
    assert [r._key[p] for p in r._idle] == [keys[1], keys[0]] and eng.cache.free_pages == 6
    small = [60 + i for i in range(10)]                         # 11 tokens: 3 pages of the 4 free
    assert run(eng, [small], 1)[0].generated == alone(small, 1)
    assert set(keys) <= set(r._page)                            # nothing evicted
    big = [70 + i for i in range(16)]                           # 17 tokens: 5 pages, 1 free + 4 evicted
    assert run(eng, [big], 1)[0].generated == alone(big, 1)
    assert keys[1] not in r._page and keys[0] not in r._page    # the first prompt's blocks went before small's
    eng2 = engine(pages=6)
    run(eng2, [prompt], 1)
    run(eng2, [big], 1)                                         # 4 free + the tail block evicted
    assert keys[0] in eng2.cache.reclaimer._page and keys[1] not in eng2.cache.reclaimer._page
    again = run(eng2, [SYSTEM[:8] + [2]], 3)[0]                 # only the head block is there
    assert again.generated == alone(SYSTEM[:8] + [2], 3) and eng2.runner.prefilled[-1][1] == 4
    assert eng2.cache.free_pages == 6


def test_preempting_a_sequence_whose_pages_are_shared_keeps_the_others_right():
    """9 pages for three sequences sharing a two-page system prompt and growing to 30 tokens:
    the pool runs out, the youngest gives its pages back (the shared ones stay with the
    others) and is recomputed after the pages it can still find."""
    eng = engine(pages=9)
    prompts = [SYSTEM + [1 + i] for i in range(3)]
    seqs = run(eng, prompts, 19)
    assert [s.generated for s in seqs] == [alone(p, 19) for p in prompts]
    assert eng.stats["preemptions"] >= 1
    again = [(sid, start) for sid, start, _ in eng.runner.prefilled]
    assert len(again) > 3 and any(start > 0 for _, start in again[3:])   # recomputed after cached pages
    assert eng.cache.free_pages == 9 and not eng.has_work


def test_switching_prefix_caching_off_and_on_between_requests():
    eng = engine(pages=24)
    prompt = SYSTEM + [5]
    run(eng, [prompt], 2)
    eng.prefix_caching = False
    assert isinstance(eng.scheduler.prefix_cache, NoPrefixCache) and not eng.prefix_caching
    assert run(eng, [prompt], 2)[0].generated == alone(prompt, 2) and eng.runner.prefilled[-1][1] == 0
    eng.prefix_caching = True
    assert run(eng, [prompt], 2)[0].generated == alone(prompt, 2) and eng.runner.prefilled[-1][1] == 8
    plain = engine(pages=24, cached=False)
    with pytest.raises(RecipeError, match="without prefix caching"):
        plain.prefix_caching = True


def test_prefix_caching_is_on_by_default_off_under_batch_invariant():
    class KV:
        def __init__(self, on):
            self.prefix_caching = on
    assert prefix_caching(KV(None), False) and not prefix_caching(KV(None), True)
    assert not prefix_caching(KV(False), False) and prefix_caching(KV(True), False)
    with pytest.raises(RecipeError, match="batch_invariant"):
        prefix_caching(KV(True), True)
    from graphmode.errors import RecipeErrors
    from graphmode.recipe import load_recipe
    kv = {"page_size": 4, "max_pages_per_seq": 4, "layers": 2, "kv_heads": 2, "head_dim": 8}
    rec = {"version": 1, "name": "d", "inputs": [{"name": "input_ids", "dtype": "i64", "shape": ["batch", "seq"]}],
           "dims": {"batch": {"buckets": [1]}, "seq": {"buckets": [8]}}, "memory": {"kv_cache": kv}}
    assert load_recipe(rec).memory.kv_cache.prefix_caching is None
    off = load_recipe({**rec, "memory": {"kv_cache": {**kv, "prefix_caching": False}}})
    assert off.memory.kv_cache.prefix_caching is False
    with pytest.raises(RecipeErrors, match="prefix_caching"):
        load_recipe({**rec, "memory": {"kv_cache": {**kv, "prefix_caching": "yes"}}})


def test_hits_reach_the_servers_metrics():
    from graphmode.monitor import PromMetrics
    from graphmode.serve.generation import DecodeLoop
    eng = engine(pages=24)
    metrics = PromMetrics()
    loop = DecodeLoop(eng, metrics.decode_series("v1", "host"))
    run(eng, [SYSTEM + [1], SYSTEM + [2]], 2)
    run(eng, [SYSTEM + [3]], 2)
    loop._gauges()

    def value(name: str) -> float:
        return metrics.registry.get_sample_value(name, {"version": "v1", "target": "host"})
    assert value("graphmode_prefix_cache_queries_total") == eng.stats["prefix_cache_queries"] == 33
    assert value("graphmode_prefix_cache_hits_total") == eng.stats["prefix_cache_hits"] == 8
