"""The reference backend: every instruction with the IR's reference ops, one at a time.

It is the numeric oracle the other backends are checked against: a fused group runs its
body node by node through the interpreter, an op its `OpSpec.ref`, a fallback the captured
eager call. Nothing is generated, fused or tuned, so it is slow and exact to the
reference's definition of every op.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import torch

from graphmode.backends.arena import ArenaExecutable, reference_step
from graphmode.backends.base import Capabilities
from graphmode.errors import BackendError
from graphmode.ir.fallback import run_fallback
from graphmode.ir.interpreter import run_node
from graphmode.ir.ops import get_op
from graphmode.plan.execution import ExecutionPlan


class ReferenceExecutable(ArenaExecutable):
    def __init__(self, plan: ExecutionPlan, constants: Mapping[str, torch.Tensor]):
        super().__init__(plan, constants)
        self.generated = 0
        self.kernel_report: dict = {"generated": 0, "fallbacks": {}}
        self.tactics_report: dict = {}
        env = plan.env
        for ins in plan.instructions:
            if ins.kind == "view":
                continue
            ins_t = [self.views[i] for i in ins.inputs]
            outs = [self.views[o] for o in ins.outputs]
            if ins.kind == "kernel":
                node = plan.body_graphs.get(ins.node_index)
                if node is None:
                    raise BackendError(f"fused instruction #{ins.node_index} has no body", fix="recompile the plan")
                step = reference_step(lambda node=node, ins_t=ins_t: run_node(node, ins_t, env), outs)
            elif ins.kind == "fallback":
                step = reference_step(lambda ins_t=ins_t, a=ins.attrs: run_fallback(ins_t, a, env), outs)
            else:
                spec = get_op(ins.op)
                step = reference_step(lambda spec=spec, ins_t=ins_t, a=ins.attrs: spec.ref(ins_t, a, env), outs)
            self.steps.append(step)
            self.step_names.append(f"ref:{ins.op}")

    def report_lines(self) -> list[str]:
        return []


class ReferenceBackend:
    name = "reference"
    capabilities = Capabilities(device="cpu", executes=True, generates_kernels=False, oracle=True)

    def executable(self, plan: ExecutionPlan, constants: Mapping[str, torch.Tensor], *,
                   kernel_dir: Path | None = None, threads: int | None = None,
                   kernel_selection: Any = None, isa: str = "auto", weight_growth: float | None = None) -> ReferenceExecutable:
        return ReferenceExecutable(plan, constants)


__all__ = ["ReferenceBackend", "ReferenceExecutable"]
