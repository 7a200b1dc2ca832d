"""The HTTP layer (Starlette): routes over a ModelServer, errors as JSON, uvicorn runners.

Every failure answers JSON `{"error": <type>, "message", "where", "value", "fix", ...}`
with a 4xx for the client's mistakes (400 malformed body, 413 too large, 415 media type,
422 contract / recipe refused, 409 reload busy) and 503 / 504 for not ready / timeout.
A 500 means a server bug; it is logged and the worker keeps serving.
"""
from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
import time
from typing import Any, AsyncIterator

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from graphmode.errors import ConstraintError, ContractViolation, GraphmodeError, RecipeError
from graphmode.serve.codec import (answer_kind, body_kind, decode_json, decode_safetensors, encode_json,
                                   encode_safetensors, media_type)
from graphmode.serve.errors import BadRequest, ServeError
from graphmode.serve.server import ModelServer, error_dict

log = logging.getLogger("graphmode.serve")
MB = 2**20
RECIPE_MAX_BYTES = 1 << 20


def error_response(e: BaseException) -> JSONResponse:
    if isinstance(e, ServeError):
        status = e.status
    elif isinstance(e, (ContractViolation, RecipeError, ConstraintError)):
        status = 422
    elif isinstance(e, GraphmodeError):
        status = 500
    else:
        status = 500
    body = error_dict(e)
    body["status"] = status
    headers = {"Retry-After": "1"} if status == 503 else None
    return JSONResponse(body, status_code=status, headers=headers)


async def read_body(request: Request, limit: int) -> bytes:
    """The body, at most `limit` bytes (413 beyond; the rest is drained, up to a bound, so
    the client reads the answer instead of a reset connection)."""
    too_big = BadRequest(f"body larger than {limit / MB:g} MB", status=413, reason="too_large", where="body",
                         fix="send less per request, or raise --max-body-mb")
    stream = request.stream().__aiter__()
    cl = request.headers.get("content-length")
    if cl is not None:
        try:
            n = int(cl)
        except ValueError:
            raise BadRequest("Content-Length is not a number", where="Content-Length", value=cl) from None
        if n > limit:
            await _drain(stream, 4 * limit + 16 * MB)
            raise too_big
    chunks, total = [], 0
    async for chunk in stream:
        total += len(chunk)
        if total > limit:
            await _drain(stream, 4 * limit + 16 * MB)
            raise too_big
        chunks.append(chunk)
    return b"".join(chunks)


async def _drain(stream: Any, cap: int) -> None:
    seen = 0
    with contextlib.suppress(ClientDisconnect, StopAsyncIteration):
        async for chunk in stream:
            seen += len(chunk)
            if seen > cap:
                break


def create_app(server: ModelServer) -> Starlette:
    metrics = server.metrics

    def bad(e: ServeError, dep: Any = None) -> JSONResponse:
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
            body = await read_body(request, server.max_body_bytes)
            decode = decode_json if kind == "json" else decode_safetensors
            inputs = await run_in_threadpool(decode, body, dep.dtypes)
            result = await server.infer(dep, inputs)
            if answer_kind(kind, request.headers.get("accept")) == "json":
                return Response(await run_in_threadpool(encode_json, result), media_type="application/json")
            data = await run_in_threadpool(encode_safetensors, result)
            return Response(data, media_type="application/octet-stream",
                            headers={"X-Graphmode-Recipe-Version": result["recipe_version"],
                                     "X-Graphmode-Bucket": json.dumps(result["bucket"])})
        except ClientDisconnect:
            return Response(status_code=400)
        except ServeError as e:
            return bad(e, dep)
        except ContractViolation as e:            # already counted by the deployment
            return error_response(e)
        except Exception as e:  # noqa: BLE001 - answered, logged, and the server keeps going
            log.exception("infer failed")
            return error_response(e)

    async def healthz(request: Request) -> Response:
        body = {"status": "failed" if server.state == "failed" else "live", "state": server.state,
                "uptime_s": round(time.time() - server.started, 3)}
        if server.error is not None:
            body["error"] = error_dict(server.error)
        return JSONResponse(body, status_code=503 if server.state == "failed" else 200)

    async def readyz(request: Request) -> Response:
        view = server.readiness()
        ready = server.state == "ready" and server.active is not None
        view["status"] = "ready" if ready else "not ready"
        if not ready and server.state == "warming" and server.active is None:
            view["progress"] = "compiling and warming up the recipe's buckets"
        return JSONResponse(view, status_code=200 if ready else 503)

    async def metrics_endpoint(request: Request) -> Response:
        if server.batcher is not None:
            metrics.queue_depth.labels(server.target_name).set(server.batcher.depth())
        return Response(metrics.text(), media_type=metrics.content_type)

    async def get_recipe(request: Request) -> Response:
        return JSONResponse(server.recipe_view())

    async def put_recipe(request: Request) -> Response:
        try:
            body = await read_body(request, RECIPE_MAX_BYTES)
            if not body.strip():
                raise BadRequest("empty recipe", status=422, reason="recipe", where="body",
                                 fix="send the recipe as YAML or JSON")
            mt = media_type(request.headers.get("content-type"))
            if mt in ("application/json", "text/json") or mt.endswith("+json"):
                try:
                    source: Any = json.loads(body)
                except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
                    raise BadRequest(f"malformed JSON recipe: {e}", status=422, reason="recipe", where="body",
                                     fix="send a JSON object (or YAML with Content-Type: application/yaml)") from None
                if isinstance(source, dict) and isinstance(source.get("recipe"), dict):
                    source = source["recipe"]          # accept GET /v1/recipe's answer as is
            elif mt in ("", "application/yaml", "application/x-yaml", "text/yaml", "text/x-yaml", "text/plain",
                        "application/x-www-form-urlencoded"):        # curl --data-binary's default
                source = bytes(body)
            else:
                raise BadRequest(f"unsupported content type {mt!r} for a recipe", status=415,
                                 reason="unsupported_media_type", where="Content-Type",
                                 fix="send application/yaml or application/json")
            ticket = await run_in_threadpool(server.request_reload, source, "api")
            if ticket is None:
                return JSONResponse({"status": "unchanged", "version": server.active.version})
            wait = request.query_params.get("wait", "").lower() in ("1", "true", "yes")
            if not wait:
                return JSONResponse({"status": "accepted", **ticket.to_dict()}, status_code=202,
                                    headers={"Location": "/v1/recipe"})
            timeout = float(request.query_params.get("timeout", "600"))
            finished = await run_in_threadpool(ticket.wait, timeout)
            if not finished:
                return JSONResponse({"status": "compiling", **ticket.to_dict()}, status_code=202)
            if ticket.state == "swapped":
                return JSONResponse({"status": "swapped", **ticket.to_dict()})
            return error_response(ticket.error or GraphmodeError("reload failed"))
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
        return JSONResponse({"error": "HTTPError", "message": exc.detail, "status": exc.status_code,
                             "fix": "endpoints: POST /v1/infer, GET|PUT /v1/recipe, GET /healthz, /readyz, /metrics"},
                            status_code=exc.status_code, headers=getattr(exc, "headers", None))

    async def server_error(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error", exc_info=exc)
        return error_response(exc)

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
    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={HTTPException: http_error, Exception: server_error})
    app.state.server = server
    return app


def bind(host: str, port: int) -> socket.socket:
    """A listening socket (port 0 picks a free one); BadRequest-free errors for the CLI."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise GraphmodeError(f"cannot listen on {host}:{port}: {e.strerror}", where="--host/--port",
                             value=f"{host}:{port}", fix="pick a free port (or 0 for any)") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def uvicorn_server(app: Starlette, *, log_level: str = "warning") -> Any:
    import uvicorn
    config = uvicorn.Config(app, log_level=log_level, lifespan="on", access_log=False,
                            timeout_graceful_shutdown=5)
    return uvicorn.Server(config)


class ServerThread:
    """Run a ModelServer's app on uvicorn in a background thread (tests, notebooks)."""

    def __init__(self, server: ModelServer, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
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

    def wait_ready(self, timeout: float = 300.0) -> "ServerThread":
        t0 = time.monotonic()
        while self.server.state != "ready":
            if self.server.state == "failed":
                raise self.server.error or GraphmodeError("the server failed to load its recipe")
            if time.monotonic() - t0 > timeout:
                raise GraphmodeError(f"the server was not ready within {timeout:g} s", where="serve")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self.uvicorn.should_exit = True
        self.thread.join(timeout)
        with contextlib.suppress(OSError):
            self.sock.close()

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
