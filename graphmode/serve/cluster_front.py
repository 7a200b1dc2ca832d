"""The HTTP ingress in front of the replicas of `graphmode serve --replicas`: Ray's proxy
hands every request to a front replica (no CPU reserved, no model), which passes it to a
model replica through a Ray Serve handle (`GraphmodeReplica.forward`) and relays the ASGI
messages that replica's app sends back.

Why a hop of our own: a replica that dies with a request in flight makes Ray's proxy answer
a bare `500 Internal Server Error`, which a client cannot tell from a bug. Here the death is
seen as Ray's actor error, before or after the answer started:

  * before it started, an inference request (idempotent: `/v1/infer`, KServe's infer,
    completions, chat completions, embeddings, and any GET) is sent once more, and Ray's
    router picks a live replica; anything else, or a second death, is answered `503` with
    `Retry-After` and graphmode's (or, on the OpenAI paths, OpenAI's) error body;
  * after it started (a stream), the status cannot change: an SSE stream ends with an error
    event in OpenAI's shape (`data: {"error": {..., "code": "not_ready"}}`, then `[DONE]`),
    as the single server ends a generation that failed; any other answer cut short ends
    where it was (the client sees a body shorter than promised, or an unterminated chunked one).
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any

log = logging.getLogger("graphmode.serve.cluster")
FRONT = "GraphmodeFront"
IDEMPOTENT_POSTS = ("/v1/infer", "/v1/completions", "/v1/chat/completions", "/v1/embeddings")
SCOPE_KEYS = ("http_version", "method", "scheme", "path", "raw_path", "root_path", "query_string", "headers",
              "client", "server")


def retryable(method: str, path: str) -> bool:
    """Requests that change nothing, so a second try on another replica is safe."""
    if method in ("GET", "HEAD"):
        return True
    path = path.rstrip("/")
    return method == "POST" and (path in IDEMPOTENT_POSTS or path.startswith("/v2/models/") and path.endswith("/infer"))


def replica_died(e: BaseException) -> bool:
    """Ray's error for a replica actor that died (or cannot be reached) with the request."""
    from ray.exceptions import RayActorError, RayTaskError
    return isinstance(e, RayActorError) or isinstance(e, RayTaskError) and isinstance(
        getattr(e, "cause", None), RayActorError)


class GraphmodeFront:
    """One front replica: the handle to the model replicas and the body bound of a request."""

    def __init__(self, replicas: Any, max_body_bytes: int):
        self.replicas = replicas.options(stream=True)
        self.max_body_bytes = max_body_bytes

    def __serve_build_asgi_app__(self) -> Any:
        return FrontApp(self)

    async def asgi(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                await send({"type": message["type"] + ".complete"})
                if message["type"] == "lifespan.shutdown":
                    return
        if scope["type"] != "http":
            return
        from graphmode.serve.app import error_response, is_openai_path
        from graphmode.serve.errors import BadRequest, NotReady
        body = await _read(receive, self.max_body_bytes)
        if body is None:
            e = BadRequest(f"the request body is over {self.max_body_bytes} bytes", status=413,
                           reason="too_large", where="body", fix="send a smaller request")
            return await error_response(e, openai=is_openai_path(scope["path"]))(scope, receive, send)
        request = {k: scope[k] for k in SCOPE_KEYS if k in scope}
        tries = 2 if retryable(scope["method"], scope["path"]) else 1
        for attempt in range(tries):
            started: dict | None = None
            try:
                async for batch in self.replicas.forward.remote(request, body):
                    for message in batch:
                        if message["type"] == "http.response.start":
                            started = message
                        await send(message)
                return
            except Exception as e:  # noqa: BLE001 - a replica's death is answered below; anything else too
                if started is not None:
                    log.warning("%s %s: the replica stopped mid-answer (%s)", scope["method"], scope["path"],
                                type(e).__name__)
                    for message in cut_short(started):
                        await send(message)
                    return
                if not replica_died(e):
                    log.error("%s %s failed in the front", scope["method"], scope["path"], exc_info=e)
                    return await error_response(e, openai=is_openai_path(scope["path"]))(scope, receive, send)
                log.warning("%s %s: the replica died (try %d of %d)", scope["method"], scope["path"], attempt + 1,
                            tries)
        e = NotReady("the replica serving this request stopped before it answered" +
                     (", and so did the one it was retried on" if tries > 1 else " (not retried: it changes the "
                      "server)"), where="replica", fix="retry: another replica answers")
        await error_response(e, openai=is_openai_path(scope["path"]))(scope, receive, send)


def cut_short(start: dict) -> list[dict]:
    """What the front still sends when the replica of an answer that started dies: for an SSE
    stream, an error event in OpenAI's shape and `[DONE]` (the single server's end of a failed
    generation); for anything else nothing (its status and length are sent: it stays cut)."""
    from graphmode.serve.codec import dumps
    from graphmode.serve.errors import NotReady, openai_error
    headers = {k.lower(): v for k, v in start.get("headers", [])}
    if not headers.get(b"content-type", b"").startswith(b"text/event-stream"):
        return []
    e = NotReady("the replica serving this stream stopped mid-answer", where="replica",
                 fix="send the request again: another replica answers (the tokens above are not resumed)")
    event = b"data: " + dumps({"error": openai_error(e)}) + b"\n\n" + b"data: [DONE]\n\n"
    return [{"type": "http.response.body", "body": event, "more_body": False}]


class FrontApp:
    """The front's ASGI app (an object with `async __call__`: uvicorn, which runs it in Ray's
    replica, takes a plain callable of three arguments for an ASGI2 app)."""

    def __init__(self, front: GraphmodeFront):
        self.front = front

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        await self.front.asgi(scope, receive, send)


async def _read(receive: Any, limit: int) -> bytes | None:
    """The whole body, or None past `limit` bytes (the replica checks its own, smaller, limits)."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return b"".join(chunks)
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def relay(app: Any, request: dict, body: bytes) -> Any:
    """Run one request from the front through `app` (a replica's ASGI app), yielding the
    messages it sends, in lists: the replica side of `GraphmodeFront`. The response's start
    travels with its first body chunk (a whole answer in one item), so a replica that dies
    between the two leaves the front with nothing sent, which it can still retry."""
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, **request}
    messages: asyncio.Queue = asyncio.Queue()
    delivered = False

    async def receive() -> dict:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()          # the client's side is the front's: no disconnect comes here
        return {"type": "http.disconnect"}

    task = asyncio.ensure_future(app(scope, receive, messages.put))
    task.add_done_callback(lambda _: messages.put_nowait(None))
    start = None
    while (message := await messages.get()) is not None:
        if message["type"] == "http.response.start":
            start = message
            continue
        yield [start, message] if start is not None else [message]
        start = None
    if start is not None:
        yield [start]
    task.result()
