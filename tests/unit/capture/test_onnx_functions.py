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


def _against_ort(node, inputs, outputs, feeds: dict, opset: int):
    import onnxruntime as ort
    from onnx import shape_inference
    m = helper.make_model(helper.make_graph([node], "g", inputs, [helper.make_value_info(o, helper.TypeProto())
                                                                   for o in outputs]),
                          opset_imports=[helper.make_opsetid("", opset)])
    inferred = shape_inference.infer_shapes(m)
    del m.graph.output[:]
    m.graph.output.extend(inferred.graph.output)
    want = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {k: v.numpy() for k, v in feeds.items()})
    graph, _ = import_onnx(m)
    got = interpret(graph, dict(zip(graph.inputs, feeds.values())))
    for out, w in zip(graph.outputs, want):
        assert torch.allclose(got[out], torch.from_numpy(w), rtol=1e-4, atol=1e-5), out
    return graph


def test_body_built_here_where_the_inliner_cannot_type_an_omitted_input():
    """onnx's inliner fails on a node that leaves an optional input out (CausalConvWithState
    without past_state): the body is built for the node's types here instead."""
    torch.manual_seed(0)
    x, w = torch.randn(2, 4, 6), torch.randn(4, 1, 3)
    node = helper.make_node("CausalConvWithState", ["x", "w", "", ""], ["y", "state"], activation="silu")
    _against_ort(node, [helper.make_tensor_value_info("x", FL, [2, 4, 6]), helper.make_tensor_value_info("w", FL, [4, 1, 3])],
                 ["y", "state"], {"x": x, "w": w}, opset=27)


def test_built_body_with_a_scan_subgraph():
    """LinearAttention's gated rule is a Scan over the steps: the subgraph's own names are
    renamed apart from the model's, what it reads from the body keeps the body's names."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 16) for _ in range(3))
    decay = -torch.rand(2, 4, 2)
    node = helper.make_node("LinearAttention", ["q", "k", "v", "", "decay"], ["y", "state"], q_num_heads=2,
                            kv_num_heads=2, update_rule="gated")
    ins = [helper.make_tensor_value_info(n, FL, [2, 4, 16]) for n in "qkv"]
    ins.append(helper.make_tensor_value_info("decay", FL, [2, 4, 2]))
    graph = _against_ort(node, ins, ["y", "state"], {"q": q, "k": k, "v": v, "decay": decay}, opset=27)
    assert all(n.op != "LinearAttention" for n in graph.nodes)


def test_a_function_the_model_defines_is_inlined():
    """onnxscript writes a helper as a model-local function (domain 'this'): its body is imported
    (it was refused as an unknown op type)."""
    from onnx import helper as h
    fn = h.make_function("this", "gated", ["x"], ["y"], [h.make_node("Sigmoid", ["x"], ["s"]),
                                                           h.make_node("Mul", ["x", "s"], ["y"])],
                         [h.make_opsetid("", 18)])
    g = h.make_graph([h.make_node("gated", ["x"], ["g"], domain="this"), h.make_node("Add", ["g", "x"], ["y"])], "g",
                     [h.make_tensor_value_info("x", FL, [3, 4])], [h.make_tensor_value_info("y", FL, [3, 4])])
    m = h.make_model(g, opset_imports=[h.make_opsetid("", 18), h.make_opsetid("this", 1)], functions=[fn])
    graph, _ = import_onnx(m)
    x = torch.randn(3, 4)
    assert torch.allclose(interpret(graph, {graph.inputs[0]: x})[graph.outputs[0]], x * torch.sigmoid(x) + x,
                          atol=1e-6)
