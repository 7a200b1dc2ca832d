"""Generated fp32 GEMM kernels: register-blocked FMA micro-kernels over pre-packed weights.

Why not ATen: at batch 1 the GEMMs of a transformer are skinny (M = 16 rows against a
768x3072 weight) and the BLAS path reaches a fraction of peak there, mostly because it packs
the weight again on every call and splits the work badly over two threads. Here the weight
is a constant: it is packed ONCE, when the plan is built, into the panel layout the
micro-kernel streams, and every size is baked into the kernel as a constant.

Layout and loops (BLIS-style, with the B panels packed ahead of time):

- `C[m, n] = sum_k A[m, k] * B[k, n] (+ bias[n])`, A row-major [M, K] (`lda = K`), C
  row-major [M, N]. B is either *packed* (constant weights: panels of NR columns,
  `packed[jp][k][r] = B[k, jp*NR + r]`, zero-padded to a multiple of NR) or *row-major*
  [K, N] (a runtime operand of a batched matmul; the last panel is read with masked loads).
- micro-kernel: an MR x NR tile of C held in vector registers for a whole K block; per k
  it loads NR/VL vectors of B and broadcasts MR values of A (one FMA per register).
- loops: m-blocks of MC rows (A block in L2) / N panels / K blocks of KC (B panel slice in
  L1) / MR tiles. The parallel loop is over (batch, m-block, panel chunk) tasks, chunks
  sized so that every thread gets the same number of tasks: at batch 1 each thread streams
  its own half of the weight. It is an OpenMP loop (`par="omp"`: the same libgomp thread
  team torch's own ops use, so the two never compete for the CPUs; a separate
  caller-participating pool was tried and lost for exactly that reason) or no loop at all
  (`par="serial"`, which wins on a machine whose other CPUs are busy); GEMMs under
  PAR_FLOPS that read less than PAR_BYTES of B always run serially (`worth_threads`).
- bias is the accumulator's initial value (no extra pass over C).

ISA: AVX-512 (VL 16) or AVX2+FMA (VL 8) intrinsics, each behind `#if` on the compiler's own
macros, so a kernel compiled for a host without that ISA falls back to the portable C
micro-kernel (correct, slow) instead of failing to build; the tactic timing then never
picks it. `<immintrin.h>` is included with its `mm_malloc.h` guard pre-defined, since that
header's `<stdlib.h>` would clash with the prelude's own malloc/free declarations.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

import torch

from graphmode.backends.cpu.abi import KernelSource, entry_point, kernel_source, template
from graphmode.backends.cpu.epilogue import Epilogue, gemm_load
from graphmode.backends.cpu.isa import ISA_GUARD, ISAS, REGISTERS, VL
from graphmode.backends.cpu.omp_loops import MIN_CHUNKS, omp_for
from graphmode.errors import BackendError
from graphmode.ir.types import TensorType

PARS = ("omp", "serial")
PAR_FLOPS = 1 << 20      # below ~1 MFLOP a GEMM runs on one thread: a fork/join costs a few us
PAR_BYTES = 1 << 18      # ... unless it reads this much B: a decode step's GEMV is bound by that read, not its flops


def worth_threads(p: "GemmProblem") -> bool:
    """Whether a parallel loop may pay for its fork/join. Flops alone understate a GEMV: a
    batch-1 decode step's 576x576 f32 weight (1.3 MB, 0.66 MFLOP) takes ~40 us to read on one
    core, which a second core's share of the memory bandwidth shortens. Timing decides."""
    return p.flops >= PAR_FLOPS or p.batch * p.n * p.k * 4 >= PAR_BYTES


@dataclass(frozen=True)
class GemmConfig:
    """One blocking of the generated kernel. `kc` / `mc` of 0 mean "the whole K / M"."""

    isa: str
    mr: int
    nr: int
    kc: int = 0
    mc: int = 0
    split: int = 1     # tasks per thread: 1 = one static share each; >1 = finer tasks, dynamic schedule
    par: str = "omp"   # omp: an OpenMP parallel loop over the tasks; serial: the calling thread only

    def __post_init__(self):
        if self.isa not in VL:
            raise BackendError(f"unknown GEMM ISA {self.isa!r}", value=self.isa, fix=f"one of {', '.join(ISAS)}")
        if self.mr < 1 or self.nr < 1 or self.nr % VL[self.isa]:
            raise BackendError(f"bad GEMM tile {self.mr}x{self.nr} for {self.isa}", value=(self.mr, self.nr),
                               fix=f"nr must be a multiple of {VL[self.isa]}")
        if self.mc and self.mc % self.mr:
            raise BackendError(f"mc={self.mc} is not a multiple of mr={self.mr}", value=self.mc)
        if self.par not in PARS:
            raise BackendError(f"unknown GEMM parallel runtime {self.par!r}", value=self.par,
                               fix=f"one of {', '.join(PARS)}")

    @property
    def name(self) -> str:
        s = f"_s{self.split}" if self.split > 1 else ""
        s += f"_{self.par}" if self.par != "omp" else ""
        return f"{self.isa}_{self.mr}x{self.nr}_k{self.kc or 'all'}_m{self.mc or 'all'}{s}"

    @property
    def registers(self) -> int:
        """Vector registers the micro-kernel needs: accumulators, B vectors, one broadcast."""
        nv = self.nr // VL[self.isa]
        return self.mr * nv + nv + 1

    @staticmethod
    def parse(name: str) -> "GemmConfig":
        isa, tile, k, m, *rest = name.split("_")
        mr, nr = tile.split("x")
        kc, mc = k[1:], m[1:]
        split = next((int(r[1:]) for r in rest if r[:1] == "s" and r[1:].isdigit()), 1)
        par = next((r for r in rest if r in PARS), "omp")
        return GemmConfig(isa, int(mr), int(nr), 0 if kc == "all" else int(kc), 0 if mc == "all" else int(mc),
                          split, par)


@dataclass(frozen=True)
class GemmProblem:
    """One GEMM shape as the executor sees it. `batch` GEMMs of [m, k] @ [k, n]; `b_packed`:
    B is a constant packed at plan build (linear weights, constant matmul operands);
    `b_batched`: B has its own matrix per batch entry (else one B for every entry)."""

    op: str            # linear | matmul
    batch: int
    m: int
    n: int
    k: int
    bias: bool = False
    b_packed: bool = True
    b_batched: bool = False
    dtype: str = "f32"
    epi: Epilogue | None = None     # an elementwise epilogue applied at the store (epilogue.py)
    c_aliases_operand: bool = False  # C shares memory with an epilogue operand (an in-place residual add)

    @property
    def flops(self) -> float:
        return 2.0 * self.batch * self.m * self.n * self.k

    @property
    def text(self) -> str:
        b = f"{self.batch}x" if self.batch > 1 else ""
        extra = "+bias" if self.bias else ""
        extra += f"+{self.epi.text}" if self.epi is not None else ""
        layout = "packed" if self.b_packed else ("B batched" if self.b_batched else "B shared")
        return f"{self.op} {b}{self.m}x{self.n}x{self.k}{extra} {self.dtype} ({layout})"

    def key(self) -> dict:
        k = {"op": self.op, "batch": self.batch, "m": self.m, "n": self.n, "k": self.k, "bias": self.bias,
             "b_packed": self.b_packed, "b_batched": self.b_batched, "dtype": self.dtype}
        if self.epi is not None:
            k.update(epilogue=self.epi.digest, epilogue_kinds=list(self.epi.kinds),
                     c_aliases_operand=self.c_aliases_operand)
        return k


# ------------------------------------------------------------------------------------ packing

def packed_numel(n: int, k: int, nr: int) -> int:
    return math.ceil(n / nr) * nr * k


def pack_b(w: torch.Tensor, nr: int, *, transposed: bool) -> torch.Tensor:
    """Constant B in the micro-kernel's panel layout [ceil(N/nr), K, nr], zero-padded.

    `transposed=True`: `w` is a linear weight [N, K] (B = w^T); else `w` is B itself [K, N]."""
    if w.dim() != 2:
        raise BackendError("only 2-D GEMM operands can be packed", value=tuple(w.shape))
    wn = w if transposed else w.t()
    n, k = wn.shape
    full = n // nr
    out = torch.empty(math.ceil(n / nr), k, nr, dtype=w.dtype)
    # one pass over the weight (a zeroed [N, K] copy first was two more: GPT-2 binds 500 MB)
    out[:full].copy_(wn[:full * nr].unflatten(0, (full, nr)).transpose(1, 2))
    if full < out.shape[0]:
        out[full].zero_()
        out[full, :, :n - full * nr].copy_(wn[full * nr:].t())
    return out


# ------------------------------------------------------------------------------- generation




def _ukr_call(isa: str, rows: int, cols: int, maskb: bool, args: str) -> str:
    """A call of the micro-kernel for a `rows` x `cols` tile (cols <= nr)."""
    vl = VL[isa]
    nv = math.ceil(cols / vl)
    last = cols - (nv - 1) * vl
    mb = "true" if (maskb and last < vl) else "false"
    if isa == "portable":
        return f"gm_gemm_ukr_c<{rows}, {nv}, {last}, {mb}>({args});"
    return f"gm_gemm_ukr_{isa}<{rows}, {nv}, {last}, {mb}>({args});"


def _tiles(isa: str, cfg: GemmConfig, p: GemmProblem, rem_m: int, rem_n: int, indent: str) -> list[str]:
    """The M-tile loop of one (panel, K block): full MR tiles then the remainder rows, for a
    full or the partial last panel. With an epilogue the last K block stores the tile into
    a stack tile (after loading the partial sums there) and the epilogue writes C from it."""
    maskb = not p.b_packed
    args = "kc, a + i * K + pc, K, bp, LDB, cp + i * N, N, bb, pc == 0"
    targs = "kc, a + i * K + pc, K, bp, LDB, tile, NR, bb, pc == 0"
    out: list[str] = []

    def one(rows: int, cols: int) -> str:
        if p.epi is None:
            return _ukr_call(isa, rows, cols, maskb, args)
        return ("{ if (pc + kc < K) " + _ukr_call(isa, rows, cols, maskb, args)
                + f" else {{ if (pc > 0) @SYM@_load(cp + i * N, tile, {rows}, {cols}); "
                + _ukr_call(isa, rows, cols, maskb, targs)
                + f" @SYM@_epi(g, tile, cp + i * N, i, jp * NR, {rows}, {cols}); }} }}")

    def calls(cols: int) -> list[str]:
        body = [f"{indent}for (; i + {cfg.mr} <= m1; i += {cfg.mr}) " + one(cfg.mr, cols)]
        if rem_m:
            body.append(f"{indent}if (i < m1) " + one(rem_m, cols))
        return body

    if rem_n:
        out.append(f"{indent}if (jp == NP - 1) {{")
        out += ["  " + ln for ln in calls(rem_n)]
        out.append(f"{indent}}} else {{")
        out += ["  " + ln for ln in calls(cfg.nr)]
        out.append(f"{indent}}}")
    else:
        out += calls(cfg.nr)
    return out


def chunks_for(units: int, panels: int, threads: int) -> int:
    """Panel chunks per (batch, m-block) unit so that the task count is a multiple of
    `threads` (every thread gets the same work) where there are enough panels, and a multiple
    of that up to omp_loops.MIN_CHUNKS tasks where the panels allow: a static schedule still
    gives each thread the same contiguous panels, a dynamic one lets the threads that run
    claim the share of one the host took away."""
    if threads <= 1:
        return 1
    nch = max(1, min(panels, threads // math.gcd(units, threads)))
    for over in range(math.ceil(MIN_CHUNKS / (units * nch)), 1, -1):
        if nch * over <= panels:
            return nch * over
    return nch


def generate_gemm(p: GemmProblem, cfg: GemmConfig, threads: int) -> KernelSource:
    """The kernel for problem `p` with blocking `cfg`: `symbol(a, b[, bias], c)` over raw
    buffers (b packed by `pack_b(..., cfg.nr)` when `p.b_packed`)."""
    if p.dtype != "f32":
        raise BackendError(f"generated GEMM supports f32 only, not {p.dtype}", where=p.text,
                           fix="the ATen tactic runs other dtypes")
    if cfg.registers > REGISTERS[cfg.isa] and cfg.isa != "portable":
        raise BackendError(f"tile {cfg.mr}x{cfg.nr} needs {cfg.registers} vector registers, {cfg.isa} has "
                           f"{REGISTERS[cfg.isa]}", value=cfg.name, fix="use a smaller tile")
    M, N, K = p.m, p.n, p.k
    if p.epi is not None and p.batch != 1:
        raise BackendError("a fused epilogue needs a single (unbatched) GEMM", where=p.text,
                           fix="the epilogue runs as its own kernel")
    kc = min(cfg.kc or K, K)
    if p.epi is not None and p.c_aliases_operand and kc < K:
        raise BackendError("C aliases an epilogue operand: K blocks would overwrite it with partial sums",
                           where=p.text, value=cfg.name, fix="a configuration with the whole K in one block")
    mc = min(cfg.mc or M, M)
    mc = max(cfg.mr, mc - mc % cfg.mr) if mc < M else M
    npan = math.ceil(N / cfg.nr)
    mb = math.ceil(M / mc)
    if cfg.par == "serial":
        threads = 1
    units = p.batch * mb
    nch = chunks_for(units, npan, threads)
    if threads > 1 and cfg.split > 1:
        nch = max(1, min(npan, nch * cfg.split))
    tasks = p.batch * mb * nch
    rem_m = (M - (mb - 1) * mc) % cfg.mr
    rem_n = N % cfg.nr
    sa, sc = M * K, M * N
    sb = (npan * cfg.nr * K if p.b_packed else K * N) if p.b_batched else 0
    ldb = cfg.nr if p.b_packed else N
    b_off = "jp * (K * NR) + pc * NR" if p.b_packed else "pc * N + jp * NR"
    par = threads != 1 and tasks > 1 and worth_threads(p)
    n_epi = len(p.epi.kinds) if p.epi is not None else 0
    inputs = ("a", "b") + (("bias",) if p.bias else ()) + tuple(f"e{i}" for i in range(n_epi))
    lines = [
        "namespace {",
        "struct @SYM@_args { const float* A; const float* B; const float* bias; float* C; "
        + "".join(f"const float* e{i}; " for i in range(n_epi)) + "};",
        f"constexpr long @SYM@_tasks = {tasks};",
    ]
    if p.epi is not None:
        lines += _epilogue_fns(p, cfg)
    lines += [
        "void @SYM@_task(const void* ctx, long t) {",
        "  const @SYM@_args* g = (const @SYM@_args*)ctx;",
        "  const float* bias = g->bias;",
        f"  constexpr long M = {M}, N = {N}, K = {K}, KC = {kc}, MC = {mc}, NR = {cfg.nr}, NP = {npan};",
        f"  constexpr long MB = {mb}, NCH = {nch}, LDB = {ldb};",
        "  (void)NR; (void)MB;",
        "  const long bt = t / (MB * NCH), ib = (t / NCH) % MB, ch = t % NCH;",
        "  const long p0 = ch * NP / NCH, p1 = (ch + 1) * NP / NCH;",
        f"  const float* a = g->A + bt * {sa}L;",
        f"  const float* b = g->B + bt * {sb}L;",
        f"  float* c = g->C + bt * {sc}L;",
        "  const long m0 = ib * MC, m1 = (m0 + MC < M) ? m0 + MC : M;",
        *([f"  alignas(64) float tile[{cfg.mr * cfg.nr}];"] if p.epi is not None else []),
        "  for (long jp = p0; jp < p1; ++jp) {",
        "    float* cp = c + jp * NR;",
        "    const float* bb = bias ? bias + jp * NR : nullptr;",
        "    for (long pc = 0; pc < K; pc += KC) {",
        "      const long kc = (K - pc < KC) ? K - pc : KC;",
        f"      const float* bp = b + {b_off};",
        "      long i = m0;",
    ]
    body = _tiles(cfg.isa, cfg, p, rem_m, rem_n, " " * 6)
    if cfg.isa in ISA_GUARD:
        lines.append(f"#if {ISA_GUARD[cfg.isa]}")
        lines += body
        lines.append("#else")
        lines += _tiles("portable", GemmConfig("portable", cfg.mr, cfg.nr, cfg.kc, cfg.mc, cfg.split, cfg.par), p,
                        rem_m, rem_n, " " * 6)
        lines.append("#endif")
    else:
        lines += body
    lines += ["    }", "  }", "}", "}  // namespace", ""]
    args = (f"  const @SYM@_args g = {{(const float*)p0, (const float*)p1, "
            f"{'(const float*)p2' if p.bias else 'nullptr'}, (float*)p{len(inputs)}"
            + "".join(f", (const float*)p{len(inputs) - n_epi + i}" for i in range(n_epi)) + "};")
    loop = "  for (long t = 0; t < @SYM@_tasks; ++t) @SYM@_task(&g, t);"
    omp = ["  " + omp_for(tasks, p.flops, fixed="dynamic, 1" if cfg.split > 1 else None)] if par else []
    lines += entry_point(len(inputs) + 1, [args, *omp, loop])
    return kernel_source("gemm", template("gemm.h") + "\n".join(lines) + "\n", inputs=inputs, outputs=("c",),
                         types=_types(p, cfg), kind="gemm", parallel=par, pattern=f"{p.text} [{cfg.name}]")


def _epilogue_fns(p: GemmProblem, cfg: GemmConfig) -> list[str]:
    """`@SYM@_load` (C tile -> stack tile: the partial sums of the earlier K blocks) and
    `@SYM@_epi` (stack tile -> C through the epilogue, operands read at (row, col))."""
    loads = [gemm_load(k, i, p.n) for i, k in enumerate(p.epi.kinds)]
    return [
        "GM_INLINE void @SYM@_load(const float* c, float* tile, long rows, long cols) {",
        "  for (long r = 0; r < rows; ++r)",
        f"    for (long j = 0; j < cols; ++j) tile[r * {cfg.nr} + j] = c[r * {p.n}L + j];",
        "}",
        "GM_GEMM_EPI void @SYM@_epi(const @SYM@_args* g, const float* __restrict tile, float* c, long r0, long c0, "
        "long rows, long cols) {",
        "  for (long r = 0; r < rows; ++r) {",
        "    const long row = r0 + r;",
        "    #pragma omp simd",
        "    for (long j = 0; j < cols; ++j) {",
        "      const long col = c0 + j;",
        "      (void)row; (void)col;",
        *p.epi.render(f"tile[r * {cfg.nr} + j]", loads, "      "),
        f"      c[r * {p.n}L + j] = res;",
        "    }",
        "  }",
        "}",
    ]


def _types(p: GemmProblem, cfg: GemmConfig) -> Mapping[str, TensorType]:
    bshape = ((p.batch if p.b_batched else 1) * packed_numel(p.n, p.k, cfg.nr),) if p.b_packed else \
        ((p.batch, p.k, p.n) if p.b_batched else (p.k, p.n))
    t = {"a": TensorType("f32", (p.batch, p.m, p.k)), "b": TensorType("f32", bshape),
         "c": TensorType("f32", (p.batch, p.m, p.n))}
    if p.bias:
        t["bias"] = TensorType("f32", (p.n,))
    for i, k in enumerate(p.epi.kinds if p.epi is not None else ()):
        t[f"e{i}"] = TensorType("f32", {"full": (p.m, p.n), "last": (p.n,), "scalar": (1,)}[k])
    return t


__all__ = ["GemmConfig", "GemmProblem", "generate_gemm", "pack_b", "packed_numel",
           "chunks_for", "PAR_FLOPS"]
