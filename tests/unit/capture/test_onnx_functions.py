"""ONNX ops imported through their schema's function body: an op with no converter (Celu,
MeanVarianceNormalization with its default axes), one whose converter refuses a node
(LayerNormalization's Mean output), and a context-dependent body (SoftmaxCrossEntropyLoss)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from onnx import TensorProto, helper

from graphmode.capture.onnx import import_onnx
from graphmode.ir.interpreter import interpret

FL, I64 = TensorProto.FLOAT, TensorProto.INT64


def _run(nodes, inputs, outputs, feeds, opset=18):
    g = helper.make_graph(nodes, "g", inputs, outputs)
    graph, rep = import_onnx(helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)]))
    out = interpret(graph, dict(zip(graph.inputs, feeds)))
    return [out[o] for o in graph.outputs], graph


def test_body_of_an_op_without_converter_uses_the_schema_defaults():
    x = torch.randn(2, 3, 4, 5)
    (y,), graph = _run([helper.make_node("MeanVarianceNormalization", ["x"], ["y"])],
                       [helper.make_tensor_value_info("x", FL, [2, 3, 4, 5])],
                       [helper.make_tensor_value_info("y", FL, [2, 3, 4, 5])], [x])
    mean = x.mean((0, 2, 3), keepdim=True)                 # default axes [0, 2, 3], not every axis
    std = ((x * x).mean((0, 2, 3), keepdim=True) - mean * mean).sqrt()
    assert torch.allclose(y, (x - mean) / (std + 1e-9), atol=1e-5)
    (y,), _ = _run([helper.make_node("Celu", ["x"], ["y"], alpha=2.0)], [helper.make_tensor_value_info("x", FL, [7])],
                   [helper.make_tensor_value_info("y", FL, [7])], [x.reshape(-1)[:7]])
    assert torch.allclose(y, F.celu(x.reshape(-1)[:7], 2.0), atol=1e-6)


def test_refused_node_falls_back_to_the_body():
    x = torch.randn(3, 4)
    (y, mean), _ = _run([helper.make_node("LayerNormalization", ["x", "s"], ["y", "m"], axis=-1)],
                        [helper.make_tensor_value_info("x", FL, [3, 4]), helper.make_tensor_value_info("s", FL, [4])],
                        [helper.make_tensor_value_info("y", FL, [3, 4]), helper.make_tensor_value_info("m", FL, [3, 1])],
                        [x, torch.ones(4)])
    assert torch.allclose(mean, x.mean(-1, keepdim=True), atol=1e-6)
    assert torch.allclose(y, F.layer_norm(x, (4,)), atol=1e-5)


def test_context_dependent_body():
    x, t = torch.randn(5, 3), torch.tensor([0, 2, 1, 1, 0])
    (loss,), _ = _run([helper.make_node("SoftmaxCrossEntropyLoss", ["x", "t"], ["loss"], reduction="mean")],
                      [helper.make_tensor_value_info("x", FL, [5, 3]), helper.make_tensor_value_info("t", I64, [5])],
                      [helper.make_tensor_value_info("loss", FL, [])], [x, t])
    assert torch.allclose(loss, F.cross_entropy(x, t), atol=1e-6)
