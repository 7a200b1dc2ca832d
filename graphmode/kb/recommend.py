"""Recommend a recipe for a model on a target from what the knowledge base measured.

Candidates are (recipe, model, hardware) triples with at least one measurement that kept the
contract (`status = ok`). They are ranked by the nearest architecture first, then the same or
the most similar hardware, then the objective: distances within `NEAR` of each other count as
equally near, so among recipes for equally close models on equally similar hardware the
fastest (latency: lowest p99, else p50) or the most productive (throughput) wins.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from graphmode.errors import GraphmodeError
from graphmode.kb.fingerprint import hardware_similarity, model_distance
from graphmode.kb.store import KnowledgeBase

OBJECTIVES = ("latency", "throughput")
NEAR = 0.05


@dataclass
class Recommendation:
    recipe: dict[str, Any]             # hash, name, body, origin
    model: dict[str, Any]              # the model it was measured with
    hardware: dict[str, Any]           # the hardware it was measured on
    model_distance: float
    hardware_similarity: float
    # the metrics of its best measurement on the objective, together: the best of each metric over
    # different measurements paired a p99 with a p50 never measured with it (threads 1 and 2)
    best: dict[str, Any] = field(default_factory=dict)
    measurements: int = 0
    sources: list[str] = field(default_factory=list)
    threads: int | None = None                 # ... and that measurement's threads and source
    best_source: str | None = None

    def objective_value(self, objective: str) -> float | None:
        if objective == "throughput":
            return self.best.get("throughput")
        return self.best.get("p99_ms") if self.best.get("p99_ms") is not None else self.best.get("p50_ms")

    def why(self, objective: str) -> str:
        v = self.objective_value(objective)
        metric = ("throughput" if objective == "throughput"
                  else "p99_ms" if self.best.get("p99_ms") is not None else "p50_ms")
        shown = "not measured" if v is None else f"{v:.4g}" + (" items/s" if objective == "throughput" else " ms")
        threads = self.threads
        return (f"model {self.model['name']} ({self.model['family']}) at distance {self.model_distance:g}, "
                f"hardware {self.hardware['name']} ({self.hardware.get('cpu_model') or self.hardware['kind']}) "
                f"similarity {self.hardware_similarity:g}, {metric} {shown}"
                + (f" with {threads} thread(s)" if threads else "") + (f" ({self.best_source})" if self.best_source else "")
                + f", the best of {self.measurements} measurement(s) from {', '.join(self.sources)}")

    def to_json(self, objective: str) -> dict[str, Any]:
        return {"recipe": {k: self.recipe[k] for k in ("hash", "name", "origin")}, "body": self.recipe["body"],
                "model": {k: self.model[k] for k in ("name", "family", "fingerprint")},
                "hardware": {k: self.hardware[k] for k in ("name", "cpu_model", "fingerprint")},
                "model_distance": self.model_distance, "hardware_similarity": self.hardware_similarity,
                "best": self.best, "threads": self.threads, "best_source": self.best_source,
                "measurements": self.measurements,
                "sources": self.sources,
                "objective_value": self.objective_value(objective), "why": self.why(objective)}


METRICS = ("p50_ms", "p99_ms", "p99_over_p50", "throughput", "peak_memory_mb", "compile_s")


def _rank(m: Any, objective: str) -> tuple[float, float]:
    """A measurement's place on the objective, lower better (unmeasured last)."""
    if objective == "throughput":
        return (-(m["throughput"] or 0.0), 0.0)
    p99, p50 = m["p99_ms"], m["p50_ms"]
    return (p99 if p99 is not None else p50 if p50 is not None else math.inf, p50 if p50 is not None else math.inf)


def check_objective(objective: str) -> str:
    if objective not in OBJECTIVES:
        raise GraphmodeError(f"unknown objective {objective!r}", where="--objective",
                             fix=f"one of {', '.join(OBJECTIVES)}")
    return objective


def recommend(kb: KnowledgeBase, model: dict[str, Any], hardware: dict[str, Any], objective: str = "latency",
              limit: int | None = 5) -> list[Recommendation]:
    """Ranked recommendations for `model` (a models row) on `hardware` (a hardware row)."""
    check_objective(objective)
    hws = {r["id"]: r for r in kb.rows("SELECT * FROM hardware")}
    mds = {r["id"]: r for r in kb.rows("SELECT * FROM models")}
    rcs = {r["id"]: r for r in kb.rows("SELECT * FROM recipes")}
    groups: dict[tuple[int, int, int], Recommendation] = {}
    for p in kb.rows("SELECT * FROM performance WHERE status = 'ok' ORDER BY id"):
        if p["recipe"] not in rcs or p["model"] not in mds or p["hardware"] not in hws:
            continue         # it refers to a row skipped as damaged (said by kb.rows)
        key = (p["recipe"], p["model"], p["hardware"])
        rec = groups.get(key)
        if rec is None:
            rec = groups[key] = Recommendation(rcs[p["recipe"]], mds[p["model"]], hws[p["hardware"]],
                                               model_distance(model, mds[p["model"]]),
                                               hardware_similarity(hardware, hws[p["hardware"]]))
        rec.measurements += 1
        if p["source"] not in rec.sources:
            rec.sources.append(p["source"])
        if not rec.best or _rank(p, objective) < _rank(rec.best, objective):
            rec.best = {k: p[k] for k in METRICS}
            rec.threads, rec.best_source = p["threads"], p["source"]
    sign = -1.0 if objective == "throughput" else 1.0

    def key(r: Recommendation) -> tuple:
        v = r.objective_value(objective)
        return (round(r.model_distance / NEAR), -round(r.hardware_similarity / NEAR),
                sign * v if v is not None else math.inf, r.recipe["hash"])
    ranked = sorted(groups.values(), key=key)
    return ranked if limit is None else ranked[:limit]
