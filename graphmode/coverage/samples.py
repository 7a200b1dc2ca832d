"""An op's sample inputs as the coverage checks use them: seeded tensors, the op as a one-op
fused group, and which CPU lowering takes each sample.

`graphmode ops --op NAME` shows these claims; tests/unit/ir/test_op_coverage.py runs the same
samples through the interpreter, the CPU executor and the generated kernels.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from graphmode.backends.cpu.catalog import claim_fused, claim_native
from graphmode.backends.cpu.lowering import ATEN, Claim, OpCall, claim
from graphmode.ir.graph import Graph, Node
from graphmode.ir.ops import OPS, Sample
from graphmode.ir.types import DTYPES, TensorType

def sample_inputs(sample: Sample, index: int) -> list[torch.Tensor]:
    """Sample `index`'s input tensors (seeded by the index: the same tensors every run)."""
    return sample.make(torch.Generator().manual_seed(index))


def group_kind(op: str) -> str:
    """The fused-group kind of a group around `op`, named as the fusion pass names them."""
    kind = OPS[op].kind
    return kind if kind in ("reduction", "norm") else "elementwise"


def one_op_group(op: str, inputs: Sequence[str], outputs: Sequence[str], attrs: Mapping[str, Any],
                 types: Mapping[str, TensorType]) -> Node:
    """`op` alone as a fused node (what the generated-kernel tier is asked to write)."""
    body = Graph(f"{op}.group")
    for name in inputs:
        if name not in body.values:
            body.add_input(name, types[name])
    for name in outputs:
        body.add_value(name, types[name])
    body.nodes = [Node(op, tuple(inputs), tuple(outputs), dict(attrs))]
    body.outputs = list(outputs)
    return Node("fused", tuple(dict.fromkeys(inputs)), tuple(outputs), {"kind": group_kind(op), "pattern": op}, body)


def cpu_claims(op: str, ins: Sequence[torch.Tensor], attrs: Mapping[str, Any]) -> dict[str, Claim]:
    """tier -> the CPU backend's answer for `op` over `ins`: a native kernel or an ATen step
    (the executor tries them in that order for an op instruction; the reference op runs what
    neither claims), and a generated kernel for the op as a one-op fused group."""
    in_types = [TensorType.of(t) for t in ins]
    out_types = OPS[op].infer(in_types, dict(attrs))
    outs = [torch.empty(t.concrete({}), dtype=DTYPES[t.dtype]) for t in out_types]
    names_in, names_out = [f"x{i}" for i in range(len(ins))], [f"y{i}" for i in range(len(outs))]
    call = OpCall(op, list(ins), outs, dict(attrs), {}, names_in, names_out)
    types = dict(zip(names_in + names_out, in_types + list(out_types)))
    group = one_op_group(op, names_in, names_out, attrs, types)
    return {"native": claim_native(call)[1], "aten": claim(ATEN, op, call)[1],
            "generated": claim_fused(group, types, {})[1]}


def runs_as(claims: Mapping[str, Claim]) -> str:
    """What runs an op instruction with these claims: `native`, `aten`, else `reference`."""
    return "native" if claims["native"] else "aten" if claims["aten"] else "reference"


__all__ = ["sample_inputs", "group_kind", "one_op_group", "cpu_claims", "runs_as"]
