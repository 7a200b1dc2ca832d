"""The host probe's memory bandwidth: streaming C kernels over a buffer far larger than the LLC,
the best read as the roofline's bandwidth, every variant kept in the facts, the torch fallback
without a compiler, and cached probes of the old version measured again. Nothing here asserts
how fast the machine is: only that the numbers exist, are positive and are picked right."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from graphmode.errors import TargetError
from graphmode.targets import host as H
from graphmode.targets.bandwidth import (COMPILERS, STREAM_MAX, STREAM_MIN, best_read, measure_bandwidth,
                                        measure_fma_peak,
                                         stream_buffer_bytes)

MIB = 2**20
DATA = Path(__file__).resolve().parents[1] / "data" / "targets"
HAVE_CC = any(shutil.which(c) for c in COMPILERS)


def _probe(**over):
    p = {"threads": 2, "gemm_n": 64, "gemm_f32_gflops": 50.0, "dispatch_us": 3.0, "probe_seconds": 0.01,
         "probed_at": "2026-01-01T00:00:00+00:00", "copy_gbps": 8.4, "read_gbps": 19.0, "read_variant": "read_nt",
         "bandwidth_variants_gbps": {"read": 17.5, "read_prefetch": 18.2, "read_nt": 19.0, "copy": 8.4},
         "bandwidth_buffer_mib": 512.0, "bandwidth_threads": 2, "bandwidth_method": "C kernel (cc -O3), 2 thread(s)"}
    p.update(over)
    return p


@pytest.fixture
def zen3_facts():
    cpu = H.parse_cpuinfo((DATA / "cpuinfo_epyc_zen3.txt").read_text())
    return H.HostFacts(cpu=cpu, cores=2, threads=2, caches=[], memory_bytes=2**34, clock_mhz=2450.0,
                       clock_source="test")


# ----------------------------------------------------------------------------- pure selection logic

@pytest.mark.parametrize("llc_mib, mem_gib, want_mib", [
    (32, 24, 512),        # 16 x a 32 MiB L3: the project machine
    (8, 24, 256),         # small LLC: the floor, still 32 x the LLC
    (1024, 1024, 512),    # huge LLC: capped well under 1 GiB
    (32, 1, 128),         # small memory: at most an eighth of it
    (0, 24, 256),         # no cache facts
])
def test_stream_buffer_sizing(llc_mib, mem_gib, want_mib):
    assert stream_buffer_bytes(llc_mib * MIB, mem_gib * 2**30) == want_mib * MIB


def test_stream_buffer_is_far_above_common_llcs_and_aligned():
    for llc in (2 * MIB, 16 * MIB, 32 * MIB):
        size = stream_buffer_bytes(llc, 64 * 2**30)
        assert 4 * llc <= size <= STREAM_MAX < 2**30 and size >= STREAM_MIN
    odd = stream_buffer_bytes(32 * MIB, 2**30 + 12345)          # memory / 8 is not a multiple of 2 MiB
    assert odd % (2 * MIB) == 0 and odd <= (2**30 + 12345) // 8


def test_container_memory_limit(tmp_path):
    """A container's limit, not the host's MemTotal, bounds the buffer (cgroup v2, then v1)."""
    assert H.memory_limit_bytes(tmp_path) is None                       # no cgroup files
    (tmp_path / "memory.max").write_text("max\n")
    assert H.memory_limit_bytes(tmp_path) is None                       # v2, unlimited
    (tmp_path / "memory").mkdir()
    (tmp_path / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert H.memory_limit_bytes(tmp_path) is None                       # v1, unlimited
    (tmp_path / "memory.max").write_text(f"{2**30}\n")
    assert H.memory_limit_bytes(tmp_path) == 2**30
    assert stream_buffer_bytes(32 * MIB, 2**30) == 128 * MIB             # an eighth of the 1 GiB container


def test_best_read_picks_the_fastest_read_never_the_copy():
    assert best_read({"read": 10.0, "read_prefetch": 12.5, "read_nt": 11.0, "copy": 30.0}) == ("read_prefetch", 12.5)
    assert best_read({"sum": 5.0, "copy": 6.0}) == ("sum", 5.0)                 # the torch fallback
    assert best_read({"read": 0.0, "read_nt": None, "read_prefetch": True, "copy": 6.0}) is None
    assert best_read({}) is None


def test_probe_bandwidth_is_the_best_read_else_the_copy():
    gbps, what = H.probe_bandwidth(_probe())
    assert gbps == 19.0 and "read_nt" in what
    gbps, what = H.probe_bandwidth({k: v for k, v in _probe().items() if not k.startswith("read")})
    assert gbps == 8.4 and "copy" in what


def test_host_target_rooflines_on_the_best_read(zen3_facts):
    t = H.build_host_target(zen3_facts, _probe())
    assert t.memory_bandwidth_gbps == 19.0
    assert t.groups["memory_banks"]["system_dram"]["bandwidth_gbps"] == 19.0
    m = t.groups["measured"]
    assert m["bandwidth_variants_gbps"] == {"read": 17.5, "read_prefetch": 18.2, "read_nt": 19.0, "copy": 8.4}
    assert m["copy_gbps"] == 8.4 and "best streaming read" in m["bandwidth_source"]


def test_bad_read_number_is_refused_or_reprobed(tmp_path, zen3_facts):
    with pytest.raises(TargetError, match="unusable"):
        H.detect_host(cache_dir=tmp_path, facts=zen3_facts, probe_fn=lambda th: _probe(read_gbps=0))
    key = zen3_facts.cache_key(torch.__version__)
    (tmp_path / "host.json").write_text(json.dumps({"key": key, "probe": _probe(read_gbps="fast")}))
    with pytest.warns(H.HostProbeWarning, match="corrupt"):
        t = H.detect_host(cache_dir=tmp_path, facts=zen3_facts, probe_fn=lambda th: _probe(read_gbps=21.0))
    assert t.memory_bandwidth_gbps == 21.0 and t.groups["measured"]["source"] == "probe"


def test_probe_of_the_old_version_is_measured_again(tmp_path, zen3_facts):
    """A probe cached before the streaming kernels (version 1: one torch copy) is not reused."""
    assert H.PROBE_VERSION >= 2
    old_key = dict(zen3_facts.cache_key(torch.__version__), probe_version=1)
    old = {k: v for k, v in _probe().items() if not k.startswith(("read", "bandwidth"))}
    assert H.save_probe_cache(tmp_path / "host.json", old_key, old)
    calls = []
    t = H.detect_host(cache_dir=tmp_path, facts=zen3_facts, probe_fn=lambda th: calls.append(th) or _probe())
    assert calls == [2] and t.groups["measured"]["reprobe_reason"] == "key changed: probe_version"
    assert t.memory_bandwidth_gbps == 19.0
    again = H.detect_host(cache_dir=tmp_path, facts=zen3_facts, probe_fn=lambda th: calls.append(th) or _probe())
    assert calls == [2] and again.groups["measured"]["source"] == "cache"     # the new probe is cached


# ----------------------------------------------------------------------------- real measurements (small)

def _check_facts(out: dict, threads: int, buffer_mib: float) -> dict:
    v = out["bandwidth_variants_gbps"]
    assert v and all(x > 0 for x in v.values())
    assert out["read_gbps"] > 0 and v[out["read_variant"]] == out["read_gbps"]
    assert out["read_gbps"] == max(x for k, x in v.items() if k != "copy")
    assert out["copy_gbps"] == v["copy"] > 0
    assert out["bandwidth_threads"] == threads and out["bandwidth_buffer_mib"] == buffer_mib
    return v


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler: the torch fallback is tested below")
def test_streaming_kernels_run_and_report_every_variant():
    out = measure_bandwidth(2, 8 * MIB, budget_s=0.05)
    v = _check_facts(out, 2, 8.0)
    assert out["bandwidth_method"].startswith("C kernel (") and "2 thread(s)" in out["bandwidth_method"]
    assert {"read", "read_prefetch", "copy"} <= set(v)
    assert ("read_nt" in v) != ("bandwidth_note" in out)      # present, or said to be absent


def test_without_a_compiler_the_probe_falls_back_to_torch_and_says_so():
    out = measure_bandwidth(1, 8 * MIB, budget_s=0.05, compilers=("graphmode-no-such-cc",))
    v = _check_facts(out, 1, 8.0)
    assert set(v) == {"sum", "copy"} and out["read_variant"] == "sum"
    assert "torch" in out["bandwidth_method"] and "graphmode-no-such-cc: not found" in out["bandwidth_method"]


def test_run_probe_reports_the_bandwidth_fields():
    p = H.run_probe(1, gemm_n=64, copy_mib=8, budget_s=0.2)
    _check_facts(p, 1, 8.0)
    assert p["threads"] == 1 and p["gemm_f32_gflops"] > 0 and p["dispatch_us"] > 0 and H._valid_probe(p)
    assert H.probe_bandwidth(p)[0] == p["read_gbps"]
    assert p["fma_f32_gflops"] > 0 and "1 thread(s)" in p["fma_method"]     # the peak's probe beside it


def test_fma_chains_measure_a_peak_and_say_how():
    """The FMA peak probe runs on the system compiler; without one it says why and reports no
    number (the target keeps its clock-based peak)."""
    if not any(shutil.which(c) for c in COMPILERS):
        pytest.skip("no C compiler")
    out = measure_fma_peak(2, budget_s=0.05)
    assert out["fma_f32_gflops"] > 0 and "2 thread(s), 12 chains of" in out["fma_method"]
    none = measure_fma_peak(1, compilers=("graphmode-no-such-cc",))
    assert "fma_f32_gflops" not in none and "not measured (no C kernel" in none["fma_method"]


def test_a_temporary_folder_it_cannot_write_measures_without_the_c_kernels(monkeypatch):
    """A full TMPDIR ended `graphmode run` in a raw OSError traceback from the probe (trial AA)."""
    import tempfile

    import graphmode.targets.bandwidth as bw

    def full(*a, **k):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(tempfile, "TemporaryDirectory", full)
    bw._kernels.cache_clear()
    try:
        out = measure_bandwidth(1, 8 * MIB, budget_s=0.05, compilers=("graphmode-full-tmp-cc",))
    finally:
        bw._kernels.cache_clear()
    assert out["read_gbps"] > 0 and "No space left on device" in out["bandwidth_method"]
    assert "set TMPDIR" in out["bandwidth_method"]
