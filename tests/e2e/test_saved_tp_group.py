"""A tensor-parallel group saved and loaded: `graphmode compile --save` with a TP=2 recipe starts
the ranks, each writes its shard's `.gm`, and the group file names them; `graphmode.load` of the
group file starts 2 ranks that load their own files (no capture, no kernel compile: a fresh
cache) and answer as the compiled group does."""
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
