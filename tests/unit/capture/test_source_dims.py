"""A recipe may name an ONNX file's axes otherwise than the file does (`batch`, `seq` for the
exporter's `x_dynamic_axes_1`): the inputs graphmode makes for `run`, `verify` and the tactics
follow the recipe's dims. Before, `graphmode run --shape` and `graphmode verify` failed with
"no value for dim 'x_dynamic_axes_1'" while the Python API ran the same recipe."""
from __future__ import annotations

import warnings

import torch

from graphmode.capture.source import resolve_model
from graphmode.recipe import load_recipe


class Two(torch.nn.Module):
    def forward(self, x, mask):
        return (x * mask.unsqueeze(-1)).sum(1)


def test_inputs_made_for_a_recipe_that_renames_the_files_axes(tmp_path):
    path = tmp_path / "two.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(Two(), (torch.randn(2, 5, 4), torch.ones(2, 5)), str(path), dynamo=False,
                          input_names=["x", "mask"], dynamic_axes={"x": [0, 1], "mask": [0, 1]})
    recipe = load_recipe({"version": 1, "name": "two", "dims": {"batch": {"buckets": [2, 4]}, "seq": {"buckets": [8]}},
                          "inputs": [{"name": "x", "dtype": "f32", "shape": ["batch", "seq", 4]},
                                     {"name": "mask", "dtype": "f32", "shape": ["batch", "seq"]}]})
    source = resolve_model(str(path), recipe)
    made = source.make_inputs({"batch": 3, "seq": 7})
    assert made["x"].shape == (3, 7, 4) and made["mask"].shape == (3, 7)
