"""Content hash (version stamp), diff and merge of recipes."""
from pathlib import Path

import pytest

from graphmode.errors import RecipeErrors
from graphmode.recipe import diff_recipes, load_recipe, merge_recipes, recipe_hash
from graphmode.recipe.hashing import canonical_json

ROOT = Path(__file__).resolve().parents[3]
MINILM = ROOT / "examples" / "recipes" / "minilm_cpu.yaml"


def test_hash_is_stable_and_content_based():
    a = load_recipe(MINILM)
    text = MINILM.read_text()
    reordered = "\n".join(["# a comment that changes nothing"] + text.splitlines())
    b = load_recipe(reordered)
    assert recipe_hash(a) == recipe_hash(b) == a.hash()
    assert len(a.hash()) == 16 and int(a.hash(), 16) >= 0
    assert a == b and hash(a) == hash(b)
    # defaults spelled out give the same stamp; aliases normalise
    c = load_recipe(text.replace("exe_mode: graph", "exe_mode: graph\ncapture: {include_ops: [], exclude_ops: []}")
                    .replace("compute: f32", "compute: float32"))
    assert c.hash() == a.hash()
    d = load_recipe(text.replace("budget_mb: 2048", "budget_mb: 2049"))
    assert d.hash() != a.hash()
    assert '"budget_mb":2048.0' in canonical_json(a)


def test_hash_is_pinned():
    # changing the canonical form changes every deployed version stamp; do it on purpose only
    r = load_recipe("version: 1\nname: pin\ninputs: [{name: x, dtype: f32, shape: [n]}]\ndims: {n: 4}\n")
    assert r.hash() == recipe_hash(r)
    assert canonical_json(r).startswith('{"alias_groups":[],"capture":{"exclude_ops":[],"include_ops":[]}')


def test_diff_lists_changed_paths():
    a = load_recipe(MINILM)
    text = MINILM.read_text().replace("budget_mb: 2048", "budget_mb: 4096") \
        .replace("buckets: [1, 2, 4, 8, 16, 32]", "buckets: [1, 2, 4, 8]") \
        .replace("{name: token_type_ids, dtype: i64, shape: [batch, seq], pad_value: 0}",
                 "{name: token_type_ids, dtype: i32, shape: [batch, seq], pad_value: 0}") \
        .replace("    - match: {batch: 1, seq: [2, 128]}\n      p50_ms: 250\n", "") \
        .replace("per_bucket:\n", "per_bucket: []\n")
    b = load_recipe(text)
    changes = {c.path: c for c in diff_recipes(a, b)}
    assert changes["memory.budget_mb"].old == 2048.0 and changes["memory.budget_mb"].new == 4096.0
    assert changes["dims.batch.buckets"].new == [1, 2, 4, 8] and changes["dims.batch.buckets"].kind == "changed"
    assert changes["inputs[token_type_ids].dtype"].old == "i64"               # named lists keyed by name
    assert changes["sla.per_bucket[0].p50_ms"].kind == "removed"
    assert diff_recipes(a, a) == []
    assert "description" not in changes


def test_merge():
    base = load_recipe(MINILM)
    merged = merge_recipes(base, {"memory": {"budget_mb": 4096}, "dims": {"batch": {"buckets": [1, 8]}}})
    assert merged.memory.budget_mb == 4096 and merged.dims["batch"].buckets == [1, 8]
    assert merged.dims["seq"] == base.dims["seq"] and merged.precision == base.precision
    assert [c.path for c in diff_recipes(base, merged)] == ["dims.batch.buckets", "memory.budget_mb"]
    other = load_recipe(MINILM.read_text().replace("name: minilm-cpu", "name: other"))
    assert merge_recipes(base, other).name == "other"
    with pytest.raises(RecipeErrors) as ei:
        merge_recipes(base, {"memory": {"budget_mb": -1}})
    assert ei.value.errors[0].where == "memory.budget_mb"


def test_a_section_removed_is_said_by_its_fields_only():
    """Removing the whole sla section printed 'sla added null' and a 'removed null' row beside
    the fields it really removed (trial S)."""
    from graphmode.recipe import load_recipe
    base = {"version": 1, "name": "r", "inputs": [{"name": "x", "dtype": "f32", "shape": ["batch", 4]}],
            "dims": {"batch": {"buckets": [1, 2]}}}
    with_sla, without = load_recipe(dict(base, sla={"p99_ms": 5.0})), load_recipe(base)
    changes = diff_recipes(with_sla, without)
    assert changes and all(c.path.startswith("sla.") and c.kind == "removed" and c.old is not None for c in changes)
    assert [c.kind for c in diff_recipes(without, with_sla)] == ["added"] * len(changes)
