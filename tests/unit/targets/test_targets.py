"""graphmode.targets: shipped files, registry errors, host detection and probe cache, cost model, CLI."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from graphmode.errors import TargetError
from graphmode.paths import cache_layout
from graphmode.targets import (Calibration, bank_ids, arithmetic_intensity, check_target, elementwise_cost,
                               get_target, list_targets, load_target_file, matmul_cost, predict_op,
                               predict_op_seconds, predict_seconds, resolve_group, ridge_point, target_from_dict)
from graphmode.targets import host as H
from graphmode.targets.registry import KNOWN_DTYPES
from graphmode.targets.units import parse_bandwidth_gbps, parse_bytes, parse_flops

DATA = Path(__file__).resolve().parents[1] / "data" / "targets"
SHIPPED = [n for n in list_targets() if n != "host"]
REPO = Path(__file__).resolve().parents[3]


# ----------------------------------------------------------------------------- shipped files

def test_registry_lists_required_targets():
    for name in ("a100_sxm", "a100_pcie", "h100_sxm", "h200", "l40s", "mi250", "ascend_910b", "cpu_avx2"):
        assert name in SHIPPED
    assert list_targets()[-1] == "host"


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_target_loads_and_is_self_consistent(name):
    t = get_target(name)
    assert t.name == name and not t.measured
    assert check_target(t) == []
    assert t.dtypes and set(t.dtypes) == set(t.peak_flops)
    assert all(dt in KNOWN_DTYPES for dt in t.dtypes)
    assert all(v > 0 for v in t.peak_flops.values())
    assert t.memory_bandwidth_gbps > 0 and t.memory_bytes > 0 and t.compute_units > 0
    assert t.llc_bytes >= t.l2_bytes or t.kind == "cpu"
    for g in ("memory_banks", "compute_classes"):
        assert t.groups[g], f"{name}: empty {g}"
    # every target offers the portable names recipes use
    hbm = resolve_group(t, "memory_banks", "high_bandwidth")
    assert hbm["bandwidth_gbps"] == pytest.approx(t.memory_bandwidth_gbps)
    assert hbm["bytes"] <= t.memory_bytes
    resolve_group(t, "compute_classes", "matrix")
    # a compute class never beats the chip's headline peak for a dtype
    for cname, cls in t.groups["compute_classes"].items():
        for dt, v in cls.get("peak_flops", {}).items():
            assert v <= t.peak_flops[dt] * 1.0001, (name, cname, dt)
    # a floating-point dtype narrower than f32 is never slower than f32 on these chips
    for dt in ("f16", "bf16", "fp8_e4m3"):
        if dt in t.peak_flops:
            assert t.peak_flops[dt] >= t.peak_flops["f32"]


def test_published_numbers():
    a100, h100, h200, l40s, mi250 = (get_target(n) for n in ("a100_sxm", "h100_sxm", "h200", "l40s", "mi250"))
    assert a100.compute_units == 108 and a100.memory_bandwidth_gbps == 2039 and a100.peak_flops["bf16"] == 312e12
    assert a100.l2_bytes == 40 * 2**20 and "fp8_e4m3" not in a100.dtypes
    assert get_target("a100_pcie").memory_bandwidth_gbps == 1935
    assert h100.compute_units == 132 and h100.peak_flops["fp8_e4m3"] == 1979e12
    assert h100.groups["interconnects"]["nvlink"]["bandwidth_gbps"] == 900
    assert h200.memory_bandwidth_gbps == 4800 and h200.memory_bytes > 140 * 2**30
    assert l40s.arch == "sm_89" and l40s.memory_bandwidth_gbps == 864
    assert mi250.arch == "gfx90a" and mi250.compute_units == 208 and "tf32" not in mi250.dtypes


def test_resolve_group_aliases_and_errors():
    assert resolve_group(get_target("mi250"), "compute_classes", "tensor_core")["name"] == "matrix"
    assert resolve_group(get_target("ascend_910b"), "compute_classes", "cube")["name"] == "matrix"
    assert resolve_group(get_target("h100_sxm"), "memory_banks", "hbm")["name"] == "high_bandwidth"
    with pytest.raises(TargetError) as e:
        resolve_group(get_target("h100_sxm"), "memory_banks", "high_bandwith")
    assert "high_bandwidth" in e.value.fix and "host_pinned" in e.value.fix
    with pytest.raises(TargetError, match="no group"):
        resolve_group(get_target("h100_sxm"), "nonexistent", "x")


def test_bank_ids_one_recipe_several_chips():
    affinity = ["high_bandwidth"]
    assert bank_ids(get_target("a100_sxm"), affinity) == [0, 1, 2, 3, 4]
    assert bank_ids(get_target("h200"), affinity) == [0, 1, 2, 3, 4, 5]
    assert bank_ids(get_target("cpu_avx2"), affinity) == [0]
    assert bank_ids(get_target("mi250"), ["gcd1_local", 7, "gcd0_local"]) == [4, 5, 6, 7, 0, 1, 2, 3]
    assert bank_ids(get_target("h100_sxm"), ["host_pinned"]) == []
    with pytest.raises(TargetError) as e:
        bank_ids(get_target("l40s"), ["low_power"])
    assert "high_bandwidth" in e.value.fix


# ----------------------------------------------------------------------------- registry errors

def test_unknown_target_suggests_near_match():
    with pytest.raises(TargetError) as e:
        get_target("h100_sxn")
    err = e.value
    assert err.value == "h100_sxn" and "did you mean 'h100_sxm'" in err.fix
    for n in ("a100_sxm", "mi250", "host"):
        assert n in err.fix
    assert err.exit_code == 2


def test_name_normalisation_and_aliases():
    assert get_target("H100-SXM").name == "h100_sxm"
    assert get_target("gfx90a").name == "mi250"
    assert get_target("a100").name == "a100_sxm"


def _write(tmp_path, d, name="t.yaml"):
    p = tmp_path / name
    p.write_text(yaml.safe_dump(d, sort_keys=False))
    return p


def _base() -> dict:
    return yaml.safe_load((DATA / "custom_chip.yaml").read_text())


def test_custom_file_and_inline_dict_with_units(tmp_path):
    t = load_target_file(DATA / "custom_chip.yaml")
    assert t.name == "my_npu" and t.memory_bytes == 32 * 2**30 and t.memory_bandwidth_gbps == 1200
    assert t.peak_flops == {"f32": 25e12, "bf16": 200e12, "i8": 400e12}
    assert t.groups["memory_banks"]["high_bandwidth"]["bytes"] == 32 * 2**30
    t2 = target_from_dict(_base())
    assert t2 == t


@pytest.mark.parametrize("mutate, where, value, fix_part", [
    (lambda d: d.pop("compute_units"), "compute_units", None, "add the field"),
    (lambda d: d.update(compute_units="many"), "compute_units", "many", "Target schema"),
    (lambda d: d.update(kind="fpga"), "kind", "fpga", "'cpu'"),
    (lambda d: d.update(sm_count=108), "sm_count", 108, "remove the field"),
    (lambda d: d.update(memory_bytes="32 GiBB"), "memory_bytes", "32 GiBB", "'80 GiB'"),
    (lambda d: d["peak_flops"].update(bf16="fast"), "peak_flops.bf16", "fast", "TFLOPS"),
    (lambda d: d.update(dtypes=["f32", "bf16", "i8", "f16"]), "dtypes.3", "f16", "add peak_flops.f16"),
    (lambda d: d.update(dtypes=["f32", "bf16", "int8"]), "dtypes.2", "int8", "did you mean"),
    (lambda d: d["groups"].pop("compute_classes"), "groups.compute_classes", None, "declare groups.compute_classes"),
    (lambda d: d["groups"]["memory_banks"]["high_bandwidth"].update(bytes="lots"),
     "groups.memory_banks.high_bandwidth.bytes", "lots", "'80 GiB'"),
])
def test_malformed_target_file_names_field_value_fix(tmp_path, mutate, where, value, fix_part):
    d = _base()
    mutate(d)
    p = _write(tmp_path, d)
    with pytest.raises(TargetError) as e:
        load_target_file(p)
    err = e.value
    assert err.where == f"{p}: {where}"
    assert err.value == value
    assert fix_part in err.fix
    if value is not None:   # a present field: the error points at its line
        assert err.line is not None
        line = p.read_text().splitlines()[err.line - 1]
        last = where.split(".")[-1]
        assert (str(value) in line) if last.isdigit() else (last in line)


def test_yaml_syntax_error_has_line(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("name: x\nkind: gpu\npeak_flops: {f32: 1\n  bad: [\n")
    with pytest.raises(TargetError) as e:
        load_target_file(p)
    assert e.value.line is not None and "YAML" in e.value.message
    with pytest.raises(TargetError, match="not found"):
        load_target_file(tmp_path / "missing.yaml")


def test_units():
    assert parse_bytes("80 GiB") == 80 * 2**30 and parse_bytes("48 GB") == 48 * 10**9 and parse_bytes(1024) == 1024
    assert parse_bandwidth_gbps("3.35 TB/s") == pytest.approx(3350) and parse_bandwidth_gbps(900) == 900
    assert parse_flops("19.5 TFLOPS") == 19.5e12 and parse_flops("624 TOPS") == 624e12
    assert parse_flops("1.979 PFLOPS") == pytest.approx(1.979e15) and parse_flops("312e12") == 312e12


# ----------------------------------------------------------------------------- cpuinfo / sysfs parsers

def test_parse_cpuinfo_xeon_avx512_amx():
    cpu = H.parse_cpuinfo((DATA / "cpuinfo_xeon_spr_amx.txt").read_text())
    assert cpu.isa == "x86_64" and cpu.vendor == "intel" and cpu.processors == 2
    assert cpu.model_name == "Intel(R) Xeon(R) Platinum 8480+" and cpu.family == 6 and cpu.model == 143
    simd = H.simd_features(cpu)
    for f in ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx512_fp16",
              "amx_tile", "amx_bf16", "amx_int8"):
        assert f in simd
    assert H.vector_width_bits(cpu) == 512 and H.vector_registers(cpu) == 32
    ua = H.microarch(cpu)
    assert ua.arch == "sapphirerapids" and ua.fma_units == 2 and ua.datapath_bits == 512
    fpc = H.flops_per_cycle_per_core(cpu, ua)
    assert fpc["f32"] == 64 and fpc["f64"] == 32 and fpc["bf16"] == 1024 and fpc["i8"] == 2048 and fpc["f16"] == 128
    assert H.clock_mhz(cpu, "/nonexistent") == (2000.0, "/proc/cpuinfo cpu MHz")


def test_parse_cpuinfo_epyc_zen3_avx2_only():
    cpu = H.parse_cpuinfo((DATA / "cpuinfo_epyc_zen3.txt").read_text())
    assert cpu.vendor == "amd" and cpu.family == 25 and cpu.model == 1
    assert "avx512f" not in H.simd_features(cpu) and "avx2" in H.simd_features(cpu)
    assert H.vector_width_bits(cpu) == 256 and H.vector_registers(cpu) == 16
    ua = H.microarch(cpu)
    assert (ua.arch, ua.fma_units, ua.datapath_bits) == ("zen3", 2, 256)
    fpc = H.flops_per_cycle_per_core(cpu, ua)
    assert fpc == {"f64": 16, "f32": 32, "i8": 64}
    facts = H.HostFacts(cpu=cpu, cores=2, threads=2, caches=[], memory_bytes=2**34, clock_mhz=2450, clock_source="t")
    assert H.theoretical_peaks(facts)["f32"] == pytest.approx(2 * 32 * 2.45e9)   # 156.8 GFLOP/s


@pytest.mark.parametrize("fixture, arch, simd, width, f32", [
    ("cpuinfo_graviton2_aarch64.txt", "neoverse-n1", ["neon", "fp16", "neon_fp16", "dotprod"], 128, 16),
    ("cpuinfo_graviton3_sve.txt", "neoverse-v1", ["neon", "dotprod", "sve", "bf16", "i8mm"], 256, 32),
])
def test_parse_cpuinfo_aarch64(fixture, arch, simd, width, f32):
    cpu = H.parse_cpuinfo((DATA / fixture).read_text())
    assert cpu.isa == "aarch64" and cpu.vendor == "arm" and cpu.implementer == 0x41
    assert arch in cpu.model_name and cpu.mhz is None
    assert all(f in H.simd_features(cpu) for f in simd)
    assert H.vector_registers(cpu) == 32
    assert H.vector_width_bits(cpu, sve_bytes=32) == width
    ua = H.microarch(cpu)
    assert ua.arch == arch
    fpc = H.flops_per_cycle_per_core(cpu, ua)
    assert fpc["f32"] == f32 and fpc["i8"] > fpc["f32"]
    assert H.clock_mhz(cpu, "/nonexistent") == (None, "unknown")


def test_host_target_without_clock_uses_measured_gemm():
    cpu = H.parse_cpuinfo((DATA / "cpuinfo_graviton2_aarch64.txt").read_text())
    facts = H.HostFacts(cpu=cpu, cores=4, threads=4, caches=[], memory_bytes=2**33, clock_mhz=None,
                        clock_source="unknown")
    t = H.build_host_target(facts, _fake_probe())
    assert t.peak_flops["f32"] == pytest.approx(50e9) and t.peak_flops["f16"] == pytest.approx(100e9)
    assert t.arch == "neoverse-n1" and "neon" in t.simd and t.registers_per_core == 32
    assert check_target(t) == []


def _sysfs(root: Path, cpus: int) -> Path:
    spec = [(1, "Data", "48K", None), (1, "Instruction", "32K", None), (2, "Unified", "2048K", None),
            (3, "Unified", "107520K", f"0-{cpus - 1}")]
    for c in range(cpus):
        for i, (lv, ty, size, shared) in enumerate(spec):
            d = root / f"cpu{c}" / "cache" / f"index{i}"
            d.mkdir(parents=True)
            (d / "level").write_text(f"{lv}\n")
            (d / "type").write_text(f"{ty}\n")
            (d / "size").write_text(f"{size}\n")
            (d / "shared_cpu_list").write_text(f"{shared or c}\n")
    (root / "cpufreq").mkdir()  # a non-cpu folder must be ignored
    return root


def test_parse_caches_sizes_meminfo(tmp_path):
    caches = H.parse_caches(_sysfs(tmp_path / "cpu", 4))
    by = {(c.level, c.type): c for c in caches}
    assert by[(1, "Data")].size_bytes == 48 * 1024 and by[(1, "Data")].instances == 4
    assert by[(2, "Unified")].size_bytes == 2 * 2**20
    assert by[(3, "Unified")].instances == 1 and by[(3, "Unified")].shared_by == 4
    assert H._cache_fallback(caches) == (48 * 1024, 2 * 2**20, 105 * 2**20)
    assert parse_bytes("32K\n") == 32768              # sysfs writes binary K with a newline
    assert H.parse_meminfo("MemTotal:       24683652 kB\nMemFree: 1 kB\n") == 24683652 * 1024
    assert H.parse_cpu_list("0-3,8,10-11") == {0, 1, 2, 3, 8, 10, 11}


def test_detect_host_facts_from_fixture_roots(tmp_path):
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "cpuinfo").write_text((DATA / "cpuinfo_xeon_spr_amx.txt").read_text())
    (proc / "meminfo").write_text("MemTotal:       1048576 kB\n")
    facts = H.detect_host_facts(proc_root=proc, sys_cpu_root=_sysfs(tmp_path / "cpu", 2), cores=2, threads=2)
    assert facts.memory_bytes == 2**30 and facts.clock_mhz == 2000.0
    t = H.build_host_target(facts, _fake_probe())
    assert t.arch == "sapphirerapids" and t.vector_width_bits == 512
    assert set(t.dtypes) == {"f64", "f32", "f16", "bf16", "i8"}
    assert t.peak_flops["f32"] == pytest.approx(2 * 64 * 2.0e9)
    assert resolve_group(t, "compute_classes", "tensor_core")["name"] == "matrix"   # AMX
    assert check_target(t) == []


# ----------------------------------------------------------------------------- host on this machine

def test_detect_host_facts_this_machine():
    facts = H.detect_host_facts()
    assert facts.cores >= 1 and facts.threads >= 1 and facts.memory_bytes > 2**28
    cpu = facts.cpu
    assert cpu.model_name and cpu.isa in ("x86_64", "aarch64")
    assert cpu.flags, "no flags parsed from /proc/cpuinfo"
    if cpu.isa == "x86_64":
        assert "avx2" in cpu.flags or H.vector_width_bits(cpu) == 128
        assert H.vector_width_bits(cpu) == (512 if "avx512f" in cpu.flags else 256 if "avx2" in cpu.flags else 128)
        assert H.vector_registers(cpu) == (32 if "avx512f" in cpu.flags else 16)
    assert facts.caches and any(c.level == 1 for c in facts.caches)


@pytest.fixture(scope="module")
def host_cache(tmp_path_factory):
    """One real probe of this machine, shared by the tests that need real numbers."""
    root = tmp_path_factory.mktemp("gmcache")
    t = get_target("host", cache_dir=root / "targets")
    return root, t


def test_real_host_target(host_cache):
    root, t = host_cache
    m = t.groups["measured"]
    assert t.name == "host" and t.measured and t.kind == "cpu" and t.compute_units >= 1
    assert check_target(t) == []
    assert m["source"] == "probe" and m["gemm_f32_gflops"] > 0 and m["copy_gbps"] > 0 and m["dispatch_us"] > 0
    assert m["probe_seconds"] < 15
    assert t.peak_flops["f32"] >= m["gemm_f32_gflops"] * 1e9 * 0.999     # peak is an upper bound
    assert t.memory_bandwidth_gbps == (m.get("read_gbps") or m["copy_gbps"])   # the best read variant
    assert (root / "targets" / "host.json").exists()
    again = get_target("host", cache_dir=root / "targets")
    assert again.groups["measured"]["source"] == "cache" and again.peak_flops == t.peak_flops


def test_run_probe_small():
    p = H.run_probe(gemm_n=128, copy_mib=4, budget_s=0.3)
    assert p["gemm_f32_gflops"] > 0 and p["copy_gbps"] > 0 and p["dispatch_us"] > 0 and p["threads"] >= 1


def _fake_probe(**over):
    p = {"threads": 2, "gemm_n": 64, "copy_mib": 1, "gemm_f32_gflops": 50.0, "copy_gbps": 20.0,
         "dispatch_us": 3.0, "probe_seconds": 0.01, "probed_at": "2026-01-01T00:00:00+00:00"}
    p.update(over)
    return p


class _Counter:
    def __init__(self):
        self.calls = 0

    def __call__(self, threads):
        self.calls += 1
        return _fake_probe(threads=threads, gemm_f32_gflops=40.0 + self.calls)


@pytest.fixture
def zen3_facts():
    cpu = H.parse_cpuinfo((DATA / "cpuinfo_epyc_zen3.txt").read_text())
    return H.HostFacts(cpu=cpu, cores=2, threads=2, caches=[], memory_bytes=2**34, clock_mhz=2450.0,
                       clock_source="test")


def test_probe_cache_hit_corrupt_and_key_change(tmp_path, zen3_facts):
    probe = _Counter()
    t1 = H.detect_host(cache_dir=tmp_path, facts=zen3_facts, probe_fn=probe)
    assert probe.calls == 1 and t1.groups["measured"]["source"] == "probe"
    assert t1.groups["measured"]["reprobe_reason"] == "no cache file"
    t2 = H.detect_host(cache_dir=tmp_path, facts=zen3_facts, probe_fn=probe)
    assert probe.calls == 1 and t2.groups["measured"]["source"] == "cache"
    assert t2.groups["measured"]["gemm_f32_gflops"] == 41.0

    cache = tmp_path / "host.json"
    for garbage in ("{not json", json.dumps({"key": {}, "probe": {"copy_gbps": "fast"}}), "[]"):
        cache.write_text(garbage)
        with pytest.warns(H.HostProbeWarning, match="corrupt"):
            t3 = H.detect_host(cache_dir=tmp_path, facts=zen3_facts, probe_fn=probe)
        assert t3.groups["measured"]["source"] == "probe"
    assert probe.calls == 4
    assert json.loads(cache.read_text())["probe"]["gemm_f32_gflops"] == 44.0   # rewritten

    with warnings.catch_warnings():
        warnings.simplefilter("error")        # a key change is not a warning
        t4 = H.detect_host(cache_dir=tmp_path, facts=replace(zen3_facts, threads=1), probe_fn=probe)
    assert probe.calls == 5 and "threads" in t4.groups["measured"]["reprobe_reason"]
    other_cpu = replace(zen3_facts, cpu=replace(zen3_facts.cpu, model_name="AMD EPYC 9654"), cores=4)
    t5 = H.detect_host(cache_dir=tmp_path, facts=other_cpu, probe_fn=probe)
    assert probe.calls == 6 and "cpu_model" in t5.groups["measured"]["reprobe_reason"]
    H.detect_host(cache_dir=tmp_path, facts=other_cpu, probe_fn=probe)
    assert probe.calls == 6
    H.detect_host(cache_dir=tmp_path, facts=other_cpu, probe_fn=probe, reprobe=True)
    assert probe.calls == 7


def test_probe_cache_torch_version_in_key(tmp_path, zen3_facts, monkeypatch):
    import torch
    probe = _Counter()
    H.detect_host(cache_dir=tmp_path, facts=zen3_facts, probe_fn=probe)
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    t = H.detect_host(cache_dir=tmp_path, facts=zen3_facts, probe_fn=probe)
    assert probe.calls == 2 and "torch" in t.groups["measured"]["reprobe_reason"]


def test_unwritable_cache_warns_but_works(tmp_path, zen3_facts):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.warns(H.HostProbeWarning, match="cannot write"):
        t = H.detect_host(cache_dir=blocker / "sub", facts=zen3_facts, probe_fn=_Counter())
    assert t.memory_bandwidth_gbps == 20.0


def test_bad_probe_is_a_target_error(tmp_path, zen3_facts):
    with pytest.raises(TargetError, match="unusable"):
        H.detect_host(cache_dir=tmp_path, facts=zen3_facts, probe_fn=lambda th: _fake_probe(copy_gbps=0))


def test_measured_gemm_above_theoretical_raises_peak(zen3_facts):
    t = H.build_host_target(zen3_facts, _fake_probe(gemm_f32_gflops=200.0))   # theory: 156.8
    assert t.peak_flops["f32"] == pytest.approx(200e9)
    assert t.peak_flops["f64"] == pytest.approx(100e9)
    assert "implied clock" in t.groups["cpu"]["clock_note"]


def test_measured_fma_throughput_above_theoretical_raises_peak(zen3_facts):
    """A VM reports its nominal clock: the FMA chains (what the cores do at their real clock)
    raise the peak even where torch's GEMM stays under it, so a generated GEMM that passes
    torch's rate is still under its roofline; a probe without FMA numbers keeps the old peak."""
    t = H.build_host_target(zen3_facts, _fake_probe(gemm_f32_gflops=150.0, fma_f32_gflops=210.0))  # theory: 156.8
    assert t.peak_flops["f32"] == pytest.approx(210e9) and t.peak_flops["f64"] == pytest.approx(105e9)
    assert "FMA throughput exceeded the peak" in t.groups["cpu"]["clock_note"]
    assert H.build_host_target(zen3_facts, _fake_probe(gemm_f32_gflops=150.0)).peak_flops["f32"] == \
        pytest.approx(156.8e9, rel=1e-3)
    assert t.groups["cpu"]["probe_note"] == ""


def test_probe_on_a_busy_host_says_so(zen3_facts):
    """FMA chains well under what the reported clock allows (this 2-core VM read 117 GFLOP/s in
    one of its slow periods and 234 in another, the clock allowing 166): the note says the
    numbers are low and how to measure again."""
    t = H.build_host_target(zen3_facts, _fake_probe(gemm_f32_gflops=80.0, fma_f32_gflops=90.0))  # theory: 156.8
    note = t.groups["cpu"]["probe_note"]
    assert "90 GFLOP/s, 0.57x" in note and "--reprobe" in note
    assert t.peak_flops["f32"] == pytest.approx(156.8e9, rel=1e-3)        # the peak stays the clock's


# ----------------------------------------------------------------------------- cost model

def test_roofline_known_ops():
    a100 = get_target("a100_sxm")
    n = 4096
    op = matmul_cost(n, n, n, "f16")
    assert op.flops == 2 * n**3 and op.bytes_moved == 3 * n * n * 2
    p = predict_op(a100, op)
    assert p.bound == "compute"
    assert p.compute_s == pytest.approx(2 * n**3 / 312e12)             # 440.5 us
    assert p.seconds == pytest.approx(2 * n**3 / 312e12 + 4e-6)
    assert predict_op_seconds(a100, op.flops, op.bytes_moved, "f16") == pytest.approx(p.seconds)
    # a large fp32 add on H100 is memory-bound: 3 x 4e8 bytes / 3.35 TB/s
    h100 = get_target("h100_sxm")
    add = elementwise_cost(100_000_000, "f32", inputs=2)
    q = predict_op(h100, add)
    assert q.bound == "memory" and q.seconds == pytest.approx(1.2e9 / 3.35e12 + 4e-6)
    # a tiny op is overhead-bound
    assert predict_op(h100, elementwise_cost(16)).bound == "overhead"
    assert predict_op_seconds(h100, 0, 0) == pytest.approx(4e-6)
    # unknown dtype peak falls back to f32
    assert predict_op_seconds(get_target("mi250"), 1e12, 0, "tf32") == pytest.approx(1e12 / 90.5e12 + 6e-6)
    assert ridge_point(a100, "f16") == pytest.approx(312e12 / 2039e9)
    assert arithmetic_intensity(op.flops, op.bytes_moved) > ridge_point(a100, "f16")


def test_end_to_end_prediction():
    t = get_target("cpu_avx2")
    ops = [matmul_cost(128, 3072, 768, shared_b=True, name="fc1"), elementwise_cost(128 * 3072, kind="gelu"),
           matmul_cost(128, 768, 3072, shared_b=True, name="fc2")]
    pred = predict_seconds(t, ops)
    assert pred.total_s == pytest.approx(sum(predict_op(t, o).seconds for o in ops))
    assert set(pred.by_kind()) == {"matmul", "gelu"} and sum(pred.bound_counts().values()) == 3


def test_calibration_apply_fit_roundtrip(tmp_path):
    a100 = get_target("a100_sxm")
    op = matmul_cost(4096, 4096, 4096, "f16")
    cal = Calibration(target="a100_sxm", op_efficiency={"matmul": 0.5}, overhead_us=10)
    p = predict_op(a100, op, cal)
    assert p.seconds == pytest.approx(2 * (2 * 4096**3 / 312e12) + 10e-6)
    assert predict_op_seconds(a100, op.flops, op.bytes_moved, "f16", op_kind="softmax", calibration=cal) == \
        pytest.approx(2 * 4096**3 / 312e12 + 10e-6)                      # default efficiency 1
    path = cal.save(cache_layout(tmp_path).calibration("a100_sxm"))
    assert path == tmp_path / "calibration" / "a100_sxm.json"
    assert Calibration.load(path) == cal
    # fit recovers a known efficiency from synthetic measurements
    samples = [(matmul_cost(m, m, m, "f16"), 2 * m**3 / 312e12 / 0.7 + 4e-6) for m in (1024, 2048, 4096)]
    fitted = Calibration.fit(a100, samples)
    assert fitted.op_efficiency["matmul"] == pytest.approx(0.7, rel=1e-3) and fitted.samples == 3
    with pytest.raises(TargetError, match="another target"):
        predict_op(get_target("h100_sxm"), op, cal)


def test_malformed_calibration_file(tmp_path):
    p = tmp_path / "c.json"
    p.write_text(json.dumps({"target": "a100_sxm", "default_efficiency": -1}))
    with pytest.raises(TargetError) as e:
        Calibration.load(p)
    assert e.value.where.endswith("default_efficiency") and e.value.value == -1
    p.write_text(json.dumps({"target": "a100_sxm", "op_efficiency": {"matmul": 0}}))
    with pytest.raises(TargetError, match="positive"):
        Calibration.load(p)
    p.write_text("{")
    with pytest.raises(TargetError, match="not valid JSON"):
        Calibration.load(p)


# ----------------------------------------------------------------------------- CLI

def _runner():
    from typer.testing import CliRunner

    import graphmode.cli.targets_cmd  # noqa: F401  (registers the sub-command)
    from graphmode.cli.app import app
    return CliRunner(), app


def test_cli_list_json(host_cache):
    root, _ = host_cache
    runner, app = _runner()
    r = runner.invoke(app, ["targets", "list", "--json", "--cache-dir", str(root)])
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout)
    assert [x["name"] for x in rows] == list_targets()
    h = next(x for x in rows if x["name"] == "host")
    assert h["measured"] and h["peak_f32_flops"] > 0
    r = runner.invoke(app, ["targets", "list", "--cache-dir", str(root)])
    assert r.exit_code == 0 and "h100_sxm" in r.stdout and "host *" in r.stdout


def test_cli_show_host_json_reads_cache(host_cache):
    root, t = host_cache
    runner, app = _runner()
    r = runner.invoke(app, ["targets", "show", "host", "--json"], env={"GRAPHMODE_CACHE_DIR": str(root)})
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["name"] == "host" and d["groups"]["measured"]["source"] == "cache"
    assert d["peak_flops"] == t.peak_flops and d["groups"]["cpu"]["model_name"] == t.groups["cpu"]["model_name"]
    r = runner.invoke(app, ["targets", "show", "h200"])
    assert r.exit_code == 0 and "4800 GB/s" in r.stdout and "high_bandwidth" in r.stdout
    r = runner.invoke(app, ["targets", "show", str(DATA / "custom_chip.yaml"), "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout)["name"] == "my_npu"


def test_cli_unknown_target_exit_code_no_traceback(tmp_path):
    env = dict(os.environ, GRAPHMODE_CACHE_DIR=str(tmp_path))
    r = subprocess.run([sys.executable, "-m", "graphmode", "targets", "show", "a100_sxn"], capture_output=True,
                       text=True, env=env, cwd=REPO, timeout=60)
    assert r.returncode == 2
    assert "TargetError" in r.stderr and "did you mean 'a100_sxm'" in r.stderr
    assert "Traceback" not in r.stderr + r.stdout
    r = subprocess.run([sys.executable, "-m", "graphmode", "targets", "show", "a100_sxn", "--json"],
                       capture_output=True, text=True, env=env, cwd=REPO, timeout=60)
    assert r.returncode == 2 and json.loads(r.stdout)["error"] == "TargetError"
