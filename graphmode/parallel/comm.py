"""Communicators: how the collective ops (`ir/ops/collective.py`) reach the other ranks.

A rank runs its shard of the graph; each collective node calls the communicator bound to it:
- `TorchDistributed`: the `torch.distributed` default group (gloo on CPU, nccl later), one
  process per rank; every collective waits at most the group's timeout (`parallel.comm.timeout_s`),
  so a rank that died or hangs makes the others fail with `RankFailure`, never hang.
- `ThreadGroup`: the ranks as threads of one process, joined by a barrier with the same timeout:
  the reference interpreter runs every rank of a sharded graph with it (the shard pass's tests
  and `verify`), with the very same op semantics.

Binding: `bind(comm)` for the current thread (a context variable, so the ranks of a thread group
each see their own), `bind_process(comm)` for every thread of a rank process (its executor may
run on a server's worker thread), both kept in graphmode/ir/communicator.py, where the ops read
`active()`.
"""
from __future__ import annotations

import re
import threading
import time
from typing import Optional

import torch

from graphmode.errors import RankFailure
from graphmode.ir.communicator import Communicator, active, bind, bind_process  # noqa: F401 (re-exported)


# ---- torch.distributed -------------------------------------------------------------------------

_SOURCE_PREFIX = re.compile(r"^\[[^\]]*\.(?:cc|cpp|h):\d+\]\s*")

class TorchDistributed:
    """The default process group of this process (`init_process_group` done by the launcher)."""

    def __init__(self, rank: int, world: int, timeout_s: float):
        self.rank, self.world, self.timeout_s = rank, world, timeout_s
        self.calls = 0
        self.bytes = 0
        self.seconds = 0.0
        self.by_op: dict[str, list] = {}      # collective -> [calls, bytes, seconds], as the totals
        self.trace: list[tuple[str, int, float]] = []   # (collective, bytes, seconds) of each, in order

    def stats(self) -> dict[str, dict[str, float]]:
        """A copy of the per-collective counters (subtract two to get one call's)."""
        return {op: {"calls": c, "bytes": b, "seconds": s} for op, (c, b, s) in self.by_op.items()}

    def _run(self, what: str, t: torch.Tensor, fn, nbytes: int | None = None) -> torch.Tensor:
        t0 = time.perf_counter()
        try:
            out = fn()
        except RuntimeError as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else repr(e)
            first = _SOURCE_PREFIX.sub("", first)        # gloo's "[/__w/pytorch/.../unbound_buffer.cc:78] "
            others = [r for r in range(self.world) if r != self.rank]
            raise RankFailure(f"{what} over {self.world} ranks failed after {time.perf_counter() - t0:.1f} s, "
                              f"waiting on rank{'s' if len(others) > 1 else ''} "
                              f"{', '.join(map(str, others))}: {first}",
                              where=f"rank {self.rank}", fix="another rank died, hung past parallel.comm.timeout_s "
                              f"({self.timeout_s:g} s) or was not started; see its error above, then restart "
                              "every rank") from None
        dt = time.perf_counter() - t0
        nb = t.numel() * t.element_size() if nbytes is None else nbytes
        self.calls += 1
        self.bytes += nb
        self.seconds += dt
        row = self.by_op.setdefault(what, [0, 0, 0.0])
        row[0], row[1], row[2] = row[0] + 1, row[1] + nb, row[2] + dt
        if len(self.trace) < 100_000:          # the launcher empties it every call
            self.trace.append((what, nb, dt))
        return out

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist
        t = t.contiguous().clone()
        return self._run("all_reduce", t, lambda: (dist.all_reduce(t), t)[1])

    def all_gather(self, t: torch.Tensor, axis: int) -> torch.Tensor:
        import torch.distributed as dist
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.world)]
        return self._run("all_gather", t, lambda: (dist.all_gather(parts, t), torch.cat(parts, axis))[1],
                         t.numel() * t.element_size() * self.world)     # the gathered result, as the cost model

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        import torch.distributed as dist
        t = t.contiguous()
        return self._run("broadcast", t, lambda: (dist.broadcast(t, src), t)[1])


# ---- threads of one process --------------------------------------------------------------------

class _Shared:
    def __init__(self, world: int, timeout_s: float):
        self.world, self.timeout_s = world, timeout_s
        self.barrier = threading.Barrier(world, timeout=timeout_s)
        self.slots: list[Optional[torch.Tensor]] = [None] * world


class ThreadGroup:
    """One rank of `world` ranks that are threads of this process; make them with `ThreadGroup.ranks`."""

    def __init__(self, shared: _Shared, rank: int):
        self._s, self.rank, self.world, self.timeout_s = shared, rank, shared.world, shared.timeout_s

    @staticmethod
    def ranks(world: int, timeout_s: float = 60.0) -> list["ThreadGroup"]:
        s = _Shared(world, timeout_s)
        return [ThreadGroup(s, r) for r in range(world)]

    def _exchange(self, what: str, t: torch.Tensor) -> list[torch.Tensor]:
        s = self._s
        try:
            s.barrier.wait()               # everyone left the previous exchange
            s.slots[self.rank] = t
            s.barrier.wait()               # everyone wrote
            parts = list(s.slots)
            s.barrier.wait()               # everyone read
        except threading.BrokenBarrierError:
            s.barrier.abort()
            raise RankFailure(f"{what} over {self.world} thread ranks found the group broken "
                              f"(a rank failed or waited more than {self.timeout_s:g} s)",
                              where=f"rank {self.rank}", fix="see the failing rank's error") from None
        return parts

    def abort(self) -> None:
        """A rank that fails breaks the barrier, so the others stop at once instead of timing out."""
        self._s.barrier.abort()

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        parts = self._exchange("all_reduce", t)
        out = parts[0].clone()
        for p in parts[1:]:
            out = out + p                  # rank order: every rank sums the same way
        return out

    def all_gather(self, t: torch.Tensor, axis: int) -> torch.Tensor:
        return torch.cat(self._exchange("all_gather", t), axis)

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        return self._exchange("broadcast", t)[src].clone()


def run_ranks(world: int, fn, timeout_s: float = 60.0) -> list:
    """fn(rank, comm) on `world` threads, each bound to its ThreadGroup rank; results in rank
    order. The first exception is re-raised (the others see a broken group and stop)."""
    comms = ThreadGroup.ranks(world, timeout_s)
    results: list = [None] * world
    errors: list = [None] * world

    def body(r: int) -> None:
        try:
            with bind(comms[r]):
                results[r] = fn(r, comms[r])
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            errors[r] = e
            comms[r].abort()
    threads = [threading.Thread(target=body, args=(r,), name=f"rank{r}") for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    first = next((e for e in errors if e is not None and not isinstance(e, RankFailure)), None) or \
        next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
    return results
