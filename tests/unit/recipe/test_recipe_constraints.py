"""Recipe layer 3: Z3 proofs of memory, latency (SLA) and KV pages over every admissible shape."""
import math
from pathlib import Path

import pytest
import sympy
import yaml
import z3
from hypothesis import given, settings
from hypothesis import strategies as st

from graphmode.errors import ConstraintError
from graphmode.recipe import (ModelFacts, build_constraint_model, dim_symbol, estimate_facts, kv_cache_bytes,
                              load_recipe, validate)
from graphmode.recipe import constraints as C
from graphmode.recipe.smt import SmtError, evaluate, to_z3
from graphmode.targets import load_target_file

ROOT = Path(__file__).resolve().parents[3]
DATA = Path(__file__).resolve().parents[1] / "data" / "recipes"
CPU = load_target_file(DATA / "cpu_target.yaml")
GPU = load_target_file(DATA / "gpu_target.yaml")
MB = 2**20
B, S = dim_symbol("batch"), dim_symbol("seq")


# ---- sympy -> z3 ---------------------------------------------------------------------------

def z3_value(expr, values):
    vars = {k: z3.Int(k) for k in values}
    z, d = to_z3(expr, vars)
    s = z3.Solver()
    s.add(*[vars[k] == v for k, v in values.items()])
    assert s.check() == z3.sat
    return sympy.Rational(s.model().eval(z).as_long(), d)


@pytest.mark.parametrize("expr", [
    B * S + 3, 4 * B * S**2 - S, sympy.ceiling(S / 16) * B, sympy.floor((B + S) / 3),
    sympy.Max(B * 7, S) + sympy.Min(B, 5), sympy.Rational(3, 7) * S + sympy.Rational(1, 2),
    sympy.Float(0.25) * B * S, sympy.ceiling(sympy.Rational(5, 3) * S - B / 2), sympy.Abs(B - S), B**3,
    sympy.Mod(S, 64), sympy.Mod(B * S - 100, 7) + 1, sympy.Mod(S / 3, sympy.Rational(5, 2)),
    # quotients by dims: torch's arange(0, b*s, s) length (nn.EmbeddingBag), which sympy keeps as b + 1 + floor(-1/s)
    sympy.floor((B * S + S - 1) / S), sympy.ceiling(B * S / (S + 1)) + sympy.floor(sympy.Rational(7, 2) / (B * S)),
])
def test_to_z3_matches_sympy(expr):
    for b, s in [(1, 1), (3, 17), (32, 512), (7, 100)]:
        assert z3_value(expr, {"batch": b, "seq": s}) == evaluate(expr, {"batch": b, "seq": s})


@settings(max_examples=60, deadline=None)
@given(a=st.integers(-50, 50), c=st.integers(1, 40), k=st.integers(-9, 9), b=st.integers(1, 64),
       s=st.integers(1, 600))
def test_to_z3_property(a, c, k, b, s):
    expr = (a * B * S + sympy.ceiling(S / c) * k + sympy.floor(B * S / (c + 1)) - sympy.Max(S, c * B)
            + sympy.Mod(a * S + k, c))
    assert z3_value(expr, {"batch": b, "seq": s}) == evaluate(expr, {"batch": b, "seq": s})


def test_to_z3_rejects_unsupported():
    with pytest.raises(SmtError, match="not a recipe dim"):
        to_z3(B * sympy.Symbol("heads"), {"batch": z3.Int("batch")})
    with pytest.raises(SmtError):
        to_z3(sympy.log(B), {"batch": z3.Int("batch")})
    with pytest.raises(SmtError):
        to_z3(1 / B, {"batch": z3.Int("batch")})
    with pytest.raises(SmtError, match="not positive"):
        to_z3(sympy.floor(B / (B - S)), {"batch": z3.Int("batch"), "seq": z3.Int("seq")})


# ---- memory ----------------------------------------------------------------------------------

def test_over_budget_counterexample_checked_by_evaluation():
    r = load_recipe(DATA / "minilm_over_budget.yaml")
    rep = validate(r, CPU)
    assert rep.verdict == "refused"
    mem = next(p for p in rep.proofs if p.name == "memory")
    ce = mem.counterexample
    assert ce == {"batch": 32, "seq": 512}
    assert mem.message.startswith("batch=32, seq=512: needs 1263.1 MB > 1024 MB budget")
    total = evaluate(rep.model.memory_bytes, ce)                 # direct evaluation agrees
    assert total > 1024 * MB and mem.detail["needed_bytes"] == int(total)
    assert set(r.dim_buckets()["seq"]) >= {ce["seq"]}             # a padded bucket, not an arbitrary value
    with pytest.raises(ConstraintError) as ei:
        rep.raise_for_errors()
    assert ei.value.exit_code == 1 and ei.value.counterexample == ce and "batch=32, seq=512" in str(ei.value)


def test_a_tiny_budget_and_what_it_refuses_read_as_numbers():
    """'needs 0.0 MB > 0.00999928 MB budget': the need rounded away and the budget showed float noise."""
    import yaml
    data = yaml.safe_load((DATA / "minilm_over_budget.yaml").read_text())
    data["memory"]["budget_mb"] = 0.01
    mem = next(p for p in validate(load_recipe(data), CPU).proofs if p.name == "memory")
    assert "> 0.01 MB budget" in mem.message and "needs 0.0 MB" not in mem.message, mem.message


def test_a_refused_memory_proof_leads_with_the_lever_of_its_largest_term():
    """The fix was one sentence whatever held the memory ('or lower precision', also for an
    int4 recipe whose weights were the smallest term)."""
    def fix(path, **over):
        data = yaml.safe_load(path.read_text())
        for k, v in over.items():
            data.setdefault(k, {}).update(v)
        with pytest.raises(ConstraintError) as ei:
            validate(load_recipe(data), CPU).raise_for_errors()
        return ei.value.fix
    activations = fix(DATA / "minilm_over_budget.yaml")
    assert activations.startswith("shrink the largest buckets") and "precision.weights: int8 or int4" in activations
    weights = fix(ROOT / "examples/recipes/gpt2_decoder.yaml", memory={"budget_mb": 900})
    assert weights.startswith("store linear weights narrow (precision.weights: int8 or int4)")
    kv = fix(ROOT / "examples/recipes/gpt2_decoder_int4.yaml", memory={"budget_mb": 900, "weight_growth": 1})
    assert kv.startswith("shrink the KV pool") and "int4)" not in kv and kv.endswith("or raise memory.budget_mb")


def test_weights_that_are_mostly_an_embedding_table_are_not_told_to_narrow():
    """Trial AB: a 2,000,000 x 16 table over a 64 MB budget was told to narrow its linear weights
    (int8, then int4 once int8 was set) and lower weight_growth: neither touches a lookup table."""
    from graphmode.recipe.validate import memory_fix
    rec = load_recipe(yaml.safe_load((ROOT / "examples/recipes/gpt2_decoder.yaml").read_text()))
    mb = 2**20
    table = memory_fix(rec, {"weights": 122 * mb, "prepared_weights": 0.01 * mb, "activations": 0.1 * mb},
                       lookup_bytes=121.9 * mb)
    assert table == ("shrink the embedding tables (121.9 MB: precision.weights does not narrow a lookup table), "
                     "or raise memory.budget_mb")
    dense = memory_fix(rec, {"weights": 122 * mb, "prepared_weights": 300 * mb, "activations": 0.1 * mb})
    assert dense.startswith("store linear weights narrow") and "weight_growth" in dense and "embedding" not in dense


def test_quantized_weights_shrink_the_estimate_before_loading():
    """precision.weights stores the linear weights narrow; the estimate counted them at f32."""
    base = yaml.safe_load((ROOT / "examples/recipes/gpt2_decoder.yaml").read_text())
    est = {w: estimate_facts(load_recipe({**base, "precision": {**base["precision"], "weights": w}})).weights_bytes
           for w in ("f32", "bf16", "int8", "int4")}
    assert est["f32"] > est["bf16"] > est["int8"] > est["int4"] and est["int4"] < est["f32"] / 2
    no_shape = {**base, "model": {"kind": "decoder", "params_m": 124.4}, "precision": {"weights": "int4"}}
    facts = estimate_facts(load_recipe(no_shape))
    assert facts.weights_bytes == est["f32"] and any("model.layers and model.hidden" in n for n in facts.notes)


def test_memory_proof_with_headroom_and_enumeration_agree():
    rep = validate(load_recipe(ROOT / "examples/recipes/minilm_cpu.yaml"), CPU)
    mem = next(p for p in rep.proofs if p.name == "memory")
    assert mem.status == "proved"
    cm = rep.model
    worst = max(evaluate(cm.memory_bytes, b) for b in rep.recipe.buckets())
    assert abs(mem.detail["worst_bytes"] - float(worst)) < 1
    # a budget just below the worst case is refuted at exactly the worst bucket
    cm.budget_bytes = int(worst) - 1
    p = C.prove_memory(cm)
    assert p.status == "refuted" and evaluate(cm.memory_bytes, p.counterexample) > cm.budget_bytes
    cm.budget_bytes = int(worst)
    assert C.prove_memory(cm).status == "proved"


def test_range_dims_proved_symbolically():
    r = load_recipe(DATA / "range_decoder.yaml")
    assert r.plans_count() == 16 * 128
    rep = validate(r, CPU)
    assert rep.verdict == "valid", [p.message for p in rep.proofs]
    assert sum(p.seconds for p in rep.proofs) < 2
    cm = rep.model
    worst = evaluate(cm.memory_bytes, {"batch": 16, "seq": 2048})     # monotone in both dims
    mem = next(p for p in rep.proofs if p.name == "memory")
    assert abs(mem.detail["worst_bytes"] - float(worst)) < 1 and mem.detail["worst_at"] == {"batch": 16, "seq": 2048}
    cm.budget_bytes = int(worst) - 1
    p = C.prove_memory(cm)
    assert p.status == "refuted" and evaluate(cm.memory_bytes, p.counterexample) > cm.budget_bytes
    assert p.counterexample["seq"] % 16 == 0


def test_kv_cache_term_and_pages():
    r = load_recipe(ROOT / "examples/recipes/gpt2_decoder.yaml")
    kv = kv_cache_bytes(r)
    # the pool the runtime allocates, whatever the request: 2 (K,V) x 12 layers x 12 heads x 64 dims x
    # 4 bytes x 16 tokens per page, for 8 sequences (the largest batch) of 64 pages each
    page = 2 * 12 * 12 * 64 * 4 * 16
    assert evaluate(kv, {"batch": 2, "seq": 17}) == page * 8 * 64
    sized = load_recipe((ROOT / "examples/recipes/gpt2_decoder.yaml").read_text().replace(
        "max_pages_per_seq: 64", "max_pages_per_seq: 64\n    pages: 100"))
    assert kv_cache_bytes(sized) == page * 100
    text = (ROOT / "examples/recipes/gpt2_decoder.yaml").read_text().replace("max_pages_per_seq: 64",
                                                                              "max_pages_per_seq: 48")
    rep = validate(load_recipe(text), CPU)
    pages = next(p for p in rep.proofs if p.name == "memory.kv_cache.max_pages_per_seq")
    assert pages.status == "refuted" and rep.verdict == "refused"
    seq = pages.counterexample["seq"]
    assert -(-seq // 16) > 48 and "pages of 16 tokens > max_pages_per_seq 48" in pages.message


# ---- latency ---------------------------------------------------------------------------------

def test_sla_refuted_with_roofline_breakdown():
    text = (ROOT / "examples/recipes/minilm_cpu.yaml").read_text().replace("p99_ms: 20000", "p99_ms: 500")
    rep = validate(load_recipe(text), CPU)
    p = next(p for p in rep.proofs if p.name == "sla.p99_ms")
    assert p.status == "refuted"
    pred = evaluate(rep.model.latency_s(), p.counterexample)
    assert pred > sympy.Rational(1, 2) and abs(p.detail["predicted_ms"] - float(pred) * 1000) < 1e-6
    assert "GFLOP" in p.message and "launches" in p.message
    # the same recipe on the GPU meets the SLA
    assert validate(load_recipe(text), GPU).verdict == "valid"


def test_per_bucket_sla_covers_buckets_requests_pad_into():
    text = (ROOT / "examples/recipes/minilm_cpu.yaml").read_text()
    r = load_recipe(text)
    cm = build_constraint_model(r, CPU)
    b = next(x for x in cm.sla if x.path == "sla.per_bucket[0]")
    seq_buckets = r.dim_buckets()["seq"]
    assert b.select["seq"] == (2, min(x for x in seq_buckets if x >= 128))   # a seq=128 request pads up
    assert b.select["batch"] == (1, 1) and b.which == "p50" and b.bound_ms == 250


def test_sla_without_flops_is_unproved_not_valid():
    text = (DATA / "minilm_over_budget.yaml").read_text().replace(
        "model: {kind: encoder, params_m: 22.7, layers: 6, hidden: 384, heads: 12, intermediate: 1536}",
        "model: {params_m: 22.7}").replace("budget_mb: 1024", "budget_mb: 4096") + "sla: {p99_ms: 100}\n"
    rep = validate(load_recipe(text), CPU)
    p = next(p for p in rep.proofs if p.name.startswith("sla"))
    assert p.status == "unproved" and "gflops_per_item" in p.message
    assert rep.verdict == "unproved" and not rep.ok
    with pytest.raises(ConstraintError):
        rep.raise_for_errors()


def test_timeout_reports_unproved(monkeypatch):
    monkeypatch.setattr(C, "_solve", lambda cons, vars, timeout_ms, domains=None: ("unknown", "timeout"))
    rep = validate(load_recipe(ROOT / "examples/recipes/resnet18_cpu.yaml"), CPU)
    others = [p for p in rep.proofs if p.name != "memory"]      # memory: decided at the buckets (below)
    assert others and {p.status for p in others} == {"unproved"}
    assert all("unproved (timeout)" in p.message for p in others)
    memory = next(p for p in rep.proofs if p.name == "memory")
    assert memory.status == "proved" and "decided at each of the" in memory.message
    assert rep.verdict == "unproved"


# ---- ModelFacts: the compiler's interface ----------------------------------------------------

def test_compiler_facts_replace_the_estimate():
    r = load_recipe(ROOT / "examples/recipes/gpt2_decoder.yaml")
    est = estimate_facts(r)
    assert est.weights_bytes == int(round(124.4e6)) * 4 and est.flops is not None
    # the planner's exact arena expression (any sympy expr over dim symbols, by name)
    b, s = sympy.Symbol("batch"), sympy.Symbol("seq")
    facts = ModelFacts(weights_bytes=500 * MB, activation_bytes=b * s * 768 * 4 * 10 + 2 * MB,
                       flops=2 * 124 * 10**6 * b * s, bytes_moved=500 * MB + b * s * 768 * 4 * 40, n_ops=150,
                       source="memory planner (test)")
    rep = validate(r, CPU, model_facts=facts)
    assert rep.verdict == "valid" and rep.model.facts_source == "memory planner (test)"
    # KV always from the recipe; the kernels' prepared copies beside the weights, memory.weight_growth x them
    assert set(rep.model.memory_terms) == {"weights", "prepared_weights", "activations", "kv_cache"}
    assert rep.model.memory_terms["prepared_weights"] == math.ceil(500 * MB * r.memory.weight_growth)
    worst = rep.proofs[[p.name for p in rep.proofs].index("memory")].detail["worst_bytes"]
    expect = (500 * MB * (1 + r.memory.weight_growth) + 8 * 1023 * 768 * 40 + 2 * MB
              + evaluate(kv_cache_bytes(r), {"batch": 8, "seq": 1023}))
    assert abs(worst - float(expect)) < 1
    # a facts expression with an unknown symbol cannot be proved (never "valid")
    bad = ModelFacts(weights_bytes=0, activation_bytes=sympy.Symbol("heads") * 4)
    rep = validate(r, CPU, model_facts=bad)
    mem = next(p for p in rep.proofs if p.name == "memory")
    assert mem.status == "unproved" and "heads" in mem.message



def test_prepared_copies_count_in_memory_not_in_traffic():
    """A kernel reads a weight's prepared copy instead of the original: the copies are memory
    the plan holds, not bytes one run moves (the latency roofline and the bench's floor read
    `resident_once_bytes`)."""
    r = load_recipe(ROOT / "examples/recipes/minilm_cpu.yaml")
    facts = ModelFacts(weights_bytes=100 * MB, activation_bytes=10 * MB, flops=1, n_ops=0)
    cm = build_constraint_model(r, CPU, facts)
    assert cm.memory_bytes == 110 * MB + math.ceil(100 * MB * r.memory.weight_growth)
    assert cm.resident_once_bytes == 110 * MB
    moved = sympy.Rational(110 * MB) / sympy.Rational(cm.bandwidth.numerator, cm.bandwidth.denominator)
    assert sympy.simplify(cm.latency_s() - moved) == 0          # memory-bound: 1 FLOP

def test_shipped_recipes_prove_fast():
    for name in ("minilm_cpu", "gpt2_decoder", "resnet18_cpu"):
        rep = validate(load_recipe(ROOT / f"examples/recipes/{name}.yaml"), CPU)
        assert rep.verdict == "valid", (name, [p.message for p in rep.proofs])
        assert sum(p.seconds for p in rep.proofs) < 2.0


def test_a_memory_proof_z3_gives_up_on_is_decided_at_the_buckets():
    """ResNet with dynamic H and W: Z3 timed out on the strided convs' floors and the recipe was
    unproved (with a fix reading "or raise memory.budget_mb"); plans exist at the buckets only, so
    evaluating each decides it exactly."""
    import sympy

    from graphmode.recipe.constraints import ConstraintModel, prove_memory
    h, w = (sympy.Symbol(n, integer=True, positive=True) for n in "HW")
    down = lambda x: sympy.floor((sympy.floor((x - 1) / 2) + 1 - 1) / 2) + 1  # noqa: E731
    need = 1000 * down(h) * down(w) * (sympy.floor(h / 7) + sympy.floor(w / 3))
    cm = ConstraintModel(domains={"H": [64, 96, 128], "W": [64, 96, 128]}, memory_terms={"activations": need},
                         budget_bytes=10**9, budget_source="954 MB budget")
    p = prove_memory(cm, timeout_ms=1)
    assert p.status == "proved" and "H=128, W=128" in p.message
    cm.budget_bytes = 10**6
    p = prove_memory(cm, timeout_ms=1)
    assert p.status == "refuted" and p.counterexample == {"H": 128, "W": 128}
