"""Every ISA code path of the generated kernels, on every host (backends/cpu/isa.py, build.py).

A kernel carries a path per ISA behind the compiler's macros, and the build flags pick one:
on an AVX-512 host the AVX2 and portable paths would otherwise never run. Per ISA (one
library each, a module fixture): the flags select that path and nothing wider is in the
library, then every kernel kind (elementwise and reduction groups, GEMM micro-kernels packed,
runtime-B and with an epilogue, Winograd and im2col convs, attention, pools, weight-only
int8/bf16/int4 linear, int4 x q8) is run against
torch where the host can execute that ISA; where it cannot, the path is built only. Then the
cap as a recipe field (`codegen.isa`): refused above the target, in every cache key, in the
tactics' candidates, and a small model compiled under it end to end. No timing assertions.
"""
from __future__ import annotations

import json
import platform
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import pytest
import torch
import torch.nn.functional as F

import graphmode
from graphmode.backends.cpu.backend import CpuBackend
from graphmode.backends.cpu.build import KernelBuilder
from graphmode.backends.cpu.catalog import native_source
from graphmode.backends.cpu.codegen import generate
from graphmode.backends.cpu.conv import ConvProblem
from graphmode.backends.cpu.epilogue import tile_epilogue
from graphmode.backends.cpu.gemm import GemmConfig, GemmProblem, generate_gemm, pack_b
from graphmode.backends.cpu.im2col import Im2colConfig
from graphmode.backends.cpu.isa import (CAPS, ISAS, cap_problem, capped_simd, host_isas, host_simd, march,
                                        registers)
from graphmode.backends.cpu.kernels import run_with_tensors
from graphmode.backends.cpu.tactics import TacticsContext
from graphmode.backends.cpu.tactics.candidates import CONFIGS
from graphmode.backends.cpu.winograd import WinogradConfig
from graphmode.errors import BackendError, RecipeErrors
from graphmode.ir import parse_graph
from graphmode.ir.interpreter import run_node
from graphmode.ir.ops import int4
from graphmode.passes.quantize_weights import quantize
from graphmode.recipe import load_recipe, validate
from graphmode.recipe.hashing import canonical_json
from graphmode.recipe.schema import CodegenSpec
from graphmode.runtime.build import cache_key
from graphmode.runtime.cache import key_digest, make_key
from graphmode.targets import get_target
from graphmode.verify.numerics import rel_l2

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "e2e"))
from tiny_models import mlp  # noqa: E402

_PROBE = KernelBuilder(Path(tempfile.gettempdir()) / "graphmode-test-probe")
needs_cxx = pytest.mark.skipif(not _PROBE.compiler_available(), reason="no C++ compiler on this machine")
HOST = host_isas(host_simd())
TOL = 1e-5

G = torch.Generator().manual_seed(0)


def randn(*shape):
    return torch.randn(*shape, generator=G)


# ------------------------------------------------------------------------------ the kernels

ELEMENTWISE = """graph @g(%x: f32[4,8,96], %b: f32[96]) -> (%y) {
  %y: f32[4,8,96] = fused(%x, %b) {"kind": "elementwise"} {
    %a: f32[4,8,96] = add(%x, %b)
    %y: f32[4,8,96] = gelu(%a)
  }
  return %y
}"""
SOFTMAX = """graph @g(%sc: f32[2,4,16,19], %m: f32[2,1,1,19]) -> (%p) {
  %p: f32[2,4,16,19] = fused(%sc, %m) {"kind": "reduction"} {
    %b: f32[2,4,16,19] = add(%sc, %m)
    %p: f32[2,4,16,19] = softmax(%b) {"dim": -1}
  }
  return %p
}"""
LAYER_NORM = """graph @g(%x: f32[2,16,100], %r: f32[2,16,100], %w: f32[100], %bb: f32[100]) -> (%y) {
  %y: f32[2,16,100] = fused(%x, %r, %w, %bb) {"kind": "norm"} {
    %h: f32[2,16,100] = add(%x, %r)
    %y: f32[2,16,100] = layer_norm(%h, %w, %bb) {"eps": 1e-05}
  }
  return %y
}"""
GEMM_EPILOGUE = """graph @g(%x: f32[19,40], %w: f32[70,40], %bl: f32[70], %res: f32[19,70]) -> (%y) {
  %y: f32[19,70] = fused(%x, %w, %bl, %res) {"kind": "gemm_epilogue"} {
    %g: f32[19,70] = linear(%x, %w, %bl)
    %ge: f32[19,70] = gelu(%g)
    %y: f32[19,70] = add(%ge, %res)
  }
  return %y
}"""


@dataclass
class Case:
    """One kernel: its source, and `run(kernel) -> (got, want)`."""

    source: object
    run: Callable


def _group(text: str) -> Case:
    g = parse_graph(text)
    node = next(n for n in g.nodes if n.op == "fused")
    ks = generate(node, {k: v.type for k, v in g.values.items()})
    ins = [randn(*(int(d) for d in g.values[n].type.shape)) for n in node.inputs]

    def run(kernel):
        got = run_with_tensors(kernel, dict(zip(node.inputs, ins)), source=ks)
        with torch.inference_mode():
            want = dict(zip(node.outputs, run_node(node, ins, {})))
        return got[node.outputs[0]], want[node.outputs[0]]
    return Case(ks, run)


def _gemm(p: GemmProblem, cfg: GemmConfig) -> Case:
    """A linear (B packed at build) or a batched matmul over a runtime B."""
    a = randn(p.batch, p.m, p.k)
    bias = randn(p.n) if p.bias else None
    if p.op == "linear":
        w = randn(p.n, p.k)
        want, b = a @ w.t(), pack_b(w, cfg.nr, transposed=True)
    else:
        b = randn(p.batch, p.k, p.n)
        want = a @ b
    want = want + bias if bias is not None else want
    ks = generate_gemm(p, cfg, threads=2)

    def run(kernel):
        c = torch.full((p.batch, p.m, p.n), float("nan"))
        kernel([t.data_ptr() for t in [a, b] + ([bias] if bias is not None else []) + [c]])
        return c, want
    return Case(ks, run)


def _gemm_epilogue(cfg: GemmConfig) -> Case:
    g = parse_graph(GEMM_EPILOGUE)
    node = next(n for n in g.nodes if n.op == "fused")
    epi = tile_epilogue(node, {k: v.type for k, v in g.values.items()})
    assert epi is not None and epi.kinds == ("full",)
    a, w, bias, res = randn(19, 40), randn(70, 40), randn(70), randn(19, 70)
    want = epi.reference(torch.addmm(bias, a, w.t()), [res])
    ks = generate_gemm(GemmProblem("linear", 1, 19, 70, 40, bias=True, epi=epi), cfg, threads=2)

    def run(kernel):
        c, b = torch.full((19, 70), float("nan")), pack_b(w, cfg.nr, transposed=True)
        kernel([t.data_ptr() for t in (a, b, bias, res, c)])
        return c, want
    return Case(ks, run)


def _conv(p: ConvProblem, cfg) -> Case:
    x, w, bias = randn(p.n, p.cin, p.h, p.w), randn(p.cout, p.cin, p.kh, p.kw), randn(p.cout)
    want = F.conv2d(x, w, bias, p.stride, p.padding, p.dilation)
    ks = cfg.generate(p, 2)

    def run(kernel):
        y, u = torch.full_like(want, float("nan")), cfg.prepare_weight(w)
        ws = torch.zeros(cfg.workspace_numel(p))
        kernel([t.data_ptr() for t in (x, u, bias, ws, y)])
        return y, want
    return Case(ks, run)


def _native(op: str, ins: list, attrs: dict, ref: Callable) -> Case:
    want = ref(*ins)
    names = ["q", "k", "v", "mask"][:len(ins)] if op == "sdpa" else [f"in{i}" for i in range(len(ins))]
    ks = native_source(op, ins, [torch.empty_like(want)], attrs, {}, names, ["out"])
    assert ks is not None, op

    def run(kernel):
        return run_with_tensors(kernel, dict(zip(ks.inputs, ins)), source=ks)["out"], want
    return Case(ks, run)


def cases(isa: str) -> dict[str, Case]:
    """Every kernel kind, its GEMMs in `isa`'s blockings (what the tactics offer under that cap)."""
    first = CONFIGS[isa][0]
    blocked = next(c for c in CONFIGS[isa] if c.kc)          # K and M blocks: partial-sum tiles
    conv_cfg = GemmConfig(isa, first.mr, first.nr)
    mask = torch.rand(1, 2, 20, 37, generator=G) < 0.7
    return {
        "elementwise": _group(ELEMENTWISE),
        "softmax": _group(SOFTMAX),
        "layer_norm": _group(LAYER_NORM),
        "gemm_packed": _gemm(GemmProblem("linear", 1, 17, 70, 33, bias=True), first),
        "gemm_packed_blocked": _gemm(GemmProblem("linear", 1, 37, 45, 300, bias=True), blocked),
        "gemm_runtime_b": _gemm(GemmProblem("matmul", 3, 5, 37, 19, b_packed=False, b_batched=True), first),
        "gemm_epilogue": _gemm_epilogue(first),
        "conv_winograd4": _conv(ConvProblem(1, 16, 10, 9, 12, 3, 3, (1, 1), (1, 1), bias=True),
                                WinogradConfig(4, conv_cfg)),
        "conv_winograd2": _conv(ConvProblem(2, 5, 7, 8, 9, 3, 3, (1, 1), (1, 1), bias=True),
                                WinogradConfig(2, conv_cfg)),
        "conv_im2col": _conv(ConvProblem(1, 3, 15, 13, 20, 3, 3, (2, 2), (1, 1), bias=True), Im2colConfig(conv_cfg)),
        "conv_im2col_rows": _conv(ConvProblem(2, 3, 15, 13, 20, 3, 3, (2, 2), (1, 1), bias=True),
                                  Im2colConfig(replace(conv_cfg, par="serial"), first.mr * 2, 2)),
        "attention": _native("sdpa", [randn(1, 2, 20, 32), randn(1, 2, 37, 32), randn(1, 2, 37, 24), mask],
                             {"is_causal": False, "scale": None},
                             lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m)),
        "max_pool": _native("max_pool2d", [randn(2, 3, 13, 17)],
                            {"kernel": [3, 3], "stride": [2, 2], "padding": [1, 1], "dilation": 1, "ceil_mode": False},
                            lambda x: F.max_pool2d(x, 3, 2, 1)),
        "avg_pool": _native("avg_pool2d", [randn(1, 8, 12, 12)], {"kernel": 2},
                            lambda x: F.avg_pool2d(x, 2)),
        "adaptive_pool": _native("adaptive_avg_pool2d", [randn(2, 24, 7, 7)], {"output_size": [1, 1]},
                                 lambda x: F.adaptive_avg_pool2d(x, 1)),
        "qlinear_int8": _native("qlinear", [randn(5, 37), *quantize(randn(19, 37), "int8"), randn(19)], {},
                                lambda x, w, s, b: F.linear(x, w.float() * s[:, None], b)),
        "qlinear_bf16": _native("qlinear", [randn(1, 40), *quantize(randn(9, 40), "bf16")], {},
                                lambda x, w, s: F.linear(x, w.float())),
        "qlinear_panels": _native("qlinear", [randn(37, 45), *quantize(randn(70, 45), "int8"), randn(70)], {},
                                  lambda x, w, s, b: F.linear(x, w.float() * s[:, None], b)),
        "qlinear_int4": _native("qlinear", [randn(3, 128), *quantize(randn(19, 128), "int4", 32), randn(19)], {},
                                lambda x, w, s, b: F.linear(x, int4.dequantize(w, s), b)),
        "qlinear_int4_asym": _native("qlinear", [randn(1, 256), *quantize(randn(9, 256), "int4", 128, "asymmetric")],
                                     {}, lambda x, w, s: F.linear(x, int4.dequantize(w, s))),
        "qlinear_int4_panels": _native("qlinear", [randn(37, 128), *quantize(randn(70, 128), "int4", 64, "asymmetric"),
                                                   randn(70)], {}, lambda x, w, s, b: F.linear(x, int4.dequantize(w, s), b)),
        "qlinear_int4_q8": _native("qlinear", [randn(3, 160), *quantize(randn(19, 160), "int4", 32), randn(19)],
                                   {"act": "q8"}, int4.q8_linear),
    }


NAMES = list(cases("portable"))


@pytest.fixture(scope="module", params=ISAS)
def lib(request, isa_builder):
    """One library per ISA cap: every kernel kind built with that cap's flags."""
    isa = request.param
    builder = isa_builder(isa, "isa")
    cs = cases(isa)
    kernels = builder.build_many([c.source for c in cs.values()])
    return isa, builder, cs, kernels


def _macros(builder: KernelBuilder) -> set[str]:
    out = subprocess.run([builder.compiler, *[f for f in builder.flags if f not in ("-shared", "-fPIC")],
                          "-dM", "-E", "-x", "c++", "/dev/null"], capture_output=True, text=True, check=True).stdout
    return {ln.split()[1] for ln in out.splitlines() if ln.startswith("#define ")}


@needs_cxx
def test_flags_select_the_path_and_nothing_wider(lib):
    """The cap's flags make the ISA_GUARDs take its path; the library holds its vector code
    and none of a wider ISA (so the compiler did not auto-vectorise past the cap either)."""
    isa, builder, cs, _ = lib
    m = _macros(builder)
    assert ("__AVX512F__" in m) == (isa == "avx512"), builder.flags
    assert ({"__AVX2__", "__FMA__"} <= m) == (isa != "portable"), builder.flags
    if isa == "portable":
        assert "__AVX__" not in m
    if shutil.which("objdump") is None or platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("no objdump, or not x86-64: the library's registers are not read")
    lib_path = builder.library_path([c.source for c in cs.values()])
    asm = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(lib_path)], capture_output=True, text=True,
                         check=True).stdout
    regs = {r: f"%{r}" in asm for r in ("xmm", "ymm", "zmm")}
    assert regs == {"xmm": True, "ymm": isa != "portable", "zmm": isa == "avx512"}, (isa, regs)
    if isa != "portable":
        assert "vfmadd" in asm


@needs_cxx
@pytest.mark.parametrize("name", NAMES)
def test_kernel_matches_torch(lib, name):
    isa, _builder, cs, kernels = lib
    if isa not in HOST:
        pytest.skip(f"this host runs {', '.join(HOST)}: the {isa} path is built (the test above) but cannot run here")
    c = cs[name]
    got, want = c.run(kernels[c.source.symbol])
    assert got.shape == want.shape and rel_l2(got, want) < TOL, (isa, name, rel_l2(got, want))


# ------------------------------------------------------------------------------ the cap

def test_caps_and_flags():
    assert CodegenSpec.model_fields["isa"].annotation.__args__ == CAPS    # the schema lists every cap
    avx512 = ["avx", "avx2", "fma", "f16c", "avx512f", "avx512vl", "avx512bw"]
    avx2 = ["avx", "avx2", "fma", "f16c"]
    assert march("auto", avx512) == march("avx512", avx512) == ("-march=native",)
    assert march("avx2", avx512) == ("-march=native", "-mno-avx512f")
    assert march("avx2", avx2) == ("-march=native",) and march("portable", avx2) == ("-march=x86-64",)
    assert march("avx512", avx2) == ("-march=x86-64-v4",)              # built, never run, on an AVX2 host
    assert march("portable", ["neon"]) == ("-march=native",)           # a non-x86 host's best is portable
    assert host_isas(capped_simd(avx512, "avx2")) == ["avx2", "portable"]
    assert host_isas(capped_simd(avx512, "portable")) == ["portable"]
    assert registers("avx2", avx512) == 32 and registers("avx2", capped_simd(avx512, "avx2")) == 16
    assert cap_problem("avx2", avx512) is None and cap_problem("auto", []) is None
    why, fix = cap_problem("avx512", avx2)
    assert "cannot run avx512" in why and "avx2, portable" in why and "auto" in fix
    with pytest.raises(BackendError, match="unknown ISA"):
        KernelBuilder(tempfile.gettempdir(), isa="sse9")


def _recipe(isa: str | None = None, **over):
    r = {"version": 1, "name": "capped", "inputs": [{"name": "input", "dtype": "f32", "shape": ["batch", 16]}],
         "dims": {"batch": {"buckets": [4]}}, "codegen": {"kernel_selection": "heuristic"}}
    if isa is not None:
        r["codegen"]["isa"] = isa
    return load_recipe({**r, **over})


def test_recipe_field_checked_against_the_target():
    plain, auto = _recipe(), _recipe("auto")
    assert plain.codegen.isa == "auto" and '"isa":' not in canonical_json(plain)   # old stamps hold
    assert auto.hash() == plain.hash() != _recipe("avx2").hash() != _recipe("portable").hash()
    with pytest.raises(RecipeErrors, match="codegen.isa"):
        _recipe("avx3")
    rep = validate(_recipe("avx512"), get_target("cpu_avx2"))
    assert rep.verdict == "malformed"
    err = rep.errors[0]
    assert err.where == "codegen.isa" and err.value == "avx512" and "avx2, portable" in err.message
    assert "cpu_avx2" in err.message and "codegen.isa: auto" in err.fix
    assert validate(_recipe("avx2"), get_target("cpu_avx2")).verdict == "valid"
    for isa in HOST:
        assert validate(_recipe(isa), "host").verdict == "valid"


def _builders(tmp_path) -> dict[str, KernelBuilder]:
    """A builder per cap the compiler here can build (every one on x86-64)."""
    out = {isa: KernelBuilder(tmp_path, isa=isa) for isa in CAPS}
    return {isa: b for isa, b in out.items() if b.compiler_available()}


@needs_cxx
def test_tactics_draw_the_capped_isa(tmp_path):
    """On an AVX-512 target, a cap gives that ISA's GEMM candidates within its register budget
    (AVX2 code built without AVX-512VL has 16 registers, not 32), and its own timing cache key."""
    p = GemmProblem("linear", 1, 16, 96, 64, bias=True)
    simd = ["avx", "avx2", "fma", "f16c", "avx512f", "avx512vl", "avx512bw"]
    keys = {}
    for isa, builder in _builders(tmp_path).items():
        ctx = TacticsContext(None, 2, simd=simd, llc_bytes=1 << 25, builder=builder)
        want = "avx512" if isa == "auto" else isa
        names = ctx.candidates(p)[1:]
        assert names and all(n.startswith(want + "_") for n in names), (isa, names)
        assert host_isas(ctx.simd)[0] == want
        assert registers(want, ctx.simd) == {"avx512": 32, "avx2": 16}.get(want, 1 << 30)
        keys[isa] = repr(ctx.cache_key(p, ctx.candidates(p), {}))
    caps = [keys[i] for i in ISAS if i in keys]
    assert len(set(caps)) == len(caps) >= 2


@needs_cxx
def test_kernel_and_plan_cache_keys_differ_per_isa(tmp_path):
    srcs = [cases("portable")["elementwise"].source]
    paths = {isa: b.library_path(srcs) for isa, b in _builders(tmp_path).items()}
    assert len({paths[i] for i in ISAS if i in paths}) == len(paths) - 1 >= 2   # one library per cap
    assert paths["auto"] == paths[HOST[0]]                              # auto is the host's best: shared
    keys = {isa: make_key("g" * 16, "r" * 16, "host", {"batch": 4}, isa=isa) for isa in CAPS}
    assert len({key_digest(k) for k in keys.values()}) == len(CAPS)
    old = {k: v for k, v in keys["auto"].items() if k != "isa"}        # written before the field existed
    assert key_digest(old) == key_digest(keys["auto"])


def test_compile_refuses_a_cap_above_the_target(tmp_path):
    model, _ = mlp()
    with pytest.raises(RecipeErrors, match="codegen.isa") as e:
        graphmode.compile(model, _recipe("avx512"), "cpu_avx2", cache_dir=tmp_path)
    assert "cannot run avx512 kernels" in str(e.value) and "fix: codegen.isa: auto" in str(e.value)


@needs_cxx
@pytest.mark.parametrize("isa", ISAS)
def test_model_compiled_under_a_cap_matches_eager(isa, tmp_path):
    if isa not in HOST:      # the recipe check refuses it on the host target; the backend on its own too
        with pytest.raises(BackendError, match="cannot run") as e:
            CpuBackend().executable(None, {}, kernel_dir=tmp_path, isa=isa)
        assert e.value.where == "codegen.isa"
        return
    model, (x,) = mlp()
    with torch.inference_mode():
        want = model(x)
    cm = graphmode.compile(model, _recipe(isa), cache_dir=tmp_path, threads=2)
    got = cm(x)
    assert rel_l2(got, want) < TOL
    exe = cm.executable({"batch": 4})
    assert exe.tactics.builder.isa == isa and host_isas(exe.tactics.simd)[0] == isa
    winners = [g["winner"] for g in exe.tactics_report["gemms"]]
    assert winners and all(w.startswith(isa + "_") for w in winners), winners
    assert cache_key(cm, {"batch": 4})["isa"] == isa



def _cli(tmp_path, monkeypatch):
    import graphmode.cli.bench_cmd  # noqa: F401  (registers `bench`)
    from typer.testing import CliRunner

    from graphmode.cli.app import app
    monkeypatch.setenv("GRAPHMODE_CACHE_DIR", str(tmp_path / "cache"))
    return lambda *args: CliRunner().invoke(app, ["bench", "--model", TINY_BENCH, "--shape", "4x32", "--engines",
                                                   "graphmode", "--quick", "--threads", "1", "--out",
                                                   str(tmp_path / "out"), "--json", *args])


TINY_BENCH = f"{Path(__file__).resolve().parents[2] / 'bench' / 'test_bench.py'}:tiny_mlp"
BELOW_BEST = HOST[1] if len(HOST) > 1 else HOST[0]         # a cap below the host's best where there is one


@needs_cxx
def test_bench_isa_reaches_the_graphmode_compile(tmp_path, monkeypatch):
    """`graphmode bench --isa` reaches the recipe graphmode rows compile (the bench harness's
    own path, without its timing loop); a name that is not a cap exits 2 before anything runs."""
    from graphmode.bench.engines import ModelShared, graphmode_model
    from graphmode.bench.models import load_cases
    case = load_cases([TINY_BENCH], ["4x32"], quick=True)[0]
    shared = ModelShared(case.bundle, case.envs, 1, cache_dir=tmp_path, isa=BELOW_BEST)
    cm, rec, _s, _now = graphmode_model(shared)
    assert rec.codegen.isa == BELOW_BEST and cm.executable(case.envs[0]).tactics.builder.isa == BELOW_BEST
    bad = _cli(tmp_path, monkeypatch)("--isa", "avx3")
    assert bad.exit_code == 2 and "--isa" in bad.output and "one of auto, avx512, avx2, portable" in bad.output


@needs_cxx
@pytest.mark.slow
def test_bench_isa_rows(tmp_path, monkeypatch):
    """The rows of `graphmode bench --isa` ran (and say) that code path."""
    res = _cli(tmp_path, monkeypatch)("--isa", BELOW_BEST)
    assert res.exit_code == 0, res.output
    g = next(r for r in json.loads(res.stdout) if r["engine"] == "graphmode")
    assert g["status"] == "ok" and g["numerics_ok"] and g["isa"] == BELOW_BEST
    assert g["label"] == f"graphmode[{BELOW_BEST}]"
