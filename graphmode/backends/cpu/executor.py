"""CPU executor: runs an ExecutionPlan over one preallocated arena.

At load time every slot becomes a fixed tensor view into the arena and every instruction a
closure bound to those views (binding.py), so a run is one Python loop of calls: fused
groups go to generated C++ kernels (raw pointers), GEMM/conv to ATen (oneDNN/MKL) or the
generated kernel tactic selection picked, writing straight into their output slot,
everything else to native kernels, ATen `out=` variants or the reference op + copy.
"""
from __future__ import annotations

import logging
import time
from typing import Mapping

import torch

from graphmode.backends.arena import ArenaExecutable
from graphmode.backends.cpu.binding import Binder
from graphmode.backends.cpu.build import KernelBuilder
from graphmode.backends.cpu.invariance import batch_variant_steps
from graphmode.backends.cpu.tactics import report_lines, tactics_context
from graphmode.plan.execution import ExecutionPlan

log = logging.getLogger("graphmode.cpu")


class CpuExecutable(ArenaExecutable):
    """`builder`: where generated kernels (fused groups, native single ops, GEMM/conv
    candidates) are built; None = none are (ATen and the reference ops run everything).
    `tactics`: GEMM/conv tactic selection (tactics/context.py `tactics_context`: None = on
    when `builder` has a compiler, a policy name, a TacticsContext, or False = off).
    `kernel_report` says what was generated and why groups fell back, `tactics_report` what
    won per GEMM/conv shape. `memory_budget_bytes`: the recipe's memory budget, which the
    conv winners' workspace must fit in beside the weights, their prepared copies and the
    arena, as the contract monitor counts them (None: no limit)."""

    def __init__(self, plan: ExecutionPlan, constants: Mapping[str, torch.Tensor], *,
                 builder: KernelBuilder | None = None, threads: int | None = None, tactics=None,
                 memory_budget_bytes: int | None = None):
        super().__init__(plan, constants)
        self.threads = threads
        self.tactics = tactics_context(tactics, builder, threads, self.consts)
        binder = Binder(plan, self.views, self.consts, builder, self.tactics)
        self.steps, self.step_names = binder.bind()
        self.generated = binder.generated
        self.reference_groups = binder.reference_groups
        self.kernel_report = binder.report
        self.tactics_report: dict = {}
        if self.tactics is not None:
            t0 = time.perf_counter()
            self.tactics.weights.memory_left = None if memory_budget_bytes is None else (
                memory_budget_bytes - int(plan.arena_bytes)
                - sum(t.numel() * t.element_size() for t in constants.values()))
            try:
                self.tactics.finalize()
            except Exception as e:  # noqa: BLE001 - tuning is an optimisation: every step still runs ATen
                log.warning("GEMM tactic selection failed; ATen runs every GEMM: %s", e)
                self.tactics_report["error"] = str(e)
            self.tactics_report.update(self.tactics.report())
            self.tactics_report["seconds"] = round(time.perf_counter() - t0, 3)
        self.tactic_files = frozenset(self.tactics.cache.used) if self.tactics is not None else frozenset()

    def memory_report(self) -> dict[str, int]:
        """The arena, plus the winners' prepared weights (shared with other buckets' executables
        over the same constants) and conv workspaces tactic selection keeps."""
        out = super().memory_report()
        out["prepared_weights_bytes"] = int(self.tactics_report.get("packed_bytes", 0))
        out["workspace_bytes"] = int(self.tactics_report.get("workspace_bytes", 0))
        return out

    def batch_variant_steps(self) -> list[str]:
        """The steps whose rows may be other bits at another row count (invariance.py): what
        `determinism: batch_invariant` asks before it batches sequences in this plan."""
        return batch_variant_steps(self)

    def report_lines(self) -> list[str]:
        """Human lines for what tactic selection decided (the compile report prints them)."""
        return report_lines(self.tactics_report)


__all__ = ["CpuExecutable"]
