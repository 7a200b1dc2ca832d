"""The precompiled intrinsics header (backends/cpu/pch.py): made at a process's second library
that includes simd.h, read by the ones after it, which compute what they compute without it; a
compile it breaks is retried without it and it is not used again; clang never gets it."""
from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch

from graphmode.backends.cpu import pch
from graphmode.backends.cpu.build import DEFAULT_FLAGS, KernelBuilder
from graphmode.backends.cpu.gemm import GemmConfig, GemmProblem, generate_gemm, pack_b

_PROBE = KernelBuilder(Path(tempfile.gettempdir()) / "graphmode-test-probe")
needs_gcc = pytest.mark.skipif(not (_PROBE.compiler_available() and pch.is_gcc(_PROBE.toolchain.version)),
                               reason="no g++ on this machine")


@pytest.fixture
def fresh(monkeypatch):
    """As a process that has built no library yet."""
    monkeypatch.setattr(pch, "_STATE", {})


def _builder(folder: Path) -> KernelBuilder:
    """A builder whose flags no other in this process has: a header is one per process and flag set,
    and a background build of an earlier test (a plan's buckets) would make it first."""
    return KernelBuilder(folder, flags=DEFAULT_FLAGS + ("-DGM_PCH_TEST",))


def _state(b: KernelBuilder):
    """This builder's header (other threads of the process may hold others)."""
    return pch._STATE[pch._key(b.toolchain.cxx, b.toolchain.flags)]


def _linear(n: int):
    cfg = GemmConfig("portable", 4, 16, 0, 0)         # its text holds simd.h on every host
    p = GemmProblem("linear", 1, 5, n, 24, bias=True)
    torch.manual_seed(n)
    a, w, bias = torch.randn(1, 5, 24), torch.randn(n, 24), torch.randn(n)
    return generate_gemm(p, cfg, threads=2), (a, pack_b(w, cfg.nr, transposed=True), bias), a @ w.t() + bias


def _run(builder: KernelBuilder, n: int) -> None:
    ks, args, want = _linear(n)
    kernel = builder.build(ks)
    out = torch.full_like(want, float("nan"))
    kernel([t.data_ptr() for t in (*args, out)])
    assert torch.allclose(out, want, rtol=1e-5, atol=1e-5)


@needs_gcc
def test_the_second_library_reads_the_header_and_computes_the_same(tmp_path, fresh):
    b = _builder(tmp_path)
    assert pch.NEEDED_BY in _linear(16)[0].translation_unit()
    _run(b, 16)
    _run(b, 17)
    state = _state(b)
    assert state.state == "ready" and state.path.with_suffix(".h.gch").stat().st_size > 0
    state.path.write_text("#error the text was read\n")    # so a compile that reads the text fails
    _run(b, 18)
    assert state.state == "ready"                           # it read the precompiled header
    assert b.stats["compiles"] == 3 and b.stats["precompiled_header"] == 2


@needs_gcc
def test_a_compile_the_header_breaks_is_retried_without_it_and_it_is_dropped(tmp_path, fresh, monkeypatch, caplog):
    b = _builder(tmp_path)
    _run(b, 16)
    _run(b, 17)                                       # made and read
    state = _state(b)
    state.path.with_suffix(".h.gch").write_bytes(b"not a precompiled header")
    state.path.write_text("#error a broken header\n")     # gcc falls back to the text: it fails
    with caplog.at_level("WARNING", logger="graphmode.backends.cpu"):
        _run(b, 18)
    assert state.state == "failed" and "only without the precompiled" in caplog.text
    _run(b, 19)
    assert b.stats["compiles"] == 4 and b.stats["precompiled_header"] == 1


def test_only_gcc_and_only_what_includes_the_intrinsics_get_it(fresh):
    tu = "int f(void) { return 1; }\n"
    assert pch.flags_for("/usr/bin/g++", "g++ (Debian 14.2.0) 14.2.0", ("-O3",), tu) == []
    simd = pch.NEEDED_BY + "\n"
    for _ in range(3):
        assert pch.flags_for("/usr/bin/clang++", "Debian clang version 19.1.7", ("-O3",), simd) == []
    assert not any(k[1] == "/usr/bin/clang++" for k in pch._STATE)     # clang: never counted, never built


@needs_gcc
def test_no_temporary_folder_means_no_header_not_a_failed_build(tmp_path, fresh, monkeypatch):
    def full(*a, **k):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(pch.tempfile, "TemporaryDirectory", full)
    b = _builder(tmp_path)
    _run(b, 16)
    _run(b, 17)
    assert b.stats["compiles"] == 2 and b.stats["precompiled_header"] == 0
