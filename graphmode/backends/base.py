"""What the runtime asks of a backend, and what a backend says it can do.

A backend turns an ExecutionPlan into an `Executable` for one device. The runtime, the CLI
and the benchmark depend on these protocols only; which backend runs a model is a name
looked up in the registry (registry.py). Capabilities are data, read by callers and tests,
never inferred from a backend's class.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol, runtime_checkable

import torch

from graphmode.plan.execution import ExecutionPlan


@dataclass(frozen=True)
class Capabilities:
    """What a backend does. `device`: where its plans run ("cpu", "cuda"; "none" for a
    backend without hardware); `executes`: whether its executables run (the null backend's
    only plan and generate); `generates_kernels`: whether it writes kernels for fused groups
    and single ops; `kernel_selection`: the recipe's `codegen.kernel_selection` policies it
    honours (empty: it has no tactics); `oracle`: its numerics are the reference the others
    are checked against."""

    device: str
    executes: bool
    generates_kernels: bool
    kernel_selection: tuple[str, ...] = ()
    oracle: bool = False


@runtime_checkable
class Executable(Protocol):
    """One bucket's plan, bound to a device. `steps` / `step_names` (`kind:op`, one per
    instruction that is not a view), `views` (slot name -> tensor), `plan` and `lock` are
    what profiling and bisection walk; `events` lists cache damage found while building it;
    `generated`, `kernel_report` and `tactics_report` are what the compile report shows."""

    plan: ExecutionPlan
    steps: list[Callable[[], None]]
    step_names: list[str]
    views: dict[str, torch.Tensor]
    events: list[dict]
    generated: int
    kernel_report: dict
    tactics_report: dict

    def run(self, inputs: Mapping[str, torch.Tensor],
            index: Mapping[str, tuple] | None = None) -> dict[str, torch.Tensor]: ...

    def report_lines(self) -> list[str]: ...


@runtime_checkable
class Backend(Protocol):
    """Builds executables for one device. `kernel_dir`: where it caches compiled kernels
    (None: its default); `threads`: the plan's thread count; `kernel_selection`: the
    recipe's policy (None: the backend's default); `isa`: the recipe's `codegen.isa` cap on
    the code its kernels run (auto: the host's best; passed only when a recipe sets one, so
    a backend without ISA-specific code may leave it out); `weight_growth`: the recipe's
    `memory.weight_growth` cap on prepared weights (passed only to a backend whose
    capabilities say it generates kernels); `memory_budget_bytes`: the recipe's numeric
    `memory.budget_mb` (passed only to a backend that generates kernels: its tactics keep
    their workspace inside it); `schedule`: the recipe's `codegen.schedule`
    (passed only when a recipe sets one, to a backend that generates kernels); `batch_invariant`:
    the recipe's `determinism: batch_invariant` (passed, True, only to a backend with kernel
    selection): its GEMMs take kernels whose rows do not depend on the row count."""

    name: str
    capabilities: Capabilities

    def executable(self, plan: ExecutionPlan, constants: Mapping[str, torch.Tensor], *,
                   kernel_dir: Path | None = None, threads: int | None = None,
                   kernel_selection: Any = None, isa: str = "auto", weight_growth: float | None = None,
                   memory_budget_bytes: int | None = None, schedule: str = "auto") -> Executable: ...


__all__ = ["Capabilities", "Executable", "Backend"]
