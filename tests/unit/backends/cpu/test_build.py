"""Cached kernel libraries are validated before dlopen: a truncated file (SIGBUS when mapped),
one for another machine, one copied from another build key, or one that does not load in a
subprocess is refused and rebuilt, whatever its sidecar checksum says."""
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
from graphmode.backends.cpu.build import KernelBuilder, elf_problem, library_problem
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
    lib.with_suffix(".so.sha256").write_text(hashlib.sha256(lib.read_bytes()).hexdigest())


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
    assert library_problem(lib, key).startswith("unreadable")      # no sidecar checksum
    reseal(lib)
    assert "build key missing" in library_problem(lib, key)
    with open(lib, "ab") as f:              # the marker bytes alone do not make it ours
        f.write((build_mod.KEY_MARK + key).encode())
    reseal(lib)
    assert "trial load" in library_problem(lib, key)
    lib.unlink()
    lib.mkdir()
    assert library_problem(lib, key) == "not a regular file"


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
    monkeypatch.setattr(build_mod, "_PROBES", {})      # probe here, not from this process's memory
    b = KernelBuilder(tmp_path)
    if not b.compiler_available():
        pytest.skip("no C++ compiler on this machine")
    (record,) = tmp_path.glob("probe-*.json")
    record.write_text('["-O0", "-include", "/etc/passwd"]')
    monkeypatch.setattr(build_mod, "_PROBES", {})
    b2 = KernelBuilder(tmp_path)
    assert b2.compiler_available() and set(b2.flags) <= set(b2.base_flags) | {"-fopenmp-simd"}
