"""A key mask beside a relative position bias, attention written out (what the classic ONNX
exporter writes for T5): the relative positions are a position x position value, but looked up
in a table of finite biases and added to a key mask broadcast over the queries, so a softmax
row is masked whole only where the mask row is all padding. Such a model's padded requests
run padded in graph mode and match ONNX Runtime; a request with a row masked whole is still
refused, and a causal triangle written out is still a query x key mask."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn

import graphmode
from graphmode.analysis.padding import analyze_padding
from graphmode.capture.onnx import import_onnx
from graphmode.errors import ContractViolation

ort = pytest.importorskip("onnxruntime")
MIN = torch.finfo(torch.float32).min


class RelBiasEncoder(nn.Module):
    """T5's attention in miniature: bias[q, k] from a table by clamped relative position, plus a
    key mask (1 - mask) * finfo.min, into two layers of softmax(q k^T + bias) v. `causal` masks
    the keys after each query too (a decoder's triangle written out)."""

    def __init__(self, causal: bool = False):
        super().__init__()
        self.bias = nn.Embedding(9, 1)
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.causal = causal

    def forward(self, x, mask):
        s = x.shape[1]
        pos = torch.arange(s)
        rel = pos[None, :] - pos[:, None]
        b = self.bias(rel.clamp(-4, 4) + 4)[..., 0]
        if self.causal:
            b = b.masked_fill(rel > 0, MIN)
        m = b[None] + (1.0 - mask[:, None, :].float()) * MIN
        for lin in self.layers:
            h = lin(x)
            x = torch.softmax(h @ h.transpose(-1, -2) + m, -1) @ h
        return x


def _export(model: nn.Module, path) -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (torch.randn(2, 6, 8), torch.ones(2, 6, dtype=torch.int64)), str(path),
                          dynamo=False, input_names=["x", "mask"], output_names=["y"], opset_version=17,
                          dynamic_axes={"x": {0: "batch", 1: "seq"}, "mask": {0: "batch", 1: "seq"}})
    return str(path)


@pytest.mark.parametrize("causal,query_key", [(False, []), (True, ["seq"])])
def test_a_key_mask_beside_a_relative_position_bias_is_no_query_key_mask(tmp_path, causal, query_key):
    torch.manual_seed(0)
    g, _ = import_onnx(_export(RelBiasEncoder(causal).eval(), tmp_path / "m.onnx"),
                       dims={"batch": (1, 4), "seq": (1, 32)})
    rep = analyze_padding(g, {"x": 0.0, "mask": 0}, ["seq"], masks=["mask"])
    assert rep.masked == ["seq"] and rep.query_key == query_key


RECIPE = {"version": 1, "name": "relbias", "exe_mode": "graph", "on_violation": "error",
          "inputs": [{"name": "x", "dtype": "f32", "shape": ["batch", "seq", 8]},
                     {"name": "mask", "dtype": "i64", "shape": ["batch", "seq"], "pad_value": 0,
                      "role": "attention_mask"}],
          "dims": {"batch": {"buckets": [2]}, "seq": {"min": 1, "buckets": [8, 16]}}}


def _run(cm, sess, x, mask):
    out = cm(x, mask)
    out = out[0] if isinstance(out, (list, tuple)) else out
    want = sess.run(None, {"x": x.numpy(), "mask": mask.numpy()})[0]
    np.testing.assert_allclose(out.detach().numpy(), want, rtol=1e-4, atol=1e-5)


def test_padded_requests_run_in_graph_mode_and_match_onnxruntime(tmp_path):
    torch.manual_seed(0)
    path = _export(RelBiasEncoder().eval(), tmp_path / "m.onnx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cm = graphmode.compile(path, RECIPE, cache_dir=tmp_path / "cache")
    assert cm.masked_dims == ["seq"] and cm.query_key_dims == []
    sess = ort.InferenceSession(path)
    x, mask = torch.randn(2, 5, 8), torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    _run(cm, sess, x, mask)
    assert cm.last_path["path"] == "graph"
    with pytest.raises(ContractViolation, match="masks a whole row"):
        cm(x, torch.tensor([[0, 0, 0, 0, 0], [1, 1, 1, 1, 1]]))


def test_t5_exported_by_the_classic_exporter_pads_requests_whose_rows_keep_a_key(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.T5Config(vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4)
    model = transformers.T5EncoderModel(cfg).eval()
    path = str(tmp_path / "t5.onnx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (torch.randint(0, 100, (2, 7)), torch.ones(2, 7, dtype=torch.int64)), path,
                          dynamo=False, input_names=["input_ids", "attention_mask"], opset_version=17,
                          dynamic_axes={"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "seq"}})
        cm = graphmode.compile(path, cache_dir=tmp_path / "cache")
    assert cm.masked_dims == ["seq"] and cm.query_key_dims == []
    sess = ort.InferenceSession(path)
    ids, mask = torch.randint(0, 100, (2, 5)), torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    out = cm(ids, mask)
    out = out if isinstance(out, torch.Tensor) else out[0]
    want = sess.run(None, {"input_ids": ids.numpy(), "attention_mask": mask.numpy()})[0]
    np.testing.assert_allclose(out.detach().numpy(), want, rtol=1e-4, atol=1e-5)
    assert cm.last_path["path"] == "graph"
    # a row masked whole is not padded: the draft runs it in ONNX Runtime (it refused it under on_violation: error)
    empty = torch.tensor([[0, 0, 0, 0, 0], [1, 1, 1, 1, 1]])
    out = cm(ids, empty)
    out = out if isinstance(out, torch.Tensor) else out[0]
    want = sess.run(None, {"input_ids": ids.numpy(), "attention_mask": empty.numpy()})[0]
    np.testing.assert_allclose(out.detach().numpy(), want, rtol=1e-4, atol=1e-5)
    assert cm.recipe.on_violation == "eager" and cm.last_path["path"] == "eager"
