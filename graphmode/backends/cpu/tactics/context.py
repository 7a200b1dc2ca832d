"""The tactics context of one executable: its GEMM/conv steps, tuned and switched together.

Plans bind their steps first and tune afterwards: the ATen lowering of a GEMM or conv asks
the context it was handed (`OpCall.tactics`) for a step, which runs ATen until `finalize()`
has compiled every candidate of the plan in one library (one compiler run), tuned the new
shapes (checked against ATen, timed or read from the timing cache, picked by the policy)
and switched each step to its winner. Constant weights are packed once there, for the
winner only; the packed copy lives in the context (which the executable keeps) and is
shared process-wide with other contexts over the same constants.
"""
from __future__ import annotations

import logging
import statistics
import time
import weakref
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

from graphmode.backends.cpu.build import KernelBuilder, builder_for
from graphmode.backends.cpu.conv import ConvConfig, ConvProblem, conv_problem_of
from graphmode.backends.cpu.gemm import GemmConfig, GemmProblem, pack_b
from graphmode.backends.cpu.isa import capped_simd
from graphmode.backends.cpu.tactics.cache import CACHE_VERSION, RETUNE_NOISY, TimingCache, retime_reason
from graphmode.backends.cpu.tactics.candidates import (CONFIGS, TOLERANCE_F32, Checker, candidate_names,
                                                       candidate_sources, conv_config, conv_kind, prepared_bytes)
from graphmode.backends.cpu.tactics.selection import NOISY, POLICIES, Selection, pick, timing_doubts
from graphmode.backends.cpu.tactics.steps import (ATEN, ConvStep, FusedEpilogue, GemmStep, aten_gemm, problem_of)
from graphmode.backends.cpu.tactics.timing import ColdPool, conv_timing_fns, gemm_timing_fns, machine_load, measure
from graphmode.backends.cpu.tensors import overlaps
from graphmode.errors import BackendError
from graphmode.hostmem import release, trim_heap

log = logging.getLogger("graphmode.cpu.tactics")

_STATS: dict[str, Callable[[list[float]], float]] = {"min": min, "median": statistics.median}


PACKING_SLACK = 1.25     # a prepared weight up to this multiple of its source is packing, not growth
BUDGET_SLACK_BYTES = 1 << 20   # tiny weights are not held to a ratio (an 8-column layer packs to 32 columns)
SUBPROBLEM_MARGIN = 1.25  # a batched conv keeps the candidates this close to the best at batch 1 ...
SUBPROBLEM_KEEP = 2       # ... at most this many
SIBLING_MARGIN = 1.10     # a GEMM/conv that differs from one tuned before only in its epilogue keeps the
SIBLING_KEEP = 2          # candidates this close to that one's best, at most this many


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
                 cpu_clock: Callable[[], float] = time.process_time):
        if policy not in POLICIES:
            raise BackendError(f"unknown kernel selection policy {policy!r}", where="codegen.kernel_selection",
                               value=policy, fix=f"one of {', '.join(POLICIES)}")
        if statistic not in _STATS:
            raise BackendError(f"unknown timing statistic {statistic!r}", value=statistic, fix="min or median")
        self.statistic = statistic
        self.cache = TimingCache(cache_dir)
        self.threads = int(threads or torch.get_num_threads())
        self.policy = policy
        self._target, self._simd, self._llc = target, simd, llc_bytes
        self._builder = builder
        self.cold = cold        # None: decided at finalize (the plan's GEMM weights exceed the LLC)
        self.reps = max(1, int(reps))
        self.sample_s = float(sample_s)
        self.budget_s = float(budget_s)
        self.retune_noisy = int(retune_noisy)
        self.cpu_clock = cpu_clock      # the process's CPU seconds (a test feeds one that says "starved")
        self.tolerance = tolerance
        self.seed = seed
        self.configs = {k: tuple(v) for k, v in (configs or CONFIGS).items()}
        self.weight_growth = weight_growth      # None: no limit on the prepared weights
        self._excluded: dict[GemmProblem, dict[str, str]] = {}   # candidates the weight budget rules out
        self.constant_ptrs: set[int] = set()
        self.steps: list[GemmStep] = []
        self._pending: list[GemmStep] = []
        self.selections: list[Selection] = []
        self.packed: dict[tuple, _Packed] = {}   # the winners' packed weights this context keeps alive
        self._scratch: dict[tuple, Any] = {}      # packs and references while one plan is tuned
        self._workspaces: list[torch.Tensor] = []   # conv scratch: one serves every conv step bound with it
        self._pool: ColdPool | None = None                  # the cold-timing copies while a plan is tuned
        self._carried: dict[tuple, torch.Tensor] = {}       # winners' prepared weights the checks made, until bound
        self.stats = {"timed_shapes": 0, "timing_runs": 0, "cache_hits": 0, "cache_misses": 0, "checks": 0,
                      "rejected": 0, "tune_s": 0.0, "build_s": 0.0}
        self.failures: dict[str, str] = {}
        self._checker = Checker(self._scratch, seed, tolerance, self._pack, self._conv_weight)

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
        """Candidate names for a problem: ATen, then the host ISA's generated configurations
        (less those the plan's weight budget rules out: `fit_weight_budget`)."""
        out = candidate_names(p, simd=self.simd, threads=self.threads, configs=self.configs,
                              generated=self.generated_available())
        gone = self._excluded.get(p)
        return [n for n in out if n not in gone] if gone else out

    def fit_weight_budget(self, by_problem: Mapping[GemmProblem, Sequence[GemmStep]]) -> None:
        """Rule out, before anything is built or timed, the candidates whose prepared weights
        could take the plan past `weight_growth` x the bytes of the constant weights they are
        prepared from. The plan's worst case (each shape at its largest remaining candidate)
        shrinks by dropping the largest candidates of the shape whose FLOPs per weight byte
        they add are fewest (a Winograd F(4x4) weight is 4x the conv's: on a 7x7 map it buys
        least), until it fits or no shape has a candidate more than PACKING_SLACK x its
        weight. Excluding before timing also keeps timing's transient buffers in the budget."""
        if self.weight_growth is None:
            return
        sizes: dict[GemmProblem, dict[str, int]] = {}
        own: dict[GemmProblem, int] = {}
        for p, steps in by_problem.items():
            if not p.b_packed:
                continue
            weights = {(s.b.data_ptr(), tuple(s.b.shape)): s.b for s in steps}
            own[p] = sum(t.numel() * t.element_size() for t in weights.values())
            per = {n: prepared_bytes(p, n) for n in self.candidates(p)}
            sizes[p] = {n: own[p] if b is None else b * len(weights) for n, b in per.items()}
        budget = self.weight_growth * sum(own.values()) + BUDGET_SLACK_BYTES

        def worst() -> int:
            return sum(max(v.values()) for v in sizes.values() if v)
        def extra(q: GemmProblem) -> int:       # what the largest remaining candidate adds over the weight
            return max(sizes[q].values()) - own[q]
        while sizes and worst() > budget:
            # packing pads a weight to whole panels (a few %): only a real growth is worth a candidate
            shrinkable = [q for q in sizes if extra(q) > (PACKING_SLACK - 1) * own[q]]
            if not shrinkable:
                break
            p = min(shrinkable, key=lambda q: q.flops / max(extra(q), 1))    # FLOPs per byte it adds
            top = max(sizes[p].values())
            for n in [n for n, b in sizes[p].items() if b == top]:
                del sizes[p][n]
                self._excluded.setdefault(p, {})[n] = (
                    f"its prepared weights ({top / 2**20:.1f} MiB) would take the plan past "
                    f"memory.weight_growth {self.weight_growth:g}x the model's weights")
        self.stats["weight_budget_bytes"] = int(budget)
        self.stats["excluded_for_weight_budget"] = sum(len(v) for v in self._excluded.values())

    def narrow_from_one_image(self, p: GemmProblem) -> None:
        """A conv over a batch keeps only the generated candidates of the algorithms (Winograd
        F(4x4), F(2x2), im2col) within SUBPROBLEM_MARGIN of the best (at most SUBPROBLEM_KEEP)
        where the timing cache already holds the same conv at batch 1 (a smaller bucket of the
        plan, tuned before), plus ATen: the others are neither built nor timed. An algorithm's
        cost is per image, so one image ranks them; the blocking within one (the tile chunk
        follows the batch's tile count) and the survivors are still checked and timed at the
        real batch. (A ResNet-18 batch-8 bucket built ~60 candidate kernels, 10 s of its 19 s.)"""
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
        by_kind: dict[str, float] = {}
        for n, t in cached["timings_s"].items():
            if n != ATEN and n in names and n not in cached["rejected"] and t > 0:
                by_kind[conv_kind(n)] = min(t, by_kind.get(conv_kind(n), t))
        if not by_kind:
            return
        best = min(by_kind.values())
        keep = sorted((k for k, t in by_kind.items() if t <= SUBPROBLEM_MARGIN * best), key=by_kind.get)
        keep = keep[:SUBPROBLEM_KEEP]
        for n in self.candidates(p)[1:]:
            k = conv_kind(n)
            if k not in keep:
                self._excluded.setdefault(p, {})[n] = (
                    f"{k} ran {by_kind[k] / best:.2f}x the best at batch 1 (timing cache)" if k in by_kind
                    else f"{k} was no contender at batch 1 (timing cache)")
        self.stats["narrowed_from_one_image"] = self.stats.get("narrowed_from_one_image", 0) + 1

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
        if epilogue is not None and p.batch == 1 and epilogue.fits(p.m * p.n):
            p = replace(p, epi=epilogue.epi, c_aliases_operand=overlaps([epilogue.out], epilogue.operands))
            c = epilogue.out
        else:
            epilogue = None
        return self._enqueue(GemmStep(default, p, ins_t[0], ins_t[1], bias, c, epilogue))

    def request_conv(self, ins_t: Sequence[torch.Tensor], outs: Sequence[torch.Tensor], attrs: Mapping,
                     default: Callable[[], None], epilogue: FusedEpilogue | None = None) -> Callable[[], None]:
        """A step for this conv2d: a `ConvStep` tuned at `finalize()`, or `default` when no
        generated kernel covers it (then it stays ATen without any timing)."""
        p = conv_problem_of(ins_t, outs, attrs, self.constant_ptrs)
        if p is None or p.groups != 1:
            return default
        bias = ins_t[2] if len(ins_t) > 2 else None
        c = outs[0]
        if epilogue is not None and epilogue.fits(c.numel()):
            p = replace(p, epi=epilogue.epi)     # conv kernels read each operand element before writing it
            c = epilogue.out
        else:
            epilogue = None
        return self._enqueue(ConvStep(default, p, ins_t[0], ins_t[1], bias, c, epilogue))

    def _enqueue(self, step: GemmStep) -> GemmStep:
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
            self._scratch.clear()
            self._checker.digests.clear()
            self._pool = None
        order = {p: i for i, p in enumerate(by_problem)}
        new.sort(key=lambda sel: order[sel.problem])          # plan order in the report
        # the steps of one executable run one at a time and conv kernels keep nothing in their
        # workspace between calls: one buffer, the size of the largest winner's, serves them all
        need = max([conv_config(sel.winner).workspace_numel(sel.problem) for sel in new
                    if isinstance(sel.problem, ConvProblem) and sel.winner != ATEN], default=0)
        ws = next((w for w in self._workspaces if w.numel() >= need), None) if need else None
        if need and ws is None:
            ws = torch.empty(need)
            self._workspaces.append(ws)
        try:
            for sel in new:
                self.selections.append(sel)
                for s in by_problem[sel.problem]:
                    self._bind(s, sel, kernels, ws)
                self._scratch.clear()
        finally:
            self._scratch.clear()
            self._carried.clear()
        return new

    def _tune_shape(self, p: GemmProblem, steps: Sequence[GemmStep], kernels: Mapping) -> Selection:
        """Select `p`'s winner (timed, or from the timing cache); its sources' pages released after."""
        sel = self._select(p, steps[0], kernels)
        sel.uses = len(steps)
        key = self._scratch_key(steps[0], sel.winner)
        if not sel.timed and key in self._scratch:
            # a cached pick's check prepared the winner's weight: binding takes it over (a timed
            # pick's is made again at binding, after the timing buffers are gone)
            self._carried[key] = self._scratch[key]
        self._scratch.clear()
        release(steps[0].b)      # the checks and timing read it; binding reads it again
        trim_heap()
        return sel

    def narrow_to_sibling(self, p: GemmProblem, lead: Selection) -> None:
        """`p` is `lead.problem` but for its epilogue (applied at the store: the same cost for
        every candidate), so it keeps only the generated candidates that ran within
        SIBLING_MARGIN of the best in `lead`'s timing (at most SIBLING_KEEP), plus ATen: the
        others are neither built nor timed. The survivors are still checked and timed with the
        real epilogue. (ResNet-18's eleven 3x3 stride-1 convs are four shapes.)"""
        times = {n: t for n, t in lead.timings_s.items() if t > 0 and n not in lead.rejected}
        if not times:
            return
        best = min(times.values())
        keep = sorted((n for n, t in times.items() if n != ATEN and t <= SIBLING_MARGIN * best), key=times.get)
        keep = keep[:SIBLING_KEEP]
        for n in self.candidates(p)[1:]:
            if n not in keep:
                self._excluded.setdefault(p, {})[n] = (
                    f"ran {times[n] / best:.2f}x the best for {lead.problem.text} (the same but for the epilogue)"
                    if n in times else f"was no contender for {lead.problem.text} (the same but for the epilogue)")
        self.stats["narrowed_from_sibling"] = self.stats.get("narrowed_from_sibling", 0) + 1

    def _scratch_key(self, step: GemmStep, name: str) -> tuple | None:
        """Where `_conv_weight` / `_pack` memoise candidate `name`'s prepared copy of the step's weight."""
        if name == ATEN or not step.problem.b_packed:
            return None
        if isinstance(step, ConvStep):
            return _conv_key(step.b, conv_config(name))
        return _pack_memo_key(step.b, GemmConfig.parse(name).nr, step.problem)

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
        step = GemmStep(aten_gemm(p, a, b, bias, c), p, a if p.batch > 1 else a.view(p.m, p.k), b, bias,
                        c if p.batch > 1 else c.view(p.m, p.n))
        if self.cold is None:
            self.cold = b.numel() * 4 > self.llc_bytes if p.b_packed else False
        kernels = self._build({p: candidate_sources(p, self.candidates(p), self.threads)})
        self._pool = self._cold_pool(kernels)
        try:
            sel = self._select(p, step, kernels)
        finally:
            self._scratch.clear()
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
                out[key] = self.builder.failures.get(s.symbol) or self.failures.get("*", "not built")
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

    def _check(self, p: GemmProblem, name: str, step: GemmStep, kernels: Mapping,
               expect: str | None = None) -> str | None:
        """None when candidate `name` matches ATen on random data (or gives the bits `expect`
        that passed before), else why not."""
        k = kernels.get((p, name))
        if not isinstance(k, tuple):
            return f"does not build: {k}"
        self.stats["checks"] += 1
        return self._checker.check(p, name, step, k[0], expect)

    def _select(self, p: GemmProblem, step: GemmStep, kernels: Mapping) -> Selection:
        t0 = time.perf_counter()
        names = self.candidates(p)
        if self.policy == "heuristic":
            sel = self._heuristic(p, names, step, kernels)
            sel.tune_s = time.perf_counter() - t0
            return sel
        key = self.cache_key(p, names, kernels)
        cached = self.cache.get(key)
        previous, tries = cached, 1
        if cached is not None and self._retime(cached):
            log.info("timing cache entry for %s was measured on a busy machine; measuring again", p.text)
            tries = cached["tries"] + 1
            cached = None
        if cached is not None:
            sel = self._from_cache(p, cached, step, kernels, t0)
            if sel is not None:
                return sel
        self.stats["cache_misses"] += 1
        sel = Selection(p, ATEN, self.policy, timed=True)
        sel.rejected.update(self._excluded.get(p, {}))
        for name in names[1:]:
            err = self._check(p, name, step, kernels)
            if err is not None:
                sel.rejected[name] = err[:500]
                self.stats["rejected"] += 1
        for k in [k for k in self._scratch if k[0] in ("inputs", "reference", "epilogue")]:
            del self._scratch[k]      # the checks' operands and ATen's result: not the timing's
        keep: list = []   # the timing buffers live until the timing is done
        fns = self._timing_fns(p, names, step, kernels, sel.rejected, keep)
        samples, sel.cpu_per_wall = self._measure(fns)
        if sel.starved:       # another process had the CPUs: once more, the burst may have passed
            log.info("timing of %s was starved (%.2f CPU-s per wall-s); measuring again", p.text, sel.cpu_per_wall)
            again, cpw = self._measure(fns)
            if cpw >= sel.cpu_per_wall:
                samples, sel.cpu_per_wall = again, cpw
        del keep, fns
        self.stats["timing_runs"] += sum(len(v) for v in samples.values())
        sel.load, sel.cores = machine_load()
        sel.timings_s = {n: _STATS[self.statistic](v) for n, v in samples.items()}
        sel.medians_s = {n: statistics.median(v) for n, v in samples.items()}
        self.stats["timed_shapes"] += 1
        sel.winner = pick(self.policy, p, sel.timings_s)
        mins = sel.mins_s = {n: min(v) for n, v in samples.items() if v}
        ratios = sorted(sel.medians_s[n] / mins[n] for n in mins if mins[n] > 0)
        # noisy (measured again by the next builds): most candidates' samples disagree, or the ATen
        # baseline's alone do (every margin is stated against it), or the machine was overloaded
        sel.noisy = bool(ratios) and ratios[len(ratios) // 2] > NOISY or bool(timing_doubts(sel, (ATEN,)))
        digests = {n: self._checker.digests.pop((p, n)) for n in names if (p, n) in self._checker.digests}
        if sel.starved and previous is not None and not previous["starved"]:
            # a starved timing never replaces one the process had the CPUs for
            kept = self._from_cache(p, previous, step, kernels, t0)
            if kept is not None:
                self.cache.put(key, {**previous, "tries": tries}, reps=self.reps)
                return kept
        self.cache.put(key, {"timings_s": sel.timings_s, "medians_s": sel.medians_s, "rejected": sel.rejected,
                             "noisy": sel.noisy, "tries": tries, "mins_s": sel.mins_s, "load": sel.load,
                             "cores": sel.cores, "digests": digests, "cpu_per_wall": sel.cpu_per_wall,
                             "starved": sel.starved}, reps=self.reps)
        sel.tune_s = time.perf_counter() - t0
        self.stats["tune_s"] += sel.tune_s
        return sel

    def _retime(self, entry: Mapping[str, Any]) -> bool:
        """Whether a cached entry is measured again (cache.retime_reason)."""
        return retime_reason(entry, self.retune_noisy, *machine_load()) is not None

    def _from_cache(self, p: GemmProblem, cached: Mapping[str, Any], step: GemmStep, kernels: Mapping,
                    t0: float) -> Selection | None:
        """The selection a cache entry records, its winner checked again; None when the winner now
        fails its check (then the shape is tuned again)."""
        sel = Selection(p, ATEN, self.policy, dict(cached["timings_s"]),
                        {**cached["rejected"], **self._excluded.get(p, {})},
                        from_cache=True, medians_s=dict(cached["medians_s"]), noisy=cached["noisy"],
                        mins_s=dict(cached["mins_s"]), load=cached["load"], cores=cached["cores"],
                        cpu_per_wall=cached.get("cpu_per_wall"))
        sel.winner = pick(self.policy, p, sel.timings_s)
        # a stale cache must not hand out a wrong kernel: the winner is checked again (one run;
        # ATen runs too unless the output has the bits that passed when it was timed)
        if sel.winner == ATEN or self._check(p, sel.winner, step, kernels,
                                             cached.get("digests", {}).get(sel.winner)) is None:
            self.stats["cache_hits"] += 1
            sel.tune_s = time.perf_counter() - t0
            return sel
        log.warning("timing cache entry for %s names %s, which now fails its check; tuning again", p.text, sel.winner)
        return None

    def _measure(self, fns: Mapping[str, Callable[[], None]]) -> tuple[dict[str, list[float]], float]:
        """`measure`'s samples and the process's CPU-s per wall-s while it ran."""
        c0, w0 = self.cpu_clock(), time.perf_counter()
        samples = measure(fns, reps=self.reps, sample_s=self.sample_s, budget_s=self.budget_s)
        wall = time.perf_counter() - w0
        return samples, (self.cpu_clock() - c0) / wall if wall > 0 else 0.0

    def _heuristic(self, p: GemmProblem, names: Sequence[str], step: GemmStep, kernels: Mapping) -> Selection:
        sel = Selection(p, ATEN, "heuristic")
        sel.rejected.update(self._excluded.get(p, {}))
        for name in names[1:2]:          # the first generated configuration, if any
            err = self._check(p, name, step, kernels)
            if err is None:
                sel.winner = name
            else:
                sel.rejected[name] = err
        return sel

    def _cold_pool(self, kernels: Mapping) -> ColdPool:
        """How this plan's timing makes weights cold: flushed by the candidates' library, where it can."""
        lib = next((k[0].library for k in kernels.values() if isinstance(k, tuple)), None)
        return ColdPool(self.llc_bytes, bool(self.cold), lib)

    def _timing_fns(self, p, names: Sequence[str], step: GemmStep, kernels: Mapping, rejected: Mapping[str, str],
                    keep: list) -> dict[str, Callable[[], None]]:
        kw = {"seed": self.seed, "pool": self._pool or self._cold_pool(kernels)}
        if isinstance(step, ConvStep):
            return conv_timing_fns(p, names, step, kernels, rejected, keep, weight=self._conv_weight, **kw)
        return gemm_timing_fns(p, names, step, kernels, rejected, keep,
                               pack=lambda w, nr: self._pack(w, p, nr), **kw)

    # ---- weights and binding -------------------------------------------------------------------
    def _pack(self, w: torch.Tensor, p: GemmProblem, nr: int) -> torch.Tensor:
        """`w` packed for panels of `nr` (memoised while one plan is tuned: the checks, the
        timing and the winner's binding share one packing per weight and panel width)."""
        key = _pack_memo_key(w, nr, p)
        got = self._scratch.get(key)
        if got is None:
            got = self._bound_copy(_packed_key(w, nr, p))
        if got is None:
            got = self._scratch[key] = pack_b(w, nr, transposed=(p.op == "linear"))
        return got

    def _conv_weight(self, w: torch.Tensor, cfg: ConvConfig) -> torch.Tensor:
        """The candidate's transformed/packed weight (memoised while one plan is tuned)."""
        key = _conv_key(w, cfg)
        got = self._scratch.get(key)
        if got is None:
            got = self._bound_copy(key)
        if got is None:
            got = self._scratch[key] = cfg.prepare_weight(w)
        return got

    def _bound_copy(self, key: tuple) -> torch.Tensor | None:
        """The copy an executable already binds under `key` (another bucket of the model, same
        constant): its checks read that instead of preparing the weight again."""
        holder = self._holder(key)
        return holder.t if holder is not None else None

    def _holder(self, key: tuple) -> "_Packed | None":
        return self.packed.get(key) or _PACKED.get(key)

    def _kept(self, key: tuple, src: torch.Tensor, scratch_key: tuple,
              prepare: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The winner's prepared copy of constant `src` under `key`, shared process-wide: the
        executables of one model's buckets (same constants) hold one copy, not one each. The
        copy the checks and timing made (under `scratch_key`) is taken over, else prepared."""
        holder = self._holder(key)
        if holder is None:
            t = self._scratch.pop(scratch_key, None)
            t = self._carried.pop(scratch_key, None) if t is None else t
            holder = _Packed(src, t if t is not None else prepare())
            _PACKED[key] = holder
            release(src)     # a spilled constant's pages go (graphmode/hostmem.py); others stay as they are
            if t is None:
                trim_heap()  # the transform's transients: else binding peaks ~50 MB over its result
        self.packed[key] = holder
        return holder.t

    def _bind(self, step: GemmStep, sel: Selection, kernels: Mapping, ws: torch.Tensor | None = None) -> None:
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
                self._workspaces.append(ws)
            bufs = [step.a, w] + ([step.bias] if p.bias else []) + list(step.ops) + [ws, step.c]
        else:
            nr = GemmConfig.parse(sel.winner).nr
            if p.b_packed:
                w = step.b
                b = self._kept(_packed_key(w, nr, p), w, _pack_memo_key(w, nr, p), lambda: self._pack(w, p, nr))
            else:
                b = step.b
            bufs = [step.a, b] + ([step.bias] if p.bias else []) + list(step.ops) + [step.c]
        step.keep = tuple(bufs)
        step.fn = kernel.bind([t.data_ptr() for t in bufs])
        step.tactic = sel.winner

    # ---- reporting ------------------------------------------------------------------------------
    def report(self) -> dict:
        return {"policy": self.policy, "threads": self.threads, "cold_weights": self.cold,
                "gemms": [s.to_json() for s in self.selections], "stats": dict(self.stats),
                "packed_bytes": sum(h.t.numel() * h.t.element_size() for h in self.packed.values()),
                "workspace_bytes": sum(t.numel() * t.element_size() for t in self._workspaces),
                "steps": {"total": len(self.steps),
                          "generated": sum(1 for s in self.steps if s.tactic != ATEN)}}


class _Packed:
    """A packed weight and its source. Holding the source keeps its address from being
    reused by another tensor while the packed copy is findable under that address."""

    __slots__ = ("__weakref__", "src", "t")

    def __init__(self, src: torch.Tensor, t: torch.Tensor):
        self.src, self.t = src, t


_PACKED: "weakref.WeakValueDictionary[tuple, _Packed]" = weakref.WeakValueDictionary()


def _packed_key(w: torch.Tensor, nr: int, p: GemmProblem) -> tuple:
    """Where constant `w` packed for panels of `nr` is kept (_PACKED)."""
    return (w.data_ptr(), tuple(w.shape), tuple(w.stride()), w._version, nr, p.op)


def _pack_memo_key(w: torch.Tensor, nr: int, p: GemmProblem) -> tuple:
    """Where `_pack` memoises `w` packed for panels of `nr` while one plan is tuned."""
    return (w.data_ptr(), tuple(w.shape), nr, p.op)


def _conv_key(w: torch.Tensor, cfg: ConvConfig) -> tuple:
    """Where conv weight `w` prepared for `cfg` is kept (_PACKED), and memoised while tuning."""
    return (w.data_ptr(), tuple(w.shape), w._version) + cfg.weight_key()


def _sans_epilogue(p: GemmProblem) -> GemmProblem:
    """The problem without its store epilogue: what its candidates' ranking depends on."""
    if isinstance(p, ConvProblem):
        return replace(p, epi=None)
    return replace(p, epi=None, c_aliases_operand=False)


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


def tactics_context(spec, builder: KernelBuilder | None, threads: int | None,
                    constants: Mapping[str, torch.Tensor], *, frozen: bool = False,
                    weight_growth: float | None = None) -> TacticsContext | None:
    """The tactics context an executable binds its steps with, or None when tactics are off.

    `spec`: None = on when `builder` builds generated kernels (a compiler is there), with the
    timing cache next to the builder's kernel folder; a policy name (`latency_first`,
    `throughput_first`, `heuristic`) = the same with that policy; a `TacticsContext` = that
    one; False = off (ATen runs every GEMM). `frozen`: the timing cache is the decision record
    (an artifact's): entries cached as noisy are used as they are, not measured again.
    `weight_growth`: the recipe's memory.weight_growth for a context made here (None: no limit)."""
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
                             weight_growth=weight_growth, **({"retune_noisy": 0} if frozen else {}))
    ctx.add_constants(constants)
    return ctx


__all__ = ["TacticsContext", "tactics_context"]
