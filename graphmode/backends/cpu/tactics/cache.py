"""The timing cache: what a shape's candidates measured, one JSON file per key on disk.

Keyed by the target identity with its SIMD flags, the compiler and its flags, thread count,
op, shape, dtype, whether weights are timed cold, and the candidate set including each
generated kernel's symbol (a hash of its source), so the next plan build with those shapes
does no timing, and any change to what would be timed is a miss. Files live in the cache
dir's `tactics/` folder as `gemm-<sha256 of the key>.json`, written to a temporary name and
renamed; an entry is read through graphmode/untrusted.py (a regular file inside the folder,
at most MAX_ENTRY_BYTES, strict JSON), and one that fails, does not parse, holds numbers out
of range or does not match its key is a miss (timed again, then overwritten). Entries written
before a field existed still load (the field reads as empty). `digests`: each passing
candidate's check output digest (candidates.Checker), so a hit re-checks its winner without ATen.
Each entry records the conditions it was timed under: `load` and `cores`, `cpu_per_wall` (the
process's CPU-s per wall-s while the candidates ran) and `starved` (below selection.STARVED: the
samples timed the scheduler too); the context decides from them when an entry is timed again.
"""
from __future__ import annotations

import datetime as _dt
import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any, Mapping

from graphmode.backends.cpu.toolchain import warn_once
from graphmode.untrusted import UntrustedFileError, read_json

log = logging.getLogger("graphmode.cpu.tactics")

# 2: calibration round-robin + a second chance for pruned candidates (timing.measure); entries
# timed before could hold a fast candidate pruned by a burst of load, so they are timed again
CACHE_VERSION = 2
RETUNE_NOISY = 2      # re-timings a noisy entry gets from later plan builds (TacticsContext's default)


MAX_ENTRY_BYTES = 4 << 20        # one entry's file (ours are a few KiB)


def _seconds(v: Any) -> bool:
    """A stored time, load or CPU-s per wall-s: a finite, non-negative number of sane size (JSON parsing already
    refused NaN and 1e999)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < 1e9


def _count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= 1 << 20


class TimingCache:
    """The timing cache in folder `root` (None: nothing is persisted). `used`: the entries'
    file names this cache read or wrote, what a `.gm` of the plans built with it ships (the
    folder is shared by every model compiled with the same cache dir)."""

    def __init__(self, root: str | Path | None):
        self.root = Path(root) if root is not None else None
        self.used: set[str] = set()

    def path(self, key: Mapping) -> Path | None:
        if self.root is None:
            return None
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
        return self.root / f"gemm-{digest}.json"

    def get(self, key: Mapping) -> dict[str, Any] | None:
        """The entry stored under `key`, its fields checked and typed, or None."""
        path = self.path(key)
        if path is None:
            return None
        try:
            d = read_json(path, limit=MAX_ENTRY_BYTES, root=self.root)
        except UntrustedFileError as e:
            if os.path.lexists(path):
                log.warning("ignoring the GEMM timing cache entry %s: %s", path, e.message)
            return None
        if not isinstance(d, dict) or d.get("key") != json.loads(json.dumps(key)):
            return None
        t, r = d.get("timings_s"), d.get("rejected", {})
        if not isinstance(t, dict) or not isinstance(r, dict) or not all(_seconds(v) for v in t.values()):
            return None
        med = d.get("medians_s") if isinstance(d.get("medians_s"), dict) else {}
        lo = d.get("mins_s") if isinstance(d.get("mins_s"), dict) else {}
        load, cores, tries = d.get("load"), d.get("cores"), d.get("tries", 1)
        dg = d.get("digests") if isinstance(d.get("digests"), dict) else {}
        self.used.add(path.name)
        return {"digests": {k: v for k, v in dg.items() if isinstance(v, str)},
                "timings_s": {k: float(v) for k, v in t.items()}, "rejected": {k: str(v) for k, v in r.items()},
                "medians_s": {k: float(v) for k, v in med.items() if _seconds(v)},
                "mins_s": {k: float(v) for k, v in lo.items() if _seconds(v)},
                "load": float(load) if _seconds(load) else None,
                "cores": cores if _count(cores) else None,
                "noisy": d.get("noisy") is True, "tries": tries if _count(tries) else 1,
                "cpu_per_wall": float(cpw) if _seconds(cpw := d.get("cpu_per_wall")) else None,
                "starved": d.get("starved") is True}

    def put(self, key: Mapping, entry: Mapping, *, reps: int) -> None:
        """Store `entry` under `key` (with when it was measured and the minimum samples per
        candidate); a folder that cannot be written is a warning, not an error."""
        path = self.path(key)
        if path is None:
            return
        data = {"key": key, **entry, "measured_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                "reps": reps}
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=1, sort_keys=True)
            os.replace(tmp, path)
            self.used.add(path.name)
        except OSError as e:        # said once per folder: a read-only cache would say it for every GEMM
            warn_once(f"tactics-unwritable:{path.parent}", f"cannot write the GEMM timing cache {path.parent} "
                      f"({e.strerror or e}): timings measured in this process are not kept")


def retime_reason(entry: Mapping[str, Any], retune_noisy: int, load: float | None, cores: int) -> str | None:
    """Why a plan build measures cached `entry` again instead of using it, or None: never in a
    frozen build (`retune_noisy` 0, an artifact's); a noisy entry for its first `retune_noisy`
    re-timings; one timed busy (`timed_busy`) also after those whenever the host is quiet now
    (load average within its cores), so the first quiet build replaces it and a busy one, whose
    timing would be starved again, does not pay for it."""
    if retune_noisy <= 0:
        return None
    if entry.get("noisy") and entry.get("tries", 1) <= retune_noisy:
        return f"noisy: re-timing {entry.get('tries', 1)} of {retune_noisy}"
    if timed_busy(entry) and load is not None and load <= cores:
        return f"timed {'starved' if entry.get('starved') else 'on a busy host'}, and the host is quiet now " \
               f"(load {load:.1f} on {cores} cores)"
    return None


def timed_busy(entry: Mapping[str, Any]) -> bool:
    """Timed starved, or while the load average exceeded the process's cores (entries written
    before `starved` was recorded say only that)."""
    load, cores = entry.get("load"), entry.get("cores")
    return bool(entry.get("starved")) or (load is not None and bool(cores) and load > cores)


__all__ = ["CACHE_VERSION", "RETUNE_NOISY", "TimingCache", "retime_reason", "timed_busy"]
