"""Arithmetic work per node, for the cost model, the roofline and the compile report."""
from __future__ import annotations

import math

from graphmode.ir.ops.spec import OPS


def flops_of(op: str, in_shapes: list[tuple[int, ...]], out_shapes: list[tuple[int, ...]], attrs=None) -> float:
    """Arithmetic work of one node with concrete shapes (multiply-add = 2 FLOPs)."""
    spec = OPS[op]
    out_n = math.prod(out_shapes[0]) if out_shapes else 0
    if spec.kind == "gemm":
        k = in_shapes[0][-1] if in_shapes and in_shapes[0] else 1     # einsum of 0-d operands
        return 2.0 * out_n * k
    if spec.kind == "conv":
        w = in_shapes[1]
        return 2.0 * out_n * w[1] * w[2] * w[3]
    if spec.kind == "attention":
        q, k = in_shapes[0], in_shapes[1]
        if (attrs or {}).get("layout") == "bshd":     # [batch, seq, heads, dim]
            q, k = (q[0], q[2], q[1], q[3]), (k[0], k[2], k[1], k[3])
        lq, lk, d = q[-2], k[-2], q[-1]
        batch = math.prod(q[:-2])
        return 4.0 * batch * lq * lk * d + 5.0 * batch * lq * lk
    if spec.kind in ("shape", "data", "collective"):      # communication: graphmode/recipe/parallel_cost.py
        return 0.0
    if spec.kind in ("reduction", "norm"):
        return spec.flops_per_elem * math.prod(in_shapes[0])
    return spec.flops_per_elem * out_n
