"""Every lowering of the CPU backend, registered: import this to claim and bind instructions.

The modules below register their claim functions into lowering.py's table when imported;
this module imports all of them (nothing else does), so the table is complete exactly when
this module is loaded, and no generator module depends on another through the table.
"""
from __future__ import annotations

from typing import Callable

from graphmode.backends.arena import reference_step
from graphmode.backends.cpu import aten, attention, codegen, layout_kernels, movement, paged, pool, wgemm  # noqa: F401 - they register lowerings
from graphmode.backends.cpu import aten_out, group_norm, index_maps, resample  # noqa: F401 - they register lowerings
from graphmode.backends.cpu.abi import KernelSource
from graphmode.backends.cpu.lowering import ATEN, GENERATED, NATIVE, Claim, Lowering, OpCall, claim
from graphmode.backends.cpu.native import precheck
from graphmode.ir.ops import get_op


def claim_native(call: OpCall) -> tuple[Lowering | None, Claim]:
    """The native kernel lowering that takes op instruction `call`, if any (its `make()`
    returns the KernelSource)."""
    why = precheck(call)
    if why is not None:
        return None, why
    return claim(NATIVE, call.op, call)


def claim_fused(node, types, constants) -> tuple[Lowering | None, Claim]:
    """The generated-kernel lowering that takes fused group `node` at `types`, if any."""
    return claim(GENERATED, "fused", node, types, constants)


def op_step(call: OpCall) -> Callable[[], None]:
    """The step of op instruction `call` without a kernel: its ATen lowering's, else the
    reference op writing into the output slots."""
    _low, c = claim(ATEN, call.op, call)
    if c:
        return c.make()
    spec, ins, attrs, env = get_op(call.op), list(call.ins), call.attrs, call.env
    outs = [None if n in call.unread else o for n, o in zip(call.outputs, call.outs)] if call.unread else call.outs
    return reference_step(lambda: spec.ref(ins, attrs, env), list(outs))


def native_source(op: str, ins, outs, attrs, env, inputs, outputs) -> KernelSource | None:
    """The native kernel of one instruction (tensors `ins` / `outs`, value names `inputs` /
    `outputs`), or None when no native lowering claims it (ATen runs it)."""
    _low, c = claim_native(OpCall(op, list(ins), list(outs), attrs, env, list(inputs), list(outputs)))
    return c.make() if c else None


__all__ = ["claim_native", "claim_fused", "op_step", "native_source"]
