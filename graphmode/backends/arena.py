"""An executable over one preallocated host arena: what every host-memory backend shares.

At load time every slot of the plan becomes a fixed tensor view into the arena (or the
constant it names), and the backend turns every instruction into a step bound to those
views, so a run is one Python loop of calls. `steps` / `step_names` / `views` / `plan` /
`lock` are what profiling (bench/profile.py) and bisection (verify/bisect.py) walk.
"""
from __future__ import annotations

from typing import Callable, Mapping, Sequence

import torch

from graphmode.errors import BackendError, ContractViolation, GraphmodeError
from graphmode.hostmem import empty_huge
from graphmode.ir.types import DTYPES
from graphmode.openmp import ForkSafeLock
from graphmode.plan.execution import ExecutionPlan


class ArenaExecutable:
    """The arena, the slot views and the run loop; a backend fills `steps` and `step_names`
    (one per instruction that is not a view) and its reports."""

    def __init__(self, plan: ExecutionPlan, constants: Mapping[str, torch.Tensor]):
        self.plan = plan
        self.lock = ForkSafeLock()     # one arena: runs on one executable are serialised
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
                done = 0
                try:
                    for step in self.steps:
                        step()
                        done += 1
                except GraphmodeError:
                    raise
                except Exception as e:
                    raise self.rejected(done, e) or e from None
            # outside inference mode: the caller gets ordinary tensors, which it may update in place
            # (an inference tensor refuses that outside inference mode); none records autograd
            with torch.no_grad():
                outs = {}
                for o in self.plan.outputs:
                    v = self.views[o][index[o]] if o in index else self.views[o]
                    outs[o] = empty_huge(v.shape, v.dtype).copy_(v)
            return outs


    def rejected(self, index: int, err: Exception) -> ContractViolation | None:
        """A torch operator's own check failing on a request (embedding_bag's offsets, indices
        past a table no analysis bounds) as an error naming the op, instead of torch's bare
        exception from inside the plan. None for any other step (a generated kernel, a copy):
        left as it is."""
        name = self.step_names[index] if index < len(self.step_names) else ""
        kind, _, op = name.partition(":")
        if kind not in _ATEN_CALLS or not isinstance(err, (RuntimeError, IndexError, ValueError)):
            return None
        outs = [ins.outputs for ins in self.plan.instructions if ins.kind != "view"][index]
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        return ContractViolation(f"{op} (%{outs[0]}) failed on this request: {first}", kind="input",
                                 where=f"step {index + 1} of {len(self.steps)}, {name}",
                                 fix="send values the op accepts (eager PyTorch raises on the same ones); if eager "
                                     "answers this request, report it with the model")


# step kinds that call a torch operator with the request's values (its own checks then apply)
_ATEN_CALLS = frozenset({"aten", "ref", "fallback"})


def reference_step(compute: Callable[[], list[torch.Tensor]],
                   outs: Sequence[torch.Tensor | None]) -> Callable[[], None]:
    """A step computing its outputs with reference ops (`compute`) and copying them into
    their slots. An output nothing reads is None and not copied: an ATen call's extra results
    (embedding_bag's max_indices) can have another size in torch's kernel than its shape
    functions gave at capture. A result of another shape than its slot is graphmode's error,
    never broadcast into the slot."""
    def step() -> None:
        for o, r in zip(outs, compute()):
            if o is not None:
                if r.shape != o.shape:
                    raise BackendError(f"a step's result has shape {list(r.shape)} where the plan holds "
                                       f"{list(o.shape)}", fix="report it with the model; exe_mode: eager runs the "
                                       "model meanwhile")
                o.copy_(r)
    return step


__all__ = ["ArenaExecutable", "reference_step"]
