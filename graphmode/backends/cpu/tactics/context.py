"""The tactics context of one executable: its GEMM/conv steps, tuned and switched together.

Plans bind their steps first and tune afterwards: the ATen lowering of a GEMM or conv asks
the context it was handed (`OpCall.tactics`) for a step, which runs ATen until `finalize()`
has compiled every candidate of the plan in one library (one compiler run), tuned the new
shapes (checked against ATen, timed or read from the timing cache, picked by the policy)
and switched each step to its winner. Constant weights are packed once there, for the
winner only; the packed copy lives in the context (which the executable keeps) and is
shared process-wide with other contexts over the same constants.

`invariant` (determinism: batch_invariant): ATen never wins a shape a generated candidate
passed (selection.pick); `batch_variant(ctx)` lists what still runs ATen.
"""
from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

from graphmode.backends.cpu.build import KernelBuilder, builder_for
from graphmode.backends.cpu.conv import ConvProblem
from graphmode.backends.cpu.gemm import GemmConfig, GemmProblem
from graphmode.backends.cpu.tactics.host import TuningHost
from graphmode.backends.cpu.tactics.cache import CACHE_VERSION, RETUNE_NOISY, TimingCache
from graphmode.backends.cpu.tactics.candidates import (CONFIGS, TOLERANCE_F32, Checker, build_candidates,
                                                       candidate_names, candidate_sources)
from graphmode.backends.cpu.tactics.narrowing import (  # noqa: F401 - the constants: read here too
    BUDGET_SLACK_BYTES, PACKING_SLACK, SIBLING_KEEP, SIBLING_MARGIN, SUBPROBLEM_KEEP, SUBPROBLEM_MARGIN,
    one_image_exclusions, sibling_exclusions, weight_budget_exclusions, within_workspace, workspace_bytes)
from graphmode.backends.cpu.tactics.selection import POLICIES, Selection
from graphmode.backends.cpu.tactics.steps import ATEN, FusedEpilogue, GemmStep, conv_step, gemm_step, random_step
from graphmode.backends.cpu.tactics.timing import ColdPool
from graphmode.backends.cpu.tactics.tuning import STATISTICS, ShapeTuner
from graphmode.backends.cpu.tactics.weights import PreparedWeights
from graphmode.errors import BackendError
from graphmode.hostmem import release, trim_heap


class TacticsContext:
    """Tactic selection for the GEMMs and convs of one executable (and its timing cache).

    `cache_dir`: the timing cache folder (None: no persistence). `threads`: the plan's thread
    count (kernels are built for it and timed with it). `simd`/`target`: the ISA flags the
    candidates are drawn from (default: the `host` target), less what lies above the
    builder's ISA cap. `builder`: the KernelBuilder (default: the shared one for the default
    kernel folder and `threads`). `cold`: time
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
    builds, so one load spike does not decide a shape for good. A timing during which the
    process got less than STARVED CPU-s per wall-s (`cpu_clock` over the wall clock: its
    threads waited for CPUs that other processes had) is measured once more at once; if it
    stays starved it is cached as `starved`, never replaces an entry that was not, and is
    measured again by the first later build that finds the host quiet (`_retime`).
    """

    def __init__(self, cache_dir: str | Path | None, threads: int | None = None, *, policy: str = "latency_first",
                 target: Any = None, simd: Sequence[str] | None = None, builder: KernelBuilder | None = None,
                 cold: bool | None = None, llc_bytes: int | None = None, reps: int = 5,
                 configs: Mapping[str, Sequence[GemmConfig]] | None = None, tolerance: float = TOLERANCE_F32,
                 statistic: str = "median", sample_s: float = 5e-4, budget_s: float = 0.01,
                 retune_noisy: int = RETUNE_NOISY, seed: int = 0, weight_growth: float | None = None,
                 cpu_clock: Callable[[], float] = time.process_time, invariant: bool = False):
        if policy not in POLICIES:
            raise BackendError(f"unknown kernel selection policy {policy!r}", where="codegen.kernel_selection",
                               value=policy, fix=f"one of {', '.join(POLICIES)}")
        if statistic not in STATISTICS:
            raise BackendError(f"unknown timing statistic {statistic!r}", value=statistic, fix="min or median")
        self.statistic = statistic
        self.cache = TimingCache(cache_dir)
        self.threads = int(threads or torch.get_num_threads())
        self.policy = policy
        self.host = TuningHost(target, simd, llc_bytes, builder, self.threads)
        self.cold = cold        # None: decided at finalize (the plan's GEMM weights exceed the LLC)
        self.seed = seed
        self.aten_only: list[str] = []     # GEMM/conv steps no generated kernel covers (ATen runs them)
        self.configs = {k: tuple(v) for k, v in (configs or CONFIGS).items()}
        self.weight_growth = weight_growth      # None: no limit on the prepared weights
        self._excluded: dict[GemmProblem, dict[str, str]] = {}   # ruled out before building (narrowing.py)
        self.constant_ptrs: set[int] = set()
        self.steps: list[GemmStep] = []
        self._pending: list[GemmStep] = []
        self.selections: list[Selection] = []
        self.weights = PreparedWeights()   # candidates' prepared weights while tuning; the winners' after
        self._pool: ColdPool | None = None                  # the cold-timing copies while a plan is tuned
        self.stats = {"timed_shapes": 0, "timing_runs": 0, "cache_hits": 0, "cache_misses": 0, "checks": 0,
                      "rejected": 0, "tune_s": 0.0, "build_s": 0.0}
        self.failures: dict[str, str] = {}
        self._checker = Checker(self.weights.scratch, seed, tolerance, self.weights.pack, self.weights.conv_weight)
        # cpu_clock: the process's CPU seconds (a test feeds one that says "starved")
        self._tuner = ShapeTuner(self.cache, self._checker, self.weights, self.stats, policy=policy,
                                 statistic=statistic, reps=max(1, int(reps)), sample_s=float(sample_s),
                                 budget_s=float(budget_s), retune_noisy=int(retune_noisy), seed=seed,
                                 cpu_clock=cpu_clock, invariant=invariant)

    # ---- setup -----------------------------------------------------------------------------
    @property
    def simd(self) -> list[str]:
        """The target's SIMD features under the builder's ISA cap (host.py)."""
        return self.host.simd

    @property
    def llc_bytes(self) -> int:
        return self.host.llc_bytes

    @property
    def target_id(self) -> str:
        return self.host.target_id

    @property
    def builder(self) -> KernelBuilder:
        return self.host.builder

    @property
    def packed(self) -> dict:
        """The winners' prepared weights this context keeps alive (key -> holder of `.t`)."""
        return self.weights.packed

    def add_constants(self, tensors: Mapping[str, torch.Tensor] | Sequence[torch.Tensor]) -> None:
        """Declare the plan's constant tensors: only these may be packed ahead of time."""
        vals = tensors.values() if isinstance(tensors, Mapping) else tensors
        self.constant_ptrs.update(t.data_ptr() for t in vals)

    def candidates(self, p: GemmProblem) -> list[str]:
        """Candidate names for a problem: ATen, then the host ISA's generated configurations
        (less those the plan's weight budget rules out: `fit_weight_budget`)."""
        out = candidate_names(p, simd=self.simd, threads=self.threads, configs=self.configs,
                              generated=self.host.generated_available())
        gone = self._excluded.get(p)
        return [n for n in out if n not in gone] if gone else out

    def fit_weight_budget(self, by_problem: Mapping[GemmProblem, Sequence[GemmStep]]) -> None:
        """Rule out, before anything is built or timed, the candidates whose prepared weights
        could take the plan past `weight_growth` x the constant weights (narrowing.py)."""
        if self.weight_growth is None:
            return
        excluded, budget = weight_budget_exclusions(by_problem, self.candidates, self.weight_growth)
        for p, gone in excluded.items():
            self._excluded.setdefault(p, {}).update(gone)
        self.stats["weight_budget_bytes"] = budget
        self.stats["excluded_for_weight_budget"] = sum(len(v) for v in self._excluded.values())

    def narrow_from_one_image(self, p: GemmProblem) -> None:
        """A conv over a batch keeps only the candidates of the algorithms that ranked near the
        best where the timing cache holds the same conv at batch 1 (narrowing.py), plus ATen."""
        if not isinstance(p, ConvProblem) or p.n == 1 or self.policy == "heuristic":
            return
        one = replace(p, n=1)
        gone = self._excluded.get(p, {})
        names = [n for n in self.candidates(one) if n not in gone]
        srcs = candidate_sources(one, names, self.threads)
        cached = self.cache.get(self.cache_key(one, names, {(one, n): (None, v) if not isinstance(v, Exception) else v
                                                          for n, v in srcs.items()}))
        if cached is None:      # (a batch-1 entry measured on a busy machine still ranks the algorithms)
            return
        out = one_image_exclusions(self.candidates(p), names, cached)
        if out is None:
            return
        if out:
            self._excluded.setdefault(p, {}).update(out)
        self.stats["narrowed_from_one_image"] = self.stats.get("narrowed_from_one_image", 0) + 1

    # ---- the executor's side ---------------------------------------------------------------
    def request(self, op: str, ins_t: Sequence[torch.Tensor], outs: Sequence[torch.Tensor],
                default: Callable[[], None], epilogue: FusedEpilogue | None = None) -> Callable[[], None]:
        """A step for this GEMM: a `GemmStep` tuned at `finalize()`, or `default` when only ATen
        can run it. With `epilogue`, a step that takes it has `fused_epilogue` set (it then
        runs the epilogue too); one that cannot comes back without it."""
        return self._enqueue(gemm_step(op, ins_t, outs, default, epilogue, self.constant_ptrs), default,
                             f"{op} {_shapes(ins_t)}")

    def request_conv(self, ins_t: Sequence[torch.Tensor], outs: Sequence[torch.Tensor], attrs: Mapping,
                     default: Callable[[], None], epilogue: FusedEpilogue | None = None) -> Callable[[], None]:
        """A step for this conv2d: a `ConvStep` tuned at `finalize()`, or `default` when no
        generated kernel covers it (then it stays ATen without any timing)."""
        return self._enqueue(conv_step(ins_t, outs, attrs, default, epilogue, self.constant_ptrs), default,
                             f"conv2d {_shapes(ins_t)}")

    def _enqueue(self, step: GemmStep | None, default: Callable[[], None], what: str) -> Callable[[], None]:
        if step is None:
            self.aten_only.append(what)
            return default
        self.steps.append(step)
        self._pending.append(step)
        return step

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
        self.fit_weight_budget(by_problem)
        for p in by_problem:
            self.narrow_from_one_image(p)
        # shapes that differ from another only in their epilogue (ResNet's conv+bias, +relu,
        # +add+relu) are tuned after it, with only the candidates that ranked near its best
        leads: dict[GemmProblem, GemmProblem] = {}
        followers: dict[GemmProblem, GemmProblem] = {}
        for p in by_problem:
            lead = leads.setdefault(_sans_epilogue(p), p)
            if lead is not p and self.policy != "heuristic":
                followers[p] = lead
        # every shape is tuned before any winner is bound: the timing's transient buffers (each
        # shape's candidate weights) are gone before the winners' prepared weights are made, so
        # the peak is the larger of the two instead of their sum
        new: list[Selection] = []
        kernels: dict = {}
        try:
            for wave in ([p for p in by_problem if p not in followers], list(followers)):
                if not wave:
                    continue
                picked = {s.problem: s for s in new}
                for p in wave:
                    if p in followers:
                        self.narrow_to_sibling(p, picked[followers[p]])
                kernels.update(self._build({p: candidate_sources(p, self.candidates(p), self.threads) for p in wave}))
                self._pool = self._cold_pool(kernels)
                for p in wave:
                    new.append(self._tune_shape(p, by_problem[p], kernels))
                self.stats["timing_pool_bytes"] = max(self.stats.get("timing_pool_bytes", 0), self._pool.nbytes)
                self._pool = None
        finally:
            self.weights.scratch.clear()
            self._checker.digests.clear()
            self._pool = None
        order = {p: i for i, p in enumerate(by_problem)}
        new = within_workspace(sorted(new, key=lambda sel: order[sel.problem]), by_problem, self.weights.memory_left)
        ws = self.weights.workspace(max([workspace_bytes(sel.problem, sel.winner) // 4 for sel in new], default=0))
        try:
            for sel in new:
                self.selections.append(sel)
                for s in by_problem[sel.problem]:
                    self.weights.bind(s, sel, kernels, ws)
                self.weights.scratch.clear()
        finally:
            self.weights.scratch.clear()
            self.weights.carried.clear()
        return new

    def _tune_shape(self, p: GemmProblem, steps: Sequence[GemmStep], kernels: Mapping) -> Selection:
        """Select `p`'s winner (timed, or from the timing cache); its sources' pages released after."""
        sel = self._select(p, steps[0], kernels)
        sel.uses = len(steps)
        if not sel.timed:
            self.weights.carry(steps[0], sel.winner)
        self.weights.scratch.clear()
        release(steps[0].b)      # the checks and timing read it; binding reads it again
        trim_heap()
        return sel

    def narrow_to_sibling(self, p: GemmProblem, lead: Selection) -> None:
        """`p` is `lead.problem` but for its epilogue: it keeps only the candidates that ran near
        the best in `lead`'s timing (narrowing.py), plus ATen."""
        out = sibling_exclusions(self.candidates(p), lead)
        if out is None:
            return
        if out:
            self._excluded.setdefault(p, {}).update(out)
        self.stats["narrowed_from_sibling"] = self.stats.get("narrowed_from_sibling", 0) + 1

    def select(self, p: GemmProblem, *, b: torch.Tensor | None = None) -> Selection:
        """Tune one problem on its own (no executor): B is `b` or random. For tests/tools."""
        step = random_step(p, self.seed + 1, b)
        b = step.b
        if p.b_packed:
            self.constant_ptrs.add(b.data_ptr())
        if self.cold is None:
            self.cold = b.numel() * 4 > self.llc_bytes if p.b_packed else False
        kernels = self._build({p: candidate_sources(p, self.candidates(p), self.threads)})
        self._pool = self._cold_pool(kernels)
        try:
            sel = self._select(p, step, kernels)
        finally:
            self.weights.scratch.clear()
            self._checker.digests.clear()
            self._pool = None
        sel.uses = 1
        self.selections.append(sel)
        return sel

    # ---- compilation -------------------------------------------------------------------------
    def _build(self, sources: Mapping[GemmProblem, Mapping[str, Any]]) -> dict[tuple[GemmProblem, str], Any]:
        """Compile the candidates into one library; (problem, name) -> (kernel, source) or the
        error text. Under the heuristic policy only the candidates it could pick are built."""
        t0 = time.perf_counter()
        out = build_candidates(self.builder, sources, first_only=self.policy == "heuristic", failures=self.failures)
        self.stats["build_s"] += time.perf_counter() - t0
        return out

    # ---- selection -----------------------------------------------------------------------------
    def cache_key(self, p: GemmProblem, names: Sequence[str], kernels: Mapping) -> dict:
        srcs = {}
        for n in names:
            k = kernels.get((p, n))
            srcs[n] = k[1].symbol if isinstance(k, tuple) else None
        return {"version": CACHE_VERSION, "target": self.target_id, "compiler": self.host.compiler_id(),
                "threads": self.threads, "cold": self.cold, "statistic": self.statistic, **p.key(),
                "candidates": srcs}

    def _select(self, p: GemmProblem, step: GemmStep, kernels: Mapping) -> Selection:
        t0 = time.perf_counter()
        names = self.candidates(p)
        excluded = self._excluded.get(p, {})
        if self.policy == "heuristic":
            return self._tuner.heuristic(p, names, step, kernels, excluded, t0)
        return self._tuner.select(p, names, step, kernels, key=self.cache_key(p, names, kernels), excluded=excluded,
                                  pool=self._pool or self._cold_pool(kernels), t0=t0)

    def _cold_pool(self, kernels: Mapping) -> ColdPool:
        """How this plan's timing makes weights cold: flushed by the candidates' library, where it can."""
        lib = next((k[0].library for k in kernels.values() if isinstance(k, tuple)), None)
        return ColdPool(self.llc_bytes, bool(self.cold), lib)

    # ---- reporting ------------------------------------------------------------------------------
    def report(self) -> dict:
        return {"policy": self.policy, "threads": self.threads, "cold_weights": self.cold,
                "batch_invariant": self._tuner.invariant,
                "gemms": [s.to_json() for s in self.selections], "stats": dict(self.stats),
                "packed_bytes": self.weights.packed_bytes(), "workspace_bytes": self.weights.workspace_bytes(),
                "steps": {"total": len(self.steps),
                          "generated": sum(1 for s in self.steps if s.tactic != ATEN)}}


def batch_variant(ctx: TacticsContext) -> list[str]:
    """The GEMM/conv steps of `ctx` whose output rows may depend on how many rows there are:
    those ATen runs (MKL/oneDNN choose their kernels, and so the summation order, by M). Every
    generated GEMM kernel sums each output element as bias + a[m,0] b[0,n] + a[m,1] b[1,n]
    + ... in k order, one FMA per step, whatever its tile, K blocks (stored and reloaded as
    f32: exact), ISA or M (templates/gemm.h): its rows are the same bits at any M."""
    return ([f"{s} runs ATen (no generated kernel covers it)" for s in ctx.aten_only]
            + [f"{s.problem.text} runs ATen" for s in ctx.steps if s.tactic == ATEN])


def _shapes(ts: Sequence[torch.Tensor]) -> str:
    return " x ".join(f"{str(t.dtype).replace('torch.', '')}{list(t.shape)}" for t in ts)


def _sans_epilogue(p: GemmProblem) -> GemmProblem:
    """The problem without its store epilogue: what its candidates' ranking depends on."""
    if isinstance(p, ConvProblem):
        return replace(p, epi=None)
    return replace(p, epi=None, c_aliases_operand=False)


def tactics_context(spec, builder: KernelBuilder | None, threads: int | None,
                    constants: Mapping[str, torch.Tensor], *, frozen: bool = False,
                    weight_growth: float | None = None, invariant: bool = False) -> TacticsContext | None:
    """The tactics context an executable binds its steps with, or None when tactics are off.

    `spec`: None = on when `builder` builds generated kernels (a compiler is there), with the
    timing cache next to the builder's kernel folder; a policy name (`latency_first`,
    `throughput_first`, `heuristic`) = the same with that policy; a `TacticsContext` = that
    one; False = off (ATen runs every GEMM). `frozen`: the timing cache is the decision record
    (an artifact's): entries cached as noisy are used as they are, not measured again.
    `weight_growth`: the recipe's memory.weight_growth for a context made here (None: no limit).
    `invariant`: the recipe's determinism is batch_invariant (TacticsContext)."""
    if spec is False:
        return None
    if isinstance(spec, TacticsContext):
        ctx = spec
    else:
        if spec is None and builder is None:
            return None          # no generated kernels: plain ATen
        policy = spec if isinstance(spec, str) else "latency_first"
        if policy not in POLICIES:
            raise BackendError(f"unknown GEMM tactic policy {policy!r}", value=policy,
                               fix=f"one of {', '.join(POLICIES)}, or tactics=False")
        if builder is None:
            builder = builder_for(None, threads)
        try:
            if not builder.compiler_available():
                return None
        except Exception:  # noqa: BLE001 - a broken toolchain only means "ATen only"
            return None
        ctx = TacticsContext(Path(builder.cache_dir).parent / "tactics", threads, policy=policy, builder=builder,
                             weight_growth=weight_growth, invariant=invariant,
                             **({"retune_noisy": 0} if frozen else {}))
    ctx.add_constants(constants)
    return ctx


__all__ = ["TacticsContext", "tactics_context", "batch_variant"]
