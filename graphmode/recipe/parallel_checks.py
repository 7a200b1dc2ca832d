"""Cross-field checks of the recipe's `parallel` section (layer 2 of verification).

Each problem is (field path, message, value, fix); `recipe/semantics.py` turns them into
RecipeErrors with the YAML line. What the checks need from the model (heads, KV heads,
intermediate size) comes from the recipe's `model` section. Without one, the `shard` pass finds
what the captured graph lets it split and gathers the rest whole (correct; the compile report
lists what was gathered). A vocabulary need not divide: the `shard` pass pads it
(ceil(vocab / tensor) rows a rank).
"""
from __future__ import annotations

from typing import Any

from graphmode.recipe.parallel_spec import unlinked_pair

Problem = tuple[str, str, Any, str]


def check_parallel(recipe: Any, target: Any, dim_buckets: dict[str, list[int]]) -> list[Problem]:
    p = recipe.parallel
    if p is None:
        return []
    out: list[Problem] = []
    n = p.tensor
    if len(p.device_group) < n:
        out.append(("parallel.device_group", f"{len(p.device_group)} device(s) for tensor {n}: every rank needs "
                    "a device of its own", p.device_group,
                    f"list at least {n} devices, or lower parallel.tensor to {len(p.device_group)}"))
    if not p.links:
        out.append(("parallel.links", "missing: the proofs price every collective on the link it crosses", None,
                    'add links: {loopback: {bandwidth_gbps: "${target.groups.interconnects.loopback.bandwidth_gbps}", '
                    'latency_us: "${target.groups.interconnects.loopback.latency_us}"}} (docs/tensor-parallel.md)'))
    for name, link in p.links.items():
        stray = [d for d in link.devices if d not in p.device_group]
        if stray:
            out.append((f"parallel.links.{name}.devices", f"{', '.join(stray)} not in parallel.device_group "
                        f"{p.device_group}", link.devices, "name devices of the group (or leave devices out: the "
                                                           "link joins every pair)"))
    if out:
        return out
    pair = unlinked_pair(p)
    if pair is not None:
        out.append(("parallel.links", f"no link joins {pair[0]} and {pair[1]}, but a collective crosses every pair "
                    "of ranks", sorted(p.links), f"add a link with devices [{pair[0]}, {pair[1]}] (or without "
                                                 "devices: it joins every pair)"))
    if p.backend == "nccl" and target is not None and getattr(target, "kind", "cpu") == "cpu":
        out.append(("parallel.backend", f"nccl runs on GPUs; target {target.name!r} is a CPU", p.backend,
                    "backend: gloo"))
    m = recipe.model
    if p.split() == "head":
        for cls, field, v in undivided(recipe, n):
            if p.strategy[cls] == "head":
                what = f"the KV cache's {v} KV heads do not" if field == "memory.kv_cache.kv_heads" else \
                    f"{field} = {v} does not"
                out.append(("parallel.tensor", f"{what} split over {n} ranks", n,
                            f"a tensor degree dividing {v}, or strategy.{cls}: replicate"))
    if p.split() == "batch" and n > 1:
        bdim = m.batch_dim if m is not None else "batch"
        vals = dim_buckets.get(bdim)
        if vals is None:
            out.append(("parallel.strategy", f"batch strategy, but the recipe has no {bdim!r} dim to split",
                        bdim, "declare the batch dim under dims (or model.batch_dim)"))
        else:
            bad = [v for v in vals if v % n]
            if bad:
                out.append((f"dims.{bdim}", f"bucket {bdim}={bad[0]} does not split over {n} ranks"
                            + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else "")
                            + ": each rank runs an equal share of the padded batch", bad[0],
                            f"buckets that are multiples of {n} (e.g. step: {n}); a request of {bad[0]} is padded "
                            f"up to the next one"))
    return out


def undivided(recipe: Any, n: int) -> list[tuple[str, str, int]]:
    """(layer class, field, count) for every count the recipe names (its `model` section's heads,
    KV heads and MLP width, its KV cache's heads) that does not divide by `n`: the classes that
    cannot split by heads over `n` ranks."""
    m, kv = recipe.model, recipe.memory.kv_cache
    counts = {"attention": [("model.heads", m.heads if m else None), ("model.kv_heads", m.kv_heads if m else None),
                            ("memory.kv_cache.kv_heads", (kv.kv_heads or (m.kv_heads or m.heads if m else None))
                             if kv is not None else None)],
              "mlp": [("model.intermediate", m.intermediate if m else None)]}
    return [(cls, f, v) for cls, named in counts.items() for f, v in named if v is not None and v % n]
