"""ONNX TopK, ScatterElements, ScatterND, ReverseSequence, Tile, CumProd, Det
(capture/onnx/convert_select.py), negative-step Slice, GatherND batch_dims, Col2Im, MaxUnpool and 3-d
ConvTranspose, imported and interpreted, against ONNX Runtime; what the converters do not cover is
refused by name."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from graphmode.capture.onnx import import_onnx
from graphmode.errors import CaptureError
from graphmode.ir.interpreter import interpret

def _model(op: str, feeds: dict, consts: dict, n_out: int, opset: int, **attrs):
    inputs = [helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(v.dtype), list(v.shape)) for k, v in feeds.items()]
    inits = [numpy_helper.from_array(v, k) for k, v in consts.items()]
    outs = [f"y{i}" for i in range(n_out)]
    node = helper.make_node(op, list(feeds) + list(consts), outs, **attrs)
    g = helper.make_graph([node], "g", inputs, [helper.make_value_info(o, helper.TypeProto()) for o in outs], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    from onnx import shape_inference
    inferred = shape_inference.infer_shapes(m)
    del m.graph.output[:]
    m.graph.output.extend(inferred.graph.output)
    return m


def _check(op: str, feeds: dict, consts: dict | None = None, n_out: int = 1, opset: int = 22, **attrs):
    m = _model(op, feeds, consts or {}, n_out, opset, **attrs)
    want = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    graph, _ = import_onnx(m)
    got = interpret(graph, {v: torch.from_numpy(feeds[k]) for v, k in zip(graph.inputs, feeds)})
    assert len(graph.outputs) == len(want)
    for out, w in zip(graph.outputs, want):
        g = got[out].numpy()
        assert g.shape == w.shape and g.dtype == w.dtype
        assert np.allclose(g, w, rtol=1e-5, atol=1e-6), (g, w)


X = np.array([[3.0, 1.0, 3.0, 2.0, 1.0], [0.5, 0.5, -1.0, 4.0, 0.5]], dtype=np.float32)


@pytest.mark.parametrize("largest", [1, 0])
def test_topk_keeps_the_lower_index_first_among_ties(largest):
    _check("TopK", {"x": X}, {"k": np.array([3], dtype=np.int64)}, n_out=2, axis=-1, largest=largest)


def test_topk_along_a_dynamic_axis_is_taken_where_the_recipe_keeps_it_at_least_k(tmp_path):
    """TopK over a symbolic extent was refused; it is the same stable sort and first K where the
    recipe's range keeps the extent >= K, and refused naming the range where it does not (ONNX
    Runtime fails on a shorter row)."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "n"])
    node = helper.make_node("TopK", ["x", "k"], ["v", "i"], axis=1)
    outs = [helper.make_tensor_value_info("v", TensorProto.FLOAT, ["batch", 3]),
            helper.make_tensor_value_info("i", TensorProto.INT64, ["batch", 3])]
    g = helper.make_graph([node], "g", [x], outs, [numpy_helper.from_array(np.array([3], dtype=np.int64), "k")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    graph, _ = import_onnx(m, dims={"batch": (1, 4), "n": (3, 16)})
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    for n in (3, 5, 16):
        feed = np.random.default_rng(n).standard_normal((2, n)).astype(np.float32)
        feed[0, :2] = 9.0                                        # a tie: the lower index first
        got = interpret(graph, {graph.inputs[0]: torch.from_numpy(feed)})
        for out, want in zip(graph.outputs, sess.run(None, {"x": feed})):
            assert np.array_equal(got[out].numpy(), want), n
    with pytest.raises(CaptureError, match=r"TopK K=3 along n, which the recipe lets be shorter than K \(down to 2\)") \
            as e:
        import_onnx(m, dims={"batch": (1, 4), "n": (2, 16)})
    assert e.value.suggested_ranges == {"n": (3, None)} and "recipe init --dim n=3:MAX" in e.value.fix
    # trial AG: a draft started n at 1 and refused itself; it starts n at K
    from graphmode.kb.draft import draft_recipe
    path = tmp_path / "topk.onnx"
    onnx.save(m, str(path))
    assert draft_recipe(str(path)).data["dims"]["n"]["min"] == 3


@pytest.mark.parametrize("exclusive", [0, 1])
@pytest.mark.parametrize("dtype", [TensorProto.FLOAT, TensorProto.INT32])
def test_reverse_cumsum_along_a_dynamic_axis_matches_onnx_runtime(exclusive, dtype):
    """Trial AG: `CumSum reverse=1` over a dynamic seq was refused ('over a symbolic extent'); the
    axis is flipped by indices counted from its end (exact, no total-minus-prefix cancellation)."""
    x = helper.make_tensor_value_info("x", dtype, ["batch", "seq", 3])
    node = helper.make_node("CumSum", ["x", "ax"], ["y"], reverse=1, exclusive=exclusive)
    out = helper.make_tensor_value_info("y", dtype, ["batch", "seq", 3])
    g = helper.make_graph([node], "g", [x], [out], [numpy_helper.from_array(np.array(1, dtype=np.int64), "ax")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    graph, _ = import_onnx(m, dims={"batch": (1, 4), "seq": (1, 32)})
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    for seq in (1, 6, 31):
        feed = np.random.default_rng(seq).standard_normal((2, seq, 3)) * 1e3
        feed = feed.astype(np.float32 if dtype == TensorProto.FLOAT else np.int32)
        got = interpret(graph, {graph.inputs[0]: torch.from_numpy(feed)})[graph.outputs[0]].numpy()
        want = sess.run(None, {"x": feed})[0]
        assert got.dtype == want.dtype and np.allclose(got, want, rtol=1e-6, atol=1e-3), seq


@pytest.mark.parametrize("reduction", ["none", "add", "mul", "max", "min"])
def test_scatter_elements_reductions_and_negative_indices(reduction):
    idx = np.array([[1, -1], [0, 0]], dtype=np.int64) if reduction != "none" else np.array([[1, -1], [0, 2]],
                                                                                           dtype=np.int64)
    _check("ScatterElements", {"x": X, "i": idx, "u": np.array([[5.0, 6.0], [7.0, -8.0]], dtype=np.float32)},
           axis=1, reduction=reduction)


@pytest.mark.parametrize("reduction", ["none", "add", "max"])
def test_scatter_nd_writes_rows_and_elements(reduction):
    data = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    rows = np.array([[1, 2], [0, -1]], dtype=np.int64)                  # two [4]-rows, one negative index
    _check("ScatterND", {"x": data, "i": rows, "u": np.full((2, 4), 9.0, dtype=np.float32)}, reduction=reduction)
    elems = np.array([[[0, 0, 1]], [[1, 2, 3]]], dtype=np.int64)       # single elements, index batch [2, 1]
    _check("ScatterND", {"x": data, "i": elems, "u": np.array([[-1.0], [50.0]], dtype=np.float32)},
           reduction=reduction)


@pytest.mark.parametrize("batch_axis,time_axis", [(1, 0), (0, 1)])
def test_reverse_sequence_reverses_each_prefix(batch_axis, time_axis):
    x = np.arange(20, dtype=np.float32).reshape(4, 5) if time_axis == 0 else np.arange(20, dtype=np.float32).reshape(5, 4)
    lens = np.array([4, 1, 3, 2, 4], dtype=np.int64)
    _check("ReverseSequence", {"x": x, "lens": lens}, batch_axis=batch_axis, time_axis=time_axis)


def test_tile_repeats_each_axis():
    _check("Tile", {"x": X}, {"r": np.array([2, 3], dtype=np.int64)})


@pytest.mark.parametrize("exclusive,reverse", [(0, 0), (1, 0), (0, 1), (1, 1)])
def test_cumprod_at_opset_26(exclusive, reverse):
    _check("CumProd", {"x": X}, {"axis": np.array(1, dtype=np.int64)}, opset=26, exclusive=exclusive,
           reverse=reverse)


def test_det_of_a_batch_of_matrices():
    rng = np.random.default_rng(0)
    _check("Det", {"x": rng.standard_normal((3, 4, 4)).astype(np.float32)})


def test_topk_of_uint64_is_refused_by_name():
    m = _model("TopK", {"x": np.arange(5, dtype=np.uint64)}, {"k": np.array([2], dtype=np.int64)}, 2, 22)
    with pytest.raises(CaptureError, match="TopK on u64"):
        import_onnx(m)


@pytest.mark.parametrize("starts,ends,steps", [([-1, 8], [-100, 1], [-1, -3]), ([1, 100], [0, -100], [-2, -1])])
def test_slice_with_negative_steps(starts, ends, steps):
    x = np.arange(60, dtype=np.float32).reshape(6, 10)
    _check("Slice", {"x": x}, {"s": np.array(starts, dtype=np.int64), "e": np.array(ends, dtype=np.int64),
                               "a": np.array([0, 1], dtype=np.int64), "st": np.array(steps, dtype=np.int64)})


def test_scan_before_opset_9_is_refused_by_name():
    body = helper.make_graph([helper.make_node("Add", ["s", "x"], ["s2"]), helper.make_node("Identity", ["s2"], ["y"])],
                             "body", [helper.make_tensor_value_info(v, TensorProto.FLOAT, [2]) for v in ("s", "x")],
                             [helper.make_tensor_value_info(v, TensorProto.FLOAT, [2]) for v in ("s2", "y")])
    node = helper.make_node("Scan", ["", "init", "xs"], ["last", "ys"], num_scan_inputs=1, body=body)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("init", TensorProto.FLOAT, [1, 2]),
                                        helper.make_tensor_value_info("xs", TensorProto.FLOAT, [1, 3, 2])],
                          [helper.make_tensor_value_info("last", TensorProto.FLOAT, [1, 2]),
                           helper.make_tensor_value_info("ys", TensorProto.FLOAT, [1, 3, 2])])
    with pytest.raises(CaptureError, match="Scan before opset 9"):
        import_onnx(helper.make_model(g, opset_imports=[helper.make_opsetid("", 8)]))


def test_col2im_and_3d_conv_transpose_as_aten_reference_ops():
    rng = np.random.default_rng(1)
    _check("Col2Im", {"x": rng.standard_normal((1, 4, 6)).astype(np.float32)},
           {"img": np.array([3, 4], dtype=np.int64), "blk": np.array([2, 2], dtype=np.int64)}, pads=[0, 1, 0, 1],
           strides=[1, 2])
    _check("ConvTranspose", {"x": rng.standard_normal((1, 2, 3, 4, 2)).astype(np.float32)},
           {"w": rng.standard_normal((2, 3, 2, 2, 2)).astype(np.float32), "b": np.ones(3, dtype=np.float32)},
           strides=[2, 1, 1], pads=[1, 0, 0, 1, 0, 0])


def test_gather_nd_with_batch_dims():
    data = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    _check("GatherND", {"x": data, "i": np.array([[[2, -1], [0, 1]], [[1, 3], [-3, 0]]], dtype=np.int64)},
           batch_dims=1)


def test_max_unpool_of_max_pool_indices_over_several_planes():
    """MaxPool's indices (from ONNX Runtime) count over the whole (N, C, H, W) tensor."""
    x = np.random.default_rng(4).standard_normal((2, 3, 4, 6)).astype(np.float32)
    pool = helper.make_graph([helper.make_node("MaxPool", ["x"], ["p", "i"], kernel_shape=[2, 2], strides=[2, 2])],
                             "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 4, 6])],
                             [helper.make_tensor_value_info("p", TensorProto.FLOAT, [2, 3, 2, 3]),
                              helper.make_tensor_value_info("i", TensorProto.INT64, [2, 3, 2, 3])])
    m = helper.make_model(pool, opset_imports=[helper.make_opsetid("", 22)])
    p, i = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    assert i.max() >= 4 * 6              # indices past the first plane
    _check("MaxUnpool", {"p": p, "i": i}, kernel_shape=[2, 2], strides=[2, 2])


@pytest.mark.parametrize("mode", ["linear", "circular"])
def test_tensor_scatter_writes_each_rows_steps_from_its_index(mode):
    rng = np.random.default_rng(0)
    past, upd = rng.standard_normal((2, 3, 8, 4), dtype=np.float32), rng.standard_normal((2, 3, 3, 4), dtype=np.float32)
    start = np.array([5, 0] if mode == "linear" else [7, 2], dtype=np.int64)
    _check("TensorScatter", {"past": past, "upd": upd, "w": start}, opset=24, mode=mode)
    _check("TensorScatter", {"past": past, "upd": upd}, opset=24, mode=mode)          # no write_indices: from 0
    _check("TensorScatter", {"past": past.transpose(0, 2, 1, 3).copy(), "upd": upd.transpose(0, 2, 1, 3).copy(),
                             "w": start}, opset=24, mode=mode, axis=1)


@pytest.mark.parametrize("src,dst", [(np.float32, np.int32), (np.int64, np.float64), (np.uint16, np.int16),
                                     (np.int8, np.uint8)])
def test_bitcast_keeps_the_bytes(src, dst):
    x = (np.arange(-6, 6).reshape(3, 4) * 37).astype(src)
    graph, _ = import_onnx(_model("BitCast", {"x": x}, {}, 1, 26, to=helper.np_dtype_to_tensor_dtype(np.dtype(dst))))
    (out,) = graph.outputs
    got = interpret(graph, {graph.inputs[0]: torch.from_numpy(x)})[out].numpy()
    assert got.dtype == np.dtype(dst) and got.tobytes() == x.view(dst).tobytes()


def test_bitcast_between_widths_is_refused():
    g = helper.make_graph([helper.make_node("BitCast", ["x"], ["y"], to=TensorProto.INT64)], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                          [helper.make_tensor_value_info("y", TensorProto.INT64, [4])])
    with pytest.raises(CaptureError, match="same bit-width"):
        import_onnx(helper.make_model(g, opset_imports=[helper.make_opsetid("", 26)]))


def test_tensor_scatter_over_a_dynamic_batch_checks_its_write_indices(tmp_path):
    """A symbolic batch compiles (the write keeps the cache's type at every size); a write past
    the cache's end in linear mode is refused before the plan runs, naming the input and range."""
    import graphmode
    from graphmode.errors import ContractViolation
    onnx_path = tmp_path / "cache.onnx"
    from onnx import save
    io = [helper.make_tensor_value_info("past", TensorProto.FLOAT, ["batch", 3, 8, 4]),
          helper.make_tensor_value_info("upd", TensorProto.FLOAT, ["batch", 3, 2, 4]),
          helper.make_tensor_value_info("w", TensorProto.INT64, ["batch"])]
    g = helper.make_graph([helper.make_node("TensorScatter", ["past", "upd", "w"], ["present"])], "g", io,
                          [helper.make_tensor_value_info("present", TensorProto.FLOAT, ["batch", 3, 8, 4])])
    save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 24)]), onnx_path)
    cm = graphmode.compile(str(onnx_path))
    for b in (1, 3):
        past, upd, w = torch.randn(b, 3, 8, 4), torch.randn(b, 3, 2, 4), torch.arange(b) * 3
        want = past.clone()
        for i in range(b):
            want[i, :, w[i]:w[i] + 2] = upd[i]
        assert torch.equal(cm(past=past, upd=upd, w=w), want)
    with pytest.raises(ContractViolation, match=r"'w' holds 7 .* valid range \[0, 6\].*writes into the 8 rows"):
        cm(past=torch.zeros(2, 3, 8, 4), upd=torch.zeros(2, 3, 2, 4), w=torch.tensor([0, 7]))


@pytest.mark.parametrize("with_mask", [False, True])
def test_deform_conv_samples_each_tap_at_its_offset(with_mask):
    """DeformConv against ONNX Runtime: groups and offset groups, stride, dilation, pads, offsets
    that leave the image (zeros there), a mask and a bias."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 4, 7, 6), dtype=np.float32)
    w = rng.standard_normal((6, 2, 3, 2), dtype=np.float32)
    oh, ow = (7 + 2 - 5) // 2 + 1, (6 + 2 - 2) // 1 + 1        # dilation 2 on H: a 5-tall window
    feeds = {"x": x, "w": w, "off": (rng.standard_normal((2, 2 * 2 * 6, oh, ow)) * 2).astype(np.float32),
             "b": rng.standard_normal(6).astype(np.float32)}
    if with_mask:
        feeds["mask"] = rng.random((2, 2 * 6, oh, ow), dtype=np.float32)
    _check("DeformConv", feeds, opset=22, group=2, offset_group=2, strides=[2, 1], dilations=[2, 1],
           pads=[1, 1, 1, 1], kernel_shape=[3, 2])


def test_tile_by_a_count_computed_from_a_dim_repeats_a_table_batch_times():
    """DeBERTa-v2's dynamo export: relative positions [2, 3] tiled [batch, 1] ("Tile repeats must
    be concrete integers"); ONNX Runtime runs it."""
    table = numpy_helper.from_array(np.arange(6, dtype=np.float32).reshape(2, 3), "table")
    nodes = [helper.make_node("Shape", ["x"], ["shape"]),
             helper.make_node("Gather", ["shape", "zero"], ["b"], axis=0),
             helper.make_node("Concat", ["b", "one"], ["reps"], axis=0),
             helper.make_node("Tile", ["table", "reps"], ["y"])]
    consts = [table, numpy_helper.from_array(np.array([0], dtype=np.int64), "zero"),
              numpy_helper.from_array(np.array([1], dtype=np.int64), "one")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], consts)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    graph, _ = import_onnx(m, dims={"batch": (1, 8)})
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    for b in (1, 3):
        x = np.zeros((b, 4), dtype=np.float32)
        got = interpret(graph, {graph.inputs[0]: torch.from_numpy(x)})[graph.outputs[0]].numpy()
        assert np.array_equal(got, sess.run(None, {"x": x})[0])
