"""GEMM and conv tactic selection: for every GEMM / conv shape of a plan, ATen or a generated kernel.

Convolutions (ungrouped, fp32, constant weight) have ATen, generated Winograd kernels for
3x3 stride 1 (winograd.py: F(4x4) and F(2x2)) and generated im2col GEMMs (im2col.py) as
candidates, each over two GEMM blockings, checked, timed, cached and bound exactly like the
GEMMs below; grouped convs stay ATen without timing.

Candidates per shape are ATen (`torch.addmm` / `bmm` / `matmul` into the output slot, what
the executor runs without tactics) and the generated micro-kernels of `gemm.py` in a few
tile/blocking configurations for the host's best ISA. Each candidate must first match
ATen on random data (fp32 rel L2 < 1e-5) or it is rejected; the survivors are timed at the
plan's thread count (interleaved round-robin samples, median; see TacticsContext) and the
policy picks one:

- `latency_first` (default): the smallest median time;
- `throughput_first`: the most GFLOP/s at the plan's thread count. A plan runs one request
  at a time on all its threads, so for a fixed shape this is the same argmax as
  latency_first; the name is kept so the recipe's `codegen.kernel_selection` maps 1:1;
- `heuristic`: no timing: the first generated configuration for the ISA (the one that
  measured best on skinny transformer GEMMs), ATen for non-f32 or without a compiler.

Timings are persisted in a timing cache, one JSON file per key under `cache_dir` (keyed by
the target identity with its SIMD flags, the compiler and its flags, thread count, op,
shape, dtype, whether weights are timed cold, and the candidate set including a hash of
every generated kernel's source), so the next plan build with those shapes does no timing.

Plans bind their steps first and tune afterwards: `select_gemm` hands the executor a
`GemmStep` that runs ATen until `TacticsContext.finalize()` has compiled every candidate of
the plan in one library (one compiler run), tuned the new shapes and switched each step to
its winner. Constant weights are packed once there, for the winner only, and the packed
copy lives in the context (which the executable keeps).
"""
from __future__ import annotations

import datetime as _dt
import hashlib
import json
import logging
import math
import os
import statistics
import tempfile
import time
import weakref
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

from graphmode.backends.cpu.gemm import PAR_FLOPS, GemmConfig, GemmProblem, generate_gemm, host_isas, pack_b
from graphmode.backends.cpu.conv import ConvConfig, ConvProblem, conv_config, conv_problem_of
from graphmode.backends.cpu.epilogue import Epilogue
from graphmode.backends.cpu.im2col import Im2colConfig
from graphmode.backends.cpu.im2col import gemm_problem as im2col_gemm
from graphmode.backends.cpu.winograd import WinogradConfig, chunk_for, geometry
from graphmode.backends.cpu.winograd import gemm_problem as winograd_gemm
from graphmode.errors import BackendError

log = logging.getLogger("graphmode.cpu.tactics")

POLICIES = ("latency_first", "throughput_first", "heuristic")
CACHE_VERSION = 1
ATEN = "aten"
TOLERANCE_F32 = 1e-5
WINOGRAD_TILES = (4, 2)   # F(4x4, 3x3) first: 4x fewer multiplies; F(2x2) for small images / many channels
NOISY = 1.5        # median/min of the timing samples above which a measurement counts as noisy
MARGIN_CAP = 20.0  # a margin between two candidates of one shape beyond this is shown as "> 20x", suspect
CALIBRATION_CALLS = 3   # back-to-back calls whose fastest sets a candidate's calls per sample

# generated configurations per ISA, best-first for the heuristic (measured on the 16-row
# GEMMs of MiniLM / GPT-2 and 128-row ones, Zen 4, 1 and 2 threads)
# (the `serial` variants run on the calling thread only: on a shared machine whose other CPU
# is busy, an OpenMP region over a 30-100 us GEMM can wait out its second thread's
# preemption; the timing decides whether that happens here)
CONFIGS: dict[str, tuple[GemmConfig, ...]] = {
    "avx512": (GemmConfig("avx512", 8, 32), GemmConfig("avx512", 8, 32, par="serial"),
               GemmConfig("avx512", 8, 48, 256), GemmConfig("avx512", 8, 48, 256, par="serial"),
               GemmConfig("avx512", 6, 64, 256), GemmConfig("avx512", 12, 32, 256, 96)),
    "avx2": (GemmConfig("avx2", 6, 16), GemmConfig("avx2", 6, 16, par="serial"), GemmConfig("avx2", 4, 24, 256),
             GemmConfig("avx2", 6, 16, 256, 72)),
    "portable": (GemmConfig("portable", 4, 16, 256), GemmConfig("portable", 4, 16, 256, par="serial")),
}


@dataclass
class Selection:
    """What tactic selection decided for one GEMM shape (one row of the compile report)."""

    problem: GemmProblem
    winner: str
    policy: str
    timings_s: dict[str, float] = field(default_factory=dict)   # the statistic the policy compared, seconds
    rejected: dict[str, str] = field(default_factory=dict)      # candidate -> why it may not win
    from_cache: bool = False
    timed: bool = False
    tune_s: float = 0.0
    uses: int = 0                                               # plan steps with this shape
    noisy: bool = False                                         # timed while the machine was busy
    medians_s: dict[str, float] = field(default_factory=dict)   # median seconds per candidate (for reports)
    mins_s: dict[str, float] = field(default_factory=dict)      # fastest sample per candidate (its spread)
    load: float | None = None                                   # 1-minute load average when it was timed
    cores: int | None = None                                    # CPUs this process could use then

    @property
    def config(self) -> GemmConfig | ConvConfig | None:
        if self.winner == ATEN:
            return None
        return conv_config(self.winner) if isinstance(self.problem, ConvProblem) else GemmConfig.parse(self.winner)

    @property
    def speedup_vs_aten(self) -> float | None:
        """ATen's time / the winner's, as measured (see `margin` before printing it)."""
        t, a = self.timings_s.get(self.winner), self.timings_s.get(ATEN)
        return a / t if t and a else None

    @property
    def runner_up(self) -> str | None:
        others = {k: v for k, v in self.timings_s.items() if k != self.winner}
        return min(others, key=others.get) if others else None

    @property
    def margin_vs_runner_up(self) -> float | None:
        """Runner-up median / winner median (>= 1 under latency_first), as measured."""
        t, r = self.timings_s.get(self.winner), self.runner_up
        return self.timings_s[r] / t if t and r else None

    def margin(self, slower: str | None) -> Margin | None:
        """How much faster the winner timed than candidate `slower`, with the reasons to doubt it:
        a ratio of two numbers is only as good as the worse of them."""
        t = self.timings_s.get(self.winner)
        a = self.timings_s.get(slower) if slower else None
        if not t or not a or slower == self.winner:
            return None
        return Margin(a / t, tuple(timing_doubts(self, (slower, self.winner))))

    def gflops(self, name: str | None = None) -> float | None:
        t = self.timings_s.get(name or self.winner)
        return self.problem.flops / t / 1e9 if t else None

    def to_json(self) -> dict:
        vs_aten = self.margin(ATEN) if self.winner != ATEN else None
        vs_next = self.margin(self.runner_up)
        return {"gemm": self.problem.text, "shape": self.problem.key(), "winner": self.winner,
                "policy": self.policy, "uses": self.uses, "from_cache": self.from_cache, "timed": self.timed,
                "timings_us": {k: round(v * 1e6, 2) for k, v in sorted(self.timings_s.items(), key=lambda kv: kv[1])},
                "medians_us": {k: round(v * 1e6, 2) for k, v in sorted(self.medians_s.items(), key=lambda kv: kv[1])},
                "mins_us": {k: round(v * 1e6, 2) for k, v in sorted(self.mins_s.items(), key=lambda kv: kv[1])},
                "gflops": round(self.gflops() or 0.0, 2) or None,
                "speedup_vs_aten": _r(vs_aten.value) if vs_aten else None,
                "margin_vs_runner_up": _r(vs_next.value) if vs_next else None,
                "margins": {k: m.to_json() for k, m in (("aten", vs_aten), ("runner_up", vs_next)) if m},
                "runner_up": self.runner_up, "load": self.load, "cores": self.cores,
                "rejected": dict(self.rejected), "tune_s": round(self.tune_s, 3), "noisy": self.noisy}

    def text(self) -> str:
        s = f"{self.problem.text}: {self.winner}"
        vs_aten = self.margin(ATEN)
        vs_next = self.margin(self.runner_up)
        if vs_aten is not None:
            s += f" ({vs_aten.text('aten')}"
            g = self.gflops()
            s += f", {g:.1f} GFLOP/s)" if g else ")"
        elif self.winner == ATEN and vs_next is not None:
            s += f" ({vs_next.text('the best generated kernel')})"
        if self.from_cache:
            s += " [timing cache]"
        return s


@dataclass(frozen=True)
class Margin:
    """The winner's time against another candidate's, as the compile report states it: beyond
    MARGIN_CAP it is shown as "> 20x, baseline suspect" (two kernels of one shape, both
    checked against ATen, do not differ 1000-fold; a baseline that waited out the scheduler
    does), and any doubt about either timing is said next to it."""

    measured: float
    suspect: tuple[str, ...] = ()

    @property
    def capped(self) -> bool:
        return self.measured > MARGIN_CAP

    @property
    def value(self) -> float:
        return min(self.measured, MARGIN_CAP)

    def to_json(self) -> dict:
        return {"measured": _r(self.measured), "shown": _r(self.value), "capped": self.capped,
                "suspect": list(self.suspect)}

    def text(self, against: str) -> str:
        return margin_text(self.to_json(), against)


def margin_text(m: Mapping[str, Any], against: str) -> str:
    """`1.52x vs aten`, `1.52x vs aten (suspect: ...)` or `> 20x vs aten, baseline suspect (...)`."""
    why = "; ".join(m.get("suspect") or ())
    if m.get("capped"):
        return f"> {MARGIN_CAP:g}x vs {against}, baseline suspect" + (f" ({why})" if why else "")
    return f"{m['measured']:.2f}x vs {against}" + (f" (suspect: {why})" if why else "")


def timing_doubts(sel: Selection, names: Sequence[str]) -> list[str]:
    """Why the timings of `names` in `sel` may not be measurements of the kernels: their samples
    disagree (median/min above NOISY: some waited out another process's time slice), the
    machine's load exceeded its cores while they were taken, or the entry was marked noisy."""
    out = []
    for n in dict.fromkeys(names):
        med, lo = sel.medians_s.get(n), sel.mins_s.get(n)
        if med and lo and med / lo > NOISY:
            out.append(f"{n} samples {_us(lo)}..{_us(med)} (median/min {med / lo:.1f})")
    if sel.load is not None and sel.cores and sel.load > sel.cores:
        out.append(f"timed at load {sel.load:.1f} on {sel.cores} cores")
    elif sel.noisy and not out:
        out.append("timed while the machine was busy")
    return out


def _us(s: float) -> str:
    us = s * 1e6
    return f"{us / 1e3:.3g} ms" if us >= 1e3 else f"{us:.3g} us"


def _machine_load() -> tuple[float | None, int]:
    """(1-minute load average, CPUs this process may use): timings taken with more runnable
    threads than CPUs measure the scheduler, not the kernel."""
    from graphmode.targets.host import load_average, usable_cores
    load = load_average()
    return (load[0] if load else None), usable_cores()


def _r(x: float | None) -> float | None:
    return round(x, 3) if x is not None else None


@dataclass
class FusedEpilogue:
    """An epilogue offered to a GEMM/conv step (backends/cpu/provider.py): the generated
    candidates apply `epi` at their store and write `out`; ATen runs its GEMM and then `run`
    (the group's own epilogue kernel over the GEMM buffer)."""

    epi: Epilogue
    operands: list[torch.Tensor]
    out: torch.Tensor
    run: Callable[[], None]


class GemmStep:
    """A plan step for one GEMM. Runs `fn`: ATen until tuning switches it to the winner.
    With a fused epilogue `c` is the group's output, `ops` the epilogue operands, and the
    ATen default runs the GEMM and then the epilogue kernel."""

    __slots__ = ("fn", "default", "problem", "a", "b", "bias", "c", "keep", "tactic", "ops", "epilogue_run")

    def __init__(self, default: Callable[[], None], problem: GemmProblem, a, b, bias, c,
                 fused: FusedEpilogue | None = None):
        self.problem = problem
        self.a, self.b, self.bias, self.c = a, b, bias, c
        self.keep: tuple = ()
        self.tactic = ATEN
        self.ops: list[torch.Tensor] = list(fused.operands) if fused is not None else []
        self.epilogue_run = fused.run if fused is not None else None
        if fused is not None:
            run = fused.run

            def default_then_epilogue() -> None:
                default()
                run()
            self.fn = self.default = default_then_epilogue
        else:
            self.fn = self.default = default

    @property
    def fused_epilogue(self) -> bool:
        return self.epilogue_run is not None

    def __call__(self) -> None:
        self.fn()


class ConvStep(GemmStep):
    """A plan step for one conv2d (a `ConvProblem`; `a` the input, `b` the constant weight,
    `c` the output): ATen until tuning switches it to a generated kernel."""

    __slots__ = ()


# ------------------------------------------------------------------------------ the problem

def problem_of(op: str, ins_t: Sequence[torch.Tensor], outs: Sequence[torch.Tensor],
               constant_ptrs: Mapping[int, Any] | set[int] | None = None) -> GemmProblem | None:
    """The GEMM an executor step computes, or None when only ATen can run it (non-f32,
    non-contiguous buffers, broadcast batch dims, a linear weight that is not a constant)."""
    y = outs[0]
    tensors = list(ins_t) + [y]
    if any(t.dtype != torch.float32 or not t.is_contiguous() or t.device.type != "cpu" for t in tensors):
        return None
    consts = constant_ptrs or ()
    if op == "linear":
        x, w = ins_t[0], ins_t[1]
        if w.dim() != 2 or x.dim() < 1 or w.data_ptr() not in consts:
            return None
        n, k = w.shape
        if x.shape[-1] != k or k == 0 or n == 0 or x.numel() == 0 or y.numel() != x.numel() // k * n:
            return None
        if len(ins_t) > 2 and (ins_t[2].dim() != 1 or ins_t[2].shape[0] != n):
            return None
        return GemmProblem("linear", 1, x.numel() // k, n, k, bias=len(ins_t) > 2, b_packed=True)
    if op == "matmul" and len(ins_t) == 2:
        x, w = ins_t
        if x.dim() < 2 or w.dim() < 2:
            return None
        k, n = w.shape[-2], w.shape[-1]
        if x.shape[-1] != k or 0 in (k, n) or x.numel() == 0:
            return None
        if w.dim() == 2:
            m = x.numel() // k
            if y.numel() != m * n:
                return None
            return GemmProblem("matmul", 1, m, n, k, b_packed=w.data_ptr() in consts)
        if x.dim() == w.dim() and x.shape[:-2] == w.shape[:-2]:
            batch = math.prod(x.shape[:-2])
            m = x.shape[-2]
            if tuple(y.shape) != tuple(x.shape[:-1]) + (n,):
                return None
            return GemmProblem("matmul", batch, m, n, k, b_packed=False, b_batched=True)
    return None


# ------------------------------------------------------------------------------- the context

class TacticsContext:
    """Tactic selection for the GEMMs of one executable (and its timing cache).

    `cache_dir`: the timing cache folder (None: no persistence). `threads`: the plan's thread
    count (kernels are built for it and timed with it). `simd`/`target`: the ISA flags the
    candidates are drawn from (default: the `host` target). `builder`: the KernelBuilder
    (default: the shared one for the default kernel folder and `threads`). `cold`: time
    constant weights rotated through more copies than the LLC holds (weights of a model
    larger than the cache are not cache-resident when the plan runs); None = decide at
    `finalize()`: cold when the plan's GEMM weights together exceed the LLC. `configs`: override the
    generated configurations (ISA -> list). Timing: at least `reps` samples per candidate,
    each of >= `sample_s` seconds of back-to-back calls, and more samples (up to 8x `reps`)
    until `budget_s` per candidate; `statistic` is what the policy compares: `median`
    (default) or `min` of the samples. The median is deliberate: on a shared machine a
    2-thread call whose second thread is preempted waits out a scheduler time slice (4-8 ms
    here, against 20-500 us of work); a candidate that suffers that in most samples should
    lose to the serial one, which the fastest sample would hide. Both are reported. A timing
    taken while the machine was that busy (median/min of the samples above NOISY for most
    candidates) is cached as `noisy` and measured again by the next `retune_noisy` plan
    builds, so one load spike does not decide a shape for good.
    """

    def __init__(self, cache_dir: str | Path | None, threads: int | None = None, *, policy: str = "latency_first",
                 target: Any = None, simd: Sequence[str] | None = None, builder: Any = None,
                 cold: bool | None = None, llc_bytes: int | None = None, reps: int = 5,
                 configs: Mapping[str, Sequence[GemmConfig]] | None = None, tolerance: float = TOLERANCE_F32,
                 statistic: str = "median", sample_s: float = 5e-4, budget_s: float = 0.01,
                 retune_noisy: int = 2, seed: int = 0):
        if policy not in POLICIES:
            raise BackendError(f"unknown kernel selection policy {policy!r}", where="codegen.kernel_selection",
                               value=policy, fix=f"one of {', '.join(POLICIES)}")
        if statistic not in _STATS:
            raise BackendError(f"unknown timing statistic {statistic!r}", value=statistic, fix="min or median")
        self.statistic = statistic
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None
        self.threads = int(threads or torch.get_num_threads())
        self.policy = policy
        self._target, self._simd, self._llc = target, simd, llc_bytes
        self._builder = builder
        self.cold = cold        # None: decided at finalize (the plan's GEMM weights exceed the LLC)
        self.reps = max(1, int(reps))
        self.sample_s = float(sample_s)
        self.budget_s = float(budget_s)
        self.retune_noisy = int(retune_noisy)
        self.tolerance = tolerance
        self.seed = seed
        self.configs = {k: tuple(v) for k, v in (configs or CONFIGS).items()}
        self.constant_ptrs: set[int] = set()
        self.steps: list[GemmStep] = []
        self._pending: list[GemmStep] = []
        self.selections: list[Selection] = []
        self.packed: dict[tuple, _Packed] = {}   # the winners' packed weights this context keeps alive
        self._scratch: dict[tuple, Any] = {}      # packs and references while one plan is tuned
        self._workspaces: dict[tuple, torch.Tensor] = {}   # Winograd scratch of the bound conv steps
        self.stats = {"timed_shapes": 0, "timing_runs": 0, "cache_hits": 0, "cache_misses": 0, "checks": 0,
                      "rejected": 0, "tune_s": 0.0, "build_s": 0.0}
        self.failures: dict[str, str] = {}

    # ---- setup -----------------------------------------------------------------------------
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
        self._resolve()
        return sorted(self._simd)

    @property
    def llc_bytes(self) -> int:
        self._resolve()
        return int(self._llc)

    @property
    def target_id(self) -> str:
        return _target_identity(self._target, self.simd)

    @property
    def builder(self):
        if self._builder is None:
            from graphmode.backends.cpu.provider import builder_for
            self._builder = builder_for(None, self.threads)
        return self._builder

    def add_constants(self, tensors: Mapping[str, torch.Tensor] | Sequence[torch.Tensor]) -> None:
        """Declare the plan's constant tensors: only these may be packed ahead of time."""
        vals = tensors.values() if isinstance(tensors, Mapping) else tensors
        self.constant_ptrs.update(t.data_ptr() for t in vals)

    def generated_available(self) -> bool:
        try:
            return bool(self.builder.compiler_available())
        except Exception:  # noqa: BLE001 - a broken toolchain only means "ATen only"
            return False

    def candidates(self, p: GemmProblem) -> list[str]:
        """Candidate names for a problem: ATen, then the host ISA's generated configurations."""
        out = [ATEN]
        if p.dtype != "f32" or not self.generated_available():
            return out
        if isinstance(p, ConvProblem):
            return out + self._conv_candidates(p)
        isa = host_isas(self.simd)[0]
        for cfg in self.configs.get(isa, ()):
            if cfg.registers > _registers(isa, self.simd) and isa != "portable":
                continue
            # blockings this shape does not feel are the same kernel: keep one of them
            one = self.threads == 1 or p.flops < PAR_FLOPS
            eff = GemmConfig(cfg.isa, cfg.mr, cfg.nr, cfg.kc if cfg.kc < p.k else 0,
                             cfg.mc if cfg.mc < p.m else 0, cfg.split if p.n > cfg.nr and not one else 1,
                             "serial" if one else cfg.par)
            if p.epi is not None and p.c_aliases_operand and eff.kc:
                continue      # partial sums in C would overwrite the operand it shares memory with
            if eff.name not in out:
                out.append(eff.name)
        return out

    def _conv_candidates(self, p: ConvProblem) -> list[str]:
        """For 3x3 stride 1: Winograd F(4x4) and F(2x2), each as whole-image passes (GEMMs
        parallel over tile positions) and tile-blocked (when there are blocks for every
        thread); then im2col for any ungrouped conv. One GEMM blocking each (the host ISA's
        first): every candidate is a compiled kernel, and compile time counts."""
        isa = host_isas(self.simd)[0]
        cfgs = [c for c in self.configs.get(isa, ()) if c.par == "omp"
                and (c.registers <= _registers(isa, self.simd) or isa == "portable")]
        if not cfgs:
            return []
        base = cfgs[0]
        out: list[str] = []

        def fit(g: GemmProblem, serial: bool = False) -> GemmConfig:
            one = serial or self.threads == 1 or g.flops < PAR_FLOPS
            return GemmConfig(base.isa, base.mr, base.nr, base.kc if base.kc < g.k else 0,
                              base.mc if base.mc < g.m else 0, base.split if g.n > base.nr and not one else 1,
                              "serial" if one else base.par)
        if p.winograd_ok:
            for m in WINOGRAD_TILES:
                out.append(WinogradConfig(m, fit(winograd_gemm(p, m))).name)
                chunk = chunk_for(p, m, base.mr)
                if self.threads > 1 and geometry(p, m).t >= chunk * self.threads:
                    out.append(WinogradConfig(m, fit(winograd_gemm(p, m, chunk), serial=True), chunk,
                                              self.threads).name)
        out.append(Im2colConfig(fit(im2col_gemm(p))).name)
        return out

    # ---- the executor's side ---------------------------------------------------------------
    def request(self, op: str, ins_t: Sequence[torch.Tensor], outs: Sequence[torch.Tensor],
                default: Callable[[], None], epilogue: FusedEpilogue | None = None) -> Callable[[], None]:
        """A step for this GEMM: a `GemmStep` tuned at `finalize()`, or `default` when only ATen
        can run it. With `epilogue`, a step that takes it has `fused_epilogue` set (it then
        runs the epilogue too); one that cannot comes back without it."""
        p = problem_of(op, ins_t, outs, self.constant_ptrs)
        if p is None:
            return default
        bias = ins_t[2] if op == "linear" and len(ins_t) > 2 else None
        c = outs[0]
        if epilogue is not None and p.batch == 1 and _fusable(p.m * p.n, epilogue):
            p = replace(p, epi=epilogue.epi, c_aliases_operand=_overlaps(epilogue.out, epilogue.operands))
            c = epilogue.out
        else:
            epilogue = None
        return self._enqueue(GemmStep(default, p, ins_t[0], ins_t[1], bias, c, epilogue))

    def _enqueue(self, step: GemmStep) -> GemmStep:
        self.steps.append(step)
        self._pending.append(step)
        return step

    def request_conv(self, ins_t: Sequence[torch.Tensor], outs: Sequence[torch.Tensor], attrs: Mapping,
                     default: Callable[[], None], epilogue: FusedEpilogue | None = None) -> Callable[[], None]:
        """A step for this conv2d: a `ConvStep` tuned at `finalize()`, or `default` when no
        generated kernel covers it (then it stays ATen without any timing)."""
        p = conv_problem_of(ins_t, outs, attrs, self.constant_ptrs)
        if p is None or p.groups != 1:
            return default
        bias = ins_t[2] if len(ins_t) > 2 else None
        c = outs[0]
        if epilogue is not None and _fusable(c.numel(), epilogue):
            p = replace(p, epi=epilogue.epi)     # conv kernels read each operand element before writing it
            c = epilogue.out
        else:
            epilogue = None
        return self._enqueue(ConvStep(default, p, ins_t[0], ins_t[1], bias, c, epilogue))

    def finalize(self) -> list[Selection]:
        """Tune every distinct GEMM shape requested since the last call and switch each of
        those steps to its winner; returns the new selections."""
        pending, self._pending = self._pending, []
        if not pending:
            return []
        by_problem: dict[GemmProblem, list[GemmStep]] = {}
        for s in pending:
            by_problem.setdefault(s.problem, []).append(s)
        if self.cold is None:
            weights = {(s.b.data_ptr(), s.b.numel()) for s in pending if s.problem.b_packed}
            self.cold = sum(n for _, n in weights) * 4 > self.llc_bytes
        new: list[Selection] = []
        kernels = self._build({p: self._sources(p, self.candidates(p)) for p in by_problem})
        try:
            for p, steps in by_problem.items():
                sel = self._select(p, steps[0], kernels)
                sel.uses = len(steps)
                self.selections.append(sel)
                new.append(sel)
                for s in steps:
                    self._bind(s, sel, kernels)
                self._scratch.clear()
        finally:
            self._scratch.clear()
        return new

    def select(self, p: GemmProblem, *, b: torch.Tensor | None = None) -> Selection:
        """Tune one problem on its own (no executor): B is `b` or random. For tests/tools."""
        gen = torch.Generator().manual_seed(self.seed + 1)
        if b is None:
            if p.op == "linear":
                b = torch.randn(p.n, p.k, generator=gen)
            elif p.b_batched:
                b = torch.randn(p.batch, p.k, p.n, generator=gen)
            else:
                b = torch.randn(p.k, p.n, generator=gen)
        a = torch.randn(p.batch, p.m, p.k, generator=gen)
        c = torch.empty(p.batch, p.m, p.n)
        bias = torch.randn(p.n, generator=gen) if p.bias else None
        if p.b_packed:
            self.constant_ptrs.add(b.data_ptr())
        op_ins = [a if p.batch > 1 else a.view(p.m, p.k), b] + ([bias] if bias is not None else [])
        out = c if p.batch > 1 else c.view(p.m, p.n)
        step = GemmStep(aten_fn(p.op, op_ins, out), p, op_ins[0], b, bias, out)
        if self.cold is None:
            self.cold = b.numel() * 4 > self.llc_bytes if p.b_packed else False
        kernels = self._build({p: self._sources(p, self.candidates(p))})
        try:
            sel = self._select(p, step, kernels)
        finally:
            self._scratch.clear()
        sel.uses = 1
        self.selections.append(sel)
        return sel

    # ---- compilation -------------------------------------------------------------------------
    def _sources(self, p: GemmProblem, names: Sequence[str]) -> dict[str, Any]:
        out = {}
        for name in names:
            if name == ATEN:
                continue
            try:
                if isinstance(p, ConvProblem):
                    out[name] = conv_config(name).generate(p, self.threads)
                else:
                    out[name] = generate_gemm(p, GemmConfig.parse(name), self.threads)
            except BackendError as e:
                out[name] = e
        return out

    def _build(self, sources: Mapping[GemmProblem, Mapping[str, Any]]) -> dict[tuple[GemmProblem, str], Any]:
        """Compile the candidates into one library; (problem, name) -> kernel or the error text.
        Under the heuristic policy only the candidates it could pick are built."""
        t0 = time.perf_counter()
        want: dict[tuple[GemmProblem, str], Any] = {}
        for p, per in sources.items():
            names = list(per)
            if self.policy == "heuristic":
                names = names[:1]
            for name in names:
                want[(p, name)] = per[name]
        srcs = [s for s in want.values() if not isinstance(s, Exception)]
        built: dict[str, Any] = {}
        if srcs:
            try:
                built = self.builder.build_many(srcs, strict=False)
            except BackendError as e:
                log.warning("generated GEMM kernels do not build; ATen runs every GEMM: %s", e.message)
                built = {}
                self.failures["*"] = e.message
        out: dict[tuple[GemmProblem, str], Any] = {}
        for key, s in want.items():
            if isinstance(s, Exception):
                out[key] = str(s)
            elif s.symbol in built:
                out[key] = (built[s.symbol], s)
            else:
                out[key] = getattr(self.builder, "failures", {}).get(s.symbol) or self.failures.get("*", "not built")
        self.stats["build_s"] += time.perf_counter() - t0
        return out

    # ---- selection -----------------------------------------------------------------------------
    def cache_key(self, p: GemmProblem, names: Sequence[str], kernels: Mapping) -> dict:
        srcs = {}
        for n in names:
            k = kernels.get((p, n))
            srcs[n] = k[1].symbol if isinstance(k, tuple) else None
        return {"version": CACHE_VERSION, "target": self.target_id, "compiler": self._compiler_id(),
                "threads": self.threads, "cold": self.cold, "statistic": self.statistic, **p.key(),
                "candidates": srcs}

    def _compiler_id(self) -> str:
        try:
            b = self.builder
            return f"{b.compiler} {' '.join(b.flags)}" if b.compiler_available() else "none"
        except Exception:  # noqa: BLE001
            return "none"

    def _select(self, p: GemmProblem, step: GemmStep, kernels: Mapping) -> Selection:
        t0 = time.perf_counter()
        names = self.candidates(p)
        if self.policy == "heuristic":
            sel = self._heuristic(p, names, step, kernels)
            sel.tune_s = time.perf_counter() - t0
            return sel
        key = self.cache_key(p, names, kernels)
        cached = self._cache_get(key)
        tries = 1
        if cached is not None and cached["noisy"] and cached["tries"] <= self.retune_noisy:
            log.info("timing cache entry for %s was measured on a busy machine; measuring again", p.text)
            tries = cached["tries"] + 1
            cached = None
        if cached is not None:
            sel = Selection(p, ATEN, self.policy, dict(cached["timings_s"]), dict(cached["rejected"]),
                            from_cache=True, medians_s=dict(cached["medians_s"]), noisy=cached["noisy"],
                            mins_s=dict(cached["mins_s"]), load=cached["load"], cores=cached["cores"])
            sel.winner = self._pick(p, sel.timings_s)
            # a stale cache must not hand out a wrong kernel: the winner is checked again (one run)
            if sel.winner == ATEN or self._check(p, sel.winner, step, kernels) is None:
                self.stats["cache_hits"] += 1
                sel.tune_s = time.perf_counter() - t0
                return sel
            log.warning("timing cache entry for %s names %s, which now fails its check; tuning again",
                        p.text, sel.winner)
        self.stats["cache_misses"] += 1
        sel = Selection(p, ATEN, self.policy, timed=True)
        for name in names[1:]:
            err = self._check(p, name, step, kernels)
            if err is not None:
                sel.rejected[name] = err[:500]
                self.stats["rejected"] += 1
        keep: list = []   # the timing buffers live until the timing is done
        samples = self._time(self._timing_fns(p, names, step, kernels, sel.rejected, keep))
        del keep
        sel.load, sel.cores = _machine_load()
        sel.timings_s = {n: _STATS[self.statistic](v) for n, v in samples.items()}
        sel.medians_s = {n: statistics.median(v) for n, v in samples.items()}
        self.stats["timed_shapes"] += 1
        sel.winner = self._pick(p, sel.timings_s)
        mins = sel.mins_s = {n: min(v) for n, v in samples.items() if v}
        ratios = sorted(sel.medians_s[n] / mins[n] for n in mins if mins[n] > 0)
        # noisy (measured again by the next builds): most candidates' samples disagree, or the ATen
        # baseline's alone do (every margin is stated against it), or the machine was overloaded
        sel.noisy = bool(ratios) and ratios[len(ratios) // 2] > NOISY or bool(timing_doubts(sel, (ATEN,)))
        self._cache_put(key, {"timings_s": sel.timings_s, "medians_s": sel.medians_s, "rejected": sel.rejected,
                              "noisy": sel.noisy, "tries": tries, "mins_s": sel.mins_s, "load": sel.load,
                              "cores": sel.cores})
        sel.tune_s = time.perf_counter() - t0
        self.stats["tune_s"] += sel.tune_s
        return sel

    def _pick(self, p: GemmProblem, timings: Mapping[str, float]) -> str:
        if not timings:
            return ATEN
        if self.policy == "throughput_first":
            return max(timings, key=lambda n: (p.flops / timings[n], n == ATEN))
        return min(timings, key=lambda n: (timings[n], n != ATEN))

    def _heuristic(self, p: GemmProblem, names: Sequence[str], step: GemmStep, kernels: Mapping) -> Selection:
        sel = Selection(p, ATEN, "heuristic")
        for name in names[1:2]:          # the first generated configuration, if any
            k = kernels.get((p, name))
            err = self._check(p, name, step, kernels) if isinstance(k, tuple) else f"does not build: {k}"
            if err is None:
                sel.winner = name
            else:
                sel.rejected[name] = err
        return sel

    # ---- correctness ----------------------------------------------------------------------------
    def _operands(self, p: GemmProblem, step: GemmStep):
        """Random A (and B when it is not a constant), the real weight and bias otherwise."""
        gen = torch.Generator().manual_seed(self.seed)
        a = torch.randn(p.batch, p.m, p.k, generator=gen)
        b = step.b if p.b_packed else torch.randn(_b_shape(p), generator=gen)
        bias = step.bias
        return a, b, bias

    def _reference(self, p: GemmProblem, a, b, bias) -> torch.Tensor:
        c = torch.empty(p.batch, p.m, p.n)
        aten_fn(p.op, _op_inputs(p, a, b, bias), _op_output(p, c))()
        return c

    def _check(self, p: GemmProblem, name: str, step: GemmStep, kernels: Mapping) -> str | None:
        """None when candidate `name` matches ATen on random data, else why not."""
        from graphmode.verify.numerics import rel_l2
        k = kernels.get((p, name))
        if not isinstance(k, tuple):
            return f"does not build: {k}"
        self.stats["checks"] += 1
        if isinstance(p, ConvProblem):
            return self._check_conv(p, name, step, k[0])
        memo = ("reference", p, step.b.data_ptr())    # one ATen run per shape, shared by the candidates
        if memo not in self._scratch:
            a, b, bias = self._operands(p, step)
            self._scratch[memo] = (a, b, bias, self._reference(p, a, b, bias))
        a, b, bias, ref = self._scratch[memo]
        cfg = GemmConfig.parse(name)
        bk = self._pack(b, p, cfg.nr) if p.b_packed else b.contiguous()
        c = torch.full((p.batch, p.m, p.n), float("nan"))
        ops: list[torch.Tensor] = []
        if p.epi is not None:
            ops, ref = self._epilogue_reference(p, step, ref)
        try:
            k[0]([a.data_ptr(), bk.data_ptr()] + ([bias.data_ptr()] if p.bias else []) + [t.data_ptr() for t in ops]
                 + [c.data_ptr()])
        except Exception as e:  # noqa: BLE001
            return f"raised {type(e).__name__}: {e}"
        err = rel_l2(c, ref)
        if not err < self.tolerance:
            return f"rel L2 {err:.2e} vs ATen exceeds {self.tolerance:.0e}"
        return None

    def _epilogue_reference(self, p, step, acc: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Random epilogue operands (the plan's buffers hold whatever ran last) and the
        reference epilogue over the reference GEMM/conv result `acc`."""
        memo = ("epilogue", p, step.b.data_ptr())
        if memo not in self._scratch:
            gen = torch.Generator().manual_seed(self.seed + 3)
            ops = [torch.randn(tuple(t.shape), generator=gen) for t in step.ops]
            with torch.inference_mode():
                ref = p.epi.reference(acc.reshape(step.c.shape), ops)
            self._scratch[memo] = (ops, ref.reshape(acc.shape).contiguous())
        return self._scratch[memo]

    def _pack(self, w: torch.Tensor, p: GemmProblem, nr: int) -> torch.Tensor:
        """`w` packed for panels of `nr` (memoised while one plan is tuned: the checks, the
        timing and the winner's binding share one packing per weight and panel width)."""
        key = (w.data_ptr(), tuple(w.shape), nr, p.op)
        got = self._scratch.get(key)
        if got is None:
            got = self._scratch[key] = pack_b(w, nr, transposed=(p.op == "linear"))
        return got

    # ---- timing -----------------------------------------------------------------------------------
    def _timing_fns(self, p: GemmProblem, names: Sequence[str], step: GemmStep, kernels: Mapping,
                    rejected: Mapping[str, str], keep: list) -> dict[str, Callable[[], None]]:
        """One closure per candidate that may win (checked already). With `cold`, every call
        reads its weight from the next of enough copies to stream 2x the LLC between two uses
        of one copy. Timing is data-independent, so all candidates share one set of copies
        (each reads it in its own layout: ATen as [N, K], a kernel as its panels); only the
        first copy holds the real weight in every layout's place."""
        if isinstance(p, ConvProblem):
            return self._conv_timing_fns(p, names, step, kernels, rejected, keep)
        gen = torch.Generator().manual_seed(self.seed + 2)
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
            b = torch.randn(_b_shape(p), generator=gen)
            keep.append(b)
            fns[ATEN] = aten_fn(p.op, _op_inputs(p, a, b, bias), _op_output(p, c))
            if step.epilogue_run is not None:
                fns[ATEN] = _then(fns[ATEN], step.epilogue_run)
            for name in live:
                fns[name] = kernels[(p, name)][0].bind([a.data_ptr(), b.data_ptr(), *extra, c.data_ptr()])
            return fns
        packs = {GemmConfig.parse(n).nr: self._pack(step.b, p, GemmConfig.parse(n).nr) for n in live}
        copies = 1
        if self.cold:
            copies = max(1, math.ceil(2 * self.llc_bytes / max(step.b.numel() * 4, 1)))
        slots: list[torch.Tensor] = []
        if copies > 1:
            width = max([step.b.numel()] + [t.numel() for t in packs.values()])
            pool = torch.empty(copies - 1, width)
            src = next(iter(packs.values()), step.b).reshape(-1)
            pool[:, :src.numel()].copy_(src.unsqueeze(0).expand(copies - 1, src.numel()))
            pool[:, src.numel():].zero_()
            keep.append(pool)
            slots = list(pool.unbind(0))
        wshape = tuple(step.b.shape)
        bs = [step.b] + [t[:step.b.numel()].view(wshape) for t in slots]
        fns[ATEN] = _rotate([aten_fn(p.op, _op_inputs(p, a, b, bias), _op_output(p, c)) for b in bs])
        if step.epilogue_run is not None:
            fns[ATEN] = _then(fns[ATEN], step.epilogue_run)
        for name in live:
            kern = kernels[(p, name)][0]
            bks = [packs[GemmConfig.parse(name).nr]] + slots
            fns[name] = _rotate([kern.bind([a.data_ptr(), bk.data_ptr(), *extra, c.data_ptr()]) for bk in bks])
        return fns

    def _time(self, fns: Mapping[str, Callable[[], None]]) -> dict[str, list[float]]:
        """Seconds per call of each closure, one list of samples each: a warm-up call, then
        interleaved round-robin samples (see the class doc for their count and length), the
        start candidate rotating so that drift of a shared machine hits every candidate alike.
        The calls per sample come from the fastest of CALIBRATION_CALLS back-to-back calls:
        from one call, a candidate whose call happened to wait out a time slice (a 2-thread
        ATen GEMM of 8 KFLOP took 15 ms at load 5 on 2 cores) got samples of one call each,
        against 1000-call samples of the others, and a "36892x vs aten" margin."""
        names = list(fns)
        inner: dict[str, int] = {}
        longest = 0.0
        for n in names:
            fns[n]()
            dt = math.inf
            for _ in range(CALIBRATION_CALLS):
                t0 = time.perf_counter()
                fns[n]()
                dt = min(dt, max(time.perf_counter() - t0, 1e-7))
            inner[n] = max(1, min(1000, int(self.sample_s / dt)))
            longest = max(longest, dt * inner[n])
        reps = max(self.reps, min(8 * self.reps, int(self.budget_s / max(longest, 1e-6))))
        samples: dict[str, list[float]] = {n: [] for n in names}
        with torch.inference_mode():
            for r in range(reps):
                for j in range(len(names)):
                    n = names[(r + j) % len(names)]
                    f, calls = fns[n], inner[n]
                    t0 = time.perf_counter()
                    for _ in range(calls):
                        f()
                    samples[n].append((time.perf_counter() - t0) / calls)
                    self.stats["timing_runs"] += 1
        return samples

    # ---- binding ----------------------------------------------------------------------------------
    def _bind(self, step: GemmStep, sel: Selection, kernels: Mapping) -> None:
        if sel.winner == ATEN:
            step.fn, step.tactic = step.default, ATEN
            return
        k = kernels.get((step.problem, sel.winner))
        if not isinstance(k, tuple):   # cannot happen after a passing check; stay correct anyway
            step.fn, step.tactic = step.default, ATEN
            return
        p = step.problem
        if isinstance(p, ConvProblem):
            self._bind_conv(step, sel.winner, k[0])
            return
        cfg = GemmConfig.parse(sel.winner)
        if p.b_packed:
            bk = self._packed_weight(step.b, p, cfg.nr)
        else:
            bk = step.b
        extra = [step.bias] if p.bias else []
        bufs = [step.a, bk, *extra, *step.ops, step.c]
        step.keep = tuple(bufs)
        step.fn = k[0].bind([t.data_ptr() for t in bufs])
        step.tactic = sel.winner

    def _packed_weight(self, w: torch.Tensor, p: GemmProblem, nr: int) -> torch.Tensor:
        """The winner's packed copy of constant `w`, shared process-wide: the executables of
        one model's buckets (same constants) hold one copy, not one each."""
        key = (w.data_ptr(), tuple(w.shape), tuple(w.stride()), w._version, nr, p.op)
        holder = self.packed.get(key)
        if holder is None:
            holder = _PACKED.get(key)
        if holder is None:
            t = self._scratch.pop(key[:2] + (nr, p.op), None)
            holder = _Packed(w, t if t is not None else self._pack(w, p, nr))
            _PACKED[key] = holder
        self.packed[key] = holder
        return holder.t

    # ---- convolutions ----------------------------------------------------------------------------
    def _conv_weight(self, w: torch.Tensor, cfg: ConvConfig) -> torch.Tensor:
        """The candidate's transformed/packed weight (memoised while one plan is tuned)."""
        key = (w.data_ptr(), tuple(w.shape), w._version) + cfg.weight_key()
        got = self._scratch.get(key)
        if got is None:
            got = self._scratch[key] = cfg.prepare_weight(w)
        return got

    def _conv_args(self, step: ConvStep, cfg: ConvConfig, x, u, ws, y, ops=()) -> list[int]:
        extra = [step.bias.data_ptr()] if step.problem.bias else []
        return [x.data_ptr(), u.data_ptr(), *extra, *(t.data_ptr() for t in ops), ws.data_ptr(), y.data_ptr()]

    def _check_conv(self, p: ConvProblem, name: str, step: ConvStep, kernel) -> str | None:
        from graphmode.verify.numerics import rel_l2
        memo = ("reference", p, step.b.data_ptr())
        if memo not in self._scratch:
            gen = torch.Generator().manual_seed(self.seed)
            x = torch.randn(p.n, p.cin, p.h, p.w, generator=gen)
            ref = torch.empty(p.n, p.cout, p.ho, p.wo)
            _conv_aten(p, x, step.b, step.bias, ref)()
            self._scratch[memo] = (x, ref)
        x, ref = self._scratch[memo]
        ops: list[torch.Tensor] = []
        if p.epi is not None:
            ops, ref = self._epilogue_reference(p, step, ref)
        cfg = conv_config(name)
        u = self._conv_weight(step.b, cfg)
        ws = torch.zeros(cfg.workspace_numel(p))
        y = torch.full((p.n, p.cout, p.ho, p.wo), float("nan"))
        try:
            kernel(self._conv_args(step, cfg, x, u, ws, y, ops))
        except Exception as e:  # noqa: BLE001
            return f"raised {type(e).__name__}: {e}"
        err = rel_l2(y, ref)
        if not err < self.tolerance:
            return f"rel L2 {err:.2e} vs ATen exceeds {self.tolerance:.0e}"
        return None

    def _conv_timing_fns(self, p: ConvProblem, names: Sequence[str], step: ConvStep, kernels: Mapping,
                         rejected: Mapping[str, str], keep: list) -> dict[str, Callable[[], None]]:
        """As for GEMMs; with `cold`, each candidate rotates over copies of ITS weight (the
        Winograd weights are 16/9 or 4x the direct ones, which is the point of timing cold)."""
        gen = torch.Generator().manual_seed(self.seed + 2)
        x = torch.randn(p.n, p.cin, p.h, p.w, generator=gen)
        y = torch.empty(p.n, p.cout, p.ho, p.wo)
        keep += [x, y]

        def copies_of(t: torch.Tensor) -> list[torch.Tensor]:
            n = max(1, math.ceil(2 * self.llc_bytes / max(t.numel() * 4, 1))) if self.cold else 1
            out = [t] + [t.clone() for _ in range(n - 1)]
            keep.extend(out[1:])
            return out

        fns: dict[str, Callable[[], None]] = {
            ATEN: _rotate([_conv_aten(p, x, w, step.bias, y) for w in copies_of(step.b)])}
        ops: list[torch.Tensor] = []
        if step.epilogue_run is not None:     # ATen's time includes the group's epilogue kernel
            fns[ATEN] = _then(fns[ATEN], step.epilogue_run)
            ops = [torch.randn(tuple(t.shape), generator=gen) for t in step.ops]
            keep += ops
        for name in names:
            if name == ATEN or name in rejected:
                continue
            cfg = conv_config(name)
            kern = kernels[(p, name)][0]
            ws = torch.zeros(cfg.workspace_numel(p))
            keep.append(ws)
            fns[name] = _rotate([kern.bind(self._conv_args(step, cfg, x, u, ws, y, ops))
                                 for u in copies_of(self._conv_weight(step.b, cfg))])
        return fns

    def _bind_conv(self, step: ConvStep, winner: str, kernel) -> None:
        cfg = conv_config(winner)
        p = step.problem
        key = (step.b.data_ptr(), tuple(step.b.shape), step.b._version) + cfg.weight_key()
        holder = self.packed.get(key) or _PACKED.get(key)
        if holder is None:
            t = self._scratch.pop(key, None)
            holder = _Packed(step.b, t if t is not None else cfg.prepare_weight(step.b))
            _PACKED[key] = holder
        self.packed[key] = holder
        # one workspace per (shape, candidate kind) in this context: steps of one executable never
        # overlap, and a shape's zero padding border is only ever left zero by kernels of that shape
        ws_key = ("ws", p, cfg.name)
        ws = self._workspaces.get(ws_key)
        if ws is None:
            ws = self._workspaces[ws_key] = torch.zeros(cfg.workspace_numel(p))
        bufs = [step.a, holder.t] + ([step.bias] if p.bias else []) + list(step.ops) + [ws, step.c]
        step.keep = tuple(bufs)
        step.fn = kernel.bind([t.data_ptr() for t in bufs])
        step.tactic = winner

    # ---- the timing cache ---------------------------------------------------------------------------
    def _cache_path(self, key: Mapping) -> Path | None:
        if self.cache_dir is None:
            return None
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
        return self.cache_dir / f"gemm-{digest}.json"

    def _cache_get(self, key: Mapping) -> dict | None:
        path = self._cache_path(key)
        if path is None:
            return None
        try:
            d = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(d, dict) or d.get("key") != json.loads(json.dumps(key)):
            return None
        t, r = d.get("timings_s"), d.get("rejected", {})
        if not isinstance(t, dict) or not isinstance(r, dict):
            return None
        if not all(isinstance(v, (int, float)) for v in t.values()):
            return None
        med = d.get("medians_s") if isinstance(d.get("medians_s"), dict) else {}
        lo = d.get("mins_s") if isinstance(d.get("mins_s"), dict) else {}
        load, cores = d.get("load"), d.get("cores")
        return {"timings_s": {k: float(v) for k, v in t.items()}, "rejected": {k: str(v) for k, v in r.items()},
                "medians_s": {k: float(v) for k, v in med.items() if isinstance(v, (int, float))},
                "mins_s": {k: float(v) for k, v in lo.items() if isinstance(v, (int, float))},
                "load": float(load) if isinstance(load, (int, float)) else None,
                "cores": int(cores) if isinstance(cores, int) else None,
                "noisy": bool(d.get("noisy", False)), "tries": int(d.get("tries", 1) or 1)}

    def _cache_put(self, key: Mapping, entry: Mapping) -> None:
        path = self._cache_path(key)
        if path is None:
            return
        data = {"key": key, **entry, "measured_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                "reps": self.reps}
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=1, sort_keys=True)
            os.replace(tmp, path)
        except OSError as e:
            log.warning("cannot write the GEMM timing cache %s: %s", path, e)

    # ---- reporting ------------------------------------------------------------------------------
    def report(self) -> dict:
        return {"policy": self.policy, "threads": self.threads, "cold_weights": self.cold,
                "gemms": [s.to_json() for s in self.selections], "stats": dict(self.stats),
                "packed_bytes": sum(h.t.numel() * h.t.element_size() for h in self.packed.values()),
                "steps": {"total": len(self.steps),
                          "generated": sum(1 for s in self.steps if s.tactic != ATEN)}}


# ---------------------------------------------------------------------------------- helpers

class _Packed:
    """A packed weight and its source. Holding the source keeps its address from being
    reused by another tensor while the packed copy is findable under that address."""

    __slots__ = ("__weakref__", "src", "t")

    def __init__(self, src: torch.Tensor, t: torch.Tensor):
        self.src, self.t = src, t


_PACKED: "weakref.WeakValueDictionary[tuple, _Packed]" = weakref.WeakValueDictionary()


_STATS: dict[str, Callable[[list[float]], float]] = {"min": min, "median": statistics.median}


def report_lines(report: Mapping[str, Any]) -> list[str]:
    """Human lines for a `TacticsContext.report()` (what the compile report prints)."""
    if not report:
        return []
    st = report.get("steps", {})
    lines = [f"GEMM tactics ({report.get('policy')}, {report.get('threads')} threads): "
             f"{st.get('generated', 0)}/{st.get('total', 0)} GEMM/conv steps on generated kernels, "
             f"tuning {report.get('seconds', 0.0):.2f}s"]
    for g in report.get("gemms", []):
        s = f"  {g['gemm']} x{g['uses']}: {g['winner']}"
        margins = g.get("margins") or {}
        if g["winner"] != ATEN and (margins.get("aten") or g.get("speedup_vs_aten")):
            s += ", " + margin_text(margins.get("aten") or _bare_margin(g["speedup_vs_aten"]), "aten")
        if g.get("gflops"):
            s += f", {g['gflops']:.1f} GFLOP/s"
        if margins.get("runner_up") or g.get("margin_vs_runner_up"):
            s += ", " + margin_text(margins.get("runner_up") or _bare_margin(g["margin_vs_runner_up"]), "runner-up")
        if g.get("from_cache"):
            s += " (timing cache)"
        if g.get("rejected"):
            s += f"; rejected: {', '.join(sorted(g['rejected']))}"
        lines.append(s)
    if report.get("error"):
        lines.append(f"  tuning failed, ATen runs every GEMM: {report['error']}")
    return lines


def _bare_margin(measured: float) -> dict:
    """A margin from a report written before margins carried their doubts: capped all the same."""
    return Margin(float(measured)).to_json()


def _then(f: Callable[[], None], g: Callable[[], None]) -> Callable[[], None]:
    def both() -> None:
        f()
        g()
    return both


def _fusable(numel: int, fused: FusedEpilogue) -> bool:
    out = fused.out
    return (out.dtype == torch.float32 and out.is_contiguous() and out.numel() == numel
            and all(t.dtype == torch.float32 and t.is_contiguous() for t in fused.operands))


def _overlaps(out: torch.Tensor, others: Sequence[torch.Tensor]) -> bool:
    lo, hi = out.data_ptr(), out.data_ptr() + out.numel() * out.element_size()
    return any(t.data_ptr() < hi and lo < t.data_ptr() + t.numel() * t.element_size() for t in others)


def _rotate(calls: list[Callable[[], None]]) -> Callable[[], None]:
    if len(calls) == 1:
        return calls[0]
    it = [0]

    def f() -> None:
        i = it[0]
        it[0] = (i + 1) % len(calls)
        calls[i]()
    return f


def _b_shape(p: GemmProblem) -> tuple[int, ...]:
    """A runtime B as the kernel sees it (leading batch dims flattened)."""
    return (p.batch, p.k, p.n) if p.b_batched else (p.k, p.n)


def _op_inputs(p: GemmProblem, a: torch.Tensor, b: torch.Tensor, bias) -> list[torch.Tensor]:
    x = a if p.op == "matmul" and p.batch > 1 else a.view(p.batch * p.m, p.k)
    return [x, b] + ([bias] if bias is not None else [])


def _op_output(p: GemmProblem, c: torch.Tensor) -> torch.Tensor:
    return c if p.op == "matmul" and p.batch > 1 else c.view(p.batch * p.m, p.n)


def _conv_aten(p: ConvProblem, x: torch.Tensor, w: torch.Tensor, bias, y: torch.Tensor) -> Callable[[], None]:
    """The ATen closure the executor runs for conv2d (the `aten` tactic)."""
    conv = torch.ops.aten.convolution.out
    s, pad, d, g = list(p.stride), list(p.padding), list(p.dilation), p.groups
    return lambda: conv(x, w, bias, s, pad, d, False, [0, 0], g, out=y)


def aten_fn(op: str, ins_t: Sequence[torch.Tensor], y: torch.Tensor) -> Callable[[], None]:
    """The ATen closure the executor runs for linear / matmul (the `aten` tactic)."""
    from graphmode.backends.cpu.executor import _gemm_closure
    return _gemm_closure(op, list(ins_t), y)


def _registers(isa: str, simd: Sequence[str]) -> int:
    # AVX2 code compiled for an AVX-512 host may use all 32 registers (EVEX encodings)
    if isa == "avx2" and "avx512vl" in simd:
        return 32
    return {"avx512": 32, "avx2": 16}.get(isa, 1 << 30)


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


def select_gemm(ctx: TacticsContext | None, op: str, ins_t: Sequence[torch.Tensor], outs: Sequence[torch.Tensor],
                attrs: Mapping, env: Mapping[str, int], default: Callable[[], None],
                epilogue: FusedEpilogue | None = None) -> Callable[[], None]:
    """The executor's entry point for `linear` / `matmul`: `default` (the ATen closure) when
    there is no tactics context or the GEMM is not one the generated kernels cover, else a
    step that the context tunes and switches at `finalize()`."""
    if ctx is None:
        return default
    return ctx.request(op, ins_t, outs, default, epilogue)


def select_conv(ctx: TacticsContext | None, ins_t: Sequence[torch.Tensor], outs: Sequence[torch.Tensor],
                attrs: Mapping, default: Callable[[], None], epilogue: FusedEpilogue | None = None) -> Callable[[], None]:
    """The executor's entry point for `conv2d` (see `select_gemm`)."""
    if ctx is None:
        return default
    return ctx.request_conv(ins_t, outs, attrs, default, epilogue)


__all__ = ["TacticsContext", "Selection", "GemmStep", "ConvStep", "FusedEpilogue", "select_gemm", "select_conv", "problem_of", "aten_fn", "report_lines",
           "Margin", "margin_text", "timing_doubts", "MARGIN_CAP",
           "POLICIES", "CONFIGS", "ATEN"]
