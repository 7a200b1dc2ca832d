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
import os
import re
from typing import Mapping

from graphmode.errors import BackendError
from graphmode.openmp import bounded_wait

SCHEDULES = ("static", "dynamic", "guided", "claim")
# what `auto` builds where OpenMP's idle threads sleep soon (auto_schedule): graphmode's own pool,
# whose join does not wait for a thread that claimed nothing. Quiet host, 2026-12-03 23:26 and 23:34 UTC (docs/performance-contention.md): contended <= 1.0x the
# best other engine on 7 of 7 shapes in both runs (dynamic 5 and 4 of 7), and MiniLM (1,16) 1.6 ms
# against dynamic's 3.5 ms when ONNX Runtime and OpenVINO ran in the same rounds (2.2 ms alone).
DEFAULT_SCHEDULE = "claim"
MIN_CHUNKS = 8                  # claimable loops have at least this many chunks (4 per thread at 2 threads)
MAX_CHUNKS = 64                 # and at most this many claims per loop
MIN_CHUNK_WORK = 40_000         # work units (~2 us) per chunk; a claim costs ~0.1 us uncontended

_FLAGS = {"static": (), "dynamic": ("-DGM_SCHEDULE_DYNAMIC",), "guided": ("-DGM_SCHEDULE_GUIDED",),
          "claim": ("-DGM_SCHEDULE_CLAIM",)}


def auto_schedule(environ: Mapping[str, str] | None = None) -> str:
    """What `auto` builds: DEFAULT_SCHEDULE where OpenMP's idle threads sleep soon (the
    `graphmode` command sees to it, graphmode/openmp.py), else `dynamic`. A program that imported
    torch with libgomp's default wait keeps torch's team spinning ~7 ms after each ATen op, on
    the cores the pool's workers need; `dynamic` runs the kernels on that same team. MiniLM
    (1,128), 2 threads, 2026-12-04: 11.8 ms a call under claim against 8.2 ms under dynamic
    with the default wait; 7.4 and 7.1 ms with GOMP_SPINCOUNT=1000."""
    return DEFAULT_SCHEDULE if bounded_wait(os.environ if environ is None else environ) else "dynamic"


def resolve_schedule(schedule: str | None) -> str:
    """`schedule` (None / auto = `auto_schedule()`) checked against SCHEDULES."""
    s = auto_schedule() if schedule in (None, "auto") else schedule
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


_CLAIM_PRAGMA = re.compile(r"^(\s*)#pragma omp parallel for( simd)? schedule\((?:GM_SCHED\((\d+)\)|static)\) "
                           r"num_threads\((.+)\)\s*$")
_REGION = re.compile(r"^(\s*)#pragma omp parallel num_threads\((.+)\)\s*$")
_REGION_FOR = re.compile(r"^\s*#pragma omp for schedule\((?:GM_SCHED\((\d+)\)|static)\)\s*$")
_FOR = re.compile(r"^(\s*)for \((long|int64_t|int) (\w+) = ([^;]+); (\w+) < ([^;]+); \+\+(\w+)\)\s*(.*)$")
# a generated kernel's operand pointer, cast from its void* parameter: `const float* i0 = (const float*)p0;`
_OPERAND = re.compile(r"^\s*(?:const )?[\w:]+\* (?:__restrict )?(\w+) = \((?:const )?[\w:]+\*\)p\d+;\s*$")
_LITERALS = re.compile(r'//.*$|"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'')


def _braces(line: str) -> int:
    """Opening minus closing braces of a C++ line, outside comments and literals."""
    code = _LITERALS.sub("", line)
    return code.count("{") - code.count("}")


def _block_end(lines: list[str], j: int) -> int | None:
    """The index of the `}` line closing a block whose body starts at lines[j] (None: there is
    none, or code shares its line)."""
    depth = 1
    for k in range(j, len(lines)):
        depth += _braces(lines[k])
        if depth <= 0:
            return k if depth == 0 and lines[k].strip() == "}" else None
    return None


def _loop(lines: list[str], j: int, simd: bool) -> tuple[str, str, list[str], int] | None:
    """The canonical `for (T v = lo; v < hi; ++v)` loop at lines[j]: (lo, hi, the loop over
    [gm_lo, gm_hi) instead, the index after it); None for any other form."""
    head = _FOR.match(lines[j]) if j < len(lines) else None
    if head is None:
        return None
    ind, ctype, var, lo, cvar, hi, ivar, rest = head.groups()
    if cvar != var or ivar != var:
        return None
    loop = [*([f"{ind}#pragma omp simd"] if simd else []),
            f"{ind}for ({ctype} {var} = gm_lo; {var} < gm_hi; ++{var}){' ' + rest if rest else ''}"]
    if rest.endswith(";") and "{" not in rest and "}" not in rest:     # one statement
        return lo, hi, loop, j + 1
    k = j + 1
    if rest == "":
        if k >= len(lines) or lines[k].strip() != "{":
            return None
        loop.append(lines[k])
        k += 1
    elif rest != "{":
        return None
    end = _block_end(lines, k)
    return None if end is None else (lo, hi, loop + lines[k:end + 1], end + 1)


def _region_loop(lines: list[str], i: int) -> tuple[list[str], int] | None:
    """A `#pragma omp parallel` region at lines[i] whose one work-sharing construct is a
    `#pragma omp for` (claimable or static) at its top level: the region's own lines (per-thread scratch:
    a row buffer, attention's K^T) become each chunk's, around the loop."""
    region = _REGION.match(lines[i])
    if region is None or i + 1 >= len(lines) or lines[i + 1].strip() != "{":
        return None
    end = _block_end(lines, i + 2)
    if end is None:
        return None
    inner = lines[i + 2:end]
    pragmas = [k for k, ln in enumerate(inner) if ln.lstrip().startswith("#pragma omp")
               and not ln.lstrip().startswith("#pragma omp simd")]
    # a region indexing per-thread scratch by its OpenMP thread number stays OpenMP: a claiming
    # pool's threads have other numbers, and two would share a block
    if len(pragmas) != 1 or any("omp_get_thread_num" in ln or "gm_thread_num" in ln for ln in inner):
        return None
    k = pragmas[0]
    work = _REGION_FOR.match(inner[k])
    if work is None or sum(_braces(ln) for ln in inner[:k]) != 0:
        return None
    loop = _loop(inner, k + 1, False)
    if loop is None:
        return None
    lo, hi, body, after = loop
    ind, nt = region.group(1), region.group(2)
    return ([f"{ind}gm_parallel_for((long)({lo}), (long)({hi}), {work.group(1) or 0}L, {nt}, "
             "[&](long gm_lo, long gm_hi) {",
             *inner[:k], *body, *inner[after:], f"{ind}}});"], end + 1)


def _claimed(lines: list[str], i: int) -> tuple[list[str], int] | None:
    """The `gm_parallel_for` form of the claimable loop (or region) whose pragma is lines[i],
    and the index after it; None when it is not in a form written here (it stays OpenMP)."""
    pragma = _CLAIM_PRAGMA.match(lines[i])
    if pragma is None:
        return _region_loop(lines, i)
    loop = _loop(lines, i + 1, bool(pragma.group(2)))
    if loop is None:
        return None
    lo, hi, body, after = loop
    ind, chunk, nt = pragma.group(1), pragma.group(3) or 0, pragma.group(4)
    return ([f"{ind}gm_parallel_for((long)({lo}), (long)({hi}), {chunk}L, {nt}, [&](long gm_lo, long gm_hi) {{",
             *body, f"{ind}}});"], after)


def claim_loops(source: str) -> tuple[str, int, int]:
    """`source` for the `claim` schedule: every `#pragma omp parallel for [simd]` loop, claimable
    (GM_SCHED(c): chunks of c) or static (chunk 0: one per thread), not collapsed, over a
    canonical `for (T v = lo; v < hi; ++v)`, written as `gm_parallel_for(lo, hi, chunk, threads,
    [&](long gm_lo, long gm_hi) { for (T v = gm_lo; v < gm_hi; ++v) ... });` on the
    work-claiming pool; and every `#pragma omp parallel` region around one such `#pragma omp
    for` likewise, its own lines (per-thread scratch) run per chunk. Returns the text, how many
    were rewritten and how many claimable loops were left to OpenMP (`dynamic`: collapsed, or
    in a region of another form). Every loop written through `omp_for` has iterations that
    write disjoint outputs, a region's own lines only set up scratch, and the lambda shares what
    the OpenMP loop shared (it captures by reference), so the results are the same bits; the
    caller may run every chunk (a static loop's too) when the workers are late."""
    lines = source.split("\n")
    out: list[str] = []
    operands: dict[str, str] = {}     # the current function's operand casts, by pointer name
    done = left = i = 0
    while i < len(lines):
        cast = _OPERAND.match(lines[i])
        if lines[i][:1] not in ("", " ", "\t", "#"):      # a function starts or ends (bodies are indented)
            operands = {}
        elif cast:
            operands[cast.group(1)] = lines[i].strip()
        else:      # a pointer moved after its cast is not cast again
            for name in [n for n in operands if re.search(rf"\b{n}\s*(?:[-+]?=)(?!=)", lines[i])]:
                del operands[name]
        got = _claimed(lines, i) if "#pragma omp parallel" in lines[i] else None
        if got is None:
            left += "GM_SCHED(" in lines[i] and lines[i].lstrip().startswith("#pragma omp")
            out.append(lines[i])
            i += 1
            continue
        text, i = got
        # The operands cast again inside the lambda, from the parameters: the outer pointers reached
        # through the [&] closure are reloaded in every loop (a float store might move them), which
        # GCC vectorises with gathers of the pointer: a layer norm ran 6-7x slower than as a plain loop.
        ind = re.match(r"\s*", text[0]).group(0)
        out += [text[0], *(f"{ind}  {op}" for op in operands.values()), *text[1:]]
        done += 1
    return "\n".join(out), done, left


__all__ = ["SCHEDULES", "DEFAULT_SCHEDULE", "auto_schedule", "resolve_schedule", "schedule_flags", "chunk_for", "schedule_clause",
           "omp_for", "claim_loops"]
