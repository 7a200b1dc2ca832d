"""The module torch.export traces: a copy of the user's, over the same tensors.

Non-strict torch.export swaps fake tensors into the module it traces (its parameters and
buffers, for the trace's duration), and graphmode patches some submodules' forward while it
exports (capture/fast_paths.py). Another thread calling the same module meanwhile (a service
that serves eager while it compiles in the background, or graphmode's own eager fallback) ran
on fake tensors ('fake_mode.in_kernel_invocation must be False') and broke the trace as well
(trial AC). The copy has its own module objects, so the swaps and patches stay in it, and shares
every parameter, buffer and tensor attribute with the original, so it costs no weight memory
and the exported program holds the user's tensors.
"""
from __future__ import annotations

import copy

import torch


def traced_copy(module: torch.nn.Module) -> torch.nn.Module:
    """`module` with its own module objects and the original's tensors; `module` itself where it
    cannot be copied (an attribute deepcopy refuses: the trace then runs on it as before)."""
    memo: dict[int, object] = {}
    for sub in module.modules():
        for value in vars(sub).values():
            _share(value, memo)
    for t in (*module.parameters(), *module.buffers()):
        memo[id(t)] = t
    if any(isinstance(sub, torch.jit.ScriptModule) for sub in module.modules()):
        return module               # TorchScript copies itself with new tensors (torch.jit.trace's modules)
    try:
        copied = copy.deepcopy(module, memo)
    except Exception:  # noqa: BLE001 - any object deepcopy cannot copy: trace the original
        return module
    same = all(a is b for a, b in zip((*module.parameters(), *module.buffers()),
                                      (*copied.parameters(), *copied.buffers())))
    return copied if same else module


def _share(value: object, memo: dict[int, object]) -> None:
    """Tensors the module holds outside its parameters and buffers (a plain attribute, the
    dicts nn.Module keeps them in) are shared, not copied."""
    if isinstance(value, torch.Tensor):
        memo[id(value)] = value
    elif isinstance(value, dict):
        for v in value.values():
            if isinstance(v, torch.Tensor):
                memo[id(v)] = v
    elif isinstance(value, (list, tuple)):
        for v in value:
            if isinstance(v, torch.Tensor):
                memo[id(v)] = v
