"""The CPU backend: generated C++ kernels (fused groups, native single ops, tuned GEMM/conv
candidates) and ATen, over one host arena per bucket."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import torch

from graphmode.backends.base import Capabilities
from graphmode.backends.cpu.build import builder_for
from graphmode.backends.cpu.executor import CpuExecutable
from graphmode.backends.cpu.tactics import POLICIES
from graphmode.plan.execution import ExecutionPlan


class CpuBackend:
    name = "cpu"
    capabilities = Capabilities(device="cpu", executes=True, generates_kernels=True, kernel_selection=POLICIES)

    def executable(self, plan: ExecutionPlan, constants: Mapping[str, torch.Tensor], *,
                   kernel_dir: Path | None = None, threads: int | None = None,
                   kernel_selection: Any = None) -> CpuExecutable:
        """Kernels are built in (and loaded from) `kernel_dir` (default ~/.cache/graphmode/
        kernels), the tactics' timing cache lives next to it in `tactics/`."""
        builder = builder_for(kernel_dir, threads)
        seen = len(builder.events)
        exe = CpuExecutable(plan, constants, builder=builder, threads=threads, tactics=kernel_selection)
        exe.events = builder.events[seen:]
        return exe


__all__ = ["CpuBackend"]
