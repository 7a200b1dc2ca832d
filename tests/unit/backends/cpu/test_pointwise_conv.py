"""The generated 1x1 convolution on NCHW (backends/cpu/pointwise_conv.py) and its tactic:
numerics against ATen on shapes with a channel tail and a pixel tail, with and without bias and
an epilogue, the candidate a 1x1 step gets beside im2col, and a MobileNet-style block through the
executor. Nothing here asserts on a timing."""
from __future__ import annotations

import pytest
import torch

from graphmode.backends.cpu.build import KernelBuilder
from graphmode.backends.cpu.conv import ConvProblem
from graphmode.backends.cpu.pointwise_conv import PB, PointwiseConfig, is_pointwise
from graphmode.backends.cpu.tactics import ATEN, ConvStep
from graphmode.backends.cpu.tactics.candidates import conv_config, conv_kind, prepared_bytes
from graphmode.errors import BackendError
from graphmode.verify.numerics import rel_l2
from test_winograd import _conv_step, _ctx, needs_cxx

# (n, cin, h, w, cout, bias)
SHAPES = [
    (4, 16, 64, 64, 24, True),     # MobileNet's pointwise: many pixels, few channels
    (2, 5, 7, 9, 6, False),        # a channel tail (6 = 4 + 2) and a pixel tail (63 = 32 + 31)
    (1, 64, 3, 3, 130, True),      # fewer pixels than a tile, many channels
    (3, 1, 2, PB, 1, True),        # one input channel, one output channel, whole tiles
]


def _problem(n, cin, h, w, cout, bias) -> ConvProblem:
    return ConvProblem(n, cin, h, w, cout, 1, 1, (1, 1), (0, 0), bias=bias)


@needs_cxx
@pytest.mark.parametrize("threads", [1, 2])
def test_pointwise_matches_aten(tmp_path, threads):
    cfg = PointwiseConfig()
    cases = [(s, cfg.generate(_problem(*s), threads)) for s in SHAPES]
    kernels = KernelBuilder(tmp_path / "k", threads=2).build_many([c[1] for c in cases])
    for shape, src in cases:
        n, cin, h, w, cout, has_bias = shape
        g = torch.Generator().manual_seed(sum(shape))
        x, wt = torch.randn(n, cin, h, w, generator=g), torch.randn(cout, cin, 1, 1, generator=g)
        bias = torch.randn(cout, generator=g) if has_bias else None
        ref = torch.nn.functional.conv2d(x, wt, bias)
        wp, ws = cfg.prepare_weight(wt), torch.empty(1)
        for _ in range(2):
            y = torch.full_like(ref, float("nan"))       # every output element is written
            kernels[src.symbol]([t.data_ptr() for t in [x, wp] + ([bias] if has_bias else []) + [ws, y]])
            assert rel_l2(y, ref) < 1e-6, (shape, rel_l2(y, ref))


def test_names_kinds_and_what_is_pointwise():
    p = _problem(*SHAPES[0])
    assert conv_config("pw") == PointwiseConfig() and conv_kind("pw") == "pw" and is_pointwise(p)
    assert prepared_bytes(p, "pw") == 24 * 16 * 4
    for other in (ConvProblem(1, 8, 6, 6, 8, 1, 1, (2, 2), (0, 0)), ConvProblem(1, 8, 6, 6, 8, 1, 1, (1, 1), (1, 1)),
                  ConvProblem(1, 8, 6, 6, 8, 3, 3, (1, 1), (1, 1)), ConvProblem(1, 8, 6, 6, 8, 1, 1, (1, 1), (0, 0),
                                                                                groups=2)):
        assert not is_pointwise(other)
    with pytest.raises(BackendError, match="1x1 convs of stride 1"):
        PointwiseConfig().generate(ConvProblem(1, 8, 6, 6, 8, 3, 3, (1, 1), (1, 1)), 1)


@needs_cxx
def test_a_1x1_step_gets_the_pointwise_candidate_beside_im2col_and_runs_checked(tmp_path):
    g = torch.Generator().manual_seed(5)
    x, w, b = torch.randn(2, 16, 20, 20, generator=g), torch.randn(24, 16, 1, 1, generator=g), torch.randn(24)
    y = torch.empty(2, 24, 20, 20)
    ctx = _ctx(tmp_path)
    step = _conv_step(ctx, x, w, b, y, {"stride": [1, 1], "padding": [0, 0], "dilation": [1, 1], "groups": 1})
    names = ctx.candidates(step.problem)
    assert isinstance(step, ConvStep) and names[:2] == [ATEN, "pw"] and any(n.startswith("im2col") for n in names)
    (sel,) = ctx.finalize()
    assert not sel.rejected and "pw" in sel.timings_s
    step()
    assert rel_l2(y, torch.nn.functional.conv2d(x, w, b)) < 1e-6


class _InvertedResidual(torch.nn.Module):
    """MobileNetV2's block: 1x1 expand + ReLU6, depthwise 3x3 + ReLU6, 1x1 project, residual."""

    def __init__(self, c: int = 12, e: int = 3):
        super().__init__()
        self.expand, self.project = torch.nn.Conv2d(c, c * e, 1), torch.nn.Conv2d(c * e, c, 1)
        self.dw = torch.nn.Conv2d(c * e, c * e, 3, padding=1, groups=c * e)

    def forward(self, x):
        h = torch.nn.functional.relu6(self.expand(x))
        return x + self.project(torch.nn.functional.relu6(self.dw(h)))


@needs_cxx
def test_an_inverted_residual_block_compiles_with_the_pointwise_tactic_and_matches_eager(tmp_path):
    import graphmode
    torch.manual_seed(0)
    m = _InvertedResidual().eval()
    x = torch.randn(2, 12, 15, 17)
    recipe = {"version": 1, "name": "mbv2", "inputs": [{"name": "x", "dtype": "f32", "shape": ["batch", 12, 15, 17]}],
              "dims": {"batch": {"buckets": [2]}}, "exe_mode": "graph", "codegen": {"kernel_selection": "heuristic"}}
    cm = graphmode.compile((m, (x,)), recipe, cache_dir=tmp_path)
    with torch.no_grad():
        assert rel_l2(cm(x), m(x)) < 1e-5
    report = cm.executable({"batch": 2}).tactics_report
    picked = [g["winner"] for g in report["gemms"] if g["shape"].get("kh") == 1]
    assert picked == ["pw", "pw"], report["gemms"]       # heuristic selection: the first generated candidate
