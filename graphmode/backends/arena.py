"""An executable over one preallocated host arena: what every host-memory backend shares.

At load time every slot of the plan becomes a fixed tensor view into the arena (or the
constant it names), and the backend turns every instruction into a step bound to those
views, so a run is one Python loop of calls. `steps` / `step_names` / `views` / `plan` /
`lock` are what profiling (bench/profile.py) and bisection (verify/bisect.py) walk.
"""
from __future__ import annotations

import threading
from typing import Callable, Mapping

import torch

from graphmode.hostmem import empty_huge
from graphmode.ir.types import DTYPES
from graphmode.plan.execution import ExecutionPlan


class ArenaExecutable:
    """The arena, the slot views and the run loop; a backend fills `steps` and `step_names`
    (one per instruction that is not a view) and its reports."""

    def __init__(self, plan: ExecutionPlan, constants: Mapping[str, torch.Tensor]):
        self.plan = plan
        self.lock = threading.Lock()   # one arena: runs on one executable are serialised
        self.arena = torch.empty(max(plan.arena_bytes, 1), dtype=torch.uint8)
        self.consts = {k: constants[k].contiguous() for k in plan.constants if k in constants}
        self.views: dict[str, torch.Tensor] = {}
        for name, slot in plan.slots.items():
            if slot.const is not None:
                self.views[name] = self.consts[slot.const]
            else:
                raw = self.arena[slot.offset: slot.offset + slot.nbytes]
                self.views[name] = raw.view(DTYPES[slot.dtype]).view(slot.shape)
        self.steps: list[Callable[[], None]] = []
        self.step_names: list[str] = []
        self.events: list[dict] = []        # cache damage found (and repaired) while building it

    def memory_report(self) -> dict[str, int]:
        """Bytes this executable holds beyond the graph's constants."""
        return {"arena_bytes": int(self.arena.numel())}

    def run(self, inputs: Mapping[str, torch.Tensor],
            index: Mapping[str, tuple] | None = None) -> dict[str, torch.Tensor]:
        """Copy inputs into their slots, run every step, return copies of the outputs; of an
        output named in `index`, only `view[index[name]]` (a padded request's real rows: the
        padding is never copied out of the arena)."""
        index = index or {}
        with self.lock:
            with torch.inference_mode():
                for name in self.plan.inputs:
                    self.views[name].copy_(inputs[name])
                for step in self.steps:
                    step()
            # outside inference mode: the caller gets ordinary tensors, which it may update in place
            # (an inference tensor refuses that outside inference mode); none records autograd
            with torch.no_grad():
                outs = {}
                for o in self.plan.outputs:
                    v = self.views[o][index[o]] if o in index else self.views[o]
                    outs[o] = empty_huge(v.shape, v.dtype).copy_(v)
            return outs


def reference_step(compute: Callable[[], list[torch.Tensor]], outs: list[torch.Tensor]) -> Callable[[], None]:
    """A step computing its outputs with reference ops (`compute`) and copying them into
    their slots."""
    if len(outs) == 1:
        y = outs[0]
        return lambda: y.copy_(compute()[0])

    def step() -> None:
        for o, r in zip(outs, compute()):
            o.copy_(r)
    return step


__all__ = ["ArenaExecutable", "reference_step"]
