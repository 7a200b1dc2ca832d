"""The sweep: set each fuzzer up, generate its seeded cases, run them (in a worker subprocess,
or against a server for HTTP), and collect one Result per case."""
from __future__ import annotations

import importlib
import json
import random
import time
from pathlib import Path
from typing import Any, Callable, Iterable

from graphmode.fuzz import FAMILIES
from graphmode.fuzz.outcome import Result
from graphmode.fuzz.worker import Worker

MODULES = {"recipes": "recipes", "onnx": "onnx_files", "artifacts": "artifacts", "caches": "caches", "kb": "kb",
           "http": "http"}
DEFAULT_TIMEOUT_S = 120.0


def run_family(family: str, n: int, seed: int, work: Path, timeout_s: float = DEFAULT_TIMEOUT_S,
               log: Callable[[str], None] = lambda s: None,
               select: Callable[[dict[str, Any]], bool] | None = None) -> list[Result]:
    """`n` seeded cases of one fuzzer (those `select` keeps, when given)."""
    mod = importlib.import_module(f"graphmode.fuzz.{MODULES[family]}")
    fam_work = work / family
    fam_work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    ctx = mod.setup(fam_work)
    log(f"{family}: set up in {time.perf_counter() - t0:.1f} s")
    cases = mod.cases(random.Random(f"{seed}:{family}"), n, ctx)
    if select is not None:
        cases = [c for c in cases if select(c)]
    if hasattr(mod, "run_cases"):                       # a server under test: the runner sends the requests
        return mod.run_cases(cases, ctx, timeout_s, log)
    ctx_file = fam_work / "ctx.json"
    ctx_file.write_text(json.dumps(ctx))
    worker = Worker(MODULES[family], ctx_file, fam_work / "worker.log")
    results = []
    try:
        for c in cases:
            t = time.perf_counter()
            outcome, detail = worker.run(c, c.get("timeout_s", timeout_s))
            results.append(Result(family, c["id"], outcome, detail, time.perf_counter() - t))
            if results[-1].failed:
                log(f"  {family} {c['id']}: {outcome}: {detail}")
    finally:
        worker.stop()
        if hasattr(mod, "cleanup"):
            mod.cleanup(fam_work)
    return results


def run(families: Iterable[str], n: int | dict[str, int], seed: int, work: Path,
        timeout_s: float = DEFAULT_TIMEOUT_S, log: Callable[[str], None] = lambda s: None) -> list[Result]:
    out: list[Result] = []
    for fam in families:
        if fam not in FAMILIES:
            raise ValueError(f"unknown fuzzer {fam!r}: one of {', '.join(FAMILIES)}")
        k = n[fam] if isinstance(n, dict) else n
        t0 = time.perf_counter()
        res = run_family(fam, k, seed, work, timeout_s, log)
        log(f"{fam}: {len(res)} case(s) in {time.perf_counter() - t0:.1f} s, "
            f"{sum(r.failed for r in res)} failure(s)")
        out += res
    return out


def to_json(results: list[Result], **meta: Any) -> dict[str, Any]:
    from graphmode.fuzz.outcome import summary
    header, rows = summary(results)
    return {**meta, "summary": [dict(zip(header, r)) for r in rows], "cases": [r.to_json() for r in results]}
