"""An index by an arange grid, as dynamo exports it (transformers' masks:
`mask[arange(B)[:, None], arange(S)]`, a GatherND over a concat of the two aranges): the importer
indexes by the concat's columns, so the padding analysis still sees aranges over the padded
dims. Before, a slice of the concat hid them, and every dynamo-exported BERT was drafted with
batch and seq unsafe to pad (requests between buckets went to ONNX Runtime)."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from torch.export import Dim

import graphmode
from graphmode.kb.draft import draft_recipe

ort = pytest.importorskip("onnxruntime")


class _GridMasked(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(16, 16)

    def forward(self, x, mask):
        b, s = mask.shape
        keep = mask.bool()[torch.arange(b)[:, None], torch.arange(s)[None, :]]     # transformers' mask gather
        h = self.proj(x) * keep[..., None]
        return h.sum(1) / keep.sum(1, keepdim=True)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    path = tmp_path_factory.mktemp("grid") / "grid.onnx"
    x, mask = torch.randn(2, 8, 16), torch.ones(2, 8, dtype=torch.long)
    b, s = Dim("batch", max=16), Dim("seq", max=32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(_GridMasked().eval(), (x, mask), str(path), input_names=["x", "mask"], output_names=["y"],
                          dynamic_shapes={"x": {0: b, 1: s}, "mask": {0: b, 1: s}}, dynamo=True)
    return str(path)


def test_a_dynamo_index_grid_is_safe_to_pad_and_matches_onnxruntime(exported, tmp_path):
    import onnx
    assert "GatherND" in {n.op_type for n in onnx.load(exported).graph.node}     # the exporter's form
    d = draft_recipe(exported, record=False)
    lines = " ".join(d.verdict.lines())
    assert "padding batch: safe" in lines and "padding seq: safe" in lines, lines
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cm = graphmode.compile(exported, d.recipe, cache_dir=tmp_path)
    sess = ort.InferenceSession(exported)
    g = torch.Generator().manual_seed(1)
    for b, s in [(3, 5), (1, 7), (2, 13)]:
        x, mask = torch.randn(b, s, 16, generator=g), torch.ones(b, s, dtype=torch.long)
        mask[0, s // 2:] = 0                              # a request's own padding
        got = cm(x=x, mask=mask)
        got = got[0] if isinstance(got, (list, tuple)) else got
        np.testing.assert_allclose(got.numpy(), sess.run(None, {"x": x.numpy(), "mask": mask.numpy()})[0],
                                   rtol=1e-5, atol=1e-5)
        assert cm.last_path["path"] == "graph" and cm.last_path["bucket"] != {"batch": b, "seq": s}
