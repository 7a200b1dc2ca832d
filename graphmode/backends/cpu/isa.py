"""The instruction sets generated kernels are written for, and what each offers.

Kernels carry a code path per ISA behind the compiler's own macros (`ISA_GUARD`), so a
kernel built for a host without that ISA takes the next path instead of failing to build;
`portable` is plain C the compiler vectorises as it can. Tactics draw candidates for the
host's best ISA (`host_isas`), within its vector register file (`registers`).
"""
from __future__ import annotations

from typing import Iterable, Sequence

VL = {"avx512": 16, "avx2": 8, "portable": 8}          # fp32 lanes per vector
ISAS = tuple(VL)
REGISTERS = {"avx512": 32, "avx2": 16, "portable": 16}
ISA_GUARD = {"avx512": "defined(__AVX512F__)", "avx2": "defined(__AVX2__) && defined(__FMA__)"}


def host_isas(simd: Iterable[str]) -> list[str]:
    """The generated-kernel ISAs this host runs, best first (always ends with portable)."""
    s = set(simd)
    out = []
    if "avx512f" in s:
        out.append("avx512")
    if "avx2" in s and "fma" in s:
        out.append("avx2")
    out.append("portable")
    return out


def registers(isa: str, simd: Sequence[str]) -> int:
    """Vector registers an `isa` kernel may use on a host with flags `simd` (portable code
    has no budget: the compiler allocates)."""
    if isa == "avx2" and "avx512vl" in simd:   # AVX2 code on an AVX-512 host may use all 32 (EVEX)
        return 32
    return {"avx512": 32, "avx2": 16}.get(isa, 1 << 30)


__all__ = ["VL", "ISAS", "REGISTERS", "ISA_GUARD", "host_isas", "registers"]
