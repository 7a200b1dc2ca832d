"""Input forms ONNX models need: scalars (`shape: []`), empty axes (a 0 extent), the unsigned
dtypes, and constant inputs (`value`: shape-like data a model takes as an input)."""
from __future__ import annotations

import pytest

from graphmode.errors import RecipeError
from graphmode.recipe import check_semantics, load_recipe, recipe_hash
from graphmode.recipe.hashing import canonical_json


def _recipe(*inputs: str) -> str:
    body = "\n".join(f"  - {i}" for i in inputs)
    return f"version: 1\nname: forms\ninputs:\n  - {{name: x, dtype: f32, shape: [batch, 4]}}\n{body}\n" \
           "dims:\n  batch: {buckets: [1, 2]}\n"


def _errors(text: str) -> dict[str, str]:
    try:
        rec = load_recipe(text)
    except RecipeError as e:
        return {x.where: x.message for x in getattr(e, "errors", [e])}
    return {x.where: x.message for x in check_semantics(rec).errors}


def test_scalar_empty_axis_and_unsigned_inputs_load():
    rec = load_recipe(_recipe("{name: s, dtype: u16, shape: []}", "{name: e, dtype: u64, shape: [0, 3]}",
                              "{name: k, dtype: uint32, shape: [2]}"))
    assert [(i.name, i.dtype, i.shape) for i in rec.inputs[1:]] == [("s", "u16", []), ("e", "u64", [0, 3]),
                                                                     ("k", "u32", [2])]
    assert not check_semantics(rec).errors


def test_constant_value_is_checked_against_shape_and_dtype():
    rec = load_recipe(_recipe("{name: axes, dtype: i64, shape: [2], value: [0, -1]}",
                              "{name: k, dtype: i64, shape: [], value: 3}"))
    assert [i.value for i in rec.inputs[1:]] == [[0, -1], 3] and not check_semantics(rec).errors
    assert "has shape [3]" in _errors(_recipe("{name: a, dtype: i64, shape: [2], value: [1, 2, 3]}"))["inputs[1].value"]
    assert "fixed shape" in _errors(_recipe("{name: a, dtype: i64, shape: [batch], value: [1]}"))["inputs[1].value"]
    assert "does not fit dtype u8" in _errors(_recipe("{name: a, dtype: u8, shape: [], value: 300}"))["inputs[1].value"]
    assert "holds integers only" in _errors(_recipe("{name: a, dtype: i32, shape: [], value: 1.5}"))["inputs[1].value"]
    assert "ragged" in _errors(_recipe("{name: a, dtype: i64, shape: [2, 2], value: [[1], [2, 3]]}"))["inputs[1].value"]
    big = "[" + ", ".join(["0"] * 5000) + "]"
    assert "at most 4096" in _errors(_recipe(f"{{name: a, dtype: i64, shape: [5000], value: {big}}}"))[
        "inputs[1].value"]


def test_a_recipe_without_constants_keeps_its_hash():
    rec = load_recipe(_recipe())
    assert '"value"' not in canonical_json(rec)
    with_value = load_recipe(_recipe("{name: k, dtype: i64, shape: [], value: 3}"))
    assert recipe_hash(with_value) != recipe_hash(load_recipe(_recipe("{name: k, dtype: i64, shape: []}")))


@pytest.mark.parametrize("bad", ["-1", "'x y'"])
def test_negative_or_malformed_extents_are_still_errors(bad):
    assert "inputs[1].shape[0]" in _errors(_recipe(f"{{name: a, dtype: f32, shape: [{bad}]}}"))
