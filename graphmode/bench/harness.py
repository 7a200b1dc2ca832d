"""The benchmark loop: every engine on the same inputs, same threads, interleaved rounds.

Per (model, shape):
1. set up every engine (timed, with its peak RSS), each failure recorded with its reason;
2. warm-up calls; the outputs of the last one are compared with eager (relative L2);
3. `iters` rounds; in each round every engine runs `rewarm` untimed calls and then one timed
   call, starting one engine later each round (rotation), so slow drift of the machine
   (other jobs, thermal, frequency) lands on every engine alike; a per-shape time budget
   may end the rounds early (never below `min_iters`). The untimed calls matter: right
   after another engine ran, a call is slower (its thread pool went to sleep, the other
   engine's allocations and threads changed the caches and heap) — measured on 2 cores,
   eager MiniLM (1,128) took 25 ms alone, 31-53 ms when timed right after ONNX Runtime or
   torch.compile, 29 ms among four engines with one untimed call and 23 ms with two (every
   engine then matched its time when benchmarked alone). The timed call is therefore the
   warm, steady-state latency of an engine serving back-to-back requests;
4. median, p90, ratios vs eager and vs the best engine that is not graphmode;
5. the conditions of each engine's timed calls (load average per round, the process's CPU
   seconds per wall second, the spread of its rounds) and how graphmode ran (its eager
   fallbacks and islands) become flags on the row (quality.py), so a number the machine
   made is never shown as a result without saying so;
6. the shape's roofline floor on the host (floors.py) and each row's time as a multiple of
   it (`x_floor`): how far every engine is from what the hardware allows.

Only the rows are data; nothing here asserts on timings.

`graphmode bench decode` (`run_decode_bench`, below): time to first token and decode tokens/s
of graphmode's decode engine next to `transformers` and llama.cpp, on the same weights,
prompts and threads, in one run.

Scenarios per model (defaults; `--quick` shrinks them):
- `ttft pP`: one prompt of P tokens (128, 512), one new token; the metric is TTFT
  (request -> first token in the caller's hands), in ms;
- `decode bB`: B prompts (1, 4, 16) of `context` tokens (512), `new` greedy tokens (32)
  each; the metric is decode tokens/s = B * (new - 1) / (last token - the last row's first
  token, as produced), i.e. the batch over its time per output token after the prefill
  (TPOT). End-of-sequence never stops a row, so every engine does the same work.

Method (as `graphmode bench`, above): every engine is set up once per model; per
scenario each engine runs once untimed (warm-up: lazy compiles and plan builds happen
there, so its wall time is kept as `warmup_s`, and its tokens are compared with
transformers eager's), then timed rounds in which every engine runs once, the first
engine rotating each round; median and p90 over rounds;
the load average, the process's CPU-s per wall-s and the rounds' spread become the same
flags (quality.py). A per-scenario budget ends the rounds early, never below `min_iters`.
Each decode row carries its bandwidth ceiling (floors.py).

The rounds (`interleave`), the timed call's conditions (`measured`), the statistics, the
ratios and the run's meta are one implementation for both (rounds.py); what differs is a
small part of each (what a call is, what its numerics are checked against, which floor
applies), here.
"""
from __future__ import annotations

import gc
import math
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from graphmode.bench.contend import Burners, Phases
from graphmode.bench.engines import (DEFAULT_ENGINES, DecodeShared, Engine, EngineUnavailable, ModelShared, _reason,
                                     make_decode_engine, make_engine, parse_decode_engines)
from graphmode.bench.floors import (DTYPE_BYTES, _probe_warning, decode_bytes, flag_floor, floor_tok_s,
                                    read_bandwidth_gbps, shape_floor)
from graphmode.bench.machine import PeakRss, _version
from graphmode.bench.models import DECODE_PRETTY, PRETTY, DecodeCase, ModelCase, decode_recipe
from graphmode.bench.quality import LEGEND, Conditions, Probe, apply_floor, judge, warning_lines
from graphmode.bench.report import decode_goals
from graphmode.bench.rounds import (NUMERICS_TOL, BenchResult, interleave, measured, ratios, run_meta, summary_stats,
                                    torch_threads)
from graphmode.bench.rounds import median_interval  # noqa: F401 - importable from the harness too
from graphmode.errors import GraphmodeError
from graphmode.kb.record import record_bench
from graphmode.verify.numerics import WEIGHT_ONLY

# how an engine is set up beyond its defaults: said in every report, since it moves its times
ENGINE_SETTINGS = {"onnxruntime": "intra_op and inter_op allow_spinning=0: its pool threads would spin after each "
                                  "run and take the cores of the engine timed next (eager measured 2.1x slower "
                                  "right after it on 2 cores); a process running ONNX Runtime alone may be faster "
                                  "with spinning on (its default)"}


@dataclass
class BenchConfig:
    engines: list[tuple[str, str | None]] = field(default_factory=lambda: list(DEFAULT_ENGINES))
    threads: int = 2
    iters: int = 20
    min_iters: int = 5
    warmup: int = 2
    rewarm: int = 2                  # untimed calls before each timed call in a round (see module doc)
    budget_s: float = 90.0           # per shape: stop the rounds after this much timed wall time
    seed: int = 0
    tol: float = NUMERICS_TOL
    recipe: Any = None               # a recipe path for graphmode (else one at the shapes)
    cache_dir: Any = None            # graphmode artifact cache (None: fresh temp dir per model)
    onnx_cache_dir: Any = None       # ONNX export cache (None: <cache root>/onnx, graphmode.paths)
    quick: bool = False              # a smoke run: rows are flagged `quick`, never read as timings
    kb: Any = None                   # knowledge base file the graphmode rows are recorded in (None: off)
    isa: str | None = None           # graphmode's codegen.isa cap (None: the recipe's own)
    on_stage: Any = None             # hears graphmode's compile stages and plan builds (graphmode/progress.py)
    contend: int = 0                 # CPU burners beside the contended phase of every round (contend.py)


def _rel_l2(got: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    """Max over outputs of ||got - ref|| / ||ref|| (float64); inf on a count/shape mismatch."""
    if len(got) != len(ref):
        return math.inf
    worst = 0.0
    for g, r in zip(got, ref):
        g = g.detach().to(torch.float64).reshape(-1) if g.shape == r.shape else None
        if g is None:
            return math.inf
        r = r.detach().to(torch.float64).reshape(-1)
        den = float(r.norm())
        num = float((g - r).norm())
        err = num / den if den else num
        if not math.isfinite(err):
            return math.inf
        worst = max(worst, err)
    return worst


# ---- encoders (`graphmode bench`) -----------------------------------------------------------


@dataclass
class _Slot:
    engine: Engine
    row: dict[str, Any]
    times: dict[str, list[float]] = field(default_factory=dict)         # phase -> ms per timed call
    ok: bool = True
    cond: dict[str, Conditions] = field(default_factory=dict)          # phase -> its conditions


def bench_shape(case: ModelCase, shared: ModelShared, env: dict[str, int], cfg: BenchConfig,
                log: Callable[[str], None] = lambda s: None, probe: Probe | None = None,
                phases: Phases | None = None) -> list[dict[str, Any]]:
    """The rows of one (model, shape): one per engine, and with burners (`phases`) one more per
    engine for the contended phase (`condition: contended`)."""
    probe = probe or Probe()
    phases = phases or Phases(None)
    bundle = case.bundle
    inputs = bundle.make_inputs(env, seed=cfg.seed)
    shape = case.shape_of(env)
    try:
        with torch.inference_mode():
            ref = [t.clone() for t in bundle.run(inputs)]
    except Exception as e:  # noqa: BLE001 - a shape the model cannot take is a failed result, not a crash
        reason = (f"eager PyTorch fails at this shape, so nothing can be checked against it: {type(e).__name__}: "
                  f"{str(e).splitlines()[0][:200] if str(e) else ''}; fix: a --shape the model takes")
        log(f"  {reason}")
        return [{**_row(case, shape, env, name, variant, make_engine(name, variant).label, cfg), "status": "failed",
                 "reason": reason, "condition": phase, "contend": phases.burners.n if phase == "contended" else 0}
                for phase in phases.names for name, variant in cfg.engines]
    if any(name == "torch_compile" for name, _ in cfg.engines):
        import torch._dynamo as dynamo
        dynamo.reset()    # earlier cases' compiles would count against the recompile limit
    slots: list[_Slot] = []
    for name, variant in cfg.engines:
        eng = make_engine(name, variant)
        row = _row(case, shape, env, name, variant, eng.label, cfg)
        slot = _Slot(eng, row)
        slots.append(slot)
        log(f"  setup {eng.label} ...")
        t0 = time.perf_counter()
        try:
            with PeakRss() as mem:
                eng.setup(shared, env, inputs)
                eng()                                  # first call: lazy compiles happen here
            row["setup_s"] = round(time.perf_counter() - t0 + eng.extra_s, 3)
            row["setup_detail"] = eng.setup_detail
            row["peak_rss_mb"] = None if mem.delta_mb is None else round(mem.delta_mb, 1)
            row["rss_exact"] = mem.exact
        except Exception as e:  # noqa: BLE001 - a failing engine is a result, not a crash
            _fail(slot, e, time.perf_counter() - t0)
            log(f"  {eng.label} failed: {row['reason']}")
    live = [s for s in slots if s.ok]
    for _ in range(max(cfg.warmup - 1, 0)):
        for s in live:
            _guard(s, lambda: s.engine())
    for s in [s for s in live if s.ok]:
        def check(s=s):
            with PeakRss() as mem:
                raw = s.engine()
            s.row["run_peak_rss_mb"] = None if mem.delta_mb is None else round(mem.delta_mb, 1)
            err = _rel_l2(s.engine.outputs(raw), ref)
            s.row["rel_l2_err"] = err if math.isfinite(err) else None
            s.row["numerics_ok"] = bool(math.isfinite(err) and err <= cfg.tol)
        _guard(s, check)

    def turn(s: _Slot, load: float | None, phase: str) -> None:
        try:                                # the untimed calls absorb the switch from the previous engine
            _, dt = measured(s.cond.setdefault(phase, Conditions()), probe, load, s.engine, untimed=cfg.rewarm)
        except Exception as e:  # noqa: BLE001
            _fail(s, e)
            return
        s.times.setdefault(phase, []).append(dt * 1e3)
    interleave(slots, cfg.iters, cfg.min_iters, cfg.budget_s, probe, turn, phases)
    by_phase: dict[str, list[dict[str, Any]]] = {p: [] for p in phases.names}
    for s in slots:
        if s.ok:
            s.row.update(_execution(s.engine.execution()))
        s.engine.close()
        base = dict(s.row)
        for phase in phases.names:
            row = s.row if phase == "quiet" else dict(base)
            row.update(condition=phase, contend=phases.burners.n if phase == "contended" else 0)
            times = s.times.get(phase) or []
            if s.ok and times:
                row.update(**summary_stats(times, mean_min=True), **s.cond[phase].to_row())
            elif s.ok:
                row.update(status="failed", reason="no timed run (iters = 0)")
            by_phase[phase].append(row)
    rows: list[dict[str, Any]] = []
    for phase, prow in by_phase.items():
        _ratios(prow)
        judge(prow, probe.cores, quick=cfg.quick, contended=phase == "contended")
        rows += prow
    slowdowns(rows)
    if any(r.get("flags") for r in rows) and not cfg.quick:
        log(f"  flagged: {', '.join(r['label'] + ' (' + ','.join(r['flags']) + ')' for r in rows if r.get('flags'))}")
    gc.collect()
    return rows


def _row(case: ModelCase, shape: Any, env: dict[str, int], name: str, variant: str | None, label: str,
         cfg: BenchConfig) -> dict[str, Any]:
    """A (model, shape, engine) row before it is measured."""
    return {"model": case.name, "model_name": PRETTY.get(case.name, case.name), "shape": shape, "dims": dict(env),
            "engine": name, "variant": variant or "default", "label": label, "status": "ok", "reason": None,
            "skipped": False, "threads": cfg.threads}


def slowdowns(rows: list[dict[str, Any]]) -> None:
    """On each contended row of one shape, `slowdown` = its median / the same engine's quiet
    median: how much the busy neighbours cost that engine."""
    quiet = {r["label"]: r for r in rows if r.get("condition", "quiet") == "quiet"}
    for r in rows:
        if r.get("condition") != "contended":
            continue
        q = quiet.get(r["label"])
        ok = q is not None and q.get("median_ms") and r.get("median_ms")
        r["slowdown"] = round(r["median_ms"] / q["median_ms"], 4) if ok else None


def _execution(info: dict[str, Any] | None) -> dict[str, Any]:
    """Row fields for how an engine ran: `eager_fallback` says on how many calls, and why,
    graphmode ran eager PyTorch (then its time is not graph-mode time), `eager_islands` how
    many ops of a hybrid graph ran eagerly."""
    if info is None:
        return {}
    fb = f"{info['eager_calls']}/{info['calls']} calls ({info['eager_reason']})" if info["eager_calls"] else None
    return {"execution": info, "eager_fallback": fb, "eager_islands": info["eager_islands"]}


def _fail(slot: _Slot, e: BaseException, setup_s: float | None = None) -> None:
    slot.ok = False
    slot.row["status"] = "failed"
    slot.row["reason"] = _reason(e)
    slot.row["skipped"] = isinstance(e, EngineUnavailable)
    if setup_s is not None:
        slot.row["setup_s"] = round(setup_s, 3)
        slot.row["setup_detail"] = slot.engine.setup_detail
    slot.engine.close()


def _guard(slot: _Slot, fn: Callable[[], Any]) -> None:
    if not slot.ok:
        return
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        _fail(slot, e)


def _ratios(rows: list[dict[str, Any]]) -> None:
    """ratio_vs_eager = median / eager median (< 1: faster than eager); speedup = the inverse;
    ratio_vs_best_other = median / the fastest ok engine other than graphmode. Rows that ran
    an eager fallback get none."""
    ratios(rows, ("median_ms", "p90_ms", "mean_ms", "min_ms", "iters", "ratio_vs_eager", "speedup_vs_eager",
                  "ratio_vs_best_other", "best_other_engine", "rel_l2_err", "numerics_ok", "setup_s", "setup_detail",
                  "peak_rss_mb", "run_peak_rss_mb", "rss_exact", "rounds_ms", "spread", "load_max", "cpu_per_wall",
                  "waited_per_wall", "eager_fallback", "eager_islands", "ratio_vs_best_other_ci95"), paired=True)



def run_bench(cases: Sequence[ModelCase], cfg: BenchConfig, log: Callable[[str], None] = lambda s: None,
              target: Any = None, probe: Probe | None = None) -> BenchResult:
    """Run every case; torch's intra-op threads are set to cfg.threads for the run and restored."""
    probe = probe or Probe()
    load_start = probe.loadavg()
    rows: list[dict[str, Any]] = []
    t_start = time.perf_counter()
    # the burners start paused: they spin only during the contended phase of each round
    with torch_threads(cfg.threads), Burners(cfg.contend) as burners:
        phases = Phases(burners)
        for case in cases:
            shared = ModelShared(case.bundle, case.envs, cfg.threads, cache_dir=cfg.cache_dir,
                                 recipe=case.recipe if case.recipe is not None else cfg.recipe,
                                 onnx_cache_dir=cfg.onnx_cache_dir, isa=cfg.isa, on_stage=cfg.on_stage)
            try:
                first = len(rows)
                for env in case.envs:
                    log(f"{case.name} {'x'.join(map(str, case.shape_of(env)))}")
                    shape_rows = bench_shape(case, shared, env, cfg, log, probe, phases)
                    apply_floor(shape_rows, shape_floor(shared.store.get("graphmode"), env, target))
                    for r in shape_rows:
                        r["tol"] = cfg.tol
                        rows.append(r)
                note = record_bench(cfg.kb, shared.store.get("graphmode"),
                                    [r for r in rows[first:] if r["condition"] == "quiet"], target)
                if note:
                    log(note)
            finally:
                tmp = shared.store.get("tmp")
                shared.store.clear()
                if tmp is not None:
                    tmp.cleanup()
                gc.collect()
    meta = run_meta(
        cfg.threads, target, probe, rows, quick=cfg.quick, load_start=load_start, t_start=t_start,
        warnings=warning_lines(rows, cfg.quick) + _probe_warning(target), contend=cfg.contend,
        models=[{"model": c.name, "spec": c.spec, "load_s": round(c.load_s, 3), "shapes": [c.shape_of(e) for e in c.envs],
                 "source": getattr(c.bundle, "source", "")} for c in cases],
        engines=[make_engine(n, v).label for n, v in cfg.engines],
        method={"warmup": cfg.warmup, "rewarm": cfg.rewarm, "iters": cfg.iters, "min_iters": cfg.min_iters, "budget_s_per_shape": cfg.budget_s,
                "rounds": "interleaved round-robin, rotated start each round; per engine and round "
                          f"{cfg.rewarm} untimed call(s) then 1 timed call", "seed": cfg.seed,
                "numerics_tol": cfg.tol, "engine_settings": ENGINE_SETTINGS,
                **({"contend": f"{cfg.contend} CPU burner process(es) (a fixed integer loop each) paused "
                               "(SIGSTOP) for the quiet pass of every round and resumed for a second, contended "
                               "pass of the same engines; slowdown = contended median / quiet median"}
                   if cfg.contend else {}),
                "ratio_vs_eager": "median_ms / eager median_ms (< 1 is faster than eager)",
                "ratio_vs_best_other": "median_ms / fastest ok non-graphmode engine's median_ms",
                "ratio_vs_best_other_ci95": "graphmode: distribution-free 95% interval of the median of its "
                                            "per-round time / that engine's time in the same round",
                "floor_ms": "the shape's roofline time on the host target: max(FLOPs / peak, bytes / bandwidth) "
                            "with the probe's bandwidth (best streaming read) and theoretical peak, FLOPs and "
                            "bytes (weights, a lookup table's rows a request reads, + planned activations) as "
                            "graphmode's compiler counts them",
                "x_floor": "median_ms / floor_ms (>= 1; below 1 is flagged `floor`)",
                "setup_s": "engine setup + first call; shared per-model work (graphmode capture+passes, ONNX "
                           "export time from its cache record) is charged to every shape",
                "peak_rss_mb": "peak resident MB added during setup + first call over the RSS before it "
                               "(VmHWM reset via /proc/self/clear_refs); model-level work is in the first "
                               "shape's row",
                "run_peak_rss_mb": "peak resident MB one warm call adds over the RSS before it",
                "flags": dict(LEGEND),
                "conditions": "per row: load_max = highest 1-minute load average sampled at the start of "
                              "its rounds; cpu_per_wall = process CPU seconds / wall seconds over its timed "
                              "calls; waited_per_wall = seconds its threads waited on a run queue (summed) / "
                              "wall seconds over its timed calls; spread = p90 / median of its rounds (rounds_ms)"},
        recipe=str(cfg.recipe) if cfg.recipe is not None else "auto: buckets exactly at the benchmarked shapes")
    return BenchResult(rows, meta)


# ---- decoders (`graphmode bench decode`) ----------------------------------------------------

@dataclass(frozen=True)
class Scenario:
    kind: str            # "ttft" | "decode"
    batch: int
    prompt: int
    new: int

    @property
    def name(self) -> str:
        return f"ttft p{self.prompt}" if self.kind == "ttft" else f"decode b{self.batch} ctx{self.prompt}"


@dataclass
class DecodeConfig:
    engines: list[tuple[str, str | None]] = field(default_factory=lambda: parse_decode_engines(None))
    prompt_lens: tuple[int, ...] = (128, 512)
    batches: tuple[int, ...] = (1, 4, 16)
    context: int = 512
    new_tokens: int = 32
    threads: int = 2
    iters: int = 5
    min_iters: int = 3
    warmup: int = 1
    budget_s: float = 300.0
    seed: int = 0
    cache_dir: Any = None
    quick: bool = False
    on_stage: Any = None            # hears graphmode's decoder capture, passes and plans (graphmode/progress.py)
    contend: int = 0                # CPU burners beside the contended pass of every round (contend.py)
    prefix_cache: bool = True       # graphmode's "repeated system prompt" scenario (prefix.py)

    def scenarios(self) -> list[Scenario]:
        return ([Scenario("ttft", 1, p, 1) for p in self.prompt_lens] +
                [Scenario("decode", b, self.context, self.new_tokens) for b in self.batches])

    @property
    def max_tokens(self) -> int:
        return max(max(self.prompt_lens) + 1, self.context + self.new_tokens)


QUICK = dict(prompt_lens=(8, 32), batches=(1, 2), context=16, new_tokens=4, iters=2, min_iters=2, warmup=1)


# ---- the run ------------------------------------------------------------------------------

def prompts_for(sc: Scenario, vocab: int, seed: int) -> torch.Tensor:
    """Random prompt ids in [3, vocab) (0-2 are the synthetic vocab's specials), one row per sequence."""
    g = torch.Generator().manual_seed(seed * 1000 + sc.batch * 7 + sc.prompt)
    return torch.randint(3, vocab, (sc.batch, sc.prompt), generator=g, dtype=torch.int64)


@dataclass
class _DecodeSlot:
    engine: Any
    rows: dict[tuple[Scenario, str], dict]       # (scenario, phase: quiet | contended) -> its row
    ok: bool = True
    reason: str | None = None
    skipped: bool = False
    setup_s: float | None = None
    failed_in: str | None = None          # "setup" or the scenario it failed in


def _decode_row(case: DecodeCase, sc: Scenario, eng: Any, threads: int, phase: str = "quiet",
                contend: int = 0) -> dict[str, Any]:
    """A contended row's scenario is named `<scenario> busy`, so every table shows it as a
    column of its own beside the quiet one."""
    return {"model": case.name, "model_name": DECODE_PRETTY.get(case.name, case.name),
            "scenario": sc.name + (" busy" if phase == "contended" else ""), "condition": phase, "contend": contend,
            "kind": sc.kind, "batch": sc.batch, "prompt": sc.prompt, "new_tokens": sc.new, "engine": eng.name,
            "variant": eng.variant or "default", "label": eng.label, "dtype": eng.dtype, "kv_dtype": eng.kv_dtype,
            "status": "ok", "reason": None, "skipped": False, "threads": threads, "times": [], "tok_s": [],
            "eager_fallback": None, "eager_islands": 0}


def bench_decode_model(case: DecodeCase, cfg: DecodeConfig, gbps: float, log: Callable[[str], None],
                       probe: Probe, phases: Phases | None = None,
                       prefix_rows: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    phases = phases or Phases(None)
    n_busy = phases.burners.n if phases.burners else 0
    vocab = int(case.lm.config.vocab_size)
    scen = cfg.scenarios()
    recipe = decode_recipe(case.lm, [s.prompt for s in scen], [s.batch for s in scen], cfg.max_tokens,
                           name=f"bench-decode-{case.name}")
    work = tempfile.TemporaryDirectory(prefix="graphmode-decode-")
    shared = DecodeShared(case.name, case.bundle, case.lm, recipe, cfg.threads, max(s.batch for s in scen),
                          cfg.max_tokens, cache_dir=cfg.cache_dir, work=Path(work.name), on_stage=cfg.on_stage)
    slots: list[_DecodeSlot] = []
    try:
        for name, variant in cfg.engines:
            eng = make_decode_engine(name, variant)
            slot = _DecodeSlot(eng, {(sc, ph): _decode_row(case, sc, eng, cfg.threads, ph,
                                                           n_busy if ph == "contended" else 0)
                                     for sc in scen for ph in phases.names})
            slots.append(slot)
            log(f"  setup {eng.label} ...")
            t0 = time.perf_counter()
            try:
                eng.setup(shared)
            except Exception as e:  # noqa: BLE001 - a failing engine is a result, not a crash
                _decode_fail(slot, e, "setup")
                log(f"  {eng.label}: {slot.reason}")
            slot.setup_s = round(time.perf_counter() - t0, 3)
        for sc in scen:
            log(f"{case.name} {sc.name}")
            _run_scenario(case, sc, slots, cfg, vocab, log, probe, phases)
        if cfg.prefix_cache and prefix_rows is not None:
            from graphmode.bench.prefix import prefix_scenarios
            prefix_rows += prefix_scenarios(case.name, [s.engine for s in slots if s.ok], cfg, vocab, log, probe)
        rows = []
        wb = {d: decode_bytes(case.lm, d) for d in {s.engine.dtype for s in slots}}
        for sc in scen:
            for ph in phases.names:
                group = [_decode_finish(s, sc, ph, wb, gbps) for s in slots]
                _decode_ratios(group)
                judge(group, probe.cores, quick=cfg.quick, contended=ph == "contended")
                flag_floor(group)
                rows += group
        return rows
    finally:
        for s in slots:
            s.engine.close()
        work.cleanup()
        gc.collect()


def _decode_fail(slot: _DecodeSlot, e: BaseException, where: str, row: dict | None = None) -> None:
    """The engine is out of this model's run from here on; the row it failed in says why (rows
    it measured before stay measured)."""
    slot.ok, slot.reason, slot.skipped, slot.failed_in = False, _reason(e), isinstance(e, EngineUnavailable), where
    if row is not None:
        row["_error"] = slot.reason


def _run_scenario(case: DecodeCase, sc: Scenario, slots: list[_DecodeSlot], cfg: DecodeConfig, vocab: int,
              log: Callable[[str], None], probe: Probe, phases: Phases) -> None:
    prompts = prompts_for(sc, vocab, cfg.seed)
    live = [s for s in slots if s.ok]
    ref = None
    for s in live:                                  # warm-up; its tokens are the numerics check
        t0 = time.perf_counter()
        for _ in range(max(1, cfg.warmup)):
            try:
                got = s.engine.run(prompts, sc.new)
            except Exception as e:  # noqa: BLE001
                _decode_fail(s, e, sc.name, s.rows[sc, "quiet"])
                log(f"  {s.engine.label} failed: {s.reason}")
                break
        else:
            s.rows[sc, "quiet"]["warmup_s"] = round(time.perf_counter() - t0, 3)
            s.rows[sc, "quiet"]["_tokens"] = got.tokens
            if s.engine.name == "eager":
                ref = got.tokens
    for s in slots:
        row = s.rows[sc, "quiet"]
        if ref is not None and "_tokens" in row:
            row["tokens_match"] = _agreement(row.pop("_tokens"), ref)
        row.pop("_tokens", None)

    def turn(s: _DecodeSlot, load: float | None, phase: str) -> None:
        row = s.rows[sc, phase]
        try:
            got, _ = measured(row.setdefault("_cond", Conditions()), probe, load, lambda: s.engine.run(prompts, sc.new))
        except Exception as e:  # noqa: BLE001
            _decode_fail(s, e, sc.name, row)
            return
        span = got.end_s - got.decode_from_s
        row["times"].append(got.first_s * 1e3 if sc.kind == "ttft" else span * 1e3 / max(sc.new - 1, 1))
        if sc.kind == "decode":
            row["tok_s"].append(sc.batch * (sc.new - 1) / max(span, 1e-9))
        row.setdefault("ttft_rounds_ms", []).append(round(got.first_s * 1e3, 3))
    interleave(slots, cfg.iters, cfg.min_iters, cfg.budget_s, probe, turn, phases)


def _agreement(got: list[list[int]], ref: list[list[int]]) -> dict[str, int]:
    """Greedy tokens equal to transformers eager's, counted up to each row's first difference,
    and the rows whose first new token (the prefill's top-1, same input for both) is eager's."""
    same = 0
    for g, r in zip(got, ref):
        for a, b in zip(g, r):
            if a != b:
                break
            same += 1
    first = sum(1 for g, r in zip(got, ref) if g[:1] == r[:1])
    return {"same": same, "of": sum(len(r) for r in ref), "first": first, "rows": len(ref)}


def _decode_finish(slot: _DecodeSlot, sc: Scenario, phase: str, wb: dict[str, tuple[float, float]],
                   gbps: float) -> dict[str, Any]:
    row = slot.rows[sc, phase]
    cond = row.pop("_cond", None)
    row["setup_s"] = slot.setup_s
    row["setup_detail"] = slot.engine.setup_detail
    row.setdefault("tokens_match", None)
    row.setdefault("warmup_s", None)
    times = row.pop("times")
    toks = row.pop("tok_s")
    error = row.pop("_error", None)
    if error or not times:
        if error or slot.failed_in in (None, "setup"):
            reason = error or slot.reason or "no timed run"
        else:
            reason = f"not run: it failed in {slot.failed_in} ({slot.reason})"
        row.update(status="failed", reason=reason, skipped=slot.skipped and slot.failed_in == "setup",
                   median_ms=None, decode_tok_s=None)
    else:
        row.update(**summary_stats(times), ttft_ms=round(statistics.median(row["ttft_rounds_ms"]), 3))
        row.update(**(cond.to_row() if cond else {}))
        if sc.kind == "decode":
            row["decode_tok_s"] = round(statistics.median(toks), 3)
    row["floor_tok_s"] = row["of_floor"] = None
    if sc.kind == "decode" and row.get("decode_tok_s"):
        w, kv = wb[slot.engine.dtype]
        kv *= DTYPE_BYTES[slot.engine.kv_dtype] / 4.0
        fl = floor_tok_s(w, kv, sc.batch, sc.prompt + (sc.new - 1) / 2, gbps)
        row["floor_tok_s"] = round(fl, 3)
        row["of_floor"] = round(row["decode_tok_s"] / fl, 4)
    return row


def _decode_ratios(rows: list[dict[str, Any]]) -> None:
    """`speedup_vs_eager` (what quality.judge bounds) and `ratio_vs_best_other` on the
    scenario's time metric (TTFT ms, or ms per decode step)."""
    ratios(rows, ("median_ms", "p90_ms", "speedup_vs_eager", "ratio_vs_eager", "ratio_vs_best_other",
                  "best_other_engine", "decode_tok_s", "spread", "load_max", "cpu_per_wall", "waited_per_wall",
                  "ttft_ms"))


@dataclass
class DecodeResult(BenchResult):
    goals: list[dict[str, Any]] = field(default_factory=list)

    def _where(self, r: dict[str, Any]) -> str:
        return f"{r['model']} {r['scenario']} {r['label']}"

    def _numerics(self, r: dict[str, Any], where: str) -> list[str]:
        """graphmode's tokens against transformers eager's (with int8 / bf16 weights: each row's
        first token). Tokens are checked on the quiet rows (the contended ones run the same
        engine on the same prompts)."""
        if r["engine"] != "graphmode" or r.get("condition") == "contended":
            return []
        m = r.get("tokens_match")
        if m is None:
            return [f"{where}: no transformers eager tokens to compare with (add eager to --engines)"]
        if r.get("variant") in WEIGHT_ONLY:
            # narrow weights flip a near-tie now and then, and a free-running sequence
            # differs from there on: the check is each row's first token (the prefill's
            # top-1 on eager's own input); graphmode verify measures top-1 per position
            if m.get("first") != m.get("rows"):
                return [f"{where}: a first new token differs from transformers eager's under "
                        f"{r['variant']} weights ({m})"]
        elif m["same"] != m["of"]:
            return [f"{where}: greedy tokens differ from transformers eager ({m})"]
        return []


def run_decode_bench(cases: Sequence[DecodeCase], cfg: DecodeConfig, log: Callable[[str], None] = lambda s: None,
                     target: Any = None, probe: Probe | None = None) -> DecodeResult:
    for c in cases:
        if c.lm.config.vocab_size < 4:
            raise GraphmodeError("the model's vocabulary is too small for random prompts", where="--model",
                                 value=c.name)
    probe = probe or Probe()
    load_start = probe.loadavg()
    t_start = time.perf_counter()
    rows: list[dict[str, Any]] = []
    prefix_rows: list[dict[str, Any]] = []
    with torch_threads(cfg.threads):
        read = read_bandwidth_gbps(cfg.threads)
        probed = getattr(target, "memory_bandwidth_gbps", None) if target is not None else None
        gbps = max(read, probed or 0.0)
        with Burners(cfg.contend) as burners:      # paused: they spin only in the contended pass of each round
            for case in cases:
                rows += bench_decode_model(case, cfg, gbps, log, probe, Phases(burners), prefix_rows)
    meta = run_meta(
        cfg.threads, target, probe, rows, quick=cfg.quick, load_start=load_start, t_start=t_start,
        warnings=warning_lines(_for_warnings(rows), cfg.quick), kind="decode", contend=cfg.contend,
        order=("kind", "quick", "usable_cores", "loadavg_start", "loadavg_max", "wall_s", "bandwidth", "models",
               "engines", "method", "warnings"),
        bandwidth={"read_gbps_measured": round(read, 2), "host_probe_gbps": probed,
                   "floor_uses_gbps": round(gbps, 2),
                   "how": "best of 5 sums of a 512 MB f32 buffer at --threads; the floor uses the larger of it "
                          "and the host probe (graphmode targets show host)"},
        models=[{"model": c.name, "spec": c.spec, "load_s": round(c.load_s, 3), "class": type(c.lm).__name__,
                 "params_m": round(sum(p.numel() for p in c.lm.parameters()) / 1e6, 2)} for c in cases],
        engines=[make_decode_engine(n, v).label for n, v in cfg.engines],
        method={"scenarios": [s.name for s in cfg.scenarios()], "prompt_lens": list(cfg.prompt_lens),
                "batches": list(cfg.batches), "context": cfg.context, "new_tokens": cfg.new_tokens,
                "warmup": cfg.warmup, "iters": cfg.iters, "min_iters": cfg.min_iters,
                "budget_s_per_scenario": cfg.budget_s, "seed": cfg.seed,
                "ttft": "request -> first token in the caller's hands (ms), batch 1, one new token",
                "decode_tok_s": "batch * (new - 1) / (last token - the last row's first token, as produced), "
                                "greedy, end-of-sequence ignored",
                "rounds": "interleaved, rotated start each round; 1 timed run per engine per round",
                **({"contend": f"{cfg.contend} CPU burner process(es) paused (SIGSTOP) for the quiet pass of every "
                               "round and resumed for a second, contended pass of the same engines; contended "
                               "rows are the scenarios named '<scenario> busy'"} if cfg.contend else {}),
                "floor": "batch * bandwidth / (weight bytes + batch * mean context * KV bytes per token) "
                         "at the engine's weight and KV dtypes",
                "floor_assumes": "a decode step reads every weight once from memory (none stays in cache; the LM "
                                 "head counted once even when tied; token and position tables one row, i.e. not "
                                 "counted; 1-D weights at f32) and the K and V of every cached token once; "
                                 "activations, logits and per-step overhead cost nothing; the bandwidth is the "
                                 "larger of a streaming read measured now at --threads and the host probe's"})
    meta["versions"].update(llama_cpp_python=_version("llama_cpp_python"), gguf=_version("gguf"))
    if cfg.prefix_cache:
        meta["prefix_cache"] = prefix_rows
    return DecodeResult(rows, meta, decode_goals(rows, cfg.quick))


def _for_warnings(rows):
    return [{**r, "shape": [r["scenario"]]} for r in rows]
