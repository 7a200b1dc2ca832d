"""The instruction sets generated kernels are written for, what each offers, and the cap.

Kernels carry a code path per ISA behind the compiler's own macros (`ISA_GUARD`), so a
kernel built for a host without that ISA takes the next path instead of failing to build;
`portable` is plain C the compiler vectorises as it can. Which path a library takes is
decided by its compile flags alone: `march` gives the flags for a cap (the recipe's
`codegen.isa`), chosen so that the guards select that ISA's path AND the compiler cannot
auto-vectorise the rest with a wider one. Without a cap that is `-march=native` (the host's
best). Tactics draw candidates for the best ISA of `capped_simd(simd, cap)` (`host_isas`),
within its vector register file (`registers`).
"""
from __future__ import annotations

from functools import lru_cache
from typing import Iterable, Sequence

VL = {"avx512": 16, "avx2": 8, "portable": 8}          # fp32 lanes per vector
ISAS = tuple(VL)
CAPS = ("auto",) + ISAS                                  # the values of a recipe's codegen.isa
REGISTERS = {"avx512": 32, "avx2": 16, "portable": 16}
ISA_GUARD = {"avx512": "defined(__AVX512F__)", "avx2": "defined(__AVX2__) && defined(__FMA__)"}
# the flags (cpuinfo names) above each cap: a capped host is treated as if it lacked them
_ABOVE = {"avx2": ("avx512", "amx"), "portable": ("avx", "fma", "f16c", "amx")}
# flags that compile an ISA's path on any x86-64 host (for building a path this host cannot run)
_CROSS = {"avx512": "-march=x86-64-v4", "avx2": "-march=x86-64-v3", "portable": "-march=x86-64"}


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


def capped_simd(simd: Iterable[str], cap: str | None) -> list[str]:
    """`simd` without the features above `cap` (None/auto: all of them): what the tactics
    see, so that they draw `cap`'s configurations with its register budget (an AVX2 cap
    compiles without AVX-512VL: 16 ymm registers, not 32) and key its timings apart."""
    drop = _ABOVE.get(cap or "auto", ())
    return [f for f in simd if not f.startswith(drop)] if drop else list(simd)


def resolve(cap: str | None, simd: Iterable[str]) -> str:
    """The ISA kernels under `cap` are built for (auto: the host's best)."""
    return host_isas(simd)[0] if cap in (None, "auto") else cap


def cap_problem(cap: str | None, simd: Iterable[str], host: str = "this host") -> tuple[str, str] | None:
    """(why, fix) when a host with flags `simd` cannot run kernels capped at `cap`, else None."""
    if cap in (None, "auto"):
        return None
    runs = host_isas(simd)
    if cap in runs:
        return None
    return (f"{host} cannot run {cap} kernels: it runs {', '.join(runs)}",
            f"codegen.isa: auto (the best it runs) or one of {', '.join(runs)}; a cap can only lower the ISA")


def march(cap: str | None, simd: Iterable[str]) -> tuple[str, ...]:
    """The -march flags for kernels capped at `cap` on a host with flags `simd`.

    The host's best ISA (and auto): `-march=native`. A lower one the host runs: native with
    what lies above turned off (`-mno-avx512f` for AVX2 on an AVX-512 host, which also drops
    every AVX-512 extension and the EVEX registers), or the x86-64 baseline for portable, so
    the compiler cannot vectorise with the wider ISA either. One the host cannot run: the
    x86-64 level that has it, to build (never run) that path here."""
    simd = list(simd)
    runs = host_isas(simd)
    if cap in (None, "auto") or cap == runs[0]:
        return ("-march=native",)
    if cap == "avx2" and cap in runs:
        return ("-march=native", "-mno-avx512f")
    return (_CROSS[cap],)


@lru_cache(maxsize=1)
def host_simd() -> tuple[str, ...]:
    """This machine's SIMD features (/proc/cpuinfo, as the host target names them); empty
    where they cannot be read (then only portable kernels run)."""
    from graphmode.targets.host import parse_cpuinfo, simd_features
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        return ()
    return tuple(simd_features(parse_cpuinfo(text)))


__all__ = ["VL", "ISAS", "CAPS", "REGISTERS", "ISA_GUARD", "host_isas", "registers", "capped_simd", "resolve",
           "cap_problem", "march", "host_simd"]
