"""The CPU backend's lowering registry: who runs each plan instruction, decided by claims.

A lowering is registered for ops with `@lowers(op, ..., tier=...)` and answers one question
before anything is generated or bound: does it take this instance? Its function returns a
`Claim`: `claimed(make)` (calling `make()` builds what runs the instruction) or
`refused(why)` (the reason says what it does not cover). Tiers, tried in this order:

- `native` (op instructions): a generated single-op kernel (pool.py, movement.py,
  attention.py); `make()` returns its `KernelSource`. Needs a C++ compiler.
- `aten` (op instructions): an ATen closure writing into the output slot (aten.py);
  `make()` returns the step.
- `generated` (fused groups, by group kind): a generated kernel for the group
  (codegen.py); `make()` returns its `KernelSource`.

What no lowering claims runs with the reference op (the executor's own last resort). This
module only holds the table; catalog.py imports every module that registers into it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch

from graphmode.errors import BackendError

NATIVE, ATEN, GENERATED = "native", "aten", "generated"
TIERS = (NATIVE, ATEN, GENERATED)


@dataclass(frozen=True)
class Claim:
    """A lowering's answer for one instance: `make` when it takes it, else why not (`why`,
    with the offending `value` and a `fix` when there is one). Truthy when claimed."""

    make: Callable[[], Any] | None = None
    why: str = ""
    value: Any = None
    fix: str | None = None

    def __bool__(self) -> bool:
        return self.make is not None


def claimed(make: Callable[[], Any]) -> Claim:
    return Claim(make)


def refused(why: str, value: Any = None, fix: str | None = None) -> Claim:
    return Claim(None, why, value, fix)


@dataclass
class OpCall:
    """One op instruction as its lowerings see it: the bound buffers (fixed addresses),
    attributes, the bucket's dims and value names. `tactics` (a tactics.TacticsContext or
    None) and `epilogue` (a tactics.FusedEpilogue or None) are for the GEMM/conv lowerings:
    passed explicitly by whoever binds the step."""

    op: str
    ins: Sequence[torch.Tensor]
    outs: Sequence[torch.Tensor]
    attrs: Mapping[str, Any]
    env: Mapping[str, int]
    inputs: Sequence[str] = ()
    outputs: Sequence[str] = ()
    tactics: Any = None
    epilogue: Any = None
    unread: frozenset = frozenset()      # outputs nothing reads (a reference step need not write them)


@dataclass(frozen=True)
class Lowering:
    op: str
    tier: str
    claim: Callable[..., Claim]


_TABLE: dict[tuple[str, str], list[Lowering]] = {}     # (tier, op) -> its lowerings, in registration order


def lowers(*ops: str, tier: str) -> Callable[[Callable[..., Claim]], Callable[..., Claim]]:
    """Register the decorated claim function for `ops` in `tier` (later registrations of one
    op and tier are tried after earlier ones)."""
    if tier not in TIERS:
        raise BackendError(f"unknown lowering tier {tier!r}", where=f"@lowers{ops}", value=tier,
                           fix=f"one of {', '.join(TIERS)}")

    def deco(fn: Callable[..., Claim]) -> Callable[..., Claim]:
        for op in ops:
            _TABLE.setdefault((tier, op), []).append(Lowering(op, tier, fn))
        return fn
    return deco


def lowerings(tier: str, op: str) -> list[Lowering]:
    return list(_TABLE.get((tier, op), ()))


def ops_in(tier: str) -> frozenset[str]:
    """The ops some lowering of `tier` is registered for (`fused` for groups)."""
    return frozenset(op for t, op in _TABLE if t == tier)


def claim(tier: str, op: str, *args: Any) -> tuple[Lowering | None, Claim]:
    """The first lowering of `tier` for `op` that claims the instance `args`, with its claim;
    else (None, the last refusal, or a refusal saying no lowering is registered)."""
    last = refused(f"no {tier} lowering for {op}", value=op)
    for low in lowerings(tier, op):
        c = low.claim(*args)
        if c:
            return low, c
        last = c
    return None, last


__all__ = ["Claim", "claimed", "refused", "OpCall", "Lowering", "lowers", "lowerings", "ops_in", "claim",
           "NATIVE", "ATEN", "GENERATED", "TIERS"]
