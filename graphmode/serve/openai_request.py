"""The body of an OpenAI `POST /v1/completions` request, checked field by field.

Accepted: `prompt` (a string, a list of strings, a list of token ids, or a list of token-id
lists; strings only when the model has a tokenizer), `max_tokens` (default 16),
`temperature` (default 1; 0 = greedy), `top_p`, `top_k` (vLLM's extension; -1 or 0 = off),
`seed`, `stop` (strings with a tokenizer, or token-id lists `[[id, ...], ...]`),
`stop_token_ids` and `ignore_eos` (vLLM's extensions), `stream`, `stream_options.include_usage`,
`model` and `user`. OpenAI fields graphmode does not implement (`n` > 1, `best_of` > 1,
`echo`, `logprobs`, `suffix`, penalties, `logit_bias`) are refused unless they hold their
neutral value, and unknown fields are refused: a request never silently means something
else. Every refusal is a BadRequest (400) naming the field, the value and the fix.

A temperature below `GREEDY_BELOW` is greedy (as in vLLM): dividing logits by it would
overflow to inf, and the sampling step it shares with other requests would fail for all.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from graphmode.decode.sampling import SamplingParams
from graphmode.errors import GraphmodeError
from graphmode.serve.codec import clip
from graphmode.serve.errors import BadRequest
from graphmode.serve.jsonbody import load_json

DEFAULT_MAX_TOKENS = 16            # OpenAI's default
MAX_PROMPTS = 64                   # prompts in one request
MAX_STOPS = 16
MAX_STOP_LEN = 256                 # characters of a stop string, tokens of a stop sequence
MAX_INT = 2**63
GREEDY_BELOW = 1e-5
NEUTRAL = {"n": (1,), "best_of": (1,), "echo": (False,), "logprobs": (), "suffix": (), "presence_penalty": (0,),
           "frequency_penalty": (0,), "logit_bias": ({},)}
REAL = ("presence_penalty", "frequency_penalty")      # numbers: 0 and 0.0 are both neutral
FIELDS = {"prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos",
          "stream", "stream_options", "model", "user", *NEUTRAL}
NO_TOKENIZER = "this model has no tokenizer; send token ids"
USAGE = 'send {"prompt": [token ids] or "text", "max_tokens": 16, ...}'
SPLIT = f"send at most {MAX_PROMPTS} prompts per request (split the rest into more requests)"
STOP_FORMS = 'send "stop": "text" or ["text", ...] (with a tokenizer), or [[id, ...], ...]'


@dataclass
class CompletionRequest:
    prompts: list[list[int]]
    params: SamplingParams
    stream: bool
    include_usage: bool
    stop_text: tuple[str, ...]             # stop strings (matched on the decoded text)
    model: str | None


def _bad(where: str, message: str, value: Any = None, *, fix: str) -> BadRequest:
    return BadRequest(message, reason="bad_parameter", where=where, value=value, fix=fix)


def _int(doc: dict, key: str, default: int | None, lo: int, hi: int = MAX_INT) -> int | None:
    v = doc.get(key)
    if v is None:
        return default
    if type(v) is not int or not lo <= v < hi:
        raise _bad(key, f"{key} must be an integer in [{lo}, {hi})", v,
                   fix=f"send a whole number from {lo} to {hi - 1} (or leave {key} out)")
    return v


def _num(doc: dict, key: str, default: float, lo: float, hi: float | None = None, *, open_lo: bool = False) -> float:
    v = doc.get(key)
    if v is None:
        return default
    ok = type(v) in (int, float) and math.isfinite(v) and (v > lo if open_lo else v >= lo) and (hi is None or v <= hi)
    if not ok:
        rng = f"{'(' if open_lo else '['}{lo:g}, {f'{hi:g}]' if hi is not None else 'inf)'}"
        raise _bad(key, f"{key} must be a number in {rng}", v, fix=f"send a finite number in {rng} (or leave "
                                                                  f"{key} out for {default:g})")
    return float(v)


def _bool(doc: dict, key: str) -> bool:
    v = doc.get(key, False)
    if v is None:
        return False
    if type(v) is not bool:
        raise _bad(key, f"{key} must be true or false", v, fix=f"send {key}: true or false (JSON booleans)")
    return v


def _id_list(v: Any, where: str) -> list[int]:
    if not isinstance(v, list) or not v or not all(type(t) is int for t in v):
        raise _bad(where, "must be a non-empty list of integer token ids", v, fix="send [id, id, ...]")
    return v


def _prompts(v: Any, tokenizer: Any) -> list[list[int]]:
    if isinstance(v, str) or (isinstance(v, list) and v and all(isinstance(p, str) for p in v)):
        texts = [v] if isinstance(v, str) else v
        if tokenizer is None:
            raise _bad("prompt", NO_TOKENIZER, v, fix='send "prompt": [id, id, ...] (or a list of such lists)')
        if len(texts) > MAX_PROMPTS:
            raise _bad("prompt", f"at most {MAX_PROMPTS} prompts per request", len(texts), fix=SPLIT)
        return [list(tokenizer.encode(t)) for t in texts]
    if isinstance(v, list) and v and all(type(t) is int for t in v):
        return [v]
    if isinstance(v, list) and v and all(isinstance(p, list) for p in v):
        if len(v) > MAX_PROMPTS:
            raise _bad("prompt", f"at most {MAX_PROMPTS} prompts per request", len(v), fix=SPLIT)
        return [_id_list(p, f"prompt[{i}]") for i, p in enumerate(v)]
    raise _bad("prompt", "prompt must be a string, a list of strings, a list of token ids or a list of token-id "
                         "lists", v if v is not None else "nothing", fix=USAGE)


def _stops(doc: dict, tokenizer: Any) -> tuple[tuple[str, ...], list[tuple[int, ...]]]:
    v = doc.get("stop")
    texts: list[str] = []
    seqs: list[tuple[int, ...]] = []
    if isinstance(v, str):
        v = [v]
    if v is None or v == []:
        pass
    elif isinstance(v, list) and all(isinstance(s, str) for s in v):
        if tokenizer is None:
            raise _bad("stop", f"stop strings need a tokenizer: {NO_TOKENIZER}", v,
                       fix='send stop as token-id sequences: "stop": [[id, ...], ...]')
        if not all(0 < len(s) <= MAX_STOP_LEN for s in v):
            raise _bad("stop", f"stop strings must have 1 to {MAX_STOP_LEN} characters", v,
                       fix="drop empty stop strings and shorten long ones")
        texts = list(v)
    elif isinstance(v, list) and all(isinstance(s, list) for s in v):
        seqs = [tuple(_id_list(s, f"stop[{i}]")) for i, s in enumerate(v)]
        if not all(len(s) <= MAX_STOP_LEN for s in seqs):
            raise _bad("stop", f"a stop sequence has at most {MAX_STOP_LEN} tokens",
                       max(len(s) for s in seqs), fix="shorten the stop sequences")
    elif isinstance(v, list) and all(type(s) is int for s in v):
        raise _bad("stop", "a flat list of token ids is ambiguous", v,
                   fix='write one sequence as [[id, id]], single tokens as "stop_token_ids": [id, id]')
    else:
        raise _bad("stop", "stop must be a string, a list of strings or a list of token-id lists", v,
                   fix=STOP_FORMS)
    ids = doc.get("stop_token_ids")
    if ids is not None:
        seqs += [(t,) for t in _id_list(ids, "stop_token_ids")]
    if len(texts) + len(seqs) > MAX_STOPS:
        raise _bad("stop", f"at most {MAX_STOPS} stop strings and sequences", len(texts) + len(seqs),
                   fix=f"send at most {MAX_STOPS} in stop and stop_token_ids together")
    return tuple(texts), seqs


def _unsupported(doc: dict) -> None:
    for key, neutral in NEUTRAL.items():
        v = doc.get(key)
        real = key in REAL and type(v) in (int, float)
        if v is not None and not any((real or type(v) is type(n)) and v == n for n in neutral):
            raise _bad(key, f"{key} is not supported by graphmode", v,
                       fix=f"leave {key} out{f' (or send {neutral[0]!r})' if neutral else ''}")


def parse_completion(body: bytes, *, tokenizer: Any, eos: Any) -> CompletionRequest:
    """The request in `body` (JSON bytes) for a model with `tokenizer` (None: token ids only)
    whose end-of-sequence token(s) are `eos`. Tokenizes text: call it off the event loop."""
    doc = load_json(body, USAGE)
    if not isinstance(doc, dict):
        raise BadRequest("the body must be a JSON object", reason="malformed_body", where="body", fix=USAGE)
    unknown = sorted(set(doc) - FIELDS)
    if unknown:
        raise _bad("body", f"unknown field(s) {[clip(k, 40) for k in unknown[:5]]}",
                   fix=f"the fields are {', '.join(sorted(FIELDS))}")
    _unsupported(doc)
    model = doc.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad("model", "model must be a string", model, fix="send the name GET /v1/models lists (or leave "
                                                                 "model out)")
    if doc.get("user") is not None and not isinstance(doc["user"], str):
        raise _bad("user", "user must be a string", doc["user"], fix="send a string (or leave user out)")
    if "prompt" not in doc:
        raise _bad("prompt", "prompt is required", fix=USAGE)
    prompts = _prompts(doc["prompt"], tokenizer)
    stop_text, stop_ids = _stops(doc, tokenizer)
    stream = _bool(doc, "stream")
    opts = doc.get("stream_options")
    include_usage = False
    if opts is not None:
        if not stream:
            raise _bad("stream_options", "stream_options needs stream: true", opts,
                       fix="send stream: true, or leave stream_options out")
        if not isinstance(opts, dict) or set(opts) - {"include_usage"}:
            raise _bad("stream_options", "stream_options takes only include_usage", opts,
                       fix='send "stream_options": {"include_usage": true}')
        include_usage = _bool(opts, "include_usage")
    temperature = _num(doc, "temperature", 1.0, 0.0)
    top_p = _num(doc, "top_p", 1.0, 0.0, 1.0, open_lo=True)
    top_k = _int(doc, "top_k", None, -1, 2**31)
    sample = temperature >= GREEDY_BELOW
    try:
        params = SamplingParams(
            max_new_tokens=_int(doc, "max_tokens", DEFAULT_MAX_TOKENS, 1, 2**31), do_sample=sample,
            temperature=temperature if sample else 1.0, top_k=top_k if top_k and top_k > 0 else None,
            top_p=top_p if top_p < 1 else None, eos_token_id=None if _bool(doc, "ignore_eos") else eos,
            seed=_int(doc, "seed", None, -MAX_INT), stop=tuple(stop_ids))
    except GraphmodeError as e:          # the engine's own checks (kept in step with ours)
        raise _bad(e.where or "body", e.message, e.value, fix=e.fix or USAGE) from None
    return CompletionRequest(prompts, params, stream, include_usage, stop_text, model)
