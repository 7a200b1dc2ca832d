"""torchrun's ranks (graphmode/parallel/torchrun.py, `graphmode rank`) without processes: rank 0's
requests broadcast to thread ranks, the world/recipe check and the CLI's refusals before any
group is joined. The real torchrun run is tests/e2e/test_torchrun.py (slow)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

import graphmode.recipe  # noqa: F401  (first: the recipe package and graphmode.parallel import each other)
from graphmode.cli.app import app
from graphmode.cli.rank_cmd import RequestFile, named_outputs, torchrun_env
from graphmode.errors import ContractViolation, GraphmodeError, RankFailure
from graphmode.parallel.comm import run_ranks
from graphmode.parallel.torchrun import CLOSE, KEEPALIVE, Broadcasts, check_world
from graphmode.recipe import Recipe

sys.path.insert(0, str(Path(__file__).parents[2] / "e2e"))
import tiny_tp  # noqa: E402

MLP = tiny_tp.recipe("mlp-tp2", inputs=tiny_tp.MLP_INPUTS, dims=tiny_tp.MLP_DIMS)


def test_every_rank_receives_rank_0s_requests_in_order_then_close():
    reqs = [("run", (), {"input": torch.randn(2, 16)}), ("run", (), {"input": torch.randn(1, 16)})]
    answers: list = []

    def rank(r, comm):
        ch = Broadcasts(comm, reqs if r == 0 else [("run", (), {})], answers.append)   # only rank 0's are read
        got = [ch.recv() for _ in range(3)]
        ch.send(("ok", f"from {r}", {}))
        return got
    seen = run_ranks(3, rank, timeout_s=30)
    for got in seen:
        assert [m[0] for m in got] == ["run", "run", CLOSE[0]]
        assert all(torch.equal(a[2]["input"], b[2]["input"]) for a, b in zip(got, reqs))
    assert answers == [("ok", "from 0", {})]          # only rank 0 answers


def test_while_rank_0_waits_for_a_request_every_rank_gets_keepalives():
    """A slow source (a pipe, stdin): rank 0 broadcasts KEEPALIVEs meanwhile, so the others' wait
    never reaches the collective timeout; the source here is held until rank 1 has seen two."""
    import threading
    held = threading.Event()

    def source():
        yield ("run", (), {"n": 1})
        assert held.wait(30)
        yield ("run", (), {"n": 2})

    def rank(r, comm):
        ch = Broadcasts(comm, source() if r == 0 else None, keepalive_s=0.01)
        got, waits = [], 0
        while (msg := ch.recv()) != CLOSE:
            if msg == KEEPALIVE:
                waits += 1
                if r == 1 and waits == 2:
                    held.set()
            else:
                got.append(msg[2]["n"])
        return got, waits
    (got0, waits0), (got1, waits1) = run_ranks(2, rank, timeout_s=30)
    assert got0 == got1 == [1, 2] and waits0 == waits1 >= 2


def test_a_message_naming_its_ranks_reaches_each_its_own_part_and_rank_0s_alone_crosses_nothing():
    """{rank: message}: the decode engine's start (rank 0 runs the engine, the others follow);
    a message for rank 0 alone (sample inputs) is not broadcast, so rank 1 skips it unseen."""
    msgs = [{0: ("method", "engine", ()), 1: ("method", "follow", ())}, {0: ("sample", {"batch": 2}, 0)},
            ("run", (), {"n": 1})]

    def rank(r, comm):
        ch = Broadcasts(comm, msgs if r == 0 else None)
        got = []
        while (msg := ch.recv()) != CLOSE:
            got.append(msg[:2])
        return got, ch.received
    (got0, crossed0), (got1, crossed1) = run_ranks(2, rank, timeout_s=30)
    assert got0 == [("method", "engine"), ("sample", {"batch": 2}), ("run", ())]
    assert got1 == [("method", "follow"), ("run", ())]
    assert crossed0 == crossed1 == 3                   # the engine's start, the run and the close


def test_a_decoder_recipe_under_torchrun_is_served_not_fed_a_file(tmp_path, monkeypatch):
    r = tiny_tp.recipe("gpt2-tp2", dims={"batch": {"buckets": [1]}, "seq": {"buckets": [8], "min": 2}})
    r["memory"] = {"kv_cache": {"page_size": 4, "max_pages_per_seq": 6, "pages": 16, "layers": 2, "kv_heads": 4,
                                "head_dim": 8}}
    (tmp_path / "tp2.yaml").write_text(yaml.safe_dump(r))
    (tmp_path / "req.jsonl").write_text("")
    for k, v in {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(k, v)
    res = CliRunner().invoke(app, ["rank", "--model", "x:y", "--recipe", str(tmp_path / "tp2.yaml"), "--requests",
                                   str(tmp_path / "req.jsonl")])
    assert res.exit_code == 2 and "--serve-port" in res.output and "memory.kv_cache" in res.output, res.output


def test_a_refusal_is_answered_and_any_other_error_stops_the_rank():
    answers: list = []

    def rank(r, comm):
        ch = Broadcasts(comm, [], answers.append)
        ch.send(("error", ContractViolation("too long", where="dims.seq")))
        if r == 1:
            ch.send(("error", RankFailure("all_reduce failed", where="rank 1")))
        return True
    with pytest.raises(RankFailure, match="all_reduce failed"):
        run_ranks(2, rank, timeout_s=30)
    assert [type(a[1]) for a in answers] == [ContractViolation]


def test_torchruns_world_must_be_the_recipes_tensor_degree():
    rec = Recipe.model_validate(MLP)
    check_world(rec, 2, 1)
    with pytest.raises(GraphmodeError, match=r"torchrun started 3 rank\(s\) \(WORLD_SIZE 3\).*parallel.tensor 2") as e:
        check_world(rec, 3, 0)
    assert e.value.where == "parallel.tensor" and "--nproc-per-node" in e.value.fix
    with pytest.raises(GraphmodeError, match="rank 2 is outside the group of 2"):
        check_world(rec, 2, 2)


def test_the_environment_is_torchruns_or_refused():
    env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500",
           "LOCAL_WORLD_SIZE": "1"}
    assert torchrun_env(env) == {"rank": 1, "world": 2, "master_addr": "10.0.0.1", "master_port": 29500,
                                 "local_world": 1}
    with pytest.raises(GraphmodeError, match="MASTER_ADDR, MASTER_PORT not set") as e:
        torchrun_env({"RANK": "0", "WORLD_SIZE": "2"})
    assert "torchrun" in e.value.fix
    with pytest.raises(GraphmodeError, match="must be integers"):
        torchrun_env({**env, "RANK": "one"})


def test_the_rank_command_refuses_a_wrong_world_before_joining(tmp_path, monkeypatch):
    path = tmp_path / "tp2.yaml"
    path.write_text(yaml.safe_dump(MLP))
    (tmp_path / "req.jsonl").write_text("")
    for k, v in {"RANK": "0", "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1",
                 "LOCAL_WORLD_SIZE": "3"}.items():
        monkeypatch.setenv(k, v)
    args = ["rank", "--model", "x:y", "--recipe", str(path), "--requests", str(tmp_path / "req.jsonl")]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 2 and "WORLD_SIZE 3" in res.output and "parallel.tensor 2" in res.output, res.output
    monkeypatch.setenv("WORLD_SIZE", "2")
    res = CliRunner().invoke(app, args[:-2])
    assert res.exit_code == 2 and "from a file or serves them over HTTP" in res.output, res.output
    res = CliRunner().invoke(app, args + ["--serve-port", "0"])          # both: which one is meant?
    assert res.exit_code == 2 and "--requests / --serve-port" in res.output, res.output
    res = CliRunner().invoke(app, args[:-1] + [str(tmp_path / "missing.jsonl")])
    assert res.exit_code == 2 and "no such requests file" in res.output, res.output


def test_request_lines_are_decoded_as_the_server_does_and_answered_in_their_order(tmp_path):
    import io
    f = tmp_path / "req.jsonl"
    f.write_text('{"inputs": {"input": [[1, 2]]}}\n\n{"inputs": {"input": "x"}}\nnot json\n{"inputs": {"input": [[3, 4]]}}\n')
    out = io.StringIO()
    feed = RequestFile(f, {"input": "f32"}, out)
    msgs = list(feed)                     # read ahead of the answers, as rank 0's reader thread does
    assert [m[2]["input"].tolist() for m in msgs] == [[[1.0, 2.0]], [[3.0, 4.0]]] and out.getvalue() == ""
    feed.answer(("ok", torch.ones(1, 2), {}))
    feed.answer(("error", ContractViolation("too wide", where="inputs.input.shape[1]")))
    lines = [json.loads(ln) for ln in out.getvalue().splitlines()]
    assert [ln["line"] for ln in lines] == [1, 3, 4, 5] and lines[0]["outputs"] == {"output_0": [[1.0, 1.0]]}
    assert [ln["error"]["error"] for ln in lines[1:]] == ["BadRequest", "BadRequest", "ContractViolation"]
    assert (feed.answered, feed.refused) == (1, 3)
    assert named_outputs((torch.ones(1), [torch.zeros(2)])).keys() == {"output_0", "output_1"}
    assert list(named_outputs({"logits": torch.ones(1), "n": 3})) == ["logits"]
