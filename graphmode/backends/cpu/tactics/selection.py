"""What tactic selection decided, how the policies decide, and how the report says it.

Policies, over the candidates that passed their check against ATen:

- `latency_first` (default): the smallest time (the context's statistic of the samples);
- `throughput_first`: the most GFLOP/s at the plan's thread count. A plan runs one request
  at a time on all its threads, so for a fixed shape this is the same argmax as
  latency_first; the name is kept so the recipe's `codegen.kernel_selection` maps 1:1;
- `heuristic`: no timing: the first generated configuration for the ISA (the one that
  measured best on skinny transformer GEMMs), ATen for non-f32 or without a compiler.

A margin between two timings is only as good as the worse of them: the report caps it and
says why a number is suspect (samples that disagree, a machine busier than its cores).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from graphmode.backends.cpu.gemm import GemmProblem
from graphmode.backends.cpu.tactics.steps import ATEN
from graphmode.targets.host import STARVED  # noqa: F401 - re-exported: the CPU-per-wall bound the bench flags too

POLICIES = ("latency_first", "throughput_first", "heuristic")
NOISY = 1.5        # median/min of the timing samples above which a measurement counts as noisy
MARGIN_CAP = 20.0  # a margin between two candidates of one shape beyond this is shown as "> 20x", suspect


def pick(policy: str, p: GemmProblem, timings: Mapping[str, float], *, invariant: bool = False) -> str:
    """The winner under `policy` among the timed candidates (ATen on a tie). `invariant`
    (determinism: batch_invariant): among the generated ones when any passed, since their
    rows are the same bits at any M and ATen's are not (TacticsContext.batch_variant)."""
    if invariant and any(n != ATEN for n in timings):
        timings = {n: t for n, t in timings.items() if n != ATEN}
    if not timings:
        return ATEN
    if policy == "throughput_first":
        return max(timings, key=lambda n: (p.flops / timings[n], n == ATEN))
    return min(timings, key=lambda n: (timings[n], n != ATEN))


@dataclass
class Selection:
    """What tactic selection decided for one GEMM shape (one row of the compile report)."""

    problem: GemmProblem
    winner: str
    policy: str
    timings_s: dict[str, float] = field(default_factory=dict)   # the statistic the policy compared, seconds
    rejected: dict[str, str] = field(default_factory=dict)      # candidate -> why it may not win
    from_cache: bool = False
    timed: bool = False
    tune_s: float = 0.0
    uses: int = 0                                               # plan steps with this shape
    noisy: bool = False                                         # timed while the machine was busy
    medians_s: dict[str, float] = field(default_factory=dict)   # median seconds per candidate (for reports)
    mins_s: dict[str, float] = field(default_factory=dict)      # fastest sample per candidate (its spread)
    load: float | None = None                                   # 1-minute load average when it was timed
    cores: int | None = None                                    # CPUs this process could use then
    cpu_per_wall: float | None = None                           # process CPU-s per wall-s of the timing

    @property
    def starved(self) -> bool:
        """Timed while this process waited for a CPU (the bench's `starved` flag): a compute
        call that has the machine uses at least one full core, so below STARVED CPU-s per
        wall-s the samples timed the scheduler too."""
        return self.cpu_per_wall is not None and self.cpu_per_wall < STARVED

    @property
    def runner_up(self) -> str | None:
        others = {k: v for k, v in self.timings_s.items() if k != self.winner}
        return min(others, key=others.get) if others else None

    def margin(self, slower: str | None) -> Margin | None:
        """How much faster the winner timed than candidate `slower`, with the reasons to doubt it:
        a ratio of two numbers is only as good as the worse of them."""
        t = self.timings_s.get(self.winner)
        a = self.timings_s.get(slower) if slower else None
        if not t or not a or slower == self.winner:
            return None
        return Margin(a / t, tuple(timing_doubts(self, (slower, self.winner))))

    def gflops(self, name: str | None = None) -> float | None:
        t = self.timings_s.get(name or self.winner)
        return self.problem.flops / t / 1e9 if t else None

    def to_json(self) -> dict:
        vs_aten = self.margin(ATEN) if self.winner != ATEN else None
        vs_next = self.margin(self.runner_up)
        return {"gemm": self.problem.text, "shape": self.problem.key(), "winner": self.winner,
                "policy": self.policy, "uses": self.uses, "from_cache": self.from_cache, "timed": self.timed,
                "timings_us": {k: round(v * 1e6, 2) for k, v in sorted(self.timings_s.items(), key=lambda kv: kv[1])},
                "medians_us": {k: round(v * 1e6, 2) for k, v in sorted(self.medians_s.items(), key=lambda kv: kv[1])},
                "mins_us": {k: round(v * 1e6, 2) for k, v in sorted(self.mins_s.items(), key=lambda kv: kv[1])},
                "gflops": round(self.gflops() or 0.0, 2) or None,
                "speedup_vs_aten": _r(vs_aten.value) if vs_aten else None,
                "margin_vs_runner_up": _r(vs_next.value) if vs_next else None,
                "margins": {k: m.to_json() for k, m in (("aten", vs_aten), ("runner_up", vs_next)) if m},
                "runner_up": self.runner_up, "load": self.load, "cores": self.cores,
                "rejected": dict(self.rejected), "tune_s": round(self.tune_s, 3), "noisy": self.noisy,
                "cpu_per_wall": _r(self.cpu_per_wall), "starved": self.starved}

    def text(self) -> str:
        s = f"{self.problem.text}: {self.winner}"
        vs_aten = self.margin(ATEN)
        vs_next = self.margin(self.runner_up)
        if vs_aten is not None:
            s += f" ({vs_aten.text('aten')}"
            g = self.gflops()
            s += f", {g:.1f} GFLOP/s)" if g else ")"
        elif self.winner == ATEN and vs_next is not None:
            s += f" ({vs_next.text('the best generated kernel')})"
        if self.from_cache:
            s += " [timing cache]"
        return s


@dataclass(frozen=True)
class Margin:
    """The winner's time against another candidate's, as the compile report states it: beyond
    MARGIN_CAP it is shown as "> 20x, baseline suspect" (two kernels of one shape, both
    checked against ATen, do not differ 1000-fold; a baseline that waited out the scheduler
    does), and any doubt about either timing is said next to it."""

    measured: float
    suspect: tuple[str, ...] = ()

    @property
    def capped(self) -> bool:
        return self.measured > MARGIN_CAP

    @property
    def value(self) -> float:
        return min(self.measured, MARGIN_CAP)

    def to_json(self) -> dict:
        return {"measured": _r(self.measured), "shown": _r(self.value), "capped": self.capped,
                "suspect": list(self.suspect)}

    def text(self, against: str) -> str:
        return margin_text(self.to_json(), against)


def margin_text(m: Mapping[str, Any], against: str) -> str:
    """`1.52x vs aten`, `1.52x vs aten (suspect: ...)` or `> 20x vs aten, baseline suspect (...)`."""
    why = "; ".join(m.get("suspect") or ())
    if m.get("capped"):
        return f"> {MARGIN_CAP:g}x vs {against}, baseline suspect" + (f" ({why})" if why else "")
    return f"{m['measured']:.2f}x vs {against}" + (f" (suspect: {why})" if why else "")


def timing_doubts(sel: Selection, names: Sequence[str]) -> list[str]:
    """Why the timings of `names` in `sel` may not be measurements of the kernels: their samples
    disagree (median/min above NOISY: some waited out another process's time slice), the
    machine's load exceeded its cores while they were taken, or the entry was marked noisy."""
    out = []
    for n in dict.fromkeys(names):
        med, lo = sel.medians_s.get(n), sel.mins_s.get(n)
        if med and lo and med / lo > NOISY:
            out.append(f"{n} samples {_us(lo)}..{_us(med)} (median/min {med / lo:.1f})")
    if sel.starved:
        out.append(f"timed starved ({sel.cpu_per_wall:.2f} CPU-s per wall-s)")
    if sel.load is not None and sel.cores and sel.load > sel.cores:
        out.append(f"timed at load {sel.load:.1f} on {sel.cores} cores")
    elif sel.noisy and not out:
        out.append("timed while the machine was busy")
    return out


def _us(s: float) -> str:
    us = s * 1e6
    return f"{us / 1e3:.3g} ms" if us >= 1e3 else f"{us:.3g} us"


def _r(x: float | None) -> float | None:
    return round(x, 3) if x is not None else None


def report_lines(report: Mapping[str, Any]) -> list[str]:
    """Human lines for a `TacticsContext.report()` (what the compile report prints)."""
    if not report:
        return []
    st = report.get("steps", {})
    lines = [f"GEMM tactics ({report.get('policy')}, {report.get('threads')} threads): "
             f"{st.get('generated', 0)}/{st.get('total', 0)} GEMM/conv steps on generated kernels, "
             f"tuning {report.get('seconds', 0.0):.2f}s"]
    for g in report.get("gemms", []):
        s = f"  {g['gemm']} x{g['uses']}: {g['winner']}"
        margins = g.get("margins") or {}
        if g["winner"] != ATEN and (margins.get("aten") or g.get("speedup_vs_aten")):
            s += ", " + margin_text(margins.get("aten") or _bare_margin(g["speedup_vs_aten"]), "aten")
        if g.get("gflops"):
            s += f", {g['gflops']:.1f} GFLOP/s"
        if margins.get("runner_up") or g.get("margin_vs_runner_up"):
            s += ", " + margin_text(margins.get("runner_up") or _bare_margin(g["margin_vs_runner_up"]), "runner-up")
        if g.get("from_cache"):
            s += " (timing cache)"
        if g.get("rejected"):
            s += f"; rejected: {', '.join(sorted(g['rejected']))}"
        lines.append(s)
    if report.get("error"):
        lines.append(f"  tuning failed, ATen runs every GEMM: {report['error']}")
    return lines


def _bare_margin(measured: float) -> dict:
    """A margin from a report written before margins carried their doubts: capped all the same."""
    return Margin(float(measured)).to_json()


__all__ = ["POLICIES", "NOISY", "STARVED", "MARGIN_CAP", "Selection", "Margin", "margin_text", "timing_doubts", "pick",
           "report_lines"]
