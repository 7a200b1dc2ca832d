"""Whether a benchmark row is a measurement: flags, their notes, and what the harness
reads from the machine to decide.

A timing is only a measurement of an engine when the engine had the CPUs while it ran and
its rounds agree; a ratio is only as good as both of its timings. On 2 shared cores a
`bench --quick` under load charted 176x over eager: a number of the scheduler, printed
like a result. So every row carries the conditions of its own rounds (load average per
round, the process's CPU seconds per wall second of its untimed and timed calls, the spread of
its rounds), and
`judge` turns them into flags that the JSON, the Markdown, the table and the chart show:

- `load`: the 1-minute load average exceeded the usable cores during the row's rounds
  (or the engine ran more threads than there are cores);
- `starved`: the process's threads waited on a run queue (runnable, no CPU free) for more
  than WAITED_LIMIT seconds per wall-second of its rounds' calls, summed over threads
  (`/proc/self/task/*/schedstat`): a 2-thread engine given one core waits about 1. Where
  the kernel does not expose it: the process got less than STARVED CPU-seconds per
  wall-second (a compute call that has the machine uses at least one full core), which
  misses a many-thread engine given one core;
- `spread`: p90 / median of its rounds above SPREAD_LIMIT: the rounds disagree;
- `ratio`: faster or slower than eager by more than RATIO_CAP: beyond a sanity bound
  for fp32 CPU inference of the same model on the same threads;
- `gap`: more than GAP_LIMIT times faster than the next-fastest engine of the shape;
- `baseline`: eager's own row is flagged, so every ratio vs eager is suspect;
- `fallback`: graphmode ran the model in eager PyTorch (exe_mode eager, or a request
  outside the contract with on_violation: eager): that time is not graph-mode speed, and
  the row has no ratios;
- `islands`: graphmode ran in hybrid mode with eager islands (the time is real, but part
  of it is PyTorch's);
- `quick`: a `--quick` smoke run: too few rounds, no re-warm; not a measurement;
- `floor`: faster than the shape's roofline floor (`apply_floor`), max(FLOPs / peak, bytes /
  bandwidth) on the probed host: the probe under-measured (its peak is torch's best GEMM
  rate), the engine did fewer FLOPs than the shape counts (Winograd), or the bytes stayed in
  cache.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from graphmode.targets.host import STARVED, WAITED_LIMIT, load_average, run_queue_wait_s, starved, usable_cores

SPREAD_LIMIT = 1.5     # p90 / median of an engine's rounds
RATIO_CAP = 20.0       # speed-up (or slow-down) vs eager
GAP_LIMIT = 5.0        # fastest engine vs the next one

QUICK_NOTE = ("--quick is a smoke run (few rounds, no re-warm): it checks that every engine runs and matches "
              "eager; its timings are not measurements")
TIMING_FLAGS = ("load", "starved", "spread")          # the row's own timing is doubtful
RATIO_FLAGS = TIMING_FLAGS + ("ratio", "gap", "baseline", "quick")   # its ratios are doubtful
QUICK_SILENT = RATIO_FLAGS + ("floor",)       # about timings: not warned about in a --quick run
FLOOR_FIELDS = ("floor_ms", "floor_bound", "floor_flops", "floor_bytes", "floor_note")
LEGEND = {
    "load": "load average above the usable cores during its rounds",
    "starved": f"its threads waited for a CPU > {WAITED_LIMIT:g} s per wall-s of its timed calls "
               f"(or, unexposed, got < {STARVED:g} CPU-s per wall-s)",
    "spread": f"p90 / median of its rounds > {SPREAD_LIMIT:g} (rounds disagree)",
    "ratio": f"more than {RATIO_CAP:g}x faster or slower than eager: beyond a sanity bound",
    "gap": f"more than {GAP_LIMIT:g}x faster than the next engine of the shape",
    "baseline": "eager's own timing is flagged, so ratios vs eager are suspect",
    "fallback": "graphmode ran eager PyTorch: not graph-mode speed, no ratios",
    "islands": "hybrid mode: some ops ran as eager islands",
    "quick": "--quick smoke run: not a measurement",
    "floor": "faster than its roofline floor: the probe's peak or bandwidth is below what the engine reached, "
             "it did fewer FLOPs than counted (Winograd), or the data stayed in cache",
}


@dataclass
class Probe:
    """What the harness reads from the machine around timed calls. Passed in, so a test can
    feed a load average or a CPU clock it controls."""

    loadavg: Callable[[], list[float] | None] = load_average
    cpu_time: Callable[[], float] = time.process_time
    waited: Callable[[], float | None] = run_queue_wait_s
    cores: int = field(default_factory=usable_cores)

    def load1(self) -> float | None:
        got = self.loadavg()
        return float(got[0]) if got else None


@dataclass
class Conditions:
    """The machine around one engine's timed calls of one shape."""

    loads: list[float] = field(default_factory=list)
    cpu_s: float = 0.0
    wall_s: float = 0.0
    waited_s: float | None = 0.0        # None once a call's run-queue wait could not be read

    def to_row(self) -> dict[str, Any]:
        per_wall = self.wall_s > 0
        return {"load_max": round(max(self.loads), 2) if self.loads else None,
                "cpu_per_wall": round(self.cpu_s / self.wall_s, 3) if per_wall else None,
                "waited_per_wall": round(self.waited_s / self.wall_s, 3)
                if per_wall and self.waited_s is not None else None}


def _flag(row: dict, code: str, note: str) -> None:
    if code not in row["flags"]:
        row["flags"].append(code)
        row["notes"].append(f"{code}: {note}")


def judge(rows: list[dict[str, Any]], cores: int, quick: bool = False, contended: bool = False) -> None:
    """Set `flags` (codes, see the module doc) and `notes` (one sentence each, with the
    numbers) on the rows of one (model, shape) and condition. `contended`: rows timed beside
    the bench's own CPU burners, where load and starvation are the condition measured, not a
    doubt about it (their `cpu_per_wall` and `load_max` still say how starved they were)."""
    for r in rows:
        r["flags"], r["notes"] = [], []
    ok = [r for r in rows if r["status"] == "ok" and r.get("median_ms")]
    for r in ok:
        if r.get("eager_fallback"):
            _flag(r, "fallback", f"ran eager PyTorch on {r['eager_fallback']}: this time is not graph-mode speed")
        if r.get("eager_islands"):
            ops = ", ".join((r.get("execution") or {}).get("island_ops") or ())
            _flag(r, "islands", f"hybrid: {r['eager_islands']} op(s) ran as eager islands" + (f" ({ops})" if ops else ""))
        threads = r.get("threads") or 0
        if not contended:
            if r.get("load_max") is not None and r["load_max"] > cores:
                _flag(r, "load", f"load average reached {r['load_max']:.2f} on {cores} usable core(s) during its rounds")
            elif threads > cores:
                _flag(r, "load", f"{threads} threads on {cores} usable core(s)")
            if starved(r.get("cpu_per_wall"), r.get("waited_per_wall")):
                _flag(r, "starved", f"its threads waited for a CPU {r['waited_per_wall']:.2f} s per wall-s of its timed "
                                    "calls" if r.get("waited_per_wall") is not None else
                                    f"the process got {r['cpu_per_wall']:.2f} CPU-s per wall-s of its timed calls")
        if r.get("spread") is not None and r["spread"] > SPREAD_LIMIT:
            _flag(r, "spread", f"its rounds disagree: p90 / median = {r['spread']:.2f}")
        x = r.get("speedup_vs_eager")
        if x and not 1 / RATIO_CAP <= x <= RATIO_CAP:
            _flag(r, "ratio", f"{x:.1f}x vs eager is beyond the {RATIO_CAP:g}x sanity bound")
        if quick:
            _flag(r, "quick", "a --quick smoke run (few rounds, no re-warm): not a measurement")
    timed = sorted((r for r in ok if not r.get("eager_fallback")), key=lambda r: r["median_ms"])
    if len(timed) >= 3 and timed[1]["median_ms"] > GAP_LIMIT * timed[0]["median_ms"]:
        g = timed[1]["median_ms"] / timed[0]["median_ms"]
        _flag(timed[0], "gap", f"{g:.1f}x faster than the next engine ({timed[1]['label']})")
    eager = next((r for r in ok if r["engine"] == "eager"), None)
    doubt = [f for f in (eager or {}).get("flags", []) if f in TIMING_FLAGS]
    for r in ok:
        if eager is not None and r is not eager and doubt and r.get("ratio_vs_eager") is not None:
            _flag(r, "baseline", f"eager's own timing is flagged ({', '.join(doubt)})")


def apply_floor(rows: Sequence[dict[str, Any]], floor: Mapping[str, Any]) -> None:
    """Give every (judged) row of one shape the shape's roofline floor — `floor` holds
    `floor_ms`, `floor_bound`, `floor_flops`, `floor_bytes` (harness.shape_floor), or
    `floor_note` saying why there is none — and its own time as a multiple of it:
    `x_floor` = median_ms / floor_ms. A row under 1x beat the roofline: flagged `floor`."""
    for r in rows:
        r.update({k: floor.get(k) for k in FLOOR_FIELDS})
        med = r.get("median_ms") if r["status"] == "ok" else None
        r["x_floor"] = float(f"{med / floor['floor_ms']:.4g}") if med and floor.get("floor_ms") else None
        if r["x_floor"] is not None and r["x_floor"] < 1:
            _flag(r, "floor", f"{r['x_floor']:.2f}x its roofline floor: {med:.3g} ms against {floor['floor_ms']:.3g} ms "
                              f"({floor['floor_bound']}-bound: {floor['floor_flops'] / 1e9:.3g} GFLOP, "
                              f"{floor['floor_bytes'] / 1e6:.3g} MB) on the probed host; {_below_floor(floor)}")


def _below_floor(floor: dict[str, Any]) -> str:
    """Why a row can beat its floor, by which term set it."""
    if floor.get("floor_bound") == "compute":
        return ("the engine did fewer FLOPs than the shape counts (Winograd convolutions multiply less), or the "
                "host probe's peak is low (without a C compiler it cannot run its FMA chains and rests on the "
                "reported clock and torch's GEMM)")
    return "the host probe under-measured (re-probe with `graphmode targets show host --reprobe`) or the data " \
           "stayed in cache"


def warning_lines(rows: list[dict[str, Any]], quick: bool = False) -> list[str]:
    """One line per flagged row; under `--quick` (not a measurement at all) only the flags
    that are not about timing."""
    out = []
    for r in rows:
        notes = [n for n, f in zip(r.get("notes") or (), r.get("flags") or ()) if not (quick and f in QUICK_SILENT)]
        if notes:
            where = f"{r['model']} {'x'.join(map(str, r['shape']))} {r['label']}"
            out.append(f"{where}: " + "; ".join(notes))
    return out


def doubtful_ratio(row: Mapping[str, Any]) -> bool:
    """A row whose ratios must not be read (or charted) as a measurement without its flags."""
    return any(f in RATIO_FLAGS for f in row.get("flags") or ())

