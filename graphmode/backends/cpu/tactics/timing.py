"""Timing candidates: closures over synthetic operands, and interleaved samples of them.

Every candidate of a shape is timed on the same random operands at the plan's thread count.
With `cold`, each call reads its weight from DRAM (the weights of a model larger than the
cache are not cache resident when the plan runs): the weight is flushed from every cache
level before each call, outside the timed region (`Flushed`; the kernels' library exports
the flush). Where it cannot flush (no kernel library, a CPU without a flush instruction),
each call reads the next of enough copies to stream 2x the LLC between two uses of one; the
copies are views of one `ColdPool` buffer of 2x the LLC that every candidate of every shape
of a plan shares (that pool was the peak of a ResNet-18 bucket build). Samples interleave
the candidates round-robin, the start rotating, so that drift of a shared machine hits every
candidate alike; the context's statistic (median by default) of the samples is what the
policy compares.
"""
from __future__ import annotations

import math
import time
from typing import Callable, Mapping, Sequence

import torch

from graphmode.backends.cpu.conv import ConvConfig, ConvProblem
from graphmode.backends.cpu.tactics.candidates import conv_config
from graphmode.backends.cpu.gemm import GemmConfig, GemmProblem
from graphmode.backends.cpu.tactics.steps import ATEN, ConvStep, GemmStep, aten_conv, aten_gemm, b_shape, conv_args

CALIBRATION_CALLS = 3   # back-to-back calls whose fastest sets a candidate's calls per sample
PRUNE = 1.5             # a candidate this much slower than the best in calibration is not sampled further


def machine_load() -> tuple[float | None, int]:
    """(1-minute load average, CPUs this process may use): timings taken with more runnable
    threads than CPUs measure the scheduler, not the kernel."""
    from graphmode.targets.host import load_average, usable_cores
    load = load_average()
    return (load[0] if load else None), usable_cores()


def measure(fns: Mapping[str, Callable[[], None]], *, reps: int, sample_s: float,
            budget_s: float, prune: float | None = PRUNE) -> dict[str, list[float]]:
    """Seconds per call of each closure, one list of samples each: a warm-up call, then at
    least `reps` interleaved round-robin samples of >= `sample_s` seconds of back-to-back
    calls, more (up to 8x `reps`) while they fit `budget_s` per candidate. The calls per
    sample come from the fastest of CALIBRATION_CALLS calls: from one call, a candidate whose
    call happened to wait out a time slice (a 2-thread ATen GEMM of 8 KFLOP took 15 ms at
    load 5 on 2 cores) got samples of one call each, against 1000-call samples of the
    others, and a "36892x vs aten" margin. A candidate whose fastest calibration call is more
    than `prune` x the fastest one's is not sampled further: its calibration calls are its
    samples (one candidate of GPT-2's 50257-column LM head takes ~50 ms a call, and most of a
    bucket's tuning went to timing candidates that could not win).

    The calibration calls go round-robin too, and a pruned candidate gets one more call
    after the sampling: a burst of load on a 2-core host made all three back-to-back calls of
    one parallel GEMM 5x slow, which pruned the fastest candidate and cached a serial kernel
    2x slower (MiniLM's linear+GELU). One that comes back within `prune` x is sampled with
    the others after all."""
    names = list(fns)
    inner: dict[str, int] = {}
    first: dict[str, list[float]] = {n: [] for n in names}
    for n in names:
        fns[n]()
    for _ in range(CALIBRATION_CALLS):
        for n in names:
            first[n].append(max(_per_call(fns[n], 1), 1e-7))
    best = min(min(v) for v in first.values()) if first else 0.0
    samples: dict[str, list[float]] = {n: list(first[n]) for n in names if prune and min(first[n]) > prune * best}
    live = [n for n in names if n not in samples]
    _sample(fns, live, samples, inner, reps, sample_s, budget_s, first)
    best = min([best] + [min(samples[n]) for n in live if samples[n]])
    again = []
    for n in [n for n in names if n not in live]:
        t = max(_per_call(fns[n], 1), 1e-7)
        samples[n].append(t)
        if t <= prune * best:
            again.append(n)
    if again:
        for n in again:
            first[n].append(samples[n][-1])
        samples.update({n: [] for n in again})
        _sample(fns, live + again, samples, inner, reps, sample_s, 0.0, first)
    return {n: samples[n] for n in names}


def _sample(fns: Mapping[str, Callable[[], None]], live: list[str], samples: dict[str, list[float]],
            inner: dict[str, int], reps: int, sample_s: float, budget_s: float,
            first: Mapping[str, list[float]]) -> None:
    """Round-robin samples of the `live` candidates (calls per sample from their fastest call)."""
    longest = 0.0
    for n in live:
        dt = min(first[n])
        inner.setdefault(n, max(1, min(1000, int(sample_s / dt))))
        longest = max(longest, dt * inner[n])
    rounds = max(reps, min(8 * reps, int(budget_s / max(longest, 1e-6))))
    for n in live:
        samples.setdefault(n, [])
    with torch.inference_mode():
        for r in range(rounds):
            for j in range(len(live)):
                n = live[(r + j) % len(live)]
                samples[n].append(_per_call(fns[n], inner[n]))


def _per_call(f: Callable[[], None], calls: int) -> float:
    """Seconds per call over `calls` calls of `f`; a `Flushed` call's flush is not timed."""
    if isinstance(f, Flushed):
        run, flush, total = f.fn, f.flush, 0.0
        for _ in range(calls):
            flush()
            t0 = time.perf_counter()
            run()
            total += time.perf_counter() - t0
        return total / calls
    t0 = time.perf_counter()
    for _ in range(calls):
        f()
    return (time.perf_counter() - t0) / calls


class Flushed:
    """`fn` whose operand must be cold at each call: `measure` runs `flush` before each call,
    outside the timed region (called directly, it flushes too)."""

    __slots__ = ("fn", "flush")

    def __init__(self, fn: Callable[[], None], flush: Callable[[], None]):
        self.fn, self.flush = fn, flush

    def __call__(self) -> None:
        self.flush()
        self.fn()


def rotate(calls: list[Callable[[], None]]) -> Callable[[], None]:
    """One closure calling the next of `calls` each time."""
    if len(calls) == 1:
        return calls[0]
    it = [0]

    def f() -> None:
        i = it[0]
        it[0] = (i + 1) % len(calls)
        calls[i]()
    return f


def then(f: Callable[[], None], g: Callable[[], None] | None) -> Callable[[], None]:
    """`f` then `g` in one closure (`f` alone when there is no `g`)."""
    if g is None:
        return f

    def both() -> None:
        f()
        g()
    return both


def copies_for(numel: int, llc_bytes: int, cold: bool) -> int:
    """Copies of an fp32 weight of `numel` elements that stream 2x the LLC between two uses."""
    return max(1, math.ceil(2 * llc_bytes / max(numel * 4, 1))) if cold else 1


class ColdPool:
    """How cold timing makes a weight cold at each call (`each_cold`): flushed by `library`
    (a CompiledLibrary that `can_flush`), else rotated over copies that are views of one buffer
    of 2x the LLC (one small constant: timing is data-independent; only each candidate's first
    copy is its real weight), allocated on first use, shared by every candidate and shape
    timed with it, and released with the pool. `cold=False`: every call on the weight itself."""

    def __init__(self, llc_bytes: int, cold: bool, library=None):
        self.llc_bytes, self.cold = int(llc_bytes), bool(cold)
        self.library = library if library is not None and getattr(library, "can_flush", False) else None
        self._buf: torch.Tensor | None = None

    def each_cold(self, t: torch.Tensor, make: Callable[[torch.Tensor], Callable[[], None]]) -> Callable[[], None]:
        """A closure running `make(u)`'s call where `u` holds `t`'s place and is not in any
        cache when the call starts (with `cold`)."""
        if not self.cold:
            return make(t)
        if self.library is not None:
            return Flushed(make(t), self.library.flusher(t))
        return rotate([make(u) for u in self.copies(t)])

    def copies(self, t: torch.Tensor) -> list[torch.Tensor]:
        """`t`, then views of the pool shaped like it: enough that reading them in turn
        streams 2x the LLC between two reads of one."""
        n = t.numel()
        extra = copies_for(n, self.llc_bytes, self.cold) - 1
        if extra <= 0:
            return [t]
        if self._buf is None:      # extra * n < 2 * LLC / 4 floats for every n (written: no zero pages)
            self._buf = torch.empty(max(1, 2 * self.llc_bytes // 4)).fill_(0.0625)
        return [t] + [self._buf[i * n:(i + 1) * n].view(tuple(t.shape)) for i in range(extra)]

    @property
    def nbytes(self) -> int:
        return 0 if self._buf is None else self._buf.numel() * 4


def gemm_timing_fns(p: GemmProblem, names: Sequence[str], step: GemmStep, kernels: Mapping,
                    rejected: Mapping[str, str], keep: list, *, seed: int, pool: ColdPool,
                    pack: Callable[[torch.Tensor, int], torch.Tensor]) -> dict[str, Callable[[], None]]:
    """One closure per GEMM candidate that may win (checked already; `pack(w, nr)` gives the
    constant weight in a candidate's panels); `pool` makes each call's weight cold. Buffers go
    to `keep`, which must outlive the timing."""
    gen = torch.Generator().manual_seed(seed + 2)
    a = torch.randn(p.batch, p.m, p.k, generator=gen)
    c = torch.empty(p.batch, p.m, p.n)
    keep += [a, c]
    bias = step.bias
    extra = [bias.data_ptr()] if p.bias else []
    if p.epi is not None:       # operands of the same shapes; ATen's time includes the epilogue kernel
        ops = [torch.randn(tuple(t.shape), generator=gen) for t in step.ops]
        keep += ops
        extra = extra + [t.data_ptr() for t in ops]
    live = [n for n in names if n != ATEN and n not in rejected]
    fns: dict[str, Callable[[], None]] = {}
    if not p.b_packed:
        b = torch.randn(b_shape(p), generator=gen)
        keep.append(b)
        fns[ATEN] = then(aten_gemm(p, a, b, bias, c), step.epilogue_run)
        for name in live:
            fns[name] = kernels[(p, name)][0].bind([a.data_ptr(), b.data_ptr(), *extra, c.data_ptr()])
        return fns
    packs = {GemmConfig.parse(n).nr: pack(step.b, GemmConfig.parse(n).nr) for n in live}
    fns[ATEN] = pool.each_cold(step.b, lambda u: then(aten_gemm(p, a, u, bias, c), step.epilogue_run))
    for name in live:
        kern = kernels[(p, name)][0]
        fns[name] = pool.each_cold(packs[GemmConfig.parse(name).nr],
                                   lambda u, kern=kern: kern.bind([a.data_ptr(), u.data_ptr(), *extra, c.data_ptr()]))
    return fns


def conv_timing_fns(p: ConvProblem, names: Sequence[str], step: ConvStep, kernels: Mapping,
                    rejected: Mapping[str, str], keep: list, *, seed: int, pool: ColdPool,
                    weight: Callable[[torch.Tensor, ConvConfig], torch.Tensor]) -> dict[str, Callable[[], None]]:
    """As `gemm_timing_fns` for convs (`weight(w, cfg)` gives a candidate's prepared weight);
    each candidate's call finds ITS weight cold (the Winograd weights are 16/9 or 4x the
    direct ones, which is the point of timing cold)."""
    gen = torch.Generator().manual_seed(seed + 2)
    x = torch.randn(p.n, p.cin, p.h, p.w, generator=gen)
    y = torch.empty(p.n, p.cout, p.ho, p.wo)
    keep += [x, y]
    fns: dict[str, Callable[[], None]] = {     # ATen's time includes the group's epilogue kernel
        ATEN: pool.each_cold(step.b, lambda u: then(aten_conv(p, x, u, step.bias, y), step.epilogue_run))}
    ops: list[torch.Tensor] = []
    if step.epilogue_run is not None:
        ops = [torch.randn(tuple(t.shape), generator=gen) for t in step.ops]
        keep += ops
    live = [n for n in names if n != ATEN and n not in rejected]
    # conv kernels keep nothing in their workspace between calls: one buffer serves every candidate
    ws = torch.zeros(max([conv_config(n).workspace_numel(p) for n in live], default=0))
    keep.append(ws)
    for name in live:
        cfg = conv_config(name)
        kern = kernels[(p, name)][0]
        fns[name] = pool.each_cold(weight(step.b, cfg),
                                   lambda u, kern=kern, cfg=cfg: kern.bind(conv_args(step, cfg, x, u, ws, y, ops)))
    return fns


__all__ = ["CALIBRATION_CALLS", "ColdPool", "Flushed", "measure", "machine_load", "rotate", "then", "copies_for", "gemm_timing_fns",
           "conv_timing_fns"]
