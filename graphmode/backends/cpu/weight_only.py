"""What the weight-only linears share: the int8/bf16 kernel (wgemm.py) and the int4 one
(q4gemm.py) pick their code path per ISA, switch to f32 panels from the same row count and
split output columns between threads alike; kept here so neither imports the other's module
(wgemm hands packed int4 weights to q4gemm)."""
from __future__ import annotations

from graphmode.backends.cpu.isa import ISA_GUARD

PAR_FLOPS = 1 << 18      # below this one thread: a [1, 64] x [64, 64] layer is done before a team wakes
PANEL = {"avx512": ("gm_wq_p512", 8, 2, 16), "avx2": ("gm_wq_p256", 6, 2, 8), "portable": ("gm_wq_pc", 4, 2, 8)}
PANEL_ROWS = 32          # from this many rows the panel path (widen once, f32 micro-kernels) is faster


def isa_lines(n: int, tiles: dict[str, tuple[int, int]], traits: dict[str, str]) -> list[str]:
    """Per ISA: the dot path's traits and tile, the panel path's micro-kernel and the shape of
    the last, narrower column block of N."""
    out = []
    for i, isa in enumerate(("avx512", "avx2", "portable")):
        mr, nr = tiles[isa]
        pname, _pmr, pnv, pl = PANEL[isa]
        rest = n % (pnv * pl)
        tv = -(-rest // pl)
        out += [("#if " + ISA_GUARD[isa]) if i == 0 else ("#elif " + ISA_GUARD[isa]) if i == 1 else "#else",
                f"typedef {traits[isa]} VT; constexpr int MR = {mr}, NR = {nr};",
                f"typedef {pname} PK; constexpr int TV = {tv}, TLAST = {rest - (tv - 1) * pl if tv else 0};"]
    return out + ["#endif"]


def split_columns(run: list[str], par: bool) -> list[str]:
    """`run` (over output columns [n0, n1)) on one thread, or on contiguous ranges of the NB
    column blocks per thread, so each weight byte is read by one thread."""
    if not par:
        return ["  {", "    const long n0 = 0, n1 = N;", *run, "  }"]
    return ["  const long T = gm_nt() < NB ? gm_nt() : NB;",
            "  #pragma omp parallel for schedule(static) num_threads(T)",
            "  for (long t = 0; t < T; ++t) {",
            "    const long n0 = t * NB / T * COLS, n1 = (t + 1) * NB / T * COLS;", *run, "  }"]
