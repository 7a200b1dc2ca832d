"""Dynamic batching: requests that arrive within a window run as one model call.

A batch holds requests of one deployment (recipe version), in arrival order, whose batch
rows sum to at most the largest admissible batch. `merge` pads every request to the
batch's common size on the other dims (with the recipe's pad values, the same padding the
compile verdict proved safe; dims it found unsafe are never merged across sizes) and
concatenates along the batch dim; the CompiledModel then pads that up to the smallest
bucket that holds it. `split` cuts the
outputs back per request: its rows on the batch axis, its own extent on every other
sliced dim.

The `Batcher` runs on the server's event loop and hands each batch to a single worker
thread, so the loop stays free to accept requests while a batch runs. A request waits at
most `window_s` after its arrival for company.
"""
from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

from graphmode.serve.errors import NotReady


@dataclass
class Pending:
    """One request waiting for (or in) a batch."""
    deployment: Any
    inputs: dict[str, torch.Tensor]
    dims: dict[str, int]
    rows: int                         # its extent on the batch dim (1 when the recipe has none)
    alone: bool = False               # run by itself (eager fallback, or no batch dim)
    arrived: float = field(default_factory=time.perf_counter)
    future: asyncio.Future | None = None


def merge(batch: Sequence[Pending], specs: Sequence[Any], batch_dim: str) -> tuple[dict[str, torch.Tensor],
                                                                                 dict[str, int]]:
    """Concatenate requests along `batch_dim`, padding other dims to the largest request.

    `specs` are the recipe's InputSpecs (name, shape with dim names, pad_value). Returns the
    merged inputs and their dim values (batch = total rows, other dims = their maximum)."""
    if len(batch) == 1:
        return dict(batch[0].inputs), dict(batch[0].dims)
    dims: dict[str, int] = {}
    for p in batch:
        for d, v in p.dims.items():
            dims[d] = v if d not in dims else max(dims[d], v)
    dims[batch_dim] = sum(p.rows for p in batch)
    merged = {}
    for spec in specs:
        axes = [(ax, d) for ax, d in enumerate(spec.shape) if isinstance(d, str)]
        cat_axis = next(ax for ax, d in axes if d == batch_dim)
        parts = []
        for p in batch:
            t = p.inputs[spec.name]
            pads: list[int] = []
            need = False
            for ax in reversed(range(t.dim())):
                extra = 0
                for a, d in axes:
                    if a == ax and d != batch_dim:
                        extra = dims[d] - int(t.shape[ax])
                pads += [0, extra]
                need |= extra > 0
            parts.append(F.pad(t, pads, value=spec.pad_value) if need else t)
        merged[spec.name] = torch.cat(parts, dim=cat_axis)
    return merged, dims


def split(outputs: Sequence[torch.Tensor], axes: Sequence[Sequence[str | None]], batch: Sequence[Pending],
          batch_dim: str) -> list[list[torch.Tensor]]:
    """Per request, its slice of every output. `axes[i][ax]` names the dim of output i's axis
    ax (None: not sliced). An output with no batch axis is given whole to every request."""
    if len(batch) == 1:
        return [list(outputs)]
    total = sum(p.rows for p in batch)
    res: list[list[torch.Tensor]] = [[] for _ in batch]
    for t, names in zip(outputs, axes):
        names = list(names)
        if batch_dim not in names and t.dim() > 0 and int(t.shape[0]) == total:
            names = [batch_dim] + names[1:] if names else [batch_dim]
        offset = 0
        for i, p in enumerate(batch):
            idx: list[slice] = []
            for ax in range(t.dim()):
                d = names[ax] if ax < len(names) else None
                if d == batch_dim:
                    idx.append(slice(offset, offset + p.rows))
                elif d is not None and d in p.dims and p.dims[d] < int(t.shape[ax]):
                    idx.append(slice(0, p.dims[d]))
                else:
                    idx.append(slice(None))
            res[i].append(t[tuple(idx)])
            offset += p.rows
    return res


def compatible(a: Pending, b: Pending) -> bool:
    """Requests batch together on one deployment, and never by padding a dim the padding
    analysis found unsafe (the compile verdict's exact dims: those must match exactly)."""
    if a.deployment is not b.deployment or a.alone or b.alone:
        return False
    exact = getattr(getattr(a.deployment, "cm", None), "exact_dims", ())
    return all(a.dims.get(d) == b.dims.get(d) for d in exact)


class Batcher:
    """Collects requests into batches and runs them, one at a time, on `executor`.

    `run(batch)` executes in the worker thread and returns one result (or exception) per
    request; `max_rows(deployment)` caps the rows of a batch."""

    def __init__(self, run: Callable[[list[Pending]], list[Any]], max_rows: Callable[[Any], int], *,
                 window_s: float, executor: Any, on_depth: Callable[[int], None] | None = None):
        self.run = run
        self.max_rows = max_rows
        self.window_s = max(0.0, float(window_s))
        self.executor = executor
        self.on_depth = on_depth
        self.queue: asyncio.Queue[Pending] = asyncio.Queue()
        self.carry: deque[Pending] = deque()
        self.batches = 0
        self._task: asyncio.Task | None = None
        self._flush: asyncio.Event | None = None
        self._collecting: list[Pending] = []      # the batch waiting for its window to fill

    def flush(self) -> None:
        """No more waiting for a batch to fill (shutdown: nothing new arrives): run what is queued now."""
        self.window_s = 0.0
        if self._flush is not None:
            self._flush.set()

    def start(self) -> None:
        self._flush = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="graphmode-batcher")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - shutting down
                pass
        for p in list(self.carry) + self._drain() + self._collecting:
            if p.future is not None and not p.future.done():
                p.future.set_exception(NotReady("the server is shutting down", where="request",
                                                fix="retry it (on another replica, or once the server is back)"))

    def _drain(self) -> list[Pending]:
        out = []
        while not self.queue.empty():
            out.append(self.queue.get_nowait())
        return out

    def depth(self) -> int:
        return self.queue.qsize() + len(self.carry) + len(self._collecting)

    def submit(self, p: Pending) -> None:
        self.queue.put_nowait(p)
        if self.on_depth:
            self.on_depth(self.depth())

    async def _next(self, timeout: float | None) -> Pending | None:
        if self.carry:
            return self.carry.popleft()
        if timeout is None:
            return await self.queue.get()
        if timeout <= 0 or (self._flush is not None and self._flush.is_set()):
            return self.queue.get_nowait() if not self.queue.empty() else None
        getter = asyncio.ensure_future(self.queue.get())
        woken = asyncio.ensure_future(self._flush.wait()) if self._flush is not None else None
        try:
            await asyncio.wait({getter} | ({woken} if woken else set()), timeout=timeout,
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            for f in (getter, woken):
                if f is not None and not f.done():
                    f.cancel()
        if getter.done() and not getter.cancelled():
            return getter.result()
        return self.queue.get_nowait() if not self.queue.empty() and woken is not None and woken.done() else None

    async def _collect(self) -> list[Pending]:
        first = await self._next(None)
        assert first is not None
        batch = self._collecting = [first]
        if first.alone:
            return batch
        limit = self.max_rows(first.deployment)
        rows = first.rows
        deadline = first.arrived + self.window_s
        while rows < limit:
            nxt = await self._next(deadline - time.perf_counter())
            if nxt is None:
                break
            if not compatible(first, nxt) or rows + nxt.rows > limit:
                self.carry.appendleft(nxt)     # it starts the next batch, keeping arrival order
                break
            batch.append(nxt)
            rows += nxt.rows
        return batch

    async def _loop(self) -> None:
        while True:
            await self._run_one(await self._collect())

    async def _run_one(self, batch: list[Pending]) -> None:
        """Run one batch and answer its requests. Its own frame: once it returns nothing here
        refers to the batch, so a retired deployment is not kept alive by the last batch it ran."""
        live = [p for p in batch if p.future is None or not p.future.done()]
        self._collecting = []
        if self.on_depth:
            self.on_depth(self.depth())
        if not live:
            return
        try:
            results = await asyncio.get_running_loop().run_in_executor(self.executor, self.run, live)
        except Exception as e:  # noqa: BLE001 - the worker must survive anything
            results = [e] * len(live)
        self.batches += 1
        for p, r in zip(live, results):
            if p.future is None or p.future.done():
                continue
            if isinstance(r, BaseException):
                p.future.set_exception(r)
            else:
                p.future.set_result(r)
