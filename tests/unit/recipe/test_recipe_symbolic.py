"""Target-relative values (`${target...}`, bank names) resolved against two different targets."""
from pathlib import Path

import pytest

from graphmode.errors import RecipeErrors
from graphmode.recipe import load_recipe, resolve, validate
from graphmode.recipe import symbolic as S
from graphmode.targets.schema import Target

DATA = Path(__file__).resolve().parents[1] / "data" / "recipes"
GROUPS = {"compute_classes": {"vector": {"units": 1}}}

H100 = Target(name="h100_like", kind="gpu", vendor="nvidia", arch="sm_90", compute_units=132,
              vector_width_bits=1024, l1_bytes=256 * 1024, l2_bytes=50 * 2**20, llc_bytes=50 * 2**20,
              memory_bytes=80 * 2**30, memory_bandwidth_gbps=3350.0,
              peak_flops={"f32": 67e12, "bf16": 989e12}, dtypes=["f32", "bf16"], launch_overhead_us=4.0,
              groups={**GROUPS, "memory_banks": {
                  "high_bandwidth": {"aliases": ["hbm"], "ids": [4, 5, 6, 7], "bandwidth_gbps": 3350},
                  "low_power": {"ids": [0, 1, 2, 3], "bandwidth_gbps": 800}}})
CPU = Target(name="cpu_like", kind="cpu", vendor="amd", arch="zen3", compute_units=2, vector_width_bits=256,
             l1_bytes=32768, l2_bytes=524288, llc_bytes=32 * 2**20, memory_bytes=24 * 2**30,
             memory_bandwidth_gbps=20.0, peak_flops={"f32": 150e9}, dtypes=["f32"], launch_overhead_us=2.0,
             groups={**GROUPS, "memory_banks": {"system_dram": {"aliases": ["high_bandwidth", "dram"], "ids": [0],
                                                                "bandwidth_gbps": 20}}})
BARE = CPU.model_copy(update={"name": "bare", "groups": {}})


def test_same_recipe_resolves_differently_on_two_targets():
    r = load_recipe(DATA / "symbolic.yaml")
    assert r.is_symbolic() and r.memory.budget_mb.startswith("${")
    g, c = resolve(r, H100), resolve(r, CPU)
    assert g.memory.budget_mb == 4096 and c.memory.budget_mb == 4096          # min(half of memory, 4096)
    assert g.memory.bank_affinity == [4, 5, 6, 7] and c.memory.bank_affinity == [0]
    assert g.sla.p99_ms == pytest.approx(max(10, 4e12 / 67e12 * 1000))
    assert c.sla.p99_ms == pytest.approx(4e12 / 150e9 * 1000)
    assert not g.is_symbolic() and g.resolved_on == "h100_like"
    assert g.hash() != c.hash() != r.hash()                                  # the stamp is per resolution
    assert any("[4, 5, 6, 7]" in n for n in g.notes)


def test_resolution_on_small_target_and_validation():
    small = CPU.model_copy(update={"name": "small", "memory_bytes": 4 * 2**30})
    r = resolve(load_recipe(DATA / "symbolic.yaml"), small)
    assert r.memory.budget_mb == 2048                                        # half of 4 GiB
    rep = validate(load_recipe(DATA / "symbolic.yaml"), H100)
    assert rep.verdict == "valid" and rep.recipe.memory.budget_mb == 4096
    assert rep.hash == rep.recipe.hash()


def test_bank_affinity_alias_and_unknown_name():
    text = (DATA / "symbolic.yaml").read_text()
    r = resolve(load_recipe(text.replace("[high_bandwidth]", "[hbm, low_power, 2]")), H100)
    assert r.memory.bank_affinity == [4, 5, 6, 7, 0, 1, 2, 3]
    with pytest.raises(RecipeErrors) as ei:
        resolve(load_recipe(text.replace("[high_bandwidth]", "[high_bandwidth, turbo_banks]")), H100)
    e = ei.value.errors[0]
    assert e.where == "memory.bank_affinity[1]" and "low_power" in e.render() and e.line == 12
    r = resolve(load_recipe(text), BARE)                                     # no memory banks: does not apply
    assert r.memory.bank_affinity == [] and "does not apply" in r.notes[0]


@pytest.mark.parametrize("expr,value", [
    ("${target.memory_mb * 0.5}", 40 * 1024),
    ("${target.memory_gb}", 80),
    ("${target.peak_tflops.bf16 / 2}", 494.5),
    ("${floor(target.memory_bandwidth_gbps / 1000)}", 3),
    ("${ceil(target.compute_units / 64) + -1}", 2),
    ("${max(1, min(target.l2_bytes // 2**20, 8)) % 5}", 3),
    ("${round(abs(-2.6))}", 3),
    ("${target.groups.memory_banks.hbm.bandwidth_gbps}", 3350),
])
def test_expression_language(expr, value):
    assert S.evaluate(expr, H100) == pytest.approx(value)


@pytest.mark.parametrize("expr,needle", [
    ("${}", "empty"),
    ("${__import__('os')}", "only these functions"),
    ("${target.__class__}", "unknown reference"),
    ("${(lambda: 1)()}", "only these functions"),
    ("${[1, 2]}", "not allowed"),
    ("${'a' * 3}", "only numbers"),
    ("${True + 1}", "only numbers"),
    ("${2 ** 100}", "exponent"),
    ("${2 ** target.compute_units}", "exponent"),
    ("${1 << 3}", "operator LShift"),
    ("${1 if target.memory_mb else 2}", "not allowed"),
    ("${os.environ}", "unknown name 'os'"),
    ("${target.memory_mb +}", "syntax error"),
    ("${max()}", "needs an argument"),
    ("${" + "1+" * 150 + "1}", "longer than"),
])
def test_expression_language_rejects(expr, needle):
    with pytest.raises(S.SymbolicError, match=None) as ei:
        S.parse(expr)
    assert needle in str(ei.value)


@pytest.mark.parametrize("expr,needle", [
    ("${target.peak_flops.fp8_e4m3}", "no peak_flops"),
    ("${target.groups.memory_banks.sram.bytes}", "no memory_banks entry"),
    ("${target.groups.memory_banks.hbm.capacity}", "has no 'capacity'"),
    ("${target.groups.memory_banks.hbm.aliases}", "not a number"),
    ("${target.memory_mb / (target.compute_units - 132)}", "division by zero"),
])
def test_resolution_errors(expr, needle):
    with pytest.raises(S.SymbolicError) as ei:
        S.evaluate(expr, H100)
    assert needle in str(ei.value)


def test_resolution_errors_carry_path_and_line():
    text = (DATA / "symbolic.yaml").read_text().replace("target.peak_flops.f32", "target.peak_flops.bf16")
    r = load_recipe(text)
    with pytest.raises(RecipeErrors) as ei:
        resolve(r, CPU)
    e = ei.value.errors[0]
    assert e.where == "sla.p99_ms" and e.line == 14 and "cpu_like" in e.message and "bf16" in e.message
    resolve(r, H100)                                                        # fine where the peak exists
    rep = validate(r, CPU)
    assert rep.verdict == "malformed" and rep.errors[0].where == "sla.p99_ms"


def test_resolved_value_must_still_fit_the_schema():
    text = (DATA / "symbolic.yaml").read_text().replace("${min(target.memory_mb * 0.5, 4096)}",
                                                        "${target.memory_mb - 10**9}")
    with pytest.raises(RecipeErrors) as ei:
        resolve(load_recipe(text), CPU)
    e = ei.value.errors[0]
    assert e.where == "memory.budget_mb" and "must be > 0" in e.message and "after resolving" in e.message


def test_integer_fields_resolve_to_ints():
    text = (DATA / "symbolic.yaml").read_text().replace(
        "  bank_affinity", "  kv_cache: {max_pages_per_seq: '${target.compute_units // 2}', layers: 6, "
                           "kv_heads: 12, head_dim: 32}\n  bank_affinity")
    r = resolve(load_recipe(text), H100)
    assert r.memory.kv_cache.max_pages_per_seq == 66 and isinstance(r.memory.kv_cache.max_pages_per_seq, int)
    text = text.replace("compute_units // 2", "compute_units / 5")
    with pytest.raises(RecipeErrors) as ei:
        resolve(load_recipe(text), H100)
    assert "integer" in ei.value.errors[0].message
