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
    if p.split() == "head" and m is not None:
        need = []
        if p.strategy["attention"] == "head":
            need += [("model.heads", m.heads), ("model.kv_heads", m.kv_heads)]
        if p.strategy["mlp"] == "head":
            need.append(("model.intermediate", m.intermediate))
        for field, v in need:
            if v is not None and v % n:
                cls = {"model.heads": "attention", "model.kv_heads": "attention", "model.intermediate": "mlp"}[field]
                out.append(("parallel.tensor", f"{field} = {v} does not split over {n} ranks", n,
                            f"a tensor degree dividing {v}, or strategy.{cls}: replicate"))
    kv = recipe.memory.kv_cache
    if p.split() == "head" and kv is not None and p.strategy["attention"] == "head":
        heads = kv.kv_heads or (m.kv_heads or m.heads if m else None)
        if heads is not None and heads % n:
            out.append(("parallel.tensor", f"the KV cache's {heads} KV heads do not split over {n} ranks", n,
                        f"a tensor degree dividing {heads}, or strategy.attention: replicate"))
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
