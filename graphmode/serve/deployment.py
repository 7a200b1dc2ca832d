"""A deployment (one recipe version compiled, monitored and checked against its contract per
request) and the ticket of a recipe loading in the background."""
from __future__ import annotations

import asyncio
import itertools
import threading
import time
from typing import Any, Callable, Mapping

import torch
import torch.utils._pytree as pytree

from graphmode.errors import ContractViolation
from graphmode.monitor import ContractMonitor
from graphmode.serve.batching import Pending
from graphmode.serve.errors import detach, error_dict


def _facts_key(recipe: Any) -> tuple:
    """Recipes with equal keys compile the model to graphs with the same weights and FLOPs (a
    decoder's facts are its paged graph's: only another decoder recipe shares them)."""
    return (tuple((i.name, i.dtype, tuple(i.shape)) for i in recipe.inputs), tuple(sorted(recipe.dims)),
            recipe.precision.compute, recipe.exe_mode == "eager", recipe.memory.kv_cache is not None)


class Deployment:
    """One recipe version, compiled and monitored."""

    def __init__(self, recipe: Any, cm: Any, monitor: ContractMonitor, *, origin: str, facts: Any,
                 max_batch: int | None):
        self.recipe = recipe
        self.version = recipe.hash()
        self.name = recipe.name
        self.cm = cm
        self.monitor = monitor
        self.origin = origin
        self.facts = facts
        self.facts_key = _facts_key(recipe)
        self.created = time.time()
        self.buckets = recipe.buckets()
        self.plans = len(self.buckets)     # what warming up builds (a decoder: its prefill/decode plans)
        self.warmed = 0
        self.decoder: Any = None           # a DecodeLoop when the recipe has memory.kv_cache (completions)
        self.dtypes = {i.name: i.dtype for i in recipe.inputs}
        bd = recipe.model.batch_dim if recipe.model is not None else "batch"
        batchable = bd in recipe.dims and all(bd in i.shape for i in recipe.inputs)
        self.batch_dim = bd if batchable else None
        self.max_rows = 1
        if self.batch_dim is not None:
            self.max_rows = recipe.dim_range(bd)[1]
            if max_batch is not None:
                self.max_rows = max(1, min(self.max_rows, max_batch))
        self._outputs: tuple[list[str], list[list[str | None]]] | None = None
        self._independent: bool | None = None

    @property
    def output_names(self) -> list[str]:
        """The model's output names (read from the graph on first use: a decoder's
        whole-sequence graph is lowered then, runtime/deferred.py)."""
        return self._output_meta()[0]

    @property
    def output_axes(self) -> list[list[str | None]]:
        """Each output's axes by dim name (None: a fixed or unnamed axis)."""
        return self._output_meta()[1]

    def _output_meta(self) -> tuple[list[str], list[list[str | None]]]:
        if self._outputs is None:
            cm, recipe = self.cm, self.recipe
            g = cm.graph
            src_names = list(getattr(cm.source, "output_names", []) or [])
            if g is not None:     # the model's own outputs (the new values of inputs it updates in place follow them)
                tail = getattr(cm, "tail", None)      # a data-dependent tail's outputs are the model's
                n_user = len(g.outputs) - len(getattr(cm, "mutated_inputs", []))
                users = tail.outputs if tail is not None else g.outputs[:n_user]
                names = src_names if len(src_names) == len(users) else list(users)
                axes = [[_axis_name(d) for d in (tail or g).values[o].type.shape] for o in users]
            else:
                names = src_names or list(recipe.outputs)
                axes = [[d if isinstance(d, str) and d != "*" else None for d in recipe.outputs.get(n, [])]
                        for n in names]
            self._outputs = (names, axes)
        return self._outputs

    def describe(self) -> dict[str, Any]:
        return {"version": self.version, "name": self.name, "origin": self.origin,
                "created": self.created, "buckets": self.plans, "warmed": self.warmed}

    # ---- requests ----------------------------------------------------------------------------
    def prepare(self, inputs: Mapping[str, torch.Tensor]) -> Pending:
        """Check a request against this recipe's contract; a refusal is counted, then raised."""
        cm = self.cm
        try:
            bound = cm.bind_inputs((), dict(inputs))
            dims = cm.shape_of(bound)
        except ContractViolation as e:
            e.kind = "shape" if ".shape" in (e.where or "") else "input"
            declared = "send the inputs the recipe declares: " + ", ".join(
                f"{i.name} {list(i.shape)} {i.dtype}" for i in self.recipe.inputs)
            if e.where == "inputs" and e.message.startswith("missing inputs"):
                # the runtime's why (forward's optional arguments, torch.zeros) speaks to Python callers
                e.message, e.fix = e.message.split(":")[0], declared
            e.fix = e.fix or declared
            self.monitor.refused(e.kind)
            raise
        try:
            cm.check_inputs(bound, dims)        # index values, declared ranges, positions: before any queue
        except ContractViolation as e:
            self.monitor.refused(e.kind)
            raise
        rows = dims.get(self.batch_dim, 1) if self.batch_dim else 1
        hazard = getattr(cm, "pad_hazard", None)      # a rank group's ranks check their own
        if cm.mode != "eager" and hazard is not None and hazard(bound, dims, cm.bucket_for(dims)) is not None:
            # its own masked positions: not merged with others, and run unpadded (runtime/shaping.py)
            return Pending(self, bound, dims, rows, alone=True)
        if cm.mode == "eager":
            return Pending(self, bound, dims, rows, alone=not self.merges)
        if cm.bucket_for(dims) is None:
            if self.recipe.on_violation == "eager" and cm.source.module is not None:
                return Pending(self, bound, dims, rows, alone=True)   # the runtime counts it
            self.monitor.refused("shape")
            raise outside_contract(self.recipe, dims)
        if rows > self.max_rows:
            self.monitor.refused("shape")
            raise ContractViolation(f"{self.batch_dim} = {rows} is more than the server's --max-batch "
                                    f"{self.max_rows}", where=f"dims.{self.batch_dim}", value=rows,
                                    fix=f"split the request into parts of at most {self.max_rows} rows")
        return Pending(self, bound, dims, rows, alone=not self.merges)

    @property
    def merges(self) -> bool:
        """Whether requests may be merged along the batch dim: only where the model's rows never
        meet (analysis.padding.positions_independent). `x - x.sum(0)`, a prefix scan or a
        sequence-first encoder whose leading dim is called batch would answer each request
        with the others' rows in it."""
        if self.batch_dim is None:
            return False
        if self._independent is None:
            told = getattr(self.cm, "rows_independent", None)        # a rank group's rank 0 judged it
            judge = getattr(self.cm, "independent_along", None)
            self._independent = bool(told) if told is not None else bool(judge and judge(self.batch_dim))
        return self._independent

    def flatten(self, out: Any) -> list[torch.Tensor]:
        return [t for t in pytree.tree_flatten(out)[0] if isinstance(t, torch.Tensor)]

    def names_for(self, n: int) -> list[str]:
        return self.output_names if len(self.output_names) == n else [f"output_{i}" for i in range(n)]


def _axis_name(d: Any) -> str | None:
    return d.name if getattr(d, "is_Symbol", False) else None


def outside_contract(recipe: Any, dims: Mapping[str, int]) -> ContractViolation:
    for d, v in dims.items():
        lo, hi = recipe.dim_range(d)
        if not lo <= v <= hi:
            return ContractViolation(f"dim {d!r} = {v} is outside the recipe's range [{lo}, {hi}]",
                                     where=f"dims.{d}", value=v, fix=f"send {d} within [{lo}, {hi}]")
    return ContractViolation(f"no bucket holds shape {dict(dims)}", where="dims", value=dict(dims),
                             fix="send a shape the recipe's buckets cover")


class ReloadTicket:
    """One background load of a recipe; `wait()` blocks until it swapped or failed."""

    _ids = itertools.count(1)

    def __init__(self, version: str, name: str, origin: str, previous: str | None, reason: str = ""):
        self.id = next(self._ids)
        self.version, self.name, self.origin, self.previous, self.reason = version, name, origin, previous, reason
        self.state = "compiling"
        self.error: BaseException | None = None
        self.started = time.time()
        self.finished: float | None = None
        self.progress = (0, 0)
        self._done = threading.Event()

    def finish(self, state: str, error: BaseException | None = None) -> None:
        self.state, self.error, self.finished = state, detach(error) if error is not None else None, time.time()
        self._done.set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)

    async def wait_async(self, timeout: float, give_up: Callable[[], bool] = lambda: False) -> bool:
        """`wait` for the event loop: polls, so no worker thread is held for the whole wait;
        False past `timeout` or as soon as `give_up()` (the server is stopping)."""
        deadline = time.monotonic() + timeout
        while not self._done.is_set():
            left = deadline - time.monotonic()
            if left <= 0 or give_up():
                return False
            await asyncio.sleep(min(0.05, left))
        return True

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "state": self.state, "version": self.version, "name": self.name,
                "origin": self.origin, "previous": self.previous, "reason": self.reason,
                "started": self.started, "finished": self.finished,
                "warmed": self.progress[0], "buckets": self.progress[1],
                "error": error_dict(self.error) if self.error is not None else None}
