"""The HTTP layer (Starlette): routes over a ModelServer, errors as JSON, uvicorn runners.

Every failure answers strict JSON `{"error": <type>, "message", "where", "value", "fix", ...}`
with a 4xx for the client's mistakes (400 malformed body or query, 401 no admin token,
408 headers or body too slow, 413 too large, 415 media type, 422 contract / recipe refused,
409 reload busy) and 503 / 504 for not ready / timeout. A 500 means a server bug; it is
logged and the worker keeps serving.

Slow clients cannot hold the server: the headers must arrive within `header_timeout_s`
(checked in the HTTP protocol, `_GuardedH11`), the body within `body_timeout_s`, and a
Content-Length over the limit is answered 413 before any of the body is read. The protocol
itself answers what never reaches a route, in JSON like every other error: a request line
longer than the head limit 414, headers past it 431, a chunk announcing more than the
body limit 413 at once, anything h11 cannot parse 400. It then closes *lingering*: it stops
writing but keeps reading (and dropping) what the client still sends, for a moment, so the
client reads the answer instead of a connection reset. A response to HEAD never has a body.
"""
from __future__ import annotations

import asyncio
import contextlib
import errno
import hmac
import ipaddress
import logging
import socket
import threading
import time
from typing import Any, AsyncIterator

import h11
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route
from uvicorn.protocols.http.h11_impl import H11Protocol

from graphmode.errors import ContractViolation, GraphmodeError
from graphmode.serve.codec import (answer_kind, body_kind, clip, decode_json, decode_safetensors, dumps, encode_json,
                                   encode_safetensors, media_type)
from graphmode.serve.errors import (BadRequest, NotReady, ServeError, Unauthorized, error_dict, http_status,
                                    openai_error, openai_status)
from graphmode.serve.server import ModelServer, ServeConfig

log = logging.getLogger("graphmode.serve")
MB = 2**20
RECIPE_MAX_BYTES = 1 << 20
MAX_WAIT_S = 3600.0
DRAIN_MAX_BYTES = 64 * MB     # an oversized body up to this is read and dropped so the client sees the 413
LAST_EVENT_S = 1.0            # after the shutdown grace: time for streams to send their error event
YAML_TYPES = ("", "application/yaml", "application/x-yaml", "text/yaml", "text/x-yaml", "text/plain",
              "application/x-www-form-urlencoded")       # (curl --data-binary's default)
WAIT_VALUES = {"": False, "0": False, "false": False, "no": False, "1": True, "true": True, "yes": True}
CLOSE = {"Connection": "close"}


class JSONAnswer(Response):
    """A JSON answer written by `codec.dumps`: always strict JSON, whatever the content."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return dumps(content)


def error_response(e: BaseException, *, openai: bool = False) -> Response:
    """The error's JSON answer: graphmode's body, or with `openai` OpenAI's
    `{"error": {"message", "type", "param", "code", ...}}` (the OpenAI endpoints)."""
    status = openai_status(e) if openai else http_status(e)
    if openai:
        body = {"error": openai_error(e)}
    else:
        try:
            body = error_dict(e)
        except ValueError:                    # a value too long to print
            body = {"error": type(e).__name__, "message": getattr(e, "message", "")[:500]}
        body["status"] = status
    headers = dict(getattr(e, "headers", None) or {})
    if status == 503:
        headers["Retry-After"] = "1"
    if status == 401:
        headers["WWW-Authenticate"] = 'Bearer realm="graphmode"'
    return JSONAnswer(body, status_code=status, headers=headers)


def openai_failure(server: Any, e: BaseException, what: str) -> Response:
    """An OpenAI endpoint's failure, answered in OpenAI's shape: a client's mistake counted as a
    bad request (the contract's refusals are counted by the deployment), a bug logged."""
    if isinstance(e, ClientDisconnect):
        return Response(status_code=400)
    if isinstance(e, ServeError):
        if e.status != 422:
            server.metrics.bad_requests.labels(server.target_name, e.reason).inc()
    elif not isinstance(e, GraphmodeError):
        log.error("%s failed", what, exc_info=e)
    return error_response(e, openai=True)


def is_openai_path(path: str) -> bool:
    """The OpenAI API's paths (`/v1/...` but graphmode's own `/v1/infer` and `/v1/recipe`):
    their errors are answered in OpenAI's shape."""
    return path.startswith("/v1/") and not path.startswith(("/v1/infer", "/v1/recipe"))


# ---- request bodies -------------------------------------------------------------------------

async def read_body(request: Request, limit: int, timeout_s: float) -> bytes:
    """The body, at most `limit` bytes, within `timeout_s` (408 beyond, connection closed).
    A body over the limit gets 413: at once, from its Content-Length, when that is over
    DRAIN_MAX_BYTES (connection closed); else after reading and dropping the rest, so a
    client that writes the whole body before reading sees the 413, not a reset."""
    deadline = time.monotonic() + timeout_s
    stream = request.stream().__aiter__()

    def too_big(drained: bool) -> BadRequest:
        return BadRequest(f"body larger than {limit / MB:g} MB", status=413, reason="too_large", where="body",
                          fix="send less per request, or raise --max-body-mb", headers=None if drained else CLOSE)

    cl = request.headers.get("content-length")
    if cl is not None:
        if not cl.strip().isdigit():
            raise BadRequest("Content-Length is not a number", where="Content-Length", value=clip(cl), headers=CLOSE,
                             fix="send the body's length in bytes, or Transfer-Encoding: chunked")
        n = int(cl)
        if n > limit:
            raise too_big(n <= max(DRAIN_MAX_BYTES, limit) and await _drain(stream, n, deadline))
    chunks, total = [], 0
    while True:
        chunk = await _next_chunk(stream, deadline, timeout_s)
        if chunk is None:
            return b"".join(chunks)
        total += len(chunk)
        if total > limit:
            raise too_big(await _drain(stream, DRAIN_MAX_BYTES - total, deadline))
        chunks.append(chunk)


async def _next_chunk(stream: Any, deadline: float, timeout_s: float) -> bytes | None:
    try:
        return await asyncio.wait_for(stream.__anext__(), max(0.0, deadline - time.monotonic()))
    except StopAsyncIteration:
        return None
    except asyncio.TimeoutError:
        raise BadRequest(f"the request body did not arrive within {timeout_s:g} s", status=408,
                         reason="timeout", where="body", headers=CLOSE,
                         fix="send the whole body promptly (or raise --body-timeout-s)") from None


async def _drain(stream: Any, cap: int, deadline: float) -> bool:
    """Read and drop the rest of the body; False when it is longer than `cap` or too slow."""
    seen = 0
    with contextlib.suppress(ClientDisconnect):
        while True:
            try:
                chunk = await asyncio.wait_for(stream.__anext__(), max(0.0, deadline - time.monotonic()))
            except StopAsyncIteration:
                return True
            except asyncio.TimeoutError:
                return False
            seen += len(chunk)
            if seen > cap:
                return False
    return False


# ---- access control ---------------------------------------------------------------------------

def authorize(request: Request, token: str | None) -> None:
    """State-changing endpoints need `Authorization: Bearer <admin token>` when one is set."""
    if token is None:
        return
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), token.encode()):
        raise Unauthorized("this endpoint changes the server: it needs the admin token", where="Authorization",
                           fix="send the header `Authorization: Bearer <token>` with the server's admin token")


def is_loopback(host: str) -> bool:
    h = host.strip().strip("[]")
    if h.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(h.split("%")[0]).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(h, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(str(i[4][0]).split("%")[0]).is_loopback for i in infos)


def check_exposure(host: str, config: ServeConfig) -> None:
    """Refuse to listen beyond loopback when anyone who can connect could swap the recipe."""
    if config.admin_token is None and not config.insecure_no_auth and not is_loopback(host):
        raise GraphmodeError(f"refusing to listen on {host!r} without an admin token: anyone who can reach it could "
                             "replace the serving recipe", where="--host", value=host,
                             fix="set GRAPHMODE_ADMIN_TOKEN (or --admin-token), listen on 127.0.0.1, or pass "
                                 "--insecure-no-auth on a network you trust")


# ---- PUT /v1/recipe options -------------------------------------------------------------------

def reload_options(request: Request) -> tuple[bool, float]:
    """(wait, timeout) from the query; anything else is refused before any side effect."""
    q = request.query_params
    unknown = sorted(set(q.keys()) - {"wait", "timeout"})
    if unknown:
        raise BadRequest(f"unknown query parameter(s) {[clip(k, 40) for k in unknown[:5]]}", where="query",
                         fix="PUT /v1/recipe takes ?wait=1 and &timeout=SECONDS")
    for k in ("wait", "timeout"):
        if len(q.getlist(k)) > 1:
            raise BadRequest(f"query parameter {k!r} given more than once", where=f"query.{k}",
                             fix=f"give {k!r} once")
    wait = q.get("wait", "").strip().lower()
    if wait not in WAIT_VALUES:
        raise BadRequest("'wait' must be 1/0, true/false or yes/no", where="query.wait", value=clip(wait, 40),
                         fix="?wait=1 answers once the new version serves (or is refused), ?wait=0 at once")
    timeout = 600.0
    if "timeout" in q:
        raw = q["timeout"]
        try:
            timeout = float(raw)
        except ValueError:
            timeout = float("nan")
        if not 0 < timeout <= MAX_WAIT_S:              # also refuses nan and inf
            raise BadRequest(f"'timeout' must be a number of seconds in (0, {MAX_WAIT_S:g}]", where="query.timeout",
                             value=clip(raw, 40), fix="e.g. ?wait=1&timeout=300")
    return WAIT_VALUES[wait], timeout


def recipe_kind(content_type: str | None) -> str:
    mt = media_type(content_type)
    if mt in ("application/json", "text/json") or mt.endswith("+json"):
        return "json"
    if mt in YAML_TYPES:
        return "yaml"
    raise BadRequest(f"unsupported content type {clip(mt)!r} for a recipe", status=415,
                     reason="unsupported_media_type", where="Content-Type",
                     fix="send application/yaml or application/json")


# ---- the app ------------------------------------------------------------------------------------

def create_app(server: ModelServer) -> Starlette:
    metrics = server.metrics
    cfg = server.config

    def bad(e: ServeError, dep: Any = None) -> Response:
        if e.status == 422 and dep is not None:
            dep.monitor.refused("input")
        elif e.status != 422:
            metrics.bad_requests.labels(server.target_name, e.reason).inc()
        return error_response(e)

    async def infer(request: Request) -> Response:
        dep = None
        try:
            dep = server.current()
            kind = body_kind(request.headers.get("content-type"))
            body = await read_body(request, server.max_body_bytes, cfg.body_timeout_s)
            decode = decode_json if kind == "json" else decode_safetensors
            inputs = await run_in_threadpool(decode, body, dep.dtypes)
            result = await server.infer(dep, inputs)
            if answer_kind(kind, request.headers.get("accept")) == "json":
                return Response(await run_in_threadpool(encode_json, result), media_type="application/json")
            data = await run_in_threadpool(encode_safetensors, result)
            return Response(data, media_type="application/octet-stream",
                            headers={"X-Graphmode-Recipe-Version": result["recipe_version"],
                                     "X-Graphmode-Bucket": dumps(result["bucket"]).decode()})
        except ClientDisconnect:
            return Response(status_code=400)
        except ServeError as e:
            return bad(e, dep)
        except ContractViolation as e:            # already counted by the deployment
            return error_response(e)
        except GraphmodeError as e:               # a recipe a decoder's whole-sequence graph refuses (422)
            return error_response(e)
        except Exception as e:  # noqa: BLE001 - answered, logged, and the server keeps going
            log.exception("infer failed")
            return error_response(e)

    async def healthz(request: Request) -> Response:
        failed = server.state == "failed"
        body = {"status": "failed" if failed else "live", "state": server.state,
                "uptime_s": round(time.time() - server.started, 3)}
        if server.error is not None:
            body["error"] = error_dict(server.error)
        group = await run_in_threadpool(server.group_health)      # tensor-parallel ranks: never waits on a step
        if group is not None:
            body["ranks"] = group["ranks"]
            if group["down"] is not None:
                failed = True
                body.update(status="failed", state="failed",     # as /readyz says: its group is down
                            error={"error": "RankFailure", "message": group["down"], "where": "parallel"})
        return JSONAnswer(body, status_code=503 if failed else 200)

    async def readyz(request: Request) -> Response:
        view = server.readiness()
        group = await run_in_threadpool(server.group_health)
        ready = server.state == "ready" and server.active is not None and (group is None or group["down"] is None)
        if group is not None:
            view["ranks"] = group["ranks"]
            if group["down"] is not None:
                view["error"] = {"error": "RankFailure", "message": group["down"], "where": "parallel"}
                view["state"] = "failed"         # the server's state reads ready: its group is down
        view["status"] = "ready" if ready else "not ready"
        if not ready and server.state == "warming" and server.active is None:
            view["progress"] = "loading the artifact's plans" if server.artifact is not None else \
                "compiling and warming up the recipe's buckets"
        return JSONAnswer(view, status_code=200 if ready else 503)

    async def metrics_endpoint(request: Request) -> Response:
        await run_in_threadpool(server.group_health)     # graphmode_tensor_parallel_ranks_up
        if server.batcher is not None:
            metrics.queue_depth.labels(server.target_name).set(server.batcher.depth())
        return Response(metrics.text(), media_type=metrics.content_type)

    async def get_recipe(request: Request) -> Response:
        return JSONAnswer(server.recipe_view())

    async def put_recipe(request: Request) -> Response:
        try:
            authorize(request, cfg.admin_token)
            wait, timeout = reload_options(request)
            kind = recipe_kind(request.headers.get("content-type"))
            body = await read_body(request, RECIPE_MAX_BYTES, cfg.body_timeout_s)
            if not body.strip():
                raise BadRequest("empty recipe", status=422, reason="recipe", where="body",
                                 fix="send the recipe as YAML or JSON")
            if server.active is None:
                raise NotReady("the server is still loading its first recipe", fix="retry when /readyz answers 200")
            recipe = await run_in_threadpool(server.check_recipe, body, kind)
            ticket = await run_in_threadpool(server.request_reload, recipe, "api")
            if ticket is None:
                return JSONAnswer({"status": "unchanged", "version": server.active.version})
            if not wait:
                return JSONAnswer({"status": "accepted", **ticket.to_dict()}, status_code=202,
                                  headers={"Location": "/v1/recipe"})
            if not await ticket.wait_async(timeout, give_up=lambda: server.stopping):
                if server.stopping:
                    raise NotReady("the server is shutting down before the new recipe is warm", where="recipe",
                                   fix="send the recipe to the server that replaces this one")
                return JSONAnswer({"status": "compiling", **ticket.to_dict()}, status_code=202)
            if ticket.state == "swapped":
                return JSONAnswer({"status": "swapped", **ticket.to_dict()})
            return error_response(ticket.error or GraphmodeError("reload failed"))
        except ClientDisconnect:
            return Response(status_code=400)
        except ServeError as e:
            if e.status != 422:
                metrics.bad_requests.labels(server.target_name, e.reason).inc()
            return error_response(e)
        except GraphmodeError as e:
            return error_response(e)
        except Exception as e:  # noqa: BLE001
            log.exception("PUT /v1/recipe failed")
            return error_response(e)

    async def http_error(request: Request, exc: HTTPException) -> Response:
        fix = ("endpoints: POST /v1/infer, POST /v1/completions, POST /v1/chat/completions, POST /v1/embeddings, "
               "GET /v1/models[/{id}], GET|PUT /v1/recipe, GET /healthz, /readyz, /metrics, and KServe v2: GET /v2, "
               "/v2/health/live|ready, /v2/models/{name}[/ready], POST /v2/models/{name}/infer")
        reason = "not_found" if exc.status_code == 404 else "method_not_allowed"
        metrics.bad_requests.labels(server.target_name, reason).inc()      # (as documented: a 405 was not)
        if is_openai_path(request.url.path):
            err = BadRequest(f"{request.method} {clip(request.url.path, 80)}: {exc.detail}", status=exc.status_code,
                             reason=reason, where="path", fix=fix)
            return error_response(err, openai=True)
        return JSONAnswer({"error": "HTTPError", "message": exc.detail, "status": exc.status_code, "fix": fix},
                          status_code=exc.status_code, headers=getattr(exc, "headers", None))

    async def server_error(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error", exc_info=exc)
        return error_response(exc, openai=is_openai_path(request.url.path))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await server.start()
        try:
            yield
        finally:
            await server.stop()

    routes = [Route("/v1/infer", infer, methods=["POST"]),
              Route("/v1/recipe", get_recipe, methods=["GET"]),
              Route("/v1/recipe", put_recipe, methods=["PUT"]),
              Route("/healthz", healthz, methods=["GET"]),
              Route("/readyz", readyz, methods=["GET"]),
              Route("/metrics", metrics_endpoint, methods=["GET"])]
    from graphmode.serve.completions import completion_routes    # (they use this module's helpers)
    from graphmode.serve.embeddings import embedding_routes
    from graphmode.serve.kserve import kserve_routes
    from graphmode.serve.tokenize import tokenize_routes
    routes += completion_routes(server) + embedding_routes(server) + kserve_routes(server) + tokenize_routes(server)
    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={HTTPException: http_error, Exception: server_error})
    app.state.server = server
    return app


# ---- uvicorn ---------------------------------------------------------------------------------

def body_limit(method: str, path: str, max_body_bytes: int) -> int:
    """The most body bytes the route for (method, path) reads (read_body's `limit` there)."""
    return RECIPE_MAX_BYTES if method == "PUT" and path.rstrip("/") == "/v1/recipe" else max_body_bytes


HEAD_LIMIT = 16 * 1024        # request line + headers (h11's default incomplete-event limit)
LINGER_S = 2.0                # after an answer the protocol wrote itself: how long it keeps draining
LINGER_MAX_BYTES = 64 * MB    # ... and how much


class _GuardedH11(H11Protocol):
    """uvicorn's h11 protocol with a deadline on a request's headers: from a connection's
    first moment (or a request's first byte on a kept-alive one) to its last header line.
    uvicorn itself only times out idle kept-alive connections, so a client that sends half
    a request line would otherwise hold its connection forever. It also answers, in JSON,
    the requests no route sees (module docstring): 400, 414, 431, and 413 for a chunk
    announced over the route's body limit."""

    header_timeout_s = 10.0
    max_body_bytes = 16 * MB
    _header_timer: asyncio.TimerHandle | None = None
    _lingering = False
    _drained = 0
    _linger_timer: asyncio.TimerHandle | None = None
    _sized: Any = None                  # the request cycle whose head size was checked

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._watch_headers()

    def data_received(self, data: bytes) -> None:
        if self._lingering:                 # answered already: drop what the client still sends
            self._drained += len(data)
            if self._drained > LINGER_MAX_BYTES:
                self.transport.close()
            return
        super().data_received(data)
        if not self._lingering:
            self._check_head_size()
        if not self._lingering:
            self._check_announced_body()
        self._watch_headers()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_header_timer()
        if self._linger_timer is not None:
            self._linger_timer.cancel()
            self._linger_timer = None
        super().connection_lost(exc)

    # ---- answers no route gives -------------------------------------------------------------
    def send_400_response(self, msg: str) -> None:
        """h11 could not parse the request: 414 / 431 when its head outgrew HEAD_LIMIT (by the
        request line or by the headers), else 400; JSON, then a lingering close."""
        if self.cycle is not None and self.cycle.response_started and not self.cycle.response_complete:   # mid-answer
            self.cycle.disconnected = True
            self.transport.close()
            return
        buf = self.conn.trailing_data[0]
        limit = self._head_limit()
        line_end = buf.find(b"\r\n", 0, limit + 2)
        if len(buf) > limit:
            self._head_too_large(line_end < 0, limit, head=buf[:5] == b"HEAD ")
        else:
            self._answer(400, "Bad Request", "BadRequest", "malformed HTTP request", "request",
                         "send a valid HTTP/1.1 request", head=buf[:5] == b"HEAD ")

    def _head_limit(self) -> int:
        got = getattr(self.conn, "_max_incomplete_event_size", None)
        return got if isinstance(got, int) else HEAD_LIMIT

    def _check_head_size(self) -> None:
        """h11 bounds a head only while it is incomplete: one that arrived whole in one read
        is measured here, so the limit does not depend on how the bytes were split."""
        cycle = self.cycle
        if cycle is None or cycle is self._sized or cycle.response_started:
            return
        self._sized = cycle
        scope = self.scope
        line = len(scope["raw_path"]) + len(scope["query_string"]) + 1
        size = line + sum(len(k) + len(v) + 4 for k, v in scope["headers"])
        limit = self._head_limit()
        if size > limit:
            self._head_too_large(line > limit, limit, head=scope["method"] == "HEAD")

    def _head_too_large(self, by_line: bool, limit: int, head: bool) -> None:
        if by_line:
            self._answer(414, "URI Too Long", "URLTooLong", f"the request line is longer than {limit} bytes",
                         "request line", "send a shorter URL (put data in the body)", head=head)
        else:
            self._answer(431, "Request Header Fields Too Large", "HeadersTooLarge",
                         f"the request headers are larger than {limit} bytes", "headers",
                         "send fewer or shorter headers", head=head)

    def _check_announced_body(self) -> None:
        """A chunk whose announced size alone is over the route's body limit: 413 now, instead
        of waiting for a body that would be refused anyway (or never comes)."""
        cycle = self.cycle
        if cycle is None or cycle.response_started or self.conn.their_state is not h11.SEND_BODY:
            return
        pending = getattr(getattr(self.conn, "_reader", None), "_bytes_in_chunk", 0)
        limit = body_limit(self.scope["method"], self.scope["path"], self.max_body_bytes)
        if isinstance(pending, int) and pending > limit:
            self._answer(413, "Content Too Large", "BadRequest", f"the body announces a chunk of {pending} bytes, "
                         f"more than the {limit / MB:g} MB this endpoint takes", "body",
                         "send less per request, or raise --max-body-mb", head=self.scope["method"] == "HEAD")

    def _answer(self, status: int, phrase: str, error: str, message: str, where: str, fix: str, *,
                head: bool = False, linger: bool = True) -> None:
        """Write a JSON error (no body for HEAD) and close: lingering (module docstring), or at once."""
        body = dumps({"error": error, "message": message, "where": where, "status": status, "fix": fix})
        self.transport.write(b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\nconnection: close\r\n"
                             b"content-length: %d\r\n\r\n%s" % (status, phrase.encode(), len(body),
                                                                  b"" if head else body))
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.disconnected = True              # the route (if one runs) answers no more
            self.cycle.message_event.set()
        if not linger:
            self.transport.close()
            return
        self._lingering = True
        self._stop_header_timer()
        with contextlib.suppress(Exception):
            self.transport.resume_reading()
            self.transport.write_eof()
        self._linger_timer = self.loop.call_later(LINGER_S, self.transport.close)

    def _watch_headers(self) -> None:
        if self.conn.their_state is not h11.IDLE or self.transport.is_closing():
            self._stop_header_timer()
        elif self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_too_slow)

    def _stop_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if self.conn.their_state is not h11.IDLE or self.transport.is_closing() or self._lingering:
            return
        self._answer(408, "Request Timeout", "RequestTimeout",
                     f"the request headers did not arrive within {self.header_timeout_s:g} s", "headers",
                     "send the whole request promptly (or raise --header-timeout-s)",
                     head=self.conn.trailing_data[0][:5] == b"HEAD ", linger=False)


FORCED_STOP_S = 10.0       # what a forced exit (a second Ctrl-C) still gives the server's own stop


def uvicorn_server(app: Starlette, *, log_level: str = "warning") -> Any:
    import uvicorn

    server: ModelServer = app.state.server

    grace = server.config.shutdown_grace_s

    class Server(uvicorn.Server):
        """Tells the ModelServer when shutdown begins (before uvicorn waits for open requests),
        so a request waiting on a recipe check or a compile answers instead of being cancelled;
        generations still running when the grace is over end with an error event, before
        uvicorn cancels what is left (which would cut a stream off without a word)."""

        async def shutdown(self, sockets: Any = None) -> None:
            server.begin_stop()
            timer = asyncio.get_running_loop().call_later(grace, server.end_requests)
            try:
                await super().shutdown(sockets=sockets)
                if self.force_exit:
                    # a second Ctrl-C stops the wait for open requests, not graphmode's own stop (its
                    # rank processes, the last knowledge-base window): uvicorn skips the lifespan's
                    # shutdown there, and asyncio then cancelled its task, which starlette printed as
                    # a traceback on the way out
                    await asyncio.wait_for(self.lifespan.shutdown(), FORCED_STOP_S)
            except asyncio.TimeoutError:
                pass
            finally:
                timer.cancel()

    protocol = type("GuardedH11", (_GuardedH11,), {"header_timeout_s": server.config.header_timeout_s,
                                                  "max_body_bytes": server.max_body_bytes})
    config = uvicorn.Config(app, log_level=log_level, lifespan="on", access_log=False, http=protocol,
                            timeout_graceful_shutdown=grace + LAST_EVENT_S)
    return Server(config)


def bind(host: str, port: int) -> socket.socket:
    """A listening socket (port 0 picks a free one); BadRequest-free errors for the CLI."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except (OSError, OverflowError) as e:
        sock.close()
        host_problem = isinstance(e, socket.gaierror) or getattr(e, "errno", None) == errno.EADDRNOTAVAIL
        raise GraphmodeError(f"cannot listen on {host}:{port}: {getattr(e, 'strerror', None) or e}",
                             where="--host" if host_problem else "--host/--port", value=f"{host}:{port}",
                             fix="give an address of this machine: 127.0.0.1 (this machine only), 0.0.0.0 (every "
                                 "interface) or one of its own" if host_problem else
                             "pick a free port (or 0 for any)") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


class ServerThread:
    """Run a ModelServer's app on uvicorn in a background thread (tests, notebooks)."""

    def __init__(self, server: ModelServer, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        check_exposure(host, server.config)
        self.server = server
        self.app = create_app(server)
        self.sock = bind(host, port)
        self.host, self.port = self.sock.getsockname()[:2]
        self.url = f"http://{host}:{self.port}"
        self.uvicorn = uvicorn_server(self.app, log_level=log_level)
        self.thread = threading.Thread(target=self.uvicorn.run, kwargs={"sockets": [self.sock]}, daemon=True,
                                       name="graphmode-uvicorn")

    def start(self, timeout: float = 30.0) -> "ServerThread":
        self.thread.start()
        t0 = time.monotonic()
        while not self.uvicorn.started:
            if not self.thread.is_alive() or time.monotonic() - t0 > timeout:
                raise GraphmodeError("the HTTP server did not start", where="serve",
                                     value=f"{self.host}:{self.port}")
            time.sleep(0.01)
        return self

    def wait_ready(self, timeout: float = 600.0) -> "ServerThread":
        t0 = time.monotonic()
        while self.server.state != "ready":
            if self.server.state == "failed":
                raise self.server.error or GraphmodeError("the server failed to load its recipe")
            if time.monotonic() - t0 > timeout:
                raise GraphmodeError(f"the server was not ready within {timeout:g} s", where="serve")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.uvicorn.should_exit = True
        self.thread.join(timeout)
        with contextlib.suppress(OSError):
            self.sock.close()
        self.server.join_background(timeout)        # an abandoned build ends at its next step

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
