"""Typed errors. Each one says what is wrong, where (field path / node / pass), and the fix.

The CLI catches `GraphmodeError` and prints `str(err)` with the exit code the error
carries; anything else escaping the CLI is a bug.
"""
from __future__ import annotations

from typing import Any


def short_value(value: Any, limit: int = 80) -> Any:
    """`value` as an error shows it: itself if short, else its repr cut to `limit` characters.
    An int too long for repr (over 4300 digits) is shown by its size, a structure nested too
    deeply for repr by its type, instead of raising."""
    try:
        r = repr(value)
    except (ValueError, RecursionError):
        if isinstance(value, int):
            return f"<an integer of {value.bit_length()} bits>"
        return f"<a {type(value).__name__} nested too deeply to show>"
    return value if len(r) <= limit else r[:limit] + "..."


def _shown(value: Any) -> str:
    v = short_value(value)
    return v if isinstance(v, str) and v is not value else repr(v)


class GraphmodeError(Exception):
    """Base class. `exit_code` is what the CLI exits with (2 = malformed input)."""

    exit_code = 2

    def __init__(self, message: str, *, where: str | None = None, value: Any = None,
                 fix: str | None = None, line: int | None = None):
        self.message = message
        self.where = where
        self.value = value
        self.fix = fix
        self.line = line
        super().__init__(self.render())

    def render(self) -> str:
        head = self.message
        loc = []
        if self.where:
            loc.append(self.where)
        if self.line is not None:
            loc.append(f"line {self.line}")
        if loc:
            head = f"{': '.join([', '.join(loc)])}: {head}"
        if self.value is not None:
            head += f" (got {_shown(self.value)})"
        if self.fix:
            head += f"\n  fix: {self.fix}"
        return head

    def to_dict(self) -> dict[str, Any]:
        return {"error": type(self).__name__, "message": self.message, "where": self.where,
                "value": _shown(self.value) if self.value is not None else None,
                "line": self.line, "fix": self.fix}


class RecipeError(GraphmodeError):
    """The recipe is malformed (schema) or inconsistent (semantics)."""


class RecipeErrors(RecipeError):
    """Several field-level recipe errors found in one validation run."""

    def __init__(self, errors: list[RecipeError]):
        self.errors = errors
        GraphmodeError.__init__(self, f"{len(errors)} error(s) in recipe")

    def render(self) -> str:  # one line per field error
        return "\n".join(e.render() for e in getattr(self, "errors", [])) or self.message

    def to_dict(self) -> dict[str, Any]:
        """Every error's fields (the first field error's, as the summary), and each one in `errors`."""
        first = self.errors[0].to_dict() if self.errors else {}
        return {**first, "error": "RecipeErrors", "message": f"{self.message}; first: {first.get('message')}",
                "errors": [e.to_dict() for e in self.errors]}


class ArtifactError(GraphmodeError):
    """An artifact that cannot be written, read or run here (exit 2 where the path holds none)."""

    exit_code = 1

    def __init__(self, message: str, *, exit_code: int | None = None, **kw):
        if exit_code is not None:
            self.exit_code = exit_code
        super().__init__(message, **kw)


class ConstraintError(GraphmodeError):
    """A recipe constraint is refuted (with a counter-example) or could not be proved."""

    exit_code = 1

    def __init__(self, message: str, *, counterexample: dict[str, int] | None = None, **kw):
        self.counterexample = counterexample
        super().__init__(message, **kw)


class TargetError(GraphmodeError):
    """Unknown target, malformed hardware description file, or failed host probe."""


class CaptureError(GraphmodeError):
    """The model could not be turned into IR (export failure, malformed ONNX, bad spec)."""


class IRError(GraphmodeError):
    """The IR violates an invariant (verifier) or cannot be parsed."""


class PassError(GraphmodeError):
    """A pass failed or broke the IR; names the pass and the passes that ran before it."""


class PlanError(GraphmodeError):
    """Scheduling, memory planning or lowering failed."""


class BackendError(GraphmodeError):
    """A backend could not build or run a kernel (e.g. no C compiler)."""


class CacheError(GraphmodeError):
    """An artifact-cache entry is corrupt or stale."""


class ContractViolation(GraphmodeError):
    """A request broke the recipe's contract at run time (shape outside the declared dims...)."""

    def __init__(self, message: str, *, kind: str = "shape", **kw):
        self.kind = kind
        super().__init__(message, **kw)


class RankFailure(GraphmodeError):
    """A tensor-parallel rank died, hung past the collective timeout, or could not join its group:
    the ranks still alive stop with this instead of waiting for it."""

    exit_code = 1


def warning_line(message: Any, category: type) -> str | None:
    """graphmode's own notice or warning as the one line it prints (`notice: ...`, `warning: ...`),
    without Python's file and source line, which name graphmode's code; None for others' warnings."""
    if category.__name__ == "GraphmodeNotice":
        return f"notice: {message}"
    if category.__module__.split(".")[0] == "graphmode":
        return f"warning: {message}"
    return None


class GraphmodeNotice(UserWarning):
    """Something graphmode did on the user's behalf that they may want to make explicit (a
    warning, not an error: every layer may give one)."""

