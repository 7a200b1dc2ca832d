"""Host memory a compiled model gives back: freed heap, and weights nothing reads any more;
and the fresh buffers it hands out (`empty_huge`), backed by transparent huge pages.

A plan reads its GEMM and conv weights in the layout its kernels want (packed panels,
Winograd-transformed); the graph's own constants (BN-folded convs, transposed linears: new
tensors the passes made) are then read only when another bucket is built, by an ATen step, or
by the reference interpreter. `spill_constants` moves them to a file-backed mapping, and
`ConstantSpill.release()` drops the pages this process maps (after a bucket is built): the
kernel refaults a page from the page cache or the file if anything reads it again, so nothing
changes but resident memory. Like ONNX Runtime's pre-packing, which frees an initializer once
every consumer holds its packed copy, except that the original stays readable.

The file is created in the model's cache folder and unlinked as soon as it is mapped: no other
process can open, truncate or replace it (a truncated mapping would fault), and its disk space
goes with the mapping. A folder on tmpfs/ramfs is not used (its pages are memory whatever
this process maps), nor a platform without mmap-backed tensors: then constants stay in memory
and the reason is recorded.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
import sys
import tempfile
import weakref
from pathlib import Path
from typing import Mapping

import torch

log = logging.getLogger("graphmode.hostmem")

MIN_SPILL_BYTES = 1 << 16     # smaller constants stay in memory: a page each would be mostly padding
ALIGN = 4096
HUGE_PAGE = 2 << 20
MIN_HUGE_BYTES = 4 << 20      # numpy advises huge pages from this size on, for the same reason
_MADV_DONTNEED = 4
_MADV_HUGEPAGE = 14
_MEMORY_FS = {0x01021994: "tmpfs", 0x858458F6: "ramfs"}


@functools.lru_cache(maxsize=1)
def _libc():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


def trim_heap() -> None:
    """Give freed heap back to the OS (glibc's malloc_trim): glibc raises its mmap threshold
    after large frees, so the big transient buffers of tactic timing land on the heap and stay
    resident after they are freed unless trimmed."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


class _StatFs(ctypes.Structure):
    """struct statfs: f_type first (Linux), the rest unread."""
    _fields_ = [("f_type", ctypes.c_long), ("rest", ctypes.c_byte * 120)]


def memory_backed(folder: Path) -> str | None:
    """'tmpfs' / 'ramfs' when `folder` keeps its files in memory, else None."""
    if not sys.platform.startswith("linux"):
        return None
    folder = Path(folder).absolute()
    while not folder.exists() and folder != folder.parent:    # the folder may not exist yet
        folder = folder.parent
    try:
        libc = _libc()
        buf = _StatFs()
        if libc is None or libc.statfs(str(folder).encode(), ctypes.byref(buf)) != 0:
            return None
        return _MEMORY_FS.get(buf.f_type & 0xFFFFFFFF)
    except (OSError, AttributeError):
        return None


_LIVE: "weakref.WeakSet[ConstantSpill]" = weakref.WeakSet()


def _madvise(addr: int, length: int, advice: int) -> bool:
    libc = _libc()
    if libc is None or not hasattr(libc, "madvise") or length <= 0:
        return False
    rc = libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(length), ctypes.c_int(advice))
    if rc != 0:
        log.debug("madvise(%d) failed: errno %d", advice, ctypes.get_errno())
    return rc == 0


def _madvise_dontneed(addr: int, length: int) -> bool:
    return _madvise(addr, length, _MADV_DONTNEED)


def empty_huge(shape, dtype: torch.dtype) -> torch.Tensor:
    """A fresh tensor whose 2 MiB-aligned interior is advised MADV_HUGEPAGE before anything
    touches it (from MIN_HUGE_BYTES on; smaller ones, and other platforms, are plain
    `torch.empty`). Why: a returned output is new memory on every call, and with the kernel's
    THP mode `madvise` each 4 KiB page of it costs a fault and a zeroing on first write:
    GPT-2's logits at 1x128 (25.7 MB) took 5.5 ms to copy out that way and 0.8 ms with huge
    pages. Nothing else changes: the advice only lets the kernel map larger pages."""
    t = torch.empty(shape, dtype=dtype)
    n = t.numel() * t.element_size()
    if n >= MIN_HUGE_BYTES and sys.platform.startswith("linux"):
        p = t.data_ptr()
        lo, hi = -(-p // HUGE_PAGE) * HUGE_PAGE, (p + n) // HUGE_PAGE * HUGE_PAGE
        _madvise(lo, hi - lo, _MADV_HUGEPAGE)
    return t


def release(t: torch.Tensor) -> int:
    """Drop the pages of `t` if it is a spilled constant (a no-op for any other tensor: on
    anonymous memory DONTNEED would zero it); returns the bytes advised away. For a step that
    now reads its own prepared copy of `t`."""
    start = t.data_ptr()
    for sp in list(_LIVE):
        if sp.base is None or not sp.lo <= start < sp.hi:
            continue
        end = min(start + -(-t.numel() * t.element_size() // ALIGN) * ALIGN, sp.hi)
        if sp.packed:
            # every spilled constant starts on its own page and owns the pages up to the next one
            return end - start if start % ALIGN == 0 and _madvise_dontneed(start, end - start) else 0
        # a mapped file's tensors share boundary pages: dropping a neighbour's clean page only refaults it
        lo = start - start % ALIGN
        return end - lo if _madvise_dontneed(lo, end - lo) else 0
    return 0


class ConstantSpill:
    """The file-backed mapping holding a model's spilled constants: views of `base` (a spill
    file, every constant page-aligned: `packed`) or tensors mapped from a saved file, which
    `base` (a list of them) keeps alive; `lo`..`hi` is the page range they span."""

    def __init__(self, base, names: list[str], nbytes: int, why_not: str | None = None, *,
                 span: tuple[int, int] | None = None):
        self.base, self.names, self.nbytes, self.why_not = base, names, nbytes, why_not
        self.packed = isinstance(base, torch.Tensor)
        if span is None and self.packed:
            span = (base.data_ptr(), base.data_ptr() + base.numel())
        self.lo, self.hi = span or (0, 0)
        self.releases = 0

    def release(self) -> int:
        """Drop this process's pages of the spilled constants; returns the bytes advised away."""
        if self.base is None or not self.nbytes:
            return 0
        if not _madvise_dontneed(self.lo, self.hi - self.lo):
            return 0
        self.releases += 1
        return self.nbytes

    def report(self) -> dict:
        return {"spilled_constants": len(self.names), "spilled_bytes": self.nbytes, "why_not": self.why_not,
                "releases": self.releases}


def spill_constants(constants: Mapping[str, torch.Tensor], folder: Path | None, *,
                    keep: set[int] = frozenset()) -> tuple[dict[str, torch.Tensor], ConstantSpill]:
    """`constants` with every contiguous floating constant of >= MIN_SPILL_BYTES whose storage is
    not in `keep` (the module's own parameters: they stay where the module has them) replaced by
    an equal tensor in a file-backed mapping under `folder` (None: a temporary folder)."""
    pick = [n for n, t in constants.items()
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.device.type == "cpu"
            and t.is_contiguous() and t.numel() * t.element_size() >= MIN_SPILL_BYTES
            and t.untyped_storage().data_ptr() not in keep]
    out = dict(constants)
    if not pick:
        return out, ConstantSpill(None, [], 0)
    folder = Path(folder) if folder is not None else Path(tempfile.gettempdir())
    mem = memory_backed(folder)
    if mem is not None:
        return out, ConstantSpill(None, [], 0, why_not=f"{folder} is on {mem} (files there are memory)")
    offsets, total = {}, 0
    for n in pick:
        offsets[n] = total
        total += -(-constants[n].numel() * constants[n].element_size() // ALIGN) * ALIGN
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, path = tempfile.mkstemp(prefix="spill-", suffix=".bin", dir=folder)
        try:
            with os.fdopen(fd, "wb") as f:
                for n in pick:
                    t = constants[n]
                    f.seek(offsets[n])
                    f.write(t.detach().reshape(-1).view(torch.uint8).numpy())
                f.truncate(total)
            base = torch.from_file(path, shared=True, size=total, dtype=torch.uint8)
        finally:
            try:
                os.unlink(path)
            except OSError:
                pass
    except (OSError, RuntimeError) as e:
        return out, ConstantSpill(None, [], 0, why_not=f"cannot write a spill file in {folder}: {e}")
    for n in pick:
        t = constants[n]
        nb = t.numel() * t.element_size()
        out[n] = base[offsets[n]:offsets[n] + nb].view(t.dtype).view(t.shape)
    spill = ConstantSpill(base, pick, sum(constants[n].numel() * constants[n].element_size() for n in pick))
    _LIVE.add(spill)
    return out, spill


def load_mapped(path: Path) -> tuple[dict[str, torch.Tensor], ConstantSpill]:
    """The constants `torch.save`d in `path`, mapped from the file instead of read into memory
    (a `.gm`'s weights: its extracted copy is the spill file already), and their spill. The
    mapping is private and never written, so released pages refault from the file."""
    constants = torch.load(path, mmap=True, weights_only=True)
    mapped = [t for t in constants.values() if isinstance(t, torch.Tensor) and t.numel()]
    why = memory_backed(Path(path).parent)
    if not mapped or why is not None:
        return constants, ConstantSpill(None, [], 0, why_not=why and f"{Path(path).parent} is on {why}")
    lo = min(t.untyped_storage().data_ptr() for t in mapped)
    hi = max(t.untyped_storage().data_ptr() + t.untyped_storage().nbytes() for t in mapped)
    # torch maps the whole file from a page boundary: the pages around its tensors are the mapping's
    span = (lo - lo % ALIGN, -(-hi // ALIGN) * ALIGN)
    spill = ConstantSpill(mapped, list(constants), sum(t.numel() * t.element_size() for t in mapped), span=span)
    _LIVE.add(spill)
    return constants, spill


__all__ = ["ConstantSpill", "load_mapped", "MIN_SPILL_BYTES", "memory_backed", "release", "spill_constants", "trim_heap"]
