"""Where graphmode keeps what it writes to disk: one layout under one root.

Every module that caches something takes the root (or the folder below it) as an argument;
this module is the only one that knows the folder names and the default root, so moving a
cache is a one-line change and `--cache-dir` moves all of them together. The default,
~/.cache/graphmode, is resolved when asked, never at import: a HOME set by a test or a
service manager is honoured. Only the CLI reads GRAPHMODE_CACHE_DIR (`graphmode.cli.options`).

    <root>/plans/<digest>/         execution plans                  runtime/cache.py
    <root>/kernels/                compiled kernel libraries        backends/cpu/build.py
    <root>/tactics/                GEMM/conv timing cache           backends/cpu/tactics.py
    <root>/targets/host.json       the host probe                   targets/host.py
    <root>/calibration/<t>.json    cost-model calibration of t      graphmode profile
    <root>/onnx/                   ONNX exports of bundles          capture/onnx_export.py
    <root>/kb/                     knowledge base                   graphmode/kb
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


def default_root() -> Path:
    return Path.home() / ".cache" / "graphmode"


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

    def calibration(self, target: str) -> Path:
        return self.root / "calibration" / f"{target}.json"


def cache_layout(root: str | os.PathLike | None = None) -> CacheLayout:
    """The layout under `root` (None: the default root)."""
    return CacheLayout(Path(root) if root is not None else default_root())
