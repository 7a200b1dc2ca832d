"""ONNX models that take shape-like data as inputs (Reshape's shape, ReduceSum's axes): the recipe
declares them constant (`inputs[].value`), the model compiles for that value, and a call with
another value is a contract violation. Also scalar (rank-0) inputs."""
from __future__ import annotations

import warnings

import onnx
import pytest
import torch
from onnx import TensorProto, helper

import graphmode
from graphmode.errors import CaptureError, ContractViolation

F, I64 = TensorProto.FLOAT, TensorProto.INT64


def _save(tmp_path, nodes, inputs, outputs, name="m"):
    g = helper.make_graph(nodes, name, inputs, outputs)
    path = tmp_path / f"{name}.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)]), path)
    return str(path)


def _compile(path, recipe, tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return graphmode.compile(path, recipe, cache_dir=tmp_path / "cache")


def test_reshape_and_reduce_with_constant_shape_like_inputs(tmp_path):
    path = _save(tmp_path, [helper.make_node("Reshape", ["x", "shape"], ["r"]),
                            helper.make_node("ReduceSum", ["r", "axes"], ["y"], keepdims=0)],
                 [helper.make_tensor_value_info("x", F, [2, 6]), helper.make_tensor_value_info("shape", I64, [3]),
                  helper.make_tensor_value_info("axes", I64, [1])],
                 [helper.make_tensor_value_info("y", F, [2, 3])])
    recipe = {"version": 1, "name": "c", "dims": {"b": 2},
              "inputs": [{"name": "x", "dtype": "f32", "shape": ["b", 6]},
                         {"name": "shape", "dtype": "i64", "shape": [3], "value": [2, 3, 2]},
                         {"name": "axes", "dtype": "i64", "shape": [1], "value": [-1]}]}
    cm = _compile(path, recipe, tmp_path)
    x = torch.randn(2, 6)
    y = cm(x=x, shape=torch.tensor([2, 3, 2]), axes=torch.tensor([-1]))
    assert torch.allclose(y, x.reshape(2, 3, 2).sum(-1))
    with pytest.raises(ContractViolation, match="inputs.shape.value"):
        cm(x=x, shape=torch.tensor([2, 2, 3]), axes=torch.tensor([-1]))
    without = dict(recipe, inputs=[recipe["inputs"][0], {"name": "shape", "dtype": "i64", "shape": [3]},
                                   recipe["inputs"][2]])
    with pytest.raises(CaptureError, match="is computed from run-time tensor data"):
        _compile(path, without, tmp_path)


def test_scalar_input(tmp_path):
    path = _save(tmp_path, [helper.make_node("Mul", ["x", "s"], ["y"])],
                 [helper.make_tensor_value_info("x", F, [3]), helper.make_tensor_value_info("s", F, [])],
                 [helper.make_tensor_value_info("y", F, [3])])
    cm = _compile(path, {"version": 1, "name": "s", "dims": {"n": 3},
                         "inputs": [{"name": "x", "dtype": "f32", "shape": ["n"]},
                                    {"name": "s", "dtype": "f32", "shape": []}]}, tmp_path)
    x = torch.randn(3)
    assert torch.allclose(cm(x=x, s=torch.tensor(2.5)), x * 2.5)


def test_a_fully_static_model_compiles_from_a_recipe_without_dims(tmp_path):
    path = _save(tmp_path, [helper.make_node("Range", ["start", "limit", "delta"], ["r"]),
                            helper.make_node("Mul", ["r", "x"], ["y"])],
                 [helper.make_tensor_value_info("start", F, []), helper.make_tensor_value_info("limit", F, []),
                  helper.make_tensor_value_info("delta", F, []), helper.make_tensor_value_info("x", F, [4])],
                 [helper.make_tensor_value_info("y", F, [4])])
    recipe = {"version": 1, "name": "static",
              "inputs": [{"name": "start", "dtype": "f32", "shape": [], "value": 1.0},
                         {"name": "limit", "dtype": "f32", "shape": [], "value": 9.0},
                         {"name": "delta", "dtype": "f32", "shape": [], "value": 2.0},
                         {"name": "x", "dtype": "f32", "shape": [4]}]}
    cm = _compile(path, recipe, tmp_path)
    x = torch.randn(4)
    y = cm(start=torch.tensor(1.0), limit=torch.tensor(9.0), delta=torch.tensor(2.0), x=x)
    assert torch.allclose(y, torch.arange(1.0, 9.0, 2.0) * x)
    with pytest.raises(ContractViolation, match="inputs.x"):
        cm(start=torch.tensor(1.0), limit=torch.tensor(9.0), delta=torch.tensor(2.0), x=torch.randn(5))


def test_an_initializer_listed_as_an_input_is_a_constant_and_a_value_for_it_is_refused_saying_so(tmp_path):
    """Old exporters list initializers among the graph inputs too (ONNX Runtime lets a caller
    override them). graphmode folds them as constants: a call that gives one is refused naming
    it as the file's initializer, not as an unknown input."""
    g = helper.make_graph([helper.make_node("Mul", ["x", "w"], ["y"])], "m",
                          [helper.make_tensor_value_info("x", F, ["batch", 4]), helper.make_tensor_value_info("w", F, [4])],
                          [helper.make_tensor_value_info("y", F, ["batch", 4])],
                          [helper.make_tensor("w", F, [4], [1.0, 2.0, 3.0, 4.0])])
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)]), path)
    cm = _compile(str(path), None, tmp_path)
    x = torch.randn(2, 4)
    assert torch.equal(cm(x=x), x * torch.tensor([1.0, 2.0, 3.0, 4.0]))
    with pytest.raises(ContractViolation, match=r"inputs \['w'\] are initializers of the ONNX file") as e:
        cm(x=x, w=torch.ones(4))
    assert "leave them out" in e.value.fix
