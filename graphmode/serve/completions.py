"""OpenAI-compatible `POST /v1/completions`, `POST /v1/chat/completions`, `GET /v1/models` and
`GET /v1/models/{id}` over a decoder deployment.

A request's prompts (a chat's messages rendered by the chat template, chat.py), each `n`
times, become sequences of the deployment's DecodeLoop (generation.py); the answer is the
whole completion, or with `"stream": true` server-sent events in OpenAI's format: one
`data: {...}` event per token of a choice (a chat stream opens with each choice's role), then
`data: [DONE]`. Each choice carries `text` (or a chat `message` / `delta`; decoded when the
model has a tokenizer, else "") and `token_ids` (vLLM's extension), `logprobs` when asked for,
`finish_reason` "stop" (end-of-sequence token or a stop sequence) or "length", and `usage`
counts prompt and generated tokens. Errors are OpenAI's `{"error": {"message", "type",
"param", "code", ...}}` (errors.openai_error).

A stop sequence is not part of the answer: while streaming, a tail of tokens (or text) that
may still turn out to start one is held back until it cannot (decode/output.py ChoiceOutput). A client that goes away, or
a request past `--request-timeout-s` (end to end when not streamed, until the first token
when streamed), cancels its sequences: their KV pages come back at the next step.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import time
import uuid
from collections import deque
from typing import Any, AsyncIterator

from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
import torch

from graphmode.decode.output import ChoiceOutput
from graphmode.decode.sampling import prompt_logprobs, ranked_prompt_logprobs
from graphmode.errors import ContractViolation, GraphmodeError
from graphmode.serve.app import error_response, openai_failure, read_body
from graphmode.serve.codec import body_kind, clip, dumps
from graphmode.serve import chat
from graphmode.serve.errors import BadRequest, RequestTimeout, openai_error
from graphmode.serve.generation import Generation
from graphmode.serve.openai_request import CompletionRequest, as_sent, parse_chat, parse_completion
from graphmode.serve.token_text import TokenText

Update = tuple[int, list[int], list[Any], str, "str | None"]   # index, tokens, their logprobs, text, finish


class Completion:
    """One request's sequences, their outputs and the OpenAI documents written from them
    (`text_completion`, or `chat.completion` / `chat.completion.chunk` for a chat)."""

    def __init__(self, req: CompletionRequest, gens: list[Generation], queue: asyncio.Queue, decoder: Any,
                 model: str, version: str, tokenizer: Any, prompt_logprobs: list[list[Any]] | None = None,
                 ranked: list[list[Any]] | None = None):
        self.req, self.gens, self.queue, self.decoder = req, gens, queue, decoder
        self.prompt_logprobs = prompt_logprobs       # per choice, with echo and logprobs: its prompt's
        self.ranked = ranked                         # per choice, vLLM's prompt_logprobs: ranked_prompt_logprobs
        self.model, self.version, self.tokenizer = model, version, tokenizer
        self.id = f"{'chatcmpl' if req.chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.prompts = [p for p, _ in req.sequences]
        self.outputs = [ChoiceOutput(i, tokenizer, req.stop_text, req.params.stop, req.params.min_tokens,
                                     keep_stop=req.keep_stop, skip_special=req.skip_special) for i in range(len(gens))]
        self.logprobs: list[list[Any]] = [[] for _ in gens]     # per token of outputs[i].tokens
        self.token_text = TokenText(tokenizer)
        self.shown: list[list[int]] = [[] for _ in gens]        # completion tokens given logprobs so far
        self.echoed = [0] * len(gens)                            # characters of the echoed prompt
        self.opened = [False] * len(gens)                       # a choice's first chunk was written

    @property
    def done(self) -> bool:
        return all(o.finish_reason is not None for o in self.outputs)

    async def updates(self) -> AsyncIterator[Update]:
        """One update per token a choice shows (tokens held back for a possible stop come out
        together once they cannot be one), the finish riding on the last; raises the error of
        a sequence that failed."""
        pending: deque = deque()
        while not self.done:
            if not pending:
                pending.append(await self.queue.get())
                while not self.queue.empty():
                    pending.append(self.queue.get_nowait())
            kind, i, value = pending.popleft()
            out = self.outputs[i]
            if out.finish_reason is not None:
                continue                            # late tokens of a sequence a stop string ended
            if kind == "error":
                raise value
            reason = value if kind == "done" else None
            if kind == "token":
                out.tokens.append(value[0])
                self.logprobs[i].append(value[1])
                reason = value[2]                   # its last token: the finish in the same update
            start = out.sent_tokens
            toks, text = out.release(reason)
            if out.finish_reason is not None and reason is None:
                self.decoder.cancel(self.gens[i], "stop")   # a stop string ended it
            if toks or text or out.finish_reason is not None:
                yield i, toks, self.logprobs[i][start:start + len(toks)], text, out.finish_reason

    def cancel(self) -> None:
        for g in self.gens:
            self.decoder.cancel(g)

    def usage(self) -> dict[str, int]:
        prompt = sum(len(p) for p in self.req.prompts)
        completion = sum(len(o.tokens) for o in self.outputs)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def _doc(self, choices: list[dict[str, Any]], chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.req.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "system_fingerprint": self.version, "choices": choices}

    def _logprobs(self, i: int, tokens: list[int], lps: list[Any], echoed: list[int]) -> dict[str, Any] | None:
        """OpenAI's logprobs of the prompt tokens `echoed` and then `tokens`: completions'
        {tokens, token_logprobs, top_logprobs, text_offset}, or chat's {content: [{token,
        logprob, bytes, top_logprobs}]}."""
        if self.req.params.logprobs is None:
            return None
        tt = self.token_text
        names = [tt.name(t) for t in echoed + tokens]
        if self.req.chat:
            def entry(t: int, name: str, lp: float) -> dict[str, Any]:
                raw = tt.bytes(t)
                return {"token": name, "logprob": lp, "bytes": None if raw is None else list(raw)}
            return {"content": [{**entry(t, name, lp), "top_logprobs": [
                entry(u, n, v) for (u, v), n in zip(top, tt.names([u for u, _ in top]))]}
                for t, name, (lp, top) in zip(echoed + tokens, names, lps)]}
        offsets = tt.offsets(echoed, 0, 0)
        start = len(self.shown[i])
        self.shown[i] += tokens
        offsets += tt.offsets(self.shown[i], start, self.echoed[i])
        return {"tokens": names, "token_logprobs": [lp for lp, _ in lps],
                "top_logprobs": [None if top is None else dict(zip(tt.names([u for u, _ in top]), (v for _, v in top)))
                                 for _, top in lps],
                "text_offset": offsets}

    def _choice(self, i: int, tokens: list[int], lps: list[Any], text: str, finish: str | None,
                chunk: bool) -> dict[str, Any]:
        first = not self.opened[i]
        self.opened[i] = True
        if first and self.req.echo_text:                 # chat echo: the last assistant message, then the answer
            text = self.req.echo_text + text
        if self.req.echo and first and self.tokenizer is not None:
            prompt = self.tokenizer.decode(self.prompts[i], skip_special_tokens=self.req.skip_special,
                                           clean_up_tokenization_spaces=False)
            self.echoed[i] = len(prompt)
            text = prompt + text
        echoed, shown_lps = [], lps
        if first and self.prompt_logprobs is not None:
            echoed, shown_lps = self.prompts[i], self.prompt_logprobs[i] + lps
        body: dict[str, Any] = {"index": i}
        if not self.req.chat:
            body["text"] = text
        elif chunk:
            body["delta"] = {"content": text} if text or tokens else {}
        else:
            body["message"] = {"role": "assistant", "content": text}
        if first and self.ranked is not None:            # vLLM's: with the choice's first document
            body["prompt_logprobs"] = [None if d is None else {str(t): {
                "logprob": lp, "rank": rank, "decoded_token": self.token_text.name(t) if self.tokenizer else None}
                for t, (lp, rank) in d.items()} for d in self.ranked[i]]
        return {**body, "token_ids": tokens, "logprobs": self._logprobs(i, tokens, shown_lps, echoed),
                "finish_reason": finish}

    def _event(self, doc: dict[str, Any]) -> bytes:
        return b"data: " + dumps(doc) + b"\n\n"

    def opening(self) -> list[bytes]:
        """A chat stream's first chunks: each choice's assistant role (OpenAI's, vLLM's)."""
        if not self.req.chat:
            return []
        return [self._event(self._with_usage(self._doc([{"index": i, "delta": {"role": "assistant", "content": ""},
                                                          "logprobs": None, "finish_reason": None}], True)))
                for i in range(len(self.outputs))]

    def _with_usage(self, doc: dict[str, Any]) -> dict[str, Any]:
        if self.req.include_usage:
            doc["usage"] = None
        return doc

    def chunk(self, update: Update) -> bytes:
        return self._event(self._with_usage(self._doc([self._choice(*update, chunk=True)], True)))

    def usage_chunk(self) -> bytes:
        return self._event({**self._doc([], True), "usage": self.usage()})

    def whole(self, parts: dict[int, list[Update]]) -> dict[str, Any]:
        choices = []
        for o in self.outputs:
            got = parts.get(o.index, [])
            lps = [lp for u in got for lp in u[2]]
            choices.append(self._choice(o.index, o.tokens[:o.sent_tokens], lps, "".join(u[3] for u in got),
                                        o.finish_reason, chunk=False))
        return {**self._doc(choices, False), "usage": self.usage()}


def usable_tokens(engine: Any) -> int:
    """The tokens a sequence may reach: its pages, within the pool and the model's positions (a
    recipe may give pages for more tokens than either: chat's default answer fills the smallest)."""
    context = getattr(engine, "context", None) or (getattr(engine, "cfg", None) or {}).get("context")
    held = engine.layout.sequence_tokens              # a pool smaller than one sequence's pages: what it holds
    return min(held, int(context)) if context else held


def _in_request_terms(e: ContractViolation, index: int | None, prompt_field: str | None = None) -> None:
    """The engine's refusal in the request's field names: `prompt` (or `prompt[i]` of several)
    for a prompt longer than the contract or bad token ids, `max_tokens` for more tokens than
    a sequence's pages hold; kind `shape` for sizes outside the contract, `input` otherwise."""
    where = e.where or ""
    e.kind = "shape" if where.startswith(("dims.", "max_new_tokens")) else "input"
    if where in ("dims.seq", "prompt"):
        e.where = prompt_field or ("prompt" if index is None else f"prompt[{index}]")
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

    def model_doc(name: str) -> dict[str, Any]:
        from graphmode.serve.tokenize import max_model_len
        dep = server.active
        return {"id": name, "object": "model", "created": int(dep.created) if dep else 0, "owned_by": "graphmode",
                "root": dep.version if dep else None, "max_model_len": max_model_len(server)}

    async def models(request: Request) -> Response:
        data = [model_doc(name) for name in server.model_names()]
        return Response(dumps({"object": "list", "data": data}), media_type="application/json")

    async def model(request: Request) -> Response:
        name = request.path_params["model"]
        if name not in server.model_names():
            return error_response(_unknown_model(name), openai=True)
        return Response(dumps(model_doc(name)), media_type="application/json")

    def _unknown_model(name: str) -> BadRequest:
        return BadRequest(f"model {clip(name, 60)!r} is not served here", status=404, reason="model_not_found",
                          where="model", value=as_sent(clip(name, 60)),
                          fix=f"send model {server.model_names()[0]!r} (or leave it out); GET /v1/models lists them")

    def parse_text(body: bytes, decoder: Any, eos: Any) -> CompletionRequest:
        return parse_completion(body, tokenizer=server.tokenizer, eos=eos)

    def parse_chat_body(body: bytes, decoder: Any, eos: Any) -> CompletionRequest:
        tok = server.tokenizer
        return parse_chat(body, tokenizer=tok, eos=eos, render=functools.partial(chat.render, tok),
                          context=usable_tokens(decoder.engine))

    def endpoint(parse: Any) -> Any:
        async def handle(request: Request) -> Response:
            arrived = time.perf_counter()
            dep = None
            try:
                dep = server.current()
                decoder = dep.decoder
                if decoder is None:
                    raise BadRequest("this model is not served as a decoder", status=404, reason="not_a_decoder",
                                     where="recipe.memory.kv_cache",
                                     fix="serve a causal LM with a recipe that declares memory.kv_cache; encoders "
                                         "answer POST /v1/embeddings, /v1/infer and /v2/models/{name}/infer")
                body_kind(request.headers.get("content-type"), json_only=True)
                body = await read_body(request, server.max_body_bytes, cfg.body_timeout_s)
                eos = decoder.engine.cfg.get("eos")
                req = await run_in_threadpool(parse, body, decoder, tuple(eos) if isinstance(eos, list) else eos)
                if req.model is not None and req.model not in server.model_names():
                    raise _unknown_model(req.model)
                return await _answer(request, dep, req, arrived)
            except Exception as e:  # noqa: BLE001 - answered (a bug logged), and the server keeps going
                if isinstance(e, ContractViolation):
                    dep.monitor.refused(e.kind or "input", "decode")
                elif not isinstance(e, (GraphmodeError, ClientDisconnect)) and dep is not None:
                    dep.monitor.request_status("error", "decode")
                return openai_failure(server, e, "completion")
        return handle

    async def _answer(request: Request, dep: Any, req: CompletionRequest, arrived: float) -> Response:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        seqs = req.sequences
        scored = await _prompt_scores(dep, req, lambda lg, p: prompt_logprobs(lg, p, req.params.logprobs)) \
            if req.echo and req.params.logprobs is not None else None
        ranked = await _prompt_scores(dep, req, lambda lg, p: ranked_prompt_logprobs(lg, p, req.prompt_logprobs)) \
            if req.prompt_logprobs is not None else None
        if req.prompt_only:
            return _prompt_only(dep, req, scored, ranked)
        try:
            gens = await run_in_threadpool(dep.decoder.submit, [p for p, _ in seqs], [q for _, q in seqs], arrived,
                                           queue, loop)
        except ContractViolation as e:
            where = "messages" if req.chat else None
            _in_request_terms(e, getattr(e, "prompt_index", 0) // req.n if len(req.prompts) > 1 else None, where)
            raise
        comp = Completion(req, gens, queue, dep.decoder, req.model or server.model_names()[0], dep.version,
                          server.tokenizer, scored, ranked)      # the name the client used, as vLLM echoes it
        watcher = asyncio.ensure_future(_disconnected(request))
        updates = comp.updates()
        parts: dict[int, list[Update]] = {}
        first: list = []

        async def collect() -> None:
            async for update in updates:
                if req.stream:
                    first.append(update)
                    return
                parts.setdefault(update[0], []).append(update)

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
            return Response(dumps(comp.whole(parts)), media_type="application/json")
        return StreamingResponse(_events(comp, first, updates, watcher, dep), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _events(comp: Completion, first: list, updates: AsyncIterator, watcher: asyncio.Future,
                      dep: Any) -> AsyncIterator[bytes]:
        outcome = "cancelled"               # unless the stream ends (the client went away, or shutdown)
        try:
            for opening in comp.opening():
                yield opening
            for update in first:
                yield comp.chunk(update)
            try:
                async for update in _until(updates, watcher):
                    yield comp.chunk(update)
            except GraphmodeError as e:
                outcome = "error"
                yield b"data: " + dumps({"error": openai_error(e)}) + b"\n\n"
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

    async def _prompt_scores(dep: Any, req: CompletionRequest, score: Any) -> list[list[Any]]:
        """Per choice, `score(logits, prompt)` of its prompt: the whole-sequence graph's logits at
        every position (the paged decode graph has the head at the last one only), once per prompt."""
        asked = "echo with logprobs" if req.echo else "prompt_logprobs"
        if (getattr(dep.cm, "artifact", None) or {}).get("decoder") is not None:
            raise BadRequest(f"{asked} scores the prompt with the logits at every position, from the model's "
                             "whole-sequence graph, and a decoder's .gm holds only the paged decode graph (its head "
                             "at the last position)", status=501, reason="not_implemented",
                             where="echo" if req.echo else "prompt_logprobs",
                             fix=f"leave out {asked} (completions are served from this .gm), or serve the model "
                                 "itself (its source) for prompt scores")
        names = {i.name for i in dep.recipe.inputs}
        by_prompt: dict[tuple[int, ...], list[Any]] = {}
        for i, p in enumerate(req.prompts):
            if tuple(p) in by_prompt:
                continue
            x = torch.tensor([p], dtype=torch.int64)
            inputs = {"input_ids": x, "attention_mask": torch.ones_like(x)}
            try:
                result = await server.infer(dep, {k: v for k, v in inputs.items() if k in names})
            except ContractViolation as e:
                _in_request_terms(e, i if len(req.prompts) > 1 else None)
                raise
            outs = result["outputs"]
            logits = outs["logits"] if "logits" in outs else next(iter(outs.values())) if len(outs) == 1 else None
            if logits is None:
                raise BadRequest(f"the model's whole-sequence outputs {sorted(outs)} have no logits to score the "
                                 "prompt with", status=501, reason="not_implemented",
                                 where="echo" if req.echo else "prompt_logprobs",
                                 fix="leave out prompt_logprobs and echo-with-logprobs: they need logits")
            by_prompt[tuple(p)] = await run_in_threadpool(score, logits[0], p)
        return [by_prompt[tuple(p)] for p, _ in req.sequences]

    def _prompt_only(dep: Any, req: CompletionRequest, scored: list[list[Any]] | None,
                     ranked: list[list[Any]] | None) -> Response:
        """max_tokens 0 with echo: each choice is its prompt (scored), finished by length."""
        comp = Completion(req, [None] * len(req.sequences), asyncio.Queue(), dep.decoder,
                          req.model or server.model_names()[0], dep.version, server.tokenizer, scored, ranked)
        for o in comp.outputs:
            o.finish_reason = "length"
        _count(dep, "ok")
        if not req.stream:
            return Response(dumps(comp.whole({})), media_type="application/json")
        events = [comp.chunk((o.index, [], [], "", "length")) for o in comp.outputs]
        events += [comp.usage_chunk()] if req.include_usage else []
        return Response(b"".join(events) + b"data: [DONE]\n\n", media_type="text/event-stream",
                        headers={"Cache-Control": "no-cache"})

    def _count(dep: Any, outcome: str) -> None:
        if outcome == "ok":
            dep.monitor.record_operation(set())
        dep.monitor.request_status(outcome, "decode")

    return [Route("/v1/completions", endpoint(parse_text), methods=["POST"]),
            Route("/v1/chat/completions", endpoint(parse_chat_body), methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/v1/models/{model:path}", model, methods=["GET"])]


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
