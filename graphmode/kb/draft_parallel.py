"""A draft's `parallel` section (`recipe init --tensor N`): the ranks a model is split across on
this machine, written out in full (strategy, device group, loopback link, comm), so a user no
longer pastes the section from the docs by hand. The draft above it stays the one-process
draft, proved with the compiled graph; the group's recipe is validated on the target (the
links, the per-rank memory and the SLA with communication), and each rank proves its own
shard when it compiles."""
from __future__ import annotations

import dataclasses
from typing import Any

from graphmode.errors import RecipeError

_CONV = ("conv",)
_ATTENTION = ("attention", "softmax", "sdpa", "matmul", "bmm")
_BY_HEADS = {"attention": "attention by heads", "mlp": "the MLP column then row",
             "embedding": "embeddings and the LM head by vocabulary"}


def strategy_for(graph: Any) -> tuple[str, str]:
    """(strategy, why): a CNN splits by batch (every rank holds every weight and a share of the
    batch); everything else by heads (attention by heads, the MLP column then row, embeddings
    and the LM head by vocabulary)."""
    ops = {str(getattr(n, "op", "")).lower() for n in getattr(graph, "nodes", ())}
    conv = any(c in op for op in ops for c in _CONV)
    attention = any(a in op for op in ops for a in _ATTENTION)
    if conv and not attention:
        return "batch", "a CNN (convolutions, no attention): each rank runs a share of the batch"
    return "head", "attention by heads, the MLP column then row, embeddings and the LM head by vocabulary"


def with_tensor(draft: Any, tensor: int, target: Any) -> Any:
    """`draft` with a `parallel` section for `tensor` ranks on this machine; refused (naming why)
    when the group's recipe does not validate on `target`."""
    from graphmode.recipe import load_recipe, validate
    if tensor == 1:
        return draft
    strategy, why = strategy_for(draft.graph)
    if strategy == "batch" and "batch" not in (draft.data.get("dims") or {}):
        raise RecipeError(f"--tensor {tensor}: this CNN would split by batch, and its draft has no batch dim",
                          where="--tensor", value=tensor, fix="give --dim batch=LO:HI, or leave --tensor out")
    dims = draft.data.get("dims") or {}
    if strategy == "batch":
        dims = {**dims, "batch": _split_batch(dims["batch"], tensor)}
    whole: list[str] = []
    if strategy == "head":
        strategy, whole = _whole_classes(draft.data, tensor)
        if whole:
            split = [_BY_HEADS[k] for k, v in strategy.items() if v == "head"]
            why = "; ".join(([", ".join(split)] if split else []) + whole)
    group = [f"rank{r}" for r in range(tensor)]
    loopback = "${target.groups.interconnects.loopback.%s}"
    data = {**draft.data, **({"dims": dims} if dims else {}), "parallel": {
        "tensor": tensor, "strategy": strategy, "device_group": group, "backend": "gloo",
        "links": {"loopback": {"bandwidth_gbps": loopback % "bandwidth_gbps", "latency_us": loopback % "latency_us"}},
        "comm": {"dtype": "f32", "timeout_s": 60}}}
    shown = strategy if isinstance(strategy, str) else ", ".join(f"{k} {v}" for k, v in strategy.items())
    notes = {**draft.notes, "parallel": (f"--tensor {tensor}: {tensor} rank processes on this machine, joined by "
                                         f"gloo over loopback; strategy {shown}: {why}; each rank proves its "
                                         "shard's memory when it compiles")}
    if strategy == "batch":
        notes["dims.batch"] = (notes.get("dims.batch", "").split("; ")[0] + f"; buckets the multiples of {tensor} "
                               f"up to {dims['batch']['max']}: each rank runs an equal share of the padded batch")
    recipe = load_recipe(data)
    report = validate(recipe, target)
    if report.verdict in ("malformed", "refused"):
        report.raise_for_errors()          # names the field and its fix (a link too slow for the SLA, ...)
    return dataclasses.replace(draft, data=data, notes=notes, recipe=recipe, report=report)


def _whole_classes(data: dict, tensor: int) -> tuple[Any, list[str]]:
    """("head", []) when every class splits by heads over `tensor` ranks (recipe/parallel_checks.py
    `undivided`); else a strategy map running the classes that do not whole on every rank (as
    vLLM replicates KV heads that do not split), and why, for the draft's note."""
    from graphmode.recipe import load_recipe
    from graphmode.recipe.parallel_checks import undivided
    bad = undivided(load_recipe(data), tensor)
    if not bad:
        return "head", []
    first = {cls: (f, v) for cls, f, v in reversed(bad)}      # each class's first count that does not divide
    split = {"attention": "head", "mlp": "head", "embedding": "head"} | {cls: "replicate" for cls in first}
    names = {"attention": "attention", "mlp": "the MLP"}
    return split, [f"{f} = {v} does not split over {tensor} ranks, so {names[cls]} runs whole on every rank"
                   for cls, (f, v) in first.items()]


def _split_batch(dim: dict, tensor: int) -> dict:
    """A batch dim whose buckets split evenly over the ranks: the multiples of `tensor` up to its
    max (a request of 1 runs padded to `tensor`, so padding batch must be safe)."""
    if dim.get("exact_plans") or set(dim) <= {"min", "max"} and dim["min"] < dim["max"]:    # every value a bucket
        raise RecipeError("--tensor: this CNN would split by batch, but padding its batch is unsafe (the draft gave "
                          "it exact buckets)", where="--tensor", fix="leave --tensor out, or write the parallel "
                          "section with strategy replicate")
    hi = dim["max"] // tensor * tensor
    if hi < tensor:
        raise RecipeError(f"--tensor {tensor}: batch up to {dim['max']} cannot be split over {tensor} ranks",
                          where="--tensor", value=tensor, fix=f"give --dim batch=1:{tensor * 4} or more")
    return {"min": dim["min"], "max": hi, "buckets": list(range(tensor, hi + 1, tensor))}
