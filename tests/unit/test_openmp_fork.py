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


CHILD_RUNS = r"""
import os, sys, threading, torch, graphmode
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256)).eval()
x = torch.randn(64, 256)
rec = {"version": 1, "name": "fork", "inputs": [{"name": "input", "dtype": "f32", "shape": ["batch", 256]}],
       "dims": {"batch": {"buckets": [64]}}, "exe_mode": "graph"}
cm = graphmode.compile((m, {"input": x}, {"input": ["batch", 256]}), rec, cache_dir=sys.argv[1])
with torch.inference_mode():
    want = m(x)
assert (cm(input=x) - want).norm() / want.norm() < 1e-5
stop = threading.Event()
def calls():                     # threads in the middle of calls when the process forks
    while not stop.is_set():
        cm(input=x)
busy = [threading.Thread(target=calls) for _ in range(2)]
for t in busy:
    t.start()
pid = os.fork()
if pid == 0:
    ok = (cm(input=x) - want).norm() / want.norm() < 1e-5 and torch.get_num_threads() == 1
    os._exit(0 if ok else 3)
_, status = os.waitpid(pid, 0)
stop.set()
for t in busy:
    t.join()
print("child", os.waitstatus_to_exitcode(status))
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork() on this platform")
def test_a_child_forked_while_threads_call_a_plan_runs_it_on_one_thread(tmp_path):
    """Trial AC: without GOMP_SPINCOUNT bounded (a plain program), a child forked after its
    parent ran a plan hung in the kernel's first parallel loop (libgomp's team is gone), and one
    forked while other threads were calling hung on the plan's lock. The child runs the plan on
    one thread, as PyTorch's DataLoader runs its forked workers."""
    import subprocess
    import sys
    from pathlib import Path
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    out = subprocess.run([sys.executable, "-c", CHILD_RUNS, str(tmp_path)], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and out.stdout.split()[-2:] == ["child", "0"], out.stdout + out.stderr[-2000:]
