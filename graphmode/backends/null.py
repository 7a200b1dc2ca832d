"""The null backend: plans and generates kernels, runs nothing.

It makes everything the CPU backend would decide before compiling: which lowering claims
each instruction, the C++ of every claimed fused group and single op, the reasons groups
fall back, so CI can test planning and code generation on a machine without a C++
compiler (or the hardware a plan is meant for). Its executables refuse to run.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import torch

from graphmode.backends.arena import ArenaExecutable
from graphmode.backends.base import Capabilities
from graphmode.backends.cpu.binding import plan_sources
from graphmode.errors import BackendError
from graphmode.plan.execution import ExecutionPlan


class NullExecutable(ArenaExecutable):
    """`sources`: node_index -> the KernelSource the CPU backend would compile for it;
    `step_names`: what the CPU backend would run each instruction with (`kernel` groups
    without a source run their reference ops there)."""

    def __init__(self, plan: ExecutionPlan, constants: Mapping[str, torch.Tensor]):
        super().__init__(plan, constants)
        self.kernel_report: dict = {"generated": 0, "fallbacks": {}}
        self.sources, _special = plan_sources(plan, self.views, self.consts, self.kernel_report)
        self.generated = self.kernel_report["generated"] = len(self.sources)
        self.tactics_report: dict = {}
        for ins in plan.instructions:
            if ins.kind == "view":
                continue
            kind = ins.kind if ins.kind in ("kernel", "fallback") else \
                "native" if ins.node_index in self.sources else "aten"
            self.step_names.append(f"{kind}:{ins.op}")

    def run(self, inputs: Mapping[str, torch.Tensor], index: Mapping[str, tuple] | None = None) -> dict[str, torch.Tensor]:
        raise BackendError("the null backend plans and generates kernels but runs nothing", where="backend null",
                           fix="run the model with the cpu backend (or reference, the oracle)")

    def report_lines(self) -> list[str]:
        return []


class NullBackend:
    name = "null"
    capabilities = Capabilities(device="none", executes=False, generates_kernels=True)

    def executable(self, plan: ExecutionPlan, constants: Mapping[str, torch.Tensor], *,
                   kernel_dir: Path | None = None, threads: int | None = None,
                   kernel_selection: Any = None, isa: str = "auto", weight_growth: float | None = None,
                   memory_budget_bytes: int | None = None) -> NullExecutable:
        return NullExecutable(plan, constants)


__all__ = ["NullBackend", "NullExecutable"]
