"""C++ for fused groups: the claim check and the entry point of the group generators.

Three generators, chosen by what the group holds:

- elementwise bodies (emit.py): one loop nest per distinct output shape;
- reduction/norm bodies (exactly one op with the `row_reduction` trait, over the last dim,
  of those rowwise.py writes): a row kernel with the elementwise prologue and epilogue ops
  inside its passes;
- gemm_epilogue bodies: only the ops after the GEMM, as an elementwise (or row) kernel that
  reads the GEMM output buffer (which may be the output buffer itself).

`claim_group` is the GENERATED lowering for fused groups: it checks everything the
generators need (ops, dtypes, shapes, how values broadcast) and refuses with the reason
(the executor then runs the group with the reference ops) before any C is written.
The generated text contains no value names, so identical groups (the same op chain in
every layer) produce the same symbol and are compiled once.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import torch

from graphmode.backends.cpu.abi import KernelSource, kernel_source
from graphmode.backends.cpu.cexpr import CTYPE, ELEMENTWISE_OPS
from graphmode.backends.cpu.emit import PAR_THRESHOLD, ElementwiseGen, Partial, elementwise_refusal
from graphmode.backends.cpu.groups import (GEMM_OPS, ROW_REDUCTIONS, Body, concrete_types, gemm_epilogue_refusal,
                                           group_where, needed_nodes, scalar_of, split_gemm_epilogue)
from graphmode.backends.cpu.lowering import GENERATED, Claim, claimed, lowers, refused
from graphmode.backends.cpu.rowwise import ROW_KERNELS, RowGen, row_plan
from graphmode.errors import BackendError
from graphmode.ir.graph import Node
from graphmode.ir.ops import OPS
from graphmode.ir.types import TensorType

MAX_EMBED = 1 << 16         # body constants up to this many elements are embedded in the source
DEFAULT_FIX = "the executor runs this group with the reference ops"
GENERATED_OPS = ELEMENTWISE_OPS | frozenset(ROW_KERNELS)    # every op some group generator writes


@lowers("fused", tier=GENERATED)
def claim_group(node: Node, types: Mapping[str, TensorType], constants: Mapping[str, torch.Tensor] | None = None
                ) -> Claim:
    """Whether a generator writes fused group `node` at the concrete shapes `types` (its
    inputs', and any other value's); `make()` then returns its KernelSource. `constants` may
    give the data of constant inputs: those with one element are inlined as literals (so
    `pow(x, 3)` becomes `x*x*x`) and dropped from the arguments."""
    where = group_where(node)
    if node.op != "fused" or node.body is None:
        return refused(f"expected a fused node, got {node.op!r}", value=node.op)
    kind = node.attrs.get("kind", "elementwise")
    if kind == "attention":
        return refused("attention groups are not generated (sdpa runs with ATen)", value=kind)
    vt = concrete_types(node, types)
    if isinstance(vt, Claim):
        return vt
    constants = constants or {}
    known: dict[str, float | int | bool] = {}
    arrays: dict[str, torch.Tensor] = {}
    for name, t in node.body.constants.items():
        if t.numel() == 1:
            known[name] = scalar_of(t)
        elif t.numel() <= MAX_EMBED:
            arrays[name] = t.detach().contiguous().cpu()
        else:
            return refused(f"body constant %{name} has {t.numel()} elements (> {MAX_EMBED})",
                           fix="make it an input of the fused node")
    for name in node.inputs:
        t = constants.get(name)
        if t is not None and t.numel() == 1:
            known[name] = scalar_of(t)

    gemm = None
    if kind == "gemm_epilogue":
        why = gemm_epilogue_refusal(node)
        if why is not None:
            return why
        gemm, nodes = split_gemm_epilogue(node)
        g_out, nodes = _viewed_gemm_result(gemm.outputs[0], nodes, node.outputs)
        if not nodes:
            return refused("gemm_epilogue group has no epilogue ops", fix="run the GEMM alone (nothing to generate)")
        inputs = [g_out] + list(node.inputs)
        outputs = [o for o in node.outputs if o != g_out]
        if not outputs:
            return refused("the epilogue produces no output of the group")
    else:
        nodes = list(node.body.nodes)
        inputs = list(node.inputs)
        outputs = list(node.outputs)
    for o in outputs:
        if o in inputs:
            return refused(f"output %{o} is also an input of the group")
    body = Body(where, inputs, outputs, nodes, vt, known, arrays)
    why = _ops_refusal(body)
    if why is not None:
        return why
    reds = [n for n in needed_nodes(body, outputs) if n.op in ROW_REDUCTIONS]
    if len(reds) > 1:
        return refused(f"{len(reds)} reductions in one group ({', '.join(n.op for n in reds)})", value=reds[1].op,
                       fix="split the group: one reduction per row kernel")
    if reds:
        plan = row_plan(body, reds[0])
        if isinstance(plan, Claim):
            return plan
        run = RowGen(body, plan).run
    else:
        why = elementwise_refusal(body)
        if why is not None:
            return why
        run = ElementwiseGen(body).run
    folded = tuple(n for n in node.inputs if n in known)
    pattern = node.attrs.get("pattern", "") or kind

    def make() -> KernelSource:
        p = run()
        if gemm is not None and gemm.outputs[0] in node.outputs:   # the GEMM result is kept: never overwrite it
            p.may_alias = {o: tuple(i for i in v if i != gemm.outputs[0]) for o, v in p.may_alias.items()}
        return _finish(p, gemm, folded, pattern)
    return claimed(make)


def generate(node: Node, types: Mapping[str, TensorType], *,
             constants: Mapping[str, torch.Tensor] | None = None) -> KernelSource:
    """C++ for one fused group at concrete shapes (see `claim_group`); a group no generator
    writes raises BackendError with the reason."""
    c = claim_group(node, types, constants)
    if not c:
        raise BackendError(c.why, where=group_where(node), value=c.value, fix=c.fix or DEFAULT_FIX)
    return c.make()


def _viewed_gemm_result(g_out: str, nodes: list[Node], outputs: Sequence[str]) -> tuple[str, list[Node]]:
    """A reshape of the GEMM's result that opens the epilogue is a view of its contiguous buffer
    (the ABI's inputs[0]): the epilogue reads that buffer at the reshaped shape. A Conv1d arrives
    as a 1xW conv2d then a reshape dropping the unit dim; the reshape made its GELU epilogue,
    and with it the conv, run op by op in the reference interpreter (10x ONNX Runtime's time)."""
    while nodes and nodes[0].op == "reshape" and nodes[0].inputs[0] == g_out and nodes[0].outputs[0] not in outputs \
            and not any(g_out in n.inputs for n in nodes[1:]) and g_out not in outputs:
        g_out, nodes = nodes[0].outputs[0], nodes[1:]
    return g_out, nodes


def _ops_refusal(body: Body) -> Claim | None:
    for n in body.nodes:
        if n.op in ELEMENTWISE_OPS or n.op in ROW_REDUCTIONS:
            continue
        spec = OPS.get(n.op)
        kind = spec.kind if spec else "unknown"
        return refused(f"op {n.op!r} ({kind}) is not supported by the CPU code generator", value=n.op)
    for name in set(body.inputs) | {v for n in body.nodes for v in n.inputs + n.outputs}:
        t = body.vt.get(name)
        if t is not None and t.dtype not in CTYPE:
            return refused(f"dtype {t.dtype} of %{name} is not supported (f32, f64, integers, bool)", value=t.dtype)
    return None


def _finish(p: Partial, gemm: Node | None, folded: tuple[str, ...], pattern: str) -> KernelSource:
    return kernel_source(p.kind, p.source, inputs=p.inputs, outputs=p.outputs,
                         types={n: p.types[n] for n in p.inputs + p.outputs}, kind=p.kind,
                         may_alias=p.may_alias, parallel=p.parallel, gemm=gemm, folded=folded, pattern=pattern)


__all__ = ["claim_group", "generate", "split_gemm_epilogue", "ELEMENTWISE_OPS", "GEMM_OPS", "ROW_REDUCTIONS",
           "GENERATED_OPS", "PAR_THRESHOLD", "MAX_EMBED"]
