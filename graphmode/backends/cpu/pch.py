"""A precompiled header for the x86 intrinsics kernels include, one per process and flag set.

Parsing `<immintrin.h>` is most of what g++ spends on a small kernel library: an empty
translation unit takes 0.05 s, 0.33 s with it, and a typical library 0.5-0.8 s in all (a tiny
decoder compiles 25 of them). Made once (~0.8 s) and read with `-include`, it costs 0.06 s. The
header is templates/simd.h itself, guard and all, so the text of it that follows in the
translation unit adds nothing; GCC reads a precompiled header only where it was made with the
same code-generation flags and macros (else it reads the header's text), so the libraries are
the ones built without it and keep their build keys.

It lives in a private temporary folder of this process (never in the shared cache, where a
crafted one would reach every library built after it), and is made at the second library of a
process that needs it: a command that compiles one library does not pay for it. GCC only (clang
reads its own format); a compile that fails with it is retried without it, and it is not used
again in this process, so it can make a build faster and never make one fail.
"""
from __future__ import annotations

import logging
import os
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Sequence

from graphmode.backends.cpu.abi import template

log = logging.getLogger("graphmode.backends.cpu")

HEADER = "simd.h"
NEEDED_BY = "#define GM_SIMD_H"      # in a translation unit that holds simd.h's text
TIMEOUT_S = 120

_LOCK = threading.Lock()
_STATE: dict[tuple, "_Header"] = {}
_FOLDERS: list[tempfile.TemporaryDirectory] = []


class _Header:
    def __init__(self) -> None:
        self.seen = 0                   # libraries that needed it so far
        self.path: Path | None = None   # the header whose .gch is built
        self.state = "unbuilt"          # unbuilt | building | ready | failed


def _key(cxx: str, flags: Sequence[str]) -> tuple:
    return (os.getpid(), cxx, tuple(flags))       # a forked child makes its own (its parent's folder goes)


def is_gcc(version: str) -> bool:
    return "clang" not in version.lower()


def flags_for(cxx: str, version: str, flags: Sequence[str], tu: str) -> list[str]:
    """The flags that make a compile of `tu` with `cxx` and `flags` read the precompiled header,
    or [] (not needed, not GCC, the first library of the process, being built by another thread,
    failed)."""
    if NEEDED_BY not in tu or not is_gcc(version):
        return []
    key = _key(cxx, flags)
    with _LOCK:
        h = _STATE.setdefault(key, _Header())
        h.seen += 1
        if h.state == "ready" and h.path is not None and h.path.with_suffix(".h.gch").is_file():
            return ["-include", str(h.path)]
        if h.state != "unbuilt" or h.seen < 2:
            return []
        h.state = "building"
    path = _build(cxx, flags)
    with _LOCK:
        h.path, h.state = path, ("ready" if path is not None else "failed")
    return ["-include", str(path)] if path is not None else []


def _build(cxx: str, flags: Sequence[str]) -> Path | None:
    cflags = [f for f in flags if f != "-shared"]
    try:
        folder = tempfile.TemporaryDirectory(prefix="gm-pch-")
        _FOLDERS.append(folder)          # removed at exit
        header = Path(folder.name) / "gm_simd.h"
        header.write_text(template(HEADER))
        res = subprocess.run([cxx, *cflags, "-fPIC", "-x", "c++-header", str(header), "-o", f"{header}.gch"],
                             capture_output=True, text=True, timeout=TIMEOUT_S)
    except (OSError, subprocess.SubprocessError) as e:
        log.debug("no precompiled header: %s", e)
        return None
    if res.returncode != 0:
        log.debug("no precompiled header: %s", res.stderr[-500:])
        return None
    return header


def failed(flags: Sequence[str], cxx: str) -> None:
    """A compile with the header failed and then passed without it: not used again here."""
    with _LOCK:
        h = _STATE.get(_key(cxx, flags))
        if h is not None:
            h.state = "failed"
    log.warning("a kernel library compiled only without the precompiled system header; it is not used again "
                "in this process")


__all__ = ["flags_for", "failed", "is_gcc", "NEEDED_BY"]
