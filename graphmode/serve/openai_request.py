"""The body of an OpenAI `POST /v1/completions` or `POST /v1/chat/completions` request, checked
field by field.

Completions: `prompt` (a string, a list of strings, a list of token ids, or a list of token-id
lists; strings only when the model has a tokenizer), `echo`, `logprobs` (k: the chosen token's
log-probability and the k most likely; with `echo`, the prompt's tokens' too, the first one
null), `max_tokens: 0` with `echo` (the prompt scored, nothing generated: what evaluation
harnesses send), `suffix` (null only). Chat: `messages` (rendered by the
chat template, graphmode/serve/chat.py), `max_completion_tokens` (= `max_tokens`),
`logprobs` (true/false) with `top_logprobs`, `tools` / `tool_choice` (none only), and vLLM's
`add_generation_prompt`, `continue_final_message` (the last assistant message left open for the
answer to go on), `chat_template_kwargs` (extra template variables, e.g. `enable_thinking`) and
`echo` (the answer starts with the last message's content when it is the assistant's). Both: `max_tokens` (default 16, chat: what the sequence's
pages hold), `temperature` (default 1; 0 = greedy), `top_p`, `top_k` (vLLM's; -1 or 0 = off), `min_p`,
`seed`, `n` (choices per prompt; with a seed, choice 0 samples with it, choice j with a seed hashed
from (seed, j)), `best_of` (only
null or equal to `n`), `presence_penalty`, `frequency_penalty`, `repetition_penalty` (vLLM's),
`min_tokens` (vLLM's), `stop` (strings with a tokenizer, or token-id lists `[[id, ...], ...]`),
`stop_token_ids`, `ignore_eos`, `include_stop_str_in_output`, `skip_special_tokens` and `prompt_logprobs`
(vLLM's: per prompt token after the first, its logprob and rank and the k most likely), `stream`,
`stream_options.include_usage`,
`response_format` (`{"type": "text"}` only), `logit_bias`, `model` and `user`.
Anything else is refused, and so is a value graphmode does not implement: a request never
silently means something else. Every refusal is a BadRequest (400) naming the field, the
value and the fix.

A temperature below `GREEDY_BELOW` is greedy (as in vLLM): dividing logits by it would
overflow to inf, and the sampling step it shares with other requests would fail for all.
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, replace
from typing import Any

from graphmode.decode.output import encode_text
from graphmode.decode.sampling import MAX_LOGPROBS, SamplingParams
from graphmode.errors import GraphmodeError
from graphmode.serve.codec import clip
from graphmode.serve.errors import BadRequest
from graphmode.serve.jsonbody import load_json

DEFAULT_MAX_TOKENS = 16            # OpenAI's default
MAX_PROMPTS = 64                   # prompts in one request
MAX_STOPS = 16
MAX_STOP_LEN = 256                 # characters of a stop string, tokens of a stop sequence
MAX_INT = 2**63
MAX_N = 16                         # choices per prompt
MAX_LOGIT_BIAS = 300               # OpenAI's limit
GREEDY_BELOW = 1e-5
NEUTRAL = {"suffix": ()}
SHARED = {"max_tokens", "temperature", "top_p", "top_k", "min_p", "skip_special_tokens", "seed", "stop",
          "stop_token_ids", "ignore_eos", "stream",
          "stream_options", "model", "user", "n", "best_of", "presence_penalty", "frequency_penalty",
          "repetition_penalty", "min_tokens", "response_format", "logit_bias", "include_stop_str_in_output",
          "prompt_logprobs"}
FIELDS = {"prompt", "echo", "logprobs", "suffix", *SHARED}
CHAT_NEUTRAL = {"tools": ([],), "tool_choice": ("none",), "functions": ([],),
                "function_call": ("none",), "parallel_tool_calls": (True, False), "store": (False,)}
CHAT_FIELDS = {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "add_generation_prompt",
               "continue_final_message", "chat_template_kwargs", "echo", *CHAT_NEUTRAL, *SHARED}
TEMPLATE_OWN = {"messages", "add_generation_prompt", "continue_final_message", "tokenize", "chat_template",
                "tools", "documents", "return_dict", "tokenizer_kwargs"}     # apply_chat_template's own arguments
MAX_TEMPLATE_KWARGS = 32
ROLES = ("system", "developer", "user", "assistant")
MESSAGE_KEYS = {"role", "content", "name"}
NO_TOKENIZER = "this model has no tokenizer; send token ids"
USAGE = 'send {"prompt": [token ids] or "text", "max_tokens": 16, ...}'
CHAT_USAGE = 'send {"messages": [{"role": "user", "content": "..."}], "max_tokens": 16, ...}'
SPLIT = f"send at most {MAX_PROMPTS} prompts (times n) per request (split the rest into more requests)"
STOP_FORMS = 'send "stop": "text" or ["text", ...] (with a tokenizer), or [[id, ...], ...]'


@dataclass
class CompletionRequest:
    prompts: list[list[int]]               # one per prompt; each runs `n` times
    params: SamplingParams
    stream: bool
    include_usage: bool
    stop_text: tuple[str, ...]             # stop strings (matched on the decoded text)
    model: str | None
    n: int = 1
    echo: bool = False
    chat: bool = False
    prompt_only: bool = False              # max_tokens 0 with echo: the prompt (and its logprobs), no tokens
    keep_stop: bool = False                # include_stop_str_in_output: a matched stop sequence stays in the text
    skip_special: bool = True              # vLLM's skip_special_tokens: special tokens left out of the text
    echo_text: str = ""                    # chat echo: the last (assistant) message the answer goes on from
    prompt_logprobs: int | None = None     # vLLM's: each prompt token's logprob, rank and the k most likely

    @property
    def sequences(self) -> list[tuple[list[int], SamplingParams]]:
        """(prompt, params) of each choice, in OpenAI's order: choice i * n + j is prompt i's
        j-th sample; with a seed, choice 0 samples with it (the n = 1 answer) and the j-th with a
        seed hashed from (seed, j), so requests numbered by consecutive seeds share no samples."""
        out = []
        for p in self.prompts:
            for j in range(self.n):
                seed = self.params.seed
                out.append((p, self.params if not j or seed is None else replace(self.params,
                                                                                  seed=choice_seed(seed, j))))
        return out


def choice_seed(seed: int, j: int) -> int:
    """The seed of a request's j-th choice (j >= 1): 63 bits of a hash of both, the same on every
    host and Python (not `hash()`, which is salted per process)."""
    digest = hashlib.blake2b(f"{seed}:{j}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class _AsSent(str):
    """A value's JSON text, shown as it is (not quoted again as a Python string)."""

    def __repr__(self) -> str:
        return str(self)


def as_sent(value: Any) -> Any:
    """A request field's value as an error shows it: as the client sent it, JSON (`true`, `"1"`),
    not Python (`True`, `'1'`)."""
    if value is None or isinstance(value, _AsSent):
        return value
    return _AsSent(json.dumps(value, default=str, ensure_ascii=False))


def bad(where: str, message: str, value: Any = None, *, fix: str) -> BadRequest:
    """A refused field, its value shown as the client sent it (`as_sent`)."""
    value = as_sent(value)
    return BadRequest(message, reason="bad_parameter", where=where, value=value, fix=fix)


def _int(doc: dict, key: str, default: int | None, lo: int, hi: int = MAX_INT) -> int | None:
    v = doc.get(key)
    if v is None:
        return default
    if type(v) is not int or not lo <= v < hi:
        raise bad(key, f"{key} must be an integer in [{lo}, {hi})", v,
                   fix=f"send a whole number from {lo} to {hi - 1} (or leave {key} out)")
    return v


def _num(doc: dict, key: str, default: float, lo: float, hi: float | None = None, *, open_lo: bool = False) -> float:
    v = doc.get(key)
    if v is None:
        return default
    ok = type(v) in (int, float) and math.isfinite(v) and (v > lo if open_lo else v >= lo) and (hi is None or v <= hi)
    if not ok:
        rng = f"{'(' if open_lo else '['}{lo:g}, {f'{hi:g}]' if hi is not None else 'inf)'}"
        raise bad(key, f"{key} must be a number in {rng}", v, fix=f"send a finite number in {rng} (or leave "
                                                                  f"{key} out for {default:g})")
    return float(v)


def _bool(doc: dict, key: str) -> bool:
    v = doc.get(key, False)
    if v is None:
        return False
    if type(v) is not bool:
        raise bad(key, f"{key} must be true or false", v, fix=f"send {key}: true or false (JSON booleans)")
    return v


def _id_list(v: Any, where: str) -> list[int]:
    if not isinstance(v, list) or not v or not all(type(t) is int for t in v):
        raise bad(where, "must be a non-empty list of integer token ids", v, fix="send [id, id, ...]")
    return v


def _prompts(v: Any, tokenizer: Any) -> list[list[int]]:
    if isinstance(v, str) or (isinstance(v, list) and v and all(isinstance(p, str) for p in v)):
        texts = [v] if isinstance(v, str) else v
        if tokenizer is None:
            raise bad("prompt", NO_TOKENIZER, v, fix='send "prompt": [id, id, ...] (or a list of such lists)')
        if len(texts) > MAX_PROMPTS:
            raise bad("prompt", f"at most {MAX_PROMPTS} prompts per request", len(texts), fix=SPLIT)
        ids = [encode_text(tokenizer, t, "prompt") for t in texts]
        if not all(ids):                # as an empty id list is: one refusal for one mistake
            raise bad("prompt", "the prompt is empty: a completion continues at least one token", v,
                      fix="send a prompt whose text the tokenizer turns into one token or more")
        return ids
    if isinstance(v, list) and v and all(type(t) is int for t in v):
        return [v]
    if isinstance(v, list) and v and all(isinstance(p, list) for p in v):
        if len(v) > MAX_PROMPTS:
            raise bad("prompt", f"at most {MAX_PROMPTS} prompts per request", len(v), fix=SPLIT)
        return [_id_list(p, f"prompt[{i}]") for i, p in enumerate(v)]
    if v == []:
        raise bad("prompt", "the prompt is empty: a completion continues at least one token", v,
                  fix='send "prompt": [id, ...] with one token or more (a BOS token id alone starts from nothing)')
    raise bad("prompt", "prompt must be a string, a list of strings, a list of token ids or a list of token-id "
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
            raise bad("stop", f"stop strings need a tokenizer: {NO_TOKENIZER}", v,
                       fix='send stop as token-id sequences: "stop": [[id, ...], ...]')
        if not all(0 < len(s) <= MAX_STOP_LEN for s in v):
            raise bad("stop", f"stop strings must have 1 to {MAX_STOP_LEN} characters", v,
                       fix="drop empty stop strings and shorten long ones")
        texts = list(v)
    elif isinstance(v, list) and all(isinstance(s, list) for s in v):
        seqs = [tuple(_id_list(s, f"stop[{i}]")) for i, s in enumerate(v)]
        if not all(len(s) <= MAX_STOP_LEN for s in seqs):
            raise bad("stop", f"a stop sequence has at most {MAX_STOP_LEN} tokens",
                       max(len(s) for s in seqs), fix="shorten the stop sequences")
    elif isinstance(v, list) and all(type(s) is int for s in v):
        raise bad("stop", "a flat list of token ids is ambiguous", v,
                   fix='write one sequence as [[id, id]], single tokens as "stop_token_ids": [id, id]')
    else:
        raise bad("stop", "stop must be a string, a list of strings or a list of token-id lists", v,
                   fix=STOP_FORMS)
    ids = doc.get("stop_token_ids")
    if ids is not None:
        seqs += [(t,) for t in _id_list(ids, "stop_token_ids")]
    if len(texts) + len(seqs) > MAX_STOPS:
        raise bad("stop", f"at most {MAX_STOPS} stop strings and sequences", len(texts) + len(seqs),
                   fix=f"send at most {MAX_STOPS} in stop and stop_token_ids together")
    return tuple(texts), seqs


def _unsupported(doc: dict, neutral_values: dict[str, tuple]) -> None:
    for key, neutral in neutral_values.items():
        v = doc.get(key)
        if v is not None and not any(type(v) is type(n) and v == n for n in neutral):
            raise bad(key, f"{key} is not supported by graphmode", v,
                       fix=f"leave {key} out{f' (or send {neutral[0]!r})' if neutral else ''}")


def load_object(body: bytes, usage: str, fields: set[str]) -> dict:
    """The body as a JSON object with only `fields`, or a BadRequest naming what is wrong."""
    doc = load_json(body, usage)
    if not isinstance(doc, dict):
        raise BadRequest("the body must be a JSON object", reason="malformed_body", where="body", fix=usage)
    unknown = sorted(set(doc) - fields)
    if unknown:
        raise bad("body", f"unknown field(s) {[clip(k, 40) for k in unknown[:5]]}",
                   fix=f"the fields are {', '.join(sorted(fields))}")
    return doc


def _common(doc: dict, prompts: list[list[int]], tokenizer: Any, eos: Any, *, max_tokens: int,
            logprobs: int | None, echo: bool = False, chat: bool = False) -> CompletionRequest:
    """The fields completions and chat share, into the request for `prompts`."""
    model = doc.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("model", "model must be a string", model, fix="send the name GET /v1/models lists (or leave "
                                                                 "model out)")
    if doc.get("user") is not None and not isinstance(doc["user"], str):
        raise bad("user", "user must be a string", doc["user"], fix="send a string (or leave user out)")
    fmt = doc.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise bad("response_format", "structured output (json_object, json_schema) is not implemented by graphmode",
                   fmt, fix='leave response_format out (or send {"type": "text"}); ask for JSON in the prompt instead')
    n = _int(doc, "n", 1, 1, MAX_N + 1)
    best_of = _int(doc, "best_of", None, 1, MAX_N + 1)
    if best_of is not None and best_of != n:
        raise bad("best_of", f"best_of ({best_of}) other than n ({n}) is not supported (vLLM's V1 engine dropped it "
                              "too)", best_of, fix="leave best_of out and send n: the number of choices you want")
    if len(prompts) * n > MAX_PROMPTS:
        raise bad("n", f"{len(prompts)} prompt(s) x n {n} = {len(prompts) * n} sequences, more than {MAX_PROMPTS}",
                  n, fix=SPLIT)
    stop_text, stop_ids = _stops(doc, tokenizer)
    stream = _bool(doc, "stream")
    opts = doc.get("stream_options")
    include_usage = False
    if opts is not None:
        if not stream:
            raise bad("stream_options", "stream_options needs stream: true", opts,
                       fix="send stream: true, or leave stream_options out")
        if not isinstance(opts, dict) or set(opts) - {"include_usage"}:
            raise bad("stream_options", "stream_options takes only include_usage", opts,
                       fix='send "stream_options": {"include_usage": true}')
        include_usage = _bool(opts, "include_usage")
    temperature = _num(doc, "temperature", 1.0, 0.0)
    top_p = _num(doc, "top_p", 1.0, 0.0, 1.0, open_lo=True)
    top_k = _int(doc, "top_k", None, -1, 2**31)
    sample = temperature >= GREEDY_BELOW
    min_tokens = _int(doc, "min_tokens", 0, 0, 2**31)
    if min_tokens > max_tokens:
        raise bad("min_tokens", f"min_tokens ({min_tokens}) is more than max_tokens ({max_tokens})", min_tokens,
                   fix="send min_tokens <= max_tokens")
    lb = doc.get("logit_bias")
    if lb is not None and not (isinstance(lb, dict) and len(lb) <= MAX_LOGIT_BIAS
                               and all(k.isascii() and k.isdigit() and len(k) <= 10 and type(v) in (int, float)
                                       for k, v in lb.items())):
        raise bad("logit_bias", f"logit_bias must map at most {MAX_LOGIT_BIAS} token ids (strings) to numbers",
                  clip(str(lb)), fix='send {"50256": -100, ...} with biases in [-100, 100]')
    try:
        params = SamplingParams(
            max_new_tokens=max_tokens, do_sample=sample,
            temperature=temperature if sample else 1.0, top_k=top_k if top_k and top_k > 0 else None,
            top_p=top_p if top_p < 1 else None, min_p=_num(doc, "min_p", 0.0, 0.0, 1.0) or None,
            eos_token_id=None if _bool(doc, "ignore_eos") else eos,
            seed=_int(doc, "seed", None, -MAX_INT, MAX_INT), stop=tuple(stop_ids),
            presence_penalty=_num(doc, "presence_penalty", 0.0, -2.0, 2.0),
            frequency_penalty=_num(doc, "frequency_penalty", 0.0, -2.0, 2.0),
            repetition_penalty=_num(doc, "repetition_penalty", 1.0, 0.0, open_lo=True),
            min_tokens=min_tokens, logprobs=logprobs,
            logit_bias=tuple((int(k), float(v)) for k, v in (lb or {}).items()))
    except GraphmodeError as e:          # the engine's own checks (kept in step with ours)
        raise bad(e.where or "body", e.message, e.value, fix=e.fix or USAGE) from None
    return CompletionRequest(prompts, params, stream, include_usage, stop_text, model, n=n, echo=echo, chat=chat,
                             prompt_logprobs=_int(doc, "prompt_logprobs", None, 0, MAX_LOGPROBS + 1),
                             keep_stop=_bool(doc, "include_stop_str_in_output"),
                             skip_special=_bool(doc, "skip_special_tokens") if "skip_special_tokens" in doc else True)


def parse_completion(body: bytes, *, tokenizer: Any, eos: Any) -> CompletionRequest:
    """The request in `body` (JSON bytes) for a model with `tokenizer` (None: token ids only)
    whose end-of-sequence token(s) are `eos`. Tokenizes text: call it off the event loop."""
    doc = load_object(body, USAGE, FIELDS)
    _unsupported(doc, NEUTRAL)
    if "prompt" not in doc:
        raise bad("prompt", "prompt is required", fix=USAGE)
    prompts = _prompts(doc["prompt"], tokenizer)
    logprobs = _int(doc, "logprobs", None, 0, MAX_LOGPROBS + 1)
    echo = _bool(doc, "echo")
    max_tokens = doc.get("max_tokens")
    if max_tokens == 0 and type(max_tokens) is int:
        if not echo:
            raise bad("max_tokens", "max_tokens 0 asks for no tokens: only a prompt echoed back (scored with "
                                    "logprobs) has an answer", 0, fix="send max_tokens >= 1, or echo: true")
        req = _common({**doc, "max_tokens": 1}, prompts, tokenizer, eos, max_tokens=1, logprobs=logprobs, echo=True)
        return replace(req, prompt_only=True)
    return _common(doc, prompts, tokenizer, eos, max_tokens=_int(doc, "max_tokens", DEFAULT_MAX_TOKENS, 1, 2**31),
                   logprobs=logprobs, echo=echo)


def parse_messages(v: Any) -> list[dict[str, str]]:
    """`messages` as the chat template takes them: role, content (text; a list of text parts is
    joined with newlines, as vLLM does) and an optional name."""
    if not isinstance(v, list) or not v:
        raise bad("messages", "messages must be a non-empty list of {role, content} objects",
                   v if v is not None else "nothing", fix=CHAT_USAGE)
    out = []
    for i, m in enumerate(v):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(where, "a message must be an object {role, content}", m, fix=CHAT_USAGE)
        # an assistant's empty tool_calls / null function_call (clients echo its previous answer with them) is none
        extra = sorted(k for k in set(m) - MESSAGE_KEYS if not (k in ("tool_calls", "function_call") and not m[k]
                                                                 and m.get("role") == "assistant"))
        if extra:
            raise bad(f"{where}.{clip(extra[0], 40)}", f"message field(s) {[clip(k, 40) for k in extra[:5]]} are not "
                       "supported (no tools or function calls)", fix="send role, content and optionally name")
        role = m.get("role")
        if role not in ROLES:
            raise bad(f"{where}.role", f"role must be one of {', '.join(ROLES)}", role,
                       fix="tool messages need tools, which graphmode does not serve")
        content = m.get("content")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
                        and set(part) <= {"type", "text"}):
                    raise bad(f"{where}.content[{j}]", "only text parts {type: text, text} are supported", part,
                               fix="send text content (no images, audio or files)")
                texts.append(part["text"])
            content = "\n".join(texts)
        if not isinstance(content, str):
            raise bad(f"{where}.content", "content must be a string or a list of text parts", content,
                       fix='send "content": "text"')
        name = m.get("name")
        if name is not None and not isinstance(name, str):
            raise bad(f"{where}.name", "name must be a string", name, fix="send a string (or leave name out)")
        out.append({"role": role, "content": content, **({"name": name} if name is not None else {})})
    return out


def parse_chat(body: bytes, *, tokenizer: Any, eos: Any, render: Any, context: int) -> CompletionRequest:
    """A chat request: its messages rendered to token ids by `render(messages,
    add_generation_prompt)` (chat.py), else as `parse_completion`. Without `max_tokens` (or
    `max_completion_tokens`) the answer may fill the `context` tokens a sequence holds (vLLM's
    default)."""
    doc = load_object(body, CHAT_USAGE, CHAT_FIELDS)
    _unsupported(doc, CHAT_NEUTRAL)
    if tokenizer is None:
        raise BadRequest("chat completions need a tokenizer; this model has none", reason="no_tokenizer",
                         where="messages", fix="send token ids to POST /v1/completions")
    messages = parse_messages(doc.get("messages"))
    a, b = _int(doc, "max_tokens", None, 1, 2**31), _int(doc, "max_completion_tokens", None, 1, 2**31)
    if a is not None and b is not None and a != b:
        raise bad("max_completion_tokens", f"max_tokens ({a}) and max_completion_tokens ({b}) disagree", b,
                   fix="send one of them")
    top = _int(doc, "top_logprobs", None, 0, MAX_LOGPROBS + 1)
    want = _bool(doc, "logprobs")
    if top is not None and not want:
        raise bad("top_logprobs", "top_logprobs needs logprobs: true", top, fix="send logprobs: true too")
    add, cont, kwargs = template_options(doc)
    prompt = render(messages, add, cont, kwargs)
    if not prompt:
        raise bad("messages", "the chat template rendered no tokens", fix="send a message with content")
    given = a if a is not None else b
    req = _common(doc, [prompt], tokenizer, eos, max_tokens=given if given is not None else max(1, context - len(prompt)),
                  logprobs=(top or 0) if want else None, chat=True)
    if _bool(doc, "echo") and messages[-1]["role"] == "assistant":
        req.echo_text = messages[-1]["content"]          # vLLM's: the answer goes on from the last message
    return req


def template_options(doc: dict) -> tuple[bool, bool, dict[str, Any]]:
    """(add_generation_prompt, continue_final_message, chat_template_kwargs) of a chat or
    /tokenize request, checked as vLLM checks them."""
    add = doc.get("add_generation_prompt", True)
    if type(add) is not bool:
        raise bad("add_generation_prompt", "add_generation_prompt must be true or false", add,
                   fix="send true or false")
    cont = _bool(doc, "continue_final_message")
    if cont and add:
        raise bad("continue_final_message", "continue_final_message and add_generation_prompt cannot both be true",
                  True, fix="send add_generation_prompt: false with continue_final_message: true (the answer goes on "
                            "from the last message instead of opening a new one)")
    kwargs = doc.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict) or len(kwargs) > MAX_TEMPLATE_KWARGS or \
            not all(isinstance(k, str) and k.isidentifier() for k in kwargs):
        raise bad("chat_template_kwargs", f"chat_template_kwargs must map at most {MAX_TEMPLATE_KWARGS} names to "
                                          "values", clip(str(kwargs)), fix='send {"enable_thinking": false, ...}')
    own = sorted(TEMPLATE_OWN & set(kwargs))
    if own:
        raise bad("chat_template_kwargs", f"{own} are the request's own fields, not template variables", own,
                  fix="send them as top-level fields (add_generation_prompt, continue_final_message, ...)")
    return add, cont, kwargs
