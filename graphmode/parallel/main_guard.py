"""Refuse to spawn ranks from a script's unguarded top level, before any rank starts.

The ranks start by `spawn`, which imports the caller's script again in every rank: a
`graphmode.compile` at its top level would run again there, where multiprocessing refuses to
start processes ("An attempt has been made to start a new process before the current process
has finished its bootstrapping phase"), and the caller saw only "rank 1 exited with code 1".
Python's own fix is the `if __name__ == "__main__":` guard; this finds a call that lacks it.
"""
from __future__ import annotations

import ast
import sys
from functools import lru_cache
from pathlib import Path
from types import FrameType

from graphmode.errors import GraphmodeError


@lru_cache(maxsize=8)
def _guarded_lines(path: str) -> tuple[tuple[int, int], ...]:
    """Line spans of the file's `if __name__ == "__main__":` blocks."""
    try:
        tree = ast.parse(Path(path).read_text(encoding="utf-8"), path)
    except (OSError, SyntaxError, ValueError):
        return ((1, 10**9),)                 # cannot tell: trust the script
    spans = []
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "__name__" in ast.unparse(node.test) and "__main__" in ast.unparse(node.test):
            spans.append((node.lineno, node.end_lineno or node.lineno))
    return tuple(spans)


def _main_module_frame(frame: FrameType | None) -> FrameType | None:
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__") == "__main__":
            return frame
        frame = frame.f_back
    return None


def check_main_guard(frame: FrameType | None = None) -> None:
    """Raise when this call comes from the top level of a script file outside its main guard."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    spec = getattr(getattr(main, "__spec__", None), "name", None) or ""
    if not path or not str(path).endswith(".py") or spec == "__main__" or spec.endswith(".__main__"):
        return        # python -c, a REPL, a notebook, `python -m package`: spawn does not run them again
    top = _main_module_frame(frame or sys._getframe(1))
    if top is None or Path(top.f_code.co_filename).resolve() != Path(path).resolve():
        return
    line = top.f_lineno
    if any(lo <= line <= hi for lo, hi in _guarded_lines(str(Path(path).resolve()))):
        return
    raise GraphmodeError(f"the tensor-parallel ranks start by spawn, which imports {Path(path).name} again in every "
                         f"rank: its line {line} (outside `if __name__ == \"__main__\":`) would start them again there",
                         where=f"{path}:{line}",
                         fix="put the script's top-level code under `if __name__ == \"__main__\":` (what "
                             "multiprocessing and torch.distributed scripts need)")
