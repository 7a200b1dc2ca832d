"""Generated paged KV-cache attention (`paged_attention`, ir/ops/kv.py) for the CPU executor.

Why: the reference op is a Python loop per sequence of torch indexing and an sdpa call; in
GPT-2 small batch-1 decoding that is ~0.45 ms per layer per token, a fifth of the decode step,
for a few microseconds of arithmetic. With every shape baked in, one call validates, writes
and attends.

Pools are f32, bf16 or f16 (memory.kv_cache.dtype): bf16 and f16 are written rounded to
nearest even as torch converts and widened when read (f16 keeps 3 more mantissa bits than bf16
in the same bytes, llama.cpp's default cache). Semantics are the reference's: for each sequence i
with n = lens[i] > 0 and s0 = start[i],
the keys/values of rows t < n go to cache position s0 + t (page table[i, pos / page_size],
slot pos % page_size) of the pools, IN PLACE (the pools are graph `state` constants at fixed
addresses), every sequence's writes before any read (sequences may share pages), then query
row t of head h attends causally to positions 0 .. s0 + t of kv head h / (heads / kv_heads)
with `scale` (1/sqrt(head_dim) when None). Rows t >= n and sequences with n <= 0 are zeros.
A sequence whose positions leave its table (n > seq, s0 < 0, s0 + n > max_pages * page_size)
or whose table names a page outside the pool is never read or written: its rows are zeros,
it is counted, and the bound step raises (where the reference would index out of range).

Loops: validation and the writes run on the calling thread (a few rows per decode step; the
writes of one slot by two sequences then land in the reference's order). The attention is
one task per (sequence, kv head, block of query rows), shared over an OpenMP team when the
call's causal work, known only at run time from lens and start, is worth it. Per query row
(templates/paged_attention.h): scores of L cache rows at a time as dot products over the
head dim, reduced across lanes into one vector (no packing of K: a decode row reads each key
once), softmax with 16 partial sums, then P V accumulated in registers, page by page. The
vector traits are attention.h's (AVX-512, AVX2+FMA, portable), chosen by ISA_GUARD.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from graphmode.backends.cpu.abi import KernelSource, status_export, template
from graphmode.backends.cpu.attention import PAR_FLOPS, vector_traits
from graphmode.backends.cpu.cexpr import lit
from graphmode.backends.cpu.lowering import NATIVE, Claim, OpCall, claimed, lowers, refused
from graphmode.backends.cpu.native import finish
from graphmode.backends.cpu.omp_loops import omp_for
from graphmode.backends.cpu.tensors import overlaps

MAX_HEAD_DIM = 256       # a row's P V accumulators and its query live in registers
ROWS_PER_TASK = 16       # query rows (all heads of a kv head together) per task
SPLIT = 64               # cache positions per task of a decode row: a Llama's 512-token context in 8 x 3 kv heads
STATUS = "paged_attention: sequence positions outside its block table or pool"
_KV = {torch.float32: ("f32", "float"), torch.bfloat16: ("bf16", "gm_u16"),   # pool dtype: name, C type
       torch.float16: ("f16", "gm_h16")}


@dataclass(frozen=True)
class PagedProblem:
    """One paged_attention instance: q [b, h, s, d], k [b, kvh, s, d], v [b, kvh, s, e],
    pools [pages, page, kvh, d|e], block_table [b, max_pages]."""

    b: int
    h: int
    kvh: int
    s: int
    d: int
    e: int
    pages: int
    page: int
    max_pages: int
    scale: float
    kv: str = "f32"                  # the pools' dtype: f32, bf16 or f16

    @property
    def text(self) -> str:
        return (f"paged_attention q [{self.b},{self.h},{self.s},{self.d}] kv_heads {self.kvh} v dim {self.e} "
                f"pool [{self.pages},{self.page}] {self.kv} table [{self.b},{self.max_pages}] scale {self.scale!r}")


def problem_of(call: OpCall) -> PagedProblem | str:
    """The fixed-size problem of `call`, or why the kernel does not cover it."""
    if len(call.ins) != 8 or len(call.outs) != 1:
        return "not q, k, v, k_pool, v_pool, block_table, start, lens -> out"
    q, k, v, kp, vp, table, start, lens = call.ins
    o = call.outs[0]
    if any(t.dtype != torch.float32 for t in (q, k, v, o)):
        return "q, k, v and the output must be f32"
    if kp.dtype != vp.dtype or kp.dtype not in _KV:
        return f"pools of {kp.dtype} / {vp.dtype} (the kernel reads and writes f32, bf16 or f16 pools, both alike)"
    if any(t.dtype != torch.int64 for t in (table, start, lens)):
        return "block_table, start and lens must be i64"
    if [t.dim() for t in call.ins] + [o.dim()] != [4, 4, 4, 4, 4, 2, 1, 1, 4]:
        return "ranks are not q/k/v/pools 4, block_table 2, start/lens 1"
    b, h, s, d = (int(x) for x in q.shape)
    kvh, e = int(k.shape[1]), int(v.shape[3])
    pages, page, max_pages = int(kp.shape[0]), int(kp.shape[1]), int(table.shape[1])
    shapes_ok = (tuple(k.shape) == (b, kvh, s, d) and tuple(v.shape) == (b, kvh, s, e)
                 and tuple(kp.shape) == (pages, page, kvh, d) and tuple(vp.shape) == (pages, page, kvh, e)
                 and tuple(table.shape) == (b, max_pages) and tuple(start.shape) == (b,)
                 and tuple(lens.shape) == (b,) and tuple(o.shape) == (b, h, s, e))
    if not shapes_ok:
        return "the shapes of q, k, v, the pools, the table and the output do not agree"
    if min(b, h, kvh, s, d, e, pages, page, max_pages) < 1 or h % kvh:
        return "an empty dim, or heads not a multiple of kv_heads"
    if max(d, e) > MAX_HEAD_DIM:
        return f"head dims above {MAX_HEAD_DIM}"
    if overlaps([kp], [vp]) or overlaps([o], call.ins) or overlaps([kp, vp], [q, k, v, table, start, lens]):
        return "the pools or the output share memory with another argument"
    scale = call.attrs.get("scale")
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    if not math.isfinite(scale):
        return "a non-finite scale"
    return PagedProblem(b, h, kvh, s, d, e, pages, page, max_pages, scale, _KV[kp.dtype][0])


def generate_paged(p: PagedProblem) -> tuple[str, str]:
    """(namespace text, entry body lines) of problem `p`'s kernel: @SYM@(q, k, v, k_pool,
    v_pool, block_table, start, lens, out)."""
    g = p.h // p.kvh
    tb = min(p.s, max(1, ROWS_PER_TASK // g))
    ntb = math.ceil(p.s / tb)
    lines = ["namespace @SYM@_ns {",
             f"constexpr long B = {p.b}, H = {p.h}, KVH = {p.kvh}, G = {g}, S = {p.s}, D = {p.d}, E = {p.e};",
             f"constexpr long PAGES = {p.pages}, PAGE = {p.page}, MAXP = {p.max_pages};",
             f"constexpr long TB = {tb}, NTB = {ntb}, TASKS = {p.b * p.kvh * ntb};",
             f"constexpr float SCALE = {lit(p.scale, 'f32')};",
             f"constexpr long SPLIT = {SPLIT};   // cache positions per task of a decode row (S == 1)",
             "typedef __UINT16_TYPE__ gm_u16;",
             "struct gm_h16 { gm_u16 b; };   // an IEEE half: its own type, so the pool's loads and stores overload",
             f"typedef {dict(_KV.values())[p.kv]} KV;",
             f"constexpr double PAR_WORK = {float(PAR_FLOPS)!r};   // flops below which one thread runs the call"]
    lines += vector_traits()
    text = "\n".join(lines) + "\n" + template("paged_attention.h") + "}  // namespace @SYM@_ns\n"
    body = [
        "  using namespace @SYM@_ns;",
        "  const float* q = (const float*)p0; const float* k = (const float*)p1; const float* v = (const float*)p2;",
        "  KV* kp = (KV*)p3; KV* vp = (KV*)p4;",
        "  const int64_t* table = (const int64_t*)p5; const int64_t* start = (const int64_t*)p6;",
        "  const int64_t* lens = (const int64_t*)p7; float* o = (float*)p8;",
        "  uint8_t ok[B];",
        "  long bad = 0, ctx = 0;",
        "  double work = 0.0;",
        "  for (long i = 0; i < B; ++i) {",
        "    ok[i] = (uint8_t)check(table + i * MAXP, start[i], lens[i]);",
        "    bad += ok[i] == 2;",
        "    if (ok[i] != 1) continue;",
        "    const long s0 = start[i], n = lens[i];",
        "    write(k, v, kp, vp, table + i * MAXP, i, s0, n);",
        "    ctx = s0 + n > ctx ? s0 + n : ctx;",
        "    work += 2.0 * H * (D + E) * (double)n * ((double)s0 + 0.5 * (double)(n + 1));",
        "  }",
        "  if (bad) __atomic_fetch_add(&@SYM@_bad, bad, __ATOMIC_RELAXED);",
        *(_decode_split() if p.s == 1 else _row_tasks(p.b * p.kvh * ntb)),
    ]
    return text, body


def _decode_split() -> list[str]:
    """Decode rows: tasks over (sequence, kv head, SPLIT positions), claimable by the pool, then
    the caller merges each head's parts (templates/paged_attention.h)."""
    return [
        "  long off[B + 1], nparts = 1;",
        "  off[0] = 0;",
        "  for (long i = 0; i < B; ++i) {",
        "    const long ns = ok[i] == 1 && lens[i] > 0 ? (start[i] + SPLIT) / SPLIT : 0;",
        "    off[i + 1] = off[i] + KVH * ns;",
        "    nparts = ns > nparts ? ns : nparts;",
        "  }",
        "  const long ntasks = off[B];",
        "  float* part = (float*)malloc((size_t)(B * H * nparts * (2 + E)) * sizeof(float) + 64);",
        "  const int nt = work >= PAR_WORK && ntasks > 1 ? gm_nt() : 1;",
        "  #pragma omp parallel for schedule(GM_SCHED(1)) num_threads(nt)",
        "  for (long t = 0; t < ntasks; ++t) split_task(q, kp, vp, table, start, off, nparts, part, t);",
        "  for (long i = 0; i < B; ++i)",
        "    for (long h = 0; h < H; ++h) {",
        "      float* orow = o + (i * H + h) * E;",
        "      const long ns = (off[i + 1] - off[i]) / KVH;",
        "      if (ns) merge(part + (i * H + h) * nparts * (2 + E), ns, orow);",
        "      else for (long x = 0; x < E; ++x) orow[x] = 0.0f;",
        "    }",
        "  free(part);",
    ]


def _row_tasks(tasks: int) -> list[str]:
    """Rows of a prefill (S > 1): one task per (sequence, kv head, block of query rows)."""
    return [
        "  const size_t scratch = (size_t)((ctx + 15) & ~15L) * sizeof(float) + 64;",
        "  #pragma omp parallel if(work >= PAR_WORK && TASKS > 1) num_threads(gm_nt())",
        "  {",
        "    char* raw = (char*)malloc(scratch);",
        "    float* s = (float*)(((size_t)raw + 63) & ~(size_t)63);",
        "    " + omp_for(tasks, region=False, fixed="dynamic"),
        "    for (long t = 0; t < TASKS; ++t) task(q, kp, vp, table, start, lens, ok, o, t, s);",
        "    free(raw);",
        "  }",
    ]


@lowers("paged_attention", tier=NATIVE)
def paged_attention(call: OpCall) -> Claim:
    p = problem_of(call)
    if isinstance(p, str):
        return refused(p)

    def make() -> KernelSource:
        text, body = generate_paged(p)
        return finish("paged_attention", call, body, header=template("attention.h") + text,
                      pre=status_export("@SYM@_bad"), parallel=True, pattern=p.text, status=STATUS)
    return claimed(make)


__all__ = ["PagedProblem", "problem_of", "generate_paged", "paged_attention", "STATUS"]
