"""The Open Inference Protocol (KServe v2, REST) over the server's deployments.

    GET  /v2                                     server metadata
    GET  /v2/health/live, /v2/health/ready       200 when true, 503 when not (ready: every bucket warm)
    GET  /v2/models/{name}[/versions/{v}]        model metadata: inputs and outputs (-1 = a dynamic dim)
    GET  /v2/models/{name}[/versions/{v}]/ready
    POST /v2/models/{name}[/versions/{v}]/infer  {"inputs": [{"name", "shape", "datatype", "data"}], ...}

`name` is the model's name or the serving recipe's, `v` the serving recipe version. An
inference request goes through the same contract check, dynamic batching and monitoring
as `POST /v1/infer`; `data` is row-major (flat or nested), converted like `/v1/infer`'s
JSON inputs (integers stay integers, non-finite values are refused), and the datatype must
be the recipe's. The answer's `outputs` hold flat row-major `data`; its `parameters` carry
the recipe version and the bucket that ran. Errors are the protocol's `{"error": message}`
with graphmode's `type`, `where`, `value`, `fix` and `status` alongside. The binary tensor
extension is not implemented (415).
"""
from __future__ import annotations

import logging
from typing import Any

import torch
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

import graphmode
from graphmode.errors import ContractViolation, GraphmodeError
from graphmode.ir.graph import declared_name
from graphmode.ir.types import DTYPES, TORCH_TO_DTYPE
from graphmode.serve.app import read_body
from graphmode.serve.codec import _json_tensor, body_kind, clip, dumps, parse_json
from graphmode.serve.errors import BadRequest, NotReady, ServeError, error_dict, http_status

log = logging.getLogger("graphmode.serve")
V2_DTYPES = {"BOOL": "bool", "UINT8": "u8", "INT8": "i8", "INT16": "i16", "INT32": "i32", "INT64": "i64",
             "FP16": "f16", "BF16": "bf16", "FP32": "f32", "FP64": "f64"}
GM_TO_V2 = {v: k for k, v in V2_DTYPES.items()}
USAGE = '{"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}'


def v2_error(e: BaseException) -> Response:
    status = http_status(e)
    d = error_dict(e)
    body = {**d, "error": d.get("message") or d.get("error"), "type": d.get("error"), "status": status}
    headers = {k: v for k, v in (getattr(e, "headers", None) or {}).items()}
    if status == 503:
        headers["Retry-After"] = "1"
    return Response(dumps(body), status_code=status, headers=headers, media_type="application/json")


def _json(doc: Any, status: int = 200) -> Response:
    return Response(dumps(doc), status_code=status, media_type="application/json")


def _bad(where: str, message: str, value: Any = None, fix: str | None = None) -> BadRequest:
    return BadRequest(message, reason="malformed_body", where=where,
                      value=value, fix=fix or f"send {USAGE}")


def parse_infer(body: bytes, dtypes: dict[str, str], outputs: list[str]) -> tuple[Any, dict[str, torch.Tensor],
                                                                                  list[str] | None]:
    """(request id, {input: tensor}, the outputs asked for or None for all) from a v2 request."""
    if not body.strip():
        raise BadRequest("empty body", reason="malformed_body", where="body", fix=f"send {USAGE}")
    # NaN / Infinity read as numbers, as /v1/infer reads them: refused with the input and index they
    # sit at (the contract's value check), where the parser said only "NaN is not a JSON value"
    doc = parse_json(body, f"send {USAGE}")
    if not isinstance(doc, dict):
        raise _bad("body", "the body must be a JSON object")
    extra = sorted(set(doc) - {"id", "parameters", "inputs", "outputs"})
    if extra:
        raise _bad("body", f"unknown field(s) {[clip(k, 40) for k in extra[:5]]}",
                   fix="an inference request holds id, parameters, inputs and outputs")
    if not isinstance(doc.get("inputs"), list) or not doc["inputs"]:
        raise _bad("inputs", "inputs must be a non-empty list of tensors")
    if doc.get("parameters") is not None and not isinstance(doc["parameters"], dict):
        raise _bad("parameters", "parameters must be an object", doc["parameters"])
    tensors: dict[str, torch.Tensor] = {}
    for i, t in enumerate(doc["inputs"]):
        where = f"inputs[{i}]"
        if not isinstance(t, dict) or set(t) - {"name", "shape", "datatype", "data", "parameters"} \
                or not {"name", "shape", "datatype", "data"} <= set(t):
            raise _bad(where, "a tensor is an object with name, shape, datatype and data (and parameters)",
                       sorted(t) if isinstance(t, dict) else type(t).__name__)
        name, dt = t["name"], t["datatype"]
        if not isinstance(name, str) or name in tensors:
            raise _bad(f"{where}.name", "each input needs its own name (a string)", name)
        if t.get("parameters") is not None and not isinstance(t["parameters"], dict):
            raise _bad(f"{where}.parameters", "parameters must be an object", t["parameters"])
        if (t.get("parameters") or {}).get("binary_data_size") is not None:
            raise BadRequest("the binary tensor extension is not supported", status=415,
                             reason="unsupported_media_type", where=f"{where}.parameters.binary_data_size",
                             fix="send the tensor's values in data (JSON)")
        name = declared_name(name, dtypes) or name     # an ONNX model's own spelling ("x:0" of x_0)
        if name not in dtypes:
            raise BadRequest(f"input {clip(name)!r} is not an input of the recipe", status=422, reason="input",
                             where=f"{where}.name", fix=f"the recipe declares {', '.join(dtypes)}")
        want = GM_TO_V2.get(dtypes[name], dtypes[name])
        if dt != want:
            raise BadRequest(f"input {clip(name)!r} has datatype {clip(dt, 20)!r}, the recipe declares {want}",
                             status=422, reason="input", where=f"{where}.datatype", fix=f"send {want}")
        try:
            tensors[name] = _json_tensor(name, {"data": t["data"], "shape": t["shape"]}, DTYPES[dtypes[name]])
        except BadRequest as e:                   # named as this protocol names the tensor
            e.where = where + (e.where or "").removeprefix(f"inputs.{name}")
            e.fix = e.fix or f"send data with as many {want} values as shape's dims multiply to, row-major"
            raise
    wanted = doc.get("outputs")
    if wanted is not None:
        if not isinstance(wanted, list) or not all(isinstance(o, dict) and isinstance(o.get("name"), str)
                                                   for o in wanted):
            raise _bad("outputs", 'outputs must be a list of {"name": ...}', wanted)
        wanted = [o["name"] for o in wanted]
        unknown = [n for n in wanted if n not in outputs]
        if unknown:
            raise _bad("outputs", f"unknown output(s) {[clip(n, 40) for n in unknown[:5]]}",
                       fix=f"the model's outputs are {', '.join(outputs)}")
    return doc.get("id"), tensors, wanted


def encode_infer(result: dict[str, Any], wanted: list[str] | None, req_id: Any, model: str) -> bytes:
    outs = result["outputs"]
    tensors = []
    for name in (wanted if wanted is not None else list(outs)):
        t = outs[name]
        data = (t.float() if t.dtype in (torch.float16, torch.bfloat16) else t).reshape(-1).tolist()
        tensors.append({"name": name, "datatype": GM_TO_V2.get(TORCH_TO_DTYPE.get(t.dtype, ""), str(t.dtype)),
                        "shape": list(t.shape), "data": data})
    bucket = result.get("bucket")
    doc: dict[str, Any] = {"model_name": model, "model_version": result["recipe_version"], "outputs": tensors,
                           "parameters": {"recipe_version": result["recipe_version"],
                                          "bucket": ",".join(f"{k}={v}" for k, v in sorted(bucket.items()))
                                          if bucket else "eager",
                                          "latency_ms": result.get("latency_ms")}}
    if req_id is not None:
        doc["id"] = req_id
    return dumps(doc)


def _tensor_meta(name: str, dtype: str, shape: Any) -> dict[str, Any]:
    return {"name": name, "datatype": GM_TO_V2.get(dtype, dtype),
            "shape": [d if isinstance(d, int) else -1 for d in shape]}


def kserve_routes(server: Any) -> list[Route]:
    cfg = server.config

    def deployment(request: Request) -> Any:
        name = request.path_params["name"]
        if name not in server.model_names():
            raise BadRequest(f"model {clip(name, 60)!r} is not served here", status=404, reason="model_not_found",
                             where="name", fix=f"the model is {server.model_names()[0]!r}")
        dep = server.current()
        version = request.path_params.get("version")
        if version is not None and version != dep.version:
            raise BadRequest(f"version {clip(version, 40)!r} is not serving", status=404, reason="model_not_found",
                             where="version", fix=f"the serving recipe version is {dep.version}")
        return dep

    def ready() -> bool:
        return server.state == "ready" and server.active is not None

    async def server_meta(request: Request) -> Response:
        return _json({"name": "graphmode", "version": graphmode.__version__, "extensions": []})

    async def live(request: Request) -> Response:
        return _json({"live": server.state != "failed"}, 200 if server.state != "failed" else 503)

    async def server_ready(request: Request) -> Response:
        return _json({"ready": ready()}, 200 if ready() else 503)

    async def model_meta(request: Request) -> Response:
        from graphmode.verdict import user_output_types
        try:
            dep = deployment(request)
            await server.whole_sequence(dep)        # a decoder's outputs: its whole-sequence graph's
        except GraphmodeError as e:                  # ServeErrors, and a recipe that graph refuses (422)
            return v2_error(e)
        g = dep.cm.graph          # a tensor-parallel group holds none: rank 0 reported its outputs' types
        # the model's outputs (a data-dependent tail's, where it has one), not its in-place updates
        types = [(t.dtype, t.shape) for t in user_output_types(g, dep.cm)] if g is not None \
            else list(getattr(dep.cm, "output_types", None) or [])
        outputs = [_tensor_meta(n, dtype, shape) for n, (dtype, shape) in zip(dep.names_for(len(types)), types)]
        return _json({"name": request.path_params["name"], "versions": [dep.version], "platform": "graphmode",
                      "parameters": {"recipe_name": dep.name, "decoder": dep.decoder is not None},
                      "inputs": [_tensor_meta(i.name, i.dtype, i.shape) for i in dep.recipe.inputs],
                      "outputs": outputs})

    async def model_ready(request: Request) -> Response:
        try:
            deployment(request)
        except NotReady:
            return _json({"name": request.path_params["name"], "ready": False}, 503)
        except ServeError as e:
            return v2_error(e)
        return _json({"name": request.path_params["name"], "ready": ready()}, 200 if ready() else 503)

    async def infer(request: Request) -> Response:
        dep = None
        try:
            dep = deployment(request)
            if body_kind(request.headers.get("content-type")) != "json" \
                    or "inference-header-content-length" in request.headers:
                raise BadRequest("the binary tensor extension is not supported", status=415,
                                 reason="unsupported_media_type", where="Content-Type",
                                 fix="send application/json with each tensor's values in data")
            body = await read_body(request, server.max_body_bytes, cfg.body_timeout_s)
            await server.whole_sequence(dep)        # the output names parse_infer checks are its graph's
            req_id, inputs, wanted = await run_in_threadpool(parse_infer, body, dep.dtypes, dep.output_names)
            result = await server.infer(dep, inputs)
            return Response(await run_in_threadpool(encode_infer, result, wanted, req_id, request.path_params["name"]),
                            media_type="application/json")
        except ClientDisconnect:
            return Response(status_code=400)
        except ServeError as e:
            if e.status == 422 and dep is not None:
                dep.monitor.refused("input")
            elif e.status != 422:
                server.metrics.bad_requests.labels(server.target_name, e.reason).inc()
            return v2_error(e)
        except ContractViolation as e:            # already counted by the deployment
            return v2_error(e)
        except GraphmodeError as e:               # a recipe the whole-sequence graph refuses (422)
            return v2_error(e)
        except Exception as e:  # noqa: BLE001 - answered, logged, and the server keeps going
            log.exception("v2 infer failed")
            return v2_error(e)

    routes = [Route("/v2", server_meta, methods=["GET"]),
              Route("/v2/health/live", live, methods=["GET"]),
              Route("/v2/health/ready", server_ready, methods=["GET"])]
    for base in ("/v2/models/{name}", "/v2/models/{name}/versions/{version}"):
        routes += [Route(base, model_meta, methods=["GET"]),
                   Route(f"{base}/ready", model_ready, methods=["GET"]),
                   Route(f"{base}/infer", infer, methods=["POST"])]
    return routes
