"""A tensor-parallel decoder group saved and started again from its files (decode/saved.py):
2 ranks of the tiny GPT-2 of tiny_tp.py each write their shard's paged graph and plans as their
own `.gm`, the group file names them; `graphmode.load` of the group file starts 2 ranks that
build their engines over their files with no capture and no kernel compile, and give the saved
group's greedy tokens (and transformers'); each rank's pool is still half the KV heads, as the
proof counts; `graphmode serve` of the group file answers completions."""
from __future__ import annotations

import sys
import warnings
from pathlib import Path

import httpx
import pytest
import torch

import graphmode
from graphmode.decode.api import causal_lm
from graphmode.recipe import load_recipe
from graphmode.recipe.facts import kv_cache_bytes
from graphmode.runtime.artifact import ArtifactError
from graphmode.runtime.rank_artifacts import load_group as load_encoder_group
from graphmode.serve import ModelServer, ServeConfig

sys.path.insert(0, str(Path(__file__).parent))
from test_serve import serve_cache  # noqa: E402
from test_serve_hardening import serving  # noqa: E402
from test_tensor_parallel_decode import MASK, PROMPTS, SPEC, recipe  # noqa: E402

pytestmark = pytest.mark.slow      # two rank processes compile a decoder each, then two load it


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    d = tmp_path_factory.mktemp("tp-decoder-gm")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        one = graphmode.compile(f"{SPEC}:gpt2", recipe("gpt2", 1), cache_dir=d / "cache")
        with graphmode.compile(f"{SPEC}:gpt2", recipe("gpt2", 2), cache_dir=d / "cache") as tp:
            want = tp.generate(PROMPTS, MASK, max_new_tokens=12)
            summary = tp.save(d / "lm.gm")
    return one, want, summary, d


def test_a_loaded_decoder_group_gives_the_saved_groups_tokens_without_compiling(saved):
    one, want, summary, d = saved
    assert [Path(f).name for f in summary["files"]] == ["lm.rank0.gm", "lm.rank1.gm"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = causal_lm(one.source).generate(PROMPTS, attention_mask=MASK, max_new_tokens=12, do_sample=False,
                                             pad_token_id=0)
    with graphmode.load(d / "lm.gm", cache_dir=d / "fresh") as group:
        got = group.generate(PROMPTS, MASK, max_new_tokens=12)
        assert torch.equal(got, want) and torch.equal(got, ref), (got.tolist(), want.tolist(), ref.tolist())
        whole = kv_cache_bytes(load_recipe(recipe("gpt2", 1)))
        for r in group.ranks:
            assert r["kernel_compiles"] == 0 and r["artifact_loads"] == len(summary["buckets"]), r
            assert r["kv_pool_bytes"] == r["kv_bytes"] == r["proof_kv_bytes"] == whole // 2, r


def test_the_encoder_group_loader_refuses_a_decoder_group_and_names_the_one_that_starts_it(saved):
    *_, d = saved
    with pytest.raises(ArtifactError, match="decoder group") as e:
        load_encoder_group(d / "lm.gm")
    assert "graphmode.load" in e.value.fix


def test_serving_the_decoder_groups_file_answers_completions(saved, tmp_path_factory):
    _, want, _, d = saved
    server = ModelServer(str(d / "lm.gm"), None, config=ServeConfig(cache_dir=serve_cache(tmp_path_factory),
                                                                     shutdown_grace_s=1.0))
    with serving(server) as (running, _client, tracebacks):
        r = httpx.post(running.url + "/v1/completions", timeout=120,
                       json={"prompt": PROMPTS[1].tolist(), "max_tokens": 12, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == want[1, PROMPTS.shape[1]:].tolist()
        assert not tracebacks
