"""`graphmode conformance onnx|opinfo`: run a suite nobody here wrote through graphmode, each case
classified pass / wrong / refused / crash / hang; writes <out>/<suite>.json and <suite>.md."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

import typer

from graphmode.cli.app import app, console, err_console
from graphmode.cli.options import CacheDir
from graphmode.errors import GraphmodeError


@app.command("conformance")
def conformance(
    suite: str = typer.Argument(..., help="onnx (the ONNX backend node tests) or opinfo (PyTorch OpInfo samples)"),
    sample: Optional[int] = typer.Option(None, "--sample", min=1,
                                         help="run N cases, the same every time, spread over ops (default: all)"),
    only: Optional[str] = typer.Option(None, "--only", help="run only cases whose id or op matches this regex"),
    out: Path = typer.Option(Path("build/conformance"), "--out", help="folder for <suite>.json and <suite>.md"),
    publish: Optional[Path] = typer.Option(None, "--publish",
                                           help="also put the table into this document's section for the suite "
                                                "(e.g. docs/conformance.md)"),
    jobs: int = typer.Option(1, "--jobs", "-j", min=1, help="worker processes"),
    timeout: float = typer.Option(60.0, "--timeout", min=1.0, help="seconds per case before it counts as a hang"),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="one line per case"),
    cache_dir: Optional[Path] = CacheDir,
) -> None:
    """Exit 0 when no case is wrong, crashes or hangs; 1 otherwise (refusals are allowed)."""
    from graphmode.conformance import report, run_suite
    try:
        rx = re.compile(only) if only else None
    except re.error as e:
        raise GraphmodeError(f"--only is not a valid regular expression: {e}", where="--only", value=only,
                             fix="escape special characters, e.g. 'test_gather\\b'") from None
    keep = (lambda c: bool(rx.search(c.id) or rx.search(c.op))) if rx else None
    out.mkdir(parents=True, exist_ok=True)

    def progress(k: int, n: int, r) -> None:
        if verbose or r.outcome in ("wrong", "crash", "hang"):
            err_console.print(f"[{k}/{n}] {r.outcome:7} {r.id} ({r.seconds:.1f} s) {r.detail[:160]}",
                              markup=False, highlight=False, soft_wrap=True)
        elif k % 50 == 0 or k == n:
            err_console.print(f"[{k}/{n}]", highlight=False)

    run = run_suite(suite, sample=sample, only=keep, jobs=jobs, timeout_s=timeout,
                    options={"cache_dir": str(cache_dir) if cache_dir else None},
                    log_path=out / f"{suite}-workers.log", progress=progress)
    js, md = report.write(run, out)
    if publish is not None:
        report.publish(run, publish)
    c = run.counts()
    n = len(run.results)
    console.print(f"{run.title}: {n} cases: " + ", ".join(f"{k} {v}" for k, v in c.items())
                  + (f" ({100 * c['pass'] / n:.0f}% pass)" if n else ""), highlight=False)
    console.print(f"wrote {js} and {md}" + (f"; published in {publish}" if publish else ""), highlight=False)
    if c["wrong"] or c["crash"] or c["hang"]:
        raise typer.Exit(1)
