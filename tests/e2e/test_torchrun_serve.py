"""`torchrun ... -m graphmode rank --serve-port P`: real torchrun (--standalone, 2 processes on
loopback) starts the ranks; rank 0 serves the group over HTTP from its own process
(graphmode/parallel/torchrun.py `TorchrunGroup`) while rank 1 follows its broadcasts.

- The tiny MLP (encoder path): /v1/infer answers as one process (TP=1), a request outside the
  contract gets its 422, /healthz lists both ranks, a hot reload is refused with the reason;
  a rank that hangs (SIGSTOP) makes the next request a 503 within the collective timeout and
  /healthz fail, never a hang.
- The tiny GPT-2 (decoder path): completions, plain and streamed, give transformers' greedy
  tokens; SIGTERM to torchrun ends rank 0's server gracefully and every rank process.

Each run compiles two shards (slow). Every wait has a ceiling and waits for an event."""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

import graphmode
from graphmode.verify.numerics import rel_l2

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import tiny_tp  # noqa: E402
from test_serve import eventually  # noqa: E402 - poll an event under a ceiling
from test_serve_tensor_parallel import EVENT_S, Served, alive, greedy, write_recipe  # noqa: E402

TIMEOUT_S = 5          # the MLP recipe's collective timeout: a hung rank is found within it

pytestmark = pytest.mark.slow


class TorchrunServed(Served):
    """2 ranks of `graphmode rank --serve-port` under real torchrun; rank 0 answers on a free port."""

    def __init__(self, model: str, recipe: Path, cache: Path, log: Path):
        super().__init__(recipe, cache, log, command=lambda port: [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "graphmode",
            "rank", "--model", model, "--recipe", str(recipe), "--serve-port", str(port), "--threads", "1"])
        self.pids = self.rank_pids()

    def stop(self) -> None:
        """SIGTERM to torchrun (it passes it on to its ranks), then every rank process is gone."""
        self.terminate()
        eventually(lambda: not any(alive(p) for p in self.pids), EVENT_S, f"rank processes {self.pids} gone")


def test_rank_0_serves_an_encoder_group_and_a_hung_rank_fails_fast(tmp_path):
    r = tiny_tp.recipe("mlp-tp2", inputs=tiny_tp.MLP_INPUTS, dims=tiny_tp.MLP_DIMS)
    r["parallel"]["comm"]["timeout_s"] = TIMEOUT_S
    (tmp_path / "tp2.yaml").write_text(yaml.safe_dump(r))
    spec = f"{HERE / 'tiny_tp.py'}:mlp"
    s = TorchrunServed(spec, tmp_path / "tp2.yaml", tmp_path / "cache", tmp_path / "log")
    try:
        health = s.client.get("/healthz").json()
        assert [x["rank"] for x in health["ranks"]] == [0, 1] and all(x["alive"] for x in health["ranks"]), health
        assert all(alive(p) for p in s.pids)
        one = graphmode.compile(spec, tiny_tp.recipe("mlp-tp1", 1, inputs=tiny_tp.MLP_INPUTS, dims=tiny_tp.MLP_DIMS),
                                cache_dir=tmp_path / "cache")
        x = torch.randn(2, 16, generator=torch.Generator().manual_seed(7))
        got = s.client.post("/v1/infer", json={"inputs": {"input": x.tolist()}})
        assert got.status_code == 200, got.text
        want = one(input=x)
        want = want[0] if isinstance(want, (tuple, list)) else want
        out = torch.tensor(next(iter(got.json()["outputs"].values())))
        assert out.shape == want.shape and rel_l2(out, want) < 1e-5
        bad = s.client.post("/v1/infer", json={"inputs": {"input": torch.zeros(2, 15).tolist()}})
        assert bad.status_code == 422 and bad.json()["where"] == "inputs.input.shape[1]", bad.text
        put = s.client.put("/v1/recipe", content=(tmp_path / "tp2.yaml").read_text())
        assert put.status_code == 422 and "torchrun started" in put.json()["message"], put.text
        os.kill(s.pids[1], signal.SIGSTOP)                 # rank 1 hangs
        try:
            t0 = time.monotonic()
            r = s.client.post("/v1/infer", json={"inputs": {"input": x.tolist()}})
            assert r.status_code == 503 and "ranks are down" in r.json()["message"], r.text
            assert time.monotonic() - t0 < TIMEOUT_S + 30
            h = s.client.get("/healthz")
            assert h.status_code == 503 and "rank 0" in h.json()["error"]["message"], h.text
        finally:
            os.kill(s.pids[1], signal.SIGCONT)
    finally:
        s.stop()


def test_rank_0_serves_completions_of_a_decoder_group(tmp_path):
    recipe = write_recipe(tmp_path / "tp2.yaml", 2)
    s = TorchrunServed(f"{HERE / 'tiny_tp.py'}:gpt2", recipe, tmp_path / "cache", tmp_path / "log")
    try:
        p1, p2 = [5, 6, 7], [9, 10, 11, 12]
        r = s.client.post("/v1/completions", json={"prompt": p1, "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
        want = greedy(p1, 8)
        assert r.json()["choices"][0]["token_ids"][:len(want)] == want
        tokens: list[int] = []
        with s.client.stream("POST", "/v1/completions",
                             json={"prompt": p2, "max_tokens": 6, "temperature": 0, "stream": True}) as st:
            assert st.status_code == 200, st.read()
            for line in st.iter_lines():
                if line.startswith("data: {"):
                    tokens += sum((c["token_ids"] for c in json.loads(line[6:])["choices"]), [])
        want = greedy(p2, 6)
        assert tokens[:len(want)] == want, (tokens, want)
    finally:
        s.stop()
    log = (tmp_path / "log").read_text()
    assert "graphmode serve: stopped" in log and "rank 0/2" in log, log[-3000:]
