"""Generated kernels for single ops (native lowerings: graphmode/backends/cpu/pool.py, movement.py).
Every case is generated from tensors, as the CPU binding does for a plan step, compiled into
ONE shared library (a module fixture) and compared with the op's reference (ATen): exactly,
except the average pools (fp32 sums in another order). Then what each generator refuses, and
a compiled ResNet-18 whose pools run as native steps. Nothing here asserts on a timing.
"""
from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from graphmode.errors import BackendError

from graphmode.backends.cpu.build import KernelBuilder
from graphmode.backends.cpu.isa import ISAS, host_isas, host_simd
from graphmode.backends.cpu.kernels import run_with_tensors
from graphmode.backends.cpu.catalog import native_source
from graphmode.backends.cpu.lowering import NATIVE, ops_in
from graphmode.ir.ops import get_op
from graphmode.verify.numerics import rel_l2

_PROBE = KernelBuilder(Path(tempfile.gettempdir()) / "graphmode-test-probe")
needs_cxx = pytest.mark.skipif(not _PROBE.compiler_available(), reason="no C++ compiler on this machine")

G = torch.Generator().manual_seed(0)


def randn(*shape):
    return torch.randn(*shape, generator=G)


def randint(lo, hi, *shape, dtype=torch.int64):
    return torch.randint(lo, hi, shape, generator=G, dtype=dtype)


def specials(*shape):
    """Random values with NaN, +-0.0 and -inf sprinkled in, some windows all zeros of mixed
    sign: where an order-changing max would differ from ATen's (NaN, the sign of a zero)."""
    x = randn(*shape)
    flat = x.view(-1)
    n = flat.numel()
    flat[torch.randint(0, n, (n // 40,), generator=G)] = float("nan")
    flat[torch.randint(0, n, (n // 20,), generator=G)] = -float("inf")
    z = torch.randint(0, n, (n // 10,), generator=G)
    flat[z] = torch.where(torch.rand(z.shape, generator=G) < 0.5, 0.0, -0.0)
    x[..., :6, :6] = torch.where(torch.rand(x[..., :6, :6].shape, generator=G) < 0.5, 0.0, -0.0)
    return x


@dataclass
class Case:
    op: str
    inputs: list
    out_shape: tuple
    out_dtype: torch.dtype
    attrs: dict = field(default_factory=dict)
    env: dict = field(default_factory=dict)
    exact: bool = True              # else rel L2 < 1e-6 (fp32 sums in another order)


def mp(k, s=None, p=0, d=1, ceil=False):
    return {"kernel": k, "stride": s, "padding": p, "dilation": d, "ceil_mode": ceil}


def pool_case(op, x, attrs, **kw):
    y = get_op(op).ref([x], attrs, {})[0]
    return Case(op, [x], tuple(y.shape), y.dtype, attrs, **kw)


def case_of(op, inputs, attrs=None, env=None, **kw):
    y = get_op(op).ref(inputs, attrs or {}, env or {})[0]
    return Case(op, inputs, tuple(y.shape), y.dtype, attrs or {}, env or {}, **kw)


CASES: dict[str, Case] = {
    # max_pool2d: ResNet's stem pool (parallel), ceil mode, dilation, strides 1 / 2 / 3, non-square
    "max_resnet_stem": pool_case("max_pool2d", randn(1, 64, 112, 112), mp([3, 3], [2, 2], [1, 1])),
    "max_batch2_ceil": pool_case("max_pool2d", randn(2, 3, 9, 11), mp(3, 2, 1, ceil=True)),
    "max_ceil_drop_last": pool_case("max_pool2d", randn(1, 2, 7, 7), mp(2, 2, 0, ceil=True)),
    "max_ceil_wide": pool_case("max_pool2d", randn(2, 3, 21, 40), mp([3, 2], [2, 2], [1, 0], ceil=True)),
    "max_dilated": pool_case("max_pool2d", randn(2, 3, 10, 13), mp([3, 2], [1, 2], [1, 1], [2, 1])),
    "max_dilated_wide": pool_case("max_pool2d", randn(1, 2, 12, 61), mp(3, 2, 1, 2)),
    "max_stride1": pool_case("max_pool2d", randn(1, 4, 33, 40), mp(3, 1, 1)),
    "max_stride3": pool_case("max_pool2d", randn(3, 2, 20, 37), mp(5, 3, 2)),
    "max_nonsquare": pool_case("max_pool2d", randn(2, 5, 17, 9), mp([2, 3], [2, 1], [0, 1])),
    "max_default_stride": pool_case("max_pool2d", randn(1, 3, 8, 8), {"kernel": 2}),
    "max_specials_s2": pool_case("max_pool2d", specials(2, 3, 40, 40), mp(3, 2, 1)),
    "max_specials_s1": pool_case("max_pool2d", specials(1, 3, 24, 50), mp(3, 1, 1)),
    "max_specials_edges": pool_case("max_pool2d", specials(1, 2, 9, 10), mp(3, 2, 1, ceil=True)),
    # avg_pool2d: padding counted or not, ceil mode (windows past the padded input)
    "avg_pad": pool_case("avg_pool2d", randn(2, 3, 9, 11), {"kernel": 3, "stride": 2, "padding": 1}, exact=False),
    "avg_pad_excl": pool_case("avg_pool2d", randn(2, 3, 9, 11),
                              {"kernel": 3, "stride": 2, "padding": 1, "count_include_pad": False}, exact=False),
    "avg_ceil": pool_case("avg_pool2d", randn(1, 4, 10, 7),
                          {"kernel": [3, 2], "stride": [2, 3], "padding": [1, 1], "ceil_mode": True}, exact=False),
    "avg_ceil_excl": pool_case("avg_pool2d", randn(1, 4, 10, 7),
                               {"kernel": 3, "stride": 2, "padding": 1, "ceil_mode": True,
                                "count_include_pad": False}, exact=False),
    "avg_big": pool_case("avg_pool2d", randn(1, 64, 56, 56), {"kernel": 2}, exact=False),
    # adaptive_avg_pool2d: ResNet's global pool, batch > 1, uneven windows, identity
    "adaptive_global": pool_case("adaptive_avg_pool2d", randn(1, 512, 7, 7), {"output_size": [1, 1]}, exact=False),
    "adaptive_global_b3": pool_case("adaptive_avg_pool2d", randn(3, 70, 5, 9), {"output_size": 1}, exact=False),
    "adaptive_uneven": pool_case("adaptive_avg_pool2d", randn(2, 3, 10, 9), {"output_size": [4, 3]}, exact=False),
    "adaptive_uneven2": pool_case("adaptive_avg_pool2d", randn(2, 3, 7, 11), {"output_size": [3, 5]}, exact=False),
    "adaptive_identity": pool_case("adaptive_avg_pool2d", randn(1, 8, 5, 5), {"output_size": [5, 5]}, exact=False),
    "adaptive_big": pool_case("adaptive_avg_pool2d", randn(2, 256, 14, 14), {"output_size": [2, 2]}, exact=False),
    # permute: MiniLM's head split/merge (rows), transposes (tiles), any item size, parallel, empty
    "permute_heads": case_of("permute", [randn(1, 128, 12, 32)], {"perm": [0, 2, 1, 3]}),
    "permute_merge": case_of("permute", [randn(1, 12, 16, 32)], {"perm": [0, 2, 1, 3]}),
    "permute_transpose4d": case_of("permute", [randn(2, 3, 5, 7)], {"perm": [0, 3, 2, 1]}),
    "permute_2d_odd": case_of("permute", [randn(33, 47)], {"perm": [1, 0]}),
    "permute_unit_dims": case_of("permute", [randn(4, 1, 6)], {"perm": [2, 1, 0]}),
    "permute_identity": case_of("permute", [randn(2, 3, 4)], {"perm": [0, 1, 2]}),
    "permute_negative": case_of("permute", [randn(2, 3, 4)], {"perm": [0, -1, 1]}),
    "permute_i64": case_of("permute", [randint(-10**12, 10**12, 3, 5, 7)], {"perm": [2, 0, 1]}),
    "permute_bool": case_of("permute", [randint(0, 2, 6, 17, 3) > 0], {"perm": [1, 2, 0]}),
    "permute_f16": case_of("permute", [randn(5, 6, 7).half()], {"perm": [2, 1, 0]}),
    "permute_u8": case_of("permute", [randint(0, 255, 9, 20, dtype=torch.uint8)], {"perm": [1, 0]}),
    "permute_parallel": case_of("permute", [randn(64, 64, 48)], {"perm": [2, 0, 1]}),
    "permute_parallel_rows": case_of("permute", [randn(8, 128, 12, 32)], {"perm": [0, 2, 1, 3]}),
    "permute_empty": case_of("permute", [randn(0, 3)], {"perm": [1, 0]}),
    # slice: GPT-2's qkv split, a symbolic end, step > 1, negative start/end, a single row
    "slice_qkv": case_of("slice", [randn(1, 16, 2304)], {"dim": 2, "start": 768, "end": 1536, "step": 1}),
    "slice_seq": case_of("slice", [randint(0, 512, 1, 512)], {"dim": 1, "start": 0, "end": "seq", "step": 1},
                         {"seq": 16}),
    "slice_step2": case_of("slice", [randn(4, 10, 6)], {"dim": 1, "start": 1, "end": -1, "step": 2}),
    "slice_step3_last": case_of("slice", [randn(3, 8, 5)], {"dim": -1, "start": 0, "end": 5, "step": 3}),
    "slice_negative": case_of("slice", [randn(5, 7)], {"dim": 0, "start": -3, "end": 2 ** 62}),
    "slice_first_token": case_of("slice", [randn(1, 16, 384)], {"dim": 1, "start": 0, "end": 1, "step": 1}),
    "slice_clipped": case_of("slice", [randn(6, 4)], {"dim": 0, "start": 2, "end": 100}),
    # index: MiniLM's mask gather, negative indices, broadcast index shapes, i32 indices
    "index_mask": case_of("index", [randint(0, 2, 1, 16) > 0, torch.zeros(1, 1, 1, 1, dtype=torch.int64),
                                    torch.arange(16).view(1, 1, 1, 16)], {"dims": [0, 1]}),
    "index_middle_neg": case_of("index", [randn(4, 6, 5), randint(-6, 6, 3, 2)], {"dims": [1]}),
    "index_broadcast": case_of("index", [randn(3, 4, 5), randint(-3, 3, 2, 1), randint(0, 4, 3)],
                               {"dims": [0, 1]}),
    "index_i32": case_of("index", [randint(0, 100, 7, 3), randint(0, 7, 5, dtype=torch.int32)], {"dims": [0]}),
    # cast: the conversions C does as torch does
    "cast_i64_bool": case_of("cast", [randint(-2, 3, 1, 16)], {"dtype": "bool"}),
    "cast_f32_bool": case_of("cast", [specials(3, 40)], {"dtype": "bool"}),
    "cast_bool_f32": case_of("cast", [randint(0, 2, 4, 5) > 0], {"dtype": "f32"}),
    "cast_i64_f32": case_of("cast", [randint(-2 ** 40, 2 ** 40, 64)], {"dtype": "f32"}),
    "cast_f64_f32": case_of("cast", [torch.randn(33, dtype=torch.float64, generator=G) * 1e30], {"dtype": "f32"}),
    "cast_i64_i32_wrap": case_of("cast", [randint(-2 ** 40, 2 ** 40, 50)], {"dtype": "i32"}),
    "cast_u8_i64": case_of("cast", [randint(0, 255, 20, dtype=torch.uint8)], {"dtype": "i64"}),
    "cast_big_f32_f64": case_of("cast", [randn(300, 1000)], {"dtype": "f64"}),
    # logical_and / logical_or: MiniLM's mask broadcast, mixed dtypes, a scalar, parallel
    "and_mask": case_of("logical_and", [randint(0, 2, 1, 1, 16, 1) > 0, randint(0, 2, 1, 1, 1, 16) > 0]),
    "and_mixed": case_of("logical_and", [specials(3, 1, 5), randint(-1, 2, 4, 1)]),
    "or_scalar": case_of("logical_or", [torch.tensor(False), randint(0, 2, 7) > 0]),
    "or_big": case_of("logical_or", [randint(0, 2, 512, 1) > 0, randint(0, 2, 512, 512) > 0]),
    # arange: a symbolic end, i32, a negative step
    "arange_seq": case_of("arange", [], {"start": 0, "end": "seq", "step": 1, "dtype": "i64"}, {"seq": 16}),
    "arange_i32": case_of("arange", [], {"start": 3, "end": 20, "step": 4, "dtype": "i32"}),
    "arange_down": case_of("arange", [], {"start": 10, "end": -2, "step": -3, "dtype": "i64"}),
}


def _names(c: Case) -> tuple[list[str], list[str]]:
    return [f"in{i}" for i in range(len(c.inputs))], ["out"]


def _source(c: Case, out: torch.Tensor | None = None):
    ins, outs = _names(c)
    y = out if out is not None else torch.empty(c.out_shape, dtype=c.out_dtype)
    return native_source(c.op, c.inputs, [y], c.attrs, c.env, ins, outs)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Every case generated, then compiled into one library (one build_many)."""
    if not _PROBE.compiler_available():
        pytest.skip("no C++ compiler")
    b = KernelBuilder(tmp_path_factory.mktemp("kcache"), threads=2)
    sources = {}
    for name, c in CASES.items():
        ks = _source(c)
        assert ks is not None, f"{name}: the generator refused a case it should cover"
        sources[name] = ks
    kernels = b.build_many(list(sources.values()))
    return sources, kernels


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values and dtype, NaN where NaN, and the sign of every zero."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if not a.is_floating_point():
        return torch.equal(a, b)
    if not torch.equal(torch.isnan(a), torch.isnan(b)):
        return False
    ok = ~torch.isnan(a)
    return torch.equal(a[ok], b[ok]) and torch.equal(torch.signbit(a[ok]), torch.signbit(b[ok]))


@needs_cxx
@pytest.mark.parametrize("name", list(CASES))
def test_matches_aten(built, name):
    sources, kernels = built
    c = CASES[name]
    ks = sources[name]
    got = run_with_tensors(kernels[ks.symbol], dict(zip(ks.inputs, c.inputs)), source=ks)["out"]
    ref = get_op(c.op).ref(c.inputs, c.attrs, c.env)[0].contiguous()
    if c.exact:
        assert _same(got, ref), f"{name}: {ks.pattern} differs from ATen"
    else:
        assert got.dtype == ref.dtype and got.shape == ref.shape
        assert rel_l2(got, ref) < 1e-6, f"{name}: rel L2 {rel_l2(got, ref)}"



POOLS = {name: c for name, c in CASES.items() if "pool" in c.op}


@pytest.fixture(scope="module", params=ISAS)
def pools_per_isa(request, isa_builder):
    """The pool cases built once per ISA cap: pool.h holds per-ISA vector code (16 floats as
    one AVX-512, two AVX2 or four SSE registers), so every path is built and, where the host
    runs it, checked, whatever host CI lands on."""
    builder = isa_builder(request.param, "pools")
    sources = {name: _source(c) for name, c in POOLS.items()}
    return request.param, sources, builder.build_many(list(sources.values()))


@needs_cxx
@pytest.mark.parametrize("name", list(POOLS))
def test_pools_match_aten_on_every_isa(pools_per_isa, name):
    isa, sources, kernels = pools_per_isa
    if isa not in host_isas(host_simd()):
        pytest.skip(f"this host cannot run the {isa} path (it was built)")
    c, ks = POOLS[name], sources[name]
    got = run_with_tensors(kernels[ks.symbol], dict(zip(ks.inputs, c.inputs)), source=ks)["out"]
    ref = get_op(c.op).ref(c.inputs, c.attrs, c.env)[0].contiguous()
    if c.exact:
        assert _same(got, ref), f"{isa} {name}: {ks.pattern} differs from ATen"
    else:
        assert rel_l2(got, ref) < 1e-6, f"{isa} {name}: rel L2 {rel_l2(got, ref)}"

def test_every_op_registered():
    assert {"max_pool2d", "avg_pool2d", "adaptive_avg_pool2d", "permute", "slice", "index", "cast",
            "logical_and", "logical_or", "arange"} <= ops_in(NATIVE)


def test_parallel_only_for_large_work(built):
    sources, _ = built
    assert sources["max_resnet_stem"].parallel and sources["permute_parallel"].parallel
    assert sources["permute_parallel_rows"].parallel
    assert not sources["adaptive_global"].parallel and not sources["permute_heads"].parallel


def test_identical_instructions_share_a_symbol():
    a = _source(CASES["permute_heads"])
    x = randn(1, 128, 12, 32)
    b = native_source("permute", [x], [torch.empty(1, 12, 128, 32)], {"perm": [0, 2, 1, 3]}, {}, ["q"], ["qt"])
    assert a.symbol == b.symbol and b.args == ("q", "qt")


def test_index_out_of_range_raises_and_never_reads_outside(built):
    """As ATen raises IndexError, the bound step raises a BackendError naming the op; the
    out-of-range blocks are zeros (never a read outside x) and the rest is exact."""
    sources, kernels = built
    c = CASES["index_middle_neg"]
    ks = sources["index_middle_neg"]
    assert ks.status
    idx = c.inputs[1].clone()
    idx[0, 0] = 6
    idx[1, 1] = -7
    x = c.inputs[0]
    got = torch.full((4, 3, 2, 5), float("nan"))
    step = kernels[ks.symbol].bind([x.data_ptr(), idx.data_ptr(), got.data_ptr()])
    with pytest.raises(BackendError, match=r"index out of range: dims .* take -6 to 5 \(8 invalid\)"):
        step()
    assert torch.equal(got[:, 0, 0], torch.zeros(4, 5)) and torch.equal(got[:, 1, 1], torch.zeros(4, 5))
    ok = get_op("index").ref([x, idx.clamp(-6, 5)], c.attrs, {})[0]
    assert torch.equal(got[:, 2], ok[:, 2])
    step2 = kernels[ks.symbol].bind([x.data_ptr(), c.inputs[1].data_ptr(), got.data_ptr()])
    step2()                                   # the count was reset: a valid call passes
    assert torch.equal(got, get_op("index").ref(c.inputs, c.attrs, {})[0])


def _refused(op, inputs, out, attrs, env=None):
    ins = [f"in{i}" for i in range(len(inputs))]
    return native_source(op, inputs, [out], attrs, env or {}, ins, ["out"]) is None


def test_generators_refuse_what_they_do_not_cover():
    x = randn(1, 2, 8, 8)
    y = torch.empty(1, 2, 4, 4)
    assert _refused("max_pool2d", [x.double()], y.double(), mp(2, 2))                       # dtype
    assert _refused("max_pool2d", [x.contiguous(memory_format=torch.channels_last)], y, mp(2, 2))  # layout
    assert _refused("max_pool2d", [x], torch.empty(1, 2, 3, 3), mp(2, 2))                   # not ATen's shape
    assert _refused("max_pool2d", [x], torch.empty(1, 2, 6, 6), mp(2, 2, 2))                # pad > kernel / 2
    assert _refused("max_pool2d", [x], y, mp(2, 2) | {"kernel": [2, 2.5]})                  # not an int
    assert _refused("max_pool2d", [x[0]], y[0], mp(2, 2))                                   # 3-d
    assert _refused("avg_pool2d", [x], y, {"kernel": 2, "divisor_override": 3})
    assert _refused("adaptive_avg_pool2d", [x.half()], torch.empty(1, 2, 1, 1).half(), {"output_size": 1})
    assert _refused("cast", [randn(4)], torch.empty(4, dtype=torch.int64), {"dtype": "i64"})  # float -> int
    assert _refused("cast", [randn(4)], torch.empty(4, dtype=torch.bfloat16), {"dtype": "bf16"})
    assert _refused("arange", [], torch.empty(4), {"start": 0, "end": 4, "dtype": "f32"})      # float arange
    assert _refused("index", [randn(3, 4, 5), randint(0, 3, 2), randint(0, 5, 2)],
                    torch.empty(2, 4), {"dims": [0, 2]})                                      # not consecutive
    assert _refused("index", [randn(3, 4), randint(0, 3, 2) > 0], torch.empty(2, 4), {"dims": [0]})  # bool index
    assert _refused("slice", [randn(5, 4)], torch.empty(3, 4), {"dim": 0, "start": 0, "end": 5, "step": 0})
    buf = randn(16)
    assert _refused("permute", [buf[0:8].view(2, 4)], buf[4:12].view(4, 2), {"perm": [1, 0]})  # overlapping


# ------------------------------------------------------------------------------- end to end

@needs_cxx
def test_resnet18_runs_native_pools_and_matches_eager(tmp_path):
    """The compiled graph's plan through the CPU binding and executor. GEMM tactics are off:
    building their candidates takes seconds and is not what is tested here."""
    import graphmode
    from graphmode.backends.cpu.executor import CpuExecutable
    from graphmode.capture.zoo import build
    from graphmode.recipe import load_recipe
    from graphmode.backends.cpu.build import builder_for
    from graphmode.runtime.build import attach_bodies, build_plan
    small = build("resnet18", image_size=64)
    recipe = {"version": 1, "name": "resnet-native",
              "inputs": [{"name": "pixel_values", "dtype": "f32", "shape": ["batch", 3, 64, 64]}],
              "dims": {"batch": {"buckets": [2]}}, "exe_mode": "graph", "targets": ["host"]}
    cm = graphmode.compile(small, load_recipe(recipe), cache_dir=tmp_path)
    env = {"batch": 2}
    plan = attach_bodies(build_plan(cm.graph, cm.recipe, env), cm.graph)
    exe = CpuExecutable(plan, cm.graph.constants, builder=builder_for(tmp_path / "kernels", 2), threads=2,
                        tactics=False)
    assert "native:max_pool2d" in exe.step_names and "aten:max_pool2d" not in exe.step_names
    assert "native:adaptive_avg_pool2d" in exe.step_names
    assert exe.kernel_report.get("native", 0) >= 2 and not exe.kernel_report["fallbacks"]
    x = small.make_inputs(env, seed=3)
    got = exe.run(x)[plan.outputs[0]]
    with torch.inference_mode():
        ref = small.module(**x)
    ref = ref[0] if isinstance(ref, (tuple, list)) else ref
    assert rel_l2(got, ref) < 1e-5


def _plan_exe(cm, env, kdir):
    from graphmode.backends.cpu.executor import CpuExecutable
    from graphmode.backends.cpu.build import builder_for
    from graphmode.runtime.build import attach_bodies, build_plan
    plan = attach_bodies(build_plan(cm.graph, cm.recipe, env), cm.graph)
    return CpuExecutable(plan, cm.graph.constants, builder=builder_for(kdir, 2), threads=2, tactics=False)


@needs_cxx
@pytest.mark.parametrize("model", ["minilm", pytest.param("gpt2", marks=pytest.mark.slow)])
def test_transformer_data_ops_run_native_and_match_eager(bundle, model, tmp_path):
    """The qkv slices and the attention-mask chain (arange, cast, index, logical_and) of a real
    plan all become native steps, the head permutes are read in place by the sdpa (layout
    bshd: no permute step is left), and the outputs stay eager's."""
    import graphmode
    from graphmode.recipe import load_recipe
    b = bundle(model)
    env = {"batch": 1, "seq": 16}
    recipe = {"version": 1, "name": f"{model}-native",
              "inputs": [{"name": n, "dtype": "i64", "shape": ["batch", "seq"]} for n in b.input_names],
              "dims": {"batch": {"buckets": [1]}, "seq": {"buckets": [16]}}, "exe_mode": "graph", "targets": ["host"]}
    cm = graphmode.compile(b, load_recipe(recipe), cache_dir=tmp_path)
    exe = _plan_exe(cm, env, tmp_path / "kernels")
    aten = {n for n in exe.step_names if n.startswith("aten:")}
    for op in ("permute", "slice", "index", "cast", "arange", "logical_and"):
        assert f"aten:{op}" not in aten
    assert "native:sdpa" in exe.step_names and not exe.kernel_report["fallbacks"]
    assert not [n for n in exe.step_names if "permute" in n]
    x = b.make_inputs(env, seed=4)
    out = exe.run(x)
    with torch.inference_mode():
        ref = b.module(**x)
    ref = ref if isinstance(ref, (tuple, list)) else (ref,)
    for name, r in zip(exe.plan.outputs, ref):
        assert rel_l2(out[name], r) < 1e-5
