"""The OpenMP pragma of every parallel loop in the generated kernels, and the build's schedule.

A `schedule(static)` loop gives each thread a fixed 1/T of its iterations, so it ends when its
slowest thread does: on a busy host the thread the scheduler took away finishes its share late
while the others wait at the barrier. Under `schedule(dynamic, c)` threads claim chunks of `c`
iterations as they go, and the ones that run take the work of the one that does not. A claim
is an atomic increment on a shared counter, so a loop is made claimable only when it has enough
chunks to balance (`MIN_CHUNKS`) of at least `MIN_CHUNK_WORK` each (a few microseconds: the cost
model's work units, ~0.05 ns each here, as emit.PAR_THRESHOLD counts them); loops too small for
that stay static at every schedule.

The generators decide per loop whether it is claimable and its chunk (`omp_for`); the build
decides how claimable loops are scheduled (`SCHEDULES`, the recipe's `codegen.schedule`): the
kernel text says `schedule(GM_SCHED(c))`, a prelude macro that the build's compile flag
(`schedule_flags`) turns into `static`, `dynamic, c` or `guided, c`. So a kernel's text and
symbol are the same at every schedule and only its library (keyed by the flags) differs. Every
loop written through here has iterations that write disjoint outputs and reduce nothing across
iterations, so a kernel's results are bit-identical at every schedule.
"""
from __future__ import annotations

import math
import re

from graphmode.errors import BackendError

SCHEDULES = ("static", "dynamic", "guided", "claim")
DEFAULT_SCHEDULE = "dynamic"    # what `auto` builds: the quiet-host A/B in docs/performance-contention.md
MIN_CHUNKS = 8                  # claimable loops have at least this many chunks (4 per thread at 2 threads)
MAX_CHUNKS = 64                 # and at most this many claims per loop
MIN_CHUNK_WORK = 40_000         # work units (~2 us) per chunk; a claim costs ~0.1 us uncontended

_FLAGS = {"static": (), "dynamic": ("-DGM_SCHEDULE_DYNAMIC",), "guided": ("-DGM_SCHEDULE_GUIDED",),
          "claim": ("-DGM_SCHEDULE_CLAIM",)}


def resolve_schedule(schedule: str | None) -> str:
    """`schedule` (None / auto = DEFAULT_SCHEDULE) checked against SCHEDULES."""
    s = DEFAULT_SCHEDULE if schedule in (None, "auto") else schedule
    if s not in SCHEDULES:
        raise BackendError(f"unknown loop schedule {schedule!r}", where="codegen.schedule", value=schedule,
                           fix=f"one of auto, {', '.join(SCHEDULES)}")
    return s


def schedule_flags(schedule: str | None) -> tuple[str, ...]:
    """The compile flags that make GM_SCHED (templates/prelude.h) the build's `schedule`."""
    return _FLAGS[resolve_schedule(schedule)]


def chunk_for(trips: int, work: float | None, align: int = 1) -> int | None:
    """Iterations per claimed chunk for a loop of `trips` iterations doing `work` units in all
    (None: unknown, then only the chunk count bounds it), a multiple of `align` (iterations that
    share state a thread keeps, e.g. one head's K^T), or None when the loop has too few chunks
    to balance and stays static."""
    if trips < MIN_CHUNKS:
        return None
    chunk = math.ceil(trips / MAX_CHUNKS)
    if work:
        chunk = max(chunk, math.ceil(MIN_CHUNK_WORK * trips / work))
    chunk = -(-chunk // align) * align
    return chunk if trips // chunk >= MIN_CHUNKS else None


def schedule_clause(trips: int, work: float | None = None, *, fixed: str | None = None, align: int = 1) -> str:
    """`schedule(...)` for one loop: GM_SCHED(chunk) when claimable, static otherwise.
    `fixed` pins a schedule the kernel's own design needs (e.g. `dynamic, 1` over split-K tasks
    of unequal length) whatever the build's."""
    if fixed is not None:
        return f"schedule({fixed})"
    chunk = chunk_for(trips, work, align)
    return "schedule(static)" if chunk is None else f"schedule(GM_SCHED({chunk}))"


def omp_for(trips: int, work: float | None = None, *, region: bool = True, collapse: int = 1, simd: bool = False,
            threads: str = "gm_nt()", fixed: str | None = None, align: int = 1) -> str:
    """The pragma line (no indent) of a parallel loop of `trips` iterations (the collapsed
    count with `collapse`), `work` units in all: `#pragma omp parallel for ...` with its own
    team of `threads`, or with `region=False` the `#pragma omp for ...` of a loop inside an
    enclosing `#pragma omp parallel`."""
    parts = ["#pragma omp", "parallel for" if region else "for"]
    if simd:
        parts.append("simd")
    if collapse > 1:
        parts.append(f"collapse({collapse})")
    parts.append(schedule_clause(trips, work, fixed=fixed, align=align))
    if region:
        parts.append(f"num_threads({threads})")
    return " ".join(parts)


_CLAIM_PRAGMA = re.compile(r"^(\s*)#pragma omp parallel for( simd)? schedule\(GM_SCHED\((\d+)\)\) num_threads\((.+)\)\s*$")
_FOR = re.compile(r"^(\s*)for \((long|int64_t|int) (\w+) = ([^;]+); (\w+) < ([^;]+); \+\+(\w+)\)\s*(.*)$")
_LITERALS = re.compile(r'//.*$|"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'')


def _braces(line: str) -> int:
    """Opening minus closing braces of a C++ line, outside comments and literals."""
    code = _LITERALS.sub("", line)
    return code.count("{") - code.count("}")


def _claimed(lines: list[str], i: int) -> tuple[list[str], int] | None:
    """The `gm_parallel_for` form of the claimable loop whose pragma is lines[i], and the index
    after the loop; None when the loop is not in a form written here (it stays OpenMP)."""
    pragma = _CLAIM_PRAGMA.match(lines[i])
    head = _FOR.match(lines[i + 1]) if pragma and i + 1 < len(lines) else None
    if head is None:
        return None
    ind, ctype, var, lo, cvar, hi, ivar, rest = head.groups()
    if cvar != var or ivar != var:
        return None
    simd, chunk, nt = pragma.group(2), pragma.group(3), pragma.group(4)
    start = [f"{ind}gm_parallel_for((long)({lo}), (long)({hi}), {chunk}L, {nt}, [&](long gm_lo, long gm_hi) {{",
             *([f"{ind}#pragma omp simd"] if simd else []),
             f"{ind}for ({ctype} {var} = gm_lo; {var} < gm_hi; ++{var}){' ' + rest if rest else ''}"]
    end = f"{ind}}});"
    if rest.endswith(";") and "{" not in rest and "}" not in rest:     # one statement
        return start + [end], i + 2
    j = i + 2
    if rest == "":
        if j >= len(lines) or lines[j].strip() != "{":
            return None
        start.append(lines[j])
        j += 1
    elif rest != "{":
        return None
    depth = 1
    for k in range(j, len(lines)):
        depth += _braces(lines[k])
        if depth == 0:
            if lines[k].strip() != "}":
                return None
            return start + lines[j:k + 1] + [end], k + 1
        if depth < 0:
            return None
    return None


def claim_loops(source: str) -> tuple[str, int, int]:
    """`source` with every claimable `#pragma omp parallel for [simd]` loop (GM_SCHED, not
    collapsed, a canonical `for (T v = lo; v < hi; ++v)`) written as `gm_parallel_for(lo, hi, chunk,
    threads, [&](long gm_lo, long gm_hi) { for (T v = gm_lo; v < gm_hi; ++v) ... });` for the
    work-claiming pool (the `claim` schedule); how many loops were rewritten and how many
    claimable ones were left to OpenMP (`dynamic`: inside a parallel region, collapsed).
    Each iteration writes its own outputs and the lambda shares what the OpenMP loop shared
    (captures by reference), so the results are the same bits."""
    lines = source.split("\n")
    out: list[str] = []
    done = left = i = 0
    while i < len(lines):
        got = _claimed(lines, i) if "GM_SCHED(" in lines[i] else None
        if got is None:
            left += "GM_SCHED(" in lines[i] and lines[i].lstrip().startswith("#pragma omp")
            out.append(lines[i])
            i += 1
            continue
        text, i = got
        out += text
        done += 1
    return "\n".join(out), done, left


__all__ = ["SCHEDULES", "DEFAULT_SCHEDULE", "resolve_schedule", "schedule_flags", "chunk_for", "schedule_clause",
           "omp_for", "claim_loops"]
