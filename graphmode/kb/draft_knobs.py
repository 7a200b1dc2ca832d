"""The knobs a recipe draft takes from the knowledge base: precision, fusion and kernel
selection of the nearest measured recipe, when it is near enough and keeps the model's numerics.
A knowledge base that cannot be read is skipped with a notice (the draft takes graphmode's
defaults), as verify and tune skip it, rather than refusing the draft."""
from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

MAX_KNOB_DISTANCE = 1.5        # farther knowledge-base entries say nothing about this model


def knobs_from_kb(data: dict, notes: dict, model_row: dict, hw_row: dict, kb_path: Any, objective: str) -> list:
    """Precision, fusion and kernel selection of the nearest measured recipe (if near enough)."""
    defaults = {"optimize": "graphmode's default pipeline and fusion (no knowledge-base entry near this model)",
                "precision": "f32: the numerics contract of the captured model (no knowledge-base entry near it)",
                "codegen": f"{objective}-first: time GEMM/conv kernels per shape (no knowledge-base entry near it)"}
    recs = []
    if kb_path is not None and Path(kb_path).exists():
        from graphmode.errors import GraphmodeNotice
        from graphmode.kb.recommend import recommend
        from graphmode.kb.store import KbError, KnowledgeBase
        try:
            with KnowledgeBase(kb_path) as kb:
                recs = recommend(kb, model_row, hw_row, objective)
        except KbError as e:
            warnings.warn(GraphmodeNotice(f"knowledge base {kb_path} skipped: {e.message} (fix: {e.fix}); the "
                                          "draft takes graphmode's defaults"))
            notes.update({k: v.split(" (no ")[0] + " (the knowledge base could not be read)"
                          for k, v in defaults.items()})
            return []
    near = [r for r in recs if r.model_distance <= MAX_KNOB_DISTANCE]
    if not near:
        notes.update(defaults)
        return recs
    top = near[0]
    body = top.recipe["body"]
    src = (f"from knowledge base recipe {top.recipe['hash']} ({top.recipe['name']}), nearest measured: "
           f"{top.why(objective)}")
    opt = body.get("optimize") if isinstance(body.get("optimize"), dict) else {}
    data["optimize"] = {k: v for k, v in {"preset": opt.get("preset", "default"), "passes": opt.get("passes"),
                                          "fusion": opt.get("fusion", {"enabled": True})}.items() if v is not None}
    if "passes" in data["optimize"]:
        data["optimize"].pop("preset")
    data["codegen"] = body["codegen"] if isinstance(body.get("codegen"), dict) else data["codegen"]
    for k in ("optimize", "codegen"):
        notes[k] = src
    prec = body["precision"] if isinstance(body.get("precision"), dict) else {"compute": "f32"}
    if _keeps_f32(prec):
        data["precision"], notes["precision"] = prec, src
    else:       # a draft holds the model's numerics: trading them is the user's call (an int4 entry
        data["precision"] = {"compute": "f32"}      # drafted another model's wrong greedy tokens)
        notes["precision"] = (f"f32: the numerics contract of the captured model; the nearest measured recipe "
                              f"{top.recipe['hash']} ({top.recipe['name']}) runs {_precision_text(prec)}, which "
                              "changes the answer: set precision yourself (and `graphmode verify` it) for that")
    return recs


def _keeps_f32(prec: dict) -> bool:
    """A precision section that computes what the f32 model computes (no narrow weights or casts)."""
    return (prec.get("compute", "f32") == "f32" and prec.get("weights", "f32") in ("f32", None)
            and prec.get("accumulate") in ("f32", None)
            and all(v == "f32" for v in (prec.get("overrides") or {}).values()))


def _precision_text(prec: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in prec.items() if v not in (None, {}, []))


__all__ = ["MAX_KNOB_DISTANCE", "knobs_from_kb"]
