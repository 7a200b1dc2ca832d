"""`graphmode bench`: graphmode vs eager PyTorch, torch.compile, ONNX Runtime and OpenVINO,
side by side on the same inputs and threads. See bench/README.md."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import List, Optional

import typer

from graphmode.cli.app import app, console, err_console
from graphmode.cli.options import CacheDir, KbPath, kb_file
from graphmode.cli.progress import progress
from graphmode.paths import shown



def default_out_dir() -> Path:
    repo_bench = Path(__file__).resolve().parents[2] / "bench"
    return (repo_bench if repo_bench.is_dir() else Path.cwd() / "bench") / "results"


def results_place(out: Optional[Path], name: Optional[str]) -> Path:
    """The results folder, checked before anything is measured (a file there failed the write
    after the whole run), and `--name` a plain file stem (a path in it wrote outside --out)."""
    from graphmode.errors import GraphmodeError
    from graphmode.paths import writable_output
    if name is not None and (not name or Path(name).name != name or name in (".", "..")):
        raise GraphmodeError("--name is the results' file stem, not a path", where="--name", value=name,
                             fix="give a plain name (letters, digits, -, _), and the folder with --out")
    return writable_output(out or default_out_dir(), "--out", folder=True)


def _mark_isa(res, cap: str, labelled: bool, simd) -> None:
    """Each graphmode row says which code path its kernels ran; an `--isa` run's rows are
    labelled `graphmode[<isa>]` in the tables too, and its warnings say which of the other
    engines' kernels were not held to that ISA as well."""
    from graphmode.backends.cpu.isa import resolve
    from graphmode.bench.machine import isa_env_missing
    res.meta["isa"] = resolve(cap, simd)
    for r in res.rows:
        if r["engine"] == "graphmode":
            r["isa"] = res.meta["isa"]
            if labelled:
                r["label"] = f"graphmode[{cap}]"
    below_best = labelled and res.meta["isa"] != resolve("auto", simd)
    missing = isa_env_missing(res.meta["isa"]) if below_best else {}
    if missing:
        res.meta.setdefault("warnings", []).append(
            f"--isa {cap} holds graphmode's kernels to {res.meta['isa']}; torch's (eager, torch.compile) and "
            "oneDNN's (torch's and OpenVINO's convolutions) keep the host's best unless the run starts with "
            + " ".join(f"{k}={v}" for k, v in missing.items())
            + "; ONNX Runtime and OpenVINO's matmuls (MLAS) cannot be held to it")


bench_app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
app.add_typer(bench_app, name="bench")


@bench_app.callback(invoke_without_command=True)
def bench_cmd(
    ctx: typer.Context,
    model: Optional[List[str]] = typer.Option(None, "--model", help="minilm | gpt2 | resnet18 | "
                                              "path/file.py:function | package.module:function (repeatable; "
                                              "default: the three built-ins)"),
    shape: Optional[List[str]] = typer.Option(None, "--shape", help="first-input shape, e.g. 1x128 or 8x3x224x224 "
                                              "(repeatable; default: each model's standard shapes)"),
    engines: Optional[str] = typer.Option(None, "--engines", help="comma list of eager,torch_compile,onnxruntime,"
                                          "openvino,graphmode (default: all, and torch_compile[max-autotune] "
                                          "unless --quick)"),
    with_: Optional[List[str]] = typer.Option(None, "--with", help="extra torch.compile variant: max-autotune (in "
                                              "the default list already; adds it to an --engines list), freezing, "
                                              "max-autotune+freezing (slow to compile)"),
    iters: int = typer.Option(20, "--iters", min=1, help="timed interleaved rounds per shape"),
    warmup: int = typer.Option(2, "--warmup", min=1, help="untimed calls per engine before timing"),
    rewarm: int = typer.Option(2, "--rewarm", min=0, help="untimed calls per engine before each timed call "
                               "(absorbs the switch from the previous engine)"),
    budget_s: float = typer.Option(90.0, "--budget-s", min=0.001, help="per shape: stop rounds after this many seconds "
                                   "(at least 5 rounds)"),
    threads: int = typer.Option(2, "--threads", min=1, max=1024, help="intra-op threads for every engine"),
    recipe: Optional[Path] = typer.Option(None, "--recipe", help="graphmode recipe (default: one with buckets "
                                          "exactly at the benchmarked shapes)"),
    out: Optional[Path] = typer.Option(None, "--out", help="results folder (default bench/results)"),
    name: Optional[str] = typer.Option(None, "--name", help="file stem of the results (default bench, or quick)"),
    zoo: bool = typer.Option(False, "--zoo", help="add every model family of graphmode.capture.families (small "
                             "configs) at its example shape: graph-mode coverage, numerics and speed in one table"),
    quick: bool = typer.Option(False, "--quick", help="smoke run: one shape per model, 3 rounds; exit 1 unless "
                               "every engine ran and matched eager (its timings are not measurements)"),
    tol: float = typer.Option(1e-4, "--tol", min=0.0, help="relative L2 vs eager that counts as matching"),
    cache_dir: Optional[Path] = CacheDir,
    kb: Optional[Path] = KbPath,
    warm_cache: bool = typer.Option(False, "--warm-cache", help="compile graphmode through the plan and kernel "
                                    "cache under --cache-dir (default: a fresh temporary one, so setup_s is a "
                                    "cold compile)"),
    as_json: bool = typer.Option(False, "--json", help="print the rows as JSON on stdout"),
    contend: int = typer.Option(0, "--contend", min=0, max=64, help="also time every engine with N CPU burner "
                                "processes running (started and stopped by the bench): quiet and contended columns "
                                "side by side, with each engine's slowdown"),
    between_buckets: bool = typer.Option(False, "--between-buckets", help="requests between buckets: each model "
                                         "compiled with batch buckets 1,2,4 and seq buckets under max_padding 0.5, "
                                         "timed at random request shapes inside that contract (graphmode's chosen way: padded, split, eager, or "
                                         "once a value recurs a plan of its own, built in setup; eager at the "
                                         "request's own shape); default models: models the tests never "
                                         "build (T5 encoder, Llama-style LM, DistilBERT, ViT, MLP-Mixer)"),
    samples: Optional[int] = typer.Option(None, "--samples", min=1, help="--between-buckets: random request shapes "
                                          "per model (besides batch 3 x seq 50; default 6)"),
    tensor_parallel: int = typer.Option(1, "--tensor-parallel", min=1, max=64, help="time the models at TP=1 "
                                        "(--threads threads) against N rank processes (--threads / N each): "
                                        "latency, weights per rank, communication per collective measured vs the "
                                        "cost model, and the loopback link measured (docs/tensor-parallel.md)"),
    isa: Optional[str] = typer.Option(None, "--isa", help="cap graphmode's generated kernels at avx512 | avx2 | "
                                      "portable (the recipe's codegen.isa; default: the recipe's own, auto = the "
                                      "host's best): e.g. the AVX2 code path's table from an AVX-512 host"),
) -> None:
    """Benchmark graphmode against the alternatives; writes JSON, Markdown and a PNG chart.
    `graphmode bench decode` benchmarks generation (TTFT, tokens/s) instead."""
    if ctx.invoked_subcommand is not None:
        return
    out = results_place(out, name)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from graphmode.backends.cpu.isa import CAPS, cap_problem
    from graphmode.bench.engines import parse_engines
    from graphmode.bench.harness import BenchConfig, run_bench
    from graphmode.bench.models import DEFAULT_MODELS, load_cases
    from graphmode.bench.report import goals, quiet_rows, rich_table, write_results
    from graphmode.errors import GraphmodeError, TargetError
    from graphmode.openmp import in_effect
    from graphmode.paths import cache_layout
    from graphmode.recipe import load_recipe
    from graphmode.targets import get_target

    if tensor_parallel > 1:
        if between_buckets or zoo or contend or engines or with_ or isa:
            raise GraphmodeError("--tensor-parallel times graphmode at TP=1 against TP=N only",
                                 where="--tensor-parallel", value=tensor_parallel,
                                 fix="leave out --between-buckets, --zoo, --contend, --engines, --with and --isa")
        from graphmode.cli.bench_tp import bench_tp
        bench_tp(model, shape, tensor_parallel, threads=threads, iters=3 if quick else iters, recipe=recipe,
                 out=out, name=name or f"tp{tensor_parallel}", cache_dir=cache_dir,
                 warm_cache=warm_cache, as_json=as_json, quick=quick, tol=tol)
        return
    if samples is not None and not between_buckets:
        raise GraphmodeError("--samples is the number of request shapes --between-buckets draws", where="--samples",
                             value=samples, fix="add --between-buckets, or leave out --samples")
    samples = samples or 6
    if between_buckets and (zoo or shape or recipe is not None):
        raise GraphmodeError("--between-buckets samples its own shapes under its own contract",
                             where="--between-buckets", fix="leave out --zoo, --shape and --recipe")
    eng = parse_engines(engines if engines is not None else ("eager,graphmode" if between_buckets else None),
                        with_ or [], quick=quick)
    if isa is not None and isa not in CAPS:
        raise GraphmodeError(f"unknown ISA {isa!r}", where="--isa", value=isa, fix=f"one of {', '.join(CAPS)}")
    layout = cache_layout(cache_dir)
    cfg = BenchConfig(engines=eng, threads=threads, iters=3 if quick else iters, min_iters=3 if quick else 5,
                      warmup=1 if quick else warmup, rewarm=0 if quick else rewarm, budget_s=budget_s, tol=tol,
                      recipe=str(recipe) if recipe else None, cache_dir=layout.root if warm_cache else None,
                      onnx_cache_dir=layout.onnx, quick=quick, kb=None if quick else kb_file(kb, cache_dir), isa=isa,
                      contend=contend)
    log = (lambda s: err_console.print(s, markup=False, highlight=False)) if not as_json else (lambda s: None)
    if between_buckets:
        from graphmode.bench import between
        models = list(model or between.MODELS.values())
    else:
        models = list(model or ([] if zoo else DEFAULT_MODELS))
    if zoo:
        from graphmode.capture.families import FAMILIES
        models += [f"graphmode.capture.families:{n}" for n in FAMILIES]
    cases = load_cases(models, shape or [], quick=quick, recipe=load_recipe(recipe) if recipe else None)
    if between_buckets:
        for c in cases:
            c.recipe = between.contract_recipe(c.bundle, c.name)
            c.envs = between.sample_envs(c.bundle, 1 if quick else samples, 0, load_recipe(c.recipe).dim_buckets())
            if len(c.envs) < (1 if quick else samples):
                log(f"{c.name}: only {len(c.envs)} request shape(s) fall between its buckets")
    target = get_target("host", cache_dir=layout.targets)
    why = cap_problem(isa, target.simd)
    if why is not None:
        raise TargetError(why[0], where="--isa", value=isa, fix=why[1].replace("codegen.isa:", "--isa"))
    try:
        with progress(measuring=True) as on_stage:      # graphmode's compile stages, between the engines' setup lines
            cfg.on_stage = on_stage
            res = run_bench(cases, cfg, log=log, target=target)
    except KeyboardInterrupt:
        err_console.print(f"interrupted: nothing written to {out or default_out_dir()} and nothing recorded in the "
                          "knowledge base (rounds cut short are not a measurement); run it again to measure",
                          markup=False, highlight=False)
        raise typer.Exit(130) from None
    _mark_isa(res, isa or (load_recipe(recipe).codegen.isa if recipe else "auto"), isa is not None, target.simd)
    res.meta["openmp_env"] = in_effect(os.environ)
    if between_buckets:
        res.meta["between_buckets"] = {"batch_buckets": between.BATCH_BUCKETS, "seq": between.SEQ_DIM,
                                       "samples": samples, "summary": between.summary(quiet_rows(res))}
        res.meta["recipe"] = (f"per model: batch buckets {between.BATCH_BUCKETS}, seq {between.SEQ_DIM['min']}-"
                              f"{between.SEQ_DIM['max']} under max_padding {between.SEQ_DIM['max_padding']}; the "
                              "request shapes fall between the buckets")
    paths = write_results(res, out,
                          name or ("quick" if quick else "between" if between_buckets else "bench"))
    if as_json:
        print(json.dumps(res.rows, indent=1, default=str))
    else:
        table, notes = rich_table(res, console.width)
        console.print(table)
        for n in notes:
            console.print(f"  {n}", markup=False, highlight=False)
        for g in (between.summary_lines(quiet_rows(res)) if between_buckets else goals(res)):
            console.print(f"goal: {g}", markup=False, highlight=False)
        console.print("wrote " + ", ".join(shown(p) for p in paths.values()), highlight=False)
    for w in res.meta.get("warnings", []):      # stderr: --json keeps stdout to the rows
        err_console.print(f"warning: {w}", markup=False, highlight=False, style="yellow", soft_wrap=True)
    if quick:
        bad = res.quick_failures()
        if bad:
            for b in bad:
                err_console.print(f"quick check failed: {b}", markup=False, highlight=False)
            raise SystemExit(1)
        if not as_json:
            console.print("quick check: every engine ran and matched eager")
    else:
        bad = res.quick_failures("graphmode")     # written above beside the alternatives; still a failed run
        for b in bad:
            err_console.print(f"graphmode failed: {b}", markup=False, highlight=False)
        if bad:
            raise SystemExit(1)


from graphmode.cli.bench_decode_cmd import decode_cmd  # noqa: E402  (its own module: `bench decode`)

bench_app.command("decode")(decode_cmd)
