"""The common model families (small configs, random weights) compile in graph mode with no
fallback and match eager in two buckets, one of them reached by padding; their ONNX exports
compile and match ONNX Runtime. A representative slice runs by default, every family with
`-m slow`."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.utils._pytree as pytree

import graphmode
from graphmode.capture.families import FAMILIES, recipe
from graphmode.capture.spec import bundle_from_module
from graphmode.verify.numerics import rel_l2

# one of each kind of trouble: padded masks, RoPE + grouped-query attention, windows + roll,
# argmax pooling, depthwise convs + hardswish + squeeze-excite (the rest, e.g. T5's relative
# positions, Whisper's conv1d, EfficientNet's 'same' padding, run with -m slow)
FAST = ["bert", "llama", "swin", "clip_text", "mobilenet_v3"]
SLOW = [n for n in FAMILIES if n not in FAST]


def _shapes(rec: dict) -> list[dict]:
    if "seq" in rec["dims"]:
        return [{"batch": 1, "seq": 8}, {"batch": 2, "seq": 5}]      # seq 5 runs padded to the bucket 8
    return [{"batch": 1}, {"batch": 2}]


def _bundle(name: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m, ex, dims = FAMILIES[name].build()
        return bundle_from_module(m, ex, dims, name=name)


def _check(cm, b, reference) -> None:
    assert cm.capture_report.fallbacks == []
    for env in _shapes(cm.recipe.model_dump()):
        x = b.make_inputs(env, seed=3)
        got = pytree.tree_leaves(cm(**x))
        want = reference(x)
        assert cm.last_path["path"] == "graph", cm.last_path
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert g.shape == w.shape and rel_l2(g, w) < 1e-5, (cm.recipe.name, env, rel_l2(g, w))


def _torch_family(name: str, cache) -> None:
    b = _bundle(name)
    cm = graphmode.compile(b, recipe(name), cache_dir=cache)

    def eager(x):
        with torch.inference_mode():
            return list(b.module(**x))
    _check(cm, b, eager)


def _onnx_family(name: str, tmp_path, cache) -> None:
    from graphmode.capture.onnx_export import export_onnx
    b = _bundle(name)
    rec = export_onnx(b, tmp_path / f"{name}.onnx")
    cm = graphmode.compile(rec.path, recipe(name), cache_dir=cache)
    assert cm.source.module is None
    _check(cm, b, cm.source.reference)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("family-cache")


@pytest.mark.parametrize("name", FAST)
def test_family_graph_mode_matches_eager(name, cache):
    _torch_family(name, cache)


@pytest.mark.slow
@pytest.mark.parametrize("name", SLOW)
def test_family_graph_mode_matches_eager_all(name, cache):
    _torch_family(name, cache)


@pytest.mark.parametrize("name", ["llama", "swin"])
def test_family_onnx_export_matches_onnxruntime(name, tmp_path, cache):
    _onnx_family(name, tmp_path, cache)


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in FAMILIES if n not in ("llama", "swin")])
def test_family_onnx_export_matches_onnxruntime_all(name, tmp_path, cache):
    _onnx_family(name, tmp_path, cache)


def test_a_cache_in_the_output_is_dropped_with_a_notice():
    from graphmode.capture.families import _DECODER, _hf, _text
    from graphmode.capture.spec import GraphmodeNotice
    m, ex, dims = _text(_hf("LlamaForCausalLM", "LlamaConfig", **{**_DECODER, "use_cache": True}))
    with pytest.warns(GraphmodeNotice, match="use_cache=False"):
        b = bundle_from_module(m, ex, dims)
    assert b.output_names == ["logits"]
