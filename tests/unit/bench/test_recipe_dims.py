"""`graphmode bench` / `profile --model file.py:fn --recipe r.yaml --shape 2x16` for a model handed
with static example shapes: the shape reads as the recipe's dims (as `run --shape` does). Before,
"no --shape fits model", and its fix led to "shape {} is outside the recipe's dims"."""
from __future__ import annotations

from graphmode.bench.models import load_cases
from graphmode.recipe import load_recipe

MODEL = '''
import torch
def build():
    m = torch.nn.Sequential(torch.nn.Embedding(50, 8), torch.nn.Linear(8, 4)).eval()
    return m, {"input": torch.randint(0, 50, (2, 12))}
'''


def test_a_static_example_takes_the_recipes_dims(tmp_path):
    (tmp_path / "m.py").write_text(MODEL)
    recipe = load_recipe({"version": 1, "name": "m", "inputs": [{"name": "input", "dtype": "i64",
                                                                 "shape": ["batch", "seq"]}],
                          "dims": {"batch": {"buckets": [1, 2, 4]}, "seq": {"buckets": [8, 16, 32], "min": 2}}})
    case, = load_cases([f"{tmp_path / 'm.py'}:build"], ["2x16"], recipe=recipe)
    assert case.envs == [{"batch": 2, "seq": 16}]
    assert case.bundle.make_inputs(case.envs[0])["input"].shape == (2, 16)
    plain, = load_cases([f"{tmp_path / 'm.py'}:build"], [])          # no recipe: the example's shape
    assert plain.bundle.dim_names == []


def test_without_a_recipe_a_static_example_takes_a_leading_batch(tmp_path):
    """`bench --model m.py:build --shape 4x12` for an example of batch 2 said 'no --shape fits'
    (its fix: 2x12), where compile and recipe init take the leading axis as a batch."""
    (tmp_path / "m.py").write_text(MODEL)
    case, = load_cases([f"{tmp_path / 'm.py'}:build"], ["4x12", "2x12"])
    assert case.envs == [{"batch": 4}, {"batch": 2}] and case.bundle.make_inputs(case.envs[0])["input"].shape == (4, 12)
    import pytest
    from graphmode.errors import GraphmodeError
    with pytest.raises(GraphmodeError, match="no --shape fits") as e:
        load_cases([f"{tmp_path / 'm.py'}:build"], ["4x13"])
    assert "--recipe" in e.value.fix


BARE = '''
import torch
from transformers import BertConfig, BertModel
def bare():
    return torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU()).eval()
def bert():
    torch.manual_seed(0)
    return BertModel(BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                intermediate_size=32, max_position_embeddings=32)).eval()
'''


def test_a_module_alone_takes_its_inputs_from_the_recipe_or_its_config(tmp_path):
    """`profile --model m.py:fn --recipe r.yaml` for a function returning the module alone said
    "returned a bare ... give a recipe that declares its inputs (--recipe)" with --recipe given;
    compile, run and verify take it (a Hugging Face model's inputs from its config)."""
    import pytest
    from graphmode.errors import GraphmodeError
    (tmp_path / "bare_models.py").write_text(BARE)
    recipe = load_recipe({"version": 1, "name": "m",
                          "inputs": [{"name": "input", "dtype": "f32", "shape": ["batch", 8]}],
                          "dims": {"batch": {"buckets": [1, 4]}}})
    case, = load_cases([f"{tmp_path / 'bare_models.py'}:bare"], ["4"], recipe=recipe)
    assert case.envs == [{"batch": 4}] and case.bundle.make_inputs(case.envs[0])["input"].shape == (4, 8)
    hf, = load_cases([f"{tmp_path / 'bare_models.py'}:bert"], ["2x12"])
    assert hf.bundle.make_inputs(hf.envs[0])["input_ids"].shape == (2, 12)
    other = load_recipe({"version": 1, "name": "m",
                         "inputs": [{"name": "x", "dtype": "i64", "shape": ["batch", "seq"]}],
                         "dims": {"batch": {"buckets": [1, 2]}, "seq": {"buckets": [8, 16]}}})
    (tmp_path / "m.py").write_text(MODEL)
    with pytest.raises(GraphmodeError, match="no --shape fits") as e:      # it was silently not applied
        load_cases([f"{tmp_path / 'm.py'}:build"], ["2x16"], recipe=other)
    assert "the recipe's dims name none of its axes: it declares inputs ['x']" in e.value.fix
