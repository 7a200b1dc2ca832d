"""`python -m graphmode.fuzz [--only recipes,kb] [--cases N] [--seed S]`: the sweep, a summary
table, the failures; exit 1 when any case failed."""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from graphmode.fuzz import FAMILIES
from graphmode.fuzz.outcome import markdown
from graphmode.fuzz.run import DEFAULT_TIMEOUT_S, run, to_json

DEFAULT_CASES = {"recipes": 600, "onnx": 120, "artifacts": 160, "caches": 90, "kb": 300, "http": 600}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m graphmode.fuzz", description=__doc__)
    p.add_argument("--only", default=",".join(FAMILIES), help=f"comma-separated: {', '.join(FAMILIES)}")
    p.add_argument("--cases", type=int, default=None, help="cases per fuzzer (default: each fuzzer's own)")
    p.add_argument("--seed", type=int, default=20261203)
    p.add_argument("--timeout-s", type=float, default=DEFAULT_TIMEOUT_S, help="per case")
    p.add_argument("--work", type=Path, default=None, help="scratch folder (default: a temporary one)")
    p.add_argument("--json", type=Path, default=None, help="write every case's result here")
    a = p.parse_args(argv)
    fams = [f.strip() for f in a.only.split(",") if f.strip()]
    n = a.cases if a.cases is not None else DEFAULT_CASES
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="graphmode-fuzz-") as tmp:
        work = a.work or Path(tmp)
        results = run(fams, n, a.seed, work, a.timeout_s, log=lambda s: print(s, file=sys.stderr, flush=True))
    print(markdown(results))
    failed = [r for r in results if r.failed]
    for r in failed:
        print(f"FAILED {r.family} {r.case}: {r.outcome}: {r.detail}")
    print(f"{len(results)} case(s), {len(failed)} failure(s) in {time.perf_counter() - t0:.0f} s (seed {a.seed})")
    if a.json:
        a.json.write_text(json.dumps(to_json(results, seed=a.seed), indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
