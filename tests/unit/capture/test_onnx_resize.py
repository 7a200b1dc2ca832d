"""ONNX Resize as per-axis linear maps, against onnx's reference evaluator across modes,
coordinate transformations, crop-and-resize extrapolation, antialiasing and an integer input."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from graphmode.capture.onnx import import_onnx
from graphmode.ir.interpreter import interpret

CASES = [
    ({"mode": "nearest"}, [1, 1, 2.0, 1.5], None),
    ({"mode": "nearest", "nearest_mode": "ceil", "coordinate_transformation_mode": "asymmetric"}, [1, 1, 0.6, 2.3],
     None),
    ({"mode": "linear", "coordinate_transformation_mode": "align_corners"}, [1, 1, 1.7, 0.5], None),
    ({"mode": "cubic", "cubic_coeff_a": -0.5, "exclude_outside": 1}, [1, 1, 0.8, 1.3], None),
    ({"mode": "linear", "antialias": 1}, [1, 1, 0.5, 0.6], None),
    ({"mode": "linear", "coordinate_transformation_mode": "tf_crop_and_resize", "extrapolation_value": 7.0},
     [1, 1, 1.5, 1.2], [0, 0, -0.2, 0.1, 1, 1, 0.9, 1.3]),
]


@pytest.mark.parametrize("attrs,scales,roi", CASES)
@pytest.mark.parametrize("dtype", [np.float32, np.uint8])
def test_resize_matches_onnx_reference(attrs, scales, roi, dtype):
    x = (np.random.default_rng(0).random((1, 2, 5, 6)) * 200).astype(dtype)
    inits = [numpy_helper.from_array(np.array(roi or [], np.float32), "roi"),
             numpy_helper.from_array(np.array(scales, np.float32), "scales")]
    t = TensorProto.FLOAT if dtype == np.float32 else TensorProto.UINT8
    node = helper.make_node("Resize", ["x", "roi", "scales"], ["y"], **attrs)

    def model(out_shape):
        g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", t, list(x.shape))],
                              [helper.make_tensor_value_info("y", t, out_shape)], inits)
        return helper.make_model(g, opset_imports=[helper.make_opsetid("", 19)])
    want = ReferenceEvaluator(model([])).run(None, {"x": x})[0]
    m = model(list(want.shape))
    graph, _ = import_onnx(m)
    got = interpret(graph, {graph.inputs[0]: torch.from_numpy(x)})[graph.outputs[0]].numpy()
    assert got.shape == want.shape and got.dtype == want.dtype
    if dtype == np.uint8:
        assert np.abs(got.astype(int) - want.astype(int)).max() <= 1     # f32 vs f64 sums round apart at .5
    else:
        assert np.allclose(got, want, rtol=1e-5, atol=1e-5)
