"""Where a compiled plan's time goes, and a cost model calibrated from it.

`profile_bucket` runs one bucket's executable `runs` times. Each run is a pair: one normal
`exe.run(inputs)` (the total) and the same steps one by one under a timer (per step), the
order alternating between runs. Per step the median over runs is reported with its work
(FLOPs, bytes from the plan), the achieved GFLOP/s and GB/s, and the roofline bound of
`graphmode.targets.cost` for the target. total - sum(steps) is the executor's own cost
(input copies, output clones and the Python loop between steps); it is paired per run, so
machine drift cancels out.

Next to it, eager PyTorch's dispatch cost: a tight loop of tiny `torch.add` calls, times
the number of ATen ops one eager forward dispatches (counted with a dispatch mode).

A roofline is an upper bound, so a step that beats it is never shown as a plain "123 %":
`roofline_breaches` names every such step with its achieved GB/s or GFLOP/s next to the
probe's, and why it can beat it — the probe under-measured the host (weights streamed from
memory faster than the probe's bandwidth, or a GEMM above the theoretical peak), or the step
read data that was still in cache (activations the previous steps just wrote, or a model
whose weights fit in the last-level cache).

Calibration (`fit_calibration`) over the per-step samples of every profiled bucket:
  step_i ~= roofline_i / efficiency[key_i]          run ~= sum_i step_i + n * overhead
with key_i = `kind|ai-class[|narrow|wide]|size-class` (`cost_key`: op kind, arithmetic-
intensity bin, GEMM N/K class, roofline-time bin), each key's efficiency = sum(roofline) /
sum(measured) over its steps (time weighted, so the big steps decide; coarser prefixes are
stored too, for work the samples did not cover) and `overhead` = the executor's
per-instruction gap. The result is a `Calibration` (one JSON per target); `predict_bucket`
predicts through `graphmode.targets.cost.predict_seconds(..., calibration=...)`, and the
recipe's Z3 latency model uses the same file through its `model_efficiency` and
`overhead_us`.
"""
from __future__ import annotations

import datetime as _dt
import json
import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import torch

from graphmode.targets.cost import Calibration, OpCost, predict_op, predict_seconds

SAMPLES_VERSION = 1
TINY_ROOFLINE_S = 1e-6      # steps with less roofline work than this are dispatch-bound
NOISY_SPREAD = 1.3          # run totals with p90 / median above this were disturbed (other load)


# ---- classifying instructions ------------------------------------------------------------------

def cost_kind(ins: Any) -> str:
    """Calibration key of a plan instruction: the op table's kind (`gemm`, `conv`, `norm`,
    `elementwise`, `shape`, `data`, ...); generated/fused groups are `fused.<kind>` (they run
    other code than ATen), keyed by the GEMM/conv/attention they contain when they do."""
    from graphmode.ir.ops import OPS
    if ins.kind == "kernel":
        body = ins.attrs.get("body_ops") or []
        kinds = {OPS[o].kind for o in body if o in OPS}
        for k in ("conv", "gemm", "attention"):
            if k in kinds:
                return f"fused.{k}"
        return f"fused.{ins.attrs.get('kind') or ins.op}"
    if ins.kind == "fallback":
        return "fallback"
    spec = OPS.get(ins.op)
    return spec.kind if spec is not None else "other"


NARROW_GEMM = 512    # a GEMM whose N or K is below this runs far from peak on small M (too little reuse)


def shape_class(ins: Any, slots: Mapping[str, Any]) -> str:
    """`narrow`/`wide` for GEMM-like instructions (min(N, K) < NARROW_GEMM or not), else "".
    Two GEMMs with the same FLOPs and bytes (16x384x1536 and 16x768x768) can differ 3x in
    speed; FLOPs and bytes alone cannot tell them apart, their N and K can."""
    kind = cost_kind(ins)
    if kind not in ("gemm", "fused.gemm") or len(ins.inputs) < 2:
        return ""
    a, b = slots[ins.inputs[0]].shape, slots[ins.inputs[1]].shape
    if not a or not b:
        return ""
    op = ins.op if ins.kind != "kernel" else next((o for o in (ins.attrs.get("body_ops") or [])
                                                    if o in ("linear", "matmul")), "linear")
    k = a[-1]
    n = b[0] if op == "linear" else b[-1]
    return "narrow" if min(n, k) < NARROW_GEMM else "wide"


def instruction_cost(ins: Any, dtype: str = "f32") -> OpCost:
    return OpCost(kind=cost_kind(ins), flops=float(ins.flops), bytes_moved=float(ins.bytes), dtype=dtype,
                  name=f"{ins.kind}:{ins.op}")


def step_instructions(exe: Any) -> list[Any]:
    """The plan instructions behind `exe.steps` (view instructions bind to no step)."""
    ins = [i for i in exe.plan.instructions if i.kind != "view"]
    if len(ins) != len(exe.steps):
        raise RuntimeError(f"{len(exe.steps)} steps for {len(ins)} non-view instructions: the executor binds "
                           "instructions differently than the profiler assumes")
    return ins


# ---- measuring ---------------------------------------------------------------------------------

@dataclass
class StepRow:
    index: int                 # position in exe.steps
    node_index: int
    name: str                  # kind:op
    cost_kind: str
    body_ops: list[str]
    in_shapes: list[list[int]]
    out_shapes: list[list[int]]
    flops: float
    bytes: float
    time_s: float              # median over runs
    share: float               # of the sum of steps
    gflops: float | None
    gbps: float | None
    roofline_s: float          # max(flops / peak, bytes / bandwidth) on the target
    bound: str                 # compute | memory
    roofline_frac: float | None  # roofline_s / time_s: how close to the bound
    shape_class: str = ""        # narrow | wide for GEMMs (see shape_class)
    const_bytes: float = 0.0     # of `bytes`, the constants (weights) it reads

    def label(self) -> str:
        body = f" [{'+'.join(self.body_ops)}]" if self.body_ops else ""
        return f"#{self.index} {self.name}{body}"

    @property
    def gathers(self) -> bool:
        """An indexed read (embedding, paged attention, index) from inputs much larger than its
        result: its byte count holds every row it could pick, an upper bound on what it reads."""
        from graphmode.ir.ops import OPS
        ops = self.body_ops or [self.name.split(":", 1)[-1]]
        elems = (lambda shapes: sum(math.prod(sh) for sh in shapes))
        return (any(o in OPS and OPS[o].has("index_dependent") and OPS[o].kind != "reduction" for o in ops)
                and elems(self.in_shapes) >= 4 * max(1, elems(self.out_shapes)))


@dataclass
class BucketProfile:
    model: str
    bucket: dict[str, int]
    threads: int
    runs: int
    steps: list[StepRow]
    run_s: float                     # median exe.run (bucket plan: copy in, steps, clone out)
    steps_sum_s: float               # sum of per-step medians
    gap_s: float                     # median over runs of (run - sum of that run's steps)
    copy_in_s: float
    clone_out_s: float
    call_s: float | None = None      # median CompiledModel call (bind, bucket, pad, run, slice)
    check_s: float | None = None     # of call_s, the input value checks (index ranges, runtime/bounds.py)
    checked_inputs: list[str] = field(default_factory=list)   # the inputs those checks cover
    eager_s: float | None = None     # median eager forward, same inputs
    eager_ops: int | None = None     # ATen ops one eager forward dispatches
    dispatch_us: float | None = None  # eager per-op dispatch cost (tiny torch.add)
    dispatch_out_us: float | None = None  # same with out= (what most executor steps do)
    facts: dict[str, float] = field(default_factory=dict)   # recipe-model facts at this bucket
    notes: list[str] = field(default_factory=list)
    loadavg: list[float] | None = None   # machine load (1/5/15 min) when the bucket was profiled
    spread: float | None = None          # p90 / median of the run totals: > NOISY_SPREAD means noise
    weights_bytes: float = 0.0           # the plan's constants: what one run streams besides activations
    above_roofline: list[dict[str, Any]] = field(default_factory=list)   # roofline_breaches of the steps

    @property
    def key(self) -> str:
        return f"{self.model}|" + ",".join(f"{k}={v}" for k, v in sorted(self.bucket.items())) + f"|t{self.threads}"

    @property
    def noisy(self) -> bool:
        return self.spread is not None and self.spread > NOISY_SPREAD

    @property
    def n_steps(self) -> int:
        return len(self.steps)

    @property
    def executor_overhead_us(self) -> float:
        """Per instruction: (run - sum of steps - input copies - output clones) / steps."""
        return max(0.0, self.gap_s - self.copy_in_s - self.clone_out_s) / max(self.n_steps, 1) * 1e6

    @property
    def gap_per_instruction_us(self) -> float:
        return max(0.0, self.gap_s) / max(self.n_steps, 1) * 1e6

    def dispatch_floor_us(self) -> float | None:
        tiny = [s.time_s for s in self.steps if s.roofline_s < TINY_ROOFLINE_S]
        return statistics.median(tiny) * 1e6 if tiny else None

    def by_kind(self) -> list[dict[str, Any]]:
        agg: dict[str, dict[str, Any]] = {}
        for s in self.steps:
            a = agg.setdefault(s.name if not s.body_ops else f"{s.name}", {"name": s.name, "count": 0, "time_s": 0.0,
                                                                          "flops": 0.0, "bytes": 0.0, "roofline_s": 0.0})
            a["count"] += 1
            a["time_s"] += s.time_s
            a["flops"] += s.flops
            a["bytes"] += s.bytes
            a["roofline_s"] += s.roofline_s
        total = self.steps_sum_s or 1.0
        out = sorted(agg.values(), key=lambda a: -a["time_s"])
        for a in out:
            a["share"] = a["time_s"] / total
        return out

    def top(self, n: int = 15) -> list[StepRow]:
        return sorted(self.steps, key=lambda s: -s.time_s)[:n]

    def samples(self) -> dict[str, Any]:
        """What calibration keeps of this profile (see `SampleStore`)."""
        return {"model": self.model, "bucket": self.bucket, "threads": self.threads, "run_s": self.run_s,
                "steps_sum_s": self.steps_sum_s, "gap_s": self.gap_s, "n_steps": self.n_steps,
                "facts": self.facts, "loadavg": self.loadavg, "spread": self.spread,
                "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                "steps": [[s.cost_kind, s.flops, s.bytes, s.time_s, s.shape_class] for s in self.steps]}

    def to_json(self, top: int = 15) -> dict[str, Any]:
        return {"model": self.model, "bucket": self.bucket, "threads": self.threads, "runs": self.runs,
                "run_ms": self.run_s * 1e3, "steps_sum_ms": self.steps_sum_s * 1e3, "gap_ms": self.gap_s * 1e3,
                "copy_in_ms": self.copy_in_s * 1e3, "clone_out_ms": self.clone_out_s * 1e3,
                "call_ms": _ms(self.call_s), "check_ms": _ms(self.check_s), "checked_inputs": self.checked_inputs,
                "eager_ms": _ms(self.eager_s), "n_steps": self.n_steps,
                "executor_overhead_us_per_instruction": self.executor_overhead_us,
                "gap_us_per_instruction": self.gap_per_instruction_us,
                "dispatch_floor_us": self.dispatch_floor_us(),
                "eager_dispatch_us_per_op": self.dispatch_us, "eager_dispatch_out_us_per_op": self.dispatch_out_us,
                "eager_aten_ops": self.eager_ops,
                "eager_dispatch_ms_estimate": (self.eager_ops * self.dispatch_us / 1e3
                                               if self.eager_ops and self.dispatch_us else None),
                "top": [asdict(s) for s in self.top(top)], "by_op": self.by_kind(),
                "steps": [asdict(s) for s in self.steps], "facts": self.facts, "notes": self.notes,
                "loadavg": self.loadavg, "spread": self.spread, "noisy": self.noisy,
                "weights_bytes": self.weights_bytes, "above_roofline": self.above_roofline}


def _ms(v: float | None) -> float | None:
    return None if v is None else v * 1e3


def _median_time(fn, runs: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def eager_dispatch_us(calls: int = 2000, repeats: int = 7) -> tuple[float, float]:
    """Per-call cost of a tiny `torch.add` (1 element) under inference_mode, µs: (plain, out=)."""
    a, b = torch.ones(1), torch.ones(1)
    c = torch.empty(1)
    plain, out = [], []
    with torch.inference_mode():
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(calls):
                torch.add(a, b)
            plain.append((time.perf_counter() - t0) / calls)
            t0 = time.perf_counter()
            for _ in range(calls):
                torch.add(a, b, out=c)
            out.append((time.perf_counter() - t0) / calls)
    return statistics.median(plain) * 1e6, statistics.median(out) * 1e6


def count_eager_ops(module: torch.nn.Module, inputs: Mapping[str, torch.Tensor]) -> int:
    """ATen ops one eager forward dispatches (below autograd, i.e. what the CPU kernels see)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            _Count.n += 1
            return func(*args, **(kwargs or {}))

    with torch.inference_mode(), _Count():
        module(**inputs)
    return _Count.n


def _ran_as(name: str, step: Any) -> str:
    """A step's kind as it runs now: an op bound as an ATen call whose tuned step chose a
    generated kernel (a depthwise conv's `dw`) is a kernel, not ATen."""
    tactic = getattr(step, "tactic", None)
    kind, _, op = name.partition(":")
    return f"kernel:{op}" if kind == "aten" and isinstance(tactic, str) and tactic != "aten" else name


def profile_executable(exe: Any, inputs: Mapping[str, torch.Tensor], target: Any, *, runs: int = 20,
                       model: str = "model", threads: int = 1) -> BucketProfile:
    """Paired total / per-step timing of one bucket's CpuExecutable (inputs at the bucket's shape)."""
    instrs = step_instructions(exe)
    steps, names = exe.steps, [_ran_as(name, step) for name, step in zip(exe.step_names, exe.steps)]
    n = len(steps)
    per: list[list[float]] = [[] for _ in range(n)]
    totals, gaps, copies, clones = [], [], [], []
    views = exe.views
    plan = exe.plan
    exe.run(inputs)                          # warm

    def timed_run() -> float:
        t0 = time.perf_counter()
        exe.run(inputs)
        return time.perf_counter() - t0

    for r in range(runs):
        total = timed_run() if r % 2 == 0 else None     # alternate which half of the pair goes first
        with exe.lock, torch.inference_mode():
            t0 = time.perf_counter()
            for name in plan.inputs:
                views[name].copy_(inputs[name])
            copies.append(time.perf_counter() - t0)
            run_sum = 0.0
            for i, step in enumerate(steps):
                t0 = time.perf_counter()
                step()
                dt = time.perf_counter() - t0
                per[i].append(dt)
                run_sum += dt
            t0 = time.perf_counter()
            _ = {o: views[o].clone() for o in plan.outputs}
            clones.append(time.perf_counter() - t0)
        if total is None:
            total = timed_run()
        totals.append(total)
        gaps.append(total - run_sum)
    med = [statistics.median(p) for p in per]
    ssum = sum(med)
    srt = sorted(totals)
    spread = srt[min(len(srt) - 1, round(0.9 * (len(srt) - 1)))] / statistics.median(totals)
    rows = []
    for i, (ins, name, t) in enumerate(zip(instrs, names, med)):
        pred = predict_op(target, instruction_cost(ins))
        roof = max(pred.compute_s, pred.memory_s)
        rows.append(StepRow(
            index=i, node_index=ins.node_index, name=name, cost_kind=cost_kind(ins),
            body_ops=list(ins.attrs.get("body_ops") or []),
            in_shapes=[list(plan.slots[v].shape) for v in ins.inputs],
            out_shapes=[list(plan.slots[v].shape) for v in ins.outputs],
            flops=float(ins.flops), bytes=float(ins.bytes), time_s=t, share=t / ssum if ssum else 0.0,
            gflops=ins.flops / t / 1e9 if t > 0 and ins.flops else None,
            gbps=ins.bytes / t / 1e9 if t > 0 and ins.bytes else None,
            roofline_s=roof, bound="compute" if pred.compute_s >= pred.memory_s else "memory",
            roofline_frac=roof / t if t > 0 else None, shape_class=shape_class(ins, plan.slots),
            const_bytes=float(sum(plan.slots[v].nbytes for v in ins.inputs if plan.slots[v].const is not None))))
    weights = float(sum(plan.slots[c].nbytes for c in plan.constants if c in plan.slots))
    return BucketProfile(model=model, bucket=dict(plan.env), threads=threads, runs=runs, steps=rows,
                         run_s=statistics.median(totals), steps_sum_s=ssum, gap_s=statistics.median(gaps),
                         copy_in_s=statistics.median(copies), clone_out_s=statistics.median(clones),
                         spread=spread, weights_bytes=weights,
                         above_roofline=roofline_breaches(rows, target, weights))


def roofline_breaches(steps: Sequence[StepRow], target: Any, weights_bytes: float) -> list[dict[str, Any]]:
    """The steps that ran faster than their roofline on `target`, each with its achieved rate, the
    target's (`probe`) and the `cause`: `peak` (a GEMM above the f32 peak: the cores ran faster
    than the reported clock and the probe's FMA chains, which a probe taken on a busy host
    under-measures), `probe` (a step that reads mostly weights of a model larger than the LLC,
    so from memory, above the probed bandwidth: the probe under-measured), `cache` (its data
    was in cache: activations the previous steps just wrote, or weights that fit in the LLC)
    or `gather` (an indexed read whose byte count is the whole table it picks rows from).
    `why` says it in one sentence with the numbers."""
    bw, peak, llc = target.memory_bandwidth_gbps, target.peak("f32") / 1e9, target.llc_bytes
    out = []
    for s in steps:
        if s.time_s <= 0:
            continue
        p = predict_op(target, OpCost(kind=s.cost_kind, flops=s.flops, bytes_moved=s.bytes))
        roof = max(p.compute_s, p.memory_s)
        if roof <= s.time_s:
            continue
        frac = roof / s.time_s
        if p.compute_s >= p.memory_s:
            achieved, probe, unit, cause = s.flops / s.time_s / 1e9, peak, "GFLOP/s", "peak"
            why = (f"{s.label()} ran at {achieved:.3g} GFLOP/s, above the f32 peak of {peak:.3g} GFLOP/s ({frac:.0%} "
                   "of its roofline): the peak under-counts this host (its cores ran faster than the reported "
                   "clock and than the probe's FMA chains did, e.g. a probe taken while the host was busy); re-probe "
                   "on an idle machine with `graphmode targets show host --reprobe`")
        else:
            achieved, probe, unit = s.bytes / s.time_s / 1e9, bw, "GB/s"
            weights = s.const_bytes >= 0.5 * s.bytes
            cause = "gather" if s.gathers else "probe" if weights and weights_bytes > llc else "cache"
            head = f"{s.label()} moved {achieved:.3g} GB/s, above the probe's {bw:.3g} GB/s ({frac:.0%} of its roofline)"
            if cause == "gather":
                why = (f"{head}: it reads only the rows (or pages) it indexes, and its byte count is every row it "
                       "could pick, so this rate is not what it read")
            elif cause == "probe":
                why = (f"{head}: the host probe under-measured the memory bandwidth (the step reads mostly weights, and "
                       f"the model's {weights_bytes / 2**20:.3g} MiB exceed the {llc / 2**20:.0f} MiB LLC); re-probe on "
                       "an idle machine with `graphmode targets show host --reprobe`")
            else:
                where = (f"the model's {weights_bytes / 2**20:.3g} MiB of weights fit in the {llc / 2**20:.0f} MiB LLC"
                         if weights else "activations the previous steps just wrote")
                why = f"{head}: its data was in cache ({where}), which the memory roofline does not bound"
        out.append({"step": s.index, "label": s.label(), "achieved": round(achieved, 3), "probe": round(probe, 3),
                    "unit": unit, "roofline_frac": round(frac, 3), "cause": cause, "why": why})
    return out


def model_roofline(target: Any, facts: Mapping[str, float], dtype: str = "f32") -> tuple[float, str]:
    """(seconds, compute | memory): max(FLOPs / peak, bytes / bandwidth) of one whole run from
    its facts (`facts_at`): the floor no engine can beat on `target`."""
    p = predict_op(target, OpCost(kind="model", flops=float(facts.get("flops", 0.0)),
                                  bytes_moved=float(facts.get("bytes", 0.0)), dtype=dtype))
    return max(p.compute_s, p.memory_s), "compute" if p.compute_s >= p.memory_s else "memory"


def facts_at(cm: Any, recipe: Any, target: Any, env: Mapping[str, int]) -> dict[str, float]:
    """The recipe latency model's inputs at one bucket, from the compiler's facts: total FLOPs,
    bytes (weights + planned activations, as the proof counts them, but a lookup table only
    for the rows it picks) and instruction count."""
    from graphmode.compile_report import model_facts
    from graphmode.plan.memory import activation_peak_expr
    from graphmode.recipe import smt
    from graphmode.recipe.constraints import build_constraint_model
    act = activation_peak_expr(cm.graph, reuse=recipe.optimize.memory_reuse,
                               alias_groups=[list(g) for g in recipe.alias_groups])
    facts = model_facts(cm.graph, act)
    m = build_constraint_model(recipe, target, facts)
    vals = {k: int(v) for k, v in env.items()}
    moved = m.bytes_moved if m.bytes_moved is not None else m.resident_once_bytes
    table, picked = lookup_table_bytes(cm.graph, vals)
    return {"flops": float(smt.evaluate(m.flops, vals)), "bytes": float(smt.evaluate(moved, vals)) - table + picked,
            "n_ops": float(smt.evaluate(m.n_ops, vals))}


def lookup_table_bytes(graph: Any, env: Mapping[str, int]) -> tuple[int, int]:
    """(bytes of the constants read only by indexed reads, bytes those reads pick at `env`): a
    lookup table is read a row per index, not whole. The proofs count every weight (their
    latency bound stays conservative); a floor that counted MiniLM's 47 MB token table at
    (1, 16) was twice what a run reads, and a row 'at 0.91x the floor' was not near it."""
    from graphmode.analysis.indices import lookup_only_constants
    from graphmode.ir.types import eval_dim
    users = graph.users()
    table = picked = 0
    for k in lookup_only_constants(graph):
        t = graph.constants[k]
        table += t.numel() * t.element_size()
        for n in users[k]:
            out = graph.type_of(n.outputs[0])
            picked += math.prod(eval_dim(d, env) for d in out.shape) * t.element_size()
    return table, picked


def profile_bucket(cm: Any, recipe: Any, env: Mapping[str, int], target: Any, *, runs: int = 20,
                   model: str = "model", threads: int = 1, eager: bool = True, seed: int = 0) -> BucketProfile:
    """Profile the bucket `env` of a CompiledModel; eager and dispatch numbers next to it."""
    from graphmode.targets.host import load_average
    env = dict(env)
    exe = cm.executable(env)
    inputs = cm.sample_inputs(env, seed=seed)
    load = load_average()
    prof = profile_executable(exe, inputs, target, runs=runs, model=model, threads=threads)
    prof.loadavg = load
    prof.call_s = _median_time(lambda: cm(**inputs), max(3, runs // 2))
    prof.checked_inputs = [c.input for c in cm.bounds()[0]]
    prof.check_s = _median_time(lambda: cm.check_inputs(inputs), max(3, runs // 2))
    try:
        prof.facts = facts_at(cm, recipe, target, env)
    except Exception as e:  # noqa: BLE001 - the proof model is an extra column, never a blocker
        prof.notes.append(f"recipe latency model unavailable: {type(e).__name__}: {e}")
    if eager and cm.source.module is not None:
        module = cm.source.module
        with torch.inference_mode():
            prof.eager_s = _median_time(lambda: module(**inputs), max(3, runs // 2))
        prof.eager_ops = count_eager_ops(module, inputs)
        prof.dispatch_us, prof.dispatch_out_us = eager_dispatch_us()
    return prof


# ---- calibration ---------------------------------------------------------------------------------

class SampleStore:
    """Profiled buckets kept next to a calibration (`<calibration>.samples.json`), so one
    calibration is fitted over every model and bucket profiled on the target; profiling the
    same model/bucket/threads again replaces its entry."""

    def __init__(self, path: str | Path, target: str):
        self.path = Path(path)
        self.target = target
        self.buckets: dict[str, dict[str, Any]] = {}
        if self.path.is_file():
            try:
                data = json.loads(self.path.read_text(encoding="utf-8"))
                if data.get("version") == SAMPLES_VERSION and data.get("target") == target:
                    self.buckets = dict(data.get("buckets", {}))
            except (OSError, ValueError, AttributeError):
                self.buckets = {}     # unreadable: start again (the calibration is refitted below)

    @staticmethod
    def path_for(calibration_path: str | Path) -> Path:
        p = Path(calibration_path)
        return p.with_name(p.stem + ".samples.json")

    def add(self, prof: BucketProfile) -> None:
        self.buckets[prof.key] = prof.samples()

    def save(self) -> Path:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps({"version": SAMPLES_VERSION, "target": self.target,
                                         "buckets": self.buckets}), encoding="utf-8")
        return self.path


def _roof(target: Any, kind: str, flops: float, nbytes: float) -> float:
    p = predict_op(target, OpCost(kind=kind, flops=flops, bytes_moved=nbytes))
    return max(p.compute_s, p.memory_s)


_AI_BINS = ((1, "ai<1"), (4, "ai1-4"), (16, "ai4-16"), (64, "ai16-64"), (256, "ai64-256"))
_SIZE_BINS = ((TINY_ROOFLINE_S, "tiny"), (50e-6, "small"))


def cost_key(target: Any, kind: str, flops: float, nbytes: float, shape: str = "") -> str:
    """Calibration key `kind|ai-class[|shape-class]|size-class`: arithmetic intensity
    (FLOP/byte, bins of 4x: skinny vs square GEMMs), narrow vs wide GEMMs (`shape_class`),
    and the roofline time (dispatch-bound steps vs real work). `Calibration.efficiency`
    falls back to ever shorter prefixes (`gemm|ai4-16|narrow`, `gemm|ai4-16`, `gemm`)."""
    ai = flops / nbytes if nbytes else math.inf
    a = next((label for hi, label in _AI_BINS if ai < hi), "ai256+")
    roof = _roof(target, kind, flops, nbytes)
    size = next((label for hi, label in _SIZE_BINS if roof < hi), "large")
    return f"{kind}|{a}|{shape}|{size}" if shape else f"{kind}|{a}|{size}"


def _step(st: Sequence[Any]) -> tuple[str, float, float, float, str]:
    """A stored step: [kind, flops, bytes, seconds(, shape class)]."""
    return st[0], float(st[1]), float(st[2]), float(st[3]), (st[4] if len(st) > 4 else "")


def fit_calibration(target: Any, buckets: Iterable[Mapping[str, Any]], note: str = "") -> Calibration:
    """One Calibration from the per-step samples of profiled buckets (see the module doc).

    Every step is keyed `kind|ai-class|size-class`; the efficiency of a key (and of its
    coarser prefixes `kind|ai-class` and `kind`, used for work not seen here) is
    sum(roofline) / sum(measured) over its steps, so the time of the big steps decides and
    the fitted plan totals reproduce the measured sum of steps. `overhead_us` is the
    executor's own per-instruction cost between steps (median over buckets)."""
    buckets = list(buckets)
    if not buckets:
        from graphmode.errors import TargetError
        raise TargetError("no profiled buckets to calibrate from", where="calibration",
                          fix="run `graphmode profile --model M --calibrate` first")
    gap = statistics.median(max(0.0, bk["gap_s"]) / max(bk["n_steps"], 1) for bk in buckets)
    num: dict[str, float] = {}
    den: dict[str, float] = {}
    tot_r = tot_t = 0.0
    n = 0
    for bk in buckets:
        for st in bk["steps"]:
            kind, f, b, t, shape = _step(st)
            n += 1
            roof = _roof(target, kind, f, b)
            if roof <= 0 or t <= 0:
                continue
            tot_r += roof
            tot_t += t
            parts = cost_key(target, kind, f, b, shape).split("|")
            for i in range(1, len(parts) + 1):
                k = "|".join(parts[:i])
                num[k] = num.get(k, 0.0) + roof
                den[k] = den.get(k, 0.0) + t
    raw = {k: num[k] / den[k] for k in sorted(num) if den[k] > 0}
    over = sorted(k for k, v in raw.items() if v > 1.0)
    eff = {k: _round(min(1.0, v)) for k, v in raw.items()}
    if over:    # faster than the roofline: data the cache held (a small model), not what a larger one gets
        note = (note + "; " if note else "") + (f"{len(over)} step class(es) ran faster than the roofline "
                                                 f"({', '.join(over[:3])}{', ...' if len(over) > 3 else ''}): "
                                                 "capped at efficiency 1, a prediction never under the floor")
    cal = Calibration(target=target.name, op_efficiency=eff,
                      default_efficiency=_round(min(1.0, tot_r / tot_t)) if tot_t > 0 else 1.0,
                      overhead_us=round(gap * 1e6, 3), samples=n, **Calibration.reference_of(target),
                      created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                      note=(f"fitted by graphmode profile from {len(buckets)} bucket(s): "
                            + ", ".join(sorted(f"{bk['model']} {_bk(bk['bucket'])}" for bk in buckets))
                            + (f"; {note}" if note else "")))
    model_eff = []
    for bk in buckets:
        fa = bk.get("facts") or {}
        if not fa.get("flops") and not fa.get("bytes"):
            continue
        roof = model_roofline(target, fa)[0]
        work = bk["run_s"] - fa.get("n_ops", 0.0) * gap
        if roof > 0 and work > 0:
            model_eff.append(roof / work)
    if model_eff:
        cal.model_efficiency = _round(min(1.0, statistics.median(model_eff)))
    return cal


def _round(x: float) -> float:
    """4 significant digits (efficiencies span 1e-4 .. 10)."""
    return float(f"{x:.4g}") if x > 0 else 1e-9


def _bk(bucket: Mapping[str, int]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(bucket.items()))


def reference_target(target: Any, calibration: Calibration | None) -> Any:
    """`target` with the peak and bandwidth `calibration` was fitted against (the host probe
    measures bandwidth again when its key changes, and under load it reads lower)."""
    if calibration is None or not (calibration.reference_bandwidth_gbps or calibration.reference_peak_flops):
        return target
    return target.model_copy(update={"memory_bandwidth_gbps": calibration.bandwidth_gbps(target),
                                     "peak_flops": {**target.peak_flops, **calibration.reference_peak_flops}})


def predict_bucket(target: Any, sample: Mapping[str, Any], calibration: Calibration | None) -> float:
    """End-to-end seconds of a profiled bucket's plan through the cost model."""
    tgt = reference_target(target, calibration)
    ops = []
    for st in sample["steps"]:
        k, f, b, _, shape = _step(st)
        ops.append(OpCost(kind=cost_key(tgt, k, f, b, shape), flops=f, bytes_moved=b))
    return predict_seconds(tgt, ops, calibration=calibration).total_s


def predict_recipe_model(target: Any, sample: Mapping[str, Any], calibration: Calibration | None) -> float | None:
    """The recipe's Z3 latency model (graphmode.recipe.constraints) at this bucket's facts."""
    from fractions import Fraction

    from graphmode.recipe.constraints import ConstraintModel, apply_calibration
    fa = sample.get("facts") or {}
    if not fa:
        return None
    cm = ConstraintModel(domains={}, memory_terms={"bytes": int(fa["bytes"])}, budget_bytes=None, budget_source="",
                         flops=int(fa["flops"]), bytes_moved=int(fa["bytes"]), n_ops=int(fa["n_ops"]),
                         peak_flops=Fraction(str(target.peak("f32"))),
                         bandwidth=Fraction(str(target.memory_bandwidth_gbps)) * 10**9,
                         launch_overhead_s=Fraction(str(target.launch_overhead_us)) / 10**6)
    cm = apply_calibration(cm, target, calibration)
    lat = cm.latency_s()
    return float(lat) if lat is not None else None


@dataclass
class PredictionRow:
    key: str
    model: str
    bucket: dict[str, int]
    measured_s: float
    roofline_s: float                 # uncalibrated cost model
    calibrated_s: float
    loo_s: float | None               # calibrated without this model's samples (out of sample)
    recipe_model_s: float | None      # the recipe's Z3 latency model, uncalibrated
    recipe_model_cal_s: float | None  # ... calibrated
    previous_s: float | None = None   # with the calibration that existed before this run
    noisy: bool = False               # the bucket's run totals spread more than NOISY_SPREAD

    @staticmethod
    def err(pred: float | None, meas: float) -> float | None:
        return None if pred is None or not meas else (pred - meas) / meas

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        for k in ("roofline_s", "calibrated_s", "loo_s", "recipe_model_s", "recipe_model_cal_s", "previous_s"):
            d[k.replace("_s", "_err")] = self.err(getattr(self, k), self.measured_s)
        return d


def prediction_table(target: Any, buckets: Mapping[str, Mapping[str, Any]], calibration: Calibration,
                     previous: Calibration | None = None) -> list[PredictionRow]:
    rows = []
    for key, s in buckets.items():
        others = [b for k, b in buckets.items() if b["model"] != s["model"]]
        loo = predict_bucket(target, s, fit_calibration(target, others)) if others else None
        rows.append(PredictionRow(
            key=key, model=s["model"], bucket=dict(s["bucket"]), measured_s=s["run_s"],
            roofline_s=predict_bucket(target, s, None), calibrated_s=predict_bucket(target, s, calibration),
            loo_s=loo, recipe_model_s=predict_recipe_model(target, s, None),
            recipe_model_cal_s=predict_recipe_model(target, s, calibration),
            previous_s=predict_bucket(target, s, previous) if previous is not None else None,
            noisy=(s.get("spread") or 0.0) > NOISY_SPREAD))
    return rows


def within(rows: Sequence[PredictionRow], bound: float = 0.25) -> bool:
    """Every calibrated prediction within +-bound of the measured median."""
    errs = [PredictionRow.err(r.calibrated_s, r.measured_s) for r in rows]
    return all(e is not None and abs(e) <= bound for e in errs)
