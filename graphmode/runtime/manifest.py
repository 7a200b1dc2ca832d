"""The `.gm` manifest's schema: every field a load reads, bounded and typed (pydantic, strict),
and the digest over the fields that makes an edit by hand a refused file, not a traceback or
another output structure at the call (runtime/artifact.py reads and writes it)."""
from __future__ import annotations

import hashlib
import json
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

MAX_THREADS = 1024
MAX_ITEMS = 4096        # buckets, outputs, kernels, members
MAX_RANKS = 64          # parallel.tensor's bound


def _text(n: int):
    return Field(max_length=n)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class HostFacts(_Strict):
    cpu: str = _text(256)
    arch: str = _text(32)
    simd: list[str] = Field(max_length=64)


class Member(_Strict):
    bytes: int = Field(ge=0, le=1 << 40)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class OutputSpec(_Strict):
    """How the model's outputs nest (capture/outputs.py `describe`). Its class is only imported
    when it names a transformers ModelOutput (`outputs._class`); anything else loads as a dict
    (a NamedTuple as a namedtuple of its fields, torch.return_types from torch itself)."""

    t: Literal["tensor", "none", "tuple", "list", "dict", "model_output", "namedtuple", "structseq"]
    keys: Optional[list[str]] = Field(default=None, max_length=MAX_ITEMS)
    items: Optional[list["OutputSpec"]] = Field(default=None, max_length=MAX_ITEMS)
    class_: Optional[str] = Field(default=None, alias="class", max_length=512)
    key_kind: Optional[Literal["int"]] = None
    key_kinds: Optional[list[Literal["int", "str"]]] = Field(default=None, max_length=MAX_ITEMS)
    ordered: Optional[bool] = None


class ValueBound(_Strict):
    input: str = _text(256)
    lo: int
    hi: int
    model: Optional[list[int]] = Field(min_length=2, max_length=2)
    model_why: str = _text(1024)
    declared: Optional[list[int]] = Field(min_length=2, max_length=2)
    column: Optional[list[int]] = Field(default=None, min_length=2, max_length=2)     # (axis, index)


class DimBound(_Strict):
    dim: str = _text(256)
    max: int
    why: str = _text(1024)


class InputBounds(_Strict):
    """The request checks of runtime/bounds.py, as the compile derived them from the whole model."""

    values: list[ValueBound] = Field(max_length=MAX_ITEMS)
    dims: list[DimBound] = Field(max_length=MAX_ITEMS)


class DecoderFacts(_Strict):
    """A decoder's sizes (decode/lm.py `lm_config`): what its engine needs besides the graph."""

    layers: int = Field(ge=1, le=1 << 16)
    heads: Optional[int] = Field(ge=1, le=1 << 16)
    kv_heads: Optional[int] = Field(ge=1, le=1 << 16)
    head_dim: Optional[int] = Field(ge=1, le=1 << 16)
    vocab: Optional[int] = Field(ge=1, le=1 << 31)
    context: Optional[int] = Field(ge=1, le=1 << 31)
    eos: Union[int, list[int], None] = None
    pad: Optional[int] = None


class Manifest(_Strict):
    """What a manifest may hold: every field typed and bounded."""

    format: int
    graphmode: str = _text(64)
    torch: str = _text(64)
    created: str = _text(64)
    host: HostFacts
    model: str = _text(256)
    recipe_hash: str = Field(pattern=r"^[0-9a-f]{8,64}$")
    graph_hash: str = Field(pattern=r"^[0-9a-f]{8,64}$")
    target: Optional[str] = Field(pattern=r"^[^./\\\x00-\x1f][^/\\\x00-\x1f]{0,127}$")     # a target's name, not a path
    mode: Literal["graph", "hybrid"]
    device: str = Field(pattern=r"^[a-z][a-z0-9_]{0,31}$")
    isa: str = _text(32)                # one of backends.cpu.isa.CAPS (checked with the members)
    threads: Optional[int] = Field(ge=1, le=MAX_THREADS)
    buckets: list[str] = Field(min_length=1, max_length=MAX_ITEMS)
    outputs: list[str] = Field(max_length=MAX_ITEMS)
    out_spec: Optional[str] = _text(1 << 20)
    output_structure: Optional[OutputSpec] = None
    mutated_inputs: list[str] = Field(default_factory=list, max_length=MAX_ITEMS)
    positional: list[str] = Field(default_factory=list, max_length=MAX_ITEMS)   # forward's parameters, in order
    omitted: dict[str, int] = Field(default_factory=dict, max_length=MAX_ITEMS)  # optional inputs' constants
    exact_dims: list[str] = Field(max_length=MAX_ITEMS)
    masked_dims: list[str] = Field(default_factory=list, max_length=MAX_ITEMS)   # runtime/shaping.py pad_hazard
    mask_sources: Optional[list[str]] = Field(default=None, max_length=MAX_ITEMS)  # the inputs it checks
    query_key_dims: list[str] = Field(default_factory=list, max_length=MAX_ITEMS)
    kernels: list[str] = Field(max_length=MAX_ITEMS)
    files: dict[str, Member] = Field(max_length=4 * MAX_ITEMS)
    rank: Optional[int] = Field(default=None, ge=0, le=MAX_RANKS)     # a rank's shard of a tensor-parallel group
    world: Optional[int] = Field(default=None, ge=2, le=MAX_RANKS)    # (runtime/rank_artifacts.py)
    input_bounds: Optional[InputBounds] = None     # absent in artifacts saved before them: derived from the graph
    bucket_envs: Optional[list[dict[str, int]]] = Field(default=None, max_length=MAX_ITEMS)   # else the recipe's
    # the kernels' loop schedule (backends/cpu/omp_loops.py): `auto` resolves by the process's OpenMP
    # wait, and it is part of every library's key, so a load in another kind of process uses this one
    schedule: Optional[Literal["static", "dynamic", "guided", "claim"]] = None
    # the modules defining custom ops the graph's fallback nodes call (ir/fallback.py op_module)
    op_modules: list[Annotated[str, StringConstraints(max_length=256, pattern=r"^[A-Za-z_][\w.]*$")]] = \
        Field(default_factory=list, max_length=MAX_ITEMS)
    decoder: Optional[DecoderFacts] = None         # a decoder's paged graph (decode/saved.py)
    digest: str = Field(pattern=r"^[0-9a-f]{64}$")  # manifest_digest: the other fields' sha256


def manifest_digest(manifest: dict[str, Any]) -> str:
    """The sha256 of a manifest's fields but `digest`, as canonical JSON: mutated_inputs or the
    output structure edited by hand reached the call as a bare traceback or another structure."""
    body = json.dumps({k: v for k, v in manifest.items() if k != "digest"}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(body.encode()).hexdigest()
