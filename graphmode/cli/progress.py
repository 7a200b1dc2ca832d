"""How the CLI shows the library's progress events (graphmode/progress.py), always on stderr:
stdout holds the command's results, so `--json` output stays clean JSON whatever is shown.

- stderr is a terminal: a rich progress display (spinner, stage, bar, "N of M", elapsed, ETA),
  each finished stage left as one line above it;
- stderr is a pipe or a file (CI logs, `2> log`): plain single lines, a stage's start, its steps
  (at most one a second: "plans 3 of 12: batch=4 (built) [6.2s, ETA 18.6s]") and its end with its time;
- `graphmode --no-progress ...`: nothing.

    with progress() as on_stage:
        cm = graphmode.compile(model, recipe, on_stage=on_stage)
        cm.warmup()
"""
from __future__ import annotations

import sys
import time
from contextlib import ExitStack, contextmanager
from typing import Callable, Iterator, Optional

from graphmode.progress import OnStage, Stage

LINE_EVERY_S = 1.0          # plain lines: at most one step line a second per stage
PREFIX = "graphmode: "
_settings = {"enabled": True}


def set_enabled(enabled: bool) -> None:
    """`graphmode --no-progress` turns every command's progress off."""
    _settings["enabled"] = enabled


def _is_tty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _eta(s: Stage) -> Optional[float]:
    if not s.total or not s.done or s.done >= s.total:
        return None
    return s.seconds / s.done * (s.total - s.done)


def _secs(x: float) -> str:
    return f"{x:.1f}s" if x < 60 else f"{int(x // 60)}m{int(x % 60):02d}s"


class PlainLines:
    """Progress as plain lines through `write` (one call per line)."""

    def __init__(self, write: Callable[[str], None], every_s: float = LINE_EVERY_S, clock=time.monotonic):
        self.write, self.every_s, self.clock = write, every_s, clock
        self._last: dict[str, float] = {}        # stage -> when its last step line was written
        self._detail: dict[str, str] = {}        # stage -> its last step's detail

    def __call__(self, s: Stage) -> None:
        if s.finished:
            done = f" ({s.done} of {s.total})" if s.total and s.total > 1 else ""
            last = self._detail.pop(s.name, "") if s.total == 1 else ""
            self._last.pop(s.name, None)
            self.write(f"{PREFIX}{s.name}{' ' + last if last else ''} done in {_secs(s.seconds)}{done}")
        elif s.done == 0:
            todo = f" 0 of {s.total}" if s.total and s.total > 1 else ""
            self.write(f"{PREFIX}{s.name}{' ' + s.detail if s.detail else ''}{todo} ...")
            self._last[s.name] = self.clock()
        elif s.total == 1:                     # a one-step stage: its end says it all
            self._detail[s.name] = s.detail
        else:
            now = self.clock()
            if now - self._last.get(s.name, 0.0) < self.every_s:
                return
            self._last[s.name] = now
            of = f" of {s.total}" if s.total else ""
            eta = _eta(s)
            self.write(f"{PREFIX}{s.name} {s.done}{of}{': ' + s.detail if s.detail else ''} "
                       f"[{_secs(s.seconds)}{', ETA ' + _secs(eta) if eta is not None else ''}]")


class LiveDisplay:
    """Progress as a rich display on a terminal: one task per running stage; a finished stage
    leaves a line ("capture 3.1s") above the display."""

    def __init__(self, console, auto_refresh: bool = True):
        from rich.progress import (BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn,
                                   TimeRemainingColumn)
        self.console = console
        self.bar = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                            TextColumn("{task.fields[count]}"), TimeElapsedColumn(), TextColumn("ETA"),
                            TimeRemainingColumn(), console=console, transient=True, auto_refresh=auto_refresh,
                            # warnings and stray writes print above the display; stdout only when it is
                            # this terminal too (a piped stdout holds results and must not get them)
                            redirect_stderr=True, redirect_stdout=_is_tty(sys.stdout))
        self.auto_refresh = auto_refresh
        self._tasks: dict[str, int] = {}

    def __enter__(self) -> "LiveDisplay":
        self.bar.start()
        return self

    def __exit__(self, *exc) -> None:
        self.bar.stop()

    def __call__(self, s: Stage) -> None:
        task = self._tasks.get(s.name)
        if s.finished:
            if task is not None:
                self.bar.remove_task(task)
                del self._tasks[s.name]
            count = f" ({s.done} of {s.total})" if s.total and s.total > 1 else ""
            self.console.print(f"[green]✓[/] {s.name}{count} [dim]{_secs(s.seconds)}[/]", highlight=False)
            return
        text = f"{s.name}{': ' + s.detail if s.detail else ''}"
        count = f"{s.done} of {s.total}" if s.total else ""
        if task is None:
            self._tasks[s.name] = self.bar.add_task(text, total=s.total, completed=s.done, count=count)
        else:
            self.bar.update(task, description=text, completed=s.done, count=count)
        if not self.auto_refresh:
            self.bar.refresh()


class _Open:
    """Passes events on while its `progress()` block runs and drops them after: a model keeps
    the callback, and a plan it builds later (mid-output) must not draw."""

    def __init__(self, show: OnStage):
        self.show: Optional[OnStage] = show

    def __call__(self, s: Stage) -> None:
        if self.show is not None:
            self.show(s)


@contextmanager
def progress(live: Optional[bool] = None, measuring: bool = False) -> Iterator[Optional[OnStage]]:
    """The callback to hand the library (None when progress is off). `live`: a rich display
    (default: when stderr is a terminal); False: plain lines even on a terminal (for commands
    whose own output, such as a server's log, shares stderr). `measuring`: the command times
    things meanwhile, so the display redraws only on events (no refresh thread taking a core)."""
    from graphmode.cli.app import err_console
    if not _settings["enabled"]:
        yield None
        return
    if live is None:
        live = err_console.is_terminal
    with ExitStack() as stack:
        show = stack.enter_context(LiveDisplay(err_console, auto_refresh=not measuring)) if live else \
            PlainLines(lambda line: err_console.print(line, markup=False, highlight=False, soft_wrap=True))
        gate = _Open(show)
        try:
            yield gate
        finally:
            gate.show = None
