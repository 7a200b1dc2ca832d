"""Dims an ONNX file declares as expressions (dynamo writes value_info dims such as `Min(32, s27)`):
the importer reads them over its own dims, passes over one that holds only on part of the dims'
range (the IR's slice of a 32-row table by seq assumes seq <= 32, and the index analysis bounds
seq by it), and still refuses a declaration that agrees with the importer nowhere. A draft of
such a model takes seq up to 32, matches ONNX Runtime inside and refuses a request past it."""
from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest
import sympy
import torch
from onnx import TensorProto, helper, numpy_helper

import graphmode
from graphmode.capture.onnx import import_onnx
from graphmode.capture.onnx.values import agrees_somewhere, declared_expr
from graphmode.errors import CaptureError, ContractViolation, GraphmodeError
from graphmode.ir.types import sym
from onnx_compile import compile_onnx

ort = pytest.importorskip("onnxruntime")
F, I64 = TensorProto.FLOAT, TensorProto.INT64


def _pos_model(path, declared: str = "Min(32, s27)"):
    """forward(x) = x @ W + pos[:x.shape[1]], pos of 32 rows: dynamo's graph and value_info."""
    rng = np.random.RandomState(0)
    inits = [numpy_helper.from_array(rng.randn(16, 16).astype(np.float32), "W"),
             numpy_helper.from_array(rng.randn(32, 16).astype(np.float32), "pos"),
             numpy_helper.from_array(np.array([0], np.int64), "zero"),
             numpy_helper.from_array(np.array([1], np.int64), "one")]
    nodes = [helper.make_node("Shape", ["x"], ["n"], start=1, end=2),
             helper.make_node("MatMul", ["x", "W"], ["mm"]),
             helper.make_node("Slice", ["pos", "zero", "n", "zero", "one"], ["slice_1"]),
             helper.make_node("Add", ["mm", "slice_1"], ["y"])]
    g = helper.make_graph(nodes, "pos", [helper.make_tensor_value_info("x", F, ["s77", "s27", 16])],
                          [helper.make_tensor_value_info("y", F, ["s77", "s27", 16])], inits,
                          value_info=[helper.make_tensor_value_info("slice_1", F, [declared, 16]),
                                      helper.make_tensor_value_info("mm", F, ["s77", "s27", 16])])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return str(path)


def _matches_ort(cm, path, shapes):
    sess = ort.InferenceSession(path)
    for b, s in shapes:
        x = torch.randn(b, s, 16)
        out = cm(x)
        out = out[0] if isinstance(out, (list, tuple)) else out
        np.testing.assert_allclose(out.numpy(), sess.run(None, {"x": x.numpy()})[0], rtol=1e-5, atol=1e-5)
        assert cm.last_path["path"] == "graph"          # compiled, not handed to ONNX Runtime


@pytest.mark.parametrize("text,want", [
    ("Min(32, s27)", sympy.Min(32, sym("seq"))),
    ("Max(1, s27)", sym("seq")),
    ("(s27//2)", sympy.floor(sym("seq") / 2)),
    ("FloorDiv(s27, 2)", sympy.floor(sym("seq") / 2)),
    ("CeilToInt(IntTrueDiv(s27, 2))", sympy.ceiling(sym("seq") / 2)),
    ("PythonMod(s27, 7)", sympy.Mod(sym("seq"), 7)),
    ("2*s27 + s77", 2 * sym("seq") + sym("batch")),
])
def test_dynamos_size_expressions_are_read_over_the_importers_dims(text, want):
    got = declared_expr(text, {"s27": sym("seq"), "s77": sym("batch")})
    assert got is not None and sympy.simplify(sympy.sympify(got) - want) == 0


def test_an_expression_over_names_the_inputs_do_not_define_says_nothing():
    assert declared_expr("Min(32, unk__3)", {"s27": sym("seq")}) is None
    assert declared_expr("s27 +", {"s27": sym("seq")}) is None


def test_agreement_is_decided_over_the_dims_ranges():
    seq = sym("seq")
    assert agrees_somewhere(sympy.Min(32, seq), seq, {"seq": (1, 4096)})
    assert not agrees_somewhere(sympy.Min(32, seq), seq, {"seq": (40, 4096)})
    assert not agrees_somewhere(sympy.Mod(seq, 2) + seq + 100, seq, {"seq": (1, 4096)})


def test_a_draft_takes_the_range_the_model_runs_for_and_matches_onnxruntime(tmp_path):
    path = _pos_model(tmp_path / "pos.onnx")
    cm = compile_onnx(path, tmp_path / "cache")
    assert (cm.recipe.dims["s27"].min, cm.recipe.dims["s27"].max) == (1, 32)
    _matches_ort(cm, path, [(1, 1), (2, 5), (3, 17), (2, 32)])
    with pytest.raises(ContractViolation, match="32 positions"):
        cm(torch.randn(1, 33, 16))
    with pytest.raises(Exception):           # ONNX Runtime cannot run it either
        ort.InferenceSession(path).run(None, {"x": np.zeros((1, 33, 16), np.float32)})


def test_a_recipe_past_the_table_is_refused_naming_the_dim(tmp_path):
    path = _pos_model(tmp_path / "pos.onnx")
    r = {"version": 1, "name": "pos", "inputs": [{"name": "x", "dtype": "f32", "shape": ["batch", "seq", 16]}],
         "dims": {"batch": {"min": 1, "max": 4}, "seq": {"min": 1, "max": 64, "buckets": [16, 64]}}}
    with pytest.raises(GraphmodeError, match="at most 32"):
        compile_onnx(path, tmp_path / "cache", r)
    r["dims"]["seq"] = {"min": 1, "max": 32, "buckets": [8, 32]}
    _matches_ort(compile_onnx(path, tmp_path / "cache", r), path, [(1, 3), (4, 32)])


def test_a_declaration_that_agrees_nowhere_is_still_refused(tmp_path):
    path = _pos_model(tmp_path / "bad.onnx", declared="Mod(s27, 2) + s27 + 100")
    with pytest.raises(CaptureError, match="declares") as e:
        import_onnx(path)
    assert "Slice" in e.value.where


def test_dynamos_own_export_of_a_position_table_slice_compiles(tmp_path):
    from torch.export import Dim

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.l, self.pos = torch.nn.Linear(16, 16), torch.nn.Parameter(torch.randn(32, 16))

        def forward(self, x):
            return self.l(x) + self.pos[:x.shape[1]]
    torch.manual_seed(0)
    path = str(tmp_path / "dyn.onnx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(M().eval(), (torch.randn(2, 8, 16),), path, dynamo=True,
                          dynamic_shapes={"x": {0: Dim.AUTO, 1: Dim.AUTO}})
    cm = compile_onnx(path, tmp_path / "cache")
    seq = next(d for d, s in cm.recipe.dims.items() if s.max == 32)
    assert cm.recipe.dims[seq].min == 1
    _matches_ort(cm, path, [(1, 1), (2, 9), (3, 32)])
    with pytest.raises(ContractViolation, match="32 positions"):
        cm(torch.randn(2, 40, 16))



def _pooled_model(y: list, x: tuple = ("batch", 4, 8), m: list | None = None) -> bytes:
    """y = Relu(ReduceMean(x, axis 2, keepdims)): [batch, 4, 1], with the shapes the file declares
    (`m`: the intermediate's value_info); a dim named zzqqd is renamed with a byte that is not UTF-8."""
    g = helper.make_graph([helper.make_node("ReduceMean", ["x"], ["m"], axes=[2], keepdims=1),
                           helper.make_node("Relu", ["m"], ["y"])], "pool",
                          [helper.make_tensor_value_info("x", F, list(x))], [helper.make_tensor_value_info("y", F, y)],
                          value_info=[helper.make_tensor_value_info("m", F, m)] if m else [])
    raw = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()
    return raw.replace(b"zzqqd", b"zz\x8bqd")


def test_a_declared_dynamic_axis_the_graph_computes_fixed_is_called_a_wrong_declaration():
    """A legacy export of MobileNetV2 declares its pooled output [batch, 1280, batch, d]; the
    fix said "re-export with dynamic axes on every dynamic input dim", which it had."""
    with pytest.raises(CaptureError, match="the file's declared shape is wrong") as e:
        import_onnx(_pooled_model(["batch", 4, "batch"]), dims={"batch": (1, 4)})
    assert "dim 2: the importer inferred 1, the ONNX model declares batch" in e.value.message
    assert "clear 'y''s declared shape" in e.value.fix


def test_a_declared_dim_name_that_is_not_utf8_checks_nothing():
    """One flipped byte in a value's declared dim name (ONNX Runtime runs the file) was an
    importer bug: "TypeError: cannot use a string pattern on a bytes-like object"."""
    raw = _pooled_model(["batch", 4, 1], m=["batch", 4, "zzqqd"])
    assert not isinstance(onnx.load_model_from_string(raw).graph.value_info[0].type.tensor_type.shape.dim[2].dim_param,
                          str)
    g, _ = import_onnx(raw, dims={"batch": (1, 4)})
    assert [str(d) for d in g.values[g.outputs[0]].type.shape] == ["batch", "4", "1"]


@pytest.mark.parametrize("shapes", [{"x": ("zzqqd", 4, 8)}, {"y": ["batch", "zzqqd", 1]}], ids=["input", "output"])
def test_an_input_or_output_dim_name_that_is_not_utf8_is_called_damaged(tmp_path, shapes):
    """An input's: a raw TypeError traceback from `recipe init`; an output's is the model's
    signature, refused the same way."""
    path = tmp_path / "damaged.onnx"
    path.write_bytes(_pooled_model(**{"y": ["batch", 4, 1], **shapes}))
    with pytest.raises(CaptureError, match="name is not UTF-8 text: the file is damaged") as e:
        graphmode.compile(str(path))
    assert "re-export" in e.value.fix


def test_an_axis_the_onnx_file_fixes_is_refused_with_an_export_fix(tmp_path):
    """A DeiT exported with only batch dynamic, called at 64x64: the fix told an ONNX user to
    compile with dynamic_shapes= or example inputs, which a file has neither of."""
    from graphmode.errors import ContractViolation
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8])
    path = tmp_path / "relu.onnx"
    onnx.save(helper.make_model(helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y]),
                                opset_imports=[helper.make_opsetid("", 17)]), str(path))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cm = graphmode.compile(str(path))
    with pytest.raises(ContractViolation, match="axis 1 must be 8") as e:
        cm(torch.randn(2, 9))
    assert "export it again with the axis dynamic" in e.value.fix and "dynamic_shapes=" in e.value.fix
