"""A compiler-output cache for the test run, as ccache is for a C++ project's CI.

Tests build kernels in folders of their own (tmp_path caches), so the same generated source
was compiled again in test after test: 2,217 compiles, 727 of the default run's ~1,600 CPU
seconds (2026-12-07). The tests put a `c++` first on PATH that runs the real compiler once
per (compiler, arguments, source bytes) and copies its output from the cache afterwards, so
every test still loads a library the real compiler made from exactly that source and flags.

Only a compile of one source file into one output is cached (a library or an object); probes
from stdin, links of several objects and failed compiles always run the compiler. The cache
lives under .pytest_cache (shared by pytest-xdist workers and reruns, entries unused for a
week removed), keyed by the compiler's version and this host's CPU, since `-march=native`
means the host. GRAPHMODE_TEST_CXX_CACHE=0 turns it off.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SOURCES = (".cpp", ".cc", ".c")
KEEP_S = 7 * 24 * 3600


def _host_tag(cxx: str) -> str:
    """The compiler's version and what this CPU offers (the meaning of -march=native)."""
    h = hashlib.sha256(subprocess.run([cxx, "--version"], capture_output=True).stdout)
    try:
        flags = [ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith(("flags", "model name"))]
        h.update("\n".join(sorted(set(flags))).encode())
    except OSError:
        h.update(os.uname().machine.encode())
    return h.hexdigest()[:16]


def install(root: Path) -> Path | None:
    """Write the wrapper under `root` for the first C++ compiler on PATH; its folder (to put
    first on PATH), or None when there is no compiler (the tests then see that themselves)."""
    if os.environ.get("GRAPHMODE_TEST_CXX_CACHE") == "0":
        return None
    outside = os.pathsep.join(d for d in os.environ.get("PATH", "").split(os.pathsep)
                              if d and not Path(d).resolve().is_relative_to(root.resolve()))
    cxx = next((p for p in (shutil.which(c, path=outside) for c in ("c++", "g++", "clang++")) if p), None)
    if cxx is None:
        return None
    store = root / _host_tag(cxx)
    bindir = store / "bin"
    bindir.mkdir(parents=True, exist_ok=True)
    script = (f"#!{sys.executable}\nimport sys\nsys.path.insert(0, {str(Path(__file__).parent)!r})\n"
              f"import cxx_cache\nsys.exit(cxx_cache.main({cxx!r}, {str(store)!r}, sys.argv[1:]))\n")
    wrapper = bindir / "c++"
    if not wrapper.is_file() or wrapper.read_text() != script:
        fd, tmp = tempfile.mkstemp(dir=bindir)
        with os.fdopen(fd, "w") as f:
            f.write(script)
        os.chmod(tmp, 0o755)
        os.replace(tmp, wrapper)
    return bindir


def prune(root: Path) -> None:
    """Remove entries unused for a week (hits touch theirs)."""
    now = time.time()
    for entry in root.glob("*/out/*"):
        try:
            if now - entry.stat().st_mtime > KEEP_S:
                entry.unlink()
        except OSError:
            pass


def _key(cxx: str, args: list[str], src: int, out: int) -> str | None:
    h = hashlib.sha256(cxx.encode())
    for i, a in enumerate(args):
        h.update(b"\0" + (b"<src>" if i == src else b"<out>" if i == out else a.encode()))
    try:
        text = Path(args[src]).read_bytes()
    except OSError:
        return None
    if b'#include "' in text:            # a header beside the source would not be in the key
        return None
    h.update(b"\0" + text)
    return h.hexdigest()


def main(cxx: str, store: str, args: list[str]) -> int:
    if Path(cxx).resolve().is_relative_to(Path(store).resolve().parent):
        print(f"cxx_cache: {cxx} is a wrapper, not a compiler", file=sys.stderr)
        return 127
    srcs = [i for i, a in enumerate(args) if a.endswith(SOURCES) and not a.startswith("-")]
    out = args.index("-o") + 1 if args.count("-o") == 1 and args.index("-o") + 1 < len(args) else None
    key = _key(cxx, args, srcs[0], out) if len(srcs) == 1 and out is not None else None
    if key is None:
        return subprocess.call([cxx, *args])
    cached = Path(store) / "out" / key
    if cached.is_file():
        shutil.copy(cached, args[out])
        os.utime(cached)
        return 0
    rc = subprocess.call([cxx, *args])
    if rc == 0:
        cached.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=cached.parent)
        os.close(fd)
        shutil.copy(args[out], tmp)
        os.replace(tmp, cached)
    return rc
