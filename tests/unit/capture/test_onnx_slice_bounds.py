"""ONNX Slice bounds past a dynamic axis (a trial's findings), against ONNX Runtime on the compiled
path. ONNX clamps `starts`/`ends` to the axis; the IR's slice over a symbolic axis takes a constant
end as the end, so x[:, -2:1000] was planned 1000 - (n - 2) wide (a BackendError at every shape),
x[:, :16] with n fixed at 8 was refused, and of two slices on one axis only the first was held to
the dim's minimum (a draft refused by its own proof)."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto as TP
from onnx import helper, numpy_helper

import graphmode
from graphmode.analysis.extents import slice_needs
from graphmode.verdict import ContractRefused

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _slices(path, *bounds: tuple[int, int]) -> str:
    """y_k = x[:, start_k:end_k] for each (start, end), over x [b, n]."""
    nodes, inits, outs = [], [], []
    for k, (s, e) in enumerate(bounds):
        inits += [numpy_helper.from_array(np.array([v], np.int64), f"{w}{k}") for w, v in (("s", s), ("e", e))]
        nodes.append(helper.make_node("Slice", ["x", f"s{k}", f"e{k}", "axis"], [f"y{k}"]))
        outs.append(helper.make_tensor_value_info(f"y{k}", TP.FLOAT, ["b", None]))
    inits.append(numpy_helper.from_array(np.array([1], np.int64), "axis"))
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TP.FLOAT, ["b", "n"])], outs, inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 9
    onnx.save(m, path)
    return str(path)


def _recipe(lo: int, hi: int, buckets: list[int], on_violation: str = "error") -> dict:
    return {"version": 1, "name": "slices", "inputs": [{"name": "x", "dtype": "f32", "shape": ["b", "n"]}],
            "dims": {"b": {"buckets": [2]}, "n": {"min": lo, "max": hi, "buckets": buckets}},
            "exe_mode": "graph", "on_violation": on_violation, "targets": ["host"]}


def _matches_ort(path: str, cm, n: int) -> None:
    x = np.random.default_rng(n).standard_normal((2, n)).astype(np.float32)
    got = cm(x=torch.from_numpy(x))
    got = got if isinstance(got, (tuple, list)) else [got]
    want = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, {"x": x})
    assert [tuple(g.shape) for g in got] == [w.shape for w in want]
    assert all(np.array_equal(g.numpy(), w) for g, w in zip(got, want))
    assert cm.last_path["path"] == "graph"


def test_an_end_past_the_axis_at_every_admitted_value_is_the_axis_end(tmp_path):
    path = _slices(tmp_path / "last2.onnx", (-2, 1000), (1, 1000))
    # (padding n would move the last positions: what falls between buckets runs in ONNX Runtime)
    cm = graphmode.compile(path, _recipe(2, 64, [2, 17, 64], "eager"), cache_dir=tmp_path / "c")
    for n in (2, 17, 64):
        _matches_ort(path, cm, n)


def test_a_truncation_is_exact_where_the_recipe_fixes_the_axis_and_refused_where_it_straddles(tmp_path):
    path = _slices(tmp_path / "first16.onnx", (0, 16))
    cm = graphmode.compile(path, _recipe(8, 8, [8]), cache_dir=tmp_path / "c")
    _matches_ort(path, cm, 8)
    with pytest.raises(ContractRefused, match=r"slice 0:16 .* takes 16") as e:
        graphmode.compile(path, _recipe(4, 64, [4, 64]), cache_dir=tmp_path / "c")
    assert "dims.n.min: 16" in e.value.fix


def test_a_draft_starts_the_dim_where_every_slice_on_it_fits(tmp_path):
    """x[:, -2:] needs 2 positions, x[:, -3:-1] needs 3: the draft's n starts at 3."""
    path = _slices(tmp_path / "two.onnx", (-2, 2 ** 63 - 1), (-3, -1))
    cm = graphmode.compile(path, cache_dir=tmp_path / "c")
    assert cm.recipe.dim_range("n")[0] == 3
    _matches_ort(path, cm, 64)


def test_a_start_from_the_end_up_to_a_constant_end_needs_both():
    assert slice_needs(-2, 1000) == 1000 and slice_needs(-8, 4) == 8
    assert slice_needs(-3, -1) == 3 and slice_needs(0, 16) == 16 and slice_needs(2, 2 ** 62) == 2
