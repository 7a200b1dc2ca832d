"""Recipe layer 1: YAML loading, the pydantic schema, and field-level errors with lines."""
from pathlib import Path

import pytest

from graphmode.errors import RecipeError, RecipeErrors
from graphmode.recipe import Recipe, load_recipe
from graphmode.recipe.schema import FUSION_PATTERNS

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = ROOT / "examples" / "recipes"

FULL = """\
version: 1
name: full-recipe
description: every field group
model:
  kind: decoder
  params_m: 124.4
  layers: 12
  hidden: 768
  heads: 12
  vocab: 50257
  n_ops: 200
inputs:
  - {name: input_ids, dtype: int64, shape: [batch, seq], pad_value: 50256}
  - {name: pixel, dtype: float32, shape: [batch, 3, 32, 32], pad_value: 0.5}
outputs:
  logits: [batch, seq, 50257]
  pooled: [batch, "*"]
dims:
  batch: {buckets: [1, 2, 4, 8]}
  seq: {min: 2, max: 512, max_padding: 0.5, max_buckets: 12}
exe_mode: hybrid
on_violation: eager
capture:
  include_ops: [aten.linear, softmax]
  exclude_ops: [multinomial]
optimize:
  passes: [canonicalize, fuse, memory_plan]
  fusion: {enabled: true, patterns: [elementwise, attention], min_ops: 2, max_ops: 8}
  memory_reuse: false
precision:
  compute: fp32
  accumulate: f64
  overrides: {softmax: f32, layer_norm: float32}
memory:
  budget_mb: 4096
  bank_affinity: [high_bandwidth, 3]
  kv_cache: {page_size: 16, max_pages_per_seq: 32, dtype: f32, layers: 12, kv_heads: 12, head_dim: 64}
sla:
  p50_ms: 100
  p99_ms: 200
  per_bucket:
    - match: {batch: 1, seq: [2, 64]}
      p50_ms: 10
targets:
  - host
  - name: inline_chip
    kind: cpu
    vendor: acme
    arch: x
    compute_units: 4
    vector_width_bits: 256
    l1_bytes: 32 KiB
    l2_bytes: 1 MiB
    llc_bytes: 8 MiB
    memory_bytes: 16 GiB
    memory_bandwidth_gbps: 40
    peak_flops: {f32: 200 GFLOPS}
    dtypes: [f32]
    groups:
      memory_banks: {dram: {ids: [0]}}
      compute_classes: {vector: {units: 4}}
alias_groups: [[input_ids, logits]]
replayable: false
requires: {torch: ">=2.13,<2.14", python: ">=3.11", driver: ">=535", cuda: ">=12", graphmode: ">=0.1"}
"""


def line_no(text: str, needle: str) -> int:
    """1-based line of the first occurrence of `needle` in `text`."""
    return text[: text.index(needle)].count("\n") + 1


def errors_of(text: str) -> list[RecipeError]:
    with pytest.raises(RecipeError) as ei:
        load_recipe(text)
    e = ei.value
    return e.errors if isinstance(e, RecipeErrors) else [e]


def one_error(text: str, where: str) -> RecipeError:
    errs = [e for e in errors_of(text) if e.where == where]
    assert errs, f"no error at {where}: {[e.render() for e in errors_of(text)]}"
    return errs[0]


@pytest.mark.parametrize("name", ["minilm_cpu", "gpt2_decoder", "resnet18_cpu"])
def test_examples_load(name):
    r = load_recipe(EXAMPLES / f"{name}.yaml")
    assert r.version == 1 and r.source.endswith(f"{name}.yaml")
    assert r.targets == ["host"]
    assert r.line_of("inputs[0].dtype") is not None


def test_every_field_group_loads():
    r = load_recipe(FULL)
    assert r.name == "full-recipe" and r.model.kind == "decoder" and r.model.n_ops == 200
    assert [i.dtype for i in r.inputs] == ["i64", "f32"]                 # aliases normalised
    assert r.inputs[0].shape == ["batch", "seq"] and r.inputs[1].shape == ["batch", 3, 32, 32]
    assert r.inputs[1].pad_value == 0.5
    assert r.outputs == {"logits": ["batch", "seq", 50257], "pooled": ["batch", "*"]}
    assert r.dims["batch"].buckets == [1, 2, 4, 8]
    assert r.dims["seq"].max_padding == 0.5 and r.dims["seq"].max_buckets == 12
    assert r.exe_mode == "hybrid" and r.on_violation == "eager"
    assert r.capture.exclude_ops == ["multinomial"] and "aten.linear" in r.capture.include_ops
    assert r.pipeline() == ["canonicalize", "fuse", "memory_plan"]
    assert r.optimize.fusion.max_ops == 8 and r.optimize.memory_reuse is False
    assert r.precision.compute == "f32" and r.precision.accumulate_dtype() == "f64"
    assert r.precision.overrides == {"softmax": "f32", "layer_norm": "f32"}
    assert r.memory.budget_mb == 4096.0 and r.memory.bank_affinity == ["high_bandwidth", 3]
    assert r.memory.kv_cache.page_size == 16 and r.memory.kv_cache.head_dim == 64
    assert r.sla.per_bucket[0].match == {"batch": 1, "seq": [2, 64]}
    assert r.targets[0] == "host" and r.targets[1].name == "inline_chip"
    assert r.targets[1].memory_bytes == 16 * 2**30                     # units via the target registry
    assert r.alias_groups == [["input_ids", "logits"]] and r.replayable is False
    assert r.requires.torch == ">=2.13,<2.14" and r.requires.cuda == ">=12"
    assert r.line_of("memory.kv_cache.page_size") == line_no(FULL, "kv_cache:")
    assert r.line_of("dims.seq.max_padding") == line_no(FULL, "seq: {min")     # flow mapping: its line
    assert r.line_of("targets[1].vendor") == line_no(FULL, "vendor: acme")


def test_defaults():
    r = load_recipe("version: 1\nname: tiny\ninputs: [{name: x, dtype: f32, shape: [n]}]\ndims: {n: 4}\n")
    assert r.exe_mode == "graph" and r.on_violation == "error" and r.replayable is True
    assert r.pipeline()[-1] == "memory_plan" and r.optimize.preset is None
    assert r.optimize.fusion.patterns == list(FUSION_PATTERNS)
    assert r.precision.compute == "f32" and r.memory.budget_mb is None and r.sla is None
    assert r.dims["n"].buckets == [4] and r.dim_buckets() == {"n": [4]}


def test_python_construction_and_dict():
    data = {"version": 1, "name": "py", "inputs": [{"name": "x", "dtype": "f16", "shape": ["b", 8]}],
            "dims": {"b": {"buckets": [1, 2]}}}
    r = load_recipe(data)
    assert isinstance(r, Recipe) and r.inputs[0].dtype == "f16"
    assert Recipe.model_validate(data) == r
    with pytest.raises(RecipeErrors) as ei:
        load_recipe({**data, "exe_mode": "fast"})
    assert ei.value.errors[0].where == "exe_mode"


def test_all_errors_collected_with_path_value_line_fix():
    text = FULL.replace("exe_mode: hybrid", "exe_mode: turbo").replace("page_size: 16", "page_size: 12") \
        .replace("dtype: int64", "dtype: int65").replace("memory_reuse: false", "memory_reus: false")
    errs = errors_of(text)
    by = {e.where: e for e in errs}
    assert set(by) >= {"exe_mode", "memory.kv_cache.page_size", "inputs[0].dtype", "optimize.memory_reus"}
    e = by["exe_mode"]
    assert e.value == "turbo" and e.line == line_no(text, "exe_mode") and "'graph'" in e.fix
    e = by["memory.kv_cache.page_size"]
    assert e.value == 12 and e.line == line_no(text, "kv_cache:")
    assert "power of two" in e.message and "8 or 16" in e.message
    e = by["optimize.memory_reus"]
    assert "unknown key" in e.message and "memory_reuse" in e.fix          # did-you-mean
    assert f"inputs[0].dtype, line {line_no(text, 'int65')}" in RecipeErrors(errs).render()
    assert [x.line for x in errs] == sorted(x.line for x in errs)          # reported in file order


@pytest.mark.parametrize("old,new,where,expect", [
    ("version: 1", "version: 2", "version", "version 1"),
    ("name: full-recipe", "name: 'bad name'", "name", "letters"),
    ("pad_value: 50256", "pad_value: [1]", "inputs[0].pad_value", "number"),
    ("shape: [batch, seq]", "shape: [batch, -1]", "inputs[0].shape[1]", "integer >= 0"),
    ("pooled: [batch, \"*\"]", "pooled: [batch, -1]", "outputs.pooled[1]", "'*'"),
    ("buckets: [1, 2, 4, 8]", "buckets: [1, two]", "dims.batch.buckets[1]", "integer"),
    ("max_padding: 0.5", "max_padding: 1.5", "dims.seq.max_padding", "< 1"),
    ("max_buckets: 12", "max_buckets: 0", "dims.seq.max_buckets", ">= 1"),
    ("on_violation: eager", "on_violation: ignore", "on_violation", "'error'"),
    ("exclude_ops: [multinomial]", "exclude_ops: [1bad]", "capture.exclude_ops[0]", "op name"),
    ("patterns: [elementwise, attention]", "patterns: [elementwise, conv_epilogue]",
     "optimize.fusion.patterns[1]", "attention"),
    ("min_ops: 2", "min_ops: 0", "optimize.fusion.min_ops", ">= 1"),
    ("enabled: true", "enabled: maybe", "optimize.fusion.enabled", "boolean"),
    ("compute: fp32", "compute: i64", "precision.compute", "floating-point"),
    ("layer_norm: float32", "layer_norm: f33", "precision.overrides.layer_norm", "unknown dtype"),
    ("budget_mb: 4096", "budget_mb: 0", "memory.budget_mb", "> 0"),
    ("budget_mb: 4096", "budget_mb: lots", "memory.budget_mb", "${target"),
    # a size with a unit, or a quoted number: the number to write (it said "expected a number" alone)
    ("budget_mb: 4096", "budget_mb: 2 GiB", "memory.budget_mb", "fix: write 2048 (the field takes a number of MB"),
    ("budget_mb: 4096", "budget_mb: 1.5g", "memory.budget_mb", "fix: write 1536 ("),
    ("budget_mb: 4096", "budget_mb: 512MB", "memory.budget_mb", "fix: write 512 ("),
    ("budget_mb: 4096", "budget_mb: '256'", "memory.budget_mb", "fix: write the number without quotes: 256"),
    ("p99_ms: 200", "p99_ms: 2 s", "sla.p99_ms", "fix: write a plain number of ms"),
    # YAML 1.1 read an exponent without a dot as a string ("expected a number (got '1e30')")
    ("budget_mb: 4096", "budget_mb: 1e30", "memory.budget_mb", "out of range"),
    ("budget_mb: 4096", "budget_mb: '${os.system(1)}'", "memory.budget_mb", "only these functions"),
    ("max_pages_per_seq: 32", "max_pages_per_seq: 2.5", "memory.kv_cache.max_pages_per_seq", "integer"),
    # a float dtype no pool can store passed validate and failed inside the to_paged pass
    ("dtype: f32, layers: 12", "dtype: fp8_e4m3, layers: 12", "memory.kv_cache.dtype",
     "a KV cache stores f64, f32, f16, bf16"),
    ("bank_affinity: [high_bandwidth, 3]", "bank_affinity: [-1]", "memory.bank_affinity[0]", "bank"),
    ("p99_ms: 200", "p99_ms: -1", "sla.p99_ms", "> 0"),
    ("match: {batch: 1, seq: [2, 64]}", "match: {batch: 1, seq: [2, 64, 9]}",
     "sla.per_bucket[0].match.seq", "[lo, hi]"),
    ("match: {batch: 1, seq: [2, 64]}", "match: {}", "sla.per_bucket[0].match", "empty"),
    ("vendor: acme", "vendor: acme\n    sm_count: 3", "targets[1]", "sm_count"),
    ("alias_groups: [[input_ids, logits]]", "alias_groups: [input_ids]", "alias_groups[0]", "list"),
    ("replayable: false", "replayable: 0", "replayable", "boolean"),
    ("torch: \">=2.13,<2.14\"", "torch: \">>2\"", "requires.torch", "version constraint"),
    ("kind: decoder", "kind: rnn", "model.kind", "'encoder'"),
    ("n_ops: 200", "n_ops: many", "model.n_ops", "integer"),
])
def test_field_errors(old, new, where, expect):
    assert old in FULL, old
    e = one_error(FULL.replace(old, new, 1), where)
    assert expect in e.render(), e.render()
    assert e.line is not None and e.line > 0


def test_missing_required_keys():
    errs = errors_of("version: 1\ndims: {n: 4}\n")
    by = {e.where: e for e in errs}
    assert set(by) == {"name", "inputs"}
    assert "missing required key 'name'" in by["name"].message and by["name"].line == 1


def test_unknown_key_nested_lists_valid_keys():
    e = one_error(FULL.replace("head_dim: 64", "head_dim: 64, head_dims: 64"), "memory.kv_cache.head_dims")
    assert "page_size" in e.fix and "head_dim" in e.fix and e.line == line_no(FULL, "kv_cache:")


def test_duplicate_keys_are_errors():
    text = FULL.replace("exe_mode: hybrid", "exe_mode: hybrid\nexe_mode: graph")
    e = one_error(text, "exe_mode")
    first = line_no(text, "exe_mode")
    assert "duplicate key" in e.message and f"line {first}" in e.message and e.line == first + 1


@pytest.mark.parametrize("text,line,needle", [
    ("", 1, "empty"),
    ("# only a comment\n", 1, "empty"),
    ("- a\n- b\n", 1, "mapping"),
    ("just a string", 1, "mapping"),
    ("version: 1\nname: x\ninputs:\n\t- name: a\n", 4, "tabs"),
    ("version: 1\nname: x\n  inputs: 3\n", 3, "YAML syntax"),
    ("version: 1\nname: [x\n", 3, "YAML syntax"),
    ("version: 1\n---\nversion: 1\n", 2, "single document"),
    ("a: &a [*a]\n", 1, "recursive"),
    ("version: !!python/object:os.system x\n", 1, "constructor"),
    ("? [a, b]\n: 1\n", 1, "plain scalars"),
    ("version: 1\nname: \x07\n", 2, "control"),
    ("1: 2\n", 1, "must be a name"),
])
def test_yaml_problems_are_recipe_errors(text, line, needle):
    errs = errors_of(text)
    assert any(e.line == line and needle in e.render() for e in errs), [e.render() for e in errs]


def test_alias_bomb_and_binary():
    bomb = "a: &a [1,1,1,1,1,1,1,1,1,1]\n" + "".join(
        f"{c}: &{c} [{', '.join(['*' + p] * 10)}]\n" for p, c in zip("abcde", "bcdef"))
    assert "alias bomb" in errors_of(bomb)[0].message
    assert "UTF-8" in errors_of(b"\xff\xfe\x00garbage")[0].message


def test_extension_keys_and_merge():
    text = ("x-common: &common {dtype: i64, shape: [batch, seq]}\nversion: 1\nname: m\n"
            "inputs:\n  - {<<: *common, name: a}\n  - {<<: *common, name: b}\n"
            "dims: {batch: 2, seq: 8}\n")
    r = load_recipe(text)
    assert [i.name for i in r.inputs] == ["a", "b"] and r.inputs[1].shape == ["batch", "seq"]


def test_missing_file_is_recipe_error(tmp_path):
    with pytest.raises(RecipeError) as ei:
        load_recipe(tmp_path / "nope.yaml")
    assert "cannot read" in ei.value.message


def test_memory_weight_growth_defaults_keeps_old_stamps_and_refuses_below_one():
    from graphmode.errors import RecipeErrors
    from graphmode.recipe import load_recipe
    from graphmode.recipe.hashing import canonical_json
    base = {"version": 1, "name": "wg", "inputs": [{"name": "x", "dtype": "f32", "shape": ["b", 4]}],
            "dims": {"b": {"buckets": [1]}}}
    plain = load_recipe(base)
    assert plain.memory.weight_growth == 2.5 and "weight_growth" not in canonical_json(plain)
    assert load_recipe({**base, "memory": {"weight_growth": 2.5}}).hash() == plain.hash()
    tight = load_recipe({**base, "memory": {"weight_growth": 1.5}})
    assert tight.memory.weight_growth == 1.5 and tight.hash() != plain.hash()
    with pytest.raises(RecipeErrors, match="memory.weight_growth"):
        load_recipe({**base, "memory": {"weight_growth": 0.5}})


def test_an_exponent_without_a_dot_is_a_number_as_in_yaml_1_2():
    r = load_recipe(FULL.replace("budget_mb: 4096", "budget_mb: 4e3", 1))
    assert r.memory.budget_mb == 4000.0
