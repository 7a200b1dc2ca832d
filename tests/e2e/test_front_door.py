"""Models as users hand them: every way in (module, (module, inputs[, dims]), a Hugging Face model
from its config, an .onnx path, a ModelBundle; with and without a recipe), outputs in eager's
structure and named by it, in-place updates, static models, and drafts that validate and compile.
The zoo sweep over every architecture is `slow` (`pytest -m slow`)."""
from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
import torch.nn as nn
from transformers.utils import ModelOutput

import graphmode
from graphmode.capture.spec import bundle_from_module
from graphmode.errors import CaptureError, ContractViolation, RecipeError
from graphmode.kb.draft import MAX_DRAFT_PLANS, draft_recipe
from graphmode.verdict import ContractRefused
from graphmode.verify.numerics import rel_l2

FAST = {"codegen": {"kernel_selection": "heuristic"}}      # tactics are timed in their own tests


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).float().norm() / b.float().norm().clamp(min=1e-12))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(16, 32), nn.Linear(32, 4)

    def forward(self, x):
        return self.l2(torch.relu(self.l1(x)))


class CNN(nn.Module):
    """Static shapes only: a flatten to a fixed-size linear ties every axis."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn, self.fc = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Linear(4 * 6 * 6, 5)

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.conv(x))).reshape(1, -1))


class Structured(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        h = self.lin(x)
        return {"hidden": h, "pair": (h.sum(-1), h.amax(-1))}


def mlp_recipe(**over) -> dict:
    r = {"version": 1, "name": "mlp", "inputs": [{"name": "x", "dtype": "f32", "shape": ["batch", 16]}],
         "dims": {"batch": {"buckets": [2, 4]}}, **FAST}
    r.update(over)
    return r


def _mlp():
    torch.manual_seed(0)
    return MLP().eval()


def test_a_module_every_way_in_returns_what_eager_returns():
    m, x = _mlp(), torch.randn(3, 16)
    bundle = bundle_from_module(m, {"x": torch.randn(2, 16)}, {"x": ["batch", 16]})
    ways = {"module + recipe": (m, mlp_recipe()), "(module, inputs) + recipe": ((m, (x,)), mlp_recipe()),
            "(module, inputs, dims) + recipe": ((m, {"x": x}, {"x": ["batch", 16]}), mlp_recipe()),
            "bundle + recipe": (bundle, mlp_recipe()), "(module, inputs)": ((m, (x,)), None),
            "(module, inputs, dims)": ((m, {"x": x}, {"x": ["batch", 16]}), None), "bundle": (bundle, None)}
    for what, (model, recipe) in ways.items():
        cm = graphmode.compile(model, recipe)
        y = cm(x)
        assert isinstance(y, torch.Tensor), what                # not a 1-tuple
        assert rel(y, m(x)) < 1e-5, what
        assert cm.output_names == ["output"], what
    for examples in [(x,), x, {"x": x}]:                         # TensorRT's inputs=, OpenVINO's example_input=
        cm = graphmode.compile(m, example_inputs=examples)
        z = torch.randn(5, 16)                                   # another batch: the draft made it dynamic
        assert rel(cm(z), m(z)) < 1e-5 and rel(cm(x), m(x)) < 1e-5
    with pytest.raises(CaptureError, match="no example inputs") as e:
        graphmode.compile(m)                                     # nothing says what it takes
    assert "recipe" in e.value.fix and "example_inputs=" in e.value.fix
    with pytest.raises(CaptureError, match="cannot compile a tuple of 1"):
        graphmode.compile((m,), mlp_recipe())


@pytest.mark.parametrize("where_examples_went", ["tensor", "tuple", "dict", "list"])
def test_examples_in_the_recipe_slot_are_refused_saying_where_they_go(where_examples_went):
    """`graphmode.compile(model, x)`, as torch habits write it, reached YAML's parser: a bare
    'TypeError: a string or stream input is required'."""
    m, x = _mlp(), torch.randn(3, 16)
    given = {"tensor": x, "tuple": (x,), "dict": {"x": x}, "list": [x]}[where_examples_went]
    with pytest.raises(RecipeError, match="example inputs go in `example_inputs=`") as e:
        graphmode.compile(m, given)
    assert "graphmode.compile(model, example_inputs=(x,))" in e.value.fix
    with pytest.raises(RecipeError, match="this model already names its inputs"):
        graphmode.compile((m, (x,)), example_inputs=(x,))
    with pytest.raises(RecipeError, match="a recipe is a path, YAML text") as e:
        graphmode.compile(m, 42)
    assert e.value.value == "int"


class _MaskedMean(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.out = nn.Embedding(50, 16), nn.Linear(16, 5)

    def forward(self, ids, mask):
        h = self.out(self.emb(ids)) * mask[..., None]
        return h.sum(1) / mask.sum(1, keepdim=True)


def test_torch_export_dynamic_shapes_name_the_dims_of_a_draft():
    """`dynamic_shapes=`, as a torch.export user writes it, was a TypeError: its Dims name the
    axes (bounds become the dim's range), Dim.AUTO axes a mask shares with its ids get one name,
    and what has no counterpart (a derived dim, an unknown input, beside a recipe) is refused."""
    from torch.export import Dim
    m, ids, mask = _MaskedMean().eval(), torch.randint(0, 50, (2, 12)), torch.ones(2, 12)
    seq = Dim("seq", min=2, max=40)
    x, mk = torch.randint(0, 50, (3, 17)), torch.ones(3, 17)
    mk[0, 10:] = 0
    for ds in ({"ids": {0: Dim("batch"), 1: seq}, "mask": {0: Dim("batch"), 1: seq}},
               ({0: Dim.AUTO, 1: Dim.AUTO}, [Dim.AUTO, Dim.AUTO])):
        cm = graphmode.compile(m, example_inputs=(ids, mask), dynamic_shapes=ds)
        assert [i.shape for i in cm.recipe.inputs] == [["batch", "seq"]] * 2
        with torch.no_grad():
            assert rel_l2(cm(x, mk), m(x, mk)) < 1e-5 and cm.last_path["path"] == "graph"
    assert (cm.recipe.dims["seq"].min, cm.recipe.dims["seq"].max) != (2, 40)     # AUTO: the draft's range
    bounded = graphmode.compile(m, example_inputs=(ids, mask), dynamic_shapes={"ids": {1: seq}, "mask": {1: seq}})
    assert (bounded.recipe.dims["seq"].min, bounded.recipe.dims["seq"].max) == (2, 40)
    for ds, match in (({"idz": {0: "batch"}}, "inputs the examples do not have"), ({"ids": {1: 2 * seq}}, "derived"),
                      ({"ids": {2: "seq"}}, "no axis 2"), ([{0: "batch"}], "1 entries for 2")):
        with pytest.raises(RecipeError, match=match):
            graphmode.compile(m, example_inputs=(ids, mask), dynamic_shapes=ds)
    with pytest.raises(RecipeError, match="this call gives a recipe"):
        graphmode.compile(m, mlp_recipe(), example_inputs=(ids, mask), dynamic_shapes={"ids": {0: "batch"}})


def test_outputs_keep_their_structure_and_names():
    torch.manual_seed(0)
    m, x = Structured().eval(), torch.randn(2, 8)
    cm = graphmode.compile((m, (x,)))
    assert cm.output_names == ["hidden", "pair_0", "pair_1"]
    assert set(cm.recipe.outputs) == {"hidden", "pair_0", "pair_1"}
    y, ref = cm(x), m(x)
    assert set(y) == {"hidden", "pair"} and isinstance(y["pair"], tuple)
    assert rel(y["hidden"], ref["hidden"]) < 1e-5 and rel(y["pair"][1], ref["pair"][1]) < 1e-5
    r = {"version": 1, "name": "s", "inputs": [{"name": "x", "dtype": "f32", "shape": ["batch", 8]}],
         "outputs": {"pair_0": ["batch"]}, "dims": {"batch": {"buckets": [2]}}, **FAST}
    graphmode.compile(m, r)                                      # the names a recipe's outputs use
    r["outputs"] = {"out": ["batch"]}
    with pytest.raises(ContractRefused) as e:
        graphmode.compile(m, r)
    text = str(e.value)
    assert "has no output 'out'" in text and "(got" not in text and "pair_0" in text


@dataclasses.dataclass
class OwnOutput(ModelOutput):
    """A model's own ModelOutput subclass (outside transformers): came back as a dict."""
    logits: torch.Tensor = None
    hidden: torch.Tensor | None = None


class OwnHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 4)

    def forward(self, x):
        h = self.lin(x)
        return OwnOutput(logits=h.relu(), hidden=h)


def test_a_models_own_model_output_class_comes_back_as_itself(tmp_path):
    torch.manual_seed(0)
    m, x = OwnHead().eval(), torch.randn(2, 8)
    cm = graphmode.compile((m, (x,)))
    y, ref = cm(torch.randn(3, 8)), m(x)
    assert type(y) is OwnOutput and list(y.keys()) == ["logits", "hidden"] and y.logits.shape == (3, 4)
    y = cm(x)
    assert rel(y.logits, ref.logits) < 1e-5 and rel(y[1], ref[1]) < 1e-5 and y.to_tuple()[0] is y.logits


class Counter(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x):
        self.seen.add_(1)
        return x * 2


class TrainingNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("running_mean", torch.zeros(3))
        self.register_buffer("running_var", torch.ones(3))

    def forward(self, x):
        return torch.nn.functional.batch_norm(x, self.running_mean, self.running_var, training=True)


class Scale(nn.Module):
    def forward(self, x, y):
        x.mul_(2)                       # updates the caller's tensor
        return x + y


def test_inputs_updated_in_place_reach_the_caller_and_buffer_updates_are_refused():
    x, y = torch.ones(2, 3), torch.full((2, 3), 5.0)
    cm = graphmode.compile((Scale(), (x.clone(), y)))
    assert cm.capture_report.mutated_inputs == ["x"] and cm.output_names == ["output"]
    out = cm(x, y)
    assert torch.equal(out, torch.full((2, 3), 7.0))            # the real output, not the update
    assert torch.equal(x, torch.full((2, 3), 2.0))               # the caller's x, as eager leaves it
    with pytest.raises(CaptureError, match="updates its buffer 'seen' in place") as e:
        graphmode.compile((Counter(), (torch.ones(2, 3),)))
    assert "aten.add" in str(e.value) and "eval" in e.value.fix
    with pytest.raises(CaptureError, match="running_mean"):      # batch statistics, whatever the module's mode
        graphmode.compile(TrainingNorm(), {"version": 1, "name": "bn", **FAST,
                                           "inputs": [{"name": "x", "dtype": "f32", "shape": [4, 3]}]})


def test_an_input_updated_in_place_that_shares_memory_is_refused_by_name():
    """Eager sees `x.mul_(2)` through every argument sharing x's memory; a compiled call runs each
    input from its own copy (cm(x, x) answered rel L2 0.4 off eager), and an expanded x made
    torch's copy-back raise after the plan ran."""
    cm = graphmode.compile((Scale(), (torch.ones(2, 3), torch.ones(2, 3))))
    x = torch.ones(2, 3)
    with pytest.raises(ContractViolation, match="shares memory with input 'y'"):
        cm(x, x)
    with pytest.raises(ContractViolation, match="shares memory with input 'y'"):
        base = torch.ones(3, 3)
        cm(base[:2], base[1:])                                      # overlapping views
    with pytest.raises(ContractViolation, match="expanded tensor") as e:
        cm(torch.ones(1, 3).expand(2, 3), torch.ones(2, 3))
    assert "clone()" in e.value.fix
    assert torch.equal(x, torch.ones(2, 3))                          # refused before anything ran
    assert torch.equal(cm(x, x.clone()), torch.full((2, 3), 3.0))


def test_a_static_model_drafts_without_dims_and_saves(tmp_path):
    torch.manual_seed(0)
    m, x = CNN().eval(), torch.randn(1, 3, 8, 8)
    d = draft_recipe((m, (x,)))
    assert "dims" not in d.data and d.recipe.dims == {} and d.report.verdict == "valid"
    assert d.data["inputs"] == [{"name": "x", "dtype": "f32", "shape": [1, 3, 8, 8]}]
    assert "prepared weights" in d.notes["memory.budget_mb"]
    cm = graphmode.compile(d.source.bundle, d.recipe, cache_dir=tmp_path)
    assert rel(cm(x), m(x)) < 1e-5
    cm.save(tmp_path / "cnn.gm")
    back = graphmode.load(tmp_path / "cnn.gm", cache_dir=tmp_path)
    y = back(x)
    assert isinstance(y, torch.Tensor) and rel(y, m(x)) < 1e-5 and back.output_names == ["output"]


def static_cnn():
    """`tests/e2e/test_front_door.py:static_cnn`: the static CNN as `--model` takes it."""
    torch.manual_seed(0)
    return CNN().eval(), (torch.randn(1, 3, 8, 8),)


def _cli(*args: str):
    from typer.testing import CliRunner

    from graphmode.cli.app import _register, app
    _register()
    res = CliRunner().invoke(app, list(args))
    assert res.exit_code == 0 and "Traceback" not in res.output, res.output
    return res.output


def _static_recipe(tmp_path) -> tuple[str, str]:
    spec = f"{__file__}:static_cnn"
    out = tmp_path / "cnn.yaml"
    _cli("recipe", "init", "--model", spec, "--out", str(out), "--cache-dir", str(tmp_path))
    assert "dims:" not in out.read_text()
    return spec, str(out)


def test_a_static_model_verifies_runs_and_serves(tmp_path):
    import httpx

    from graphmode.serve import ModelServer, ServeConfig, ServerThread
    spec, recipe = _static_recipe(tmp_path)
    assert "all shapes match eager" in _cli("verify", "--model", spec, "--recipe", recipe, "--cache-dir", str(tmp_path))
    assert "│ output " in _cli("run", "--model", spec, "--recipe", recipe, "--cache-dir", str(tmp_path))
    m, (x,) = static_cnn()
    server = ModelServer(spec, recipe, config=ServeConfig(cache_dir=tmp_path))
    running = ServerThread(server).start()
    try:
        running.wait_ready(600)
        r = httpx.post(f"{running.url}/v1/infer", json={"inputs": {"x": x.tolist()}}, timeout=300)
        assert r.status_code == 200, r.text
        assert rel(torch.tensor(r.json()["outputs"]["output"]), m(x)) < 1e-5
    finally:
        running.stop()


@pytest.mark.slow
def test_a_static_model_profiles_and_benches(tmp_path):
    spec, recipe = _static_recipe(tmp_path)
    _cli("profile", "--model", spec, "--recipe", recipe, "--runs", "2", "--no-eager", "--cache-dir", str(tmp_path))
    _cli("bench", "--model", spec, "--recipe", recipe, "--quick", "--engines", "eager,graphmode", "--out",
         str(tmp_path / "bench"), "--cache-dir", str(tmp_path))


def test_recipe_init_dim_goes_on_an_axis_the_model_fixed():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Embedding(50, 8), nn.Linear(8, 4)).eval()
    ids = torch.randint(0, 50, (2, 6))
    d = draft_recipe((m, (ids,)), ranges={"seq": (2, 32)})
    assert d.data["inputs"][0]["shape"] == ["batch", "seq"] and d.data["dims"]["seq"]["max"] == 32
    d = draft_recipe((m, (ids,)), ranges={"len": (2, 16, [("input", 1)])})
    assert d.data["inputs"][0]["shape"] == ["batch", "len"]
    with pytest.raises(graphmode.errors.RecipeError, match="cannot tell which input axis") as e:
        draft_recipe((m, (ids,)), ranges={"width": (2, 16)})
    assert "@INPUT:AXIS" in e.value.fix


def test_a_recipe_whose_dims_are_wrong_is_refused_by_field_before_the_model_is_exported():
    """A dim with min above max reached torch.export, whose complaint blamed the model."""
    r = {"version": 1, "name": "minmax", "inputs": [{"name": "x", "dtype": "f32", "shape": ["batch", 16]}],
         "dims": {"batch": {"min": 8, "max": 4}}}
    with pytest.raises(graphmode.errors.RecipeErrors) as e:
        graphmode.compile(bundle_from_module(MLP().eval(), {"x": torch.randn(2, 16)}, {"x": ["batch", None]}), r)
    assert [(x.where, x.value) for x in e.value.errors] == [("dims.batch.max", 4)] and "max >= 8" in e.value.render()


@pytest.mark.parametrize("layer,shape", [(nn.Conv1d(1, 4, 10, stride=5), [2, 1, "n"]),
                                         (nn.Conv2d(3, 4, 3, stride=2, padding=1), [1, 3, "n", 16]),
                                         (nn.MaxPool2d(2), [1, 3, "n", 16]),
                                         (nn.Sequential(nn.Conv1d(1, 4, 10, stride=5), nn.Conv1d(4, 4, 2, stride=2)),
                                          [2, 1, "n"]),
                                         (nn.Sequential(nn.MaxPool2d(2), nn.MaxPool2d(2)), [1, 3, "n", 16])],
                         ids=["conv1d", "conv2d", "pool", "stacked_conv1d", "stacked_pools"])
def test_a_strided_window_over_a_dynamic_dim_compiles(layer, shape, tmp_path):
    """Its output size is a floor division of the dim: torch's FloorDiv and sympy's floor were
    compared as text, and canonicalize called the captured graph invalid ('a graphmode bug');
    stacked, torch's floor(n/10) met the IR's floor(floor(n/5)/2)."""
    r = {"version": 1, "name": "strided", "inputs": [{"name": "input", "dtype": "f32", "shape": shape}],
         "dims": {"n": {"buckets": [40, 80], "min": 40}}, "on_violation": "eager"}     # a window over padding
    cm = graphmode.compile(layer.eval(), r, cache_dir=tmp_path)
    x = torch.randn(*[80 if d == "n" else d for d in shape])
    with torch.no_grad():
        assert rel(cm(x), layer(x)) < 1e-5 and cm.last_path["path"] == "graph"


def test_a_size_divided_by_a_dim_is_proved(tmp_path):
    """nn.EmbeddingBag's offsets are arange(0, batch*seq, seq): its length, floor((b*s + s - 1)/s),
    reached the memory proof as b + 1 + floor(-1/s), and graphmode refused its own draft."""
    bag = nn.EmbeddingBag(50, 8, mode="mean").eval()
    cm = graphmode.compile((bag, (torch.randint(0, 50, (2, 5)),), {"input": ["batch", "seq"]}), cache_dir=tmp_path)
    ids = torch.randint(0, 50, (2, 5))
    assert torch.equal(cm(ids), bag(ids))


def test_an_hf_encoder_compiles_as_loaded_and_returns_its_model_output():
    import transformers as T
    torch.manual_seed(0)
    m = T.BertModel(T.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
                                 vocab_size=100, max_position_embeddings=64)).eval()
    d = draft_recipe(m)
    assert d.data["dims"]["seq"]["max"] == 64 and "config.max_position_embeddings" in d.notes["dims.seq"]
    assert [i["name"] for i in d.data["inputs"]] == ["input_ids", "attention_mask", "token_type_ids"]
    assert d.report.plans <= MAX_DRAFT_PLANS and d.report.verdict == "valid"
    # 16 plans over batch 1..32 x seq 1..64: the fewest-padding split would pad a lone request to
    # batch 2; it keeps a bucket of its own
    assert d.recipe.dim_buckets()["batch"][0] == 1 and len(d.recipe.dim_buckets()["batch"]) > 1
    assert "bucket(s) [1, " in d.notes["dims.batch"]
    cm = graphmode.compile(d.source.bundle, dict(d.data, **FAST))
    ids = torch.randint(3, 100, (2, 7))
    kw = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "token_type_ids": torch.zeros_like(ids)}
    y, ref = cm(**kw), m(**kw)
    assert type(y) is type(ref) and list(y.keys()) == ["last_hidden_state", "pooler_output"]
    assert rel(y.last_hidden_state, ref.last_hidden_state) < 1e-5 and rel(y.pooler_output, ref.pooler_output) < 1e-5


def test_inputs_an_hf_model_takes_as_optional_may_be_left_out_as_in_eager():
    """`cm(input_ids=ids)` as a user calls the transformers model: the attention mask (ones) and
    token types (zeros) eager assumes when they are None are put in, and outputs equal eager's."""
    import transformers as T
    torch.manual_seed(0)
    m = T.BertModel(T.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
                                 vocab_size=100, max_position_embeddings=64)).eval()
    cm = graphmode.compile(m, dict(draft_recipe(m).data, **FAST))
    ids = torch.randint(3, 100, (2, 7))
    y, ref = cm(input_ids=ids), m(input_ids=ids)
    assert rel(y.last_hidden_state, ref.last_hidden_state) < 1e-5 and rel(y.pooler_output, ref.pooler_output) < 1e-5
    y = cm(ids, attention_mask=torch.ones_like(ids))          # one given, one left out
    assert rel(y.last_hidden_state, ref.last_hidden_state) < 1e-5
    y = cm(input_ids=ids, attention_mask=None, token_type_ids=None)    # None, as eager takes it: left out
    assert rel(y.last_hidden_state, ref.last_hidden_state) < 1e-5


class MaskMeansDrop(nn.Module):
    """`mask=None` means "drop every position", not "keep every position": no input to fill in."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 8)

    def forward(self, ids, mask=None):
        keep = mask if mask is not None else torch.zeros_like(ids)
        return (self.emb(ids) * keep[..., None]).sum(1)


def test_an_input_whose_absence_means_something_else_is_still_required():
    from graphmode.errors import ContractViolation
    ids = torch.randint(0, 50, (2, 6))
    cm = graphmode.compile((MaskMeansDrop().eval(), {"ids": ids, "mask": torch.ones_like(ids)},
                            {"ids": ["batch", "seq"], "mask": ["batch", "seq"]}))
    with pytest.raises(ContractViolation, match="missing inputs \\['mask'\\]"):
        cm(ids=ids)
    with pytest.raises(ContractViolation, match="missing inputs \\['mask'\\]"):
        cm(ids=ids, mask=None)                                  # None is its default: as omitted, still required


class MaskFromIds(nn.Module):
    """`mask=None` means "build it from the ids" (XLM, Flaubert: ids != pad index): no one constant."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 8)

    def forward(self, ids, mask=None):
        if mask is None:
            mask = (ids != 0).long()
        m = mask[..., None].float()
        return (self.emb(ids) * m).sum(1) / m.sum(1).clamp(min=1e-9)


def test_an_input_the_model_derives_from_the_ids_is_not_filled_with_a_constant():
    """The examples hold no pad id, so without and with a mask of ones agreed there; a request
    with padded rows then got ones where eager masked them (rel L2 0.66). The check now also runs
    the examples with pad ids in them, and the omitted mask stays required, saying why."""
    from graphmode.errors import ContractViolation
    ex = {"ids": torch.randint(1, 50, (2, 8)), "mask": torch.ones(2, 8, dtype=torch.long)}
    cm = graphmode.compile((MaskFromIds().eval(), ex, {"ids": ["batch", "seq"], "mask": ["batch", "seq"]}))
    ids = torch.randint(1, 50, (2, 8))
    ids[0, 5:] = 0
    for call in (lambda: cm(ids), lambda: cm(ids, None), lambda: cm(ids=ids, mask=None)):
        with pytest.raises(ContractViolation, match="missing inputs \\['mask'\\]: forward takes"):
            call()


@pytest.mark.slow     # ~30-50 s on a busy 2-core host: several HF encoders
def test_what_a_tokenizer_returns_is_taken_and_a_parameter_left_out_is_named():
    """DeBERTa-v2 ignores token types (type_vocab_size 0), but its tokenizer returns them: a draft
    left them out and cm(**tokenizer(...)) was refused as "arguments do not match the model's
    signature", as was LayoutLM's bbox, a parameter the draft does not know to give."""
    import transformers as T
    torch.manual_seed(0)
    c = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, vocab_size=100,
             max_position_embeddings=64)
    m = T.DebertaV2Model(T.DebertaV2Config(**c)).eval()
    cm = graphmode.compile(m)
    batch = {"input_ids": torch.randint(3, 100, (2, 8)), "attention_mask": torch.ones(2, 8, dtype=torch.long),
             "token_type_ids": torch.zeros(2, 8, dtype=torch.long)}
    with torch.no_grad():
        ref = m(**batch).last_hidden_state
    assert rel(cm(**batch).last_hidden_state, ref) < 1e-5
    # a tokenizer's padded batch between buckets: the draft said seq pads safely, then refused it
    # (DeBERTa builds a query x key mask from its mask: such a request is not padded); it runs eagerly
    seq = next(v for v in range(2, 64) if v not in cm.recipe.dim_buckets()["seq"])
    padded = {k: torch.randint(3, 100, (3, seq)) if k == "input_ids" else torch.zeros(3, seq, dtype=torch.long)
              for k in batch}
    padded["attention_mask"][:, : seq // 2 + 1] = 1
    assert cm.recipe.on_violation == "eager" and "query x key mask" in cm.draft_notes["on_violation"]
    seq_line = next(x for x in cm.verdict.lines() if x.startswith("padding seq"))     # the RecipeDrafted summary's
    assert "query x key mask: a request whose mask hides any position and whose seq is off a bucket" in seq_line
    with torch.no_grad():
        assert rel(cm(**padded).last_hidden_state, m(**padded).last_hidden_state) < 1e-5
    assert cm.last_path["path"] == "eager"
    with torch.no_grad():                 # that length recurring gets a plan of its own, unpadded (exact_plans),
        for _ in range(2):                # built in the background from its third request on
            cm(**padded)
        assert cm.wait_for_builds(timeout=600)
        out = cm(**padded).last_hidden_state
        assert rel(out, m(**padded).last_hidden_state) < 1e-5
    assert cm.last_path["path"] == "graph" and cm.last_path["bucket"]["seq"] == seq
    lm = T.LayoutLMModel(T.LayoutLMConfig(**c)).eval()
    cm = graphmode.compile(lm)
    with pytest.raises(ContractViolation, match="'bbox'.* parameter of LayoutLMModel.forward that this model was not "
                                                "compiled with") as e:
        cm(input_ids=batch["input_ids"], bbox=torch.zeros(2, 8, 4, dtype=torch.long))
    assert "example inputs that include them" in e.value.fix


@pytest.mark.slow     # ~30-50 s on a busy 2-core host: a draft of every bucket
def test_a_multiple_choice_head_compiles_without_examples():
    """*ForMultipleChoice takes [batch, choices, seq]; the draft gave it [batch, seq] and said to
    check module(**example_inputs), which the user never gave."""
    import transformers as T
    torch.manual_seed(0)
    m = T.ErnieForMultipleChoice(T.ErnieConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                               intermediate_size=64, vocab_size=100, max_position_embeddings=64)).eval()
    cm = graphmode.compile(m)
    assert [list(i.shape) for i in cm.recipe.inputs][0] == ["batch", "choices", "seq"]
    ids, mask = torch.randint(3, 100, (1, 4, 10)), torch.ones(1, 4, 10, dtype=torch.long)
    with torch.no_grad():
        ref = m(input_ids=ids, attention_mask=mask).logits
    assert rel(cm(input_ids=ids, attention_mask=mask).logits, ref) < 1e-5


@pytest.mark.slow     # ~30-50 s on a busy 2-core host: CLIP: two towers
def test_a_two_tower_model_compiles_without_examples():
    """CLIPModel takes token ids and images: graphmode made the ids alone from its config, and the
    capture failed inside the vision tower ('NoneType' object has no attribute 'shape')."""
    import transformers as T
    torch.manual_seed(0)
    tower = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4)
    m = T.CLIPModel(T.CLIPConfig(text_config=dict(tower, vocab_size=99, max_position_embeddings=32),
                                 vision_config=dict(tower, image_size=32, patch_size=8))).eval()
    cm = graphmode.compile(m)
    assert [i.name for i in cm.recipe.inputs] == ["input_ids", "attention_mask", "pixel_values"]
    kw = dict(input_ids=torch.randint(3, 99, (3, 7)), attention_mask=torch.ones(3, 7, dtype=torch.long),
              pixel_values=torch.randn(3, 3, 32, 32))
    with torch.no_grad():
        ref = m(**kw)
    got = cm(**kw)
    assert type(got) is type(ref) and rel(got.logits_per_image, ref.logits_per_image) < 1e-5
    with pytest.raises(ContractViolation, match="dim 'batch' is 3 in one input but 2") as e:    # 2 images, 3 texts
        cm(**dict(kw, pixel_values=torch.randn(2, 3, 32, 32)))
    assert "dynamic_shapes=" in e.value.fix and "Dim('pixel_values_batch')" in e.value.fix


def test_a_causal_lm_with_its_default_cache_compiles_under_a_recipe():
    import transformers as T
    torch.manual_seed(0)
    m = T.GPT2LMHeadModel(T.GPT2Config(n_embd=32, n_layer=1, n_head=4, vocab_size=100, n_positions=64)).eval()
    assert m.config.use_cache
    r = {"version": 1, "name": "gpt2-tiny", **FAST,
         "inputs": [{"name": "input_ids", "dtype": "i64", "shape": ["batch", "seq"]},
                    {"name": "attention_mask", "dtype": "i64", "shape": ["batch", "seq"], "role": "attention_mask"}],
         "dims": {"batch": {"buckets": [2]}, "seq": {"buckets": [8], "min": 2}}}
    cm = graphmode.compile(m, r)
    ids = torch.randint(3, 100, (2, 8))
    y, ref = cm(input_ids=ids, attention_mask=torch.ones_like(ids)), m(input_ids=ids)
    assert type(y).__name__ == "CausalLMOutputWithCrossAttentions" and y.past_key_values is None
    assert rel(y.logits, ref.logits) < 1e-5


def test_an_onnx_path_compiles_without_a_recipe(tmp_path):
    from graphmode.capture.onnx_export import export_onnx
    torch.manual_seed(0)
    m, x = CNN().eval(), torch.randn(1, 3, 8, 8)
    path = tmp_path / "cnn.onnx"
    export_onnx(bundle_from_module(m, {"x": x}, name="cnn"), path, dynamic=False, cache_dir=tmp_path / "onnx")
    cm = graphmode.compile(str(path))
    assert cm.recipe.dims == {}
    assert rel(cm(x), m(x)) < 1e-5


def test_a_model_named_by_the_cli_spec_finds_the_plans_python_cached(tmp_path):
    """`graphmode compile --model m.py:build_mlp` names the model after its builder ("mlp" here,
    "build" for build()), graphmode.compile(module) after its class: the graph's name is a label,
    so the same model keys the same cache entries either way (a server warmed from Python hit)."""
    from graphmode.runtime.cache import ArtifactCache
    (tmp_path / "mm.py").write_text(
        "import torch\n"
        "def build():\n"
        "    torch.manual_seed(0)\n"
        "    m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))\n"
        "    return m.eval(), (torch.randn(2, 16),)\n")
    recipe = {"version": 1, "name": "mm", **FAST, "inputs": [{"name": "input", "dtype": "f32", "shape": ["batch", 16]}],
              "dims": {"batch": {"buckets": [2]}}}
    cache = tmp_path / "cache"
    by_spec = graphmode.compile(f"{tmp_path / 'mm.py'}:build", recipe, cache_dir=cache, warmup=True)
    entries = len(ArtifactCache(cache).entries())
    import importlib.util
    spec = importlib.util.spec_from_file_location("mm", tmp_path / "mm.py")
    mm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mm)
    module, (x,) = mm.build()
    by_module = graphmode.compile(module, recipe, cache_dir=cache, warmup=True)
    assert by_spec.graph.name != by_module.graph.name
    assert by_spec.graph.structural_hash() == by_module.graph.structural_hash()
    assert entries >= 1 and len(ArtifactCache(cache).entries()) == entries       # the second compile hit
    events = [e["event"] for e in by_module.cache_events]     # (a plan named after the other was "corrupt")
    assert "hit" in events and "corrupt" not in events, by_module.cache_events
    assert rel(by_module(x), module(x)) < 1e-5


def test_a_save_pretrained_folder_compiles_as_the_model_it_holds(tmp_path):
    import transformers as T
    torch.manual_seed(0)
    m = T.BertModel(T.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
                                 vocab_size=100, max_position_embeddings=64)).eval()
    m.save_pretrained(tmp_path / "bert")
    inputs = [{"name": n, "dtype": "i64", "shape": ["batch", "seq"]}
              for n in ("input_ids", "attention_mask", "token_type_ids")]
    cm = graphmode.compile(str(tmp_path / "bert"), {"version": 1, "name": "bert-folder", "inputs": inputs, **FAST,
                                                    "dims": {"batch": {"buckets": [2]}, "seq": {"buckets": [11]}}})
    ids = torch.randint(0, 100, (2, 11))
    kw = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "token_type_ids": torch.zeros_like(ids)}
    with torch.inference_mode():
        want = m(**kw)
    got = cm(**kw)
    assert type(got) is type(want) and rel(got.last_hidden_state, want.last_hidden_state) < 1e-5
    # transformers 5 takes these through **kwargs: return_dict=False answers eager's tuple, and an
    # option fixed at compile is named as one (both read "unexpected keyword argument")
    with torch.inference_mode():
        want_tuple = m(**kw, return_dict=False)
    got_tuple = cm(**kw, return_dict=False)
    assert type(got_tuple) is tuple and len(got_tuple) == len(want_tuple) == 2
    assert all(rel(a, b) < 1e-5 for a, b in zip(got_tuple, want_tuple))
    with pytest.raises(ContractViolation, match="output_hidden_states") as e:
        cm(**kw, output_hidden_states=True)
    assert "config" in e.value.fix
    (tmp_path / "plain").mkdir()
    with pytest.raises(CaptureError, match="without a config.json") as e:
        graphmode.compile(str(tmp_path / "plain"))
    assert "save_pretrained" in e.value.fix


def test_a_request_outside_a_drafted_range_is_said_once(tmp_path):
    """An ONNX file's free axis gets a guessed range (1..64); requests past it ran in ONNX Runtime
    without a word, and the model looked compiled."""
    from graphmode.runtime.compiled import OutsideDraft

    class Mean(nn.Module):
        def forward(self, x):
            return x.mean(1) * 2
    path = tmp_path / "mean.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(Mean(), (torch.randn(2, 8, 4),), str(path), dynamo=False, opset_version=17,
                          input_names=["x"], dynamic_axes={"x": {0: "batch", 1: "n"}})
        cm = graphmode.compile(str(path), cache_dir=tmp_path)
    lo, hi = cm.recipe.dim_range("n")
    x = torch.randn(2, hi + 36, 4)
    with pytest.warns(OutsideDraft, match=rf"'n' = {hi + 36} is outside.*ONNX Runtime.*--dim n=LO:HI"):
        assert rel(cm(x), Mean()(x)) < 1e-5 and cm.last_path["path"] == "eager"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cm(torch.randn(2, hi + 40, 4))                  # said once per dim


# ---- the zoo: every draft validates and compiles (slow) --------------------------------------------------

def _hf(cls: str, cfg: str, **kw):
    import transformers as T
    torch.manual_seed(0)
    return getattr(T, cls)(getattr(T, cfg)(**kw)).eval()


_TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, vocab_size=100,
             max_position_embeddings=64)
ZOO = {
    "bert": lambda: _hf("BertModel", "BertConfig", **_TINY),
    "distilbert": lambda: _hf("DistilBertModel", "DistilBertConfig", dim=32, n_layers=2, n_heads=4, hidden_dim=64,
                              vocab_size=100, max_position_embeddings=64),
    "gpt2": lambda: _hf("GPT2LMHeadModel", "GPT2Config", n_embd=32, n_layer=2, n_head=4, vocab_size=100,
                        n_positions=64),
    "llama": lambda: _hf("LlamaForCausalLM", "LlamaConfig", **_TINY, num_key_value_heads=2),
    "llama_model": lambda: _hf("LlamaModel", "LlamaConfig", **_TINY, num_key_value_heads=2),
    "qwen2": lambda: _hf("Qwen2ForCausalLM", "Qwen2Config", **_TINY, num_key_value_heads=2),
    "vit": lambda: _hf("ViTModel", "ViTConfig", hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                       intermediate_size=64, image_size=32, patch_size=8),
    "whisper_encoder": lambda: _hf("WhisperForAudioClassification", "WhisperConfig", d_model=32, encoder_layers=2,
                                   encoder_attention_heads=4, encoder_ffn_dim=64, num_mel_bins=16,
                                   max_source_positions=16, vocab_size=100).encoder,
    "wav2vec2": lambda: _hf("Wav2Vec2Model", "Wav2Vec2Config", hidden_size=32, num_hidden_layers=2,
                            num_attention_heads=4, intermediate_size=64, conv_dim=(16, 16), conv_stride=(5, 2),
                            conv_kernel=(10, 3), num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4),
    "mlp": lambda: (_mlp(), (torch.randn(2, 16),)),
    "static_cnn": lambda: (CNN().eval(), (torch.randn(1, 3, 8, 8),)),
}


def _sample(cm, bucket: dict) -> dict:
    return cm.source.make_inputs(bucket, seed=1)


@pytest.mark.slow
@pytest.mark.parametrize("name", [*ZOO, "onnx_bert"])
def test_every_draft_validates_and_compiles(name, tmp_path):
    if name == "onnx_bert":
        from graphmode.capture import families
        from graphmode.capture.onnx_export import export_onnx
        m, ex, dims = families.bert()
        model = str(tmp_path / "bert.onnx")
        export_onnx(bundle_from_module(m, ex, dims, name="bert"), model, dynamic=True, cache_dir=tmp_path / "o")
    else:
        model = ZOO[name]()
    d = draft_recipe(model)
    assert d.report.verdict == "valid" and d.report.plans <= MAX_DRAFT_PLANS, (d.report.verdict, d.report.plans)
    cm = graphmode.compile(d.source.bundle if name != "onnx_bert" else model, d.recipe, cache_dir=tmp_path)
    buckets = d.recipe.buckets()
    for b in (buckets[0], buckets[-1]):
        x = _sample(cm, b) if name != "onnx_bert" else d.source.bundle.make_inputs(b, int_high=100)
        got = cm(**x)
        want = cm.source.reference(x)
        leaves = [t for t in torch.utils._pytree.tree_leaves(got) if isinstance(t, torch.Tensor)]
        assert len(leaves) == len(want)
        for g, w in zip(leaves, want):
            assert rel(g, w) < 1e-5, (name, b)
    if _is_lm(name):
        assert d.recipe.memory.kv_cache is not None and d.recipe.memory.kv_cache.kv_heads in (2, 4)
        ids = torch.randint(3, 100, (2, 6))
        assert cm.generate(ids, max_new_tokens=4).tolist() == \
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False).tolist()


def _is_lm(name: str) -> bool:
    return name in ("gpt2", "llama", "qwen2")


@pytest.mark.slow     # ~30-50 s on a busy 2-core host: the CLI case is in the default set
def test_generate_on_a_draft_without_a_kv_cache_says_why():
    """BLOOM's ALiBi attention: the draft compiles its forward pass and no KV cache, and `generate`
    says so with the drafter's reason, naming ALiBi (not "add memory.kv_cache", which the decode
    engine would then refuse, nor "does not capture as one sdpa")."""
    import transformers as T
    from graphmode.errors import RecipeError
    torch.manual_seed(0)
    m = T.BloomForCausalLM(T.BloomConfig(hidden_size=32, n_layer=1, n_head=4, vocab_size=100)).eval()
    cm = graphmode.compile(m)
    ids = torch.randint(3, 100, (1, 6))
    assert rel(cm(input_ids=ids).logits, m(input_ids=ids).logits) < 1e-5
    with pytest.raises(RecipeError) as e:
        cm.generate(ids, max_new_tokens=2)
    assert "drafted recipe has none" in str(e.value) and "ALiBi position biases" in str(e.value)
    from graphmode.decode.engine import lower_decoder
    from graphmode.errors import CaptureError
    with pytest.raises(CaptureError, match="ALiBi") as e:      # a decoder recipe: refused before capture
        lower_decoder(m, cm.recipe)
    assert "without memory.kv_cache" in e.value.fix


def tiny_bloom():
    import transformers as T
    torch.manual_seed(0)
    return T.BloomForCausalLM(T.BloomConfig(hidden_size=32, n_layer=1, n_head=4, vocab_size=100)).eval()


def test_graphmode_generate_with_a_recipe_without_a_kv_cache_says_why_the_model_cannot_decode(tmp_path):
    """`graphmode generate --recipe` (the draft `recipe init` wrote: no kv_cache, for ALiBi) told
    the user to add memory.kv_cache; done, the decode engine refused it for ALiBi."""
    import json

    import yaml
    from typer.testing import CliRunner

    from graphmode.cli.app import _register, app
    _register()
    rec = tmp_path / "bloom.yaml"
    rec.write_text(yaml.safe_dump({"version": 1, "name": "bloom", "dims": {"batch": {"buckets": [1]},
                                                                          "seq": {"min": 1, "max": 16}},
                                   "inputs": [{"name": "input_ids", "dtype": "i64", "shape": ["batch", "seq"]}]}))
    res = CliRunner().invoke(app, ["generate", "--model", f"{__file__}:tiny_bloom", "--recipe", str(rec),
                                   "--prompt-ids", "5,6", "--json"])
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    err = json.loads(res.stdout)
    assert "ALiBi position biases" in err["message"] and "without memory.kv_cache" in err["fix"], err


@pytest.mark.slow     # ~9 s: a T5 build for one refusal
def test_generate_on_an_encoder_decoder_says_graphmode_decodes_causal_lms():
    import transformers as T
    from graphmode.errors import RecipeError
    torch.manual_seed(0)
    cfg = T.BartConfig(vocab_size=100, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
                       decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64)
    cm = graphmode.compile(T.BartForConditionalGeneration(cfg).eval(), mode="eager")    # the draft decides, not the plans
    with pytest.raises(RecipeError, match="encoder-decoder model, and graphmode decodes decoder-only causal LMs"):
        cm.generate(torch.randint(3, 100, (1, 5)), max_new_tokens=2)


def test_a_request_outside_the_contract_that_eager_refuses_too_is_a_contract_violation(tmp_path):
    """Under on_violation: eager (every hybrid draft) eager's own RuntimeError reached the user
    bare (MPT past its ALiBi table); it is a ContractViolation naming the range and eager's error."""
    class AtMost16(nn.Module):
        def forward(self, x):
            if x.shape[1] > 16:                  # as transformers' models check their inputs
                raise ValueError(f"sequence of {x.shape[1]} is longer than the 16 this model takes")
            return x * 2
    m = AtMost16().eval()
    rec = {"version": 1, "name": "table", "on_violation": "eager", **FAST,
           "inputs": [{"name": "x", "dtype": "f32", "shape": [1, "seq", 8]}], "dims": {"seq": {"buckets": [8, 16]}}}
    cm = graphmode.compile((m, (torch.randn(1, 16, 8),), {"x": [1, "seq", 8]}), rec, cache_dir=tmp_path)
    with pytest.raises(ContractViolation, match=r"outside the recipe's range .*the model itself fails on it: "
                                                r"ValueError: sequence of 20") as e:
        cm(torch.randn(1, 20, 8))
    assert isinstance(e.value.__cause__, ValueError)


def test_an_onnx_model_in_memory_compiles_as_its_file_does(tmp_path):
    """onnxruntime.InferenceSession takes a model in memory; graphmode.compile(onnx.load(p))
    said 'cannot compile a ModelProto'."""
    import onnx
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 4), nn.ReLU()).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(m, (torch.randn(2, 8),), tmp_path / "m.onnx", input_names=["x"],
                          dynamic_axes={"x": {0: "batch"}}, dynamo=False)
        cm = graphmode.compile(onnx.load(tmp_path / "m.onnx"), cache_dir=tmp_path / "c")
    x = torch.randn(3, 8)
    with torch.no_grad():
        assert rel(cm(x=x), m(x)) < 1e-5
    # loaded without its external data: said, not a file written beside a temp copy that lacks it
    onnx.save(onnx.load(tmp_path / "m.onnx"), tmp_path / "ext.onnx", save_as_external_data=True,
              size_threshold=0, location="ext.bin")
    with pytest.raises(CaptureError, match="refers to weights it does not hold"):
        graphmode.compile(onnx.load(tmp_path / "ext.onnx", load_external_data=False))


class BoundedBothWays(nn.Module):
    """x[1] holds for batch >= 2; cdist takes another path past 25 rows."""

    def forward(self, x):
        return torch.cdist(x, x), x[1] * 2


def test_a_draft_keeps_a_lower_and_an_upper_bound_torch_export_finds_in_turn():
    """The second bound found replaced the first (batch min 2 max 32), and the compile failed."""
    m = BoundedBothWays()
    cm = graphmode.compile(m, example_inputs=(torch.randn(4, 6),))
    assert (cm.recipe.dims["batch"].min, cm.recipe.dims["batch"].max) == (2, 25)
    x = torch.randn(7, 6)
    assert all(rel(a, b) < 1e-5 for a, b in zip(cm(x), m(x)))


class MatTimesWeight(nn.Module):
    def forward(self, a, w):
        return a @ w


def test_a_draft_that_keeps_every_shape_says_why_when_a_call_meets_it():
    """Leading axes 3 and 7: no batch axis; the draft said nothing, the call's fix only the shape."""
    cm = graphmode.compile(MatTimesWeight(), example_inputs=(torch.randn(3, 7), torch.randn(7, 2)))
    assert cm.recipe.dims == {}
    with pytest.raises(ContractViolation) as e:
        cm(torch.randn(5, 7), torch.randn(7, 2))
    assert "leading axes differ (a 3, w 7)" in e.value.fix and "dynamic_shapes=" in e.value.fix


def test_shapes_declared_fixed_axis_by_axis_stay_static():
    """input_dims of sizes and None declare every axis fixed: the draft guessed a dynamic batch
    anyway (9 plans, and calls at other batches accepted), as for examples handed without them."""
    m = torch.nn.Linear(16, 8).eval()
    x = torch.randn(4, 16)
    cm = graphmode.compile((m, {"input": x}, {"input": [None, 16]}))
    assert cm.recipe.dims == {} and cm.recipe.inputs[0].shape == [4, 16]
    assert torch.allclose(cm(x), m(x), rtol=1e-5, atol=1e-6)
    with pytest.raises(ContractViolation, match="axis 0 must be 4") as e:
        cm(torch.randn(3, 16))
    assert "declared fixed (input_dims)" in e.value.fix
    assert graphmode.compile((m, {"input": x})).recipe.inputs[0].shape == ["batch", 16]   # examples alone: a batch
