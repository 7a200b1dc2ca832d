"""`graphmode bench decode --tensor-parallel N`: decode tokens/s of one process with T threads
(TP=1) against N rank processes with T/N threads each (graphmode/decode/tensor_parallel.py),
on the same model, prompts and recipe but for its `parallel` section.

The scenario is `batch` rows of `context` random tokens, `new` greedy tokens each. Rounds
alternate TP=1 and TP=N; each side's decode tokens/s is the median over rounds of the tokens
made after the step that gave every row its first token over the time from then to the last
token (as bench/speculative.py). Both sides' tokens must be equal (greedy; a round where they
differ fails the row). Beside the speed: the weights and the KV pool each rank holds against
one process's, and per decode step rank 0's broadcast (the step's inputs) and collectives,
their bytes and the time rank 0 spent in them (which includes waiting for rank 1).
"""
from __future__ import annotations

import random
import statistics
import tempfile
import time
from typing import Any, Callable, Iterator

from graphmode.bench.models import DecodeCase, decode_engine, decode_recipe

LOOPBACK = {"bandwidth_gbps": "${target.groups.interconnects.loopback.bandwidth_gbps}",
            "latency_us": "${target.groups.interconnects.loopback.latency_us}"}


def _round(stream: Callable[..., Iterator[dict[int, list[int]]]], prompts: Any, new: int
           ) -> tuple[list[list[int]], float]:
    """Tokens per row and decode tokens/s (after every row has its first token)."""
    rows = prompts.shape[0]
    toks: list[list[int]] = [[] for _ in range(rows)]
    first, made = None, 0
    for out in stream(prompts, max_new_tokens=new):
        for i, t in out.items():
            toks[i].extend(t)
        if first is None and all(toks):
            first, made = time.perf_counter(), sum(map(len, toks))
    end = time.perf_counter()
    return toks, (sum(map(len, toks)) - made) / max(end - first, 1e-9)


def bench_tp_decode(case: DecodeCase, *, world: int, batch: int, context: int, new: int, iters: int, threads: int,
                    cache_dir: str | None = None, on_stage: Any = None, timeout_s: float = 60.0,
                    log: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """One row: TP=1 and TP=N decode tokens/s, tokens equal, memory per rank, communication per step."""
    import torch

    import graphmode
    one_recipe = decode_recipe(case.lm, [context], [batch], context + new, name=f"bench-tp1-{case.name}")
    tp_recipe = dict(decode_recipe(case.lm, [context], [batch], context + new, name=f"bench-tp{world}-{case.name}"),
                     parallel={"tensor": world, "device_group": [f"rank{i}" for i in range(world)],
                               "links": {"loopback": LOOPBACK}, "comm": {"timeout_s": timeout_s}})
    row: dict[str, Any] = {"model": case.name, "scenario": f"decode b{batch} ctx{context}", "batch": batch,
                           "context": context, "new_tokens": new, "tensor_parallel": world, "threads": threads,
                           "threads_per_rank": max(1, threads // world)}
    rng = random.Random(0)
    with tempfile.TemporaryDirectory(prefix="graphmode-bench-tpdec-") as tmp:
        cm, eng, row["tp1_build_s"] = decode_engine(case.bundle, one_recipe, threads=threads,
                                                    cache_dir=cache_dir or tmp, on_stage=on_stage,
                                                    prepare=(batch, context))
        vocab = int(eng.cfg["vocab"] or 100)
        prompts = torch.tensor([[rng.randrange(3, max(4, vocab)) for _ in range(context)] for _ in range(batch)])
        t0 = time.perf_counter()
        with graphmode.compile(case.lm, tp_recipe, "host", cache_dir=cache_dir or tmp,   # pickled to the ranks
                               threads=max(1, threads // world)) as tp:
            row["tpn_build_s"] = round(time.perf_counter() - t0, 3)
            one_s, tp_s, same = [], [], True
            for i in range(iters + 1):                       # round 0 warms both sides up, untimed
                want, a = _round(cm.stream, prompts, new)
                got, b = _round(tp.stream, prompts, new)
                same = same and got == want
                if i:
                    one_s.append(a)
                    tp_s.append(b)
                log(f"  tp decode {case.name} round {i}: TP=1 {a:.1f} tok/s, TP={world} {b:.1f} tok/s, "
                    f"tokens {'equal' if got == want else 'DIFFER'}")
            steps = tp.last_stats["prefill_steps"] + tp.last_stats["decode_steps"]
            c0 = tp.last_comm[0]
            whole_w = sum(t.numel() * t.element_size() for k, t in eng.lowered.graph.constants.items()
                          if eng.lowered.graph.values[k].role != "state")
            row.update(weights_mb=round(whole_w / 2**20, 3),
                       weights_per_rank_mb=[round(r["weights_bytes"] / 2**20, 3) for r in tp.ranks],
                       kv_pool_mb=round(eng.cache.bytes / 2**20, 3),
                       kv_pool_per_rank_mb=[round(r["kv_pool_bytes"] / 2**20, 3) for r in tp.ranks],
                       steps=steps,
                       comm_per_step={op: {"calls": round(v["calls"] / steps, 2), "bytes": round(v["bytes"] / steps),
                                           "ms": round(1e3 * v["seconds"] / steps, 3)}
                                      for op, v in c0["per_op"].items()})
    tp1, tpn = statistics.median(one_s), statistics.median(tp_s)
    row.update(tp1_tok_s=round(tp1, 2), tpn_tok_s=round(tpn, 2), speedup=round(tpn / tp1, 3), tokens_equal=same,
               iters=iters)
    if not same:
        row["error"] = f"TP={world} greedy tokens differ from TP=1's"
    return row


COLUMNS = ("model", "scenario", "tensor_parallel", "threads", "tp1_tok_s", "tpn_tok_s", "speedup", "weights_mb",
           "weights_per_rank_mb", "kv_pool_mb", "kv_pool_per_rank_mb", "comm_per_step", "tokens_equal")


def write_tp_decode(rows: list[dict], meta: dict, out_dir: Any, name: str) -> dict[str, Any]:
    """`<name>-tp.json`, `.meta.json` and `.md`, beside the decode bench's files."""
    from graphmode.bench.report import _md_table, _write
    lines = [f"# graphmode tensor-parallel decode, {meta.get('date', '')}", "",
             f"- host load (uptime) at start: {meta.get('load', '?')}",
             "- " + __doc__.split("\n\n")[1].replace("\n", " "), ""]
    lines += _md_table(list(COLUMNS), [[str(r.get(c, "")) for c in COLUMNS] for r in rows])
    return _write(out_dir, f"{name}-tp", rows, meta, "\n".join(lines) + "\n")
