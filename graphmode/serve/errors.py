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
