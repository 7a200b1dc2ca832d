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


class _DyingReplicas:
    """A handle whose replica sends a stream's start and first event, then dies."""

    def __init__(self, content_type: bytes):
        self.content_type = content_type
        self.forward = self

    def options(self, **_):
        return self

    async def remote(self, request: dict, body: bytes):
        yield [{"type": "http.response.start", "status": 200, "headers": [(b"content-type", self.content_type)]},
               {"type": "http.response.body", "body": b"data: {\"choices\": []}\n\n", "more_body": True}]
        raise RuntimeError("the replica's actor died")


def _through_front(content_type: bytes) -> list[dict]:
    from graphmode.serve.cluster_front import GraphmodeFront
    sent: list[dict] = []

    async def receive():
        return {"type": "http.request", "body": b'{"prompt": [1], "stream": true}', "more_body": False}

    async def send(message):
        sent.append(message)
    front = GraphmodeFront(_DyingReplicas(content_type), 1 << 20)
    asyncio.run(front.asgi({"type": "http", **_request("POST", "/v1/completions")}, receive, send))
    return sent


def test_a_stream_whose_replica_dies_ends_with_an_error_event_in_openais_shape():
    import json
    sent = _through_front(b"text/event-stream; charset=utf-8")
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body", "http.response.body"]
    assert sent[0]["status"] == 200 and sent[-1]["more_body"] is False
    events = [e[len(b"data: "):] for e in sent[-1]["body"].split(b"\n\n") if e]
    assert events[-1] == b"[DONE]" and len(events) == 2
    error = json.loads(events[0])["error"]
    assert error["code"] == "not_ready" and error["type"] == "service_unavailable_error" and "mid-answer" in error["message"]
    assert "another replica" in error["message"]                  # the fix, in the one line the client shows
    plain = _through_front(b"application/json")                   # not a stream: nothing is added to a cut body
    assert [m["type"] for m in plain] == ["http.response.start", "http.response.body"]
