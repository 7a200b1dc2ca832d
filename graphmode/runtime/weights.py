"""The weights a compiled model was built with, and the check that its module still holds them.

The captured graph shares storage with the module's parameters and buffers (no second copy of
the weights), while each plan's kernels pack their own copies when the plan is built. An
in-place update of the module after compile (`load_state_dict`, `param.copy_`, an optimizer
step) then reaches the steps that read the shared storage and not the packed ones, and plans
built later see only the new values: answers that match neither the old model nor the new one.
So a call compares the tensors' version counters with the ones at compile (about 10 us for 150
tensors) and refuses when one moved.
"""
from __future__ import annotations

from typing import Any

from graphmode.errors import GraphmodeError


class FrozenWeights:
    def __init__(self, module: Any):
        named = [(n, t) for n, t in (*module.named_parameters(), *module.named_buffers())
                 if not t.is_inference()]    # an inference tensor keeps no version (and cannot change outside one)
        self._names = [n for n, _ in named]
        self._tensors = [t for _, t in named]
        self._versions = [t._version for t in self._tensors]

    def check(self) -> None:
        """Raise when a parameter or buffer was updated in place since compile."""
        if [t._version for t in self._tensors] == self._versions:
            return
        changed = [n for n, t, v in zip(self._names, self._tensors, self._versions) if t._version != v]
        more = f" (+{len(changed) - 3} more)" if len(changed) > 3 else ""
        raise GraphmodeError(f"the model's weights changed after graphmode.compile: {', '.join(changed[:3])}{more} "
                             "were updated in place (load_state_dict, copy_, an optimizer step); the compiled plans "
                             "hold the weights they were built with, so answering would mix old and new",
                             where=f"model.{changed[0]}",
                             fix="compile again after loading or updating the weights: load the checkpoint first, "
                                 "then graphmode.compile(model, recipe)")
