"""What a torch user does to a compiled model, as a new-user trial did it: each either works as
on the eager module or is refused with a graphmode error naming what to do (before: raw
AttributeErrors and pickling errors, a flat tuple in eager mode, a bf16 model from a compile under
autocast, an omitted mask filled with ones where the model masks its own padding id)."""
from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import torch

import graphmode
from graphmode.errors import ContractViolation, GraphmodeError, RecipeError
from graphmode.runtime.habits import AutocastIgnored

FAST = {"codegen": {"kernel_selection": "heuristic"}}


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _recipe(**over) -> dict:
    return {"version": 1, "name": "mlp", "inputs": [{"name": "input", "dtype": "f32", "shape": ["batch", 8]}],
            "dims": {"batch": {"buckets": [2, 4]}}, **FAST, **over}


class Structured(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, input, temperature: float = 1.0):
        h = self.lin(input) / temperature
        return {"a": h, "b": (input * 2, [h.sum(-1)])}


def _model():
    torch.manual_seed(0)
    return Structured().eval()


def test_eager_mode_returns_eagers_structure(tmp_path):
    m, x = _model(), torch.randn(3, 8)
    cm = graphmode.compile(m, _recipe(exe_mode="eager"), cache_dir=tmp_path)
    out, ref = cm(x), m(x)
    assert isinstance(out, dict) and isinstance(out["b"], tuple) and isinstance(out["b"][1], list)
    torch.testing.assert_close(out["a"], ref["a"])


def test_a_module_in_training_mode_is_compiled_in_eval_and_told(tmp_path):
    """It was set to eval() silently (the user's own module, dropout off from then on)."""
    from graphmode.capture.spec import GraphmodeNotice
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5))        # train() by default
    with pytest.warns(GraphmodeNotice, match=r"Sequential was in training mode \(Sequential, 0, 1\).*model.eval\(\)"):
        cm = graphmode.compile(m, _recipe(), cache_dir=tmp_path)
    x = torch.randn(3, 8)
    assert not m.training and torch.allclose(cm(x), m(x), atol=1e-6)


def test_autocast_around_compile_or_a_call_is_ignored_with_a_warning(tmp_path):
    m, x = _model(), torch.randn(3, 8)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            cm = graphmode.compile(m, _recipe(), cache_dir=tmp_path)
            out = cm(x)
    assert [w for w in said if issubclass(w.category, AutocastIgnored)]
    assert out["a"].dtype == torch.float32
    torch.testing.assert_close(out["a"], m(x)["a"], rtol=1e-5, atol=1e-6)


def test_module_habits_work_or_are_refused_naming_the_way(tmp_path):
    m, x = _model(), torch.randn(3, 8)
    cm = graphmode.compile(m, _recipe(), cache_dir=tmp_path)
    assert cm.eval() is cm and cm.to("cpu") is cm and cm.train(False) is cm
    assert cm.cpu() is cm and cm.float() is cm and cm.to(x) is cm and cm.to(torch.float32) is cm   # where it is
    torch.testing.assert_close(cm.forward(x)["a"], m(x)["a"], rtol=1e-5, atol=1e-6)
    for act in (lambda: copy.deepcopy(cm), lambda: pickle.dumps(cm), lambda: cm.train(),
                lambda: cm.to(torch.float16), lambda: cm.to("meta"), lambda: cm.half(), lambda: cm.to("bogus"),
                lambda: cm.to(x.half())):       # a raw RuntimeError from torch.device, or no half() at all
        with pytest.raises(GraphmodeError) as e:
            act()
        assert e.value.fix
    assert graphmode.GraphmodeError is GraphmodeError
    for odd, how in [(x.to_sparse(), "sparse_coo"), (x.to_mkldnn(), "mkldnn"),
                     (torch.nested.nested_tensor([torch.randn(8), torch.randn(8)]), "nested")]:
        with pytest.raises(ContractViolation, match=f"is a {how} tensor") as e:
            cm(odd)
        assert "to_dense" in e.value.fix
    # a Python option at the value it was compiled with is that value; another is refused
    torch.testing.assert_close(cm(x, temperature=1.0)["a"], m(x)["a"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(cm(x, 1.0)["a"], m(x)["a"], rtol=1e-5, atol=1e-6)
    with pytest.raises(ContractViolation, match="temperature"):
        cm(x, temperature=2.0)
    with pytest.raises(ContractViolation, match="an empty request is outside every recipe") as e:
        cm(torch.randn(0, 8))
    assert "widen" not in e.value.fix


def test_a_function_or_a_named_model_with_example_inputs_is_refused_for_what_it_is():
    with pytest.raises(RecipeError, match="not a function") as e:
        graphmode.compile(lambda a: a * 2, example_inputs=(torch.randn(2, 8),))
    assert "forward" in e.value.fix
    with pytest.raises(RecipeError, match="already names its inputs"):
        graphmode.compile("model.onnx", example_inputs=(torch.randn(2, 8),))


def test_a_batch_one_example_drafts_a_dynamic_batch():
    m, x = _model(), torch.randn(1, 8)
    cm = graphmode.compile(m, example_inputs=(x,))
    assert "batch" in cm.recipe.dims
    z = torch.randn(5, 8)
    torch.testing.assert_close(cm(z)["a"], m(z)["a"], rtol=1e-5, atol=1e-6)


class InPlace(torch.nn.Module):
    def forward(self, input):
        input.mul_(2)
        return input + 1


def test_an_in_place_update_of_a_leaf_that_requires_grad_is_refused_as_eager_refuses_it(tmp_path):
    cm = graphmode.compile(InPlace(), _recipe(), cache_dir=tmp_path)
    x = torch.randn(2, 8, requires_grad=True)
    with pytest.raises(RuntimeError, match="leaf Variable"):
        InPlace()(x)
    with pytest.raises(ContractViolation, match="leaf tensor that requires grad") as e:
        cm(x)
    assert "no_grad" in e.value.fix
    with torch.no_grad():                                           # eager allows it there, and so do we
        before = x.detach().clone()
        torch.testing.assert_close(cm(x), before * 2 + 1)
        torch.testing.assert_close(x.detach(), before * 2)


PAD = 49


class OwnMask(torch.nn.Module):
    """Builds its mask from its padding id when none is given (XLM-style), with a pad id that is none
    of 0, 1, 2 and no config: only its embedding's padding_idx says which one."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(50, 16, padding_idx=PAD)
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, ids, mask=None):
        if mask is None:
            mask = (ids != PAD).long()
        h = self.lin(self.emb(ids)) * mask.unsqueeze(-1)
        return h.sum(1) / mask.sum(1, keepdim=True)


def test_an_omitted_mask_the_model_builds_from_its_padding_idx_is_refused_not_filled_with_ones():
    torch.manual_seed(0)
    m = OwnMask().eval()
    ids = torch.randint(0, 40, (2, 6))
    cm = graphmode.compile((m, {"ids": ids, "mask": torch.ones(2, 6, dtype=torch.long)},
                            {"ids": ["batch", "seq"], "mask": ["batch", "seq"]}))
    with pytest.raises(ContractViolation, match="missing inputs \\['mask'\\]"):
        cm(torch.tensor([[5, 7, 9, PAD, PAD, PAD]]))


@pytest.mark.slow     # ~12 s: a save and a load; the compiled model's filling is the tests' above
def test_a_saved_model_fills_an_omitted_optional_input_as_the_compiled_one_does(tmp_path):
    from transformers import BertConfig, BertModel
    torch.manual_seed(0)
    bert = BertModel(BertConfig(vocab_size=60, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                intermediate_size=32, max_position_embeddings=32)).eval()
    ids = torch.randint(3, 60, (2, 6))
    cm = graphmode.compile((bert, {"input_ids": ids, "attention_mask": torch.ones(2, 6, dtype=torch.long)},
                            {"input_ids": ["batch", "seq"], "attention_mask": ["batch", "seq"]}))
    want = bert(input_ids=ids).last_hidden_state
    torch.testing.assert_close(cm(ids).last_hidden_state, want, rtol=1e-5, atol=1e-5)
    cm.save(tmp_path / "bert.gm")
    loaded = graphmode.load(tmp_path / "bert.gm")
    torch.testing.assert_close(loaded(ids).last_hidden_state, want, rtol=1e-5, atol=1e-5)


def test_torch_export_of_a_module_calling_a_compiled_model_is_refused_not_frozen():
    """torch.export traced the compiled model with fake tensors: its answer became a lifted
    constant, and the exported program answered every input the same (max error 1.5-2.1)."""
    m = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU()).eval()
    cm = graphmode.compile(m, example_inputs=(torch.randn(2, 16),))
    cm(torch.randn(2, 16))

    class Calls(torch.nn.Module):
        def forward(self, x):
            return cm(x) * 2
    with pytest.raises(GraphmodeError, match="called while torch traces a model around it") as e:
        torch.export.export(Calls(), (torch.randn(2, 16),))
    assert "export or trace the eager model itself" in e.value.fix
    x = torch.randn(3, 16)
    assert torch.allclose(cm(x), m(x), atol=1e-6)          # a real call after it still runs the plans


def test_an_input_that_requires_grad_is_told_the_outputs_carry_none(tmp_path):
    """Autograd was cut in silence: backward() then failed with torch's generic 'does not require grad'."""
    import warnings

    from graphmode.capture.spec import GraphmodeNotice
    m, x = _model(), torch.randn(3, 8, requires_grad=True)
    cm = graphmode.compile(m, _recipe(), cache_dir=tmp_path)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        cm(x), cm(x)
        with torch.no_grad():
            cm(x)
    notes = [str(w.message) for w in said if w.category is GraphmodeNotice]
    assert len(notes) == 1 and "carry no gradient" in notes[0] and "torch.no_grad()" in notes[0]
