"""Declarations of every pass: what it requires, provides and invalidates, and the model
of its options.

This is data, not code, so the recipe layer can check a pass order and embed a pass's
options without importing the passes themselves (nor torch). A property a pass *requires*
must be provided by an earlier pass and not invalidated in between. `memory_plan` must come
last: every pass that rewrites the graph invalidates it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from graphmode.passes.options import (ConstantFoldOptions, CseOptions, FuseOptions, MemoryPlanOptions, PagedOptions,
                                      PassOptions, PrecisionOptions, QuantizeWeightsOptions, ShardOptions)


@dataclass(frozen=True)
class PassInfo:
    name: str
    summary: str
    requires: frozenset[str] = field(default_factory=frozenset)
    provides: frozenset[str] = field(default_factory=frozenset)
    invalidates: frozenset[str] = field(default_factory=frozenset)
    options: type[PassOptions] | None = None   # None: the pass takes no options
    options_at: str = ""                       # where a recipe sets them ("" = only via PassContext)
    not_after: dict[str, str] = field(default_factory=dict)    # pass -> why this one finds nothing after it


def _info(name, summary, requires=(), provides=(), invalidates=("memory_planned",), options=None, options_at="",
          not_after=None):
    return PassInfo(name, summary, frozenset(requires), frozenset(provides), frozenset(invalidates), options,
                    options_at, dict(not_after or {}))


PASS_INFOS: dict[str, PassInfo] = {p.name: p for p in [
    # first, on the graph as captured: it finds each layer's K/V before the grouped-query repeat
    # that canonicalize would merge, and the sdpa nodes that fuse would fold into regions
    _info("to_paged", "a causal LM onto a paged KV cache: sdpa -> paged_attention over the pool, the head at "
          "each sequence's last position (decoding)", provides=("paged",), invalidates=("memory_planned", "canonical"),
          options=PagedOptions, options_at="memory.kv_cache"),
    _info("canonicalize", "remove identity/no-op reshapes and casts, merge transpose and reshape chains",
          provides=("canonical",)),
    _info("precision", "run float ops in the recipe's compute dtype (per-op overrides); outputs keep their dtype",
          provides=("precision",), options=PrecisionOptions),
    _info("constant_fold", "evaluate constant subgraphs; fold batch-norm into conv/linear; pre-transpose weights",
          provides=("folded",), options=ConstantFoldOptions),
    _info("shard", "split the graph for one rank of a tensor-parallel group: column- then row-parallel linears, "
          "heads across ranks, vocab-parallel embedding and LM head, or the batch; inserts the collectives",
          provides=("sharded",), options=ShardOptions, options_at="parallel"),
    _info("merge_linears", "linears that read the same input over constant weights (q/k/v, gate/up) become one "
          "GEMM over the concatenated weight (and bias), its output sliced back", provides=("linears_merged",),
          not_after={"quantize_weights": "its qlinears are no longer linears to merge",
                     "fuse": "it finds no linear inside a fused region"}),
    # its weights must be constants: before constant_fold a captured addmm's weight is a transpose
    _info("quantize_weights", "store constant linear weights as bf16, int8 (per-output-channel scale) or int4 "
          "(group-wise scales), read narrow by the kernel; activations stay f32", requires=("folded",),
          provides=("weights_quantized",), options=QuantizeWeightsOptions, options_at="precision.weights",
          not_after={"fuse": "it finds no linear inside a fused region"}),
    _info("cse", "merge nodes that compute the same value", provides=("cse",), options=CseOptions),
    _info("dce", "remove nodes whose results are never used", provides=("dce",)),
    _info("layout", "eliminate transposes and pick target-preferred layouts",
          requires=("canonical",), provides=("layout",), invalidates=("memory_planned", "fused")),
    _info("fuse", "group elementwise/reduction chains, GEMM epilogues and attention blocks",
          requires=("canonical",), provides=("fused",), options=FuseOptions, options_at="optimize.fusion"),
    _info("memory_plan", "liveness over the schedule and arena offsets for every value",
          provides=("memory_planned",), invalidates=(), options=MemoryPlanOptions),
]}

# Named pipelines a recipe can refer to with `optimize.preset`.
PRESETS: dict[str, list[str]] = {
    "none": ["memory_plan"],
    # merge_linears is opt-in: on a quiet host it made a Llama's f32 decode step slower, not faster
    # (docs/decode-bound.md); `with_merged_linears` is the default with it
    "default": ["canonicalize", "precision", "constant_fold", "quantize_weights", "cse", "dce",
                "layout", "fuse", "dce", "memory_plan"],
    "no_fusion": ["canonicalize", "precision", "constant_fold", "quantize_weights", "cse", "dce", "layout", "dce",
                  "memory_plan"],
}

FINAL_REQUIREMENTS = frozenset({"memory_planned"})


def with_merged_linears(passes: list[str]) -> list[str]:
    """`passes` with merge_linears after constant_fold (before quantize_weights quantizes the
    merged weights): what `optimize.passes` lists to turn the pass on."""
    at = passes.index("constant_fold") + 1
    return passes[:at] + ["merge_linears"] + passes[at:]


def check_order(names: list[str]) -> list[tuple[int, str]]:
    """Return (index, message) for every problem in a pass list; empty means valid."""
    problems: list[tuple[int, str]] = []
    have: set[str] = set()
    for i, name in enumerate(names):
        info = PASS_INFOS.get(name)
        if info is None:
            problems.append((i, f"unknown pass {name!r}; known passes: {', '.join(sorted(PASS_INFOS))}"))
            continue
        for before, why in info.not_after.items():
            if before in names[:i]:
                problems.append((i, f"pass {name!r} after {before!r}: {why}; put {name} before {before}"))
        missing = info.requires - have
        if missing:
            providers = sorted({p.name for p in PASS_INFOS.values() if p.provides & missing})
            problems.append((i, f"pass {name!r} requires {', '.join(sorted(missing))}, "
                                f"which no earlier pass provides (or a later one invalidated); "
                                f"put {' or '.join(providers)} before it"))
        have -= info.invalidates
        have |= info.provides
    missing = FINAL_REQUIREMENTS - have
    if names and missing:
        problems.append((len(names) - 1, "the pipeline must end with 'memory_plan' "
                                         "(every rewriting pass invalidates the memory plan)"))
    return problems


def without(passes: list[str], name: str) -> list[str]:
    """`passes` less `name` and the passes that need what only it provided (quantize_weights
    needs constant_fold's folded weights): a list the recipe accepts."""
    out = [p for p in passes if p != name]
    while True:
        bad = [i for i, _ in check_order(out) if out[i] != "memory_plan"]
        if not bad:
            return out
        out.pop(bad[0])
