"""The module a compiled model was built from, and the check that it is still that module.

The captured graph shares storage with the module's parameters and buffers (no second copy of
the weights), while each plan's kernels pack their own copies when the plan is built. An
in-place update of the module after compile (`load_state_dict`, `param.copy_`, an optimizer
step) then reaches the steps that read the shared storage and not the packed ones, and plans
built later see only the new values: answers that match neither the old model nor the new one.
A tensor, submodule or hook *replaced* after compile (`load_state_dict(assign=True)`, `m.fc =
nn.Linear(...)`, a hook added or removed) is never seen by the compiled plans at all. So a call
compares the tensors' version counters, the module tree's slots (which tensor, submodule and
how many hooks each holds) and its switches (public bools and strings: `training`, a flag the
forward branches on; torch.export fixed the values it read) with the ones at compile, and
refuses when one moved (about 15 us for 150 tensors). `param.data = t` (and `m.half()`, which
does that to every tensor) moves no version counter but moves the tensor's storage: the data
pointers are compared too. Public Python numbers (`m.eps = 1e-3`, `attn.scale = 2.0`) are
compared as the switches are, except those a forward set itself while graphmode ran it (Swin's
shift_size: its own state, capture/self_changes.py), and a number graphmode's own eager run of
the model set (an eager fallback) is taken as the model's new state. A write *into*
`param.data` (`param.data.copy_(t)`) moves nothing and is not seen.
"""
from __future__ import annotations

from operator import attrgetter, is_not
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from graphmode.capture.self_changes import NUMBERS, SWITCHES, busy_modules, state_numbers
from graphmode.errors import GraphmodeError

_VERSION = attrgetter("_version")
_DATA_PTR = torch.Tensor.data_ptr
_MISSING = object()

_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks")
_GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks")


def _global_hook_dicts() -> list[dict]:
    from torch.nn.modules import module as m
    return [getattr(m, name) for name in _GLOBAL_HOOKS if isinstance(getattr(m, name, None), dict)]


class FrozenWeights:
    def __init__(self, module: Any, held: Any = None):
        """`held`: the captured graph's constants ({name: tensor}), when known: a plain tensor
        attribute the graph does not hold is state the model's own forward may replace on every
        call (RecurrentGemma's conv1d_state), not a weight the plans froze."""
        named = [(n, t) for n, t in (*module.named_parameters(), *module.named_buffers())
                 if not t.is_inference()]    # an inference tensor keeps no version (and cannot change outside one)
        self._names = [n for n, _ in named]
        self._tensors = [t for _, t in named]
        self._versions = [t._version for t in self._tensors]
        # a sparse tensor has no data pointer of its own: its version counter is all there is
        self._stored = [(n, t) for n, t in named if t.layout is torch.strided]
        self._stored_tensors = [t for _, t in self._stored]
        self._storages = list(map(_DATA_PTR, self._stored_tensors))
        # (label, the dict that holds it, key, what it held at compile)
        python = [(p, m) for p, m in module.named_modules() if not isinstance(m, torch.jit.ScriptModule)]
        self._module_ids = {id(m) for _, m in module.named_modules()}
        self._slots = [(f"{path}.{k}" if path else k, d, k, v) for path, sub in python
                       for d in (sub._parameters, sub._buffers, sub._modules) for k, v in d.items()]
        # plain tensor attributes (not parameters or buffers: `self.scale = torch.full(...)`), which the
        # graph holds as constants: one replaced is refused as a buffer is (a Python number is not checked)
        storages = None if held is None else {t.untyped_storage().data_ptr() for t in held.values()
                                               if t.layout is torch.strided}
        self._slots += [(label, sub.__dict__, k, v) for path, sub in python for k, v in sub.__dict__.items()
                        if isinstance(v, torch.Tensor) and (label := f"{path}.{k}" if path else k)
                        and (held is None or label in held or v.untyped_storage().data_ptr() in storages)]
        self._slot_dicts, self._slot_keys, self._slot_values = (list(c) for c in zip(*[(d, k, v) for _, d, k, v
                                                                                      in self._slots])) \
            if self._slots else ([], [], [])
        # switches a forward may read (`self.use_cache`, `training`: public bools and strings, which no
        # forward may change itself, capture/self_changes.py) and numbers (`self.eps`): torch.export fixed
        # the values it read in the plans, so one set to another value since compile is refused too. The
        # numbers a forward set itself while graphmode ran it are its state (Swin's shift_size follows
        # the input), not checked
        switches = [(f"{path}.{k}" if path else k, sub.__dict__, k, v) for path, sub in python
                    for k, v in sub.__dict__.items() if not k.startswith("_") and (
                        type(v) in SWITCHES or type(v) in NUMBERS and k not in state_numbers(sub))]
        self._scalar_labels, self._scalar_dicts, self._scalar_keys, self._scalar_values = (
            [s[i] for s in switches] for i in range(4))
        self._hooks = [(path or type(module).__name__, getattr(sub, h)) for path, sub in python
                       for h in _HOOK_DICTS] + [("torch.nn.modules.module", d) for d in _global_hook_dicts()]
        self._hook_marks = self._marks()
        self._held = [d for _, d in self._hooks if d]      # hooks that can be removed
        self._held_marks = [(len(d), next(reversed(d))) for d in self._held]
        self._next_hook = RemovableHandle.next_id           # moves with every hook registered anywhere

    def check(self) -> None:
        """Raise when a parameter or buffer was updated in place, or a tensor, submodule or hook
        replaced, since compile."""
        if list(map(_VERSION, self._tensors)) != self._versions:
            changed = [n for n, t, v in zip(self._names, self._tensors, self._versions) if t._version != v]
            self._refuse(changed, "were updated in place (load_state_dict, copy_, an optimizer step)")
        if self._compiling():
            return                  # graphmode compiles it in another thread: torch.export's swaps are not changes
        if list(map(_DATA_PTR, self._stored_tensors)) != self._storages:
            changed = [n for (n, t), p in zip(self._stored, self._storages) if t.data_ptr() != p]
            if changed and not self._compiling():       # a capture that began after the look above
                self._refuse(changed, "were given new data (param.data = t, module.half() or .to(dtype))")
        if any(map(is_not, map(dict.get, self._slot_dicts, self._slot_keys), self._slot_values)):
            changed = [label for label, d, k, v in self._slots if d.get(k) is not v]
            if changed and not self._compiling():
                self._refuse(changed, "were replaced (load_state_dict(assign=True), an attribute set to a new "
                                      "tensor or module)")
        if any(map(is_not, map(dict.get, self._scalar_dicts, self._scalar_keys), self._scalar_values)):
            self._check_scalars()
        if RemovableHandle.next_id == self._next_hook and \
                [(len(d), next(reversed(d), None)) for d in self._held] == self._held_marks:
            return
        marks = self._marks()
        if marks != self._hook_marks:
            changed = [where for (where, _), a, b in zip(self._hooks, marks, self._hook_marks) if a != b]
            self._refuse(changed, "gained or lost forward hooks (register_forward_hook, handle.remove())")
        self._next_hook = RemovableHandle.next_id           # a hook registered elsewhere: this model's are as they were

    def _check_scalars(self) -> None:
        """An attribute holding another object than at compile: refused where its value differs
        (an equal value set again is the same answer), else remembered."""
        for i, (label, d, k, v) in enumerate(zip(self._scalar_labels, self._scalar_dicts, self._scalar_keys,
                                                 self._scalar_values)):
            now = d.get(k, _MISSING)
            if now is v:
                continue
            if not (type(now) is type(v) and (now == v or now != now and v != v)):     # NaN set again: equal
                self._refuse([label], f"was set to {now!r} (it was {v!r} at compile; torch.export fixed the "
                                      "value the forward read in the plans)" if now is not _MISSING else
                             f"was deleted (it was {v!r} at compile)")
            self._scalar_values[i] = now

    def _compiling(self) -> bool:
        """Whether graphmode runs or traces one of these modules in another thread now."""
        busy = busy_modules()
        return bool(busy) and not self._module_ids.isdisjoint(busy)

    def eager_ran(self) -> None:
        """graphmode ran the model eagerly (a request off the plans): the numbers its forward set
        there are its own state, the ones later calls compare with. Checked first: a number the
        user set before the call is still refused."""
        for i, (d, k, v) in enumerate(zip(self._scalar_dicts, self._scalar_keys, self._scalar_values)):
            if type(v) in NUMBERS and d.get(k, _MISSING) is not v and type(d.get(k)) in NUMBERS:
                self._scalar_values[i] = d[k]

    def _marks(self) -> list:
        """Per hook dict, its size and newest handle id: a hook removed and another added moves it."""
        return [(len(d), next(reversed(d), None)) for _, d in self._hooks]

    def _refuse(self, changed: list[str], how: str) -> None:
        more = f" (+{len(changed) - 3} more)" if len(changed) > 3 else ""
        raise GraphmodeError(f"the model changed after graphmode.compile: {', '.join(changed[:3])}{more} {how}; "
                             "the compiled plans hold the model as it was, so answering would mix old and new",
                             where=f"model.{changed[0]}",
                             fix="compile again after changing the model: load the checkpoint, set the hooks "
                                 "or attributes first, then graphmode.compile(model, recipe)")


__all__ = ["FrozenWeights"]
