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

from graphmode.untrusted import UntrustedFileError, read_json

log = logging.getLogger("graphmode.cpu.tactics")

# 2: calibration round-robin + a second chance for pruned candidates (timing.measure); entries
# timed before could hold a fast candidate pruned by a burst of load, so they are timed again
CACHE_VERSION = 2


MAX_ENTRY_BYTES = 4 << 20        # one entry's file (ours are a few KiB)


def _seconds(v: Any) -> bool:
    """A stored time or load: a finite, non-negative number of sane size (JSON parsing already
    refused NaN and 1e999)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < 1e9


def _count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= 1 << 20


class TimingCache:
    """The timing cache in folder `root` (None: nothing is persisted)."""

    def __init__(self, root: str | Path | None):
        self.root = Path(root) if root is not None else None

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
        return {"digests": {k: v for k, v in dg.items() if isinstance(v, str)},
                "timings_s": {k: float(v) for k, v in t.items()}, "rejected": {k: str(v) for k, v in r.items()},
                "medians_s": {k: float(v) for k, v in med.items() if _seconds(v)},
                "mins_s": {k: float(v) for k, v in lo.items() if _seconds(v)},
                "load": float(load) if _seconds(load) else None,
                "cores": cores if _count(cores) else None,
                "noisy": d.get("noisy") is True, "tries": tries if _count(tries) else 1}

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
        except OSError as e:
            log.warning("cannot write the GEMM timing cache %s: %s", path, e)


__all__ = ["CACHE_VERSION", "TimingCache"]
