"""Special values through compiled elementwise ops match eager: the order and the exponent path
ATen takes decide whether an overflow or -inf gives inf, a finite number or NaN."""
from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

import graphmode

X = torch.tensor([[-float("inf"), 1e38, 4.0, -2.0]])


class _Pow(torch.nn.Module):
    def forward(self, x):
        return x.pow(0.5)


class _HardSwish(torch.nn.Module):
    def forward(self, x):
        return F.hardswish(x)


def _same(model, tmp_path):
    r = {"version": 1, "name": "o", "inputs": [{"name": "x", "dtype": "f32", "shape": [1, 4]}], "exe_mode": "graph",
         "targets": ["host"]}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cm = graphmode.compile(model, r, cache_dir=tmp_path)
    want, got = model(X), cm(X)
    assert torch.equal(torch.isnan(want), torch.isnan(got)), (want, got)
    assert torch.equal(want[~torch.isnan(want)], got[~torch.isnan(got)]), (want, got)


def test_a_lone_pow_by_one_half_is_a_square_root_as_in_eager(tmp_path):
    _same(_Pow(), tmp_path)          # pow(-inf, 0.5): NaN in eager (sqrt), was +inf (the tensor-tensor kernel)


def test_hardswish_multiplies_before_it_divides_as_aten_does(tmp_path):
    _same(_HardSwish(), tmp_path)    # hardswish(1e38): inf in eager (x * 6 overflows), was 1e38


class _NormAfterRelu(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = torch.nn.LayerNorm(32)

    def forward(self, x):
        return self.ln(torch.relu(x))


def test_a_fused_layer_norm_whose_variance_overflows_gives_nan_as_eager(tmp_path):
    """ATen's f32 moments overflow to a NaN row; the fused kernel gave the bias (0), hiding it."""
    torch.manual_seed(0)
    model = _NormAfterRelu().eval()
    r = {"version": 1, "name": "o", "inputs": [{"name": "x", "dtype": "f32", "shape": [2, 32]}], "exe_mode": "graph",
         "targets": ["host"]}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cm = graphmode.compile(model, r, cache_dir=tmp_path)
    x = torch.randn(2, 32, generator=torch.Generator().manual_seed(1))
    x[0] *= 1e20                               # row 0 overflows, row 1 does not
    with torch.no_grad():
        want, got = model(x), cm(x)
    assert bool(torch.isnan(want[0]).all()) and bool(torch.isnan(got[0]).all())
    assert torch.allclose(got[1], want[1], rtol=1e-5, atol=1e-6)
