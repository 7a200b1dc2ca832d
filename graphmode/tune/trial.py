"""One tuning trial: a recipe configuration compiled, checked against eager and timed.

The model is captured once (`TrialRunner.__init__`, `compiler.capture_model`): no knob tune
changes what capture sees (the dims' ranges and the capture op lists stay the recipe's), so
every trial is the driver's `relower` of the same graph and pays only for the verdict, the
passes, the proof and its plans.

A trial is measured on a fixed workload: request shapes drawn once (seeded) from the
recipe's admissible ranges, the smallest and the largest included, so padding costs what
the traffic pays. Each round times every request once (rotating the order); p50 and p99
are over all timed requests, P99/P50 is over every call relative to its shape's median (the
jitter of a shape, not the spread between sizes), throughput is items per second of busy time.
Every trial ends as `ok`, `violates` (the contract: verdict, proof, SLA, memory,
determinism or numerics, with the reason) or `failed` (an error, with its message).
"""
from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree

from graphmode.errors import GraphmodeError
from graphmode.kb.measure import batch_rows, judge, latency_summary, plan_memory_mb
from graphmode.monitor.drift import sla_target
from graphmode.recipe.buckets import bucket_for, dim_range
from graphmode.tune.space import apply, key_of
from graphmode.verify.numerics import WEIGHT_ONLY

WORKLOAD = 6              # request shapes per trial
GRAPH_AXES = ("fusion", "fusion.max_ops")      # knobs that act only through the optimized graph
MIN_ROUNDS, MAX_ROUNDS = 3, 200
STATUSES = ("ok", "violates", "failed")


class TrialCutOff(Exception):
    """The budget ended inside a trial (between two plan builds or timing rounds): the trial is
    not a result, so it is neither journaled nor recorded, and a resumed run measures it."""


@dataclass
class TrialResult:
    index: int
    config: dict[str, Any]
    status: str                              # ok | violates | failed
    reason: str | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    recipe_hash: str | None = None
    seconds: float = 0.0
    samples: int = 0
    replayed: bool = False                   # read back from the journal, not run now
    recipe: Any = None                       # the trial's Recipe (not journaled)
    ir_hash: str | None = None
    error: GraphmodeError | None = None      # why it failed, where graphmode said (not journaled)
    same_as: int | None = None               # the trial whose compiled graph and plan this one is

    @property
    def key(self) -> str:
        return key_of(self.config)

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, "config": self.config, "status": self.status, "reason": self.reason,
                "metrics": self.metrics, "recipe_hash": self.recipe_hash, "seconds": round(self.seconds, 3),
                "samples": self.samples, **({"same_as": self.same_as} if self.same_as is not None else {})}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "TrialResult":
        """A journaled trial, read back only when every field is what a trial writes: a line
        edited by hand (a p99 of "fast" or -5 ms, a NaN) raises ValueError and is skipped, so it
        neither crashes the report nor wins the search."""
        metrics = dict(d.get("metrics") or {})
        for k, v in metrics.items():
            if v is not None and not (type(v) in (int, float) and math.isfinite(v) and v >= 0):
                raise ValueError(f"metric {k} = {v!r} is not a finite number >= 0")
        if d["status"] not in STATUSES or type(d["index"]) is not int or not isinstance(d["config"], dict):
            raise ValueError("not a trial graphmode wrote")
        seconds, samples = d.get("seconds") or 0.0, d.get("samples") or 0
        if type(seconds) not in (int, float) or not math.isfinite(seconds) or type(samples) is not int:
            raise ValueError("not a trial graphmode wrote")
        reason, rhash = d.get("reason"), d.get("recipe_hash")
        if not all(v is None or isinstance(v, str) for v in (reason, rhash)):
            raise ValueError("not a trial graphmode wrote")
        same = d.get("same_as")
        if same is not None and type(same) is not int:
            raise ValueError("not a trial graphmode wrote")
        return cls(d["index"], dict(d["config"]), d["status"], reason, metrics, rhash, float(seconds), samples,
                   replayed=True, same_as=same)


def jitter(times: list[list[float]]) -> float | None:
    """P99/P50 of every timed call relative to its own request shape's median: how far the slow
    calls stray from the typical one, without the spread between request sizes."""
    norm = []
    for ts in times:
        med = latency_summary(ts)["p50_ms"]
        norm += [t / med for t in ts] if med else []
    return latency_summary(norm)["p99_over_p50"]


def workload(recipe: Any, seed: int = 0) -> list[dict[str, int]]:
    """The request shapes every trial is timed on: all-smallest, all-largest, then random."""
    rng = random.Random(seed)
    ranges = {d: dim_range(s) for d, s in recipe.dims.items()}
    shapes = [{d: lo for d, (lo, _) in ranges.items()}, {d: hi for d, (_, hi) in ranges.items()}]
    while len(shapes) < WORKLOAD:
        shapes.append({d: rng.randint(lo, hi) for d, (lo, hi) in ranges.items()})
    return list({key_of(s): s for s in shapes}.values())


def _check(deadline: float) -> None:
    if time.monotonic() > deadline:
        raise TrialCutOff


class TrialRunner:
    """Runs trials of one model and base recipe on one target."""

    def __init__(self, model: Any, base_data: dict[str, Any], target: Any, *, tol: float, measure_s: float,
                 cache_dir: Any = None, seed: int = 0):
        from graphmode.compiler import capture_model
        from graphmode.recipe import load_recipe
        self.base_data, self.target, self.tol, self.measure_s, self.cache_dir = base_data, target, tol, measure_s, \
            cache_dir
        self.base = load_recipe(base_data)
        self.captured = capture_model(model, self.base)
        self.graph0, self.src = self.captured.captured, self.captured.source
        self.shapes = workload(self.base, seed)
        from graphmode.analysis.indices import analyze_indices
        from graphmode.runtime.bounds import draw_within, value_checks
        inside = value_checks(self.base, analyze_indices(self.graph0))     # ids inside the model's tables
        self._inputs = [draw_within(self.src.make_inputs(s, seed=seed), inside, seed) for s in self.shapes]
        self._refs = [[t.detach().clone() for t in self.src.reference(x)] for x in self._inputs]
        self._measured: dict[tuple[str, str], TrialResult] = {}     # (graph, plan knobs) -> the trial timed
        self._ran: set[int] = set()                                 # trial indices run in this process

    def run(self, cfg: dict[str, Any], index: int, deadline: float = float("inf")) -> TrialResult:
        """Run one trial; raises TrialCutOff when `deadline` (time.monotonic) passes inside it."""
        t0 = time.perf_counter()
        res = TrialResult(index, dict(cfg), "failed")
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(int(cfg.get("threads") or threads))
            self._run(cfg, res, t0, deadline)
        except TrialCutOff:
            raise
        except GraphmodeError as e:
            res.status = "violates" if e.exit_code == 1 else "failed"
            res.reason, res.error = f"{type(e).__name__}: {e.render()}", e
        except Exception as e:  # noqa: BLE001 - a trial that crashes is a recorded result, not the end of tuning
            first = (str(e).strip().splitlines() or [""])[0]
            res.status, res.reason = "failed", f"{type(e).__name__}: {first}"
        finally:
            torch.set_num_threads(threads)
        res.seconds = time.perf_counter() - t0
        return res

    def _run(self, cfg: dict[str, Any], res: TrialResult, t0: float, deadline: float) -> None:
        from graphmode.compiler import relower
        from graphmode.recipe import load_recipe, recipe_hash
        from graphmode.runtime.compiled import CompiledModel
        recipe = res.recipe = load_recipe(apply(self.base_data, cfg))
        res.recipe_hash = recipe_hash(recipe)
        mode = recipe.exe_mode
        low = relower(self.captured, recipe, self.target)      # refused at the verdict or the proof
        cm = CompiledModel.from_lowered(low, recipe, self.target, mode=mode, cache_dir=self.cache_dir,
                                        threads=cfg.get("threads"))
        res.ir_hash = low.graph.structural_hash()
        plan = (res.ir_hash, key_of({k: v for k, v in cfg.items() if k not in GRAPH_AXES}))
        same = self._measured.get(plan)
        again = res.index in self._ran                 # tune's confirmation: measured again, whatever it equals
        self._ran.add(res.index)
        if same is not None and not again:
            # a fusion change that leaves the compiled graph as it was (an attention pattern dropped from
            # a CNN) is the same plan: timed again, its noise was "confirmed +5.8%"
            res.metrics, res.samples, res.same_as = dict(same.metrics), same.samples, same.index
            res.status, res.reason = same.status, same.reason
            return
        buckets = [bucket_for(recipe, s) for s in self.shapes]
        if mode != "eager":
            for b in buckets:
                if b is not None:
                    _check(deadline)
                    cm.executable(b)
        compile_s = time.perf_counter() - t0
        err, flips = self._numerics(cm, recipe, low.graph)
        times = self._time(cm, deadline)
        pooled = [t for ts in times for t in ts]
        m = latency_summary(pooled)
        m["p99_over_p50"] = jitter(times)
        busy = sum(pooled) / 1e3
        items = sum(batch_rows(recipe, s) * len(ts) for s, ts in zip(self.shapes, times))
        m.update(throughput=round(items / busy, 3) if busy > 0 else None, compile_s=round(compile_s, 4),
                 numerics_err=err, peak_memory_mb=plan_memory_mb(cm, [b for b in buckets if b is not None]))
        res.metrics, res.samples = m, len(pooled)
        tol = max(self.tol, WEIGHT_ONLY.get(recipe.precision.weights, 0.0))    # narrow weights: their contract
        _, overall = judge(recipe, None, m, tol=tol)
        why = [overall] if overall else []
        if flips:
            why.append(f"numerics: {recipe.precision.weights} weights change the top-1 of {flips} position(s) the "
                       "f32 model decided (graphmode verify shows them)")
        for s, ts in zip(self.shapes, times):                # per-bucket SLA entries hold per request shape
            entry = sla_target(recipe, s)
            if entry is not None and entry.key != "sla":
                per = latency_summary(ts)
                _, r = judge(recipe, s, {"p50_ms": per["p50_ms"], "p99_ms": per["p99_ms"]})
                if r:
                    why.append(f"at {s}: {r}")
        res.status, res.reason = ("violates", "; ".join(why)) if why else ("ok", None)
        self._measured.setdefault(plan, res)

    def _numerics(self, cm: Any, recipe: Any, graph: Any) -> tuple[float, int]:
        """The worst rel L2 vs eager over the workload, and the confident top-1 flips of logits
        where the recipe stores weights narrow: the contract `graphmode verify` holds it to
        (a verify-passing int8 recipe was recorded `violates` at the f32 tolerance)."""
        from graphmode.verify.bisect import compare_outputs, logit_outputs, output_labels
        err, flips = 0.0, 0
        for x, ref in zip(self._inputs, self._refs):
            got = [t for t in pytree.tree_leaves(cm(**x)) if isinstance(t, torch.Tensor)]
            if len(got) != len(ref) or any(g.shape != r.shape for g, r in zip(got, ref)):
                return float("inf"), flips
            for c in compare_outputs(output_labels(self.src, graph, len(got)), got, ref,
                                     recipe.precision.compute, recipe.precision.weights,
                                     logits=logit_outputs(graph, len(got))):
                err = max(err, c.rel_l2)
                flips += c.top1.flips if c.judge_top1 and c.top1 is not None else 0
        return err, flips

    def _time(self, cm: Callable[..., Any], deadline: float) -> list[list[float]]:
        """ms per request shape: rounds until `measure_s` has passed (at least MIN_ROUNDS)."""
        times: list[list[float]] = [[] for _ in self._inputs]
        order = list(range(len(self._inputs)))
        enough = time.monotonic() + self.measure_s
        rounds = 0
        with torch.inference_mode():
            for x in self._inputs:                  # one untimed call each: the plans are warm
                cm(**x)
            while rounds < MIN_ROUNDS or (rounds < MAX_ROUNDS and time.monotonic() < min(enough, deadline)):
                _check(deadline)
                for i in order[rounds % len(order):] + order[:rounds % len(order)]:
                    t = time.perf_counter()
                    cm(**self._inputs[i])
                    times[i].append((time.perf_counter() - t) * 1e3)
                rounds += 1
        return times
