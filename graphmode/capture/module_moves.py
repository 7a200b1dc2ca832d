"""`module.to(...)` inside forward, when it changes nothing, kept as the no-op it is in eager.

Some models cast a submodule in forward (SwitchTransformers' router: `self.classifier =
self.classifier.to(self.dtype)`). In eager, when every parameter and buffer already has that
dtype and device, the call leaves them as they are; under torch.export the same call still
swaps each parameter and fails ("_apply(): Couldn't swap Linear.weight", or a complaint about
inference tensors). While a model is exported, a `to` that would change nothing returns the
module untouched; one that would change something is refused naming the model's line.
"""
from __future__ import annotations

import contextlib
import sys
import threading
from typing import Iterator

import torch

from graphmode.capture.export_errors import shown_path
from graphmode.errors import CaptureError, GraphmodeError


def _changes_nothing(module: torch.nn.Module, args: tuple, kwargs: dict) -> bool:
    try:
        device, dtype, _, memory_format = torch._C._nn._parse_to(*args, **kwargs)
    except Exception:  # noqa: BLE001 - arguments torch itself refuses: let the real call say so
        return False
    if memory_format is not None:
        return False
    for t in list(module.parameters()) + list(module.buffers()):
        if device is not None and t.device != torch.device(device):
            return False
        if dtype is not None and (t.is_floating_point() or t.is_complex()) and t.dtype != dtype:
            return False
    return True


_REAL_TO = torch.nn.Module.to
_LOCK = threading.Lock()
_USERS = [0]                 # exports under way in this process (the wrapper is installed while > 0)
_HERE = threading.local()    # this thread's depth: other threads' `to` calls pass straight through


def _to(self, *args, **kwargs):
    if not getattr(_HERE, "depth", 0):
        return _REAL_TO(self, *args, **kwargs)
    if _changes_nothing(self, args, kwargs):
        return self
    caller = sys._getframe(1)
    try:
        return _REAL_TO(self, *args, **kwargs)
    except GraphmodeError:
        raise
    except Exception as e:  # noqa: BLE001 - torch.export's many ways of failing a parameter swap
        at = f"{shown_path(caller.f_code.co_filename)}:{caller.f_lineno} in {caller.f_code.co_name}"
        raise CaptureError(f"the model moves or casts a {type(self).__name__} inside forward at {at}, which "
                           f"torch.export cannot trace ({type(e).__name__}: {str(e).splitlines()[0]})",
                           where="model", fix="cast or move the model once before compiling (model.to(dtype)) so "
                                              "the call in forward changes nothing, or run the model with "
                                              "exe_mode: eager") from None


@contextlib.contextmanager
def unchanged_moves_kept() -> Iterator[None]:
    """While this thread exports: `Module.to` that would change no parameter or buffer returns
    the module (installed once for concurrent exports, removed after the last)."""
    with _LOCK:
        _USERS[0] += 1
        torch.nn.Module.to = _to
    _HERE.depth = getattr(_HERE, "depth", 0) + 1
    try:
        yield
    finally:
        _HERE.depth -= 1
        with _LOCK:
            _USERS[0] -= 1
            if not _USERS[0]:
                torch.nn.Module.to = _REAL_TO
