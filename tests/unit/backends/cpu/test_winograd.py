"""Generated convolutions (backends/cpu/winograd.py, im2col.py) and their tactic selection.

Numerics of Winograd F(2x2) and F(4x4) and of im2col GEMMs against ATen's direct convolution
on awkward shapes (padding 0/1/2, strides, dilation, 1x1 and 7x7 kernels, edge tiles, channel
counts that are not multiples of the vector width, batch > 1), the weight transform, the conv
tactics of TacticsContext (check, timing cache, binding) and the executor path on a small
CNN. Nothing here asserts on a timing.
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
import torch

from graphmode.backends.cpu.build import KernelBuilder
from graphmode.backends.cpu.gemm import GemmConfig
from graphmode.backends.cpu.conv import ConvProblem, conv_problem_of
from graphmode.backends.cpu.im2col import Im2colConfig, prepared_numel
from graphmode.backends.cpu.tactics import ATEN, ConvStep, TacticsContext
from graphmode.backends.cpu.tactics.candidates import CONFIGS, candidate_names, conv_config, conv_kind
from graphmode.backends.cpu.winograd import (WinogradConfig, generate_winograd, transform_weight,
                                             transformed_numel, workspace_numel)
from graphmode.errors import BackendError
from graphmode.verify.numerics import rel_l2

_PROBE = KernelBuilder(Path(tempfile.gettempdir()) / "graphmode-test-probe")
needs_cxx = pytest.mark.skipif(not _PROBE.compiler_available(), reason="no C++ compiler on this machine")

# (n, cin, h, w, cout, padding, bias)
SHAPES = [
    (1, 16, 8, 8, 16, 1, True),
    (2, 3, 11, 7, 5, 1, True),        # channels below one vector, odd sizes: partial edge tiles
    (1, 24, 13, 13, 40, 1, False),
    (1, 32, 9, 10, 17, 0, True),      # no padding: Ho = H - 2
    (3, 8, 6, 5, 8, 2, True),         # padding 2: output larger than the input
    (1, 64, 14, 14, 64, 1, True),
]
CFGS = [WinogradConfig(2, GemmConfig("avx512", 8, 32)), WinogradConfig(4, GemmConfig("avx512", 8, 32)),
        WinogradConfig(4, GemmConfig("avx2", 6, 16, 16, 0, par="serial")),
        WinogradConfig(2, GemmConfig("portable", 4, 16)),
        # tile-blocked: blocks of 8 / 6 tiles over 2 threads (partial last blocks, 1-block images)
        WinogradConfig(4, GemmConfig("avx512", 8, 32, par="serial"), 8, 2),
        WinogradConfig(2, GemmConfig("avx2", 6, 16, par="serial"), 6, 2)]


def _problem(n, cin, h, w, cout, pad, bias) -> ConvProblem:
    return ConvProblem(n, cin, h, w, cout, 3, 3, (1, 1), (pad, pad), bias=bias)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    if not _PROBE.compiler_available():
        pytest.skip("no C++ compiler")
    builder = KernelBuilder(tmp_path_factory.mktemp("wcache"), threads=2)
    cases = [(s, cfg, generate_winograd(_problem(*s), cfg, threads=2)) for s in SHAPES for cfg in CFGS]
    return cases, builder.build_many([c[2] for c in cases])


@needs_cxx
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s[:5])) + f"-p{s[5]}")
def test_winograd_matches_direct_conv(built, shape):
    cases, kernels = built
    n, cin, h, w, cout, pad, has_bias = shape
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(n, cin, h, w, generator=g)
    wt = torch.randn(cout, cin, 3, 3, generator=g)
    bias = torch.randn(cout, generator=g) if has_bias else None
    ref = torch.nn.functional.conv2d(x, wt, bias, padding=pad)
    p = _problem(*shape)
    assert (p.ho, p.wo) == tuple(ref.shape[2:])
    for s, cfg, src in cases:
        if s != shape:
            continue
        u = transform_weight(wt, cfg.m, cfg.gemm.nr)
        assert u.numel() == transformed_numel(p, cfg.m, cfg.gemm.nr)
        ws = torch.zeros(workspace_numel(p, cfg))
        for _ in range(2):              # a second call on the same workspace: its zero border survives
            y = torch.full_like(ref, float("nan"))
            args = [x, u] + ([bias] if has_bias else []) + [ws, y]
            kernels[src.symbol]([t.data_ptr() for t in args])
            err = rel_l2(y, ref)
            assert err < (1e-6 if cfg.m == 2 else 5e-6), (p.text, cfg.name, err)


@needs_cxx
@pytest.mark.parametrize("value", [float("inf"), -float("inf"), float("nan")])
def test_a_non_finite_input_runs_the_direct_convolution_for_that_call(built, value):
    """inf in a patch made inf - inf and inf * 0 in the transforms: NaN over whole tiles where
    eager's direct sum gives +-inf at the pixel's neighbours. The kernel flags the call in its
    workspace and the bound step runs its fallback (the ATen default); finite calls do not."""
    cases, kernels = built
    shape = SHAPES[2]
    n, cin, h, w, cout, pad, has_bias = shape
    g = torch.Generator().manual_seed(7)
    wt, x = torch.randn(cout, cin, 3, 3, generator=g), torch.randn(n, cin, h, w, generator=g)
    for s, cfg, src in cases:
        if s != shape:
            continue
        u, ws, y = transform_weight(wt, cfg.m, cfg.gemm.nr), torch.zeros(workspace_numel(_problem(*s), cfg)), \
            torch.empty(n, cout, h, w)
        xi = x.clone()
        fell_back = []

        def direct():
            fell_back.append(1)
            y.copy_(torch.nn.functional.conv2d(xi, wt, padding=pad))
        step = kernels[src.symbol].bind([t.data_ptr() for t in (xi, u, ws, y)], fallback=direct)
        step()
        assert not fell_back and rel_l2(y, torch.nn.functional.conv2d(xi, wt, padding=pad)) < 5e-6
        xi[0, 3, 5, 6] = value
        step()
        ref = torch.nn.functional.conv2d(xi, wt, padding=pad)
        assert fell_back == [1], cfg.name
        assert torch.equal(y.isnan(), ref.isnan()) and torch.equal(y.isinf(), ref.isinf()), cfg.name
        xi[0, 3, 5, 6] = 0.0
        step()                                  # the flag is the call's: a finite call does not fall back
        assert fell_back == [1], cfg.name


# (n, cin, h, w, cout, k, stride, padding, dilation, bias)
IM2COL = [
    (1, 3, 23, 20, 16, 7, 2, 3, 1, True),     # a ResNet-like stem
    (2, 16, 9, 9, 24, 3, 2, 1, 1, False),     # stride 2, odd size
    (1, 20, 8, 8, 33, 1, 2, 0, 1, True),      # 1x1 downsample
    (2, 18, 7, 6, 10, 1, 1, 0, 1, True),      # 1x1 stride 1: no patch matrix
    (1, 8, 10, 10, 8, 3, 1, 2, 2, True),      # dilated
    (1, 5, 6, 7, 9, 3, 1, 1, 1, False),
]
IM2COL_CFGS = [Im2colConfig(GemmConfig("avx512", 8, 32)), Im2colConfig(GemmConfig("avx2", 6, 16, 16, 12, par="serial")),
               # the row-blocked schedule: blocks that cross images, a last block shorter than the chunk
               Im2colConfig(GemmConfig("avx512", 8, 32, par="serial"), 16, 2),
               Im2colConfig(GemmConfig("avx2", 6, 16, 16, 12, par="serial"), 12, 3)]


def _im2col_problem(n, cin, h, w, cout, k, s, pad, d, bias) -> ConvProblem:
    return ConvProblem(n, cin, h, w, cout, k, k, (s, s), (pad, pad), (d, d), bias=bias)


@needs_cxx
def test_im2col_matches_direct_conv(tmp_path):
    builder = KernelBuilder(tmp_path / "k", threads=2)
    cases = [(s, cfg, cfg.generate(_im2col_problem(*s), 2)) for s in IM2COL for cfg in IM2COL_CFGS
             if cfg.applies(_im2col_problem(*s))]
    assert len(cases) == len(IM2COL) * len(IM2COL_CFGS) - 2      # no row blocks without a patch matrix
    kernels = builder.build_many([c[2] for c in cases])
    for shape, cfg, src in cases:
        n, cin, h, w, cout, k, st, pad, d, has_bias = shape
        g = torch.Generator().manual_seed(sum(shape))
        x = torch.randn(n, cin, h, w, generator=g)
        wt = torch.randn(cout, cin, k, k, generator=g)
        bias = torch.randn(cout, generator=g) if has_bias else None
        ref = torch.nn.functional.conv2d(x, wt, bias, stride=st, padding=pad, dilation=d)
        p = _im2col_problem(*shape)
        wp = cfg.prepare_weight(wt)
        assert wp.numel() == prepared_numel(p, cfg.gemm.nr) and (p.ho, p.wo) == tuple(ref.shape[2:])
        ws = torch.full((cfg.workspace_numel(p),), float("nan"))     # any contents: every call writes what it reads
        for _ in range(2):
            y = torch.full_like(ref, float("nan"))
            kernels[src.symbol]([t.data_ptr() for t in [x, wp] + ([bias] if has_bias else []) + [ws, y]])
            assert rel_l2(y, ref) < 1e-6, (p.text, cfg.name, rel_l2(y, ref))


def test_the_row_blocked_im2col_is_offered_where_the_patch_matrix_outgrows_l2():
    """ResNet's 7x7 stem at batch 1: a 7.4 MB patch matrix and a 3.2 MB result, each written
    and read back once by the whole-image schedule; the row-blocked one keeps a block of each
    in half a core's L2, in a number of blocks every thread gets the same share of."""
    from graphmode.backends.cpu.im2col import chunk_for
    stem = ConvProblem(1, 3, 224, 224, 64, 7, 7, (2, 2), (3, 3), bias=True)
    for threads in (1, 2, 3):
        c = chunk_for(stem, 8, threads)
        blocks = -(-stem.ho * stem.wo // c)
        assert c % 8 == 0 and c * (147 + 64) * 4 <= 512 << 10 and blocks % threads == 0, (threads, c)
    names = candidate_names(stem, simd=["avx2", "fma", "avx512f"], threads=2, configs=CONFIGS, generated=True)
    blocked = [n for n in names if n.startswith("im2colc")]
    assert blocked == [f"im2colc{chunk_for(stem, 8, 2)}x2_avx512_8x32_kall_mall_serial"]
    assert conv_kind(blocked[0]) == "im2col" and conv_config(blocked[0]).chunk == chunk_for(stem, 8, 2)
    small = ConvProblem(1, 8, 9, 9, 8, 3, 3, (2, 2), (1, 1))          # 25 pixels: one block is the whole
    names = candidate_names(small, simd=["avx2", "fma", "avx512f"], threads=2, configs=CONFIGS, generated=True)
    assert not [n for n in names if n.startswith("im2colc")]
    with pytest.raises(BackendError, match="multiple of mr"):
        Im2colConfig(GemmConfig("avx512", 8, 32, par="serial"), 12, 2)
    direct = ConvProblem(1, 16, 8, 8, 16, 1, 1, (1, 1), (0, 0))
    assert not IM2COL_CFGS[2].applies(direct) and IM2COL_CFGS[0].applies(direct)


def test_problem_and_names():
    x, w, y = torch.zeros(1, 8, 10, 10), torch.zeros(16, 8, 3, 3), torch.zeros(1, 16, 10, 10)
    attrs = {"stride": [1, 1], "padding": [1, 1], "dilation": [1, 1], "groups": 1}
    assert conv_problem_of([x, w], [y], attrs, set()) is None            # weight not a constant
    p = conv_problem_of([x, w], [y], attrs, {w.data_ptr()})
    assert p is not None and p.winograd_ok and not p.bias and (p.ho, p.wo) == (10, 10)
    assert p.flops == 2 * 16 * 100 * 8 * 9
    assert "conv2d 1x8x10x10 * 16x8x3x3 s1 p1" in p.text
    s2 = ConvProblem(1, 8, 10, 10, 16, 3, 3, (2, 2), (1, 1))
    assert not s2.winograd_ok and IM2COL_CFGS[0].applies(s2) and not CFGS[0].applies(s2)
    with pytest.raises(BackendError, match="3x3 stride-1"):
        generate_winograd(s2, CFGS[0], 2)
    for cfg in CFGS + IM2COL_CFGS:
        assert conv_config(cfg.name) == cfg
    with pytest.raises(BackendError):
        conv_config("avx2_6x16_kall_mall")
    with pytest.raises(BackendError):
        WinogradConfig(3, GemmConfig("avx2", 6, 16))
    with pytest.raises(BackendError):
        WinogradConfig.parse("avx2_6x16_kall_mall")


def test_weight_transform_is_exact_on_identity():
    """A filter with a single 1 at the centre is the identity convolution: U must reproduce it
    (checks G and the [xi, cin, cout] layout without any kernel)."""
    w = torch.zeros(16, 16, 3, 3)
    for c in range(16):
        w[c, c, 1, 1] = 1.0
    for m in (2, 4):
        nr = 16
        u = transform_weight(w, m, nr).view((m + 2) ** 2, 1, 16, nr)    # one panel: [xi, panel, cin, nr]
        g = {2: torch.tensor([[1, 0, 0], [.5, .5, .5], [.5, -.5, .5], [0, 0, 1]], dtype=torch.float64),
             4: torch.tensor([[1 / 4, 0, 0], [-1 / 6, -1 / 6, -1 / 6], [-1 / 6, 1 / 6, -1 / 6],
                              [1 / 24, 1 / 12, 1 / 6], [1 / 24, -1 / 12, 1 / 6], [0, 0, 1]], dtype=torch.float64)}[m]
        centre = (g[:, 1:2] @ g[:, 1:2].t()).reshape(-1)                  # G e_centre G^T
        for xi in range((m + 2) ** 2):
            assert torch.allclose(u[xi, 0].double(), torch.eye(16, dtype=torch.float64) * centre[xi], atol=1e-7)


def _ctx(tmp_path: Path, **kw) -> TacticsContext:
    from graphmode.targets import get_target
    kw.setdefault("builder", KernelBuilder(tmp_path / "kernels", threads=2))
    kw.setdefault("simd", list(get_target("host").simd))
    kw.setdefault("llc_bytes", 1 << 20)
    kw.setdefault("reps", 2)
    kw.setdefault("budget_s", 0.0)
    kw.setdefault("retune_noisy", 0)
    return TacticsContext(tmp_path / "tactics", 2, **kw)


def _conv_step(ctx: TacticsContext, x, w, b, y, attrs):
    from graphmode.backends.cpu.catalog import op_step
    from graphmode.backends.cpu.lowering import OpCall
    ctx.add_constants([w, b])
    return op_step(OpCall("conv2d", [x, w, b], [y], attrs, {}, tactics=ctx))


@needs_cxx
def test_conv_tactics_select_check_cache_and_bind(tmp_path):
    g = torch.Generator().manual_seed(1)
    x, w, b = torch.randn(1, 16, 12, 12, generator=g), torch.randn(32, 16, 3, 3, generator=g), torch.randn(32)
    y = torch.empty(1, 32, 12, 12)
    attrs = {"stride": [1, 1], "padding": [1, 1], "dilation": [1, 1], "groups": 1}
    ctx = _ctx(tmp_path, llc_bytes=16 << 10)     # the weight (18 KiB) exceeds this "LLC": timed cold, rotated
    step = _conv_step(ctx, x, w, b, y, attrs)
    assert isinstance(step, ConvStep)
    names = ctx.candidates(step.problem)
    assert names[0] == ATEN and {n.split("_")[0] for n in names[1:]} >= {"wino4", "wino2", "im2col"}
    (sel,) = ctx.finalize()
    assert not sel.rejected and set(sel.timings_s) == set(names) and sel.winner in names
    assert ctx.cold is True
    step()
    ref = torch.nn.functional.conv2d(x, w, b, padding=1)
    assert rel_l2(y, ref) < 5e-6 and step.tactic == sel.winner
    files = list((tmp_path / "tactics").glob("gemm-*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["key"]["op"] == "conv2d"
    rep = ctx.report()["gemms"][0]
    assert rep["gemm"] == step.problem.text and rep["shape"]["kh"] == 3

    again = _ctx(tmp_path, llc_bytes=16 << 10)         # the next plan build: from the timing cache
    step2 = _conv_step(again, x, w, b, torch.empty_like(y), attrs)
    (sel2,) = again.finalize()
    assert sel2.from_cache and sel2.winner == sel.winner and again.stats["timing_runs"] == 0

    heur = _ctx(tmp_path, policy="heuristic")        # no timing: the first Winograd candidate
    y3 = torch.empty_like(y)
    step3 = _conv_step(heur, x, w, b, y3, attrs)
    (sel3,) = heur.finalize()
    assert sel3.winner == names[1] and heur.stats["timing_runs"] == 0
    step3()
    assert rel_l2(y3, ref) < 5e-6
    del step2


@needs_cxx
def test_conv_tactics_strided_and_grouped(tmp_path):
    ctx = _ctx(tmp_path)
    x, w, b = torch.randn(1, 8, 9, 9), torch.randn(8, 8, 3, 3), torch.randn(8)
    y = torch.empty(1, 8, 5, 5)
    step = _conv_step(ctx, x, w, b, y, {"stride": [2, 2], "padding": [1, 1], "dilation": [1, 1], "groups": 1})
    assert isinstance(step, ConvStep)
    assert [n.split("_")[0] for n in ctx.candidates(step.problem)[1:]] == ["im2col"]   # no Winograd at stride 2
    ctx.finalize()
    step()
    assert rel_l2(y, torch.nn.functional.conv2d(x, w, b, stride=2, padding=1)) < 1e-6
    wg = torch.randn(8, 4, 3, 3)                      # grouped: ATen without timing
    default = _conv_step(ctx, x, wg, b, torch.empty(1, 8, 9, 9),
                         {"stride": [1, 1], "padding": [1, 1], "dilation": [1, 1], "groups": 2})
    assert not isinstance(default, ConvStep) and ctx.finalize() == []


class _Cnn(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = torch.nn.Conv2d(3, 16, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(16)
        self.c2 = torch.nn.Conv2d(16, 16, 3, padding=1, bias=False)
        self.c3 = torch.nn.Conv2d(16, 24, 3, stride=2, padding=1)

    def forward(self, x):
        h = torch.relu(self.bn(self.c1(x)))
        h = torch.relu(self.c2(h) + h)
        return self.c3(h)


@needs_cxx
def test_executor_runs_winograd_convs_matching_eager(tmp_path):
    import graphmode
    from graphmode.recipe import load_recipe

    torch.manual_seed(0)
    m = _Cnn().eval()
    with torch.no_grad():
        m.bn.running_mean.uniform_(-0.5, 0.5)
        m.bn.running_var.uniform_(0.5, 2.0)
    r = load_recipe({"version": 1, "name": "cnn", "exe_mode": "graph", "targets": ["host"],
                     "inputs": [{"name": "x", "dtype": "f32", "shape": ["batch", 3, 20, 20]}],
                     "dims": {"batch": {"buckets": [1, 2]}}})
    cm = graphmode.compile(m, r, cache_dir=tmp_path, threads=2)
    for batch in (1, 2):
        x = torch.randn(batch, 3, 20, 20)
        with torch.inference_mode():
            ref = m(x)
        assert rel_l2(cm(x), ref) < 1e-5
        rep = cm.executable({"batch": batch}).tactics_report
        convs = [g for g in rep["gemms"] if g["shape"]["op"] == "conv2d"]
        assert len(convs) == 3 and {tuple(g["shape"]["stride"]) for g in convs} == {(1, 1), (2, 2)}, rep["gemms"]


def test_small_feature_maps_also_get_the_best_fitting_row_blocking():
    """A 7x7 map is 4 rows of F(4x4) tiles per image: AVX2's 6-row blocking pads a third of
    them, so its 4x24 blocking is a second Winograd candidate; a 56x56 map (196 rows) and the
    AVX-512 list (no blocking halves the padding) keep one."""
    from graphmode.backends.cpu.isa import capped_simd
    from graphmode.backends.cpu.tactics.candidates import CONFIGS, candidate_names
    simd = ["sse4_2", "avx", "avx2", "fma", "avx512f", "avx512vl"]
    for isa, shape, extra in [("avx2", (1, 512, 7, 7, 512), ["wino4_avx2_4x24_k256_mall"]),
                              ("avx2", (1, 64, 56, 56, 64), []), ("avx512", (1, 512, 7, 7, 512), [])]:
        n, cin, h, w, cout = shape
        names = candidate_names(_problem(n, cin, h, w, cout, 1, True), simd=capped_simd(simd, isa), threads=2,
                                configs=CONFIGS, generated=True)
        wino4 = [x for x in names if x.startswith("wino4_")]
        assert wino4[1:] == extra and len(set(names)) == len(names), (isa, shape, names)


@needs_cxx
def test_conv_steps_of_one_plan_share_one_workspace_whatever_it_holds(tmp_path):
    """Conv kernels write their padded input's zero border themselves, so every conv step of
    a context binds one workspace (the largest winner's), filled with NaN here: steps of
    different shapes run in turn over the same scratch and still match ATen."""
    g = torch.Generator().manual_seed(3)
    ctx = _ctx(tmp_path, policy="heuristic")
    cases = []
    for (n, cin, h, w, cout, pad, stride) in [(1, 16, 12, 12, 16, 1, 1), (1, 8, 9, 7, 24, 2, 1),
                                              (2, 24, 10, 10, 8, 1, 2)]:
        x = torch.randn(n, cin, h, w, generator=g)
        wt, b = torch.randn(cout, cin, 3, 3, generator=g), torch.randn(cout, generator=g)
        ref = torch.nn.functional.conv2d(x, wt, b, stride=stride, padding=pad)
        y = torch.empty_like(ref)
        attrs = {"stride": [stride, stride], "padding": [pad, pad], "dilation": [1, 1], "groups": 1}
        cases.append((_conv_step(ctx, x, wt, b, y, attrs), y, ref))
    sels = ctx.finalize()
    assert all(s.winner != ATEN for s in sels)
    (ws,) = ctx.weights.workspaces
    assert ws.numel() == max(conv_config(s.winner).workspace_numel(s.problem) for s in sels)
    assert all(ws.data_ptr() in {t.data_ptr() for t in step.keep} for step, _, _ in cases)
    ws.fill_(float("nan"))
    for step, y, ref in cases + cases[::-1]:
        y.fill_(float("nan"))
        step()
        assert rel_l2(y, ref) < 5e-6, step.problem.text
    assert ctx.report()["workspace_bytes"] == ws.numel() * 4


def test_winograd_weight_transform_is_lean_and_unchanged():
    """The transform is written one tile position at a time; it equals G g G^T packed per
    position (the whole-tensor float64 form it replaced)."""
    from graphmode.backends.cpu.gemm import pack_b
    from graphmode.backends.cpu.winograd import VEC, _MATRICES
    import math
    g = torch.Generator().manual_seed(5)
    for cout, cin, m, nr in [(20, 3, 2, 16), (40, 33, 4, 32), (16, 16, 4, 24)]:
        w = torch.randn(cout, cin, 3, 3, generator=g)
        gm = torch.tensor([[float(v) for v in row] for row in _MATRICES[m][1]], dtype=torch.float64)
        u = (gm @ w.double() @ gm.t()).permute(2, 3, 1, 0).reshape((m + 2) ** 2, cin, cout)
        cp, cop = math.ceil(cin / VEC) * VEC, math.ceil(cout / VEC) * VEC
        full = torch.zeros((m + 2) ** 2, cp, cop)
        full[:, :cin, :cout] = u.float()
        ref = torch.cat([pack_b(full[i], nr, transposed=False).reshape(-1) for i in range((m + 2) ** 2)])
        assert torch.equal(transform_weight(w, m, nr), ref)


@needs_cxx
def test_compiled_model_spills_folded_weights_and_reports_what_it_holds(tmp_path):
    """BN folding makes new conv weights: compile moves them to a file-backed mapping, each
    bucket build releases their pages once the kernels hold prepared copies, and the model
    still matches eager (the released originals refault if anything reads them)."""
    import graphmode
    from graphmode.recipe import load_recipe

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Conv2d(64, 64, 3, padding=1), torch.nn.BatchNorm2d(64), torch.nn.ReLU(),
                            torch.nn.Conv2d(64, 64, 3, padding=1)).eval()
    with torch.no_grad():
        m[1].running_var.uniform_(0.5, 2.0)
    r = load_recipe({"version": 1, "name": "cnn64", "exe_mode": "graph", "targets": ["host"],
                     "inputs": [{"name": "input", "dtype": "f32", "shape": ["batch", 64, 10, 10]}],
                     "dims": {"batch": {"buckets": [1, 2]}}, "codegen": {"kernel_selection": "heuristic"}})
    cm = graphmode.compile(m, r, cache_dir=tmp_path, threads=2)
    mem = cm.memory_report()
    assert mem["spilled_constants"] == 1 and mem["spilled_bytes"] == 64 * 64 * 9 * 4, mem   # the folded conv
    for batch in (1, 2, 1):
        x = torch.randn(batch, 64, 10, 10)
        with torch.inference_mode():
            ref = m(x)
        assert rel_l2(cm(x), ref) < 1e-5
    mem = cm.memory_report()
    assert mem["releases"] >= 4 and set(mem["buckets"]) == {"batch=1", "batch=2"}
    assert all(b["prepared_weights_bytes"] >= 2 * 64 * 64 * 9 * 4 and b["arena_bytes"] > 0
               for b in mem["buckets"].values()), mem


def test_cold_timing_copies_are_views_of_one_pool_of_twice_the_llc():
    """Every candidate of every shape rotates over views of one buffer (one pool per candidate
    made timing the peak of a ResNet-18 build); each candidate still streams >= 2x the LLC
    between two reads of one copy, its first copy being its real weight."""
    from graphmode.backends.cpu.tactics.timing import ColdPool
    llc = 1 << 20
    pool = ColdPool(llc, cold=True)
    bases = set()
    for shape in [(64, 64, 3, 3), (9, 1000), (700, 700)]:
        w = torch.randn(shape)
        copies = pool.copies(w)
        assert copies[0] is w and all(c.shape == w.shape for c in copies)
        assert len(copies) * w.numel() * 4 >= 2 * llc or len(copies) == 1
        bases |= {c.untyped_storage().data_ptr() for c in copies[1:]}
    assert len(bases) == 1 and pool.nbytes == 2 * llc
    assert ColdPool(llc, cold=False).copies(w) == [w]


@needs_cxx
@pytest.mark.parametrize("budget_images", [1, 2, 4])
def test_im2col_runs_the_batch_in_blocks_of_images(tmp_path, monkeypatch, budget_images):
    """With a scratch budget of `budget_images` images the batch of 4 runs in blocks of that
    many (one GEMM per block): same result, a workspace that many images large."""
    import graphmode.backends.cpu.im2col as im2col
    shape = (4, 6, 11, 9, 10, 3, 2, 1, 1, True)
    p = _im2col_problem(*shape)
    per = sum(im2col._per_image(p)) * 4
    monkeypatch.setattr(im2col, "COL_BLOCK_BYTES", per * budget_images)
    assert im2col.images_per_block(p) == budget_images
    cfg = IM2COL_CFGS[1]
    assert cfg.workspace_numel(p) * 4 == per * budget_images
    src = cfg.generate(p, 2)
    kern = KernelBuilder(tmp_path / "k", threads=2).build_many([src])[src.symbol]
    g = torch.Generator().manual_seed(7)
    x, wt, bias = torch.randn(4, 6, 11, 9, generator=g), torch.randn(10, 6, 3, 3, generator=g), torch.randn(10)
    ref = torch.nn.functional.conv2d(x, wt, bias, stride=2, padding=1)
    ws = torch.full((cfg.workspace_numel(p),), float("nan"))
    y = torch.full_like(ref, float("nan"))
    wp = cfg.prepare_weight(wt)         # held: the kernel reads it after the pointer list is built
    kern([t.data_ptr() for t in [x, wp, bias, ws, y]])
    assert rel_l2(y, ref) < 1e-6


@needs_cxx
def test_weight_growth_budget_drops_the_candidates_that_buy_least_per_byte(tmp_path):
    """Two 128-channel 3x3 convs, on a 16x16 and a 4x4 map. Unlimited, both may take F(4x4)
    (4x their weight); under memory.weight_growth 1.5 the small map (16x fewer FLOPs per
    byte) loses its Winograd candidates first, the large one keeps F(2x2), and what the plan
    binds stays within the budget."""
    def plan(**kw):
        ctx = _ctx(tmp_path, policy="heuristic", **kw)
        g = torch.Generator().manual_seed(11)
        steps = []
        for hw in (16, 4):
            x, w, b = torch.randn(1, 128, hw, hw, generator=g), torch.randn(128, 128, 3, 3, generator=g), torch.zeros(128)
            attrs = {"stride": [1, 1], "padding": [1, 1], "dilation": [1, 1], "groups": 1}
            steps.append((_conv_step(ctx, x, w, b, torch.empty(1, 128, hw, hw), attrs), x, w))
        return ctx, steps, ctx.finalize()

    ctx, steps, _ = plan()
    assert all(any(n.startswith("wino4") for n in ctx.candidates(s.problem)) for s, _, _ in steps)
    ctx, steps, sels = plan(weight_growth=1.5)
    big, small = (ctx.candidates(s.problem) for s, _, _ in steps)
    assert not any(n.startswith("wino4") for n in big) and any(n.startswith("wino2") for n in big)
    assert not any(n.startswith("wino") for n in small) and any(n.startswith("im2col") for n in small)
    assert all("memory.weight_growth 1.5x" in why for why in sels[1].rejected.values()) and sels[1].rejected
    rep = ctx.report()
    assert rep["packed_bytes"] <= rep["stats"]["weight_budget_bytes"] == 1.5 * 2 * 128 * 128 * 9 * 4 + (1 << 20)
    for step, x, w in steps:
        step()
        assert rel_l2(step.c, torch.nn.functional.conv2d(x, w, padding=1)) < 5e-6


@needs_cxx
def test_a_batched_conv_builds_only_the_contenders_of_its_one_image_timing(tmp_path):
    """With the conv at batch 1 in the timing cache (a smaller bucket tuned first), the same
    conv at batch 3 builds and times only the generated candidates close to the best there
    (and ATen); the rest are ruled out with the batch-1 ratio, and the winner still matches."""
    g = torch.Generator().manual_seed(13)
    w, b = torch.randn(32, 16, 3, 3, generator=g), torch.randn(32, generator=g)
    attrs = {"stride": [1, 1], "padding": [1, 1], "dilation": [1, 1], "groups": 1}

    def tuned(n):
        ctx = _ctx(tmp_path)
        x = torch.randn(n, 16, 12, 12, generator=g)
        step = _conv_step(ctx, x, w, b, torch.empty(n, 32, 12, 12), attrs)
        (sel,) = ctx.finalize()
        return ctx, step, sel, x

    ctx3, _, sel3, _ = tuned(3)                      # nothing at batch 1 yet: every candidate
    assert "narrowed_from_one_image" not in ctx3.stats
    every = set(sel3.timings_s)
    ctx1, _, sel1, _ = tuned(1)
    ctx3, step, sel, x = tuned(3)
    assert ctx3.stats["narrowed_from_one_image"] == 1
    kinds: dict = {}
    for n, t in sel1.timings_s.items():
        if n != ATEN:
            kinds[conv_kind(n)] = min(t, kinds.get(conv_kind(n), t))
    kept = {conv_kind(n) for n in sel.timings_s if n != ATEN}
    assert ATEN in sel.timings_s and 1 <= len(kept) <= 2
    assert all(kinds[k] <= 1.25 * min(kinds.values()) for k in kept)
    assert {n for n in every if n != ATEN and conv_kind(n) not in kept} == set(sel.rejected)
    assert all("at batch 1 (timing cache)" in why for why in sel.rejected.values())
    step()
    assert rel_l2(step.c, torch.nn.functional.conv2d(x, w, b, padding=1)) < 5e-6


def _counted_work(counts: dict, name: str, steps: int):
    """A call that counts itself under `name` and loops `steps` times: timing tests compare
    work, not sleeps (a busy host slows every loop alike)."""
    def f():
        counts[name] += 1
        acc = 0
        for i in range(steps):
            acc += i
    return f


def test_timing_stops_sampling_candidates_far_behind_in_calibration():
    """A candidate over PRUNE x the fastest in its calibration calls keeps those calls (and one
    more, its second chance) as its samples; the rest are sampled round-robin as before. The candidates are 50x apart in work
    (a loop of n steps), so a busy host slows both; asserted on counts."""
    from graphmode.backends.cpu.tactics.timing import CALIBRATION_CALLS, measure
    calls = {"fast": 0, "slow": 0}

    def fn(name, steps):
        return _counted_work(calls, name, steps)
    got = measure({"fast": fn("fast", 4_000), "slow": fn("slow", 200_000)}, reps=4, sample_s=1e-4, budget_s=0.0)
    # its calibration calls and the one call of its second chance
    assert len(got["slow"]) == CALIBRATION_CALLS + 1 and calls["slow"] == 2 + CALIBRATION_CALLS
    assert len(got["fast"]) == 4 + 0 and min(got["slow"]) > min(got["fast"])
    both = measure({"fast": fn("fast", 4_000), "slow": fn("slow", 200_000)}, reps=4, sample_s=1e-4, budget_s=0.0,
                   prune=None)
    assert len(both["slow"]) == 4



class _Clock:
    """A virtual clock for `measure`: each candidate call advances it by its cost, so the
    timing logic is tested on exact durations, not on this host's load."""

    def __init__(self):
        self.now, self.calls = 0.0, 0

    def perf_counter(self) -> float:
        return self.now

    def candidate(self, cost_s: float, slow=lambda clock, own: False):
        own = [0]

        def f():
            own[0] += 1
            self.now += cost_s * (10 if slow(self, own[0]) else 1)
            self.calls += 1
        return f


def test_a_burst_of_load_in_calibration_does_not_prune_the_fastest_candidate(monkeypatch):
    """Calibration calls go round-robin: a burst three calls long (here: global calls 6-8,
    which back to back would have been all of B's calibration) slows one call of each
    candidate, so B, the fastest, is sampled like the others and wins."""
    from graphmode.backends.cpu.tactics import timing
    clock = _Clock()
    monkeypatch.setattr(timing, "time", clock)
    burst = lambda c, own: 6 <= c.calls < 9                                  # noqa: E731
    fns = {"A": clock.candidate(1e-3, burst), "B": clock.candidate(5e-4, burst), "C": clock.candidate(2e-3, burst)}
    got = timing.measure(fns, reps=4, sample_s=1e-5, budget_s=0.0)
    assert len(got["B"]) == len(got["A"]) == 4            # none pruned: 4 rounds each
    assert min(got, key=lambda n: sorted(got[n])[len(got[n]) // 2]) == "B"


def test_a_pruned_candidate_that_comes_back_fast_is_sampled_after_all(monkeypatch):
    """B's warm-up and three calibration calls all landed in bursts (10x slow): it is pruned,
    but its second-chance call after the sampling is fast, so it gets its samples and wins;
    C, slow every time, keeps its calibration calls and the one extra call."""
    from graphmode.backends.cpu.tactics import timing
    clock = _Clock()
    monkeypatch.setattr(timing, "time", clock)
    fns = {"A": clock.candidate(1e-3), "B": clock.candidate(5e-4, lambda c, own: own <= 1 + timing.CALIBRATION_CALLS),
           "C": clock.candidate(2e-2)}
    got = timing.measure(fns, reps=4, sample_s=1e-5, budget_s=0.0)
    assert len(got["C"]) == timing.CALIBRATION_CALLS + 1
    assert len(got["B"]) == 4 and max(got["B"]) == pytest.approx(5e-4)
    assert len(got["A"]) == 8                       # its rounds, then the rounds beside B
    assert min(got, key=lambda n: sorted(got[n])[len(got[n]) // 2]) == "B"

@needs_cxx
def test_cold_timing_flushes_the_weight_outside_the_timed_region(tmp_path):
    """Every kernel library exports gm_flush_lines; with it cold timing needs no pool: each
    call's weight is flushed before the call and the flush is not timed. Without a library
    that can flush, the pool's rotating copies remain. Asserted on counts and data, and on one
    ordering of loops 50x apart in work (a busy host slows both alike)."""
    import platform

    from graphmode.backends.cpu.tactics.timing import ColdPool, Flushed, measure, rotate
    from graphmode.backends.cpu.abi import entry_point, kernel_source
    src = kernel_source("nop", "\n".join(entry_point(1, ["  (void)p0;"])), inputs=("x",), outputs=(), types={},
                        kind="native")
    kern = KernelBuilder(tmp_path / "k", threads=1).build_many([src])[src.symbol]
    lib = kern.library
    if platform.machine().lower() in ("x86_64", "amd64", "aarch64", "arm64"):
        assert lib.can_flush
    w = torch.randn(300, 301)
    before = w.clone()
    lib.flusher(w)()                                   # evicting lines never changes the data
    assert torch.equal(w, before)
    made: list = []
    pool = ColdPool(1 << 20, cold=True, library=lib)
    f = pool.each_cold(w, lambda u: made.append(u) or (lambda: None))
    if lib.can_flush:
        assert isinstance(f, Flushed) and made == [w] and pool.nbytes == 0
    fallback = ColdPool(1 << 20, cold=True, library=None)
    made.clear()
    fallback.each_cold(w, lambda u: made.append(u) or (lambda: None))
    assert made[0] is w and len(made) * w.numel() * 4 >= 2 << 20 and fallback.nbytes == 2 << 20
    made.clear()
    assert ColdPool(1 << 20, cold=False, library=lib).each_cold(w, lambda u: made.append(u) or rotate([len])) \
        and made == [w]

    counts = {"run": 0, "flush": 0}

    def work(name, steps):
        return _counted_work(counts, name, steps)
    got = measure({"cold": Flushed(work("run", 4_000), work("flush", 200_000))}, reps=3, sample_s=1e-4,
                  budget_s=0.0)
    assert counts["flush"] == counts["run"] > 3           # one flush before every call, warm-up included
    plain = measure({"both": lambda: (work("run", 4_000)(), work("flush", 200_000)())}, reps=3, sample_s=1e-4,
                    budget_s=0.0)
    assert min(got["cold"]) < min(plain["both"])           # the flush is outside the timed region


@needs_cxx
def test_convs_that_differ_only_in_their_epilogue_share_one_ranking(tmp_path):
    """Three 3x3 convs of one shape: +relu, plain, +residual add+relu (ResNet's pattern). The
    first is tuned over every candidate; the others build and time only those within
    SIBLING_MARGIN of its best (at most SIBLING_KEEP) and ATen, each still checked and timed
    with its own epilogue; the report lists them in plan order and the model matches eager."""
    import graphmode
    from graphmode.backends.cpu.tactics.context import SIBLING_KEEP
    from graphmode.recipe import load_recipe

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = (torch.nn.Conv2d(32, 32, 3, padding=1) for _ in range(3))

        def forward(self, x):
            y = torch.relu(self.a(x))
            return torch.relu(self.c(self.b(y)) + y)

    torch.manual_seed(0)
    m = Block().eval()
    r = load_recipe({"version": 1, "name": "siblings", "exe_mode": "graph", "targets": ["host"],
                     "inputs": [{"name": "x", "dtype": "f32", "shape": ["batch", 32, 12, 12]}],
                     "dims": {"batch": {"buckets": [1]}}})
    cm = graphmode.compile(m, r, cache_dir=tmp_path, threads=2)
    x = torch.randn(1, 32, 12, 12)
    with torch.inference_mode():
        ref = m(x)
    assert rel_l2(cm(x), ref) < 1e-5
    rep = cm.executable({"batch": 1}).tactics.report()
    convs = [g for g in rep["gemms"] if g["gemm"].startswith("conv2d")]
    assert len(convs) == 3 and rep["stats"]["narrowed_from_sibling"] == 2
    lead, *rest = convs
    assert "+relu" in lead["gemm"] and "add" in rest[1]["gemm"]             # plan order
    for g in rest:
        generated = [n for n in g["timings_us"] if n != ATEN]
        # how many generated candidates fall within the margin is a timing (on a busy host none
        # may): the narrowing itself is what is checked
        assert ATEN in g["timings_us"] and len(generated) <= SIBLING_KEEP
        assert set(generated) <= set(lead["timings_us"])
        assert g["rejected"] and all("the same but for the epilogue" in why for why in g["rejected"].values())


@needs_cxx
def test_a_library_built_before_the_flush_export_loads_and_times_from_the_pool(tmp_path):
    """A kernel library from an older build (a saved .gm artifact) has no gm_flush_lines: it
    loads, says it cannot flush, and cold timing falls back to the pool's copies."""
    import shutil
    import subprocess

    from graphmode.backends.cpu.kernels import CompiledLibrary
    from graphmode.backends.cpu.tactics.timing import ColdPool, Flushed
    src = tmp_path / "old.cpp"
    src.write_text('extern "C" { int t = 0; void gm_set_threads(int n) { t = n; } int gm_get_threads(void) '
                   '{ return t; } }\n')
    cxx = next(c for c in ("c++", "g++", "clang++") if shutil.which(c))
    subprocess.run([cxx, "-shared", "-fPIC", str(src), "-o", str(tmp_path / "old.so")], check=True)
    lib = CompiledLibrary(tmp_path / "old.so", threads=1)
    assert not lib.can_flush
    pool = ColdPool(1 << 20, cold=True, library=lib)
    made: list = []
    f = pool.each_cold(torch.randn(64, 64), lambda u: made.append(u) or (lambda: None))
    assert not isinstance(f, Flushed) and len(made) > 1 and pool.nbytes == 2 << 20
