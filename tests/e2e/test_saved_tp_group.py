"""A tensor-parallel group saved and loaded: `graphmode compile --save` with a TP=2 recipe starts
the ranks, each writes its shard's `.gm`, and the group file names them; `graphmode.load` of the
group file starts 2 ranks that load their own files (no capture, no kernel compile: a fresh
cache) and answer as the compiled group does. A saved BERT group keeps the whole model's input
bounds (its ranks' embeddings hold half the table each), `graphmode run` checks it against the
reference interpreter on its ranks, and `graphmode serve` serves the group file."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

import graphmode
from graphmode.cli.app import _register, app
from graphmode.parallel.launch import TensorParallelModel
from graphmode.verify.numerics import rel_l2

sys.path.insert(0, str(Path(__file__).parent))
import tiny_tp  # noqa: E402

SPEC = str(Path(__file__).with_name("tiny_tp.py"))
_register()


@pytest.mark.slow      # two rank groups start (compile, then load): ~2-3 min on a busy 2-core host
def test_a_saved_group_loads_on_its_ranks_without_compiling_and_answers_alike(tmp_path):
    rec = tiny_tp.recipe("mlp-tp2", inputs=tiny_tp.MLP_INPUTS, dims={"batch": {"buckets": [1, 2], "min": 1}})
    (tmp_path / "tp2.yaml").write_text(yaml.safe_dump(rec))
    out = tmp_path / "mlp.gm"
    res = CliRunner().invoke(app, ["compile", "--model", f"{SPEC}:mlp", "--recipe", str(tmp_path / "tp2.yaml"),
                                   "--save", str(out), "--cache-dir", str(tmp_path / "build")])
    assert res.exit_code == 0, res.output
    assert f"saved {out}: 2 bucket(s)" in res.output
    assert sorted(p.name for p in tmp_path.glob("mlp*.gm")) == ["mlp.gm", "mlp.rank0.gm", "mlp.rank1.gm"]
    xs = [torch.randn(b, 16, generator=torch.Generator().manual_seed(b)) for b in (1, 2)]
    with graphmode.compile(f"{SPEC}:mlp", rec, cache_dir=tmp_path / "build") as tp:
        want = [tp(input=x) for x in xs]
    with graphmode.load(out, cache_dir=tmp_path / "fresh") as loaded:
        assert isinstance(loaded, TensorParallelModel) and loaded.source.module is None
        for r, info in enumerate(loaded.ranks):        # each rank loaded its own file: both buckets, no kernel built
            assert info["rank"] == r and info["artifact_loads"] == 2 and info["kernel_compiles"] == 0, info
        assert loaded.ranks[0]["artifact"] != loaded.ranks[1]["artifact"]
        for x, w in zip(xs, want):
            assert torch.equal(loaded(input=x), w)
        assert loaded.last_comm[0]["collectives"] == 1     # the row-parallel linear's all_reduce


@pytest.mark.slow      # a BERT group compiled and saved, then started twice from its file: ~1-2 min
def test_a_saved_bert_group_keeps_its_bounds_runs_against_the_interpreter_and_is_served(tmp_path):
    import json

    import httpx

    from graphmode.errors import ContractViolation
    from graphmode.serve import ModelServer, ServeConfig, ServerThread
    rec = tiny_tp.recipe("bert-tp2")
    out = tmp_path / "bert.gm"
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(5))
    feed = {"input_ids": ids, "attention_mask": torch.ones(2, 16, dtype=torch.long)}
    with graphmode.compile(f"{SPEC}:bert", rec, cache_dir=tmp_path / "build") as tp:
        want = tp(**feed)[0]
        tp.save(out)
    with graphmode.load(out, cache_dir=tmp_path / "fresh") as loaded:
        assert torch.equal(loaded(**feed)[0], want)
        with pytest.raises(ContractViolation, match=r"holds 96 .* outside its valid range \[0, 95\]"):
            loaded(input_ids=torch.full((2, 16), 96), attention_mask=feed["attention_mask"])
        assert rel_l2(loaded.interpret(**feed)[0], want) < 1e-5

    res = CliRunner().invoke(app, ["run", "--model", str(out), "--iters", "1", "--cache-dir", str(tmp_path / "fresh"),
                                   "--json"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout[res.stdout.index("{"):])
    assert report["numerics_ok"] and report["parallel"]["ranks"] == 2
    assert "reference interpreter on the ranks" in report["median_ms"]
    assert [o["output"] for o in report["outputs"]] == ["last_hidden_state"]      # rank 0's names, not positions

    server = ModelServer(str(out), None, config=ServeConfig(batch_window_ms=0, cache_dir=tmp_path / "fresh"))
    running = ServerThread(server).start()
    try:
        running.wait_ready(600)
        with httpx.Client(base_url=running.url, timeout=120) as c:
            assert len(c.get("/healthz").json()["ranks"]) == 2
            r = c.post("/v1/infer", json={"inputs": {k: v.tolist() for k, v in feed.items()}})
            assert r.status_code == 200, r.text
            (got,) = r.json()["outputs"].values()
            assert rel_l2(torch.tensor(got), want) < 1e-5
            r = c.post("/v1/infer", json={"inputs": {"input_ids": [[96] * 16] * 2, "attention_mask": [[1] * 16] * 2}})
            assert r.status_code == 422 and "[0, 95]" in r.text, r.text
    finally:
        running.stop()
        if server.active is not None:
            server.active.cm.close()
