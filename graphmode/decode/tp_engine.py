"""A tensor-parallel group's decode engine, driven from the calling process as the server and
`graphmode generate` drive a `DecodeEngine`.

The engine itself (scheduler, sampling, KV pools) runs on rank 0 (`engine_loop`), and the other
ranks follow its steps (`RankDecoder.rank_follow`), as for `TensorParallelDecoder.generate`.
`RemoteEngine` offers the engine's request interface in the caller, which holds neither weights
nor pools: `add` (the sequence's id back, or the engine's refusal), `cancel` (applied before the
next step), `step` (the tokens chosen, with their logprobs, the sequences that finished, the
engine's counts, and the step's logit rows while `on_logits` asks for them: verify's decode
check), `has_work`, `stats`, `lock`. Each call is one message on rank 0's pipe and its reply, so
continuous batching is the engine's own: sequences added between two steps join the next one,
whichever request they came from.

While nobody asks for a step (an idle server), rank 0 broadcasts a keep-alive every quarter of
`parallel.comm.timeout_s`, so the other ranks' wait for the next step never times out; a rank
that died or hangs makes that broadcast fail on rank 0. Every wait in the caller is bounded
(`comm.timeout_s` plus a margin) and watches every rank's process: a death or an overrun
raises `RankFailure` and stops the group (`health` says so without a request).
"""
from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any, Callable, Sequence

import torch

from graphmode.decode.scheduler import Sequence_
from graphmode.errors import GraphmodeError, RankFailure

MARGIN_S = 10.0            # beyond the collective timeout: a rank's own error reaches the caller first
KEEPALIVE = 2               # StepCodec's first word for "no step, keep waiting" (0 ends, 1 is a step)


def engine_loop(rd: Any, conn: Any, keepalive_s: float) -> None:
    """Rank 0 (`RankDecoder.rank_engine`): serve the caller's add / cancel / step messages until
    ("end",); a keep-alive broadcast whenever none came for `keepalive_s`. The other ranks are
    released at the end whatever happens."""
    eng = rd.engine
    seqs: dict[int, Any] = {}
    chosen: list[tuple[int, int, Any]] = []

    def on_token(sid: int, tok: int) -> None:
        s = seqs[sid]
        chosen.append((sid, tok, s.logprobs[-1] if s.params.logprobs is not None and s.logprobs else None))

    rows: list[tuple[int, torch.Tensor]] = []          # the step's logit rows, while the caller asks for them

    def on_logits(s: Any, row: torch.Tensor) -> None:
        rows.append((s.id, row.detach().float().clone()))

    before, counts = rd._counters(), dict(eng.stats)
    ended = False
    conn.send(("ready", start_info(eng)))
    try:
        with torch.inference_mode():
            while True:
                if not conn.poll(keepalive_s):
                    rd.keepalive()
                    continue
                msg = conn.recv()
                if msg[0] == "add":
                    try:
                        s = eng.add(msg[1], msg[2], on_token=on_token)
                    except GraphmodeError as e:       # the engine's refusal: the group stays up
                        conn.send(("refused", e))
                        continue
                    seqs[s.id] = s
                    conn.send(("added", s.id))
                elif msg[0] == "cancel":
                    s = seqs.pop(msg[1], None)
                    if s is not None and not s.done:
                        eng.cancel(s)
                elif msg[0] == "logits":              # verify's decode check (decode/check.py): no reply
                    eng.on_logits = on_logits if msg[1] else None
                elif msg[0] == "step":
                    chosen.clear()
                    rows.clear()
                    try:
                        finished = eng.step()
                    except GraphmodeError as e:
                        if isinstance(e, RankFailure) or getattr(eng.runner, "running", False):
                            raise       # inside a broadcast step: the other ranks may wait in its collectives
                        # a refusal before any rank ran the step: the other ranks wait at the next
                        # broadcast, so every live sequence ends (as one process's server ends them)
                        # and the group keeps serving
                        for s in list(seqs.values()):
                            eng.cancel(s)
                        conn.send(("step-failed", e, sorted(seqs)))
                        seqs.clear()
                        continue
                    for s in finished:
                        seqs.pop(s.id, None)
                    conn.send(("stepped", list(chosen), [(s.id, s.finish_reason) for s in finished], describe(eng),
                               list(rows)))
                else:                                 # ("end",)
                    break
        ended = True
    finally:
        try:
            eng.runner.stop()
        except Exception:  # noqa: BLE001 - a broken group: the error that broke it is raised
            if ended:
                raise
    stats = {k: v - counts.get(k, 0) for k, v in eng.stats.items()}
    conn.send(("ok", None, rd._meta(before, stats=stats)))


def start_info(eng: Any) -> dict[str, Any]:
    """What the caller needs of rank 0's engine before its first request: the contract's
    bounds, the pool's layout, the proof and the facts it was checked against."""
    lay = eng.layout
    return {"cfg": dict(eng.cfg), "max_prompt": eng.max_prompt, "min_prompt": eng.min_prompt, "context": eng.context,
            "layout": {"max_tokens": lay.max_tokens, "sequence_tokens": lay.sequence_tokens, "pages": lay.pages,
                       "page_size": lay.page_size,
                       "max_pages_per_seq": lay.max_pages_per_seq, "batch_buckets": list(eng.batch_buckets)},
            "kv_pool_bytes": eng.cache.bytes,       # a loaded .gm's engine was not lowered here: no facts or proof
            "facts": getattr(eng.lowered, "facts", None), "proof": getattr(eng.lowered, "proof", None),
            "view": describe(eng)}


def describe(eng: Any) -> dict[str, Any]:
    """What the caller mirrors of rank 0's engine after each message."""
    return {"stats": dict(eng.stats), "running": [s.id for s in eng.running], "waiting": [s.id for s in eng.waiting],
            "used_pages": eng.cache.used_pages}


class RemoteEngine:
    """Rank 0's decode engine seen from the calling process (module doc). Built by
    `TensorParallelDecoder.engine()`; `close()` ends rank 0's loop (the group stays up)."""

    def __init__(self, tp: Any, info: dict[str, Any]):
        self.tp = tp
        self.lock = threading.RLock()
        self.cfg = dict(info["cfg"])
        self.max_prompt, self.min_prompt, self.context = info["max_prompt"], info["min_prompt"], info["context"]
        self.layout = SimpleNamespace(**info["layout"])
        self.cache = SimpleNamespace(layout=self.layout, used_pages=0, bytes=info["kv_pool_bytes"])
        self.lowered = SimpleNamespace(facts=info["facts"], proof=info["proof"]) \
            if info["proof"] is not None else None        # rank 0's shard's (None: loaded from its .gm)
        self.speculator = None
        self._on_logits: Callable[[Sequence_, torch.Tensor], None] | None = None
        self._live: dict[int, Sequence_] = {}
        self._view: dict[str, Any] = info["view"]
        self._wait_s = tp.timeout_s + MARGIN_S
        self._open = True
        self._shut = False

    # ---- the engine's interface ------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return bool(self._live) and self.tp._down is None

    @property
    def running(self) -> list[Sequence_]:
        return [self._live[i] for i in self._view["running"] if i in self._live]

    @property
    def waiting(self) -> list[Sequence_]:
        return [self._live[i] for i in self._view["waiting"] if i in self._live]

    @property
    def stats(self) -> dict[str, int]:
        return dict(self._view["stats"])

    @property
    def batch_buckets(self) -> list[int]:
        return list(self.layout.batch_buckets)

    def room(self, prompt: int) -> int:
        """New tokens a prompt of `prompt` tokens leaves (DecodeEngine.room)."""
        return min(self.layout.sequence_tokens, self.context or self.layout.max_tokens) - prompt

    @property
    def on_logits(self) -> Callable[[Sequence_, torch.Tensor], None] | None:
        return self._on_logits

    @on_logits.setter
    def on_logits(self, hook: Callable[[Sequence_, torch.Tensor], None] | None) -> None:
        """Every step's logit rows come back from rank 0 to `hook` (a verification hook, as
        DecodeEngine.on_logits); None stops them."""
        with self.lock:
            self._check_open()
            self.tp.send({0: ("logits", hook is not None)})
            self._on_logits = hook

    def prepare(self, rows: int, longest: int) -> None:
        """Every rank built every bucket's plan before it reported ready."""

    def warmup(self, built: Any = None) -> None:
        """As `prepare`."""

    def add(self, prompt: Sequence[int], params: Any, on_token: Callable[[int, int], None] | None = None
            ) -> Sequence_:
        """Queue a sequence on rank 0's engine (it runs from the next step); raises the engine's
        refusal (ContractViolation, ...) as it would, or RankFailure when the group is down."""
        with self.lock:
            self._check_open()
            self.tp.send({0: ("add", [int(t) for t in prompt], params)})
            rep = self._reply("add")
            if rep[0] == "refused":
                raise rep[1]
            s = Sequence_(rep[1], [int(t) for t in prompt], params, on_token=on_token)   # a mirror of rank 0's
            self._live[s.id] = s
            return s

    def cancel(self, s: Sequence_) -> None:
        """End `s` now ("cancelled" unless it had a reason); rank 0 frees its pages before the next step."""
        with self.lock:
            if self._live.pop(s.id, None) is None:
                return
            s.state, s.finish_reason = "finished", s.finish_reason or "cancelled"
            if self._open and self.tp._down is None:
                self.tp.send({0: ("cancel", s.id)})

    def step(self) -> list[Sequence_]:
        """One step of rank 0's engine on every rank; the chosen tokens reach their sequences'
        `on_token` here. Returns the sequences that finished in it."""
        with self.lock:
            self._check_open()
            self.tp.send({0: ("step",)})
            rep = self._reply("decode step")
            if rep[0] == "step-failed":          # rank 0 ended every live sequence; the group is up
                for sid in rep[2]:
                    s = self._live.pop(sid, None)
                    if s is not None:
                        s.state, s.finish_reason = "finished", "error"
                raise rep[1]
            _, chosen, ended, view, rows = rep
            for sid, row in rows:
                if self._on_logits is not None and sid in self._live:
                    self._on_logits(self._live[sid], row)
            for sid, tok, lp in chosen:
                s = self._live.get(sid)
                if s is None:                     # cancelled here meanwhile
                    continue
                s.generated.append(tok)
                if lp is not None:
                    s.logprobs.append(lp)
                if s.on_token is not None:
                    s.on_token(sid, tok)
            finished = []
            for sid, reason in ended:
                s = self._live.pop(sid, None)
                if s is not None:
                    s.state, s.finish_reason = "finished", reason
                    finished.append(s)
            self._view = view
            self.cache.used_pages = view["used_pages"]
            return finished

    # ---- the group ---------------------------------------------------------------------------------
    def health(self) -> str | None:
        """None while every rank is up; else why not (the group is then stopped). Never waits
        for a step: between steps it also reads an error rank 0 reported (a failed keep-alive)."""
        tp = self.tp
        if tp.down() is not None:
            return tp._down
        if self.lock.acquire(blocking=False):
            try:
                if tp._down is None and tp.conns[0].poll():
                    tp._read(0)                  # an error: the group is stopped and it is raised
            except Exception as e:  # noqa: BLE001 - the rank's error: the group is stopped, said below
                if tp._down is None:
                    tp._stop(str(e).splitlines()[0])
            finally:
                self.lock.release()
        return tp._down

    def ranks(self) -> list[dict[str, Any]]:
        """Per rank: its pid and whether its process is alive."""
        return self.tp.rank_states()

    def close(self) -> dict[str, Any] | None:
        """End rank 0's loop and release the other ranks (the group stays up for other work);
        rank 0's counts of the whole session, or None when the group was down."""
        with self.lock:
            if not self._open:
                return None
            self._open = False
            for s in list(self._live.values()):
                s.state, s.finish_reason = "finished", "cancelled"
            self._live.clear()
            tp = self.tp
            if tp._down is not None:
                return None
            tp.send({0: ("end",)})
            replies = tp.collect(list(range(tp.world)), self._wait_s, "end of the decode loop")
            return replies[0][2]

    def shutdown(self) -> None:
        """`close()`, then stop every rank process (bounded: a rank that does not leave is killed).
        Once: later calls do nothing."""
        if self._shut:
            return
        self._shut = True
        try:
            self.close()
        except Exception:  # noqa: BLE001 - a broken group: it is stopped below all the same
            pass
        self.tp.close()

    def _check_open(self) -> None:
        if not self._open:
            raise RankFailure("this tensor-parallel decode engine was closed", where="parallel",
                              fix="start the group again (graphmode.compile with the recipe)")

    def _reply(self, what: str) -> Any:
        """Rank 0's answer. An error there (a refusal comes back as "refused") ended its decode
        loop, so the ranks no longer follow this engine's messages: the group is stopped and the
        call fails as a group failure, not as an answer read out of step."""
        rep = self.tp.receive(0, self._wait_s, what)
        if rep[0] == "error":
            self._open = False
            err = rep[1]
            why = f"rank 0's decode loop ended at the {what}: {type(err).__name__}: {str(err).splitlines()[0][:300]}"
            self.tp._stop(why)
            raise RankFailure(why, where="parallel", fix="the group is stopped; start it again (and see the error "
                              "above: a bug to report where it is not the request's)") from None
        return rep
