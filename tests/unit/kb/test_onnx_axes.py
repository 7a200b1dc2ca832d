"""Drafts for an ONNX file whose exporter named every input's axes on its own (`dynamic_axes=
{"x": [0, 1], "mask": [0, 1]}`): the per-input names of axes the graph ties are one dim, so the
draft compiles (before: "shapes ... do not broadcast ... graphmode cannot know they are equal"),
axes it keeps apart stay two dims (a query and a document of their own lengths), and
`--dim batch=...` / `--dim seq=...` name the file's dynamic axes (before: refused, "an ONNX
model's axes are fixed in the file")."""
from __future__ import annotations

import warnings

import numpy as np
import onnxruntime as ort
import pytest
import torch

import graphmode
from graphmode.errors import RecipeError
from graphmode.kb.draft import draft_recipe


class Masked(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(30, 4)

    def forward(self, ids, mask):
        return (self.emb(ids) * mask.unsqueeze(-1)).sum(1)


@pytest.fixture(scope="module")
def onnx_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("axes") / "masked.onnx"
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(Masked().eval(), (torch.randint(0, 30, (2, 5)), torch.ones(2, 5)), str(path), dynamo=False,
                          input_names=["ids", "mask"], dynamic_axes={"ids": [0, 1], "mask": [0, 1]})
    return path


def test_the_exporters_per_input_axis_names_draft_as_one_dim_each(onnx_file, tmp_path):
    draft = draft_recipe(str(onnx_file), record=False)
    assert {i.name: list(i.shape) for i in draft.recipe.inputs} == {"ids": ["batch", "seq"], "mask": ["batch", "seq"]}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cm = graphmode.compile(str(onnx_file), cache_dir=tmp_path)
    ids, mask = torch.randint(0, 30, (3, 7)), torch.ones(3, 7)
    want = ort.InferenceSession(str(onnx_file)).run(None, {"ids": ids.numpy(), "mask": mask.numpy()})[0]
    np.testing.assert_allclose(cm(ids=ids, mask=mask).numpy(), want, rtol=1e-5, atol=1e-6)


def test_dims_given_name_the_files_dynamic_axes(onnx_file):
    draft = draft_recipe(str(onnx_file), record=False, ranges={"batch": (1, 8), "seq": (1, 64)})
    assert draft.recipe.dim_range("batch") == (1, 8) and draft.recipe.dim_range("seq") == (1, 64)
    with pytest.raises(RecipeError, match="no dynamic axis where dim 'h' goes"):
        draft_recipe(str(onnx_file), record=False, ranges={"h": (1, 8)})


class QueryAndDocument(torch.nn.Module):
    """Two token inputs of their own lengths, pooled apart, multiplied per row."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(30, 4)

    def forward(self, query, doc):
        return (self.emb(query).mean(1) * self.emb(doc).amax(1)).sum(-1)


def test_axes_the_graph_keeps_apart_stay_two_dims(tmp_path):
    path = tmp_path / "dual.onnx"
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(QueryAndDocument().eval(), (torch.randint(0, 30, (2, 5)), torch.randint(0, 30, (2, 9))),
                          str(path), dynamo=False, input_names=["query", "doc"],
                          dynamic_axes={"query": [0, 1], "doc": [0, 1]})
    draft = draft_recipe(str(path), record=False, ranges={"batch": (1, 4)})
    shapes = {i.name: list(i.shape) for i in draft.recipe.inputs}
    assert shapes["query"][0] == shapes["doc"][0] == "batch" and shapes["query"][1] != shapes["doc"][1], shapes
    cm = graphmode.compile(str(path), draft.recipe, cache_dir=tmp_path / "cache")
    q, d = torch.randint(0, 30, (3, 4)), torch.randint(0, 30, (3, 11))          # lengths 4 and 11 in one call
    want = ort.InferenceSession(str(path)).run(None, {"query": q.numpy(), "doc": d.numpy()})[0]
    np.testing.assert_allclose(cm(query=q, doc=d).numpy(), want, rtol=1e-5, atol=1e-6)


def _symbolic_file(path, ids_dims, mask_dims):
    """ids -> embedding rows times the unsqueezed float mask: what the axes are called is the
    file's (dynamo writes torch's symbols: `s18`, `s43`)."""
    from onnx import TensorProto, helper, numpy_helper
    table = numpy_helper.from_array(np.arange(120, dtype=np.float32).reshape(30, 4) / 50, "table")
    axes = numpy_helper.from_array(np.array([2], dtype=np.int64), "axes")
    g = helper.make_graph(
        [helper.make_node("Gather", ["table", "ids"], ["e"]), helper.make_node("Unsqueeze", ["mask", "axes"], ["m"]),
         helper.make_node("Mul", ["e", "m"], ["y"])], "sym",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ids_dims),
         helper.make_tensor_value_info("mask", TensorProto.FLOAT, mask_dims)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], initializer=[table, axes])
    import onnx
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(path))


def test_torch_export_symbols_draft_as_batch_and_seq(tmp_path):
    """A dynamo export names axes by torch's symbols, a batch of its own per input (s18, s43)
    and a sequence shared or not (s41 / s70 with s53): the draft reads batch and seq, and
    compiles (the graph ties what it multiplies)."""
    for ids_dims, mask_dims in ((["s18", "s41"], ["s43", "s41"]), (["s72", "s70"], ["s43", "s53"])):
        path = tmp_path / f"{ids_dims[1]}.onnx"
        _symbolic_file(path, ids_dims, mask_dims)
        draft = draft_recipe(str(path), record=False)
        assert {i.name: list(i.shape) for i in draft.recipe.inputs} == {"ids": ["batch", "seq"],
                                                                         "mask": ["batch", "seq"]}, ids_dims
    cm = graphmode.compile(str(path), draft.recipe, cache_dir=tmp_path / "cache")
    ids, mask = torch.randint(0, 30, (3, 7)), torch.rand(3, 7)
    want = ort.InferenceSession(str(path)).run(None, {"ids": ids.numpy(), "mask": mask.numpy()})[0]
    np.testing.assert_allclose(cm(ids=ids, mask=mask).numpy(), want, rtol=1e-5, atol=1e-6)


def test_an_image_s_made_up_axes_are_height_and_width(tmp_path):
    import onnx
    from onnx import TensorProto, helper

    from graphmode.capture.spec import as_model
    from graphmode.kb.onnx_axes import named, unified
    g = helper.make_graph([helper.make_node("Relu", ["pixel_values"], ["y"])], "img",
                          [helper.make_tensor_value_info("pixel_values", TensorProto.FLOAT, ["s99", 3, "s100", "s4"])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(tmp_path / "img.onnx"))
    assert named(unified(as_model(str(tmp_path / "img.onnx")))).input_dims == {
        "pixel_values": ["batch", 3, "height", "width"]}


def test_a_raw_audio_axis_drafts_as_seconds_of_audio(tmp_path):
    """A Wav2Vec2 file's `samples` axis drafted as 20..64 (an unnamed axis' default): every real
    clip ran in ONNX Runtime. Raw audio gets 0.1 .. 10 s at 16 kHz, as a Hugging Face model does."""
    import onnx
    from onnx import TensorProto, helper

    from graphmode.capture.hf import AUDIO_SAMPLES
    g = helper.make_graph([helper.make_node("Relu", ["input_values"], ["y"])], "audio",
                          [helper.make_tensor_value_info("input_values", TensorProto.FLOAT, ["s0", "s1"])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(tmp_path / "audio.onnx"))
    d = draft_recipe(str(tmp_path / "audio.onnx"), record=False)
    assert d.recipe.dim_range("samples") == AUDIO_SAMPLES and "16 kHz" in d.notes["dims.samples"]
