"""The options of every pass, declared once as pydantic models (referenced by each pass's
declaration in registry.py). The recipe schema embeds them: `optimize.fusion` *is*
`FuseOptions`, so a recipe and a pass cannot disagree about a field or a default.

This module imports pydantic only (no torch): the recipe layer, and the serve sandbox that
validates recipes, import it. Field checks are per field; rules across fields (min_ops <=
max_ops) are the recipe's semantic layer and the pass's own check, so a recipe reports
them with their line like every other cross-field rule.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict

FUSION_PATTERNS = ("elementwise", "reduction", "gemm_epilogue", "attention")
MAX_COUNT = 2**31 - 1


def _count(v: Any) -> int:
    """An int in [1, 2**31 - 1], with the recipe's wording for a bad one."""
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError("expected an integer")
    if not 1 <= v <= MAX_COUNT:
        raise ValueError(f"out of range: must be >= 1 and <= {MAX_COUNT}; fix: use a value >= 1 and <= {MAX_COUNT}")
    return v


Count = Annotated[int, BeforeValidator(_count)]


class PassOptions(BaseModel):
    """Strict, frozen, unknown keys rejected: the same contract as a recipe section."""
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class FuseOptions(PassOptions):
    enabled: bool = True
    patterns: list[Literal[FUSION_PATTERNS]] = list(FUSION_PATTERNS)  # type: ignore[valid-type]
    min_ops: Count = 2
    max_ops: Count = 32


class ConstantFoldOptions(PassOptions):
    max_bytes: Count = 64 << 20        # larger folded results stay nodes (the weight file would balloon)
    fold_batch_norm: bool = True


class CseOptions(PassOptions):
    max_const_numel: Count = 4096     # larger constants are not compared byte for byte
    dedupe_params: bool = False


class PrecisionOptions(PassOptions):
    compute: str = "f32"
    overrides: dict[str, str] = {}


class QuantizeWeightsOptions(PassOptions):
    weights: Literal["f32", "bf16", "int8", "int4"] = "f32"
    group_size: Literal[32, 64, 128] = 32
    int4_scheme: Literal["symmetric", "asymmetric"] = "symmetric"
    int4_activations: Literal["f32", "q8"] = "f32"


class MemoryPlanOptions(PassOptions):
    reuse: bool = True
    alignment: int = 64
    alias_groups: list[list[str]] = []


class PagedOptions(PassOptions):
    """The KV pool `to_paged` puts attention on: the recipe's memory.kv_cache, `pages` the pool
    its memory proof counts. layers, kv_heads and head_dim left None are read off the graph."""
    page_size: int | None = None
    pages: int | None = None
    max_pages_per_seq: int | None = None
    layers: int | None = None
    kv_heads: int | None = None
    head_dim: int | None = None
    dtype: str = "f32"


class ShardOptions(PassOptions):
    """One rank of a tensor-parallel group (the recipe's `parallel` section, plus the rank)."""
    rank: int = 0
    world: int = 1
    strategy: dict[str, Literal["head", "batch", "replicate"]] = {}   # layer class -> strategy (head if absent)
    comm_dtype: Literal["f32", "bf16", "int8"] = "f32"
    batch_dim: str = "batch"
