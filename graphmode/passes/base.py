"""Pass infrastructure: a pass is a name (its `PassInfo` in registry.py) and `run(graph, ctx)`.

Passes never mutate their input graph: they return a new one in `PassResult`. Analyses a
pass computes (e.g. the memory plan) go into `ctx.analyses`, keyed by name.
"""
from __future__ import annotations

import importlib
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol

from pydantic import BaseModel, ValidationError

from graphmode.errors import PassError
from graphmode.ir.graph import Graph
from graphmode.passes.options import PassOptions
from graphmode.passes.registry import PASS_INFOS, PassInfo


@dataclass
class PassResult:
    graph: Graph
    modified: bool
    stats: dict[str, Any] = field(default_factory=dict)   # e.g. {"removed": 12, "groups": 30}


class Instrument(Protocol):
    """Hooks around every pass (print/dump IR, timing, monitoring)."""

    def before_pass(self, name: str, index: int, graph: Graph, ctx: "PassContext") -> None: ...

    def after_pass(self, name: str, index: int, result: PassResult, seconds: float, ctx: "PassContext") -> None: ...


@dataclass
class PassContext:
    """Everything a pass may read besides the graph. Passed explicitly, never global.

    - `options`: per-pass settings, a mapping or the pass's own options model (registry.py),
      e.g. options["fuse"] = recipe.optimize.fusion or {"patterns": ["elementwise"], "max_ops": 8},
      options["memory_plan"] = {"reuse": True, "alias_groups": [...], "alignment": 64}.
    - `buckets`: concrete dim values a plan will be built for, e.g. [{"batch": 1, "seq": 16}, ...].
    - `target`: a graphmode.targets.schema.Target or None (layout preferences, cache sizes).
    - `analyses`: results computed by passes (e.g. analyses["memory_plan"] -> MemoryPlanSet).
    """

    options: dict[str, Mapping[str, Any] | BaseModel] = field(default_factory=dict)
    buckets: list[dict[str, int]] = field(default_factory=list)
    target: Any = None
    instruments: list[Instrument] = field(default_factory=list)
    verify: bool = True
    analyses: dict[str, Any] = field(default_factory=dict)

    def opts(self, pass_name: str) -> PassOptions | None:
        """The options of `pass_name` as its declared model (defaults filled in); a bad field
        is a PassError naming it, the value and what it accepts."""
        info = PASS_INFOS[pass_name]
        raw = self.options.get(pass_name, {})
        if info.options is None:
            if raw:
                raise PassError(f"pass {pass_name!r} takes no options", where=f"options[{pass_name!r}]", value=raw,
                                fix=f"remove options[{pass_name!r}]")
            return None
        if isinstance(raw, info.options):
            return raw
        if isinstance(raw, BaseModel):
            raw = raw.model_dump()
        try:
            return info.options.model_validate(raw)
        except ValidationError as e:
            err = e.errors(include_url=False)[0]
            at = info.options_at or f"options[{pass_name!r}]"
            where = ".".join([at, *(str(p) for p in err["loc"][:1])])
            fields = ", ".join(info.options.model_fields)
            raise PassError(f"{pass_name} option: {err['msg']}", where=where, value=err.get("input"),
                            fix=f"{pass_name} takes {fields}") from None


PassFn = Callable[[Graph, PassContext], PassResult]
PASS_MODULES = ("to_paged", "canonicalize", "precision", "constant_fold", "shard", "merge_linears", "quantize_weights",
                "cse", "dce", "layout", "fuse", "memory_plan")


class _Implementations(dict):
    """Pass name -> run function. The pass modules register themselves when they are
    imported, which happens on the first lookup: importing the passes package, or the
    registry and options (the recipe layer does), stays light."""

    _loaded = False
    _loading = False
    # one thread imports the pass modules; another looking a pass up meanwhile waits for all of them
    # (it saw `_loaded` set before the registrations and reported a pass missing: two threads
    # compiling at once in a fresh process). Reentrant: a pass module may look up PASSES as it loads.
    _lock = threading.RLock()

    def _load(self) -> None:
        if _Implementations._loaded:
            return
        with _Implementations._lock:
            if _Implementations._loaded or _Implementations._loading:
                return
            _Implementations._loading = True
            try:
                for mod in PASS_MODULES:
                    importlib.import_module(f"graphmode.passes.{mod}")
                _Implementations._loaded = True
            finally:
                _Implementations._loading = False

    def __getitem__(self, key):
        self._load()
        return super().__getitem__(key)

    def __contains__(self, key) -> bool:
        self._load()
        return super().__contains__(key)

    def __iter__(self):
        self._load()
        return super().__iter__()

    def __len__(self) -> int:
        self._load()
        return super().__len__()

    def get(self, key, default=None):
        self._load()
        return super().get(key, default)

    def keys(self):
        self._load()
        return super().keys()

    def items(self):
        self._load()
        return super().items()

    def values(self):
        self._load()
        return super().values()


PASSES: dict[str, PassFn] = _Implementations()


def register_pass(name: str) -> Callable[[PassFn], PassFn]:
    """Attach a run function to a pass declared in registry.PASS_INFOS."""
    if name not in PASS_INFOS:
        raise KeyError(f"pass {name!r} is not declared in graphmode/passes/registry.py")

    def deco(fn: PassFn) -> PassFn:
        dict.__setitem__(PASSES, name, fn)
        return fn
    return deco


def info(name: str) -> PassInfo:
    return PASS_INFOS[name]
