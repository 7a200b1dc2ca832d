"""Cached kernel libraries are validated before dlopen: one whose seal (an HMAC under the
folder's key) does not match, a truncated file (SIGBUS when mapped), one for another machine,
one copied from another build key, or one that does not load in a subprocess is refused and
rebuilt, whatever a sidecar checksum says."""
from __future__ import annotations

import _ctypes
import hashlib
import shutil
import struct
import tempfile
from pathlib import Path

import pytest
import torch

import graphmode.backends.cpu.build as build_mod
import graphmode.backends.cpu.toolchain as toolchain_mod
from graphmode.backends.cpu.build import KernelBuilder, elf_problem, library_problem, seal_library, seal_path
from graphmode.backends.cpu.codegen import generate
from graphmode.backends.cpu.kernels import run_with_tensors
from graphmode.ir import parse_graph
from graphmode.verify.numerics import rel_l2

_PROBE = KernelBuilder(Path(tempfile.gettempdir()) / "graphmode-test-probe")
needs_cxx = pytest.mark.skipif(not _PROBE.compiler_available(), reason="no C++ compiler on this machine")
SYSTEM_SO = Path(_ctypes.__file__)          # a real shared object of this machine
needs_elf = pytest.mark.skipif(build_mod._host_elf() is None or SYSTEM_SO.suffix != ".so",
                               reason="this host does not use ELF shared objects")


def _kernel(op: str):
    g = parse_graph(f"""graph @t(%x: f32[4,8]) -> (%y) {{
  %y: f32[4,8] = fused(%x) {{"kind": "elementwise"}} {{
    %y: f32[4,8] = {op}(%x)
  }}
  return %y
}}""")
    return generate(g.nodes[0], {k: v.type for k, v in g.values.items()})


def reseal(lib: Path) -> None:
    """Seal `lib` as the folder's key holder would (so the checks after the seal are what refuse it)."""
    seal_library(lib)


@needs_elf
def test_elf_check_accepts_a_real_library_and_refuses_damage():
    data = SYSTEM_SO.read_bytes()
    assert elf_problem(data) is None
    for cut in (10, 63, 200, len(data) // 2, len(data) - 1):
        assert elf_problem(data[:cut]) is not None, cut
    assert "not an ELF" in elf_problem(b"#!/bin/sh\n" + data)
    other = bytearray(data)
    other[18:20] = struct.pack("<H", 0x28 if data[18:20] != struct.pack("<H", 0x28) else 0x3E)
    assert "ELF machine" in elf_problem(bytes(other))
    exe = bytearray(data)
    exe[16:18] = struct.pack("<H", 2)       # ET_EXEC
    assert "not a shared object" in elf_problem(bytes(exe))
    wide = bytearray(data)
    wide[4] = 1 if data[4] == 2 else 2
    assert "word size" in elf_problem(bytes(wide))


@needs_elf
def test_library_problem_on_foreign_files(tmp_path):
    key = "0" * 32
    lib = tmp_path / f"{key}.so"
    shutil.copyfile(SYSTEM_SO, lib)
    assert "cannot open" in library_problem(lib, key)      # no seal
    reseal(lib)
    assert "build key missing" in library_problem(lib, key)
    with open(lib, "ab") as f:              # the marker bytes alone do not make it ours
        f.write((build_mod.KEY_MARK + key).encode())
    reseal(lib)
    assert "trial load" in library_problem(lib, key)
    lib.unlink()
    lib.mkdir()
    assert "not a regular file" in library_problem(lib, key)


@needs_cxx
def test_damaged_cached_library_is_rebuilt(tmp_path, monkeypatch):
    ks, other = _kernel("sigmoid"), _kernel("tanh")
    builder = KernelBuilder(tmp_path)
    builder.build(ks)
    path = builder.library_path([ks])
    key = path.stem
    assert library_problem(path, key) is None
    KernelBuilder(tmp_path).build(other)
    good, foreign = path.read_bytes(), KernelBuilder(tmp_path).library_path([other]).read_bytes()
    x = torch.randn(4, 8)
    for name, blob in (("truncated", good[: len(good) // 2]), ("foreign", foreign), ("headers only", good[:64])):
        path.with_name("t.tmp").write_bytes(blob)
        path.with_name("t.tmp").replace(path)     # a new file: a mapping loaded before stays valid
        reseal(path)
        assert library_problem(path, key) is not None, name   # so the build below never maps it
        monkeypatch.setattr(build_mod, "_LOADED", {})         # as a fresh process
        b = KernelBuilder(tmp_path)
        k = b.build(ks)
        assert b.stats["rebuilds"] == 1 and b.stats["compiles"] == 1, name
        assert [e["event"] for e in b.events] == ["corrupt"] and b.events[0]["path"] == str(path)
        assert rel_l2(run_with_tensors(k, {"x": x})["y"], torch.sigmoid(x)) < 1e-6
        assert library_problem(path, key) is None


def test_tampered_probe_record_is_ignored(tmp_path, monkeypatch):
    monkeypatch.setattr(toolchain_mod, "_PROBES", {})      # probe here, not from this process's memory
    b = KernelBuilder(tmp_path)
    if not b.compiler_available():
        pytest.skip("no C++ compiler on this machine")
    (record,) = tmp_path.glob("probe-*.json")
    record.write_text('["-O0", "-include", "/etc/passwd"]')
    monkeypatch.setattr(toolchain_mod, "_PROBES", {})
    b2 = KernelBuilder(tmp_path)
    assert b2.compiler_available() and set(b2.flags) <= set(b2.base_flags) | {"-fopenmp-simd"}


@needs_cxx
def test_forged_seal_or_library_from_another_cache_is_refused(tmp_path, monkeypatch):
    """A library edited with a freshly computed checksum in place of the seal, and a library
    copied with its seal from another cache folder (another key), are refused unloaded."""
    ks = _kernel("sigmoid")
    path = KernelBuilder(tmp_path / "a").library_path([ks])
    KernelBuilder(tmp_path / "a").build(ks)
    assert library_problem(path, path.stem) is None
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF                         # one flipped bit pattern in the code
    path.write_bytes(bytes(data))
    seal_path(path).write_text(hashlib.sha256(bytes(data)).hexdigest())   # what a checksum tamper does
    assert "seal does not match" in library_problem(path, path.stem)
    seal_path(path).write_bytes(b"\xff\xfe not ascii")               # found by the fuzz sweep: a TypeError once
    assert "seal does not match" in library_problem(path, path.stem)
    other = tmp_path / "b"
    KernelBuilder(other).build(_kernel("tanh"))          # another folder, another key
    shutil.copyfile(path, other / path.name)
    seal_library(path)                                   # sealed under a's key ...
    shutil.copyfile(seal_path(path), seal_path(other / path.name))
    assert "seal does not match" in library_problem(other / path.name, path.stem)    # ... is void in b
    monkeypatch.setattr(build_mod, "_LOADED", {})
    b = KernelBuilder(other)
    b.build(ks)
    assert [e["event"] for e in b.events] == ["corrupt"] and "seal" in b.events[0]["reason"]


@needs_cxx
def test_unwritable_kernel_folder_builds_uncached_once(tmp_path, monkeypatch, caplog):
    """A file where the folder should be (as a read-only or full disk, the folder cannot be
    written): the kernels are built in a private folder, said once, and they run."""
    (tmp_path / "cache").write_text("a file in place of the cache folder")
    folder = tmp_path / "cache" / "kernels"
    monkeypatch.setattr(toolchain_mod, "_WARNED", set())
    b = KernelBuilder(folder)
    with caplog.at_level("WARNING", logger="graphmode.backends.cpu"):
        k1, k2 = b.build(_kernel("sigmoid")), b.build(_kernel("tanh"))
    x = torch.randn(4, 8)
    assert rel_l2(run_with_tensors(k1, {"x": x})["y"], torch.sigmoid(x)) < 1e-6
    assert rel_l2(run_with_tensors(k2, {"x": x})["y"], torch.tanh(x)) < 1e-6
    assert [e["event"] for e in b.events] == ["unwritable", "unwritable"]
    assert len([r for r in caplog.records if "uncached" in r.getMessage()]) == 1
    assert (tmp_path / "cache").read_text().startswith("a file")


def _seal_keys_made_at_once(folder: Path, makers: int) -> list:
    """What `makers` threads released together get from `_seal_key(folder)` (an exception or the key)."""
    import threading
    start, got = threading.Barrier(makers), [None] * makers

    def make(i):
        start.wait()
        try:
            got[i] = build_mod._seal_key(folder)
        except Exception as e:     # noqa: BLE001 - the test reports whatever a maker raised
            got[i] = e
    threads = [threading.Thread(target=make, args=(i,)) for i in range(makers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return got


def test_makers_of_a_new_seal_key_at_once_all_get_the_one_that_stays(tmp_path):
    """Ranks sharing a cache made the key at once: one took the key a peer had just linked for
    damage, deleted it, and the peer's read failed (CI: both ranks died 'cannot open .seal-key')."""
    for n in range(40):
        folder = tmp_path / f"k{n}"
        got = _seal_keys_made_at_once(folder, 6)
        assert all(isinstance(k, bytes) for k in got), got
        assert len(set(got)) == 1 and got[0] == (folder / build_mod.SEAL_KEY).read_bytes()


@pytest.mark.parametrize("damage", ["short", "folder", "link"])
def test_a_damaged_seal_key_is_replaced_once(tmp_path, damage):
    """Run 30 times: a maker resolved the link a second time for its message while a peer
    replaced it, and realpath's EINVAL escaped (CI, about 1 run in 10)."""
    for n in range(30):
        folder = tmp_path / f"kernels{n}"
        folder.mkdir()
        path, elsewhere = folder / build_mod.SEAL_KEY, tmp_path / f"elsewhere{n}"
        if damage == "short":
            path.write_bytes(b"12345")
        elif damage == "folder":
            (path / "inside").mkdir(parents=True)
        else:
            elsewhere.write_bytes(b"k" * 32)
            path.symlink_to(elsewhere)
        got = _seal_keys_made_at_once(folder, 4)
        assert all(isinstance(k, bytes) and len(k) == 32 for k in got), got
        assert path.is_file() and not path.is_symlink() and path.read_bytes() in got
        assert path.read_bytes() != b"k" * 32 and (path.stat().st_mode & 0o777) == 0o600
        assert elsewhere.exists() or damage != "link"
        assert [p.name for p in folder.iterdir()] == [build_mod.SEAL_KEY]    # no temporary left behind


@needs_cxx
def test_a_cache_cleared_in_the_middle_of_a_build_builds_again(tmp_path, monkeypatch, caplog):
    """`graphmode cache clear` in another process removed the build folder under the compiler:
    a raw FileNotFoundError traceback (from the fallback's own temporary folder)."""
    real, calls = build_mod.run, []

    def cleared_first(cmd, **kw):
        calls.append(cmd)
        if len(calls) == 1:
            shutil.rmtree(tmp_path / "kernels")          # as `cache clear` does, while the compiler runs
        return real(cmd, **kw)
    monkeypatch.setattr(build_mod, "run", cleared_first)
    b = KernelBuilder(tmp_path / "kernels")
    with caplog.at_level("WARNING", logger="graphmode.backends.cpu"):
        k = b.build(_kernel("sigmoid"))
    x = torch.randn(4, 8)
    assert rel_l2(run_with_tensors(k, {"x": x})["y"], torch.sigmoid(x)) < 1e-6
    assert b.stats["compiles"] == 1 and b.library_path([_kernel("sigmoid")]).is_file()
    assert [r.getMessage() for r in caplog.records if "was removed while" in r.getMessage()]


@needs_cxx
def test_builders_of_one_library_at_once_compile_it_once(tmp_path):
    """The ranks of a tensor-parallel group compiled the same kernels for their shards, each on
    its own: twice the cold start's compile time on a 2-core host. Builders sharing a folder
    (separate processes or, here, separate builders in threads: each opens its own lock file
    description) now take the library's build lock; the later one loads what the first built."""
    import threading
    folder, n = tmp_path / "kernels", 3
    builders = [KernelBuilder(folder) for _ in range(n)]
    start, got = threading.Barrier(n), [None] * n

    def build(i):
        start.wait()
        got[i] = builders[i].build(_kernel("sigmoid"))
    threads = [threading.Thread(target=build, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(b.stats["compiles"] for b in builders) == 1, [b.stats for b in builders]
    assert sum(b.stats["cache_hits"] for b in builders) == n - 1 and not any(b.events for b in builders)
    x = torch.randn(4, 8)
    for k in got:
        assert rel_l2(run_with_tensors(k, {"x": x})["y"], torch.sigmoid(x)) < 1e-6
    assert not [p.name for p in folder.iterdir() if p.name.startswith(build_mod.LOCK_PREFIX)]
