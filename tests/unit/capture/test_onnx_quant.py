"""ONNX QuantizeLinear / DequantizeLinear (per tensor, per axis, blocked) and QLinearMatMul as
core ops, against onnx's reference evaluator (rounding half to even, saturation)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from graphmode.capture.onnx import import_onnx
from graphmode.ir.interpreter import interpret


def _check(node, x, inits, out_type, opset=21):
    def model(shape):
        g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", helper.np_dtype_to_tensor_dtype(x.dtype),
                                                                          list(x.shape))],
                              [helper.make_tensor_value_info("y", out_type, shape)],
                              [numpy_helper.from_array(v, k) for k, v in inits.items()])
        return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    want = ReferenceEvaluator(model([])).run(None, {"x": x})[0]
    graph, _ = import_onnx(model(list(want.shape)))
    got = interpret(graph, {graph.inputs[0]: torch.from_numpy(x)})[graph.outputs[0]].numpy()
    assert got.dtype == want.dtype
    assert np.allclose(got, want, rtol=1e-6) if want.dtype.kind == "f" else np.array_equal(got, want)


X = (np.random.default_rng(0).standard_normal((2, 6, 4)) * 40).astype(np.float32)
X[0, 0, :3] = [2.5, 3.5, -2.5]          # ties round to even


@pytest.mark.parametrize("zp_dtype", [np.uint8, np.int8, np.int16])
def test_quantize_per_tensor_axis_and_block(zp_dtype):
    t = helper.np_dtype_to_tensor_dtype(np.dtype(zp_dtype))
    _check(helper.make_node("QuantizeLinear", ["x", "s", "z"], ["y"]), X,
           {"s": np.array(0.5, np.float32), "z": np.array(3, zp_dtype)}, t)
    _check(helper.make_node("QuantizeLinear", ["x", "s", "z"], ["y"], axis=1), X,
           {"s": np.linspace(0.2, 2, 6).astype(np.float32), "z": np.arange(6).astype(zp_dtype)}, t)
    _check(helper.make_node("QuantizeLinear", ["x", "s", "z"], ["y"], axis=2, block_size=2), X,
           {"s": np.full((2, 6, 2), 0.7, np.float32), "z": np.ones((2, 6, 2), zp_dtype)}, t)


def test_dequantize_and_qlinear_matmul():
    q = (np.random.default_rng(1).integers(0, 255, (2, 6, 4))).astype(np.uint8)
    _check(helper.make_node("DequantizeLinear", ["x", "s", "z"], ["y"], axis=1), q,
           {"s": np.linspace(0.1, 1, 6).astype(np.float32), "z": np.arange(6).astype(np.uint8)}, TensorProto.FLOAT)
    a = (np.random.default_rng(2).integers(0, 255, (3, 4))).astype(np.uint8)
    inits = {"as": np.array(0.05, np.float32), "az": np.array(100, np.uint8),
             "b": np.random.default_rng(3).integers(0, 255, (4, 5)).astype(np.uint8),
             "bs": np.array(0.02, np.float32), "bz": np.array(128, np.uint8), "ys": np.array(0.3, np.float32),
             "yz": np.array(90, np.uint8)}
    _check(helper.make_node("QLinearMatMul", ["x", "as", "az", "b", "bs", "bz", "ys", "yz"], ["y"]), a, inits,
           TensorProto.UINT8)


def test_uint16_zero_points_compile(tmp_path):
    """quantize_static(activation_type=QUInt16) writes uint16 zero points, which the padding
    analysis read with a min() torch has no uint16 kernel for (a raw NotImplementedError)."""
    import onnx
    import onnxruntime as ort
    import graphmode
    nodes = [helper.make_node("QuantizeLinear", ["x", "sc", "zp"], ["q"]),
             helper.make_node("DequantizeLinear", ["q", "sc", "zp"], ["y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4])],
                          [numpy_helper.from_array(np.array(0.5, np.float32), "sc"),
                           numpy_helper.from_array(np.array(32768, np.uint16), "zp")])
    path = tmp_path / "u16.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)]), path)
    x = np.array([[0.25, 0.75, -3.0, 1e6], [1.0, -1e6, 0.0, 7.3]], np.float32)
    want = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    assert np.array_equal(graphmode.compile(str(path))(x=torch.from_numpy(x)).numpy(), want)


@pytest.mark.parametrize("tp", ["INT4", "UINT4"])
def test_4bit_qdq_weights_dequantize_exactly(tp):
    """INT4 / UINT4 initializers (4-bit QDQ weights, blocked or per axis, with 4-bit zero points)
    were refused as a dtype graphmode lacks: they are read one value a byte, and the block
    dequantization then matmul equals onnx's reference evaluator."""
    rng = np.random.default_rng(4)
    signed = tp == "INT4"
    lo, hi = (-8, 8) if signed else (0, 16)
    k, n, block = 8, 3, 4
    w = helper.make_tensor("w", getattr(TensorProto, tp), [k, n], rng.integers(lo, hi, (k, n)).flatten().tolist())
    z = helper.make_tensor("z", getattr(TensorProto, tp), [k // block, n],
                           rng.integers(lo, hi, (k // block, n)).flatten().tolist())
    s = numpy_helper.from_array(rng.random((k // block, n)).astype(np.float32), "s")
    g = helper.make_graph([helper.make_node("DequantizeLinear", ["w", "s", "z"], ["wf"], axis=0, block_size=block),
                           helper.make_node("MatMul", ["x", "wf"], ["y"])], "q4",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, k])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, n])], [w, s, z])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
    x = rng.standard_normal((2, k)).astype(np.float32)
    want = ReferenceEvaluator(model).run(None, {"x": x})[0]
    graph, _ = import_onnx(model)
    got = interpret(graph, {graph.inputs[0]: torch.from_numpy(x)})[graph.outputs[0]].numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
