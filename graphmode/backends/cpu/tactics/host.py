"""The machine a tactics context builds and times its candidates for.

Its SIMD features (under the builder's ISA cap), its last-level cache, the kernel builder and
the compiler: what the candidates are drawn from, and what the timing cache keys a
measurement by. The host target is read lazily: only when there is a GEMM to tune.
"""
from __future__ import annotations

from typing import Any, Sequence

from graphmode.backends.cpu.build import KernelBuilder, builder_for
from graphmode.backends.cpu.isa import capped_simd


class TuningHost:
    """`target`: a graphmode Target (default: `host`, read on first use); `simd` / `llc_bytes`:
    overrides of the target's; `builder`: the KernelBuilder (default: the shared one for the
    default kernel folder and `threads`)."""

    def __init__(self, target: Any, simd: Sequence[str] | None, llc_bytes: int | None,
                 builder: KernelBuilder | None, threads: int):
        self._target, self._simd, self._llc = target, simd, llc_bytes
        self._builder = builder
        self.threads = threads

    def _resolve(self) -> None:
        """The host target is read only when there is a GEMM to tune (its first read costs ~1 s)."""
        if self._simd is not None and self._llc is not None:
            return
        if self._target is None:
            from graphmode.targets import get_target
            self._target = get_target("host")
        if self._simd is None:
            self._simd = list(self._target.simd)
        if self._llc is None:
            self._llc = int(self._target.llc_bytes or 32 << 20)

    @property
    def simd(self) -> list[str]:
        """The target's SIMD features under the builder's ISA cap (the candidates' ISA and
        register budget, and part of the timing cache key)."""
        self._resolve()
        return sorted(capped_simd(self._simd, getattr(self._builder, "isa", None)))

    @property
    def llc_bytes(self) -> int:
        self._resolve()
        return int(self._llc)

    @property
    def target_id(self) -> str:
        return _target_identity(self._target, self.simd)

    @property
    def builder(self) -> KernelBuilder:
        if self._builder is None:
            self._builder = builder_for(None, self.threads)
        return self._builder

    def generated_available(self) -> bool:
        try:
            return bool(self.builder.compiler_available())
        except Exception:  # noqa: BLE001 - a broken toolchain only means "ATen only"
            return False

    def compiler_id(self) -> str:
        try:
            b = self.builder
            return f"{b.compiler} {' '.join(b.flags)}" if b.compiler_available() else "none"
        except Exception:  # noqa: BLE001
            return "none"


def _target_identity(target: Any, simd: Sequence[str]) -> str:
    if target is None:
        return "simd:" + ",".join(simd)
    cpu = {}
    try:
        cpu = dict((target.groups or {}).get("cpu", {}))
    except Exception:  # noqa: BLE001
        cpu = {}
    parts = [getattr(target, "name", "?"), getattr(target, "arch", "?"), str(cpu.get("model_name", "")),
             str(cpu.get("family", "")), str(cpu.get("model", "")), str(getattr(target, "compute_units", "")),
             "simd:" + ",".join(simd)]
    return "|".join(parts)


__all__ = ["TuningHost"]
