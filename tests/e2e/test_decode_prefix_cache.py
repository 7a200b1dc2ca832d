"""Automatic prefix caching on compiled tiny GPT-2 and Llama decoders (at most 2 sequences a
step, a pool of 10 pages of 4 tokens): greedy tokens equal to eager PyTorch's and to the same
engine with prefix caching off, logits within fp32 tolerance, for prompts sharing a system
prompt (one after another and running together), a shared prefix that ends exactly on a
page boundary, eviction under the small pool and preemption of sequences whose pages are
shared."""
from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch

import graphmode
from graphmode.capture.spec import bundle_from_module
from graphmode.decode.api import engine_of
from graphmode.decode.engine import drive
from graphmode.decode.sampling import SamplingParams
from graphmode.recipe.facts import kv_cache_bytes

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_decode import _lm, recipe  # noqa: E402  (the decode tests' tiny GPT-2 and Llama, their recipe)

SYSTEM = [5, 17, 23, 42, 8, 61, 33, 70, 12]          # 9 tokens: two full pages of 4 and one token


@pytest.fixture(scope="module", params=["gpt2", pytest.param("llama", marks=pytest.mark.slow)])   # ~35 s each
def model(request, tmp_path_factory):
    lm, kvh = _lm(request.param)
    ex = {"input_ids": torch.randint(3, 100, (2, 8)), "attention_mask": torch.ones(2, 8, dtype=torch.long)}
    b = bundle_from_module(lm, ex, {k: ["batch", "seq"] for k in ex})
    rec = dict(recipe(kvh, pages=10), dims={"batch": {"buckets": [1, 2]}, "seq": {"buckets": [8, 32], "min": 2}})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cm = graphmode.compile(b, rec, cache_dir=tmp_path_factory.mktemp("prefix-cache"))
    eng = engine_of(cm)
    assert eng.prefix_caching and eng.cache.bytes == kv_cache_bytes(cm.recipe) == 10 * eng.layout.page_bytes
    return lm, eng


def generate(eng, prompts: list[list[int]], n: int, *, cached: bool, join_after: int | None = None):
    """Greedy answers of `prompts` run together (the last one added after `join_after` steps),
    and each one's logits per step."""
    eng.prefix_caching = cached
    rows: dict[int, list[torch.Tensor]] = {}
    eng.on_logits = lambda s, row: rows.setdefault(s.id, []).append(row.clone())
    try:
        late = prompts[-1:] if join_after is not None else []
        seqs = [eng.add(p, SamplingParams(max_new_tokens=n)) for p in prompts[:len(prompts) - len(late)]]
        steps = drive(eng, None)
        for _ in range(join_after or 0):
            next(steps)
        seqs += [eng.add(p, SamplingParams(max_new_tokens=n)) for p in late]
        for _ in drive(eng, seqs):
            pass
    finally:
        eng.on_logits = None
        eng.prefix_caching = True
    assert eng.cache.used_pages == 0 and not eng.has_work
    return [s.generated for s in seqs], [torch.stack(rows[s.id]) for s in seqs]


@torch.no_grad()
def reference(lm, prompt: list[int], n: int) -> list[int]:
    """Eager greedy decoding, the whole sequence recomputed at every step (no end token)."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(lm(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
    return ids[len(prompt):]


def close(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    for x, y in zip(a, b):
        assert x.shape == y.shape
        assert float((x - y).norm() / y.norm()) < 1e-5


def test_prompts_sharing_a_system_prompt_decode_as_without_the_cache(model):
    lm, eng = model
    prompts = [SYSTEM + [30 + i, 40 + i] for i in range(3)] + [SYSTEM[:8], SYSTEM[:8], SYSTEM[:8] + [50, 51, 52]]
    hits = eng.stats["prefix_cache_hits"]
    plain, plain_logits = zip(*(generate(eng, [p], 6, cached=False) for p in prompts))
    assert eng.stats["prefix_cache_hits"] == hits                     # off: nothing looked up matched
    cached, cached_logits = zip(*(generate(eng, [p], 6, cached=True) for p in prompts))
    assert [t[0] for t in cached] == [t[0] for t in plain] == [reference(lm, p, 6) for p in prompts]
    for a, b in zip(cached_logits, plain_logits):
        close(a, b)
    # every later prompt found its system pages; an 8-token prompt (on a page boundary) reuses
    # one page and prefills its last block again; the longer one reuses both
    assert eng.stats["prefix_cache_hits"] - hits == 8 + 8 + 4 + 4 + 8


def test_concurrent_sharers_eviction_and_preemption_in_a_small_pool(model):
    """Three sequences of 11 + 12 tokens (6 pages each) in 10 pages share two system pages:
    one joins while the others run, the pool runs out and the youngest is preempted (its
    shared pages stay with the other), prompts of other tokens then evict the kept pages."""
    lm, eng = model
    prompts = [SYSTEM + [60 + i, 70 + i] for i in range(3)]
    want = [reference(lm, p, 12) for p in prompts]
    pre = eng.stats["preemptions"]
    plain, plain_logits = generate(eng, prompts, 12, cached=False, join_after=2)
    cached, cached_logits = generate(eng, prompts, 12, cached=True, join_after=2)
    assert plain == cached == want
    close(cached_logits, plain_logits)
    assert eng.stats["preemptions"] - pre >= 2                        # in both runs
    others = [[80 + i] * 13 for i in range(3)]                        # 13 + 6 tokens each: kept pages evicted
    assert generate(eng, others, 6, cached=True)[0] == [reference(lm, p, 6) for p in others]
    kept = eng.cache.reclaimer
    assert kept.match(eng.add(prompts[0], SamplingParams(max_new_tokens=1))) == []
    for _ in drive(eng):
        pass
    again, _ = generate(eng, prompts[:1], 12, cached=True)
    assert again == want[:1]
