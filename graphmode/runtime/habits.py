"""What torch habits do to a compiled model: `cm.eval()`, `cm.forward(x)`, `cm.to("cpu")`,
`copy.deepcopy(cm)`, a call under `torch.autocast`.

A CompiledModel stands in for an eval-mode module on the host: the first three are what they
already are (eval mode, a call, the CPU); what it cannot be (training mode, another device, a
copy of its arena and locks) is refused naming the way that works instead of an AttributeError
or a pickling error from deep inside.
"""
from __future__ import annotations

import warnings
from typing import Any

import torch

from graphmode.errors import GraphmodeError


class AutocastIgnored(UserWarning):
    """torch.autocast was on around graphmode.compile or a call: the recipe's precision applies."""


AUTOCAST_NOTE = ("graphmode captures and runs the model at the recipe's precision (precision.compute), not "
                 "torch.autocast's: for bf16 compute, set precision.compute: bf16")


class TorchHabits:
    """Module-like methods of a compiled model (mixed into CompiledModel)."""

    _autocast_said = False

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self(*args, **kwargs)

    def eval(self) -> "TorchHabits":
        return self                     # compiled in eval mode (the capture put the module there)

    def train(self, mode: bool = True) -> "TorchHabits":
        if mode:
            raise GraphmodeError("a compiled model runs in eval mode only: dropout and batch statistics were "
                                 "fixed at capture", where="train()", value=mode,
                                 fix="train the eager module, then compile it again (graphmode.compile)")
        return self

    def to(self, *args: Any, **kwargs: Any) -> "TorchHabits":
        target = kwargs.get("device", args[0] if args else None)
        dtype = kwargs.get("dtype", next((a for a in args if isinstance(a, torch.dtype)), None))
        if isinstance(target, torch.Tensor):         # nn.Module.to(tensor): that tensor's device and dtype
            target, dtype = target.device, dtype or (target.dtype if target.dtype != torch.float32 else None)
        try:
            device = None if target is None or isinstance(target, torch.dtype) else torch.device(target)
        except (RuntimeError, TypeError):
            raise GraphmodeError("not a device", where="to()", value=str(target),
                                 fix="cm.to('cpu') (a compiled model runs where it was compiled for)") from None
        from graphmode.ir.types import DTYPES
        if dtype is not None and DTYPES.get(self.recipe.precision.compute) == dtype:
            dtype = None                                # the dtype it computes in already
        if (device is None or device.type == "cpu") and dtype is None:
            return self
        raise GraphmodeError("a compiled model stays where it was compiled for: its plans, kernels and weights are "
                             "the target's", where="to()", value=str(dtype or device),
                             fix="compile for that target (targets in the recipe, graphmode.compile(target=...)), "
                                 "or for another dtype set precision in the recipe")

    def half(self) -> "TorchHabits":
        return self.to(torch.float16)

    def float(self) -> "TorchHabits":
        return self.to(torch.float32)

    def cpu(self) -> "TorchHabits":
        return self.to("cpu")

    def __deepcopy__(self, memo: dict) -> Any:
        raise _no_copy("copy.deepcopy")

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise _no_copy("pickle")

    def _call_without_autocast(self, args: tuple, kwargs: dict) -> Any:
        """A call under torch.autocast: run at the recipe's precision (said once). Eager would
        compute in autocast's dtype, which no plan does; a plan built inside autocast would also
        check its kernels against autocast's ATen results."""
        if not self._autocast_said:
            self._autocast_said = True
            warnings.warn(AutocastIgnored(f"a call under torch.autocast: {AUTOCAST_NOTE}"), stacklevel=3)
        with torch.autocast("cpu", enabled=False):
            return self(*args, **kwargs)


def _no_copy(how: str) -> GraphmodeError:
    return GraphmodeError(f"a compiled model cannot be copied by {how}: it holds its plans' memory, kernels and "
                          "locks", where=how, fix="cm.save('model.gm') and graphmode.load('model.gm') (another "
                          "process too), or call graphmode.compile again")
