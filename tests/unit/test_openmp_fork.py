"""A plan build in a child forked after its parent ran OpenMP (graphmode/openmp.py): refused,
naming warm-up before the fork or the spawn start method, where it hung for ever in libgomp."""
from __future__ import annotations

import os

import pytest

from graphmode import openmp
from graphmode.errors import GraphmodeError


def _child_refuses() -> int:
    """The exit code of a forked child that asks to build: 0 refused, 1 allowed, 2 another error."""
    pid = os.fork()
    if pid == 0:                                   # the child touches no OpenMP: it only asks
        try:
            openmp.check_fork_safe("building the plan of bucket {'batch': 3}")
            code = 1
        except GraphmodeError as e:
            code = 0 if "spawn" in e.fix and "cm.warmup()" in e.fix else 2
        except BaseException:  # noqa: BLE001 - whatever it is, the child must exit here
            code = 2
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork() on this platform")
def test_a_child_forked_after_a_build_refuses_to_build(monkeypatch):
    monkeypatch.setitem(openmp._STATE, "ran", False)
    monkeypatch.setitem(openmp._STATE, "forked_after_run", False)
    assert _child_refuses() == 1                   # the parent built nothing: the child may build
    openmp.ran_parallel()
    assert _child_refuses() == 0
    openmp.check_fork_safe("this process, the parent")   # the parent itself builds on
