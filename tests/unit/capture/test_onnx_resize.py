"""ONNX Resize as per-axis linear maps, against ONNX Runtime and onnx's reference evaluator
across modes, coordinate transformations, crop-and-resize extrapolation, antialiasing and an
integer input; and against PyTorch for what its exporter writes."""
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
    ({"mode": "linear", "coordinate_transformation_mode": "align_corners"}, [1, 1, 1.6, 0.5], None),
    ({"mode": "cubic", "cubic_coeff_a": -0.5, "exclude_outside": 1}, [1, 1, 0.8, 1.3], None),
    ({"mode": "linear", "antialias": 1}, [1, 1, 0.5, 0.6], None),
    ({"mode": "linear", "coordinate_transformation_mode": "tf_crop_and_resize", "extrapolation_value": 7.0},
     [1, 1, 1.6, 1.5], [0, 0, -0.2, 0.1, 1, 1, 0.9, 1.3]),
]
ORT_REFUSES = {(3, np.uint8)}       # ONNX Runtime has no cubic for uint8: the reference alone


def _model(attrs, scales, roi, x, out_shape=()):
    inits = [numpy_helper.from_array(np.array(roi or [], np.float32), "roi"),
             numpy_helper.from_array(np.array(scales, np.float32), "scales")]
    t = TensorProto.FLOAT if x.dtype == np.float32 else TensorProto.UINT8
    node = helper.make_node("Resize", ["x", "roi", "scales"], ["y"], **attrs)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", t, list(x.shape))],
                          [helper.make_tensor_value_info("y", t, list(out_shape))], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 19)])


def _close(got, want):
    assert got.shape == want.shape and got.dtype == want.dtype
    if want.dtype == np.uint8:
        assert np.abs(got.astype(int) - want.astype(int)).max() <= 1     # f32 vs f64 sums round apart at .5
    else:
        assert np.allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("dtype", [np.float32, np.uint8])
def test_resize_matches_onnx_runtime_and_the_reference(case, dtype):
    import onnxruntime as ort
    attrs, scales, roi = CASES[case]
    x = (np.random.default_rng(0).random((1, 2, 5, 6)) * 200).astype(dtype)
    ref = ReferenceEvaluator(_model(attrs, scales, roi, x)).run(None, {"x": x})[0]
    graph, _ = import_onnx(_model(attrs, scales, roi, x, ref.shape))
    got = interpret(graph, {graph.inputs[0]: torch.from_numpy(x)})[graph.outputs[0]].numpy()
    _close(got, ref)
    if (case, dtype) not in ORT_REFUSES:
        _close(got, ort.InferenceSession(_model(attrs, scales, roi, x, ref.shape).SerializeToString(),
                                         providers=["CPUExecutionProvider"]).run(None, {"x": x})[0])


@pytest.mark.parametrize("attrs,scales,roi", [
    ({"mode": "linear", "coordinate_transformation_mode": "align_corners"}, [1, 1, 1.7, 0.5], None),
    ({"mode": "cubic", "coordinate_transformation_mode": "align_corners"}, [1, 1, 0.5, 1], None),
    ({"mode": "linear", "coordinate_transformation_mode": "tf_crop_and_resize"}, [1, 1, 1.5, 1],
     [0, 0, 0.1, 0, 1, 1, 0.9, 1]),
])
def test_a_scale_whose_output_length_is_floored_reads_two_ways_and_is_refused(attrs, scales, roi):
    """At 1.7 x 5 ONNX Runtime and PyTorch divide by the output's 8 - 1, onnx's reference (the
    node tests) by 8.5 - 1: answering either is wrong to the other, so the import refuses."""
    from graphmode.errors import CaptureError
    x = np.zeros((1, 2, 5, 6), np.float32)
    out = [int(np.float32(s) * np.float32(e)) for s, e in zip(scales, x.shape)]
    with pytest.raises(CaptureError, match=r"reads two ways: ONNX Runtime (and PyTorch )?divides? by the output length"
                                           r" \d+ - 1, the ONNX reference by [\d.]+ - 1") as e:
        import_onnx(_model(attrs, scales, roi, x, out))
    assert "sizes instead of scales" in e.value.fix


@pytest.mark.parametrize("kw", [dict(scale_factor=0.6, mode="nearest"), dict(scale_factor=1.7, mode="nearest"),
                                dict(size=(8, 11), mode="bilinear", align_corners=True),
                                dict(scale_factor=1.7, mode="bicubic")])
def test_what_pytorch_exports_from_interpolate_means_what_pytorch_computes(kw, tmp_path):
    """A file exported from F.interpolate(scale_factor=0.6, mode='nearest') answered another
    pixel than PyTorch and ONNX Runtime (float64 coordinates); 0.7 x 10 is 7 rows in float32."""
    class Interp(torch.nn.Module):
        def forward(self, x):
            return torch.nn.functional.interpolate(x, **kw)
    x = torch.arange(2 * 2 * 10 * 7, dtype=torch.float32).reshape(2, 2, 10, 7)
    torch.onnx.export(Interp(), (x,), tmp_path / "m.onnx", dynamo=False, opset_version=17)
    graph, _ = import_onnx(str(tmp_path / "m.onnx"))
    got = interpret(graph, {graph.inputs[0]: x})[graph.outputs[0]]
    want = Interp()(x)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-4)


def test_a_scale_whose_length_floors_apart_in_float32_and_float64_is_refused():
    """0.7 x 10 rows: 7 for ONNX Runtime and PyTorch (float32), 6 for onnx's shape inference."""
    from graphmode.errors import CaptureError
    x = np.zeros((1, 1, 10, 4), np.float32)
    m = _model({"mode": "linear"}, [1, 1, 0.7, 1], None, x, ["n", "c", "h", "w"])
    with pytest.raises(CaptureError, match=r"scale 0.7 on axis 2 of length 10 reads two ways: ONNX Runtime and "
                                           r"PyTorch compute 7 rows \(in float32\), onnx's shape inference and "
                                           r"reference 6"):
        import_onnx(m)
