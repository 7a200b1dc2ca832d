"""A JSON request body as a document, or a BadRequest (400) saying why not."""
from __future__ import annotations

import json
from typing import Any

from graphmode.serve.codec import clip
from graphmode.serve.errors import BadRequest


def load_json(body: bytes, fix: str) -> Any:
    """`body` parsed as JSON. `NaN` / `Infinity` are refused (they are not JSON), as are
    bodies that are not UTF-8, nested too deeply, or hold an integer of thousands of digits."""
    def refuse(token: str) -> None:
        raise BadRequest(f"malformed JSON: {token} is not a JSON value", reason="malformed_json", where="body",
                         fix="send finite numbers")
    if not body.strip():
        raise BadRequest("empty body", reason="malformed_body", where="body", fix=fix)
    try:
        return json.loads(body, parse_constant=refuse)
    except json.JSONDecodeError as e:
        raise BadRequest(f"malformed JSON: {e.msg} at line {e.lineno} column {e.colno}", reason="malformed_json",
                         where="body", fix=fix) from None
    except UnicodeDecodeError:
        raise BadRequest("the body is not UTF-8 text", reason="malformed_json", where="body") from None
    except RecursionError:
        raise BadRequest("JSON nested too deeply", reason="malformed_json", where="body") from None
    except ValueError as e:                   # an integer literal of more than 4300 digits
        raise BadRequest(f"malformed JSON: {clip(e, 120)}", reason="malformed_json", where="body",
                         fix="send numbers of at most a few dozen digits") from None
