"""Which steps of a CPU executable may give a row other bits in a plan with another row count.

`determinism: batch_invariant` batches decode steps only where a sequence's logits are the
same bits in a batch-b plan as in the batch-1 plan it would run alone. A step keeps that
when each output row is computed from its own input row in an order that does not depend
on M (the rows the step has) or on the other rows:

- elementwise, shape and data-movement ops: no reduction at all;
- generated group kernels (elementwise, row kernels: one row at a time, the row's length
  baked in, threads split rows, never a row; rowwise.py);
- GEMMs on generated kernels (every one sums in k order, one FMA per step: tactics
  `TacticsContext.batch_variant`), never ATen's (MKL/oneDNN choose kernels by M);
- native paged attention (one task per sequence, kv head and block of query rows, each
  row's scores, softmax and P V in a fixed order, page by page: paged.py);
- native weight-only quantized linears below `wgemm.PANEL_ROWS` rows (the dot path; from
  there the panel path sums in another order);
- ATen's layer norm, and softmax / log softmax along the last dim: its CPU kernels split
  rows over threads and reduce each row with the same vector code whatever the row count.

Anything else that reduces (ATen or reference reductions, norms, attention; a fused group
whose kernel did not build and runs its reference ops) is listed: the decode engine then
runs those batches one sequence at a time rather than lose a bit (decode/runner.py).
"""
from __future__ import annotations

import math
from typing import Any

from graphmode.backends.cpu.tactics.context import batch_variant
from graphmode.backends.cpu.wgemm import PANEL_ROWS
from graphmode.errors import IRError
from graphmode.ir.ops import get_op

ROW_LOCAL_KINDS = frozenset({"elementwise", "shape", "data"})     # no arithmetic across elements
ROW_INVARIANT_NATIVE = frozenset({"paged_attention"})
ROW_INVARIANT_ATEN = frozenset({"layer_norm", "softmax", "log_softmax"})     # over the trailing dim(s)
TACTIC_KINDS = frozenset({"gemm", "conv"})                        # GEMM/conv: the tactics context decides


def batch_variant_steps(exe: Any) -> list[str]:
    """Why `exe`'s rows may not be the same bits as in a plan with another row count: one line
    per step that may reduce in an M-dependent order (empty: none)."""
    out: list[str] = []
    instructions = [ins for ins in exe.plan.instructions if ins.kind != "view"]
    gemm_tactics = False
    for ins, name in zip(instructions, exe.step_names):
        how = name.split(":", 1)[0]
        if how == "kernel":
            if ins.node_index in exe.reference_groups:
                out.append(f"fused group #{ins.node_index} runs its reference ops (no generated kernel)")
            gemm_tactics |= _has_gemm(exe, ins)      # a gemm_epilogue group's GEMM is a tactics step
            continue
        kind = _kind(ins.op)
        if kind in ROW_LOCAL_KINDS:
            continue
        if how == "native" and ins.op in ROW_INVARIANT_NATIVE:
            continue
        if how == "native" and ins.op == "qlinear":
            rows = _rows(exe, ins)
            if rows < PANEL_ROWS:
                continue
            out.append(f"qlinear #{ins.node_index} over {rows} rows takes the panel path (another summation "
                       f"order than below {PANEL_ROWS} rows)")
            continue
        if how == "aten" and ins.op in ROW_INVARIANT_ATEN and _along_last(exe, ins):
            continue
        if how == "aten" and kind in TACTIC_KINDS:
            gemm_tactics = True
            continue
        out.append(f"{ins.op} #{ins.node_index} ({how}) may reduce in an order that depends on the row count")
    if gemm_tactics:
        if exe.tactics is None:
            out.append("GEMMs run ATen (no generated kernels: no C++ compiler, or tactics off)")
        else:
            out += batch_variant(exe.tactics)
    return out


def _kind(op: str) -> str:
    try:
        return get_op(op).kind
    except IRError:
        return "unknown"


def _has_gemm(exe: Any, ins: Any) -> bool:
    node = exe.plan.body_graphs.get(ins.node_index)
    return node is None or any(_kind(n.op) in TACTIC_KINDS for n in node.body.nodes)


def _along_last(exe: Any, ins: Any) -> bool:
    """layer_norm normalises trailing dims; softmax must run along the last one."""
    if ins.op == "layer_norm":
        return True
    dim = ins.attrs.get("dim", -1)
    return isinstance(dim, int) and dim in (-1, exe.views[ins.inputs[0]].dim() - 1)


def _rows(exe: Any, ins: Any) -> int:
    x = exe.views[ins.inputs[0]]
    return math.prod(int(d) for d in x.shape[:-1])


__all__ = ["batch_variant_steps", "ROW_LOCAL_KINDS", "ROW_INVARIANT_NATIVE", "ROW_INVARIANT_ATEN"]
