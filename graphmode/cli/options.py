"""Options several commands share. GRAPHMODE_CACHE_DIR is read here and nowhere else: each
command passes the root on as an argument (graphmode.paths lays out the folders under it).

    cache_dir: Optional[Path] = CacheDir
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

CacheDir = typer.Option(None, "--cache-dir", envvar="GRAPHMODE_CACHE_DIR", show_envvar=True,
                        help="cache root: plans, kernels, timing cache, host probe, calibration, ONNX exports "
                             "(default ~/.cache/graphmode)")

KbPath = typer.Option(None, "--kb", envvar="GRAPHMODE_KB", show_envvar=True,
                      help="knowledge base file, shareable by a team (default <cache root>/kb/kb.sqlite)")


def kb_file(kb: Optional[Path], cache_dir: Optional[Path]) -> Path:
    """The knowledge base every measuring command records into."""
    from graphmode.paths import cache_layout
    return kb if kb is not None else cache_layout(cache_dir).kb / "kb.sqlite"
