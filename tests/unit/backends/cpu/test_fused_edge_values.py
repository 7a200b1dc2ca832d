"""Edge values through fused groups and epilogues, against eager PyTorch element by element
(trial AH): a float -> uint8 -> float cast chain wraps, x + 0.0 of -0.0 is +0.0, tanh keeps
-0.0 and saturates to exactly +-1 (a tanh GELU after a Linear is -0.0 far left, not x * 3e-8),
an integer tensor clamped to float bounds is promoted, and LayerNorm of a row far from zero is
no further from the float64 answer than eager's."""
from __future__ import annotations

import torch

import graphmode


class _Edges(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(1, 1)
        with torch.no_grad():
            self.lin.weight.fill_(1.0)
            self.lin.bias.zero_()
        self.norm = torch.nn.LayerNorm(768)

    def forward(self, x, n, rows):
        wrapped = x.to(torch.uint8).float() * 2 + 1
        big = x.to(torch.int16).float()
        plus_zero = 1.0 / (x + 0.0)
        coth = 1.0 / torch.tanh(x)
        gelu = torch.nn.functional.gelu(self.lin(x.reshape(-1, 1)), approximate="tanh")
        clamped = torch.clamp(n, 0.5, 2.5)
        return wrapped, big, plus_zero, coth, gelu, clamped, self.norm(rows)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.isnan(), b.isnan()) and \
        torch.equal(torch.where(a.isnan(), 0, a).signbit(), torch.where(b.isnan(), 0, b).signbit()) and \
        torch.allclose(a.nan_to_num(), b.nan_to_num(), rtol=1e-6, atol=0)


def test_edge_values_through_fused_groups_match_eager(tmp_path):
    torch.manual_seed(0)
    m = _Edges().eval()
    x = torch.tensor([[-0.0, 0.0, -1.0, -2.5, 300.0, 255.9, 1e5, -8.0, -100.0, -1e6, 2.0, -1e30]])
    n = torch.tensor([[-3, 0, 1, 2, 3, 9, 1, 1, 1, 1, 1, 1]], dtype=torch.int32)
    rows = torch.randn(2, 768) + torch.tensor([[1e4], [1e5]])
    cm = graphmode.compile((m, (x, n, rows), {"x": [1, 12], "n": [1, 12], "rows": [2, 768]}), cache_dir=tmp_path)
    with torch.no_grad():
        got, want = cm(x, n, rows), m(x, n, rows)
    names = ["wrapped", "big", "plus_zero", "coth", "gelu", "clamped"]
    for name, a, b in zip(names, got[:-1], want[:-1]):
        assert _same(a, b), (name, a, b)
    exact = torch.nn.functional.layer_norm(rows.double(), (768,), m.norm.weight.double(), m.norm.bias.double())
    err = [float((t.double() - exact).norm() / exact.norm()) for t in (got[-1], want[-1])]
    assert err[0] <= err[1] * 1.01, err        # graphmode's moments: no worse than eager's
