"""Prompt-lookup speculative decoding without a model: the n-gram proposer, and the engine's
verify step over a real paged KV cache with a fake runner whose next token depends on the
tokens before it only (as a real model's does), so every verify row can be checked against
what plain decoding computes: same tokens, stops and lengths hit in the middle of an accepted
run, sequences of different accept lengths in one step, pages of rejected drafts freed."""
from __future__ import annotations

import pytest
import torch

from graphmode.decode.engine import DecodeEngine, drive
from graphmode.decode.kvcache import KVLayout, PagedKVCache
from graphmode.decode.runner import bucket
from graphmode.decode.sampling import SamplingParams
from graphmode.decode.scheduler import Scheduler
from graphmode.decode.speculative import NgramProposer, Speculator, speculator_of
from graphmode.errors import RecipeError

VOCAB = 50
BATCHES = [1, 2, 4, 8]


def next_token(prefix: list[int]) -> int:
    """A model that repeats with period 5 after token 10, and walks up elsewhere."""
    last = prefix[-1]
    return 10 + (last - 9) % 5 if last >= 10 else (last + 3) % 10


def test_proposer_takes_the_longest_then_latest_match():
    p = NgramProposer(num_tokens=3, ngram_max=3, ngram_min=1)
    assert p.propose([1, 2, 3, 9, 1, 2, 3, 7, 5, 2, 3]) == [7, 5, 2]      # "2 3" latest (n=3 has no match)
    assert p.propose([4, 1, 2, 3, 8, 1, 2, 3, 6, 1, 2, 3]) == [6, 1, 2]   # "1 2 3": the latest of two
    assert p.propose([5, 6, 7, 5, 6]) == [7, 5, 6]
    assert p.propose([5, 6, 7, 5, 6], limit=2) == [7, 5]
    assert p.propose([5, 6, 7, 5, 6], limit=0) == []
    assert p.propose([1, 2, 3, 4]) == [] and p.propose([7]) == []
    assert p.propose([3, 9, 3]) == [9, 3, 9]                       # a continuation that runs into the tail repeats
    assert p.propose([4, 7, 7, 7]) == [7, 7, 7]                    # a loop of period 1 drafts every row it may
    assert p.propose([4, 7, 7, 7], limit=2) == [7, 7]
    assert NgramProposer(3, ngram_max=3, ngram_min=2).propose([1, 2, 5, 2]) == []   # a 1-gram is below min


class FakeRunner:
    """Logits with argmax next_token(prefix) per row; checks the pages and cache lengths a real
    runner relies on (a verify row at position p needs a slot for p)."""

    batch_buckets = BATCHES

    def __init__(self, cache: PagedKVCache):
        self.cache = cache
        self.verify_rows: list[int] = []

    def _logits(self, prefixes: list[list[int]]) -> torch.Tensor:
        out = torch.zeros(bucket(BATCHES, len(prefixes), "batch"), VOCAB)
        for i, p in enumerate(prefixes):
            out[i, next_token(p)] = 1.0
        return out

    def prefill(self, seqs):
        return self._logits([s.tokens for s in seqs])

    def decode(self, seqs):
        for s in seqs:
            assert s.cached == len(s.tokens) - 1
        return self._logits([s.tokens for s in seqs])

    def verify(self, seqs, drafts):
        prefixes = []
        for s, d in zip(seqs, drafts):
            assert s.cached == len(s.tokens) - 1
            assert len(self.cache.tables[s.id]) >= self.cache.pages_for(len(s.tokens) + len(d))
            prefixes += [s.tokens + d[:j] for j in range(len(d) + 1)]
        assert any(drafts)
        self.verify_rows.append(len(prefixes))
        assert len(prefixes) <= BATCHES[-1]
        return self._logits(prefixes)


def engine(*, pages: int = 64, num_tokens: int = 4, ngram_max: int = 3):
    cache = PagedKVCache(KVLayout(layers=1, kv_heads=1, head_dim=2, page_size=4, pages=pages, max_pages_per_seq=12))
    spec = Speculator(NgramProposer(num_tokens, ngram_max, 1), BATCHES[-1]) if num_tokens else None
    return DecodeEngine(FakeRunner(cache), Scheduler(cache, BATCHES[-1]), {"vocab": VOCAB, "eos": None},
                        max_prompt=16, speculator=spec)


def run(eng, prompts, params):
    seqs = [eng.add(p, params) for p in prompts]
    for _ in drive(eng, seqs):
        pass
    return [(s.generated, s.finish_reason) for s in seqs]


PROMPTS = [[10, 11, 12, 13, 14, 10, 11], [1, 2, 3], [12, 13, 14, 10, 11, 12, 13, 14, 10], [4, 20, 5]]


@pytest.mark.parametrize("params", [SamplingParams(max_new_tokens=17), SamplingParams(max_new_tokens=9, eos_token_id=13),
                                    SamplingParams(max_new_tokens=20, stop=((11, 12, 13),)),
                                    SamplingParams(max_new_tokens=12, min_tokens=6, eos_token_id=14)])
def test_speculative_tokens_stops_and_lengths_equal_plain_decoding(params):
    plain = run(engine(num_tokens=0), PROMPTS, params)
    eng = engine()
    spec = run(eng, PROMPTS, params)
    assert spec == plain
    assert eng.stats["accepted_tokens"] > 0 and eng.stats["draft_tokens"] >= eng.stats["accepted_tokens"]
    assert eng.stats["generated_tokens"] == sum(len(g) for g, _ in plain)
    assert eng.cache.free_pages == eng.layout.pages


def test_stops_in_the_middle_of_an_accepted_run_end_there():
    """The 5-cycle prompt's drafts are all right: eos, a stop sequence and the length each end
    the sequence inside a run of accepted drafts, with nothing after them."""
    prompt = [10, 11, 12, 13, 14, 10, 11, 12, 13, 14, 10]
    for params, reason, accepted in [(SamplingParams(max_new_tokens=12, eos_token_id=13), "eos", 2),
                                     (SamplingParams(max_new_tokens=12, stop=((12, 13),)), "stop", 2),
                                     (SamplingParams(max_new_tokens=3), "length", 1)]:   # 1 draft: room for 2
        eng = engine()
        assert run(eng, [prompt], params) == [([11, 12, 13], reason)]
        assert eng.stats["decode_steps"] == 1 and eng.stats["accepted_tokens"] == accepted, eng.stats


def test_batched_sequences_accept_different_lengths_and_give_rejected_pages_back():
    eng = engine(num_tokens=5)
    walk = eng.add([1, 4, 5, 5, 5, 5, 1], SamplingParams(max_new_tokens=14))   # "1 4" drafts "5 5 ..": wrong
    cyc = eng.add([10, 11, 12, 13, 14, 10, 11], SamplingParams(max_new_tokens=14))   # drafts right
    eng.step()                                       # prefill, then one verify step of both
    assert eng.runner.verify_rows == [8]             # 6 rows + 2: the batch's free rows went to drafts
    assert walk.generated == [4, 7] and cyc.generated == [12, 13, 14]
    assert eng.stats["draft_tokens"] == 6 and eng.stats["accepted_tokens"] == 1
    for s in (cyc, walk):                            # pages for the cached tokens and the next one only
        assert s.cached == len(s.tokens) - 1
        assert len(eng.cache.tables[s.id]) == eng.cache.pages_for(len(s.tokens))
    for _ in drive(eng, [cyc, walk]):
        pass
    assert cyc.generated == run(engine(num_tokens=0), [cyc.prompt], cyc.params)[0][0]
    assert walk.generated == run(engine(num_tokens=0), [walk.prompt], walk.params)[0][0]


def test_a_full_batch_or_a_full_pool_decodes_without_drafts():
    eng = engine()
    seqs = [eng.add([10, 11, 12, 13, 14, 10, 11], SamplingParams(max_new_tokens=6)) for _ in range(8)]
    for _ in drive(eng, seqs):
        pass
    assert eng.runner.verify_rows == [] and eng.stats["draft_tokens"] == 0
    eng = engine(pages=2)                   # 8 tokens: the prompt's 7 and its next one, no slot for a draft
    assert run(eng, [[10, 11, 12, 13, 14, 10, 11]], SamplingParams(max_new_tokens=1)) == [([12], "length")]
    assert eng.stats["draft_tokens"] == 0


def test_seeded_sampling_draws_what_plain_decoding_draws():
    """One draw per emitted token from the sequence's generator: accepting a draft when the
    draw equals it is the rejection rule for a one-token draft, and the same seed gives the
    same tokens."""
    params = SamplingParams(max_new_tokens=15, do_sample=True, temperature=0.7, seed=3)
    assert run(engine(), PROMPTS, params) == run(engine(num_tokens=0), PROMPTS, params)


def test_speculation_that_cannot_keep_its_promise_is_refused():
    from graphmode.recipe.loader import load_recipe
    r = {"version": 1, "name": "d", "inputs": [{"name": "input_ids", "dtype": "i64", "shape": ["batch", "seq"]}],
         "dims": {"batch": {"buckets": [1, 4]}, "seq": {"buckets": [8]}},
         "memory": {"kv_cache": {"page_size": 4, "max_pages_per_seq": 4}}, "decode": {"speculative": {}}}
    rec = load_recipe(r)
    assert speculator_of(rec, 4, invariant=False).proposer == NgramProposer(4, 3, 1)
    with pytest.raises(RecipeError, match="batch_invariant") as e:
        speculator_of(rec, 4, invariant=True)
    assert e.value.where == "decode.speculative"
    with pytest.raises(RecipeError, match="no row is ever free"):
        speculator_of(rec, 1, invariant=False)
    assert speculator_of(load_recipe({**r, "decode": {}}), 4, invariant=False) is None
    for bad, needle in [({"num_tokens": 0}, "num_tokens"), ({"ngram_min": 3, "ngram_max": 2}, "ngram_min"),
                        ({"method": "eagle"}, "method")]:
        with pytest.raises(RecipeError, match=needle):
            load_recipe({**r, "decode": {"speculative": bad}})
    with pytest.raises(RecipeError, match="needs memory.kv_cache"):
        load_recipe({**r, "memory": {}})
    with pytest.raises(RecipeError, match="batch_invariant cannot hold"):
        load_recipe({**r, "determinism": "batch_invariant"})


def test_trim_gives_back_the_pages_past_a_length():
    cache = PagedKVCache(KVLayout(layers=1, kv_heads=1, head_dim=2, page_size=4, pages=8, max_pages_per_seq=8))
    cache.reserve(0, 13)
    assert len(cache.tables[0]) == 4 and cache.free_pages == 4
    cache.trim(0, 6)
    assert len(cache.tables[0]) == 2 and cache.free_pages == 6 and cache.tokens[0] == 6
    cache.trim(1, 3)                                                   # an unknown sequence: nothing
    assert cache.free_pages == 6


class Words:
    """A tokenizer whose token t is the word `w<t>` (ChoiceOutput's decode interface)."""

    def decode(self, ids, **_):
        return " ".join(f"w{t}" for t in ids)


def test_a_stop_string_inside_an_accepted_run_ends_the_answer_where_plain_decoding_does():
    """Text stops are matched on what a caller sees (ChoiceOutput, as the server and the CLI
    release tokens after each step): several tokens arriving in one verify step still cut the
    answer at the token that completed the stop string."""
    from graphmode.decode.output import ChoiceOutput
    prompt = [10, 11, 12, 13, 14, 10, 11, 12, 13, 14, 10]

    def answer(eng):
        out = ChoiceOutput(0, Words(), ("w13 w14",), ())
        s = eng.add(prompt, SamplingParams(max_new_tokens=12), on_token=lambda sid, tok: out.tokens.append(tok))
        text = ""
        for _ in drive(eng, [s]):
            text += out.release()[1]
            if out.finish_reason is not None:
                eng.cancel(s)
        return out.tokens, text + out.release(s.finish_reason)[1], out.finish_reason

    eng = engine()
    got = answer(eng)
    assert got == answer(engine(num_tokens=0)) == ([11, 12, 13, 14], "w11 w12 ", "stop")
    assert eng.stats["decode_steps"] == 1 and eng.stats["accepted_tokens"] == 4   # one step made all of them


def test_draft_and_accepted_counts_reach_the_servers_metrics():
    from graphmode.monitor import PromMetrics
    from graphmode.serve.generation import DecodeLoop
    eng, metrics = engine(), PromMetrics()
    loop = DecodeLoop(eng, metrics.decode_series("v1", "host"))
    run(eng, PROMPTS[:2], SamplingParams(max_new_tokens=9))
    loop._gauges()
    run(eng, PROMPTS[2:], SamplingParams(max_new_tokens=9))
    loop._gauges()

    def value(name: str) -> float:
        return metrics.registry.get_sample_value(name, {"version": "v1", "target": "host"})
    assert value("graphmode_spec_decode_draft_tokens_total") == eng.stats["draft_tokens"] > 0
    assert value("graphmode_spec_decode_accepted_tokens_total") == eng.stats["accepted_tokens"] > 0


def test_a_version_that_does_not_draft_exports_no_speculative_series():
    """After a reload from a recipe without speculative decoding to one with it, /metrics showed
    the old version's draft and accepted counters at 0 (trial W)."""
    from graphmode.monitor import PromMetrics
    metrics = PromMetrics()
    plain = metrics.decode_series("v1", "host", speculative=False)
    metrics.decode_series("v2", "host", speculative=True)
    assert "draft_tokens" not in plain.counted()
    text = metrics.text().decode()
    assert 'graphmode_spec_decode_draft_tokens_total{target="host",version="v2"}' in text
    assert 'version="v1"' not in "".join(ln for ln in text.splitlines() if ln.startswith("graphmode_spec_decode"))
