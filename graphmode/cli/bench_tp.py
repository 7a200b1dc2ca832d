"""`graphmode bench --tensor-parallel N` (graphmode/bench/tensor_parallel.py): TP=1 against N ranks,
printed, and written as JSON and Markdown beside the other bench results."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Optional, Sequence

from graphmode.cli.app import console, err_console
from graphmode.cli.progress import progress

TP_MODELS = ["minilm", "gpt2"]        # the default encoder shapes' transformers (ResNet-18 splits by batch)


def bench_tp(models: Optional[Sequence[str]], shapes: Optional[Sequence[str]], world: int, *, threads: int,
             iters: int, recipe: Optional[Path], out: Path, name: str, cache_dir: Optional[Path],
             warm_cache: bool, as_json: bool, quick: bool, tol: float) -> None:
    from graphmode.bench.models import load_cases
    from graphmode.bench.tensor_parallel import TPConfig, markdown, run_tp_bench
    from graphmode.paths import cache_layout
    from graphmode.recipe import load_recipe
    from graphmode.targets import get_target
    layout = cache_layout(cache_dir)
    target = get_target("host", cache_dir=layout.targets)
    cases = load_cases(list(models or TP_MODELS), list(shapes or []), quick=quick)
    if recipe is not None:
        import yaml
        load_recipe(recipe)                                 # refused here with its own errors
        base = yaml.safe_load(recipe.read_text(encoding="utf-8"))
        base.pop("parallel", None)
        for c in cases:
            c.recipe = base
    log = (lambda s: err_console.print(s, markup=False, highlight=False)) if not as_json else (lambda s: None)
    with tempfile.TemporaryDirectory(prefix="graphmode-bench-tp-") as tmp, progress(measuring=True) as on_stage:
        cfg = TPConfig(world=world, threads=threads, iters=iters, warmup=1 if quick else 2,
                       cache_dir=layout.root if warm_cache else tmp, on_stage=on_stage,
                       link_reps=5 if quick else 15, extra={"cpu_count": os.cpu_count()})
        res = run_tp_bench(cases, cfg, target, log=log)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(res, indent=1, default=str) + "\n", encoding="utf-8")
    md = markdown(res)
    (out / f"{name}.md").write_text(md, encoding="utf-8")
    bad = [f"{r['model']} {r['shape']}: TP={world} differs from TP=1 (relative L2 {r['rel_l2_vs_tp1']:.2e} > "
           f"{tol:g})" for r in res["rows"] if not r["rel_l2_vs_tp1"] <= tol]
    if as_json:
        print(json.dumps(res, indent=1, default=str))
    else:
        console.print(md, markup=False, highlight=False)
        console.print(f"wrote {out / (name + '.json')}, {out / (name + '.md')}", highlight=False)
    for b in bad:
        err_console.print(f"numerics: {b}", markup=False, highlight=False)
    if bad:
        raise SystemExit(1)


def print_tp_profile(profiles: Sequence[dict]) -> None:
    """`graphmode profile` of a `parallel` recipe: per bucket, the call and each rank's run, then
    per collective the communication of one step measured beside the cost model's."""
    from rich import box
    from rich.table import Table

    from graphmode.bench.tensor_parallel import link_text

    def pct(e):
        return "-" if e is None else f"{e * 100:+.0f}%"
    for p in profiles:
        b = ",".join(f"{k}={v}" for k, v in p["bucket"].items())
        console.print(f"\n[bold]{p['model']}[/] bucket {b}: {len(p['rank_run_ms'])} ranks, median of {p['runs']} "
                      f"calls: call {p['call_ms']:.2f} ms, rank runs "
                      f"{', '.join(f'{x:.2f}' for x in p['rank_run_ms'])} ms; weights per rank "
                      f"{', '.join(f'{w:.2f}' for w in p['weights_mb_per_rank'])} MB", highlight=False)
        link = p["link"]
        t = Table(title="communication per step (err = predicted / measured - 1)", title_justify="left",
                  box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1))
        cols = ["collective", "calls", "bytes", "measured ms", "predicted ms", "err"]
        if link:
            cols += ["on measured link ms", "err"]
        for c in cols:
            t.add_column(c, justify="left" if c == "collective" else "right")
        for c in p["comm"]:
            cells = [c["collective"], str(c["calls"]), f"{c['bytes']:.0f}", f"{c['ms']:.3f}",
                     f"{c['predicted_ms']:.3f}", pct(c["err"])]
            if link:
                cells += [f"{c['calibrated_ms']:.3f}", pct(c["calibrated_err"])]
            t.add_row(*cells)
        console.print(t)
        if link:
            n = link["nominal"]
            if not link.get("bandwidth_resolved", True):
                console.print(f"  link {n['name']}: recipe {n['bandwidth_gbps']:g} GB/s, {n['latency_us']:g} us; "
                              f"measured: {link['latency_us']:.0f} us, the bandwidth not resolved (the times did not "
                              f"grow with size up to {max(link.get('fit_bytes') or [0])} bytes: messages this small, or "
                              "a busy host); for a `links` entry, keep the bandwidth and set latency_us from this",
                              highlight=False)
                continue
            console.print(f"  link {n['name']}: recipe {n['bandwidth_gbps']:g} GB/s, {n['latency_us']:g} us; measured "
                          f"(f32 all_reduces {link['gap_ms']:.2f} ms apart, as this bucket's calls) "
                          f"{link_text(link)}. For this host's recipes: "
                          f"links: {{{n['name']}: {{bandwidth_gbps: {link['bandwidth_gbps']:.2g}, latency_us: "
                          f"{link['latency_us']:.0f}}}}}", highlight=False)
