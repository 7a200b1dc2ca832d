"""Busy neighbours on demand: `bench --contend N` times every engine again while N CPU burners
run beside it, so the "shared host" case is reproducible on a quiet one.

A burner is a separate Python process spinning on a fixed integer loop (one core's worth of
work each, no memory traffic to speak of: the neighbour is another compute job). The bench
owns them: `Burners` starts them, pauses them (SIGSTOP) while the quiet rounds run and resumes
them (SIGCONT) for the contended ones, so both tables come from the same rounds of the same
set-up engines; it kills them on every way out of the `with` block. A burner also ends
itself: at its `lifetime_s`, when the bench process is gone (Linux's parent-death signal,
SIGKILL, which reaches a stopped process too; elsewhere it polls its parent), so not even a
SIGKILL of the bench leaves one spinning.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import Sequence

from graphmode.errors import GraphmodeError

MAX_BURNERS = 64
DEFAULT_LIFETIME_S = 4 * 3600.0     # an upper bound on one bench run; a burner never outlives it

# The burner's whole program (run with -I -S: no site packages, a fast start). argv: the bench's
# pid, the lifetime in seconds. It spins in slices of fixed work and checks its parent and its
# deadline between slices (~1 ms each).
BURNER_SOURCE = r"""
import os, sys, time
parent, lifetime = int(sys.argv[1]), float(sys.argv[2])
try:
    import ctypes
    ctypes.CDLL(None, use_errno=True).prctl(1, 9, 0, 0, 0)   # PR_SET_PDEATHSIG = SIGKILL
except Exception:
    pass
end = time.monotonic() + lifetime
x = 1
sys.stdout.write("ready\n")
sys.stdout.flush()
while os.getppid() == parent and time.monotonic() < end:
    for _ in range(20000):
        x = (x * 1103515245 + 12345) & 0x7FFFFFFF
"""


class Burners:
    """`n` CPU burner processes for the life of a `with` block (started paused, see `resume`)."""

    def __init__(self, n: int, *, lifetime_s: float = DEFAULT_LIFETIME_S, python: str | None = None):
        if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= MAX_BURNERS:
            raise GraphmodeError("the number of CPU burners must be an integer in 0..%d" % MAX_BURNERS,
                                 where="--contend", value=n, fix="e.g. --contend 2 (as many as the host has cores)")
        if not lifetime_s > 0:
            raise GraphmodeError("a burner's lifetime must be positive", where="lifetime_s", value=lifetime_s,
                                 fix="seconds, e.g. 3600")
        self.n = n
        self.lifetime_s = float(lifetime_s)
        self.python = python or sys.executable
        self.procs: list[subprocess.Popen] = []
        self.running = False

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self) -> "Burners":
        """Start the burners and wait until each runs its loop; they are left paused."""
        try:
            for _ in range(self.n):
                p = subprocess.Popen([self.python, "-I", "-S", "-c", BURNER_SOURCE, str(os.getpid()),
                                      repr(self.lifetime_s)], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL)
                self.procs.append(p)
            for p in self.procs:
                line = p.stdout.readline() if p.stdout is not None else b""
                if line.strip() != b"ready":
                    raise GraphmodeError("a CPU burner did not start", where="--contend",
                                         value=p.poll(), fix=f"check that {self.python} runs")
            self.running = True
            self.pause()
        except BaseException:
            self.stop()
            raise
        return self

    def _signal(self, sig: int) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.kill(p.pid, sig)
                except ProcessLookupError:
                    pass

    def pause(self) -> None:
        """Stop every burner (SIGSTOP): the host is as quiet as without them."""
        if self.running:
            self._signal(signal.SIGSTOP)
            self.running = False

    def resume(self) -> None:
        """Let every burner spin again (SIGCONT)."""
        if self.procs and not self.running:
            self._signal(signal.SIGCONT)
            self.running = True

    def alive(self) -> list[int]:
        """The pids of burners still running (or paused)."""
        return [p.pid for p in self.procs if p.poll() is None]

    def stop(self) -> None:
        """Kill every burner and reap it (SIGKILL works on a paused process too)."""
        self._signal(signal.SIGKILL)
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:     # pragma: no cover - a SIGKILLed child is reaped at once
                pass
            if p.stdout is not None:
                p.stdout.close()
        self.procs = []
        self.running = False

    def __enter__(self) -> "Burners":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class Phases:
    """What the timed rounds alternate between: `names` (`quiet`, then `contended` when there
    are burners) and `enter(name)`, which pauses or resumes the burners for that phase."""

    def __init__(self, burners: Burners | None):
        self.burners = burners if burners is not None and burners.n > 0 else None
        self.names: Sequence[str] = ("quiet", "contended") if self.burners else ("quiet",)

    def enter(self, name: str) -> None:
        if self.burners is None:
            return
        if name == "contended":
            self.burners.resume()
        else:
            self.burners.pause()


__all__ = ["Burners", "Phases", "BURNER_SOURCE", "MAX_BURNERS", "DEFAULT_LIFETIME_S"]
