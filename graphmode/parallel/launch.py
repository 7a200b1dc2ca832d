"""One machine, N ranks: graphmode starts the rank processes of a `parallel` recipe itself.

`launch(model, recipe, ...)` spawns `parallel.tensor` processes; each joins the group with
`torch.distributed` (the recipe's backend, gloo on CPU, over loopback TCP, with
`parallel.comm.timeout_s` on every collective), compiles only its own shard
(`graphmode.compile(..., rank=r)`: the `shard` pass for that rank, its plans and cache entries)
and waits for requests on a pipe. The returned `TensorParallelModel` is called like a
`CompiledModel`: every rank gets the request, they run their shards together, rank 0's outputs
are the answer.

Failure is bounded, never a hang: a rank that dies is seen at once (its process sentinel), a
rank that hangs makes the others' collectives time out after `timeout_s`, and the parent waits
at most `timeout_s` plus a margin for any rank. Either way the call raises `RankFailure`
naming the rank, the group is stopped, and later calls are refused.
"""
from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import socket
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import Any, Callable, Mapping

from graphmode.errors import ContractViolation, GraphmodeError, RankFailure

_MARGIN_S = 10.0          # beyond the collective timeout: a rank's own error reaches the parent first


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Plain:
    """A pipe end that pickles plainly: multiprocessing's own pickler moves every tensor through
    a shared-memory file (torch's reductions), milliseconds a message; a request's and an
    answer's tensors are small enough to copy inline."""

    def __init__(self, conn: Any):
        self.conn = conn

    def send(self, obj: Any) -> None:
        self.conn.send_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))

    def recv(self) -> Any:
        return pickle.loads(self.conn.recv_bytes())

    def poll(self, timeout: float = 0.0) -> bool:
        return self.conn.poll(timeout)

    def fileno(self) -> int:
        return self.conn.fileno()

    def close(self) -> None:
        self.conn.close()


def _portable(e: BaseException, rank: int) -> BaseException:
    """`e` if it survives pickling (typed graphmode errors keep their type), else a RankFailure
    carrying its text."""
    try:
        back = pickle.loads(pickle.dumps(e))
        if isinstance(back, BaseException) and str(back) == str(e):
            return back
    except Exception:  # noqa: BLE001 - anything unpicklable becomes text
        pass
    return RankFailure(f"{type(e).__name__}: {e}", where=f"rank {rank}")


@dataclass(frozen=True)
class RankDriver:
    """What a rank needs from the pipeline driver, passed in by the driver (graphmode/compiler.py):
    the launcher sits below it in the layers and does not import it. Top-level functions, so they
    pickle by name into the spawned ranks."""
    compile: Callable[..., Any]                 # compiler.compile (a rank's shard under `rank=`)
    resolve_model: Callable[[Any, Any], Any]    # capture.source.resolve_model (the parent's eager model)
    collectives: Callable[[Any], tuple]         # compile_report.graph_collectives
    save: Callable[..., Any] | None = None      # runtime.rank_artifacts.save_group (TensorParallelModel.save)
    facts: Callable[[Any], Any] | None = None   # compiler.facts_of (what a rank's proof rested on)


def start_rank(rank: int, world: int, init_method: str, model: Any, recipe: Any, target: Any, mode: str | None,
               cache_dir: Any, threads: int, driver: RankDriver, on_stage: Any = None) -> tuple[Any, Any, dict]:
    """Join the group (`init_method`: tcp://host:port), bind this process's communicator and
    compile this rank's shard with every bucket's plan (so a call never waits on a peer's plan
    build past the collective timeout); `on_stage` hears its capture, passes, proof and plans.
    Returns (the rank's CompiledModel, its communicator, what it reports: pid, weights and KV
    bytes, collectives). Shared by `launch` and torchrun."""
    import torch
    import torch.distributed as dist

    from graphmode.parallel.comm import TorchDistributed, bind_process

    par = recipe.parallel
    torch.set_num_threads(threads)
    timeout = float(par.comm.timeout_s)
    dist.init_process_group(par.backend, init_method=init_method, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout))
    comm = TorchDistributed(rank, world, timeout)
    bind_process(comm)
    heard = {"on_stage": on_stage} if on_stage is not None else {}      # a saved group's load has no stages
    cm = driver.compile(model, recipe, target, mode=mode, cache_dir=cache_dir, threads=threads, warmup=True, rank=rank,
                        **heard)
    g = cm.graph
    held = {k: t.numel() * t.element_size() for k, t in (g.constants.items() if g else ())}
    state = sum(n for k, n in held.items() if g.values[k].role == "state")     # a decoder's KV pools
    info = {"rank": rank, "pid": os.getpid(), "weights_bytes": sum(held.values()) - state,
            **({"kv_bytes": state} if state else {}), **dict(getattr(cm, "rank_info", {})),
            "collectives": driver.collectives(g) if g else ()}
    if rank == 0 and recipe.memory.kv_cache is None and hasattr(cm, "bounds"):
        info["input_bounds"] = cm.bounds()    # the whole model's tables: a caller checks requests with them
        bd = recipe.model.batch_dim if recipe.model is not None else "batch"
        info["rows_independent"] = bool(cm.independent_along(bd))     # whether a server may merge requests
        info["output_names"] = list(getattr(cm, "output_names", []) or [])
        info["output_types"] = [(g.values[o].type.dtype, g.values[o].type.shape) for o in g.outputs] if g else []
        # what a server proves the recipe with again: the facts rank 0's own proof rested on
        info["facts"] = driver.facts(cm) if driver.facts is not None else None
    return cm, comm, info


def _rank_main(rank: int, world: int, port: int, conn, model: bytes, recipe: Any, target: Any, mode: str | None,
               cache_dir: Any, threads: int, driver: RankDriver, report: bool = False) -> None:
    """One rank process of `launch`: start (above), report ready, answer the parent's requests.
    With `report`, its start's progress events go to the parent as ("stage", Stage) first."""
    conn = _Plain(conn)
    _warnings_as_lines(rank)
    _thread_lock_for_bars()
    try:
        heard = _StartProgress(conn) if report else None
        cm, comm, info = start_rank(rank, world, f"tcp://127.0.0.1:{port}", pickle.loads(model), recipe, target,
                                    mode, cache_dir, threads, driver, on_stage=heard)
        if heard is not None:
            heard.starting = False
        conn.send(("ready", info))
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises it
        conn.send(("error", _portable(e, rank)))
        return
    answer_requests(cm, comm, conn, rank)
    stop_rank()


def _thread_lock_for_bars() -> None:
    """tqdm (torch.fx's interpreter draws a bar during capture) makes a multiprocessing lock on
    first use: a named semaphore that a rank stopped by a kill leaves behind, and the parent's
    resource tracker then warns of "leaked semaphore objects" after every failed start. A rank's
    bars never cross processes: a thread lock serves."""
    try:
        from tqdm import tqdm
    except ImportError:
        return
    tqdm.set_lock(threading.RLock())


class _StartProgress:
    """A rank's progress events to the parent while it starts; a plan built later (a recurring
    value's, dims.D.exact_plans) is not reported: the pipe then carries requests and answers."""

    def __init__(self, conn: Any):
        self.conn, self.starting = conn, True

    def __call__(self, s: Any) -> None:
        if self.starting:
            self.conn.send(("stage", s))


def _warnings_as_lines(rank: int) -> None:
    """graphmode's notices and warnings in a rank as one line each, named by rank (not Python's
    file and source line); a notice once, from rank 0, since every rank meets the same ones."""
    import sys
    import warnings

    from graphmode.errors import warning_line
    shown = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        said = warning_line(message, category)
        if said is None:
            shown(message, category, filename, lineno, file, line)
        elif said.startswith("warning:"):
            print(f"rank {rank} {said}", file=sys.stderr)
        elif rank == 0:
            print(said, file=sys.stderr)
    warnings.showwarning = show


def answer_requests(cm: Any, comm: Any, conn: Any, rank: int) -> None:
    """A rank's request loop: each message `conn.recv()` gives is answered with `conn.send`
    until ("close",) or the end of `conn` (EOFError). `conn` is the parent's pipe under `launch`,
    rank 0's broadcasts under torchrun (graphmode/parallel/torchrun.py). Messages: ("run", args,
    kwargs) -> ("ok", rank 0's outputs, counters) or ("error", err); ("sample", env, seed);
    ("method", name, args): cm.rank_<name>(conn, *args) (conn.direct where it has one: rank 0's pipe
    when its own process serves under torchrun); ("link", sizes, reps); ("interpret", args,
    kwargs): rank 0's outputs of every rank's shard graph interpreted; ("save", path):
    the rank's shard as an artifact (runtime/rank_artifacts.py); ("cancel",): nothing."""
    import torch

    from graphmode.parallel.link import measure_link

    while True:
        try:
            msg = conn.recv()
        except EOFError:              # the parent went away
            break
        if msg[0] == "close":
            break
        if msg[0] == "cancel":        # for a request that had ended already
            continue
        if msg[0] == "sample":        # rank 0: sample inputs inside the whole model's tables
            try:
                conn.send(("ok", cm.sample_inputs(msg[1], seed=msg[2]), {}))
            except BaseException as e:  # noqa: BLE001 - reported to the parent
                conn.send(("error", _portable(e, rank)))
            continue
        if msg[0] == "method":        # the rank's own protocol: cm.rank_<name>(pipe, *args) sends its replies
            try:
                getattr(cm, f"rank_{msg[1]}")(getattr(conn, "direct", conn), *msg[2])
            except BaseException as e:  # noqa: BLE001 - reported to the parent
                conn.send(("error", _portable(e, rank)))
            continue
        if msg[0] == "save":          # every rank: its shard as the artifact msg[1] (runtime/rank_artifacts.py)
            try:
                conn.send(("ok", cm.save(msg[1], rank=rank), {}))
            except BaseException as e:  # noqa: BLE001 - reported to the parent
                conn.send(("error", _portable(e, rank)))
            continue
        if msg[0] == "interpret":     # every rank: its shard through the reference interpreter (ir/interpreter.py)
            try:
                from graphmode.ir.interpreter import interpret
                with torch.inference_mode():
                    res = interpret(cm.graph, cm.bind_inputs(msg[1], msg[2]))    # collectives on this rank's comm
                conn.send(("ok", [res[o] for o in cm.graph.outputs] if rank == 0 else None, {}))
            except BaseException as e:  # noqa: BLE001 - reported to the parent
                conn.send(("error", _portable(e, rank)))
            continue
        if msg[0] == "link":          # every rank: time all_reduces of msg[1] bytes, msg[2] times each, msg[3] apart
            try:
                conn.send(("ok", measure_link(*msg[1:]), {}))
            except BaseException as e:  # noqa: BLE001 - reported to the parent
                conn.send(("error", _portable(e, rank)))
            continue
        _, args, kwargs = msg
        try:
            calls, nbytes, secs, per_op = comm.calls, comm.bytes, comm.seconds, comm.stats()
            comm.trace.clear()
            t0, cpu0 = time.perf_counter(), time.process_time()
            with torch.inference_mode():
                out = cm(*args, **kwargs)
            conn.send(("ok", out if rank == 0 else None,
                       {"collectives": comm.calls - calls, "comm_bytes": comm.bytes - nbytes,
                        "comm_s": comm.seconds - secs, "run_s": time.perf_counter() - t0,
                        "cpu_s": time.process_time() - cpu0,       # every thread of the rank: spinning shows here
                        "path": dict(cm.last_path or {}),
                        "per_op": stats_delta(comm.stats(), per_op), "trace": list(comm.trace)}))
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            conn.send(("error", _portable(e, rank)))


def stop_rank() -> None:
    """Leave the group (it may be broken already)."""
    import torch.distributed as dist
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - the group may already be broken
        pass


def stats_delta(now: dict, before: dict) -> dict:
    """Per collective, the counters of one call (`TorchDistributed.stats` after minus before)."""
    zero = {"calls": 0, "bytes": 0, "seconds": 0.0}
    return {op: {k: v - before.get(op, zero)[k] for k, v in row.items()}
            for op, row in now.items() if row["calls"] > before.get(op, zero)["calls"]}


class NotOnRanks(GraphmodeError, AttributeError):
    """A CompiledModel feature the rank group does not offer (an AttributeError too, so
    `getattr(tp, name, default)` still works)."""


class TensorParallelModel:
    """The rank processes of one `parallel` recipe, called like a CompiledModel (rank 0 answers).
    Use as a context manager, or `close()` it: the ranks are stopped either way at exit."""

    def __init__(self, model: Any, recipe: Any, procs: list, conns: list, target: Any = "host", *,
                 resolve_model: Callable[[Any, Any], Any], save_group: Callable[..., Any] | None = None):
        self.model, self.recipe, self.procs, self.conns, self.target = model, recipe, procs, conns, target
        self._resolve_model, self._save_group = resolve_model, save_group
        self.ranks: list[dict] = []          # per rank once started: pid, weights_bytes
        self.collectives: tuple = ()         # rank 0's sharded graph's (compile_report.graph_collectives)
        self.world = len(procs)
        self.replying = list(range(self.world))  # the ranks that answer each message (rank 0 only under torchrun)
        self.timeout_s = float(recipe.parallel.comm.timeout_s)
        self.mode = "graph"
        self.graph = None                    # each rank holds its own shard
        self.last_comm: list[dict] = []      # per rank, after the last call: collectives, bytes, seconds
        self.last_path: dict = {}
        self.input_bounds: tuple | None = None   # rank 0's request checks (runtime/bounds.py), once started
        self.rows_independent = False            # rank 0's: requests may be merged along the batch dim
        self.threads: int | None = None          # each rank's, once started
        self.output_names: list[str] = []        # rank 0's (a saved group's source has none of its own)
        self.output_types: list[tuple] = []      # rank 0's (dtype, shape) per output: what KServe metadata lists
        self._source = None
        self._down: str | None = None
        self.on_stage: Any = None                # hears rank 0's start progress (`launch`)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    @property
    def source(self) -> Any:
        """The model in this process (inputs, eager reference), loaded on first use."""
        if self._source is None:
            self._source = self._resolve_model(self.model, self.recipe)
            if not getattr(self._source, "output_names", None) and self.output_names:
                self._source.output_names = list(self.output_names)
        return self._source

    def started(self, infos: list[dict]) -> None:
        """Every rank's start report (`start_rank`), in rank order: what rank 0 alone reports of the
        whole model (collectives, request bounds, outputs) is kept here, the rest per rank."""
        self.ranks = [dict(i) for i in infos]
        first = self.ranks[0]
        self.collectives, self.input_bounds = first.pop("collectives", ()), first.pop("input_bounds", None)
        self.rows_independent = bool(first.pop("rows_independent", False))
        self.output_names, self.output_types = first.pop("output_names", []), first.pop("output_types", [])
        self.facts = first.pop("facts", None)       # rank 0's shard's: what its proof rested on
        for r in self.ranks[1:]:
            r.pop("collectives", None)

    def warmup(self) -> None:
        """Every rank has built every bucket's plan at start; nothing is left to do."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.send({r: ("run", args, kwargs) for r in range(self.world)})
        replies = self._collect(self.timeout_s + _MARGIN_S, "run")
        self.last_comm = [rep[2] for rep in replies]
        self.last_path = dict(replies[0][2].get("path") or {})
        return replies[0][1]

    def save(self, path: Any) -> dict:
        """Every rank's shard in its own artifact beside a group file at `path`, which
        `graphmode.load` starts the ranks from without compiling (runtime/rank_artifacts.py)."""
        if self._save_group is None:
            raise NotOnRanks("this rank group cannot be saved (started without a group saver)", where="parallel",
                             fix="start it with graphmode.compile")
        return self._save_group(self, path)

    def save_ranks(self, paths: list) -> list[dict]:
        """Rank r writes its shard's artifact to paths[r]; their manifests, in rank order."""
        self.send({r: ("save", str(p)) for r, p in enumerate(paths)})
        return [rep[1] for rep in self._collect(None, "save")]

    def measure_link(self, sizes: tuple[int, ...], reps: int, gap_s: float = 0.0) -> list[list[tuple[int, list]]]:
        """Per rank, (bytes, seconds of each of `reps`) f32 all_reduces of each size between the
        ranks, each after `gap_s` of compute (`graphmode.parallel.link`): what the recipe's
        `links` stand for, measured; `link.link_samples` makes them one mean per size."""
        self.send({r: ("link", tuple(sizes), reps, gap_s) for r in range(self.world)})
        return [rep[1] for rep in self._collect(self.timeout_s * len(sizes) + reps * len(sizes) * gap_s + _MARGIN_S,
                                                "link measurement")]

    def interpret(self, *args: Any, **kwargs: Any) -> list:
        """Rank 0's outputs (a flat list) of every rank's shard run by the reference interpreter, the
        collectives over the group's own links: the ops' eager definitions over the ranks' weights,
        what `graphmode run` checks a saved group's kernels and plans against (no module here)."""
        self.send({r: ("interpret", args, kwargs) for r in range(self.world)})
        return self._collect(None, "interpretation")[0][1]

    def send(self, msgs: Mapping[int, Any]) -> None:
        """msgs[r] to rank r (a rank that stopped reading fails the group)."""
        self._check_up()
        for r, msg in msgs.items():
            try:
                self.conns[r].send(msg)
            except (BrokenPipeError, ConnectionResetError, OSError):
                self._fail(self._death(r) or f"rank {r} stopped reading requests")

    def receive(self, r: int, timeout_s: float, what: str) -> Any:
        """The next message of rank `r` within `timeout_s`, while every rank's death is watched:
        a death, an overrun or a rank's error other than a refusal (ContractViolation) stops the
        group and raises; a refusal comes back as the message ("error", err)."""
        deadline = time.monotonic() + timeout_s
        while True:
            ready = wait([self.conns[r]] + [p.sentinel for p in self.procs], max(0.0, deadline - time.monotonic()))
            if self.conns[r] in ready or self.conns[r].poll():
                return self._read(r)
            dead = next((d for d in map(self._death, self.replying) if d), None)
            if dead:
                self._fail(dead)
            if not ready:
                self._fail(f"rank {r} did not answer the {what} within {timeout_s:g} s")

    def _read(self, r: int) -> Any:
        """Rank r's waiting message; a closed pipe or an error other than a refusal stops the group."""
        try:
            rep = self.conns[r].recv()
        except (EOFError, OSError):
            self.procs[r].join(1)
            self._fail(self._death(r) or f"rank {r} closed its pipe")
        if rep[0] == "error" and not isinstance(rep[1], ContractViolation):
            self._fail_with(rep[1], r)
        return rep

    def collect(self, ranks: list[int], timeout_s: float, what: str) -> list:
        """One reply from each of `ranks` that answers (as `receive`, each within `timeout_s`)."""
        return [self.receive(r, timeout_s, what) for r in ranks if r in self.replying]

    def sample_inputs(self, env: Mapping[str, int], seed: int = 0) -> dict[str, Any]:
        """Rank 0's sample inputs at `env`: index inputs drawn inside the tables of the model
        as captured (its shard's tables are split)."""
        self.send({0: ("sample", dict(env), seed)})
        deadline = time.monotonic() + self.timeout_s + _MARGIN_S
        while not self.conns[0].poll(0.1):
            if self._death(0) or time.monotonic() > deadline:
                self._fail(self._death(0) or f"rank 0 did not answer within {self.timeout_s:g} s")
        rep = self.conns[0].recv()
        if rep[0] == "error":
            self._fail_with(rep[1], 0)
        return rep[1]

    def down(self) -> str | None:
        """None while every rank process is up; else why not (a death found here stops the group).
        Never waits on a call in flight."""
        if self._down is None:
            dead = next((d for d in map(self._death, self.replying) if d), None)
            if dead:
                self._stop(dead)
        return self._down

    def rank_states(self) -> list[dict[str, Any]]:
        """Per rank: its pid and whether its process is alive (what /healthz lists)."""
        return [{"rank": r, "pid": p.pid, "alive": p.is_alive()} for r, p in enumerate(self.procs)]

    def _check_up(self) -> None:
        if self._down is not None:
            raise RankFailure(f"the tensor-parallel group is down: {self._down}", where="parallel",
                              fix="start the ranks again (graphmode.compile with the recipe)")

    def _death(self, r: int) -> str | None:
        code = self.procs[r].exitcode
        if code is None:
            return None
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        return f"rank {r} (pid {self.procs[r].pid}) {how}"

    def _collect(self, timeout_s: float | None, what: str) -> list:
        """One reply per rank; the first death, error or overrun stops the group and raises. A
        request every rank refuses (a ContractViolation, raised before anything runs) is raised
        with the group kept up."""
        got: dict[int, Any] = {}
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        waiting = set(self.replying)
        while waiting:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = wait([self.conns[r] for r in waiting] + [self.procs[r].sentinel for r in waiting], left)
            if not ready:
                self._fail(f"rank(s) {', '.join(map(str, sorted(waiting)))} did not answer the {what} within "
                           f"{timeout_s:g} s")
            for r in sorted(waiting):
                if self.conns[r] in ready or self.conns[r].poll():
                    rep = self._read(r)
                    if rep[0] == "stage":          # a start's progress (`launch(on_stage=)`): not the reply
                        if self.on_stage is not None:
                            self.on_stage(rep[1])
                        continue
                    got[r] = rep
                    waiting.discard(r)
                elif self.procs[r].sentinel in ready:
                    self.procs[r].join(1)
                    self._fail(self._death(r) or f"rank {r} stopped")
        replies = [got[r] for r in self.replying]
        refused = [rep[1] for rep in replies if rep[0] == "error"]
        if refused and len(refused) == len(replies):
            raise refused[0]          # every rank refused the request before running it: the group stays up
        if refused:                   # some ranks ran it, some did not: their states may differ
            self._fail_with(refused[0], next(r for r, rep in enumerate(replies) if rep[0] == "error"))
        return replies

    def _fail_with(self, err: BaseException, rank: int) -> None:
        """A rank's own error: a dead peer is the cause when a collective failed and one died."""
        if isinstance(err, RankFailure):     # a peer's sockets close a moment before its exit is seen
            wait([p.sentinel for i, p in enumerate(self.procs) if i != rank], 1.0)
        dead = [d for d in (self._death(r) for r in self.replying if r != rank) if d]
        if isinstance(err, RankFailure) and dead:
            self._fail(f"{dead[0]}; {err.message}")
        self._stop(str(err).splitlines()[0])
        raise err

    def _fail(self, why: str) -> None:
        self._stop(why)
        raise RankFailure(why, where="parallel", fix="see the rank's error above (or its exit code); the group is "
                          f"stopped, start it again (collectives wait at most parallel.comm.timeout_s = "
                          f"{self.timeout_s:g} s)")

    def _stop(self, why: str) -> None:
        self._down = why
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(5)

    def close(self) -> None:
        if self._down is None:
            for c in self.conns:
                try:
                    c.send(("close",))
                except OSError:
                    pass
            for p in self.procs:
                p.join(self.timeout_s)
        self._stop(self._down or "closed")
        for c in self.conns:
            c.close()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        raise NotOnRanks(f"{name!r} is not available on a tensor-parallel group yet: it is called, returns rank "
                         "0's outputs, and reports ranks and last_comm", where="parallel",
                         fix="tensor: 1 for this feature (docs/tensor-parallel.md lists what is not done)")

    def __enter__(self) -> "TensorParallelModel":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_down", "x") is None:
            try:
                self._stop("collected")
            except Exception:  # noqa: BLE001 - interpreter shutdown
                pass


def check_group(recipe: Any) -> int:
    """The recipe's rank count, once its group can be started here: a device per rank, gloo."""
    par = recipe.parallel
    world = par.tensor
    if len(par.device_group) < world:
        raise GraphmodeError(f"{len(par.device_group)} device(s) for tensor {world}: every rank needs a device",
                             where="parallel.device_group", value=par.device_group,
                             fix=f"list at least {world} devices, or lower parallel.tensor")
    if par.backend != "gloo":
        raise GraphmodeError(f"backend {par.backend!r} is not started by graphmode yet", where="parallel.backend",
                             fix="backend: gloo (CPU ranks)")
    return world


def launch(model: Any, recipe: Any, target: Any = "host", *, driver: RankDriver, mode: str | None = None,
           cache_dir: Any = None, threads: int | None = None, on_stage: Any = None) -> TensorParallelModel:
    """Start the `parallel.tensor` ranks of `recipe` on this machine (module doc); returns when
    every rank has compiled its shard, or raises the first rank's error (a refusal keeps its type).
    `on_stage` hears rank 0's capture, passes, proof and plans as they happen (the ranks build
    theirs side by side): a start that builds hundreds of plans says so."""
    world = check_group(recipe)
    from graphmode.parallel.main_guard import check_main_guard
    check_main_guard()
    threads = threads or max(1, (os.cpu_count() or 1) // world)
    ctx = mp.get_context("spawn")
    port = _free_port()
    # the model crosses pickled plainly: spawn's own pickler would move every tensor of the caller's
    # model into shared memory in place, under whatever was compiled from it in this process already
    blob = pickle.dumps(model, protocol=pickle.HIGHEST_PROTOCOL)
    procs, conns = [], []
    for r in range(world):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_rank_main, name=f"graphmode-rank{r}", daemon=True,
                        args=(r, world, port, child, blob, recipe, target, mode, cache_dir, threads, driver,
                              r == 0 and on_stage is not None))
        p.start()
        child.close()
        procs.append(p)
        conns.append(_Plain(parent))
    tp = TensorParallelModel(model, recipe, procs, conns, target, resolve_model=driver.resolve_model,
                             save_group=driver.save)
    tp.threads = threads                      # each rank's
    tp.on_stage = on_stage
    tp.started([rep[1] for rep in tp._collect(None, "start")])
    return tp
