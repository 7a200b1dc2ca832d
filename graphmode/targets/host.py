"""`host`: the machine graphmode runs on, described as a Target.

Two halves:
- *static facts*, read from /proc and /sys every time (cheap): CPU model, vendor, family,
  flags -> SIMD features and microarchitecture, usable cores, caches, memory, clock. From
  them the theoretical peak per dtype: cores x FMA pipes x (datapath bits / 32) x 2 x clock,
  scaled per dtype by what the ISA offers (bf16 dot products, VNNI, AMX, ...).
- a *probe* (~2-3 s): an fp32 GEMM and a bf16 GEMM (torch) at the configured thread count,
  streaming memory bandwidth (C kernels reading a buffer far larger than the LLC, see
  targets/bandwidth.py), the dispatch cost of a tiny op. It is cached as JSON
  (`<cache root>/targets/host.json`, see graphmode.paths) under a key of CPU model, core count,
  thread count and torch version, and measured again when the key changes, when asked
  (`reprobe=True`), or when the file is unreadable (with a `HostProbeWarning`).

`peak_flops` holds the theoretical peaks; `memory_bandwidth_gbps` the best measured streaming
read (`probe_bandwidth`), `launch_overhead_us` the dispatch cost; `groups.measured` every probe
number, the bandwidth of each streaming variant included.
The parsers take text / a root folder so tests can feed them fixtures.
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import re
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from graphmode.errors import TargetError
from graphmode.paths import cache_layout
from graphmode.targets.bandwidth import measure_bandwidth, measure_fma_peak, stream_buffer_bytes
from graphmode.targets.quota import affinity_cores
from graphmode.targets.schema import Target
from graphmode.targets.units import parse_bytes

SLOW_PROBE = 0.8             # FMA chains under this share of the clock's theoretical peak: a busy host
PROBE_VERSION = 3            # 2: bandwidth from streaming C kernels (was one torch copy); 3: + the FMA peak
CACHE_FILE = "host.json"


def load_average() -> list[float] | None:
    """1/5/15-minute load averages: other work on the machine inflates every timing."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


STARVED = 0.75         # CPU-s per wall-s of timed calls below which the process waited for CPUs
WAITED_LIMIT = 0.25    # run-queue s of the process's threads per wall-s above which it did


def starved(cpu_per_wall: float | None, waited_per_wall: float | None) -> bool:
    """Whether timed calls waited for CPUs other processes had (what the bench's `starved` flag
    and tactic timing judge alike): by the threads' run-queue wait where the kernel says
    (`run_queue_wait_s`: a 2-thread call given one core waits ~1 s per s, though it gets a
    full CPU-second per second), else by the CPU the process got (a compute call that has the
    machine uses at least one full core)."""
    if waited_per_wall is not None:
        return waited_per_wall > WAITED_LIMIT
    return cpu_per_wall is not None and cpu_per_wall < STARVED


def run_queue_wait_s(proc: str | Path = "/proc/self/task") -> float | None:
    """Seconds this process's threads have waited on a run queue, runnable but not running
    (`/proc/<pid>/task/*/schedstat`, second field): what "starved" means, whatever the thread
    count; CPU seconds per wall second cannot tell a thread that waited for a CPU from one that
    had nothing to do. None where the kernel does not expose it."""
    total, seen = 0, False
    try:
        tasks = list(Path(proc).iterdir())
    except OSError:
        return None
    for t in tasks:
        text = _read(t / "schedstat")
        fields = text.split() if text else []
        if len(fields) >= 2 and fields[1].isdigit():
            total += int(fields[1])
            seen = True
    return total / 1e9 if seen else None


def usable_cores() -> int:
    """CPUs this process may run on (its affinity mask; a container may allow fewer than the host
    has; its CPU quota is targets.quota's)."""
    return affinity_cores()


def memory_limit_bytes(cgroup_root: str | Path = "/sys/fs/cgroup") -> int | None:
    """The container's memory limit (cgroup v2 `memory.max`, v1 `memory/memory.limit_in_bytes`),
    None when unlimited or unknown: /proc/meminfo shows the host's memory, not what this
    process may use, and the probe's streaming buffer must fit in the latter."""
    root = Path(cgroup_root)
    for f in (root / "memory.max", root / "memory" / "memory.limit_in_bytes"):
        text = _read(f)
        if text and text.strip().isdigit() and int(text) < 2**60:
            return int(text)
    return None


class HostProbeWarning(UserWarning):
    """The host probe cache was unreadable or unwritable; the probe ran again / was not saved."""


def default_cache_dir() -> Path:
    """Where the probe is kept when no `cache_dir` is given."""
    return cache_layout().targets


# ----------------------------------------------------------------------------- parsers

@dataclass
class CpuInfo:
    """What /proc/cpuinfo says about the first processor (plus the count of processors)."""
    isa: str = "x86_64"                # x86_64 | aarch64 | unknown
    vendor: str = "unknown"            # amd | intel | arm | apple | ... (lower case)
    model_name: str = "unknown CPU"
    family: int | None = None          # x86 cpu family
    model: int | None = None           # x86 model number
    stepping: int | None = None
    implementer: int | None = None     # aarch64 "CPU implementer"
    part: int | None = None            # aarch64 "CPU part"
    mhz: float | None = None           # max "cpu MHz" over processors
    flags: set[str] = field(default_factory=set)
    processors: int = 0


_X86_VENDORS = {"AuthenticAMD": "amd", "GenuineIntel": "intel", "HygonGenuine": "hygon", "CentaurHauls": "centaur"}
_ARM_IMPLEMENTERS = {0x41: "arm", 0x42: "broadcom", 0x43: "cavium", 0x46: "fujitsu", 0x48: "hisilicon",
                     0x4E: "nvidia", 0x51: "qualcomm", 0x61: "apple", 0xC0: "ampere"}
# (implementer, part) -> (core name, FMA/SIMD pipes, SIMD datapath bits)
_ARM_PARTS = {(0x41, 0xD03): ("cortex-a53", 1, 128), (0x41, 0xD08): ("cortex-a72", 2, 128),
              (0x41, 0xD0B): ("cortex-a76", 2, 128), (0x41, 0xD0C): ("neoverse-n1", 2, 128),
              (0x41, 0xD40): ("neoverse-v1", 2, 256), (0x41, 0xD49): ("neoverse-n2", 2, 128),
              (0x41, 0xD4F): ("neoverse-v2", 4, 128), (0x41, 0xD8E): ("neoverse-n3", 2, 128),
              (0x41, 0xD84): ("neoverse-v3", 4, 128), (0xC0, 0xAC3): ("ampere-one", 2, 128),
              (0x48, 0xD01): ("tsv110", 2, 128)}


def _int(s: str) -> int | None:
    try:
        return int(s, 0)
    except ValueError:
        return None


def parse_cpuinfo(text: str) -> CpuInfo:
    """Parse /proc/cpuinfo text (x86 or aarch64)."""
    info = CpuInfo()
    blocks = [b for b in re.split(r"\n\s*\n", text) if "processor" in b.lower()]
    if not blocks:
        blocks = [text]
    first: dict[str, str] = {}
    mhz: list[float] = []
    global_kv: dict[str, str] = {}
    for i, block in enumerate(blocks):
        kv = {}
        for line in block.splitlines():
            if ":" not in line:
                continue
            k, v = line.split(":", 1)
            kv[k.strip().lower()] = v.strip()
        if i == 0:
            first = kv
        if "cpu mhz" in kv:
            try:
                mhz.append(float(kv["cpu mhz"]))
            except ValueError:
                pass
    for block in re.split(r"\n\s*\n", text):  # aarch64 puts "Hardware"/"model name" in trailing blocks sometimes
        for line in block.splitlines():
            if ":" in line:
                k, v = line.split(":", 1)
                global_kv.setdefault(k.strip().lower(), v.strip())
    info.processors = sum(1 for b in blocks if re.search(r"^processor\s*:", b, re.M | re.I))
    if "flags" in first:                                   # x86
        info.isa = "x86_64"
        info.flags = set(first["flags"].split())
        info.vendor = _X86_VENDORS.get(first.get("vendor_id", ""), first.get("vendor_id", "unknown").lower())
        info.family = _int(first.get("cpu family", ""))
        info.model = _int(first.get("model", ""))
        info.stepping = _int(first.get("stepping", ""))
        info.model_name = first.get("model name", info.model_name)
    elif "features" in first or "cpu implementer" in first:  # aarch64
        info.isa = "aarch64"
        info.flags = set(first.get("features", "").split())
        info.implementer = _int(first.get("cpu implementer", ""))
        info.part = _int(first.get("cpu part", ""))
        info.vendor = _ARM_IMPLEMENTERS.get(info.implementer or -1, "arm")
        name = first.get("model name") or global_kv.get("model name")
        core = _ARM_PARTS.get((info.implementer or -1, info.part or -1))
        if name and not name.lower().startswith("armv8 processor"):
            info.model_name = name
        elif core:
            info.model_name = f"{info.vendor.upper() if info.vendor == 'arm' else info.vendor.capitalize()} {core[0]}"
        else:
            info.model_name = f"aarch64 implementer {info.implementer:#x} part {info.part:#x}" \
                if info.implementer is not None and info.part is not None else (name or "aarch64 CPU")
    else:
        info.isa = "unknown"
        info.model_name = first.get("model name", info.model_name)
    info.mhz = max(mhz) if mhz else None
    return info


def parse_meminfo(text: str) -> int | None:
    """MemTotal from /proc/meminfo text -> bytes."""
    m = re.search(r"^MemTotal:\s*(\d+)\s*kB", text, re.M)
    return int(m.group(1)) * 1024 if m else None


def parse_cpu_list(s: str) -> set[int]:
    """'0-3,8,10-11' -> {0,1,2,3,8,10,11}."""
    out: set[int] = set()
    for part in s.strip().split(","):
        if not part:
            continue
        if "-" in part:
            a, b = part.split("-")
            out.update(range(int(a), int(b) + 1))
        else:
            out.add(int(part))
    return out


@dataclass
class CacheLevel:
    level: int
    type: str          # Data | Instruction | Unified
    size_bytes: int    # one instance
    instances: int     # distinct instances among the cpus looked at
    shared_by: int     # cpus sharing one instance


def parse_caches(sys_cpu_root: str | Path, cpus: set[int] | None = None) -> list[CacheLevel]:
    """Caches from <root>/cpu<N>/cache/index*/{level,type,size,shared_cpu_list}.

    `cpus`: the processors to count instances over (default: every cpu<N> folder)."""
    root = Path(sys_cpu_root)
    dirs = sorted((p for p in root.glob("cpu[0-9]*") if p.name[3:].isdigit()), key=lambda p: int(p.name[3:]))
    if cpus is not None:
        dirs = [d for d in dirs if int(d.name[3:]) in cpus] or dirs[:1]
    seen: dict[tuple[int, str], dict[str, Any]] = {}
    for d in dirs:
        for idx in sorted(d.glob("cache/index[0-9]*")):
            try:
                level = int((idx / "level").read_text().strip())
                ctype = (idx / "type").read_text().strip()
                size = parse_bytes((idx / "size").read_text())   # "32K": binary, as sysfs writes it
            except (OSError, ValueError):
                continue
            try:
                shared = frozenset(parse_cpu_list((idx / "shared_cpu_list").read_text()))
            except (OSError, ValueError):
                shared = frozenset({int(d.name[3:])})
            e = seen.setdefault((level, ctype), {"size": size, "instances": set()})
            e["instances"].add(shared)
    return [CacheLevel(level=lv, type=ct, size_bytes=e["size"], instances=len(e["instances"]),
                       shared_by=max(len(s) for s in e["instances"]))
            for (lv, ct), e in sorted(seen.items())]


# ----------------------------------------------------------------------------- ISA model

# Normalised SIMD feature names, in the order they are reported.
_X86_FEATURES = ["sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512dq", "avx512cd", "avx512bw", "avx512vl",
                 "avx512_vnni", "avx512_bf16", "avx512_fp16", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8",
                 "amx_fp16"]
_ARM_FEATURES = {"asimd": "neon", "fphp": "fp16", "asimdhp": "neon_fp16", "asimddp": "dotprod", "sve": "sve",
                 "sve2": "sve2", "bf16": "bf16", "i8mm": "i8mm", "sme": "sme"}


def simd_features(cpu: CpuInfo) -> list[str]:
    """SIMD / matrix ISA extensions from the flags, normalised (x86: cpuinfo names; arm: neon, sve...)."""
    if cpu.isa == "aarch64":
        return [v for k, v in _ARM_FEATURES.items() if k in cpu.flags]
    return [f for f in _X86_FEATURES if f in cpu.flags]


def vector_width_bits(cpu: CpuInfo, sve_bytes: int | None = None) -> int:
    """Widest architectural SIMD register: 512 with avx512f, 256 with avx2/avx, else 128; SVE as set."""
    if cpu.isa == "aarch64":
        return max(128, (sve_bytes or 16) * 8) if "sve" in cpu.flags else 128
    if "avx512f" in cpu.flags:
        return 512
    if "avx2" in cpu.flags or "avx" in cpu.flags:
        return 256
    return 128


def vector_registers(cpu: CpuInfo) -> int:
    """Architectural vector registers: 32 with AVX-512 or on aarch64, else 16."""
    return 32 if (cpu.isa == "aarch64" or "avx512f" in cpu.flags) else 16


@dataclass
class MicroArch:
    arch: str            # zen4, x86-64-v3, neoverse-n1, ...
    fma_units: int       # FMA pipes per core
    datapath_bits: int   # width of one pipe (Zen 4 runs 512-bit ops on 256-bit pipes)
    note: str = ""


def microarch(cpu: CpuInfo, sve_bytes: int | None = None) -> MicroArch:
    """Best-effort microarchitecture and FMA throughput from vendor/family/model/flags."""
    f = cpu.flags
    if cpu.isa == "aarch64":
        core = _ARM_PARTS.get((cpu.implementer or -1, cpu.part or -1))
        if core:
            return MicroArch(core[0], core[1], core[2])
        width = max(128, (sve_bytes or 16) * 8) if "sve" in f else 128
        return MicroArch("armv8-a", 2, width, "unknown core: assumed 2 SIMD FMA pipes")
    if cpu.vendor in ("amd", "hygon") and cpu.family is not None:
        fam, mod = cpu.family, cpu.model or 0
        if fam == 0x17:
            return MicroArch("zen2", 2, 256) if mod >= 0x30 else MicroArch("zen", 2, 128)
        if fam == 0x19:
            if 0x10 <= mod <= 0x1F or 0x60 <= mod <= 0x7F or 0xA0 <= mod <= 0xAF:
                return MicroArch("zen4", 2, 256, "AVX-512 executes on 256-bit pipes")
            return MicroArch("zen3", 2, 256)
        if fam == 0x1A:
            return MicroArch("zen5", 2, 512)
    level = _x86_level(f)
    if cpu.vendor == "intel":
        if "amx_tile" in f:
            return MicroArch("sapphirerapids", 2, 512)
        if "avx512f" in f:
            server = "xeon" in cpu.model_name.lower() and not re.search(r"bronze|silver|gold 5\d", cpu.model_name, re.I)
            return MicroArch(level, 2 if server else 1, 512,
                             "" if server else "assumed one 512-bit FMA pipe (client / low-bin Xeon)")
    if "avx512f" in f:
        return MicroArch(level, 2, 512)
    if "fma" in f and "avx2" in f:
        return MicroArch(level, 2, 256)
    if "avx" in f:
        return MicroArch(level, 1, 256, "no FMA: counted as one 256-bit multiply-add pipe")
    return MicroArch(level, 1, 128)


def _x86_level(f: set[str]) -> str:
    if {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"} <= f:
        return "x86-64-v4"
    if {"avx2", "fma", "bmi2"} <= f or {"avx2", "fma"} <= f:
        return "x86-64-v3"
    if "sse4_2" in f:
        return "x86-64-v2"
    return "x86-64"


def flops_per_cycle_per_core(cpu: CpuInfo, ua: MicroArch) -> dict[str, float]:
    """FLOP (or int OP) per cycle per core for each dtype the ISA computes natively."""
    f = cpu.flags
    f32 = ua.fma_units * (ua.datapath_bits / 32) * 2
    out = {"f64": f32 / 2, "f32": f32}
    if cpu.isa == "aarch64":
        if "fphp" in f or "asimdhp" in f:
            out["f16"] = f32 * 2
        if "bf16" in f:
            out["bf16"] = f32 * 2
        if "asimddp" in f or "i8mm" in f:
            out["i8"] = f32 * (8 if "i8mm" in f else 4)
        return out
    if "amx_bf16" in f:
        out["bf16"] = 1024.0                       # AMX TMUL: 512 bf16 MAC/cycle/core
    elif "avx512_bf16" in f:
        out["bf16"] = f32 * 2                      # vdpbf16ps: 2 MACs per 32-bit lane
    if "amx_fp16" in f:
        out["f16"] = 1024.0
    elif "avx512_fp16" in f:
        out["f16"] = f32 * 2
    if "amx_int8" in f:
        out["i8"] = 2048.0                         # AMX TMUL: 1024 int8 MAC/cycle/core
    elif "avx512_vnni" in f or "avx_vnni" in f:
        out["i8"] = f32 * 4                        # vpdpbusd: 4 MACs per 32-bit lane
    elif "avx2" in f:
        out["i8"] = f32 * 2                        # vpmaddubsw + vpmaddwd
    return out


def clock_mhz(cpu: CpuInfo, sys_cpu_root: str | Path = "/sys/devices/system/cpu") -> tuple[float | None, str]:
    """(MHz, source) for the theoretical peak: cpufreq base_frequency, the '@ x.xxGHz' in the
    model name, cpuinfo 'cpu MHz', cpufreq cpuinfo_max_freq, in that order."""
    root = Path(sys_cpu_root) / "cpu0" / "cpufreq"
    try:
        return int((root / "base_frequency").read_text()) / 1000, "cpufreq base_frequency"
    except (OSError, ValueError):
        pass
    m = re.search(r"@\s*(\d+(?:\.\d+)?)\s*GHz", cpu.model_name, re.I)
    if m:
        return float(m.group(1)) * 1000, "model name"
    if cpu.mhz:
        return cpu.mhz, "/proc/cpuinfo cpu MHz"
    try:
        return int((root / "cpuinfo_max_freq").read_text()) / 1000, "cpufreq cpuinfo_max_freq"
    except (OSError, ValueError):
        return None, "unknown"


# ----------------------------------------------------------------------------- static facts

@dataclass
class HostFacts:
    """Everything about the host that does not need a measurement."""
    cpu: CpuInfo
    cores: int                      # usable logical CPUs (affinity)
    threads: int                    # torch intra-op threads the probe uses
    caches: list[CacheLevel]
    memory_bytes: int
    clock_mhz: float | None
    clock_source: str
    sve_bytes: int | None = None

    def cache_key(self, torch_version: str) -> dict[str, Any]:
        return {"cpu_model": self.cpu.model_name, "cores": self.cores, "threads": self.threads,
                "torch": torch_version, "probe_version": PROBE_VERSION}


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None


def detect_host_facts(*, proc_root: str | Path = "/proc", sys_cpu_root: str | Path = "/sys/devices/system/cpu",
                      cores: int | None = None, threads: int | None = None) -> HostFacts:
    """Read the static facts. Roots are arguments so tests can point them at fixtures."""
    proc = Path(proc_root)
    cpu = parse_cpuinfo(_read(proc / "cpuinfo") or "")
    if cores is None:
        try:
            cores = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            cores = os.cpu_count() or cpu.processors or 1
    if threads is None:
        import torch
        threads = torch.get_num_threads()
    try:
        affinity = os.sched_getaffinity(0)
    except (AttributeError, OSError):
        affinity = None
    caches = parse_caches(sys_cpu_root, affinity)
    mem = parse_meminfo(_read(proc / "meminfo") or "")
    if not mem:
        try:
            mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            mem = 0
    if not mem:
        raise TargetError("cannot read the host's memory size", where="host: memory_bytes",
                          fix="check that /proc/meminfo is readable, or describe the host in a target file")
    sve = _read(proc / "sys" / "abi" / "sve_default_vector_length")
    mhz, src = clock_mhz(cpu, sys_cpu_root)
    return HostFacts(cpu=cpu, cores=max(1, cores), threads=max(1, threads), caches=caches, memory_bytes=mem,
                     clock_mhz=mhz, clock_source=src, sve_bytes=int(sve) if sve and sve.strip().isdigit() else None)


def _cache_fallback(caches: list[CacheLevel]) -> tuple[int, int, int]:
    """(l1d per core, l2 per core, llc total) from parsed caches, with common defaults."""
    by = {(c.level, c.type): c for c in caches}
    l1 = by.get((1, "Data")) or by.get((1, "Unified"))
    l2 = by.get((2, "Unified")) or by.get((2, "Data"))
    top = max((c for c in caches if c.type in ("Unified", "Data")), key=lambda c: c.level, default=None)
    l1b = l1.size_bytes if l1 else 32 * 1024
    l2b = l2.size_bytes if l2 else 512 * 1024
    llc = top.size_bytes * top.instances if top else l2b
    return l1b, l2b, llc


def theoretical_peaks(facts: HostFacts) -> dict[str, float]:
    """FLOP/s per dtype: cores x flops/cycle/core x clock. Empty when the clock is unknown."""
    if not facts.clock_mhz:
        return {}
    ua = microarch(facts.cpu, facts.sve_bytes)
    return {dt: facts.cores * fpc * facts.clock_mhz * 1e6 for dt, fpc in flops_per_cycle_per_core(facts.cpu, ua).items()}


# ----------------------------------------------------------------------------- probe

def _stream_buffer(facts: HostFacts) -> int:
    """The bandwidth probe's buffer for this host: from its LLC, within its (container's) memory."""
    memory = min(facts.memory_bytes, memory_limit_bytes() or facts.memory_bytes)
    return stream_buffer_bytes(_cache_fallback(facts.caches)[2], memory)


def run_probe(threads: int | None = None, *, gemm_n: int = 1536, copy_mib: float | None = None,
              budget_s: float = 2.5) -> dict[str, Any]:
    """Measure achieved GEMM FLOP/s (fp32, bf16), streaming memory bandwidth and tiny-op
    dispatch time.

    Best-of-N timings, each part with its own slice of `budget_s`. Runs at `threads` torch
    threads (default: the current setting; the bandwidth kernels use as many) and restores the
    setting afterwards. `copy_mib`: the streaming buffer (read and copy variants), default
    `stream_buffer_bytes` of this host's LLC and memory."""
    import torch

    t_start = time.perf_counter()
    old = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    if copy_mib is None:
        copy_mib = _stream_buffer(detect_host_facts(threads=torch.get_num_threads())) / 2**20
    out: dict[str, Any] = {"threads": torch.get_num_threads(), "gemm_n": gemm_n}
    try:  # a busy machine measures low; keep the load next to the numbers
        out["loadavg_1m"] = round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        pass

    def best(fn: Callable[[], None], reps: int, slot_s: float) -> float:
        fn()  # warm-up
        times: list[float] = []
        deadline = time.perf_counter() + slot_s
        for _ in range(reps):
            s = time.perf_counter()
            fn()
            times.append(time.perf_counter() - s)
            if time.perf_counter() > deadline:
                break
        return min(times)

    try:
        with torch.inference_mode():
            g = torch.Generator().manual_seed(0)
            a = torch.randn(gemm_n, gemm_n, generator=g)
            b = torch.randn(gemm_n, gemm_n, generator=g)
            c = torch.empty(gemm_n, gemm_n)
            t = best(lambda: torch.mm(a, b, out=c), 8, budget_s * 0.4)
            out["gemm_f32_gflops"] = round(2 * gemm_n**3 / t / 1e9, 2)
            ab, bb = a.bfloat16(), b.bfloat16()
            cb = torch.empty(gemm_n, gemm_n, dtype=torch.bfloat16)
            s = time.perf_counter()
            torch.mm(ab, bb, out=cb)
            if time.perf_counter() - s < budget_s * 0.15:   # skip bf16 where it is emulated and slow
                t = best(lambda: torch.mm(ab, bb, out=cb), 6, budget_s * 0.2)
                out["gemm_bf16_gflops"] = round(2 * gemm_n**3 / t / 1e9, 2)
            del a, b, c, ab, bb, cb
            out.update(measure_bandwidth(out["threads"], int(copy_mib * 2**20), budget_s * 0.25))
            out.update(measure_fma_peak(out["threads"], budget_s * 0.1))
            x, y, z = torch.ones(8), torch.ones(8), torch.empty(8)
            for _ in range(200):
                torch.add(x, y, out=z)
            reps = 2000
            samples = []
            for _ in range(3):
                s = time.perf_counter()
                for _ in range(reps):
                    torch.add(x, y, out=z)
                samples.append((time.perf_counter() - s) / reps)
            out["dispatch_us"] = round(min(samples) * 1e6, 3)
    finally:
        torch.set_num_threads(old)
    out["probe_seconds"] = round(time.perf_counter() - t_start, 3)
    out["probed_at"] = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    return out


_PROBE_FIELDS = {"gemm_f32_gflops": float, "copy_gbps": float, "dispatch_us": float, "probe_seconds": float}


def _positive(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0


def _valid_probe(p: Any) -> bool:
    """The required numbers are positive; `read_gbps`, when there, too (a probe written by hand
    or by a test may leave it out: `probe_bandwidth` then uses the copy)."""
    return (isinstance(p, dict) and all(_positive(p.get(k)) for k in _PROBE_FIELDS)
            and ("read_gbps" not in p or _positive(p["read_gbps"])))


def probe_bandwidth(probe: dict[str, Any]) -> tuple[float, str]:
    """(GB/s, what it is) for the roofline: the best streaming read of the probe; the copy for a
    probe that has no read numbers."""
    if _positive(probe.get("read_gbps")):
        return float(probe["read_gbps"]), f"best streaming read ({probe.get('read_variant', 'read')})"
    return float(probe["copy_gbps"]), "copy (the probe has no read numbers)"


def load_probe_cache(path: Path, key: dict[str, Any]) -> tuple[dict[str, Any] | None, str]:
    """(probe, why): the cached probe when the file exists, parses and its key matches."""
    if not path.exists():
        return None, "no cache file"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        warnings.warn(f"host probe cache {path} is corrupt ({e}); probing again", HostProbeWarning, stacklevel=3)
        return None, "corrupt"
    if not isinstance(data, dict) or not isinstance(data.get("key"), dict) or not _valid_probe(data.get("probe")):
        warnings.warn(f"host probe cache {path} is corrupt (missing or malformed key/probe); probing again",
                      HostProbeWarning, stacklevel=3)
        return None, "corrupt"
    if data["key"] != key:
        changed = sorted(k for k in set(key) | set(data["key"]) if key.get(k) != data["key"].get(k))
        return None, "key changed: " + ", ".join(changed)
    return data["probe"], "hit"


def save_probe_cache(path: Path, key: dict[str, Any], probe: dict[str, Any]) -> bool:
    """Write atomically; a failure warns and returns False (the probe result is still used)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"key": key, "probe": probe}, indent=2, sort_keys=True), encoding="utf-8")
        os.replace(tmp, path)
        return True
    except OSError as e:
        warnings.warn(f"cannot write host probe cache {path}: {e}", HostProbeWarning, stacklevel=3)
        return False


# ----------------------------------------------------------------------------- Target

# Links between processes of this host (tensor-parallel ranks), nominal: gloo over loopback TCP
# all-reduced ~1 GB/s at ~100-250 us a message on a 2-core VM (2026-12-03, loaded);
# `graphmode bench --tensor-parallel` measures them against these numbers.
HOST_LINKS = {
    "loopback": {"kind": "TCP over the loopback interface (gloo)", "bandwidth_gbps": 1.0, "latency_us": 100.0,
                 "source": "nominal"},
    "shared_memory": {"kind": "shared memory between processes", "bandwidth_gbps": 4.0, "latency_us": 10.0,
                      "source": "nominal"},
}

def build_host_target(facts: HostFacts, probe: dict[str, Any], *, source: str = "probe",
                      cache_file: str | None = None) -> Target:
    """The `host` Target from static facts and probe numbers."""
    cpu = facts.cpu
    ua = microarch(cpu, facts.sve_bytes)
    peaks = theoretical_peaks(facts)
    if not peaks:  # unknown clock: fall back to the measured GEMM rate, scaled per dtype by the ISA
        fpc = flops_per_cycle_per_core(cpu, ua)
        f32 = probe["gemm_f32_gflops"] * 1e9
        peaks = {dt: f32 * v / fpc["f32"] for dt, v in fpc.items()}
    clock_note = probe_note = ""
    # what the cores did: the GEMM, and the FMA chains where the probe has them (its C kernel)
    fma = probe.get("fma_f32_gflops") if _positive(probe.get("fma_f32_gflops")) else 0.0
    if facts.clock_mhz and fma and fma * 1e9 < SLOW_PROBE * peaks["f32"]:
        probe_note = (f"the FMA chains reached {fma:.4g} GFLOP/s, {fma * 1e9 / peaks['f32']:.2f}x what "
                      f"{facts.cores} core(s) at the reported {facts.clock_mhz:.0f} MHz allow: the cores were "
                      "shared or throttled while the probe ran, so its peak and bandwidth are low; re-probe "
                      "with `graphmode targets show host --reprobe`")
    achieved, what = max((probe["gemm_f32_gflops"] * 1e9, "GEMM"), (fma * 1e9, "FMA throughput"))
    if facts.clock_mhz and achieved > peaks["f32"]:
        # The cores beat the "peak": the reported clock is below the one they ran at (turbo, or
        # a VM reporting the nominal TSC clock). A peak is an upper bound, so raise it.
        scale = achieved / peaks["f32"]
        peaks = {dt: v * scale for dt, v in peaks.items()}
        clock_note = (f"measured fp32 {what} exceeded the peak at {facts.clock_mhz:.0f} MHz; peaks use the "
                      f"implied clock {facts.clock_mhz * scale:.0f} MHz")
    l1, l2, llc = _cache_fallback(facts.caches)
    bw, bw_source = probe_bandwidth(probe)
    dtypes = [dt for dt in ("f64", "f32", "f16", "bf16", "i8") if dt in peaks]
    simd = simd_features(cpu)
    measured = {k: v for k, v in probe.items()}
    measured["source"] = source
    measured["bandwidth_source"] = bw_source
    if cache_file:
        measured["cache_file"] = cache_file
    if peaks.get("f32"):
        measured["gemm_f32_efficiency"] = round(probe["gemm_f32_gflops"] * 1e9 / peaks["f32"], 3)
    if peaks.get("bf16") and probe.get("gemm_bf16_gflops"):
        measured["gemm_bf16_efficiency"] = round(probe["gemm_bf16_gflops"] * 1e9 / peaks["bf16"], 3)
    amx_of = {"bf16": "amx_bf16", "f16": "amx_fp16", "i8": "amx_int8"}
    vector_dtypes = [dt for dt in dtypes if amx_of.get(dt) not in cpu.flags]
    compute: dict[str, dict[str, Any]] = {
        "vector": {"aliases": ["simd", "fma"] + ([] if "amx_tile" in cpu.flags else ["matrix"]),
                   "units": facts.cores, "width_bits": vector_width_bits(cpu, facts.sve_bytes),
                   "datapath_bits": ua.datapath_bits, "fma_units": ua.fma_units, "dtypes": vector_dtypes,
                   "peak_flops": {dt: peaks[dt] for dt in vector_dtypes}},
    }
    if "amx_tile" in cpu.flags:
        amx = [dt for dt in dtypes if dt not in vector_dtypes]
        compute["matrix"] = {"aliases": ["amx", "tensor_core"], "units": facts.cores, "dtypes": amx,
                             "peak_flops": {dt: peaks[dt] for dt in amx}}
    groups: dict[str, dict[str, Any]] = {
        "memory_banks": {
            "system_dram": {"aliases": ["high_bandwidth", "host_pinned", "device_local", "host", "dram"],
                            "kind": "system DRAM", "ids": [0], "bytes": facts.memory_bytes, "bandwidth_gbps": bw,
                            "measured": True},
            "on_chip": {"aliases": ["llc", "l3"], "kind": f"L{max((c.level for c in facts.caches), default=2)} cache",
                        "llc_bytes": llc},
        },
        "compute_classes": compute,
        "interconnects": HOST_LINKS,
        "caches": {f"l{c.level}{'' if c.type == 'Unified' else c.type[0].lower()}":
                   {"bytes": c.size_bytes, "instances": c.instances, "shared_by": c.shared_by}
                   for c in facts.caches} or {"unknown": {"note": "no cache information in sysfs"}},
        "cpu": {"model_name": cpu.model_name, "vendor": cpu.vendor, "isa": cpu.isa, "family": cpu.family,
                "model": cpu.model, "stepping": cpu.stepping, "implementer": cpu.implementer, "part": cpu.part,
                "clock_mhz": facts.clock_mhz, "clock_source": facts.clock_source, "cores": facts.cores,
                "threads": facts.threads, "microarch_note": ua.note, "clock_note": clock_note,
                "probe_note": probe_note,
                "effective_clock_mhz": round(peaks["f32"] / (facts.cores * flops_per_cycle_per_core(cpu, ua)["f32"] * 1e6), 1),
                "flops_per_cycle_per_core": flops_per_cycle_per_core(cpu, ua)},
        "measured": measured,
    }
    return Target(
        name="host",
        description=f"{cpu.model_name}, {facts.cores} core(s), detected on this machine",
        kind="cpu", vendor=cpu.vendor, arch=ua.arch, compute_units=facts.cores,
        vector_width_bits=vector_width_bits(cpu, facts.sve_bytes), simd=simd,
        registers_per_core=vector_registers(cpu), l1_bytes=l1, l2_bytes=l2, llc_bytes=llc,
        memory_bytes=facts.memory_bytes, memory_bandwidth_gbps=bw, peak_flops=peaks, dtypes=dtypes,
        interconnect=None, launch_overhead_us=float(probe["dispatch_us"]), groups=groups, measured=True)


def probe_note(target: Any) -> str:
    """The host probe's doubt about its own numbers (FMA chains under SLOW_PROBE of what the
    reported clock allows), or "" for a probe without one and for any other target."""
    return ((getattr(target, "groups", None) or {}).get("cpu") or {}).get("probe_note") or ""


def detect_host(*, cache_dir: str | Path | None = None, reprobe: bool = False, facts: HostFacts | None = None,
                probe_fn: Callable[[int], dict[str, Any]] | None = None) -> Target:
    """The `host` Target: static facts now, probe numbers from the cache or a fresh probe.

    `facts` / `probe_fn(threads)` are injectable for tests."""
    import torch

    facts = facts or detect_host_facts()
    probe_fn = probe_fn or (lambda threads: run_probe(threads, copy_mib=_stream_buffer(facts) / 2**20))
    path = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    path = path / CACHE_FILE
    key = facts.cache_key(torch.__version__)
    probe, why = (None, "reprobe requested") if reprobe else load_probe_cache(path, key)
    source = "cache"
    if probe is None:
        probe = probe_fn(facts.threads)
        if not _valid_probe(probe):
            raise TargetError("the host probe returned unusable numbers", where="host: probe", value=probe,
                              fix="run `graphmode targets show host --reprobe` on an idle machine")
        probe = dict(probe, reprobe_reason=why)
        save_probe_cache(path, key, probe)
        source = "probe"
    return build_host_target(facts, probe, source=source, cache_file=str(path))


__all__ = ["CpuInfo", "CacheLevel", "HostFacts", "HostProbeWarning", "MicroArch", "build_host_target",
           "clock_mhz", "detect_host", "detect_host_facts", "flops_per_cycle_per_core", "load_probe_cache",
           "memory_limit_bytes", "microarch", "parse_caches", "parse_cpu_list", "parse_cpuinfo", "parse_meminfo",
           "probe_bandwidth", "probe_note", "run_probe", "save_probe_cache", "simd_features", "theoretical_peaks",
           "vector_registers", "vector_width_bits"]
