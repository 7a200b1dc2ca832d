"""The decode scheduler over a real paged KV cache, driven through the engine with a fake model
runner (no model): admission by free pages and batch room, preemption by recompute with every
answer what the sequence gets alone, batch-invariant sequences holding their whole answer's
pages, prefilled alone and decoded together, cancellation, the prefix-cache hooks, and `drive` giving the pages of
an abandoned run back."""
from __future__ import annotations

import pytest
import torch

from graphmode.decode.engine import DecodeEngine, drive
from graphmode.decode.kvcache import KVLayout, PagedKVCache
from graphmode.decode.runner import bucket
from graphmode.decode.sampling import SamplingParams
from graphmode.decode.scheduler import NoPrefixCache, Scheduler

VOCAB = 50
BATCHES = [1, 2, 4]


class FakeRunner:
    """Logits whose argmax is (last token + 1) % VOCAB: a sequence's tokens depend on its own
    tokens only, as a real model's do. Checks what the real runner relies on: a prefilled
    sequence holds pages for its tokens, a decoded one has exactly its last token uncached
    and a slot for it."""

    batch_buckets = BATCHES

    def __init__(self, cache: PagedKVCache):
        self.cache = cache
        self.calls: list[tuple[str, list[int]]] = []

    def _logits(self, seqs) -> torch.Tensor:
        out = torch.zeros(bucket(BATCHES, len(seqs), "batch"), VOCAB)
        for i, s in enumerate(seqs):
            out[i, (s.tokens[-1] + 1) % VOCAB] = 1.0
        return out

    def _holds(self, s, tokens: int) -> None:
        assert len(self.cache.tables[s.id]) >= self.cache.pages_for(tokens), (s.id, tokens)

    def prefill(self, seqs):
        self.calls.append(("prefill", [s.id for s in seqs]))
        for s in seqs:
            self._holds(s, len(s.tokens))
        return self._logits(seqs)

    def decode(self, seqs):
        self.calls.append(("decode", [s.id for s in seqs]))
        for s in seqs:
            assert s.cached == len(s.tokens) - 1, (s.id, s.cached, len(s.tokens))
            self._holds(s, len(s.tokens))
        return self._logits(seqs)


def engine(pages: int, *, page_size: int = 4, max_pages: int = 6, invariant: bool = False, prefix=None):
    cache = PagedKVCache(KVLayout(layers=1, kv_heads=1, head_dim=2, page_size=page_size, pages=pages,
                                  max_pages_per_seq=max_pages))
    sched = Scheduler(cache, BATCHES[-1], invariant=invariant, prefix_cache=prefix)
    return DecodeEngine(FakeRunner(cache), sched, {"vocab": VOCAB, "eos": None}, max_prompt=16)


def alone(prompt: list[int], n: int) -> list[int]:
    out, t = [], prompt[-1]
    for _ in range(n):
        t = (t + 1) % VOCAB
        out.append(t)
    return out


def run(eng, prompts, n):
    seqs = [eng.add(p, SamplingParams(max_new_tokens=n)) for p in prompts]
    for _ in drive(eng, seqs):
        pass
    return seqs


def test_admission_waits_for_free_pages_and_batch_room():
    eng = engine(pages=5)                        # 7-token prompts: 2 pages each with the first new token
    seqs = [eng.add([1 + i] * 7, SamplingParams(max_new_tokens=1)) for i in range(3)]
    batches = eng.scheduler.admit()
    assert [[s.id for s in b] for b in batches] == [[0, 1]] and list(eng.scheduler.waiting) == [seqs[2]]
    assert eng.cache.free_pages == 1
    roomy = engine(pages=40)
    for i in range(6):
        roomy.add([i + 1], SamplingParams(max_new_tokens=1))
    assert [len(b) for b in roomy.scheduler.admit()] == [4]          # the largest batch bucket


def test_preemption_recomputes_and_every_answer_is_the_one_alone():
    """8 pages of 4 tokens for three sequences growing to 24 tokens: the pool runs out while
    they decode, the youngest gives its pages back and is recomputed from its tokens."""
    eng = engine(pages=8)
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13, 14], [21, 22]]
    seqs = run(eng, prompts, 18)
    assert [s.generated for s in seqs] == [alone(p, 18) for p in prompts]
    assert all(s.finish_reason == "length" for s in seqs)
    assert eng.stats["preemptions"] >= 1 and eng.stats["generated_tokens"] >= 3 * 18
    assert eng.cache.free_pages == 8 and not eng.has_work
    recomputed = [ids for kind, ids in eng.runner.calls if kind == "prefill"]
    assert len(recomputed) > 1                    # a preempted sequence was prefilled again


def test_batch_invariant_sequences_hold_their_answer_prefill_alone_and_decode_together():
    eng = engine(pages=10, invariant=True)
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15, 16, 17], [21, 22]]
    seqs = [eng.add(p, SamplingParams(max_new_tokens=10)) for p in prompts]
    eng.scheduler.admit()                        # what the first step admits, pages of whole answers
    held = {s.id: len(eng.cache.tables.get(s.id, [])) for s in seqs}
    assert held[0] == eng.cache.pages_for(13) and held[1] == eng.cache.pages_for(19)
    assert list(eng.scheduler.waiting) == [seqs[2]]                  # 4 + 5 pages: the third waits
    eng2 = engine(pages=10, invariant=True)
    seqs = run(eng2, prompts, 10)
    assert [s.generated for s in seqs] == [alone(p, 10) for p in prompts]
    assert all(len(ids) == 1 for kind, ids in eng2.runner.calls if kind == "prefill")
    assert max(len(ids) for kind, ids in eng2.runner.calls if kind == "decode") == 2    # the pool holds two answers
    assert eng2.stats["preemptions"] == 0
    assert eng2.cache.free_pages == 10


def test_cancel_gives_pages_back_waiting_or_running():
    eng = engine(pages=5)
    a, b, c = (eng.add([1 + i] * 7, SamplingParams(max_new_tokens=8)) for i in range(3))
    eng.step()
    assert eng.running == [a, b] and list(eng.waiting) == [c]
    eng.cancel(a)
    eng.cancel(c)
    assert a.finish_reason == c.finish_reason == "cancelled" and not eng.waiting and eng.running == [b]
    assert eng.cache.free_pages == 5 - len(eng.cache.tables[b.id])
    for _ in drive(eng):
        pass
    assert b.finish_reason == "length" and eng.cache.free_pages == 5


def test_stop_sequences_and_eos_end_a_sequence():
    eng = engine(pages=20)
    eos = eng.add([3], SamplingParams(max_new_tokens=10, eos_token_id=7))
    stop = eng.add([10], SamplingParams(max_new_tokens=10, stop=((12, 13),)))
    for _ in drive(eng, [eos, stop]):
        pass
    assert (eos.generated, eos.finish_reason) == ([4, 5, 6, 7], "eos")
    assert (stop.generated, stop.finish_reason) == ([11, 12, 13], "stop")


def test_prefix_cache_hooks_are_called_at_admission_and_after_prefill():
    class Recording(NoPrefixCache):
        def __init__(self):
            self.events: list[tuple[str, int]] = []

        def match(self, seq):
            self.events.append(("match", seq.id))
            return []

        def insert(self, seq):
            self.events.append(("insert", seq.id))

    prefix = Recording()
    eng = engine(pages=20, prefix=prefix)
    run(eng, [[1, 2], [3]], 2)
    assert prefix.events == [("match", 0), ("match", 1), ("insert", 0), ("insert", 1)]


def test_drive_closed_early_cancels_its_sequences():
    eng = engine(pages=20)
    seqs = [eng.add([1, 2, 3], SamplingParams(max_new_tokens=12)) for _ in range(2)]
    other = eng.add([4], SamplingParams(max_new_tokens=3))
    steps = drive(eng, seqs)
    next(steps)
    steps.close()
    assert all(s.finish_reason == "cancelled" for s in seqs) and not other.done
    assert eng.cache.free_pages == 20 - len(eng.cache.tables[other.id])


def test_a_pool_that_cannot_hold_one_sequence_is_an_error():
    from graphmode.errors import GraphmodeError
    eng = engine(pages=2, max_pages=4)            # 8 tokens in the pool; a sequence may grow to 16
    s = eng.add([1] * 7, SamplingParams(max_new_tokens=1))
    eng.scheduler.admit()
    s.generated, s.state, s.cached = [2, 3], "running", 8
    eng.scheduler.running.append(s)
    with pytest.raises(GraphmodeError, match="cannot hold one running sequence"):
        eng.scheduler.decoding()
