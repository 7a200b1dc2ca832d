"""`graphmode bench decode --speculative N` on the tiny test GPT-2: one engine with its drafts
on and off, the row's fields (tok/s both ways, speed-up, accept rate, tokens equal), the files
beside the decode bench's, and the repetitive prompt it decodes."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from graphmode.bench.speculative import PERIOD, repetitive_prompt

E2E = Path(__file__).resolve().parents[2] / "e2e"


def test_repetitive_prompt_repeats_one_block():
    p = repetitive_prompt(100, 30, seed=1)
    assert len(p) == 30 and p[:PERIOD] == p[PERIOD:2 * PERIOD] and all(3 <= t < 100 for t in p)
    assert p != repetitive_prompt(100, 30, seed=2)


@pytest.mark.slow     # ~30 s on 2 cores (a GPT-2 engine built and timed); exactness is tests/e2e/test_decode_speculative.py's
def test_bench_decode_speculative_row_and_files(tmp_path, monkeypatch):
    import graphmode.cli.bench_cmd  # noqa: F401  (registers `bench`)
    from graphmode.cli.app import app
    monkeypatch.setenv("GRAPHMODE_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "results"
    res = CliRunner().invoke(app, ["bench", "decode", "--model", f"{E2E / 'tiny_decoders.py'}:gpt2", "--speculative",
                                   "3", "--context", "24", "--new-tokens", "16", "--iters", "1", "--threads", "1",
                                   "--out", str(out), "--name", "t", "--json"])
    assert res.exit_code == 0, res.output
    (row,) = json.loads(res.stdout[res.stdout.index("["):])
    assert row["tokens_equal"] is True and "error" not in row
    assert row["num_tokens"] == 3 and row["plain_tok_s"] > 0 and row["speculative_tok_s"] > 0
    assert row["speedup"] == round(row["speculative_tok_s"] / row["plain_tok_s"], 3)
    assert row["draft_tokens"] > 0 and 0 <= row["accept_rate"] <= 1
    assert row["accept_rate"] == round(row["accepted_tokens"] / row["draft_tokens"], 3)
    assert {p.name for p in out.iterdir()} == {"t-speculative.json", "t-speculative.meta.json", "t-speculative.md"}
    assert "load" in json.loads((out / "t-speculative.meta.json").read_text())
