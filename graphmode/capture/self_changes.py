"""A model that changes itself while graphmode runs it: put back, and refused where it matters.

graphmode runs the model on small examples (to learn its outputs, to capture it). Those runs
must leave the user's model as it was, and a compiled model cannot follow a model whose answer
depends on what its earlier calls changed. So while graphmode runs it:

- switches (every submodule's public str and bool attributes, and its submodules) are watched;
  a change is undone and refused, naming the attribute. transformers' BigBird, given a sequence
  too short for block-sparse attention, sets its `attention_type` to "original_full" and keeps
  it: the compiled model held full attention at every length (rel L2 7.5e-3 at 128 tokens).
- state (public int and float attributes, buffers updated in place, and parameters, buffers
  and tensor attributes replaced by other tensors) is put back after every run. A change of
  state alone is not refused (a lazy module fills in its sizes, a counter counts calls for a
  log): where the run that changed it can be repeated, it is, from the changed state, and an
  answer that differs (a running mean the output subtracts, a step counter it scales by) is
  refused, since the compiled model would answer with the state of one moment forever.
"""
from __future__ import annotations

import contextlib
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.utils._pytree as pytree

from graphmode.errors import CaptureError

_BUSY: dict[int, int] = {}      # id(module) -> graphmode runs of it in progress (a compile in another thread)
_BUSY_LOCK = threading.Lock()
_WRITES: dict[int, set[str]] = {}          # id(module) -> attributes its forward set while graphmode ran it
_STATE_NUMBERS: "weakref.WeakKeyDictionary[torch.nn.Module, frozenset[str]]" = weakref.WeakKeyDictionary()  # by submodule
_MODULE_SETATTR = torch.nn.Module.__setattr__


def _recording_setattr(self: torch.nn.Module, name: str, value: Any) -> None:
    """nn.Module.__setattr__ while graphmode runs a model: which attributes its forward sets
    (Swin sets shift_size on every call, to the same value at most shapes, so a value compared
    before and after cannot tell)."""
    if id(self) in _BUSY:
        _WRITES.setdefault(id(self), set()).add(name)
    _MODULE_SETATTR(self, name, value)


def state_numbers(module: torch.nn.Module) -> frozenset[str]:
    """The number attributes of this (sub)module that a forward set while graphmode ran it: its
    own state, which a compiled model does not hold the user to (runtime/weights.py guards the rest)."""
    return _STATE_NUMBERS.get(module, frozenset())


def busy_modules() -> frozenset[int]:
    """The ids of the modules graphmode is running or tracing now: torch.export swaps their
    parameters for its own while it traces, which a served model of the same module must not
    read as a change. A copy: another thread's capture may start or end meanwhile."""
    if not _BUSY:
        return frozenset()
    with _BUSY_LOCK:
        return frozenset(_BUSY)


SWITCHES = (str, bool)
NUMBERS = (int, float)
IGNORED = {"training"}          # graphmode puts the model in eval mode itself
SNAPSHOT_BYTES = 256 << 20      # buffers kept aside to put back: up to this much (a KV cache buffer may be GBs)


def _modules(module: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    """The Python submodules (a TorchScript module keeps its state in C++ wrappers: not watched)."""
    return ((p, m) for p, m in module.named_modules() if not isinstance(m, torch.jit.ScriptModule))


def _settings(module: torch.nn.Module) -> dict[tuple[str, str], Any]:
    return {(path, k): v for path, sub in _modules(module) for k, v in vars(sub).items()
            if isinstance(v, SWITCHES) and not k.startswith("_") and k not in IGNORED}


def _numbers(module: torch.nn.Module) -> dict[tuple[str, str], Any]:
    return {(path, k): v for path, sub in _modules(module) for k, v in vars(sub).items()
            if type(v) in NUMBERS and not k.startswith("_")}


def _tensors(module: torch.nn.Module) -> dict[tuple[str, str, str], torch.Tensor]:
    """Every tensor a submodule holds, by (path, where, name): its parameters, buffers and plain
    tensor attributes."""
    out = {}
    for path, sub in _modules(module):
        for where, d in (("_parameters", sub._parameters), ("_buffers", sub._buffers), ("__dict__", vars(sub))):
            out.update({(path, where, k): t for k, t in d.items() if isinstance(t, torch.Tensor)})
    return out


def _label(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


@dataclass
class Probe:
    """What the body of `refuse_self_changes` ran: its answer, and how to run it again."""

    answer: Any = None
    again: Callable[[], Any] | None = None


class _State:
    """The model's state before a run, and how to put it back."""

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self.numbers = _numbers(module)
        self.tensors = _tensors(module)
        self.kinds = {key: (t.dtype, t.device) for key, t in self.tensors.items()}
        buffers = [t for (p, w, k), t in self.tensors.items() if w == "_buffers" and not t.is_inference()]
        self.versions = {id(t): t._version for t in buffers}
        size = sum(t.numel() * t.element_size() for t in buffers)
        self.saved = {id(t): t.detach().clone() for t in buffers} if size <= SNAPSHOT_BYTES else {}

    def recast(self) -> list[str]:
        """Tensors the run cast or moved in place (`module.to(float64)` in forward), as labels."""
        tensors = _tensors(self.module)
        return [f"{_label(p, k)}: {str(d).removeprefix('torch.')} -> {str(t.dtype).removeprefix('torch.')}"
                + (f" on {t.device}" if t.device != dev else "")
                for key, (d, dev) in self.kinds.items() for p, _, k in [key]
                if (t := tensors.get(key)) is not None and (t.dtype, t.device) != (d, dev)]

    def changes(self) -> tuple[list[str], list[str], list[str]]:
        """(numbers changed, buffers updated in place, tensors replaced), as labels."""
        now = _numbers(self.module)
        numbers = [_label(p, k) for (p, k), v in self.numbers.items() if now.get((p, k), v) != v]
        tensors = _tensors(self.module)
        replaced = [_label(p, k) for key, t in self.tensors.items() for p, _, k in [key]
                    if tensors.get(key, t) is not t]
        inplace = [_label(p, k) for (p, w, k), t in self.tensors.items()
                   if id(t) in self.versions and t._version != self.versions[id(t)]]
        return numbers, inplace, replaced

    def restore(self) -> list[str]:
        """Put every number, tensor and saved buffer value back; the buffers it could not restore."""
        subs = dict(_modules(self.module))
        for (p, k), v in self.numbers.items():
            if p in subs and getattr(subs[p], k, v) != v:
                setattr(subs[p], k, v)
        for (p, where, k), t in self.tensors.items():
            if p in subs:
                d = vars(subs[p]) if where == "__dict__" else getattr(subs[p], where)
                d[k] = t
        lost = []
        with torch.no_grad():
            for (p, w, k), t in self.tensors.items():
                if id(t) in self.versions and t._version != self.versions[id(t)]:
                    if id(t) in self.saved:
                        t.copy_(self.saved[id(t)])
                    else:
                        lost.append(_label(p, k))
        return lost


def _same(a: Any, b: Any) -> bool:
    """The two answers hold equal tensors (other leaves, a cache object made per call, are not
    compared)."""
    la, lb = ([x for x in pytree.tree_leaves(v) if isinstance(x, torch.Tensor)] for v in (a, b))
    return len(la) == len(lb) and all(x.shape == y.shape and x.dtype == y.dtype and (torch.equal(x, y) or (
        x.is_floating_point() and torch.allclose(x, y, rtol=0, atol=0, equal_nan=True))) for x, y in zip(la, lb))


@contextlib.contextmanager
def refuse_self_changes(module: Any, where: str, during: str) -> Iterator[Probe]:
    """Run the body; put back what it changed of `module`; raise where the change matters (see
    the module's docstring). The body may fill the yielded Probe so a change of state is judged
    by a second run."""
    probe = Probe()
    if not isinstance(module, torch.nn.Module):
        yield probe
        return
    before = _settings(module)
    children = {sub: dict(sub._modules) for _, sub in _modules(module)}     # a switch may swap submodules too
    state = _State(module)
    # every submodule: a served model watches the ones it runs (a decoder's paged wrapper holds the
    # LM's submodules, not this top-level object), and torch.export swaps parameters in all of them
    subs = list(_modules(module))
    ids = [id(module)] + [id(sub) for _, sub in subs if sub is not module]
    with _BUSY_LOCK:
        if not _BUSY:
            torch.nn.Module.__setattr__ = _recording_setattr
        for i in ids:
            _BUSY[i] = _BUSY.get(i, 0) + 1
    try:
        try:
            yield probe
        except BaseException:
            _put_back(children, state)
            raise
        moved = {(p, k) for (p, k), v in _numbers(module).items() if state.numbers.get((p, k), v) != v}
        _settle(module, where, during, probe, before, children, state)
        for p, sub in subs:        # per submodule: a served wrapper may hold the LM's submodules, not this object
            mine = {k for k in _WRITES.get(id(sub), ()) if (p, k) in state.numbers} | {k for q, k in moved if q == p}
            if mine:
                _STATE_NUMBERS[sub] = state_numbers(sub) | mine
    finally:
        with _BUSY_LOCK:
            for i in ids:
                _BUSY[i] -= 1
                if not _BUSY[i]:
                    del _BUSY[i]
                    _WRITES.pop(i, None)
            if not _BUSY:
                torch.nn.Module.__setattr__ = _MODULE_SETATTR


def _put_back(children: dict, state: _State) -> list[str]:
    for sub, kept in children.items():
        if dict(sub._modules) != kept:
            sub._modules.clear()
            sub._modules.update(kept)
    return state.restore()


def _settle(module, where: str, during: str, probe: Probe, before: dict, children: dict, state: _State) -> None:
    after = _settings(module)
    changed = [(key, before[key], after.get(key)) for key in before if after.get(key, before[key]) != before[key]]
    numbers, inplace, replaced = state.changes()
    differs = None
    if not changed and (numbers or inplace or replaced) and probe.again is not None:
        try:
            differs = not _same(probe.answer, probe.again())
        except Exception:  # noqa: BLE001 - a second run that fails: the first one's changes are the cause
            differs = True
    recast = state.recast()
    lost = _put_back(children, state)
    if recast:
        raise CaptureError(f"the model casts or moves its own weights while {during} ({', '.join(recast[:4])}); "
                           "eager keeps them that way from its first call on, so the model as handed in is not "
                           "the one that answers", where=where,
                           fix="cast or move the model before compiling (e.g. model.to(torch.float64)), so the "
                               "call in forward changes nothing")
    if changed:
        subs = dict(_modules(module))
        for (path, attr), old, _ in changed:
            setattr(subs[path], attr, old)
        shown = ", ".join(f"{(path + '.') if path else ''}{attr}: {old!r} -> {new!r}"
                          for (path, attr), old, new in changed[:4])
        raise CaptureError(f"the model changed its own settings while {during} ({shown}); the compiled model would "
                           "keep the changed behaviour at every shape, where the model as configured behaves "
                           "otherwise (graphmode put the settings back)", where=where,
                           fix="set those attributes yourself before compiling (e.g. BigBird: "
                               "config.attention_type='original_full'), or give example inputs the model takes "
                               "as configured")
    if differs:
        what = ", ".join((numbers + inplace + replaced)[:4])
        if any(label.endswith("inv_freq") for label in inplace + replaced):
            from graphmode.capture.export_errors import ROPE_FIX, ROPE_WHY
            raise CaptureError(f"the model updates its rotary embedding's frequencies ({what}) while {during}. "
                               + ROPE_WHY, where="model.config.rope_scaling", fix=ROPE_FIX)
        back = f"; graphmode put them back, except {', '.join(lost)}" if lost else "; graphmode put them back"
        raise CaptureError(f"the model changes its own state each call ({what}, while {during}) and its answer "
                           f"depends on it: a compiled model answers with the state of one moment at every call"
                           f"{back}", where=where,
                           fix="keep that state outside the model and pass it in as an input (and take the new "
                               "value as an output), or fix it before compiling")


__all__ = ["Probe", "busy_modules", "refuse_self_changes"]
