"""Compile generated kernels into shared libraries, content-addressed on disk.

One library per plan: `build_many` puts every distinct kernel of a plan in one translation
unit (g++ start-up costs ~0.3 s per invocation, more than a small kernel's compile; most of it
parsing <immintrin.h>, which pch.py precompiles once per process), split
into parts compiled in parallel when there are many. The file name is sha256(source +
flags + compiler identity, which includes what -march=native expands to on this host), so
a cache shared between machines never hands out a library built for another CPU, and a
library built under one ISA cap (its -march flags) is never handed to another. Files are
written to a temporary name and `os.replace`d; processes sharing the folder (the ranks of a
tensor-parallel group, a server's workers) build a library once (`build_lock`).

Loading a library runs its code, so a cached one is loaded only after `library_problem`
finds nothing wrong: it is a regular file inside the folder within `MAX_LIBRARY_BYTES`
(graphmode/untrusted.py), its seal `<key>.so.seal` is the HMAC-SHA256, under the folder's own
random key (`.seal-key`, mode 0600, made on first use), of its build key and its sha256 (so
a library copied from another entry or machine, or edited with its checksum updated, is
refused: forging a seal needs the key, see docs/robustness.md for what that does and does
not stop), it is a complete ELF shared object for this machine (mapping a truncated one
dies of SIGBUS), it carries the build key it was compiled under, and a short-lived
subprocess loads it. A library that fails is a `corrupt` event in `events` and is rebuilt
from source. A folder that cannot be written (full disk, read-only) builds in a private
temporary folder instead, said once: uncached, never failed. Which compiler, with which
flags: toolchain.py.
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import hmac
import logging
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import replace
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

from graphmode.backends.cpu import claim_pool, pch
from graphmode.backends.cpu.abi import KernelSource, translation_unit
from graphmode.backends.cpu.isa import CAPS, host_simd, march
from graphmode.backends.cpu.kernels import CompiledKernel, CompiledLibrary
from graphmode.backends.cpu.omp_loops import claim_loops, resolve_schedule, schedule_flags
from graphmode.backends.cpu.toolchain import Toolchain, atomic_write, run, shared_flags, warn_once
from graphmode.errors import BackendError
from graphmode.paths import cache_layout
from graphmode.untrusted import KiB, MiB, UntrustedFileError, read_bytes

log = logging.getLogger("graphmode.backends.cpu")

DEFAULT_FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-ffp-contract=off",
                 "-fno-math-errno", "-fno-trapping-math", "-fwrapv", "-fvisibility=hidden", "-std=c++17")
PART_MIN = 4            # kernels per part before a library is split for parallel compilation
COMPILE_TIMEOUT_S = 300
LOCK_PREFIX = ".lock-"      # build_lock's files, one per library being built
TRIAL_LOAD_TIMEOUT_S = 120
MAX_LIBRARY_BYTES = 512 * MiB     # what a cached kernel library may weigh before it is refused unread
SEAL_SUFFIX = ".so.seal"
SEAL_KEY = ".seal-key"
_UNWRITABLE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOTDIR,
               errno.EEXIST)
KEY_MARK = "graphmode-kernel-library:"   # + the build key, a string constant in every library we build
_TRIAL_LOAD = "import ctypes, sys\nctypes.CDLL(sys.argv[1]).gm_get_threads()\n"

_LOADED: dict[str, tuple[CompiledLibrary, tuple | None]] = {}
_LOCK = threading.Lock()
_SCRATCH: list[tempfile.TemporaryDirectory] = []


class KernelBuilder:
    """Finds a C++ compiler, compiles kernels into cached shared libraries, loads them.

    `compiler`: a name or path; when given it is the only one tried. `flags`: the full flag
    list (default `DEFAULT_FLAGS`); `-march=native` and `-fopenmp` are dropped (the latter
    replaced by `-fopenmp-simd`) when the compiler rejects them. `threads`: OpenMP threads
    for every library this builder loads (None = the OpenMP default). `jobs`: parallel
    compiler processes for one library. `isa`: the cap (a recipe's `codegen.isa`; None or
    auto = the host's best): `-march=native` in the flags becomes `isa.march(isa)`, so
    every kernel takes that ISA's code path; a cap the host cannot run is still built
    (what tests of that path do here), and running it is the caller's to refuse. `schedule`:
    how the kernels' claimable parallel loops hand out iterations (omp_loops.SCHEDULES; None or
    auto = omp_loops.auto_schedule()), a compile flag, so part of every library's key.
    """

    def __init__(self, cache_dir: Path | str, compiler: str | None = None,
                 flags: Sequence[str] | None = None, *, threads: int | None = None, jobs: int | None = None,
                 isa: str | None = None, schedule: str | None = None):
        if isa is not None and isa not in CAPS:
            raise BackendError(f"unknown ISA {isa!r}", where="codegen.isa", value=isa, fix=f"one of {', '.join(CAPS)}")
        self.cache_dir = Path(cache_dir)
        self.requested = compiler
        self.isa = None if isa == "auto" else isa
        self.march = march(self.isa, host_simd()) if self.isa is not None else ("-march=native",)
        flags = DEFAULT_FLAGS if flags is None else flags
        self.schedule = resolve_schedule(schedule)
        self.base_flags = tuple(g for f in flags for g in (self.march if f == "-march=native" else (f,))) \
            + schedule_flags(self.schedule)
        self.threads = threads
        self.jobs = max(1, jobs or os.cpu_count() or 1)
        self.stats = {"compiles": 0, "cache_hits": 0, "rebuilds": 0, "compile_s": 0.0, "precompiled_header": 0}
        self.used: list[Path] = []   # every library handed out, in order (an executable's share: a slice)
        self.failures: dict[str, str] = {}   # symbol -> compiler error (build_many(strict=False))
        self.events: list[dict[str, Any]] = []   # {"event": "corrupt", "path", "reason"} per rejected library
        self.toolchain = Toolchain(compiler, self.base_flags, self.cache_dir, isa=self.isa, march=self.march)

    # ---- the compiler (toolchain.py) --------------------------------------------------------
    def compiler_available(self) -> bool:
        return self.toolchain.cxx is not None

    @property
    def compiler(self) -> str | None:
        return self.toolchain.cxx

    @property
    def flags(self) -> tuple[str, ...]:
        return self.toolchain.flags

    @property
    def unavailable_reason(self) -> str:
        return self.toolchain.why

    def _require(self) -> None:
        if not self.compiler_available():
            raise BackendError(self.toolchain.why, fix="install g++/clang++ or pass KernelBuilder(compiler=...); "
                                              "the executor falls back to ATen for these groups")

    # ---- building ---------------------------------------------------------------------------
    def build(self, source: KernelSource) -> CompiledKernel:
        return self.build_many([source])[source.symbol]

    def build_many(self, sources: Iterable[KernelSource], *, strict: bool = True) -> dict[str, CompiledKernel]:
        """Compile every distinct kernel into one library (or load it from the cache);
        symbol -> kernel.

        With `strict=False` a kernel the compiler rejects (a generator bug) does not sink the
        whole plan: it is left out of the result, its error recorded in `self.failures`, and
        the others are built; the executor runs the missing groups with the reference ops."""
        self._require()
        uniq: dict[str, KernelSource] = {}
        for s in sources:
            uniq.setdefault(s.symbol, s)
        if not uniq:
            return {}
        built = {k: self._as_built(s) for k, s in uniq.items()}
        tu = translation_unit(built.values())
        key = hashlib.sha256((tu + "\0" + self.toolchain.identity).encode()).hexdigest()[:32]
        try:
            lib = self._library(key, [built[k] for k in sorted(built)], tu)
        except BackendError:
            if strict or len(uniq) == 1:
                raise
            bad = self._syntax_failures(list(built.values()))
            if not bad:
                raise
            for sym, err in bad.items():
                log.warning("kernel %s does not compile; its group falls back: %s", sym, err[:500])
            self.failures.update(bad)
            return self.build_many([s for k, s in uniq.items() if k not in bad], strict=True)
        return {sym: CompiledKernel(src, lib) for sym, src in uniq.items()}

    def _as_built(self, source: KernelSource) -> KernelSource:
        """The text compiled for `source`: under the claim schedule its claimable loops call the
        work-claiming pool (omp_loops.claim_loops); the same kernel otherwise."""
        if self.schedule != "claim":
            return source
        return replace(source, source=claim_loops(source.source)[0])

    def _syntax_failures(self, sources: list[KernelSource]) -> dict[str, str]:
        """Which kernels the compiler rejects on their own (`-fsyntax-only`, in parallel)."""
        bad: dict[str, str] = {}
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".check-", dir=self.cache_dir))
        try:
            for start in range(0, len(sources), self.jobs):
                procs = []
                for s in sources[start:start + self.jobs]:
                    src = tmp / f"{s.symbol}.cpp"
                    src.write_text(s.translation_unit())
                    procs.append((s, subprocess.Popen([self.toolchain.cxx, *[f for f in self.toolchain.flags if f != "-shared"],
                                                       "-fsyntax-only", str(src)], stdout=subprocess.PIPE,
                                                      stderr=subprocess.PIPE, text=True)))
                for s, p in procs:
                    _out, err = p.communicate(timeout=COMPILE_TIMEOUT_S)
                    if p.returncode != 0:
                        bad[s.symbol] = err
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return bad

    def library_path(self, sources: Iterable[KernelSource]) -> Path:
        """Where the library for these kernels lives (whether or not it is built)."""
        self._require()
        uniq = {s.symbol: self._as_built(s) for s in sources}
        tu = translation_unit(uniq.values())
        return self.cache_dir / f"{hashlib.sha256((tu + chr(0) + self.toolchain.identity).encode()).hexdigest()[:32]}.so"

    def _library(self, key: str, sources: list[KernelSource], tu: str) -> CompiledLibrary:
        path = self.cache_dir / f"{key}.so"
        self.used.append(path)
        with _LOCK:
            lib, sig = _LOADED.get(str(path), (None, None))
        if lib is not None and _signature(path) == sig:   # loaded here, file untouched since
            self.stats["cache_hits"] += 1
            self._threads(lib)
            return lib
        existed = os.path.lexists(path)
        lib = self._cached(path, key)
        if lib is not None:
            return lib
        with build_lock(self.cache_dir, key) as waited:
            if waited or not existed:        # a peer (a rank, a worker) may have built it meanwhile
                lib = self._cached(path, key)
                if lib is not None:
                    return lib
            return self._build_and_load(key, path, sources, tu)

    def _cached(self, path: Path, key: str) -> CompiledLibrary | None:
        """The library at `path` when one is there and sound; a damaged one is a corrupt event."""
        if not os.path.lexists(path):
            return None
        why = library_problem(path, key)
        if why is None:
            try:
                _touch(seal_path(path))      # when it was last used: `cache prune` removes the oldest
                lib = self._load(path)
                self.stats["cache_hits"] += 1
                return lib
            except OSError as e:
                why = f"it does not load: {e}"
        self._corrupt(path, why)
        return None

    def _build_and_load(self, key: str, path: Path, sources: list[KernelSource], tu: str) -> CompiledLibrary:
        try:
            try:
                self.cache_dir.mkdir(parents=True, exist_ok=True)
                self._compile(key, path, sources, tu)
            except FileNotFoundError:        # the build folder went mid-build (`graphmode cache clear`): again
                log.warning("the kernel cache %s was removed while %s was built; building it again",
                            self.cache_dir, path.name)
                self.cache_dir.mkdir(parents=True, exist_ok=True)
                self._compile(key, path, sources, tu)
        except OSError as e:
            if e.errno not in _UNWRITABLE:
                raise BackendError(f"cannot build the kernel library: {e}", where=str(path)) from None
            path = self._uncached(key, sources, tu, e)
        except subprocess.SubprocessError as e:
            raise BackendError(f"cannot build the kernel library: {e}", where=str(path)) from None
        try:
            return self._load(path)
        except OSError as e:
            raise BackendError(f"freshly built kernel library does not load: {e}", where=str(path)) from None

    def _uncached(self, key: str, sources: list[KernelSource], tu: str, e: OSError) -> Path:
        """Build into this process's private folder when the cache folder cannot be written
        (full disk, read-only): the library works, it is just not kept. Said once per folder."""
        warn_once(f"unwritable:{self.cache_dir}", f"cannot write kernel libraries to {self.cache_dir} "
                   f"({e.strerror or e}); building them in a temporary folder, uncached, until it can be written")
        self.events.append({"event": "unwritable", "path": str(self.cache_dir), "reason": e.strerror or str(e)})
        if not _SCRATCH:
            _SCRATCH.append(tempfile.TemporaryDirectory(prefix="graphmode-kernels-"))
        path = Path(_SCRATCH[0].name) / f"{key}.so"
        try:
            if not path.exists():
                self._compile(key, path, sources, tu, sealed_in=Path(_SCRATCH[0].name))
        except (OSError, subprocess.SubprocessError) as e2:
            raise BackendError(f"cannot build the kernel library: {e2}", where=str(path),
                               fix="free disk space (or pass another cache dir)") from None
        return path

    def _corrupt(self, path: Path, why: str) -> None:
        log.warning("cached kernel library %s is corrupt (%s); rebuilding it", path, why)
        self.events.append({"event": "corrupt", "path": str(path), "reason": why})
        self.stats["rebuilds"] += 1
        for p in (path, seal_path(path)):   # the rebuild's os.replace cannot replace a folder
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)

    def _threads(self, lib: CompiledLibrary) -> None:
        if self.threads is not None:
            lib.set_threads(self.threads)

    def _load(self, path: Path) -> CompiledLibrary:
        lib = CompiledLibrary(path, threads=self.threads)
        if self.schedule == "claim":
            claim_pool.attach(lib, self)
        with _LOCK:
            _LOADED[str(path)] = (lib, _signature(path))
        return lib

    def _compile(self, key: str, path: Path, sources: list[KernelSource], tu: str, *,
                 sealed_in: Path | None = None) -> None:
        t0 = time.perf_counter()
        folder = sealed_in or self.cache_dir
        tc = self.toolchain
        include = pch.flags_for(tc.cxx, tc.version, tc.flags, tu)
        try:
            self._compile_into(folder, key, path, sources, tu, include)
        except BackendError:
            if not include:
                raise
            self._compile_into(folder, key, path, sources, tu, [])     # raises what the compiler says without it
            pch.failed(tc.flags, tc.cxx)
            include = []
        dt = time.perf_counter() - t0
        self.stats["compiles"] += 1
        self.stats["compile_s"] += dt
        self.stats["precompiled_header"] += bool(include)
        log.info("compiled %d kernels into %s in %.2f s", len(sources), path.name, dt)

    def _compile_into(self, folder: Path, key: str, path: Path, sources: list[KernelSource], tu: str,
                      include: list[str]) -> None:
        """`include`: pch.flags_for's, read before the translation unit."""
        tmp = Path(tempfile.mkdtemp(prefix=f".build-{key[:8]}-", dir=folder))
        try:
            out = tmp / "lib.so"
            nparts = min(self.jobs, len(sources) // PART_MIN)
            mark = _key_mark(key)
            if nparts <= 1:
                src = tmp / "kernels.cpp"
                src.write_text(tu + mark)
                self._check(run([self.toolchain.cxx, *self.toolchain.flags, *shared_flags(self.toolchain.flags),
                                 *include, str(src), "-o", str(out), "-lm"], timeout=COMPILE_TIMEOUT_S), src, key)
            else:
                parts: list[list[KernelSource]] = [[] for _ in range(nparts)]
                sizes = [0] * nparts
                for s in sorted(sources, key=lambda s: -len(s.source)):
                    k = sizes.index(min(sizes))
                    parts[k].append(s)
                    sizes[k] += len(s.source)
                cflags = [f for f in self.toolchain.flags if f != "-shared"]
                procs = []
                for k, part in enumerate(parts):
                    src = tmp / f"part{k}.cpp"
                    src.write_text(translation_unit(part, defs=(k == 0)) + (mark if k == 0 else ""))
                    obj = tmp / f"part{k}.o"
                    procs.append((src, subprocess.Popen([self.toolchain.cxx, *cflags, "-fPIC", *include, "-c", str(src),
                                                         "-o", str(obj)],
                                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)))
                for src, p in procs:
                    try:
                        so, se = p.communicate(timeout=COMPILE_TIMEOUT_S)
                    except subprocess.TimeoutExpired:
                        p.kill()
                        so, se = p.communicate()
                    self._check(subprocess.CompletedProcess(p.args, p.returncode, so, se), src, key)
                objs = [str(tmp / f"part{k}.o") for k in range(nparts)]
                self._check(run([self.toolchain.cxx, *self.toolchain.flags, *shared_flags(self.toolchain.flags), *objs, "-o", str(out),
                                  "-lm"], timeout=COMPILE_TIMEOUT_S), tmp / "part0.cpp", key)
            data = out.read_bytes()
            atomic_write(seal_path(path), library_seal(folder, key, data).encode())
            os.replace(out, path)
            atomic_write(path.with_suffix(".cpp"), tu.encode())
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def _check(self, res: subprocess.CompletedProcess, src: Path, key: str) -> None:
        if res.returncode == 0:
            return
        if not src.parent.is_dir():          # not the compiler's fault: its folder was removed under it
            raise FileNotFoundError(errno.ENOENT, "the build folder was removed", str(src.parent))
        keep = self.cache_dir / f"failed-{key[:16]}.cpp"
        try:
            shutil.copyfile(src, keep)
        except OSError:
            keep = src
        raise BackendError(f"C++ compilation failed ({self.toolchain.cxx}): {(res.stderr or res.stdout)[-3000:]}",
                           where=str(keep), fix="this is a code generator bug; the group falls back to ATen")


@contextmanager
def build_lock(folder: Path, key: str) -> Iterator[bool]:
    """Held while library `key` is built in `folder`, across processes (the ranks of a tensor-
    parallel group compile the same kernels for their shards): yields whether a peer held it
    first, so the caller looks again before compiling. Advisory and bounded: a folder where no
    lock file can be made (read-only, full) or a peer holding it past a compile's timeout
    builds without it (the rename of a finished library is atomic, a duplicate build is harmless)."""
    lock = folder / f"{LOCK_PREFIX}{key}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0), 0o600)
    except OSError:
        yield False
        return
    waited, deadline = False, time.monotonic() + COMPILE_TIMEOUT_S + 30
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                waited = True
                if time.monotonic() > deadline:
                    log.warning("kernel library %s: a peer's build held its lock past %d s; building it here too",
                                key, COMPILE_TIMEOUT_S + 30)
                    break
                time.sleep(0.05)
        yield waited
    finally:
        try:
            os.unlink(lock)                  # a waiter holding the old file looks again and finds the library
        except OSError:
            pass
        os.close(fd)


def _touch(path: Path) -> None:
    try:
        os.utime(path)
    except OSError:        # a read-only cache: the library still loads
        pass


def _signature(path: Path) -> tuple | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def _key_mark(key: str) -> str:
    """C++ defining the build key as a string in the library (what `library_problem` looks for)."""
    return (f'\nextern "C" __attribute__((visibility("default"), used)) '
            f'const char gm_build_key[] = "{KEY_MARK}{key}";\n')


def seal_path(lib: Path) -> Path:
    return lib.with_name(lib.stem + SEAL_SUFFIX)


def _seal_key(folder: Path) -> bytes:
    """The folder's secret (32 random bytes, made once, mode 0600; linked into place so two
    processes making it at once agree on one). A damaged one is replaced, voiding every seal.

    A key that is missing at one look and present at the next was made by a peer (ranks and
    workers share a cache): it is read, never taken for damage, so no process deletes the key
    another has just sealed with."""
    path = folder / SEAL_KEY
    folder.mkdir(parents=True, exist_ok=True)
    for look in range(4):
        try:
            key = read_bytes(path, limit=64, root=folder)
            if len(key) == 32:
                return key
        except UntrustedFileError:
            pass
        if not os.path.lexists(path):
            _place_seal_key(folder, path, replace=False)
        elif look > 0:
            _place_seal_key(folder, path, replace=True)
    raise UntrustedFileError("the kernel cache's seal key cannot be made or read; fix: remove the folder's "
                             f"{SEAL_KEY} (every library in it is then rebuilt) or use another --cache-dir",
                             where=str(path))


def _place_seal_key(folder: Path, path: Path, *, replace: bool) -> None:
    """Put a new key at `path`: linked where none is (the first of racing makers wins), or over
    a damaged file in one rename, so a reader never finds it missing (a directory in its place
    is removed first). Makers repairing at once may void each other's seals: a rebuild, no harm."""
    if replace and path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
        replace = False
    fd, tmp = tempfile.mkstemp(prefix=SEAL_KEY + ".", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(os.urandom(32))
        if replace:
            os.replace(tmp, path)
            return
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)


def library_seal(folder: Path, key: str, data: bytes) -> str:
    """The seal of a library with build key `key` and bytes `data` in `folder`."""
    msg = f"{KEY_MARK}{key}\0{hashlib.sha256(data).hexdigest()}".encode()
    return hmac.new(_seal_key(folder), msg, hashlib.sha256).hexdigest()


def seal_library(path: Path) -> None:
    """Seal a library that was checked by other means (an artifact's member, its hash in the
    manifest) so this folder's builder will load it."""
    data = read_bytes(path, limit=MAX_LIBRARY_BYTES, root=path.parent)
    atomic_write(seal_path(path), library_seal(path.parent, path.stem, data).encode())


def library_problem(path: Path, key: str) -> str | None:
    """Why the cached library at `path` must not be loaded for build key `key`, or None."""
    try:
        data = read_bytes(path, limit=MAX_LIBRARY_BYTES, root=path.parent)
        want = read_bytes(seal_path(path), limit=1 * KiB, root=path.parent).strip()
        seal = library_seal(path.parent, key, data).encode()
    except UntrustedFileError as e:
        return e.message if e.where == str(path) else f"{Path(e.where or '').name}: {e.message}"
    except OSError as e:
        return f"unreadable: {e}"
    if not hmac.compare_digest(seal, want):
        return "its seal does not match (edited, damaged, or copied from another cache)"
    why = elf_problem(data)
    if why is not None:
        return why
    if (KEY_MARK + key).encode() not in data:
        return "it was not built from this source (build key missing)"
    try:
        res = subprocess.run([sys.executable, "-I", "-c", _TRIAL_LOAD, str(path)], capture_output=True,
                             text=True, timeout=TRIAL_LOAD_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError) as e:
        return f"a trial load could not run: {e}"
    if res.returncode != 0:
        how = f"signal {-res.returncode}" if res.returncode < 0 else f"exit {res.returncode}"
        return f"a trial load in a subprocess failed ({how}): {res.stderr.strip()[-300:]}"
    return None


@lru_cache(maxsize=1)
def _host_elf() -> tuple[int, int, int] | None:
    """(class, byte order, machine) of this Python's executable; None where it is not ELF."""
    try:
        with open(os.path.realpath(sys.executable), "rb") as f:
            head = f.read(20)
    except OSError:
        return None
    if len(head) < 20 or head[:4] != b"\x7fELF":
        return None
    return head[4], head[5], struct.unpack_from("<H" if head[5] == 1 else ">H", head, 18)[0]


def elf_problem(data: bytes) -> str | None:
    """Why `data` is not a complete ELF shared object for this machine, or None (also None on a
    host whose executables are not ELF: the trial load is the check there)."""
    host = _host_elf()
    if host is None:
        return None
    if len(data) < 52 or data[:4] != b"\x7fELF":
        return "not an ELF file"
    if (data[4], data[5]) != host[:2]:
        return "an ELF file for another word size or byte order"
    e = "<" if data[5] == 1 else ">"
    wide = data[4] == 2
    try:
        e_type, machine = struct.unpack_from(e + "HH", data, 16)
        phoff, shoff = struct.unpack_from(e + ("QQ" if wide else "II"), data, 32 if wide else 28)
        phent, phnum, shent, shnum = struct.unpack_from(e + "HHHH", data, 54 if wide else 42)
        if e_type != 3:
            return "not a shared object"
        if machine != host[2]:
            return f"built for ELF machine {machine}, this host is {host[2]}"
        if phnum == 0 or phent < (56 if wide else 32) or phoff + phnum * phent > len(data):
            return "its program header table lies outside the file (truncated)"
        if shnum and (shent < (64 if wide else 40) or shoff + shnum * shent > len(data)):
            return "its section header table lies outside the file (truncated)"
        for i in range(phnum):
            at = phoff + i * phent
            if wide:
                p_type, _, p_off, _, _, p_filesz = struct.unpack_from(e + "IIQQQQ", data, at)
            else:
                p_type, p_off, _, _, p_filesz = struct.unpack_from(e + "IIIII", data, at)
            if p_off + p_filesz > len(data):
                return f"segment {i} (type {p_type}) ends at byte {p_off + p_filesz}, past the end of the " \
                       f"{len(data)}-byte file (truncated)"
        for i in range(shnum):
            at = shoff + i * shent
            if wide:
                _, sh_type, _, _, sh_off, sh_size = struct.unpack_from(e + "IIQQQQ", data, at)
            else:
                _, sh_type, _, _, sh_off, sh_size = struct.unpack_from(e + "IIIIII", data, at)
            if sh_type != 8 and sh_off + sh_size > len(data):     # 8: SHT_NOBITS (.bss), no file bytes
                return f"section {i} ends at byte {sh_off + sh_size}, past the end of the file (truncated)"
    except struct.error as err:
        return f"malformed ELF headers: {err}"
    return None


def default_kernel_dir() -> Path:
    return cache_layout().kernels


_BUILDERS: dict[tuple, KernelBuilder] = {}


def builder_for(cache_dir: Path | str | None, threads: int | None, isa: str | None = None,
                schedule: str | None = None) -> KernelBuilder:
    """The process's builder for a kernel folder (default: the cache root's kernels/, graphmode.paths), thread
    count, ISA cap and loop schedule: one per combination, so its compiler probe and loaded libraries are
    shared."""
    isa = None if isa == "auto" else isa
    schedule = resolve_schedule(schedule)
    key = (str(cache_dir or default_kernel_dir()), threads, isa, schedule)
    b = _BUILDERS.get(key)
    if b is None:
        b = _BUILDERS[key] = KernelBuilder(cache_dir or default_kernel_dir(), threads=threads, isa=isa,
                                           schedule=schedule)
    return b


def compiles_in_process() -> int:
    """Kernel libraries this process has compiled (every builder's): 0 for a process that
    only loaded libraries, from an artifact or the cache (a served replica's "no recompile")."""
    return sum(b.stats["compiles"] for b in list(_BUILDERS.values()))


def compiler_available(compiler: str | None = None, cache_dir: Path | str | None = None) -> bool:
    """Whether generated kernels can be built here (probes once per process)."""
    cache = Path(cache_dir) if cache_dir is not None else Path(tempfile.gettempdir()) / "graphmode-probe"
    return KernelBuilder(cache, compiler).compiler_available()


__all__ = ["KernelBuilder", "builder_for", "default_kernel_dir", "compiler_available", "DEFAULT_FLAGS",
           "library_problem", "elf_problem", "library_seal", "seal_library", "seal_path"]
