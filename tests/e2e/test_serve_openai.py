"""End to end with the official `openai` Python client: `graphmode serve` over the tiny GPT-2
with a word tokenizer (tiny_decoders.py:gpt2_words) on loopback, no mocks. Chat completions
(plain and streamed, the default chat template), one SSE event per token, `n`, logprobs,
echo, penalties, min_tokens, `max_completion_tokens`, `models.retrieve`, and every refusal
reaching the client as OpenAI's error body: the client shows the message, the field is its
`param`. The decoder's greedy tokens are checked against transformers' `generate`."""
from __future__ import annotations

import json
import warnings
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch
import tiny_decoders
from test_serve import serve_cache
from test_serve_hardening import serving

from graphmode.capture.spec import resolve_model_spec
from graphmode.serve import ModelServer, ServeConfig
from graphmode.serve.chat import DEFAULT_CHAT_TEMPLATE, render

openai = pytest.importorskip("openai")       # the `test` extra pins it

HERE = Path(__file__).resolve().parent
MODEL = "gpt2-words"
P1 = [5, 6, 7]
EOS = tiny_decoders.EOS


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    bundle = resolve_model_spec(f"{HERE / 'tiny_decoders.py'}:gpt2_words")
    server = ModelServer(bundle, tiny_decoders.recipe(), config=ServeConfig(cache_dir=serve_cache(tmp_path_factory)))
    with serving(server) as (running, client, _):
        oa = openai.OpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        yield SimpleNamespace(server=server, url=running.url, http=client, oa=oa, lm=bundle.raw_module,
                              tok=bundle.tokenizer)


def greedy(srv, prompt: list[int], n: int, **kw) -> list[int]:
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
    ref = greedy(srv, prompt, 8)
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


def test_completions_one_event_per_token_n_logprobs_echo(srv):
    ref = greedy(srv, P1, 10)
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
    assert r.choices[0].text == one.choices[0].text                     # choice j samples with seed + j
    assert len({c.text for c in r.choices}) > 1

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


def test_penalties_and_min_tokens_match_transformers(srv):
    prompt = [5, 6, 7, 5, 6]
    rep = srv.oa.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0,
                                    extra_body={"repetition_penalty": 1.5})
    assert rep.choices[0].model_extra["token_ids"] == greedy(srv, prompt, 10, repetition_penalty=1.5)
    plain = greedy(srv, P1, 12)
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
    with pytest.raises(openai.NotFoundError) as e:
        srv.oa.models.retrieve("no-such-model")
    assert e.value.code == "model_not_found" and "no-such-model" in str(e.value)


REFUSALS = [   # (call, kwargs, the client's error class, param, words the message must show)
    ("completions", {"prompt": P1, "max_tokens": 46}, "UnprocessableEntityError", "max_tokens", "pages hold"),
    ("completions", {"prompt": P1, "temperature": -1}, "BadRequestError", "temperature", "number in"),
    ("completions", {"prompt": P1, "best_of": 3}, "BadRequestError", "best_of", "not supported"),
    ("completions", {"prompt": P1, "n": 100}, "BadRequestError", "n", "integer"),
    ("completions", {"prompt": P1, "echo": True, "logprobs": 1}, "BadRequestError", "logprobs", "echo"),
    ("completions", {"prompt": P1, "extra_body": {"min_tokens": 5}, "max_tokens": 2}, "BadRequestError",
     "min_tokens", "more than"),
    ("completions", {"prompt": P1, "model": "gpt-4"}, "NotFoundError", "model", "not served"),
    ("completions", {"prompt": P1, "presence_penalty": 3}, "BadRequestError", "presence_penalty", "[-2, 2]"),
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
    ("chat", {"messages": [{"role": "user", "content": " ".join(["w5"] * 40)}]}, "UnprocessableEntityError",
     "messages", "at most 32"),
]


@pytest.mark.parametrize("call,kw,cls,param,words", REFUSALS)
def test_refusals_reach_the_client_as_openai_errors(srv, call, kw, cls, param, words):
    create = srv.oa.completions.create if call == "completions" else srv.oa.chat.completions.create
    kw = {"model": MODEL, **kw}
    for stream in (False, True):
        with pytest.raises(getattr(openai, cls)) as e:
            out = create(**kw, stream=stream)
            list(out) if stream else None
        err = e.value
        assert err.param == param and words in err.message and "fix:" in err.message, (kw, err.message)
        assert err.type in ("invalid_request_error",) and err.code, err.body


def test_unknown_openai_paths_answer_openai_errors(srv):
    r = srv.http.get("/v1/audio/speech")
    assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error", r.text
    r = srv.http.get("/v1/completions")
    assert r.status_code == 405 and "GET" in r.json()["error"]["message"], r.text


def test_chat_template_from_the_tokenizer_or_the_default(srv):
    from transformers import PreTrainedTokenizerFast
    tok = PreTrainedTokenizerFast(tokenizer_object=srv.tok.backend_tokenizer, unk_token="<unk>", eos_token="</s>")
    default = render(tok, MESSAGES)
    assert tok.decode(default) == "<unk> w5 w6 <unk> w7 w8 w9 <unk>"        # "system: ...\nuser: ...\nassistant:"
    tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}w3{% endif %}"
    assert render(tok, MESSAGES) == [5, 6, 7, 8, 9, 3]
    assert render(tok, MESSAGES, add_generation_prompt=False) == [5, 6, 7, 8, 9]
