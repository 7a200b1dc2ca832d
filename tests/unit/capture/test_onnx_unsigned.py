"""ONNX arithmetic on u16/u32/u64, which torch has almost no kernels for: computed on int64 and
cast back, exact against numpy, values above 2**63 included."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from onnx import TensorProto, helper

from graphmode.capture.onnx import import_onnx
from graphmode.errors import CaptureError
from graphmode.ir.interpreter import interpret

ONNX_T = {np.uint16: TensorProto.UINT16, np.uint32: TensorProto.UINT32, np.uint64: TensorProto.UINT64}
# each unsigned type and the signed type of its width (torch reads numpy's unsigned arrays through it)
PAIRS = {np.uint16: (np.int16, torch.int16, torch.uint16), np.uint32: (np.int32, torch.int32, torch.uint32),
         np.uint64: (np.int64, torch.int64, torch.uint64)}


def _to_torch(a: np.ndarray) -> torch.Tensor:
    signed, _, unsigned = PAIRS[a.dtype.type]
    return torch.from_numpy(a.view(signed)).view(unsigned)


def _to_numpy(t: torch.Tensor, dt) -> np.ndarray:
    if t.dtype == torch.bool:
        return t.numpy()
    return t.view(PAIRS[dt][1]).numpy().view(dt)


def _run(op, a, b, out_type=None):
    t = ONNX_T[a.dtype.type]
    g = helper.make_graph([helper.make_node(op, ["a", "b"], ["y"])], "g",
                          [helper.make_tensor_value_info("a", t, list(a.shape)),
                           helper.make_tensor_value_info("b", t, list(b.shape))],
                          [helper.make_tensor_value_info("y", out_type or t, list(a.shape))])
    graph, _ = import_onnx(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))
    y = interpret(graph, dict(zip(graph.inputs, (_to_torch(a), _to_torch(b)))))[graph.outputs[0]]
    return _to_numpy(y, a.dtype.type)


@pytest.mark.parametrize("dt", [np.uint16, np.uint32, np.uint64])
def test_arithmetic_wraps_and_orders_like_numpy(dt):
    top = np.iinfo(dt).max
    a = np.array([0, 1, top, top - 5, 7], dtype=dt)
    b = np.array([1, top, 2, top, 7], dtype=dt)
    with np.errstate(over="ignore"):
        for op, ref in (("Add", a + b), ("Sub", a - b), ("Mul", a * b), ("Max", np.maximum(a, b)),
                        ("Min", np.minimum(a, b))):
            assert np.array_equal(_run(op, a, b), ref), op
    for op, ref in (("Greater", a > b), ("Less", a < b), ("Equal", a == b)):
        assert np.array_equal(_run(op, a, b, TensorProto.BOOL), ref), op


def test_uint64_division_is_refused_by_name():
    a = np.array([4, 9], dtype=np.uint64)
    with pytest.raises(CaptureError, match="remainder on uint64 values is not supported"):
        _run("Mod", a, a, None)


@pytest.mark.parametrize("elem", [TensorProto.UINT8, TensorProto.INT8])
def test_sample_inputs_of_an_8_bit_input_stay_within_its_dtype(tmp_path, elem):
    """`graphmode run` / `verify` of a file with a uint8 input crashed with a raw traceback: the
    sample ints were drawn below 1000, which a uint8 cannot hold."""
    import onnx

    from graphmode.capture.spec import load_onnx_spec
    x = helper.make_tensor_value_info("x", elem, ["batch", 4])
    y = helper.make_tensor_value_info("y", elem, ["batch", 4])
    path = tmp_path / "abs8.onnx"
    onnx.save(helper.make_model(helper.make_graph([helper.make_node("Abs", ["x"], ["y"])], "g", [x], [y]),
                                opset_imports=[helper.make_opsetid("", 17)]), str(path))
    got = load_onnx_spec(path).make_inputs({"batch": 3})["x"]
    assert got.shape == (3, 4) and got.dtype in (torch.uint8, torch.int8) and int(got.max()) <= 127 + 128 * (
        got.dtype == torch.uint8)
