"""Binding a plan to the CPU: every instruction's step, chosen by the lowering registry.

All kernels of one plan go into one shared library (one compiler run, cached by content):
first every instruction a generated or native kernel claims gets its source, then the
library is built, then each instruction is bound in plan order to the first thing that
runs it: its kernel (if it built), else an ATen step (op instructions), else the reference
ops. A group no generator claims, or one the compiler rejects, keeps the reference path
for that group only; the reasons are in `report["fallbacks"]`. With no C++ compiler every
group takes the reference path and the report says so once. GEMM and conv steps are
bound through the tactics context given here (None: ATen), passed on to their lowerings.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Mapping

import torch

from graphmode.backends.arena import reference_step
from graphmode.backends.cpu.abi import KernelSource
from graphmode.backends.cpu.build import KernelBuilder
from graphmode.backends.cpu.catalog import claim_fused, claim_native, op_step
from graphmode.backends.cpu.epilogue import tile_epilogue
from graphmode.backends.cpu.groups import numel, specialize
from graphmode.backends.cpu.lowering import OpCall
from graphmode.backends.cpu.tactics.steps import FusedEpilogue
from graphmode.backends.cpu.tensors import dtype_of
from graphmode.errors import BackendError
from graphmode.ir.fallback import run_fallback
from graphmode.ir.graph import Node
from graphmode.ir.interpreter import run_node
from graphmode.ir.types import DTYPES, TensorType
from graphmode.plan.execution import ExecutionPlan, Instruction

log = logging.getLogger("graphmode.cpu")


def op_call(ins: Instruction, views: Mapping[str, torch.Tensor], env: Mapping[str, int], **kw) -> OpCall:
    return OpCall(ins.op, [views[i] for i in ins.inputs], [views[o] for o in ins.outputs], ins.attrs, env,
                  ins.inputs, ins.outputs, **kw)


def plan_sources(plan: ExecutionPlan, views: Mapping[str, torch.Tensor], constants: Mapping[str, torch.Tensor],
                 report: dict) -> tuple[dict[int, KernelSource], dict[int, Node]]:
    """node_index -> the kernel of each instruction a native or generated lowering claims,
    and node_index -> each fused node at the plan's bucket. Groups no generator claims go
    to `report["fallbacks"]` with the reason (an op no native kernel claims is no fallback:
    ATen runs it)."""
    sources: dict[int, KernelSource] = {}
    special: dict[int, Node] = {}
    for ins in plan.instructions:
        if ins.kind == "kernel":
            node = special[ins.node_index] = specialize(plan.body_graphs[ins.node_index], plan.env)
            _low, c = claim_fused(node, _types(node, views), constants)
            if not c:
                report["fallbacks"][f"%{node.outputs[0]}"] = c.why
                continue
        elif ins.kind in ("view", "fallback"):
            continue
        else:
            _low, c = claim_native(op_call(ins, views, plan.env))
            if not c:
                continue
        try:
            sources[ins.node_index] = c.make()
        except BackendError as e:   # a generator bug (it claimed what it cannot write): contained like a
            log.warning("kernel generation failed after its claim: %s", e.message)   # compiler rejection
            report["fallbacks"][f"%{ins.outputs[0]}"] = e.message
    return sources, special


def _types(node: Node, views: Mapping[str, torch.Tensor]) -> dict[str, TensorType]:
    types = {o: TensorType(dtype_of(views[o]), tuple(views[o].shape)) for o in node.outputs}
    types.update({i: node.body.values[i].type if i in node.body.values else
                  TensorType(dtype_of(views[i]), tuple(views[i].shape)) for i in node.inputs})
    return types


class Binder:
    """Binds the steps of `plan` over `views` (its slots) and `constants`. `builder`: where
    generated kernels are built (None: none are); `tactics`: the tactics context of the
    executable (None: ATen runs every GEMM/conv)."""

    def __init__(self, plan: ExecutionPlan, views: Mapping[str, torch.Tensor], constants: Mapping[str, torch.Tensor],
                 builder: KernelBuilder | None, tactics: Any = None):
        self.plan, self.views, self.constants = plan, views, constants
        self.builder, self.tactics = builder, tactics
        self.report: dict = {"generated": 0, "fallbacks": {}, "scratch_bytes": 0}
        self.generated = 0
        self.reference_groups: set[int] = set()    # fused groups run by their reference ops (node indices)
        self._special: dict[int, Node] = {}     # node_index -> the fused node at this bucket
        self._read = {i for x in plan.instructions for i in x.inputs} | set(plan.outputs)

    def bind(self) -> tuple[list[Callable[[], None]], list[str]]:
        """The plan's steps and their names (`kind:op`), one per instruction that is not a view."""
        sources = self._sources()
        kernels = self.builder.build_many(list(sources.values()), strict=False) if sources else {}
        steps, names = [], []
        for ins in self.plan.instructions:
            if ins.kind == "view":
                continue
            ks = sources.get(ins.node_index)
            kernel = kernels.get(ks.symbol) if ks is not None else None
            if ks is not None and kernel is None:
                self.report["fallbacks"][f"%{ks.outputs[0]}"] = self.builder.failures.get(ks.symbol, "not built")
            step, kind = self._step(ins, ks if kernel is not None else None, kernel)
            steps.append(step)
            names.append(f"{kind}:{ins.op}")
        return steps, names

    # ---- sources ---------------------------------------------------------------------------

    def _sources(self) -> dict[int, KernelSource]:
        if self.builder is None:
            return {}
        if not self.builder.compiler_available():
            self.report["fallbacks"]["*"] = f"no C++ compiler: {self.builder.unavailable_reason}"
            return {}
        sources, self._special = plan_sources(self.plan, self.views, self.constants, self.report)
        return sources

    # ---- steps -----------------------------------------------------------------------------
    def _step(self, ins: Instruction, ks: KernelSource | None, kernel) -> tuple[Callable[[], None], str]:
        v, env = self.views, self.plan.env
        ins_t, outs = [v[i] for i in ins.inputs], [v[o] for o in ins.outputs]
        unread = frozenset(o for o in ins.outputs if o not in self._read) if len(ins.outputs) > 1 else frozenset()
        if ins.kind == "kernel":
            if kernel is not None:
                self.generated += 1
                self.report["generated"] += 1
                return self._bind_group(ks, kernel, self._special[ins.node_index]), "kernel"
            node = self.plan.body_graphs.get(ins.node_index)
            if node is None:
                raise BackendError(f"fused instruction #{ins.node_index} has no body", fix="recompile the plan")
            self.reference_groups.add(ins.node_index)
            return reference_step(lambda: run_node(node, ins_t, env), outs), "kernel"
        if ins.kind == "fallback":
            return reference_step(lambda: run_fallback(ins_t, ins.attrs, env),
                                  [None if o in unread else t for o, t in zip(ins.outputs, outs)]), "fallback"
        if kernel is not None:     # a generated kernel for this single op (a native lowering)
            self.generated += 1
            self.report["native"] = self.report.get("native", 0) + 1
            return kernel.bind([v[a].data_ptr() for a in ks.args]), "native"
        return op_step(op_call(ins, v, env, tactics=self.tactics, unread=unread)), "aten"

    def _bind_group(self, ks: KernelSource, kernel, node: Node) -> Callable[[], None]:
        """A generated group kernel bound to its buffers; for a gemm_epilogue group, the GEMM
        step (tactics) first, which may take the epilogue into its own store."""
        views, env = self.views, self.plan.env
        if ks.gemm is None:
            return kernel.bind([views[a].data_ptr() for a in ks.args])
        buffers = dict(views)
        g = ks.gemm
        gemm_out, out = g.outputs[0], node.outputs[0]
        out_view = views[out]
        gemm_ty = node.body.values[gemm_out].type.specialize(env)
        operands = set(g.inputs)
        # the output buffer may already hold an epilogue operand (in-place residual add):
        # then the GEMM needs its own scratch buffer, or it would overwrite that operand first
        shares_operand = any(views[i].data_ptr() == out_view.data_ptr() for i in node.inputs
                             if i not in operands and i in views)
        viewed = ks.inputs[0]          # the GEMM's buffer as the epilogue reads it (a reshape of it: a view)
        if (viewed in ks.may_alias.get(out, ()) and not shares_operand
                and out_view.numel() == numel(gemm_ty) and out_view.dtype == DTYPES[gemm_ty.dtype]):
            buf = out_view.view(gemm_ty.concrete(env))
        else:
            buf = torch.empty(gemm_ty.concrete(env), dtype=DTYPES[gemm_ty.dtype])
            self.report["scratch_bytes"] += buf.numel() * buf.element_size()
        buffers[gemm_out] = buffers[viewed] = buf
        gemm_in = [views[i].view(node.body.values[i].type.concrete(env)) if i in node.body.values
                   else views[i] for i in g.inputs]
        run = kernel.bind([buffers[a].data_ptr() for a in ks.args])
        keep = [buffers[a] for a in ks.args]   # scratch buffers live as long as the step
        gemm_step = op_step(OpCall(g.op, gemm_in, [buf], g.attrs, env, tactics=self.tactics,
                                   epilogue=self._fused_epilogue(node, run)))
        if getattr(gemm_step, "fused_epilogue", False):
            self.report["fused_epilogues"] = self.report.get("fused_epilogues", 0) + 1
            return gemm_step     # its ATen default (and so its scratch buffer) lives on the step

        def step(_keep=keep) -> None:
            gemm_step()
            run()
        return step

    def _fused_epilogue(self, node: Node, run: Callable[[], None]) -> FusedEpilogue | None:
        """The group's epilogue offered to its GEMM/conv step, or None when it is not one a
        generated GEMM can apply at its store (epilogue.py). `run` is the group's own
        epilogue kernel, which the step's ATen path runs after its GEMM."""
        views = self.views
        types = {v: TensorType(dtype_of(views[v]), tuple(views[v].shape)) for v in node.inputs if v in views}
        epi = tile_epilogue(node, types, constants=self.constants)
        if epi is None or epi.result not in views or any(o not in views for o in epi.operands):
            return None
        return FusedEpilogue(epi, [views[o] for o in epi.operands], views[epi.result], run)


__all__ = ["Binder", "plan_sources", "op_call"]
