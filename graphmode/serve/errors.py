"""Errors the server answers with: each carries its HTTP status and a metrics reason."""
from __future__ import annotations

from typing import Any

from graphmode.errors import GraphmodeError


class ServeError(GraphmodeError):
    """An error with an HTTP status (`status`) and a short `reason` for the metrics."""

    status = 500
    reason = "error"

    def __init__(self, message: str, *, status: int | None = None, reason: str | None = None, **kw: Any):
        if status is not None:
            self.status = status
        if reason is not None:
            self.reason = reason
        super().__init__(message, **kw)


class BadRequest(ServeError):
    """A request the server refuses before (or while) checking it against the contract."""

    status = 400
    reason = "bad_request"


class NotReady(ServeError):
    status = 503
    reason = "not_ready"


class ReloadBusy(ServeError):
    status = 409
    reason = "busy"


class RequestTimeout(ServeError):
    status = 504
    reason = "timeout"
