"""A JSON request body as a document, or a BadRequest (400) saying why not."""
from __future__ import annotations

from typing import Any

from graphmode.serve.codec import parse_json
from graphmode.serve.errors import BadRequest


def load_json(body: bytes, fix: str) -> Any:
    """`body` parsed as JSON. `NaN` / `Infinity` are refused (they are not JSON), as are
    bodies that are not UTF-8, nested too deeply, or hold an integer of thousands of digits."""
    def refuse(token: str) -> None:
        raise BadRequest(f"malformed JSON: {token} is not a JSON value", reason="malformed_json", where="body",
                         fix="send finite numbers")
    if not body.strip():
        raise BadRequest("empty body", reason="malformed_body", where="body", fix=fix)
    return parse_json(body, fix, parse_constant=refuse)
