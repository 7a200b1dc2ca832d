"""Models written for opsets outside 11..22: read as is when every node means the same at a known
opset (decided per node from the op schemas), upgraded with onnx's version converter when an old
node does not, refused naming the node otherwise."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from onnx import TensorProto, helper

from graphmode.capture.onnx import import_onnx
from graphmode.capture.onnx.opsets import bring_in, node_span
from graphmode.errors import CaptureError
from graphmode.ir.interpreter import interpret

F = TensorProto.FLOAT


def _model(node, shape, opset, out_shape=None):
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", F, shape)],
                          [helper.make_tensor_value_info("y", F, out_shape or shape)])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


def _run(m, x):
    g, _ = import_onnx(m)
    return interpret(g, {g.inputs[0]: x})[g.outputs[0]]


def test_type_only_bumps_read_as_known():
    x = torch.randn(2, 3)
    for opset in (7, 9, 24, 28):
        assert torch.equal(_run(_model(helper.make_node("Relu", ["x"], ["y"]), [2, 3], opset), x), torch.relu(x))
    assert node_span(helper.make_node("Relu", ["x"], ["y"]), 28)[0] <= 14


def test_softmax_at_a_new_opset_keeps_the_opset_13_axis():
    x = torch.randn(2, 3, 4)
    y = _run(_model(helper.make_node("Softmax", ["x"], ["y"]), [2, 3, 4], 28), x)
    assert torch.allclose(y, torch.softmax(x, -1))


def test_hardmax_before_opset_13_reads_its_axis_over_the_input_coerced_to_2d():
    """Hardmax-11 (axis 1 by default) takes one maximum over all the trailing axes flattened,
    first one on ties, as ONNX Runtime does; it was refused."""
    x = torch.randn(2, 3, 4)
    x[1] = 0.0                                                   # a tie: the first position wins
    for axis, shape in ((1, (2, 12)), (0, (1, 24)), (2, (6, 4))):
        y = _run(_model(helper.make_node("Hardmax", ["x"], ["y"], axis=axis), [2, 3, 4], 11), x)
        flat = x.reshape(shape)
        want = torch.nn.functional.one_hot(flat.argmax(1), shape[1]).float().reshape(2, 3, 4)
        assert torch.equal(y, want), axis
    default = _run(_model(helper.make_node("Hardmax", ["x"], ["y"]), [2, 3, 4], 11), x)
    assert torch.equal(default, torch.nn.functional.one_hot(x.reshape(2, 12).argmax(1), 12).float().reshape(2, 3, 4))


def test_an_old_node_that_differs_is_converted():
    x = torch.randn(5) * 3
    m = _model(helper.make_node("Clip", ["x"], ["y"], min=-1.0, max=0.5), [5], 9)   # bounds were attributes
    assert torch.equal(_run(m, x), x.clamp(-1.0, 0.5))
    converted, written = bring_in(m, "clip9")
    assert written == 9 and converted.opset_import[0].version == 11


def test_a_node_using_a_newer_definition_is_refused_by_name():
    m = _model(helper.make_node("Cast", ["x"], ["y"], to=F, round_mode="up", name="c0"), [3], 24)
    with pytest.raises(CaptureError, match=r"#0 Cast 'c0' \(as of opset 24\)"):
        import_onnx(m)
    ok = _model(helper.make_node("Cast", ["x"], ["y"], to=F), [3], 24)   # round_mode not used: same as Cast-21
    x = torch.randn(3)
    assert torch.equal(_run(ok, x), x)


def test_old_opsets_convert_and_too_new_ones_are_refused():
    x = torch.randn(2)
    assert torch.equal(_run(_model(helper.make_node("Relu", ["x"], ["y"]), [2], 5), x), x.relu())
    with pytest.raises(CaptureError, match="newer than the installed onnx"):
        import_onnx(_model(helper.make_node("Relu", ["x"], ["y"]), [2], 99))
    assert np.__name__  # numpy imported for the models' helpers


def _add_bias(opset, **attrs):
    """x [2, 3] + b [3] at `opset`: before opset 7 only a node with broadcast=1 may broadcast."""
    b = helper.make_tensor("b", F, [3], [1.0, 2.0, 3.0])
    g = helper.make_graph([helper.make_node("Add", ["x", "b"], ["y"], name="add", **attrs)], "g",
                          [helper.make_tensor_value_info("x", F, [2, 3])],
                          [helper.make_tensor_value_info("y", F, [2, 3])], [b])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


def test_an_old_add_broadcasts_only_where_it_says_so():
    # found by the fuzz sweep: an opset-1 MLP whose bias Add had no broadcast=1 compiled (read at
    # opset 7+, it broadcast) where the model is invalid and ONNX Runtime refuses it
    x = torch.randn(2, 3)
    for opset in (1, 6):
        with pytest.raises(CaptureError, match=r"#0 Add 'add': before opset 7 .* broadcast=1; "
                                               r"they are \[2, 3\] and \[3\]"):
            import_onnx(_add_bias(opset))
        assert torch.allclose(_run(_add_bias(opset, broadcast=1), x), x + torch.tensor([1.0, 2.0, 3.0]))
    assert torch.allclose(_run(_add_bias(7), x), x + torch.tensor([1.0, 2.0, 3.0]))   # opset 7: always broadcasts


def test_an_op_newer_than_the_models_opset_is_read_where_every_node_means_the_same():
    """ONNX Runtime's optimizer writes LayerNormalization (opset 17) into an opset-14 model and
    runs it: read at opset 17, where its other nodes mean what they meant at 14."""
    nodes = [helper.make_node("LayerNormalization", ["x", "s", "b"], ["n"], axis=-1),
             helper.make_node("Relu", ["n"], ["y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8])],
                          [helper.make_tensor("s", TensorProto.FLOAT, [8], np.ones(8)),
                           helper.make_tensor("b", TensorProto.FLOAT, [8], np.zeros(8))])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 14)])
    graph, _ = import_onnx(m)
    x = torch.randn(2, 8)
    got = interpret(graph, {graph.inputs[0]: x})[graph.outputs[0]]
    assert torch.allclose(got, torch.nn.functional.layer_norm(x, (8,)).relu(), atol=1e-5)


def test_nodes_out_of_order_are_sorted_as_onnx_runtime_runs_them():
    """onnxconverter's fp16 pass with keep_io_types appends the input cast after its readers."""
    nodes = [helper.make_node("Relu", ["h"], ["y"]), helper.make_node("Neg", ["x"], ["h"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])])
    graph, _ = import_onnx(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))
    x = torch.tensor([-1.0, 0.5, 2.0])
    assert torch.equal(interpret(graph, {graph.inputs[0]: x})[graph.outputs[0]], (-x).relu())
