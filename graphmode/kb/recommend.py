"""Recommend a recipe for a model on a target from what the knowledge base measured.

Candidates are (recipe, model, hardware) triples with at least one measurement that kept the
contract (`status = ok`). They are ranked by the nearest architecture first, then the same or
the most similar hardware (distances within `NEAR` of each other count as equally near), then
the objective, compared like for like: measurements count against each other only under the
same condition (the same model on the same machine, the same command, bucket or tune run, and
thread count), each recipe by its median there. A recipe measured beside others is ranked by
the geometric mean of its ratio to the best median of each condition it shares with one, before
those measured alone (ranked by their own best median). The best single number across shapes and
sources ranked a batch-1 bench above a mixed-shape tune p99, and a tuning gain that did not
repeat above the recipe it was measured against. A tune run's confirmation (the best and the
recipe as written measured again, one after the other) replaces that run's earlier numbers for
both, and a best whose gain did not repeat is not compared in that run.
"""
from __future__ import annotations

import json
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
    # the metrics of one measurement, together (the best of each metric over different measurements
    # paired a p99 with a p50 never measured with it): the median one of the condition shown
    best: dict[str, Any] = field(default_factory=dict)
    measurements: int = 0
    sources: list[str] = field(default_factory=list)
    threads: int | None = None                 # ... and that measurement's threads and source
    best_source: str | None = None
    samples: int = 0                           # measurements under the condition shown
    versus: int = 0                            # other recipes measured under it (0: measured alone)
    relative: float | None = None              # geometric mean ratio to the best median where compared
    conditions: dict[tuple, list[dict[str, Any]]] = field(default_factory=dict, repr=False)

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
        compared = (f"; {self.relative:.3g}x the best of {self.versus + 1} recipe(s) measured under the same "
                    "conditions" if self.versus and self.relative is not None else
                    "; no other recipe measured under the same conditions")
        return (f"model {self.model['name']} ({self.model['family']}) at distance {self.model_distance:g}, "
                f"hardware {self.hardware['name']} ({self.hardware.get('cpu_model') or self.hardware['kind']}) "
                f"similarity {self.hardware_similarity:g}, {metric} {shown}"
                + (f" with {threads} thread(s)" if threads else "") + (f" ({self.best_source})" if self.best_source else "")
                + f", the median of {self.samples} of its {self.measurements} measurement(s) from "
                + f"{', '.join(self.sources)}{compared}")

    def to_json(self, objective: str) -> dict[str, Any]:
        return {"recipe": {k: self.recipe[k] for k in ("hash", "name", "origin")}, "body": self.recipe["body"],
                "model": {k: self.model[k] for k in ("name", "family", "fingerprint")},
                "hardware": {k: self.hardware[k] for k in ("name", "cpu_model", "fingerprint")},
                "model_distance": self.model_distance, "hardware_similarity": self.hardware_similarity,
                "best": self.best, "threads": self.threads, "best_source": self.best_source,
                "measurements": self.measurements, "samples": self.samples, "versus": self.versus,
                "relative": self.relative, "sources": self.sources,
                "objective_value": self.objective_value(objective), "why": self.why(objective)}


METRICS = ("p50_ms", "p99_ms", "p99_over_p50", "throughput", "peak_memory_mb", "compile_s")


def _rank(m: Any, objective: str) -> tuple[float, float]:
    """A measurement's place on the objective, lower better (unmeasured last)."""
    if objective == "throughput":
        return (-(m["throughput"] or 0.0), 0.0)
    p99, p50 = m["p99_ms"], m["p50_ms"]
    return (p99 if p99 is not None else p50 if p50 is not None else math.inf, p50 if p50 is not None else math.inf)


def _condition(p: dict[str, Any]) -> tuple:
    """What must be equal for two measurements to be compared: the model, the machine, the
    command, its bucket (a tune run: the run, whose workload mixes shapes) and its threads."""
    extra = p["extra"] if isinstance(p["extra"], dict) else {}
    run = extra.get("run") if p["source"] == "tune" else None
    where = ("run", str(run)) if run else ("bucket", json.dumps(p["bucket"], sort_keys=True))
    return (p["model"], p["hardware"], p["source"], where, p["threads"])


def _evidence(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The measurements of one recipe under one condition that count: a tune run's confirmation
    (measured again beside the recipe as written) where there is one."""
    again = [r for r in rows if isinstance(r["extra"], dict) and r["extra"].get("confirmation")]
    return again or rows


def _median(rows: list[dict[str, Any]], objective: str) -> dict[str, Any]:
    """The median measurement on the objective (the lower middle of an even count)."""
    return sorted(rows, key=lambda m: _rank(m, objective))[(len(rows) - 1) // 2]


def _value(m: dict[str, Any], objective: str) -> float:
    """Items/s or ms (positive)."""
    return -_rank(m, objective)[0] if objective == "throughput" else _rank(m, objective)[0]


def _compare(recs: list[Recommendation], objective: str) -> None:
    """Each recipe's ratio to the best median of every condition it shares with another (the
    geometric mean; 1 = the best everywhere), and the condition it is shown by."""
    by: dict[tuple, list[tuple[Recommendation, dict[str, Any]]]] = {}
    for r in recs:
        for cond, rows in r.conditions.items():
            by.setdefault(cond, []).append((r, _median(rows, objective)))
    for r in recs:
        ratios, shown = [], None
        for cond, rows in r.conditions.items():
            mine = _median(rows, objective)
            peers = by[cond]
            if len(peers) > 1:
                best = _value(min((m for _, m in peers), key=lambda m: _rank(m, objective)), objective)
                own = _value(mine, objective)
                if math.isfinite(best) and math.isfinite(own) and best > 0 and own > 0:    # >= 1, 1 the best
                    ratios.append(best / own if objective == "throughput" else own / best)
            order = (-len(peers), _rank(mine, objective))
            if shown is None or order < shown[0]:
                shown = (order, cond, mine, len(peers) - 1)
        if ratios:
            r.relative = math.exp(sum(math.log(x) for x in ratios) / len(ratios))
        if shown is not None:
            _, cond, m, r.versus = shown
            r.best = {k: m[k] for k in METRICS}
            r.threads, r.best_source, r.samples = m["threads"], m["source"], len(r.conditions[cond])


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
    rows: dict[tuple[int, int, int], dict[tuple, list[dict[str, Any]]]] = {}
    denied: set[tuple] = set()          # (recipe, model, hardware, condition) a tune confirmation did not hold in
    for p in kb.rows("SELECT * FROM performance ORDER BY id"):
        if p["recipe"] not in rcs or p["model"] not in mds or p["hardware"] not in hws:
            continue         # it refers to a row skipped as damaged (said by kb.rows)
        key = (p["recipe"], p["model"], p["hardware"])
        extra = p["extra"] if isinstance(p["extra"], dict) else {}
        if extra.get("confirmation") == "best" and extra.get("held") is False:
            denied.add((*key, _condition(p)))
        if p["status"] != "ok":
            continue         # a measurement that broke the contract is no evidence
        rec = groups.get(key)
        if rec is None:
            rec = groups[key] = Recommendation(rcs[p["recipe"]], mds[p["model"]], hws[p["hardware"]],
                                               model_distance(model, mds[p["model"]]),
                                               hardware_similarity(hardware, hws[p["hardware"]]))
        rec.measurements += 1
        if p["source"] not in rec.sources:
            rec.sources.append(p["source"])
        rows.setdefault(key, {}).setdefault(_condition(p), []).append(p)
    for key, rec in groups.items():
        for cond, measured in rows[key].items():
            if (*key, cond) not in denied:
                rec.conditions[cond] = _evidence(measured)
    ranked = [r for r in groups.values() if r.conditions]
    tiers: dict[tuple[int, int], list[Recommendation]] = {}
    for r in ranked:
        tiers.setdefault((round(r.model_distance / NEAR), -round(r.hardware_similarity / NEAR)), []).append(r)
    for tier in tiers.values():
        _compare(tier, objective)

    def key(r: Recommendation) -> tuple:
        compared = r.relative is not None
        return (round(r.model_distance / NEAR), -round(r.hardware_similarity / NEAR), not compared,
                r.relative if compared else _rank(r.best, objective)[0], r.recipe["hash"])
    ranked.sort(key=key)
    return ranked if limit is None else ranked[:limit]
