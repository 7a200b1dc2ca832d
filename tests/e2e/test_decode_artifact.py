"""A decoder saved as a `.gm` and decoded without the model's code (graphmode/decode/saved.py).

The tiny GPT-2 and the grouped-query Llama of test_decode.py, compiled under a decoder recipe,
saved and loaded into a fresh cache folder: greedy and streamed tokens equal the model's own
(and transformers'), no kernel is compiled at load, the KV pools are not in the file (their
types are), and the forward call a decoder's artifact cannot answer is refused. Through the
CLI: `graphmode compile --save` of a model with a tokenizer, `graphmode generate --model x.gm`
(text in, the tokenizer saved in the file) gives the model spec's tokens, a `--recipe` other
than the artifact's is refused, and `graphmode serve` of the file answers completions with
transformers' tokens and /v1/infer with a 422 that says why."""
from __future__ import annotations

import json
import warnings
import zipfile
from pathlib import Path

import httpx
import pytest
import torch
import yaml
from test_decode import MASK, PROMPTS, _compile
from test_serve import serve_cache
from test_serve_hardening import serving
from tiny_decoders import greedy_reference, recipe, tokenizer
from typer.testing import CliRunner

import graphmode
from graphmode.backends.cpu.build import builder_for
from graphmode.cli.app import _register, app
from graphmode.errors import GraphmodeError
from graphmode.serve import ModelServer, ServeConfig

_register()
runner = CliRunner()
TINY = str(Path(__file__).with_name("tiny_decoders.py"))


# llama (GQA pools) ~25 s on 2 busy cores: slow; gpt2 runs the same save, load and generate path
@pytest.fixture(scope="module", params=["gpt2", pytest.param("llama", marks=pytest.mark.slow)])
def saved(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(f"decoder-gm-{request.param}")
    lm, cm = _compile(request.param, d / "cache")
    path = d / f"{request.param}.gm"
    manifest = cm.save(path)
    return lm, cm, path, manifest, d


def test_a_loaded_decoder_generates_the_saved_models_tokens_without_compiling(saved):
    lm, cm, path, manifest, d = saved
    assert manifest["decoder"]["layers"] == 2 and "batch=4,seq=1" in manifest["buckets"]
    loaded = graphmode.load(path, cache_dir=d / "fresh")
    ours = loaded.generate(PROMPTS, MASK, max_new_tokens=12)
    kernels = d / "fresh" / "artifacts" / loaded.artifact["digest"] / "kernels"
    assert builder_for(kernels, loaded.threads).stats["compiles"] == 0     # every library came from the file
    assert loaded.events["artifact_load"] == len(manifest["buckets"])
    assert torch.equal(ours, cm.generate(PROMPTS, MASK, max_new_tokens=12))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = lm.generate(PROMPTS, attention_mask=MASK, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(ours, ref), (ours.tolist(), ref.tolist())
    streamed: dict[int, list[int]] = {0: [], 1: [], 2: []}
    for step in loaded.stream(PROMPTS, MASK, max_new_tokens=12):
        for row, toks in step.items():
            streamed[row] += toks
    assert [ours[i, PROMPTS.shape[1]:].tolist()[:len(streamed[i])] for i in range(3)] == \
        [streamed[i] for i in range(3)]


def test_the_kv_pools_are_stored_as_types_not_bytes(saved):
    _, cm, path, _, _ = saved
    from graphmode.decode.api import engine_of
    graph = engine_of(cm).runner.cm.graph
    pools = [k for k in graph.constants if graph.values[k].role == "state"]
    assert pools and all(k.startswith("kv.") for k in pools)
    with zipfile.ZipFile(path) as z:
        text = z.read("graph.ir").decode()
        with z.open("constants.pt") as f:
            stored = torch.load(f, weights_only=True)
    assert not set(pools) & set(stored)
    assert all(f"state %{k}:" in text for k in pools)


def test_a_decoder_artifact_refuses_a_forward_call_and_says_what_it_answers(saved):
    _, _, path, _, d = saved
    loaded = graphmode.load(path, cache_dir=d / "fresh")
    with pytest.raises(GraphmodeError, match="paged graph") as e:
        loaded(PROMPTS, MASK)
    assert "generate" in e.value.fix


# ---- the command line and the server, on the tiny GPT-2 with a word tokenizer ----------------

@pytest.fixture(scope="module")
def words(tmp_path_factory):
    d = tmp_path_factory.mktemp("decoder-gm-cli")
    rec = d / "decoder.yaml"
    rec.write_text(yaml.safe_dump(recipe()))
    other = d / "other.yaml"
    other.write_text(yaml.safe_dump(recipe("another-name")))
    path = d / "words.gm"
    res = runner.invoke(app, ["compile", "--model", f"{TINY}:gpt2_words", "--recipe", str(rec), "--save", str(path),
                              "--cache-dir", str(d / "cache")])
    assert res.exit_code == 0, res.output
    with zipfile.ZipFile(path) as z:
        assert "tokenizer/tokenizer.json" in z.namelist()
    return {"gm": str(path), "recipe": str(rec), "other": str(other), "dir": d}


def _generate(words, model: str, *args: str) -> dict:
    res = runner.invoke(app, ["generate", "--model", model, *args, "--prompt", "w5 w6 w7", "--max-tokens", "8",
                              "--json", "--cache-dir", str(words["dir"] / "cache-gen")])
    assert res.exit_code == 0 and "Traceback" not in res.output, res.output
    return json.loads(res.output[res.output.index("{"):])["choices"][0]


@pytest.mark.slow     # the tokenizer artifact: ~35 s; its reading is tests/unit/decode/test_saved_tokenizer.py
def test_generate_from_the_artifact_uses_its_tokenizer_and_gives_the_models_tokens(words):
    from_file = _generate(words, words["gm"])
    from_spec = _generate(words, f"{TINY}:gpt2_words", "--recipe", words["recipe"])
    assert from_file["tokens"] == from_spec["tokens"] == greedy_reference(tokenizer().encode("w5 w6 w7"), 8)
    assert from_file["text"] == from_spec["text"]


@pytest.mark.slow     # the tokenizer artifact: ~35 s; its reading is tests/unit/decode/test_saved_tokenizer.py
def test_generate_refuses_a_recipe_other_than_the_artifacts(words):
    res = runner.invoke(app, ["generate", "--model", words["gm"], "--recipe", words["other"], "--prompt-ids", "5,6",
                              "--cache-dir", str(words["dir"] / "cache-gen")])
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    assert "--recipe" in res.output and "not the recipe the artifact was compiled with" in res.output


@pytest.mark.slow     # the tokenizer artifact: ~35 s; its reading is tests/unit/decode/test_saved_tokenizer.py
def test_serving_the_artifact_answers_completions_and_refuses_infer(words, tmp_path_factory):
    server = ModelServer(words["gm"], None, config=ServeConfig(cache_dir=serve_cache(tmp_path_factory),
                                                               shutdown_grace_s=1.0))
    with serving(server) as (running, _client, tracebacks):
        r = httpx.post(running.url + "/v1/completions", timeout=60,
                       json={"prompt": "w5 w6 w7", "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["token_ids"] == greedy_reference(tokenizer().encode("w5 w6 w7"), 8)
        assert choice["text"] == tokenizer().decode(choice["token_ids"])
        # the name the model was served by from its spec still addresses it (it was the recipe's only)
        names = {m["id"] for m in httpx.get(running.url + "/v1/models", timeout=60).json()["data"]}
        spec_name = ModelServer(f"{TINY}:gpt2_words", words["recipe"]).model_names()[0]
        assert spec_name in names, (spec_name, names)
        r = httpx.post(running.url + "/v1/infer", timeout=60,
                       json={"inputs": {"input_ids": [[5, 6, 7]], "attention_mask": [[1, 1, 1]]}})
        assert r.status_code == 422 and "paged decode graph" in r.json()["message"], r.text
        # trial AI: prompt scores need the whole-sequence graph; the fix named /v1/completions, the endpoint used
        r = httpx.post(running.url + "/v1/completions", timeout=60,
                       json={"prompt": [5, 9, 17], "max_tokens": 0, "echo": True, "logprobs": 1})
        err = r.json()["error"]                 # OpenAI's error shape on /v1/completions
        assert r.status_code == 501 and "echo with logprobs" in err["message"], r.text
        assert "POST /v1/completions" not in err["message"] and "serve the model itself" in err["message"], r.text
        assert not tracebacks


@pytest.mark.slow     # ~70 s on 2 busy cores (a MoE decoder compiled twice); Mixtral decodes in test_decoder_recipes
def test_a_mixture_of_experts_saved_with_its_custom_op_loads_in_a_fresh_process(tmp_path):
    """Mixtral routes tokens through transformers' own torch op (an eager island); a fresh
    process has no torch.ops.transformers until transformers.integrations.moe is imported, and
    the load failed: the manifest now names the module, and loading imports it."""
    import subprocess
    import sys
    from graphmode.capture.families import _DECODER, _hf
    from graphmode.kb.draft import draft_recipe
    lm = _hf("MixtralForCausalLM", "MixtralConfig", **_DECODER, num_local_experts=4, num_experts_per_tok=2,
             sliding_window=None, initializer_range=0.3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        d = draft_recipe(lm, ranges={"batch": (1, 2), "seq": (2, 6)}, kb_path=None)
        cm = graphmode.compile(lm, d.recipe, cache_dir=tmp_path / "cache")
        want = cm.generate(torch.tensor([PROMPTS[0][:5].tolist()]), max_new_tokens=4)[0].tolist()
        cm.save(tmp_path / "moe.gm")
    with zipfile.ZipFile(tmp_path / "moe.gm") as z:
        assert json.loads(z.read("manifest.json"))["op_modules"] == ["transformers.integrations.moe"]
    code = ("import sys, torch, graphmode\n"
            f"cm = graphmode.load({str(tmp_path / 'moe.gm')!r}, cache_dir={str(tmp_path / 'cache')!r})\n"
            f"print(cm.generate(torch.tensor([{PROMPTS[0][:5].tolist()}]), max_new_tokens=4)[0].tolist())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                         env={**__import__("os").environ, "PYTHONPATH": str(Path(graphmode.__file__).parents[1])})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == str(want)
