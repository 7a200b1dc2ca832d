"""The decode thread of a decoder deployment: one thread runs the engine's `drive` loop, the
event loop gets tokens.

`DecodeEngine.step()` holds the engine's lock for a whole step (a prefill or a decode over
every running sequence), so the event loop never calls into the engine: a request's
sequences are added from a worker thread (`submit`, which raises the engine's refusals:
prompt longer than the contract, more tokens than a sequence's pages, bad token ids) and
cancelled through an inbox the loop thread reads between steps. The loop thread sleeps on
a Condition while there is no work (no busy loop) and, once its deployment is retired,
ends when the last sequence has finished (a later `submit` starts it again), so a retired
deployment's engine and KV pool become garbage.

Each token reaches its request's asyncio queue through `loop.call_soon_threadsafe`. Times
are taken on the loop thread as tokens are emitted and exported with vLLM's definitions:
TTFT = arrival -> first token, ITL = gap between two tokens of a sequence, TPOT =
(e2e - TTFT) / (tokens - 1), e2e = arrival -> last token, queue time = arrival -> the
step that admitted the sequence.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any, Sequence

from graphmode.decode.engine import DecodeEngine, drive
from graphmode.decode.output import stop_reason
from graphmode.decode.scheduler import Sequence_
from graphmode.decode.sampling import SamplingParams
from graphmode.errors import RankFailure
from graphmode.monitor.prom import DecodeSeries
from graphmode.serve.errors import NotReady, ServerFault

log = logging.getLogger("graphmode.serve")


class Generation:
    """One prompt's sequence as a request sees it. Events on `queue` (for `request`'s merged
    queue when several prompts share one): ("token", index, (token, its logprobs or None, why
    the sequence ends with it or None)), ("done", index, reason), ("error", index, exception)."""

    def __init__(self, index: int, prompt: Sequence[int], arrived: float, queue: asyncio.Queue,
                 loop: asyncio.AbstractEventLoop, series: DecodeSeries | None):
        self.index = index
        self.prompt_len = len(prompt)
        self.arrived = arrived
        self.queue = queue
        self.loop = loop
        self.series = series
        self.seq: Sequence_ | None = None
        self.tokens = 0
        self.first_at: float | None = None
        self.last_at: float | None = None
        self.admitted = False
        self.finish_reason: str | None = None     # set on the loop thread when the sequence ends

    # ---- loop thread ----------------------------------------------------------------------
    def on_token(self, seq_id: int, token: int) -> None:
        now = time.perf_counter()
        s = self.series
        if self.first_at is None:
            self.first_at = now
            if s is not None:
                s.ttft.observe(now - self.arrived)
        elif s is not None:
            s.itl.observe(now - self.last_at)
        self.last_at = now
        self.tokens += 1
        if s is not None:
            s.generation_tokens.inc()
        lp = self.seq.logprobs[-1] if self.seq is not None and self.seq.params.logprobs is not None else None
        # Why the sequence ends with this token rides with it: the "done" event is posted after
        # the step, and a stream that took the token first would end on an empty event.
        last = stop_reason(self.seq) if self.seq is not None and self.seq.generated else None
        self.post(("token", self.index, (token, lp, last)))

    def finish(self, reason: str, error: BaseException | None = None) -> None:
        if self.finish_reason is not None:
            return
        self.finish_reason = reason
        s = self.series
        if s is not None:
            s.finish(reason)
            if reason != "cancelled" and reason != "error" and self.first_at is not None:
                e2e = self.last_at - self.arrived
                s.e2e.observe(e2e)
                if self.tokens > 1:
                    s.tpot.observe((self.last_at - self.first_at) / (self.tokens - 1))
        self.post(("error", self.index, error) if error is not None else ("done", self.index, reason))

    def post(self, event: tuple) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)
        except RuntimeError:              # the event loop has closed: nobody is listening
            pass


class DecodeLoop:
    """The thread that runs `engine.step()` for one deployment while it has work."""

    def __init__(self, engine: DecodeEngine, series: DecodeSeries | None = None, *, name: str = "decode"):
        self.engine = engine
        self.series = series
        self.name = name
        self._cond = threading.Condition()
        self._live: dict[int, Generation] = {}          # engine sequence id -> its generation
        self._cancels: list[tuple[Generation, str]] = []
        self._thread: threading.Thread | None = None
        self._retired = False                         # end once idle
        self._stopped = False                         # end now
        self._totals = dict(engine.stats)               # the engine's running totals the counters have seen

    # ---- event loop side --------------------------------------------------------------------
    def submit(self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams],
               arrived: float, queue: asyncio.Queue, loop: asyncio.AbstractEventLoop) -> list[Generation]:
        """Add one sequence per prompt, all before the next step (so they can share its
        prefill). Blocks up to one engine step: call it off the event loop. Raises the
        engine's ContractViolation / GraphmodeError for a prompt it refuses, with the prompt's
        position as `prompt_index`; then none of the prompts is added."""
        if self._stopped:
            raise NotReady("the server is shutting down", where="request",
                           fix="send the request to the server that replaces this one")
        gens = [Generation(i, p, arrived, queue, loop, self.series) for i, p in enumerate(prompts)]
        each = [params] * len(gens) if isinstance(params, SamplingParams) else list(params)
        with self.engine.lock:                     # registered before the loop thread can finish them
            for g, prompt, p in zip(gens, prompts, each):
                try:
                    g.seq = self.engine.add(prompt, p, on_token=g.on_token)
                except Exception as e:
                    try:
                        for added in gens[:g.index]:
                            self.engine.cancel(added.seq)
                            self._live.pop(added.seq.id, None)
                    except RankFailure:
                        pass
                    if isinstance(e, RankFailure):
                        raise ranks_down(e) from None
                    e.prompt_index = g.index          # type: ignore[attr-defined]
                    raise
                self._live[g.seq.id] = g
        with self._cond:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True, name=f"graphmode-{self.name}")
                self._thread.start()
            self._cond.notify()
        if self.series is not None:
            self.series.waiting.set(len(self.engine.waiting))
        return gens

    def cancel(self, g: Generation, reason: str = "cancelled") -> None:
        """End the sequence and give its pages back at the next step boundary (never blocks the
        caller); `reason` is what the metrics count ("stop" when a stop string matched)."""
        if g.finish_reason is None and g.seq is not None:
            with self._cond:
                self._cancels.append((g, reason))
                self._cond.notify()

    def retire(self) -> None:
        """The deployment was swapped out: finish what is running, then let the thread end
        (a tensor-parallel engine's ranks stop then)."""
        with self._cond:
            self._retired = True
            idle = self._thread is None
            self._cond.notify()
        if idle:
            self._shutdown_engine()

    def _shutdown_engine(self) -> None:
        """A tensor-parallel engine (decode/tp_engine.py) stops its rank processes; an engine of
        this process becomes garbage with its deployment."""
        shutdown = getattr(self.engine, "shutdown", None)
        if shutdown is not None:
            shutdown()

    def health(self) -> str | None:
        """None while the engine can serve; for a tensor-parallel engine, why its ranks cannot."""
        check = getattr(self.engine, "health", None)
        return check() if check is not None else None

    def stop(self, timeout: float = 5.0) -> None:
        """Shutdown: the thread ends after its current step; unfinished requests get a 503 error."""
        with self._cond:
            self._stopped = True
            thread = self._thread
            self._cond.notify()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        self._shutdown_engine()

    # ---- loop thread --------------------------------------------------------------------------
    def _run(self) -> None:
        eng = self.engine
        while True:
            with self._cond:
                while not (eng.has_work or self._cancels or self._stopped):
                    if self._retired:
                        self._thread = None
                        threading.Thread(target=self._shutdown_engine, daemon=True).start()
                        return
                    self._cond.wait()
            if self._between_steps():
                return
            started = time.perf_counter()
            try:
                for finished in drive(eng):           # the engine's steps while it has work
                    self._finished(finished, started)
                    self._gauges()
                    if self._between_steps():
                        return
                    started = time.perf_counter()     # the next step starts when the loop resumes drive
            except RankFailure as e:      # a rank died or hung: the group is stopped, requests get a 503
                log.error("decode step failed: %s", e.message)
                self._fail_all(ranks_down(e))
            except Exception as e:  # noqa: BLE001 - the requests get a 500, the loop keeps serving
                log.exception("decode step failed")
                self._fail_all(ServerFault(f"decode step failed: {type(e).__name__}: {e}", where="decode"))
            self._gauges()

    def _between_steps(self) -> bool:
        """Apply the cancels asked for since the last step; True when the server has stopped
        (every live sequence then fails with a 503 and the thread ends)."""
        with self._cond:
            cancels, self._cancels = self._cancels, []
            stopped = self._stopped
        if stopped:
            self._fail_all(NotReady("the server shut down before the sequence finished", where="request",
                                    fix="send the request again to the server that replaces this one"))
            with self._cond:
                self._thread = None
            return True
        for g, reason in cancels:
            self._drop(g, reason)
        return False

    def _finished(self, finished: list[Sequence_], started: float) -> None:
        """After a step that began at `started`: queue times of the sequences it prefilled, the
        end of those that finished."""
        s = self.series
        for g in list(self._live.values()):
            if not g.admitted and g.first_at is not None:       # prefilled in this step
                g.admitted = True
                if s is not None:
                    s.queue_time.observe(started - g.arrived)
                    s.prompt_tokens.inc(g.prompt_len)
        for seq in finished:
            g = self._live.pop(seq.id, None)
            if g is not None:
                g.finish(seq.finish_reason or "length")

    def _drop(self, g: Generation, reason: str, error: BaseException | None = None) -> None:
        if g.seq is not None and self._live.pop(g.seq.id, None) is not None:
            self.engine.cancel(g.seq)
            g.finish(reason, error)

    def _fail_all(self, error: BaseException) -> None:
        for g in list(self._live.values()):
            self._drop(g, "error", error)

    def _gauges(self) -> None:
        """Loop thread only (the preemption, prefix cache and draft counts are differences of the
        engine's running totals)."""
        s = self.series
        if s is None:
            return
        eng = self.engine
        s.running.set(len(eng.running))
        s.waiting.set(len(eng.waiting))
        s.kv_usage.set(eng.cache.used_pages / max(1, eng.cache.layout.pages))
        stats = eng.stats
        for key, counter in s.counted().items():
            if key in stats:
                grown = stats[key] - self._totals.get(key, 0)
                if grown > 0:
                    counter.inc(grown)
        self._totals = dict(stats)

    @property
    def live(self) -> int:
        return len(self._live)

    def describe(self) -> dict[str, Any]:
        eng = self.engine
        out = {"running": len(eng.running), "waiting": len(eng.waiting), "kv_pages_used": eng.cache.used_pages,
               "kv_pages": eng.cache.layout.pages, "vocab": eng.cfg.get("vocab"), "max_prompt_tokens": eng.max_prompt,
               "max_tokens_per_sequence": eng.layout.max_tokens, **eng.stats}
        if hasattr(eng, "ranks"):                 # tensor-parallel: the group's processes
            out["ranks"] = eng.ranks()
        return out


def ranks_down(e: RankFailure) -> NotReady:
    """A tensor-parallel group's failure as the request sees it: 503, the rank and the cause named."""
    return NotReady(f"the tensor-parallel ranks are down: {e.message}", where="parallel",
                    fix="the server cannot answer until it is restarted (its /healthz fails); send the request to "
                        "another server")
