"""`graphmode bench decode`'s "repeated system prompt" scenario: time to first token of
requests that share a long system prompt, each with its own user turn, on graphmode's decode
engine with automatic prefix caching off and on (graphmode/decode/prefix_cache.py).

One engine, interleaved: every round sends one new prompt (the system prompt and a fresh
user turn) twice, with caching off and then on, or on and then off (the order alternates by
round), each request alone (batch 1, one new token). The system prompt is cached by an
untimed warm-up request first, as it would be in a server that has seen it, and the warm-up
builds both prefill plans (the whole prompt, and the user turn after the cached pages). The
same prompt with and without the cache must give the same token (counted in `tokens_match`).
The hit rate is the engine's: prompt tokens found in cached pages / prompt tokens looked up,
over the timed requests with caching on. With caching on the prefill runs in the smallest
`seq` bucket that holds the tokens after the cached pages: the speed-up is that bucket's
prefill against the whole prompt's bucket.
"""
from __future__ import annotations

import statistics
from typing import Any, Callable

import torch

from graphmode.bench.engines import _reason
from graphmode.errors import GraphmodeError

NAME = "repeated system prompt"


def prompt_split(longest: int, page_size: int) -> tuple[int, int]:
    """(system, user) tokens of a `longest`-token prompt: the user turn an eighth of it, the
    system prompt the rest, which must fill a page at least (only full pages are cached)."""
    user = max(1, longest // 8)
    if longest - user < page_size:
        raise GraphmodeError(f"a {longest}-token prompt leaves a system prompt of {longest - user} tokens, less "
                             f"than one page of {page_size}: nothing to cache", where="--prompt-lens", value=longest,
                             fix=f"benchmark a prompt of at least {page_size + 1 + page_size // 7} tokens")
    return longest - user, user


def run_prefix_scenario(engine: Any, vocab: int, longest: int, rounds: int, seed: int,
                        loadavg: Callable[[], float] | None = None) -> dict[str, Any]:
    """The scenario's result row for `engine` (bench.engines.GraphmodeLMEngine, set up)."""
    eng = engine.eng
    system, user = prompt_split(longest, eng.layout.page_size)
    g = torch.Generator().manual_seed(seed * 1000 + 17)
    sys_ids = torch.randint(3, vocab, (system,), generator=g).tolist()

    def prompt() -> torch.Tensor:
        return torch.tensor([sys_ids + torch.randint(3, vocab, (user,), generator=g).tolist()])

    def ask(p: torch.Tensor, on: bool) -> tuple[float, list[int]]:
        eng.prefix_caching = on
        got = engine.run(p, 1)
        return got.first_s * 1e3, got.tokens[0]

    row: dict[str, Any] = {"scenario": NAME, "engine": engine.label, "system_tokens": system, "user_tokens": user,
                           "page_size": eng.layout.page_size, "load_start": loadavg() if loadavg else None}
    try:
        for on in (True, True, False):             # seeds the cache; builds both prefill plans
            ask(prompt(), on)
        off_ms, on_ms, same = [], [], 0
        before = dict(eng.stats)
        for r in range(rounds):
            p = prompt()
            order = (False, True) if r % 2 == 0 else (True, False)
            got = {on: ask(p, on) for on in order}
            off_ms.append(got[False][0])
            on_ms.append(got[True][0])
            same += got[False][1] == got[True][1]
        queries = eng.stats["prefix_cache_queries"] - before["prefix_cache_queries"]
        hits = eng.stats["prefix_cache_hits"] - before["prefix_cache_hits"]
    finally:
        eng.prefix_caching = False
    off, on = statistics.median(off_ms), statistics.median(on_ms)
    row.update(rounds=rounds, ttft_off_ms=round(off, 3), ttft_on_ms=round(on, 3),
               speedup=round(off / on, 3) if on > 0 else None,
               ttft_off_rounds_ms=[round(t, 3) for t in off_ms], ttft_on_rounds_ms=[round(t, 3) for t in on_ms],
               hit_rate=round(hits / queries, 4) if queries else None, hit_tokens=hits, queried_tokens=queries,
               tokens_match={"same": same, "of": rounds}, load_end=loadavg() if loadavg else None)
    return row


def prefix_line(row: dict[str, Any]) -> str:
    """One line for the console."""
    if row.get("error"):
        return f"{row.get('model', '')} {NAME}: failed ({row['error']})"
    return (f"{row.get('model', '')} {NAME} ({row['system_tokens']} + {row['user_tokens']} tokens, "
            f"{row['rounds']} rounds): TTFT {row['ttft_off_ms']} ms without prefix caching, {row['ttft_on_ms']} ms "
            f"with it ({row['speedup']}x), hit rate {row['hit_rate']}, same first token "
            f"{row['tokens_match']['same']}/{row['tokens_match']['of']}, load {row['load_start']} -> {row['load_end']}")


def prefix_scenarios(model: str, engines: list[Any], cfg: Any, vocab: int, log: Callable[[str], None],
                     probe: Any) -> list[dict[str, Any]]:
    """The scenario on graphmode's default engine among `engines` (those set up and running):
    its rows, each also logged as one line."""
    out = []
    for e in engines:
        if e.name != "graphmode" or e.variant is not None:
            continue
        try:
            row = {"model": model, **run_prefix_scenario(e, vocab, max(cfg.prompt_lens), cfg.iters, cfg.seed,
                                                         probe.loadavg)}
        except Exception as err:  # noqa: BLE001 - a failing scenario is a result, not a crash
            row = {"model": model, "scenario": NAME, "engine": e.label, "error": _reason(err)}
        log(f"  {prefix_line(row)}")
        out.append(row)
    return out
