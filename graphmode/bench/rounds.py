"""The method every benchmark shares, encoders (`graphmode bench`) and decoders (`bench decode`).

The timed rounds (`interleave`: every engine once per round and phase, the start rotating),
a timed call and its conditions (`measured`), the statistics of the rounds, the ratios
between engines (with the distribution-free interval of graphmode's per-round ratio), the
run's meta, and the result a --quick run is judged by. harness.py supplies what differs:
what one call is, what its numerics are checked against, which floor applies.
"""
from __future__ import annotations

import math
import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch

from graphmode.bench.contend import Phases
from graphmode.bench.machine import machine_meta
from graphmode.bench.quality import QUICK_NOTE, Conditions, Probe

NUMERICS_TOL = 1e-4      # relative L2 vs eager counted as "matched" (fp32 engines reorder sums)


def _p90(xs: list[float]) -> float:
    s = sorted(xs)
    if not s:
        return math.nan
    k = 0.9 * (len(s) - 1)
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def interleave(slots: Sequence[Any], iters: int, min_iters: int, budget_s: float, probe: Probe,
               run: Callable[[Any, float | None, str], None], phases: Phases | None = None) -> None:
    """The timed rounds: in round r every engine still running (`slot.ok`) runs once per phase,
    starting r engines later each round (rotation), so slow drift of the machine lands on every
    engine alike; `run(slot, load, phase)` is one engine's turn, `load` the 1-minute load
    average sampled as the phase starts. The phases (`quiet`, then `contended` with --contend's
    burners running, contend.py) time the same engines in the same round; the burners are
    paused again at the end of each round. Past `budget_s` the rounds end early, never before
    `min_iters`."""
    phases = phases or Phases(None)
    start = time.perf_counter()
    for r in range(iters):
        live = [s for s in slots if s.ok]
        if not live:
            break
        order = live[r % len(live):] + live[:r % len(live)]
        try:
            for phase in phases.names:
                phases.enter(phase)
                load = probe.load1()
                for s in order:
                    if s.ok:
                        run(s, load, phase)
        finally:
            phases.enter("quiet")
        if r + 1 >= min_iters and time.perf_counter() - start > budget_s:
            break


def measured(cond: Conditions, probe: Probe, load: float | None, fn: Callable[[], Any],
             untimed: int = 0) -> tuple[Any, float]:
    """`untimed` calls of `fn`, then `fn()` timed: its result and wall seconds. The CPU and wall
    seconds of the whole span and the round's load go to `cond` (the conditions quality.judge
    flags). The probe reads /proc before the untimed calls, not right before the timed one:
    there it cost a sub-millisecond call ~20% (its caches cold), and the ratios between engines
    with it."""
    w0 = probe.waited()
    c0 = probe.cpu_time()
    s0 = time.perf_counter()
    for _ in range(untimed):
        fn()
    t0 = time.perf_counter()
    out = fn()
    t1 = time.perf_counter()
    cond.cpu_s += probe.cpu_time() - c0
    w1 = probe.waited()
    cond.waited_s = None if w0 is None or w1 is None or cond.waited_s is None else cond.waited_s + max(0.0, w1 - w0)
    cond.wall_s += t1 - s0
    if load is not None:
        cond.loads.append(load)
    return out, t1 - t0


def summary_stats(times: list[float], *, mean_min: bool = False) -> dict[str, Any]:
    """Median, p90 (and mean, min), the rounds and their spread (p90 / median) of timed rounds in ms."""
    med = statistics.median(times)
    out: dict[str, Any] = {"median_ms": round(med, 4), "p90_ms": round(_p90(times), 4)}
    if mean_min:
        out.update(mean_ms=round(statistics.fmean(times), 4), min_ms=round(min(times), 4))
    out.update(iters=len(times), rounds_ms=[round(t, 4) for t in times],
               spread=round(_p90(times) / med, 3) if med > 0 else None)
    return out


def ratios(rows: list[dict[str, Any]], keys: Sequence[str], *, paired: bool = False) -> None:
    """Every row gets `keys` (None until measured); rows that ran get their ratios (set_ratios),
    graphmode's with the interval of its per-round ratio when `paired`. A row that ran an eager
    fallback gets none: its time is not graph-mode speed."""
    for r in rows:
        for k in keys:
            r.setdefault(k, None)
    ok = [r for r in rows if r["status"] == "ok" and r["median_ms"] and not r.get("eager_fallback")]
    best = set_ratios(ok)
    if paired:
        paired_interval(ok, best)


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch's intra-op threads at `n` for the run, restored after."""
    prev = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(prev)


def run_meta(threads: int, target: Any, probe: Probe, rows: list[dict[str, Any]], *, quick: bool,
             load_start: Any, t_start: float, warnings: list[str], order: Sequence[str] = (),
             **fields: Any) -> dict[str, Any]:
    """The machine (machine_meta) and the run's conditions, common to every benchmark's meta,
    then `fields`; `order` lists the keys first in the order each benchmark has written them.
    `loadavg_max` is over the quiet rows: the contended ones' load is the bench's own burners."""
    meta = machine_meta(threads, target)
    rest = dict(loadavg_start=load_start, quick=quick, usable_cores=probe.cores,
                loadavg_max=max((r["load_max"] for r in rows if r.get("load_max") is not None
                                 and r.get("condition", "quiet") == "quiet"), default=None),
                warnings=([QUICK_NOTE] if quick else []) + warnings, wall_s=round(time.perf_counter() - t_start, 1),
                **fields)
    meta.update({k: rest.pop(k) for k in order})
    meta.update(rest)
    return meta


@dataclass
class BenchResult:
    rows: list[dict[str, Any]]
    meta: dict[str, Any]

    def quick_failures(self, engine: str | None = None) -> list[str]:
        """Why a --quick run fails: an engine that did not run (not counting 'not installed')
        or whose outputs do not match eager. Never a timing. `engine`: its rows only (a full
        run fails on graphmode's own failures; another engine's is a row of the report)."""
        bad = []
        for r in self.rows:
            if engine is not None and r.get("engine") != engine:
                continue
            where = self._where(r)
            if r["status"] != "ok":
                if not r["skipped"]:
                    bad.append(f"{where}: failed: {r['reason']}")
            else:
                bad += self._numerics(r, where)
        return bad

    def _where(self, r: dict[str, Any]) -> str:
        return f"{r['model']} {'x'.join(map(str, r['shape']))} {r['label']}"

    def _numerics(self, r: dict[str, Any], where: str) -> list[str]:
        if r["numerics_ok"]:
            return []
        return [f"{where}: rel L2 vs eager {r['rel_l2_err']} > {r.get('tol', NUMERICS_TOL):g}"]


def median_interval(xs: Sequence[float], level: float = 0.95) -> tuple[float, float] | None:
    """Distribution-free interval for the median of `xs`: the k-th smallest and k-th largest,
    k the largest with P(Binomial(n, 1/2) < k) <= (1 - level) / 2 (20 samples: the 6th and
    15th, 95.9%); None under 6 samples, too few for `level`."""
    s, n = sorted(xs), len(xs)
    k, tail = 0, 0.0
    while k < n and tail + math.comb(n, k) / 2 ** n <= (1 - level) / 2:
        tail += math.comb(n, k) / 2 ** n
        k += 1
    return (s[k - 1], s[n - k]) if k else None


def paired_interval(ok: list[dict[str, Any]], best: dict[str, Any] | None) -> None:
    """graphmode's `ratio_vs_best_other_ci95`: the interval of the median of its per-round
    ratios to the best other engine. Each round times every engine within a second or so, so a
    round's ratio cancels the drift of a shared host that moves both medians; a ratio whose
    interval straddles a goal is one this run does not settle."""
    for r in (r for r in ok if r["engine"] == "graphmode" and best is not None):
        a, b = r.get("rounds_ms") or [], best.get("rounds_ms") or []
        ci = median_interval([x / y for x, y in zip(a, b) if y > 0]) if len(a) == len(b) else None
        r["ratio_vs_best_other_ci95"] = None if ci is None else [round(ci[0], 4), round(ci[1], 4)]


def set_ratios(ok: list[dict[str, Any]]) -> dict[str, Any] | None:
    """On rows that ran (`median_ms` set): ratio_vs_eager = median / eager's, speedup_vs_eager
    its inverse, ratio_vs_best_other = median / the fastest engine other than graphmode whose
    outputs matched eager's (the row returned: a fast wrong answer is no baseline)."""
    eager = next((r for r in ok if r["engine"] == "eager"), None)
    others = [r for r in ok if r["engine"] != "graphmode" and r.get("numerics_ok") is not False]
    best = min(others, key=lambda r: r["median_ms"]) if others else None
    for r in ok:
        if eager:
            r["ratio_vs_eager"] = round(r["median_ms"] / eager["median_ms"], 4)
            r["speedup_vs_eager"] = round(eager["median_ms"] / r["median_ms"], 4)
        if best:
            r["ratio_vs_best_other"] = round(r["median_ms"] / best["median_ms"], 4)
            r["best_other_engine"] = best["label"]
    return best


__all__ = ["NUMERICS_TOL", "interleave", "measured", "summary_stats", "ratios", "set_ratios", "paired_interval",
           "median_interval", "torch_threads", "run_meta", "BenchResult"]
