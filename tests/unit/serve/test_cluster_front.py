"""The front of `graphmode serve --replicas` without Ray: which requests it retries on another
replica, and the replica side of the hop (`relay`), which runs a request through an ASGI app
and yields what it sends, a stream's chunks as they come."""
from __future__ import annotations

import asyncio

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from graphmode.serve.cluster_front import relay, retryable


@pytest.mark.parametrize("method, path, ok", [("POST", "/v1/infer", True), ("POST", "/v1/completions", True),
                                              ("POST", "/v1/chat/completions/", True), ("GET", "/metrics", True),
                                              ("POST", "/v2/models/mlp/infer", True), ("POST", "/v1/embeddings", True),
                                              ("PUT", "/v1/recipe", False), ("POST", "/v2/models/mlp", False)])
def test_only_requests_that_change_nothing_are_retried(method, path, ok):
    assert retryable(method, path) is ok


async def _echo(request: Request) -> JSONResponse:
    return JSONResponse({"got": (await request.json())["x"], "query": request.url.query}, status_code=201)


async def _stream(request: Request) -> StreamingResponse:
    async def events():
        for i in range(3):
            yield f"data: {i}\n\n"
    return StreamingResponse(events(), media_type="text/event-stream")


APP = Starlette(routes=[Route("/echo", _echo, methods=["POST"]), Route("/stream", _stream, methods=["GET"])])


def _request(method: str, path: str, query: bytes = b"") -> dict:
    return {"http_version": "1.1", "method": method, "scheme": "http", "path": path, "raw_path": path.encode(),
            "root_path": "", "query_string": query, "headers": [(b"content-type", b"application/json")],
            "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2)}


async def _collect(method: str, path: str, body: bytes, query: bytes = b"") -> list[list[dict]]:
    return [batch async for batch in relay(APP, _request(method, path, query), body)]


def test_relay_answers_a_request_through_the_app_in_one_item():
    batches = asyncio.run(_collect("POST", "/echo", b'{"x": 7}', b"a=1"))
    start, body = batches[0]              # the start never travels alone: a death after it could not be retried
    assert start["type"] == "http.response.start" and start["status"] == 201
    assert body["body"] == b'{"got":7,"query":"a=1"}' and not body.get("more_body")


def test_relay_yields_a_stream_chunk_by_chunk():
    batches = asyncio.run(_collect("GET", "/stream", b""))
    assert batches[0][0]["type"] == "http.response.start"
    chunks = [m["body"] for batch in batches for m in batch if m.get("body")]
    assert chunks == [b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n"] and len(batches) >= 3
