"""What a result needs next to it: the machine, the libraries, and resident-memory probes.

Peak RSS: Linux keeps a per-process high-water mark (`VmHWM` in /proc/self/status) that
writing "5" to /proc/self/clear_refs resets to the current RSS. `PeakRss` resets it,
runs a block, and reports `VmHWM - VmRSS(before)`: the extra resident memory the block
needed at its peak, on top of what the process already held. Without clear_refs (not
Linux, or not permitted) the mark cannot be reset and the delta is only a lower bound
(growth above the highest earlier peak); `PeakRss.exact` says which one was measured.
"""
from __future__ import annotations

import datetime as _dt
import os
import platform
from importlib import metadata
from pathlib import Path
from typing import Any

from graphmode.targets.host import load_average, usable_cores

_STATUS = Path("/proc/self/status")
_CLEAR = Path("/proc/self/clear_refs")


def _status_kb(field: str) -> int | None:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def rss_mb() -> float | None:
    kb = _status_kb("VmRSS")
    if kb is None:
        try:
            import resource
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
        except (ImportError, OSError):
            return None
    return kb / 1024.0


def _trim() -> None:
    """Give freed heap back to the OS (glibc), so the next block's growth shows in RSS instead
    of silently reusing memory an earlier engine freed."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _reset_peak() -> bool:
    try:
        _CLEAR.write_text("5")
        return True
    except OSError:
        return False


class PeakRss:
    """`with PeakRss() as p: ...; p.delta_mb` = peak resident MB the block added."""

    def __init__(self) -> None:
        self.exact = False
        self.delta_mb: float | None = None
        self._before: int | None = None

    def __enter__(self) -> "PeakRss":
        _trim()
        self.exact = _reset_peak()
        self._before = _status_kb("VmRSS")
        return self

    def __exit__(self, *exc: Any) -> None:
        peak = _status_kb("VmHWM")
        if peak is not None and self._before is not None:
            self.delta_mb = max(0.0, (peak - self._before) / 1024.0)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


# per graphmode ISA cap, the values that hold the other engines' own kernels to it (set before
# the process starts: torch and oneDNN read them once)
ISA_ENV = {"avx512": {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE"},
           "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
           "portable": {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41"}}


def engine_isas() -> dict[str, str]:
    """The instruction set each library's kernels may use in this process: torch's vector
    kernels (eager, torch.compile) follow ATEN_CPU_CAPABILITY; oneDNN (torch's and OpenVINO's
    convolutions) follows ONEDNN_MAX_CPU_ISA; MLAS (ONNX Runtime; OpenVINO's matmuls) reads
    CPUID itself and has no switch."""
    import torch
    return {"torch": torch.backends.cpu.get_cpu_capability(),
            "onednn": os.environ.get("ONEDNN_MAX_CPU_ISA") or "the host's best",
            "mlas": "the host's best (no switch)"}


def isa_env_missing(cap: str) -> dict[str, str]:
    """The ISA_ENV settings for `cap` this process was not started with (a bench run whose
    graphmode is held to `cap` while the other engines' kernels are not says so)."""
    return {k: v for k, v in ISA_ENV.get(cap, {}).items() if os.environ.get(k, "").lower() != v.lower()}


def machine_meta(threads: int, target: Any = None) -> dict[str, Any]:
    """Date, CPU model, SIMD flags, cores, thread count and library versions."""
    import torch

    import graphmode
    meta: dict[str, Any] = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "cpu_model": _cpu_model(),
        "cores": os.cpu_count(),
        "usable_cores": usable_cores(),
        "threads": threads,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "versions": {"graphmode": graphmode.__version__, "torch": torch.__version__,
                     "onnxruntime": _version("onnxruntime"), "onnx": _version("onnx"),
                     "openvino": _version("openvino"), "transformers": _version("transformers"),
                     "numpy": _version("numpy")},
        "torch_parallel": torch.__config__.parallel_info().splitlines()[:6],
        "engine_isa": engine_isas(),
        "loadavg_end": load_average(),
    }
    if target is not None:
        meta["target"] = {"name": target.name, "arch": target.arch, "simd": list(getattr(target, "simd", []) or []),
                          "vector_width_bits": getattr(target, "vector_width_bits", None),
                          "compute_units": target.compute_units,
                          "peak_f32_gflops": round(target.peak("f32") / 1e9, 1),
                          "memory_bandwidth_gbps": round(target.memory_bandwidth_gbps, 2),
                          "launch_overhead_us": target.launch_overhead_us}
        meta["simd"] = meta["target"]["simd"]
    return meta
