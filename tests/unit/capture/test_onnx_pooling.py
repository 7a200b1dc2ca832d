"""ONNX MaxPool / AveragePool / LpPool cases torch's pools do not take (3-d, pads over half the
window, asymmetric pads in ceil mode, dilated averages, integer max): written as strided slices
(capture/onnx/pooling.py), checked against ONNX Runtime; a window too large to unroll is refused."""
from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from graphmode.capture.onnx import import_onnx
from graphmode.errors import CaptureError
from graphmode.ir.interpreter import interpret

CASES = [
    ("MaxPool", [1, 2, 5, 6, 7], {"kernel_shape": [2, 3, 2], "strides": [2, 1, 2], "pads": [1, 0, 1, 0, 2, 1]}),
    ("AveragePool", [1, 2, 5, 6, 7], {"kernel_shape": [3, 2, 2], "strides": [2, 2, 1], "ceil_mode": 1}),
    ("MaxPool", [1, 2, 9], {"kernel_shape": [2], "strides": [2], "pads": [0, 1], "ceil_mode": 1}),
    ("MaxPool", [1, 2, 7, 8], {"kernel_shape": [3, 2], "pads": [2, 0, 0, 1], "dilations": [1, 2]}),
    ("AveragePool", [1, 2, 7, 8], {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [0, 1, 2, 1],
                                   "ceil_mode": 1}),
    ("AveragePool", [1, 2, 7, 8], {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [0, 1, 2, 1],
                                   "ceil_mode": 1, "count_include_pad": 1}),
    ("AveragePool", [1, 2, 9, 8], {"kernel_shape": [2, 2], "dilations": [2, 3], "pads": [1, 1, 1, 1]}),
    ("LpPool", [1, 2, 7, 8], {"kernel_shape": [2, 3], "strides": [2, 2], "pads": [1, 0, 0, 1], "ceil_mode": 1,
                              "p": 3}),
    ("LpPool", [1, 2, 4, 5, 6], {"kernel_shape": [2, 2, 3], "p": 2}),
]


def _model(op: str, shape: list[int], attrs: dict, elem: int, out_shape: list[int] | None, opset: int = 22):
    node = helper.make_node(op, ["x"], ["y"], **attrs)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", elem, shape)],
                          [helper.make_tensor_value_info("y", elem, out_shape)])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


def _check(op, shape, attrs, x, elem, opset=22):
    want = ort.InferenceSession(_model(op, shape, attrs, elem, None, opset).SerializeToString(),
                                providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    graph, _ = import_onnx(_model(op, shape, attrs, elem, list(want.shape), opset))
    got = interpret(graph, {graph.inputs[0]: torch.from_numpy(x)})[graph.outputs[0]].numpy()
    assert got.shape == want.shape and got.dtype == want.dtype
    return got, want


@pytest.mark.parametrize("op,shape,attrs", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_pool_matches_onnxruntime(op, shape, attrs):
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    got, want = _check(op, shape, attrs, x, TensorProto.FLOAT)
    assert np.allclose(got, want, rtol=1e-5, atol=1e-6)


def test_int8_max_pool_pads_with_the_dtype_minimum():
    x = np.random.default_rng(1).integers(-128, -100, (1, 1, 5, 5, 5)).astype(np.int8)
    got, want = _check("MaxPool", [1, 1, 5, 5, 5], {"kernel_shape": [2, 2, 2], "pads": [1, 1, 1, 1, 1, 1]}, x,
                       TensorProto.INT8)
    assert (got == want).all()


def test_a_window_too_large_to_unroll_is_refused():
    with pytest.raises(CaptureError, match="window positions"):
        import_onnx(_model("MaxPool", [1, 1, 20, 20, 20], {"kernel_shape": [11, 11, 11]}, TensorProto.FLOAT,
                           [1, 1, 10, 10, 10]))


@pytest.mark.parametrize("storage_order", [0, 1])
def test_max_pool_indices_count_over_the_whole_input(storage_order):
    """MaxPool's indices output: each max's position in the input flattened over batch and
    channels too (row-major, or column-major over H and W), as ONNX Runtime gives it."""
    x = np.random.default_rng(0).standard_normal((2, 3, 6, 5)).astype(np.float32)
    attrs = {"kernel_shape": [3, 2], "strides": [2, 1], "pads": [1, 0, 1, 0], "storage_order": storage_order}
    node = helper.make_node("MaxPool", ["x"], ["y", "i"], **attrs)
    io = [helper.make_tensor_value_info("y", TensorProto.FLOAT, None), helper.make_tensor_value_info("i", TensorProto.INT64, None)]
    m = helper.make_model(helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 6, 5])],
                                            io), opset_imports=[helper.make_opsetid("", 12)])
    want = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    for vi, w in zip(m.graph.output, want):
        vi.type.tensor_type.shape.Clear()
        for d in w.shape:
            vi.type.tensor_type.shape.dim.add().dim_value = d
    graph, _ = import_onnx(m)
    got = interpret(graph, {graph.inputs[0]: torch.from_numpy(x)})
    assert np.array_equal(got[graph.outputs[0]].numpy(), want[0])
    assert np.array_equal(got[graph.outputs[1]].numpy(), want[1])
