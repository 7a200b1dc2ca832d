"""The compile report's tactic margins: stated against ATen's timing of the same shape, capped
at MARGIN_CAP and flagged when the timings behind them are doubtful (samples that disagree,
a machine loaded beyond its cores, an entry measured on a busy machine). Timings here are
synthetic Selections; the one real timing run asserts on a count of calls, not on a time."""
from __future__ import annotations

import json
import time

import pytest

from graphmode.backends.cpu import tactics as tac
from graphmode.backends.cpu.gemm import GemmProblem
from graphmode.backends.cpu.tactics import ATEN, MARGIN_CAP, Selection, TimingCache, measure, report_lines

P = GemmProblem("linear", 1, 4, 16, 64, bias=True)
GEN = "avx512_8x32_kall_mall_serial"


def _sel(aten: tuple[float, float], gen: tuple[float, float], winner: str = GEN, **kw) -> Selection:
    """(median, min) seconds for ATen and one generated candidate."""
    kw.setdefault("load", 0.5)
    kw.setdefault("cores", 2)
    return Selection(P, winner, "latency_first", timings_s={ATEN: aten[0], GEN: gen[0]}, timed=True, uses=3,
                     medians_s={ATEN: aten[0], GEN: gen[0]}, mins_s={ATEN: aten[1], GEN: gen[1]}, **kw)


def _line(*sels: Selection) -> list[str]:
    rep = {"policy": "latency_first", "threads": 2, "gemms": [s.to_json() for s in sels],
           "steps": {"total": 3, "generated": 3}, "seconds": 0.1}
    return report_lines(rep)[1:]


def test_an_honest_margin_is_printed_as_measured():
    sel = _sel((3e-6, 2.9e-6), (2e-6, 1.9e-6))
    (line,) = _line(sel)
    assert ", 1.50x vs aten," in line and "suspect" not in line
    g = sel.to_json()
    assert g["speedup_vs_aten"] == 1.5 and g["margins"]["aten"] == {"measured": 1.5, "shown": 1.5, "capped": False,
                                                                     "suspect": []}


def test_1442x_is_capped_and_says_why():
    """ATen's samples on a busy machine: one call that waited out a time slice each. The
    report must not say 1442x."""
    sel = _sel((1.442e-3, 1.1e-5), (1e-6, 0.98e-6), load=5.6)
    (line,) = _line(sel)
    assert f"> {MARGIN_CAP:g}x vs aten, baseline suspect" in line and "1442" not in line
    assert "aten samples 11 us..1.44 ms" in line and "timed at load 5.6 on 2 cores" in line
    g = sel.to_json()
    assert g["speedup_vs_aten"] == MARGIN_CAP and g["margins"]["aten"]["measured"] == pytest.approx(1442.0)
    assert "> 20x vs aten, baseline suspect" in sel.text() and "1442" not in sel.text()


def test_over_the_cap_is_flagged_even_with_tight_samples():
    sel = _sel((5e-4, 4.9e-4), (1e-6, 1e-6))
    (line,) = _line(sel)
    assert "> 20x vs aten, baseline suspect" in line and "500" not in line


@pytest.mark.parametrize("kw, why", [({"load": 3.0}, "timed at load 3.0 on 2 cores"),
                                     ({"noisy": True}, "timed while the machine was busy")])
def test_a_busy_machine_makes_a_small_margin_suspect(kw, why):
    (line,) = _line(_sel((3e-6, 2.9e-6), (2e-6, 1.9e-6), **kw))
    assert f"1.50x vs aten (suspect: {why})" in line


def test_spread_of_the_winner_counts_too():
    (line,) = _line(_sel((3e-6, 2.9e-6), (2e-6, 1e-6)))
    assert f"1.50x vs aten (suspect: {GEN} samples 1 us..2 us (median/min 2.0))" in line


def test_aten_winner_margin_against_the_runner_up_is_capped():
    sel = _sel((1e-6, 1e-6), (1e-4, 2e-5), winner=ATEN)
    (line,) = _line(sel)
    assert "vs aten" not in line and "> 20x vs runner-up, baseline suspect" in line
    assert "> 20x vs the best generated kernel" in sel.text()


def test_a_report_written_before_margins_is_capped_as_well():
    old = {"gemm": P.text, "uses": 1, "winner": GEN, "speedup_vs_aten": 1442.0, "gflops": 1.0,
           "margin_vs_runner_up": 1.1}
    (line,) = report_lines({"policy": "latency_first", "threads": 2, "gemms": [old], "steps": {}})[1:]
    assert "> 20x vs aten, baseline suspect" in line and "1442" not in line and "1.10x vs runner-up" in line


def test_cache_entries_keep_the_spread_and_old_ones_still_load(tmp_path):
    cache = TimingCache(tmp_path)
    key = {"version": 1, "shape": "x"}
    cache.put(key, {"timings_s": {ATEN: 2e-3, GEN: 1e-6}, "medians_s": {ATEN: 2e-3, GEN: 1e-6},
                    "mins_s": {ATEN: 1e-5, GEN: 1e-6}, "rejected": {}, "noisy": True, "tries": 1,
                    "load": 5.5, "cores": 2}, reps=5)
    got = cache.get(key)
    assert got["mins_s"] == {ATEN: 1e-5, GEN: 1e-6} and got["load"] == 5.5 and got["cores"] == 2
    path = next(tmp_path.glob("gemm-*.json"))
    old = json.loads(path.read_text())
    for k in ("mins_s", "load", "cores"):
        del old[k]
    path.write_text(json.dumps(old))
    got = cache.get(key)
    assert got["mins_s"] == {} and got["load"] is None and got["cores"] is None
    sel = Selection(P, GEN, "latency_first", got["timings_s"], from_cache=True, medians_s=got["medians_s"],
                    mins_s=got["mins_s"], load=got["load"], cores=got["cores"], noisy=got["noisy"])
    (line,) = _line(sel)
    assert "> 20x vs aten, baseline suspect (timed while the machine was busy)" in line


def test_one_slow_calibration_call_does_not_make_one_call_samples():
    """The cause of the huge margins: a candidate's calls per sample came from one timed call;
    when that call waited (here: spun 20 ms on purpose), every sample of that candidate was
    one call while the others averaged up to 1000. The fastest of a few calls decides now."""
    calls = {"n": 0}

    def candidate() -> None:
        calls["n"] += 1
        if calls["n"] == 2:                       # the first calibration call, right after the warm-up
            end = time.perf_counter() + 0.02
            while time.perf_counter() < end:
                pass

    samples = measure({ATEN: candidate}, reps=3, sample_s=5e-4, budget_s=0.0)
    assert len(samples[ATEN]) == 3
    assert calls["n"] > 1 + tac.CALIBRATION_CALLS + 3    # more than one call per sample


def test_damaged_cache_entries_are_misses_never_errors(tmp_path):
    """Whatever sits where an entry should (a FIFO, a link to /dev/zero, numbers out of range,
    deep nesting, wrong types) is a miss: the shape is timed again, nothing raises or blocks."""
    import os
    cache = TimingCache(tmp_path)
    key = {"version": 1, "shape": "y"}
    path = cache.path(key)
    good = {"key": key, "timings_s": {ATEN: 1e-3}, "rejected": {}}
    bodies = ['{"key": ' + json.dumps(key) + ', "timings_s": {"aten": 1e999}, "rejected": {}}',
              json.dumps(dict(good, timings_s={ATEN: -1.0})), json.dumps(dict(good, timings_s={ATEN: "fast"})),
              json.dumps(dict(good, tries="x", cores=10 ** 30, load=True)), "[" * 100000, "[1, 2]", "\xff\xfe"]
    for body in bodies:
        path.write_text(body, encoding="utf-8", errors="surrogateescape")
        got = cache.get(key)
        assert got is None or (got["tries"] == 1 and got["cores"] is None and got["load"] is None), body[:40]
    path.unlink()
    os.mkfifo(path)
    assert cache.get(key) is None
    path.unlink()
    path.symlink_to("/dev/zero")
    assert cache.get(key) is None
