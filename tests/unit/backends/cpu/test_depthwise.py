"""The generated depthwise convolution (backends/cpu/depthwise.py) and its tactic: numerics
against ATen on awkward shapes (strides, padding wider than the kernel's reach, dilation, a
channel multiplier, a map narrower than the kernel, batch > 1), the candidate a depthwise step
gets (other grouped convs stay ATen) and a ConvNeXt-style block through the executor. Nothing
here asserts on a timing."""
from __future__ import annotations

import pytest
import torch

from graphmode.backends.cpu.isa import ISAS, host_isas, host_simd
from graphmode.backends.cpu.conv import ConvProblem
from graphmode.backends.cpu.depthwise import DepthwiseConfig, DepthwiseTiledConfig, is_depthwise
from graphmode.backends.cpu.tactics import ATEN, ConvStep
from graphmode.backends.cpu.tactics.candidates import conv_config, conv_kind, prepared_bytes
from graphmode.errors import BackendError
from graphmode.verify.numerics import rel_l2
from test_winograd import _conv_step, _ctx, needs_cxx

# (n, c, h, w, multiplier, k, stride, padding, dilation, bias)
SHAPES = [
    (1, 16, 16, 16, 1, 7, 1, 3, 1, True),      # ConvNeXt's 7x7
    (2, 5, 9, 11, 1, 3, 2, 1, 1, False),      # stride 2, odd sizes, batch 2
    (1, 8, 7, 6, 2, 3, 1, 1, 1, True),        # channel multiplier 2
    (1, 3, 10, 10, 1, 3, 1, 2, 2, True),      # dilation 2
    (1, 4, 5, 5, 1, 7, 1, 3, 1, False),       # the map narrower than the kernel
    (1, 6, 8, 8, 1, 3, 1, 4, 1, True),        # padding past the kernel's reach: rows of bias alone
    (3, 32, 14, 14, 1, 5, 2, 2, 1, True),     # MobileNet-like stride-2 5x5
    (1, 4, 9, 70, 1, 3, 1, 1, 1, True),       # a row of 5 vectors: a tile of 4 and one of 1 with a tail
    (1, 2, 5, 32, 1, 3, 1, 1, 1, False),      # whole vectors only; output rows not a multiple of a tile's
]


def _problem(n, c, h, w, m, k, s, pad, d, bias) -> ConvProblem:
    return ConvProblem(n, c, h, w, c * m, k, k, (s, s), (pad, pad), (d, d), groups=c, bias=bias)


@needs_cxx
@pytest.mark.parametrize("cfg", [DepthwiseConfig(), DepthwiseTiledConfig()], ids=["dw", "dwt"])
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("threads", [1, 2])
def test_depthwise_matches_aten(isa_builder, isa, threads, cfg):
    """Both bodies, every ISA path (dwt's tiles of vectors of 16, 8 or 8 portable lanes) built;
    those the host runs are run."""
    cases = [(s, cfg.generate(_problem(*s), threads)) for s in SHAPES]
    kernels = isa_builder(isa, f"{cfg.name}{threads}").build_many([c[1] for c in cases])
    if isa not in host_isas(host_simd()):
        pytest.skip(f"the {isa} path is built but this host cannot run it")
    for shape, src in cases:
        n, c, h, w, m, k, st, pad, d, has_bias = shape
        g = torch.Generator().manual_seed(sum(shape))
        x, wt = torch.randn(n, c, h, w, generator=g), torch.randn(c * m, 1, k, k, generator=g)
        bias = torch.randn(c * m, generator=g) if has_bias else None
        ref = torch.nn.functional.conv2d(x, wt, bias, stride=st, padding=pad, dilation=d, groups=c)
        p = _problem(*shape)
        assert (p.ho, p.wo) == tuple(ref.shape[2:]) and is_depthwise(p)
        wp, ws = cfg.prepare_weight(wt), torch.empty(1)
        for _ in range(2):
            y = torch.full_like(ref, float("nan"))       # every output element is written
            kernels[src.symbol]([t.data_ptr() for t in [x, wp] + ([bias] if has_bias else []) + [ws, y]])
            assert rel_l2(y, ref) < 1e-6, (p.text, rel_l2(y, ref))


def test_names_kinds_and_what_is_depthwise():
    p = _problem(*SHAPES[0])
    assert conv_config("dw") == DepthwiseConfig() and conv_kind("dw") == "dw"
    assert conv_config("dwt") == DepthwiseTiledConfig() and conv_kind("dwt") == "dwt"
    assert prepared_bytes(p, "dwt") == prepared_bytes(p, "dw")
    assert prepared_bytes(p, "dw") == 16 * 49 * 4
    grouped = ConvProblem(1, 8, 6, 6, 8, 3, 3, (1, 1), (1, 1), groups=2)       # groups < channels: no GEMM, no dw
    assert not is_depthwise(grouped) and not is_depthwise(ConvProblem(1, 8, 6, 6, 8, 3, 3, (1, 1), (1, 1)))
    with pytest.raises(BackendError, match="groups equal the input channels"):
        DepthwiseConfig().generate(grouped, 1)


@needs_cxx
def test_a_depthwise_step_gets_the_depthwise_candidate_and_runs_checked(tmp_path):
    g = torch.Generator().manual_seed(3)
    x, w, b = torch.randn(1, 16, 16, 16, generator=g), torch.randn(16, 1, 7, 7, generator=g), torch.randn(16)
    y = torch.empty(1, 16, 16, 16)
    attrs = {"stride": [1, 1], "padding": [3, 3], "dilation": [1, 1], "groups": 16}
    ctx = _ctx(tmp_path)
    step = _conv_step(ctx, x, w, b, y, attrs)
    assert isinstance(step, ConvStep) and ctx.candidates(step.problem) == [ATEN, "dw", "dwt"]
    (sel,) = ctx.finalize()
    assert not sel.rejected and set(sel.timings_s) == {ATEN, "dw", "dwt"}
    step()
    assert rel_l2(y, torch.nn.functional.conv2d(x, w, b, padding=3, groups=16)) < 1e-6


class _ConvNextBlock(torch.nn.Module):
    def __init__(self, c: int = 16):
        super().__init__()
        self.dw = torch.nn.Conv2d(c, c, 7, padding=3, groups=c)
        self.norm = torch.nn.LayerNorm(c)
        self.up, self.down = torch.nn.Linear(c, 4 * c), torch.nn.Linear(4 * c, c)

    def forward(self, x):
        h = self.dw(x).permute(0, 2, 3, 1)
        h = self.down(torch.nn.functional.gelu(self.up(self.norm(h))))
        return x + h.permute(0, 3, 1, 2)


@needs_cxx
def test_a_convnext_block_compiles_with_the_depthwise_tactic_and_matches_eager(tmp_path):
    import graphmode
    torch.manual_seed(0)
    m = _ConvNextBlock().eval()
    x = torch.randn(2, 16, 12, 12)
    recipe = {"version": 1, "name": "cnx", "inputs": [{"name": "x", "dtype": "f32", "shape": ["batch", 16, 12, 12]}],
              "dims": {"batch": {"buckets": [2]}}, "exe_mode": "graph", "codegen": {"kernel_selection": "heuristic"}}
    cm = graphmode.compile((m, (x,)), recipe, cache_dir=tmp_path)
    with torch.no_grad():
        assert rel_l2(cm(x), m(x)) < 1e-5
    report = cm.executable({"batch": 2}).tactics_report
    picked = [g["winner"] for g in report["gemms"] if g["shape"].get("groups", 1) > 1]
    assert picked == ["dw"]        # heuristic selection: the first generated candidate
