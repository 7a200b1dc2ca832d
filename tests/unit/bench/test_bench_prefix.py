"""`bench decode`'s repeated-system-prompt scenario (bench/prefix.py) over graphmode's bench
engine wrapping a decode engine with a fake model runner: the hit rate is the engine's, the
same prompt gives the same token with the cache off and on, the engine is left with prefix
caching off, and a prompt too short to cache a page is a failed scenario row that says why."""
from __future__ import annotations

import pytest
import torch

from graphmode.bench.engines import GraphmodeLMEngine
from graphmode.bench.prefix import prefix_line, prefix_scenarios, prompt_split, run_prefix_scenario
from graphmode.decode.engine import DecodeEngine
from graphmode.decode.kvcache import KVLayout, PagedKVCache
from graphmode.decode.prefix_cache import PagedPrefixCache
from graphmode.decode.scheduler import Scheduler
from graphmode.errors import GraphmodeError

VOCAB = 50


class Runner:
    """Greedy next token = (last token + 1) % VOCAB; records where each prefill started."""

    batch_buckets = [1, 2]

    def __init__(self):
        self.starts: list[int] = []

    def _logits(self, seqs):
        out = torch.zeros(2, VOCAB)
        for i, s in enumerate(seqs):
            out[i, (s.tokens[-1] + 1) % VOCAB] = 1.0
        return out

    def prefill(self, seqs):
        self.starts += [s.cached for s in seqs]
        return self._logits(seqs)

    def decode(self, seqs):
        return self._logits(seqs)


def bench_engine() -> GraphmodeLMEngine:
    cache = PagedKVCache(KVLayout(layers=1, kv_heads=1, head_dim=2, page_size=4, pages=40, max_pages_per_seq=16))
    eng = DecodeEngine(Runner(), Scheduler(cache, 2, prefix_cache=PagedPrefixCache(cache)),
                       {"vocab": VOCAB, "eos": None}, max_prompt=48)
    eng.prefix_caching = False                   # as GraphmodeLMEngine.setup leaves it
    e = GraphmodeLMEngine()
    e.eng = eng
    return e


class Cfg:
    prompt_lens = (8, 40)
    iters = 3
    seed = 0


class Probe:
    @staticmethod
    def loadavg() -> float:
        return 1.5


def test_the_scenario_times_off_and_on_and_reports_the_engines_hit_rate():
    e = bench_engine()
    assert prompt_split(40, 4) == (35, 5)
    lines: list[str] = []
    rows = prefix_scenarios("fake", [e], Cfg, VOCAB, lines.append, Probe)
    assert len(rows) == 1 and lines == [f"  {prefix_line(rows[0])}"]
    row = rows[0]
    assert row["model"] == "fake" and row["system_tokens"] == 35 and row["rounds"] == 3
    assert len(row["ttft_off_rounds_ms"]) == len(row["ttft_on_rounds_ms"]) == 3
    assert row["ttft_off_ms"] > 0 and row["ttft_on_ms"] > 0
    # 8 full system pages of a 40-token prompt found by each timed request with caching on
    assert (row["hit_tokens"], row["queried_tokens"], row["hit_rate"]) == (3 * 32, 3 * 40, 0.8)
    assert row["tokens_match"] == {"same": 3, "of": 3} and row["load_start"] == 1.5
    starts = e.eng.runner.starts[3:]                              # after the warm-up's three requests
    assert sorted(starts) == [0, 0, 0, 32, 32, 32]
    assert not e.eng.prefix_caching


def test_a_prompt_without_a_full_system_page_is_a_failed_row():
    with pytest.raises(GraphmodeError, match="nothing to cache"):
        prompt_split(16, 16)

    class Short(Cfg):
        prompt_lens = (4,)
    row = prefix_scenarios("fake", [bench_engine()], Short, VOCAB, lambda s: None, Probe)[0]
    assert "nothing to cache" in row["error"] and "failed" in prefix_line(row)
