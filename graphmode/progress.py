"""Progress of long work, reported to a callback the caller passes in: the library reports,
the caller formats (the CLI's graphmode/cli/progress.py draws a bar on a terminal and prints
plain lines to a pipe). Library code never prints progress itself.

    def on_stage(s: Stage) -> None:
        print(s.name, s.done, s.total, s.detail, s.finished)

    cm = graphmode.compile(model, recipe, on_stage=on_stage)     # capture, passes, proof
    cm.warmup()                                                  # plans, bucket N of M

A stage is reported as a start (done 0), one event per finished step (its `detail` says which:
a pass name, a bucket), and an end (`finished`). A stage that fails raises and has no end.
Stage names: capture, passes, proof (`compiler.lower_model`, the decode engine's graph too),
plans (`CompiledModel.warmup`, `save`, the decode engine's prepare and warm-up, and a plan
built on first use).
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Optional


@dataclass(frozen=True)
class Stage:
    """One progress event of a named stage."""

    name: str
    done: int = 0                  # steps finished so far
    total: Optional[int] = None    # steps in the stage, when known
    detail: str = ""               # the step just finished (or, at the start, what the stage works on)
    finished: bool = False         # the stage ended
    seconds: float = 0.0           # since the stage started


OnStage = Callable[[Stage], None]


class StageReporter:
    """Reports the steps of one running stage; `step(detail)` after each finished step."""

    def __init__(self, on_stage: OnStage | None, name: str, total: int | None, detail: str):
        self.on_stage, self.name, self.total, self.detail = on_stage, name, total, detail
        self.done = 0
        self.t0 = time.perf_counter()

    def _emit(self, detail: str, finished: bool = False) -> None:
        if self.on_stage is not None:
            self.on_stage(Stage(self.name, self.done, self.total, detail, finished, time.perf_counter() - self.t0))

    def start(self) -> None:
        self._emit(self.detail)

    def step(self, detail: str = "") -> None:
        self.done += 1
        self._emit(detail)

    def finish(self, detail: str = "") -> None:
        self._emit(detail or self.detail, finished=True)


@contextmanager
def stage(on_stage: OnStage | None, name: str, total: int | None = None, detail: str = "") -> Iterator[StageReporter]:
    """Report stage `name` around the block: started, each `step()`, finished (not on an error)."""
    rep = StageReporter(on_stage, name, total, detail)
    rep.start()
    yield rep
    rep.finish()


class PassProgress:
    """A pass-manager instrument (passes/manager.py) that reports each finished pass as a step
    of the `passes` stage."""

    def __init__(self, reporter: StageReporter):
        self.reporter = reporter

    def before_pass(self, name, index, graph, ctx) -> None:
        pass

    def after_pass(self, name, index, result, seconds, ctx) -> None:
        self.reporter.step(name)
