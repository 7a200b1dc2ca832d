"""`validate(recipe, target, model_facts)`: the three verification layers, one report."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional

from graphmode.errors import ConstraintError, RecipeError, RecipeErrors
from graphmode.recipe.buckets import Synthesis, dim_synthesis
from graphmode.recipe.constraints import DEFAULT_TIMEOUT_MS, ConstraintModel, Proof, prove_all
from graphmode.recipe.facts import ModelFacts
from graphmode.recipe.hashing import recipe_hash
from graphmode.recipe.resolve import resolve
from graphmode.recipe.schema import Recipe
from graphmode.recipe.semantics import Environment, RequireCheck, check_semantics
from graphmode.recipe.targets import pick_target


@dataclass
class LayerResult:
    name: str                    # schema | semantics | constraints
    status: str                  # ok | failed | refuted | unproved | skipped
    seconds: float = 0.0
    summary: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "status": self.status, "seconds": round(self.seconds, 4),
                "summary": self.summary}


def memory_fix(recipe: Recipe, terms: dict[str, float], lookup_bytes: float = 0) -> str:
    """The fix for a refused memory proof: the levers that hold a tenth or more of the need,
    largest term first. `lookup_bytes`: the weights only indexed (embedding tables), which
    precision.weights does not narrow (a narrower precision is named only where it would help)."""
    weights = terms.get("weights", 0) + terms.get("prepared_weights", 0)
    groups = {"weights": weights, "kv_cache": terms.get("kv_cache", 0),
              "activations": terms.get("activations", 0) + terms.get("workspace", 0)}
    need = sum(groups.values())

    def share(x: float) -> bool:
        return bool(need) and x >= need / 10

    narrow = {"f32": "int8 or int4", "bf16": "int8 or int4", "int8": "int4"}.get(recipe.precision.weights)
    levers = {"weights": [f"store linear weights narrow (precision.weights: {narrow})"
                          if narrow and share(weights - lookup_bytes) else None,     # (and their copies)
                          f"shrink the embedding tables ({lookup_bytes / 2**20:.1f} MB: precision.weights does not "
                          "narrow a lookup table)" if share(lookup_bytes) else None,
                          f"lower memory.weight_growth ({recipe.memory.weight_growth:g}x the weights: the "
                          "kernels' prepared copies)" if share(terms.get("prepared_weights", 0)) else None],
              "kv_cache": ["shrink the KV pool (memory.kv_cache.pages, max_pages_per_seq or dtype)"],
              "activations": ["shrink the largest buckets"]}
    out = [x for g in sorted(groups, key=groups.get, reverse=True) if share(groups[g]) for x in levers[g] if x]
    return ", ".join(out + ["or raise memory.budget_mb"])


@dataclass
class ValidationReport:
    """What each layer found. `verdict`: valid | malformed | refused | unproved."""
    recipe: Recipe
    target: Any
    layers: list[LayerResult] = field(default_factory=list)
    errors: list[RecipeError] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    requires: list[RequireCheck] = field(default_factory=list)
    proofs: list[Proof] = field(default_factory=list)
    dims: dict[str, Synthesis] = field(default_factory=dict)
    model: Optional[ConstraintModel] = None
    hash: str = ""

    @property
    def verdict(self) -> str:
        if self.errors:
            return "malformed"
        if any(p.status == "refuted" for p in self.proofs):
            return "refused"
        if any(p.status == "unproved" for p in self.proofs):
            return "unproved"
        return "valid"

    @property
    def ok(self) -> bool:
        return self.verdict == "valid"

    @property
    def plans(self) -> int:
        n = 1
        for s in self.dims.values():
            n *= len(s.buckets)
        return n

    def counterexample(self) -> Optional[Proof]:
        for p in self.proofs:
            if p.status in ("refuted", "unproved"):
                return p
        return None

    def raise_for_errors(self) -> None:
        """RecipeErrors (exit 2) for field errors; ConstraintError (exit 1) when refused or unproved."""
        if self.errors:
            raise RecipeErrors(self.errors)
        bad = [p for p in self.proofs if p.status in ("refuted", "unproved")]
        if bad:
            first = bad[0]
            msg = "; ".join(f"{p.name}: {p.message}" for p in bad)
            fix = None
            if first.status == "unproved" and "no FLOP count" in first.message:
                fix = ("give the model (`recipe validate --model`: the compiled graph counts its FLOPs) or declare "
                       "model.gflops_per_item")
            elif first.status == "unproved":
                fix = "raise the proof timeout (--timeout-ms) or give fewer buckets; an unproved recipe is not loaded"
            elif first.detail.get("fix"):            # a proof that knows its own fix (the KV pages')
                fix = first.detail["fix"]
            elif first.name == "memory":
                fix = memory_fix(self.recipe, first.detail.get("terms", {}), first.detail.get("lookup_bytes", 0))
            elif first.name.startswith("sla") and first.detail.get("link"):
                fix = (f"relax the SLA, shrink the largest buckets, give the group a faster link than "
                       f"{first.detail['link']!r} (parallel.links) or a narrower parallel.comm.dtype")
            elif first.name.startswith("sla"):
                fix = "relax the SLA, shrink the largest buckets, or pick a faster target"
            raise ConstraintError(f"recipe {'refused' if first.status == 'refuted' else 'unproved'}: {msg}",
                                  counterexample=first.counterexample, where=first.name,
                                  line=self.recipe.line_of(first.name.split(".p50")[0].split(".p99")[0]), fix=fix)

    def to_dict(self) -> dict[str, Any]:
        t = self.target
        return {
            "name": self.recipe.name, "hash": self.hash, "verdict": self.verdict,
            "target": getattr(t, "name", None), "source": self.recipe.source,
            "layers": [x.to_dict() for x in self.layers],
            "errors": [e.to_dict() for e in self.errors],
            "warnings": self.warnings, "notes": self.notes,
            "requires": [r.to_dict() for r in self.requires],
            "proofs": [p.to_dict() for p in self.proofs],
            "buckets": {d: {"values": s.buckets, "worst_padding": float(s.worst_padding),
                            "worst_padding_at": s.worst_value} for d, s in self.dims.items()},
            "plans": self.plans if self.dims else None,
            "facts_source": self.model.facts_source if self.model else None,
        }


SAVED = "saved"     # validate(calibration=SAVED): the SLA predicted with the saved calibration, as compile proves it


def validate(recipe: Recipe, target: Any = None, model_facts: ModelFacts | None = None, *,
             env: Environment | None = None, timeout_ms: int = DEFAULT_TIMEOUT_MS,
             calibration: Any = None, cache_dir: Any = None) -> ValidationReport:
    """Run semantics and the Z3 proofs of a loaded recipe on `target` (default: the recipe's
    first target, else `host`). Symbolic values are resolved on the target first.

    `calibration`: a Calibration, or SAVED for the one `profile --calibrate` saved under
    `cache_dir` (a note says which the SLA was predicted with).

    Never raises for recipe problems: inspect `report.verdict` or call `report.raise_for_errors()`.
    Raises TargetError when the target cannot be found.
    """
    report = ValidationReport(recipe, None, [LayerResult("schema", "ok", 0.0, "types, ranges, known keys")])
    tgt = pick_target(recipe, target)
    report.target = tgt
    t0 = time.perf_counter()
    try:
        resolved = resolve(recipe, tgt)
    except RecipeErrors as e:
        report.errors = list(e.errors)
        report.layers.append(LayerResult("semantics", "failed", time.perf_counter() - t0,
                                         f"{len(e.errors)} value(s) do not resolve on {tgt.name!r}"))
        report.layers.append(LayerResult("constraints", "skipped", 0.0, "semantic errors"))
        report.hash = recipe_hash(recipe)
        return report
    report.recipe = resolved
    report.notes = resolved.notes
    report.hash = recipe_hash(resolved)
    sem = check_semantics(resolved, tgt, env)
    report.errors, report.warnings, report.requires = sem.errors, sem.warnings, sem.requires
    report.layers.append(LayerResult("semantics", "failed" if sem.errors else "ok", time.perf_counter() - t0,
                                     f"{len(sem.errors)} error(s), {len(sem.warnings)} warning(s)"))
    if sem.errors:
        report.layers.append(LayerResult("constraints", "skipped", 0.0, "semantic errors"))
        return report
    report.dims = {d: dim_synthesis(s) for d, s in resolved.dims.items()}
    t0 = time.perf_counter()
    note = None
    if calibration == SAVED:     # the one `graphmode profile --calibrate` saved for the target, if any
        from graphmode.targets.cost import saved_calibration
        calibration, note = saved_calibration(tgt, cache_dir) if recipe.sla is not None else (None, None)
    report.model, report.proofs = prove_all(resolved, tgt, model_facts, timeout_ms, calibration=calibration)
    if note and any(p.name.startswith("sla") for p in report.proofs):
        report.notes.append(note)
    status = {"valid": "ok", "refused": "refuted", "unproved": "unproved"}[report.verdict]
    counts = {s: sum(p.status == s for p in report.proofs) for s in ("proved", "refuted", "unproved")}
    report.layers.append(LayerResult("constraints", status, time.perf_counter() - t0,
                                     ", ".join(f"{n} {s}" for s, n in counts.items() if n)))
    return report
