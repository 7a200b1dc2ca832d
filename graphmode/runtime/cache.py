"""On-disk artifact cache for execution plans, keyed by what determines them.

Key fields: graph hash, recipe hash, target, bucket, graphmode and torch versions. An entry is
a folder `<root>/plans/<digest>/` holding `plan.json` and `meta.json` (the key fields and the
sha256 of every file). Writes go to a temporary folder renamed into place (atomic); a read
verifies checksums and key, and a corrupt or stale entry is reported, removed and rebuilt —
never loaded.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch

import graphmode
from graphmode.errors import CacheError

log = logging.getLogger("graphmode.cache")
KEY_FIELDS = ("graph_hash", "recipe_hash", "target", "bucket", "graphmode", "torch")


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "graphmode"


def make_key(graph_hash: str, recipe_hash: str, target: str, bucket: Mapping[str, int]) -> dict[str, str]:
    return {"graph_hash": graph_hash, "recipe_hash": recipe_hash, "target": target,
            "bucket": ",".join(f"{k}={v}" for k, v in sorted(bucket.items())),
            "graphmode": graphmode.__version__, "torch": torch.__version__}


def key_digest(key: Mapping[str, str]) -> str:
    return hashlib.sha256(json.dumps({k: key[k] for k in KEY_FIELDS}, sort_keys=True).encode()).hexdigest()[:24]


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@dataclass
class Entry:
    digest: str
    path: Path
    key: dict[str, str]
    size: int
    created: float
    last_used: float


class ArtifactCache:
    def __init__(self, root: str | Path | None = None):
        self.root = Path(root) if root is not None else default_cache_dir()
        self.plans = self.root / "plans"
        self.events: list[dict[str, Any]] = []

    def _event(self, kind: str, **info: Any) -> None:
        self.events.append({"event": kind, **info})
        (log.warning if kind == "corrupt" else log.info)("cache %s %s", kind, info)

    # ---- read / write --------------------------------------------------------------------
    def get(self, key: Mapping[str, str]) -> dict | None:
        """The cached plan JSON for `key`, or None (miss, or a corrupt entry now removed)."""
        d = self.plans / key_digest(key)
        if not d.exists():
            self._event("miss", key=dict(key))
            return None
        try:
            meta = json.loads((d / "meta.json").read_text())
            if {k: meta["key"].get(k) for k in KEY_FIELDS} != {k: key[k] for k in KEY_FIELDS}:
                raise CacheError("entry key does not match its folder (stale or tampered)")
            for name, digest in meta["files"].items():
                if _sha(d / name) != digest:
                    raise CacheError(f"checksum mismatch in {name}")
            plan = json.loads((d / "plan.json").read_text())
        except (OSError, ValueError, KeyError, CacheError) as e:
            self._event("corrupt", path=str(d), reason=str(e))
            shutil.rmtree(d, ignore_errors=True)
            return None
        try:
            os.utime(d / "meta.json")
        except OSError:
            pass
        self._event("hit", key=dict(key))
        return plan

    def put(self, key: Mapping[str, str], plan_json: Mapping[str, Any]) -> Path:
        self.plans.mkdir(parents=True, exist_ok=True)
        final = self.plans / key_digest(key)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=self.plans))
        try:
            (tmp / "plan.json").write_text(json.dumps(plan_json))
            meta = {"key": dict(key), "files": {"plan.json": _sha(tmp / "plan.json")}, "created": time.time()}
            (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
            if final.exists():
                shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise CacheError(f"cannot write cache entry under {self.plans}: {e}",
                             fix="check permissions/disk space or pass another cache dir") from None
        return final

    # ---- management ------------------------------------------------------------------------
    def entries(self) -> list[Entry]:
        out = []
        if not self.plans.exists():
            return out
        for d in sorted(self.plans.iterdir()):
            if d.name.startswith(".tmp-") or not d.is_dir():
                continue
            size = sum(f.stat().st_size for f in d.rglob("*") if f.is_file())
            try:
                meta = json.loads((d / "meta.json").read_text())
                key = meta["key"]
                created = meta.get("created", 0.0)
                used = (d / "meta.json").stat().st_mtime
            except (OSError, ValueError, KeyError):
                key, created, used = {"corrupt": "unreadable meta.json"}, 0.0, 0.0
            out.append(Entry(d.name, d, key, size, created, used))
        return out

    def clear(self) -> int:
        n = len(self.entries())
        shutil.rmtree(self.plans, ignore_errors=True)
        return n

    def prune(self, max_bytes: int) -> list[Entry]:
        """Remove least-recently-used entries until the total size fits `max_bytes`."""
        entries = sorted(self.entries(), key=lambda e: e.last_used)
        total = sum(e.size for e in entries)
        removed = []
        for e in entries:
            if total <= max_bytes:
                break
            shutil.rmtree(e.path, ignore_errors=True)
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
        return {"result": "miss", "nearest": near.digest, "differs": differs,
                "reason": "; ".join(f"{k} differs ({v['nearest_entry']} cached, {v['wanted']} wanted)"
                                    for k, v in differs.items())}
