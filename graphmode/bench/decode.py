"""The decode benchmark (`graphmode bench decode`): time to first token and decode tokens/s
of graphmode's decode engine next to `transformers` and llama.cpp, on the same weights,
prompts and threads, in one run.

Scenarios per model (defaults; `--quick` shrinks them):
- `ttft pP`: one prompt of P tokens (128, 512), one new token; the metric is TTFT
  (request -> first token in the caller's hands), in ms;
- `decode bB`: B prompts (1, 4, 16) of `context` tokens (512), `new` greedy tokens (32)
  each; the metric is decode tokens/s = B * (new - 1) / (last token - the last row's first
  token, as produced), i.e. the batch over its time per output token after the prefill
  (TPOT). End-of-sequence never stops a row, so every engine does the same work.

Method (as `graphmode bench`, harness.py): every engine is set up once per model; per
scenario each engine runs once untimed (warm-up: lazy compiles and plan builds happen
there, so its wall time is kept as `warmup_s`, and its tokens are compared with
transformers eager's), then timed rounds in which every engine runs once, the first
engine rotating each round; median and p90 over rounds;
the load average, the process's CPU-s per wall-s and the rounds' spread become the same
flags (quality.py). A per-scenario budget ends the rounds early, never below `min_iters`.

The floor: a decode step reads every weight once (the LM head included, the token and
position tables only a row) and every sequence's K and V so far; at the host's measured
read bandwidth no engine can produce tokens faster than
`batch * bandwidth / (weight bytes + batch * context * KV bytes per token)`, at the
engine's own weight and KV dtypes: a floor on time per token, i.e. a ceiling on tokens/s.
Rows that ran carry it as `floor_tok_s` and `of_floor` (a row above 1 is flagged `floor`:
the bandwidth was under-measured or the weights stayed in cache). Tiny models are far from
it: their steps cost dispatch, not bytes.
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

from graphmode.bench.decode_engines import DecodeShared, make_engine, parse_engines
from graphmode.bench.decode_models import MODELS, PRETTY, QUICK_MODELS, decode_recipe
from graphmode.bench.engines import EngineUnavailable
from graphmode.bench.harness import _p90, _reason, set_ratios
from graphmode.verify.numerics import WEIGHT_ONLY
from graphmode.bench.machine import _version, machine_meta
from graphmode.bench.quality import QUICK_NOTE, Conditions, Probe, judge, warning_lines
from graphmode.decode.api import causal_lm
from graphmode.errors import GraphmodeError

DTYPE_BYTES = {"f32": 4.0, "f16": 2.0, "bf16": 2.0, "int8": 1.0, "q8_0": 34 / 32}   # per weight


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
    engines: list[tuple[str, str | None]] = field(default_factory=lambda: parse_engines(None))
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

    def scenarios(self) -> list[Scenario]:
        return ([Scenario("ttft", 1, p, 1) for p in self.prompt_lens] +
                [Scenario("decode", b, self.context, self.new_tokens) for b in self.batches])

    @property
    def max_tokens(self) -> int:
        return max(max(self.prompt_lens) + 1, self.context + self.new_tokens)


QUICK = dict(prompt_lens=(8, 16), batches=(1, 2), context=16, new_tokens=4, iters=2, min_iters=2, warmup=1)


# ---- the floor ----------------------------------------------------------------------------

def decode_bytes(lm: torch.nn.Module, dtype: str) -> tuple[float, float]:
    """(weight bytes one decode step reads, K+V bytes per cached token) at `dtype` weights
    (1-D tensors stay f32, as every engine here keeps them) and f32 KV; the caller scales
    the KV term to the engine's KV dtype."""
    from graphmode.decode.lm import lm_config
    seen: set[int] = set()
    head = lm.get_output_embeddings().weight
    gathered = {id(m.weight) for m in lm.modules() if isinstance(m, torch.nn.Embedding) and m.weight is not head}
    w = 0.0
    for p in lm.parameters():
        if id(p) in seen or id(p) in gathered:       # a lookup table is read one row per token
            continue
        seen.add(id(p))
        w += p.numel() * (DTYPE_BYTES[dtype] if p.dim() >= 2 else 4.0)
    cfg = lm_config(lm)
    return w, 2.0 * cfg["layers"] * cfg["kv_heads"] * cfg["head_dim"] * 4.0


def floor_tok_s(weight_b: float, kv_token_b: float, batch: int, context: float, gbps: float) -> float:
    return batch * gbps * 1e9 / (weight_b + batch * context * kv_token_b)


def read_bandwidth_gbps(threads: int, mb: int = 512, reps: int = 5) -> float:
    """Best of `reps` full reads (a sum) of an `mb` MB f32 buffer with `threads` threads: what
    a decode step that streams its weights can get from memory here."""
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x = torch.ones(mb * 2**20 // 4, dtype=torch.float32)
        best = math.inf
        for _ in range(reps):
            t0 = time.perf_counter()
            x.sum()
            best = min(best, time.perf_counter() - t0)
        return x.numel() * 4 / best / 1e9
    finally:
        torch.set_num_threads(prev)


# ---- the run ------------------------------------------------------------------------------

@dataclass
class DecodeCase:
    name: str
    spec: str
    bundle: Any
    lm: torch.nn.Module
    load_s: float = 0.0


def load_cases(models: Sequence[str], quick: bool) -> list[DecodeCase]:
    from graphmode.bench.models import resolve_bundle
    table = QUICK_MODELS if quick else MODELS
    cases = []
    for spec in models or list(table):
        t0 = time.perf_counter()
        builder = {**MODELS, **QUICK_MODELS}.get(spec)
        bundle = builder() if builder else resolve_bundle(spec)
        cases.append(DecodeCase(spec if builder else bundle.name, spec, bundle, causal_lm(bundle, "--model"),
                                time.perf_counter() - t0))
    return cases


def prompts_for(sc: Scenario, vocab: int, seed: int) -> torch.Tensor:
    """Random prompt ids in [3, vocab) (0-2 are the synthetic vocab's specials), one row per sequence."""
    g = torch.Generator().manual_seed(seed * 1000 + sc.batch * 7 + sc.prompt)
    return torch.randint(3, vocab, (sc.batch, sc.prompt), generator=g, dtype=torch.int64)


@dataclass
class _Slot:
    engine: Any
    rows: dict[Scenario, dict]
    ok: bool = True
    reason: str | None = None
    skipped: bool = False
    setup_s: float | None = None
    failed_in: str | None = None          # "setup" or the scenario it failed in


def _row(case: DecodeCase, sc: Scenario, eng: Any, threads: int) -> dict[str, Any]:
    return {"model": case.name, "model_name": PRETTY.get(case.name, case.name), "scenario": sc.name,
            "kind": sc.kind, "batch": sc.batch, "prompt": sc.prompt, "new_tokens": sc.new, "engine": eng.name,
            "variant": eng.variant or "default", "label": eng.label, "dtype": eng.dtype, "kv_dtype": eng.kv_dtype,
            "status": "ok", "reason": None, "skipped": False, "threads": threads, "times": [], "tok_s": [],
            "eager_fallback": None, "eager_islands": 0}


def bench_model(case: DecodeCase, cfg: DecodeConfig, gbps: float, log: Callable[[str], None],
                probe: Probe) -> list[dict[str, Any]]:
    vocab = int(case.lm.config.vocab_size)
    scen = cfg.scenarios()
    recipe = decode_recipe(case.lm, [s.prompt for s in scen], [s.batch for s in scen], cfg.max_tokens,
                           name=f"bench-decode-{case.name}")
    work = tempfile.TemporaryDirectory(prefix="graphmode-decode-")
    shared = DecodeShared(case.name, case.bundle, case.lm, recipe, cfg.threads, max(s.batch for s in scen),
                          cfg.max_tokens, cache_dir=cfg.cache_dir, work=Path(work.name), on_stage=cfg.on_stage)
    slots: list[_Slot] = []
    try:
        for name, variant in cfg.engines:
            eng = make_engine(name, variant)
            slot = _Slot(eng, {sc: _row(case, sc, eng, cfg.threads) for sc in scen})
            slots.append(slot)
            log(f"  setup {eng.label} ...")
            t0 = time.perf_counter()
            try:
                eng.setup(shared)
            except Exception as e:  # noqa: BLE001 - a failing engine is a result, not a crash
                _fail(slot, e, "setup")
                log(f"  {eng.label}: {slot.reason}")
            slot.setup_s = round(time.perf_counter() - t0, 3)
        for sc in scen:
            log(f"{case.name} {sc.name}")
            _scenario(case, sc, slots, cfg, vocab, log, probe)
        rows = []
        wb = {d: decode_bytes(case.lm, d) for d in {s.engine.dtype for s in slots}}
        for sc in scen:
            group = [_finish(s, sc, wb, gbps) for s in slots]
            _ratios(group)
            judge(group, probe.cores, quick=cfg.quick)
            flag_floor(group)
            rows += group
        return rows
    finally:
        for s in slots:
            s.engine.close()
        work.cleanup()
        gc.collect()


def _fail(slot: _Slot, e: BaseException, where: str, row: dict | None = None) -> None:
    """The engine is out of this model's run from here on; the row it failed in says why (rows
    it measured before stay measured)."""
    slot.ok, slot.reason, slot.skipped, slot.failed_in = False, _reason(e), isinstance(e, EngineUnavailable), where
    if row is not None:
        row["_error"] = slot.reason


def _scenario(case: DecodeCase, sc: Scenario, slots: list[_Slot], cfg: DecodeConfig, vocab: int,
              log: Callable[[str], None], probe: Probe) -> None:
    prompts = prompts_for(sc, vocab, cfg.seed)
    live = [s for s in slots if s.ok]
    ref = None
    for s in live:                                  # warm-up; its tokens are the numerics check
        t0 = time.perf_counter()
        for _ in range(max(1, cfg.warmup)):
            try:
                got = s.engine.run(prompts, sc.new)
            except Exception as e:  # noqa: BLE001
                _fail(s, e, sc.name, s.rows[sc])
                log(f"  {s.engine.label} failed: {s.reason}")
                break
        else:
            s.rows[sc]["warmup_s"] = round(time.perf_counter() - t0, 3)
            s.rows[sc]["_tokens"] = got.tokens
            if s.engine.name == "eager":
                ref = got.tokens
    for s in slots:
        row = s.rows[sc]
        if ref is not None and "_tokens" in row:
            row["tokens_match"] = _agreement(row.pop("_tokens"), ref)
        row.pop("_tokens", None)
    start = time.perf_counter()
    for r in range(cfg.iters):
        live = [s for s in slots if s.ok]
        if not live:
            break
        order = live[r % len(live):] + live[:r % len(live)]
        load = probe.load1()
        for s in order:
            row = s.rows[sc]
            cond: Conditions = row.setdefault("_cond", Conditions())
            try:
                c0 = probe.cpu_time()
                got = s.engine.run(prompts, sc.new)
                c1 = probe.cpu_time()
            except Exception as e:  # noqa: BLE001
                _fail(s, e, sc.name, row)
                continue
            span = got.end_s - got.decode_from_s
            row["times"].append(got.first_s * 1e3 if sc.kind == "ttft" else span * 1e3 / max(sc.new - 1, 1))
            if sc.kind == "decode":
                row["tok_s"].append(sc.batch * (sc.new - 1) / max(span, 1e-9))
            row.setdefault("ttft_rounds_ms", []).append(round(got.first_s * 1e3, 3))
            cond.cpu_s += c1 - c0
            cond.wall_s += got.end_s
            if load is not None:
                cond.loads.append(load)
        if r + 1 >= cfg.min_iters and time.perf_counter() - start > cfg.budget_s:
            break


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


def _finish(slot: _Slot, sc: Scenario, wb: dict[str, tuple[float, float]], gbps: float) -> dict[str, Any]:
    row = slot.rows[sc]
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
        med = statistics.median(times)
        row.update(median_ms=round(med, 4), p90_ms=round(_p90(times), 4), iters=len(times),
                   rounds_ms=[round(t, 4) for t in times], spread=round(_p90(times) / med, 3) if med > 0 else None,
                   ttft_ms=round(statistics.median(row["ttft_rounds_ms"]), 3))
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


def flag_floor(rows: list[dict[str, Any]]) -> None:
    """After `judge` (which resets the flags): a row faster than its bandwidth floor."""
    from graphmode.bench.quality import _flag
    for r in rows:
        if r.get("of_floor") is not None and r["of_floor"] > 1:
            _flag(r, "floor", f"{r['decode_tok_s']:.1f} tok/s is above the bandwidth ceiling {r['floor_tok_s']:.1f}: "
                              "the bandwidth was under-measured or the weights stayed in cache")


def _ratios(rows: list[dict[str, Any]]) -> None:
    """`speedup_vs_eager` (what quality.judge bounds) and `ratio_vs_best_other` on the
    scenario's time metric (TTFT ms, or ms per decode step)."""
    for r in rows:
        for k in ("median_ms", "p90_ms", "speedup_vs_eager", "ratio_vs_eager", "ratio_vs_best_other",
                  "best_other_engine", "decode_tok_s", "spread", "load_max", "cpu_per_wall", "ttft_ms"):
            r.setdefault(k, None)
    set_ratios([r for r in rows if r["status"] == "ok" and r["median_ms"]])


# ---- goals (issue 15, item 9) -------------------------------------------------------------

def goals(rows: list[dict[str, Any]], quick: bool = False) -> list[dict[str, Any]]:
    """Each goal per model: met (True/False) or None (not measurable in this run, with why;
    never judged from a --quick run, whose timings are not measurements)."""
    out = []
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model and r["status"] == "ok"]

        def pick(kind, batch=None, prompt=None, engine=None, dtype=None, not_engine=None, variant="default"):
            return [r for r in mine if r["kind"] == kind and (batch is None or r["batch"] == batch)
                    and (prompt is None or r["prompt"] == prompt)
                    and (engine is None or (r["engine"] == engine and r.get("variant", "default") == variant))
                    and (dtype is None or r["dtype"] == dtype) and r["engine"] != not_engine]

        def goal(name, target, value, need, detail):
            met = None if value is None else (value >= need if target.startswith(">=") else value <= need)
            if quick and met is not None:
                met, detail = None, f"not judged (--quick): {detail}"
            out.append({"model": model, "goal": name, "target": target, "value": value, "met": met,
                        "detail": detail})

        gm1 = next(iter(pick("decode", batch=1, engine="graphmode")), None)
        alt1 = max(pick("decode", batch=1, dtype="f32", not_engine="graphmode"),
                   key=lambda r: r["decode_tok_s"], default=None)
        goal("decode b1 fp32 vs best fp32 alternative", ">= 1.2x",
             _div(gm1 and gm1["decode_tok_s"], alt1 and alt1["decode_tok_s"]), 1.2,
             _vs(gm1, alt1, "decode_tok_s", "tok/s"))
        goal("decode b1 fp32 vs the floor", ">= 0.8", gm1 and gm1["of_floor"], 0.8,
             f"graphmode {gm1['decode_tok_s']:.1f} tok/s, floor {gm1['floor_tok_s']:.1f}"
             if gm1 and gm1.get("floor_tok_s") else "not measured: no graphmode decode b1 row with a floor")
        q8 = next(iter(pick("decode", batch=1, engine="llama_cpp", variant="q8_0")), None)
        gm8 = next(iter(pick("decode", batch=1, engine="graphmode", variant="int8")), None)
        goal("int8 decode b1 vs llama.cpp q8_0", ">= 1.0x", _div(gm8 and gm8["decode_tok_s"], q8 and q8["decode_tok_s"]),
             1.0, _vs(gm8, q8, "decode_tok_s", "tok/s") if gm8 and q8 else
             "not measured: needs graphmode[int8] and llama_cpp[q8_0] rows at batch 1" +
             (f" (graphmode[int8]: {gm8['decode_tok_s']:.1f} tok/s)" if gm8 else ""))
        gm16 = next(iter(pick("decode", batch=16, engine="graphmode")), None)
        sc16 = next(iter(pick("decode", batch=16, engine="static_compile")), None)
        goal("decode b16 throughput vs static-cache torch.compile", ">= 1.5x",
             _div(gm16 and gm16["decode_tok_s"], sc16 and sc16["decode_tok_s"]), 1.5,
             _vs(gm16, sc16, "decode_tok_s", "tok/s"))
        gm512 = next(iter(pick("ttft", prompt=512, engine="graphmode")), None)
        alt512 = min(pick("ttft", prompt=512, not_engine="graphmode"), key=lambda r: r["ttft_ms"], default=None)
        goal("TTFT p512 vs best alternative", "<= 0.8x", _div(gm512 and gm512["ttft_ms"], alt512 and alt512["ttft_ms"]),
             0.8, _vs(gm512, alt512, "ttft_ms", "ms"))
    return out


def _div(a, b):
    return round(a / b, 4) if a and b else None


def _vs(mine, other, key, unit):
    if mine is None or other is None:
        return "not measured: " + ("no graphmode row" if mine is None else "no alternative row")
    return f"graphmode {mine[key]:.1f} {unit} vs {other['label']} {other[key]:.1f} {unit}"


@dataclass
class DecodeResult:
    rows: list[dict[str, Any]]
    meta: dict[str, Any]
    goals: list[dict[str, Any]]

    def quick_failures(self) -> list[str]:
        """Why a --quick run fails: an engine that did not run (not counting 'not installed')
        or graphmode tokens that differ from transformers eager's (with int8 / bf16 weights:
        a row's first token). Never a timing."""
        bad = []
        for r in self.rows:
            where = f"{r['model']} {r['scenario']} {r['label']}"
            if r["status"] != "ok":
                if not r["skipped"]:
                    bad.append(f"{where}: failed: {r['reason']}")
            elif r["engine"] == "graphmode":
                m = r.get("tokens_match")
                if m is None:
                    bad.append(f"{where}: no transformers eager tokens to compare with (add eager to --engines)")
                elif r.get("variant") in WEIGHT_ONLY:
                    # narrow weights flip a near-tie now and then, and a free-running sequence
                    # differs from there on: the check is each row's first token (the prefill's
                    # top-1 on eager's own input); graphmode verify measures top-1 per position
                    if m.get("first") != m.get("rows"):
                        bad.append(f"{where}: a first new token differs from transformers eager's under "
                                   f"{r['variant']} weights ({m})")
                elif m["same"] != m["of"]:
                    bad.append(f"{where}: greedy tokens differ from transformers eager ({m})")
        return bad


def run_decode_bench(cases: Sequence[DecodeCase], cfg: DecodeConfig, log: Callable[[str], None] = lambda s: None,
                     target: Any = None, probe: Probe | None = None) -> DecodeResult:
    for c in cases:
        if c.lm.config.vocab_size < 4:
            raise GraphmodeError("the model's vocabulary is too small for random prompts", where="--model",
                                 value=c.name)
    probe = probe or Probe()
    load_start = probe.loadavg()
    prev = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    t_start = time.perf_counter()
    measured = read_bandwidth_gbps(cfg.threads)
    probed = getattr(target, "memory_bandwidth_gbps", None) if target is not None else None
    gbps = max(measured, probed or 0.0)
    rows: list[dict[str, Any]] = []
    try:
        for case in cases:
            rows += bench_model(case, cfg, gbps, log, probe)
    finally:
        torch.set_num_threads(prev)
    meta = machine_meta(cfg.threads, target)
    meta["versions"].update(llama_cpp_python=_version("llama_cpp_python"), gguf=_version("gguf"))
    meta.update(
        kind="decode", quick=cfg.quick, usable_cores=probe.cores, loadavg_start=load_start,
        loadavg_max=max((r["load_max"] for r in rows if r.get("load_max") is not None), default=None),
        wall_s=round(time.perf_counter() - t_start, 1),
        bandwidth={"read_gbps_measured": round(measured, 2), "host_probe_gbps": probed,
                   "floor_uses_gbps": round(gbps, 2),
                   "how": "best of 5 sums of a 512 MB f32 buffer at --threads; the floor uses the larger of it "
                          "and the host probe (graphmode targets show host)"},
        models=[{"model": c.name, "spec": c.spec, "load_s": round(c.load_s, 3), "class": type(c.lm).__name__,
                 "params_m": round(sum(p.numel() for p in c.lm.parameters()) / 1e6, 2)} for c in cases],
        engines=[make_engine(n, v).label for n, v in cfg.engines],
        method={"scenarios": [s.name for s in cfg.scenarios()], "prompt_lens": list(cfg.prompt_lens),
                "batches": list(cfg.batches), "context": cfg.context, "new_tokens": cfg.new_tokens,
                "warmup": cfg.warmup, "iters": cfg.iters, "min_iters": cfg.min_iters,
                "budget_s_per_scenario": cfg.budget_s, "seed": cfg.seed,
                "ttft": "request -> first token in the caller's hands (ms), batch 1, one new token",
                "decode_tok_s": "batch * (new - 1) / (last token - the last row's first token, as produced), "
                                "greedy, end-of-sequence ignored",
                "rounds": "interleaved, rotated start each round; 1 timed run per engine per round",
                "floor": "batch * bandwidth / (weight bytes + batch * mean context * KV bytes per token) "
                         "at the engine's weight and KV dtypes"},
        warnings=([QUICK_NOTE] if cfg.quick else []) + warning_lines(_for_warnings(rows), cfg.quick))
    return DecodeResult(rows, meta, goals(rows, cfg.quick))


def _for_warnings(rows):
    return [{**r, "shape": [r["scenario"]]} for r in rows]
