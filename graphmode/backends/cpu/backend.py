"""The CPU backend: generated C++ kernels (fused groups, native single ops, tuned GEMM/conv
candidates) and ATen, over one host arena per bucket."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import torch

from graphmode.backends.base import Capabilities
from graphmode.backends.cpu.build import builder_for
from graphmode.backends.cpu.executor import CpuExecutable
from graphmode.backends.cpu.isa import cap_problem, host_simd
from graphmode.backends.cpu.tactics import POLICIES, tactics_context
from graphmode.errors import BackendError
from graphmode.targets.quota import default_threads
from graphmode.plan.execution import ExecutionPlan


class CpuBackend:
    name = "cpu"
    capabilities = Capabilities(device="cpu", executes=True, generates_kernels=True, kernel_selection=POLICIES)

    def executable(self, plan: ExecutionPlan, constants: Mapping[str, torch.Tensor], *,
                   kernel_dir: Path | None = None, threads: int | None = None,
                   kernel_selection: Any = None, isa: str = "auto", frozen: bool = False,
                   weight_growth: float | None = None, schedule: str = "auto",
                   batch_invariant: bool = False, memory_budget_bytes: int | None = None) -> CpuExecutable:
        """Kernels are built in (and loaded from) `kernel_dir` (default <cache root>/kernels,
        graphmode.paths), the tactics' timing cache lives next to it in `tactics/`; `isa` caps their
        code path (the recipe's `codegen.isa`), never above what this host runs. `frozen`: use
        the timing cache as recorded (no re-timing of noisy entries), as a loaded artifact does.
        `weight_growth`: the recipe's memory.weight_growth (None: the prepared weights are not limited).
        `threads` None: this process's CPUs capped at its container's CPU quota (targets.quota).
        `schedule`: the recipe's `codegen.schedule`, how the kernels' parallel loops hand out work (omp_loops).
        `batch_invariant`: the recipe's determinism: no GEMM tactic whose rows depend on M
        (tactics/context.py); the executable says which steps still do (`batch_variant_steps`).
        `memory_budget_bytes`: the recipe's memory.budget_mb, which bounds the conv workspace (CpuExecutable)."""
        threads = default_threads() if threads is None else threads
        why = cap_problem(isa, host_simd())
        if why is not None:
            raise BackendError(why[0], where="codegen.isa", value=isa, fix=why[1])
        builder = builder_for(kernel_dir, threads, isa, schedule)
        if kernel_selection is None or isinstance(kernel_selection, str):
            kernel_selection = tactics_context(kernel_selection, builder, threads, {}, frozen=frozen,
                                               weight_growth=weight_growth, invariant=batch_invariant)
        seen, used = len(builder.events), len(builder.used)
        exe = CpuExecutable(plan, constants, builder=builder, threads=threads, tactics=kernel_selection,
                            memory_budget_bytes=memory_budget_bytes)
        exe.events = builder.events[seen:]
        exe.libraries = list(dict.fromkeys(builder.used[used:]))   # what an artifact must carry
        exe.schedule = builder.schedule         # part of every library's key: an artifact loads under the same
        return exe


__all__ = ["CpuBackend"]
