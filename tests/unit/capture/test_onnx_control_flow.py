"""ONNX If / Loop / Scan unrolled at import, against onnx's reference evaluator; a condition
computed at run time is refused by name."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from graphmode.capture.onnx import import_onnx
from graphmode.errors import CaptureError
from graphmode.ir.interpreter import interpret

F = TensorProto.FLOAT


def _run(nodes, inputs, outputs, feeds, inits=()):
    m = helper.make_model(helper.make_graph(nodes, "g", inputs, outputs, list(inits)),
                          opset_imports=[helper.make_opsetid("", 18)])
    want = ReferenceEvaluator(m).run(None, feeds)
    graph, _ = import_onnx(m)
    got = interpret(graph, {k: torch.from_numpy(v) for k, v in zip(graph.inputs, feeds.values())})
    for o, w in zip(graph.outputs, want):
        assert np.allclose(got[o].numpy(), w, atol=1e-6)


def test_if_with_a_constant_condition_and_a_nested_if():
    inner = helper.make_graph([helper.make_node("Mul", ["y1", "x"], ["z"])], "inner", [],
                              [helper.make_tensor_value_info("z", F, [3])])
    inner2 = helper.make_graph([helper.make_node("Sub", ["y1", "x"], ["z2"])], "inner2", [],
                               [helper.make_tensor_value_info("z2", F, [3])])
    then = helper.make_graph([helper.make_node("Add", ["x", "x"], ["y1"]),
                              helper.make_node("If", ["c"], ["y"], then_branch=inner, else_branch=inner2)], "then", [],
                             [helper.make_tensor_value_info("y", F, [3])])
    other = helper.make_graph([helper.make_node("Neg", ["x"], ["y"])], "else", [],
                              [helper.make_tensor_value_info("y", F, [3])])
    x = np.arange(3, dtype=np.float32)
    _run([helper.make_node("If", ["c"], ["out"], then_branch=then, else_branch=other)],
         [helper.make_tensor_value_info("x", F, [3])], [helper.make_tensor_value_info("out", F, [3])], {"x": x},
         [numpy_helper.from_array(np.array(True), "c")])


def test_loop_and_scan():
    body = helper.make_graph([helper.make_node("Add", ["acc", "x"], ["acc2"]),
                              helper.make_node("Identity", ["cin"], ["cout"]),
                              helper.make_node("Mul", ["acc2", "acc2"], ["sq"])], "body",
                             [helper.make_tensor_value_info("i", TensorProto.INT64, []),
                              helper.make_tensor_value_info("cin", TensorProto.BOOL, []),
                              helper.make_tensor_value_info("acc", F, [2])],
                             [helper.make_tensor_value_info("cout", TensorProto.BOOL, []),
                              helper.make_tensor_value_info("acc2", F, [2]), helper.make_tensor_value_info("sq", F, [2])])
    x = np.array([0.5, -1.0], np.float32)
    _run([helper.make_node("Loop", ["M", "go", "x"], ["final", "squares"], body=body)],
         [helper.make_tensor_value_info("x", F, [2])],
         [helper.make_tensor_value_info("final", F, [2]), helper.make_tensor_value_info("squares", F, [4, 2])],
         {"x": x}, [numpy_helper.from_array(np.array(4, np.int64), "M"), numpy_helper.from_array(np.array(True), "go")])
    sbody = helper.make_graph([helper.make_node("Add", ["s", "e"], ["s2"]), helper.make_node("Identity", ["s2"], ["o"])],
                              "sbody", [helper.make_tensor_value_info("s", F, [3]), helper.make_tensor_value_info("e", F, [3])],
                              [helper.make_tensor_value_info("s2", F, [3]), helper.make_tensor_value_info("o", F, [3])])
    seq = np.random.default_rng(0).standard_normal((5, 3)).astype(np.float32)
    _run([helper.make_node("Scan", ["init", "seq"], ["last", "all"], body=sbody, num_scan_inputs=1)],
         [helper.make_tensor_value_info("init", F, [3]), helper.make_tensor_value_info("seq", F, [5, 3])],
         [helper.make_tensor_value_info("last", F, [3]), helper.make_tensor_value_info("all", F, [5, 3])],
         {"init": np.ones(3, np.float32), "seq": seq})


def test_run_time_condition_is_refused():
    br = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "b", [],
                           [helper.make_tensor_value_info("y", F, [3])])
    g = helper.make_graph([helper.make_node("If", ["c"], ["out"], then_branch=br, else_branch=br, name="branch")], "g",
                          [helper.make_tensor_value_info("x", F, [3]), helper.make_tensor_value_info("c", TensorProto.BOOL, [])],
                          [helper.make_tensor_value_info("out", F, [3])])
    with pytest.raises(CaptureError, match="If condition .* is computed from run-time tensor data") as e:
        import_onnx(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)]))
    assert "inputs[].value" in e.value.fix


def test_initializers_of_a_branch_and_of_a_loop_body_are_read_and_shared_across_iterations():
    """A branch's or a body's own initializers were 'used before defined' (ONNX Runtime runs such
    a file); an unrolled body reads one constant, not one copy per iteration."""
    from graphmode.capture.onnx.importer import KNOWN_LIMIT
    n = KNOWN_LIMIT + 1
    big = numpy_helper.from_array(np.linspace(-1, 1, n, dtype=np.float32), "w")
    body = helper.make_graph([helper.make_node("Mul", ["acc", "w"], ["m"]), helper.make_node("Add", ["m", "one"], ["acc2"]),
                              helper.make_node("Identity", ["cin"], ["cout"])], "body",
                             [helper.make_tensor_value_info("i", TensorProto.INT64, []),
                              helper.make_tensor_value_info("cin", TensorProto.BOOL, []),
                              helper.make_tensor_value_info("acc", F, [n])],
                             [helper.make_tensor_value_info("cout", TensorProto.BOOL, []),
                              helper.make_tensor_value_info("acc2", F, [n])],
                             [big, numpy_helper.from_array(np.array(0.5, np.float32), "one")])
    then = helper.make_graph([helper.make_node("Sub", ["x", "k"], ["y"])], "then", [],
                             [helper.make_tensor_value_info("y", F, [n])], [numpy_helper.from_array(np.float32(3), "k")])
    other = helper.make_graph([helper.make_node("Neg", ["x"], ["y"])], "else", [], [helper.make_tensor_value_info("y", F, [n])])
    nodes = [helper.make_node("If", ["c"], ["b"], then_branch=then, else_branch=other),
             helper.make_node("Loop", ["M", "go", "b"], ["out"], body=body)]
    inits = [numpy_helper.from_array(np.array(True), "c"), numpy_helper.from_array(np.array(3, np.int64), "M"),
             numpy_helper.from_array(np.array(True), "go")]
    x = np.random.default_rng(1).standard_normal(n).astype(np.float32)
    _run(nodes, [helper.make_tensor_value_info("x", F, [n])], [helper.make_tensor_value_info("out", F, [n])],
         {"x": x}, inits)
    m = helper.make_model(helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, [n])],
                                            [helper.make_tensor_value_info("out", F, [n])], inits),
                          opset_imports=[helper.make_opsetid("", 18)])
    graph, _ = import_onnx(m)
    assert sum(1 for c in graph.constants.values() if c.numel() == n) == 1


def test_an_if_on_a_dim_is_decided_over_the_recipes_range_or_refused_naming_it():
    """`If(batch > 2)` (a Shape -> Gather -> Greater condition) was called run-time data: over a
    range on one side of it the branch is known at import; over one across it, refused saying so."""
    two = numpy_helper.from_array(np.array(2.0, np.float32), "two")
    then = helper.make_graph([helper.make_node("Mul", ["x", "two"], ["t"])], "then", [],
                             [helper.make_tensor_value_info("t", F, ["batch", 4])])
    other = helper.make_graph([helper.make_node("Sub", ["x", "two"], ["e"])], "else", [],
                              [helper.make_tensor_value_info("e", F, ["batch", 4])])
    nodes = [helper.make_node("Shape", ["x"], ["sh"]), helper.make_node("Gather", ["sh", "i0"], ["b"], axis=0),
             helper.make_node("Greater", ["b", "k2"], ["cond"]),
             helper.make_node("If", ["cond"], ["y"], then_branch=then, else_branch=other)]
    m = helper.make_model(helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", F, ["batch", 4])],
        [helper.make_tensor_value_info("y", F, ["batch", 4])],
        [two, numpy_helper.from_array(np.array(0, np.int64), "i0"), numpy_helper.from_array(np.array(2, np.int64), "k2")]),
        opset_imports=[helper.make_opsetid("", 18)])
    for lo, hi, want in ((3, 8, "mul"), (1, 2, "sub")):
        graph, _ = import_onnx(m, dims={"batch": (lo, hi)})
        assert [n.op for n in graph.nodes] == [want]
    with pytest.raises(CaptureError, match=r"If condition .* the recipe's ranges leave it open: Greater\(batch, 2\): "
                                           r"cannot decide .*batch.* \(batch in \[1, 8\]\)"):
        import_onnx(m, dims={"batch": (1, 8)})


def test_a_loop_over_a_dynamic_dim_is_refused_saying_to_make_it_static():
    """Trial AB: a Loop once per batch row (the classic exporter's nn.EmbeddingBag) was told to
    declare its trip count constant with inputs[].value, which cannot name a dim."""
    body = helper.make_graph([helper.make_node("Identity", ["cin"], ["cout"]),
                              helper.make_node("Add", ["acc", "one"], ["acc2"])],
                             "body", [helper.make_tensor_value_info("i", TensorProto.INT64, []),
                                      helper.make_tensor_value_info("cin", TensorProto.BOOL, []),
                                      helper.make_tensor_value_info("acc", F, [4])],
                             [helper.make_tensor_value_info("cout", TensorProto.BOOL, []),
                              helper.make_tensor_value_info("acc2", F, [4])])
    nodes = [helper.make_node("Shape", ["x"], ["sh"]), helper.make_node("Gather", ["sh", "i0"], ["b"], axis=0),
             helper.make_node("Loop", ["b", "go", "z"], ["y"], body=body)]

    def model(batch):
        return helper.make_model(helper.make_graph(
            nodes, "g", [helper.make_tensor_value_info("x", F, [batch, 4])],
            [helper.make_tensor_value_info("y", F, [4])],
            [numpy_helper.from_array(np.array(0, np.int64), "i0"), numpy_helper.from_array(np.array(True), "go"),
             numpy_helper.from_array(np.zeros(4, np.float32), "z"),
             numpy_helper.from_array(np.array(1.0, np.float32), "one")]), opset_imports=[helper.make_opsetid("", 18)])
    with pytest.raises(CaptureError, match="Loop trip count follows the dims batch: graphmode unrolls") as e:
        import_onnx(model("batch"), dims={"batch": (1, 8)})
    assert "inputs[].shape" in e.value.fix and "inputs[].value" not in e.value.fix
    _run(nodes, [helper.make_tensor_value_info("x", F, [3, 4])], [helper.make_tensor_value_info("y", F, [4])],
         {"x": np.zeros((3, 4), np.float32)}, model(3).graph.initializer)          # static: unrolled 3 times
