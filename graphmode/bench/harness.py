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
6. the shape's roofline floor on the host (`shape_floor`: max(FLOPs / peak, bytes /
   bandwidth) from the probe and graphmode's count of the model's work) and each row's time
   as a multiple of it (`x_floor`): how far every engine is from what the hardware allows.

Only the rows are data; nothing here asserts on timings.
"""
from __future__ import annotations

import gc
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from graphmode.bench.engines import DEFAULT_ENGINES, ENGINE_NAMES, Engine, EngineUnavailable, ModelShared, make_engine
from graphmode.bench.machine import PeakRss, machine_meta
from graphmode.bench.models import PRETTY, ModelCase
from graphmode.bench.profile import facts_at, model_roofline
from graphmode.bench.quality import LEGEND, QUICK_NOTE, Conditions, Probe, apply_floor, judge, warning_lines
from graphmode.errors import GraphmodeError
from graphmode.kb.record import record_bench

NUMERICS_TOL = 1e-4      # relative L2 vs eager counted as "matched" (fp32 engines reorder sums)


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


def parse_engines(text: str | None, extra: Sequence[str] = (), quick: bool = False) -> list[tuple[str, str | None]]:
    """`eager,onnxruntime,graphmode` (+ `--with max-autotune` adds torch_compile[max-autotune]);
    no text: DEFAULT_ENGINES (without torch.compile's variants when `quick`)."""
    out = [e for e in DEFAULT_ENGINES if not (quick and e[1])] if not text else []
    for n in (text.split(",") if text else ()):
        base, _, var = n.strip().partition("[")
        if not base:
            continue
        if base not in ENGINE_NAMES:
            raise GraphmodeError(f"unknown engine {base!r}", where="--engines", value=text,
                                 fix=f"choose from {', '.join(ENGINE_NAMES)}")
        out.append((base, var.rstrip("]") or None))
    for w in extra:
        from graphmode.bench.engines import TORCH_COMPILE_VARIANTS
        if w not in TORCH_COMPILE_VARIANTS or w == "default":
            raise GraphmodeError(f"unknown --with {w!r}", where="--with",
                                 fix=f"one of {', '.join(v for v in TORCH_COMPILE_VARIANTS if v != 'default')}")
        out.append(("torch_compile", w))
    seen, uniq = set(), []
    for e in out:
        if e not in seen:
            seen.add(e)
            uniq.append(e)
    return uniq


def _reason(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    msg = lines[0] if lines else ""
    return f"{type(e).__name__}: {msg}"[:400] if not isinstance(e, EngineUnavailable) else msg


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


def _p90(xs: list[float]) -> float:
    s = sorted(xs)
    if not s:
        return math.nan
    k = 0.9 * (len(s) - 1)
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


@dataclass
class _Slot:
    engine: Engine
    row: dict[str, Any]
    times: list[float] = field(default_factory=list)
    ok: bool = True
    cond: Conditions = field(default_factory=Conditions)


def bench_shape(case: ModelCase, shared: ModelShared, env: dict[str, int], cfg: BenchConfig,
                log: Callable[[str], None] = lambda s: None, probe: Probe | None = None) -> list[dict[str, Any]]:
    probe = probe or Probe()
    bundle = case.bundle
    inputs = bundle.make_inputs(env, seed=cfg.seed)
    shape = case.shape_of(env)
    with torch.inference_mode():
        ref = [t.clone() for t in bundle.run(inputs)]
    if any(name == "torch_compile" for name, _ in cfg.engines):
        import torch._dynamo as dynamo
        dynamo.reset()    # earlier cases' compiles would count against the recompile limit
    slots: list[_Slot] = []
    for name, variant in cfg.engines:
        eng = make_engine(name, variant)
        row = {"model": case.name, "model_name": PRETTY.get(case.name, case.name), "shape": shape,
               "dims": dict(env), "engine": name, "variant": variant or "default", "label": eng.label,
               "status": "ok", "reason": None, "skipped": False, "threads": cfg.threads}
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
    live = [s for s in slots if s.ok]
    start = time.perf_counter()
    rounds = 0
    for r in range(cfg.iters):
        order = live[r % len(live):] + live[:r % len(live)] if live else []
        load = probe.load1()
        for s in order:
            if not s.ok:
                continue
            try:
                for _ in range(cfg.rewarm):     # untimed: absorbs the switch from the previous engine
                    s.engine()
                c0 = probe.cpu_time()
                t0 = time.perf_counter()
                s.engine()
                dt = time.perf_counter() - t0
                c1 = probe.cpu_time()
            except Exception as e:  # noqa: BLE001
                _fail(s, e)
                continue
            s.times.append(dt * 1e3)
            s.cond.cpu_s += c1 - c0
            s.cond.wall_s += dt
            if load is not None:
                s.cond.loads.append(load)
        rounds += 1
        if rounds >= cfg.min_iters and time.perf_counter() - start > cfg.budget_s:
            break
    for s in slots:
        if s.ok:
            s.row.update(_execution(s.engine.execution()))
        s.engine.close()
        if s.ok and s.times:
            med = statistics.median(s.times)
            s.row.update(median_ms=round(med, 4), p90_ms=round(_p90(s.times), 4),
                         mean_ms=round(statistics.fmean(s.times), 4), min_ms=round(min(s.times), 4),
                         iters=len(s.times), rounds_ms=[round(t, 4) for t in s.times],
                         spread=round(_p90(s.times) / med, 3) if med > 0 else None, **s.cond.to_row())
        elif s.ok:
            s.ok = False
            s.row.update(status="failed", reason="no timed run (iters = 0)")
    rows = [s.row for s in slots]
    _ratios(rows)
    judge(rows, probe.cores, quick=cfg.quick)
    if any(r.get("flags") for r in rows) and not cfg.quick:
        log(f"  flagged: {', '.join(r['label'] + ' (' + ','.join(r['flags']) + ')' for r in rows if r.get('flags'))}")
    gc.collect()
    return rows


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
    keys = ("median_ms", "p90_ms", "mean_ms", "min_ms", "iters", "ratio_vs_eager", "speedup_vs_eager",
            "ratio_vs_best_other", "best_other_engine", "rel_l2_err", "numerics_ok", "setup_s", "setup_detail",
            "peak_rss_mb", "run_peak_rss_mb", "rss_exact", "rounds_ms", "spread", "load_max", "cpu_per_wall",
            "eager_fallback", "eager_islands", "ratio_vs_best_other_ci95")
    for r in rows:
        for k in keys:
            r.setdefault(k, None)
    # a graphmode row that ran eager PyTorch has no ratios: its time is not graph-mode speed
    ok = [r for r in rows if r["status"] == "ok" and r["median_ms"] and not r["eager_fallback"]]
    paired_interval(ok, set_ratios(ok))


def _probe_warning(target: Any) -> list[str]:
    """The host probe's own doubt (targets.host.probe_note): every floor of the run rests on it."""
    from graphmode.targets.host import probe_note
    note = probe_note(target)
    return [f"host probe: {note}; this run's floors are low with it"] if note else []


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
    its inverse, ratio_vs_best_other = median / the fastest engine other than graphmode (the
    row returned)."""
    eager = next((r for r in ok if r["engine"] == "eager"), None)
    others = [r for r in ok if r["engine"] != "graphmode"]
    best = min(others, key=lambda r: r["median_ms"]) if others else None
    for r in ok:
        if eager:
            r["ratio_vs_eager"] = round(r["median_ms"] / eager["median_ms"], 4)
            r["speedup_vs_eager"] = round(eager["median_ms"] / r["median_ms"], 4)
        if best:
            r["ratio_vs_best_other"] = round(r["median_ms"] / best["median_ms"], 4)
            r["best_other_engine"] = best["label"]
    return best


def shape_floor(compiled: Any, env: dict[str, int], target: Any) -> dict[str, Any]:
    """The roofline floor of one shape on `target`: `floor_ms` = max(FLOPs / peak, bytes /
    bandwidth) in the recipe's compute dtype, its `floor_bound`, and the `floor_flops` and
    `floor_bytes` (weights + planned activations) the recipe proofs count at this shape
    (profile.facts_at). Those counts come from graphmode's compile of the model: `compiled` is
    what the graphmode engine stored ((CompiledModel, recipe, seconds), the exception it
    raised, or None when it did not run); without one, `floor_note` says why there is no floor."""
    if target is None:
        return {"floor_note": "no target to take the peak and bandwidth from"}
    if not isinstance(compiled, tuple):
        return {"floor_note": "graphmode did not compile this model, and its compiler counts the FLOPs and bytes"
                + (f" ({_reason(compiled)})" if compiled is not None else "")}
    cm, rec, _ = compiled
    try:
        facts = facts_at(cm, rec, target, env)
    except Exception as e:  # noqa: BLE001 - the floor is an extra column, never a blocker
        return {"floor_note": f"the model's FLOPs and bytes are unavailable: {_reason(e)}"}
    seconds, bound = model_roofline(target, facts, rec.precision.compute)
    return {"floor_ms": float(f"{seconds * 1e3:.4g}"), "floor_bound": bound, "floor_flops": facts["flops"],
            "floor_bytes": facts["bytes"]}


@dataclass
class BenchResult:
    rows: list[dict[str, Any]]
    meta: dict[str, Any]

    def quick_failures(self) -> list[str]:
        """Why a --quick run fails: an engine that did not run (not counting 'not installed')
        or whose outputs do not match eager. Never a timing."""
        bad = []
        for r in self.rows:
            where = f"{r['model']} {'x'.join(map(str, r['shape']))} {r['label']}"
            if r["status"] != "ok":
                if not r["skipped"]:
                    bad.append(f"{where}: failed: {r['reason']}")
            elif not r["numerics_ok"]:
                bad.append(f"{where}: rel L2 vs eager {r['rel_l2_err']} > {r.get('tol', NUMERICS_TOL):g}")
        return bad


def run_bench(cases: Sequence[ModelCase], cfg: BenchConfig, log: Callable[[str], None] = lambda s: None,
              target: Any = None, probe: Probe | None = None) -> BenchResult:
    """Run every case; torch's intra-op threads are set to cfg.threads for the run and restored."""
    probe = probe or Probe()
    load_start = probe.loadavg()
    prev = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    rows: list[dict[str, Any]] = []
    t_start = time.perf_counter()
    try:
        for case in cases:
            shared = ModelShared(case.bundle, case.envs, cfg.threads, recipe=cfg.recipe, cache_dir=cfg.cache_dir,
                                 onnx_cache_dir=cfg.onnx_cache_dir, isa=cfg.isa, on_stage=cfg.on_stage)
            try:
                first = len(rows)
                for env in case.envs:
                    log(f"{case.name} {'x'.join(map(str, case.shape_of(env)))}")
                    shape_rows = bench_shape(case, shared, env, cfg, log, probe)
                    apply_floor(shape_rows, shape_floor(shared.store.get("graphmode"), env, target))
                    for r in shape_rows:
                        r["tol"] = cfg.tol
                        rows.append(r)
                note = record_bench(cfg.kb, shared.store.get("graphmode"), rows[first:], target)
                if note:
                    log(note)
            finally:
                tmp = shared.store.get("tmp")
                shared.store.clear()
                if tmp is not None:
                    tmp.cleanup()
                gc.collect()
    finally:
        torch.set_num_threads(prev)
    meta = machine_meta(cfg.threads, target)
    meta.update(
        loadavg_start=load_start,
        quick=cfg.quick, usable_cores=probe.cores,
        loadavg_max=max((r["load_max"] for r in rows if r.get("load_max") is not None), default=None),
        warnings=([QUICK_NOTE] if cfg.quick else []) + warning_lines(rows, cfg.quick) + _probe_warning(target),
        wall_s=round(time.perf_counter() - t_start, 1),
        models=[{"model": c.name, "spec": c.spec, "load_s": round(c.load_s, 3), "shapes": [c.shape_of(e) for e in c.envs],
                 "source": getattr(c.bundle, "source", "")} for c in cases],
        engines=[make_engine(n, v).label for n, v in cfg.engines],
        method={"warmup": cfg.warmup, "rewarm": cfg.rewarm, "iters": cfg.iters, "min_iters": cfg.min_iters, "budget_s_per_shape": cfg.budget_s,
                "rounds": "interleaved round-robin, rotated start each round; per engine and round "
                          f"{cfg.rewarm} untimed call(s) then 1 timed call", "seed": cfg.seed,
                "numerics_tol": cfg.tol,
                "ratio_vs_eager": "median_ms / eager median_ms (< 1 is faster than eager)",
                "ratio_vs_best_other": "median_ms / fastest ok non-graphmode engine's median_ms",
                "ratio_vs_best_other_ci95": "graphmode: distribution-free 95% interval of the median of its "
                                            "per-round time / that engine's time in the same round",
                "floor_ms": "the shape's roofline time on the host target: max(FLOPs / peak, bytes / bandwidth) "
                            "with the probe's bandwidth (best streaming read) and theoretical peak, FLOPs and "
                            "bytes (weights + planned activations) as graphmode's compiler counts them",
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
                              "calls; spread = p90 / median of its rounds (rounds_ms)"},
        recipe=str(cfg.recipe) if cfg.recipe is not None else "auto: buckets exactly at the benchmarked shapes")
    return BenchResult(rows, meta)
