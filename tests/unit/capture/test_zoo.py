"""Model zoo, model-spec resolution and ONNX export (graphmode.capture.zoo/spec/onnx_export)."""
from __future__ import annotations

import textwrap
import time

import pytest
import torch
from torch import nn

from graphmode.capture import onnx_export, zoo
from graphmode.capture.spec import OnnxModelSpec, as_model, bundle_from_module, resolve_model_spec
from graphmode.capture.zoo import ModelBundle
from graphmode.errors import CaptureError


# ------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def minilm() -> ModelBundle:
    return zoo.build("minilm")


@pytest.fixture(scope="module")
def resnet() -> ModelBundle:
    return zoo.build("resnet18")


@pytest.fixture(scope="module")
def gpt2() -> ModelBundle:
    return zoo.build("gpt2")


@pytest.fixture
def user_pkg(tmp_path, monkeypatch):
    """An importable package `zoo_user_models` with good and bad model functions."""
    (tmp_path / "zoo_user_models.py").write_text(textwrap.dedent("""
        import torch
        from torch import nn

        class Tiny(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(8, 4)
            def forward(self, x, y):
                return {"a": self.fc(x) + y, "b": torch.relu(x)}

        def build_tiny():
            torch.manual_seed(0)
            return Tiny(), (torch.randn(3, 8), torch.randn(3, 4))

        def build_tiny_dims():
            torch.manual_seed(0)
            return (Tiny(), {"x": torch.randn(3, 8), "y": torch.randn(3, 4)},
                    {"x": ["batch", 8], "y": ["batch", 4]})

        def returns_int():
            return 42

        def returns_module():
            return Tiny()

        def returns_bad_module():
            return "not a module", (torch.randn(2),)

        def raises():
            raise RuntimeError("boom")

        def returns_non_tensor_output():
            class M(nn.Module):
                def forward(self, x):
                    return "text"
            return M(), (torch.randn(2),)

        NOT_CALLABLE = 3
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def _out_shape(bundle: ModelBundle, name: str, shape: dict[str, int]) -> list[int]:
    return [d if isinstance(d, int) else shape[d] for d in bundle.output_dims[name]]


# ---------------------------------------------------------------------------- built-ins


@pytest.mark.parametrize("name,shapes", [
    ("minilm", [{"batch": 2, "seq": 16}, {"batch": 1, "seq": 7}]),
    ("gpt2", [{"batch": 2, "seq": 8}, {"batch": 1, "seq": 3}]),
    ("resnet18", [{"batch": 2}, {"batch": 1}]),
])
def test_builtin_runs_eagerly_for_two_shapes(name, shapes, request):
    b = request.getfixturevalue({"resnet18": "resnet", "gpt2": "gpt2", "minilm": "minilm"}[name])
    assert b.name == name and not b.module.training
    assert b.source == f"builtin:{name}"
    assert set(b.example_inputs) == set(b.input_dims) == set(b.input_names)
    for shp in shapes:
        outs = b.run(b.make_inputs(shp, seed=1))
        assert isinstance(outs, tuple) and len(outs) == len(b.output_names)
        for oname, o in zip(b.output_names, outs):
            assert list(o.shape) == _out_shape(b, oname, shp)
            assert o.dtype == torch.float32 and torch.isfinite(o).all()


def test_builtin_signatures_match_recipes(minilm, gpt2, resnet):
    assert minilm.input_dims == {n: ["batch", "seq"] for n in
                                 ("input_ids", "attention_mask", "token_type_ids")}
    assert minilm.output_names == ["last_hidden_state", "pooler_output"]
    assert gpt2.input_dims == {"input_ids": ["batch", "seq"], "attention_mask": ["batch", "seq"]}
    assert gpt2.output_names == ["logits"]
    assert resnet.input_dims == {"pixel_values": ["batch", 3, 224, 224]}  # resnet18_cpu.yaml
    assert resnet.output_names == ["logits"] and resnet.dim_names == ["batch"]
    for b in (minilm, gpt2):
        assert all(t.dtype == torch.int64 for t in b.example_inputs.values())
        assert b.dim_names == ["batch", "seq"]
        assert min(b.example_shape().values()) >= 2  # torch.export's 0/1 specialisation
    assert resnet.example_inputs["pixel_values"].dtype == torch.float32
    assert minilm.tokenizer is not None and gpt2.tokenizer is None


@pytest.mark.parametrize("name,recipe", [("minilm", "minilm_cpu"), ("gpt2", "gpt2_decoder"),
                                         ("resnet18", "resnet18_cpu")])
def test_builtin_inputs_match_shipped_recipes(name, recipe, request):
    import yaml
    from pathlib import Path
    path = Path(__file__).resolve().parents[3] / "examples" / "recipes" / f"{recipe}.yaml"
    if not path.exists():
        pytest.skip(f"{path} not shipped")
    doc = yaml.safe_load(path.read_text())
    b = request.getfixturevalue({"resnet18": "resnet", "gpt2": "gpt2", "minilm": "minilm"}[name])
    declared = {i["name"]: i["shape"] for i in doc["inputs"]}
    assert {k: declared.get(k) for k in b.input_dims} == b.input_dims
    for oname, dims in (doc.get("outputs") or {}).items():
        if oname in b.output_dims:
            assert b.output_dims[oname] == dims


@pytest.mark.parametrize("fixture,vocab", [("minilm", 30522), ("gpt2", 50257)])
def test_make_inputs_respects_shape_vocab_and_padding(fixture, vocab, request):
    b = request.getfixturevalue(fixture)
    inp = b.make_inputs({"batch": 4, "seq": 10}, seed=3)
    assert set(inp) == set(b.input_dims)
    for t in inp.values():
        assert t.shape == (4, 10) and t.dtype == torch.int64
    ids, mask = inp["input_ids"], inp["attention_mask"]
    assert int(ids.min()) >= 0 and int(ids.max()) < vocab
    assert set(mask.unique().tolist()) <= {0, 1}
    assert bool(mask[0].all())                      # row 0 unpadded
    for i in range(1, 4):                           # rows > 0: padding at the end only
        row = mask[i]
        n = int(row.sum())
        assert 1 <= n < 10
        assert row[:n].all() and not row[n:].any()
    if "token_type_ids" in inp:
        assert not inp["token_type_ids"].any()
    again = b.make_inputs({"batch": 4, "seq": 10}, seed=3)
    other = b.make_inputs({"batch": 4, "seq": 10}, seed=4)
    assert all(torch.equal(inp[k], again[k]) for k in inp)
    assert not torch.equal(inp["input_ids"], other["input_ids"])


def test_make_inputs_images_and_errors(resnet):
    x = resnet.make_inputs({"batch": 3}, seed=0)["pixel_values"]
    assert x.shape == (3, 3, 224, 224) and x.dtype == torch.float32
    assert 0.9 < float(x.std()) < 1.1
    with pytest.raises(CaptureError, match="batch"):
        resnet.make_inputs({}, seed=0)
    with pytest.raises(CaptureError, match="positive"):
        resnet.make_inputs({"batch": 0}, seed=0)
    assert resnet.shape_of(resnet.make_inputs({"batch": 5})) == {"batch": 5}
    with pytest.raises(CaptureError, match="expected 224"):
        resnet.shape_of({"pixel_values": torch.zeros(1, 3, 32, 32)})


def test_resnet_is_deterministic_and_has_nontrivial_bn():
    state = torch.random.get_rng_state()
    a, b, c = zoo.build("resnet18", 0), zoo.build("resnet18", 0), zoo.build("resnet18", 1)
    assert torch.equal(state, torch.random.get_rng_state())  # caller's RNG untouched
    sa, sb, sc = (m.module.state_dict() for m in (a, b, c))
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["net.conv1.weight"], sc["net.conv1.weight"])
    bns = [m for m in a.module.modules() if isinstance(m, nn.BatchNorm2d)]
    assert len(bns) == 20
    for bn in bns:  # BN folding must actually change the numbers
        assert bn.running_mean.abs().max() > 0.05
        assert (bn.running_var - 1).abs().max() > 0.05
        assert (bn.weight - 1).abs().max() > 0.05 and bn.bias.abs().max() > 0.01
    assert sum(p.numel() for p in a.module.parameters()) == 11_689_512  # = torchvision's
    assert torch.equal(a.run()[0], b.run()[0])


def test_gpt2_is_deterministic():
    small = {"n_layer": 1, "n_embd": 64, "n_head": 2, "vocab_size": 500, "n_positions": 64}
    a = zoo.build("gpt2", 7, config_overrides=small)
    b = zoo.build("gpt2", 7, config_overrides=small)
    c = zoo.build("gpt2", 8, config_overrides=small)
    sa, sb, sc = (m.module.state_dict() for m in (a, b, c))
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert any(not torch.equal(sa[k], sc[k]) for k in sa)
    assert torch.equal(a.run()[0], b.run()[0])


def test_minilm_cosine_with_shipped_tokenizer(minilm):
    tok = minilm.tokenizer
    enc = tok(["A man is eating food.", "A man is eating a piece of bread."],
              padding=True, return_tensors="pt")
    assert enc["attention_mask"][0].sum() < enc["attention_mask"][1].sum()  # row 0 padded
    hidden, pooled = minilm.run(dict(enc))
    assert pooled.shape == (2, 384) and pooled.abs().max() <= 1  # tanh(dense(CLS))
    emb = zoo.sentence_embeddings(hidden, enc["attention_mask"])
    assert emb.shape == (2, 384)
    assert torch.allclose(emb.norm(dim=1), torch.ones(2), atol=1e-5)
    cos = float(emb[0] @ emb[1])
    assert cos == pytest.approx(0.755, abs=0.01)


def test_sentence_embeddings_ignore_padding(minilm):
    tok = minilm.tokenizer
    one = tok(["A man is eating food."], return_tensors="pt")
    padded = tok(["A man is eating food."], padding="max_length", max_length=24,
                 return_tensors="pt")
    e1 = zoo.sentence_embeddings(minilm.run(dict(one))[0], one["attention_mask"])
    e2 = zoo.sentence_embeddings(minilm.run(dict(padded))[0], padded["attention_mask"])
    assert torch.allclose(e1, e2, atol=1e-5)


def test_build_unknown_name():
    with pytest.raises(CaptureError) as ei:
        zoo.build("vgg16")
    assert "vgg16" in str(ei.value) and "resnet18" in str(ei.value)


# -------------------------------------------------------------------------- torch.export


@pytest.mark.parametrize("fixture", ["resnet", "minilm"])
def test_torch_export_dynamic_and_symbol_map(fixture, request):
    b = request.getfixturevalue(fixture)
    ep = zoo.export_program(b, decompose="high_level")
    smap = zoo.dim_symbol_map(ep, b.input_dims)
    assert sorted(smap.values()) == sorted(b.dim_names)
    ranges = {smap[str(k)]: (int(v.lower), int(v.upper)) for k, v in ep.range_constraints.items()}
    assert ranges["batch"] == (1, 32)
    shp = {"batch": 3, "seq": 5} if "seq" in b.dim_names else {"batch": 3}
    inp = b.make_inputs(shp, seed=2)
    got = ep.module()(**inp)[0]
    assert onnx_export.rel_l2(got, b.run(inp)[0]) < 1e-6


def test_dynamic_shapes_rejects_size_one_examples(resnet):
    b1 = zoo.build("resnet18", batch=1)
    with pytest.raises(CaptureError, match="size < 2"):
        b1.dynamic_shapes()
    assert b1.dynamic_shapes(static=("batch",)) == {"pixel_values": {}}
    ds = resnet.dynamic_shapes({"batch": (2, 8)})
    assert ds["pixel_values"][0].min == 2 and ds["pixel_values"][0].max == 8


# ---------------------------------------------------------------------------- specs


def test_resolve_builtin_names_and_aliases():
    b = resolve_model_spec("ResNet-18", seed=3)
    assert isinstance(b, ModelBundle) and b.name == "resnet18"
    assert torch.equal(b.module.state_dict()["net.fc.weight"],
                       zoo.build("resnet18", 3).module.state_dict()["net.fc.weight"])


@pytest.mark.parametrize("spec,needles", [
    ("mobilenet", ["mobilenet", "minilm", "gpt2", "resnet18", ".onnx", "module:function"]),
    ("minilmm", ["did you mean 'minilm'"]),
    ("", ["empty"]),
])
def test_unknown_spec_lists_builtins(spec, needles):
    with pytest.raises(CaptureError) as ei:
        resolve_model_spec(spec)
    msg = str(ei.value)
    for n in needles:
        assert n in msg, msg


def test_missing_onnx_file_names_path(tmp_path):
    p = tmp_path / "nope" / "model.onnx"
    with pytest.raises(CaptureError) as ei:
        resolve_model_spec(str(p))
    assert str(p) in str(ei.value) and "not found" in str(ei.value)


def test_corrupt_onnx_file(tmp_path):
    p = tmp_path / "bad.onnx"
    p.write_bytes(b"\x00\x01 this is not protobuf \xff" * 10)
    with pytest.raises(CaptureError) as ei:
        resolve_model_spec(str(p))
    assert "bad.onnx" in str(ei.value)


def test_spec_not_a_string():
    with pytest.raises(CaptureError, match="string"):
        resolve_model_spec(42)  # type: ignore[arg-type]


def test_directory_and_unsupported_file(tmp_path):
    with pytest.raises(CaptureError, match="directory"):
        resolve_model_spec(str(tmp_path))
    f = tmp_path / "weights.pt"
    f.write_bytes(b"x")
    with pytest.raises(CaptureError, match="unsupported model file type"):
        resolve_model_spec(str(f))
    gm = tmp_path / "m.gm"                       # it said: give an .onnx file
    gm.write_bytes(b"x")
    with pytest.raises(CaptureError, match="a saved .gm holds plans compiled already") as e:
        resolve_model_spec(str(gm))
    assert "graphmode run" in e.value.fix


def test_callable_spec_returning_tuple(user_pkg):
    b = resolve_model_spec("zoo_user_models:build_tiny")
    assert isinstance(b, ModelBundle)
    assert b.name == "tiny" and b.input_names == ["x", "y"]
    assert b.input_dims == {"x": [3, 8], "y": [3, 4]}
    assert b.output_names == ["a", "b"]
    a, r = b.run()
    assert a.shape == (3, 4) and r.shape == (3, 8)
    assert b.source == "callable:zoo_user_models:build_tiny"


def test_callable_spec_with_dims_exports_dynamically(user_pkg):
    b = resolve_model_spec("zoo_user_models:build_tiny_dims")
    assert b.input_dims == {"x": ["batch", 8], "y": ["batch", 4]}
    ep = zoo.export_program(b)
    assert list(zoo.dim_symbol_map(ep, b.input_dims).values()) == ["batch"]
    inp = b.make_inputs({"batch": 5})
    assert [tuple(t.shape) for t in ep.module()(**inp)] == [(5, 4), (5, 8)]


def test_callable_spec_from_py_file(user_pkg):
    b = resolve_model_spec(f"{user_pkg / 'zoo_user_models.py'}:build_tiny")
    assert b.output_names == ["a", "b"]
    with pytest.raises(CaptureError, match="needs the function"):
        resolve_model_spec(str(user_pkg / "zoo_user_models.py"))


def test_a_py_file_spec_imports_the_modules_beside_it(tmp_path):
    """`models_ex.py` doing `import sibling_layers_xyz` (a file in its folder) failed with
    ModuleNotFoundError, though `python models_ex.py` runs: its folder is on sys.path now."""
    (tmp_path / "sibling_layers_xyz.py").write_text("import torch\nWIDTH = 6\n")
    (tmp_path / "models_ex.py").write_text(textwrap.dedent("""
        import torch
        import sibling_layers_xyz

        def build():
            return torch.nn.Linear(sibling_layers_xyz.WIDTH, 2), (torch.randn(1, sibling_layers_xyz.WIDTH),)
    """))
    b = resolve_model_spec(f"{tmp_path / 'models_ex.py'}:build")
    assert tuple(next(iter(b.example_inputs.values())).shape) == (1, 6)


@pytest.mark.parametrize("spec,needles", [
    ("no_such_pkg_xyz.models:build", ["no_such_pkg_xyz", "PYTHONPATH"]),
    ("zoo_user_models:biuld_tiny", ["biuld_tiny", "build_tiny"]),
    ("zoo_user_models:returns_int", ["returns_int", "int", "example_inputs"]),
    ("zoo_user_models:returns_module", ["bare Tiny", "example_inputs", "--recipe"]),
    ("zoo_user_models:returns_bad_module", ["str", "nn.Module"]),
    ("zoo_user_models:raises", ["raises()", "RuntimeError", "boom"]),
    ("zoo_user_models:returns_non_tensor_output", ["not made of tensors"]),
    ("zoo_user_models:NOT_CALLABLE", ["not callable"]),
    ("1bad.mod:fn", ["not a Python module path"]),
    ("/no/such/file.py:fn", ["not found", "/no/such/file.py"]),
])
def test_bad_callable_specs(user_pkg, spec, needles):
    with pytest.raises(CaptureError) as ei:
        resolve_model_spec(spec)
    msg = str(ei.value)
    assert spec in msg  # names the spec
    for n in needles:
        assert n in msg, msg
    assert ei.value.fix  # and says how to fix it


def test_a_spec_returning_a_module_alone_compiles_from_the_recipe(user_pkg, tmp_path):
    """'pkg.mod:fn' whose fn returns the module alone: with a recipe declaring its inputs it
    compiles like a module handed to graphmode.compile (inputs from the recipe)."""
    import graphmode
    from graphmode.capture.source import resolve_model
    from graphmode.recipe import load_recipe
    rec = load_recipe({"version": 1, "name": "bare", "targets": ["host"], "exe_mode": "graph",
                       "inputs": [{"name": "x", "dtype": "f32", "shape": ["batch", 8]},
                                  {"name": "y", "dtype": "f32", "shape": ["batch", 4]}],
                       "dims": {"batch": {"buckets": [2, 3]}}})
    assert list(resolve_model("zoo_user_models:returns_module", rec).example_inputs) == ["x", "y"]
    cm = graphmode.compile("zoo_user_models:returns_module", rec, cache_dir=tmp_path)
    x, y = torch.randn(3, 8), torch.randn(3, 4)
    from torch.utils._pytree import tree_leaves
    got, want = tree_leaves(cm(x=x, y=y)), tree_leaves(cm.source.module(x=x, y=y))
    assert len(got) == len(want) == 2
    for g, w in zip(got, want):
        assert torch.allclose(g, w, rtol=1e-5, atol=1e-6)


def test_a_spec_returning_a_hugging_face_model_alone_takes_its_inputs_from_the_config(tmp_path, monkeypatch):
    transformers = pytest.importorskip("transformers")
    (tmp_path / "hf_user_model.py").write_text(
        "import transformers\n"
        "def build():\n"
        "    cfg = transformers.BertConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,\n"
        "                                  num_attention_heads=2, vocab_size=50)\n"
        "    return transformers.BertModel(cfg).eval()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    b = as_model("hf_user_model:build")
    assert "BertModel" in type(b.module).__name__ and "input_ids" in b.input_names
    assert b.source == "callable:hf_user_model:build"


def test_bundle_from_module_validates():
    m = nn.Linear(4, 2)
    with pytest.raises(CaptureError, match="not tensors"):
        bundle_from_module(m, {"x": [1, 2]})
    with pytest.raises(CaptureError, match="input_dims"):
        bundle_from_module(m, {"x": torch.randn(2, 4)}, {"z": ["batch", 4]})
    with pytest.raises(CaptureError, match="failed.*unexpected keyword"):
        bundle_from_module(m, {"x": torch.randn(2, 4)})
    with pytest.raises(CaptureError, match="failed"):
        bundle_from_module(m, {"input": torch.randn(2, 5)})
    b = bundle_from_module(m, torch.randn(2, 4), {"input": ["batch", 4]})
    assert b.input_names == ["input"] and b.output_names == ["output"]


def test_a_fixed_axis_marked_none_takes_the_examples_size():
    """torch.export's dynamic_shapes mark a fixed axis None; graphmode read None as a dim's name
    ("dim None is 3 in one input and 32 in 'x'", trial U)."""
    b = bundle_from_module(nn.Conv2d(3, 4, 3), {"input": torch.randn(2, 3, 8, 8)},
                           {"input": ["batch", None, None, None]})
    assert b.input_dims == {"input": ["batch", 3, 8, 8]} and b.dim_names == ["batch"]


# ------------------------------------------------------------------------------- ONNX


def _check_onnx(bundle: ModelBundle, tmp_path, shapes) -> onnx_export.ExportRecord:
    rec = onnx_export.export_onnx(bundle, tmp_path / f"{bundle.name}.onnx", dynamic=True)
    spec = resolve_model_spec(rec.path)
    assert isinstance(spec, OnnxModelSpec)
    assert spec.input_names == list(bundle.input_dims)
    assert spec.input_dims == bundle.input_dims      # dim_params named like the recipe
    assert spec.output_names == bundle.output_names
    for r in onnx_export.verify_onnx(bundle, rec.path, shapes, seed=5):
        assert r["rel_l2"] < 1e-5, r
    return rec


def test_onnx_resnet18_matches_eager(resnet, tmp_path):
    rec = _check_onnx(resnet, tmp_path, [{"batch": 1}, {"batch": 3}])
    assert rec.exporter == "torchscript" and rec.opset == 17
    ops = onnx_export.onnx_op_types(rec.path)
    assert ops["Conv"] == 20 and "BatchNormalization" not in ops  # BN folded by the exporter
    spec = resolve_model_spec(rec.path)
    assert spec.input_dtypes == {"pixel_values": torch.float32}
    assert spec.make_inputs({"batch": 2})["pixel_values"].shape == (2, 3, 224, 224)


def test_onnx_minilm_matches_eager(minilm, tmp_path):
    rec = _check_onnx(minilm, tmp_path, [{"batch": 1, "seq": 1}, {"batch": 3, "seq": 24}])
    assert "LayerNormalization" in onnx_export.onnx_op_types(rec.path)


@pytest.mark.slow
def test_onnx_gpt2_matches_eager(gpt2, tmp_path):
    _check_onnx(gpt2, tmp_path, [{"batch": 1, "seq": 1}, {"batch": 2, "seq": 20}])


def test_onnx_cache_hit_and_corruption(resnet, tmp_path):
    cache = tmp_path / "cache"
    r1 = onnx_export.export_onnx(resnet, cache_dir=cache)
    assert not r1.cached and r1.path.startswith(str(cache))
    assert "resnet18" in r1.path and torch.__version__.replace("+", "_") in r1.path
    t = time.perf_counter()
    r2 = onnx_export.export_onnx(resnet, cache_dir=cache)
    assert r2.cached and r2.path == r1.path and time.perf_counter() - t < 1.0
    # copy out of the cache to an explicit path
    r3 = onnx_export.export_onnx(resnet, tmp_path / "out" / "r.onnx", cache_dir=cache)
    assert r3.cached and (tmp_path / "out" / "r.onnx").stat().st_size == r1.size
    # a truncated file no longer matches its sidecar: re-exported
    with open(r1.path, "r+b") as f:
        f.truncate(100)
    r4 = onnx_export.export_onnx(resnet, cache_dir=cache)
    assert not r4.cached and r4.size == r1.size
    # another seed is another key
    other = zoo.build("resnet18", 1)
    assert onnx_export.onnx_cache_key(other) != onnx_export.onnx_cache_key(resnet)


def test_onnx_exporter_fallback_to_dynamo(user_pkg, tmp_path, monkeypatch):
    b = resolve_model_spec("zoo_user_models:build_tiny_dims")

    def broken(*a, **k):
        raise RuntimeError("torchscript exporter broke")

    monkeypatch.setattr(onnx_export, "_export_torchscript", broken)
    rec = onnx_export.export_onnx(b, tmp_path / "tiny.onnx")
    assert rec.exporter == "dynamo" and "torchscript exporter broke" in rec.fallback_reason
    for r in onnx_export.verify_onnx(b, rec.path, [{"batch": 2}, {"batch": 7}]):
        assert r["rel_l2"] < 1e-6
    monkeypatch.setattr(onnx_export, "_export_dynamo", broken)
    with pytest.raises(CaptureError, match="every exporter"):
        onnx_export.export_onnx(b, tmp_path / "tiny2.onnx")
    with pytest.raises(CaptureError, match="exporter"):
        onnx_export.export_onnx(b, tmp_path / "t3.onnx", exporter="tflite")
