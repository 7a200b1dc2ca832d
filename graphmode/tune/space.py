"""What `graphmode tune` may change in a recipe, one axis per knob, the recipe's own value first.

    dims.<d>          bucket sets of a range dim: padding bounds at or below the recipe's
                      (`max_padding`, down to exact buckets), within its bucket limit
    fusion            which fusion patterns run (all, without attention, without GEMM
                      epilogues, elementwise only, none)
    fusion.max_ops    the largest fused group
    kernel_selection  heuristic, or timing kernels per shape for the objective
    threads           intra-op threads (not a recipe field: written as a comment, recorded)
    precision         bf16 compute (f32 softmax and layer norm) where the target computes
                      bf16 and the numerics tolerance allows it

A configuration is a dict {axis name: value}; `apply` writes it into the recipe's data.
"""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from typing import Any

from graphmode.ir.ops import OPS
from graphmode.recipe.buckets import dim_range, dim_synthesis, synthesize_buckets
from graphmode.recipe.schema import FUSION_PATTERNS
from graphmode.verify.numerics import TOLERANCE

DEFAULT_MAX_BUCKETS = 32         # per dim, when the recipe sets no max_buckets
PADDING_LEVELS = (1.0, 0.5, 0.25, 0.0)    # fractions of the recipe's padding bound tried
MAX_OPS = (8, 16, 32, 64)
# bf16 compute with the ops the op table keeps in f32 (trait keep_f32: softmax, layer_norm)
LOW_PRECISION = {"compute": "bf16", "overrides": {op: "f32" for op, spec in OPS.items() if spec.has("keep_f32")}}


@dataclass
class Axis:
    name: str
    values: list[Any]                       # candidates; values[0] is the recipe's own
    notes: list[str] = field(default_factory=list)


def key_of(cfg: dict[str, Any]) -> str:
    return json.dumps(cfg, sort_keys=True, separators=(",", ":"))


def _fusion_sets(patterns: list[str]) -> list[dict[str, Any]]:
    full = [p for p in FUSION_PATTERNS if p in patterns] or list(FUSION_PATTERNS)
    out = [{"enabled": True, "patterns": full}]
    for drop in ("attention", "gemm_epilogue"):
        if drop in full and len(full) > 1:
            out.append({"enabled": True, "patterns": [p for p in full if p != drop]})
    if full != ["elementwise"]:
        out.append({"enabled": True, "patterns": ["elementwise"]})
    out.append({"enabled": False, "patterns": full})
    return out


def _dim_values(name: str, spec: Any, limit: int) -> Axis | None:
    """Bucket-set candidates of one range dim, deduplicated by the buckets they make."""
    if spec.buckets:
        return None
    lo, hi = dim_range(spec)
    if lo >= hi:
        return None
    own = dim_synthesis(spec)
    if spec.max_padding is not None:
        bound = spec.max_padding
    elif spec.max_buckets is not None:
        bound = float(own.worst_padding)
    else:
        bound = 0.0
    k = spec.max_buckets or max(limit, len(own.buckets))
    base = {"min": lo, "max": hi, **({"step": spec.step} if spec.step != 1 else {}),
            **({"exact_plans": spec.exact_plans} if spec.exact_plans is not None else {})}   # kept by every value
    own_value = dict(base, **{x: getattr(spec, x) for x in ("max_padding", "max_buckets")
                              if getattr(spec, x) is not None})
    values, seen, notes = [own_value], {tuple(own.buckets)}, []
    for frac in PADDING_LEVELS:
        p = bound if frac == 1.0 else round(bound * frac, 4)     # own bound unrounded: 1/3 as 0.3333 needs more buckets
        s = synthesize_buckets(lo, hi, max_padding=p, max_buckets=k, step=spec.step)
        if not s.feasible:
            notes.append(f"padding <= {p:.4g} needs more than {k} buckets")
            continue
        if tuple(s.buckets) in seen:
            continue
        seen.add(tuple(s.buckets))
        limit_kept = {"max_buckets": spec.max_buckets} if spec.max_buckets is not None else {}
        values.append(dict(base, max_padding=p, **limit_kept) if p > 0 else dict(base))
    return Axis(f"dims.{name}", values, notes)


def search_space(recipe: Any, target: Any, *, objective: str, tol: float, max_buckets: int | None,
                 threads: list[int]) -> list[Axis]:
    """The axes for `recipe` on `target` (cheap and broad first, kernel timing last)."""
    axes: list[Axis] = []
    prec = recipe.precision
    own_prec = {"compute": prec.compute, **({"overrides": dict(prec.overrides)} if prec.overrides else {})}
    if prec.compute == "f32":
        why = []
        if recipe.memory.kv_cache is not None:
            why.append("bf16: decoding computes in f32 (precision.weights narrows what a decoder reads)")
        elif not target.supports_dtype("bf16"):
            why.append(f"bf16: target {target.name} does not compute in bf16")
        elif tol < TOLERANCE["bf16"]:
            why.append(f"bf16: needs --tol >= {TOLERANCE['bf16']:g} (rel L2 vs eager), tolerance is {tol:g}")
        axes.append(Axis("precision", [own_prec] + ([] if why else [dict(LOW_PRECISION)]), why))
    fusion = recipe.optimize.fusion
    own_fusion = {"enabled": fusion.enabled, "patterns": list(fusion.patterns)}
    sets = [s for s in _fusion_sets(list(fusion.patterns)) if s != own_fusion]
    axes.append(Axis("fusion", [own_fusion] + sets))
    axes.append(Axis("fusion.max_ops", [fusion.max_ops] + [m for m in MAX_OPS if m != fusion.max_ops
                                                            and m >= fusion.min_ops]))
    for d, spec in recipe.dims.items():
        ax = _dim_values(d, spec, max_buckets or DEFAULT_MAX_BUCKETS)
        if ax is not None:
            axes.append(ax)
    axes.append(Axis("threads", list(dict.fromkeys(threads))))
    ks = recipe.codegen.kernel_selection
    axes.append(Axis("kernel_selection", list(dict.fromkeys([ks, "heuristic", f"{objective}_first"]))))
    return [a for a in axes if len(a.values) > 1 or a.notes]


KNOBS = ("precision", "fusion", "dims", "threads", "kernel_selection")


def select_axes(axes: list[Axis], only: list[str]) -> list[Axis]:
    """The axes `only` names (a knob covers its sub-axes: `dims` is every `dims.<d>`); all when empty."""
    from graphmode.errors import GraphmodeError
    if not only:
        return axes
    known = list(KNOBS) + [a.name for a in axes]
    bad = [o for o in only if o not in known]
    if bad:
        raise GraphmodeError(f"unknown knob(s) {bad}", where="--only", value=bad,
                             fix=f"choose from {', '.join(dict.fromkeys(known))}")
    return [a for a in axes if any(a.name == o or a.name.startswith(o + ".") for o in only)]


def baseline(axes: list[Axis]) -> dict[str, Any]:
    return {a.name: a.values[0] for a in axes}


def apply(data: dict[str, Any], cfg: dict[str, Any]) -> dict[str, Any]:
    """The recipe data with `cfg` written in (threads are not a recipe field)."""
    out = copy.deepcopy(data)
    for name, v in cfg.items():
        if name.startswith("dims."):
            out["dims"][name[len("dims."):]] = copy.deepcopy(v)
        elif name == "precision":
            out["precision"] = dict(out.get("precision") or {}, **copy.deepcopy(v))
            if "overrides" not in v:
                out["precision"].pop("overrides", None)
        elif name == "fusion":
            opt = out.setdefault("optimize", {})
            opt["fusion"] = dict(opt.get("fusion") or {}, **v)
        elif name == "fusion.max_ops":
            opt = out.setdefault("optimize", {})
            opt["fusion"] = dict(opt.get("fusion") or {}, max_ops=v)
        elif name == "kernel_selection":
            out["codegen"] = dict(out.get("codegen") or {}, kernel_selection=v)
    return out


def describe(cfg: dict[str, Any], base: dict[str, Any]) -> str:
    """The knobs `cfg` changes from `base`, short ("fusion.max_ops=8, threads=1"); "recipe as written"."""
    parts = []
    for k, v in cfg.items():
        if base.get(k) == v:
            continue
        if k == "fusion":
            v = "off" if not v["enabled"] else "+".join(v["patterns"])
        elif k == "precision":
            v = v["compute"]
        elif k.startswith("dims."):
            v = "exact" if "max_padding" not in v else f"padding<={v['max_padding']}"
        parts.append(f"{k}={v}")
    return ", ".join(parts) or "recipe as written"
