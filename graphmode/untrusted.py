"""The one reader of files graphmode did not just write: cache entries, artifact extractions,
timing records, knowledge-base imports.

A disk can hold anything in place of what we wrote: a FIFO (reading it blocks for ever), a
device (/dev/zero never ends), a link out of the folder, a file grown to gigabytes, flipped
bits. Every such read goes through `open_file`, which opens without blocking or following a
link out of `root`, then checks on the open descriptor (no race with a swap of the path)
that it is a regular file no larger than the caller's bound, before a byte is read; the
content hash, where the caller knows it, is checked on the bytes actually read. JSON is
parsed by `parse_json`: finite numbers only, bounded nesting. Anything wrong is one
`UntrustedFileError` naming the file and why; each caller turns it into its own outcome (a
cache entry rebuilt, an artifact refused, an import refused).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import stat
import zipfile
from pathlib import Path
from typing import Any, Iterator

from graphmode.errors import GraphmodeError

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
MAX_JSON_DEPTH = 64
_CHUNK = 1 << 20


class UntrustedFileError(GraphmodeError):
    """A file on disk is not what its reader accepts (type, size, hash or content)."""


def file_kind(mode: int) -> str:
    """What a stat mode says the file is, in words."""
    for test, name in ((stat.S_ISFIFO, "FIFO"), (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"),
                       (stat.S_ISSOCK, "socket"), (stat.S_ISDIR, "folder"), (stat.S_ISLNK, "symbolic link")):
        if test(mode):
            return name
    return "special file"


def _outside(path: Path, root: Path) -> str | None:
    """Where `path` really is when that is outside `root`, else None (resolved once: a link
    replaced meanwhile makes a second resolution fail)."""
    real, top = os.path.realpath(path), os.path.realpath(root)
    return None if real == top or real.startswith(top.rstrip(os.sep) + os.sep) else real


class OpenFile:
    """A regular file opened for reading: `fd`, `size`; a context manager that closes it."""

    def __init__(self, fd: int, size: int, path: Path):
        self.fd, self.size, self.path = fd, size, path

    def __enter__(self) -> "OpenFile":
        return self

    def __exit__(self, *exc: Any) -> None:
        os.close(self.fd)

    def chunks(self) -> Iterator[bytes]:
        """The file's bytes in chunks, at most `size` of them (a file growing meanwhile is cut)."""
        left = self.size
        while left > 0:
            b = os.read(self.fd, min(_CHUNK, left))
            if not b:
                raise UntrustedFileError(f"the file shrank while it was read ({left} of {self.size} bytes missing)",
                                         where=str(self.path))
            left -= len(b)
            yield b


def open_file(path: str | os.PathLike, *, limit: int, root: str | os.PathLike | None = None) -> OpenFile:
    """`path` opened for reading if it is a regular file of at most `limit` bytes (and, with
    `root`, really inside `root` after following every link); else UntrustedFileError."""
    path = Path(path)
    try:
        real = None if root is None else _outside(path, Path(root))
    except OSError as e:      # a link replaced while it was resolved (realpath's readlink: EINVAL)
        raise UntrustedFileError(f"cannot resolve it: {e.strerror or e}", where=str(path)) from None
    if real is not None:
        raise UntrustedFileError(f"it resolves to {real}, outside {root}", where=str(path),
                                 fix="remove the link; graphmode only reads its own folder there")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))   # a FIFO opens, not blocks
    except OSError as e:
        raise UntrustedFileError(f"cannot open it: {e.strerror or e}", where=str(path)) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UntrustedFileError(f"it is a {file_kind(st.st_mode)}, not a regular file", where=str(path),
                                     fix="remove it; graphmode writes only regular files there")
        if st.st_size > limit:
            raise UntrustedFileError(f"it holds {st.st_size} bytes, more than the {limit} such a file may",
                                     where=str(path), fix="remove it; it is not one graphmode wrote")
    except BaseException:
        os.close(fd)
        raise
    return OpenFile(fd, st.st_size, path)


def read_bytes(path: str | os.PathLike, *, limit: int, root: str | os.PathLike | None = None,
               sha256: str | None = None) -> bytes:
    """The bytes of a regular file within `limit` (see `open_file`), checked against `sha256` when given."""
    with open_file(path, limit=limit, root=root) as f:
        try:
            data = b"".join(f.chunks())
        except OSError as e:
            raise UntrustedFileError(f"cannot read it: {e.strerror or e}", where=str(path)) from None
    if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256:
        raise UntrustedFileError("its content does not match its recorded sha256 (damaged or edited)",
                                 where=str(path))
    return data


def file_sha256(path: str | os.PathLike, *, limit: int, root: str | os.PathLike | None = None) -> str:
    """The sha256 of a regular file within `limit`, streamed (for files mapped or loaded by path)."""
    h = hashlib.sha256()
    with open_file(path, limit=limit, root=root) as f:
        try:
            for b in f.chunks():
                h.update(b)
        except OSError as e:
            raise UntrustedFileError(f"cannot read it: {e.strerror or e}", where=str(path)) from None
    return h.hexdigest()


def _depth(text: str) -> int:
    """The deepest nesting of brackets outside strings (checked before parsing: the parser
    recurses, so a deep document costs a RecursionError at best)."""
    depth = deepest = 0
    in_str = esc = False
    for ch in text:
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def _finite(text: str) -> float:
    v = float(text)
    if not math.isfinite(v):
        raise ValueError(f"the number {text[:40]} is out of range for a 64-bit float")
    return v


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


_NONFINITE = {"Infinity": math.inf, "-Infinity": -math.inf, "NaN": math.nan}


def _nonfinite(name: str) -> float:
    return _NONFINITE[name]


def parse_json(text: str | bytes, *, max_depth: int = MAX_JSON_DEPTH, nonfinite: bool = False) -> Any:
    """Strict JSON: finite numbers only (no NaN, Infinity or 1e999), integers of at most 4300
    digits, nesting at most `max_depth`. ValueError says what is wrong. `nonfinite` reads the
    Infinity, -Infinity and NaN Python's json writes (a plan's pad value of -inf)."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"not UTF-8 text ({e.reason} at byte {e.start})") from None
    if ("[" in text or "{" in text) and _depth(text) > max_depth:
        raise ValueError(f"nested more than {max_depth} levels deep")
    try:
        return json.loads(text, parse_float=_finite, parse_constant=_nonfinite if nonfinite else _no_constant)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def read_json(path: str | os.PathLike, *, limit: int, root: str | os.PathLike | None = None,
              sha256: str | None = None) -> Any:
    """A JSON file read with `read_bytes` and parsed with `parse_json` (UntrustedFileError either way)."""
    data = read_bytes(path, limit=limit, root=root, sha256=sha256)
    try:
        return parse_json(data)
    except ValueError as e:
        raise UntrustedFileError(f"it is not valid JSON: {e}", where=str(path)) from None


ARTIFACT_SUFFIX = ".gm"
GROUP_MEMBER = "group.json"      # a tensor-parallel group's file (runtime/rank_artifacts.py) holds only this


def is_artifact(model: Any) -> bool:
    """`model` names a `.gm` artifact: by its suffix, or by its content (a zip holding a manifest
    and a graph, or a tensor-parallel group's file) when it was renamed, so `run x.bin` loads it
    rather than asking for a recipe."""
    if not isinstance(model, (str, os.PathLike)):
        return False
    if str(model).endswith(ARTIFACT_SUFFIX):
        return True
    p = Path(model)
    try:
        if not p.is_file():
            return False
        with open(p, "rb") as f:
            if f.read(4) != b"PK\x03\x04":
                return False
        with zipfile.ZipFile(p) as z:
            names = set(z.namelist())
            return {"manifest.json", "graph.ir"} <= names or names == {GROUP_MEMBER}
    except (OSError, zipfile.BadZipFile):
        return False


__all__ = ["ARTIFACT_SUFFIX", "GROUP_MEMBER", "GiB", "KiB", "MiB", "OpenFile", "UntrustedFileError", "file_kind",
           "file_sha256", "is_artifact", "open_file", "parse_json", "read_bytes", "read_json"]
