"""On-disk artifact cache for execution plans, keyed by what determines them.

Key fields: graph hash, recipe hash, target, bucket, graphmode and torch versions, and the
recipe's `codegen.isa` cap (a field added later is left out of the digest at the value
every earlier entry had, so those entries still hit). An entry is
a folder `<root>/plans/<digest>/` holding `plan.json` and `meta.json` (the key fields and the
sha256 of plan.json); kernel libraries live in `<root>/kernels` (backends/cpu/build.py).
Writes go to a temporary folder renamed into place (atomic). A read goes through
graphmode/untrusted.py (regular files only, bounded sizes, nothing outside the root) and
checks meta.json's shape, key and checksum; anything else found there (a FIFO, a device or a
link in place of a file, a file in place of the folder, JSON of the wrong shape) is a
`corrupt` event and the entry is removed, never loaded. The checksum
only catches accidents: whoever loads a plan checks it against its key and graph
(plan/execution.py `load_plan`) and calls `invalidate` when it fails.
"""
from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch

from graphmode.errors import CacheError, GraphmodeError
from graphmode.paths import cache_root
from graphmode.untrusted import KiB, MiB, UntrustedFileError, parse_json, read_bytes, read_json
from graphmode.version import __version__

log = logging.getLogger("graphmode.cache")
# the temporary folders of a write (a plan, a kernel build or check, an artifact's extraction); one older
# than this outlived its writer (killed: SIGKILL, a crash), as no build runs past its compiler's timeout
LEFTOVER_AGE_S = 3600.0
_TEMP_PREFIXES = (".tmp-", ".build-", ".check-", ".extract-")
# the names graphmode writes under plans/, kernels/ and artifacts/: clear and prune remove those
# only (a --cache-dir pointed at a project folder with its own plans/ or kernels/ lost them)
_PLAN_NAME = re.compile(r"[0-9a-f]{24}")
_LIBRARY_STEM = re.compile(r"[0-9a-f]{32}")
_ARTIFACT_NAME = re.compile(r"[0-9a-f]{16,64}")
_PROBE_RECORD = re.compile(r"probe-[0-9a-f]+\.json")     # a compiler probe's record (toolchain.py), not a library
KEY_FIELDS = ("graph_hash", "recipe_hash", "target", "bucket", "graphmode", "torch", "isa")
FIELDS_SINCE_V1 = {"isa": "auto"}    # key field added later -> the value entries written before it had
PLAN_FILE = "plan.json"
_WARN = ("corrupt", "unusable", "unwritable")     # read_only: a setting (a pre-warmed image), said at info
_SAID_READ_ONLY: set[str] = set()
META_MAX_BYTES = 64 * KiB        # what meta.json may hold (ours are < 1 KiB)
PLAN_MAX_BYTES = 256 * MiB       # what plan.json may hold (a large model's plan is a few MiB)


def make_key(graph_hash: str, recipe_hash: str, target: str, bucket: Mapping[str, int],
             isa: str = "auto") -> dict[str, str]:
    return {"graph_hash": graph_hash, "recipe_hash": recipe_hash, "target": target,
            "bucket": ",".join(f"{k}={v}" for k, v in sorted(bucket.items())),
            "graphmode": __version__, "torch": torch.__version__, "isa": isa}


def key_fields(key: Mapping[str, Any]) -> dict[str, Any]:
    """`key`'s KEY_FIELDS, a later field missing from an older key read at its old value."""
    return {k: key.get(k, FIELDS_SINCE_V1.get(k)) for k in KEY_FIELDS}


def key_digest(key: Mapping[str, str]) -> str:
    d = {k: v for k, v in key_fields(key).items() if not (k in FIELDS_SINCE_V1 and v == FIELDS_SINCE_V1[k])}
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:24]


def _why(e: Exception) -> str:
    """A damaged entry's reason, from the error that found it."""
    if isinstance(e, GraphmodeError):
        return f"{e.where}: {e.message}" if isinstance(e, UntrustedFileError) and e.where else e.message
    return f"{type(e).__name__}: {e}"


def meta_problem(meta: Any) -> str | None:
    """Why `meta` (a parsed meta.json) is not one this cache wrote, or None."""
    if not isinstance(meta, dict):
        return f"meta.json holds a JSON {type(meta).__name__}, not an object"
    key, files = meta.get("key"), meta.get("files")
    if not isinstance(key, dict) or any(not isinstance(v, str) for v in key_fields(key).values()):
        return f"meta.json's key must map each of {', '.join(KEY_FIELDS)} to a string"
    if not isinstance(files, dict) or set(files) != {PLAN_FILE} or not isinstance(files[PLAN_FILE], str):
        return f"meta.json's files must be {{{PLAN_FILE!r}: sha256}}"
    created = meta.get("created", 0.0)
    if isinstance(created, bool) or not isinstance(created, (int, float)):
        return "meta.json's created is not a number"
    return None


def _remove(path: Path) -> bool:
    """Remove a file, link or folder tree (whatever sits at `path`); whether it is gone."""
    try:
        if path.is_symlink() or not path.is_dir():
            path.unlink()
        else:
            shutil.rmtree(path)
    except OSError:
        pass
    return not os.path.lexists(path)


@dataclass
class Entry:
    digest: str
    path: Path
    key: dict[str, str]
    size: int
    created: float
    last_used: float
    kind: str = "plan"                 # or "kernel" (a library: its .so, seal and source), "artifact", "leftover"
    files: tuple[Path, ...] = ()       # what removing it removes (default: `path`)


class ArtifactCache:
    def __init__(self, root: str | Path | None = None):
        self.root = cache_root(root)
        self.plans = self.root / "plans"
        self.kernels = self.root / "kernels"
        self.artifacts = self.root / "artifacts"
        self.events: list[dict[str, Any]] = []
        self.read_only: str | None = None     # why entries are read and none written (a pre-warmed image)

    def report(self, kind: str, **info: Any) -> None:
        """Record a cache event (a warning for corrupt entries and an unusable cache)."""
        self.events.append({"event": kind, **info})
        said = "; ".join(f"{k} {v}" for k, v in info.items())     # read by a person: no dict repr
        (log.warning if kind in _WARN else log.info)("cache %s: %s", kind, said)

    def unusable(self) -> str | None:
        """Why this cache cannot be read (reported once), or None when it can. A cache whose
        folders can be read but not written (a read-only file system, a pre-warmed cache baked into
        an image) is read as it is: `read_only` says why nothing is written."""
        try:
            for d in (self.plans, self.kernels):
                if not d.is_dir():
                    d.mkdir(parents=True, exist_ok=True)
                os.listdir(d)
        except OSError as e:
            why = f"cannot use the cache folder {self.root}: {e}"
            self.report("unusable", path=str(self.root), reason=why,
                        fix="make it a folder you can write, or pass another cache_dir; running uncached meanwhile")
            return why
        try:
            for d in (self.plans, self.kernels):
                fd, probe = tempfile.mkstemp(prefix=".probe-", dir=d)
                os.close(fd)
                os.unlink(probe)
        except OSError as e:
            if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
                self.read_only = f"cannot write the cache folder {self.root}: {e.strerror or e}"
                if str(self.root) not in _SAID_READ_ONLY:       # once per process, not per bucket
                    _SAID_READ_ONLY.add(str(self.root))
                    self.report("read_only", path=str(self.root), reason=self.read_only,
                                fix="its plans and kernels are read; new ones are built in a temporary folder for "
                                    "this process only (make it writable to keep them)")
                return None
            why = f"cannot use the cache folder {self.root}: {e}"
            self.report("unusable", path=str(self.root), reason=why,
                        fix="make it a folder you can write, or pass another cache_dir; running uncached meanwhile")
            return why
        return None

    # ---- read / write --------------------------------------------------------------------
    def get(self, key: Mapping[str, str]) -> dict | None:
        """The cached plan JSON for `key`, or None (miss, or a corrupt entry now removed)."""
        d = self.plans / key_digest(key)
        if not os.path.lexists(d):
            self.report("miss", key=dict(key))
            return None
        try:
            if d.is_symlink() or not d.is_dir():
                raise CacheError("the entry is not a folder")
            meta = read_json(d / "meta.json", limit=META_MAX_BYTES, root=self.root)
            why = meta_problem(meta)
            if why is not None:
                raise CacheError(why)
            if key_fields(meta["key"]) != key_fields(key):
                raise CacheError("entry key does not match its folder (stale or tampered)")
            try:
                data = read_bytes(d / PLAN_FILE, limit=PLAN_MAX_BYTES, root=self.root, sha256=meta["files"][PLAN_FILE])
            except UntrustedFileError as e:
                raise CacheError(f"checksum mismatch in {PLAN_FILE}" if "sha256" in e.message
                                 else f"{PLAN_FILE}: {e.message}") from None
            plan = parse_json(data, nonfinite=True)     # json.dumps writes a -inf pad value as -Infinity
            if not isinstance(plan, dict):
                raise CacheError(f"{PLAN_FILE} holds a JSON {type(plan).__name__}, not an object")
        except (OSError, ValueError, GraphmodeError) as e:
            self.invalidate(key, _why(e))
            return None
        try:
            os.utime(d / "meta.json")
        except OSError:
            pass
        self.report("hit", key=dict(key))
        return plan

    def invalidate(self, key: Mapping[str, str], reason: str) -> None:
        """Report the entry for `key` corrupt and remove it, so the next put rebuilds it."""
        d = self.plans / key_digest(key)
        self.report("corrupt", path=str(d), reason=reason, removed=_remove(d))

    def put(self, key: Mapping[str, str], plan_json: Mapping[str, Any]) -> Path:
        final = self.plans / key_digest(key)
        try:
            self.plans.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=self.plans))
        except OSError as e:
            raise CacheError(f"cannot write cache entry under {self.plans}: {e}",
                             fix="check permissions/disk space or pass another cache dir") from None
        try:
            data = json.dumps(plan_json).encode()
            (tmp / PLAN_FILE).write_bytes(data)
            meta = {"key": dict(key), "files": {PLAN_FILE: hashlib.sha256(data).hexdigest()}, "created": time.time()}
            (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
            _remove(final)
            os.replace(tmp, final)
        except OSError as e:
            _remove(tmp)
            raise CacheError(f"cannot write cache entry under {self.plans}: {e}",
                             fix="check permissions/disk space or pass another cache dir") from None
        return final

    # ---- management ------------------------------------------------------------------------
    def entries(self) -> list[Entry]:
        """Every entry, a damaged one with key {"corrupt": why} (so prune and clear see it)."""
        if not os.path.lexists(self.plans):
            return []
        try:
            names = sorted(os.listdir(self.plans))
        except OSError as e:
            raise CacheError(f"cannot list the cache folder {self.plans}: {e}", where="cache_dir",
                             fix="make it a folder you can write, or pass another --cache-dir") from None
        out = []
        for name in names:
            if name.startswith((".tmp-", ".probe-")) or not _PLAN_NAME.fullmatch(name):
                continue                          # a temporary, or not graphmode's (see foreign())
            d = self.plans / name
            size, created, used = _size(d), 0.0, 0.0
            try:
                if d.is_symlink() or not d.is_dir():
                    raise CacheError("not a folder")
                meta = read_json(d / "meta.json", limit=META_MAX_BYTES, root=self.root)
                why = meta_problem(meta)
                if why is not None:
                    raise CacheError(why)
                key = {k: str(v) for k, v in {**meta["key"], **key_fields(meta["key"])}.items()}
                created = float(meta.get("created", 0.0))
                used = (d / "meta.json").stat().st_mtime
            except (OSError, ValueError, GraphmodeError) as e:
                key = {"corrupt": _why(e)}
            out.append(Entry(name, d, key, size, created, used))
        return out

    def libraries(self) -> list[Entry]:
        """Every kernel library under kernels/ (its .so, seal and source as one entry), last used
        when a load last touched its seal (backends/cpu/build.py), and every .gm extracted under
        artifacts/, last used when it was extracted."""
        out = []
        groups: dict[str, list[Path]] = {}
        for p in _listed(self.kernels):             # (a dot name: the folder's seal key, a build's temporary;
            if _LIBRARY_STEM.fullmatch(p.name.split(".")[0]):     # probe-*.json: a compiler probe's record)
                groups.setdefault(p.name.split(".")[0], []).append(p)
        for stem, files in sorted(groups.items()):
            times = [_mtime(f) for f in files]
            out.append(Entry(stem, self.kernels / f"{stem}.so", {"kind": "kernel"}, sum(_size(f) for f in files),
                             min(times), max(times), "kernel", tuple(files)))
        for d in _listed(self.artifacts):
            if _ARTIFACT_NAME.fullmatch(d.name):
                t = _mtime(d / "complete") or _mtime(d)
                out.append(Entry(d.name, d, {"kind": "artifact"}, _size(d), t, t, "artifact"))
        return out

    def leftovers(self, min_age_s: float = LEFTOVER_AGE_S) -> list[Entry]:
        """The temporary folders of writes whose process died before it finished (older than
        `min_age_s`: a live build's folder is younger): nothing reads them, prune removes them."""
        now, out = time.time(), []
        for folder in (self.plans, self.kernels, self.artifacts):
            for d in _listed(folder):
                t = _mtime(d)
                if d.name.startswith(_TEMP_PREFIXES) and d.is_dir() and not d.is_symlink() and now - t >= min_age_s:
                    out.append(Entry(d.name, d, {"kind": "leftover"}, _size(d), t, t, "leftover"))
        return out

    def foreign(self) -> list[Path]:
        """What sits under plans/, kernels/ and artifacts/ that graphmode did not write (by its
        names): clear and prune leave it, and say so."""
        out = []
        for folder, named in ((self.plans, lambda n: _PLAN_NAME.fullmatch(n)),
                              (self.kernels, lambda n: _LIBRARY_STEM.fullmatch(n.split(".")[0])
                               or _PROBE_RECORD.fullmatch(n)),
                              (self.artifacts, lambda n: _ARTIFACT_NAME.fullmatch(n))):
            if os.path.lexists(folder) and (folder.is_symlink() or not folder.is_dir()):
                out.append(folder)
                continue
            out += [p for p in _listed(folder) if not p.name.startswith(".") and not named(p.name)]
        return out

    def clear(self) -> list[Entry]:
        """Remove every plan, kernel library and extracted artifact graphmode wrote (a damaged one
        too), and what interrupted writes left; the timing cache, host probe and knowledge base
        stay, and so does anything else under those folders (`foreign`)."""
        for d in (self.plans, self.kernels, self.artifacts):      # a file or link where graphmode's folder goes
            if os.path.lexists(d) and (d.is_symlink() or not d.is_dir()) and not _remove(d):
                raise CacheError(f"could not remove {d}", where="cache_dir", fix="check its permissions")
        gone = self.entries() + self.libraries() + self.leftovers(min_age_s=0.0)
        for e in gone:
            if not all([_remove(p) for p in e.files or (e.path,)]):
                raise CacheError(f"could not remove {e.path}", where="cache_dir", fix="check its permissions")
        return gone

    def prune(self, max_bytes: int) -> list[Entry]:
        """Remove what interrupted writes left behind, then the least recently used plans, kernel
        libraries and extracted artifacts until the cache fits `max_bytes` (a plan whose kernels
        went rebuilds them on its next load)."""
        removed = [e for e in self.leftovers() if _remove(e.path)]
        entries = sorted(self.entries() + self.libraries(), key=lambda e: e.last_used)
        total = sum(e.size for e in entries)
        for e in entries:
            if total <= max_bytes:
                break
            if all([_remove(p) for p in e.files or (e.path,)]):
                total -= e.size
                removed.append(e)
        return removed

    def explain(self, key: Mapping[str, str]) -> dict[str, Any]:
        """Why a lookup of `key` hits or misses: the nearest entry and the fields that differ."""
        digest = key_digest(key)
        entries = [e for e in self.entries() if "corrupt" not in e.key]
        if any(e.digest == digest for e in entries):
            return {"result": "hit", "digest": digest, "differs": {}}
        if not entries:
            return {"result": "miss", "reason": "the cache is empty", "differs": {}}

        def distance(e: Entry) -> int:
            return sum(1 for k in KEY_FIELDS if e.key.get(k) != key[k])
        near = min(entries, key=distance)
        differs = {k: {"wanted": key[k], "nearest_entry": near.key.get(k)} for k in KEY_FIELDS
                   if near.key.get(k) != key[k]}
        reason = "; ".join(f"{k} differs ({v['nearest_entry']} cached, {v['wanted']} wanted)"
                           for k, v in differs.items())
        if "graph_hash" in differs:      # the nearest entry is another model's (or this one's before a change)
            reason = ("no entry holds this graph; the nearest holds another (another model, or this one "
                      f"changed): {reason}")
        return {"result": "miss", "nearest": near.digest, "differs": differs, "reason": reason}


def _listed(folder: Path) -> list[Path]:
    """The folder's entries (none where it is missing or unreadable: prune and clear go on)."""
    try:
        return sorted(folder.iterdir()) if folder.is_dir() and not folder.is_symlink() else []
    except OSError:
        return []


def _mtime(path: Path) -> float:
    try:
        return path.lstat().st_mtime
    except OSError:
        return 0.0


def _size(path: Path) -> int:
    """Bytes under `path` (a file or folder; what cannot be read counts 0)."""
    try:
        if path.is_symlink() or not path.is_dir():
            return path.lstat().st_size
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())
    except OSError:
        return 0
