"""Errors the server answers with: each carries its HTTP status and a metrics reason.

This module imports no torch: the recipe sandbox's worker process (sandbox.py) uses it too.
"""
from __future__ import annotations

from typing import Any

from graphmode.errors import ConstraintError, ContractViolation, GraphmodeError, RecipeError


class ServeError(GraphmodeError):
    """An error with an HTTP status (`status`) and a short `reason` for the metrics."""

    status = 500
    reason = "error"

    def __init__(self, message: str, *, status: int | None = None, reason: str | None = None,
                 headers: dict[str, str] | None = None, **kw: Any):
        if status is not None:
            self.status = status
        if reason is not None:
            self.reason = reason
        self.headers = dict(headers or {})      # extra answer headers (e.g. Connection: close)
        super().__init__(message, **kw)


class BadRequest(ServeError):
    """A request the server refuses before (or while) checking it against the contract."""

    status = 400
    reason = "bad_request"


class Unauthorized(ServeError):
    """A state-changing request without the admin token."""

    status = 401
    reason = "unauthorized"


class NotReady(ServeError):
    status = 503
    reason = "not_ready"


class ReloadBusy(ServeError):
    status = 409
    reason = "busy"


class RequestTimeout(ServeError):
    status = 504
    reason = "timeout"


class ServerFault(ServeError):
    """An unexpected exception inside the server (a bug), reported instead of raised."""

    status = 500
    reason = "error"


class RecipeRefused(RecipeError):
    """A recipe refused by the sandbox (graphmode.serve.sandbox): its answer was built there,
    in the worker process, and is passed through as is."""

    def __init__(self, body: dict[str, Any]):
        self.body = dict(body)
        super().__init__(str(body.get("message") or "recipe refused"), where=body.get("where"))

    def to_dict(self) -> dict[str, Any]:
        return dict(self.body)


def error_dict(e: BaseException) -> dict[str, Any]:
    """The JSON body of an error answer."""
    if isinstance(e, GraphmodeError):
        d = e.to_dict()
        if isinstance(e, ConstraintError):
            d["counterexample"] = e.counterexample
            proofs = getattr(e, "proofs", None)
            if proofs:
                d["proofs"] = proofs
        if isinstance(e, ContractViolation):
            d["kind"] = e.kind
        return d
    return {"error": type(e).__name__, "message": str(e)}


OPENAI_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
                408: "timeout_error", 409: "conflict_error", 413: "invalid_request_error",
                415: "invalid_request_error", 422: "invalid_request_error", 499: "invalid_request_error",
                503: "service_unavailable_error", 504: "timeout_error"}


def openai_error(e: BaseException) -> dict[str, Any]:
    """The inside of OpenAI's error body `{"error": {...}}`: `message` (one line that also names
    the field, the value and the fix: the `openai` client shows only this), `type`, `param`
    (the request field) and `code`, with graphmode's own fields (`where`, `value`, `fix`,
    `kind`, `status`, `graphmode_error`: the error's class) beside them."""
    status = openai_status(e)
    try:
        d = error_dict(e)
    except ValueError:                    # a value too long to print
        d = {"error": type(e).__name__, "message": getattr(e, "message", "")[:500]}
    where, value, fix = d.get("where"), d.get("value"), d.get("fix")
    message = str(d.get("message") or type(e).__name__)
    if where:
        message = f"{where}: {message}"
    if value is not None:
        message += f" (got {value})"
    if fix:
        message += f"; fix: {fix}"
    if isinstance(e, ServeError):
        code = e.reason
    elif isinstance(e, ContractViolation):
        code = "context_length_exceeded" if _too_long(e) else f"contract_{e.kind or 'input'}"
    else:
        code = type(e).__name__
    out = {"message": message, "type": OPENAI_TYPES.get(status, "server_error" if status >= 500
                                                          else "invalid_request_error"),
           "param": where, "code": code, **{k: v for k, v in d.items() if k not in ("error", "message")},
           "detail": d.get("message"), "graphmode_error": d.get("error"), "status": status}
    return out


def openai_status(e: BaseException) -> int:
    """The status an OpenAI endpoint answers: a request the contract refuses (a prompt past the
    context, token ids outside the vocabulary, text the tokenizer cannot encode) is OpenAI's and
    vLLM's 400, which clients map to their own errors (context window exceeded); graphmode's own
    endpoints answer it 422."""
    status = http_status(e)
    return 400 if status == 422 else status


def _too_long(e: ContractViolation) -> bool:
    """A prompt, or a prompt and its answer, longer than a sequence may be."""
    where = (e.where or "").split("[")[0]
    return e.kind == "shape" and where in ("prompt", "max_tokens", "messages", "input") and "at most" in (
        e.fix or "") + e.message


def http_status(e: BaseException) -> int:
    """4xx for what the client sent (any typed GraphmodeError names a field of it); 500 for
    a server fault or an untyped exception."""
    if isinstance(e, ServeError):
        return e.status
    return 422 if isinstance(e, GraphmodeError) else 500


def detach(e: BaseException) -> BaseException:
    """Drop the traceback and chained exceptions of an error the server keeps (a failed
    reload's ticket, the startup error): their frames would keep a retired deployment's
    CompiledModel, plans and weights alive."""
    e.__traceback__ = None
    e.__context__ = None
    e.__cause__ = None
    return e
