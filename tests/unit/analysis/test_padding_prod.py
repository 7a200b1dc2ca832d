"""torch.prod over dims: padding an axis it keeps is safe, padding an axis it multiplies is not
(unless the padded positions hold ones). Before, prod had no rule, every padded dim reaching it
was refused, and a prod over seq was reported as unsafe for batch."""
from __future__ import annotations

import warnings

import torch

import graphmode


class Prods(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        h = self.lin(x) * 0.1 + 1
        return h.prod(-1), h.prod(1)


def test_prod_pads_the_axes_it_keeps_and_names_the_one_it_multiplies(tmp_path):
    torch.manual_seed(0)
    m = Prods().eval()
    recipe = {"version": 1, "name": "prods", "on_violation": "eager", "codegen": {"kernel_selection": "heuristic"},
              "inputs": [{"name": "x", "dtype": "f32", "shape": ["batch", "seq", 8]}],
              "dims": {"batch": {"buckets": [2, 4]}, "seq": {"buckets": [8, 16], "min": 1}}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cm = graphmode.compile(m, recipe, cache_dir=tmp_path)
    lines = cm.verdict.lines()
    assert "padding batch: safe" in lines and cm.exact_dims == ["seq"]
    assert any("prod over padded dim seq whose padded positions are not one" in line for line in lines), lines
    x = torch.randn(3, 8, 8)                     # seq at a bucket, batch padded: graph mode
    for got, want in zip(cm(x), m(x)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert cm.last_path["path"] == "graph"
