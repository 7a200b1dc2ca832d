"""`bench --contend N`: the burner processes' lifecycle (started paused, resumed and paused per
phase, killed on every way out, gone when the bench dies), the harness's quiet and contended
rows of the same rounds, and the report that puts them side by side. Real processes, real
signals; tests wait for process states, never for fixed times, and assert nothing on speed."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from graphmode.bench import harness
from graphmode.bench.contend import Burners, Phases
from graphmode.bench.harness import BenchResult
from graphmode.bench.models import ModelCase
from graphmode.bench.quality import Probe, judge, warning_lines
from graphmode.bench.report import contended_goals, goals, markdown, rich_table
from graphmode.errors import GraphmodeError

TINY = f"{Path(__file__).resolve().parent / 'test_bench.py'}:tiny_mlp"
QUIET = Probe(loadavg=lambda: [0.1, 0.1, 0.1], waited=lambda: 0.0, cores=2)
DEADLINE_S = 60.0


def _state(pid: int) -> str | None:
    """The process state letter from /proc (R, S, T, Z, ...), None once it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text.rsplit(")", 1)[1].split()[0]


def _until(pred, what: str) -> None:
    end = time.monotonic() + DEADLINE_S
    while not pred():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def _gone(pid: int) -> bool:
    return _state(pid) in (None, "Z", "X")


def test_burners_start_paused_spin_on_resume_and_die_on_stop():
    b = Burners(2, lifetime_s=120)
    with b:
        pids = b.alive()
        assert len(pids) == 2 and not b.running
        _until(lambda: all(_state(p) == "T" for p in pids), "paused burners")
        b.resume()
        _until(lambda: all(_state(p) in ("R", "S") for p in pids), "running burners")
        b.pause()
        _until(lambda: all(_state(p) == "T" for p in pids), "paused burners again")
    assert b.alive() == [] and all(_gone(p) for p in pids)


def test_burners_are_killed_when_the_block_raises():
    b = Burners(1, lifetime_s=120)
    with pytest.raises(RuntimeError):
        with b:
            pid = b.alive()[0]
            b.resume()
            raise RuntimeError("an engine failed")
    assert _gone(pid)


def test_a_burner_ends_at_its_lifetime():
    b = Burners(1, lifetime_s=0.2).start()
    try:
        pid = b.alive()[0]
        b.resume()
        _until(lambda: b.procs[0].poll() is not None, "the burner to end at its lifetime")
        assert b.procs[0].returncode == 0
    finally:
        b.stop()
    assert _gone(pid)


def test_burners_die_with_a_killed_bench(tmp_path):
    """SIGKILL of the process that started them (no cleanup runs): paused or not, they go."""
    code = ("import sys, time\nfrom graphmode.bench.contend import Burners\n"
            "b = Burners(2, lifetime_s=300).start()\nb.procs[0].send_signal(18)\n"   # one resumed, one paused
            "print(' '.join(map(str, b.alive())), flush=True)\ntime.sleep(300)\n")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
    try:
        pids = [int(x) for x in p.stdout.readline().split()]
        assert len(pids) == 2 and all(not _gone(x) for x in pids)
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=DEADLINE_S)
        _until(lambda: all(_gone(x) for x in pids), "burners to die with their parent")
    finally:
        p.kill()
        p.stdout.close()


@pytest.mark.parametrize("n", [-1, 65, 1.5, True])
def test_a_bad_burner_count_is_a_clear_error(n):
    with pytest.raises(GraphmodeError, match="--contend"):
        Burners(n)


def test_phases_without_burners_are_quiet_only():
    assert Phases(None).names == ("quiet",) and Phases(Burners(0)).names == ("quiet",)


# --------------------------------------------------------------------------------- the harness

def test_harness_times_quiet_and_contended_rounds_of_the_same_engines():
    from graphmode.capture.spec import resolve_model_spec
    case = ModelCase(TINY, "tiny", resolve_model_spec(TINY), [{"batch": 2}])
    cfg = harness.BenchConfig(engines=[("eager", None)], threads=1, iters=3, min_iters=3, warmup=1, rewarm=0,
                              contend=1)
    busy_cpu = iter(range(10**6))     # a CPU clock that moves one second per reading
    res = harness.run_bench([case], cfg, probe=Probe(loadavg=lambda: [3.0, 1.0, 1.0], cpu_time=lambda: next(busy_cpu),
                                                     cores=2))
    quiet, busy = res.rows
    assert (quiet["condition"], quiet["contend"], busy["condition"], busy["contend"]) == ("quiet", 0, "contended", 1)
    assert len(quiet["rounds_ms"]) == len(busy["rounds_ms"]) == 3 and busy["status"] == "ok"
    assert busy["slowdown"] == pytest.approx(busy["median_ms"] / quiet["median_ms"], rel=1e-3)
    # load and starvation are what the contended phase measures: flagged on quiet rows only
    assert "load" in quiet["flags"] and "load" not in busy["flags"]
    assert res.meta["contend"] == 1 and "SIGSTOP" in res.meta["method"]["contend"]


# ---------------------------------------------------------------------------------- the report

def _row(engine: str, median: float, condition: str = "quiet", **kw) -> dict:
    r = {"model": "m", "model_name": "m", "shape": [1, 16], "engine": engine, "label": engine, "status": "ok",
         "reason": None, "skipped": False, "threads": 2, "median_ms": median, "p90_ms": median, "spread": 1.05,
         "load_max": 0.5, "cpu_per_wall": 1.9, "eager_fallback": None, "eager_islands": 0, "rel_l2_err": 0.0,
         "numerics_ok": True, "condition": condition, "contend": 2 if condition == "contended" else 0}
    r.update(kw)
    return r


def _shape(quiet: dict[str, float], busy: dict[str, float]) -> BenchResult:
    rows_q = [_row(e, m) for e, m in quiet.items()]
    rows_c = [_row(e, m, "contended") for e, m in busy.items()]
    for rows, contended in ((rows_q, False), (rows_c, True)):
        harness._ratios(rows)
        judge(rows, 2, contended=contended)
    rows = rows_q + rows_c
    harness.slowdowns(rows)
    meta = {"date": "2026-12-03T00:00:00+00:00", "cpu_model": "cpu", "cores": 2, "usable_cores": 2, "threads": 2,
            "versions": {"torch": "x"}, "contend": 2,
            "method": {"warmup": 1, "iters": 3, "min_iters": 3, "budget_s_per_shape": 1.0, "rewarm": 0,
                       "contend": "2 CPU burner process(es)"}, "warnings": warning_lines(rows)}
    return BenchResult(rows, meta)


def test_report_puts_contended_columns_beside_the_quiet_ones():
    res = _shape({"eager": 10.0, "onnxruntime": 4.0, "graphmode": 3.0},
                 {"eager": 20.0, "onnxruntime": 6.0, "graphmode": 9.0})
    md = markdown(res)
    assert "| contended median | contended vs best other | slowdown |" in md
    g = next(line for line in md.splitlines() if "**graphmode**" in line)
    assert "| 9.00 | 1.50x | 3.00x |" in g and "| 0.75x |" in g        # contended vs ORT 6 ms; quiet 3 / 4
    assert md.count("**graphmode**") == 1             # one line per engine, not one per condition
    table, _ = rich_table(res)
    assert {"busy", "/best busy", "slowdown"} <= {c.header for c in table.columns}
    assert table.row_count == 3 and "2 CPU burner(s)" in str(table.caption)


def test_contended_goals_are_the_ratio_and_the_slowdown_against_onnxruntime():
    res = _shape({"onnxruntime": 4.0, "graphmode": 3.0}, {"onnxruntime": 6.0, "graphmode": 9.0})
    (line,) = goals(res)
    assert "speed met (0.75x onnxruntime" in line
    assert "contended speed NOT met (1.50x onnxruntime" in line and "slowdown NOT met (3.00x, onnxruntime's 1.50x)" in line
    ok = _shape({"onnxruntime": 4.0, "graphmode": 3.0}, {"onnxruntime": 6.0, "graphmode": 4.0})
    busy = {r["engine"]: r for r in ok.rows if r["condition"] == "contended"}
    assert contended_goals(busy) == ["contended speed met (0.67x onnxruntime; goal <= 1.0x)",
                                     "slowdown met (1.33x, onnxruntime's 1.50x)"]


def test_a_run_without_contend_has_no_contended_columns():
    rows = [_row("eager", 10.0), _row("graphmode", 5.0)]
    harness._ratios(rows)
    judge(rows, 2)
    res = BenchResult(rows, {"date": "d", "cpu_model": "cpu", "cores": 2, "threads": 2, "versions": {},
                             "method": {"warmup": 1, "iters": 3, "min_iters": 3, "budget_s_per_shape": 1.0},
                             "warnings": []})
    assert "contended" not in markdown(res) and "busy" not in {c.header for c in rich_table(res)[0].columns}
    narrow = [c.header for c in rich_table(res, 80)[0].columns]   # an 80-column terminal: the secondary columns go
    assert "engine" in narrow and "median" in narrow and "floor" not in narrow and "RSS" not in narrow
