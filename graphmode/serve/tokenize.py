"""vLLM's `POST /tokenize` and `POST /detokenize` over the served model's tokenizer.

`/tokenize` takes `prompt` (text; `add_special_tokens`, default true) or a chat's `messages`
(rendered by the chat template as `/v1/chat/completions` renders them; `add_generation_prompt`,
default true) and answers `{"count", "max_model_len", "tokens"}`: a client counts a prompt
against the context before sending it. `/detokenize` takes `tokens` and answers `{"prompt"}`.
Errors are OpenAI-shaped, as vLLM's are; a model without a tokenizer answers 400 naming it.
"""
from __future__ import annotations

from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from graphmode.decode.output import encode_text
from graphmode.serve import chat
from graphmode.serve.app import openai_failure, read_body
from graphmode.serve.codec import dumps
from graphmode.serve.openai_request import _bool, _id_list, bad, load_object, parse_messages, template_options

TOKENIZE_USAGE = 'send {"prompt": "text"} or {"messages": [{"role": "user", "content": "..."}]}'
DETOKENIZE_USAGE = 'send {"tokens": [id, id, ...]}'


def max_model_len(server: Any) -> int | None:
    """The tokens a request may hold: a decoder's sequence (its pages, the pool, the model's
    positions), an encoder's largest `seq`; None when the model has no sequence dim."""
    dep = server.active
    if dep is None:                  # warming up: an encoder's is its recipe's; a decoder's needs its engine
        recipe = getattr(server, "recipe", None)
        if recipe is None or recipe.memory.kv_cache is not None or "seq" not in recipe.dims:
            return None
        return recipe.dim_range("seq")[1]
    if getattr(dep, "decoder", None) is not None:
        from graphmode.serve.completions import usable_tokens
        return usable_tokens(dep.decoder.engine)
    return dep.recipe.dim_range("seq")[1] if "seq" in dep.recipe.dims else None


def tokenize_routes(server: Any) -> list[Route]:
    def tokenizer_of(model: Any) -> Any:
        if model is not None and model not in server.model_names():
            raise bad("model", f"model {str(model)[:60]!r} is not served here", model,
                      fix=f"send model {server.model_names()[0]!r} (or leave it out)")
        tok = server.tokenizer
        if tok is None:
            raise bad("model", "this model has no tokenizer: it takes and answers token ids", server.model_names()[0],
                      fix="tokenize on the client, or serve the model with its tokenizer")
        return tok

    def tokenize_body(body: bytes) -> dict[str, Any]:
        doc = load_object(body, TOKENIZE_USAGE, {"model", "prompt", "messages", "add_special_tokens",
                                                 "add_generation_prompt", "continue_final_message",
                                                 "chat_template_kwargs"})
        tok = tokenizer_of(doc.get("model"))
        if ("prompt" in doc) == ("messages" in doc):
            raise bad("prompt", "send one of prompt or messages", sorted(k for k in ("prompt", "messages") if k in doc),
                      fix=TOKENIZE_USAGE)
        if "messages" in doc:
            ids = chat.render(tok, parse_messages(doc["messages"]), *template_options(doc))
        else:
            if not isinstance(doc["prompt"], str):
                raise bad("prompt", "prompt must be a string", type(doc["prompt"]).__name__, fix=TOKENIZE_USAGE)
            special = _bool(doc, "add_special_tokens") if "add_special_tokens" in doc else True
            ids = encode_text(tok, doc["prompt"], "prompt", add_special_tokens=special)
        return {"count": len(ids), "max_model_len": max_model_len(server), "tokens": list(ids)}

    def detokenize_body(body: bytes) -> dict[str, Any]:
        doc = load_object(body, DETOKENIZE_USAGE, {"model", "tokens"})
        tok = tokenizer_of(doc.get("model"))
        if "tokens" not in doc:
            raise bad("tokens", "tokens is required", fix=DETOKENIZE_USAGE)
        ids = _id_list(doc["tokens"], "tokens")
        vocab = len(tok)
        outside = [t for t in ids if not 0 <= t < vocab]
        if outside:
            raise bad("tokens", f"token ids must be in [0, {vocab})", outside[:5], fix="send ids the tokenizer knows")
        return {"prompt": tok.decode(ids)}

    def endpoint(make: Any, what: str) -> Any:
        async def handle(request: Request) -> Response:
            try:
                body = await read_body(request, server.max_body_bytes, server.config.body_timeout_s)
                return Response(dumps(await run_in_threadpool(make, body)), media_type="application/json")
            except Exception as e:  # noqa: BLE001 - answered in OpenAI's shape (a bug logged)
                return openai_failure(server, e, what)
        return handle

    return [Route("/tokenize", endpoint(tokenize_body, "tokenize"), methods=["POST"]),
            Route("/detokenize", endpoint(detokenize_body, "detokenize"), methods=["POST"])]

