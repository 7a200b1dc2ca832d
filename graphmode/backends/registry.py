"""The backends, by name: the runtime asks for a device's backend here and nowhere else.

Built in: `cpu` (generated C++ kernels and ATen; the default), `reference` (the reference
ops, one instruction at a time: the numeric oracle) and `null` (plans and generates kernel
sources, runs nothing: planning and codegen testable without hardware or a compiler). They
are imported on first use; `register` adds another (a CUDA backend, a test's own).
"""
from __future__ import annotations

from graphmode.backends.base import Backend
from graphmode.errors import BackendError

DEFAULT_DEVICE = "cpu"

_BACKENDS: dict[str, Backend] = {}


def _builtins() -> None:
    if _BACKENDS:
        return
    from graphmode.backends.cpu.backend import CpuBackend
    from graphmode.backends.null import NullBackend
    from graphmode.backends.reference import ReferenceBackend
    for b in (CpuBackend(), ReferenceBackend(), NullBackend()):
        _BACKENDS.setdefault(b.name, b)


def register(backend: Backend) -> None:
    """Make `backend` the one `get_backend(backend.name)` returns."""
    _builtins()
    _BACKENDS[backend.name] = backend


def get_backend(name: str) -> Backend:
    """The backend registered as `name`, or a BackendError listing the ones there are."""
    _builtins()
    b = _BACKENDS.get(name)
    if b is None:
        raise BackendError(f"no backend {name!r}", where="backend", value=name,
                           fix=f"one of {', '.join(sorted(_BACKENDS))}")
    return b


def backends() -> dict[str, Backend]:
    """Every registered backend by name."""
    _builtins()
    return dict(_BACKENDS)


__all__ = ["DEFAULT_DEVICE", "get_backend", "register", "backends"]
