"""A layer or RMS norm run as an eager island (hybrid, `exclude_ops: [layer_norm]`) or as an
ATen-reference op (F.rms_norm) normalises each row over its last axes: padding the sequence is
safe. Before, the island was refused for padding with 'mixes positions along padded dim seq',
which was not what it does."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import graphmode


class Norms(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = torch.nn.LayerNorm(16)
        self.lin = torch.nn.Linear(16, 16)
        self.w = torch.nn.Parameter(torch.rand(16) + 0.5)

    def forward(self, x):
        return F.rms_norm(self.lin(self.ln(x)), (16,), self.w, 1e-6)


@pytest.mark.parametrize("mode,extra", [("hybrid", {"capture": {"exclude_ops": ["layer_norm"]}}), ("graph", {})])
def test_a_norm_over_the_last_axis_pads_the_sequence(mode, extra, tmp_path):
    torch.manual_seed(0)
    m = Norms().eval()
    recipe = {"version": 1, "name": "norms", "exe_mode": mode, "codegen": {"kernel_selection": "heuristic"},
              "inputs": [{"name": "x", "dtype": "f32", "shape": ["batch", "seq", 16]}],
              "dims": {"batch": {"buckets": [2, 4]}, "seq": {"buckets": [8, 16], "min": 1}}, **extra}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cm = graphmode.compile(m, recipe, cache_dir=tmp_path)
    assert cm.exact_dims == [] and "padding seq: safe" in cm.verdict.lines()
    for shape in [(3, 5, 16), (1, 11, 16)]:
        x = torch.randn(*shape)
        torch.testing.assert_close(cm(x), m(x), rtol=1e-5, atol=1e-5)
        assert cm.last_path["path"] == "graph"
