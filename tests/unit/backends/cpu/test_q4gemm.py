"""int4 weights (recipe `precision.weights: int4`): the packed format (ir/ops/int4.py) and the
generated kernel (backends/cpu/q4gemm.py). The format packs and unpacks to the same codes and
quantizes within half a step; the kernel matches the op's reference (dequantize, then an f32
linear) to fp32 rounding over groups 32/64/128, both schemes, one row (decode), partial tiles,
the threaded split and the panel path. Other ISA paths run in test_isa_paths.py. Recipe fields
refuse bad values by name. No timing assertions."""
from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch

from graphmode.backends.cpu.build import DEFAULT_FLAGS, KernelBuilder
from graphmode.backends.cpu.isa import host_simd
from graphmode.backends.cpu.catalog import claim_native, native_source
from graphmode.backends.cpu.kernels import run_with_tensors
from graphmode.backends.cpu.lowering import OpCall
from graphmode.backends.cpu.wgemm import PANEL_ROWS
from graphmode.errors import IRError, RecipeErrors
from graphmode.ir.ops import get_op, int4
from graphmode.ir.types import TensorType
from graphmode.passes.quantize_weights import quantize
from graphmode.recipe import load_recipe, validate
from graphmode.recipe.semantics import check_semantics
from graphmode.verify.numerics import rel_l2

_PROBE = KernelBuilder(Path(tempfile.gettempdir()) / "graphmode-test-probe")
needs_cxx = pytest.mark.skipif(not _PROBE.compiler_available(), reason="no C++ compiler on this machine")

G = torch.Generator().manual_seed(0)

# (leading dims of x, N, K, group, scheme, bias)
SHAPES = {
    "decode_row": ((1,), 96, 64, 32, "symmetric", True),
    "decode_row_asym_g128": ((1, 1), 50, 256, 128, "asymmetric", False),
    "partial_tiles_g64": ((7,), 13, 192, 64, "asymmetric", True),
    "batch4": ((4,), 37, 128, 32, "symmetric", False),
    "threaded_prefill": ((40,), 300, 256, 32, "asymmetric", True),
    "threaded_dot": ((3,), 700, 512, 128, "symmetric", True),
    "threaded_panels_g64": ((33,), 129, 128, 64, "symmetric", False),
    "q8_decode_row": ((1,), 96, 64, 32, "q8", True),
    "q8_odd_blocks": ((5,), 13, 96, 32, "q8", False),              # 3 blocks: AVX-512's half step
    "q8_batch4": ((2, 2), 37, 128, 32, "q8", True),
    "threaded_q8_rows": ((40,), 300, 256, 32, "q8", True),         # no panels under q8
}


def _case(lead, n, k, group, scheme, bias):
    """(inputs, attrs, the reference's output); scheme "q8": symmetric codes, q8 activations."""
    x = torch.randn(*lead, k, generator=G)
    x[..., :32] = 0.0                                   # a block of zeros: d = 0
    w, scale = quantize(torch.randn(n, k, generator=G), "int4", group, "symmetric" if scheme == "q8" else scheme)
    ins = [x, w, scale] + ([torch.randn(n, generator=G)] if bias else [])
    attrs = {"act": "q8"} if scheme == "q8" else {}
    return ins, attrs, get_op("qlinear").ref(ins, attrs, {})[0]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    if not _PROBE.compiler_available():
        pytest.skip("no C++ compiler")
    cases, sources = {}, []
    for name, shape in SHAPES.items():
        ins, attrs, want = _case(*shape)
        src = native_source("qlinear", ins, [torch.empty_like(want)], attrs, {},
                            [f"{name}_{i}" for i in range(len(ins))], [f"{name}_y"])
        assert src is not None, name
        cases[name] = (ins, want, src)
        sources.append(src)
    builder = KernelBuilder(tmp_path_factory.mktemp("q4gemm"), threads=2)
    return cases, builder.build_many(sources)


@needs_cxx
@pytest.mark.parametrize("name", list(SHAPES))
def test_kernel_matches_dequantize_then_matmul(built, name):
    cases, kernels = built
    ins, want, src = cases[name]
    got = run_with_tensors(kernels[src.symbol], dict(zip(src.inputs, ins)), source=src)[src.outputs[0]]
    assert got.shape == want.shape and rel_l2(got, want) < 1e-6, (name, rel_l2(got, want))
    lead, _n, _k, group, scheme, _b = SHAPES[name]
    assert (f"int4 symmetric g{group} x q8" if scheme == "q8" else f"int4 {scheme} g{group}") in src.pattern
    assert ("omp parallel" in src.source) == name.startswith("threaded"), name
    rows = 1
    for d in lead:
        rows *= d
    assert ("(panels)" in src.pattern) == (rows >= PANEL_ROWS and scheme != "q8"), name


@needs_cxx
def test_q8_without_vnni(tmp_path):
    """AVX-512 hosts without VNNI take vpmaddubsw + vpmaddwd for the block sums (test_isa_paths
    runs the AVX2 and portable paths); built with VNNI turned off, it computes the same sums."""
    if "avx512bw" not in host_simd():
        pytest.skip("no AVX-512BW on this host")
    ins, attrs, want = _case((3,), 21, 160, 32, "q8", True)
    src = native_source("qlinear", ins, [torch.empty_like(want)], attrs, {}, ["x", "w", "s", "b"], ["y"])
    builder = KernelBuilder(tmp_path, flags=DEFAULT_FLAGS + ("-mno-avx512vnni",))
    got = run_with_tensors(builder.build_many([src])[src.symbol], ins, source=src)["y"]
    assert rel_l2(got, want) < 1e-6
    if shutil.which("objdump"):
        asm = subprocess.run(["objdump", "-d", str(builder.library_path([src]))], capture_output=True, text=True,
                             check=True).stdout
        assert "vpmaddubsw" in asm and "%zmm" in asm and "vpdpbusd" not in asm


def test_q8_reference():
    """int4.q8_linear: llama.cpp q8_0's blocks (the largest magnitude is +-127 codes, a zero
    block has d = 0), close to the f32 answer (about 1e-2 relative here) but not equal to it."""
    x = torch.randn(2, 3, 64, generator=G)
    x[0, 0, 32:] = 0.0
    r, d = int4.quantize_activations(x)
    assert r.shape == (2, 3, 2, 32) and d.shape == (2, 3, 2)
    assert torch.equal(r.abs().amax(-1)[d != 0], torch.full_like(d[d != 0], 127.0))
    assert d[0, 0, 1] == 0 and torch.equal(r[0, 0, 1], torch.zeros(32))
    assert torch.allclose(r * d[..., None], x.reshape(2, 3, 2, 32), atol=float(d.max()) / 2 + 1e-7)
    w, s = quantize(torch.randn(7, 64, generator=G), "int4", 32)
    y, f32 = int4.q8_linear(x, w, s), torch.nn.functional.linear(x, int4.dequantize(w, s))
    assert y.shape == (2, 3, 7) and 0 < rel_l2(y, f32) < 2e-2
    with pytest.raises(ValueError, match="group 32"):
        int4.q8_linear(torch.randn(1, 64), *quantize(torch.randn(3, 64), "int4", 64))


@pytest.mark.parametrize("group", int4.GROUPS)
def test_pack_unpack_round_trip(group):
    q = torch.randint(0, 16, (5, 2 * group), generator=G, dtype=torch.uint8)
    packed = int4.pack(q, group)
    assert packed.dtype == torch.uint8 and packed.shape == (5, group)
    assert torch.equal(int4.unpack(packed, group), q)
    # llama.cpp's order: byte j of a group holds codes j (low nibble) and j + G/2 (high nibble)
    assert int(packed[0, 0]) == int(q[0, 0]) | (int(q[0, group // 2]) << 4)


@pytest.mark.parametrize("scheme", int4.SCHEMES)
@pytest.mark.parametrize("group", int4.GROUPS)
def test_quantized_weights_are_within_half_a_step(scheme, group):
    w = torch.randn(6, 2 * group, generator=G)
    w[1] = 0.0                                      # an all-zero row
    w[2, :group] = 0.25                             # a constant group
    packed, scale = quantize(w, "int4", group, scheme)
    assert packed.shape == (6, group)
    steps = (scale[..., 0] if scheme == "asymmetric" else scale).abs()
    assert scale.shape == ((6, 2, 2) if scheme == "asymmetric" else (6, 2))
    deq = int4.dequantize(packed, scale)
    err = (deq - w).abs().reshape(6, 2, group)
    codes = int4.unpack(packed, group).reshape(6, 2, group)
    # within half a step, but for symmetric codes clamped at +7: the side opposite the peak (-8
    # steps) reaches 8 steps too (llama.cpp q4_0's rule), so those are within one step
    clamped = (codes == 15) if scheme == "symmetric" else torch.zeros_like(codes, dtype=torch.bool)
    bound = torch.where(clamped, steps[..., None], steps[..., None] / 2)
    assert torch.all(err <= bound + 1e-6)
    assert torch.equal(deq[1], torch.zeros(2 * group)) and torch.allclose(deq[2, :group], w[2, :group])
    if scheme == "symmetric":      # the group's largest-magnitude weight is exactly -8 steps
        peak = w.reshape(6, 2, group).abs().argmax(-1)
        assert torch.equal(deq.reshape(6, 2, group).gather(2, peak[..., None]),
                           w.reshape(6, 2, group).gather(2, peak[..., None]))


def test_op_refuses_scales_that_do_not_match():
    spec = get_op("qlinear")
    x, w = TensorType("f32", (2, 64)), TensorType("u8", (4, 32))
    assert spec.infer([x, w, TensorType("f32", (4, 2))], {})[0].shape == (2, 4)              # group 32
    assert spec.infer([x, w, TensorType("f32", (4, 1, 2))], {})[0].shape == (2, 4)           # group 64, asym
    for bad in [TensorType("f32", (4, 4)), TensorType("f32", (4, 2, 3)), TensorType("f32", (3, 2))]:
        with pytest.raises(IRError, match="int4"):
            spec.infer([x, w, bad], {})                                                        # group 16, ...
    with pytest.raises(IRError, match="int4"):
        spec.infer([TensorType("f32", (2, 60)), w, TensorType("f32", (4, 2))], {})


def test_lowering_refuses_what_it_does_not_cover():
    x, y = torch.randn(2, 64), torch.empty(2, 4)
    w, s = quantize(torch.randn(4, 64), "int4", 32)
    for ins, why in [([x.double(), w, s], "input"), ([x, w, torch.ones(4, 4)], "scale"),
                     ([x, w, s, torch.ones(3)], "bias")]:
        _low, c = claim_native(OpCall("qlinear", ins, [y], {}, {}, [f"i{i}" for i in range(len(ins))], ["y"]))
        assert not c and why in c.why, (c.why, why)


def _recipe(**precision):
    return {"version": 1, "name": "q4", "inputs": [{"name": "input", "dtype": "f32", "shape": ["batch", 16]}],
            "dims": {"batch": {"buckets": [4]}}, "precision": precision}


def test_recipe_fields():
    r = load_recipe(_recipe(weights="int4", group_size=64, int4_scheme="asymmetric"))
    assert (r.precision.weights, r.precision.group_size, r.precision.int4_scheme) == ("int4", 64, "asymmetric")
    assert "group_size" not in load_recipe(_recipe(weights="int4")).model_dump()      # defaults leave stamps alone
    for field, value, fix in [("group_size", 48, "32, 64 or 128"), ("int4_scheme", "asym", "'asymmetric'")]:
        with pytest.raises(RecipeErrors) as e:
            load_recipe(_recipe(weights="int4", **{field: value}))
        assert f"precision.{field}" in str(e.value) and fix in str(e.value)
    assert load_recipe(_recipe(weights="int4", int4_activations="q8")).precision.int4_activations == "q8"
    assert "int4_activations" not in load_recipe(_recipe(weights="int4")).model_dump()
    for bad in [dict(weights="int4", group_size=64), dict(weights="int4", int4_scheme="asymmetric"),
                dict(weights="int8")]:
        errors = check_semantics(load_recipe(_recipe(int4_activations="q8", **bad))).errors
        assert any("precision.int4_activations" in str(e) and "group_size: 32" in str(e) for e in errors), errors
    report = validate(load_recipe(_recipe(weights="int8", group_size=64)))
    assert any("precision.group_size" in w for w in report.warnings), report.warnings


def test_compile_refuses_what_validate_refuses_before_any_pass(tmp_path):
    """int4 asymmetric codes with q8 activations: `recipe validate` refused it with the field and
    the fix, while `compile` ran quantize_weights into it and blamed that pass as a bug."""
    import yaml
    from typer.testing import CliRunner

    import graphmode
    from graphmode.cli.app import _register, app
    rec = _recipe(weights="int4", int4_scheme="asymmetric", int4_activations="q8")
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32)).eval()
    with pytest.raises(RecipeErrors, match="precision.int4_activations"):
        graphmode.compile(model, rec, cache_dir=tmp_path).lower_now()
    (tmp_path / "m.py").write_text("import torch\ndef build():\n    torch.manual_seed(0)\n    return torch.nn.Sequential("
                                   "torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32)).eval()\n")
    (tmp_path / "q.yaml").write_text(yaml.safe_dump(rec))
    _register()
    res = CliRunner().invoke(app, ["--no-progress", "compile", "--model", f"{tmp_path / 'm.py'}:build", "--recipe",
                                   str(tmp_path / "q.yaml"), "--cache-dir", str(tmp_path / "c")])
    assert res.exit_code == 2 and "precision.int4_activations" in res.output and "PassError" not in res.output, \
        res.output
