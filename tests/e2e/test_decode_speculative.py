"""Prompt-lookup speculative decoding on real causal LMs (tiny GPT-2; a grouped-query Llama in
the slow run) compiled under a recipe with decode.speculative: greedy tokens identical to
transformers' generate, batched and alone, with drafts accepted; the same engine with its
speculator off gives the same tokens, finish reasons and seeded samples (stops and lengths
that end a sequence inside a verify step included); every page comes back."""
from __future__ import annotations

import warnings
from contextlib import contextmanager

import pytest
import torch

import graphmode
from graphmode.capture.spec import bundle_from_module
from graphmode.decode.engine import drive
from graphmode.decode.sampling import SamplingParams
from test_decode import _lm, recipe

# rows that repeat themselves (drafts from the prompt) and one that does not
PROMPTS = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10, 11, 12, 13, 14, 15, 16, 17, 18],
                        [21, 22, 23, 21, 22, 23, 21, 22, 23, 21]])


@pytest.fixture(scope="module", params=["gpt2", pytest.param("llama", marks=pytest.mark.slow)])
def model(request, tmp_path_factory):
    lm, kvh = _lm(request.param)
    ex = {"input_ids": torch.randint(3, 100, (2, 8)), "attention_mask": torch.ones(2, 8, dtype=torch.long)}
    b = bundle_from_module(lm, ex, {k: ["batch", "seq"] for k in ex})
    r = dict(recipe(kvh), decode={"speculative": {"method": "ngram", "num_tokens": 3, "ngram_max": 3}})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return lm, graphmode.compile(b, r, cache_dir=tmp_path_factory.mktemp("spec-cache"))


@contextmanager
def plain(eng):
    """The same engine and plans, drafts off."""
    spec, eng.speculator = eng.speculator, None
    try:
        yield eng
    finally:
        eng.speculator = spec


def run(eng, prompts, params):
    seqs = [eng.add(p, params) for p in prompts]
    for _ in drive(eng, seqs):
        pass
    return [(s.generated, s.finish_reason) for s in seqs]


def test_speculative_greedy_is_token_identical_to_transformers(model):
    lm, cm = model
    ours = cm.generate(PROMPTS, max_new_tokens=20)
    ref = lm.generate(PROMPTS, attention_mask=torch.ones_like(PROMPTS), max_new_tokens=20, do_sample=False,
                      pad_token_id=0)
    assert torch.equal(ours, ref), (ours.tolist(), ref.tolist())
    eng = cm._decoder
    assert eng.stats["accepted_tokens"] > 0 and eng.stats["draft_tokens"] > eng.stats["accepted_tokens"], eng.stats
    assert eng.stats["decode_steps"] < 3 * 19                           # accepted drafts saved steps
    for i in range(3):                                                  # alone: every free row holds drafts
        assert torch.equal(cm.generate(PROMPTS[i:i + 1], max_new_tokens=20)[0], ours[i])
    assert eng.cache.free_pages == eng.layout.pages


def test_stops_lengths_and_seeded_samples_equal_decoding_without_drafts(model):
    _, cm = model
    eng = cm._decoder
    prompts = PROMPTS.tolist()
    with plain(eng):
        free = run(eng, prompts, SamplingParams(max_new_tokens=16))
    # an end token and a stop sequence taken from the middle of the greedy answers
    eos, stop = free[0][0][6], tuple(free[2][0][4:6])
    for params in (SamplingParams(max_new_tokens=16, eos_token_id=eos), SamplingParams(max_new_tokens=16, stop=(stop,)),
                   SamplingParams(max_new_tokens=5), SamplingParams(max_new_tokens=12, min_tokens=8, eos_token_id=eos),
                   SamplingParams(max_new_tokens=12, do_sample=True, temperature=0.8, top_k=20, seed=11)):
        with plain(eng):
            want = run(eng, prompts, params)
        before = eng.stats["draft_tokens"]
        assert run(eng, prompts, params) == want, params
        assert eng.stats["draft_tokens"] > before
    assert eng.cache.free_pages == eng.layout.pages
