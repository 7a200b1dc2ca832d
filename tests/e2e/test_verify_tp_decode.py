"""`graphmode verify` of a tensor-parallel decoder recipe checks its decode steps too: the ranks
decode two prompts in a group of their own and rank 0 sends every step's logit rows back, which
are compared with eager's, teacher-forced (decode/check.py). It checked only the whole-sequence
graph, so an f16 KV pool that overflows on the ranks passed."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).parent))
import tiny_tp  # noqa: E402

pytestmark = pytest.mark.slow      # each verify starts two rank groups (the forward's, the decoder's)

HERE = Path(__file__).parent


def verify(tmp_path: Path, model: str, dtype: str) -> tuple[int, dict]:
    from graphmode.cli.app import _register, app
    _register()
    r = tiny_tp.recipe(f"decode-tp2-{dtype}", 2, dims={"batch": {"buckets": [1, 2]}, "seq": {"buckets": [8], "min": 2}})
    r["memory"] = {"kv_cache": {"page_size": 4, "max_pages_per_seq": 6, "layers": 2, "kv_heads": 4, "head_dim": 8,
                                "dtype": dtype}}
    path = tmp_path / f"{dtype}.yaml"
    path.write_text(yaml.safe_dump(r))
    res = CliRunner().invoke(app, ["verify", "--model", model, "--recipe", str(path), "--json", "--fix",
                                   "--max-buckets", "1", "--cache-dir", str(tmp_path / "cache")])
    return res.exit_code, json.loads(res.stdout[res.stdout.index("{"):])


def test_the_ranks_decode_steps_match_eager_at_f32(tmp_path):
    code, d = verify(tmp_path, f"{HERE / 'tiny_tp.py'}:gpt2", "f32")
    assert code == 0 and d["ok"], d
    row = d["cases"][-1]
    assert row["path"] == "decode" and row["bucket"] == {"kv": "f32"}
    check = row["outputs"][0]
    # two prompts, 8 new tokens each: every step's logits came back from rank 0 and were compared
    assert check["steps"] == 16 and 0 < check["rel_l2"] < 1e-5, check


def test_an_overflowing_f16_pool_on_the_ranks_fails_with_the_bf16_fix(tmp_path):
    code, d = verify(tmp_path, f"{HERE / 'tiny_decoders.py'}:gpt2_f16_overflow", "f16")
    assert code == 1 and d["failure"]["stage"] == "decode", d        # the whole-sequence graph (f32) matches
    assert all(c["ok"] for c in d["cases"][:-1])
    assert d["failure"]["fix"] == {"memory": {"kv_cache": {"dtype": "bf16"}}}
