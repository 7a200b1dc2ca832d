"""Several machines: a rank started by `torchrun` (one command per node), not by graphmode.

`launch` (graphmode/parallel/launch.py) spawns every rank of one machine and feeds them requests
through pipes. Under torchrun each rank is its own command; `run_rank` joins the group at the
rendezvous torchrun gives it (the CLI, `graphmode rank`, reads RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT from torchrun's environment and passes them here), compiles only its own shard
(`start_rank`, the same start as `launch`'s ranks; or loads its own file of a saved group,
runtime/rank_artifacts.py) and runs the same request loop (`answer_requests`). The requests come
from rank 0: it takes each one from its own source (the CLI reads a JSONL file or stdin) and
broadcasts it to the other ranks (`Broadcasts`, with keep-alives while it waits), which follow
until rank 0 says ("close",). Only rank 0 answers.

Failure is bounded as in `launch`: every broadcast and collective waits at most
`parallel.comm.timeout_s`; a rank's error other than a refusal every rank makes alike (a
ContractViolation, raised before anything runs) ends its command with that error, and torchrun
stops the other ranks.
"""
from __future__ import annotations

import pickle
import queue
import threading
from typing import Any, Callable, Iterable, Iterator

import torch

from graphmode.errors import ContractViolation, GraphmodeError
from graphmode.parallel.launch import RankDriver, answer_requests, check_group, start_rank, stop_rank

CLOSE = ("close",)
KEEPALIVE = ("cancel",)       # a message every rank skips (answer_requests): rank 0 is waiting for a request


class Broadcasts:
    """A rank's request channel under torchrun, in place of `launch`'s pipe: `recv` is rank 0's
    next message (from `requests` on rank 0, ("close",) after the last), broadcast to every rank
    over `comm`; `send` hands rank 0's replies to `answer` and drops the others'. A reply that
    is an error other than a refusal is raised on the rank that made it (the group is not
    consistent any more).

    With `keepalive_s`, rank 0 reads `requests` on a thread of its own and, when none came
    for `keepalive_s`, broadcasts a KEEPALIVE that every rank skips: the other ranks' wait for
    the next request then never reaches the collective timeout, however slowly the requests
    come (a pipe, a stream)."""

    def __init__(self, comm: Any, requests: Iterable[tuple] | None = None,
                 answer: Callable[[tuple], None] | None = None, keepalive_s: float | None = None):
        self.comm, self.rank = comm, comm.rank
        self._requests: Iterator[tuple] = iter(requests if requests is not None else ())
        self._answer = answer
        self.keepalive_s = keepalive_s
        self.received = 0
        self._queue: queue.Queue | None = None
        if self.rank == 0 and keepalive_s is not None:
            self._queue = queue.Queue(maxsize=4)
            threading.Thread(target=self._read, name="rank0-requests", daemon=True).start()

    def _read(self) -> None:
        try:
            for msg in self._requests:
                self._queue.put(msg)
            self._queue.put(CLOSE)
        except BaseException as e:  # noqa: BLE001 - raised on rank 0's own thread by _next
            self._queue.put(("__error__", e))

    def _next(self) -> tuple:
        if self._queue is None:
            return next(self._requests, CLOSE)
        try:
            msg = self._queue.get(timeout=self.keepalive_s)
        except queue.Empty:
            return KEEPALIVE
        if msg[0] == "__error__":
            raise msg[1]
        return msg

    def recv(self) -> tuple:
        if self.rank == 0:
            msg = self._next()
            blob = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
            size = torch.tensor([len(blob)], dtype=torch.int64)
        else:
            size = torch.zeros(1, dtype=torch.int64)
        size = self.comm.broadcast(size, 0)
        buf = torch.frombuffer(bytearray(blob), dtype=torch.uint8) if self.rank == 0 \
            else torch.empty(int(size[0]), dtype=torch.uint8)
        buf = self.comm.broadcast(buf, 0)
        if self.rank != 0:
            msg = pickle.loads(buf.numpy().tobytes())
        self.received += 1
        return msg

    def send(self, reply: tuple) -> None:
        if reply[0] == "error" and not isinstance(reply[1], ContractViolation):
            raise reply[1]
        if self.rank == 0 and self._answer is not None:
            self._answer(reply)


def check_world(recipe: Any, world: int, rank: int) -> None:
    """torchrun's world must be the recipe's `parallel.tensor` (each rank runs one shard)."""
    want = check_group(recipe)
    if world != want:
        raise GraphmodeError(f"torchrun started {world} rank(s) (WORLD_SIZE {world}), the recipe splits the model "
                             f"over parallel.tensor {want}", where="parallel.tensor", value=world,
                             fix=f"start {want} ranks in all (--nnodes x --nproc-per-node = {want}), or set "
                                 f"parallel.tensor: {world}")
    if not 0 <= rank < world:
        raise GraphmodeError(f"rank {rank} is outside the group of {world}", where="RANK", value=rank,
                             fix="start the rank with torchrun, which sets RANK")


def run_rank(model: Any, recipe: Any, target: Any = "host", *, rank: int, world: int, master_addr: str,
             master_port: int, driver: RankDriver, requests: Iterable[tuple] | None = None,
             answer: Callable[[tuple], None] | None = None, mode: str | None = None, cache_dir: Any = None,
             threads: int = 1) -> dict:
    """Be rank `rank` of `world`: join the group at master_addr:master_port, compile this rank's
    shard, answer rank 0's requests until it says ("close",) (module doc). `requests` and
    `answer` are rank 0's (the other ranks' are ignored): messages as `answer_requests` takes
    them, e.g. ("run", (), {input: tensor}), and the replies ("ok", outputs, counters) or
    ("error", refusal). Returns this rank's start report (pid, weights bytes, collectives)."""
    check_world(recipe, world, rank)
    cm, comm, info = start_rank(rank, world, f"tcp://{master_addr}:{int(master_port)}", model, recipe, target,
                                mode, cache_dir, threads, driver)
    try:
        channel = Broadcasts(comm, requests if rank == 0 else None, answer, keepalive_s=comm.timeout_s / 4)
        answer_requests(cm, comm, channel, rank)
    finally:
        stop_rank()
    return info


__all__ = ["Broadcasts", "CLOSE", "KEEPALIVE", "check_world", "run_rank"]
