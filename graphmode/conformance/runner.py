"""Run a conformance suite: pick the cases, hand each to a worker subprocess, classify the answer.

Why subprocesses: a case may hang (a kernel that never returns) or kill its process (a
segfault in generated code); the parent only waits on a pipe with a deadline, so either
ends as one classified case and a fresh worker takes the next one. A worker answers many
cases (importing torch takes seconds), and starts its suite once.
"""
from __future__ import annotations

import hashlib
import importlib
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import threading
import time
import traceback
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

from graphmode.errors import GraphmodeError

OUTCOMES = ("pass", "wrong", "refused", "crash", "hang")

# suite name -> "module:class"; each suite module imports its own heavy dependencies lazily
SUITES = {"onnx": "graphmode.conformance.onnx_suite:OnnxSuite",
          "opinfo": "graphmode.conformance.opinfo_suite:OpInfoSuite"}

DEFAULT_TIMEOUT_S = 60.0
START_TIMEOUT_S = 300.0        # importing torch and building a suite's case list on a busy host
DETAIL_CHARS = 400


@dataclass(frozen=True)
class Case:
    """One case: `id` unique in its suite, `op` the row of the per-op table, `tags` the subsets it
    belongs to (`Suite.subsets`), `payload` whatever the worker needs to run it (picklable)."""

    id: str
    op: str
    tags: tuple[str, ...] = ()
    payload: Any = None


@dataclass
class Judged:
    """What a suite's `run_case` returns: graphmode's class, why, and the other engines' verdicts
    on the same case ({"ORT": "pass"}; "pass" or "fail")."""

    outcome: str
    detail: str = ""
    others: dict[str, str] = field(default_factory=dict)


@dataclass
class CaseResult:
    id: str
    op: str
    tags: tuple[str, ...]
    outcome: str
    detail: str
    seconds: float
    others: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "op": self.op, "tags": list(self.tags), "outcome": self.outcome,
                "detail": self.detail, "seconds": round(self.seconds, 3), "others": dict(self.others)}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "CaseResult":
        return cls(d["id"], d["op"], tuple(d.get("tags", ())), d["outcome"], d.get("detail", ""),
                   float(d.get("seconds", 0.0)), dict(d.get("others", {})))


class Suite(Protocol):
    """A suite module's class. Built once in the parent (to list cases) and once per worker, with
    the run's options as keywords (the CLI passes `cache_dir`, graphmode's cache root or None)."""

    name: str                      # "onnx"
    title: str                     # "ONNX backend node tests"
    subsets: dict[str, str]        # tag -> label of a summary row ("f32" -> "f32 in/out, usable opset")
    others: tuple[str, ...]        # engines judged beside graphmode ("ORT",)

    def cases(self) -> list[Case]: ...

    def run_case(self, case: Case) -> Judged: ...

    def versions(self) -> dict[str, str]: ...


@dataclass
class SuiteRun:
    """A finished run: what `report` writes."""

    suite: str
    title: str
    date: str
    versions: dict[str, str]
    results: list[CaseResult]
    total_cases: int                    # cases the suite has (the run may be a sample)
    sample: int | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    subsets: dict[str, str] = field(default_factory=dict)
    others: tuple[str, ...] = ()

    def counts(self, results: Sequence[CaseResult] | None = None) -> dict[str, int]:
        out = dict.fromkeys(OUTCOMES, 0)
        for r in self.results if results is None else results:
            out[r.outcome] += 1
        return out


def get_suite(name: str, **options: Any) -> Suite:
    """A suite by its name in SUITES, or by "package.module:Class" (a suite kept elsewhere)."""
    spec = name if ":" in name else SUITES.get(name)
    if spec is None:
        raise GraphmodeError(f"unknown conformance suite {name!r}", where="suite",
                             fix=f"one of: {', '.join(sorted(SUITES))}")
    mod, cls = spec.split(":")
    try:
        module = importlib.import_module(mod)
    except ModuleNotFoundError as e:
        raise GraphmodeError(f"conformance suite {name!r} cannot be loaded: {e}", where="suite",
                             fix="install the conformance extra: pip install -e '.[conformance]'") from None
    return getattr(module, cls)(**options)


# ---- judging one case (in the worker) --------------------------------------------------------

def _short(text: str) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= DETAIL_CHARS else text[:DETAIL_CHARS - 3] + "..."


def judge(run: Callable[[], str | None]) -> Judged:
    """Run one case through graphmode: `run` returns None when the outputs match, else a line
    saying how they differ. A GraphmodeError is a refusal, any other exception a crash (with
    the innermost frame, so the report points at the code)."""
    try:
        mismatch = run()
    except GraphmodeError as e:
        return Judged("refused", _short(f"{type(e).__name__}: {e.render()}"))
    except Exception as e:  # noqa: BLE001 - classifying every other exception is the point
        tb = traceback.extract_tb(e.__traceback__)
        at = f" at {os.path.basename(tb[-1].filename)}:{tb[-1].lineno}" if tb else ""
        return Judged("crash", _short(f"{type(e).__name__}: {e}{at}"))
    return Judged("pass") if mismatch is None else Judged("wrong", _short(mismatch))


# ---- picking a sample ---------------------------------------------------------------------------

def _h(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()


def pick_sample(cases: Sequence[Case], n: int) -> list[Case]:
    """`n` cases, the same every time, spread over ops: one case of every op (in a fixed
    pseudo-random op order) before a second case of any; kept in the suite's order."""
    by_op: dict[str, list[Case]] = defaultdict(list)
    for c in sorted(cases, key=lambda c: _h(c.id)):
        by_op[c.op].append(c)
    ops = sorted(by_op, key=_h)
    picked: set[str] = set()
    depth = 0
    while len(picked) < min(n, len(cases)):
        for op in ops:
            if depth < len(by_op[op]) and len(picked) < n:
                picked.add(by_op[op][depth].id)
        depth += 1
    return [c for c in cases if c.id in picked]


# ---- workers -------------------------------------------------------------------------------------

class _Hang(Exception):
    pass


class _Died(Exception):
    pass


def send_frame(fd: int, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    view = memoryview(struct.pack("<Q", len(data)) + data)
    while view:
        view = view[os.write(fd, view):]


def recv_frame(fd: int, deadline: float | None = None) -> Any:
    """One pickled frame from `fd`; _Hang past `deadline` (time.monotonic), _Died at end of file."""
    def read(n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([fd], [], [], left)[0]:
                    raise _Hang()
            chunk = os.read(fd, n - len(buf))
            if not chunk:
                raise _Died()
            buf += chunk
        return bytes(buf)
    (size,) = struct.unpack("<Q", read(8))
    return pickle.loads(read(size))


class _Worker:
    """One worker subprocess (`python -m graphmode.conformance.worker`), in its own process group
    so that killing it also ends the compilers it started."""

    def __init__(self, suite: str, options: dict[str, Any], log: Any):
        import json
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))   # what the parent imports
        self.proc = subprocess.Popen([sys.executable, "-m", "graphmode.conformance.worker", suite,
                                      json.dumps(options)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=log if log is not None else subprocess.DEVNULL, start_new_session=True,
                                     env=env)
        try:
            recv_frame(self.proc.stdout.fileno(), time.monotonic() + START_TIMEOUT_S)   # "ready"
        except (_Hang, _Died):
            self.kill()
            raise _Died(f"the worker did not start (exit status {self.proc.poll()}); see its log") from None

    def ask(self, case: Case, timeout_s: float) -> Judged:
        try:
            send_frame(self.proc.stdin.fileno(), case)
        except BrokenPipeError:
            raise _Died(self._death()) from None
        try:
            return recv_frame(self.proc.stdout.fileno(), time.monotonic() + timeout_s)
        except _Died:
            raise _Died(self._death()) from None

    def _death(self) -> str:
        try:
            rc = self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.kill()
            return "the worker closed its pipe and did not exit"
        if rc < 0:
            try:
                return f"the worker died of signal {signal.Signals(-rc).name}"
            except ValueError:
                return f"the worker died of signal {-rc}"
        return f"the worker exited with status {rc}"

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass

    def close(self) -> None:
        try:
            self.proc.stdin.close()       # end of input: the worker returns
            self.proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            pass
        self.kill()


def run_suite(name: str, *, sample: int | None = None, only: Callable[[Case], bool] | None = None,
              jobs: int = 1, timeout_s: float = DEFAULT_TIMEOUT_S, options: dict[str, Any] | None = None,
              log_path: str | os.PathLike | None = None,
              progress: Callable[[int, int, CaseResult], None] | None = None) -> SuiteRun:
    """Run suite `name` (all cases, those `only` keeps, or a `sample` of them) in `jobs` workers,
    each case under `timeout_s`. `options` go to the suite's constructor in every worker."""
    import datetime as dt
    options = dict(options or {})
    suite = get_suite(name, **options)
    every = suite.cases()
    cases = [c for c in every if only is None or only(c)]
    if sample is not None:
        cases = pick_sample(cases, sample)
    results: list[CaseResult | None] = [None] * len(cases)
    todo = list(range(len(cases)))[::-1]
    lock = threading.Lock()
    done = [0]
    log = open(log_path, "ab") if log_path is not None else None

    def record(i: int, judged: Judged, seconds: float) -> None:
        c = cases[i]
        r = CaseResult(c.id, c.op, c.tags, judged.outcome, judged.detail, seconds, judged.others)
        with lock:
            results[i] = r
            done[0] += 1
            k = done[0]
        if progress is not None:
            progress(k, len(cases), r)

    def slot() -> None:
        worker: _Worker | None = None
        try:
            while True:
                with lock:
                    if not todo:
                        return
                    i = todo.pop()
                t0 = time.monotonic()
                try:
                    if worker is None:
                        worker = _Worker(name, options, log)
                        t0 = time.monotonic()
                    judged = worker.ask(cases[i], timeout_s)
                except _Hang:
                    worker.kill()
                    worker = None
                    judged = Judged("hang", f"no answer within {timeout_s:g} s; the worker was killed")
                except _Died as e:
                    if worker is not None:
                        worker.kill()
                    worker = None
                    judged = Judged("crash", str(e))
                record(i, judged, time.monotonic() - t0)
        finally:
            if worker is not None:
                worker.close()

    threads = [threading.Thread(target=slot, daemon=True) for _ in range(max(1, min(jobs, len(cases))))]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        if log is not None:
            log.close()
    return SuiteRun(suite=suite.name, title=suite.title,
                    date=dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                    versions=_versions(suite), results=[r for r in results if r is not None],
                    total_cases=len(every), sample=sample, timeout_s=timeout_s, subsets=dict(suite.subsets),
                    others=tuple(suite.others))


def _versions(suite: Suite) -> dict[str, str]:
    import platform

    import torch

    import graphmode
    out = {"graphmode": graphmode.__version__}
    try:
        root = os.path.dirname(os.path.dirname(os.path.abspath(graphmode.__file__)))
        commit = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=10).stdout.strip()
        if commit:
            out["graphmode"] += f" ({commit})"
    except (OSError, subprocess.TimeoutExpired):
        pass
    out["torch"] = torch.__version__
    out.update(suite.versions())
    out["python"] = platform.python_version()
    return out
