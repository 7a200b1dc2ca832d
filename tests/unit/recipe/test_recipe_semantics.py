"""Recipe layer 2: cross-field semantics, precision vs target, `requires` vs the environment."""
from pathlib import Path

import pytest

from graphmode.recipe import Environment, check_semantics, load_recipe, validate
from graphmode.recipe.semantics import check_requires, detect_environment
from graphmode.targets import load_target_file

DATA = Path(__file__).resolve().parents[1] / "data" / "recipes"
CPU = load_target_file(DATA / "cpu_target.yaml")
GPU = load_target_file(DATA / "gpu_target.yaml")
ENV = Environment(python="3.11.7", torch="2.13.0+cpu", graphmode="0.1.0", driver=None, cuda=None)

BASE = """\
version: 1
name: sem
model: {kind: encoder, params_m: 22.7, layers: 6, hidden: 384, heads: 12}
inputs:
  - {name: input_ids, dtype: i64, shape: [batch, seq]}
  - {name: attention_mask, dtype: i64, shape: [batch, seq]}
outputs:
  hidden: [batch, seq, 384]
dims:
  batch: {buckets: [1, 2, 4, 8]}
  seq: {min: 8, max: 512, step: 8, max_padding: 0.5}
memory: {budget_mb: 2048}
"""


def problems(text: str, target=CPU, env=ENV):
    res = check_semantics(load_recipe(text), target, env)
    return {e.where: e for e in res.errors}, res


def err(text: str, where: str, target=CPU):
    errs, _ = problems(text, target)
    assert where in errs, f"no error at {where}: {[e.render() for e in errs.values()]}"
    e = errs[where]
    assert e.line is not None
    return e


def test_base_is_clean():
    errs, res = problems(BASE)
    assert errs == {} and res.warnings == []


@pytest.mark.parametrize("old,new,where,needle", [
    # dims
    ("buckets: [1, 2, 4, 8]", "buckets: [4, 1, 2]", "dims.batch.buckets", "sorted"),
    ("buckets: [1, 2, 4, 8]", "buckets: [1, 1, 2]", "dims.batch.buckets", "unique"),
    ("{buckets: [1, 2, 4, 8]}", "{buckets: [1, 2, 4], max: 8}", "dims.batch.max", "no bucket"),
    ("{buckets: [1, 2, 4, 8]}", "{buckets: [1, 2, 4], min: 2}", "dims.batch.buckets[0]", "below min"),
    ("{buckets: [1, 2, 4, 8]}", "{buckets: [2, 4, 6], step: 4}", "dims.batch.buckets[0]", "multiple of step"),
    ("{buckets: [1, 2, 4, 8]}", "{buckets: [1, 2, 4], max_buckets: 2}", "dims.batch.max_buckets", "exceed"),
    ("min: 8, max: 512", "min: 600, max: 512", "dims.seq.max", "below min"),
    ("min: 8, max: 512", "max: 512", "dims.seq.min", "needs both"),
    ("max: 512, step: 8", "max: 510, step: 8", "dims.seq.max", "multiple of step"),
    ("max_padding: 0.5", "max_padding: 0.5, max_buckets: 3", "dims.seq.max_padding", "max_buckets: 6"),
    ("max_padding: 0.5", "max_padding: 0.1", "dims.seq.max_padding", "whatever the bucket count"),
    # inputs / outputs
    ("shape: [batch, seq]}\n  - {name: attention_mask", "shape: [batch, sequence]}\n  - {name: attention_mask",
     "inputs[0].shape[1]", "not declared"),
    ("{name: input_ids, dtype: i64, shape: [batch, seq]}", "{name: input_ids, dtype: i64, shape: [batch, seq], "
     "pad_value: 0.5}", "inputs[0].pad_value", "does not fit"),
    ("hidden: [batch, seq, 384]", "hidden: [batch, tokens, 384]", "outputs.hidden[1]", "not declared"),
    # capture, optimize
    ("memory: {budget_mb: 2048}", "memory: {budget_mb: 2048}\ncapture: {exclude_ops: [softmax]}",
     "capture.exclude_ops", "exe_mode: hybrid"),
    ("memory: {budget_mb: 2048}", "memory: {budget_mb: 2048}\nexe_mode: hybrid\ncapture: {include_ops: [gelu], "
     "exclude_ops: [gelu]}", "capture.exclude_ops[0]", "both included and excluded"),
    # an op name that matches nothing (a typo, a Python path) was accepted and ignored
    ("memory: {budget_mb: 2048}", "memory: {budget_mb: 2048}\nexe_mode: hybrid\ncapture: {exclude_ops: [Gelu, gellu]}",
     "capture.exclude_ops[1]", "no ATen, ONNX or graphmode op"),
    ("memory: {budget_mb: 2048}", "memory: {budget_mb: 2048}\nexe_mode: hybrid\ncapture: {exclude_ops: "
     "[aten.gelu.default, torch.nn.functional.gelu]}", "capture.exclude_ops[1]", "no ATen, ONNX or graphmode op"),
    ("memory: {budget_mb: 2048}", "memory: {budget_mb: 2048}\nprecision: {overrides: {softmaxx: f32}}",
     "precision.overrides.softmaxx", "no op has this name"),
    # the precision pass reads graphmode ops: an ATen name (addmm) was accepted and narrowed nothing
    ("memory: {budget_mb: 2048}", "memory: {budget_mb: 2048}\nprecision: {overrides: {addmm: f64}}",
     "precision.overrides.addmm", "an ATen or ONNX name, not a graphmode op"),
    # a bf16 linear takes no int8 weight: nothing was stored int8, silently
    ("memory: {budget_mb: 2048}", "memory: {budget_mb: 2048}\nprecision: {weights: int8, overrides: {linear: f64}}",
     "precision.overrides.linear", "no weight would be stored int8"),
    ("memory: {budget_mb: 2048}", "memory: {budget_mb: 2048}\noptimize: {passes: [fuse, canonicalize]}",
     "optimize.passes[0]", "put canonicalize before it"),
    ("memory: {budget_mb: 2048}", "memory: {budget_mb: 2048}\noptimize: {passes: [canonicalize, fuse]}",
     "optimize.passes[1]", "must end with 'memory_plan'"),
    ("memory: {budget_mb: 2048}", "memory: {budget_mb: 2048}\noptimize: {passes: [canonicalize, frobnicate, "
     "memory_plan]}", "optimize.passes[1]", "unknown pass"),
    ("memory: {budget_mb: 2048}", "memory: {budget_mb: 2048}\noptimize: {passes: []}", "optimize.passes", "empty"),
    ("memory: {budget_mb: 2048}", "memory: {budget_mb: 2048}\noptimize: {preset: fastest}", "optimize.preset",
     "default"),
    ("memory: {budget_mb: 2048}", "memory: {budget_mb: 2048}\noptimize: {preset: default, passes: [memory_plan]}",
     "optimize.preset", "not both"),
    ("memory: {budget_mb: 2048}", "memory: {budget_mb: 2048}\noptimize: {fusion: {min_ops: 9, max_ops: 3}}",
     "optimize.fusion.max_ops", "below min_ops"),
    # precision (target-dependent)
    ("memory: {budget_mb: 2048}", "memory: {budget_mb: 2048}\nprecision: {compute: bf16}", "precision.compute",
     "does not compute in bf16"),
    ("memory: {budget_mb: 2048}", "memory: {budget_mb: 2048}\nprecision: {overrides: {softmax: f16}}",
     "precision.overrides.softmax", "f32, f64"),
    ("memory: {budget_mb: 2048}", "memory: {budget_mb: 2048}\nprecision: {compute: f64, accumulate: f32}",
     "precision.accumulate", "narrower"),
    # memory
    ("memory: {budget_mb: 2048}", "memory: {budget_mb: 999999}", "memory.budget_mb", "exceeds target"),
    ("memory: {budget_mb: 2048}", "memory: {budget_mb: 2048, kv_cache: {max_pages_per_seq: 8, seq_dim: len}}",
     "memory.kv_cache.seq_dim", "not declared"),
    ("model: {kind: encoder, params_m: 22.7, layers: 6, hidden: 384, heads: 12}", "",
     "memory.kv_cache.layers", "unknown"),
    # model, sla
    ("heads: 12}", "heads: 7}", "model.heads", "divisible"),
    ("memory: {budget_mb: 2048}", "memory: {budget_mb: 2048}\nsla: {p50_ms: 50, p99_ms: 10}", "sla.p50_ms",
     "p50 above p99"),
    ("memory: {budget_mb: 2048}", "memory: {budget_mb: 2048}\nsla: {per_bucket: [{match: {tokens: 1}, p50_ms: 5}]}",
     "sla.per_bucket[0].match.tokens", "not declared"),
    ("memory: {budget_mb: 2048}", "memory: {budget_mb: 2048}\nsla: {per_bucket: [{match: {batch: 64}, p50_ms: 5}]}",
     "sla.per_bucket[0].match.batch", "selects nothing"),
    ("memory: {budget_mb: 2048}", "memory: {budget_mb: 2048}\nsla: {per_bucket: [{match: {seq: [64, 8]}, "
     "p50_ms: 5}]}", "sla.per_bucket[0].match.seq", "lo > hi"),
    ("memory: {budget_mb: 2048}", "memory: {budget_mb: 2048}\nsla: {per_bucket: [{match: {batch: 1}}]}",
     "sla.per_bucket[0]", "no p50_ms"),
    # targets, aliases
    ("memory: {budget_mb: 2048}", "memory: {budget_mb: 2048}\ntargets: [h100_sxm, no_such_chip]", "targets[1]",
     "known targets"),
    ("memory: {budget_mb: 2048}", "memory: {budget_mb: 2048}\ntargets: [host, host]", "targets[1]", "duplicate"),
    ("memory: {budget_mb: 2048}", "memory: {budget_mb: 2048}\nalias_groups: [[input_ids, ghost]]",
     "alias_groups[0][1]", "not a declared input or output"),
    ("memory: {budget_mb: 2048}", "memory: {budget_mb: 2048}\nalias_groups: [[input_ids]]", "alias_groups[0]",
     "at least two"),
    ("memory: {budget_mb: 2048}", "memory: {budget_mb: 2048}\nalias_groups: [[input_ids, hidden], "
     "[attention_mask, input_ids]]", "alias_groups[1][1]", "already in alias group 0"),
])
def test_semantic_errors(old, new, where, needle):
    assert old in BASE, old
    text = BASE.replace(old, new, 1)
    if where == "memory.kv_cache.layers":
        text = text.replace("memory: {budget_mb: 2048}", "memory: {budget_mb: 2048, kv_cache: {max_pages_per_seq: 64}}")
    e = err(text, where)
    assert needle in e.render(), e.render()


def test_unused_dim():
    text = BASE.replace("dims:\n", "dims:\n  beam: 4\n")
    e = err(text, "dims.beam")
    assert "no input uses it" in e.message


def test_warnings_fusion_without_fuse():
    _, res = problems(BASE + "optimize: {preset: none}\n")
    assert any("no 'fuse' pass" in w for w in res.warnings)
    _, res = problems(BASE + "optimize: {fusion: {enabled: false}}\n")
    assert any("'fuse' pass will do nothing" in w for w in res.warnings)


def test_precision_checked_per_target():
    text = BASE + "precision: {compute: bf16, overrides: {softmax: f32}}\n"
    assert "precision.compute" in problems(text, CPU)[0]
    assert problems(text, GPU)[0] == {}
    assert "precision.compute" not in problems(text, None)[0]       # no target, no target checks


def test_requires_against_environment():
    text = BASE + 'requires: {torch: ">=2.13,<2.14", python: ">=3.11", driver: ">=535", cuda: ">=12"}\n'
    errs, res = problems(text)
    assert errs == {}
    status = {r.key: r.status for r in res.requires}
    assert status == {"torch": "ok", "python": "ok", "driver": "n/a", "cuda": "n/a"}
    assert "not applicable" in next(r for r in res.requires if r.key == "driver").reason
    # on a GPU target with a driver present, the constraint is checked
    gpu_env = Environment(python="3.11.7", torch="2.13.0+cu128", graphmode="0.1.0", driver="525.60.13", cuda="12.8")
    errs, res = problems(text, GPU, gpu_env)
    assert "requires.driver" in errs and "525.60.13" in errs["requires.driver"].message
    assert {r.key: r.status for r in res.requires}["cuda"] == "ok"
    # a failing torch pin
    errs, _ = problems(BASE + 'requires: {torch: ">=2.14"}\n')
    assert "requires.torch" in errs and "2.13.0+cpu" in errs["requires.torch"].message
    # torch missing entirely
    r = load_recipe(BASE + 'requires: {torch: ">=2"}\n')
    assert check_requires(r, Environment(python="3.11.0"))[0].status == "failed"


def test_detect_environment_reads_this_machine():
    env = detect_environment()
    assert env.python.startswith("3.") and env.torch and env.torch.startswith("2.")


def test_validate_skips_constraints_after_semantic_errors():
    rep = validate(load_recipe(BASE.replace("max: 512, step: 8", "max: 510, step: 8")), CPU, env=ENV)
    assert rep.verdict == "malformed" and rep.proofs == []
    assert [layer.status for layer in rep.layers] == ["ok", "failed", "skipped"]
    with pytest.raises(Exception) as ei:
        rep.raise_for_errors()
    assert ei.value.exit_code == 2 and "dims.seq.max" in str(ei.value)


def test_weight_only_precision_needs_f32_compute_and_its_pass():
    """precision.weights stores linear weights narrow with f32 activations: refused beside a
    low-precision compute, and where an explicit pass list leaves out quantize_weights; the
    presets run it. Left out of the recipe's stamp while f32, so existing hashes hold."""
    from graphmode.recipe.hashing import canonical_json
    ok = BASE + "precision: {weights: int8}\n"
    assert problems(ok)[0] == {} and load_recipe(ok).pipeline().index("quantize_weights") > 0
    e = err(BASE + "precision: {compute: bf16, weights: int8}\n", "precision.weights")
    assert "activations in f32" in e.message and e.fix
    e = err(BASE + "precision: {weights: bf16}\noptimize: {passes: [canonicalize, constant_fold, memory_plan]}\n",
            "precision.weights")
    assert "quantize_weights" in e.message and "quantize_weights" in e.fix
    e = err(BASE + "precision: {weights: int8}\noptimize: {preset: none}\n", "precision.weights")
    assert "optimize.preset none leaves out" in e.message and e.fix.startswith("preset: default")
    # before constant_fold a captured weight is a transpose, after fuse a linear sits in a region:
    # either way most weights stayed f32 (the docs said such a list is refused; it was accepted)
    for passes, at, why in (("[canonicalize, quantize_weights, constant_fold, memory_plan]", 1, "put constant_fold before"),
                            ("[canonicalize, constant_fold, fuse, quantize_weights, memory_plan]", 3, "before fuse")):
        e = err(BASE + f"precision: {{weights: int8}}\noptimize: {{passes: {passes}}}\n", f"optimize.passes[{at}]")
        assert why in e.fix and e.fix.startswith("put ")      # the order's fix is the error's fix line
    stamp = canonical_json(load_recipe(BASE)).replace(" ", "")
    assert '"precision":{"accumulate":null,"compute":"f32","overrides":{}}' in stamp
    assert '"weights":"int8"' in canonical_json(load_recipe(ok)).replace(" ", "")


def test_prefix_caching_under_batch_invariant_is_refused_by_validate_as_generate_refuses_it():
    """The docs said both are refused together; only `generate` did, `recipe validate` said valid."""
    import yaml
    doc = yaml.safe_load((Path(__file__).parents[3] / "examples" / "recipes" / "gpt2_decoder.yaml").read_text())
    doc["determinism"] = "batch_invariant"
    doc["memory"]["kv_cache"]["prefix_caching"] = True
    e = err(yaml.safe_dump(doc), "memory.kv_cache.prefix_caching")
    assert "batch_invariant cannot keep its logits" in e.message and "remove prefix_caching" in e.fix
