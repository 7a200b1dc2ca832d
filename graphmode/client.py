"""A small Python client for `graphmode serve`: encoders (`/v1/infer`, KServe v2) and decoders
(`/v1/completions`, whole or streamed).

    from graphmode.client import Client
    with Client("http://127.0.0.1:8000") as c:
        c.wait_ready()
        c.infer({"pixel_values": x})["logits"]              # /v1/infer -> numpy arrays
        c.v2_infer({"pixel_values": x})["logits"]           # /v2/models/{name}/infer
        c.complete([5, 6, 7], max_tokens=8, temperature=0).token_ids
        for chunk in c.stream("Hello", max_tokens=32):      # server-sent events
            print(chunk.text, end="", flush=True)

Inputs are anything numpy takes (arrays, CPU tensors, nested lists); outputs are numpy
arrays. A refused request raises `ServerError` with the server's status, message, field
(`where`) and fix. `AsyncClient` is the asyncio form of the completion calls (used by the
load generator, graphmode.bench.serve_load). Only httpx and numpy are needed.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Iterator, Mapping

import httpx
import numpy as np

from graphmode.errors import GraphmodeError

V2_NUMPY = {"BOOL": np.bool_, "UINT8": np.uint8, "INT8": np.int8, "INT16": np.int16, "INT32": np.int32,
            "INT64": np.int64, "FP16": np.float16, "FP32": np.float32, "FP64": np.float64}
NUMPY_V2 = {np.dtype(v): k for k, v in V2_NUMPY.items()}
GM_NUMPY = {"bool": np.bool_, "u8": np.uint8, "i8": np.int8, "i16": np.int16, "i32": np.int32, "i64": np.int64,
            "f16": np.float16, "bf16": np.float32, "f32": np.float32, "f64": np.float64}


class ServerError(GraphmodeError):
    """The server refused or failed a request: `status`, and its JSON error body as `body`."""

    exit_code = 1

    def __init__(self, status: int, body: Any):
        self.status = status
        self.body = body if isinstance(body, dict) else {"message": str(body)}
        b = self.body
        err = b.get("error")
        if isinstance(err, dict):          # OpenAI's shape {"error": {"message", ..., graphmode's "detail", "where"}}
            b = err
            message = err.get("detail") or err.get("message")
        else:
            message = b.get("message") or err
        super().__init__(f"HTTP {status}: {message or f'HTTP {status}'}", where=b.get("where"), value=b.get("value"),
                         fix=b.get("fix"))


@dataclass
class Choice:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass
class Completion:
    id: str
    model: str
    choices: list[Choice]
    usage: dict[str, int]
    recipe_version: str | None = None

    @property
    def text(self) -> str:
        return self.choices[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.choices[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.choices[0].finish_reason


@dataclass
class Chunk:
    """One streamed event: the new tokens and text of each choice that moved (`choices`),
    the time it arrived (`time.perf_counter()`), and `usage` on the last one when asked for."""
    choices: list[Choice]
    arrived: float
    usage: dict[str, int] | None = None

    @property
    def text(self) -> str:
        return "".join(c.text for c in self.choices)

    @property
    def token_ids(self) -> list[int]:
        return [t for c in self.choices for t in c.token_ids]


# ---- pure helpers (shared by Client and AsyncClient) ----------------------------------------

def completion_body(prompt: Any, *, stream: bool, **params: Any) -> dict[str, Any]:
    """The JSON of a completion request; parameters left as None are not sent."""
    body: dict[str, Any] = {"prompt": prompt, **{k: v for k, v in params.items() if v is not None}}
    if stream:
        body["stream"] = True
    return body


def _choice(c: Mapping[str, Any]) -> Choice:
    return Choice(int(c.get("index", 0)), c.get("text") or "", list(c.get("token_ids") or []), c.get("finish_reason"))


def parse_completion(doc: Mapping[str, Any]) -> Completion:
    return Completion(doc.get("id", ""), doc.get("model", ""), [_choice(c) for c in doc.get("choices", [])],
                      dict(doc.get("usage") or {}), doc.get("system_fingerprint"))


def parse_event(line: str) -> Chunk | None | bool:
    """One line of a server-sent event stream: a Chunk, None (not an event: blank, comment),
    or True for `data: [DONE]`. An error event raises ServerError."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if data == "[DONE]":
        return True
    doc = json.loads(data)
    if "error" in doc:
        err = doc["error"]
        raise ServerError(int(err.get("status", 500)) if isinstance(err, dict) else 500, {"error": err})
    return Chunk([_choice(c) for c in doc.get("choices", [])], time.perf_counter(), doc.get("usage"))


def _error(r: httpx.Response) -> ServerError:
    try:
        body = r.json()
    except ValueError:
        body = {"message": r.text[:500] or r.reason_phrase}
    return ServerError(r.status_code, body)


def _array(x: Any, dtype: Any = None) -> np.ndarray:
    a = np.asarray(x.detach().cpu().numpy() if hasattr(x, "detach") else x)
    if dtype is not None and a.dtype != np.dtype(dtype) and np.can_cast(a.dtype, dtype, "same_kind"):
        a = a.astype(dtype)
    return a


def v2_request(inputs: Mapping[str, Any], datatypes: Mapping[str, str], outputs: list[str] | None) -> dict[str, Any]:
    tensors = []
    for name, x in inputs.items():
        a = _array(x, V2_NUMPY.get(datatypes.get(name, "")))
        tensors.append({"name": name, "shape": list(a.shape), "datatype": NUMPY_V2.get(a.dtype, str(a.dtype)),
                        "data": a.reshape(-1).tolist()})
    body: dict[str, Any] = {"inputs": tensors}
    if outputs is not None:
        body["outputs"] = [{"name": n} for n in outputs]
    return body


def v2_outputs(doc: Mapping[str, Any]) -> dict[str, np.ndarray]:
    return {t["name"]: np.asarray(t["data"], dtype=V2_NUMPY.get(t["datatype"], np.float32)).reshape(t["shape"])
            for t in doc.get("outputs", [])}


# ---- clients -------------------------------------------------------------------------------

class Client:
    """Blocking client over one server (`url`); `model` defaults to the server's model name."""

    def __init__(self, url: str = "http://127.0.0.1:8000", *, timeout: float = 300.0, model: str | None = None,
                 token: str | None = None):
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.Client(base_url=url.rstrip("/"), timeout=timeout, headers=headers)
        self._model = model
        self._meta: dict[str, dict[str, Any]] = {}

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        self.http.close()

    def _json(self, method: str, path: str, **kw: Any) -> Any:
        r = self.http.request(method, path, **kw)
        if r.status_code >= 400:
            raise _error(r)
        return r.json()

    # ---- health ------------------------------------------------------------------------------
    def live(self) -> bool:
        return self.http.get("/v2/health/live").status_code == 200

    def ready(self) -> bool:
        return self.http.get("/v2/health/ready").status_code == 200

    def wait_ready(self, timeout: float = 600.0, every: float = 0.1) -> None:
        """Until the server is ready (its recipe compiled and warm); GraphmodeError past `timeout`
        or when the server failed to load its recipe."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                r = self.http.get("/healthz")
                if r.status_code == 503:
                    raise _error(r)
                if self.ready():
                    return
            except httpx.TransportError:
                pass                                 # not listening yet
            if time.monotonic() > deadline:
                raise GraphmodeError(f"the server was not ready within {timeout:g} s", where=str(self.http.base_url))
            time.sleep(every)

    def models(self) -> list[str]:
        return [m["id"] for m in self._json("GET", "/v1/models")["data"]]

    @property
    def model(self) -> str:
        if self._model is None:
            self._model = self.models()[0]
        return self._model

    # ---- encoders ------------------------------------------------------------------------------
    def infer(self, inputs: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """POST /v1/infer (JSON; the server converts values to the recipe's dtypes)."""
        doc = self._json("POST", "/v1/infer", json={"inputs": {k: _array(v).tolist() for k, v in inputs.items()}})
        return {k: np.asarray(v, dtype=GM_NUMPY.get(doc["dtypes"][k], np.float32))
                for k, v in doc["outputs"].items()}

    def v2_metadata(self, model: str | None = None) -> dict[str, Any]:
        name = model or self.model
        if name not in self._meta:
            self._meta[name] = self._json("GET", f"/v2/models/{name}")
        return self._meta[name]

    def v2_infer(self, inputs: Mapping[str, Any], *, model: str | None = None,
                 outputs: list[str] | None = None) -> dict[str, np.ndarray]:
        """POST /v2/models/{model}/infer; inputs are cast to the model's datatypes where that is
        lossless in kind (ints to floats, f64 to f32), else sent as they are."""
        name = model or self.model
        types = {t["name"]: t["datatype"] for t in self.v2_metadata(name)["inputs"]}
        return v2_outputs(self._json("POST", f"/v2/models/{name}/infer", json=v2_request(inputs, types, outputs)))

    # ---- decoders ------------------------------------------------------------------------------
    def complete(self, prompt: Any, *, max_tokens: int | None = None, temperature: float | None = None,
                 **params: Any) -> Completion:
        """POST /v1/completions: `prompt` is text (when the model has a tokenizer), token ids, or a
        list of either; other parameters as OpenAI's (`top_p`, `top_k`, `seed`, `stop`, ...)."""
        body = completion_body(prompt, stream=False, max_tokens=max_tokens, temperature=temperature, **params)
        return parse_completion(self._json("POST", "/v1/completions", json=body))

    def stream(self, prompt: Any, *, max_tokens: int | None = None, temperature: float | None = None,
               **params: Any) -> Iterator[Chunk]:
        """The completion as server-sent events, one Chunk per event until `[DONE]`."""
        body = completion_body(prompt, stream=True, max_tokens=max_tokens, temperature=temperature, **params)
        with self.http.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code >= 400:
                r.read()
                raise _error(r)
            for line in r.iter_lines():
                ev = parse_event(line)
                if ev is True:
                    return
                if ev is not None:
                    yield ev


class AsyncClient:
    """The completion calls for asyncio (many concurrent streams on one connection pool)."""

    def __init__(self, url: str = "http://127.0.0.1:8000", *, timeout: float = 300.0, max_connections: int = 1000):
        self.http = httpx.AsyncClient(base_url=url.rstrip("/"), timeout=timeout,
                                      limits=httpx.Limits(max_connections=max_connections,
                                                          max_keepalive_connections=max_connections))

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.http.aclose()

    async def complete(self, prompt: Any, **params: Any) -> Completion:
        r = await self.http.post("/v1/completions", json=completion_body(prompt, stream=False, **params))
        if r.status_code >= 400:
            raise _error(r)
        return parse_completion(r.json())

    async def stream(self, prompt: Any, **params: Any) -> AsyncIterator[Chunk]:
        async with self.http.stream("POST", "/v1/completions",
                                    json=completion_body(prompt, stream=True, **params)) as r:
            if r.status_code >= 400:
                await r.aread()
                raise _error(r)
            async for line in r.aiter_lines():
                ev = parse_event(line)
                if ev is True:
                    return
                if ev is not None:
                    yield ev
