"""OpenAI-compatible `POST /v1/embeddings` over an encoder deployment (e.g. the shipped MiniLM).

An encoder here is a model whose recipe takes `input_ids` (and optionally `attention_mask`,
`token_type_ids`) and which answers `last_hidden_state` [batch, seq, hidden] (or its only
3-D output). Each input (text through the model's tokenizer, with its special tokens, or
token ids as given) runs through the server's dynamic batcher like a `POST /v1/infer`
request; its embedding is sentence-transformers' pooling: the mean of the token states over
the attention mask, L2-normalised (capture/zoo.py `sentence_embeddings`). `encoding_format`
"base64" (what the `openai` client asks for by default) is the little-endian float32 bytes.
Errors are OpenAI's shape, as for the completions.
"""
from __future__ import annotations

import asyncio
import base64
from typing import Any

import torch
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from graphmode.capture.zoo import sentence_embeddings
from graphmode.decode.output import encode_text
from graphmode.errors import ContractViolation
from graphmode.serve.app import openai_failure, read_body
from graphmode.serve.codec import body_kind, clip, dumps
from graphmode.serve.errors import BadRequest
from graphmode.serve.openai_request import bad as _bad
from graphmode.serve.openai_request import load_object

MAX_INPUTS = 256
FIELDS = {"input", "model", "encoding_format", "dimensions", "user"}
USAGE = 'send {"input": "text" or ["text", ...] or [id, ...] or [[id, ...], ...], "model": ...}'


def hidden_output(dep: Any) -> str | None:
    """The name of the deployment's token-state output, or None (not an encoder)."""
    names = {i.name for i in dep.recipe.inputs}
    if "input_ids" not in names or dep.decoder is not None:
        return None
    if "last_hidden_state" in dep.output_names:
        return "last_hidden_state"
    rank3 = [n for n, axes in zip(dep.output_names, dep.output_axes) if len(axes) == 3]
    return rank3[0] if len(rank3) == 1 else None


def parse_inputs(body: bytes, tokenizer: Any) -> tuple[list[list[int]], dict[str, Any]]:
    """Token ids of each input, and the other fields (model, encoding_format, dimensions)."""
    doc = load_object(body, USAGE, FIELDS)
    v = doc.get("input")
    if isinstance(v, str) or (isinstance(v, list) and v and all(isinstance(t, str) for t in v)):
        texts = [v] if isinstance(v, str) else v
        if tokenizer is None:
            raise _bad("input", "this model has no tokenizer; send token ids", clip(str(v)),
                       fix='send "input": [id, ...] or [[id, ...], ...]')
        if not all(texts):
            raise _bad("input", "an input is empty", fix="send non-empty texts")
        ids = [encode_text(tokenizer, t, "input") for t in texts[:MAX_INPUTS + 1]]
    elif isinstance(v, list) and v and all(type(t) is int for t in v):
        ids = [v]
    elif isinstance(v, list) and v and all(isinstance(p, list) and p and all(type(t) is int for t in p) for p in v):
        ids = v
    else:
        raise _bad("input", "input must be a string, a list of strings, a list of token ids or a list of token-id "
                            "lists (none empty)", clip(str(v)) if v is not None else "nothing", fix=USAGE)
    if len(ids) > MAX_INPUTS:
        raise _bad("input", f"at most {MAX_INPUTS} inputs per request", len(v), fix="split them into more requests")
    fmt = doc.get("encoding_format", "float")
    if fmt not in ("float", "base64"):
        raise _bad("encoding_format", "encoding_format must be float or base64", fmt, fix='send "float" or "base64"')
    model, dims = doc.get("model"), doc.get("dimensions")
    if model is not None and not isinstance(model, str):
        raise _bad("model", "model must be a string", model, fix="send the name GET /v1/models lists")
    if dims is not None and type(dims) is not int:
        raise _bad("dimensions", "dimensions must be an integer", dims, fix="leave dimensions out")
    return ids, {"model": model, "encoding_format": fmt, "dimensions": dims}


def _encoded(vec: torch.Tensor, fmt: str) -> Any:
    if fmt == "base64":
        return base64.b64encode(vec.numpy().astype("<f4").tobytes()).decode()
    return vec.tolist()


def embedding_routes(server: Any) -> list[Route]:
    cfg = server.config

    async def embeddings(request: Request) -> Response:
        dep = None
        try:
            dep = server.current()
            out_name = hidden_output(dep)
            if out_name is None:
                raise BadRequest("this model is not served as an encoder", status=404, reason="not_an_encoder",
                                 where="model", fix="embeddings need a model taking input_ids that answers "
                                                    "last_hidden_state (e.g. minilm); decoders answer "
                                                    "/v1/completions and /v1/chat/completions")
            body_kind(request.headers.get("content-type"), json_only=True)
            body = await read_body(request, server.max_body_bytes, cfg.body_timeout_s)
            ids, opts = await run_in_threadpool(parse_inputs, body, server.tokenizer)
            if opts["model"] is not None and opts["model"] not in server.model_names():
                raise BadRequest(f"model {clip(opts['model'], 60)!r} is not served here", status=404,
                                 reason="model_not_found", where="model", value=clip(opts["model"], 60),
                                 fix=f"send model {server.model_names()[0]!r} (or leave it out)")
            names = {i.name for i in dep.recipe.inputs}

            async def one(i: int, toks: list[int]) -> torch.Tensor:
                x = torch.tensor([toks], dtype=torch.int64)
                mask = torch.ones_like(x)
                inputs = {"input_ids": x, "attention_mask": mask, "token_type_ids": torch.zeros_like(x)}
                try:
                    result = await server.infer(dep, {k: v for k, v in inputs.items() if k in names})
                except ContractViolation as e:
                    dim = (e.where or "").removeprefix("dims.")
                    e.where = "input" if len(ids) == 1 else f"input[{i}]"
                    if dim in dep.recipe.dims and x.shape[1] == e.value:       # its length, in the request's terms
                        lo, hi = dep.recipe.dim_range(dim)
                        e.message = f"the input has {len(toks)} tokens, this model takes {lo} to {hi}"
                        e.fix = (f"send at most {hi} tokens per input (split longer texts)" if len(toks) > hi
                                 else f"send at least {lo} tokens per input")
                        e.args = (e.render(),)
                    raise
                return sentence_embeddings(result["outputs"][out_name].float(), mask)[0]

            vecs = await asyncio.gather(*(one(i, t) for i, t in enumerate(ids)))
            hidden = int(vecs[0].numel())
            if opts["dimensions"] not in (None, hidden):
                raise _bad("dimensions", f"this model's embeddings have {hidden} dimensions", opts["dimensions"],
                           fix=f"leave dimensions out (or send {hidden})")
            n = sum(len(t) for t in ids)
            doc = {"object": "list", "model": server.model_names()[0],
                   "data": [{"object": "embedding", "index": i, "embedding": _encoded(v, opts["encoding_format"])}
                            for i, v in enumerate(vecs)],
                   "usage": {"prompt_tokens": n, "total_tokens": n}}
            return Response(dumps(doc), media_type="application/json")
        except Exception as e:  # noqa: BLE001 - answered (a bug logged), and the server keeps going
            return openai_failure(server, e, "embeddings")

    return [Route("/v1/embeddings", embeddings, methods=["POST"])]

