"""Memory bandwidth and FMA peak as the best kernels see them: multi-threaded streaming reads
of a buffer far larger than the caches, and register-resident FMA chains.

One torch copy measured 8.4 GB/s on a host where llama.cpp read GPT-2's weights at ~19 GB/s,
so `graphmode profile` showed kernels at 123% of the memory roofline and the cost model and
the SLA proofs rested on a number below what the machine does. A roofline is an upper bound:
it needs the best a kernel can stream, not what one library call happens to reach. So the
probe runs small C kernels, each on `threads` POSIX threads sweeping their own contiguous
slice, timed in C between two barriers (best of several passes):

- `read`: a vectorised sum reduction (GCC vector extensions: whatever SIMD `-march=native`
  gives), 8 independent accumulators;
- `read_prefetch`: the same with software prefetch 1 KiB ahead;
- `read_nt`: non-temporal loads (x86 with AVX2: `prefetchnta` + `vmovntdqa`); absent on other
  ISAs, and said so in `bandwidth_note`;
- `copy`: `memcpy` of one half of the buffer onto the other (libc uses streaming stores at this
  size); read + written bytes, the write side of the memory system.

The roofline uses the best read (`best_read`); every variant's GB/s stays in the probe facts.

The same library measures the FMA peak (`measure_fma_peak`): on each thread FMA_CHAINS
independent `acc = acc * m + c` chains of the widest vector the build has (one AVX-512, AVX2
or SSE/NEON register each), nothing loaded. Peaks computed from the clock that a VM reports
(its nominal TSC clock) read low: on this project's 2-vCPU Zen 4 guest the theoretical f32 peak
said 166 GFLOP/s and torch's GEMM reached about that, while generated GEMM micro-kernels ran at
215-225, so the bench's compute floors were beaten by a quarter.

The buffer (`stream_buffer_bytes`) is STREAM_FACTOR x the last-level cache that sysfs reports,
at least STREAM_MIN and at most STREAM_MAX (and an eighth of memory). The factor is large on
purpose: a virtual machine reports the cache of its own slice, not what its cores may hit. On
a 2-vCPU KVM guest whose sysfs said 32 MiB of L3 (AMD Zen 4), 2 threads read 64-256 MiB
buffers at up to 58-65 GB/s (best pass) but 512 MiB at 35-57 and 768-1024 MiB at 31-34,
while one thread read ~28-31 GB/s at every size; the guest cannot tell which of that is cache.

The kernels are compiled with the system C compiler (cc, gcc or clang; ~0.3 s) into a
temporary folder, once per process for both measurements, not through
`backends/cpu/build.py`: targets/ sits below the backends (backends/cpu/tactics imports
targets.host), so it must not import them. Without a
working compiler the probe falls back to torch (`sum` for the read, `copy_` for the copy) and
says so in `bandwidth_method`; those read lower.
"""
from __future__ import annotations

import ctypes
import functools
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

MIB = 2**20
STREAM_FACTOR = 16            # x the reported LLC (see the module doc: VMs under-report it)
STREAM_MIN = 256 * MIB
STREAM_MAX = 512 * MIB        # well under 1 GiB, and a pass stays ~20 ms at 25 GB/s
COMPILERS = ("cc", "gcc", "clang")
FLAG_SETS = (("-O3", "-march=native"), ("-O3",))     # the second for compilers that reject -march=native
COMPILE_TIMEOUT_S = 60
READ_VARIANTS = ("read", "read_prefetch", "read_nt")
VARIANTS = READ_VARIANTS + ("copy",)
_FILL = 4                     # the kernel's first-touch pass (not a measurement)
FMA_CHAINS = 12               # independent FMA chains per thread (the C kernel's FMA_CHAINS)

_SRC = r"""
#define _GNU_SOURCE
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/mman.h>
#if defined(__x86_64__) && defined(__AVX2__)
#include <immintrin.h>
#define GM_NT 1
#else
#define GM_NT 0
#endif

typedef float vf __attribute__((vector_size(32)));
enum { READ = 0, READ_PREFETCH = 1, READ_NT = 2, COPY = 3, FILL = 4, FMA = 5 };
#define STEP 256          /* bytes per loop iteration: 8 vectors, 4 cache lines */
#define PF 1024           /* software prefetch distance, bytes */

volatile float gm_bw_sink;

static float hsum(vf a) { float s = 0; for (int i = 0; i < 8; ++i) s += a[i]; return s; }

#define ACC8(v) a0 += v[0]; a1 += v[1]; a2 += v[2]; a3 += v[3]; a4 += v[4]; a5 += v[5]; a6 += v[6]; a7 += v[7]

static float read_plain(const char* p, size_t n) {
  vf a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, a4 = {0}, a5 = {0}, a6 = {0}, a7 = {0};
  for (size_t i = 0; i < n; i += STEP) { const vf* v = (const vf*)(p + i); ACC8(v); }
  return hsum(a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7);
}

static float read_prefetch(const char* p, size_t n) {
  vf a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, a4 = {0}, a5 = {0}, a6 = {0}, a7 = {0};
  for (size_t i = 0; i < n; i += STEP) {
    const vf* v = (const vf*)(p + i);
    __builtin_prefetch(p + i + PF, 0, 3); __builtin_prefetch(p + i + PF + 64, 0, 3);
    __builtin_prefetch(p + i + PF + 128, 0, 3); __builtin_prefetch(p + i + PF + 192, 0, 3);
    ACC8(v);
  }
  return hsum(a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7);
}

#if GM_NT
#define NTL(k) _mm256_castsi256_ps(_mm256_stream_load_si256(v + k))
static float read_nt(const char* p, size_t n) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
  for (size_t i = 0; i < n; i += STEP) {
    __m256i* v = (__m256i*)(p + i);
    _mm_prefetch(p + i + PF, _MM_HINT_NTA); _mm_prefetch(p + i + PF + 64, _MM_HINT_NTA);
    _mm_prefetch(p + i + PF + 128, _MM_HINT_NTA); _mm_prefetch(p + i + PF + 192, _MM_HINT_NTA);
    a0 = _mm256_add_ps(a0, NTL(0)); a1 = _mm256_add_ps(a1, NTL(1)); a2 = _mm256_add_ps(a2, NTL(2));
    a3 = _mm256_add_ps(a3, NTL(3)); a4 = _mm256_add_ps(a4, NTL(4)); a5 = _mm256_add_ps(a5, NTL(5));
    a6 = _mm256_add_ps(a6, NTL(6)); a7 = _mm256_add_ps(a7, NTL(7));
  }
  float o[8];
  _mm256_storeu_ps(o, _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)),
                                    _mm256_add_ps(_mm256_add_ps(a4, a5), _mm256_add_ps(a6, a7))));
  return o[0] + o[1] + o[2] + o[3] + o[4] + o[5] + o[6] + o[7];
}
#endif

/* FMA_CHAINS independent FMA chains of the widest vector (FMA latency 4-5 cycles x 2 ports
   needs 8-10 in flight; 12 leave room and fit 16 AVX2 registers with m and c) */
#if defined(__AVX512F__)
typedef float vw __attribute__((vector_size(64)));
#elif defined(__AVX__)
typedef float vw __attribute__((vector_size(32)));
#else
typedef float vw __attribute__((vector_size(16)));
#endif
#define FMA_CHAINS @FMA_CHAINS@
int gm_fma_lanes(void) { return (int)(sizeof(vw) / sizeof(float)); }

static float fma_chains(size_t iters) {
  vw a[FMA_CHAINS];
  const vw m = (vw){} + 0.999999f, c = (vw){} + 1e-6f;    /* converges to 1: no overflow, no denormals */
  for (int k = 0; k < FMA_CHAINS; ++k) a[k] = (vw){} + 0.001f * (float)k;
  for (size_t i = 0; i < iters; ++i) {
#pragma GCC unroll @FMA_CHAINS@
    for (int k = 0; k < FMA_CHAINS; ++k) a[k] = a[k] * m + c;   /* contracted to one FMA (-ffp-contract=fast) */
  }
  vw t = a[0];
  for (int k = 1; k < FMA_CHAINS; ++k) t += a[k];
  float s = 0;
  for (int i = 0; i < (int)(sizeof(vw) / sizeof(float)); ++i) s += t[i];
  return s;
}

/* a barrier of a mutex and a condition: portable (macOS has no pthread_barrier_t) and it
   sleeps instead of spinning, which matters on an oversubscribed machine */
typedef struct { pthread_mutex_t m; pthread_cond_t c; int n, count, phase; } bar_t;

static void bar_wait(bar_t* b) {
  pthread_mutex_lock(&b->m);
  int phase = b->phase;
  if (++b->count == b->n) { b->count = 0; b->phase++; pthread_cond_broadcast(&b->c); }
  else while (phase == b->phase) pthread_cond_wait(&b->c, &b->m);
  pthread_mutex_unlock(&b->m);
}

typedef struct { int variant, reps, tid; char *src, *dst; size_t chunk; bar_t* bar; double* secs; float sink; } job_t;

static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }

static void* worker(void* arg) {
  job_t* j = (job_t*)arg;
  float sink = 0;
  for (int r = 0; r < j->reps; ++r) {
    bar_wait(j->bar);
    double t0 = now();
    switch (j->variant) {
      case READ: sink += read_plain(j->src, j->chunk); break;
      case READ_PREFETCH: sink += read_prefetch(j->src, j->chunk); break;
#if GM_NT
      case READ_NT: sink += read_nt(j->src, j->chunk); break;
#endif
      case COPY: memcpy(j->dst, j->src, j->chunk); break;
      case FILL: { float* f = (float*)j->src; for (size_t i = 0; i < j->chunk / 4; ++i) f[i] = 1.0f; } break;
      case FMA: sink += fma_chains(j->chunk); break;
    }
    bar_wait(j->bar);                       /* the pass ends when the slowest thread is done */
    if (j->tid == 0) j->secs[r] = now() - t0;
  }
  j->sink = sink;
  return NULL;
}

int gm_bw_has(int variant) { return variant == READ_NT ? GM_NT : (variant >= READ && variant <= FILL); }

/* the jobs on their threads (the caller's is thread 0); 0 when a thread could not start */
static int run_jobs(job_t* jobs, bar_t* bar, int threads) {
  pthread_t* th = (pthread_t*)calloc((size_t)threads, sizeof(pthread_t));
  if (!th) return 0;
  int started = 1;
  for (int t = 1; t < threads; ++t) {
    if (pthread_create(&th[t], NULL, worker, &jobs[t]) != 0) break;
    started++;
  }
  if (started != threads) {               /* the barrier would never open: release what started */
    pthread_mutex_lock(&bar->m); bar->n = started; pthread_mutex_unlock(&bar->m);
  }
  worker(&jobs[0]);
  float sink = 0;
  for (int t = 0; t < started; ++t) { if (t > 0) pthread_join(th[t], NULL); sink += jobs[t].sink; }
  gm_bw_sink = sink;
  free(th);
  return started == threads;
}

/* `reps` timed passes of `variant` over `bytes` of `buf` on `threads` threads (the copy moves
   the first half onto the second); seconds per pass in secs[]. Returns the bytes one pass
   moves (read + written), or -1. */
double gm_bw_run(int variant, char* buf, size_t bytes, int threads, int reps, double* secs) {
  if (!gm_bw_has(variant) || threads < 1 || reps < 1) return -1;
  size_t span = variant == COPY ? bytes / 2 : bytes;
  size_t chunk = span / (size_t)threads / STEP * STEP;
  if (chunk == 0) return -1;
  job_t* jobs = (job_t*)calloc((size_t)threads, sizeof(job_t));
  bar_t bar = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, threads, 0, 0};
  if (!jobs) return -1;
  for (int t = 0; t < threads; ++t) {
    jobs[t] = (job_t){variant, reps, t, buf + chunk * t, buf + span + chunk * t, chunk, &bar, secs, 0};
  }
  int ok = run_jobs(jobs, &bar, threads);
  free(jobs);
  if (!ok) return -1;
  return (double)(chunk * (size_t)threads) * (variant == COPY ? 2.0 : 1.0);
}

/* `reps` timed passes of `iters` FMA_CHAINS-chain iterations on each of `threads` threads;
   seconds per pass in secs[]. Returns the FLOPs one pass does, or -1. */
double gm_fma_run(size_t iters, int threads, int reps, double* secs) {
  if (threads < 1 || reps < 1 || iters < 1) return -1;
  job_t* jobs = (job_t*)calloc((size_t)threads, sizeof(job_t));
  bar_t bar = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, threads, 0, 0};
  if (!jobs) return -1;
  for (int t = 0; t < threads; ++t) jobs[t] = (job_t){FMA, reps, t, NULL, NULL, iters, &bar, secs, 0};
  int ok = run_jobs(jobs, &bar, threads);
  free(jobs);
  if (!ok) return -1;
  return 2.0 * (double)iters * FMA_CHAINS * (double)gm_fma_lanes() * threads;
}

char* gm_bw_alloc(size_t bytes) {
  void* p = NULL;
  if (posix_memalign(&p, (size_t)1 << 21, bytes) != 0) return NULL;
#ifdef MADV_HUGEPAGE
  madvise(p, bytes, MADV_HUGEPAGE);       /* fewer TLB misses: what a large tensor gets under THP */
#endif
  return (char*)p;
}

void gm_bw_free(char* p) { free(p); }
"""


def stream_buffer_bytes(llc_bytes: int, memory_bytes: int | None = None) -> int:
    """The streaming buffer: STREAM_FACTOR x the LLC, within [STREAM_MIN, STREAM_MAX], at most
    an eighth of memory, a multiple of 2 MiB (huge-page aligned halves for the copy)."""
    size = min(max(STREAM_FACTOR * max(int(llc_bytes), 0), STREAM_MIN), STREAM_MAX)
    if memory_bytes:
        size = min(size, memory_bytes // 8)
    return max(2 * MIB, size // (2 * MIB) * (2 * MIB))


def best_read(variants: Mapping[str, float | None]) -> tuple[str, float] | None:
    """(name, GB/s) of the fastest read variant (`read*`, or torch's `sum`); the copy moves
    reads and writes and is not a read bandwidth. None when no read was measured."""
    reads = [(v, k) for k, v in variants.items() if (k.startswith("read") or k == "sum")
             and isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0]
    if not reads:
        return None
    gbps, name = max(reads)
    return name, float(gbps)


def _compile(compilers: Sequence[str], folder: Path) -> tuple[ctypes.CDLL | None, str]:
    """(the loaded kernel library, "compiler flags") or (None, why not)."""
    src = folder / "bandwidth.c"
    src.write_text(_SRC.replace("@FMA_CHAINS@", str(FMA_CHAINS)))
    tried: list[str] = []
    for name in compilers:
        cc = shutil.which(name)
        if cc is None:
            tried.append(f"{name}: not found")
            continue
        for flags in FLAG_SETS:
            out = folder / f"bandwidth{len(tried)}.so"
            try:
                res = subprocess.run([cc, *flags, "-std=gnu11", "-shared", "-fPIC", "-pthread", str(src), "-o",
                                      str(out)], capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
            except (OSError, subprocess.SubprocessError) as e:
                tried.append(f"{name}: {e}")
                break
            if res.returncode != 0:
                tried.append(f"{name} {' '.join(flags)}: {(res.stderr.strip().splitlines() or ['failed'])[-1]}")
                continue
            try:
                lib = ctypes.CDLL(str(out))
            except OSError as e:
                tried.append(f"{name}: does not load: {e}")
                continue
            lib.gm_bw_alloc.restype = ctypes.c_void_p
            lib.gm_bw_alloc.argtypes = [ctypes.c_size_t]
            lib.gm_bw_free.argtypes = [ctypes.c_void_p]
            lib.gm_bw_has.argtypes = [ctypes.c_int]
            lib.gm_fma_run.restype = ctypes.c_double
            lib.gm_fma_run.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_double)]
            lib.gm_fma_lanes.restype = ctypes.c_int
            lib.gm_bw_run.restype = ctypes.c_double
            lib.gm_bw_run.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                                      ctypes.POINTER(ctypes.c_double)]
            return lib, f"{Path(cc).name} {' '.join(flags)}"
    return None, "; ".join(tried) or "no compiler to try"


@functools.lru_cache(maxsize=4)
def _kernels(compilers: tuple[str, ...]) -> tuple[ctypes.CDLL | None, str]:
    """The probe's C kernels, compiled once per process for both the bandwidth and the FMA
    measurement (the loaded library outlives its temporary folder)."""
    try:
        with tempfile.TemporaryDirectory(prefix="graphmode-probe-", ignore_cleanup_errors=True) as tmp:
            return _compile(compilers, Path(tmp))
    except OSError as e:        # a full or unwritable TMPDIR: the probe measures without its C kernels
        return None, f"the temporary folder {tempfile.gettempdir()} cannot be written ({e.strerror or e}): set TMPDIR"


def _reps(pass_s: float, slot_s: float) -> int:
    """Passes per variant and round: what fits the slot, at least 2, at most 8."""
    return max(2, min(8, int(slot_s / max(pass_s, 1e-6))))


def _measure_c(lib: ctypes.CDLL, threads: int, nbytes: int, budget_s: float) -> dict[str, float]:
    """GB/s per available variant: best pass over two interleaved rounds (a burst of other
    work on the machine then hits one round of a variant, not all of it)."""
    buf = lib.gm_bw_alloc(nbytes)
    if not buf:
        raise MemoryError(f"cannot allocate the {nbytes / MIB:.0f} MiB streaming buffer")
    try:
        secs = (ctypes.c_double * 8)()
        if lib.gm_bw_run(_FILL, buf, nbytes, threads, 1, secs) < 0:      # first touch, by the same threads
            raise RuntimeError(f"the bandwidth kernel refused {threads} thread(s) over {nbytes} bytes")
        lib.gm_bw_run(0, buf, nbytes, threads, 1, secs)                  # warm: page tables, thread wake-up
        names = [v for i, v in enumerate(VARIANTS) if lib.gm_bw_has(i)]
        reps = _reps(secs[0], budget_s / (2 * len(names)))
        best: dict[str, float] = {}
        for _round in range(2):
            for name in names:
                moved = lib.gm_bw_run(VARIANTS.index(name), buf, nbytes, threads, reps, secs)
                t = min(secs[:reps])
                if moved > 0 and t > 0:
                    best[name] = max(best.get(name, 0.0), moved / t / 1e9)
        return best
    finally:
        lib.gm_bw_free(buf)


def _measure_torch(nbytes: int, budget_s: float) -> dict[str, float]:
    """The fallback without a C compiler: torch's sum (read) and copy_ (read + write), at
    torch's current thread count."""
    import torch
    x = torch.ones(nbytes // 4)
    half = x.numel() // 2
    src, dst = x[:half], x[half:2 * half]
    out: dict[str, float] = {}
    with torch.inference_mode():
        for name, fn, moved in (("sum", lambda: x.sum(), x.numel() * 4), ("copy", lambda: dst.copy_(src), half * 8)):
            fn()
            times = []
            deadline = time.perf_counter() + budget_s / 2
            for _ in range(8):
                s = time.perf_counter()
                fn()
                times.append(time.perf_counter() - s)
                if time.perf_counter() > deadline:
                    break
            out[name] = moved / min(times) / 1e9
    return out


def measure_bandwidth(threads: int, buffer_bytes: int, budget_s: float = 0.6, *,
                      compilers: Sequence[str] = COMPILERS) -> dict[str, Any]:
    """Probe facts: `read_gbps` (best read: the roofline's bandwidth) and `read_variant`,
    `copy_gbps`, `bandwidth_variants_gbps` (every variant), `bandwidth_buffer_mib`,
    `bandwidth_threads`, `bandwidth_method` (the compiler and flags, or the torch fallback and
    why) and, when a variant is missing, `bandwidth_note`. `compilers=()` forces the fallback."""
    threads = max(1, int(threads))
    lib, how = _kernels(tuple(compilers))
    note = ""
    variants: dict[str, float] = {}
    if lib is not None:
        try:
            variants = _measure_c(lib, threads, buffer_bytes, budget_s)
            method = f"C kernel ({how}), {threads} thread(s)"
        except (MemoryError, RuntimeError) as e:
            lib, how = None, str(e)
    if lib is None:
        variants = _measure_torch(buffer_bytes, budget_s)
        method = f"torch sum / copy_ (no C kernel: {how}); reads lower than a streaming kernel"
    elif "read_nt" not in variants:
        note = "read_nt: no non-temporal loads on this ISA build (x86 AVX2 only)"
    best = best_read(variants)
    out: dict[str, Any] = {
        "bandwidth_variants_gbps": {k: round(v, 2) for k, v in variants.items()},
        "bandwidth_buffer_mib": round(buffer_bytes / MIB, 1), "bandwidth_threads": threads,
        "bandwidth_method": method}
    if best is not None:
        out["read_variant"], out["read_gbps"] = best[0], round(best[1], 2)
    if "copy" in variants:
        out["copy_gbps"] = round(variants["copy"], 2)
    if note:
        out["bandwidth_note"] = note
    return out


def measure_fma_peak(threads: int, budget_s: float = 0.3, *, compilers: Sequence[str] = COMPILERS) -> dict[str, Any]:
    """Probe facts: `fma_f32_gflops` (the best pass of the FMA chains on `threads` threads: the
    f32 FMA peak at the clock the cores actually run) and `fma_method`; without a C compiler
    only `fma_method`, saying why (the target then keeps its clock-based peak)."""
    threads = max(1, int(threads))
    lib, how = _kernels(tuple(compilers))
    if lib is None:
        return {"fma_method": f"not measured (no C kernel: {how})"}
    secs = (ctypes.c_double * 8)()
    iters = 1 << 14
    while True:                              # a pass of at least ~2 ms (the warm-up pass sizes it)
        flops = lib.gm_fma_run(iters, threads, 1, secs)
        if flops < 0:
            return {"fma_method": f"not measured: the FMA kernel refused {threads} thread(s)"}
        if secs[0] >= 2e-3 or iters >= 1 << 26:
            break
        iters *= 4
    best = 0.0
    for _round in range(2):                  # two rounds: a burst of other work hits one of them
        reps = _reps(secs[0], budget_s / 2)
        flops = lib.gm_fma_run(iters, threads, reps, secs)
        best = max(best, flops / min(secs[:reps]) / 1e9)
    lanes = lib.gm_fma_lanes()
    return {"fma_f32_gflops": round(best, 2),
            "fma_method": f"C kernel ({how}), {threads} thread(s), {FMA_CHAINS} chains of {lanes} floats"}


__all__ = ["FMA_CHAINS", "STREAM_FACTOR", "STREAM_MAX", "STREAM_MIN", "VARIANTS", "best_read", "measure_bandwidth",
           "measure_fma_peak", "stream_buffer_bytes"]
