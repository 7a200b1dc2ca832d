"""Tuning one GEMM/conv shape: its winner from the timing cache, or checked and timed now.

A cached entry's winner is checked again before it is used (a stale cache must not hand out
a wrong kernel); an entry measured on a busy machine is measured again (cache.retime_reason).
A new timing checks every candidate against ATen, times the survivors, picks the winner by
the policy and records the timing (noisy or starved when the machine was busy) in the cache.
"""
from __future__ import annotations

import logging
import statistics
import time
from typing import Any, Callable, Mapping, Sequence

from graphmode.backends.cpu.gemm import GemmProblem
from graphmode.backends.cpu.tactics.cache import TimingCache, retime_reason
from graphmode.backends.cpu.tactics.candidates import Checker
from graphmode.backends.cpu.tactics.selection import NOISY, Selection, pick, timing_doubts
from graphmode.backends.cpu.tactics.steps import ATEN, ConvStep, GemmStep
from graphmode.backends.cpu.tactics.timing import ColdPool, conv_timing_fns, gemm_timing_fns, machine_load, measure
from graphmode.backends.cpu.tactics.weights import PreparedWeights

log = logging.getLogger("graphmode.cpu.tactics")

STATISTICS: dict[str, Callable[[list[float]], float]] = {"min": min, "median": statistics.median}


class ShapeTuner:
    """Selects the winner of one shape among its built candidates (`kernels`: (problem, name) ->
    (kernel, source) or the error text). Settings as TacticsContext documents them; `stats`
    is the context's counters, updated in place."""

    def __init__(self, cache: TimingCache, checker: Checker, weights: PreparedWeights, stats: dict, *,
                 policy: str, statistic: str, reps: int, sample_s: float, budget_s: float, retune_noisy: int,
                 seed: int, cpu_clock: Callable[[], float], invariant: bool = False):
        self.cache, self.checker, self.weights, self.stats = cache, checker, weights, stats
        self.policy, self.statistic, self.reps = policy, statistic, reps
        self.sample_s, self.budget_s, self.retune_noisy = sample_s, budget_s, retune_noisy
        self.seed, self.cpu_clock = seed, cpu_clock
        self.invariant = invariant          # ATen does not win a shape a generated kernel passed

    def check(self, p: GemmProblem, name: str, step: GemmStep, kernels: Mapping,
              expect: str | None = None) -> str | None:
        """None when candidate `name` matches ATen on random data (or gives the bits `expect`
        that passed before), else why not."""
        k = kernels.get((p, name))
        if not isinstance(k, tuple):
            return f"does not build: {k}"
        self.stats["checks"] += 1
        return self.checker.check(p, name, step, k[0], expect)

    def heuristic(self, p: GemmProblem, names: Sequence[str], step: GemmStep, kernels: Mapping,
                  excluded: Mapping[str, str], t0: float) -> Selection:
        """The first generated configuration if it passes its check, else ATen; nothing timed."""
        sel = Selection(p, ATEN, "heuristic")
        sel.rejected.update(excluded)
        for name in names[1:2]:          # the first generated configuration, if any
            err = self.check(p, name, step, kernels)
            if err is None:
                sel.winner = name
            else:
                sel.rejected[name] = err
        sel.tune_s = time.perf_counter() - t0
        return sel

    def select(self, p: GemmProblem, names: Sequence[str], step: GemmStep, kernels: Mapping, *,
               key: Mapping[str, Any], excluded: Mapping[str, str], pool: ColdPool, t0: float) -> Selection:
        """`p`'s winner among `names` (ATen first): from the cache entry under `key`, else timed
        with `pool` making the weights cold; `excluded`: the candidates the plan ruled out."""
        cached = self.cache.get(key)
        previous, tries = cached, 1
        if cached is not None and self._retime(cached):
            log.info("timing cache entry for %s was measured on a busy machine; measuring again", p.text)
            tries = cached["tries"] + 1
            cached = None
        if cached is not None:
            sel = self._from_cache(p, cached, step, kernels, excluded, t0)
            if sel is not None:
                return sel
        self.stats["cache_misses"] += 1
        sel = Selection(p, ATEN, self.policy, timed=True)
        sel.rejected.update(excluded)
        for name in names[1:]:
            err = self.check(p, name, step, kernels)
            if err is not None:
                sel.rejected[name] = err[:500]
                self.stats["rejected"] += 1
        scratch = self.weights.scratch
        for k in [k for k in scratch if k[0] in ("inputs", "reference", "epilogue")]:
            del scratch[k]      # the checks' operands and ATen's result: not the timing's
        keep: list = []   # the timing buffers live until the timing is done
        fns = self._timing_fns(p, names, step, kernels, sel.rejected, keep, pool)
        samples, sel.cpu_per_wall = self._measure(fns)
        if sel.starved:       # another process had the CPUs: once more, the burst may have passed
            log.info("timing of %s was starved (%.2f CPU-s per wall-s); measuring again", p.text, sel.cpu_per_wall)
            again, cpw = self._measure(fns)
            if cpw >= sel.cpu_per_wall:
                samples, sel.cpu_per_wall = again, cpw
        del keep, fns
        self.stats["timing_runs"] += sum(len(v) for v in samples.values())
        sel.load, sel.cores = machine_load()
        sel.timings_s = {n: STATISTICS[self.statistic](v) for n, v in samples.items()}
        sel.medians_s = {n: statistics.median(v) for n, v in samples.items()}
        self.stats["timed_shapes"] += 1
        sel.winner = pick(self.policy, p, sel.timings_s, invariant=self.invariant)
        mins = sel.mins_s = {n: min(v) for n, v in samples.items() if v}
        ratios = sorted(sel.medians_s[n] / mins[n] for n in mins if mins[n] > 0)
        # noisy (measured again by the next builds): most candidates' samples disagree, or the ATen
        # baseline's alone do (every margin is stated against it), or the machine was overloaded
        sel.noisy = bool(ratios) and ratios[len(ratios) // 2] > NOISY or bool(timing_doubts(sel, (ATEN,)))
        digests = {n: self.checker.digests.pop((p, n)) for n in names if (p, n) in self.checker.digests}
        if sel.starved and previous is not None and not previous["starved"]:
            # a starved timing never replaces one the process had the CPUs for
            kept = self._from_cache(p, previous, step, kernels, excluded, t0)
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
                    excluded: Mapping[str, str], t0: float) -> Selection | None:
        """The selection a cache entry records, its winner checked again; None when the winner now
        fails its check (then the shape is tuned again)."""
        sel = Selection(p, ATEN, self.policy, dict(cached["timings_s"]), {**cached["rejected"], **excluded},
                        from_cache=True, medians_s=dict(cached["medians_s"]), noisy=cached["noisy"],
                        mins_s=dict(cached["mins_s"]), load=cached["load"], cores=cached["cores"],
                        cpu_per_wall=cached.get("cpu_per_wall"))
        sel.winner = pick(self.policy, p, sel.timings_s, invariant=self.invariant)
        # a stale cache must not hand out a wrong kernel: the winner is checked again (one run;
        # ATen runs too unless the output has the bits that passed when it was timed)
        if sel.winner == ATEN or self.check(p, sel.winner, step, kernels,
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

    def _timing_fns(self, p, names: Sequence[str], step: GemmStep, kernels: Mapping, rejected: Mapping[str, str],
                    keep: list, pool: ColdPool) -> dict[str, Callable[[], None]]:
        kw = {"seed": self.seed, "pool": pool}
        if isinstance(step, ConvStep):
            return conv_timing_fns(p, names, step, kernels, rejected, keep, weight=self.weights.conv_weight, **kw)
        return gemm_timing_fns(p, names, step, kernels, rejected, keep,
                               pack=lambda w, nr: self.weights.pack(w, p, nr), **kw)


__all__ = ["ShapeTuner", "STATISTICS"]
