"""Generated fused scaled-dot-product attention (`sdpa`) for the CPU executor.

Why: at the sizes of a small encoder ([1, 12, 128, 32]) ATen's CPU flash kernel reaches about
a quarter of the roofline here: it packs and re-blocks for long sequences and runs its own
thread split. With every size baked in, one pass per query block does all of the work with
the scores in L1. What the built-in models pass: MiniLM a bool padding mask materialised as
[B, 1, S, S]; GPT-2 a bool causal-and-padding mask [B, 1, S, S] with is_causal False (ATen then
computes every masked score; the key-extent scan below recovers the causal structure).

Semantics are exactly `F.scaled_dot_product_attention` as the IR op's reference calls it:
`softmax(q k^T * scale + mask) v` over q [*, Sq, D], k [*, Sk, D], v [*, Sk, E] with the same
leading dims (at most two: batch, heads); the mask is bool (True = attend) or f32 (added),
broadcast to [B, H, Sq, Sk] from the right; `is_causal` keeps key j for query i iff j <= i
(top-left aligned, combined with a mask when both are given, as torch does); a row with no
attended key (all False, or all -inf) is 0, as torch returns (NaN under `nan_empty_rows`, which
the attention pass sets on an sdpa made from a softmax written out, whose answer it is); a NaN score anywhere in a row
makes that row NaN (a bool mask is applied as torch's dispatcher applies it, by adding 0 or
-inf, so a masked NaN or +inf score still poisons its row, as in torch's flash kernel; torch
itself differs between its kernels only on such non-finite inputs). One deliberate difference:
keys after the last key any row of a query block attends are never read, so a non-finite
value in, say, a padded key's K or V does not reach the output (in torch it would).
Under `layout: bshd` q, k, v and the output are [B, Sq|Sk, H, D|E] (the head permutes the fuse
pass folded in): the same problem, read and written with rows H * D apart (every operand's
batch, head and row strides are constants of the kernel). Anything else (other dtypes,
broadcast q/k/v batch dims, a mask that does not broadcast to the scores, dropout, huge
sizes) returns None and the reference op runs it.

Loops: a task is one (batch, head, query block of QB rows); tasks are split over an OpenMP
team (`num_threads(gm_nt())`, static shares or claimed chunks of whole heads: omp_loops) so each
thread takes whole heads in order and packs each head's K^T [D, Sk] (zero-padded to a multiple
of 16 keys) once into its own scratch.
Per task:

1. key extent: the block's rows only attend keys below `kend` (the causal diagonal, and the
   last attended key of each mask row, found by a backward scan), so causal and right-padded
   masks skip the dead columns of both GEMMs;
2. S = (Q K^T) * scale for the block: a register-blocked micro-kernel (MR query rows x NV
   vectors of keys, Q broadcast from its row-major rows, K^T rows as vectors);
3. per row, two passes over S (a block's rows fit in L1 up to Sk ~ 256): mask + max, then
   exp(s - max) + sum in 16 partial sums (a plain `omp simd reduction(+)` ends every row in 16
   dependent scalar adds); rows whose max is -inf (fully masked) become 0 (NaN if a score
   was NaN); 1/sum is kept per row (the scale is applied when S is stored). The exponential is the prelude's polynomial
   (`gm_expf_nc`, same ~1 ulp as `gm_expf`) with arguments below -87 set to exactly 0:
   `s - max <= 0`, so that only drops weights under 1.7e-38 of the row's largest one (masked
   keys, -inf, give 0 as in torch), and saves `gm_expf`'s clamps and two-step scaling, whose
   only purpose is the subnormal range (~8% of the kernel);
4. O = (P V) * (1/sum): a second micro-kernel (MR rows x up to 3 vectors of E, P broadcast,
   V rows as vectors, masked loads/stores on an E tail).

Micro-kernels are templates over a vector-traits struct: AVX-512 (16 lanes), AVX2+FMA (8) and
a portable C struct (8), each behind `#if` on the compiler's own macros as in gemm.py, so a
kernel built for a host without AVX-512 takes the next path instead of failing to build.
The static C++ (vector traits, micro-kernels, the task body) is in templates/attention*.h;
this module writes the shape constants and the tile loops around the micro-kernels.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from graphmode.backends.cpu.abi import KernelSource, entry_point, kernel_source, template
from graphmode.backends.cpu.cexpr import lit
from graphmode.backends.cpu.isa import ISA_GUARD
from graphmode.backends.cpu.lowering import NATIVE, Claim, OpCall, claimed, lowers, refused
from graphmode.backends.cpu.omp_loops import omp_for
from graphmode.backends.cpu.tensors import dtype_of
from graphmode.ir.types import TensorType

MAX_SK = 16384          # per-thread scratch is (D + QB) x Sk floats; beyond, ATen's online softmax
MAX_HEAD_DIM = 256
PAR_FLOPS = 1 << 18     # below this the call runs on the calling thread: [1,12,16,32] (0.4 MFLOP) already gains
SK_ALIGN = 16           # K^T and score rows are padded to whole 16-float vectors (any ISA)


@dataclass(frozen=True)
class AttnTiles:
    """Register blocking for one ISA: QK tile `qk_mr` rows x `qk_nv` vectors of keys; PV tile
    `pv_mr` rows x at most `pv_nv` vectors of the value dim (E is split into balanced chunks)."""

    vl: int
    qk_mr: int
    qk_nv: int
    pv_mr: int
    pv_nv: int


# AVX-512: 32 registers (24 accumulators + the B vectors; the broadcast folds into the FMA);
# AVX2 and portable: 16 registers, as gemm.py's tiles for the same ISAs.
TILES = {"avx512": AttnTiles(16, 8, 2, 8, 3), "avx2": AttnTiles(8, 6, 2, 6, 2), "portable": AttnTiles(8, 4, 2, 4, 2)}
_TRAITS = {"avx512": "gm_attn_v512", "avx2": "gm_attn_v256", "portable": "gm_attn_vc"}


def vector_traits(name: str = "VT") -> list[str]:
    """C++ lines typedef'ing `name` as attention.h's vector traits of the ISA the build targets
    (AVX-512, AVX2+FMA, else portable), for other kernels written over them."""
    lines = []
    for isa in ("avx512", "avx2"):
        lines += [("#if " if isa == "avx512" else "#elif ") + ISA_GUARD[isa], f"typedef {_TRAITS[isa]} {name};"]
    return lines + ["#else", f"typedef {_TRAITS['portable']} {name};", "#endif"]


@dataclass(frozen=True)
class AttnProblem:
    """One sdpa instance with every size fixed. `mask`: "" (none), "bool" or "f32";
    `mstrides`: the mask's element strides over (batch, head, query, key), 0 where broadcast."""

    b: int
    h: int
    sq: int
    sk: int
    d: int
    e: int
    scale: float
    causal: bool
    mask: str = ""
    mstrides: tuple[int, int, int, int] = (0, 0, 0, 0)
    empty_nan: bool = False          # a row attending no key is NaN (a decomposed softmax), not 0 (torch's sdpa)
    layout: str = "bhsd"             # "bshd": q, k, v, out are [batch, seq, heads, dim] (head permutes folded in)

    def strides(self, seq: int, width: int) -> tuple[int, int, int]:
        """(batch, head, row) element strides of an operand with `seq` rows of `width`."""
        if self.layout == "bshd":
            return seq * self.h * width, width, self.h * width
        return self.h * seq * width, seq * width, width

    @property
    def flops(self) -> float:
        return 2.0 * self.b * self.h * self.sq * self.sk * (self.d + self.e)

    @property
    def text(self) -> str:
        m = f" mask {self.mask} strides {list(self.mstrides)}" if self.mask else ""
        c = " causal" if self.causal else ""
        n = " empty rows NaN" if self.empty_nan else ""
        lay = " bshd" if self.layout == "bshd" else ""
        return (f"sdpa{lay} [{self.b},{self.h}] q {self.sq}x{self.d} kv {self.sk}x{self.e}{c}{m} "
                f"scale {self.scale!r}{n}")


# ------------------------------------------------------------------------------ generation

def _chunks(nvec: int, most: int) -> list[int]:
    """`nvec` vectors split into the fewest chunks of at most `most`, sizes as even as possible."""
    n = math.ceil(nvec / most)
    return [nvec // n + (1 if i < nvec % n else 0) for i in range(n)]


def _isa_section(isa: str, p: AttnProblem, qb: int) -> list[str]:
    """`@SYM@_qk` / `@SYM@_pv` for one ISA: the tile loops with their remainder tiles as
    `switch`es over compile-time sizes (the vectors of the key tail, which depends on the mask
    at run time; the rows left over in a full and in the last query block, known here)."""
    t = TILES[isa]
    tr = _TRAITS[isa]
    L = t.vl
    block_rows = {qb, p.sq - (math.ceil(p.sq / qb) - 1) * qb}

    def rests(mr: int) -> list[int]:
        return sorted({n % mr for n in block_rows} - {0})
    out = [f"constexpr long VL = {L};",
           f"typedef {tr} VT;",
           "GM_INLINE void @SYM@_qk(const float* __restrict q, const float* __restrict kt, float* __restrict s,",
           "                        long nrows, long nvec) {",
           "  long i = 0;"]

    def qk_rows(mr: int, indent: str) -> list[str]:
        args = f"D, q + i * QLD, QLD, kt + jv * {L}, SKP, s + i * SKP + jv * {L}, SKP, SCALE"
        body = [f"{indent}long jv = 0;",
                f"{indent}for (; jv + {t.qk_nv} <= nvec; jv += {t.qk_nv}) gm_attn_qk<{tr}, {mr}, {t.qk_nv}>({args});"]
        if t.qk_nv > 1:
            body.append(f"{indent}switch (nvec - jv) {{")
            for nv in range(1, t.qk_nv):
                body.append(f"{indent}  case {nv}: gm_attn_qk<{tr}, {mr}, {nv}>({args}); break;")
            body.append(f"{indent}  default: break;")
            body.append(f"{indent}}}")
        return body

    out.append(f"  for (; i + {t.qk_mr} <= nrows; i += {t.qk_mr}) {{")
    out += qk_rows(t.qk_mr, "    ")
    out.append("  }")
    if rests(t.qk_mr):
        out.append("  switch (nrows - i) {")
        for mr in rests(t.qk_mr):
            out.append(f"    case {mr}: {{")
            out += qk_rows(mr, "      ")
            out.append("      break; }")
        out.append("    default: break;")
        out.append("  }")
    out.append("}")

    # PV: E in balanced chunks of at most pv_nv vectors; the last chunk may end in a partial vector
    out += ["GM_INLINE void @SYM@_pv(const float* __restrict pm, const float* __restrict v, const float* __restrict r,",
            "                        float* __restrict o, long nrows, long kj) {"]
    nvec = math.ceil(p.e / L)
    e0 = 0
    for ci, nv in enumerate(_chunks(nvec, t.pv_nv)):
        cols = min(nv * L, p.e - e0)
        last = cols - (nv - 1) * L
        args = f"kj, pm + i * SKP, SKP, v + {e0}, VLD, r + i, o + i * OLD + {e0}, OLD"
        out.append("  {")
        out.append("    long i = 0;")
        out.append(f"    for (; i + {t.pv_mr} <= nrows; i += {t.pv_mr}) "
                   f"gm_attn_pv<{tr}, {t.pv_mr}, {nv}, {last}>({args});")
        if rests(t.pv_mr):
            out.append("    switch (nrows - i) {")
            for mr in rests(t.pv_mr):
                out.append(f"      case {mr}: gm_attn_pv<{tr}, {mr}, {nv}, {last}>({args}); break;")
            out.append("      default: break;")
            out.append("    }")
        out.append("  }")
        e0 += cols
    out.append("}")
    return out


def query_block(p: AttnProblem) -> int:
    """Rows per task: 32 (the scores of a block stay in L1 up to Sk ~ 256), halved while that
    leaves fewer than 8 tasks to split over the threads."""
    qb = min(32, p.sq)
    while qb > 8 and p.b * p.h * math.ceil(p.sq / qb) < 8:
        qb //= 2
    return qb


def generate_attention(p: AttnProblem, *, parallel: bool | None = None) -> str:
    """The kernel text (with the `@SYM@` placeholder) for problem `p`:
    `@SYM@(q, k, v[, mask], out)` over contiguous buffers."""
    qb = query_block(p)
    nqb = math.ceil(p.sq / qb)
    skp = math.ceil(p.sk / SK_ALIGN) * SK_ALIGN
    tasks = p.b * p.h * nqb
    par = (p.flops >= PAR_FLOPS and tasks > 1) if parallel is None else (parallel and tasks > 1)
    mtype = {"": "uint8_t", "bool": "uint8_t", "f32": "float"}[p.mask]
    msb, msh, msi, msj = p.mstrides
    # everything per instance lives in its own namespace: several attention kernels share a TU
    lines = ["namespace @SYM@_ns {",
             f"constexpr long H = {p.h}, SQ = {p.sq}, SK = {p.sk}, D = {p.d}, E = {p.e};",
             f"constexpr long QB = {qb}, NQB = {nqb}, SKP = {skp}, TASKS = {tasks};",
             f"constexpr long MSB = {msb}, MSH = {msh}, MSI = {msi}, MSJ = {msj};",
             *(f"constexpr long {x}_SB = {sb}, {x}_SH = {sh}, {x}LD = {ld};"
               for x, (sb, sh, ld) in (("Q", p.strides(p.sq, p.d)), ("K", p.strides(p.sk, p.d)),
                                       ("V", p.strides(p.sk, p.e)), ("O", p.strides(p.sq, p.e)))),
             f"constexpr float SCALE = {lit(p.scale, 'f32')};",
             f"constexpr int MASK = {dict(zip(('', 'bool', 'f32'), range(3)))[p.mask]};  // 0 none, 1 bool, 2 additive f32",
             f"constexpr bool CAUSAL = {'true' if p.causal else 'false'};",
             f"constexpr bool EMPTY_NAN = {'true' if p.empty_nan else 'false'};  // a row attending no key: NaN, not 0",
             f"typedef {mtype} mask_t;"]
    for isa in ("avx512", "avx2"):
        lines.append(("#if " if isa == "avx512" else "#elif ") + ISA_GUARD[isa])
        lines += _isa_section(isa, p, qb)
    lines.append("#else")
    lines += _isa_section("portable", p, qb)
    lines.append("#endif")
    text = "\n".join(lines) + "\n" + template("attention_task.h") + "}  // namespace @SYM@_ns\n"
    nargs = 5 if p.mask else 4
    mask_arg = "(const @SYM@_ns::mask_t*)p3" if p.mask else "(const @SYM@_ns::mask_t*)0"
    out_arg = f"(float*)p{nargs - 1}"
    scratch = "(D * SKP + QB * SKP + QB) * sizeof(float) + 64"   # K^T, the block's scores, 1/sum; + alignment
    body = [
        "  using namespace @SYM@_ns;",
        "  const float* q = (const float*)p0; const float* k = (const float*)p1; const float* v = (const float*)p2;",
        f"  const mask_t* m = {mask_arg};",
        f"  float* o = {out_arg};",
    ]
    region = [
        f"    char* raw = (char*)malloc({scratch});",
        "    float* kt = (float*)(((size_t)raw + 63) & ~(size_t)63);",
        "    float* s = kt + D * SKP;",
        "    float* rs = s + QB * SKP;",
        "    for (long c = 0; c < D; ++c)",
        "      for (long j = SK; j < SKP; ++j) kt[c * SKP + j] = 0.0f;",
        "    long cached = -1;",
    ]
    if par:
        body += ["  #pragma omp parallel num_threads(gm_nt())", "  {"] + region + [
            "    " + omp_for(tasks, p.flops, region=False, align=nqb),   # chunks of whole heads: K^T is per head
            "    for (long t = 0; t < TASKS; ++t) task(q, k, v, m, o, t, kt, s, rs, &cached);",
            "    free(raw);",
            "  }"]
    else:
        body += ["  {"] + region + [
            "    for (long t = 0; t < TASKS; ++t) task(q, k, v, m, o, t, kt, s, rs, &cached);",
            "    free(raw);",
            "  }"]
    return template("attention.h") + text + "\n".join(entry_point(nargs, body)) + "\n"


def problem_of(ins_t: Sequence[torch.Tensor], outs: Sequence[torch.Tensor], attrs: Mapping) -> AttnProblem | None:
    """The fixed-size problem of one sdpa instruction, or None where the kernel does not
    cover it (ATen runs the op)."""
    if len(ins_t) not in (3, 4) or len(outs) != 1:
        return None
    if any(bool(v) for k, v in attrs.items() if k not in ("is_causal", "scale", "nan_empty_rows", "layout")):
        return None                                   # dropout, gqa, ...: not this kernel's semantics
    layout = attrs.get("layout", "bhsd")
    if layout not in ("bhsd", "bshd"):
        return None
    q, k, v = ins_t[:3]
    o = outs[0]
    if layout == "bshd":                              # as [batch, heads, seq, dim] views: the same sizes
        if not q.dim() == k.dim() == v.dim() == o.dim() == 4:
            return None
        q, k, v, o = (t.transpose(1, 2) for t in (q, k, v, o))
    mask = ins_t[3] if len(ins_t) == 4 else None
    if any(t.dtype != torch.float32 for t in (q, k, v, o)):
        return None
    r = q.dim()
    if r < 2 or r > 4 or k.dim() != r or v.dim() != r:
        return None
    lead = tuple(q.shape[:-2])
    if tuple(k.shape[:-2]) != lead or tuple(v.shape[:-2]) != lead:
        return None                                   # broadcast / grouped k, v
    sq, d = q.shape[-2:]
    sk, e = v.shape[-2:]
    if k.shape[-1] != d or k.shape[-2] != sk or tuple(o.shape) != lead + (sq, e):
        return None
    if min(sq, sk, d, e) < 1 or sk > MAX_SK or max(d, e) > MAX_HEAD_DIM:
        return None
    b, h = ((1, 1) + lead)[-2:]
    kind, strides = "", (0, 0, 0, 0)
    if mask is not None:
        if mask.dtype == torch.bool:
            kind = "bool"
        elif mask.dtype == torch.float32:
            kind = "f32"
        else:
            return None
        if mask.dim() > r:
            return None                               # the result would broadcast beyond q
        mshape = (1,) * (4 - mask.dim()) + tuple(mask.shape)
        full = (b, h, sq, sk)
        if any(m not in (1, f) for m, f in zip(mshape, full)):
            return None
        st, acc = [0, 0, 0, 0], 1
        for ax in (3, 2, 1, 0):
            st[ax] = acc if mshape[ax] > 1 else 0
            acc *= mshape[ax]
        strides = tuple(st)
    scale = attrs.get("scale")
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    if not math.isfinite(scale):
        return None
    return AttnProblem(b, h, sq, sk, d, e, scale, bool(attrs.get("is_causal", False)), kind, strides,
                       bool(attrs.get("nan_empty_rows", False)), layout)


def attention_source(p: AttnProblem, inputs: Sequence[str], outputs: Sequence[str],
                     types: Mapping[str, TensorType], *, parallel: bool | None = None) -> KernelSource:
    """The KernelSource of problem `p` over the buffers `inputs` (q, k, v[, mask]) / `outputs`."""
    text = generate_attention(p, parallel=parallel)
    return kernel_source("attn", text, inputs=tuple(inputs), outputs=tuple(outputs), types=dict(types),
                         kind="attention", parallel="#pragma omp parallel" in text, pattern=p.text)


@lowers("sdpa", tier=NATIVE)
def sdpa(call: OpCall) -> Claim:
    p = problem_of(call.ins, call.outs, call.attrs)
    if p is None:
        return refused("an sdpa this kernel does not cover (dtype, dropout, broadcast q/k/v, mask, size)")
    types = {n: TensorType(dtype_of(t), tuple(t.shape))
             for n, t in zip(list(call.inputs) + list(call.outputs), list(call.ins) + list(call.outs))}
    return claimed(lambda: attention_source(p, call.inputs, call.outputs, types))


__all__ = ["TILES", "AttnProblem", "AttnTiles", "attention_source", "generate_attention", "problem_of",
           "query_block", "sdpa"]
