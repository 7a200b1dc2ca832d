"""ONNX RNN unrolled over a static sequence (capture/onnx/convert_recurrent.py), against ONNX
Runtime: directions, activations, biases, an initial state, batch-major layout, a symbolic batch;
what it does not cover is refused by name."""
from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from graphmode.capture.onnx import import_onnx
from graphmode.errors import CaptureError
from graphmode.ir.interpreter import interpret

F = TensorProto.FLOAT
SEQ, BATCH, IN, HID = 4, 3, 5, 6


def _model(attrs: dict, dirs: int, layout: int = 0, with_h0: bool = True):
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((dirs, HID, IN)).astype(np.float32) * 0.5, "W"),
             numpy_helper.from_array(rng.standard_normal((dirs, HID, HID)).astype(np.float32) * 0.5, "R"),
             numpy_helper.from_array(rng.standard_normal((dirs, 2 * HID)).astype(np.float32), "B")]
    x_shape = ["batch", SEQ, IN] if layout else [SEQ, "batch", IN]
    inputs = [helper.make_tensor_value_info("X", F, x_shape)]
    ins = ["X", "W", "R", "B", ""]
    if with_h0:
        inputs.append(helper.make_tensor_value_info("H0", F, ["batch", dirs, HID] if layout else [dirs, "batch", HID]))
        ins.append("H0")
    node = helper.make_node("RNN", ins, ["Y", "Y_h"], hidden_size=HID, layout=layout, **attrs)
    g = helper.make_graph([node], "g", inputs, [helper.make_tensor_value_info("Y", F, [None] * 4),
                                                helper.make_tensor_value_info("Y_h", F, [None] * 3)], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 22)])


CASES = [({}, 1, 0, False), ({"direction": "reverse", "activations": ["Relu"]}, 1, 0, True),
         ({"direction": "bidirectional", "activations": ["Sigmoid", "Tanh"]}, 2, 0, True),
         ({"direction": "bidirectional"}, 2, 1, True)]


@pytest.mark.parametrize("attrs,dirs,layout,with_h0", CASES)
def test_rnn_matches_onnxruntime(attrs, dirs, layout, with_h0):
    m = _model(attrs, dirs, layout, with_h0)
    rng = np.random.default_rng(1)
    feeds = {"X": rng.standard_normal((BATCH, SEQ, IN) if layout else (SEQ, BATCH, IN)).astype(np.float32)}
    if with_h0:
        feeds["H0"] = rng.standard_normal((BATCH, dirs, HID) if layout else (dirs, BATCH, HID)).astype(np.float32)
    if layout:      # ORT has no batch-major RNN: the sequence-major model on transposed data, transposed back
        ref = _model(attrs, dirs, 0, with_h0)
        ref_feeds = {"X": feeds["X"].transpose(1, 0, 2), "H0": feeds["H0"].transpose(1, 0, 2)}
        y, y_h = ort.InferenceSession(ref.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, ref_feeds)
        want = [y.transpose(2, 0, 1, 3), y_h.transpose(1, 0, 2)]
    else:
        want = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    graph, _ = import_onnx(m)
    got = interpret(graph, {v: torch.from_numpy(feeds[k]) for v, k in zip(graph.inputs, feeds)})
    for out, w in zip(graph.outputs, want):
        assert tuple(got[out].shape) == w.shape
        assert np.allclose(got[out].numpy(), w, rtol=1e-5, atol=1e-5)


def test_rnn_clip_is_refused_by_name():
    with pytest.raises(CaptureError, match="clip"):
        import_onnx(_model({"clip": 1.0}, 1))


def _gated(op: str, attrs: dict, dirs: int, extra_inputs: int):
    """A GRU (3 gates) or LSTM (4 gates) node with biases, initial states and, for LSTM, peepholes."""
    gates = 3 if op == "GRU" else 4
    rng = np.random.default_rng(2)
    inits = [numpy_helper.from_array(rng.standard_normal((dirs, gates * HID, IN)).astype(np.float32) * 0.5, "W"),
             numpy_helper.from_array(rng.standard_normal((dirs, gates * HID, HID)).astype(np.float32) * 0.5, "R"),
             numpy_helper.from_array(rng.standard_normal((dirs, 2 * gates * HID)).astype(np.float32), "B")]
    inputs = [helper.make_tensor_value_info("X", F, [SEQ, BATCH, IN]),
              helper.make_tensor_value_info("H0", F, [dirs, BATCH, HID])]
    ins = ["X", "W", "R", "B", "", "H0"]
    outs = ["Y", "Y_h"]
    if op == "LSTM":
        inputs.append(helper.make_tensor_value_info("C0", F, [dirs, BATCH, HID]))
        ins.append("C0")
        outs.append("Y_c")
        if extra_inputs:
            inits.append(numpy_helper.from_array(rng.standard_normal((dirs, 3 * HID)).astype(np.float32), "P"))
            ins.append("P")
    node = helper.make_node(op, ins, outs, hidden_size=HID, **attrs)
    ranks = {"Y": 4, "Y_h": 3, "Y_c": 3}
    g = helper.make_graph([node], "g", inputs, [helper.make_tensor_value_info(o, F, [None] * ranks[o]) for o in outs],
                          inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 22)])


GATED = [("GRU", {}, 1, 0), ("GRU", {"linear_before_reset": 1, "direction": "reverse"}, 1, 0),
         ("GRU", {"direction": "bidirectional"}, 2, 0), ("LSTM", {}, 1, 0), ("LSTM", {}, 1, 1),
         ("LSTM", {"direction": "bidirectional", "activations": ["Sigmoid", "Tanh", "Relu"] * 2}, 2, 1)]


@pytest.mark.parametrize("op,attrs,dirs,peepholes", GATED)
def test_gru_and_lstm_match_onnxruntime(op, attrs, dirs, peepholes):
    m = _gated(op, attrs, dirs, peepholes)
    rng = np.random.default_rng(3)
    feeds = {"X": rng.standard_normal((SEQ, BATCH, IN)).astype(np.float32),
             "H0": rng.standard_normal((dirs, BATCH, HID)).astype(np.float32)}
    if op == "LSTM":
        feeds["C0"] = rng.standard_normal((dirs, BATCH, HID)).astype(np.float32)
    want = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    graph, _ = import_onnx(m)
    got = interpret(graph, {v: torch.from_numpy(feeds[k]) for v, k in zip(graph.inputs, feeds)})
    assert len(graph.outputs) == len(want)
    for out, w in zip(graph.outputs, want):
        assert tuple(got[out].shape) == w.shape
        assert np.allclose(got[out].numpy(), w, rtol=1e-5, atol=1e-5)


def test_lstm_input_forget_is_refused_by_name():
    with pytest.raises(CaptureError, match="input_forget"):
        import_onnx(_gated("LSTM", {"input_forget": 1}, 1, 0))


def _with_lens(op: str, gates: int, direction: str, layout: int, x: np.ndarray):
    rng = np.random.default_rng(1)
    hid, inp, dirs = 6, x.shape[-1], 2 if direction == "bidirectional" else 1
    inits = [numpy_helper.from_array(rng.standard_normal((dirs, gates * hid, k)).astype(np.float32) * 0.5, name)
             for name, k in (("W", inp), ("R", hid))]
    inits.append(numpy_helper.from_array(rng.standard_normal((dirs, 2 * gates * hid)).astype(np.float32) * 0.1, "B"))
    outs = ["Y", "Y_h"] + (["Y_c"] if op == "LSTM" else [])
    node = helper.make_node(op, ["x", "W", "R", "B", "lens"], outs, hidden_size=hid, direction=direction,
                            layout=layout)
    io = [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x.shape)),
          helper.make_tensor_value_info("lens", TensorProto.INT32, [x.shape[1 - layout]])]
    m = helper.make_model(helper.make_graph([node], "g", io, [helper.make_value_info(o, helper.TypeProto())
                                                              for o in outs], inits),
                          opset_imports=[helper.make_opsetid("", 22)])
    return m, outs


@pytest.mark.parametrize("op,gates", [("RNN", 1), ("GRU", 3), ("LSTM", 4)])
@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
def test_sequence_lens_given_at_run_time_match_onnxruntime(op, gates, direction):
    """Shorter sequences in one batch: past its length a sequence keeps its state and outputs 0;
    the backward direction starts at its own last step (Y, Y_h and LSTM's Y_c as ORT gives them;
    layout 1, which ORT does not run, as layout 0 transposed)."""
    x = np.random.default_rng(2).standard_normal((5, 3, 4)).astype(np.float32)
    lens = np.array([5, 2, 3], np.int32)
    m, outs = _with_lens(op, gates, direction, 0, x)
    want = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x, "lens": lens})
    for layout in (0, 1):
        m, _ = _with_lens(op, gates, direction, layout, x.transpose(1, 0, 2).copy() if layout else x)
        shapes = [w.shape if not layout else (w.transpose(2, 0, 1, 3) if w.ndim == 4 else w.transpose(1, 0, 2)).shape
                  for w in want]
        for vi, shape in zip(m.graph.output, shapes):
            vi.CopyFrom(helper.make_tensor_value_info(vi.name, TensorProto.FLOAT, list(shape)))
        graph, _ = import_onnx(m)
        feed = torch.from_numpy(x.transpose(1, 0, 2).copy() if layout else x)
        got = interpret(graph, dict(zip(graph.inputs, (feed, torch.from_numpy(lens)))))
        for name, w in zip(graph.outputs, want):
            g = got[name].numpy()
            if layout:
                g = g.transpose(1, 2, 0, 3) if g.ndim == 4 else g.transpose(1, 0, 2)
            assert np.allclose(g, w, atol=1e-5), (layout, name)
