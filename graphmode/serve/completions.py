"""OpenAI-compatible `POST /v1/completions` (and `GET /v1/models`) over a decoder deployment.

A request's prompts become sequences of the deployment's DecodeLoop (generation.py); the
answer is the whole completion, or with `"stream": true` server-sent events in OpenAI's
completions format (`data: {...}` per step, then `data: [DONE]`). Each choice carries
`text` (decoded when the model has a tokenizer, else "") and `token_ids` (vLLM's
extension), `finish_reason` is "stop" (end-of-sequence token or a stop sequence) or
"length", and `usage` counts prompt and generated tokens.

A stop sequence is not part of the answer: while streaming, a tail of tokens (or text) that
may still turn out to start one is held back until it cannot (decode/output.py ChoiceOutput). A client that goes away, or
a request past `--request-timeout-s` (end to end when not streamed, until the first token
when streamed), cancels its sequences: their KV pages come back at the next step.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from typing import Any, AsyncIterator

from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from graphmode.decode.output import ChoiceOutput
from graphmode.errors import ContractViolation, GraphmodeError
from graphmode.serve.app import error_response, read_body
from graphmode.serve.codec import body_kind, clip, dumps
from graphmode.serve.errors import BadRequest, RequestTimeout, ServeError, error_dict, http_status
from graphmode.serve.generation import Generation
from graphmode.serve.openai_request import CompletionRequest, parse_completion

log = logging.getLogger("graphmode.serve")
class Completion:
    """One request's sequences, their outputs and the OpenAI documents written from them."""

    def __init__(self, req: CompletionRequest, gens: list[Generation], queue: asyncio.Queue, decoder: Any,
                 model: str, version: str, tokenizer: Any):
        self.req, self.gens, self.queue, self.decoder = req, gens, queue, decoder
        self.model, self.version = model, version
        self.id = f"cmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.outputs = [ChoiceOutput(i, tokenizer, req.stop_text, req.params.stop) for i in range(len(gens))]

    @property
    def done(self) -> bool:
        return all(o.finish_reason is not None for o in self.outputs)

    async def updates(self) -> AsyncIterator[list[tuple[int, list[int], str, str | None]]]:
        """Per wake-up, (index, new tokens, new text, finish_reason) for each choice that moved;
        raises the error of a sequence that failed."""
        while not self.done:
            events = [await self.queue.get()]
            while not self.queue.empty():
                events.append(self.queue.get_nowait())
            moved: dict[int, str | None] = {}
            for kind, i, value in events:
                out = self.outputs[i]
                if out.finish_reason is not None:
                    continue                        # late tokens of a sequence a stop string ended
                if kind == "error":
                    raise value
                if kind == "token":
                    out.tokens.append(value)
                    moved.setdefault(i, None)
                else:
                    moved[i] = value
            batch = []
            for i, reason in sorted(moved.items()):
                out = self.outputs[i]
                toks, text = out.release(reason)
                if out.finish_reason is not None and reason is None:
                    self.decoder.cancel(self.gens[i], "stop")   # a stop string ended it
                if toks or text or out.finish_reason is not None:
                    batch.append((i, toks, text, out.finish_reason))
            if batch:
                yield batch

    def cancel(self) -> None:
        for g in self.gens:
            self.decoder.cancel(g)

    def usage(self) -> dict[str, int]:
        prompt = sum(len(p) for p in self.req.prompts)
        completion = sum(len(o.tokens) for o in self.outputs)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def _doc(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "system_fingerprint": self.version, "choices": choices}

    @staticmethod
    def _choice(i: int, tokens: list[int], text: str, finish: str | None) -> dict[str, Any]:
        return {"index": i, "text": text, "token_ids": tokens, "logprobs": None, "finish_reason": finish}

    def chunk(self, batch: list[tuple[int, list[int], str, str | None]]) -> bytes:
        doc = self._doc([self._choice(*c) for c in batch])
        if self.req.include_usage:
            doc["usage"] = None
        return b"data: " + dumps(doc) + b"\n\n"

    def usage_chunk(self) -> bytes:
        return b"data: " + dumps({**self._doc([]), "usage": self.usage()}) + b"\n\n"

    def whole(self, texts: dict[int, list[str]]) -> dict[str, Any]:
        choices = [self._choice(o.index, o.tokens[:o.sent_tokens], "".join(texts.get(o.index, [])), o.finish_reason)
                   for o in self.outputs]
        return {**self._doc(choices), "usage": self.usage()}


def _in_request_terms(e: ContractViolation, index: int | None) -> None:
    """The engine's refusal in the request's field names: `prompt` (or `prompt[i]` of several)
    for a prompt longer than the contract or bad token ids, `max_tokens` for more tokens than
    a sequence's pages hold; kind `shape` for sizes outside the contract, `input` otherwise."""
    where = e.where or ""
    e.kind = "shape" if where.startswith(("dims.", "max_new_tokens")) else "input"
    if where in ("dims.seq", "prompt"):
        e.where = "prompt" if index is None else f"prompt[{index}]"
        e.fix = e.fix or f"send token ids the model knows ({e.message})"
    elif where == "max_new_tokens":
        e.where = "max_tokens"


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone away (the body has been read: nothing else can come)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def completion_routes(server: Any) -> list[Route]:
    """The routes, over `server` (a ModelServer)."""
    cfg = server.config

    async def models(request: Request) -> Response:
        dep = server.active
        data = [{"id": name, "object": "model", "created": int(dep.created) if dep else 0, "owned_by": "graphmode",
                 "root": dep.version if dep else None} for name in server.model_names()]
        return Response(dumps({"object": "list", "data": data}), media_type="application/json")

    async def completions(request: Request) -> Response:
        arrived = time.perf_counter()
        dep = None
        try:
            dep = server.current()
            decoder = dep.decoder
            if decoder is None:
                raise BadRequest("this model is not served as a decoder", status=404, reason="not_a_decoder",
                                 where="recipe.memory.kv_cache",
                                 fix="serve a causal LM with a recipe that declares memory.kv_cache; encoders "
                                     "answer POST /v1/infer and /v2/models/{name}/infer")
            if body_kind(request.headers.get("content-type")) != "json":
                raise BadRequest("completions take a JSON body", status=415, reason="unsupported_media_type",
                                 where="Content-Type", fix="send application/json")
            body = await read_body(request, server.max_body_bytes, cfg.body_timeout_s)
            eos = decoder.engine.cfg.get("eos")
            req = await run_in_threadpool(parse_completion, body, tokenizer=server.tokenizer,
                                          eos=tuple(eos) if isinstance(eos, list) else eos)
            if req.model is not None and req.model not in server.model_names():
                raise BadRequest(f"model {clip(req.model, 60)!r} is not served here", status=404,
                                 reason="unknown_model", where="model", value=clip(req.model, 60),
                                 fix=f"send model {server.model_names()[0]!r} (or leave it out)")
            return await _answer(request, dep, req, arrived)
        except ClientDisconnect:
            return Response(status_code=400)
        except ServeError as e:
            if e.status != 422:
                server.metrics.bad_requests.labels(server.target_name, e.reason).inc()
            return error_response(e)
        except ContractViolation as e:
            dep.monitor.refused(e.kind or "input", "decode")
            return error_response(e)
        except GraphmodeError as e:
            return error_response(e)
        except Exception as e:  # noqa: BLE001 - answered, logged, and the server keeps going
            log.exception("completion failed")
            if dep is not None:
                dep.monitor.request_status("error", "decode")
            return error_response(e)

    async def _answer(request: Request, dep: Any, req: CompletionRequest, arrived: float) -> Response:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        try:
            gens = await run_in_threadpool(dep.decoder.submit, req.prompts, req.params, arrived, queue, loop)
        except ContractViolation as e:
            _in_request_terms(e, getattr(e, "prompt_index", 0) if len(req.prompts) > 1 else None)
            raise
        comp = Completion(req, gens, queue, dep.decoder, server.model_names()[0], dep.version, server.tokenizer)
        watcher = asyncio.ensure_future(_disconnected(request))
        updates = comp.updates()
        texts: dict[int, list[str]] = {}
        first: list = []

        async def collect() -> None:
            async for batch in updates:
                if req.stream:
                    first.append(batch)
                    return
                for i, _, text, _ in batch:
                    texts.setdefault(i, []).append(text)

        task = asyncio.ensure_future(collect())
        try:
            await asyncio.wait({task, watcher}, timeout=cfg.request_timeout_s, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:                  # the handler itself was cancelled (shutdown)
            for t in (task, watcher):
                t.cancel()
            comp.cancel()
            raise
        if not task.done():
            task.cancel()
            watcher.cancel()
            comp.cancel()
            if watcher.done():
                _count(dep, "cancelled")
                return Response(status_code=499)        # nobody is listening
            _count(dep, "timeout")
            what = "the first token" if req.stream else "the completion"
            raise RequestTimeout(f"{what} did not come within {cfg.request_timeout_s:g} s", where="request",
                                 fix="raise --request-timeout-s, ask for fewer tokens or lower the load")
        try:
            task.result()                      # a failed sequence raises here
        except BaseException:
            watcher.cancel()
            comp.cancel()
            _count(dep, "error")
            raise
        if not req.stream:
            watcher.cancel()
            _count(dep, "ok")
            return Response(dumps(comp.whole(texts)), media_type="application/json")
        return StreamingResponse(_events(comp, first, updates, watcher, dep), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _events(comp: Completion, first: list, updates: AsyncIterator, watcher: asyncio.Future,
                      dep: Any) -> AsyncIterator[bytes]:
        outcome = "cancelled"               # unless the stream ends (the client went away, or shutdown)
        try:
            for batch in first:
                yield comp.chunk(batch)
            try:
                async for batch in _until(updates, watcher):
                    yield comp.chunk(batch)
            except GraphmodeError as e:
                outcome = "error"
                yield b"data: " + dumps({"error": {**error_dict(e), "status": http_status(e)}}) + b"\n\n"
                yield b"data: [DONE]\n\n"
                return
            if comp.done:
                outcome = "ok"
                if comp.req.include_usage:
                    yield comp.usage_chunk()
                yield b"data: [DONE]\n\n"
        finally:
            watcher.cancel()
            if outcome != "ok":
                comp.cancel()
            _count(dep, outcome)
            with contextlib.suppress(Exception):
                await updates.aclose()

    def _count(dep: Any, outcome: str) -> None:
        if outcome == "ok":
            dep.monitor.record_operation(set())
        dep.monitor.request_status(outcome, "decode")

    return [Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"])]


async def _until(updates: AsyncIterator, watcher: asyncio.Future) -> AsyncIterator[Any]:
    """`updates` until they end or `watcher` (the client went away) finishes first."""
    while True:
        nxt = asyncio.ensure_future(updates.__anext__())
        try:
            await asyncio.wait({nxt, watcher}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            nxt.cancel()
            raise
        if not nxt.done():
            nxt.cancel()
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                await nxt
            return
        try:
            yield nxt.result()
        except StopAsyncIteration:
            return
