"""What a fuzz case ended in, and the summary table over many."""
from __future__ import annotations

import traceback
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable

OK = ("accepted", "refused")
FAILURES = ("traceback", "hang", "signal", "http-5xx", "invalid-accepted", "valid-refused", "wrong-output")


@dataclass
class Result:
    family: str
    case: str
    outcome: str                 # one of OK or FAILURES
    detail: str = ""
    seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def failed(self) -> bool:
        return self.outcome in FAILURES

    def to_json(self) -> dict[str, Any]:
        return {"family": self.family, "case": self.case, "outcome": self.outcome, "detail": self.detail,
                "seconds": round(self.seconds, 3), **self.extra}


def judged(expect: str, outcome: str, detail: str) -> tuple[str, str]:
    """A case's outcome against what it expected: "valid" must be accepted, "invalid" refused,
    "either" may be both."""
    if outcome == "accepted" and expect == "invalid":
        return "invalid-accepted", detail or "ran although the input is invalid"
    if outcome == "refused" and expect == "valid":
        return "valid-refused", detail
    return outcome, detail


def from_exception(e: BaseException) -> tuple[str, str]:
    """A GraphmodeError is a clear refusal; anything else escaping is a traceback."""
    from graphmode.errors import GraphmodeError
    if isinstance(e, GraphmodeError):
        return "refused", first_line(str(e))
    frames = traceback.extract_tb(e.__traceback__)
    at = f" at {frames[-1].filename.rsplit('/', 1)[-1]}:{frames[-1].lineno}" if frames else ""
    return "traceback", f"{type(e).__name__}: {first_line(str(e))}{at}"


def from_cli(rc: int, output: str) -> tuple[str, str]:
    """A CLI run: a traceback anywhere in its output is one, whatever the exit code."""
    if "Traceback (most recent call last)" in output:
        tail = [ln for ln in output.splitlines() if ln.strip()][-1:]
        return "traceback", first_line(tail[0] if tail else "")
    if rc < 0:
        return "signal", f"killed by signal {-rc}"
    if rc == 0:
        return "accepted", ""
    err = [ln for ln in output.splitlines() if "error" in ln.lower() or "fix:" in ln]
    return "refused", first_line(err[0] if err else output.strip().splitlines()[-1] if output.strip() else f"exit {rc}")


def first_line(s: str, limit: int = 200) -> str:
    line = (s.strip().splitlines() or [""])[0]
    return line if len(line) <= limit else line[:limit] + "..."


def summary(results: Iterable[Result]) -> tuple[list[str], list[list[Any]]]:
    """(header, rows): per family, how many cases ended in each outcome."""
    results = list(results)
    cols = list(OK) + list(FAILURES)
    rows = []
    for fam in dict.fromkeys(r.family for r in results):
        c = Counter(r.outcome for r in results if r.family == fam)
        rows.append([fam, sum(c.values())] + [c.get(k, 0) for k in cols])
    total = Counter(r.outcome for r in results)
    rows.append(["total", sum(total.values())] + [total.get(k, 0) for k in cols])
    return ["fuzzer", "cases"] + cols, rows


def markdown(results: Iterable[Result]) -> str:
    header, rows = summary(results)
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(x) for x in r) + " |" for r in rows]
    return "\n".join(out)


__all__ = ["FAILURES", "OK", "Result", "first_line", "from_cli", "from_exception", "judged", "markdown", "summary"]
