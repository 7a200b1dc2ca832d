"""The tuning journal: one JSON line per finished trial, so an interrupted `graphmode tune`
resumes where it stopped.

Lines carry the run key (a digest of the base recipe, model, hardware, objective, tolerance,
search space and workload): rerunning the same command replays that run's trials instead of
measuring them again, and a changed recipe or space starts a new run in the same file. Each
line is flushed and fsync'd when its trial ends; a line cut off by a kill is skipped. One tune
at a time holds a journal (an flock on `<journal>.lock`, released at its end or when its process
dies): two at once interleaved their trials under one run key and both wrote a version.
A run also has a session: new at the first start and at `--fresh`, kept by a resume. The
knowledge base compares trials within a session; two journals of one recipe's content (a copy
under another name) are two sessions of one run key, which it had pooled as one comparison.
"""
from __future__ import annotations

import fcntl
import json
import os
import uuid
from pathlib import Path
from typing import Any

from graphmode.errors import GraphmodeError
from graphmode.tune.trial import TrialResult


class Journal:
    def __init__(self, path: str | Path, run_key: str):
        self.path = Path(path)
        self.run_key = run_key
        self.skipped = 0            # unreadable lines (a trial cut off mid-write)
        self._held: int | None = None

    def hold(self) -> None:
        """Take the journal for this run, or refuse while another tune holds it."""
        lock = self.path.with_name(self.path.name + ".lock")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        except OSError:
            return                  # a folder it cannot write: the journal's own writes will say so
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise GraphmodeError(f"another graphmode tune is running with the journal {self.path}", where="--recipe",
                                 value=str(self.path), fix="wait for it to end (it resumes from the same journal "
                                 "when run again), or tune a copy of the recipe file under another name") from None
        self._held = fd

    def release(self) -> None:
        if self._held is not None:
            os.close(self._held)
            self._held = None

    def __del__(self) -> None:
        self.release()

    def load(self) -> dict[str, TrialResult]:
        """This run's finished trials by configuration key (since its last fresh start)."""
        out: dict[str, TrialResult] = {}
        if not self.path.is_file():
            return out
        for line in self.path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                d = json.loads(line)
                if d.get("run") == self.run_key and d.get("kind") == "start" and d.get("fresh"):
                    out.clear()            # `tune --fresh` started this run over: what came before is not it
                if d.get("run") == self.run_key and d.get("kind") == "trial":
                    r = TrialResult.from_json(d["trial"])
                    out[r.key] = r
            except (ValueError, KeyError, TypeError):
                self.skipped += 1
        return out

    def _write(self, obj: dict[str, Any]) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps(obj, sort_keys=True, default=str) + "\n")
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            raise GraphmodeError(f"the tuning journal cannot be written: {e.strerror or e}", where="--recipe",
                                 value=str(self.path), fix="the journal goes beside the recipe file: tune a copy of "
                                 "the recipe in a folder you can write (and with free space)") from None

    def session(self, fresh: bool) -> str:
        """This run's session: the last start's for a resume, a new one for a first or fresh start."""
        last = None
        if not fresh and self.path.is_file():
            for line in self.path.read_text(encoding="utf-8", errors="replace").splitlines():
                try:
                    d = json.loads(line)
                except ValueError:
                    continue
                if isinstance(d, dict) and d.get("run") == self.run_key and d.get("kind") == "start":
                    last = d.get("session") if isinstance(d.get("session"), str) else None
        return last or uuid.uuid4().hex[:16]

    def start(self, header: dict[str, Any]) -> None:
        self._write({"run": self.run_key, "kind": "start", **header})

    def append(self, r: TrialResult) -> None:
        self._write({"run": self.run_key, "kind": "trial", "trial": r.to_json()})
