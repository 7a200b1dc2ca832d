"""The communicator a collective op (`ir/ops/collective.py`) reaches the other ranks through.

Bound here, below the IR's ops, so that the ops read it without importing the tensor-parallel
package that makes communicators (graphmode/parallel/comm.py: torch.distributed and thread
groups) and binds them: `bind(comm)` for the current thread (a context variable, so the ranks of
a thread group each see their own), `bind_process(comm)` for every thread of a rank process.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator, Optional, Protocol

import torch


class Communicator(Protocol):
    rank: int
    world: int
    timeout_s: float

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor: ...        # sum over ranks

    def all_gather(self, t: torch.Tensor, axis: int) -> torch.Tensor: ...   # concatenated in rank order

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor: ...


_ACTIVE: contextvars.ContextVar[Optional[Communicator]] = contextvars.ContextVar("graphmode_comm", default=None)
_PROCESS: list[Optional[Communicator]] = [None]


def active() -> Optional[Communicator]:
    return _ACTIVE.get() or _PROCESS[0]


@contextlib.contextmanager
def bind(comm: Communicator) -> Iterator[Communicator]:
    token = _ACTIVE.set(comm)
    try:
        yield comm
    finally:
        _ACTIVE.reset(token)


def bind_process(comm: Optional[Communicator]) -> None:
    _PROCESS[0] = comm
