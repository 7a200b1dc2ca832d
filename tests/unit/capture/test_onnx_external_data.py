"""An external-data ONNX file whose every tensor sits beside it (`size_threshold=0`): ONNX
Runtime's own load fails on a tensor its shape inference reads (an Unsqueeze's axes), though
graphmode imports the file. The reference and the eager fallback hand ONNX Runtime the model
with its data inlined, so a request outside the contract runs instead of failing."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import graphmode
from graphmode.capture.onnx.runtime import ort_session


def _external_file(tmp_path):
    w = numpy_helper.from_array(np.arange(12, dtype=np.float32).reshape(4, 3) / 7, "w")
    axes = numpy_helper.from_array(np.array([1], dtype=np.int64), "axes")
    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Unsqueeze", ["h", "axes"], ["y"])],
        "ext", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 1, 3])], initializer=[w, axes])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    path = tmp_path / "m.onnx"
    onnx.save_model(m, path, save_as_external_data=True, all_tensors_to_one_file=True, location="m.data",
                    size_threshold=0)
    return path, m


def test_a_file_ort_cannot_load_from_its_path_gets_a_session_with_its_data_inlined(tmp_path):
    path, _ = _external_file(tmp_path)
    with pytest.raises(Exception, match="external"):            # the ONNX Runtime limit this works around
        ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    sess = ort_session(path, ort.SessionOptions())
    x = np.ones((2, 4), dtype=np.float32)
    np.testing.assert_allclose(sess.run(None, {"x": x})[0], (x @ (np.arange(12).reshape(4, 3) / 7))[:, None],
                               rtol=1e-6)
    (tmp_path / "m.data").unlink()                           # nothing to inline: the first error stands
    with pytest.raises(Exception):
        ort_session(path, ort.SessionOptions())


def test_the_eager_fallback_of_such_a_file_runs(tmp_path):
    path, _ = _external_file(tmp_path)
    recipe = {"version": 1, "name": "ext", "inputs": [{"name": "x", "dtype": "f32", "shape": ["batch", 4]}],
              "dims": {"batch": {"buckets": [2]}}, "on_violation": "eager", "codegen": {"kernel_selection": "heuristic"}}
    cm = graphmode.compile(str(path), recipe, cache_dir=tmp_path / "cache")
    want = torch.ones(5, 4) @ (torch.arange(12.0).reshape(4, 3) / 7)
    got = cm(x=torch.ones(5, 4))                              # batch 5: outside the contract, ONNX Runtime runs it
    assert torch.allclose(got, want[:, None], rtol=1e-6) and cm.metrics()["events"]["fallback"] == 1
