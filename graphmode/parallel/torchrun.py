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

With `serve` (`graphmode rank --serve-port`), rank 0's own process serves the group over HTTP:
its request loop runs on a thread (`RankLoop`) fed through a pipe (`Relay`), and the server
calls a `TorchrunGroup`, which is the one-machine launcher's TensorParallelModel with rank 0's
loop in place of rank processes. A message may name its ranks ({rank: message}: the decode
engine on rank 0, the others following its steps).

Failure is bounded as in `launch`: every broadcast and collective waits at most
`parallel.comm.timeout_s`; a rank's error other than a refusal every rank makes alike (a
ContractViolation, raised before anything runs) ends its command with that error, and torchrun
stops the other ranks.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import socket
import threading
from typing import Any, Callable, Iterable, Iterator, Mapping

import torch

from graphmode.errors import ContractViolation, GraphmodeError
from graphmode.parallel.launch import (NotOnRanks, RankDriver, TensorParallelModel, _Plain, _portable, answer_requests,
                                       check_group, start_rank, stop_rank)

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
        """Rank 0's next message for this rank: one every rank takes, or this rank's part of a
        {rank: message} (a rank not named waits for the next)."""
        while True:
            msg = self._exchange()
            if not isinstance(msg, dict):
                return msg
            if self.rank in msg:
                return msg[self.rank]

    def _exchange(self) -> Any:
        if self.rank == 0:
            msg = self._next()
            if isinstance(msg, dict) and set(msg) == {0}:
                return msg                    # rank 0's alone (a sample): nothing crosses
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


class Relay(Broadcasts):
    """Rank 0's channel when its own process serves the group (`graphmode rank --serve-port`):
    the messages a TorchrunGroup puts on `pipe`, each broadcast as Broadcasts does (a keep-alive
    when none came for `keepalive_s`); rank 0's replies go back on the pipe. A rank method (a
    decode engine's loop) talks on the pipe itself (`direct`) and broadcasts its own steps."""

    def __init__(self, comm: Any, pipe: Any, keepalive_s: float):
        super().__init__(comm)
        self.pipe, self.keepalive_s = pipe, keepalive_s
        self.direct = _Direct(pipe)

    def _next(self) -> Any:
        if not self.pipe.poll(self.keepalive_s):
            return KEEPALIVE
        try:
            return self.pipe.recv()
        except EOFError:                      # the serving side went away
            return CLOSE

    def send(self, reply: tuple) -> None:
        if reply[0] == "error" and not isinstance(reply[1], ContractViolation):
            raise reply[1]                    # the group is not consistent any more: RankLoop reports it
        self.pipe.send(reply)


class _Direct:
    """The pipe as a rank method reads it: rank 0's part of a {rank: message}."""

    def __init__(self, pipe: Any):
        self.pipe = pipe
        self.send, self.poll = pipe.send, pipe.poll

    def recv(self) -> Any:
        msg = self.pipe.recv()
        return msg[0] if isinstance(msg, dict) else msg


class RankLoop:
    """Rank 0's request loop (answer_requests over a Relay) on a thread of the serving process,
    with what a TensorParallelModel watches of a rank process: `sentinel` (readable once the
    loop ended), `exitcode`, `pid`. An error that ends the loop goes to the pipe first, so the
    call waiting on it raises it."""

    def __init__(self, cm: Any, comm: Any, pipe: Any, keepalive_s: float):
        self.pid = os.getpid()
        self.exitcode: int | None = None
        self.error: str | None = None
        self.sentinel, self._done = os.pipe()
        self._thread = threading.Thread(target=self._main, args=(cm, comm, pipe, keepalive_s),
                                        name="rank0-requests", daemon=True)
        self._thread.start()

    def _main(self, cm: Any, comm: Any, pipe: Any, keepalive_s: float) -> None:
        code = 1
        try:
            answer_requests(cm, comm, Relay(comm, pipe, keepalive_s), 0)
            code = 0
        except BaseException as e:  # noqa: BLE001 - reported on the pipe and by exitcode
            self.error = str(e).splitlines()[0] if str(e) else type(e).__name__
            try:
                pipe.send(("error", _portable(e, 0)))
            except OSError:
                pass
        finally:
            self.exitcode = code
            os.close(self._done)

    def is_alive(self) -> bool:
        return self.exitcode is None

    def kill(self) -> None:
        """A thread is not killed: a loop stuck in a collective ends within comm.timeout_s."""

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)


class TorchrunGroup(TensorParallelModel):
    """The group torchrun started, seen from rank 0's own process as `launch`'s caller sees its
    rank processes, so the server takes it alike: each call crosses a pipe to rank 0's request
    loop (RankLoop), which broadcasts it to the other ranks; only rank 0 answers. A rank that
    dies or hangs elsewhere fails rank 0's next broadcast or collective within comm.timeout_s
    (a keep-alive goes out every quarter of it while idle): the loop ends and the group is down."""

    def __init__(self, model: Any, recipe: Any, cm: Any, comm: Any, infos: list[dict], driver: RankDriver,
                 target: Any = "host", threads: int = 1):
        mine, loops = mp.Pipe()              # a real pipe between two threads: waited on as a rank's
        loop = RankLoop(cm, comm, _Plain(loops), comm.timeout_s / 4)
        super().__init__(model, recipe, [loop], [_Plain(mine)], target, resolve_model=driver.resolve_model)
        self.world, self.replying, self.threads = comm.world, [0], threads
        self.started(infos)

    def send(self, msgs: Mapping[int, Any]) -> None:
        """One {rank: message} to rank 0's loop, which hands each rank its own."""
        self._check_up()
        try:
            self.conns[0].send(dict(msgs))
        except (BrokenPipeError, ConnectionResetError, OSError):
            self._fail(self._death(0) or "rank 0's request loop stopped reading")

    def rank_states(self) -> list[dict[str, Any]]:
        """Per rank: its pid and host; a rank elsewhere counts as alive while the group is up."""
        up = self._down is None and self.procs[0].is_alive()
        return [{"rank": i["rank"], "pid": i["pid"], "host": i.get("host"), "alive": up} for i in self.ranks]

    def _death(self, r: int) -> str | None:
        loop = self.procs[0]
        if loop.exitcode is None:
            return None
        return f"rank 0's request loop stopped: {loop.error}" if loop.error else "rank 0's request loop ended"

    def save(self, path: Any) -> dict:
        raise NotOnRanks("a group torchrun started is saved rank by rank", where="parallel",
                         fix="save it on one machine (graphmode compile --save with the recipe), then start each "
                             "rank from its file (graphmode rank --model GROUP.gm)")


def gather_infos(comm: Any, info: dict) -> list[dict]:
    """Every rank's start report (pid, host, weights), in rank order, on every rank."""
    import torch.distributed as dist
    infos: list[Any] = [None] * comm.world
    dist.all_gather_object(infos, {**info, "host": socket.gethostname()})
    return infos


def check_world(recipe: Any, world: int, rank: int) -> None:
    """torchrun's world must be the recipe's `parallel.tensor` (each rank runs one shard)."""
    want = check_group(recipe)
    if world != want:
        raise GraphmodeError(f"torchrun started {world} rank(s) (WORLD_SIZE {world}), the recipe splits the model "
                             f"over parallel.tensor {want}", where="parallel.tensor", value=world,
                             fix=f"start {want} ranks in all (--nnodes x --nproc-per-node = {want}), or a recipe "
                                 f"of parallel.tensor: {world} where it divides the model's heads (recipe validate "
                                 "--model says)")
    if not 0 <= rank < world:
        raise GraphmodeError(f"rank {rank} is outside the group of {world}", where="RANK", value=rank,
                             fix="start the rank with torchrun, which sets RANK")


def run_rank(model: Any, recipe: Any, target: Any = "host", *, rank: int, world: int, master_addr: str,
             master_port: int, driver: RankDriver, requests: Iterable[tuple] | None = None,
             answer: Callable[[tuple], None] | None = None, serve: Callable[[TorchrunGroup], None] | None = None,
             mode: str | None = None, cache_dir: Any = None, threads: int = 1) -> dict:
    """Be rank `rank` of `world`: join the group at master_addr:master_port, compile this rank's
    shard, answer rank 0's requests until it says ("close",) (module doc). `requests` and
    `answer` are rank 0's (the other ranks' are ignored): messages as `answer_requests` takes
    them, e.g. ("run", (), {input: tensor}), and the replies ("ok", outputs, counters) or
    ("error", refusal). With `serve`, rank 0 instead calls serve(group) with the group as a
    TorchrunGroup (the HTTP server's model) and closes it when that returns. Returns this
    rank's start report (pid, weights bytes, collectives)."""
    check_world(recipe, world, rank)
    cm, comm, info = start_rank(rank, world, f"tcp://{master_addr}:{int(master_port)}", model, recipe, target,
                                mode, cache_dir, threads, driver)
    try:
        infos = gather_infos(comm, info)
        if rank == 0 and serve is not None:
            group = TorchrunGroup(model, recipe, cm, comm, infos, driver, target, threads)
            try:
                serve(group)
            finally:
                group.close()
        else:
            channel = Broadcasts(comm, requests if rank == 0 else None, answer, keepalive_s=comm.timeout_s / 4)
            answer_requests(cm, comm, channel, rank)
    finally:
        stop_rank()
    return info


__all__ = ["Broadcasts", "CLOSE", "KEEPALIVE", "Relay", "TorchrunGroup", "check_world", "run_rank"]
