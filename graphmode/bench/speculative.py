"""`graphmode bench decode --speculative K`: prompt-lookup speculative decoding's accept rate and
speed-up, measured in one run on one decode engine with its drafts on and off.

The scenario is a repetitive prompt (a block of random tokens said over and over, the shape of
text that quotes itself: code edits, lists, summaries), `batch` rows of `context` tokens each,
`new` greedy tokens per row. One engine is built under the bench's decoder recipe plus
`decode.speculative {num_tokens: K}`, with batch buckets for the plain step (`batch`) and for
a verify step whose free rows hold the drafts (`batch` x (K + 1)); its speculator is switched
off for the plain rounds, so both sides run the same plans. Rounds alternate plain and
speculative; each side's decode tokens/s is the median over rounds of the tokens made after
the step that gave every row its first token over the time from then to the last token (a
step admits, prefills and decodes once, so that step's verify tokens are not counted). Every round's tokens must be the same on both sides (greedy is
exact); a round where they differ fails the row. The accept rate is accepted / proposed draft
tokens (engine stats); `tokens_per_step` is a row's tokens per step (new / (decode steps + 1)).

The bench models have random weights: what drafts they accept comes from their own loops
and the prompt's repetition, not from a trained model's copying, so the accept rate is the
scenario's, not a forecast for a trained model.
"""
from __future__ import annotations

import random
import statistics
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable

from graphmode.bench.models import DecodeCase, decode_engine, decode_recipe

PERIOD = 12            # tokens in the repeated block


def repetitive_prompt(vocab: int, length: int, seed: int) -> list[int]:
    """`length` tokens: one block of PERIOD random ids (from 3 up: past the usual specials), repeated."""
    rng = random.Random(seed)
    block = [rng.randrange(3, max(4, vocab)) for _ in range(PERIOD)]
    return (block * (length // PERIOD + 1))[:length]


@contextmanager
def drafts_off(eng: Any):
    spec, eng.speculator = eng.speculator, None
    try:
        yield
    finally:
        eng.speculator = spec


def _round(eng: Any, prompts: list[list[int]], new: int) -> tuple[list[list[int]], float, int]:
    """Tokens, decode tokens/s (the tokens made after the step that gave every row its first
    one, over the time since) and decode steps."""
    from graphmode.decode.engine import drive
    from graphmode.decode.sampling import SamplingParams
    steps0 = eng.stats["decode_steps"]
    seqs = [eng.add(p, SamplingParams(max_new_tokens=new)) for p in prompts]
    first, made = None, 0
    for _ in drive(eng, seqs):
        if first is None and all(s.generated for s in seqs):
            first, made = time.perf_counter(), sum(len(s.generated) for s in seqs)
    tok_s = (sum(len(s.generated) for s in seqs) - made) / (time.perf_counter() - first)
    return [s.generated for s in seqs], tok_s, eng.stats["decode_steps"] - steps0


def bench_speculative(case: DecodeCase, *, num_tokens: int, batch: int, context: int, new: int, iters: int,
                      threads: int, cache_dir: str | None = None, on_stage: Any = None,
                      log: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """One row: plain and speculative decode tokens/s, speed-up, accept rate, tokens equal."""
    rows = batch * (num_tokens + 1)
    recipe = decode_recipe(case.lm, [context], [batch, rows], context + new, name=f"bench-speculative-{case.name}")
    recipe["decode"] = {"speculative": {"method": "ngram", "num_tokens": num_tokens, "ngram_max": 3}}
    row: dict[str, Any] = {"model": case.name, "scenario": f"speculative b{batch} ctx{context}", "batch": batch,
                           "context": context, "new_tokens": new, "num_tokens": num_tokens, "threads": threads}
    with tempfile.TemporaryDirectory(prefix="graphmode-bench-spec-") as tmp:
        _, eng, row["engine_build_s"] = decode_engine(case.bundle, recipe, threads=threads,
                                                      cache_dir=cache_dir or tmp, on_stage=on_stage,
                                                      prepare=(batch, context))
        vocab = int(eng.cfg["vocab"] or 100)
        prompts = [repetitive_prompt(vocab, context, seed=i) for i in range(batch)]
        plain, spec, plain_steps, spec_steps, same = [], [], [], [], True
        proposed0, accepted0 = eng.stats["draft_tokens"], eng.stats["accepted_tokens"]
        for i in range(iters + 1):                        # round 0 warms both sides up, untimed
            with drafts_off(eng):
                want, ps, pst = _round(eng, prompts, new)
            got, ss, sst = _round(eng, prompts, new)
            same = same and got == want
            if i:
                plain.append(ps)
                spec.append(ss)
                plain_steps.append(pst)
                spec_steps.append(sst)
            log(f"  speculative {case.name} round {i}: plain {ps:.1f} tok/s, speculative {ss:.1f} tok/s, "
                f"tokens {'equal' if got == want else 'DIFFER'}")
        proposed = eng.stats["draft_tokens"] - proposed0
        accepted = eng.stats["accepted_tokens"] - accepted0
    plain_tok_s, spec_tok_s = statistics.median(plain), statistics.median(spec)
    row.update(plain_tok_s=round(plain_tok_s, 2), speculative_tok_s=round(spec_tok_s, 2),
               speedup=round(spec_tok_s / plain_tok_s, 3), draft_tokens=proposed, accepted_tokens=accepted,
               accept_rate=round(accepted / proposed, 3) if proposed else None,
               tokens_per_step=round(new / max(1, statistics.median(spec_steps) + 1), 3),
               plain_steps=statistics.median(plain_steps), speculative_steps=statistics.median(spec_steps),
               tokens_equal=same, iters=iters)
    if not same:
        row["error"] = "speculative greedy tokens differ from plain greedy"
    return row


COLUMNS = ("model", "scenario", "num_tokens", "plain_tok_s", "speculative_tok_s", "speedup", "accept_rate",
           "tokens_per_step", "tokens_equal")


def write_speculative(rows: list[dict], meta: dict, out_dir: str | Path, name: str) -> dict[str, Path]:
    """`<name>-speculative.json`, `.meta.json` and `.md`, beside the decode bench's files."""
    from graphmode.bench.report import _md_table, _write
    lines = [f"# graphmode speculative decoding (prompt lookup), {meta.get('date', '')}", "",
             f"- host load (uptime) at start: {meta.get('load', '?')}", "- " + __doc__.split("\n\n")[1].replace("\n", " "),
             "- the bench models have random weights: their accept rate is this scenario's, not a trained model's", ""]
    lines += _md_table(list(COLUMNS), [[str(r.get(c, "")) for c in COLUMNS] for r in rows])
    return _write(out_dir, f"{name}-speculative", rows, meta, "\n".join(lines) + "\n")
