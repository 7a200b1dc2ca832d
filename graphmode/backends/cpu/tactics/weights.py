"""The prepared (packed / transformed) weights of one tactics context, and binding steps to them.

While a plan is tuned, `scratch` memoises each candidate's prepared copy of a constant weight
(the checks, the timing and the winner's binding share one per weight and layout) and the
checks' inputs and references. The winners' copies outlive tuning: the context keeps them
(`packed`) and they are shared process-wide (`_PACKED`), so the executables of one model's
buckets (same constants) hold one copy, not one each.

A shared copy is found by its source's address, shape and version, which a write through
`param.data` (`p.data.copy_(new)`: LoRA merges, hand-written updates) leaves as they were: a
model compiled again after such a write found the first compile's packed copies of the old
weights and answered with them (rel L2 1.4 on a small GPT-NeoX). So each copy keeps a CRC-32
of its source's bytes, and one taken from another tensor object is used only while they match.
"""
from __future__ import annotations

import weakref
import zlib
from typing import Any, Callable, Mapping

import torch

from graphmode.backends.cpu.conv import ConvConfig
from graphmode.backends.cpu.gemm import GemmConfig, GemmProblem, pack_b
from graphmode.backends.cpu.tactics.candidates import conv_config
from graphmode.backends.cpu.tactics.selection import Selection
from graphmode.backends.cpu.tactics.steps import ATEN, ConvStep, GemmStep
from graphmode.hostmem import release, trim_heap


class PreparedWeights:
    """The weights one context prepares for its candidates and keeps for its winners.

    `scratch`: packs and references while one plan is tuned (shared with the Checker).
    `carried`: winners' prepared weights the checks made, until bound. `packed`: the winners'
    prepared weights this context keeps alive. `workspaces`: conv scratch buffers (one
    serves every conv step bound with it)."""

    def __init__(self) -> None:
        self.scratch: dict[tuple, Any] = {}
        self.carried: dict[tuple, torch.Tensor] = {}
        self.packed: dict[tuple, _Packed] = {}
        self.workspaces: list[torch.Tensor] = []
        self.memory_left: int | None = None   # the plan's memory budget less weights and arena (None: no limit)
        self._checked: dict[tuple, bool] = {}    # key -> the shared copy's source bytes still match

    def pack(self, w: torch.Tensor, p: GemmProblem, nr: int) -> torch.Tensor:
        """`w` packed for panels of `nr` (memoised while one plan is tuned: the checks, the
        timing and the winner's binding share one packing per weight and panel width)."""
        key = _pack_memo_key(w, nr, p)
        got = self.scratch.get(key)
        if got is None:
            got = self._bound_copy(_packed_key(w, nr, p), w)
        if got is None:
            got = self.scratch[key] = pack_b(w, nr, transposed=(p.op == "linear"))
        return got

    def conv_weight(self, w: torch.Tensor, cfg: ConvConfig) -> torch.Tensor:
        """The candidate's transformed/packed weight (memoised while one plan is tuned)."""
        key = _conv_key(w, cfg)
        got = self.scratch.get(key)
        if got is None:
            got = self._bound_copy(key, w)
        if got is None:
            got = self.scratch[key] = cfg.prepare_weight(w)
        return got

    def scratch_key(self, step: GemmStep, name: str) -> tuple | None:
        """Where `conv_weight` / `pack` memoise candidate `name`'s prepared copy of the step's weight."""
        if name == ATEN or not step.problem.b_packed:
            return None
        if isinstance(step, ConvStep):
            return _conv_key(step.b, conv_config(name))
        return _pack_memo_key(step.b, GemmConfig.parse(name).nr, step.problem)

    def carry(self, step: GemmStep, winner: str) -> None:
        """Keep the winner's weight a cached pick's check prepared: binding takes it over (a
        timed pick's is made again at binding, after the timing buffers are gone)."""
        key = self.scratch_key(step, winner)
        if key in self.scratch:
            self.carried[key] = self.scratch[key]

    def workspace(self, need: int) -> torch.Tensor | None:
        """A conv workspace of at least `need` elements (None when no conv needs one): the steps
        of one executable run one at a time and conv kernels keep nothing in their workspace
        between calls, so one buffer, the size of the largest winner's, serves them all."""
        if not need:
            return None
        ws = next((w for w in self.workspaces if w.numel() >= need), None)
        if ws is None:
            ws = torch.empty(need)
            self.workspaces.append(ws)
        return ws

    def _bound_copy(self, key: tuple, src: torch.Tensor) -> torch.Tensor | None:
        """The copy an executable already binds under `key` (another bucket of the model, same
        constant): its checks read that instead of preparing the weight again."""
        holder = self._holder(key, src)
        return holder.t if holder is not None else None

    def _holder(self, key: tuple, src: torch.Tensor) -> "_Packed | None":
        """The prepared copy of `src` under `key`: this context's, or a shared one whose source
        bytes are `src`'s (the same tensor object, or the same CRC-32)."""
        got = self.packed.get(key)
        if got is not None:
            return got
        got = _PACKED.get(key)
        if got is None or got.src is src:
            return got
        if key not in self._checked:
            self._checked[key] = got.crc == _crc(src)
        return got if self._checked[key] else None

    def _kept(self, key: tuple, src: torch.Tensor, scratch_key: tuple,
              prepare: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The winner's prepared copy of constant `src` under `key`, shared process-wide: the
        executables of one model's buckets (same constants) hold one copy, not one each. The
        copy the checks and timing made (under `scratch_key`) is taken over, else prepared."""
        holder = self._holder(key, src)
        if holder is None:
            t = self.scratch.pop(scratch_key, None)
            t = self.carried.pop(scratch_key, None) if t is None else t
            holder = _Packed(src, t if t is not None else prepare())
            _PACKED[key] = holder
            release(src)     # a spilled constant's pages go (graphmode/hostmem.py); others stay as they are
            if t is None:
                trim_heap()  # the transform's transients: else binding peaks ~50 MB over its result
        self.packed[key] = holder
        return holder.t

    def bind(self, step: GemmStep, sel: Selection, kernels: Mapping, ws: torch.Tensor | None = None) -> None:
        """Switch `step` to `sel`'s winner, bound to its prepared weight (and `ws` for a conv)."""
        k = kernels.get((step.problem, sel.winner))
        if sel.winner == ATEN or not isinstance(k, tuple):   # the latter cannot happen after a passing check
            step.fn, step.tactic = step.default, ATEN
            return
        p, kernel = step.problem, k[0]
        if isinstance(step, ConvStep):
            cfg = conv_config(sel.winner)
            key = _conv_key(step.b, cfg)
            w = self._kept(key, step.b, key, lambda: cfg.prepare_weight(step.b))
            if ws is None or ws.numel() < cfg.workspace_numel(p):
                ws = torch.empty(cfg.workspace_numel(p))
                self.workspaces.append(ws)
            bufs = [step.a, w] + ([step.bias] if p.bias else []) + list(step.ops) + [ws, step.c]
        else:
            nr = GemmConfig.parse(sel.winner).nr
            if p.b_packed:
                w = step.b
                b = self._kept(_packed_key(w, nr, p), w, _pack_memo_key(w, nr, p), lambda: self.pack(w, p, nr))
            else:
                b = step.b
            bufs = [step.a, b] + ([step.bias] if p.bias else []) + list(step.ops) + [step.c]
        step.keep = tuple(bufs)
        step.fn = kernel.bind([t.data_ptr() for t in bufs], fallback=step.default)
        step.tactic = sel.winner

    def packed_bytes(self) -> int:
        return sum(h.t.numel() * h.t.element_size() for h in self.packed.values())

    def workspace_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.workspaces)


class _Packed:
    """A packed weight and its source. Holding the source keeps its address from being
    reused by another tensor while the packed copy is findable under that address."""

    __slots__ = ("__weakref__", "src", "t", "crc")

    def __init__(self, src: torch.Tensor, t: torch.Tensor):
        self.src, self.t, self.crc = src, t, _crc(src)


def _crc(t: torch.Tensor) -> int:
    """CRC-32 of a tensor's bytes (zlib: ~4 GB/s here)."""
    t = t.detach()
    t = t if t.is_contiguous() else t.contiguous()
    return zlib.crc32(t.reshape(-1).view(torch.uint8).numpy())


_PACKED: "weakref.WeakValueDictionary[tuple, _Packed]" = weakref.WeakValueDictionary()


def _packed_key(w: torch.Tensor, nr: int, p: GemmProblem) -> tuple:
    """Where constant `w` packed for panels of `nr` is kept (_PACKED)."""
    return (w.data_ptr(), tuple(w.shape), tuple(w.stride()), w._version, nr, p.op)


def _pack_memo_key(w: torch.Tensor, nr: int, p: GemmProblem) -> tuple:
    """Where `pack` memoises `w` packed for panels of `nr` while one plan is tuned."""
    return (w.data_ptr(), tuple(w.shape), nr, p.op)


def _conv_key(w: torch.Tensor, cfg: ConvConfig) -> tuple:
    """Where conv weight `w` prepared for `cfg` is kept (_PACKED), and memoised while tuning."""
    return (w.data_ptr(), tuple(w.shape), w._version) + cfg.weight_key()


__all__ = ["PreparedWeights"]
