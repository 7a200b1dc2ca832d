"""`graphmode generate` on the tiny GPT-2 of tiny_decoders.py: greedy tokens equal to
transformers' generate (a batch of two prompts), streaming that prints the same tokens,
seeded sampling that repeats, a token-id stop sequence and a text prompt cut at a stop
string, and the refusals that come before any compile (each exits 2 with the flag, the
value and the fix, no traceback). The compiling tests share one cache folder, so kernels
are built once per module."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from graphmode.cli.app import _register, app

from tiny_decoders import VOCAB, _lm, greedy_reference, recipe, tokenizer

_register()
runner = CliRunner()
TINY = str(Path(__file__).with_name("tiny_decoders.py"))
P0, P1 = [5, 6, 7], [9, 10, 11, 12, 13, 14]
NEW = 10


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("generate")
    rec = d / "decoder.yaml"
    rec.write_text(yaml.safe_dump(recipe()))
    nokv = d / "encoder.yaml"
    nokv.write_text(yaml.safe_dump({k: v for k, v in recipe().items() if k != "memory"}))
    return {"recipe": str(rec), "nokv": str(nokv), "cache": str(d / "cache")}


def gen(files, *args: str, model: str = "gpt2", recipe_key: str = "recipe"):
    res = runner.invoke(app, ["generate", "--model", f"{TINY}:{model}", "--recipe", files[recipe_key],
                              "--cache-dir", files["cache"], *args])
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    assert "Traceback" not in res.output, res.output
    return res


def reference(prompt: list[int]) -> list[int]:
    return greedy_reference(prompt, NEW)


@pytest.fixture(scope="module")
def greedy(files):
    res = gen(files, "--prompt-ids", ",".join(map(str, P0)), "--prompt-ids", ",".join(map(str, P1)),
              "--max-tokens", str(NEW), "--json")
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def test_greedy_batch_is_token_identical_to_transformers(greedy):
    a, b = greedy["choices"]
    assert a["tokens"] == reference(P0) and b["tokens"] == reference(P1), greedy
    for c, p in ((a, P0), (b, P1)):
        assert c["prompt_tokens"] == len(p) and c["text"] is None
        assert c["finish_reason"] == ("eos" if len(c["tokens"]) < NEW else "length")
        assert c["ttft_ms"] > 0 and c["decode_tok_s"] > 0
    t = greedy["timings"]
    assert set(t) == {"ttft_ms", "decode_tok_s", "total_ms", "new_tokens", "setup_s"}
    assert 0 < t["ttft_ms"] <= t["total_ms"] and t["decode_tok_s"] > 0
    assert t["new_tokens"] == len(a["tokens"]) + len(b["tokens"])


def test_ignore_eos_runs_to_max_tokens_past_the_models_end_token(files):
    """vLLM's ignore_eos, which the server took and the CLI did not."""
    from graphmode.cli.generate_cmd import sampling
    cfg = {"eos": 2, "vocab": VOCAB}
    assert sampling(cfg, NEW, 0.0, None, None, None, []).eos == {2}
    assert sampling(cfg, NEW, 0.0, None, None, None, [], ignore_eos=True).eos == frozenset()
    res = gen(files, "--prompt-ids", ",".join(map(str, P0)), "--max-tokens", str(NEW), "--ignore-eos", "--json")
    assert res.exit_code == 0, res.output
    (c,) = json.loads(res.stdout)["choices"]
    assert c["tokens"] == reference(P0) and len(c["tokens"]) == NEW and c["finish_reason"] == "length"


def test_stream_prints_the_same_tokens(files, greedy):
    res = gen(files, "--prompt-ids", ",".join(map(str, P0)), "--max-tokens", str(NEW), "--stream")
    assert res.exit_code == 0, res.output
    assert res.stdout.split() == [str(t) for t in greedy["choices"][0]["tokens"]], res.stdout
    assert "TTFT" in res.stderr and "tok/s" in res.stderr


def test_a_stop_sequence_ends_generation_and_is_cut(files, greedy):
    toks = greedy["choices"][0]["tokens"]
    k = next(i for i in range(1, len(toks) - 1) if (toks[i], toks[i + 1]) not in zip(toks[:i], toks[1:i + 1]))
    res = gen(files, "--prompt-ids", ",".join(map(str, P0)), "--max-tokens", str(NEW), "--json",
              "--stop-ids", f"{toks[k]},{toks[k + 1]}")
    assert res.exit_code == 0, res.output
    c = json.loads(res.stdout)["choices"][0]
    assert c["tokens"] == toks[:k] and c["finish_reason"] == "stop", (c, toks)
    res = gen(files, "--prompt-ids", ",".join(map(str, P0)), "--max-tokens", str(NEW), "--stop-ids",
              f"{toks[k]},{toks[k + 1]}")
    assert f"{k} new token(s) ({k + 2} generated, stop sequences cut), finish: stop" in res.stderr, res.stderr


SAMPLE = ["--prompt-ids", "5,6,7", "--max-tokens", str(NEW), "--temperature", "3", "--top-k", "50", "--top-p", "0.95",
          "--seed", "7", "--json"]


@pytest.fixture(scope="module")
def sampled(files):
    """The same prompt twice with one seed, streamed as JSON lines."""
    res = gen(files, *SAMPLE, "--prompt-ids", "5,6,7", "--stream")
    assert res.exit_code == 0, res.output
    lines = [json.loads(x) for x in res.stdout.splitlines()]
    return lines[:-1], lines[-1]


def test_seeded_sampling_streams_as_json_lines(sampled, greedy):
    chunks, final = sampled
    a, b = (c["tokens"] for c in final["choices"])
    for i, toks in enumerate((a, b)):
        assert [t for c in chunks if c["index"] == i for t in c["tokens"]] == toks
    assert a == b                                         # each sequence draws from its own seeded generator
    assert a != greedy["choices"][0]["tokens"]            # it did sample


@pytest.mark.slow     # ~5 s; seeded sampling's repeatability is also test_seeded_sampling_streams_as_json_lines'
def test_seeded_sampling_repeats(files, sampled):
    res = gen(files, *SAMPLE)
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["choices"][0]["tokens"] == sampled[1]["choices"][0]["tokens"]


def test_text_prompt_is_cut_at_a_stop_string(files):
    tok = tokenizer()
    ref = reference([5, 6, 7])
    words = [tok.decode([t]) for t in ref]
    k = next(i for i in range(1, len(ref)) if words[i] not in words[:i]
             and not any(w.startswith(words[i]) for w in words[:i]))
    res = gen(files, "--prompt", "w5 w6 w7", "--max-tokens", str(NEW), "--stop", f" {words[k]}", "--json",
              model="gpt2_words")
    assert res.exit_code == 0, res.output
    c = json.loads(res.stdout)["choices"][0]
    assert c["text"] == " ".join(words[:k]) and c["finish_reason"] == "stop", (c, words)
    assert c["tokens"][:k] == ref[:k]


LONG = ",".join(str(3 + i % 90) for i in range(40))           # the recipe's seq allows 32


@pytest.mark.parametrize("rec,args,where,needle", [
    ("nokv", ["--prompt-ids", "5,6"], "memory.kv_cache", "memory.kv_cache"),
    ("recipe", ["--prompt-ids", LONG], "--prompt-ids", "at most 32"),
    ("recipe", ["--prompt-ids", "5"], "--prompt-ids", "at least 2"),
    ("recipe", ["--prompt-ids", "5,six,7"], "--prompt-ids", "cannot parse"),
    ("recipe", ["--prompt-ids", f"5,{VOCAB}"], "--prompt-ids #1", f"[0, {VOCAB})"),
    ("recipe", ["--prompt", "w5 w6"], "--prompt", "no tokenizer"),
    ("recipe", ["--prompt-ids", "5", "--stop", "w9"], "--stop", "no tokenizer"),
    ("recipe", [], "--prompt/--prompt-ids", "text or as token ids"),
    ("recipe", ["--prompt-ids", "5,6", "--top-k", "5"], "--top-k", "--temperature"),
    ("recipe", ["--prompt-ids", "5,6", "--top-p", "1.5"], "--top-p", "(0, 1]"),      # the value, not the temperature
    ("recipe", ["--prompt-ids", "5,6", "--temperature", "-1"], "--temperature", "temperature"),
    ("recipe", ["--prompt-ids", "5,6", "--temperature", "nan"], "--temperature", ">= 0"),
    ("recipe", ["--prompt-ids", "5,6", "--max-tokens", "0"], "--max-tokens", "max_new_tokens"),
    ("recipe", ["--prompt-ids", "5,6", "--max-tokens", "60"], "--max-tokens", "KV pages"),
])
def test_bad_requests_are_refused_before_compiling(files, tmp_path, rec, args, where, needle):
    cache = tmp_path / "cache"
    res = runner.invoke(app, ["generate", "--model", f"{TINY}:gpt2", "--recipe", files[rec], "--cache-dir",
                              str(cache), *args, "--json"])
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    err = json.loads(res.stdout)
    assert err["where"] == where and needle in err["message"] + err["fix"], err
    assert not cache.exists()                             # refused before the compile wrote anything


@pytest.mark.slow     # ~4 s; a spec's forms are read in tests/unit/capture
def test_a_spec_returning_the_model_alone_generates(files):
    """`pkg.mod:fn` returning a bare causal LM: compile, run and verify took it with --recipe,
    generate refused it (BareModuleError) though --recipe was given."""
    res = gen(files, "--prompt-ids", ",".join(map(str, P0)), "--max-tokens", str(NEW), "--json", model="gpt2_alone")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["choices"][0]["tokens"] == reference(P0)


def test_a_save_pretrained_folder_generates_from_text_with_its_own_tokenizer(files, tmp_path):
    """A folder as vLLM takes one: the class its config names, its weights and its tokenizer (it
    was refused as "a directory", and a model of one's own had no way to bring a tokenizer)."""
    folder = tmp_path / "tiny-gpt2"
    _lm().save_pretrained(folder)
    tokenizer().save_pretrained(folder)
    res = runner.invoke(app, ["generate", "--model", str(folder), "--recipe", files["recipe"], "--cache-dir",
                              files["cache"], "--prompt", " ".join(f"w{t}" for t in P0), "--max-tokens", str(NEW),
                              "--json"])
    assert res.exit_code == 0 and "Traceback" not in res.output, res.output
    choice = json.loads(res.stdout)["choices"][0]
    assert choice["tokens"] == reference(P0)
    assert choice["text"].split() == [f"w{t}" for t in reference(P0)]


@pytest.mark.slow     # ~30 s on 2 busy cores; the Python API's draft decodes in test_decoder_recipes
def test_without_a_recipe_generate_drafts_one_as_the_python_api_does(files):
    """It refused, pointing at GPT-2's recipe, whose KV sizes other models then failed on."""
    res = runner.invoke(app, ["generate", "--model", f"{TINY}:gpt2", "--cache-dir", files["cache"],
                              "--prompt-ids", ",".join(map(str, P0)), "--max-tokens", str(NEW), "--json"])
    assert res.exit_code == 0 and "Traceback" not in res.output, res.output
    assert json.loads(res.stdout)["choices"][0]["tokens"] == reference(P0)


@pytest.mark.parametrize("context,pages_help", [(64, True), (32, False)])
def test_a_request_past_the_pages_names_pages_only_where_more_would_help(context, pages_help):
    """generate --max-tokens past the pages said 'or raise max_pages_per_seq', and a recipe with more
    pages was then refused for the model's positions: more pages cannot help a model of 32 positions."""
    from graphmode.cli.generate_cmd import Request
    from graphmode.errors import ContractViolation
    from graphmode.recipe import load_recipe
    rec = load_recipe(recipe())
    room = rec.memory.kv_cache.page_size * rec.memory.kv_cache.max_pages_per_seq
    req = Request(None, None, {"context": context}, None, "--prompt-ids", [[5, 6]], (), [])
    with pytest.raises(ContractViolation) as e:
        req.check_room(rec, room)
    assert ("max_pages_per_seq" in e.value.fix) == pages_help and f"at most {room - 2}" in e.value.fix


@pytest.mark.parametrize("over,where", [
    ({"memory": {"kv_cache": dict(recipe()["memory"]["kv_cache"], kv_heads=3)}}, "memory.kv_cache.kv_heads"),
    ({"precision": {"compute": "bf16"}}, "precision.compute"),
])
def test_recipe_validate_with_the_model_refuses_the_decoder_recipes_generate_refuses(tmp_path, over, where):
    """`recipe validate --model` said valid; `generate` then refused the same recipe."""
    rec = tmp_path / "r.yaml"
    rec.write_text(yaml.safe_dump(recipe(**over)))
    res = runner.invoke(app, ["recipe", "validate", "--model", f"{TINY}:gpt2", str(rec), "--json"])
    assert res.exit_code == 2 and json.loads(res.stdout)["where"] == where, res.output


def test_speculative_decoding_reports_its_drafts(files, tmp_path):
    """With decode.speculative the run says how many draft tokens it proposed and accepted (they were
    only in the engine's stats)."""
    rec = tmp_path / "spec.yaml"
    rec.write_text(yaml.safe_dump(dict(recipe(), decode={"speculative": {"method": "ngram", "num_tokens": 3}})))
    res = gen(dict(files, spec=str(rec)), "--prompt-ids", "5,6,7,5,6,7,5,6", "--max-tokens", str(NEW), "--json",
              recipe_key="spec")
    assert res.exit_code == 0, res.output
    spec = json.loads(res.stdout)["speculative"]
    assert spec["draft_tokens"] >= spec["accepted_tokens"] >= 0 and spec["draft_tokens"] > 0, spec
    assert spec["decode_steps"] > 0 and spec["accept_rate"] == round(spec["accepted_tokens"] / spec["draft_tokens"], 4)
