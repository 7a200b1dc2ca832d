"""Fingerprints: what makes two machines or two models "the same" or "alike" for the knowledge base.

A fingerprint is a digest of identity fields only. A machine's identity is its CPU model, ISA,
microarchitecture, cores and SIMD features; its measured bandwidth and peak are attributes
that move between probes, so they are stored (and compared) but never hashed. An accelerator
or any target described by a file is identified by that file's content. A model's identity is
its architecture as captured: family, op histogram, parameter count, weight shapes and inputs;
two seeds of the same architecture are the same model to the knowledge base.

`hardware_similarity` (1 = same machine) and `model_distance` (0 = same architecture) are
what `recommend` ranks by; each term is documented where it is computed.
"""
from __future__ import annotations

import hashlib
import json
import math
import time
from collections import Counter
from typing import Any

FP_CHARS = 16
MAX_LAYER_SHAPES = 64          # distinct weight shapes kept per model (largest first)


def digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:FP_CHARS]


# ---- hardware -----------------------------------------------------------------------------------

def hardware_of(target: Any) -> dict[str, Any]:
    """A `Target` as a `hardware` row. The host's identity is its CPU; any other target's is
    its description (the target file), so two files that differ are two targets."""
    cpu = (target.groups or {}).get("cpu") if target.measured else None
    desc = target.model_dump(mode="json", exclude={"groups"} if cpu else set())
    if cpu:
        ident = {"kind": target.kind, "cpu_model": cpu.get("model_name"), "isa": cpu.get("isa"),
                 "arch": target.arch, "cores": target.compute_units, "simd": sorted(target.simd)}
    else:
        ident = {"target": target.model_dump(mode="json")}
    return {"fingerprint": digest(ident), "name": target.name, "kind": target.kind,
            "cpu_model": cpu.get("model_name") if cpu else None, "isa": cpu.get("isa") if cpu else None,
            "arch": target.arch, "cores": target.compute_units, "simd": sorted(target.simd),
            "bandwidth_gbps": round(float(target.memory_bandwidth_gbps), 3),
            "peak_f32_gflops": round(target.peak("f32") / 1e9, 3), "target": desc, "created": _now()}


def _ratio(a: Any, b: Any) -> float:
    """min/max of two positive numbers (1 = equal); 0.5 when either is unknown."""
    if not a or not b:
        return 0.5
    return min(a, b) / max(a, b)


def _jaccard(a: set, b: set) -> float:
    return len(a & b) / len(a | b) if a | b else 1.0


def hardware_similarity(a: dict[str, Any], b: dict[str, Any]) -> float:
    """1.0 for the same fingerprint; else a weighted agreement in [0, 0.95]: a kind mismatch
    (cpu vs gpu) is 0, then ISA and microarchitecture (0.25 each), SIMD features (0.2), core
    count, bandwidth and peak as min/max ratios (0.1 each)."""
    if a["fingerprint"] == b["fingerprint"]:
        return 1.0
    if a["kind"] != b["kind"]:
        return 0.0
    s = 0.25 * (a.get("isa") == b.get("isa")) + 0.25 * (a.get("arch") == b.get("arch"))
    s += 0.2 * _jaccard(set(a.get("simd") or []), set(b.get("simd") or []))
    s += 0.1 * (_ratio(a.get("cores"), b.get("cores")) + _ratio(a.get("bandwidth_gbps"), b.get("bandwidth_gbps"))
                + _ratio(a.get("peak_f32_gflops"), b.get("peak_f32_gflops")))
    return round(min(s, 0.95), 4)


# ---- models -------------------------------------------------------------------------------------

def family_of(source: Any) -> str:
    """The architecture family: a transformers config's `model_type` (bert, gpt2, ...), else the
    class name of the user's module, else the model's name (ONNX files)."""
    bundle = getattr(source, "bundle", source)
    raw = getattr(bundle, "raw_module", None)
    raw = getattr(source, "module", None) if raw is None else raw      # `is None`: a module may define __len__
    cfg = getattr(raw, "config", None)
    mtype = getattr(cfg, "model_type", None)
    if isinstance(mtype, str) and mtype:
        return mtype.lower()
    if raw is not None and type(raw).__name__ not in ("OutputFlattener",):
        return type(raw).__name__.lower()
    return str(getattr(source, "name", "model")).lower()


def model_of(graph: Any, source: Any, inputs: dict[str, Any]) -> dict[str, Any]:
    """A captured model as a `models` row. `graph` is the IR before passes (None for an eager-only
    deployment: then the module's parameters give the shapes and the histogram is empty);
    `inputs` is {name: [dtype, shape]} from the recipe."""
    if graph is not None:
        hist = dict(sorted(graph.op_counts().items()))
        tensors = [t for n, t in graph.constants.items() if graph.values[n].role == "param"]
    else:
        module = getattr(source, "module", None)
        hist = {}
        tensors = list(module.parameters()) if module is not None else []
    params = int(sum(t.numel() for t in tensors))
    shapes = Counter(tuple(int(x) for x in t.shape) for t in tensors if t.dim() >= 2)
    layer_shapes = [[list(s), c] for s, c in sorted(shapes.items(), key=lambda kv: (-math.prod(kv[0]), kv[0]))]
    layer_shapes = layer_shapes[:MAX_LAYER_SHAPES]
    family = family_of(source)
    ident = {"family": family, "params": params, "ops": hist, "shapes": layer_shapes, "inputs": inputs}
    return {"fingerprint": digest(ident), "name": str(getattr(source, "name", family)), "family": family,
            "params": params, "op_histogram": hist, "layer_shapes": layer_shapes, "inputs": inputs,
            "created": _now()}


def _cosine_distance(a: dict[str, int], b: dict[str, int]) -> float:
    keys = set(a) | set(b)
    if not keys:
        return 0.0
    dot = sum(a.get(k, 0) * b.get(k, 0) for k in keys)
    na = math.sqrt(sum(v * v for v in a.values()))
    nb = math.sqrt(sum(v * v for v in b.values()))
    return 1.0 - dot / (na * nb) if na and nb else 1.0


def model_distance(a: dict[str, Any], b: dict[str, Any]) -> float:
    """0 for the same fingerprint; else the sum of: another family (1.0), the cosine distance of
    the op histograms (0..1), |log10| of the parameter-count ratio (x0.5, at most 1), the
    Jaccard distance of the weight-shape sets (x0.5) and different input names or dtypes (0.5,
    since a recipe names its inputs)."""
    if a["fingerprint"] == b["fingerprint"]:
        return 0.0
    d = 1.0 * (a["family"] != b["family"])
    d += _cosine_distance(a["op_histogram"], b["op_histogram"])
    if a["params"] and b["params"]:
        d += min(1.0, 0.5 * abs(math.log10(a["params"] / b["params"])))
    else:
        d += 0.5
    sa = {json.dumps(s) for s, _ in a["layer_shapes"]}
    sb = {json.dumps(s) for s, _ in b["layer_shapes"]}
    d += 0.5 * (1.0 - _jaccard(sa, sb))
    ia = {k: v[0] for k, v in a["inputs"].items()}
    ib = {k: v[0] for k, v in b["inputs"].items()}
    d += 0.5 * (ia != ib)
    return round(d, 4) + 0.0           # (+ 0.0: never -0, which a recipe comment printed as "distance -0")


def recipe_inputs(recipe: Any) -> dict[str, Any]:
    """{input: [dtype, shape]} with symbolic dims as "*": what a model takes, whatever a recipe
    calls its dims."""
    return {i.name: [i.dtype, [d if isinstance(d, int) else "*" for d in i.shape]] for i in recipe.inputs}


def _now() -> float:
    return time.time()
