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


def file_in_the_way(folder: str | os.PathLike) -> Path | None:
    """The first of `folder` and its parents that exists and is not a folder (it cannot be made)."""
    folder = Path(folder)
    return next((p for p in [folder, *folder.parents] if p.exists() and not p.is_dir()), None)


def writable_output(path: str | os.PathLike, where: str, *, folder: bool = False, replaced: bool = False) -> Path:
    """`path` once it is known to be writable, checked before any work is done: a file where a
    folder goes (or a folder where a file goes), a parent that is a file, or a place this process
    cannot create or write is refused naming which (not a bare OSError after minutes of work).
    `replaced`: the file is written beside and renamed over `path`, so a link is followed (its
    target is the file replaced) and a FIFO or device, which a rename would replace, is refused."""
    from graphmode.errors import GraphmodeError
    path = Path(path)
    if replaced:
        from graphmode.untrusted import file_kind
        path = Path(os.path.realpath(path)) if path.is_symlink() else path
        if path.exists() and not path.is_dir() and not path.is_file():
            raise GraphmodeError(f"it is a {file_kind(path.stat().st_mode)}, not a regular file", where=where,
                                 value=str(path), fix="give the path of a new or regular file")
    if not folder and path.is_dir():
        raise GraphmodeError("that path is a folder; a file goes there", where=where, value=str(path),
                             fix=f"give a file path, e.g. {path / 'out'}")
    if folder and path.exists() and not path.is_dir():
        raise GraphmodeError("that path is a file; a folder goes there", where=where, value=str(path),
                             fix="give a folder path (it is created if missing)")
    parent = path if folder else path.parent
    blocker = file_in_the_way(parent)
    if blocker is not None:
        raise GraphmodeError(f"{blocker} is a file, not a folder", where=where, value=str(path),
                             fix="give a path whose parent folders are folders")
    try:
        parent.mkdir(parents=True, exist_ok=True)
        probe = parent / f".{path.name}.{os.getpid()}.probe"
        probe.touch()
        probe.unlink()
    except OSError as e:
        raise GraphmodeError(f"cannot write there: {e.strerror or e}", where=where, value=str(path),
                             fix="give a path in a folder you can write") from None
    return path
