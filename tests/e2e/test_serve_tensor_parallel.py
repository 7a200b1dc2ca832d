"""Tensor-parallel decoding through the CLI, end to end: `graphmode generate` and `graphmode serve`
with a decoder recipe under `parallel.tensor: 2` start 2 rank processes (each compiles its shard
of the tiny GPT-2 of tiny_tp.py); rank 0 schedules and samples, driven from the CLI's process
(graphmode/decode/tp_engine.py).

- generate: the same tokens as one process (`parallel` dropped), and as transformers' greedy;
  with prompt-lookup drafts (decode.speculative) too, which rank 0's engine verifies.
- serve: two concurrent completions (one streamed) give transformers' greedy tokens and share
  decode steps (continuous batching on rank 0); /healthz and /metrics report both ranks; a
  killed rank fails /healthz and answers requests 503 naming it, never a hang; SIGTERM ends the
  server and every rank process (no orphans).

Each server or generate run compiles the ranks' shards: minutes on a busy 2-core host (slow).
Every wait has a ceiling; the tests wait for events, never for fixed times."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import warnings
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
import tiny_tp  # noqa: E402
from test_serve import eventually  # noqa: E402 - poll an event under a ceiling

SPEC = f"{HERE / 'tiny_tp.py'}:gpt2"
READY_S = 900            # ceilings: 2 rank compiles on a slow, loaded 2-core host
EVENT_S = 120
P1, P2 = [5, 6, 7], [9, 10, 11, 12]

pytestmark = pytest.mark.slow


def write_recipe(path: Path, tensor: int) -> Path:
    """Batch buckets 1, 2, 4, prompts up to 8 tokens, a pool of 16 pages of 4 tokens (6 a sequence)."""
    r = tiny_tp.recipe(f"gpt2-decode-tp{tensor}", tensor, dims={"batch": {"buckets": [1, 2, 4]},
                                                                 "seq": {"buckets": [8], "min": 2}})
    r["memory"] = {"kv_cache": {"page_size": 4, "max_pages_per_seq": 6, "pages": 16, "layers": 2, "kv_heads": 4,
                                "head_dim": 8}}
    path.write_text(yaml.safe_dump(r))
    return path


def env(cache: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "GRAPHMODE_CACHE_DIR": str(cache)}


def greedy(prompt: list[int], n: int) -> list[int]:
    """transformers' greedy tokens (up to and with the model's EOS)."""
    lm = tiny_tp.gpt2()[0]
    lm = getattr(lm, "raw_module", None) or lm
    eos = lm.config.eos_token_id
    ids = torch.tensor([prompt])
    with warnings.catch_warnings(), torch.inference_mode():
        warnings.simplefilter("ignore")
        out = lm.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                          pad_token_id=0)
    new = out[0, len(prompt):].tolist()
    return new[:new.index(eos) + 1] if eos in new else new


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


# ---- generate ------------------------------------------------------------------------------------------------

def generate(recipe: Path, cache: Path) -> list[list[int]]:
    cmd = [sys.executable, "-m", "graphmode", "generate", "--model", SPEC, "--recipe", str(recipe),
           "--prompt-ids", ",".join(map(str, P1)), "--prompt-ids", ",".join(map(str, P2)), "--max-tokens", "8",
           "--json"]
    out = subprocess.run(cmd, env=env(cache), capture_output=True, text=True, timeout=READY_S, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return [c["tokens"] for c in json.loads(out.stdout)["choices"]]


def test_generate_cli_on_two_ranks_prints_one_process_s_tokens(tmp_path):
    cache = tmp_path / "cache"
    one = generate(write_recipe(tmp_path / "tp1.yaml", 1), cache)
    two = generate(write_recipe(tmp_path / "tp2.yaml", 2), cache)
    assert two == one, (two, one)
    for got, prompt in zip(two, (P1, P2)):
        want = greedy(prompt, 8)
        assert got[:len(want)] == want, (got, want)


def test_speculative_decoding_on_two_ranks_gives_greedy_tokens_and_accepts_drafts(tmp_path):
    import graphmode
    r = yaml.safe_load(write_recipe(tmp_path / "tp2.yaml", 2).read_text())
    r["decode"] = {"speculative": {"method": "ngram", "num_tokens": 3}}
    prompt = [5, 6, 7, 5, 6, 7, 5, 6]                  # a repeating prompt: drafts to look up
    with graphmode.compile(SPEC, r, cache_dir=tmp_path / "cache") as tp:
        out = tp.generate(torch.tensor([prompt]), max_new_tokens=16)
        stats = tp.last_stats
    want = greedy(prompt, 16)
    assert out[0, len(prompt):len(prompt) + len(want)].tolist() == want
    assert stats["draft_tokens"] > 0 and stats["accepted_tokens"] > 0, stats      # rank 0's engine verified drafts
    assert stats["decode_steps"] < stats["generated_tokens"] - 1, stats


# ---- serve ---------------------------------------------------------------------------------------------------

class Served:
    """`graphmode serve` in a process of its own on a free loopback port (`command(port)`: another
    command that serves there, e.g. torchrun's ranks)."""

    def __init__(self, recipe: Path, cache: Path, log: Path, command: Any = None):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        cmd = command(self.port) if command is not None else [
            sys.executable, "-m", "graphmode", "serve", "--model", SPEC, "--recipe", str(recipe), "--port",
            str(self.port), "--shutdown-grace-s", "1"]
        self.proc = subprocess.Popen(cmd, env=env(cache), cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT)
        self.client = httpx.Client(base_url=self.url, timeout=EVENT_S)
        eventually(self._ready, READY_S, f"the server's /readyz (log: {log})")

    def _ready(self) -> bool:
        assert self.proc.poll() is None, self.log.read_text()[-3000:]
        try:
            return self.client.get("/readyz").status_code == 200
        except httpx.TransportError:
            return False

    def rank_pids(self) -> list[int]:
        return [r["pid"] for r in self.client.get("/healthz").json()["ranks"]]

    def terminate(self) -> None:
        self.client.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(EVENT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                raise


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tp-serve")
    s = Served(write_recipe(tmp / "tp2.yaml", 2), tmp_path_factory.getbasetemp() / "tp-serve-cache", tmp / "log")
    yield s
    s.terminate()


def completion(client: httpx.Client, prompt: list[int], n: int) -> dict:
    r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": n, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def decode_steps(s: Served) -> int:
    return s.client.get("/v1/recipe").json()["decoder"]["decode_steps"]


def test_health_and_metrics_report_both_ranks(served):
    body = served.client.get("/healthz").json()
    assert body["status"] == "live" and [r["rank"] for r in body["ranks"]] == [0, 1], body
    assert all(r["alive"] and alive(r["pid"]) for r in body["ranks"]), body
    assert re.search(r'graphmode_tensor_parallel_ranks_up\{target="[^"]+"\} 2\.0', served.client.get("/metrics").text)
    # the ranks hold the paged decode graph only: /v1/infer is refused, saying so
    r = served.client.post("/v1/infer", json={"inputs": {"input_ids": [P1], "attention_mask": [[1, 1, 1]]}})
    assert r.status_code == 422 and "tensor-parallel decoder" in r.text, r.text


def test_concurrent_completions_share_steps_and_give_greedy_tokens(served):
    want1, want2 = greedy(P1, 20), greedy(P2, 8)
    before = decode_steps(served)
    got2: list = []
    with served.client.stream("POST", "/v1/completions",
                              json={"prompt": P1, "max_tokens": 20, "temperature": 0, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        lines = r.iter_lines()
        tokens: list[int] = []
        for line in lines:                     # the first token: the long request is running
            if line.startswith("data: {"):
                tokens += sum((c["token_ids"] for c in json.loads(line[6:])["choices"]), [])
                if tokens:
                    break
        other = threading.Thread(target=lambda: got2.append(completion(served.client, P2, 8)))
        other.start()
        for line in lines:
            if line.startswith("data: {"):
                tokens += sum((c["token_ids"] for c in json.loads(line[6:])["choices"]), [])
        other.join(EVENT_S)
    assert tokens == want1, (tokens, want1)
    assert got2 and got2[0]["token_ids"] == want2, (got2, want2)
    # one decode step runs both sequences while they overlap: fewer steps than tokens
    steps = decode_steps(served) - before
    assert steps < len(want1) + len(want2) - 1, (steps, len(want1), len(want2))


def test_sigterm_stops_every_rank(served):
    pids = served.rank_pids()
    assert all(alive(p) for p in pids)
    served.terminate()
    assert served.proc.returncode is not None
    assert "Traceback" not in served.log.read_text(), served.log.read_text()[-3000:]
    eventually(lambda: not any(alive(p) for p in pids), EVENT_S, f"rank processes {pids} gone")


def test_a_killed_rank_fails_health_and_requests_get_503_not_a_hang(tmp_path, tmp_path_factory):
    s = Served(write_recipe(tmp_path / "tp2.yaml", 2), tmp_path_factory.getbasetemp() / "tp-serve-cache",
               tmp_path / "log")
    try:
        pids = s.rank_pids()
        assert completion(s.client, P2, 4)["token_ids"] == greedy(P2, 4)
        os.kill(pids[1], signal.SIGKILL)
        r = s.client.post("/v1/completions", json={"prompt": P1, "max_tokens": 4, "temperature": 0})
        assert r.status_code == 503, r.text
        assert "rank 1" in r.text and "killed by signal 9" in r.text, r.text
        h = s.client.get("/healthz")
        assert h.status_code == 503 and "rank 1" in h.json()["error"]["message"], h.text
        assert h.json()["state"] == h.json()["status"] == "failed", h.text       # it read "state": "ready"
        r = s.client.post("/v1/completions", json={"prompt": P1, "max_tokens": 4, "temperature": 0})
        assert r.status_code == 503 and "tensor-parallel" in r.text, r.text
    finally:
        s.terminate()
    eventually(lambda: not any(alive(p) for p in pids), EVENT_S, f"rank processes {pids} gone")
