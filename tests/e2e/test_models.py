"""The three real models (PyTorch and ONNX) through the whole pipeline: graph mode with
generated kernels matches eager PyTorch (or ONNX Runtime) in every bucket of the recipe."""
from __future__ import annotations

import pytest
import torch

import graphmode
from graphmode.backends.cpu.build import compiler_available
from graphmode.recipe import load_recipe
from graphmode.verify.numerics import rel_l2

TOKENS = ("input_ids", "attention_mask", "token_type_ids")


def recipe(name: str, inputs: list[dict], dims: dict) -> object:
    return load_recipe({"version": 1, "name": f"{name}-e2e", "inputs": inputs, "dims": dims, "targets": ["host"]})


CASES = {
    "minilm": (lambda: recipe("minilm", [{"name": n, "dtype": "i64", "shape": ["batch", "seq"]} for n in TOKENS],
                              {"batch": {"buckets": [1, 3]}, "seq": {"buckets": [7, 32]}}), {}),
    "gpt2": (lambda: recipe("gpt2", [{"name": n, "dtype": "i64", "shape": ["batch", "seq"]}
                                     for n in ("input_ids", "attention_mask")],
                            {"batch": {"buckets": [1, 2]}, "seq": {"buckets": [5, 16]}}), {}),
    "resnet18": (lambda: recipe("resnet18", [{"name": "pixel_values", "dtype": "f32",
                                              "shape": ["batch", 3, 96, 96]}],
                                {"batch": {"buckets": [1, 3]}}), {"image_size": 96}),
}


def _check_every_bucket(cm, make_inputs, reference) -> None:
    for env in cm.recipe.buckets():
        x = make_inputs(env)
        got = cm(**x)
        got = list(got) if isinstance(got, (tuple, list)) else [got]
        want = reference(x)
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert g.shape == w.shape
            assert rel_l2(g, w) < 1e-5, (cm.recipe.name, env, rel_l2(g, w))
        exe = cm.executable(env)
        if compiler_available():
            assert exe.generated > 0 and exe.kernel_report["fallbacks"] == {}, exe.kernel_report


# Every bucket of the built-in models is the slow set (GPT-2 74-81 s, MiniLM 30 s, ResNet-18 25 s on
# 2 cores): graph mode over every bucket with padding (tests/e2e/test_runtime.py), MiniLM padded
# (test_runtime.py) and the families (test_families.py) stay in the default run.
@pytest.mark.slow
@pytest.mark.parametrize("name", ["minilm", "gpt2", "resnet18"])
def test_pytorch_models_every_bucket(name, tmp_path):
    from graphmode.capture.zoo import build
    make_recipe, kw = CASES[name]
    b = build(name, **kw)
    cm = graphmode.compile(b, make_recipe(), cache_dir=tmp_path)
    assert cm.capture_report.fallbacks == []
    assert any(n.op == "fused" for n in cm.graph.nodes)

    def reference(x):
        with torch.inference_mode():
            out = b.module(**x)
        return list(out) if isinstance(out, (tuple, list)) else [out]
    _check_every_bucket(cm, lambda env: b.make_inputs(env, seed=sum(env.values())), reference)


# from ONNX (20-40 s each): slow set; their PyTorch twins above and the families' ONNX exports (llama,
# swin: tests/e2e/test_families.py) stay in the default run
@pytest.mark.parametrize("name", [pytest.param("minilm", marks=pytest.mark.slow),
                                  pytest.param("resnet18", marks=pytest.mark.slow)])
def test_onnx_models_every_bucket(name, tmp_path):
    from graphmode.capture.onnx_export import export_onnx
    from graphmode.capture.spec import resolve_model_spec
    from graphmode.capture.zoo import build
    make_recipe, kw = CASES[name]
    b = build(name, **kw)
    rec = export_onnx(b, tmp_path / f"{name}.onnx")
    assert resolve_model_spec(rec.path).input_names == list(b.input_names)
    cm = graphmode.compile(rec.path, make_recipe(), cache_dir=tmp_path / "cache")
    assert cm.capture_report.fallbacks == [] and cm.source.module is None
    _check_every_bucket(cm, lambda env: b.make_inputs(env, seed=1), cm.source.reference)
