"""The recipe's `parallel` section (data only; no torch): tensor-parallel degree, the strategy per
layer class, the device group, the links between its devices and how tensors cross them.

    parallel:
      tensor: 2                       # ranks a model is split across
      strategy: head                  # or per layer class: {attention: head, mlp: head, embedding: replicate}
      device_group: [cpu0, cpu1]      # rank i runs on device_group[i]; at least `tensor` names
      backend: gloo                   # torch.distributed backend (gloo on CPU; nccl for a GPU backend)
      links:                          # bandwidth and latency, target-relative like any ${...} value
        loopback: {bandwidth_gbps: "${target.groups.interconnects.loopback.bandwidth_gbps}",
                   latency_us: "${target.groups.interconnects.loopback.latency_us}"}
      comm: {dtype: f32, timeout_s: 60}

Strategies: `head` splits a layer class across ranks (attention by heads, the MLP column then
row, embeddings and the LM head by vocabulary), `replicate` computes it whole on every rank,
`batch` splits the whole model by the batch dim (CNNs: every rank holds every weight and a
share of the batch). The recipe layer imports this module (schema.py), so it stays light.
"""
from __future__ import annotations

import math
import re
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator

import graphmode.recipe.symbolic as symbolic
from graphmode.targets.units import number_hint

LAYER_CLASSES = ("attention", "mlp", "embedding", "conv")
STRATEGIES = ("head", "batch", "replicate")
COMM_DTYPES = ("f32", "bf16", "int8")
BACKENDS = ("gloo", "nccl")
MAX_TENSOR = 64              # ranks of one tensor-parallel group
MAX_TIMEOUT_S = 3600.0
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:\-]*")


def _sym_number(*, gt: float | None = None, ge: float | None = None, le: float, what: str, unit: str):
    """A finite number in range, or a `${target...}` expression resolved on the target."""
    def check(v: Any) -> Any:
        if symbolic.is_symbolic(v):
            try:
                symbolic.parse(v)
            except symbolic.SymbolicError as e:
                raise ValueError(str(e)) from None
            return v.strip()
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            hint = f"; fix: {number_hint(v, unit)}" if isinstance(v, str) else ""
            raise ValueError(f"expected {what} (a finite number) or a ${{target...}} expression{hint}")
        if (gt is not None and not v > gt) or (ge is not None and not v >= ge) or v > le:
            lo = f"> {gt:g}" if gt is not None else f">= {ge:g}"
            raise ValueError(f"out of range: must be {lo} and <= {le:g}; fix: use a value in that range")
        return float(v)
    return check


def _degree(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError("expected a whole number of ranks; fix: e.g. tensor: 2")
    if not 1 <= v <= MAX_TENSOR:
        raise ValueError(f"out of range: ranks a model is split across, 1 to {MAX_TENSOR}; fix: tensor: 2 on a "
                         f"two-device group (1 runs unsplit)")
    return v


def _device(v: Any) -> str:
    if not isinstance(v, str) or not _NAME.fullmatch(v) or len(v) > 64:
        raise ValueError("expected a device name (letters, digits, _ . : -), e.g. cpu0 or cuda:1")
    return v


def _strategy(v: Any) -> Any:
    if isinstance(v, str):
        if v not in STRATEGIES:
            raise ValueError(f"unknown strategy {v!r}; one of: {', '.join(STRATEGIES)}")
        return {c: v for c in LAYER_CLASSES}
    if isinstance(v, dict):
        for k, s in v.items():
            if k not in LAYER_CLASSES:
                raise ValueError(f"unknown layer class {k!r}; classes: {', '.join(LAYER_CLASSES)}")
            if s not in STRATEGIES:
                raise ValueError(f"unknown strategy {s!r} for {k}; one of: {', '.join(STRATEGIES)}")
        batch = sorted(k for k, s in v.items() if s == "batch")
        head = sorted(k for k, s in v.items() if s == "head")
        if batch and head:
            raise ValueError(f"{', '.join(batch)} by batch but {', '.join(head)} by head: batch splits every layer "
                             "by the batch dim, so it cannot be mixed with head; fix: `strategy: batch` or `head`")
        default = "batch" if batch else "head"
        return {c: v.get(c, default) for c in LAYER_CLASSES}
    raise ValueError(f"expected a strategy ({' | '.join(STRATEGIES)}) or a mapping layer class -> strategy")


class _Part(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


Bandwidth = Annotated[Any, BeforeValidator(_sym_number(gt=0, le=1e6, what="a bandwidth in GB/s", unit="GB/s"))]
Latency = Annotated[Any, BeforeValidator(_sym_number(ge=0, le=1e7, what="a latency in microseconds", unit="us"))]
Device = Annotated[str, BeforeValidator(_device)]


class LinkSpec(_Part):
    """One link: GB/s and microseconds per message, between `devices` (default: every device of
    the group). A collective crosses the slowest link joining two ranks of the group."""
    bandwidth_gbps: Bandwidth
    latency_us: Latency = 0.0
    devices: list[Device] = []


class CommSpec(_Part):
    """How tensors cross links: `dtype` on the wire (bf16 halves the bytes, int8 packs each row
    with an f32 scale), `timeout_s` for every collective (a dead or hung rank fails the others)."""
    dtype: Literal["f32", "bf16", "int8"] = "f32"
    timeout_s: Annotated[float, BeforeValidator(_sym_number(gt=0, le=MAX_TIMEOUT_S, what="seconds", unit="s"))] = 60.0


class ParallelSpec(_Part):
    tensor: Annotated[int, BeforeValidator(_degree)]
    strategy: Annotated[dict[str, Literal["head", "batch", "replicate"]], BeforeValidator(_strategy)] = {
        c: "head" for c in LAYER_CLASSES}
    device_group: Annotated[list[Device], Field(min_length=1, max_length=4 * MAX_TENSOR)]
    backend: Literal["gloo", "nccl"] = "gloo"
    # may be left out here so that semantics names it beside the group's other problems (with the fix)
    links: Annotated[dict[Annotated[str, BeforeValidator(_device)], LinkSpec], Field(max_length=64)] = {}
    comm: CommSpec = CommSpec()

    @field_validator("device_group")
    @classmethod
    def _unique(cls, v: list[str]) -> list[str]:
        dup = sorted({d for d in v if v.count(d) > 1})
        if dup:
            raise ValueError(f"device(s) listed twice: {', '.join(dup)}; fix: one entry per rank")
        return v

    # -- derived (no recipe needed) --
    def ranks(self) -> list[str]:
        """The devices the ranks run on, rank 0 first."""
        return list(self.device_group[:self.tensor])

    def split(self) -> str:
        """'batch' (the whole model by batch), 'head' (some layer class by head) or 'replicate'."""
        vals = set(self.strategy.values())
        return "batch" if "batch" in vals else ("head" if "head" in vals else "replicate")

    def link_for(self) -> tuple[str, LinkSpec] | None:
        """The slowest link joining two ranks of the group (what a ring collective is paced by),
        or None when some pair of ranks has no link (semantics reports which)."""
        best: tuple[str, LinkSpec] | None = None
        for a, b in pairs(self.ranks()):
            joining = [(n, l) for n, l in self.links.items() if not l.devices or {a, b} <= set(l.devices)]
            if not joining:
                return None
            fast = max(joining, key=lambda nl: _num(nl[1].bandwidth_gbps))
            if best is None or _num(fast[1].bandwidth_gbps) < _num(best[1].bandwidth_gbps):
                best = fast
        if best is None:         # one rank: any link stands for "no traffic"
            best = next(iter(self.links.items()))
        return best


def pairs(devs: list[str]) -> list[tuple[str, str]]:
    return [(a, b) for i, a in enumerate(devs) for b in devs[i + 1:]]


def _num(v: Union[float, str]) -> float:
    return float(v) if not isinstance(v, str) else math.inf       # unresolved: compare as unknown


def unlinked_pair(spec: ParallelSpec) -> Optional[tuple[str, str]]:
    """A pair of ranks no link joins, or None."""
    for a, b in pairs(spec.ranks()):
        if not any(not l.devices or {a, b} <= set(l.devices) for l in spec.links.values()):
            return a, b
    return None
