"""capture.exclude_ops names an op the model does not have (an ONNX file writes GELU as Erf):
nothing ran eagerly and nothing said so. The capture now says which entries met no op."""
from __future__ import annotations

import warnings

import torch

import graphmode
from graphmode.capture.spec import GraphmodeNotice


class Gelu(torch.nn.Module):
    def forward(self, x):
        return torch.nn.functional.gelu(x * 2.0)


def _recipe(exclude):
    return {"version": 1, "name": "gelu", "exe_mode": "hybrid", "capture": {"exclude_ops": exclude},
            "inputs": [{"name": "x", "dtype": "f32", "shape": ["batch", 8]}], "dims": {"batch": {"buckets": [2]}},
            "codegen": {"kernel_selection": "heuristic"}}


def _notices(model, exclude, tmp_path):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        cm = graphmode.compile(model, _recipe(exclude), cache_dir=tmp_path)
    return cm, [str(w.message) for w in seen if w.category is GraphmodeNotice and "exclude_ops" in str(w.message)]


def test_an_exclusion_that_meets_no_op_is_said_and_one_that_meets_an_op_is_not(tmp_path):
    path = tmp_path / "gelu.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(Gelu(), (torch.randn(2, 8),), str(path), dynamo=False, opset_version=17,
                          input_names=["x"], dynamic_axes={"x": {0: "batch"}})
    cm, said = _notices(str(path), ["gelu", "Mul"], tmp_path / "c1")     # the file has Erf, Mul, Add: no Gelu
    assert len(said) == 1 and "['gelu']" in said[0] and "ONNX op types" in said[0], said
    x = torch.randn(2, 8)
    assert torch.allclose(cm(x=x), Gelu()(x), atol=1e-6)
    _, said = _notices(Gelu(), ["gelu"], tmp_path / "c2")                    # torch: aten.gelu is there
    assert said == []
    _, said = _notices(Gelu(), ["softmax"], tmp_path / "c3")
    assert len(said) == 1 and "ATen names" in said[0]
