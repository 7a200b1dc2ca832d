"""The work-claiming pool (graphmode/backends/cpu/claim_pool.py, templates/claim_pool.h) and the
`claim` schedule's rewriting of claimable loops (omp_loops.claim_loops). The stress tests run
many tiny jobs with more pool threads than cores (so workers are descheduled mid-job) and
from several callers at once, in a child process with a bounded wait: a hang fails the test
instead of stalling the suite. Nothing here asserts on a timing.
"""
from __future__ import annotations

import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from graphmode.backends.cpu.build import KernelBuilder
from graphmode.backends.cpu.omp_loops import claim_loops

_PROBE = KernelBuilder(Path(tempfile.gettempdir()) / "graphmode-test-probe")
needs_cxx = pytest.mark.skipif(not _PROBE.compiler_available(), reason="no C++ compiler on this machine")

PRAGMA = "#pragma omp parallel for schedule(GM_SCHED(2)) num_threads(gm_nt())"


def test_claimable_loops_become_pool_calls():
    src = "\n".join([
        "  " + PRAGMA,
        "  for (long t = 0; t < @SYM@_tasks; ++t) @SYM@_task(&g, t);",
        "  {",
        "    " + PRAGMA.replace("for ", "for simd "),
        "    for (int64_t r = 0; r < 64; ++r) {",
        "      const char* s = \"}\";  // }",
        "      if (r) { y[r] = x[r]; }",
        "    }",
        "  }",
        "  " + PRAGMA,
        "  for (long i = 0; i < 64L; ++i)",
        "  {",
        "    y[i] = 0;",
        "  }",
    ])
    out, done, left = claim_loops(src)
    assert (done, left) == (3, 0) and "#pragma omp parallel" not in out
    assert "  gm_parallel_for((long)(0), (long)(@SYM@_tasks), 2L, gm_nt(), [&](long gm_lo, long gm_hi) {\n" \
           "  for (long t = gm_lo; t < gm_hi; ++t) @SYM@_task(&g, t);\n  });" in out
    assert "    #pragma omp simd\n    for (int64_t r = gm_lo; r < gm_hi; ++r) {" in out
    assert "      if (r) { y[r] = x[r]; }\n    }\n    });\n  }" in out      # closed after the loop's own brace
    assert out.endswith("    y[i] = 0;\n  }\n  });")
    static = "  #pragma omp parallel for schedule(static) num_threads(T)\n  for (long t = 0; t < T; ++t) f(t);"
    assert claim_loops(static) == ("  gm_parallel_for((long)(0), (long)(T), 0L, T, [&](long gm_lo, long gm_hi) {\n"
                                   "  for (long t = gm_lo; t < gm_hi; ++t) f(t);\n  });", 1, 0)   # chunk 0: one per thread


def test_a_kernels_operands_are_cast_again_inside_its_lambda_unless_moved():
    src = "\n".join([
        "GM_EXPORT void gm_k(void* p0, void* p1, void* p2) {",
        "  const float* i0 = (const float*)p0;",
        "  const float* __restrict i1 = (const float*)p1;",
        "  float* o0 = (float*)p2;",
        "  i1 += 4;",
        "  " + PRAGMA,
        "  for (int64_t r = 0; r < 64; ++r) o0[r] = i0[r] + i1[r];",
        "}",
        "void other(const float* x, float* y) {",
        "  " + PRAGMA,
        "  for (int64_t r = 0; r < 64; ++r) y[r] = x[r];",
        "}",
    ])
    out, done, _ = claim_loops(src)
    assert done == 2
    assert ("  gm_parallel_for((long)(0), (long)(64), 2L, gm_nt(), [&](long gm_lo, long gm_hi) {\n"
            "    const float* i0 = (const float*)p0;\n    float* o0 = (float*)p2;\n"
            "  for (int64_t r = gm_lo; r < gm_hi; ++r) o0[r] = i0[r] + i1[r];") in out     # i1 moved: the outer one
    assert ("void other(const float* x, float* y) {\n"
            "  gm_parallel_for((long)(0), (long)(64), 2L, gm_nt(), [&](long gm_lo, long gm_hi) {\n"
            "  for (int64_t r = gm_lo;") in out                                  # nothing of gm_k's


def test_a_region_around_one_claimable_loop_becomes_a_pool_call():
    """Its own lines (per-thread scratch) run per chunk, around the chunk's iterations."""
    src = "\n".join([
        "  #pragma omp parallel num_threads(gm_nt())",
        "  {",
        "    float buf[8];",
        "    #pragma omp for schedule(GM_SCHED(4))",
        "    for (long t = 0; t < TASKS; ++t) task(t, buf);",
        "    done(buf);",
        "  }",
    ])
    assert claim_loops(src) == ("\n".join([
        "  gm_parallel_for((long)(0), (long)(TASKS), 4L, gm_nt(), [&](long gm_lo, long gm_hi) {",
        "    float buf[8];",
        "    for (long t = gm_lo; t < gm_hi; ++t) task(t, buf);",
        "    done(buf);",
        "  });",
    ]), 1, 0)
    for other in ("    #pragma omp barrier", "    #pragma omp for schedule(static)\n    for (long i = 0; i < 4; ++i) f(i);",
                  "    int me = omp_get_thread_num();", "    const long me = gm_thread_num();"):
        kept = src.replace("    done(buf);", other)
        assert claim_loops(kept)[:2] == (kept, 0)          # another construct, or thread identity: OpenMP's


@pytest.mark.parametrize("loop", [
    "  #pragma omp parallel for collapse(2) schedule(GM_SCHED(2)) num_threads(gm_nt())\n  for (long i = 0; i < 8; ++i)",
    "  #pragma omp for schedule(GM_SCHED(2))\n  for (long i = 0; i < 8; ++i) {\n  }",           # inside a region
    f"  {PRAGMA}\n  for (long i = 0; i < 8; i += 2) {{\n  }}",                                  # not ++i
    f"  {PRAGMA}\n  for (long i = 0; i < 8; ++i) {{\n  }} x = 1;",                              # code after the brace
])
def test_other_loops_stay_openmp(loop):
    out, done, left = claim_loops(loop)
    assert out == loop and (done, left) == (0, 1)


# One kernel: `reps` loops of `n` iterations each (chunk 1: n tiny chunks per job), every
# iteration adding 1 to its own element; the counts say every chunk ran exactly once per loop.
# reps and n are arguments, so every run shares one kernel library (and the pool's).
_STRESS = textwrap.dedent("""
    import sys, threading, torch
    from graphmode.backends.cpu import claim_pool
    from graphmode.backends.cpu.abi import entry_point, kernel_source
    from graphmode.backends.cpu.build import KernelBuilder
    from graphmode.ir.types import TensorType
    folder, threads, callers, reps, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    body = ["  const long reps = ((const long*)p0)[0], n = ((const long*)p0)[1];",
            "  long* out = (long*)p1;",
            "  for (long r = 0; r < reps; ++r) {",
            "    #pragma omp parallel for schedule(GM_SCHED(1)) num_threads(gm_nt())",
            "    for (long i = 0; i < n; ++i) {",
            "      out[i] += 1;",
            "    }",
            "  }"]
    src = kernel_source("stress", "\\n".join(entry_point(2, body)) + "\\n", inputs=("size",), outputs=("out",),
                        types={"size": TensorType("i64", (2,)), "out": TensorType("i64", (n,))}, kind="native",
                        parallel=True)
    k = KernelBuilder(folder, threads=threads, schedule="claim").build(src)
    size = torch.tensor([reps, n], dtype=torch.int64)
    outs = [torch.zeros(n, dtype=torch.int64) for _ in range(callers)]
    ts = [threading.Thread(target=k, args=([size.data_ptr(), o.data_ptr()],)) for o in outs]
    for t in ts: t.start()
    for t in ts: t.join()
    bad = [o.tolist() for o in outs if not bool((o == reps).all())]
    s = claim_pool.stats()
    print("stats", s)
    assert not bad, bad[:1]
    assert s["jobs"] + s["inline_jobs"] == (callers * reps if threads > 1 else 0), s
    assert s["workers"] == threads - 1, s
    print("ok")
""")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("claim-pool")


def _stress(folder, threads: int, callers: int, reps: int, n: int) -> str:
    res = subprocess.run([sys.executable, "-c", _STRESS, str(folder), str(threads), str(callers), str(reps), str(n)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "ok" in res.stdout, res.stdout + res.stderr[-3000:]
    return res.stdout


@needs_cxx
def test_many_tiny_jobs_with_more_threads_than_cores(folder):
    """8 pool threads on a 2-core host: workers are descheduled mid-job, late ones find old
    jobs gone; every chunk runs exactly once per job and nothing hangs (bounded by the child's
    timeout)."""
    out = _stress(folder, threads=8, callers=1, reps=3000, n=13)
    assert "'inline_jobs': 0" in out              # one caller: every loop went through the pool


@needs_cxx
@pytest.mark.slow
def test_concurrent_callers_and_a_single_thread(folder):
    """Three Python threads call claim kernels at once: one job at a time on the pool, the others
    run their loops alone; and a 1-thread build never starts a worker."""
    _stress(folder, threads=3, callers=3, reps=500, n=9)
    _stress(folder, threads=1, callers=1, reps=50, n=9)


# One kernel: a loop of 4 chunks on 2 threads, each chunk writing the id of the thread that ran
# it; the c-th chunk to start waits (yielding, bounded) until the (c + c % 2)-th has started, so
# both threads hold a chunk before either can finish one and claim the next.
_HOMES = textwrap.dedent("""
    import sys, threading, torch
    from graphmode.backends.cpu.abi import entry_point, kernel_source
    from graphmode.backends.cpu.build import KernelBuilder
    from graphmode.ir.types import TensorType
    body = ["  long* out = (long*)p1;",
            "  #pragma omp parallel for schedule(GM_SCHED(1)) num_threads(gm_nt())",
            "  for (long i = 0; i < 4; ++i) {",
            "    out[i] = (long)syscall(SYS_gettid);",
            "    const long c = __atomic_add_fetch(&out[4], 1, __ATOMIC_SEQ_CST), pair = c + (c & 1);",
            "    for (long s = 0; __atomic_load_n(&out[4], __ATOMIC_SEQ_CST) < pair && s < 100000000L; ++s) sched_yield();",
            "  }"]
    text = "#include <sched.h>\\n#include <sys/syscall.h>\\n#include <unistd.h>\\n" + "\\n".join(entry_point(2, body)) + "\\n"
    src = kernel_source("homes", text, inputs=("x",), outputs=("out",),
                        types={"x": TensorType("i64", (1,)), "out": TensorType("i64", (5,))}, kind="native",
                        parallel=True)
    k = KernelBuilder(sys.argv[1], threads=2, schedule="claim").build(src)
    x = torch.zeros(1, dtype=torch.int64)
    me = threading.get_native_id()
    for _ in range(20):
        out = torch.zeros(5, dtype=torch.int64)
        k([x.data_ptr(), out.data_ptr()])
        tids = out[:4].tolist()
        assert tids[0] == tids[1] == me and tids[2] == tids[3] != me, (tids, me)
    print("ok")
""")


@needs_cxx
def test_each_thread_runs_its_home_range_when_all_run(folder):
    """The caller takes the first half of a job's chunks and the worker the second, in every
    job: consecutive loops over the same rows keep them on the same core (one shared counter
    handed them out in claim order, to whichever thread came first)."""
    res = subprocess.run([sys.executable, "-c", _HOMES, str(folder)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "ok" in res.stdout, res.stdout + res.stderr[-3000:]
