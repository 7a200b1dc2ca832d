"""`torchrun ... -m graphmode rank`: real torchrun (torch.distributed.run, --standalone, 2
processes on loopback) starts the ranks of the tiny MLP's TP=2 recipe; each compiles its shard,
rank 0 reads the JSONL requests and broadcasts them. Its answers equal one process's (TP=1),
and a request outside the contract is answered with its refusal while the group goes on. From a
saved group (runtime/rank_artifacts.py), each rank loads its own file and compiles nothing."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

import graphmode
from graphmode.verify.numerics import rel_l2

sys.path.insert(0, str(Path(__file__).parent))
import tiny_tp  # noqa: E402

SPEC = str(Path(__file__).with_name("tiny_tp.py"))
ROOT = Path(__file__).parents[2]
MLP = tiny_tp.recipe("mlp-tp2", inputs=tiny_tp.MLP_INPUTS, dims=tiny_tp.MLP_DIMS)


def torchrun(tmp_path, model: str, *extra: str, cache: str = "cache") -> subprocess.CompletedProcess:
    """2 ranks of `graphmode rank` under real torchrun on loopback, bounded."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "GRAPHMODE_CACHE_DIR": str(tmp_path / cache)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "graphmode", "rank", "--model", model, *extra,
           "--requests", str(tmp_path / "req.jsonl"), "--out", str(tmp_path / "out.jsonl"), "--threads", "1"]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def requests(tmp_path) -> list[torch.Tensor]:
    """Two requests in the contract and, between them, one outside it (line 2)."""
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(2, 16, generator=g), torch.randn(1, 16, generator=g)]
    lines = [json.dumps({"inputs": {"input": x.tolist()}}) for x in xs]
    lines.insert(1, json.dumps({"inputs": {"input": torch.randn(2, 15).tolist()}}))
    (tmp_path / "req.jsonl").write_text("\n".join(lines) + "\n")
    return xs


def answers_equal_one_process(tmp_path, xs: list[torch.Tensor]) -> None:
    answers = [json.loads(ln) for ln in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [a["line"] for a in answers] == [1, 2, 3]
    assert answers[1]["error"]["error"] == "ContractViolation"
    one = graphmode.compile(f"{SPEC}:mlp", tiny_tp.recipe("mlp-tp1", 1, inputs=tiny_tp.MLP_INPUTS,
                                                          dims=tiny_tp.MLP_DIMS), cache_dir=tmp_path / "cache")
    for x, a in zip(xs, [answers[0], answers[2]]):
        got = torch.tensor(a["outputs"]["output_0"])
        want = one(input=x)
        want = want[0] if isinstance(want, (tuple, list)) else want
        assert got.shape == want.shape and rel_l2(got, want) < 1e-5


@pytest.mark.slow      # two rank processes import torch and compile a shard: ~60 s on a busy 2-core host
def test_torchrun_ranks_answer_rank_0s_requests_as_one_process(tmp_path):
    (tmp_path / "tp2.yaml").write_text(yaml.safe_dump(MLP))
    xs = requests(tmp_path)
    res = torchrun(tmp_path, f"{SPEC}:mlp", "--recipe", str(tmp_path / "tp2.yaml"))
    assert res.returncode == 0, res.stderr[-3000:]
    assert "rank 0/2" in res.stderr and "2 answered, 1 refused" in res.stderr, res.stderr[-2000:]
    answers_equal_one_process(tmp_path, xs)


@pytest.mark.slow      # the shards compile here (~20 s), then torchrun's ranks load them (~60 s)
def test_torchrun_ranks_load_their_own_files_of_a_saved_group(tmp_path):
    from graphmode.runtime.rank_artifacts import rank_paths, write_group
    files = rank_paths(tmp_path / "mlp.gm", 2)
    for r, f in enumerate(files):
        cm = graphmode.compile(f"{SPEC}:mlp", MLP, cache_dir=tmp_path / "cache", rank=r)
        cm.save(f, rank=r)
    write_group(tmp_path / "mlp.gm", files, cm.recipe)
    xs = requests(tmp_path)
    res = torchrun(tmp_path, str(tmp_path / "mlp.gm"), cache="fresh")       # no recipe: the group carries it
    assert res.returncode == 0, res.stderr[-3000:]
    for r in range(2):
        assert f"loaded from mlp.rank{r}.gm (1 bucket(s), 0 kernel(s) compiled)" in res.stderr, res.stderr[-2000:]
    answers_equal_one_process(tmp_path, xs)
