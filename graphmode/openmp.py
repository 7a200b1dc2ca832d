"""How long OpenMP's idle threads spin before they sleep: graphmode's default for its commands.

graphmode's generated kernels and torch's ATen ops share one OpenMP runtime in the process
(torch's libgomp; the kernels' libraries bind to it by soname) and one team of threads. After
each parallel loop libgomp keeps the team's other threads spinning for GOMP_SPINCOUNT
iterations (300,000 by default: ~7 ms here, a `pause` is ~25 ns on the EPYC hosts) before they
sleep, and a thread that reaches a loop's closing barrier spins the same way for the ones
still working. On a quiet host that makes the next loop's start free. On a busy one a spinning
thread holds a CPU that the thread doing the work needs, and a barrier waits for a teammate
the scheduler took away while the others spin out their time slices: MiniLM (1,16) took
170-450 ms a call next to two CPU burners at load 7-16 on 2 cores, against 5-14 ms with the
spin bounded to 1,000 iterations (~25 us) or with OMP_WAIT_POLICY=passive (docs/
performance-contention.md). A plan's steps follow each other within a few microseconds (90
steps of MiniLM (1,16): the serial ones between its parallel loops take 2-14 us), so a 25 us
spin still finds the next loop on a quiet host.

libgomp reads these variables once, when it is loaded, i.e. when torch is imported: they must
be in the environment before that. The `graphmode` command sets the default first thing
(`apply_defaults`, before any sub-command imports torch); a program that imports torch itself
sets them before that import (`GOMP_SPINCOUNT=1000` or `OMP_WAIT_POLICY=passive` in its
environment). A value the user set is never overridden.
"""
from __future__ import annotations

import os
import sys
import threading
import weakref
from typing import Callable, MutableMapping

SPIN_COUNT = 1000          # ~25 us of `pause` on the EPYC hosts: a step's dispatch, not a time slice
SPIN_BOUND = 10_000        # spins (~0.25 ms) up to which torch's idle team leaves the cores to graphmode's pool
WAIT_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def defaults(environ: MutableMapping[str, str]) -> dict[str, str]:
    """The variables graphmode would add to `environ`: GOMP_SPINCOUNT unless the user chose a
    wait policy or a spin count already."""
    if any(v in environ for v in WAIT_VARS):
        return {}
    return {"GOMP_SPINCOUNT": str(SPIN_COUNT)}


def apply_defaults(environ: MutableMapping[str, str]) -> dict[str, str]:
    """Add `defaults(environ)` to `environ` (call before torch is imported); returns them."""
    add = defaults(environ)
    environ.update(add)
    return add


def bounded_wait(environ: MutableMapping[str, str]) -> bool:
    """Whether libgomp's idle threads sleep within about SPIN_BOUND spins under `environ`:
    OMP_WAIT_POLICY=passive, or a GOMP_SPINCOUNT no larger than that (a program that imported
    torch without either spins 300,000, OMP_WAIT_POLICY=active for ever)."""
    if environ.get("OMP_WAIT_POLICY", "").strip().lower() == "passive":
        return True
    count = environ.get("GOMP_SPINCOUNT", "").strip()
    return count.isdigit() and int(count) <= SPIN_BOUND


def in_effect(environ: MutableMapping[str, str]) -> dict[str, str | None]:
    """The wait settings a run started with (None: libgomp's own default)."""
    return {v: environ.get(v) for v in WAIT_VARS}


# ---- a process forked after OpenMP ran ------------------------------------------------------
# libgomp's thread team does not survive fork(): in the child the first parallel region of more
# than one thread waits for threads that do not exist. A plan build runs ATen's parallel ops
# (tactic selection), so a build in a child forked from a process that had built one hung for
# ever (`multiprocessing`'s default start method on Linux); so did a plan the parent had built
# and run, unless the parent's idle threads had gone to sleep before the fork (GOMP_SPINCOUNT
# bounded: trial AC). In such a child, plans built before the fork run on one thread (a region
# of one thread starts no team: the kernels' libraries and torch are set to one), as PyTorch's
# DataLoader runs its forked workers, and new builds are refused.
_STATE = {"ran": False, "forked_after_run": False}
_ON_FORKED: list[Callable[[], None]] = []   # what to set to one thread in such a child (kernels.py's libraries)


def ran_parallel() -> None:
    """Note that this process has run, or may run, OpenMP's parallel regions (a plan build, a
    kernel library loaded)."""
    _STATE["ran"] = True


def on_forked_after_run(callback: Callable[[], None]) -> None:
    """Call `callback()` in a child forked after this process ran OpenMP (at the fork)."""
    _ON_FORKED.append(callback)


def forked_after_run() -> bool:
    """Whether this process was forked from one that had run OpenMP: it runs on one thread."""
    return _STATE["forked_after_run"]


def _after_fork_in_child() -> None:
    _STATE["forked_after_run"] = _STATE["ran"]
    if not _STATE["ran"]:
        return
    for callback in _ON_FORKED:
        callback()
    torch = sys.modules.get("torch")      # (not imported here: graphmode's CLI reads this module first)
    if torch is not None:
        torch.set_num_threads(1)       # ATen's parallel loops: inline on the calling thread


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class ForkSafeLock:
    """A threading.Lock that a forked child gets fresh: a lock another thread held at the fork
    stays held for ever in the child, where that thread does not exist (trial AC: a child forked
    while threads were calling a model blocked on its plan's lock). What it guards is rewritten
    by the child's next call (a plan's arena) or checked again (which buckets are built)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        _LOCKS.add(self)

    def __enter__(self) -> bool:
        return self._lock.__enter__()

    def __exit__(self, *exc) -> None:
        self._lock.__exit__(*exc)

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        return self._lock.acquire(blocking, timeout)

    def release(self) -> None:
        self._lock.release()

    def locked(self) -> bool:
        return self._lock.locked()


_LOCKS: "weakref.WeakSet[ForkSafeLock]" = weakref.WeakSet()


def _fresh_locks() -> None:
    for lock in list(_LOCKS):
        lock._lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_fresh_locks)


def check_fork_safe(what: str) -> None:
    """Refuse `what` (a plan build) in a child forked after its parent ran OpenMP: it would hang."""
    if _STATE["forked_after_run"]:
        from graphmode.errors import GraphmodeError
        raise GraphmodeError(f"{what} would hang here: this process was forked from one that had already run "
                             "OpenMP's threads (building plans), and libgomp's threads do not survive fork()",
                             where="process", fix="build every bucket before forking (cm.warmup()), or start the "
                                                  "workers with the 'spawn' method (multiprocessing.set_start_method"
                                                  "('spawn'))")


__all__ = ["SPIN_COUNT", "SPIN_BOUND", "WAIT_VARS", "defaults", "apply_defaults", "bounded_wait", "in_effect",
           "ran_parallel", "check_fork_safe", "on_forked_after_run", "forked_after_run",
           "ForkSafeLock"]
