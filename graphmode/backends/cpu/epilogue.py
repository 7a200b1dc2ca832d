"""Elementwise epilogues fused into the store of a generated GEMM or convolution.

Why: a gemm_epilogue group (linear + GELU, conv + residual add + ReLU) otherwise runs the
GEMM into a buffer and then a second kernel over that whole buffer, which by then has left
L1/L2. Applied per output tile right after the micro-kernel (or per element in a conv's
output stage), the epilogue costs its arithmetic and the loads of its own operands only.

An `Epilogue` is the group's ops after the GEMM as straight-line scalar C statements over
`acc` (the GEMM/conv result at one output element) and loads of the group's other inputs,
each classified by how it broadcasts against the output:

- `full`: the output's own shape (a residual), read at the output element's flat index;
- `last`: varies along the last dim only (a per-column vector of a GEMM);
- `chan`: varies along dim 1 only (a per-channel vector of an NCHW conv);
- `scalar`: one element.

Anything else (another broadcast, a non-f32 operand, a reduction, a group whose GEMM result
is itself an output) is not expressible: `tile_epilogue` returns None and the group keeps
its separate epilogue kernel. The kernel generators substitute `{ACC}` and `{E<k>}` (the
load of operand k at the element) into `stmts`; `reference` evaluates the same ops with the
reference op table, for the tactics' numerical check.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import torch

from graphmode.backends.cpu.cexpr import CTYPE, ELEMENTWISE_OPS, CValue, lit, op_expr, op_refusal
from graphmode.backends.cpu.groups import concrete_types, gemm_epilogue_refusal, scalar_of, split_gemm_epilogue
from graphmode.backends.cpu.lowering import Claim
from graphmode.ir.graph import Node
from graphmode.ir.ops import OPS
from graphmode.ir.types import TensorType

KINDS = ("full", "last", "chan", "scalar")


@dataclass(frozen=True)
class Epilogue:
    """One fused epilogue (hashable by its code: identical groups share kernels and timings)."""

    stmts: tuple[str, ...]          # C statements; the last one assigns `res`
    kinds: tuple[str, ...]          # per operand, in argument order
    operands: tuple[str, ...] = field(compare=False)     # the group's value names, in argument order
    result: str = field(compare=False, default="")       # the group output the epilogue produces
    nodes: tuple[Node, ...] = field(compare=False, default=())
    gemm_out: str = field(compare=False, default="")
    known: tuple[tuple[str, float | int | bool], ...] = field(compare=False, default=())

    @property
    def digest(self) -> str:
        return hashlib.sha256(("\n".join(self.stmts) + "|" + ",".join(self.kinds)).encode()).hexdigest()[:16]

    @property
    def text(self) -> str:
        return "+".join(n.op for n in self.nodes) or "epilogue"

    def render(self, acc: str, loads: Sequence[str], indent: str = "") -> list[str]:
        """The statements with the result in `res`, `acc` for the GEMM value and `loads[k]`
        for operand k at the current element."""
        out = []
        for s in self.stmts:
            s = s.replace("{ACC}", acc)
            for k, ld in enumerate(loads):
                s = s.replace(f"{{E{k}}}", ld)
            out.append(indent + s)
        return out

    def reference(self, acc: torch.Tensor, operands: Sequence[torch.Tensor]) -> torch.Tensor:
        """The epilogue on torch tensors (acc in the output's shape)."""
        vals: dict[str, torch.Tensor] = {self.gemm_out: acc}
        vals.update(zip(self.operands, operands))
        for name, v in self.known:
            vals[name] = torch.tensor(v, dtype=torch.float32)
        for n in self.nodes:
            outs = OPS[n.op].ref([vals[i] for i in n.inputs], n.attrs, {})
            vals.update(zip(n.outputs, outs))
        return vals[self.result]


def _kind(t: TensorType, out: TensorType, conv: bool) -> str | None:
    shape, oshape = [int(d) for d in t.shape], [int(d) for d in out.shape]
    numel = 1
    for d in shape:
        numel *= d
    if numel == 1:
        return "scalar"
    if len(shape) > len(oshape):
        return None
    shape = [1] * (len(oshape) - len(shape)) + shape
    if shape == oshape:
        return "full"
    nonone = [i for i, d in enumerate(shape) if d != 1]
    if conv:
        return "chan" if nonone == [1] and shape[1] == oshape[1] else None
    return "last" if nonone == [len(oshape) - 1] and shape[-1] == oshape[-1] else None


def tile_epilogue(node: Node, types: Mapping[str, TensorType], *,
                  constants: Mapping[str, torch.Tensor] | None = None) -> Epilogue | None:
    """The fusable epilogue of a (specialised) gemm_epilogue group, or None (see module doc)."""
    if node.op != "fused" or node.body is None or node.attrs.get("kind") != "gemm_epilogue":
        return None
    vt = concrete_types(node, types)
    if gemm_epilogue_refusal(node) is not None or isinstance(vt, Claim):
        return None
    gemm, nodes = split_gemm_epilogue(node)
    g_out = gemm.outputs[0]
    outs = [o for o in node.outputs if o != g_out]
    if not nodes or g_out in node.outputs or len(outs) != 1:
        return None
    res = outs[0]
    conv = gemm.op == "conv2d"
    otype = vt[g_out]
    if vt[res].dtype != "f32" or otype.dtype != "f32" or tuple(vt[res].shape) != tuple(otype.shape):
        return None
    if any(n.op not in ELEMENTWISE_OPS or len(n.outputs) != 1 for n in nodes):
        return None
    known: dict[str, float | int | bool] = {}
    for name, t in node.body.constants.items():
        if t.numel() != 1:
            return None
        known[name] = scalar_of(t)
    for name in node.inputs:
        t = (constants or {}).get(name)
        if t is not None and t.numel() == 1:
            known[name] = scalar_of(t)
    produced = {o for n in nodes for o in n.outputs}
    operands: list[str] = []
    kinds: list[str] = []
    exprs: dict[str, CValue] = {g_out: CValue("{ACC}", "f32", otype)}
    for n in nodes:
        for i in n.inputs:
            if i in exprs or i in produced:
                continue
            if i in known:
                exprs[i] = CValue(lit(known[i], vt[i].dtype), vt[i].dtype, vt[i], value=known[i])
                continue
            k = _kind(vt[i], otype, conv)
            if k is None or vt[i].dtype != "f32":
                return None
            exprs[i] = CValue(f"{{E{len(operands)}}}", "f32", vt[i])
            operands.append(i)
            kinds.append(k)
    stmts: list[str] = []
    for j, n in enumerate(nodes):
        dt = vt[n.outputs[0]].dtype
        ins = [exprs[i] for i in n.inputs]
        if dt not in CTYPE or op_refusal(n, [i.ttype for i in ins], dt) is not None:
            return None
        var = f"ep{j}"
        stmts.append(f"const {CTYPE[dt]} {var} = {op_expr(n, ins, dt, 'epilogue')};")
        exprs[n.outputs[0]] = CValue(var, dt, vt[n.outputs[0]])
    if exprs[res].dtype != "f32":
        return None
    stmts.append(f"const float res = {exprs[res].expr};")
    return Epilogue(tuple(stmts), tuple(kinds), tuple(operands), res, tuple(nodes), g_out,
                    tuple(sorted(known.items())))


def gemm_load(kind: str, k: int, ncols: int) -> str:
    """Operand k at (row, col) of a [M, N] GEMM output (`row`, `col` in scope)."""
    return {"full": f"g->e{k}[row * {ncols}L + col]", "last": f"g->e{k}[col]", "scalar": f"g->e{k}[0]"}[kind]


def conv_load(kind: str, k: int) -> str:
    """Operand k at an NCHW output element (`idx` flat index, `co` channel in scope)."""
    return {"full": f"e{k}[idx]", "chan": f"e{k}[co]", "scalar": f"e{k}[0]"}[kind]


__all__ = ["Epilogue", "tile_epilogue", "gemm_load", "conv_load", "KINDS"]
