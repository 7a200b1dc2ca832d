"""Batch invariance of the CPU kernels (`determinism: batch_invariant`, backends/cpu/invariance.py):
one row's output is the same bits whatever the other rows and however many there are (M = 1,
3, 16), for the generated GEMMs over every tile, K blocking and ISA path, the weight-only
quantized linear's dot path and the generated row kernels (layer norm, softmax, GELU); the
tactics never let ATen win under the invariant policy; and an executable lists the steps
that may break it. No timing assertions."""
from __future__ import annotations

import tempfile
import warnings
from pathlib import Path

import pytest
import torch

import graphmode
from graphmode.backends.cpu.build import KernelBuilder
from graphmode.backends.cpu.catalog import native_source
from graphmode.backends.cpu.executor import CpuExecutable
from graphmode.backends.cpu.gemm import GemmConfig, GemmProblem, generate_gemm, pack_b
from graphmode.backends.cpu.kernels import run_with_tensors
from graphmode.backends.cpu.tactics import ATEN, TacticsContext
from graphmode.backends.cpu.tactics.context import batch_variant
from graphmode.backends.cpu.tactics.selection import pick
from graphmode.backends.cpu.wgemm import PANEL_ROWS
from graphmode.capture.spec import bundle_from_module
from graphmode.passes.quantize_weights import quantize

_PROBE = KernelBuilder(Path(tempfile.gettempdir()) / "graphmode-test-probe")
needs_cxx = pytest.mark.skipif(not _PROBE.compiler_available(), reason="no C++ compiler on this machine")

ROWS = (1, 3, 16)
N, K = 40, 100          # a partial last panel (masked lanes) and K blocks that do not divide K
# tiles of every ISA path (on a host without one its `#if` falls back to portable C), whole-K
# and K-blocked, parallel and serial
CONFIGS = [GemmConfig("avx512", 8, 32), GemmConfig("avx512", 16, 16), GemmConfig("avx512", 6, 48, 16, 12),
           GemmConfig("avx512", 12, 32, 7, 0, 4), GemmConfig("avx2", 6, 16, 8, 0, par="serial"),
           GemmConfig("avx2", 4, 24), GemmConfig("portable", 4, 16, 16, 8)]


def _batch(row: torch.Tensor, m: int, at: int, seed: int) -> torch.Tensor:
    """`m` random rows with `row` at index `at`."""
    x = torch.randn(m, row.numel(), generator=torch.Generator().manual_seed(seed))
    x[at] = row
    return x


@needs_cxx
def test_a_gemm_row_is_the_same_bits_at_any_m_tile_and_k_blocking(tmp_path):
    """The row of interest sits first, last (a remainder tile) or in the middle of M = 1, 3,
    16 rows among random others: every generated kernel gives it the same bits."""
    g = torch.Generator().manual_seed(0)
    w, bias, row = torch.randn(N, K, generator=g), torch.randn(N, generator=g), torch.randn(K, generator=g)
    cases = []
    for m in ROWS:
        p = GemmProblem("linear", 1, m, N, K, bias=True)
        cases += [(p, cfg, generate_gemm(p, cfg, threads=2)) for cfg in CONFIGS]
    kernels = KernelBuilder(tmp_path, threads=2).build_many([c[2] for c in cases])
    outs = {}
    for p, cfg, src in cases:
        for at in dict.fromkeys((0, p.m // 2, p.m - 1)):
            x = _batch(row, p.m, at, seed=p.m + at)
            c = torch.full((p.m, N), float("nan"))
            b = pack_b(w, cfg.nr, transposed=True)
            kernels[src.symbol]([x.data_ptr(), b.data_ptr(), bias.data_ptr(), c.data_ptr()])
            outs[(p.m, cfg.name, at)] = c[at].clone()
    first = next(iter(outs.values()))
    assert torch.allclose(first, torch.addmm(bias, row[None], w.t())[0], rtol=1e-5, atol=1e-5)
    assert all(torch.equal(o, first) for o in outs.values()), [k for k, o in outs.items() if not torch.equal(o, first)]


@needs_cxx
@pytest.mark.parametrize("dt", ["int8", "bf16", "int4", "int4-asymmetric"])
def test_a_quantized_linear_row_is_the_same_bits_below_the_panel_rows(tmp_path, dt):
    g = torch.Generator().manual_seed(1)
    k = K if not dt.startswith("int4") else 128           # int4 packs whole groups of 32
    w, scale = quantize(torch.randn(N, k, generator=g), dt.split("-")[0],
                        scheme="asymmetric" if dt.endswith("asymmetric") else "symmetric")
    bias, row = torch.randn(N, generator=g), torch.randn(k, generator=g)
    srcs = {}
    for m in ROWS + (PANEL_ROWS - 1,):
        x = _batch(row, m, m - 1, seed=m)
        ins = [x, w, scale, bias]
        srcs[m] = (ins, native_source("qlinear", ins, [torch.empty(m, N)], {}, {}, [f"x{m}", "w", "s", "b"], [f"y{m}"]))
    kernels = KernelBuilder(tmp_path, threads=2).build_many([s for _, s in srcs.values()])
    got = [run_with_tensors(kernels[s.symbol], dict(zip(s.inputs, ins)), source=s)[s.outputs[0]][-1]
           for ins, s in srcs.values()]
    assert all(torch.equal(r, got[0]) for r in got)


class RowOps(torch.nn.Module):
    """Row kernels of a transformer block: layer norm, a linear with GELU, softmax."""

    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(40)
        self.fc = torch.nn.Linear(40, 72)

    def forward(self, x):
        return torch.softmax(torch.nn.functional.gelu(self.fc(self.norm(x))), dim=-1)


@needs_cxx
def test_compiled_row_kernels_give_a_row_the_same_bits_in_every_batch_bucket(tmp_path):
    torch.manual_seed(0)
    mod = RowOps().eval()
    ex = {"x": torch.randn(2, 40)}
    recipe = {"version": 1, "name": "rows", "exe_mode": "graph", "codegen": {"kernel_selection": "heuristic"},
              "inputs": [{"name": "x", "dtype": "f32", "shape": ["batch", 40]}],
              "dims": {"batch": {"buckets": list(ROWS)}}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cm = graphmode.compile(bundle_from_module(mod, ex, {"x": ["batch", None]}), recipe, cache_dir=tmp_path)
    row = torch.randn(40)
    got = []
    for m in ROWS:
        exe = cm.executable({"batch": m})
        assert exe.batch_variant_steps() == [], m
        got.append(next(iter(exe.run({"x": _batch(row, m, m - 1, seed=m)}).values()))[-1])
    assert all(torch.equal(r, got[0]) for r in got)
    with torch.no_grad():
        assert torch.allclose(got[0], mod(row[None])[0], rtol=1e-5, atol=1e-6)
    # without generated kernels the GEMM is ATen's: the executable says so
    plain = CpuExecutable(exe.plan, cm.graph.constants, builder=None, tactics=False)
    why = plain.batch_variant_steps()
    assert any("GEMMs run ATen" in w for w in why), why


def test_the_invariant_policy_never_picks_aten_over_a_generated_kernel():
    p = GemmProblem("linear", 1, 16, 96, 64)
    timings = {ATEN: 1e-6, "avx2_6x16_kall_mall": 3e-6, "avx2_4x24_kall_mall": 2e-6}
    assert pick("latency_first", p, timings) == ATEN
    assert pick("latency_first", p, timings, invariant=True) == "avx2_4x24_kall_mall"
    assert pick("throughput_first", p, timings, invariant=True) == "avx2_4x24_kall_mall"
    assert pick("latency_first", p, {ATEN: 1e-6}, invariant=True) == ATEN      # nothing else passed


@needs_cxx
def test_a_gemm_no_generated_kernel_covers_is_listed(tmp_path):
    """A linear whose weight is not a constant runs ATen: the context lists it (and a step whose
    winner is ATen), so the decode runner does not batch that plan."""
    ctx = TacticsContext(tmp_path / "tactics", 2, builder=KernelBuilder(tmp_path / "k", threads=2), invariant=True)
    x, w, y = torch.randn(3, 8), torch.randn(4, 8), torch.empty(3, 4)
    step = ctx.request("linear", [x, w], [y], lambda: None)
    assert step is not None and batch_variant(ctx) == ["linear float32[3, 8] x float32[4, 8] runs ATen "
                                                        "(no generated kernel covers it)"]


@pytest.mark.parametrize("op", ["layer_norm", "softmax", "log_softmax"])
def test_aten_row_ops_the_invariance_check_trusts_are_row_invariant(op):
    """invariance.ROW_INVARIANT_ATEN: ATen's CPU kernels give a row the same bits among 1 to
    64 rows (threads split rows, never a row), at a GPT-2-sized row."""
    row = torch.randn(768, generator=torch.Generator().manual_seed(2))
    w, b = torch.randn(768), torch.randn(768)
    fn = {"layer_norm": lambda x: torch.nn.functional.layer_norm(x, (768,), w, b),
          "softmax": lambda x: torch.softmax(x, -1), "log_softmax": lambda x: torch.log_softmax(x, -1)}[op]
    got = [fn(_batch(row, m, m - 1, seed=m))[-1] for m in (1, 3, 16, 64)]
    assert all(torch.equal(r, got[0]) for r in got)


@needs_cxx
def test_a_cached_timing_where_aten_won_still_gives_a_generated_kernel_under_invariance(tmp_path):
    """The timing cache is shared by both modes: an entry whose fastest candidate is ATen hands
    ATen out by default and the fastest generated kernel under `invariant`."""
    import json
    p = GemmProblem("linear", 1, 16, 96, 64, bias=True)

    def ctx(**kw) -> TacticsContext:
        return TacticsContext(tmp_path / "tactics", 2, builder=KernelBuilder(tmp_path / "kernels", threads=2),
                              llc_bytes=32 << 20, reps=2, budget_s=0.0, retune_noisy=0, **kw)
    first = ctx().select(p)
    (path,) = (tmp_path / "tactics").glob("gemm-*.json")
    entry = json.loads(path.read_text())
    gen = sorted(n for n in entry["timings_s"] if n != ATEN)
    assert gen, entry["rejected"]
    fast = {n: (1e-9 if n == ATEN else 1e-3 * (i + 1)) for i, n in enumerate([ATEN] + gen)}
    path.write_text(json.dumps(dict(entry, timings_s=fast, medians_s=fast, mins_s=fast, noisy=False, starved=False)))
    default, invariant = ctx().select(p), ctx(invariant=True).select(p)
    assert first.timed and default.from_cache and invariant.from_cache
    assert default.winner == ATEN and invariant.winner == gen[0]
