"""`graphmode bench decode --tensor-parallel 2` on the tiny test GPT-2: one process against two
ranks, the row's fields (tok/s both ways, tokens equal, weights and KV pool per rank, the
broadcast and collectives per step) and the files beside the decode bench's; --speculative with
it is refused. The one-process engine shares its weights with the model sent to the ranks, and
its tokens stay right after the ranks start (spawn's pickler once moved them into shared memory
under the compiled plans: garbage tokens)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

E2E = Path(__file__).resolve().parents[2] / "e2e"


def _bench(tmp_path, monkeypatch, *extra: str):
    import graphmode.cli.bench_cmd  # noqa: F401  (registers `bench`)
    from graphmode.cli.app import app
    monkeypatch.setenv("GRAPHMODE_CACHE_DIR", str(tmp_path / "cache"))
    return CliRunner().invoke(app, ["bench", "decode", "--model", f"{E2E / 'tiny_decoders.py'}:gpt2", *extra,
                                    "--out", str(tmp_path / "results"), "--name", "t", "--json"])


def test_speculative_and_tensor_parallel_together_are_refused(tmp_path, monkeypatch):
    res = _bench(tmp_path, monkeypatch, "--speculative", "2", "--tensor-parallel", "2")
    assert res.exit_code != 0 and "run one at a time" in res.output, res.output


@pytest.mark.slow     # minutes on 2 busy cores: one decoder compiled in this process and one on each of 2 ranks
def test_bench_decode_tensor_parallel_row_and_files(tmp_path, monkeypatch):
    res = _bench(tmp_path, monkeypatch, "--tensor-parallel", "2", "--batches", "2", "--context", "8",
                 "--new-tokens", "8", "--iters", "1", "--threads", "2")
    assert res.exit_code == 0, res.output
    (row,) = json.loads(res.stdout[res.stdout.index("["):])
    assert row["tokens_equal"] is True and "error" not in row and row["tensor_parallel"] == 2
    assert row["tp1_tok_s"] > 0 and row["tpn_tok_s"] > 0 and row["threads_per_rank"] == 1
    assert all(w < 0.75 * row["weights_mb"] for w in row["weights_per_rank_mb"])
    assert all(abs(2 * kv - row["kv_pool_mb"]) < 1e-3 for kv in row["kv_pool_per_rank_mb"])
    per_step = row["comm_per_step"]
    assert per_step["broadcast"]["calls"] == round((row["steps"] + 1) / row["steps"], 2)    # one a step + the stop
    assert per_step["all_reduce"]["calls"] > 0 and per_step["all_gather"]["bytes"] > 0
    out = tmp_path / "results"
    assert {p.name for p in out.iterdir()} == {"t-tp.json", "t-tp.meta.json", "t-tp.md"}
    assert "load" in json.loads((out / "t-tp.meta.json").read_text())
