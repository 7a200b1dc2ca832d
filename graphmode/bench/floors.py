"""The floors a benchmark row is measured against: what the hardware allows at best.

- An encoder shape's roofline time on the host (`shape_floor`): max(FLOPs / peak, bytes /
  bandwidth) from the host probe and graphmode's count of the model's work; a row's time as
  a multiple of it is its `x_floor`.
- A decoder's bandwidth ceiling on tokens/s (`floor_tok_s`): a decode step reads every
  weight once (the LM head included, the token and position tables only a row) and every
  sequence's K and V so far; at the host's measured read bandwidth no engine can produce
  tokens faster than `batch * bandwidth / (weight bytes + batch * context * KV bytes per
  token)`, at the engine's own weight and KV dtypes: a floor on time per token, i.e. a
  ceiling on tokens/s. Rows that ran carry it as `floor_tok_s` and `of_floor` (a row above
  1 is flagged `floor`: the bandwidth was under-measured or the weights stayed in cache).
  Tiny models are far from it: their steps cost dispatch, not bytes.
"""
from __future__ import annotations

import math
import time
from typing import Any

import torch

from graphmode.bench.engines import _reason
from graphmode.bench.profile import facts_at, model_roofline

# per weight; int4: graphmode's group-32 codes with an f32 scale a group; q4_0: 32 codes and an
# f16 scale in 18 bytes; q4_K_M: llama.cpp's mix of q4_K (4.5 bits) and q6_K (6.56) tensors,
# about 4.85 bits a weight on average (its own size report for 7B models), an approximation here
DTYPE_BYTES = {"f32": 4.0, "f16": 2.0, "bf16": 2.0, "int8": 1.0, "q8_0": 34 / 32, "int4": 0.5 + 4 / 32,
               "q4_0": 18 / 32, "q4_K_M": 4.85 / 8}


def _probe_warning(target: Any) -> list[str]:
    """The host probe's own doubt (targets.host.probe_note): every floor of the run rests on it."""
    from graphmode.targets.host import probe_note
    note = probe_note(target)
    return [f"host probe: {note}; this run's floors are low with it"] if note else []


def shape_floor(compiled: Any, env: dict[str, int], target: Any) -> dict[str, Any]:
    """The roofline floor of one shape on `target`: `floor_ms` = max(FLOPs / peak, bytes /
    bandwidth) in the recipe's compute dtype, its `floor_bound`, and the `floor_flops` and
    `floor_bytes` (weights + planned activations) the recipe proofs count at this shape, a lookup
    table (token embeddings) counted for the rows the shape reads
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


def flag_floor(rows: list[dict[str, Any]]) -> None:
    """After `judge` (which resets the flags): a row faster than its bandwidth floor."""
    from graphmode.bench.quality import _flag
    for r in rows:
        if r.get("of_floor") is not None and r["of_floor"] > 1:
            _flag(r, "floor", f"{r['decode_tok_s']:.1f} tok/s is above the bandwidth ceiling {r['floor_tok_s']:.1f}: "
                              "the bandwidth was under-measured or the weights stayed in cache")
