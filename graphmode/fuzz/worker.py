"""Run fuzz cases in a subprocess that may hang or die: `Worker` on the runner's side, `main`
inside it.

The worker imports a fuzzer module once and runs its `execute(case, ctx)` for each case it
reads (one JSON line each on stdin), answering one JSON line per case on a private pipe (the
cases' own output goes to stderr, a log file). The runner waits at most the case's time
limit: a worker that does not answer is killed (`hang`), one that dies is reported with its
signal (`signal`); either way a fresh worker takes the next case. Memory is capped so a case
that allocates without bound fails alone instead of taking the host down.
"""
from __future__ import annotations

import importlib
import json
import os
import resource
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from graphmode.fuzz.outcome import first_line, from_exception, judged

MEMORY_CAP = 12 << 30          # address space of one worker (torch alone maps ~3 GiB)
GRACE_S = 2.0


def special_file(path: Path, what: str) -> None:
    """Put at `path` what a careless or hostile disk may hold instead of a file: a FIFO (a read
    blocks for ever), /dev/zero (never ends), a folder, a link to itself, an empty file, bytes."""
    makers = {"fifo": lambda: os.mkfifo(path), "dev-zero": lambda: path.symlink_to("/dev/zero"),
              "folder": lambda: path.mkdir(), "link-loop": lambda: path.symlink_to(path),
              "empty": lambda: path.write_bytes(b""), "binary": lambda: path.write_bytes(b"\xff\xfe\x00\x01"),
              "empty-object": lambda: path.write_text("{}\n"), "missing": lambda: None}
    makers[what]()


def kill_group(proc: subprocess.Popen) -> None:
    """Kill a process started with start_new_session=True and everything it started."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


class Worker:
    """One worker process for fuzzer `module` with context file `ctx` (restarted after a failure)."""

    def __init__(self, module: str, ctx: Path, log: Path, start_timeout_s: float = 300.0):
        self.module, self.ctx, self.log, self.start_timeout_s = module, ctx, log, start_timeout_s
        self.proc: subprocess.Popen | None = None
        self._buf = b""

    def _start(self) -> None:
        r, w = os.pipe()
        env = dict(os.environ, PYTHONFAULTHANDLER="1")
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "graphmode.fuzz.worker", self.module, str(self.ctx),
                                          str(w)], stdin=subprocess.PIPE, stdout=log, stderr=log, pass_fds=(w,),
                                         start_new_session=True, env=env)
        os.close(w)
        self._fd, self._buf = r, b""
        if self._read(self.start_timeout_s) != {"ready": True}:
            raise RuntimeError(f"the {self.module} fuzz worker did not start (see {self.log})")

    def _read(self, timeout: float) -> dict[str, Any] | None:
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._fd], [], [], left)[0]:
                return None
            chunk = os.read(self._fd, 1 << 16)
            if not chunk:
                return {"eof": True}
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def run(self, case: dict[str, Any], timeout_s: float) -> tuple[str, str]:
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        try:
            self.proc.stdin.write((json.dumps(case) + "\n").encode())
            self.proc.stdin.flush()
        except OSError:
            pass
        got = self._read(timeout_s + GRACE_S)
        if got is not None and "outcome" in got:
            return got["outcome"], got["detail"]
        if got is None:
            self.stop()
            return "hang", f"no answer within {timeout_s:g} s"
        rc = self.proc.wait(timeout=30)
        self.proc = None
        os.close(self._fd)
        if rc < 0:
            return "signal", f"the worker died of signal {signal.Signals(-rc).name}"
        return "traceback", f"the worker exited {rc} (see {self.log})"

    def stop(self) -> None:
        if self.proc is not None:
            kill_group(self.proc)
            os.close(self._fd)
            self.proc = None


def main(argv: list[str]) -> None:
    module, ctx_path, fd = argv[0], argv[1], int(argv[2])
    out = os.fdopen(fd, "w", buffering=1)
    os.dup2(2, 1)                           # what the cases print goes to the log, not the answer pipe
    sys.stdout = sys.stderr
    try:
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_CAP, MEMORY_CAP))
    except (ValueError, OSError):
        pass
    fuzzer = importlib.import_module(f"graphmode.fuzz.{module}")
    ctx = json.loads(Path(ctx_path).read_text())
    out.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        case = json.loads(line)
        try:
            outcome, detail = fuzzer.execute(case, ctx)
        except BaseException as e:  # noqa: BLE001 - classifying whatever a case raises is the point
            if isinstance(e, KeyboardInterrupt):
                raise
            outcome, detail = from_exception(e)
        outcome, detail = judged(case.get("expect", "either"), outcome, first_line(detail, 300))
        out.write(json.dumps({"outcome": outcome, "detail": detail}) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
