"""`graphmode bench decode`: TTFT and decode tokens/s of graphmode's decode engine against
`transformers` (eager; static cache under torch.compile) and llama.cpp (f32, q8_0, q4_0, q4_K_M), with the
bandwidth floor, in one run. Registered under `graphmode bench` by bench_cmd.py. See
bench/README.md ("Decode")."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import List, Optional

import typer

from graphmode.cli.app import err_console
from graphmode.cli.options import CacheDir
from graphmode.cli.progress import progress
from graphmode.errors import GraphmodeError
from graphmode.paths import shown


def _ints(text: Optional[str], where: str) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        vals = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise GraphmodeError(f"cannot parse {text!r}", where=where, fix="write comma-separated integers, e.g. 1,4,16") \
            from None
    if not vals or any(v < 1 for v in vals):
        raise GraphmodeError("every value must be a positive integer", where=where, value=text)
    return vals


def decode_cmd(
    model: Optional[List[str]] = typer.Option(None, "--model", help="gpt2 | llama | tiny-gpt2 | tiny-llama | "
                                              "package.module:function returning a causal LM | a transformers "
                                              "save_pretrained folder (repeatable; default "
                                              "gpt2 and llama, under --quick tiny-gpt2 and tiny-llama)"),
    engines: Optional[str] = typer.Option(None, "--engines", help="comma list of eager,static_compile,llama_cpp,"
                                          "ort_genai,openvino_genai,graphmode; llama_cpp\\[f32], \\[q8_0], "
                                          "\\[q4_0] or \\[q4_K_M] picks one; graphmode\\[int8], \\[bf16], "
                                          "\\[int4], \\[int4_q8] (int4 with q8 activations), \\[batch_invariant], "
                                          "\\[kv_bf16] / \\[kv_f16] (bf16 / f16 KV pool) or "
                                          "\\[merged] (with merge_linears) a variant (default: all)"),
    prompt_lens: Optional[str] = typer.Option(None, "--prompt-lens", help="TTFT prompt lengths (default 128,512)"),
    batches: Optional[str] = typer.Option(None, "--batches", help="decode batch sizes (default 1,4,16)"),
    context: Optional[int] = typer.Option(None, "--context", min=2, help="decode prompt length (default 512)"),
    new_tokens: Optional[int] = typer.Option(None, "--new-tokens", min=2, help="greedy tokens per decode row "
                                             "(default 32)"),
    iters: Optional[int] = typer.Option(None, "--iters", min=1, help="timed interleaved rounds per scenario "
                                        "(default 5)"),
    min_iters: Optional[int] = typer.Option(None, "--min-iters", min=1, help="rounds run whatever the budget "
                                            "(default 3)"),
    budget_s: float = typer.Option(300.0, "--budget-s", min=0.001, help="per scenario: stop rounds after this many seconds"),
    threads: int = typer.Option(2, "--threads", min=1, max=1024, help="intra-op threads for every engine"),
    out: Optional[Path] = typer.Option(None, "--out", help="results folder (default bench/results)"),
    name: Optional[str] = typer.Option(None, "--name", help="file stem (default decode, or decode-quick)"),
    quick: bool = typer.Option(False, "--quick", help="smoke run on tiny models and sizes, 2 rounds; exit 1 unless "
                               "every installed engine ran and graphmode's greedy tokens equal transformers "
                               "eager's (its timings are not measurements)"),
    cache_dir: Optional[Path] = CacheDir,
    warm_cache: bool = typer.Option(False, "--warm-cache", help="build graphmode's plans through the cache under "
                                    "--cache-dir (default: a fresh temporary one, so setup is a cold compile)"),
    as_json: bool = typer.Option(False, "--json", help="print the rows as JSON on stdout"),
    prefix_cache: bool = typer.Option(True, "--prefix-cache/--no-prefix-cache", help="also time graphmode's TTFT "
                                      "for a repeated system prompt (the longest --prompt-lens: 7/8 system, 1/8 "
                                      "user turn) with automatic prefix caching off and on, interleaved; its hit "
                                      "rate (the results' meta.prefix_cache)"),
    contend: int = typer.Option(0, "--contend", min=0, max=64, help="also time every engine with N CPU burner "
                                "processes running (started and stopped by the bench): each scenario gets a "
                                "'busy' column beside its quiet one"),
    speculative: int = typer.Option(0, "--speculative", min=0, max=64, help="instead of the engine comparison: "
                                    "prompt-lookup speculative decoding with up to N drafts per step, tokens/s with "
                                    "and without drafts on one engine, accept rate (a repetitive prompt at batch 1, "
                                    "--context tokens, --new-tokens each)"),
    tensor_parallel: int = typer.Option(1, "--tensor-parallel", min=1, max=64, help="instead of the engine "
                                        "comparison: graphmode's decode tokens/s in one process (--threads) against "
                                        "N rank processes (--threads / N each), tokens equal, weights and KV pool "
                                        "per rank, communication per step (the first --batches value, --context "
                                        "tokens, --new-tokens each; docs/tensor-parallel.md)"),
) -> None:
    """Decode benchmark: time to first token and tokens/s against transformers and llama.cpp."""
    if speculative and tensor_parallel > 1:
        raise GraphmodeError("--speculative and --tensor-parallel are two benchmarks: run one at a time",
                             where="--tensor-parallel", value=tensor_parallel, fix="drop one of the two")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from graphmode.bench.engines import parse_decode_engines
    from graphmode.bench.harness import QUICK, DecodeConfig, run_decode_bench
    from graphmode.bench.models import load_decode_cases
    from graphmode.bench.prefix import prefix_line
    from graphmode.bench.report import decode_failures, decode_rich_tables, write_decode_results
    from graphmode.cli.bench_cmd import console, results_place
    from graphmode.openmp import in_effect
    from graphmode.paths import cache_layout
    from graphmode.targets import get_target

    out = results_place(out, name)

    chosen = parse_decode_engines(engines)
    missing = [e for e in ("eager", "graphmode") if quick and not speculative and tensor_parallel == 1
               and e not in {b for b, _ in chosen}]
    if missing:       # the check --quick makes compares graphmode's tokens with eager's: both must run
        raise GraphmodeError(f"--quick checks graphmode's greedy tokens against transformers eager's; --engines "
                             f"leaves out {' and '.join(missing)}", where="--engines", value=engines,
                             fix=f"add {','.join(missing)} to --engines (or drop --quick)")
    base = DecodeConfig(**QUICK) if quick else DecodeConfig()
    given = {"prompt_lens": _ints(prompt_lens, "--prompt-lens"), "batches": _ints(batches, "--batches"),
             "context": context, "new_tokens": new_tokens, "iters": iters, "min_iters": min_iters}
    layout = cache_layout(cache_dir)
    cfg = DecodeConfig(**{**base.__dict__, **{k: v for k, v in given.items() if v is not None},
                          "engines": chosen, "threads": threads, "budget_s": budget_s,
                          "quick": quick, "cache_dir": layout.root if warm_cache else None, "contend": contend,
                          "prefix_cache": prefix_cache})
    log = ((lambda s: err_console.print(s, markup=False, highlight=False, soft_wrap=True)) if not as_json
           else (lambda s: None))
    cases = load_decode_cases(model or [], quick)
    target = get_target("host", cache_dir=layout.targets)
    if speculative or tensor_parallel > 1:
        return _one_engine(cases, cfg, speculative, tensor_parallel, out,
                           name or ("decode-quick" if quick else "decode"), as_json, log)
    with progress(measuring=True) as on_stage:     # graphmode's decoder build, between the engines' setup lines
        cfg.on_stage = on_stage
        res = run_decode_bench(cases, cfg, log=log, target=target)
    res.meta["openmp_env"] = in_effect(os.environ)
    paths = write_decode_results(res, out, name or ("decode-quick" if quick else "decode"))
    if as_json:
        print(json.dumps(res.rows, indent=1, default=str))
    else:
        for t in decode_rich_tables(res):
            console.print(t)
        for f in decode_failures(res.rows):
            console.print(f"  {f}", markup=False, highlight=False)
        for row in res.meta.get("prefix_cache", []):
            console.print(prefix_line(row), markup=False, highlight=False)
        console.print("wrote " + ", ".join(shown(p) for p in paths.values()), highlight=False)
    for w in res.meta.get("warnings", []):
        err_console.print(f"warning: {w}", markup=False, highlight=False, style="yellow", soft_wrap=True)
    if quick:
        bad = res.quick_failures()
        for b in bad:
            err_console.print(f"quick check failed: {b}", markup=False, highlight=False)
        if bad:
            raise SystemExit(1)
        if not as_json:
            console.print("quick check: every installed engine ran; graphmode's greedy tokens equal transformers "
                          "eager's")
    else:
        bad = [b for b in res.quick_failures("graphmode") if "no transformers eager tokens" not in b]
        for b in bad:
            err_console.print(f"graphmode failed: {b}", markup=False, highlight=False)
        if bad:
            raise SystemExit(1)


def _one_engine(cases, cfg, speculative: int, tensor_parallel: int, out: Path, name: str, as_json: bool,
                log) -> None:
    """`--speculative N` (bench/speculative.py) or `--tensor-parallel N` (bench/tp_decode.py): one
    row per model, written beside the decode files."""
    import time
    from rich.table import Table

    from graphmode.cli.bench_cmd import console
    meta = {"date": time.strftime("%Y-%m-%d %H:%M"), "load": " ".join(f"{x:.2f}" for x in os.getloadavg()),
            "cpus": os.cpu_count(), "threads": cfg.threads, "quick": cfg.quick}
    rows = []
    with progress(measuring=True) as on_stage:
        for case in cases:
            if tensor_parallel > 1:
                from graphmode.bench.tp_decode import COLUMNS, bench_tp_decode, write_tp_decode as write
                rows.append(bench_tp_decode(case, world=tensor_parallel, batch=cfg.batches[0], context=cfg.context,
                                            new=cfg.new_tokens, iters=cfg.iters, threads=cfg.threads,
                                            cache_dir=cfg.cache_dir, on_stage=on_stage, log=log))
            else:
                from graphmode.bench.speculative import COLUMNS, bench_speculative, write_speculative as write
                rows.append(bench_speculative(case, num_tokens=speculative, batch=1, context=cfg.context,
                                              new=max(cfg.new_tokens, speculative + 2), iters=cfg.iters,
                                              threads=cfg.threads, cache_dir=cfg.cache_dir, on_stage=on_stage,
                                              log=log))
    paths = write(rows, meta, out, name)
    what = f"--tensor-parallel {tensor_parallel}" if tensor_parallel > 1 else f"--speculative {speculative}"
    if as_json:
        print(json.dumps(rows, indent=1, default=str))
    else:
        t = Table(title=f"graphmode bench decode {what} (load {meta['load']})")
        for c in COLUMNS:
            t.add_column(c)
        for r in rows:
            t.add_row(*(str(r.get(c, "")) for c in COLUMNS))
        console.print(t)
        console.print("wrote " + ", ".join(str(p) for p in paths.values()), highlight=False)
    bad = [f"{r['model']}: {r['error']}" for r in rows if r.get("error")]
    for b in bad:
        err_console.print(f"{what.lstrip('-')} check failed: {b}", markup=False, highlight=False)
    if bad:
        raise SystemExit(1)
