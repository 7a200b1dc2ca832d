"""`graphmode bench --tensor-parallel N`: one process with T threads against N rank processes
with T/N threads each, on the same model, shapes and inputs.

Per model and shape: the latency of both (medians of interleaved calls, the TP call measured in
the caller: the pipes to the ranks are part of its cost), each rank's own run time, the weights
each rank holds against the whole model's, and per call and collective the communication the
ranks measured (calls, bytes, ms) beside the cost model's prediction for the rank's sharded graph
on the recipe's link (the host target's nominal `loopback`) and on the link measured here
(`graphmode.parallel.link`) the way the shape's calls meet it: after every timed call a few
all_reduces of each size (the plan's own among them), apart by the compute the calls showed
between two collectives, so the probe shares the calls' load. The link is also measured back
to back (no compute between), the best case, once a run. TP=N's outputs are checked against
TP=1's (relative L2).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.utils._pytree as pytree

from graphmode.parallel.link import (REPS, SIZES, around, compare, compute_gap, fit_link, link_time, plan_sizes,
                                     predict_comm, round_samples)


@dataclass
class TPConfig:
    world: int = 2
    threads: int = 2            # TP=1's threads; each rank gets threads // world (at least 1)
    iters: int = 10
    warmup: int = 2
    timeout_s: float = 60.0
    cache_dir: Any = None
    link_sizes: Sequence[int] = SIZES
    link_reps: int = REPS
    on_stage: Any = None
    extra: dict = field(default_factory=dict)


def tp_recipe(base: dict, world: int, timeout_s: float) -> dict:
    """`base` (a bench recipe) with a `parallel` section: `world` ranks on the host's loopback link."""
    ref = "${target.groups.interconnects.loopback.%s}"
    r = dict(base, name=f"{base['name']}-tp{world}")
    r["parallel"] = {"tensor": world, "device_group": [f"rank{i}" for i in range(world)],
                     "links": {"loopback": {"bandwidth_gbps": ref % "bandwidth_gbps",
                                            "latency_us": ref % "latency_us"}},
                     "comm": {"timeout_s": timeout_s}}
    return r


def _leaves(out: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]


def _rel_l2(got: Any, want: Any) -> float:
    from graphmode.verify.numerics import rel_l2
    return max((rel_l2(g, w) for g, w in zip(_leaves(got), _leaves(want))), default=float("inf"))


def weights_bytes(cm: Any) -> int:
    return sum(t.numel() * t.element_size() for t in cm.graph.constants.values()) if cm.graph is not None else 0


def run_tp_bench(cases: Sequence[Any], cfg: TPConfig, target: Any,
                 log: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Every case at each of its shapes (module doc); {rows, link, meta}."""
    import graphmode
    from graphmode.bench.models import auto_recipe
    from graphmode.recipe import load_recipe
    from graphmode.recipe.resolve import resolve
    from graphmode.targets.host import load_average
    rows: list[dict[str, Any]] = []
    link: dict[str, Any] | None = None
    per_rank = max(1, cfg.threads // cfg.world)
    load0 = load_average()
    for case in cases:
        base = case.recipe if isinstance(case.recipe, dict) else auto_recipe(case.bundle, case.envs,
                                                                                f"bench-{case.name}")
        rec_n = tp_recipe(base, cfg.world, cfg.timeout_s)
        spec = resolve(load_recipe(rec_n), target).parallel
        log(f"{case.name}: compiling TP=1 ({cfg.threads} threads) and TP={cfg.world} ({per_rank} thread(s) a rank)")
        t0 = time.perf_counter()
        one = graphmode.compile(case.bundle, base, target, cache_dir=cfg.cache_dir, threads=cfg.threads,
                                warmup=True, on_stage=cfg.on_stage)
        setup1 = time.perf_counter() - t0
        t0 = time.perf_counter()
        with graphmode.compile(case.spec, rec_n, target, cache_dir=cfg.cache_dir, threads=per_rank) as tp:
            setup_n = time.perf_counter() - t0
            if link is None:
                link = measured_link(tp, spec, cfg.link_sizes, cfg.link_reps)
                log(f"loopback link measured back to back: {link['bandwidth_gbps']:.2f} GB/s, "
                    f"{link['latency_us']:.0f} us (nominal {link['nominal']['bandwidth_gbps']:g} GB/s, "
                    f"{link['nominal']['latency_us']:g} us)")
            for env in case.envs:
                rows.append(_bench_shape(case, env, one, tp, spec, cfg, setup1, setup_n, per_rank))
                log(_line(rows[-1]))
    return {"rows": rows, "link": link,
            "meta": {"world": cfg.world, "threads_tp1": cfg.threads, "threads_per_rank": per_rank,
                     "iters": cfg.iters, "loadavg_start": load0, "loadavg_end": load_average(), **cfg.extra}}


def _bench_shape(case: Any, env: dict, one: Any, tp: Any, spec: Any, cfg: TPConfig, setup1: float,
                 setup_n: float, per_rank: int) -> dict[str, Any]:
    inputs = case.bundle.make_inputs(env, seed=0)
    with torch.inference_mode():
        want = one(**inputs)
        warm = []
        for _ in range(max(1, cfg.warmup)):
            one(**inputs)
            tp(**inputs)
            warm.append(tp.last_comm)
        sent = plan_sizes(tp.collectives, spec, env)
        sizes = sorted({*cfg.link_sizes, *sent})
        t1, tn, calls, probes = [], [], [], []
        for _ in range(cfg.iters):
            t0 = time.perf_counter()
            one(**inputs)
            t1.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            got = tp(**inputs)
            tn.append(time.perf_counter() - t0)
            calls.append(tp.last_comm)
            probes.append(probe(tp, sizes, per_call_reps(cfg.link_reps, cfg.iters, tp.collectives), warm + calls))
    link = probed_link(probes, spec, tp.world, compute_gap(warm + calls), sent)
    table, rank0 = comm_tables(tp, calls, spec, env, link)
    whole = weights_bytes(one)
    lat1, latn = statistics.median(t1), statistics.median(tn)
    run_s = [statistics.median(c[r]["run_s"] for c in calls) for r in range(tp.world)]
    return {"model": case.name, "shape": "x".join(map(str, case.shape_of(env))), "env": dict(env),
            "tp1_ms": lat1 * 1e3, f"tp{tp.world}_ms": latn * 1e3, "speedup": lat1 / latn,
            "rank_run_ms": [s * 1e3 for s in run_s], "ipc_ms": (latn - max(run_s)) * 1e3,
            "rank_cpu_ms": [statistics.median(c[r]["cpu_s"] for c in calls) * 1e3 for r in range(tp.world)],
            "weights_mb_whole": whole / 1e6, "weights_mb_per_rank": [r["weights_bytes"] / 1e6 for r in tp.ranks],
            "comm": table, "comm_rank0": rank0, "link": link, "rel_l2_vs_tp1": _rel_l2(got, want),
            "setup_s": {"tp1": setup1, f"tp{tp.world}": setup_n}, "threads": {"tp1": cfg.threads, "per_rank": per_rank}}


def comm_tables(tp: Any, calls: list[list[dict]], spec: Any, env: dict, link: dict | None) -> tuple[list, list]:
    """Per collective kind, measured vs predicted (`link.compare`) over `calls` (one
    `tp.last_comm` each), and rank 0's own measurement. A collective's wait on a late peer is not
    link time: of each collective of a call, the rank that waited least (it arrived last)
    measured the link (`link.link_time`)."""
    measured = _median_calls([link_time([r["trace"] for r in c]) for c in calls])
    rank0 = _median_calls([c[0]["per_op"] for c in calls])
    fitted = {"bandwidth_gbps": link["bandwidth_gbps"], "latency_us": link["latency_us"]} if link else None
    table = compare(measured, predict_comm(tp.collectives, spec, env),
                    predict_comm(tp.collectives, spec, env, fitted) if fitted else None)
    return table, compare(rank0, {})


def measured_link(tp: Any, spec: Any, sizes: Sequence[int] = SIZES, reps: int = REPS,
                  gap_s: float = 0.0) -> dict[str, Any]:
    """The group's link measured with `gap_s` of compute before each all_reduce beside the
    recipe's (resolved) link (`probed_link`)."""
    return probed_link([tp.measure_link(tuple(sizes), reps, gap_s)], spec, tp.world, gap_s)


def probe(tp: Any, sizes: Sequence[int], reps: int, calls: Sequence[Any]) -> list:
    """After a timed call: `reps` all_reduces of each size, as far apart as the calls so far
    computed between two collectives (`link.compute_gap`)."""
    return tp.measure_link(tuple(sizes), reps, compute_gap(calls))


def per_call_reps(reps: int, calls: int, collectives: Sequence[Any] = ()) -> int:
    """All_reduces of each size after each of `calls` timed calls: `reps` over the run, at least
    three, and at least as many as a call makes (`collectives`, rank 0's graph's): each round is
    then summed as a call is (`link.round_samples`)."""
    return max(3, -(-reps // max(1, calls)), sum(c.op == "all_reduce" for c in collectives))


def probed_link(probes: Sequence[Any], spec: Any, world: int, gap_s: float,
                sizes: Sequence[int] = ()) -> dict[str, Any]:
    """The link fitted (`link.fit_link`) to probe rounds (`tp.measure_link` results, merged,
    `link.link_samples`) beside the recipe's (resolved) link; with `sizes` (a plan's), fitted
    at those sizes and their neighbours (`link.around`)."""
    samples = round_samples(probes)
    fitted = around(samples, sizes)
    name, ls = spec.link_for()
    return {"gap_ms": gap_s * 1e3, "samples": [{"bytes": b, "ms": s * 1e3} for b, s in samples],
            "fit_bytes": [b for b, _ in fitted], **fit_link(fitted, world),
            "nominal": {"name": name, "bandwidth_gbps": float(ls.bandwidth_gbps), "latency_us": float(ls.latency_us)}}


def profile_tp(case: Any, recipe: Any, target: Any, runs: int, threads: int | None, cache_dir: Any,
               on_stage: Any = None, link: bool = True) -> list[dict[str, Any]]:
    """`graphmode profile` of a `parallel` recipe: per shape, `runs` calls of the rank group;
    per call the latency, each rank's run time, and per collective the communication measured
    vs the cost model (on the recipe's link and on the link measured here)."""
    import graphmode
    from graphmode.recipe.resolve import resolve
    spec = resolve(recipe, target).parallel
    out = []
    with graphmode.compile(case.spec, recipe, target, cache_dir=cache_dir, threads=threads) as tp:
        for env in case.envs:
            inputs = case.bundle.make_inputs(env, seed=0)
            warm = []
            for _ in range(2):
                tp(**inputs)
                warm.append(tp.last_comm)
            sent = plan_sizes(tp.collectives, spec, env)
            sizes = sorted({*SIZES, *sent})
            lat, calls, probes = [], [], []
            for _ in range(runs):
                t0 = time.perf_counter()
                tp(**inputs)
                lat.append(time.perf_counter() - t0)
                calls.append(tp.last_comm)
                if link:
                    probes.append(probe(tp, sizes, per_call_reps(REPS, runs, tp.collectives), warm + calls))
            fit = probed_link(probes, spec, tp.world, compute_gap(warm + calls), sent) if link else None
            table, rank0 = comm_tables(tp, calls, spec, env, fit)
            out.append({"model": case.name, "bucket": dict(env), "runs": runs, "call_ms": statistics.median(lat) * 1e3,
                        "rank_run_ms": [statistics.median(c[r]["run_s"] for c in calls) * 1e3 for r in range(tp.world)],
                        "weights_mb_per_rank": [r["weights_bytes"] / 1e6 for r in tp.ranks],
                        "comm": table, "comm_rank0": rank0, "link": fit})
    return out


def _median_calls(calls: list[dict]) -> dict[str, dict[str, float]]:
    from graphmode.parallel.link import median_per_op
    return median_per_op(calls)


def _line(r: dict) -> str:
    tot = r["comm"][-1]
    n = len(r["weights_mb_per_rank"])
    return (f"{r['model']} {r['shape']}: TP=1 {r['tp1_ms']:.2f} ms, TP={n} {r[f'tp{n}_ms']:.2f} ms "
            f"(x{r['speedup']:.2f}); comm {tot['calls']} collectives, {tot['bytes'] / 1e3:.1f} kB, "
            f"{tot['ms']:.2f} ms measured vs {tot['predicted_ms']:.2f} ms predicted; weights per rank "
            + ", ".join(f"{w:.1f}" for w in r["weights_mb_per_rank"]) + f" MB of {r['weights_mb_whole']:.1f} MB")


def markdown(res: dict[str, Any]) -> str:
    """The run as Markdown: the latency table, the communication per collective, the link."""
    m, link = res["meta"], res["link"]
    n = m["world"]
    out = [f"# Tensor parallel: TP=1 ({m['threads_tp1']} threads) vs TP={n} ({m['threads_per_rank']} thread(s) "
           f"a rank)", "", f"Load average at start {m['loadavg_start']}, at end {m['loadavg_end']}; medians of "
           f"{m['iters']} interleaved calls.", "",
           f"| model | shape | TP=1 ms | TP={n} ms | speedup | rank run ms | pipes ms | weights MB whole | "
           f"weights MB per rank | rel L2 vs TP=1 |", "|" + "---|" * 10]
    for r in res["rows"]:
        out.append(f"| {r['model']} | {r['shape']} | {r['tp1_ms']:.2f} | {r[f'tp{n}_ms']:.2f} | {r['speedup']:.2f} | "
                   f"{', '.join(f'{x:.2f}' for x in r['rank_run_ms'])} | {r['ipc_ms']:.2f} | "
                   f"{r['weights_mb_whole']:.2f} | {', '.join(f'{w:.2f}' for w in r['weights_mb_per_rank'])} | "
                   f"{r['rel_l2_vs_tp1']:.1e} |")
    out += ["", "Communication per call (err = predicted / measured - 1; calibrated = on the measured link):", "",
            "| model | shape | collective | calls | bytes | measured ms | predicted ms | err | calibrated ms | err |",
            "|" + "---|" * 10]
    for r in res["rows"]:
        for c in r["comm"]:
            out.append(f"| {r['model']} | {r['shape']} | {c['collective']} | {c['calls']} | {c['bytes']:.0f} | "
                       f"{c['ms']:.3f} | {c['predicted_ms']:.3f} | {_pct(c['err'])} | {c['calibrated_ms']:.3f} | "
                       f"{_pct(c['calibrated_err'])} |")
    for r in res["rows"]:
        share = max(r["weights_mb_per_rank"]) / r["weights_mb_whole"] if r["weights_mb_whole"] else 0.0
        if share > 1.1 / n:
            out += ["", f"{r['model']}: a rank holds {share * 100:.0f}% of the weights, not 1/{n}: some stay whole on "
                    "every rank (a replicated layer class, or a layer whose heads or sizes do not divide by the "
                    "ranks, which the `shard` pass keeps whole)."]
    if link:
        out += ["", f"Loopback link (f32 all_reduce, {len(link['samples'])} sizes), back to back: "
                f"{link_text(link)} (nominal {link['nominal']['bandwidth_gbps']:g} GB/s, "
                f"{link['nominal']['latency_us']:g} us)."]
    lines = [f"- {r['model']} {r['shape']}: {r['link']['gap_ms']:.2f} ms apart, {link_text(r['link'])}"
             for r in res["rows"] if r.get("link")]
    if lines:
        out += ["", "As the calls meet it (the calibrated column): probed after every timed call, each all_reduce "
                "after the compute a rank does between two collectives in that shape's calls:", ""] + lines
    return "\n".join(out) + "\n"


def link_text(link: dict) -> str:
    bw = f"{link['bandwidth_gbps']:.2f} GB/s" if link.get("bandwidth_resolved", True) else \
        "bandwidth not resolved (the times did not grow with size)"
    sizes = link.get("fit_bytes")
    over = "every size" if not sizes or len(sizes) == len(link["samples"]) else \
        "the sizes " + ", ".join(_size(b) for b in sizes)
    return f"{bw}, {link['latency_us']:.0f} us, fit within {link['worst_err'] * 100:.0f}% of {over}"


def _size(nbytes: int) -> str:
    return f"{nbytes} B" if nbytes < 1024 else f"{nbytes / 1024:g} KiB"


def _pct(e: float | None) -> str:
    return "-" if e is None else f"{e * 100:+.0f}%"
