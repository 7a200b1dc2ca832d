"""End to end: `graphmode serve` over a tiny GPT-2 decoder with a word tokenizer
(tiny_decoders.py:gpt2_words), the real HTTP server on loopback, no mocks. OpenAI
completions (whole and server-sent events) give transformers' greedy tokens, seeded sampling
repeats, stop strings and stop token ids end with "stop", bad requests get a 4xx JSON error
naming the field and the fix, a client that goes away frees its KV pages, /metrics counts
what was sent, the official `openai` client (chat completions plain and streamed, one SSE
event per token, `n`, logprobs, echo, penalties against transformers', min_tokens,
`models.retrieve`, every refusal as OpenAI's error body with its message and `param`),
KServe v2 (on a small encoder too), the Python client, `graphmode loadtest`,
a hot reload while a stream is open, and a shutdown that ends an open stream with an error
event. The server lowers one graph at start, the decode engine's; the whole-sequence graph
of /v1/infer and KServe is lowered on its first request. (The hot reload recompiles the decoder: it is marked slow, run it with -m slow.)

One decoder server for the module (its warm-up is the slow part). To catch a stream mid-way
on a fast host, a test holds the decode engine's own lock: the decode thread then waits at
its next step, so what happens meanwhile (a disconnect, a swap, a shutdown) is ordered, not
raced. Every wait is for an event with a generous ceiling. The last test shuts the module's
server down."""
from __future__ import annotations

import gc
import json
import threading
import warnings
import weakref
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import numpy as np
import pytest
import torch
import tiny_decoders
from test_decode_lowering import Lowerings
from test_serve import EVENT_S, READY_S, eventually, scrape, serve_cache, total
from test_serve_hardening import serving
from typer.testing import CliRunner

from graphmode.capture.spec import resolve_model_spec
from graphmode.client import Client, ServerError
from graphmode.errors import GraphmodeError
from graphmode.serve import ModelServer, ServeConfig
from graphmode.serve.chat import DEFAULT_CHAT_TEMPLATE

HERE = Path(__file__).resolve().parent
EOS = tiny_decoders.EOS
MODEL = "gpt2-words"                     # the bundle's name: a stable `model` across reloads
P1, P2, P3 = [5, 6, 7], [9, 10, 11, 12, 13, 14], [21, 22]
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def dec(tmp_path_factory):
    bundle = resolve_model_spec(f"{HERE / 'tiny_decoders.py'}:gpt2_words")
    cfg = ServeConfig(cache_dir=serve_cache(tmp_path_factory), shutdown_grace_s=1.0)
    lowerings = Lowerings()
    server = ModelServer(bundle, tiny_decoders.recipe(), config=cfg, on_stage=lowerings)
    with serving(server) as (running, client, tracebacks):
        yield SimpleNamespace(server=server, running=running, url=running.url, client=client,
                              lm=bundle.raw_module, tok=bundle.tokenizer, tracebacks=tracebacks, refs={},
                              lowerings=lowerings, lowered_at_ready=lowerings.count)


@pytest.fixture(scope="module")
def enc(tmp_path_factory):
    """A small encoder (tiny_models.py:mlp, input [batch, 16] f32) for /v1/infer and KServe v2."""
    from tiny_models import recipe
    bundle = resolve_model_spec(f"{HERE / 'tiny_models.py'}:mlp")
    r = recipe("mlp-v2", [{"name": "input", "dtype": "f32", "shape": ["batch", 16]}], {"batch": {"buckets": [1, 2]}},
               exe_mode="graph")
    server = ModelServer(bundle, r, config=ServeConfig(cache_dir=serve_cache(tmp_path_factory)))
    with serving(server) as (running, client, _):
        yield SimpleNamespace(server=server, url=running.url, client=client, bundle=bundle)


# ---- helpers -------------------------------------------------------------------------------------------------

def greedy(dec, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy tokens for `prompt` on the served torch model (up to its EOS)."""
    key = (tuple(prompt), n)
    if key not in dec.refs:
        ids = torch.tensor([prompt])
        with warnings.catch_warnings(), torch.inference_mode():
            warnings.simplefilter("ignore")
            out = dec.lm.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                                  pad_token_id=0)
        new = out[0, len(prompt):].tolist()
        dec.refs[key] = new[:new.index(EOS) + 1] if EOS in new else new
    return dec.refs[key]


def finish_of(tokens: list[int]) -> str:
    return "stop" if tokens and tokens[-1] == EOS else "length"


def complete(dec, **body) -> dict[str, Any]:
    r = dec.client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def event(line: str) -> Any:
    """One line of a server-sent event stream: None (blank), "[DONE]" or the JSON document."""
    if not line:
        return None
    assert line.startswith("data: "), line
    return "[DONE]" if line == "data: [DONE]" else json.loads(line[6:])


def stream_events(dec, **body) -> list[Any]:
    with dec.client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.read()
        return [e for e in map(event, r.iter_lines()) if e is not None]


def merged(events: list[Any]) -> dict[int, dict[str, Any]]:
    """The choices of a stream's chunks concatenated, by index; nothing may follow a finish."""
    out: dict[int, dict[str, Any]] = {}
    for ev in events:
        if ev == "[DONE]" or not ev["choices"]:
            continue
        for c in ev["choices"]:
            o = out.setdefault(c["index"], {"text": "", "token_ids": [], "finish_reason": None})
            assert o["finish_reason"] is None, f"choice {c['index']} moved after it finished: {events}"
            o["text"] += c["text"]
            o["token_ids"] += c["token_ids"]
            o["finish_reason"] = c["finish_reason"]
    return out


def decoder_view(dec) -> dict[str, Any]:
    return dec.client.get("/v1/recipe").json()["decoder"]


def idle(dec) -> dict[str, Any]:
    """Wait until the active decoder has no sequence and no KV page in use."""
    def check():
        v = decoder_view(dec)
        return v if (dec.server.active.decoder.live, v["running"], v["waiting"], v["kv_pages_used"]) == (0,) * 4 \
            else None
    return eventually(check, EVENT_S, "the decoder to be idle with every KV page back")


def version(dec) -> str:
    return dec.server.active.version


class Frozen:
    """A streamed completion caught mid-way, its decode engine frozen: the engine's logits
    hook stops the decode thread inside the step that produces the sequence's second token
    (the first is already on the wire) until `release()`. However fast the host decodes, the
    stream is caught before its end: an event, not a race against the decoder."""

    def __init__(self, url: str, body: dict[str, Any], engine: Any):
        self.url, self.body, self.engine = url, {**body, "stream": True}, engine
        self.held = False
        self._cm = None

    def __enter__(self) -> "Frozen":
        self.gate, self.reached = threading.Event(), threading.Event()
        self._prev = prev = self.engine.on_logits

        def hook(seq: Any, logits: Any) -> None:
            if seq.generated and not self.gate.is_set():
                self.reached.set()
                self.gate.wait(EVENT_S)
            if prev is not None:
                prev(seq, logits)
        self.engine.on_logits = hook
        self.held = True
        self.client = httpx.Client(base_url=self.url, timeout=EVENT_S)
        self._cm = self.client.stream("POST", "/v1/completions", json=self.body)
        self.response = self._cm.__enter__()
        assert self.response.status_code == 200, self.response.read()
        self.events = (e for e in map(event, self.response.iter_lines()) if e is not None)
        self.first = next(self.events)
        if not self.reached.wait(EVENT_S):
            self.__exit__()
            raise AssertionError("the engine never reached the stream's second token")
        return self

    def release(self) -> None:
        if self.held:
            self.held = False
            self.engine.on_logits = self._prev
            self.gate.set()

    def disconnect(self) -> None:
        if self._cm is not None:
            self._cm, cm = None, self._cm
            cm.__exit__(None, None, None)

    def __exit__(self, *exc: Any) -> None:
        self.release()
        self.disconnect()
        self.client.close()


# ---- one lowering at start -----------------------------------------------------------------------------------

@pytest.mark.slow     # ~10 s: two server starts
def test_a_knowledge_base_summary_leaves_the_whole_sequence_graph_unlowered(dec, tmp_path):
    """serve's periodic (and shutdown) knowledge-base summary read the model's graph, which
    lowered the whole-sequence graph no request had asked for: minutes of CPU on a real model."""
    from graphmode.kb import KnowledgeBase
    from graphmode.kb.record import ServeRecorder
    if not dec.server.active.cm.pending:
        pytest.skip("the whole-sequence graph was lowered by an earlier test on this worker")
    complete(dec, prompt=[5, 6, 7], max_tokens=2, **GREEDY)
    rec = ServeRecorder(tmp_path / "kb.sqlite", dec.server.target)
    assert rec.tick(dec.server.active, force=True) is None
    assert dec.server.active.cm.pending and dec.lowerings.count == 1
    with KnowledgeBase(tmp_path / "kb.sqlite") as kb:
        assert kb.rows("SELECT source FROM performance") == [{"source": "serve"}]


def test_the_decoder_lowers_one_graph_at_start_and_the_whole_sequence_on_its_first_infer(dec):
    """Issue 25 ("the server compiles the model twice"): ready after one lowering, the decode
    engine's paged graph; the first /v1/infer (or KServe request) lowers the whole-sequence
    graph, once, and it answers what the model does."""
    assert dec.lowered_at_ready == 1
    ids = [[5, 6, 7, 8, 9]]
    r = dec.client.post("/v1/infer", json={"inputs": {"input_ids": ids, "attention_mask": [[1] * 5]}})
    assert r.status_code == 200, r.text
    r2 = dec.client.post(f"/v2/models/{MODEL}/infer", json={"inputs": [
        {"name": "input_ids", "shape": [1, 2], "datatype": "INT64", "data": [5, 6]},
        {"name": "attention_mask", "shape": [1, 2], "datatype": "INT64", "data": [1, 1]}]})
    assert r2.status_code == 200, r2.text
    assert dec.lowerings.count == 2 and not dec.server.active.cm.pending
    with torch.inference_mode():
        want = dec.lm(input_ids=torch.tensor(ids), attention_mask=torch.ones(1, 5, dtype=torch.long)).logits
    got = torch.tensor(r.json()["outputs"]["logits"])
    assert float((got - want).norm() / want.norm()) < 1e-5


@pytest.mark.slow
def test_a_recipe_only_the_whole_sequence_graph_refuses_serves_completions_and_answers_infer_422(
        tmp_path_factory):
    """The paged graph has no whole-sequence outputs, so a wrong `outputs` declaration loads
    (completions are served); /v1/infer and KServe, which need the whole-sequence graph, are
    refused with the verdict's reason, every time, after one lowering. (slow: a second
    decoder server; tests/e2e/test_decode_lowering.py checks the refusal in the Python API)"""
    bundle = resolve_model_spec(f"{HERE / 'tiny_decoders.py'}:gpt2_words")
    lowerings = Lowerings()
    server = ModelServer(bundle, tiny_decoders.recipe("tiny-decoder-outputs", outputs={"logits": ["batch", "seq", 99]}),
                         config=ServeConfig(cache_dir=serve_cache(tmp_path_factory)), on_stage=lowerings)
    with serving(server) as (_, client, tracebacks):
        r = client.post("/v1/completions", json={"prompt": P1, "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200, r.text
        body = {"inputs": {"input_ids": [P1], "attention_mask": [[1] * len(P1)]}}
        for _ in range(2):
            r = client.post("/v1/infer", json=body)
            assert r.status_code == 422 and r.json()["error"] == "ContractRefused", r.text
            assert r.json()["issues"][0]["where"] == "outputs.logits[2]" and "100" in r.json()["issues"][0]["message"]
        r = client.get(f"/v2/models/{MODEL}")
        assert r.status_code == 422 and "outputs.logits[2]" in r.text, r.text
        assert lowerings.count == 2 and client.get("/readyz").status_code == 200
        assert not tracebacks, [x.getMessage() for x in tracebacks[:3]]


# ---- completions ---------------------------------------------------------------------------------------------

def test_greedy_completions_are_transformers_tokens(dec):
    """Token-id prompts, several prompts in one request (one choice each, in order), a text
    prompt through the tokenizer: the tokens are transformers' greedy ones, usage counts them."""
    refs = [greedy(dec, p, 12) for p in (P1, P2, P3)]
    doc = complete(dec, prompt=[P1, P2, P3], max_tokens=12, **GREEDY)
    assert doc["object"] == "text_completion" and doc["model"] == MODEL and doc["system_fingerprint"] == version(dec)
    assert [c["index"] for c in doc["choices"]] == [0, 1, 2]
    for c, ref in zip(doc["choices"], refs):
        assert c["token_ids"] == ref and c["finish_reason"] == finish_of(ref)
        assert c["text"] == dec.tok.decode(ref, skip_special_tokens=True)
    n = sum(map(len, refs))
    assert doc["usage"] == {"prompt_tokens": 11, "completion_tokens": n, "total_tokens": 11 + n}

    one = complete(dec, prompt=P2, max_tokens=12, model="tiny-decoder", **GREEDY)     # by the recipe's name
    assert one["model"] == "tiny-decoder"                                # the name asked by, as vLLM answers
    one = one["choices"]
    assert len(one) == 1 and one[0]["token_ids"] == refs[1]             # alone = batched with others
    text = complete(dec, prompt=["w5 w6 w7", "w21 w22"], max_tokens=12, model=MODEL, **GREEDY)
    assert [c["token_ids"] for c in text["choices"]] == [refs[0], refs[2]]
    assert text["choices"][0]["text"] == " ".join(f"w{t}" for t in refs[0])
    assert text["usage"]["prompt_tokens"] == 5


def test_streamed_chunks_add_up_to_the_whole_answer(dec):
    whole = complete(dec, prompt=[P1, P3], max_tokens=10, **GREEDY)
    events = stream_events(dec, prompt=[P1, P3], max_tokens=10, stream_options={"include_usage": True}, **GREEDY)
    # one event per token of one choice, whatever the host's speed (a stop's held-back tail aside)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(len(e["choices"]) == 1 and len(e["choices"][0]["token_ids"]) <= 1 for e in chunks[:-1]), chunks
    assert {e["id"] for e in chunks} == {chunks[0]["id"]} and all(e["object"] == "text_completion" for e in chunks)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]     # include_usage: last
    assert all(e["usage"] is None for e in chunks[:-1])
    got = merged(chunks)
    for c in whole["choices"]:
        assert got[c["index"]] == {"text": c["text"], "token_ids": c["token_ids"], "finish_reason": c["finish_reason"]}
    plain = stream_events(dec, prompt=P2, max_tokens=3, **GREEDY)
    assert plain[-1] == "[DONE]" and all("usage" not in e for e in plain[:-1])
    assert merged(plain)[0]["token_ids"] == greedy(dec, P2, 3)


def test_a_client_that_goes_away_mid_stream_frees_its_sequence(dec):
    idle(dec)
    decoder = dec.server.active.decoder
    v = version(dec)
    before = scrape(dec.client)
    with Frozen(dec.url, {"prompt": [5, 6], "max_tokens": 40, **GREEDY}, decoder.engine) as f:
        assert decoder.live == 1 and decoder_view(dec)["kv_pages_used"] > 0
        f.disconnect()
        # the server noticed (the request is counted as cancelled) while the engine was frozen
        eventually(lambda: total(scrape(dec.client), "graphmode_requests_total", version=v, status="cancelled")
                   > total(before, "graphmode_requests_total", version=v, status="cancelled"), EVENT_S,
                   "the disconnect to cancel the request")
    idle(dec)
    after = scrape(dec.client)
    fin = "graphmode_sequences_finished_total"
    assert total(after, fin, version=v, finish_reason="cancelled") - total(before, fin, version=v,
                                                                         finish_reason="cancelled") == 1
    assert total(after, fin, version=v, finish_reason="length") == total(before, fin, version=v, finish_reason="length")
    made = total(after, "graphmode_generation_tokens_total", version=v) - total(
        before, "graphmode_generation_tokens_total", version=v)
    assert 1 <= made < 40                                             # stopped early, not run to its end
    assert total(after, "graphmode_kv_cache_usage_ratio", version=v) == 0


def test_seeded_sampling_repeats_and_tiny_temperatures_are_greedy(dec):
    body = {"prompt": [P1, P1], "max_tokens": 12, "temperature": 0.9, "top_k": 50, "top_p": 0.95, "seed": 7}
    a = [c["token_ids"] for c in complete(dec, **body)["choices"]]
    assert a[0] == a[1]                              # each sequence has its own generator, seeded alike
    assert [c["token_ids"] for c in complete(dec, **body)["choices"]] == a
    assert merged(stream_events(dec, **body))[0]["token_ids"] == a[0]
    assert complete(dec, **{**body, "seed": 8})["choices"][0]["token_ids"] != a[0]
    assert a[0] != greedy(dec, P1, 12)
    # (1e-300 once divided the logits into inf and failed every sequence of the step)
    tiny = complete(dec, prompt=P1, max_tokens=12, temperature=1e-300, presence_penalty=0.0)
    assert tiny["choices"][0]["token_ids"] == greedy(dec, P1, 12)


def test_stop_strings_and_stop_token_ids_end_with_stop(dec):
    """A stop token, a stop sequence of two tokens and a stop string, each first seen at
    position k of the greedy answer: the answer ends before it, whole or streamed (the
    stream holds back a tail that may still become a stop)."""
    ref = greedy(dec, P1, 12)
    k = next(i for i in range(2, len(ref)) if ref[i] not in ref[:i] and ref[i - 1] not in ref[:i - 1]
             and not any(f"w{t}".startswith(f"w{ref[i]}") for t in ref[:i]))
    cases = [({"stop_token_ids": [ref[k]]}, ref[:k]),
             ({"stop": [[ref[k - 1], ref[k]]]}, ref[:k - 1]),
             ({"stop": f" w{ref[k]}"}, None)]               # text: the tokens that made it are kept
    for extra, tokens in cases:
        whole = complete(dec, prompt=P1, max_tokens=12, **GREEDY, **extra)["choices"][0]
        streamed = merged(stream_events(dec, prompt=P1, max_tokens=12, **GREEDY, **extra))[0]
        assert whole["finish_reason"] == streamed["finish_reason"] == "stop", (extra, whole, streamed)
        text = dec.tok.decode(ref[:k] if tokens is None else tokens, skip_special_tokens=True)
        assert whole["text"] == streamed["text"] == text, (extra, whole, streamed)
        assert whole["token_ids"] == streamed["token_ids"] == (ref[:k + 1] if tokens is None else tokens), extra
    idle(dec)


ERRORS = [   # (body, status, where, words in the message); every answer must also carry a fix
    # the contract's refusals are OpenAI's and vLLM's 400 (graphmode's own endpoints: 422)
    ({"prompt": P1, "max_tokens": 46}, 400, "max_tokens", "pages hold"),
    ({"prompt": list(range(3, 36)), "max_tokens": 2}, 400, "prompt", "at most 32"),
    ({"prompt": [P1, list(range(3, 36))]}, 400, "prompt[1]", "at most 32"),
    ({"prompt": [5, 100, 7]}, 400, "prompt", "[0, 100)"),
    ({"prompt": [[5, 6], [6, -1]]}, 400, "prompt[1]", "[0, 100)"),
    ({"prompt": [5]}, 400, "prompt", "at least 2"),
    ({"prompt": ""}, 400, "prompt", "empty"),
    ({"prompt": P1, "model": "no-such-model"}, 404, "model", "not served"),
    ({"prompt": 5}, 400, "prompt", "prompt must be"),
    ({"prompt": [5, True]}, 400, "prompt", "prompt must be"),
    ({"prompt": P1, "max_tokens": "3"}, 400, "max_tokens", "integer"),
    ({"prompt": P1, "max_tokens": 0}, 400, "max_tokens", "echo"),
    ({"prompt": P1, "temperature": "hot"}, 400, "temperature", "number"),
    ({"prompt": P1, "top_p": 0}, 400, "top_p", "number"),
    ({"prompt": P1, "seed": 1.5}, 400, "seed", "integer"),
    ({"prompt": P1, "stream": "yes"}, 400, "stream", "true or false"),
    ({"prompt": P1, "stop": [1, 2]}, 400, "stop", "ambiguous"),
    ({"prompt": P1, "stop": [""]}, 400, "stop", "characters"),
    ({"prompt": P1, "best_of": 2}, 400, "best_of", "not supported"),
    ({"prompt": P1, "logprobs": 21}, 400, "logprobs", "integer"),
    ({"prompt": P1, "stream_options": {"include_usage": True}}, 400, "stream_options", "stream: true"),
    ({"prompt": P1, "max_token": 5}, 400, "body", "unknown field"),
    ({"max_tokens": 5}, 400, "prompt", "required"),
    ([P1], 400, "body", "JSON object"),
]


def test_bad_requests_get_a_4xx_naming_the_field_and_the_fix(dec):
    """Whole and streamed alike (a refused stream is a JSON answer, not an event stream), in
    OpenAI's error shape {"error": {"message", "type", "param", "code", ...graphmode's}}."""
    c = dec.client
    for body, status, where, words in ERRORS:
        plain = not isinstance(body, dict) or {"stream", "stream_options"} & set(body)
        for doc in [body] if plain else [body, {**body, "stream": True}]:
            r = c.post("/v1/completions", json=doc)
            e = r.json()["error"]
            assert r.status_code == status and e["status"] == status, (doc, r.text)
            assert e["param"] == where and e["type"] == "invalid_request_error" and e["code"], (doc, e)
            assert e["where"] == where and words in e["message"] and e["fix"], (doc, e)
            if where in doc and where != "prompt":                # the value the field had
                assert e["value"] == json.dumps(doc[where]), (doc, e)    # as the client sent it
    raw = [(b'{"prompt": [5', "application/json", 400, "body"), (b"", "application/json", 400, "body"),
           (b'{"prompt": [5]}', "text/csv", 415, "Content-Type"),
           (b'{"prompt": [5]}', "application/octet-stream", 415, "Content-Type")]
    for body, ctype, status, where in raw:
        r = c.post("/v1/completions", content=body, headers={"content-type": ctype})
        e = r.json()["error"]
        assert r.status_code == status and e["where"] == where and e["fix"], r.text
    assert c.post("/v1/completions", json={"prompt": P1, "max_tokens": 2, **GREEDY}).status_code == 200
    assert "Traceback" not in r.text and not dec.tracebacks, [x.getMessage() for x in dec.tracebacks[:3]]
    m = scrape(c)
    assert total(m, "graphmode_bad_requests_total", reason="bad_parameter") >= 25
    assert total(m, "graphmode_contract_violations_total", version=version(dec), kind="shape") >= 2 * 3


def test_metrics_count_what_was_sent(dec):
    idle(dec)
    v = version(dec)
    before = scrape(dec.client)
    complete(dec, prompt=[P1, P3], max_tokens=5, ignore_eos=True, **GREEDY)     # 2 sequences of 5 tokens
    stream_events(dec, prompt=P2, max_tokens=4, ignore_eos=True, **GREEDY)       # 1 of 4
    idle(dec)
    after = scrape(dec.client)

    def grew(name: str, **labels: str) -> float:
        return total(after, name, version=v, **labels) - total(before, name, version=v, **labels)

    for hist in ("time_to_first_token_seconds", "request_time_per_output_token_seconds",
                 "e2e_request_latency_seconds", "request_queue_time_seconds"):
        assert grew(f"graphmode_{hist}_count") == 3, hist            # one per sequence
        assert grew(f"graphmode_{hist}_sum") > 0, hist
    assert grew("graphmode_inter_token_latency_seconds_count") == 4 + 4 + 3     # tokens - 1 per sequence
    assert grew("graphmode_prompt_tokens_total") == len(P1) + len(P3) + len(P2)
    assert grew("graphmode_generation_tokens_total") == 14
    assert grew("graphmode_sequences_finished_total", finish_reason="length") == 3
    assert grew("graphmode_requests_total", status="ok") == 2
    assert total(after, "graphmode_num_requests_running", version=v) == 0
    assert total(after, "graphmode_kv_cache_usage_ratio", version=v) == 0
    ttft = [(dict(ls)["le"], val) for (n, ls), val in after.items()
            if n == "graphmode_time_to_first_token_seconds_bucket" and dict(ls)["version"] == v]
    assert ttft and max(val for _, val in ttft) == total(after, "graphmode_time_to_first_token_seconds_count",
                                                         version=v)


# ---- KServe v2 -----------------------------------------------------------------------------------------------

def test_kserve_v2_metadata_and_health_of_the_decoder(dec):
    c = dec.client
    assert c.get("/v2/health/live").json() == {"live": True}
    assert c.get("/v2/health/ready").json() == {"ready": True}
    assert c.get("/v2").json()["name"] == "graphmode"
    meta = c.get(f"/v2/models/{MODEL}").json()
    assert meta["versions"] == [version(dec)] and meta["parameters"]["decoder"] is True
    assert meta["inputs"] == [{"name": "input_ids", "datatype": "INT64", "shape": [-1, -1]},
                              {"name": "attention_mask", "datatype": "INT64", "shape": [-1, -1]}]
    assert meta["outputs"] == [{"name": "logits", "datatype": "FP32", "shape": [-1, -1, 100]}]
    assert c.get(f"/v2/models/{MODEL}/ready").json() == {"name": MODEL, "ready": True}
    r = c.get("/v2/models/nope")
    assert r.status_code == 404 and isinstance(r.json()["error"], str) and r.json()["where"] == "name"
    assert c.get("/v1/models").json()["data"][0]["id"] == MODEL


def test_kserve_v2_infer_matches_v1_infer_on_an_encoder(enc):
    c = enc.client
    name = "mlp-v2"
    meta = c.get(f"/v2/models/{name}").json()
    assert meta["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, 16]}] and not \
        meta["parameters"]["decoder"]
    out_name = meta["outputs"][0]["name"]
    x = torch.randn(2, 16, generator=torch.Generator().manual_seed(3))
    v1 = c.post("/v1/infer", json={"inputs": {"input": x.tolist()}}).json()
    r = c.post(f"/v2/models/{name}/infer", json={"id": "req-1", "inputs": [
        {"name": "input", "shape": [2, 16], "datatype": "FP32", "data": x.reshape(-1).tolist()}]})
    assert r.status_code == 200, r.text
    doc = r.json()
    assert doc["id"] == "req-1" and doc["model_name"] == name and doc["model_version"] == v1["recipe_version"]
    (out,) = doc["outputs"]
    assert out["name"] == out_name and out["datatype"] == "FP32" and out["shape"] == [2, 4]
    np.testing.assert_allclose(np.asarray(out["data"]).reshape(2, 4), np.asarray(v1["outputs"][out_name]),
                               rtol=1e-6, atol=1e-7)
    with torch.inference_mode():
        eager = enc.bundle.module(input=x)[0]
    np.testing.assert_allclose(np.asarray(out["data"]).reshape(2, 4), eager.numpy(), rtol=1e-4, atol=1e-5)
    assert doc["parameters"]["bucket"] == "batch=2"

    bad = [({"name": "input", "shape": [2, 16], "datatype": "INT64", "data": [1] * 32}, 422, "inputs[0].datatype"),
           ({"name": "input", "shape": [3, 16], "datatype": "FP32", "data": [0.5] * 32}, 422, "shape"),
           ({"name": "input", "shape": [32], "datatype": "FP32", "data": [0.5] * 32}, 422, "shape"),
           ({"name": "input", "shape": [5, 16], "datatype": "FP32", "data": [0.5] * 80}, 422, "batch"),
           ({"name": "nope", "shape": [1, 16], "datatype": "FP32", "data": [0.5] * 16}, 422, "inputs[0].name"),
           ({"name": "input", "shape": [1, 16], "datatype": "FP32", "data": [0.5] * 16,
             "parameters": {"binary_data_size": 64}}, 415, "binary_data_size")]
    for tensor, status, where in bad:
        r = c.post(f"/v2/models/{name}/infer", json={"inputs": [tensor]})
        e = r.json()
        assert r.status_code == status and isinstance(e["error"], str) and where in (e["where"] or ""), (tensor, e)
        assert e["fix"] and "Traceback" not in r.text, e
    r = c.post(f"/v2/models/{name}/infer", content=b"{", headers={"content-type": "application/json"})
    assert r.status_code == 400 and isinstance(r.json()["error"], str)


# ---- the official openai client -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def srv(dec):
    """The module's decoder server as the `openai` client (pinned in the test extra) sees it."""
    openai = pytest.importorskip("openai")
    oa = openai.OpenAI(base_url=dec.url + "/v1", api_key="unused", max_retries=0, timeout=EVENT_S)
    yield SimpleNamespace(openai=openai, oa=oa, server=dec.server, url=dec.url, http=dec.client, lm=dec.lm,
                          tok=dec.tok)
    oa.close()


def reference(srv, prompt: list[int], n: int, **kw) -> list[int]:
    """transformers' greedy tokens (up to its EOS); `kw`: generate's own options (penalties, ...)."""
    ids = torch.tensor([prompt])
    with warnings.catch_warnings(), torch.inference_mode():
        warnings.simplefilter("ignore")
        out = srv.lm.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                              pad_token_id=0, **kw)
    new = out[0, len(prompt):].tolist()
    return new[:new.index(EOS) + 1] if EOS in new else new


def chat_prompt(srv, messages) -> list[int]:
    return srv.tok.encode(srv.tok.apply_chat_template(messages, chat_template=DEFAULT_CHAT_TEMPLATE, tokenize=False,
                                                      add_generation_prompt=True), add_special_tokens=False)


MESSAGES = [{"role": "system", "content": "w5 w6"}, {"role": "user", "content": "w7 w8 w9"}]


def test_chat_completions_plain_and_streamed(srv):
    prompt = chat_prompt(srv, MESSAGES)
    ref = reference(srv, prompt, 8)
    r = srv.oa.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=8, temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == MODEL
    c = r.choices[0]
    assert c.message.role == "assistant" and c.message.content == srv.tok.decode(ref, skip_special_tokens=True)
    assert c.finish_reason == ("stop" if ref[-1] == EOS else "length")
    assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == len(ref)

    chunks = list(srv.oa.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant" and all(ch.object == "chat.completion.chunk"
                                                                  for ch in chunks)
    body = [ch for ch in chunks[1:] if ch.choices]
    assert "".join(ch.choices[0].delta.content or "" for ch in body) == c.message.content
    assert body[-1].choices[0].finish_reason == c.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref)
    # one event per token: each chunk but a finish-only one carries exactly one token
    toks = [ch.model_extra["choices"][0]["token_ids"] if ch.model_extra.get("choices") else
            ch.choices[0].model_extra["token_ids"] for ch in body]
    assert [t for ts in toks for t in ts] == ref and all(len(ts) == 1 for ts in toks[:-1])

    # without max_tokens a chat may fill the sequence's pages (vLLM's default)
    long = srv.oa.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert long.usage.total_tokens == srv.server.active.decoder.engine.layout.max_tokens


def test_vllm_chat_and_stop_options_through_the_openai_client(srv):
    """continue_final_message (the answer goes on from an open assistant turn), chat echo,
    chat_template_kwargs and include_stop_str_in_output, sent as vLLM's clients send them."""
    turns = MESSAGES + [{"role": "assistant", "content": "w10 w11"}]
    text = srv.tok.apply_chat_template(turns, chat_template=DEFAULT_CHAT_TEMPLATE, tokenize=False,
                                       add_generation_prompt=False, continue_final_message=True)
    prompt = srv.tok.encode(text, add_special_tokens=False)
    ref = reference(srv, prompt, 6)
    r = srv.oa.chat.completions.create(model=MODEL, messages=turns, max_tokens=6, temperature=0, extra_body={
        "add_generation_prompt": False, "continue_final_message": True, "echo": True,
        "chat_template_kwargs": {"unused": 1}})
    assert r.usage.prompt_tokens == len(prompt)
    assert r.choices[0].message.content == "w10 w11" + srv.tok.decode(ref, skip_special_tokens=True)
    ref = reference(srv, P1, 8)
    stop = srv.tok.decode(ref[2:4], skip_special_tokens=True)
    kept = srv.oa.completions.create(model=MODEL, prompt=P1, max_tokens=8, temperature=0, stop=[stop],
                                     extra_body={"include_stop_str_in_output": True}).choices[0]
    cut = srv.oa.completions.create(model=MODEL, prompt=P1, max_tokens=8, temperature=0, stop=[stop]).choices[0]
    assert kept.finish_reason == cut.finish_reason == "stop" and kept.text == cut.text + stop


def test_completions_one_event_per_token_n_logprobs_echo(srv):
    ref = reference(srv, P1, 10)
    events = []
    with srv.http.stream("POST", "/v1/completions", json={"prompt": P1, "max_tokens": 10, "temperature": 0,
                                                          "stream": True, "ignore_eos": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    assert [len(e["choices"][0]["token_ids"]) for e in events] == [1] * 10          # 10 tokens, 10 events

    s = list(srv.oa.completions.create(model=MODEL, prompt=P1, max_tokens=4, temperature=0, stream=True))
    assert sum(len(ch.choices[0].model_extra["token_ids"]) for ch in s) == len(ref[:4])

    r = srv.oa.completions.create(model=MODEL, prompt=P1, max_tokens=6, n=3, temperature=0.9, seed=11)
    assert [c.index for c in r.choices] == [0, 1, 2]
    one = srv.oa.completions.create(model=MODEL, prompt=P1, max_tokens=6, temperature=0.9, seed=11)
    assert r.choices[0].text == one.choices[0].text                     # choice 0 samples with the seed itself
    assert len({c.text for c in r.choices}) > 1
    texts: dict[int, str] = {}
    for ch in srv.oa.completions.create(model=MODEL, prompt=P1, max_tokens=6, n=3, temperature=0.9, seed=11,
                                        stream=True):
        assert len(ch.choices) == 1
        texts[ch.choices[0].index] = texts.get(ch.choices[0].index, "") + ch.choices[0].text
    assert texts == {c.index: c.text for c in r.choices}                  # streamed n adds up to the whole

    r = srv.oa.completions.create(model=MODEL, prompt=P1, max_tokens=5, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert lp.tokens == [f"w{t}" for t in ref[:5]] and len(lp.top_logprobs) == 5
    with torch.inference_mode():
        logits = srv.lm(torch.tensor([P1])).logits[0, -1].float()
    want = torch.log_softmax(logits, -1)
    assert abs(lp.token_logprobs[0] - float(want[ref[0]])) < 1e-4
    assert list(lp.top_logprobs[0]) == [f"w{t}" for t in torch.topk(want, 3).indices.tolist()]
    assert lp.text_offset[:2] == [0, len(lp.tokens[0])]

    c = srv.oa.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3, temperature=0, logprobs=True,
                                       top_logprobs=2)
    content = c.choices[0].logprobs.content
    assert len(content) == 3 and all(len(e.top_logprobs) == 2 for e in content)
    assert content[0].top_logprobs[0].logprob >= content[0].top_logprobs[1].logprob

    e = srv.oa.completions.create(model=MODEL, prompt="w5 w6 w7", max_tokens=3, temperature=0, echo=True)
    assert e.choices[0].text == "w5 w6 w7" + srv.tok.decode(ref[:3], skip_special_tokens=True)


def test_echo_with_logprobs_scores_the_prompt_as_transformers_does(srv):
    """echo + logprobs: the prompt's tokens come first, each with its log-probability given
    the ones before it (the first null), from the whole-sequence graph; max_tokens 0 scores
    the prompt alone (what evaluation harnesses send), streamed or not."""
    srv.server.active.cm.lower_now()      # the whole-sequence graph, else a first request may get 503 (lowering)
    prompt = [5, 6, 7, 9, 10]
    with torch.inference_mode():
        want = torch.log_softmax(srv.lm(torch.tensor([prompt])).logits[0].float(), -1)
    ref = reference(srv, prompt, 2)
    r = srv.oa.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0, echo=True, logprobs=2)
    lp = r.choices[0].logprobs
    assert lp.tokens == [f"w{t}" for t in prompt + ref] and r.choices[0].text.startswith("w5 w6 w7 w9 w10")
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and lp.text_offset[0] == 0
    for j in range(1, len(prompt)):
        assert abs(lp.token_logprobs[j] - float(want[j - 1, prompt[j]])) < 1e-4, j
        assert list(lp.top_logprobs[j]) == [f"w{t}" for t in torch.topk(want[j - 1], 2).indices.tolist()]
    assert abs(lp.token_logprobs[len(prompt)] - float(want[-1, ref[0]])) < 1e-4     # the first new token
    assert r.usage.completion_tokens == len(ref)

    s = srv.oa.completions.create(model=MODEL, prompt=[prompt, P1], max_tokens=0, echo=True, logprobs=0)
    assert [c.finish_reason for c in s.choices] == ["length", "length"] and s.usage.completion_tokens == 0
    assert s.choices[0].logprobs.token_logprobs == lp.token_logprobs[:len(prompt)]
    assert s.choices[0].token_ids == [] and s.choices[1].logprobs.tokens == [f"w{t}" for t in P1]
    chunks = list(srv.oa.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=1,
                                            stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].logprobs.token_logprobs == lp.token_logprobs[:len(prompt)]
    assert chunks[0].choices[0].finish_reason == "length" and chunks[-1].usage.prompt_tokens == len(prompt)


def test_prompt_logprobs_rank_each_prompt_token_as_vllm_does(srv):
    """vLLM's prompt_logprobs (refused as an unknown field before): per prompt token after the
    first, {token id: {logprob, rank, decoded_token}} of the token and the k most likely, on the
    choice's first document, completions and chat, whole or streamed."""
    srv.server.active.cm.lower_now()
    prompt = [5, 6, 7, 9, 10]
    with torch.inference_mode():
        want = torch.log_softmax(srv.lm(torch.tensor([prompt])).logits[0].float(), -1)
    r = srv.oa.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0,
                                  extra_body={"prompt_logprobs": 2})
    got = r.choices[0].model_extra["prompt_logprobs"]
    assert len(got) == len(prompt) and got[0] is None
    for j in range(1, len(prompt)):
        row, t = want[j - 1], prompt[j]
        top = torch.topk(row, 2).indices.tolist()
        assert set(got[j]) == {str(u) for u in [t, *top]}, got[j]
        mine = got[j][str(t)]
        assert abs(mine["logprob"] - float(row[t])) < 1e-4 and mine["decoded_token"] == f"w{t}"
        assert mine["rank"] == int((row > row[t]).sum()) + 1 and got[j][str(top[0])]["rank"] == 1
    assert r.choices[0].model_extra["token_ids"] == reference(srv, prompt, 2)
    chunks = list(srv.oa.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0, stream=True,
                                            extra_body={"prompt_logprobs": 2}))
    assert chunks[0].choices[0].model_extra["prompt_logprobs"] == got
    assert all("prompt_logprobs" not in c.choices[0].model_extra for c in chunks[1:] if c.choices)
    chat = srv.oa.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "w5 w6"}], max_tokens=1,
                                          temperature=0, extra_body={"prompt_logprobs": 0})
    ranks = chat.choices[0].model_extra["prompt_logprobs"]
    assert ranks[0] is None and all(len(d) == 1 for d in ranks[1:])


def test_penalties_and_min_tokens_match_transformers(srv):
    prompt = [5, 6, 7, 5, 6]
    rep = srv.oa.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0,
                                    extra_body={"repetition_penalty": 1.5})
    assert rep.choices[0].model_extra["token_ids"] == reference(srv, prompt, 10, repetition_penalty=1.5)
    plain = reference(srv, P1, 12)
    pres = srv.oa.completions.create(model=MODEL, prompt=P1, max_tokens=12, temperature=0, presence_penalty=2,
                                     frequency_penalty=1)
    ids = pres.choices[0].model_extra["token_ids"]
    assert ids != plain or len(set(plain)) == len(plain)
    # presence and frequency: by hand over the eager logits, token by token
    seq, gen = list(P1), []
    for _ in range(len(ids)):
        with torch.inference_mode():
            x = srv.lm(torch.tensor([seq])).logits[0, -1].float()
        counts = torch.bincount(torch.tensor(gen, dtype=torch.int64), minlength=x.numel()).float() if gen else 0
        x = x - 1 * counts - 2 * (counts > 0 if gen else 0)
        t = int(torch.argmax(x))
        gen.append(t)
        seq.append(t)
        if t == EOS:
            break
    assert ids == gen
    # logit_bias: -100 on the first greedy token moves the answer off it
    bias = srv.oa.completions.create(model=MODEL, prompt=P1, max_tokens=3, temperature=0,
                                     logit_bias={str(plain[0]): -100})
    assert bias.choices[0].model_extra["token_ids"][0] != plain[0]
    # min_tokens: the first greedy token as a stop token cannot be chosen before 4 tokens exist
    first = srv.oa.completions.create(model=MODEL, prompt=P1, max_tokens=10, temperature=0,
                                      extra_body={"stop_token_ids": [plain[0]]})
    assert first.choices[0].model_extra["token_ids"] == [] and first.choices[0].finish_reason == "stop"
    m = srv.oa.completions.create(model=MODEL, prompt=P1, max_tokens=10, temperature=0,
                                  extra_body={"min_tokens": 4, "stop_token_ids": [plain[0]], "ignore_eos": True})
    got = m.choices[0].model_extra["token_ids"]
    assert len(got) >= 4 and plain[0] not in got[:4] and got[0] != plain[0]


def test_models_retrieve_and_list(srv):
    assert {m.id for m in srv.oa.models.list()} >= {MODEL, "tiny-decoder"}
    m = srv.oa.models.retrieve(MODEL)
    assert m.id == MODEL and m.owned_by == "graphmode"
    with pytest.raises(srv.openai.NotFoundError) as e:
        srv.oa.models.retrieve("no-such-model")
    assert e.value.code == "model_not_found" and "no-such-model" in str(e.value)


REFUSALS = [   # (call, kwargs, the client's error class, param, words the message must show)
    ("completions", {"prompt": P1, "max_tokens": 46}, "BadRequestError", "max_tokens", "pages hold"),
    ("completions", {"prompt": P1, "temperature": -1}, "BadRequestError", "temperature", "number in"),
    ("completions", {"prompt": P1, "best_of": 3}, "BadRequestError", "best_of", "not supported"),
    ("completions", {"prompt": P1, "n": 100}, "BadRequestError", "n", "integer"),
    ("completions", {"prompt": P1, "max_tokens": 0}, "BadRequestError", "max_tokens", "echo"),
    ("completions", {"prompt": P1, "extra_body": {"min_tokens": 5}, "max_tokens": 2}, "BadRequestError",
     "min_tokens", "more than"),
    ("completions", {"prompt": P1, "model": "gpt-4"}, "NotFoundError", "model", "not served"),
    ("completions", {"prompt": P1, "presence_penalty": 3}, "BadRequestError", "presence_penalty", "[-2, 2]"),
    ("completions", {"prompt": P1, "logit_bias": {"100": 1}}, "BadRequestError", "logit_bias", "[0, 100)"),
    ("completions", {"prompt": P1, "extra_body": {"stop_token_ids": [100]}}, "BadRequestError", "stop", "[0, 100)"),
    ("completions", {"prompt": P1, "extra_body": {"response_format": {"type": "json_object"}}}, "BadRequestError",
     "response_format", "structured output"),
    ("chat", {"messages": []}, "BadRequestError", "messages", "non-empty"),
    ("chat", {"messages": [{"role": "robot", "content": "w5"}]}, "BadRequestError", "messages[0].role", "role"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "BadRequestError", "messages[0].content[0]", "text parts"),
    ("chat", {"messages": [{"role": "user"}]}, "BadRequestError", "messages[0].content", "string"),
    ("chat", {"messages": MESSAGES, "response_format": {"type": "json_object"}}, "BadRequestError",
     "response_format", "structured output"),
    ("chat", {"messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "f"}}]}, "BadRequestError",
     "tools", "not supported"),
    ("chat", {"messages": MESSAGES, "max_tokens": 2, "max_completion_tokens": 3}, "BadRequestError",
     "max_completion_tokens", "disagree"),
    ("chat", {"messages": MESSAGES, "top_logprobs": 2}, "BadRequestError", "top_logprobs", "logprobs: true"),
    ("chat", {"messages": [{"role": "user", "content": " ".join(["w5"] * 40)}]}, "BadRequestError",
     "messages", "at most 32"),
]


@pytest.mark.parametrize("call,kw,cls,param,words", REFUSALS)
def test_refusals_reach_the_client_as_openai_errors(srv, call, kw, cls, param, words):
    create = srv.oa.completions.create if call == "completions" else srv.oa.chat.completions.create
    kw = {"model": MODEL, **kw}
    for stream in (False, True):
        with pytest.raises(getattr(srv.openai, cls)) as e:
            out = create(**kw, stream=stream)
            list(out) if stream else None
        err = e.value
        assert err.param == param and words in err.message and "fix:" in err.message, (kw, err.message)
        assert err.type in ("invalid_request_error",) and err.code, err.body
        assert (err.code == "context_length_exceeded") == (words in ("pages hold", "at most 32")), err.body


def test_tokenize_and_detokenize_as_vllm_serves_them(srv):
    """A client counts its prompt against the context before sending it (vLLM's /tokenize), and
    /v1/models says that context (max_model_len)."""
    from graphmode.serve.completions import usable_tokens
    most = usable_tokens(srv.server.active.decoder.engine)
    r = srv.http.post("/tokenize", json={"prompt": "w5 w6 w7", "model": MODEL})
    assert r.status_code == 200 and r.json() == {"count": 3, "max_model_len": most, "tokens": [5, 6, 7]}, r.text
    r = srv.http.post("/tokenize", json={"messages": MESSAGES})
    assert r.json()["tokens"] == chat_prompt(srv, MESSAGES), r.text
    r = srv.http.post("/detokenize", json={"tokens": [5, 6, 7]})
    assert r.status_code == 200 and r.json() == {"prompt": "w5 w6 w7"}, r.text
    assert srv.oa.models.retrieve(MODEL).max_model_len == most
    for path, body, param in [("/tokenize", {"prompt": "w5", "messages": MESSAGES}, "prompt"),
                              ("/tokenize", {"prompt": 5}, "prompt"),
                              ("/tokenize", {"prompt": "w5", "model": "x"}, "model"),
                              ("/detokenize", {"tokens": [5, 10**6]}, "tokens"), ("/detokenize", {}, "tokens")]:
        r = srv.http.post(path, json=body)
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == param and "fix:" in err["message"], (path, body, r.text)


def test_unknown_openai_paths_answer_openai_errors(srv):
    r = srv.http.get("/v1/audio/speech")
    assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error", r.text
    r = srv.http.get("/v1/completions")
    assert r.status_code == 405 and "GET" in r.json()["error"]["message"], r.text


def test_embeddings_refused_on_a_decoder(srv):
    r = srv.http.post("/v1/embeddings", json={"input": "w5"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_an_encoder", r.text


# ---- the Python client ---------------------------------------------------------------------------------------

def test_python_client_against_the_real_servers(dec, enc):
    with Client(dec.url) as c:
        c.wait_ready(READY_S)
        assert c.models()[0] == MODEL and c.live() and c.ready()
        ref = greedy(dec, P1, 8)
        done = c.complete(P1, max_tokens=8, temperature=0)
        assert done.token_ids == ref and done.finish_reason == finish_of(ref) and done.recipe_version == version(dec)
        assert done.usage["completion_tokens"] == len(ref)
        chunks = list(c.stream("w5 w6 w7", max_tokens=8, temperature=0))
        assert chunks and [t for ch in chunks for t in ch.token_ids] == ref
        assert "".join(ch.text for ch in chunks) == done.text
        with pytest.raises(ServerError) as e:
            c.complete(P1, max_tokens=100)
        assert e.value.status == 400 and e.value.where == "max_tokens" and e.value.fix and e.value.exit_code == 1
        with pytest.raises(ServerError) as e:
            list(c.stream(P1, max_tokens=2, top_k="x"))
        assert e.value.status == 400 and e.value.where == "top_k"
    with Client(enc.url) as c:
        c.wait_ready(READY_S)
        x = np.random.default_rng(0).standard_normal((2, 16)).astype(np.float32)
        v1, v2 = c.infer({"input": x}), c.v2_infer({"input": x})
        assert set(v1) == set(v2) and all(v1[k].shape == (2, 4) for k in v1)
        for k in v1:
            np.testing.assert_allclose(v2[k], v1[k], rtol=1e-6, atol=1e-7)
        wide = c.v2_infer({"input": x.astype(np.float64)})         # cast to the model's FP32 by the client
        assert all(np.allclose(wide[k], v1[k], rtol=1e-6, atol=1e-7) for k in v1)
        with pytest.raises(ServerError) as e:
            c.v2_infer({"input": x}, model="nope")
        assert e.value.status == 404 and e.value.where == "name" and e.value.fix
        with pytest.raises(ServerError) as e:
            c.infer({"input": x[:, :8]})
        assert e.value.status == 422 and e.value.fix
        with pytest.raises(ServerError) as e:
            c.complete([1, 2])
        assert e.value.status == 404 and "decoder" in str(e.value)
    with Client("http://127.0.0.1:9", timeout=1) as c, pytest.raises(GraphmodeError, match="not ready"):
        c.wait_ready(0.3)


# ---- graphmode loadtest ----------------------------------------------------------------------------------------

def test_loadtest_command_reports_every_request(dec, tmp_path):
    import graphmode.cli.serve_cmd  # noqa: F401 - registers `loadtest` on the app
    from graphmode.cli import app
    idle(dec)
    out = tmp_path / "load.json"
    res = CliRunner().invoke(app, ["loadtest", "--url", dec.url, "--num-prompts", "6", "--input-len", "5",
                                   "--output-len", "7", "--range-ratio", "0", "--json", str(out)])
    assert res.exit_code == 0, res.output
    rep = json.loads(out.read_text())
    assert (rep["completed"], rep["failed"], rep["errors"]) == (6, 0, [])
    assert rep["input_tokens"] == 30 and rep["output_tokens"] == 6 * 7 == rep["server"]["generated_tokens"]
    # a fast step can put every token of an answer in one network read: TPOT may then round to 0
    assert rep["ttft_ms"]["p50"] > 0 and rep["tpot_ms"]["p99"] >= rep["tpot_ms"]["p50"] >= 0
    assert "Successful requests:" in res.stdout and "Median TTFT (ms):" in res.stdout
    assert "graphmode: requests " in res.stderr and res.stderr.rstrip().endswith("(6 of 6)"), res.stderr   # progress
    bad = CliRunner().invoke(app, ["loadtest", "--url", dec.url, "--input-len", "40"])
    assert bad.exit_code == 2 and "--input-len" in bad.output and "Traceback" not in bad.output


# ---- hot reload and shutdown (these change the module's server: keep them last) --------------------------------

def test_a_bucket_being_built_does_not_stall_requests_for_built_ones(dec):
    """/v1/infer on the decoder builds its whole-sequence buckets on first use (#30: one
    request of an unbuilt bucket made every other request wait for its build). Measured
    against the same requests' own solo latency, never an absolute time."""
    import statistics
    import time

    c = dec.client

    def infer(batch: int, seq: int) -> tuple[httpx.Response, float]:
        ids = [[5 + (i + j) % 90 for j in range(seq)] for i in range(batch)]
        t0 = time.perf_counter()
        r = c.post("/v1/infer", json={"inputs": {"input_ids": ids, "attention_mask": [[1] * seq] * batch}})
        return r, time.perf_counter() - t0

    first, _ = infer(1, 5)                           # builds bucket (1, 8): waits for it
    assert first.status_code == 200 and first.json()["bucket"] == {"batch": 1, "seq": 8}, first.text
    solo = statistics.median(infer(1, 5)[1] for _ in range(7))
    big: dict[str, Any] = {}
    t = threading.Thread(target=lambda: big.update(zip(("r", "s"), infer(4, 30))))
    t.start()
    during = []
    while t.is_alive():                              # a stream of small requests while (4, 32) is built
        r, s = infer(1, 5)
        assert r.status_code == 200, r.text
        during.append(s)
    t.join()
    assert big["r"].status_code == 200 and big["r"].json()["bucket"] == {"batch": 4, "seq": 32}, big["r"].text
    # before the fix the small requests queued behind the build: one or two answered, each
    # after most of the build; now they keep flowing, each far quicker than the build
    assert len(during) >= 3, (len(during), big["s"], solo)
    assert max(during) < big["s"] / 2, (max(during), big["s"])
    assert statistics.median(during) < 25 * solo, (statistics.median(during), solo)
    assert not dec.tracebacks, [x.getMessage() for x in dec.tracebacks[:3]]


def test_a_request_whose_bucket_outlasts_its_timeout_gets_503_and_the_build_goes_on(dec):
    cfg, cm = dec.server.config, dec.server.active.cm
    bucket = {"batch": 2, "seq": 32}
    assert not cm.is_built(bucket)
    body = {"inputs": {"input_ids": [[5] * 20] * 2, "attention_mask": [[1] * 20] * 2}}
    timeout, cfg.request_timeout_s = cfg.request_timeout_s, 0.01
    try:
        r = dec.client.post("/v1/infer", json=body)
    finally:
        cfg.request_timeout_s = timeout
    assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
    assert r.json()["where"] == "bucket" and "still being built" in r.json()["message"]
    eventually(lambda: cm.is_built(bucket), READY_S, "the build to finish in the background")
    r = dec.client.post("/v1/infer", json=body)
    assert r.status_code == 200 and r.json()["bucket"] == bucket, r.text


def test_a_decoders_warm_up_counts_its_prefill_and_decode_plans(dec):
    """A decoder's reload result and /readyz said "warmed": 0 of its whole-sequence bucket
    count; it builds its prefill/decode plans before ready, and counts them."""
    dep = dec.server.active
    plans = len(dep.decoder.engine.runner.envs())
    assert plans > len(dep.buckets) and dep.describe()["warmed"] == dep.describe()["buckets"] == plans
    assert dec.client.get("/readyz").json()["buckets"] == plans


@pytest.mark.slow
def test_hot_reload_while_a_stream_is_open(dec):
    """The open stream finishes on the deployment it started on (its engine frozen meanwhile),
    a request sent after the swap runs on the new one, and the retired deployment is freed.
    Slow: the new recipe is captured and compiled again (about 13 s on 2 idle cores)."""
    idle(dec)
    old = dec.server.active
    old_version, old_engine = old.version, old.decoder.engine
    ref = greedy(dec, [5, 6], 40)
    with Frozen(dec.url, {"prompt": [5, 6], "max_tokens": 40, **GREEDY}, old_engine) as f:
        r = dec.client.put(f"/v1/recipe?wait=1&timeout={READY_S}", json=tiny_decoders.recipe("tiny-decoder-reloaded"))
        assert r.status_code == 200 and r.json()["status"] == "swapped", r.text
        assert r.json()["warmed"] == r.json()["buckets"] > 0, r.text
        new_version = r.json()["version"]
        assert new_version != old_version and version(dec) == new_version
        doc = complete(dec, prompt=P1, max_tokens=6, **GREEDY)         # served while the old engine is frozen
        assert doc["system_fingerprint"] == new_version and doc["choices"][0]["token_ids"] == greedy(dec, P1, 6)
        assert {m["id"] for m in dec.client.get("/v1/models").json()["data"]} == {MODEL, "tiny-decoder-reloaded"}
        f.release()
        rest = list(f.events)
    events = [f.first] + rest
    assert events[-1] == "[DONE]" and {e["system_fingerprint"] for e in events[:-1]} == {old_version}
    assert merged(events)[0] == {"text": dec.tok.decode(ref, skip_special_tokens=True), "token_ids": ref,
                                 "finish_reason": "length"}
    gone = weakref.ref(old)
    del old, old_engine, f
    eventually(lambda: gc.collect() >= 0 and gone() is None, EVENT_S, "the retired deployment to be released",
               every_s=0.2)


def test_shutdown_ends_an_open_stream_with_an_error_event(dec):
    """Past the shutdown grace (1 s here) a generation still running ends with a 503 error
    event and `[DONE]`, and the server stops, instead of the stream being cut off."""
    decoder = dec.server.active.decoder
    with Frozen(dec.url, {"prompt": [5, 6], "max_tokens": 40, **GREEDY}, decoder.engine) as f:
        stopper = threading.Thread(target=dec.running.stop, daemon=True)
        stopper.start()
        eventually(lambda: decoder._stopped, EVENT_S, "the shutdown grace to end the generations")
        f.release()
        rest = list(f.events)
    assert rest[-1] == "[DONE]" and "error" in rest[-2], rest[-3:]
    err = rest[-2]["error"]
    assert err["status"] == 503 and err["graphmode_error"] == "NotReady" and err["fix"], err
    assert err["type"] == "service_unavailable_error" and "shut down" in err["message"], err
    stopper.join(EVENT_S)
    assert not stopper.is_alive() and not dec.running.thread.is_alive()
    assert decoder.live == 0 and decoder.engine.cache.used_pages == 0


def test_a_spec_returning_the_causal_lm_alone_serves_its_greedy_tokens(tmp_path_factory):
    """Trial AD: `serve` kept such a spec's module as it is, and the check for a causal LM looked
    only inside bundles ('decoding needs a *ForCausalLM' for a GPT2LMHeadModel); generate took it."""
    server = ModelServer(f"{HERE / 'tiny_decoders.py'}:gpt2_alone", tiny_decoders.recipe(),
                         config=ServeConfig(cache_dir=serve_cache(tmp_path_factory)))
    with serving(server) as (_running, client, tracebacks):
        own = SimpleNamespace(client=client, lm=tiny_decoders.gpt2_alone(), refs={})
        got = complete(own, prompt=P1, max_tokens=6, **GREEDY)["choices"][0]["token_ids"]
        assert got == greedy(own, P1, 6) and not tracebacks
