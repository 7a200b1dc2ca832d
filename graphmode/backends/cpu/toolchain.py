"""The C++ compiler generated kernels are built with, and the flags it accepts.

The first compiler of `CANDIDATES` (or the one asked for) that runs and compiles a probe
kernel wins; flags it rejects are dropped (`-march=native`, then `-fopenmp` for
`-fopenmp-simd` or nothing), said once. The working flag set is remembered per process and
in a probe record in the kernel folder (read as untrusted: only flags that were asked for are
taken from it). The identity (compiler path, version, flags and what `-march=native` means on
this host) goes into every library's build key.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Sequence

from graphmode.untrusted import KiB, UntrustedFileError, read_json

log = logging.getLogger("graphmode.backends.cpu")

CANDIDATES = ("c++", "g++", "clang++")

_PROBE_SRC = """
#ifdef _OPENMP
#include <omp.h>
#endif
extern "C" __attribute__((visibility("default"))) int gm_probe(float* x, int n) {
  #pragma omp parallel for
  for (int i = 0; i < n; ++i) x[i] = x[i] * 2.0f + 1.0f;
  #pragma omp simd
  for (int i = 0; i < n; ++i) x[i] += 1.0f;
#ifdef _OPENMP
  return omp_get_max_threads();
#else
  return 1;
#endif
}
"""

_WARNED: set[str] = set()
_PROBES: dict[tuple, tuple[str, ...] | None] = {}


def warn_once(key: str, msg: str) -> None:
    """Log `msg` once per process for `key` (a missing compiler, a rejected flag, a full disk)."""
    if key not in _WARNED:
        _WARNED.add(key)
        log.warning(msg)


def run(cmd: Sequence[str], cwd: str | None = None, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), cwd=cwd, capture_output=True, text=True, timeout=timeout)


def atomic_write(path: Path, data: bytes) -> None:
    """Write `path` through a temporary file in its folder and `os.replace`: readers see the
    old file or the whole new one, never a part."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def shared_flags(flags: Sequence[str]) -> list[str]:
    """What makes a link produce a shared object when `flags` do not say so already."""
    return [] if "-shared" in flags else ["-shared", "-fPIC"]


class Toolchain:
    """The compiler for one KernelBuilder, detected on first use (thread-safe).

    `requested`: a compiler name or path (then the only one tried; without one, $CXX where it
    names an executable, as build tools read it); `base_flags`: the flags asked for; `isa` /
    `march`: the ISA cap and its -march flags (named in the reason when no compiler works);
    `cache_dir`: where the probe record is kept."""

    def __init__(self, requested: str | None, base_flags: Sequence[str], cache_dir: Path, *,
                 isa: str | None = None, march: Sequence[str] = ()):
        env = os.environ.get("CXX", "").strip()
        if requested is None and env:
            if shutil.which(env) or (os.sep in env and os.access(env, os.X_OK)):
                requested = env
            else:                  # ("ccache g++" and the like: a command line, not a compiler)
                warn_once(f"cxx-env:{env}", f"CXX={env!r} names no executable: graphmode tries "
                                            f"{', '.join(CANDIDATES)} instead (set CXX to a compiler's name or path)")
        self.requested, self.base_flags, self.cache_dir = requested, tuple(base_flags), cache_dir
        self.isa, self.march = isa, tuple(march)
        self._detected = False
        self._cxx: str | None = None
        self._version = ""
        self._flags: tuple[str, ...] = ()
        self._identity = ""
        self._why = ""
        self._lock = threading.Lock()

    @property
    def cxx(self) -> str | None:
        """The compiler's path, or None when none works (`why` says why)."""
        self._detect()
        return self._cxx

    @property
    def flags(self) -> tuple[str, ...]:
        self._detect()
        return self._flags

    @property
    def version(self) -> str:
        """The first line of the compiler's --version."""
        self._detect()
        return self._version

    @property
    def identity(self) -> str:
        self._detect()
        return self._identity

    @property
    def why(self) -> str:
        self._detect()
        return self._why

    def _detect(self) -> None:
        if self._detected:
            return
        with self._lock:
            if self._detected:
                return
            names = [self.requested] if self.requested else list(CANDIDATES)
            tried = []
            for name in names:
                path = shutil.which(name) if os.sep not in name else (name if os.access(name, os.X_OK) else None)
                tried.append(name)
                if path is None:
                    continue
                try:
                    ver = run([path, "--version"], timeout=20)
                except (OSError, subprocess.SubprocessError):
                    continue
                if ver.returncode != 0:
                    continue
                version = (ver.stdout.strip().splitlines() or ["?"])[0]
                flags = self._probe(path, version)
                if flags is None:
                    continue
                self._cxx, self._version, self._flags = path, version, flags
                break
            tmp_problem = getattr(self, "_tmp_problem", None)
            if self._cxx is None and tmp_problem is not None:      # a compiler is there: nowhere to compile
                self._why = (f"cannot compile kernels: {tmp_problem}; fused groups run with the ATen/reference ops "
                             "instead of generated kernels")
                warn_once(f"notmp:{tmp_problem}", self._why)
            elif self._cxx is None:
                cap = f" for codegen.isa {self.isa} ({' '.join(self.march)})" if self.isa else ""
                self._why = (f"no working C++ compiler{cap} (tried {', '.join(tried)}); fused groups run with "
                             f"the ATen/reference ops instead of generated kernels")
                warn_once(f"nocxx:{','.join(tried)}",
                          self._why + " - install g++ (or pass compiler=...) for the generated kernels")
            else:
                native = ""
                if "-march=native" in self._flags:
                    try:  # what -march=native means on this host goes into every cache key
                        out = run([self._cxx, "-march=native", "-###", "-E", "-x", "c++", os.devnull], timeout=20)
                        native = " ".join(ln for ln in out.stderr.splitlines() if "march" in ln)
                    except (OSError, subprocess.SubprocessError):
                        native = "unknown-native"
                self._identity = json.dumps([os.path.realpath(self._cxx), self._version, list(self._flags), native])
            self._detected = True

    def _probe(self, cxx: str, version: str) -> tuple[str, ...] | None:
        """The working subset of the requested flags (cached per process and on disk)."""
        key = (cxx, version, self.base_flags)
        if key in _PROBES:
            return _PROBES[key]
        digest = hashlib.sha256(repr(key).encode()).hexdigest()[:16]
        record = self.cache_dir / f"probe-{digest}.json"
        allowed = set(self.base_flags) | {"-fopenmp-simd"}
        try:
            flags = read_json(record, limit=64 * KiB, root=self.cache_dir)
            if isinstance(flags, list) and all(isinstance(f, str) and f in allowed for f in flags):
                _PROBES[key] = tuple(flags)
                return _PROBES[key]
        except UntrustedFileError:
            pass
        candidates = [tuple(self.base_flags)]
        f = list(self.base_flags)
        if "-march=native" in f:
            f = [x for x in f if x != "-march=native"]
            candidates.append(tuple(f))
        if "-fopenmp" in f:
            candidates.append(tuple("-fopenmp-simd" if x == "-fopenmp" else x for x in f))
            candidates.append(tuple(x for x in f if x != "-fopenmp"))
        result = None
        try:
            with tempfile.TemporaryDirectory(prefix="gm-probe-") as tmp:
                src = Path(tmp) / "probe.cpp"
                src.write_text(_PROBE_SRC)
                for cand in candidates:
                    try:
                        out = run([cxx, *cand, *shared_flags(cand), str(src), "-o", str(Path(tmp) / "probe.so")],
                                  timeout=120)
                    except (OSError, subprocess.SubprocessError):
                        continue
                    if out.returncode == 0:
                        result = cand
                        break
                    said = next((ln.strip() for ln in out.stderr.splitlines()
                                 if "No space left" in ln or "cannot create temporary file" in ln), None)
                    if said is not None:
                        self._tmp_problem = (f"the compiler cannot write its temporary files in "
                                             f"{tempfile.gettempdir()} ({said[:300]}): free it or set TMPDIR")
        except OSError as e:      # no room for a temporary file: not remembered, the next process probes again
            self._tmp_problem = (f"the temporary folder {tempfile.gettempdir()} cannot be written ({e.strerror or e}): "
                                 "free it or set TMPDIR")
            return None
        if result is not None and result != tuple(self.base_flags):
            dropped = [x for x in self.base_flags if x not in result]
            warn_once(f"flags:{cxx}:{dropped}", f"{cxx} rejects {' '.join(dropped)}; generated kernels are "
                      f"compiled without {'it' if len(dropped) == 1 else 'them'} (slower)")
        _PROBES[key] = result
        if result is not None:
            try:
                self.cache_dir.mkdir(parents=True, exist_ok=True)
                atomic_write(record, json.dumps(list(result)).encode())
            except OSError:
                pass
        return result


__all__ = ["Toolchain", "CANDIDATES", "warn_once", "run", "shared_flags", "atomic_write"]
