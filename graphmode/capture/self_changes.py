"""A model that changes its own settings while graphmode runs it, refused and put back.

Some models switch themselves to another algorithm on an input they cannot take as configured,
for good: transformers' BigBird, given a sequence too short for block-sparse attention, sets its
`attention_type` to "original_full" and keeps it. graphmode runs the model on small examples
(to learn its outputs, to capture it), so the compiled model held full attention at every length
while the user's configured model answered with block-sparse attention (rel L2 7.5e-3 at 128
tokens), and the user's own model object had been switched without a word. While graphmode runs
it, every submodule's switches (its public str and bool attributes, and its submodules) are
watched; a change is undone and refused, naming the attribute. Numbers are not watched: a lazy
module fills in its sizes on its first call, and a counter counts calls.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from graphmode.errors import CaptureError

SWITCHES = (str, bool)
IGNORED = {"training"}          # graphmode puts the model in eval mode itself


def _settings(module: torch.nn.Module) -> dict[tuple[str, str], Any]:
    return {(path, k): v for path, sub in module.named_modules() for k, v in vars(sub).items()
            if isinstance(v, SWITCHES) and not k.startswith("_") and k not in IGNORED}


@contextlib.contextmanager
def refuse_self_changes(module: Any, where: str, during: str) -> Iterator[None]:
    """Run the body; if it changed a setting of `module`, put every changed one back and raise."""
    if not isinstance(module, torch.nn.Module):
        yield
        return
    before = _settings(module)
    children = {sub: dict(sub._modules) for sub in module.modules()}     # a switch may swap submodules too
    yield
    after = _settings(module)
    changed = [(key, before[key], after.get(key)) for key in before if after.get(key, before[key]) != before[key]]
    if not changed:
        return
    for sub, kept in children.items():
        if sub._modules != kept:
            sub._modules.clear()
            sub._modules.update(kept)
    subs = dict(module.named_modules())
    for (path, attr), old, _ in changed:
        setattr(subs[path], attr, old)
    shown = ", ".join(f"{(path + '.') if path else ''}{attr}: {old!r} -> {new!r}" for (path, attr), old, new in changed[:4])
    raise CaptureError(f"the model changed its own settings while {during} ({shown}); the compiled model would "
                       "keep the changed behaviour at every shape, where the model as configured behaves otherwise "
                       "(graphmode put the settings back)", where=where,
                       fix="set those attributes yourself before compiling (e.g. BigBird: "
                           "config.attention_type='original_full'), or give example inputs the model takes "
                           "as configured")


__all__ = ["refuse_self_changes"]
