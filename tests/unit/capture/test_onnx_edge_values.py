"""ONNX ops at the values a new user's trial found wrong, each against ONNX Runtime (or exact values):
integer Div above 2**53 and with negative operands, Softplus above 88, Sign(NaN), an all-zero
DynamicQuantizeLinear, Reduce* with noop_with_empty_axes, integer reductions in the input's dtype,
Pad with a crop and a pad on one axis, recipe errors that name the recipe's fields, and Resize over
a dynamic batch."""
from __future__ import annotations

import itertools

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto as TP
from onnx import helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import graphmode
from graphmode.capture.onnx import import_onnx
from graphmode.errors import CaptureError
from graphmode.ir.interpreter import interpret

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _model(nodes, inputs, outputs, inits=(), opset=19):
    g = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(inits))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 9
    return m


def _vi(name, elem, shape):
    return helper.make_tensor_value_info(name, elem, shape)


def _ort(m, feeds: dict) -> list[np.ndarray]:
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def _interpret(m, feeds: dict, **kw) -> list[np.ndarray]:
    g, _ = import_onnx(m, **kw)
    out = interpret(g, dict(zip(g.inputs, (torch.from_numpy(v) for v in feeds.values()))))
    return [out[o].numpy() for o in g.outputs]


def _compiled(m, tmp_path, recipe=None):
    path = tmp_path / f"m{len(list(tmp_path.glob('*.onnx')))}.onnx"
    onnx.save(m, path)
    return graphmode.compile(str(path), recipe, cache_dir=tmp_path / "cache")


def _call(cm, feeds: dict) -> list[np.ndarray]:
    got = cm(**{k: torch.from_numpy(v) for k, v in feeds.items()})
    return [np.asarray(g) for g in (got if isinstance(got, (list, tuple)) else [got])]


def _same(got: np.ndarray, want: np.ndarray) -> bool:
    return got.shape == want.shape and got.dtype == want.dtype and np.array_equal(got, want, equal_nan=True)


# ---------------------------------------------------------------------------------------- 1: integer Div


def _div_model(elem, n):
    return _model([helper.make_node("Div", ["a", "b"], ["y"])], [_vi("a", elem, [n]), _vi("b", elem, [n])],
                  [_vi("y", elem, [n])])


def test_int64_div_is_exact_above_2_53_and_truncates_like_onnxruntime(tmp_path):
    a = np.array([2 ** 63 - 1, 2 ** 53 + 1, 123456789012345678, -7, 7, -7, -(2 ** 63 - 1), 6, -6, 0], np.int64)
    b = np.array([2, 1, 7, 2, -2, -2, 2, 3, 4, -5], np.int64)
    m = _div_model(TP.INT64, len(a))
    want = _ort(m, {"a": a, "b": b})[0]
    assert want[:3].tolist() == [4611686018427387903, 9007199254740993, 17636684144620811]
    assert _same(_call(_compiled(m, tmp_path), {"a": a, "b": b})[0], want)


@pytest.mark.parametrize("dtype", [np.int32, np.int16, np.int8, np.uint8, np.uint16, np.uint32])
def test_narrow_integer_div_truncates_toward_zero(dtype):
    info = np.iinfo(dtype)
    a = np.array([info.max, info.min, info.max - 1, 7, 9, 1, 0] + ([-7, -9, -1] if info.min < 0 else [5, 4, 3]),
                 dtype)
    b = np.array([2, 3, 7, 2, 4, 1, 5] + ([2, -4, 3] if info.min < 0 else [2, 4, 3]), dtype)
    m = _div_model(helper.np_dtype_to_tensor_dtype(np.dtype(dtype)), len(a))
    want = np.array([(abs(x) // abs(y)) * (1 if (x >= 0) == (y >= 0) else -1) for x, y in zip(a.tolist(),
                                                                                             b.tolist())], dtype)
    assert _same(_interpret(m, {"a": a, "b": b})[0], want)
    if dtype in (np.int32, np.uint8):
        assert _same(_ort(m, {"a": a, "b": b})[0], want)


def test_uint64_div_is_exact_above_2_63(tmp_path):
    """torch has no uint64 division: computed on the int64 bit patterns, exact over the whole range."""
    top = 2 ** 64 - 1
    pairs = [(top, 1), (top, 2), (top, 3), (top, top), (top - 1, top), (2 ** 63, 2 ** 63 + 1), (2 ** 63 + 5, 2 ** 63),
             (2 ** 63, 3), (10, 3), (0, 7), (top, 2 ** 62 + 1), (12345678901234567890, 987654321), (7, 2 ** 63)]
    a, b = (np.array(v, np.uint64) for v in zip(*pairs))
    m = _div_model(TP.UINT64, len(pairs))
    want = np.array([x // y for x, y in pairs], np.uint64)
    assert _same(_ort(m, {"a": a, "b": b})[0], want)

    def u64(v: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(v.view(np.int64)).view(torch.uint64)
    got = _compiled(m, tmp_path)(a=u64(a), b=u64(b))
    assert _same(got.view(torch.int64).numpy().view(np.uint64), want)


def test_symbolic_integer_div_of_a_negative_dim_truncates():
    """-N / 2 over a dim folds toward zero (ONNX), not toward -inf."""
    import sympy

    from graphmode.capture.onnx.fold import _sym_div
    n = sympy.Symbol("N", positive=True, integer=True)
    q = _sym_div(True)(-n, 2)
    assert [int(q.subs(n, v)) for v in (1, 2, 3, 5)] == [0, -1, -1, -2]
    assert [int(_sym_div(True)(n, -2).subs(n, v)) for v in (1, 3)] == [0, -1]


# ---------------------------------------------------------------------------------------- 2: Softplus


def test_softplus_is_finite_above_88_and_accurate_below_zero(tmp_path):
    x = np.array([80, 88.8, 100, 1000, 20, 20.5, 5, 1e-8, 0, -5, -20.5, -100, -1000], np.float32)
    m = _model([helper.make_node("Softplus", ["x"], ["y"])], [_vi("x", TP.FLOAT, [len(x)])],
               [_vi("y", TP.FLOAT, [len(x)])])
    want = _ort(m, {"x": x})[0]
    got = _call(_compiled(m, tmp_path), {"x": x})[0]
    assert np.allclose(got[:4], [80, 88.8, 100, 1000], rtol=1e-6, atol=0)
    assert np.all(np.isfinite(got)) and np.allclose(got, want, rtol=1e-6, atol=1e-44)


# ---------------------------------------------------------------------------------------- 5: Sign


def test_sign_of_nan_is_nan_as_in_onnx(tmp_path):
    assert torch.sign(torch.tensor(float("nan"))).item() == 0     # torch's own semantics: the torch path keeps it
    x = np.array([np.nan, -2.5, -0.0, 0.0, 3.0, np.inf, -np.inf], np.float32)
    m = _model([helper.make_node("Sign", ["x"], ["y"])], [_vi("x", TP.FLOAT, [len(x)])],
               [_vi("y", TP.FLOAT, [len(x)])])
    want = _ort(m, {"x": x})[0]
    assert np.isnan(want[0]) and _same(ReferenceEvaluator(m).run(None, {"x": x})[0], want)
    assert _same(_call(_compiled(m, tmp_path), {"x": x})[0], want)
    xi = np.array([-3, 0, 4], np.int32)
    mi = _model([helper.make_node("Sign", ["x"], ["y"])], [_vi("x", TP.INT32, [3])], [_vi("y", TP.INT32, [3])])
    assert _same(_interpret(mi, {"x": xi})[0], _ort(mi, {"x": xi})[0])


# ---------------------------------------------------------------------------------------- 6: DynamicQuantizeLinear


def _dql_model(shape):
    return _model([helper.make_node("DynamicQuantizeLinear", ["x"], ["y", "s", "z"])], [_vi("x", TP.FLOAT, shape)],
                  [_vi("y", TP.UINT8, shape), _vi("s", TP.FLOAT, []), _vi("z", TP.UINT8, [])])


def test_dynamic_quantize_linear_of_zeros_has_onnxruntimes_unit_scale(tmp_path):
    cm = _compiled(_dql_model([2, 3]), tmp_path)
    x = np.zeros((2, 3), np.float32)
    y, s, z = _call(cm, {"x": x})
    assert s.item() == 1.0 and not y.any() and z.item() == 0
    assert all(_same(g, w) for g, w in zip((y, s, z), _ort(_dql_model([2, 3]), {"x": x})))


@pytest.mark.parametrize("values", [[0, -0.0], [5, 5], [-3, -3], [1e-45, 0], [-1e-45, 0], [1e-40, 2e-40],
                                    [-1.5, 0.3, 2.7, 100.1], [0.1, 0.2, 0.3], "random"])
def test_dynamic_quantize_linear_matches_onnxruntime(values):
    x = (np.random.default_rng(0).standard_normal((3, 7)) * 30 if values == "random" else np.array(values))
    x = x.astype(np.float32)
    m = _dql_model(list(x.shape))
    for g, w in zip(_interpret(m, {"x": x}), _ort(m, {"x": x})):
        assert _same(g, w), (values, g, w)


# ---------------------------------------------------------------------------------------- 3: Reduce* noop


ALL_REDUCE = ["ReduceSumSquare", "ReduceL2", "ReduceL1", "ReduceLogSum", "ReduceLogSumExp", "ReduceMean",
              "ReduceMax", "ReduceMin", "ReduceSum", "ReduceProd"]


def _reduce_model(op, elem, shape, axes, out_shape, **attrs):
    ax = numpy_helper.from_array(np.array(axes, np.int64), "axes")
    return _model([helper.make_node(op, ["x", "axes"], ["y"], **attrs)], [_vi("x", elem, shape)],
                  [_vi("y", elem, out_shape)], [ax])


@pytest.mark.parametrize("op", ALL_REDUCE)
def test_reduce_with_empty_axes_and_noop_matches_onnx_reference_and_onnxruntime(op):
    x = np.array([[-1.5, 2.0, 0.5], [3.0, -0.25, 1e30]], np.float32)
    m = _reduce_model(op, TP.FLOAT, [2, 3], [], [2, 3], noop_with_empty_axes=1)
    got = _interpret(m, {"x": x})[0]
    with np.errstate(all="ignore"):
        ref = ReferenceEvaluator(m).run(None, {"x": x})[0]
    assert _same(got, ref), (op, got, ref)
    assert np.allclose(got, _ort(m, {"x": x})[0], rtol=1e-6, equal_nan=True)


@pytest.mark.parametrize("op", ["ReduceSumSquare", "ReduceL2", "ReduceL1"])
def test_integer_reduce_with_noop_keeps_the_elementwise_part(op):
    x = np.array([[-3, 0, 4], [46341, -7, 2 ** 31 - 1]], np.int32)
    m = _reduce_model(op, TP.INT32, [2, 3], [], [2, 3], noop_with_empty_axes=1)
    assert _same(_interpret(m, {"x": x})[0], _ort(m, {"x": x})[0])


# ---------------------------------------------------------------------------------------- 7: integer reductions

INT_REDUCE = ["ReduceSum", "ReduceProd", "ReduceSumSquare", "ReduceL1", "ReduceL2", "ReduceMean"]
I32 = np.array([[0, 1, 2, 0, 0], [3, 4, 5, 0, 0], [-7, -2, 4, 0, 0], [-8, 3, -1, 0, 0], [-5, 3, 0, 0, 0],
                [2 ** 30, 2 ** 30, 2 ** 30, 0, 0], [2 ** 31 - 1, 2 ** 31 - 1, 1, 0, 0],
                [2 ** 24 + 1, 2 ** 24 + 2, 2 ** 24 + 3, 0, 0], [-(2 ** 31), -(2 ** 31), 5, 0, 0],
                [2 ** 31 - 1, 2 ** 31 - 1, -(2 ** 31 - 1), -(2 ** 31 - 1), 5], [46341, 46341, 0, 1, 1],
                [-1, -1, -1, -1, -1], [-46341, 46341, 1, 1, 1]], np.int32)


@pytest.mark.parametrize("op", INT_REDUCE)
@pytest.mark.parametrize("axes,keep", [([1], 0), ([1], 1), ([0], 0), ([0, 1], 0)])
def test_int32_reductions_keep_int32_and_saturate_like_onnxruntime(op, axes, keep):
    want = _ort(_reduce_model(op, TP.INT32, list(I32.shape), axes, None, keepdims=keep), {"x": I32})[0]
    m = _reduce_model(op, TP.INT32, list(I32.shape), axes, list(want.shape), keepdims=keep)
    assert _same(_interpret(m, {"x": I32})[0], want), op


@pytest.mark.parametrize("op", INT_REDUCE)
def test_int64_reductions_match_onnxruntime_in_double_and_saturate(op):
    """ONNX Runtime reduces int64 in double too: 2**53 + 1, + 3, + 5 sum to 3 * 2**53 + 8, and an
    overflow saturates."""
    x = np.array([[2 ** 40, 3, 3], [-7, 0, 0], [-8, 0, 0], [5, -7, 0], [2 ** 31, 2 ** 31, 2 ** 20], [-2, -2, -3],
                  [2 ** 53 + 1, 2 ** 53 + 3, 2 ** 53 + 5], [2 ** 62, 2 ** 62, 2 ** 62], [-(2 ** 63), -1, 0]], np.int64)
    m = _reduce_model(op, TP.INT64, list(x.shape), [1], [len(x)], keepdims=0)
    assert _same(_interpret(m, {"x": x})[0], _ort(m, {"x": x})[0])


def test_known_int32_reductions_fold_as_they_run():
    """A constant int32 input is reduced at import time with the same saturation as at run time."""
    c = numpy_helper.from_array(np.array([[2 ** 30, 2 ** 30, 2 ** 30], [-7, 1, 0]], np.int32), "c")
    ax = numpy_helper.from_array(np.array([1], np.int64), "axes")
    for op, want in (("ReduceSum", [2 ** 31 - 1, -6]), ("ReduceMean", [2 ** 30, -2])):
        m = _model([helper.make_node(op, ["c", "axes"], ["s"], keepdims=0), helper.make_node("Add", ["s", "x"], ["y"])],
                   [_vi("x", TP.INT32, [2])], [_vi("y", TP.INT32, [2])], [c, ax])
        x = np.zeros(2, np.int32)
        assert _interpret(m, {"x": x})[0].tolist() == want == _ort(m, {"x": x})[0].tolist(), op


def test_uint64_reductions_are_refused_by_name():
    with pytest.raises(CaptureError, match="ReduceSum of uint64 values is not supported"):
        import_onnx(_reduce_model("ReduceSum", TP.UINT64, [2, 3], [1], [2], keepdims=0))


def test_int32_reduce_sum_and_mean_compile_and_run(tmp_path):
    """ReduceSum was refused (inferred i64); ReduceMean compiled and then failed in torch.mean at
    every call. ORT: sums [3 12], means truncated toward zero ([-5, 3, 0] / 3 is -0.67: 0)."""
    x = np.array([[0, 1, 2], [3, 4, 5], [-5, 3, 0], [-7, 0, 0]], np.int32)
    for op, want in (("ReduceSum", [3, 12, -2, -7]), ("ReduceMean", [1, 4, 0, -2])):
        m = _reduce_model(op, TP.INT32, [4, 3], [1], [4], keepdims=0)
        got = _call(_compiled(m, tmp_path), {"x": x})[0]
        assert _same(got, np.array(want, np.int32)) and _same(got, _ort(m, {"x": x})[0]), op


# ---------------------------------------------------------------------------------------- 4: Pad


def _pad_model(mode, size, b, e):
    pads = numpy_helper.from_array(np.array([0, b, 0, e], np.int64), "pads")
    return _model([helper.make_node("Pad", ["x", "pads"], ["y"], mode=mode)], [_vi("x", TP.FLOAT, [1, size])],
                  [_vi("y", TP.FLOAT, [1, size + b + e])], [pads])


@pytest.mark.parametrize("pads,want", [((2, -1), [2, 3, 0, 1, 2, 3]), ((-2, 3), [2, 3, 4, 2, 3, 4])])
def test_pad_wrap_crops_then_wraps(pads, want):
    x = np.arange(5, dtype=np.float32)[None]
    m = _pad_model("wrap", 5, *pads)
    assert _ort(m, {"x": x})[0][0].tolist() == want
    assert _interpret(m, {"x": x})[0][0].tolist() == want


@pytest.mark.parametrize("mode", ["edge", "reflect", "wrap", "constant"])
def test_pad_with_crops_and_pads_matches_onnxruntime_or_is_refused_where_it_refuses(mode):
    for size, b, e in itertools.product([1, 2, 5], range(-3, 7), range(-3, 7)):
        if size + b + e <= 0:
            continue
        x = np.arange(1, size + 1, dtype=np.float32)[None]
        m = _pad_model(mode, size, b, e)
        try:
            want = _ort(m, {"x": x})[0]
        except Exception:  # noqa: BLE001 - onnxruntime's Fail / InvalidArgument
            want = None
        if want is None:
            with pytest.raises(CaptureError, match=f"Pad mode '{mode}'"):
                import_onnx(m)
        else:
            assert _same(_interpret(m, {"x": x})[0], want), (mode, size, b, e)


def test_reflect_pad_beyond_the_axis_is_refused_naming_the_fix():
    with pytest.raises(CaptureError, match="pads axis 1 by 5, but only 5 elements") as e:
        import_onnx(_pad_model("reflect", 5, 0, 5))
    assert "pad by less than the axis's extent" in e.value.fix


# ---------------------------------------------------------------------------------------- 8: recipe fields


def test_recipe_input_errors_name_the_recipe_fields(tmp_path):
    m = _model([helper.make_node("Relu", ["x"], ["y"])], [_vi("x", TP.FLOAT, ["N", 4])], [_vi("y", TP.FLOAT, ["N", 4])])
    base = {"version": 1, "name": "r", "dims": {"N": {"min": 1, "max": 4}}}
    x = {"name": "x", "dtype": "f32", "shape": ["N", 4]}
    cases = [([x, {"name": "z", "dtype": "f32", "shape": ["N"]}], r"inputs\[1\]\.name 'z'"),
             ([{**x, "shape": ["N", 4, 1]}], r"inputs\[0\]\.shape gives 3 dims"),
             ([{**x, "shape": ["N", 5]}], r"inputs\[0\]\.shape\[1\] says 5")]
    for inputs, match in cases:
        with pytest.raises(CaptureError, match=match) as e:
            _compiled(m, tmp_path, {**base, "inputs": inputs})
        assert "input_dims" not in str(e.value) + (e.value.fix or "")


# ---------------------------------------------------------------------------------------- 9: Resize, dynamic batch


def _resize_model(mode, ctm, how):
    inits = [numpy_helper.from_array(np.array([], np.float32), "roi")]
    kw = {"mode": mode, "coordinate_transformation_mode": ctm}
    nodes = []
    if how == "scales":
        inits.append(numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "scales"))
        nodes.append(helper.make_node("Resize", ["x", "roi", "scales"], ["y"], **kw))
    elif how == "axes":
        inits.append(numpy_helper.from_array(np.array([2, 2], np.float32), "scales"))
        nodes.append(helper.make_node("Resize", ["x", "roi", "scales"], ["y"], axes=[2, 3], **kw))
    elif how == "sizes_axes":
        inits.append(numpy_helper.from_array(np.array([4, 5], np.int64), "sizes"))
        nodes.append(helper.make_node("Resize", ["x", "roi", "", "sizes"], ["y"], axes=[2, 3], **kw))
    else:   # sizes from the input's shape, as torch.onnx writes F.interpolate(size=...)
        inits += [numpy_helper.from_array(np.array([v], np.int64), k) for k, v in (("s0", 0), ("s2", 2))]
        inits.append(numpy_helper.from_array(np.array([4, 5], np.int64), "hw"))
        nodes += [helper.make_node("Shape", ["x"], ["shp"]), helper.make_node("Slice", ["shp", "s0", "s2"], ["nc"]),
                  helper.make_node("Concat", ["nc", "hw"], ["sizes"], axis=0),
                  helper.make_node("Resize", ["x", "roi", "", "sizes"], ["y"], **kw)]
    w = 4 if how in ("scales", "axes") else 5
    return _model(nodes, [_vi("x", TP.FLOAT, ["N", 1, 2, 2])], [_vi("y", TP.FLOAT, ["N", 1, 4, w])], inits)


CTMS = ["asymmetric", "half_pixel", "align_corners", "pytorch_half_pixel"]


@pytest.mark.parametrize("how", ["scales", "axes", "sizes_axes", "sizes_shape"])
@pytest.mark.parametrize("mode,ctm", list(itertools.product(["nearest", "linear"], CTMS)))
def test_resize_over_a_dynamic_batch_matches_onnxruntime(how, mode, ctm):
    m = _resize_model(mode, ctm, how)
    g, _ = import_onnx(m)
    assert not isinstance(g.values[g.outputs[0]].type.shape[0], int)       # the batch stays symbolic
    for n in (1, 3, 5):
        x = np.random.default_rng(n).standard_normal((n, 1, 2, 2)).astype(np.float32)
        got = interpret(g, {g.inputs[0]: torch.from_numpy(x)})[g.outputs[0]].numpy()
        assert np.allclose(got, _ort(m, {"x": x})[0], atol=1e-6), (n, how, mode, ctm)


@pytest.mark.parametrize("mode,ctm,how", [pytest.param("linear", "half_pixel", "scales", marks=pytest.mark.slow),
                                          ("nearest", "asymmetric", "sizes_shape"),
                                          ("linear", "align_corners", "axes")])     # scales: "axes" reads them too
def test_resize_over_a_dynamic_batch_compiles_with_and_without_a_recipe(tmp_path, mode, ctm, how):
    m = _resize_model(mode, ctm, how)
    recipe = {"version": 1, "name": "r", "dims": {"N": {"min": 1, "max": 8, "buckets": [2, 4, 8]}},
              "inputs": [{"name": "x", "dtype": "f32", "shape": ["N", 1, 2, 2]}]}
    for cm in (_compiled(m, tmp_path), _compiled(m, tmp_path, recipe)):
        for n in (1, 3, 8):
            x = np.random.default_rng(n).standard_normal((n, 1, 2, 2)).astype(np.float32)
            got = _call(cm, {"x": x})[0]
            assert np.allclose(got, _ort(m, {"x": x})[0], atol=1e-6), n


def test_resize_of_a_symbolic_axis_it_changes_is_refused():
    scales = numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "scales")
    m = _model([helper.make_node("Resize", ["x", "", "scales"], ["y"], mode="nearest")],
               [_vi("x", TP.FLOAT, ["N", 1, "H", 2])], [_vi("y", TP.FLOAT, ["N", 1, None, 4])], [scales])
    with pytest.raises(CaptureError, match="resizes axis 2, whose extent H is symbolic"):
        import_onnx(m)


def test_a_model_without_inputs_is_refused_saying_so(tmp_path):
    """A constant graph (Range of initializers) drafted 'inputs: must not be empty', no fix."""
    from graphmode.errors import RecipeError
    inits = [numpy_helper.from_array(np.array(v, np.int64), k) for k, v in (("a", 0), ("b", 5), ("d", 1))]
    m = _model([helper.make_node("Range", ["a", "b", "d"], ["y"])], [], [_vi("y", TP.INT64, [5])], inits)
    path = tmp_path / "range.onnx"
    onnx.save(m, path)
    with pytest.raises(RecipeError, match="takes no inputs: its outputs are constants") as e:
        graphmode.compile(str(path), cache_dir=tmp_path / "c")
    assert e.value.where == "inputs" and "ONNX Runtime" in e.value.fix


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_at_the_infinities_and_nan_is_onnxruntimes(approximate, tmp_path):
    """ONNX's Gelu is x * Phi(x): +inf at +inf in ONNX Runtime, where torch's exact kernel gives
    NaN (a torch model keeps torch's answer; an ONNX file is compared with ONNX Runtime)."""
    x = np.array([np.inf, -np.inf, np.nan, 1.0, -3.0, 40.0, -40.0, 0.0], np.float32)
    m = _model([helper.make_node("Gelu", ["x"], ["y"], approximate=approximate)], [_vi("x", TP.FLOAT, [8])],
               [_vi("y", TP.FLOAT, [8])], opset=20)
    want = _ort(m, {"x": x})[0]
    assert want[0] == np.inf
    for got in (_interpret(m, {"x": x})[0], _call(_compiled(m, tmp_path), {"x": x})[0]):
        finite = np.isfinite(want)
        assert np.array_equal(np.isnan(got), np.isnan(want)) and np.array_equal(got[~finite & ~np.isnan(want)],
                                                                              want[~finite & ~np.isnan(want)])
        assert np.linalg.norm(got[finite] - want[finite]) / np.linalg.norm(want[finite]) < 1e-5
