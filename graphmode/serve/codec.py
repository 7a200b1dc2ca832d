"""Request and response bodies of `POST /v1/infer`, and the JSON every answer is written in.

Two encodings:

* JSON (`application/json`): `{"inputs": {"name": <nested list>, ...}}`; a value may also be
  `{"data": <flat or nested list>, "shape": [..], "dtype": "f32"}` (dtype optional, must
  match the recipe). Numbers are converted to the recipe's dtype: integer inputs take only
  whole JSON numbers within the dtype's range, float inputs take numbers but not booleans,
  bool inputs take only true/false. Non-finite values (`NaN`, `Infinity`, or a number the
  dtype cannot hold, such as 1e308 for f32) are refused, naming the input and the index.
* safetensors (`application/octet-stream` or `application/vnd.safetensors`): one tensor
  per input, named like the recipe's inputs, dtypes exactly the recipe's, finite values.

The answer uses the request's encoding unless `Accept` asks for the other one
(`application/json` / `application/octet-stream`). Every JSON answer is strict JSON
(RFC 8259, `dumps`): a non-finite output value is written as the string `"NaN"`,
`"Infinity"` or `"-Infinity"` (the protobuf JSON mapping's spelling); safetensors answers
carry such values bit-exact. Bad bodies raise `BadRequest`, which the app turns into a 4xx
with a JSON body; nothing here raises anything else.
"""
from __future__ import annotations

import itertools
import json
import re
import math
from typing import Any, Mapping

import torch

from graphmode.serve.errors import BadRequest

JSON_TYPES = ("application/json", "text/json")
BINARY_TYPES = ("application/octet-stream", "application/vnd.safetensors")
INT_RANGE = {torch.int64: (-2**63, 2**63 - 1), torch.int32: (-2**31, 2**31 - 1),
             torch.int16: (-2**15, 2**15 - 1), torch.int8: (-128, 127), torch.uint8: (0, 255)}
MAX_RANK = 16
NON_FINITE = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}
JSON_KINDS = {str: "strings", type(None): "null", dict: "objects", bool: "booleans",
              float: "numbers written with a decimal point or an exponent (3.0, 1e3)", int: "integers"}


def media_type(content_type: str | None) -> str:
    """'application/json; charset=utf-8' -> 'application/json'."""
    return (content_type or "").split(";", 1)[0].strip().lower()


def body_kind(content_type: str | None, json_only: bool = False) -> str:
    """'json' or 'safetensors' for a request body; BadRequest 415 for anything else (or, with
    `json_only`, an endpoint that reads JSON only: anything but JSON)."""
    mt = media_type(content_type)
    if mt in ("", "application/x-www-form-urlencoded") or mt in JSON_TYPES or mt.endswith("+json"):
        # (curl -d sends the form type: its body is read as JSON too)
        return "json"
    if mt in BINARY_TYPES and not json_only:
        return "safetensors"
    raise BadRequest(f"unsupported content type {clip(mt)!r}", status=415, reason="unsupported_media_type",
                     where="Content-Type", fix="send application/json" if json_only else
                     "send application/json or application/octet-stream (safetensors bytes)")


def answer_kind(request_kind: str, accept: str | None) -> str:
    acc = (accept or "").lower()
    if request_kind == "json":
        return "safetensors" if any(t in acc for t in BINARY_TYPES) and "json" not in acc else "json"
    return "json" if "application/json" in acc and "octet-stream" not in acc else "safetensors"


def clip(s: Any, limit: int = 80) -> str:
    """A client-supplied string as an error message quotes it: at most `limit` characters."""
    s = str(s)
    return s if len(s) <= limit else s[:limit] + "..."


# ---- strict JSON out ----------------------------------------------------------------------------

def dumps(doc: Any) -> bytes:
    """`doc` as strict JSON: non-finite floats become "NaN" / "Infinity" / "-Infinity", and
    anything else JSON cannot hold becomes a string, so an answer is never invalid JSON."""
    try:
        return json.dumps(doc, allow_nan=False, separators=(",", ":"), default=_as_text).encode()
    except ValueError:                       # a non-finite float, or an int too long to print
        return json.dumps(_strict(doc), allow_nan=False, separators=(",", ":"), default=_as_text).encode()


def _strict(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return NON_FINITE[repr(v)]
    if isinstance(v, int) and not isinstance(v, bool) and v.bit_length() > 14_000:
        return f"<an integer of {v.bit_length()} bits>"
    if isinstance(v, dict):
        return {str(k): _strict(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_strict(x) for x in v]
    return v


def _as_text(o: Any) -> str:
    try:
        return str(o)
    except Exception:  # noqa: BLE001 - an error answer must still be written
        return f"<{type(o).__name__}>"


# ---- decoding -------------------------------------------------------------------------------

def _torch_dtype(name: str) -> torch.dtype:
    from graphmode.ir.types import DTYPES
    if name not in DTYPES:
        raise BadRequest(f"the recipe's dtype {name!r} cannot be served", status=422, reason="input",
                         fix=f"serve inputs of dtype {', '.join(DTYPES)}")
    return DTYPES[name]


def _dtype_label(dtype: torch.dtype) -> str:
    from graphmode.ir.types import TORCH_TO_DTYPE
    return TORCH_TO_DTYPE.get(dtype, str(dtype).replace("torch.", ""))


def _refuse(name: str, message: str, *, where: str = "", **kw: Any) -> BadRequest:
    return BadRequest(f"input {clip(name)!r} {message}", status=422, reason="input",
                      where=f"inputs.{clip(name)}{where}", **kw)


def _scan(value: list, name: str) -> tuple[list[int], set[type]]:
    """The shape of a rectangular nested list and the types of its leaves, level by level
    (C-speed `map`s, no recursion); refuses ragged nesting, saying at which depth."""
    shape: list[int] = []
    level: list[Any] = [value]
    while True:
        kinds = set(map(type, level))
        if list not in kinds:
            return shape, kinds
        if len(kinds) > 1:
            raise _refuse(name, f"mixes lists and numbers at depth {len(shape)}",
                          fix="send a rectangular nested list")
        lengths = set(map(len, level))
        if len(lengths) > 1:
            raise _refuse(name, f"is ragged: rows at depth {len(shape)} have {sorted(lengths)[:4]} entries",
                          fix="send a rectangular nested list")
        shape.append(lengths.pop())
        if len(shape) > MAX_RANK:
            raise _refuse(name, f"is nested more than {MAX_RANK} deep", fix="send a tensor of lower rank")
        level = list(itertools.chain.from_iterable(level))
        if not level:
            return shape, set()


def _kinds(kinds: set[type]) -> str:
    return ", ".join(sorted(JSON_KINDS.get(k, k.__name__) for k in kinds))


def _first_bad(ok: torch.Tensor) -> list[int]:
    return [int(i) for i in (~ok).nonzero()[0].tolist()]


def _floats(name: str, value: list, dtype: torch.dtype) -> torch.Tensor:
    try:
        wide = torch.tensor(value, dtype=torch.float64)
    except (OverflowError, RuntimeError, ValueError):
        raise _refuse(name, "holds a number too large for a float", fix="send finite numbers") from None
    finite = torch.isfinite(wide)
    if not bool(finite.all()):
        at = _first_bad(finite)
        bad = float(wide[tuple(at)])
        raise _refuse(name, f"holds {NON_FINITE[repr(bad)]} at index {at}; only finite numbers are accepted",
                      value=NON_FINITE[repr(bad)], fix="send finite numbers (replace NaN/Infinity before sending)")
    t = wide.to(dtype)
    fits = torch.isfinite(t)
    if not bool(fits.all()):
        at = _first_bad(fits)
        raise _refuse(name, f"holds {float(wide[tuple(at)])!r} at index {at}, outside the range of "
                            f"{_dtype_label(dtype)} (largest {torch.finfo(dtype).max:.4g})",
                      value=float(wide[tuple(at)]), fix=f"send values within +-{torch.finfo(dtype).max:.4g}")
    return t


def _ints(name: str, value: list, dtype: torch.dtype) -> torch.Tensor:
    lo, hi = INT_RANGE.get(dtype, INT_RANGE[torch.int64])
    label = _dtype_label(dtype)
    try:
        t = torch.tensor(value, dtype=torch.int64)
    except (OverflowError, RuntimeError, ValueError):
        raise _refuse(name, f"has values outside {label} [{lo}, {hi}]", fix=f"send integers within [{lo}, {hi}]") \
            from None
    if t.numel() and (int(t.min()) < lo or int(t.max()) > hi):
        raise _refuse(name, f"has values outside {label} [{lo}, {hi}]", value=(int(t.min()), int(t.max())),
                      fix=f"send integers within [{lo}, {hi}]")
    return t.to(dtype)


def _json_tensor(name: str, value: Any, dtype: torch.dtype) -> torch.Tensor:
    shape = None
    if isinstance(value, dict):
        extra = sorted(set(value) - {"data", "shape", "dtype"})
        if extra or "data" not in value:
            raise _refuse(name, "as an object needs a 'data' key (and optionally 'shape', 'dtype')",
                          value=[clip(k) for k in (extra or sorted(value))[:10]],
                          fix='send {"data": [...], "shape": [...]} or a nested list')
        if "dtype" in value:
            from graphmode.recipe.schema import DTYPE_ALIASES
            want = _dtype_label(dtype)
            got = clip(value["dtype"])
            if DTYPE_ALIASES.get(got.lower(), got.lower()) != want:
                raise _refuse(name, f"has dtype {got!r}, the recipe declares {want}", where=".dtype",
                              fix=f"send {want} values (or leave dtype out)")
        shape = value.get("shape")
        if shape is not None and (not isinstance(shape, list) or len(shape) > MAX_RANK
                                  or not all(type(s) is int and s >= 0 for s in shape)):
            raise _refuse(name, f"'shape' must be a list of at most {MAX_RANK} non-negative integers",
                          where=".shape", value=clip(shape), fix="send e.g. \"shape\": [2, 16], or leave it out")
        value = value["data"]
    if not isinstance(value, list):
        raise _refuse(name, "must be a (nested) list of numbers", value=type(value).__name__,
                      fix='send a nested list, or {"data": [...], "shape": [...]}')
    _, kinds = _scan(value, name)
    if dtype == torch.bool:
        if kinds - {bool}:
            raise _refuse(name, f"is bool: send true/false; got {_kinds(kinds - {bool})}", where=".dtype",
                          fix="send true/false values")
        t = torch.tensor(value, dtype=torch.bool)
    elif not dtype.is_floating_point:
        if kinds - {int}:
            got = _kinds(kinds - {int})
            if kinds - {int} == {float}:         # NaN / Infinity (or 1e400) read as floats: name the value
                t = torch.tensor(value, dtype=torch.float64)
                odd = ~torch.isfinite(t)
                if bool(odd.any()):
                    where = _first_bad(~odd)
                    raise _refuse(name, f"holds {float(t[tuple(where)])} at index {where}; integers "
                                        f"({_dtype_label(dtype)}) are finite", where=".dtype",
                                  fix="send whole numbers (no NaN, Infinity or exponent)")
            raise _refuse(name, f"holds integers ({_dtype_label(dtype)}); got {got}", where=".dtype",
                          fix="send whole numbers (no decimal point)")
        t = _ints(name, value, dtype)
    else:
        if bool in kinds:
            raise _refuse(name, "holds floats; got booleans", where=".dtype", fix="send numbers, not true/false")
        if kinds - {int, float}:
            raise _refuse(name, f"holds {_kinds(kinds - {int, float})}; send numbers",
                          fix="send a nested list of numbers")
        t = _floats(name, value, dtype)
    if shape is not None:
        need = math.prod(shape)
        if need != t.numel():
            raise _refuse(name, f"'shape' needs {need if need < 2**63 else 'more than 2**63'} values, "
                                f"got {t.numel()}", where=".shape", value=clip(shape),
                          fix="make 'shape' multiply out to the number of values in 'data'")
        t = t.reshape(shape)
    return t


def parse_json(body: bytes, fix: str, parse_constant: Any = None) -> Any:
    """`body` as a JSON document, or a BadRequest saying why not (`fix` for a syntax error):
    not UTF-8, nested too deeply, an integer of thousands of digits. `parse_constant` sees
    NaN / Infinity (None: accepted here, refused later with the index they sit at)."""
    try:
        doc = json.loads(body, object_pairs_hook=_once_each, **({"parse_constant": parse_constant} if parse_constant
                                                                 else {}))
    except _DuplicateKey as e:
        raise BadRequest(f"the key {clip(e.args[0], 40)!r} appears twice in one object", reason="malformed_json",
                         where="body", value=clip(e.args[0], 40),
                         fix="send each key once (which of the two a JSON parser keeps depends on it)") from None
    except json.JSONDecodeError as e:
        raise BadRequest(f"malformed JSON: {e.msg} at line {e.lineno} column {e.colno}", reason="malformed_json",
                         where="body", fix=fix) from None
    except UnicodeDecodeError:
        raise BadRequest("the body is not UTF-8 text", reason="malformed_json", where="body",
                         fix="send UTF-8 encoded JSON") from None
    except RecursionError:
        raise BadRequest("JSON nested too deeply", reason="malformed_json", where="body",
                         fix="send a document nested at most a few hundred levels") from None
    except ValueError as e:                   # an integer literal of more than 4300 digits
        raise BadRequest(f"malformed JSON: {clip(e, 120)}", reason="malformed_json", where="body",
                         fix="send numbers of at most a few dozen digits") from None
    if _SURROGATE.search(body) and not _all_text(doc):
        raise BadRequest("a string holds a lone UTF-16 surrogate (\\ud800-\\udfff without its pair): it is not "
                         "text", reason="malformed_json", where="body",
                         fix="send valid Unicode (a character outside the BMP as its \\ud8xx\\udcxx pair)")
    return doc


class _DuplicateKey(ValueError):
    pass


def _once_each(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose keys are distinct: `{"input_ids": a, "input_ids": b}` kept b silently."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        raise _DuplicateKey(next(k for k, _ in pairs if k in seen or seen.add(k)))
    return out


# an escaped surrogate in the raw body: only then are the strings walked (a tokenizer raised a
# TypeError on a lone one: HTTP 500)
_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def _all_text(doc: Any) -> bool:
    """Every string in `doc` (keys too) encodes as UTF-8: no lone surrogate."""
    stack = [doc]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return False
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return True


def decode_json(body: bytes, dtypes: Mapping[str, str]) -> dict[str, torch.Tensor]:
    """JSON body -> {input: tensor} in the recipe's dtypes (`dtypes`: input name -> recipe dtype).
    Names are not checked here (the contract check names the unknown and missing ones)."""
    doc = parse_json(body, 'send {"inputs": {"name": [[...]], ...}}')
    if not isinstance(doc, dict) or "inputs" not in doc:
        raise BadRequest("the JSON body must be an object with an 'inputs' object",
                         reason="malformed_body", where="body",
                         value=[clip(k) for k in sorted(doc)[:10]] if isinstance(doc, dict) else type(doc).__name__,
                         fix='send {"inputs": {"name": [[...]], ...}}')
    extra = sorted(set(doc) - {"inputs"})
    if extra:
        raise BadRequest(f"unknown top-level key(s) {[clip(k) for k in extra[:10]]}", reason="malformed_body",
                         where="body", fix="the body holds only 'inputs'")
    inputs = doc["inputs"]
    if not isinstance(inputs, dict):
        raise BadRequest("'inputs' must be an object mapping input names to tensors",
                         reason="malformed_body", where="inputs", value=type(inputs).__name__,
                         fix='send {"inputs": {"<input name>": [[...]], ...}}')
    out = {}
    for name, value in inputs.items():
        name = _declared(name, dtypes)
        out[name] = _json_tensor(name, value, _torch_dtype(dtypes[name]))
    return out


def _declared(name: str, dtypes: Mapping[str, str]) -> str:
    """The recipe's name of input `name`: itself, or an ONNX model's own spelling ("x:0") of the
    recipe's "x_0"."""
    from graphmode.ir.graph import declared_name
    found = declared_name(name, dtypes)
    if found is not None:
        return found
    raise _refuse(name, "is not an input of the recipe", fix=f"the recipe declares {', '.join(dtypes)}")


def decode_safetensors(body: bytes, dtypes: Mapping[str, str]) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load
    if not body:
        raise BadRequest("empty body", reason="malformed_body", where="body",
                         fix="send safetensors bytes (safetensors.torch.save({...}))")
    try:
        tensors = load(body)
    except (SafetensorError, ValueError, RuntimeError, OSError, TypeError, OverflowError) as e:
        raise BadRequest(f"not a safetensors buffer: {clip(e, 200)}", reason="malformed_body", where="body",
                         fix="send the bytes of safetensors.torch.save({name: tensor, ...})") from None
    for name, t in list(tensors.items()):
        declared = _declared(name, dtypes)
        if declared != name:
            tensors[declared] = tensors.pop(name)
        name = declared
        want = _torch_dtype(dtypes[name])
        if t.dtype != want:
            raise _refuse(name, f"has dtype {_dtype_label(t.dtype)}, the recipe declares {dtypes[name]}",
                          where=".dtype", fix=f"convert it: x.to({want})")
        if t.dtype.is_floating_point and t.numel():
            finite = torch.isfinite(t)
            if not bool(finite.all()):
                at = _first_bad(finite)
                raise _refuse(name, f"holds {NON_FINITE[repr(float(t[tuple(at)]))]} at index {at}; only finite "
                                    "numbers are accepted", fix="send finite numbers")
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
           "dtypes": {k: _dtype_label(v.dtype) for k, v in outs.items()},
           **{k: v for k, v in result.items() if k != "outputs"}}
    return dumps(doc)


def encode_safetensors(result: Mapping[str, Any]) -> bytes:
    """Outputs as safetensors; the rest of the answer in its `__metadata__` (JSON strings)."""
    from safetensors.torch import save
    tensors = {k: v.detach().contiguous().clone() for k, v in result["outputs"].items()}
    meta = {k: dumps(v).decode() for k, v in result.items() if k != "outputs"}
    return save(tensors, metadata=meta)
