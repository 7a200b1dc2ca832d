"""Where graphmode keeps what it writes to disk: one layout under one root.

Every module that caches something takes the root (or the folder below it) as an argument;
this module is the only one that knows the folder names and the default root, so moving a
cache is a one-line change and `--cache-dir` moves all of them together.

The root is, in order: the caller's explicit argument (`cache_dir=`, `--cache-dir`), else
$GRAPHMODE_CACHE_DIR, else the platform's user cache folder ($XDG_CACHE_HOME/graphmode, or
~/.cache/graphmode). `cache_root` decides it, per call and never at import (a HOME or variable
set by a test or a service manager is honoured); it is the one reader of these variables
outside the CLI, so the CLI and the Python API (`graphmode.compile`, `graphmode.load`,
`generate`, the server, the KB and the timing caches) share plans whoever built them.

    <root>/plans/<digest>/         execution plans                  runtime/cache.py
    <root>/kernels/                compiled kernel libraries        backends/cpu/build.py
    <root>/tactics/                GEMM/conv timing cache           backends/cpu/tactics/
    <root>/targets/host.json       the host probe                   targets/host.py
    <root>/calibration/<t>.json    cost-model calibration of t      graphmode profile
    <root>/onnx/                   ONNX exports of bundles          capture/onnx_export.py
    <root>/kb/kb.sqlite            knowledge base                   graphmode/kb
    <root>/artifacts/<digest>/     unpacked .gm artifacts           runtime/artifact.py
    <root>/spill/                  constants the passes made        hostmem.py
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

CACHE_DIR_VARIABLE = "GRAPHMODE_CACHE_DIR"


def cache_root(explicit: str | os.PathLike | None = None) -> Path:
    """The cache root: `explicit` when given, else $GRAPHMODE_CACHE_DIR, else the platform's
    user cache folder ($XDG_CACHE_HOME when set to an absolute path, else ~/.cache) / graphmode."""
    if explicit is not None:
        return Path(explicit)
    chosen = os.environ.get(CACHE_DIR_VARIABLE, "").strip()
    if chosen:
        return Path(chosen).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    # the XDG spec: a relative XDG_CACHE_HOME is invalid and is ignored
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "graphmode"


@dataclass(frozen=True)
class CacheLayout:
    """The folders under one cache root (nothing is created here: each owner creates its own)."""

    root: Path

    @property
    def plans(self) -> Path:
        return self.root / "plans"

    @property
    def kernels(self) -> Path:
        return self.root / "kernels"

    @property
    def tactics(self) -> Path:
        return self.root / "tactics"

    @property
    def targets(self) -> Path:
        return self.root / "targets"

    @property
    def onnx(self) -> Path:
        return self.root / "onnx"

    @property
    def kb(self) -> Path:
        return self.root / "kb"

    @property
    def kb_file(self) -> Path:
        """The knowledge base every measuring command records into unless told another file."""
        return self.kb / "kb.sqlite"

    @property
    def artifacts(self) -> Path:
        return self.root / "artifacts"

    @property
    def spill(self) -> Path:
        return self.root / "spill"

    def calibration(self, target: str) -> Path:
        return self.root / "calibration" / f"{target}.json"


def cache_layout(root: str | os.PathLike | None = None) -> CacheLayout:
    """The layout under `root` (None: the default root, see `cache_root`)."""
    return CacheLayout(cache_root(root))


def shown(path: str | os.PathLike) -> str:
    """How output names a file: relative to the working folder when it is inside it, else with
    the home folder written `~`, else as it is. Output saved as a result (bench/results/*.txt)
    then names no one machine's folders."""
    p = Path(os.path.abspath(path))
    try:
        home: Path | None = Path.home()
    except RuntimeError:                      # no HOME and no password entry
        home = None
    for base, prefix in ((Path.cwd(), None), (home, "~")):
        if base is None:
            continue
        try:
            rel = p.relative_to(os.path.abspath(base))
        except ValueError:
            continue
        return str(Path(prefix) / rel) if prefix else str(rel)
    return str(path)
