"""The candidates of a GEMM / conv shape, their kernels, and the check each must pass.

Candidates per shape are ATen (what the executor runs without tactics) and generated
kernels for the best ISA of `simd` (the host's, under the recipe's `codegen.isa` cap: see
TacticsContext.simd): the micro-kernels of gemm.py in a few tile/blocking
configurations; for convolutions (ungrouped, fp32, constant weight) Winograd F(4x4) and
F(2x2) for 3x3 stride 1 (winograd.py) and im2col GEMMs (im2col.py), each over one GEMM
blocking. Each candidate must first match ATen on random data (fp32 rel L2 < 1e-5) or it is
rejected: only the survivors are timed and may win.
"""
from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch

from graphmode.backends.cpu.conv import ConvConfig, ConvProblem
from graphmode.backends.cpu.depthwise import DepthwiseConfig, DepthwiseTiledConfig, is_depthwise
from graphmode.backends.cpu.pointwise_conv import PointwiseConfig, is_pointwise
from graphmode.backends.cpu.gemm import GemmConfig, GemmProblem, generate_gemm, packed_numel, worth_threads
from graphmode.backends.cpu.im2col import Im2colConfig
from graphmode.backends.cpu.im2col import blocked_rows as im2col_rows
from graphmode.backends.cpu.im2col import chunk_for as im2col_chunk
from graphmode.backends.cpu.im2col import gemm_problem as im2col_gemm
from graphmode.backends.cpu.im2col import prepared_numel as im2col_prepared
from graphmode.backends.cpu.isa import host_isas, registers
from graphmode.backends.cpu.tactics.steps import ATEN, GemmStep, aten_conv, aten_gemm, b_shape, conv_args
from graphmode.backends.cpu.winograd import WinogradConfig, chunk_for, geometry, transformed_numel
from graphmode.backends.cpu.winograd import gemm_problem as winograd_gemm
from graphmode.errors import BackendError
from graphmode.verify.numerics import rel_l2

log = logging.getLogger("graphmode.cpu.tactics")

TOLERANCE_F32 = 1e-5
WINOGRAD_TILES = (4, 2)   # F(4x4, 3x3) first: 4x fewer multiplies; F(2x2) for small images / many channels
ROW_WASTE = 0.15          # a Winograd GEMM whose row tiles are this much padding also gets the best-fitting blocking

# generated configurations per ISA, best-first for the heuristic (measured on the 16-row
# GEMMs of MiniLM / GPT-2 and 128-row ones, Zen 4, 1 and 2 threads; AVX2 4x24 over all of K
# came last: it leads at M=16, where 16 rows are four whole 4-row tiles, and is timed there)
# AVX-512 16x16 (one vector of columns, 16 rows: B read once per panel where M = 16, 16
# broadcasts per vector of B) came last: GPT-2 (1,16) 24.1 -> 22.0 ms and MiniLM (1,16) 3.71 ->
# 3.06 ms with it (interleaved, one process; it won 4 of 5 and 3 of 4 GEMM shapes there: GPT-2's
# 154 MB LM head 7.8 -> 7.1 ms alone), the 128-token and ResNet shapes unchanged. At
# 16x768x3072 it ran at half speed (likely its 16 A rows, 12 KiB apart, sharing L1 sets), so it
# is timed like the others, never assumed. AVX2 has no 16-row tile (16 ymm registers); its
# 12x8 and 8x8 lost to 6x16 at M=16.
# (the `serial` variants run on the calling thread only: on a shared machine whose other CPU
# is busy, an OpenMP region over a 30-100 us GEMM can wait out its second thread's
# preemption; the timing decides whether that happens here)
CONFIGS: dict[str, tuple[GemmConfig, ...]] = {
    "avx512": (GemmConfig("avx512", 8, 32), GemmConfig("avx512", 8, 32, par="serial"),
               GemmConfig("avx512", 8, 48, 256), GemmConfig("avx512", 8, 48, 256, par="serial"),
               GemmConfig("avx512", 6, 64, 256), GemmConfig("avx512", 12, 32, 256, 96), GemmConfig("avx512", 16, 16)),
    "avx2": (GemmConfig("avx2", 6, 16), GemmConfig("avx2", 6, 16, par="serial"), GemmConfig("avx2", 4, 24, 256),
             GemmConfig("avx2", 6, 16, 256, 72), GemmConfig("avx2", 4, 24)),
    "portable": (GemmConfig("portable", 4, 16, 256), GemmConfig("portable", 4, 16, 256, par="serial")),
}


def conv_config(name: str) -> ConvConfig:
    """The conv candidate a name denotes (`wino4_<gemm>`, `wino2_<gemm>`, `im2col_<gemm>`, each
    with its blocked schedule's `c<chunk>x<threads>` after the algorithm where it has one; `dw`, `dwt`; `pw`)."""
    if name == "dw":
        return DepthwiseConfig()
    if name == "dwt":
        return DepthwiseTiledConfig()
    if name == "pw":
        return PointwiseConfig()
    if name.startswith("wino"):
        return WinogradConfig.parse(name)
    if name.startswith("im2col"):
        return Im2colConfig.parse(name)
    raise BackendError(f"not a generated conv candidate: {name!r}", value=name,
                       fix="wino<m>_<gemm config>, im2col_<gemm config>, dw, dwt or pw")


def conv_kind(name: str) -> str:
    """The algorithm of a conv candidate: `wino4`, `wino2`, `im2col`, `dw`, `dwt` or `pw` (its blocking aside)."""
    if name in ("dw", "dwt", "pw"):
        return name
    return "im2col" if name.startswith("im2col") else name.split("_")[0].split("c")[0]


def candidate_names(p: GemmProblem, *, simd: Sequence[str], threads: int,
                    configs: Mapping[str, Sequence[GemmConfig]], generated: bool) -> list[str]:
    """Candidate names for a problem: ATen, then (`generated`: a compiler is there) the host
    ISA's generated configurations."""
    out = [ATEN]
    if p.dtype != "f32" or not generated:
        return out
    if isinstance(p, ConvProblem):
        return out + _conv_names(p, simd, threads, configs)
    isa = host_isas(simd)[0]
    for cfg in configs.get(isa, ()):
        if cfg.registers > registers(isa, simd) and isa != "portable":
            continue
        # blockings this shape does not feel are the same kernel: keep one of them
        one = threads == 1 or not worth_threads(p)
        eff = GemmConfig(cfg.isa, cfg.mr, cfg.nr, cfg.kc if cfg.kc < p.k else 0,
                         cfg.mc if cfg.mc < p.m else 0, cfg.split if p.n > cfg.nr and not one else 1,
                         "serial" if one else cfg.par)
        if p.epi is not None and p.c_aliases_operand and eff.kc:
            continue      # partial sums in C would overwrite the operand it shares memory with
        if eff.name not in out:
            out.append(eff.name)
    return out


def _conv_names(p: ConvProblem, simd: Sequence[str], threads: int,
                configs: Mapping[str, Sequence[GemmConfig]]) -> list[str]:
    """For 3x3 stride 1: Winograd F(4x4) and F(2x2), each as whole-image passes (GEMMs
    parallel over tile positions) and tile-blocked (when there are blocks for every
    thread); then im2col for any ungrouped conv. One GEMM blocking each (the host ISA's
    first): every candidate is a compiled kernel, and compile time counts. A depthwise conv
    (groups = input channels): the depthwise kernels (accumulator rows, register tiles); other
    grouped convs: none."""
    if p.groups != 1:
        return [DepthwiseConfig().name, DepthwiseTiledConfig().name] if is_depthwise(p) else []
    isa = host_isas(simd)[0]
    cfgs = [c for c in configs.get(isa, ()) if c.par == "omp"
            and (c.registers <= registers(isa, simd) or isa == "portable")]
    if not cfgs:
        return []
    base = cfgs[0]
    out: list[str] = []

    def fit(g: GemmProblem, serial: bool = False, cfg: GemmConfig = base) -> GemmConfig:
        one = serial or threads == 1 or not worth_threads(g)
        return GemmConfig(cfg.isa, cfg.mr, cfg.nr, cfg.kc if cfg.kc < g.k else 0,
                          cfg.mc if cfg.mc < g.m else 0, cfg.split if g.n > cfg.nr and not one else 1,
                          "serial" if one else cfg.par)
    if p.winograd_ok:
        for m in WINOGRAD_TILES:
            g = winograd_gemm(p, m)
            out.append(WinogradConfig(m, fit(g)).name)
            # few tile rows (small feature maps: 7x7 is 4 rows of F(4x4) per image): the blocking
            # whose row tile wastes least of them is a second candidate (AVX2 4x24 against 6x16)
            alt = min(cfgs, key=lambda c: (_row_waste(c.mr, g.m), -c.mr))
            if _row_waste(base.mr, g.m) >= ROW_WASTE and _row_waste(alt.mr, g.m) <= _row_waste(base.mr, g.m) / 2:
                out.append(WinogradConfig(m, fit(g, cfg=alt)).name)
            chunk = chunk_for(p, m, base.mr)
            if threads > 1 and geometry(p, m).t >= chunk * threads:
                out.append(WinogradConfig(m, fit(winograd_gemm(p, m, chunk), serial=True), chunk, threads).name)
    if is_pointwise(p):         # a 1x1 on NCHW as it is, beside im2col's NHWC GEMM
        out.append(PointwiseConfig().name)
    out.append(Im2colConfig(fit(im2col_gemm(p))).name)
    chunk = im2col_chunk(p, base.mr, threads)
    blocked = Im2colConfig(fit(im2col_gemm(p, chunk), serial=True), chunk, max(1, threads))
    if blocked.applies(p) and im2col_rows(p) >= chunk * max(2, threads):
        out.append(blocked.name)
    return list(dict.fromkeys(out))


def _row_waste(mr: int, m: int) -> float:
    """The share of a GEMM's MR-row tiles that are padding for `m` rows."""
    tiles = -(-m // mr)
    return (tiles * mr - m) / (tiles * mr)


def candidate_sources(p: GemmProblem, names: Sequence[str], threads: int) -> dict[str, Any]:
    """name -> the generated kernel of each non-ATen candidate (or the BackendError saying
    why the generator does not write it: the candidate is then rejected with that reason)."""
    out: dict[str, Any] = {}
    for name in names:
        if name == ATEN:
            continue
        try:
            if isinstance(p, ConvProblem):
                out[name] = conv_config(name).generate(p, threads)
            else:
                out[name] = generate_gemm(p, GemmConfig.parse(name), threads)
        except BackendError as e:
            out[name] = e
    return out


def build_candidates(builder, sources: Mapping[GemmProblem, Mapping[str, Any]], *, first_only: bool,
                     failures: dict[str, str]) -> dict[tuple[GemmProblem, str], Any]:
    """Compile the candidates' sources (`candidate_sources` per problem) into one library with
    `builder` (a KernelBuilder); (problem, name) -> (kernel, source) or the error text.
    `first_only`: only each problem's first candidate is built (what the heuristic policy can
    pick). A toolchain that fails as a whole is recorded in `failures["*"]` (ATen runs all)."""
    want: dict[tuple[GemmProblem, str], Any] = {}
    for p, per in sources.items():
        names = list(per)
        if first_only:
            names = names[:1]
        for name in names:
            want[(p, name)] = per[name]
    srcs = [s for s in want.values() if not isinstance(s, Exception)]
    built: dict[str, Any] = {}
    if srcs:
        try:
            built = builder.build_many(srcs, strict=False)
        except BackendError as e:
            log.warning("generated GEMM kernels do not build; ATen runs every GEMM: %s", e.message)
            built = {}
            failures["*"] = e.message
    out: dict[tuple[GemmProblem, str], Any] = {}
    for key, s in want.items():
        if isinstance(s, Exception):
            out[key] = str(s)
        elif s.symbol in built:
            out[key] = (built[s.symbol], s)
        else:
            out[key] = builder.failures.get(s.symbol) or failures.get("*", "not built")
    return out


def prepared_bytes(p: GemmProblem, name: str) -> int | None:
    """Bytes of candidate `name`'s prepared copy of one constant weight (None: ATen, which
    reads the weight as it is)."""
    if name == ATEN or not p.b_packed:
        return None
    if isinstance(p, ConvProblem):
        cfg = conv_config(name)
        if isinstance(cfg, WinogradConfig):
            return transformed_numel(p, cfg.m, cfg.gemm.nr) * 4
        if isinstance(cfg, DepthwiseConfig):
            return p.cout * p.kh * p.kw * 4
        if isinstance(cfg, PointwiseConfig):
            return p.cout * p.cin * 4
        return im2col_prepared(p, cfg.gemm.nr) * 4
    return packed_numel(p.n, p.k, GemmConfig.parse(name).nr) * 4 * (p.batch if p.b_batched else 1)


@dataclass
class Checker:
    """Checks candidates against ATen on random data. `scratch` memoises, while one plan is
    tuned, the inputs and the reference of each shape (one ATen run shared by its
    candidates); `pack(w, p, nr)` and `weight(w, cfg)` give a constant weight in a
    candidate's layout. `digests[(p, name)]`: the output digest of each candidate that passed
    (the timing cache keeps them, so a warm start can check a cached winner without ATen)."""

    scratch: dict
    seed: int
    tolerance: float
    pack: Callable[[torch.Tensor, GemmProblem, int], torch.Tensor]
    weight: Callable[[torch.Tensor, ConvConfig], torch.Tensor]
    digests: dict = field(default_factory=dict)

    def check(self, p: GemmProblem, name: str, step: GemmStep, kernel, expect: str | None = None) -> str | None:
        """None when candidate `name` (its compiled `kernel`) matches ATen, else why not.

        `expect`: the digest of this candidate's output when it last passed. The same
        kernel on the same seeded inputs and weights gives the same bits, which passed then;
        anything else (other weights, another build) is compared with ATen as usual."""
        run = self._run_conv if isinstance(p, ConvProblem) else self._run_gemm
        try:
            out = run(p, name, step, kernel)
        except Exception as e:  # noqa: BLE001 - a candidate that fails to run only loses
            return f"raised {type(e).__name__}: {e}"
        digest = output_digest(out)
        if digest != expect:
            err = rel_l2(out, self._reference(p, step))
            if not err < self.tolerance:
                return f"rel L2 {err:.2e} vs ATen exceeds {self.tolerance:.0e}"
        self.digests[(p, name)] = digest
        return None

    def _inputs(self, p, step: GemmStep) -> tuple[torch.Tensor, ...]:
        """The seeded random activation (and B when it is not a constant) of `p`'s checks."""
        memo = ("inputs", p, step.b.data_ptr())
        if memo not in self.scratch:
            gen = torch.Generator().manual_seed(self.seed)
            if isinstance(p, ConvProblem):
                self.scratch[memo] = (torch.randn(p.n, p.cin, p.h, p.w, generator=gen),)
            else:
                a = torch.randn(p.batch, p.m, p.k, generator=gen)
                b = step.b if p.b_packed else torch.randn(b_shape(p), generator=gen)
                self.scratch[memo] = (a, b)
        return self.scratch[memo]

    def _reference(self, p, step: GemmStep) -> torch.Tensor:
        """ATen's result on the check inputs, through the epilogue when `p` has one."""
        memo = ("reference", p, step.b.data_ptr())
        if memo not in self.scratch:
            if isinstance(p, ConvProblem):
                (x,) = self._inputs(p, step)
                ref = torch.empty(p.n, p.cout, p.ho, p.wo)
                aten_conv(p, x, step.b, step.bias, ref)()
            else:
                a, b = self._inputs(p, step)
                ref = torch.empty(p.batch, p.m, p.n)
                aten_gemm(p, a, b, step.bias, ref)()
            if p.epi is not None:
                with torch.inference_mode():
                    out = p.epi.reference(ref.reshape(step.c.shape), self._epilogue_operands(p, step))
                ref = out.reshape(ref.shape).contiguous()
            self.scratch[memo] = ref
        return self.scratch[memo]

    def _run_gemm(self, p: GemmProblem, name: str, step: GemmStep, kernel) -> torch.Tensor:
        a, b = self._inputs(p, step)
        bk = self.pack(b, p, GemmConfig.parse(name).nr) if p.b_packed else b.contiguous()
        c = torch.full((p.batch, p.m, p.n), float("nan"))
        ops = self._epilogue_operands(p, step)
        kernel([a.data_ptr(), bk.data_ptr()] + ([step.bias.data_ptr()] if p.bias else [])
               + [t.data_ptr() for t in ops] + [c.data_ptr()])
        return c

    def _run_conv(self, p: ConvProblem, name: str, step: GemmStep, kernel) -> torch.Tensor:
        (x,) = self._inputs(p, step)
        cfg = conv_config(name)
        u = self.weight(step.b, cfg)
        ws = torch.full((cfg.workspace_numel(p),), float("nan"))   # kernels may not rely on its contents
        y = torch.full((p.n, p.cout, p.ho, p.wo), float("nan"))
        kernel(conv_args(step, cfg, x, u, ws, y, self._epilogue_operands(p, step)))
        return y

    def _epilogue_operands(self, p, step: GemmStep) -> list[torch.Tensor]:
        """Random epilogue operands (the plan's buffers hold whatever ran last)."""
        if p.epi is None:
            return []
        memo = ("epilogue", p, step.b.data_ptr())
        if memo not in self.scratch:
            gen = torch.Generator().manual_seed(self.seed + 3)
            self.scratch[memo] = [torch.randn(tuple(t.shape), generator=gen) for t in step.ops]
        return self.scratch[memo]


def output_digest(t: torch.Tensor) -> str:
    """Exact: a check output's bits (NaN payloads included)."""
    return hashlib.sha256(t.detach().contiguous().reshape(-1).numpy()).hexdigest()[:32]


__all__ = ["conv_config", "CONFIGS", "TOLERANCE_F32", "WINOGRAD_TILES", "candidate_names", "candidate_sources",
           "build_candidates", "Checker", "output_digest", "conv_kind", "prepared_bytes"]
