"""What a new user's ONNX files met: a float Range over a dim (the classic exporter's
torch.arange(x.shape[1], dtype=torch.float32)), ops imported through their function body (an
error there names the node of the file, not the body's), graph inputs and outputs without a
shape (ONNX Runtime takes them), and an unnamed axis a MatMul's weight fixes. Each is checked
against ONNX Runtime, or refused naming the node, the value and a fix that works."""
from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import graphmode
from graphmode.capture.onnx import import_onnx, supported_onnx_ops
from graphmode.capture.onnx.functions import body_origins, expand_functions
from graphmode.errors import CaptureError
from graphmode.ir import interpret
from onnx_compile import compile_onnx

ort = pytest.importorskip("onnxruntime")
F, I64 = TensorProto.FLOAT, TensorProto.INT64


def _save(path, nodes, inputs, outputs, inits=()):
    g = helper.make_graph(nodes, "m", inputs, outputs, list(inits))
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return str(path)


def _check(cm, path, feeds):
    sess = ort.InferenceSession(path)
    for x in feeds:
        out = cm(x)
        out = out[0] if isinstance(out, (list, tuple)) else out
        np.testing.assert_allclose(out.numpy(), sess.run(None, {"x": x.numpy()})[0], rtol=1e-6, atol=1e-6)
        assert cm.last_path["path"] == "graph"          # compiled, not handed to ONNX Runtime


# ---- a float Range over a dim


class FloatArange(torch.nn.Module):
    def forward(self, x):
        return x + torch.arange(x.shape[1], dtype=torch.float32)


def test_a_float_range_over_a_dim_compiles_and_matches_onnxruntime(tmp_path):
    path = str(tmp_path / "arange.onnx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(FloatArange(), (torch.rand(2, 5),), path, dynamo=False, input_names=["x"],
                          dynamic_axes={"x": {0: "b", 1: "s"}}, opset_version=17)
    assert "Range" in {n.op_type for n in onnx.load(path).graph.node}
    cm = compile_onnx(path, tmp_path / "cache")
    _check(cm, path, [torch.rand(1, 1), torch.rand(2, 5), torch.rand(3, 17), torch.rand(2, 64)])


def _range_model(path, start: float, delta: float, scale: float | None = None, add: bool = True):
    """x + Range(start, Cast(x.shape[1]) [* scale], delta), as floats (the Range alone without `add`)."""
    nodes = [helper.make_node("Shape", ["x"], ["sh"]), helper.make_node("Gather", ["sh", "one"], ["n"]),
             helper.make_node("Cast", ["n"], ["nf"], to=F)]
    lim = "nf"
    if scale is not None:
        nodes.append(helper.make_node("Mul", ["nf", "scale"], ["lim"]))
        lim = "lim"
    nodes.append(helper.make_node("Range", ["start", lim, "delta"], ["r" if add else "y"]))
    if add:
        nodes.append(helper.make_node("Add", ["x", "r"], ["y"]))
    inits = [helper.make_tensor("one", I64, [], [1]), helper.make_tensor("start", F, [], [start]),
             helper.make_tensor("delta", F, [], [delta]), helper.make_tensor("scale", F, [], [scale or 1.0])]
    return _save(path, nodes, [helper.make_tensor_value_info("x", F, ["b", "s"])],
                 [helper.make_tensor_value_info("y", F, ["b", "s"] if add else [None])], inits)


def test_a_whole_numbered_float_range_with_another_start_and_step_matches_onnxruntime(tmp_path):
    path = _range_model(tmp_path / "r2.onnx", start=-3.0, delta=2.0, add=False)
    g, _ = import_onnx(path)
    sess = ort.InferenceSession(path)
    for s in (1, 2, 7, 30):
        x = torch.zeros(1, s)
        want = sess.run(None, {"x": x.numpy()})[0]
        got = interpret(g, {"x": x})[g.outputs[0]]
        assert got.dtype == torch.float32 and np.array_equal(got.numpy(), want)


@pytest.mark.parametrize("start,delta,scale", [(0.0, 0.5, None), (0.5, 1.0, None), (0.0, 1.0, 0.5)])
def test_a_float_range_graphmode_cannot_count_exactly_is_refused_naming_the_range(tmp_path, start, delta, scale):
    path = _range_model(tmp_path / "r.onnx", start, delta, scale)
    with pytest.raises(CaptureError) as e:
        import_onnx(path)
    assert "Range 'r'" in e.value.where and "Loop" not in str(e.value)
    assert "int64" in e.value.fix


# ---- errors inside a function body name the file's node


def test_an_op_whose_body_graphmode_cannot_import_is_named_as_the_file_has_it(tmp_path):
    path = _save(tmp_path / "bern.onnx", [helper.make_node("Bernoulli", ["x"], ["y"], name="drop")],
                 [helper.make_tensor_value_info("x", F, ["b", 4])], [helper.make_tensor_value_info("y", F, ["b", 4])])
    with pytest.raises(CaptureError) as e:
        import_onnx(path)
    text = str(e.value)
    assert "Bernoulli x1 (drop: its function body uses RandomUniformLike)" in text


def test_body_origins_map_every_body_node_to_the_node_it_expands():
    nodes = [helper.make_node("Relu", ["x"], ["a"]), helper.make_node("Bernoulli", ["a"], ["b"], name="one"),
             helper.make_node("Bernoulli", ["b"], ["c"], name="two"), helper.make_node("Relu", ["c"], ["y"])]
    g = helper.make_graph(nodes, "m", [helper.make_tensor_value_info("x", F, [2])],
                          [helper.make_tensor_value_info("y", F, [2])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    e = expand_functions(m, set(supported_onnx_ops()))
    origins = body_origins(m, e)
    body = [n for n in e.graph.node if n.op_type != "Relu"]
    assert body and all(n.output[0] in origins for n in body)
    assert {origins["b"][1].name, origins["c"][1].name} == {"one", "two"}
    assert origins["b"][0] == 1 and origins["c"][0] == 2
    assert all(origins[n.output[0]][1].name == ("one" if i < len(body) // 2 else "two") for i, n in enumerate(body))


# ---- inputs and outputs without a shape


def _matmul_model(path, x_shape, y_shape):
    w = numpy_helper.from_array(np.random.RandomState(0).randn(4, 5).astype(np.float32), "W")
    ty = (lambda s: helper.make_tensor_type_proto(F, s))
    return _save(path, [helper.make_node("MatMul", ["x", "W"], ["y"])], [helper.make_value_info("x", ty(x_shape))],
                 [helper.make_value_info("y", ty(y_shape))], [w])


RECIPE = {"version": 1, "name": "mm", "inputs": [{"name": "x", "dtype": "f32", "shape": ["b", 4]}],
          "dims": {"b": {"min": 1, "max": 8, "buckets": [2, 8]}}}


@pytest.mark.parametrize("y_shape", [[None, 5], None])
def test_an_input_without_a_shape_takes_the_recipes(tmp_path, y_shape):
    path = _matmul_model(tmp_path / "noshape.onnx", None, y_shape)
    assert not onnx.load(path).graph.input[0].type.tensor_type.HasField("shape")
    _check(compile_onnx(path, tmp_path / "cache", RECIPE), path, [torch.randn(3, 4), torch.randn(8, 4), torch.randn(1, 4)])


def test_without_a_recipe_an_input_without_a_shape_is_refused_saying_a_recipe_must_declare_it(tmp_path):
    path = _matmul_model(tmp_path / "noshape.onnx", None, [None, 5])
    with pytest.raises(CaptureError) as e:
        compile_onnx(path, tmp_path / "cache")
    assert "'x' has no shape" in e.value.message and "inputs[0].shape" in e.value.fix and "recipe" in e.value.fix
    with pytest.raises(CaptureError, match="has no shape") as e:
        import_onnx(path)
    assert "recipe" in e.value.fix


@pytest.mark.parametrize("y_shape", [[None, 5], [None, None]])
def test_an_unnamed_axis_a_weight_fixes_is_refused_naming_the_recipe_field(tmp_path, y_shape):
    path = _matmul_model(tmp_path / "any.onnx", [None, None], y_shape)
    with pytest.raises(CaptureError) as e:
        compile_onnx(path, tmp_path / "cache")
    assert "must be 4" in e.value.message and "MatMul" in e.value.where
    assert "inputs[0].shape[1]" in e.value.fix and "4" in e.value.fix
    _check(compile_onnx(path, tmp_path / "cache", RECIPE), path, [torch.randn(3, 4), torch.randn(6, 4)])
