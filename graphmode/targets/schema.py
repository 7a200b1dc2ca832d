"""The hardware description a target file declares. Cost models and the recipe read only this."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

DTypeName = Literal["f64", "f32", "tf32", "f16", "bf16", "fp8_e4m3", "fp8_e5m2", "i64", "i32", "i8", "u8", "bool"]


class Target(BaseModel):
    """One chip (or `host`). Numbers are per device; FLOP/s and bytes/s are peaks."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    description: str = ""
    kind: Literal["cpu", "gpu", "npu"]
    vendor: str
    arch: str                                   # e.g. "sm_90", "gfx90a", "zen3", "ascend910b"
    compute_units: int = Field(gt=0)            # SMs / CUs / AI cores / CPU cores
    vector_width_bits: int = Field(gt=0)        # SIMD width (CPU) or warp/wavefront lanes * 32 (GPU)
    simd: list[str] = []                        # CPU ISA features: avx2, fma, avx512f, amx_tile, neon...
    registers_per_core: int = 16                # architectural vector registers (CPU GEMM tiling)
    l1_bytes: int = Field(ge=0)                 # per core / SM
    l2_bytes: int = Field(ge=0)                 # per core (CPU) or total (GPU)
    llc_bytes: int = Field(ge=0)                # last-level cache, total
    memory_bytes: int = Field(gt=0)
    memory_bandwidth_gbps: float = Field(gt=0)  # GB/s
    peak_flops: dict[str, float]                # dtype -> FLOP/s (dense)
    dtypes: list[str]                           # dtypes the target computes in natively
    interconnect: str | None = None
    launch_overhead_us: float = Field(default=5.0, ge=0)  # per kernel / per instruction
    groups: dict[str, dict[str, Any]] = {}      # named symbolic groups, e.g. memory_banks.high_bandwidth
    measured: bool = False                      # True when numbers came from a probe on this machine

    def supports_dtype(self, dtype: str) -> bool:
        return dtype in self.dtypes

    def peak(self, dtype: str) -> float:
        return self.peak_flops.get(dtype) or self.peak_flops.get("f32", 0.0)
