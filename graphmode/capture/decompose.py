"""Ops graphmode cannot lower that PyTorch itself writes in other ATen ops: decomposed, not refused.

The capture keeps high-level ATen (`run_decompositions(decomp_table={})`) so that linear,
layer_norm and friends reach their own kernels. An op with no graphmode lowering (tile, roll,
argsort, diff, nanmean, tensordot, a batch norm in training form, ...) would then be an eager
island in hybrid mode and a refusal in graph mode. Where torch has a decomposition for it (its
CompositeImplicitAutograd kernel or an entry of its decomposition tables), the program is
decomposed for exactly those ops and imported again, so they become graph ops.

A decomposition is kept only where it makes the import strictly better: one that fails, that
brings a size only the data decides (`repeat_interleave` with tensor repeats), or whose import
refuses (a complex intermediate) leaves the op where it was. An op the recipe excludes stays eager.
"""
from __future__ import annotations

from typing import Any, Iterable

import torch
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from graphmode.capture.export_errors import quiet_export_logs


def _table(ops: Iterable[torch._ops.OpOverload]) -> dict[torch._ops.OpOverload, Any]:
    """The decompositions torch has for `ops` (export's defaults first, then torch._decomp's)."""
    from torch._decomp import decomposition_table
    defaults = torch.export.default_decompositions()
    out = {}
    for op in ops:
        if op in defaults:
            out[op] = defaults[op]
        elif op in decomposition_table:
            out[op] = decomposition_table[op]
    return out


def _unbacked(ep) -> int:
    """How many nodes of `ep` make a value whose size only the data decides."""
    return sum(1 for n in ep.graph.nodes if free_unbacked_symbols(n.meta.get("val")))


def decomposable(ep, targets: Iterable[str]) -> dict[torch._ops.OpOverload, Any]:
    """{op: decomposition} for the ops of `ep` named in `targets` that torch can decompose."""
    names = set(targets)
    ops = {n.target for n in ep.graph.nodes
           if isinstance(n.target, torch._ops.OpOverload) and str(n.target) in names}
    return _table(ops)


def decompose(ep, table: dict[torch._ops.OpOverload, Any]):
    """`ep` with the ops of `table` decomposed, or None where that fails or makes a data-dependent size."""
    try:
        with torch.no_grad(), quiet_export_logs():
            out = ep.run_decompositions(decomp_table=dict(table))
    except Exception:  # noqa: BLE001 - a decomposition torch cannot trace leaves the op as it was
        return None
    return out if _unbacked(out) <= _unbacked(ep) else None
