"""Loaded kernels: a shared library per plan (ctypes), one callable per generated kernel.

Kernels take raw addresses (arena offsets resolved by the executor), so calling one costs a
ctypes call and nothing else; ctypes releases the GIL for the call. `bind` pre-packs the
addresses of a plan step whose buffers never move, which halves that cost again.
"""
from __future__ import annotations

import ctypes
import functools
import os
import weakref
from pathlib import Path
from typing import Callable, Mapping, Sequence

import torch

from graphmode.backends.cpu.abi import KernelSource
from graphmode.errors import BackendError
from graphmode.ir.types import DTYPES
from graphmode.openmp import forked_after_run, on_forked_after_run, ran_parallel

_LIBRARIES: "weakref.WeakSet[CompiledLibrary]" = weakref.WeakSet()    # every loaded library, for a fork child


def _one_thread_each() -> None:
    for lib in list(_LIBRARIES):
        lib.set_threads(1)


on_forked_after_run(_one_thread_each)


class CompiledLibrary:
    """One dlopen'ed shared library; owns the OpenMP thread count of its kernels."""

    def __init__(self, path: Path, *, threads: int | None = None):
        self.path = Path(path)
        self.cdll = ctypes.CDLL(str(self.path), mode=os.RTLD_NOW | os.RTLD_LOCAL)
        self._set = self.cdll.gm_set_threads
        self._set.argtypes = [ctypes.c_int]
        self._set.restype = None
        self._get = self.cdll.gm_get_threads
        self._get.argtypes = []
        self._get.restype = ctypes.c_int
        ran_parallel()                       # its loops may start OpenMP's team: a fork child runs them on one
        _LIBRARIES.add(self)
        if threads is not None or forked_after_run():
            self.set_threads(threads or 0)
        self._flush = getattr(self.cdll, "gm_flush_lines", None)     # absent from libraries built before it
        if self._flush is not None:
            self._flush.argtypes = [ctypes.c_void_p, ctypes.c_long]
            self._flush.restype = ctypes.c_int
        self.can_flush = self._flush is not None and bool(self._flush(None, 0))

    def flusher(self, t: torch.Tensor) -> Callable[[], None]:
        """A call that evicts `t`'s bytes from every cache level (where `can_flush`): tactic
        timing's cold calls. `t` must outlive it."""
        return functools.partial(self._flush, t.data_ptr(), t.numel() * t.element_size())

    def set_threads(self, n: int) -> None:
        """OpenMP threads for this library's parallel loops (0 = the OpenMP default). Applies to
        calls from any Python thread (it is a `num_threads` clause, not a per-thread ICV). One in
        a process forked after OpenMP ran (graphmode/openmp.py: more would wait for ever)."""
        self._set(1 if forked_after_run() else int(n))

    @property
    def threads(self) -> int:
        return int(self._get())

    def function(self, symbol: str, nargs: int):
        try:
            fn = getattr(self.cdll, symbol)
            packed = getattr(self.cdll, symbol + "_packed")
        except AttributeError:
            raise BackendError(f"symbol {symbol} missing from {self.path}",
                               fix="delete the cached library; it will be rebuilt") from None
        fn.argtypes = [ctypes.c_void_p] * nargs
        fn.restype = None
        packed.argtypes = [ctypes.c_void_p]
        packed.restype = None
        return fn, packed


class _Bound:
    """A kernel with its argument addresses fixed: `bound()` runs it."""

    __slots__ = ("_packed", "_arr")

    def __init__(self, packed, arr):
        self._packed = packed
        self._arr = arr

    def __call__(self) -> None:
        self._packed(self._arr)


class _CheckedBound(_Bound):
    """A bound kernel that validates its input data (an index in range): after each call it
    reads and resets the kernel's count of invalid elements and raises if there were any."""

    __slots__ = ("_status", "_source")

    def __init__(self, packed, arr, status, source: KernelSource):
        super().__init__(packed, arr)
        self._status, self._source = status, source

    def __call__(self) -> None:
        self._packed(self._arr)
        _raise_if_invalid(self._status(), self._source)


class _FallbackBound(_Bound):
    """A bound kernel that flags inputs it cannot compute as eager does (a Winograd tile
    holding inf): after a call that set `flag`, `fallback` (the step's ATen default) computes
    the output again."""

    __slots__ = ("_flag", "_fallback")

    def __init__(self, packed, arr, flag: ctypes.c_int32, fallback: Callable[[], None]):
        super().__init__(packed, arr)
        self._flag, self._fallback = flag, fallback

    def __call__(self) -> None:
        self._packed(self._arr)
        if self._flag.value:
            self._fallback()


def _raise_if_invalid(bad: int, source: KernelSource) -> None:
    if bad:
        raise BackendError(f"{source.status} ({bad} invalid)", where=source.pattern,
                           fix="check the model inputs (an index or id outside its table)")


class CompiledKernel:
    """`kernel(ptrs)` runs the kernel on buffer addresses ordered as `kernel.args`."""

    def __init__(self, source: KernelSource, library: CompiledLibrary):
        self.source = source
        self.library = library
        self.symbol = source.symbol
        self.args = source.args
        self.nargs = len(source.args)
        self._fn, self._packed = library.function(source.symbol, self.nargs)
        self._status = None
        if source.status:
            self._status = getattr(library.cdll, source.status_symbol)
            self._status.argtypes = []
            self._status.restype = ctypes.c_long

    def __call__(self, ptrs: Sequence[int]) -> None:
        if len(ptrs) != self.nargs:
            raise BackendError(f"kernel {self.symbol} takes {self.nargs} buffers ({', '.join(self.args)})",
                               value=len(ptrs))
        self._fn(*ptrs)
        if self._status is not None:
            _raise_if_invalid(self._status(), self.source)

    def bind(self, ptrs: Sequence[int], fallback: Callable[[], None] | None = None) -> Callable[[], None]:
        """The kernel bound to `ptrs`; `fallback` runs after a call that set the kernel's
        fallback flag (KernelSource.fallback_flag)."""
        if len(ptrs) != self.nargs:
            raise BackendError(f"kernel {self.symbol} takes {self.nargs} buffers", value=len(ptrs))
        arr = (ctypes.c_void_p * self.nargs)(*ptrs)
        flag = self.source.fallback_flag
        if flag is not None and fallback is not None:   # the flag lives in a buffer the step keeps
            at = ctypes.c_int32.from_address(ptrs[self.args.index(flag[0])] + 4 * flag[1])
            return _FallbackBound(self._packed, arr, at, fallback)
        if self._status is not None:
            return _CheckedBound(self._packed, arr, self._status, self.source)
        return _Bound(self._packed, arr)

    def set_threads(self, n: int) -> None:
        self.library.set_threads(n)

    def __repr__(self) -> str:
        return f"CompiledKernel({self.symbol}, {', '.join(self.args)})"


def run_with_tensors(kernel: CompiledKernel, tensors: Mapping[str, torch.Tensor] | Sequence[torch.Tensor],
                     out: Mapping[str, torch.Tensor] | None = None, *,
                     source: KernelSource | None = None) -> dict[str, torch.Tensor]:
    """Run on torch tensors (tests, debugging): inputs by name (or in `source.inputs` order),
    outputs allocated unless given in `out` (an `out` tensor may be an input: in-place).

    Identical groups share one compiled kernel (same symbol); pass the group's own
    `source` to address its buffers by its value names."""
    src = source or kernel.source
    if src.symbol != kernel.symbol:
        raise BackendError(f"source {src.symbol} does not belong to kernel {kernel.symbol}")
    if not isinstance(tensors, Mapping):
        tensors = dict(zip(src.inputs, tensors))
    keep: list[torch.Tensor] = []
    ptrs: list[int] = []
    for name in src.inputs:
        if name not in tensors:
            raise BackendError(f"missing input {name!r}", fix=f"pass {', '.join(src.inputs)}")
        t = _checked(name, tensors[name], src, copy_ok=True)
        keep.append(t)
        ptrs.append(t.data_ptr())
    outs: dict[str, torch.Tensor] = {}
    for name in src.outputs:
        ty = src.types[name]
        t = (out or {}).get(name)
        if t is None:
            t = torch.empty(tuple(int(d) for d in ty.shape), dtype=DTYPES[ty.dtype])
        t = _checked(name, t, src, copy_ok=False)
        outs[name] = t
        ptrs.append(t.data_ptr())
    kernel(ptrs)
    return outs


def _checked(name: str, t: torch.Tensor, src: KernelSource, *, copy_ok: bool) -> torch.Tensor:
    ty = src.types[name]
    shape = tuple(int(d) for d in ty.shape)
    if t.device.type != "cpu" or tuple(t.shape) != shape or t.dtype != DTYPES[ty.dtype]:
        raise BackendError(f"%{name} must be a cpu {ty.text()} tensor", where=f"kernel {src.symbol}",
                           value=(str(t.device), tuple(t.shape), str(t.dtype)))
    if not t.is_contiguous():
        if not copy_ok:
            raise BackendError(f"output %{name} must be contiguous", where=f"kernel {src.symbol}")
        t = t.contiguous()
    return t
