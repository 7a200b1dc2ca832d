"""Request and response bodies of `POST /v1/infer`.

Two encodings:

* JSON (`application/json`): `{"inputs": {"name": <nested list>, ...}}`; a value may also be
  `{"data": <flat or nested list>, "shape": [..], "dtype": "f32"}` (dtype optional, must
  match the recipe). Numbers are converted to the recipe's dtype: integer inputs refuse
  fractional numbers, float inputs refuse booleans, bool inputs take only true/false.
* safetensors (`application/octet-stream` or `application/vnd.safetensors`): one tensor
  per input, named like the recipe's inputs, dtypes exactly the recipe's.

The answer uses the request's encoding unless `Accept` asks for the other one
(`application/json` / `application/octet-stream`). Bad bodies raise `BadRequest`, which the
app turns into a 4xx with a JSON body; nothing here raises anything else.
"""
from __future__ import annotations

import json
import math
from typing import Any, Mapping

import torch

from graphmode.serve.errors import BadRequest

JSON_TYPES = ("application/json", "text/json")
BINARY_TYPES = ("application/octet-stream", "application/vnd.safetensors")
INT_RANGE = {torch.int64: (-2**63, 2**63 - 1), torch.int32: (-2**31, 2**31 - 1),
             torch.int16: (-2**15, 2**15 - 1), torch.int8: (-128, 127), torch.uint8: (0, 255)}


def media_type(content_type: str | None) -> str:
    """'application/json; charset=utf-8' -> 'application/json'."""
    return (content_type or "").split(";", 1)[0].strip().lower()


def body_kind(content_type: str | None) -> str:
    """'json' or 'safetensors' for a request body; BadRequest 415 for anything else."""
    mt = media_type(content_type)
    if mt in ("", "application/x-www-form-urlencoded") or mt in JSON_TYPES or mt.endswith("+json"):
        # (curl -d sends the form type: its body is read as JSON too)
        return "json"
    if mt in BINARY_TYPES:
        return "safetensors"
    raise BadRequest(f"unsupported content type {mt!r}", status=415, reason="unsupported_media_type",
                     where="Content-Type", fix="send application/json or application/octet-stream "
                                               "(safetensors bytes)")


def answer_kind(request_kind: str, accept: str | None) -> str:
    acc = (accept or "").lower()
    if request_kind == "json":
        return "safetensors" if any(t in acc for t in BINARY_TYPES) and "json" not in acc else "json"
    return "json" if "application/json" in acc and "octet-stream" not in acc else "safetensors"


# ---- decoding -------------------------------------------------------------------------------

def _torch_dtype(name: str) -> torch.dtype:
    from graphmode.ir.types import DTYPES
    if name not in DTYPES:
        raise BadRequest(f"the recipe's dtype {name!r} cannot be served", status=422, reason="input",
                         fix=f"serve inputs of dtype {', '.join(DTYPES)}")
    return DTYPES[name]


def _shape_of_nested(value: Any, name: str) -> None:
    """Reject ragged / non-numeric nesting with a message that says where."""
    if isinstance(value, list):
        if value and isinstance(value[0], list):
            n = len(value[0])
            for i, row in enumerate(value):
                if not isinstance(row, list) or len(row) != n:
                    got = len(row) if isinstance(row, list) else type(row).__name__
                    raise BadRequest(f"input {name!r} is ragged: row {i} has {got} entries, row 0 has {n}",
                                     status=422, reason="input", where=f"inputs.{name}",
                                     fix="send a rectangular nested list")


def _json_tensor(name: str, value: Any, dtype: torch.dtype) -> torch.Tensor:
    shape = None
    if isinstance(value, dict):
        extra = sorted(set(value) - {"data", "shape", "dtype"})
        if extra or "data" not in value:
            raise BadRequest(f"input {name!r} as an object needs a 'data' key (and optionally 'shape', 'dtype')",
                             status=422, reason="input", where=f"inputs.{name}",
                             value=extra or sorted(value), fix='send {"data": [...], "shape": [...]} or a nested list')
        if "dtype" in value:
            from graphmode.ir.types import TORCH_TO_DTYPE
            want = TORCH_TO_DTYPE.get(dtype, str(dtype))
            from graphmode.recipe.schema import DTYPE_ALIASES
            got = value["dtype"]
            got_n = DTYPE_ALIASES.get(str(got).lower(), str(got).lower())
            if got_n != want:
                raise BadRequest(f"input {name!r} has dtype {got!r}, the recipe declares {want}", status=422,
                                 reason="input", where=f"inputs.{name}.dtype", value=got,
                                 fix=f"send {want} values (or leave dtype out)")
        shape = value.get("shape")
        if shape is not None and (not isinstance(shape, list)
                                  or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0
                                             for s in shape)):
            raise BadRequest(f"input {name!r}: 'shape' must be a list of non-negative integers", status=422,
                             reason="input", where=f"inputs.{name}.shape", value=shape)
        value = value["data"]
    if not isinstance(value, list):
        raise BadRequest(f"input {name!r} must be a (nested) list of numbers", status=422, reason="input",
                         where=f"inputs.{name}", value=type(value).__name__)
    _shape_of_nested(value, name)
    try:
        t = torch.tensor(value)
    except (ValueError, TypeError, RuntimeError, OverflowError) as e:
        raise BadRequest(f"input {name!r} is not a rectangular array of numbers: {e}", status=422,
                         reason="input", where=f"inputs.{name}",
                         fix="send a nested list of numbers with equal-length rows") from None
    if t.numel() == 0:
        pass                                  # empty: nothing to check; the shape check refuses it
    elif dtype == torch.bool:
        if t.dtype != torch.bool:
            raise BadRequest(f"input {name!r} is bool: send true/false", status=422, reason="input",
                             where=f"inputs.{name}.dtype", value=str(t.dtype).replace("torch.", ""))
    elif not dtype.is_floating_point:
        if t.dtype.is_floating_point or t.dtype == torch.bool:
            raise BadRequest(f"input {name!r} holds integers ({str(dtype).replace('torch.', '')}); got "
                             f"{'booleans' if t.dtype == torch.bool else 'fractional numbers'}", status=422,
                             reason="input", where=f"inputs.{name}.dtype",
                             fix="send whole numbers (no decimal point)")
        lo, hi = INT_RANGE.get(dtype, (None, None))
        if lo is not None and t.numel() and (int(t.min()) < lo or int(t.max()) > hi):
            raise BadRequest(f"input {name!r} has values outside {str(dtype).replace('torch.', '')} "
                             f"[{lo}, {hi}]", status=422, reason="input", where=f"inputs.{name}",
                             value=(int(t.min()), int(t.max())))
    elif t.dtype == torch.bool:
        raise BadRequest(f"input {name!r} holds floats; got booleans", status=422, reason="input",
                         where=f"inputs.{name}.dtype")
    t = t.to(dtype)
    if shape is not None:
        if math.prod(shape) != t.numel():
            raise BadRequest(f"input {name!r}: 'shape' {shape} needs {math.prod(shape)} values, got {t.numel()}",
                             status=422, reason="input", where=f"inputs.{name}.shape", value=shape)
        t = t.reshape(shape)
    return t


def decode_json(body: bytes, dtypes: Mapping[str, str]) -> dict[str, torch.Tensor]:
    """JSON body -> {input: tensor} in the recipe's dtypes (`dtypes`: input name -> recipe dtype).
    Names are not checked here (the contract check names the unknown and missing ones)."""
    try:
        doc = json.loads(body)
    except json.JSONDecodeError as e:
        raise BadRequest(f"malformed JSON: {e.msg} at line {e.lineno} column {e.colno}", reason="malformed_json",
                         where="body", fix='send {"inputs": {"name": [[...]], ...}}') from None
    except UnicodeDecodeError:
        raise BadRequest("the body is not UTF-8 text", reason="malformed_json", where="body") from None
    except RecursionError:
        raise BadRequest("JSON nested too deeply", reason="malformed_json", where="body") from None
    if not isinstance(doc, dict) or "inputs" not in doc:
        raise BadRequest("the JSON body must be an object with an 'inputs' object",
                         reason="malformed_body", where="body",
                         value=sorted(doc)[:10] if isinstance(doc, dict) else type(doc).__name__,
                         fix='send {"inputs": {"name": [[...]], ...}}')
    extra = sorted(set(doc) - {"inputs"})
    if extra:
        raise BadRequest(f"unknown top-level key(s) {extra}", reason="malformed_body", where="body",
                         fix="the body holds only 'inputs'")
    inputs = doc["inputs"]
    if not isinstance(inputs, dict):
        raise BadRequest("'inputs' must be an object mapping input names to tensors",
                         reason="malformed_body", where="inputs", value=type(inputs).__name__)
    out = {}
    for name, value in inputs.items():
        if name not in dtypes:
            raise BadRequest(f"unknown input {name!r}", status=422, reason="input", where=f"inputs.{name}",
                             fix=f"the recipe declares {', '.join(dtypes)}")
        out[name] = _json_tensor(name, value, _torch_dtype(dtypes[name]))
    return out


def decode_safetensors(body: bytes, dtypes: Mapping[str, str]) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load
    if not body:
        raise BadRequest("empty body", reason="malformed_body", where="body",
                         fix="send safetensors bytes (safetensors.torch.save({...}))")
    try:
        tensors = load(body)
    except (SafetensorError, ValueError, RuntimeError, OSError) as e:
        raise BadRequest(f"not a safetensors buffer: {e}", reason="malformed_body", where="body",
                         fix="send the bytes of safetensors.torch.save({name: tensor, ...})") from None
    for name, t in tensors.items():
        if name not in dtypes:
            raise BadRequest(f"unknown input {name!r}", status=422, reason="input", where=f"inputs.{name}",
                             fix=f"the recipe declares {', '.join(dtypes)}")
        want = _torch_dtype(dtypes[name])
        if t.dtype != want:
            raise BadRequest(f"input {name!r} has dtype {str(t.dtype).replace('torch.', '')}, the recipe "
                             f"declares {dtypes[name]}", status=422, reason="input",
                             where=f"inputs.{name}.dtype", fix=f"convert it: x.to({want})")
    return dict(tensors)


# ---- encoding -------------------------------------------------------------------------------

def _jsonable(t: torch.Tensor) -> Any:
    if t.dtype in (torch.float16, torch.bfloat16):
        t = t.float()
    return t.tolist()


def encode_json(result: Mapping[str, Any]) -> bytes:
    outs = result["outputs"]
    doc = {"outputs": {k: _jsonable(v) for k, v in outs.items()},
           "shapes": {k: list(v.shape) for k, v in outs.items()},
           "dtypes": {k: _dtype_name(v.dtype) for k, v in outs.items()},
           **{k: v for k, v in result.items() if k != "outputs"}}
    return json.dumps(doc, allow_nan=True, separators=(",", ":")).encode()


def _dtype_name(dt: torch.dtype) -> str:
    from graphmode.ir.types import TORCH_TO_DTYPE
    return TORCH_TO_DTYPE.get(dt, str(dt).replace("torch.", ""))


def encode_safetensors(result: Mapping[str, Any]) -> bytes:
    """Outputs as safetensors; the rest of the answer in its `__metadata__` (JSON strings)."""
    from safetensors.torch import save
    tensors = {k: v.detach().contiguous().clone() for k, v in result["outputs"].items()}
    meta = {k: json.dumps(v) for k, v in result.items() if k != "outputs"}
    return save(tensors, metadata=meta)
