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
