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

from typing import MutableMapping

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


__all__ = ["SPIN_COUNT", "SPIN_BOUND", "WAIT_VARS", "defaults", "apply_defaults", "bounded_wait", "in_effect"]
