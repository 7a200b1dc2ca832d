"""A request's waits end with the shutdown: the batcher stops waiting for a batch to fill once it
is flushed, and a wait still open when the shutdown grace is over answers 503 (NotReady), not a
cancellation that uvicorn turned into a plain-text 500 and a traceback (trial U)."""
from __future__ import annotations

import asyncio
import time

import pytest

from graphmode.serve.batching import Batcher
from graphmode.serve.errors import NotReady
from graphmode.serve.serving import Serving


class _Pending:
    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.future = loop.create_future()
        self.alone, self.rows, self.deployment, self.arrived = False, 1, None, time.perf_counter()


def test_a_flushed_batcher_runs_the_batch_it_was_waiting_to_fill():
    async def main() -> list:
        ran: list = []
        b = Batcher(lambda live: ran.extend(live) or [None] * len(live), lambda dep: 8, window_s=3600.0,
                    executor=None)
        b.start()
        p = _Pending(asyncio.get_running_loop())
        b.submit(p)
        for _ in range(100_000):                           # until taken, waiting for the hour's window
            if b.depth() == 1 and b.queue.empty():
                break
            await asyncio.sleep(0)
        assert b.queue.empty()
        b.flush()
        await asyncio.wait_for(p.future, 60)
        await b.stop()
        return ran
    assert len(asyncio.run(main())) == 1


def test_a_wait_open_when_the_grace_is_over_answers_503():
    class Server(Serving):
        def __init__(self) -> None:
            self._ending = asyncio.Event()

    async def main() -> None:
        s = Server()
        never = asyncio.get_running_loop().create_future()
        waiting = asyncio.ensure_future(s._until(never, time.monotonic() + 3600))
        await asyncio.sleep(0)
        s._ending.set()                   # ModelServer.end_requests
        with pytest.raises(NotReady, match="shutting down"):
            await waiting
        assert never.cancelled()
        with pytest.raises(asyncio.TimeoutError):          # the request's own deadline is still a timeout
            await Server()._until(asyncio.get_running_loop().create_future(), time.monotonic())
        queued = asyncio.get_running_loop().create_future()
        gone = asyncio.ensure_future(Server()._until(queued, time.monotonic() + 3600))
        await asyncio.sleep(0)
        gone.cancel()                     # the client went away: its queued request is not run
        with pytest.raises(asyncio.CancelledError):
            await gone
        assert queued.cancelled()
    asyncio.run(main())

