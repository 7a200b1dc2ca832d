"""The process's work-claiming thread pool: what the `claim` loop schedule runs its loops on.

An OpenMP parallel region ends at a barrier that waits for every thread of its team, so on a
busy host a team thread the kernel scheduler took away before it reached the loop holds the
call up for its whole time slice, even when the caller could have run every chunk itself
(docs/performance-contention.md). The pool (templates/claim_pool.h) joins differently: the
caller claims chunks too and returns when every chunk is claimed and every claimed chunk has
finished, so a late worker finds nothing left and goes back to sleep; idle workers spin
`openmp.SPIN_COUNT` pauses, then block. Each thread first claims its own share of a loop (the
caller the first 1/T of the chunks, worker i the (i+2)-th), then steals from the back of the
others': with every thread running, a thread gets the same rows of consecutive loops, as under
`schedule(static)`, and its data stays in its core's caches.

There is one pool per process, in a library of its own built (and cached, sealed and
trial-loaded) like any kernel library, once; every kernel library built with the `claim`
schedule gets its entry point through `gm_set_pool` when it is loaded (`attach`). Its thread
count is each loop's: the `num_threads` its kernel library asks for (the builder's threads,
capped by the CPU quota as for OpenMP); workers are started as loops first ask for them.
"""
from __future__ import annotations

import ctypes
import threading
from typing import Any

from graphmode.backends.cpu.abi import entry_point, kernel_source, template
from graphmode.backends.cpu.kernels import CompiledLibrary
from graphmode.backends.cpu.toolchain import warn_once
from graphmode.errors import BackendError
from graphmode.openmp import SPIN_COUNT

_LOCK = threading.Lock()
_POOL: list[CompiledLibrary] = []      # the one pool library, once loaded


def pool_source():
    """The pool's KernelSource: gm_pool_entry and friends, and an empty kernel of no arguments
    (what a built library's kernel must export)."""
    text = template("claim_pool.h") + "\n".join(entry_point(0, [])) + "\n"
    return kernel_source("claim_pool", text, inputs=(), outputs=(), types={}, kind="native")


def _pool(builder: Any) -> CompiledLibrary:
    """Build (or load from `builder`'s folder) the pool library, once per process. It is built
    by a `static`-schedule builder of the same compiler and folder: it has no claimable loops."""
    with _LOCK:
        if not _POOL:
            plain = type(builder)(builder.cache_dir, builder.requested, isa=builder.isa, schedule="static")
            lib = plain.build(pool_source()).library
            lib.cdll.gm_pool_set_spin.argtypes = [ctypes.c_int]
            lib.cdll.gm_pool_set_spin(SPIN_COUNT)
            lib.cdll.gm_pool_entry.restype = ctypes.c_void_p
            _POOL.append(lib)
        return _POOL[0]


def attach(lib: CompiledLibrary, builder: Any) -> bool:
    """Hand `lib` (a kernel library built with the claim schedule) the pool's entry point;
    False when the pool cannot be built (said once): its loops then run on the calling thread."""
    setter = getattr(lib.cdll, "gm_set_pool", None)
    if setter is None:
        return False
    try:
        entry = _pool(builder).cdll.gm_pool_entry()
    except BackendError as e:
        warn_once("claim-pool", f"the work-claiming pool does not build ({e}); loops of `claim` kernels "
                                "run on the calling thread alone")
        return False
    setter.argtypes = [ctypes.c_void_p]
    setter.restype = None
    setter(entry)
    return True


def library_path() -> Any:
    """The loaded pool library's file (None before a `claim` kernel library needed it): an
    artifact ships it beside its kernels, so a load builds nothing."""
    return _POOL[0].path if _POOL else None


def stats() -> dict[str, int] | None:
    """The pool's counters (None before it is loaded): jobs it ran, chunks its workers ran,
    loops a caller ran alone (one chunk, one thread, nested or concurrent), workers started,
    the callers' sleeps waiting for a worker's chunk, wakes of sleeping workers."""
    if not _POOL:
        return None
    out = (ctypes.c_long * 6)()
    _POOL[0].cdll.gm_pool_stats(out)
    return dict(zip(("jobs", "worker_chunks", "inline_jobs", "workers", "caller_waits", "wakes"), (int(v) for v in out)))


__all__ = ["pool_source", "attach", "library_path", "stats"]
