"""graphmode/hostmem.py: constants spilled to a file-backed mapping, their pages released,
and the refusals (tmpfs, unwritable folder); fresh outputs advised huge pages. Nothing here
asserts on RSS: the values must survive every release, and a tensor that is not spilled must
never be touched."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import sys

from graphmode import hostmem
from graphmode.hostmem import (HUGE_PAGE, MIN_HUGE_BYTES, MIN_SPILL_BYTES, empty_huge, load_mapped, memory_backed,
                               release, spill_constants, trim_heap)


def _consts():
    g = torch.Generator().manual_seed(0)
    return {"big": torch.randn(256, 300, generator=g), "small": torch.randn(8, generator=g),
            "bf16": torch.randn(200, 200, generator=g).to(torch.bfloat16),
            "ints": torch.arange(40_000, dtype=torch.int64), "odd": torch.randn(4099, 5, generator=g)}


def test_spilled_constants_equal_the_originals_and_survive_release(tmp_path):
    c = _consts()
    out, sp = spill_constants(c, tmp_path / "spill")
    assert set(sp.names) == {"big", "bf16", "odd"}          # floating, >= MIN_SPILL_BYTES
    assert out["small"] is c["small"] and out["ints"] is c["ints"]
    assert sp.nbytes == sum(c[n].numel() * c[n].element_size() for n in sp.names)
    assert list((tmp_path / "spill").iterdir()) == []         # unlinked once mapped
    for n in sp.names:
        assert out[n].data_ptr() != c[n].data_ptr() and out[n].dtype == c[n].dtype
        assert out[n].data_ptr() % 4096 == 0 and torch.equal(out[n], c[n])
    assert sp.release() == sp.nbytes
    trim_heap()
    for n in sp.names:                                        # refaulted from the mapping
        assert torch.equal(out[n], c[n])
    assert sp.report()["releases"] == 1 and sp.report()["spilled_constants"] == 3


def test_release_touches_only_spilled_tensors(tmp_path):
    out, sp = spill_constants(_consts(), tmp_path)
    anon = torch.randn(300, 300)
    keep = anon.clone()
    assert release(anon) == 0 and torch.equal(anon, keep)    # DONTNEED on anonymous memory would zero it
    assert release(out["big"]) == -(-out["big"].numel() * 4 // 4096) * 4096
    assert release(out["odd"][1:]) == 0                        # not page-aligned: not a spilled constant's start
    assert torch.equal(out["odd"], _consts()["odd"]) and torch.equal(out["big"], _consts()["big"])


def test_a_saved_file_is_mapped_as_its_own_spill(tmp_path):
    """load_mapped: the tensors are pages of the saved file (nothing read into memory), every
    one, whatever its dtype or size, survives whole-spill and per-tensor releases (their pages
    are not page-aligned: a release rounds out, which only refaults a neighbour's clean page)."""
    c = _consts()
    torch.save(c, tmp_path / "w.pt")
    out, sp = load_mapped(tmp_path / "w.pt")
    assert set(sp.names) == set(c) and sp.nbytes == sum(t.numel() * t.element_size() for t in c.values())
    assert all(sp.lo <= t.data_ptr() < sp.hi for t in out.values()) and sp.lo % 4096 == sp.hi % 4096 == 0
    assert sp.release() == sp.nbytes and release(out["odd"][1:]) > 0 and release(out["small"]) > 0
    anon = torch.randn(300, 300)
    assert release(anon) == 0
    for n, t in c.items():
        assert torch.equal(out[n], t) and out[n].dtype == t.dtype


def test_module_parameters_are_not_spilled(tmp_path):
    lin = torch.nn.Linear(300, 300)
    c = {"w": lin.weight.detach(), "folded": lin.weight.detach() * 2}
    out, sp = spill_constants(c, tmp_path, keep={lin.weight.untyped_storage().data_ptr()})
    assert sp.names == ["folded"] and out["w"] is c["w"]


@pytest.mark.skipif(not (os.path.isdir("/dev/shm") and memory_backed(Path("/dev/shm"))),
                    reason="no tmpfs at /dev/shm on this machine")
def test_a_memory_backed_folder_is_not_used():
    c = _consts()
    out, sp = spill_constants(c, Path("/dev/shm") / "graphmode-test-spill")
    assert sp.names == [] and "tmpfs" in sp.why_not and all(out[k] is c[k] for k in c)


def test_an_unwritable_folder_keeps_constants_in_memory(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    c = _consts()
    out, sp = spill_constants(c, blocker / "spill")
    assert sp.names == [] and "cannot write a spill file" in sp.why_not
    assert all(out[k] is c[k] for k in c) and sp.release() == 0


def test_min_spill_bytes_is_a_page_multiple():
    assert MIN_SPILL_BYTES % 4096 == 0


def _vm_flags(addr: int) -> list[str]:
    """The VmFlags of the mapping holding `addr` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    return []


def test_fresh_outputs_are_advised_huge_pages(monkeypatch):
    big = empty_huge((3, MIN_HUGE_BYTES // 4 + 1000), torch.float32)
    assert big.shape == (3, MIN_HUGE_BYTES // 4 + 1000) and big.dtype == torch.float32 and big.is_contiguous()
    assert big.storage_offset() == 0
    small = empty_huge((10, 10), torch.int64)
    assert small.shape == (10, 10) and small.dtype == torch.int64
    big.fill_(2.5)
    assert bool((big == 2.5).all())
    if not sys.platform.startswith("linux"):
        pytest.skip("madvise is Linux's")
    interior = -(-big.data_ptr() // HUGE_PAGE) * HUGE_PAGE
    assert "hg" in _vm_flags(interior)            # the 2 MiB-aligned interior carries MADV_HUGEPAGE
    # a small one is not advised (its flags cannot say so: heap memory an earlier big tensor had
    # advised, then freed, carries the flag to whatever is allocated there next)
    advised = []
    monkeypatch.setattr(hostmem, "_madvise", lambda *a: advised.append(a) or True)
    empty_huge((10, 10), torch.int64)
    assert advised == []
