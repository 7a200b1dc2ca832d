"""The recipe change that removes a divergence `graphmode verify` found (`verify --fix`): a
change the recipe layer accepts, so applying it never trades a mismatch for a refusal."""
from __future__ import annotations

from typing import Any

from graphmode.passes.registry import without
from graphmode.verify.bisect import Divergence


def propose_fix(recipe, divergence: Divergence) -> dict[str, Any] | None:
    """A recipe change that removes the divergence: wider stored weights for a weight-only
    top-1 flip, an fp32 override for the diverging op when compute precision is reduced, a wider
    wire for a rank group (parallel.comm.dtype), else dropping the pass that introduced it."""
    compute = recipe.precision.compute
    if divergence.stage == "parallel":        # the rank group's outputs: its wire is the one recipe knob
        wider = {"int8": "bf16", "bf16": "f32"}.get(recipe.parallel.comm.dtype)
        return {"parallel": {"comm": {"dtype": wider}}} if wider else None
    if divergence.stage == "decode":          # the KV cache's rounding is the decode path's own knob
        kv = divergence.detail.get("kv")         # f16 values past 65504 need bf16's range; drift, f32's bits
        wider = "bf16" if kv == "f16" and divergence.detail.get("refused") else "f32" if kv in ("f16", "bf16") \
            else None
        return {"memory": {"kv_cache": {"dtype": wider}}} if wider else None
    if divergence.stage == "weights" or divergence.pass_name == "quantize_weights":
        wider = {"int4": "int8", "int8": "bf16"}.get(recipe.precision.weights, "f32")   # one step wider
        return {"precision": {"weights": wider}}     # (dropping the pass leaves a recipe refused)
    if divergence.op and compute != "f32":
        op = divergence.op.split("[")[0]
        if op == "fused":
            op = "softmax"
        if recipe.precision.overrides.get(op) == "f32":     # already f32 and still diverging: all of it
            return {"precision": {"compute": "f32", "overrides": {}}}
        return {"precision": {"overrides": {**dict(recipe.precision.overrides), op: "f32"}}}
    if divergence.pass_name:
        passes = without(recipe.pipeline(), divergence.pass_name)
        change: dict[str, Any] = {"optimize": {"passes": passes, "preset": None}}
        if recipe.precision.weights != "f32" and "quantize_weights" not in passes:
            change["precision"] = {"weights": "f32"}       # narrow weights need the pass the change drops
        return change
    return None
