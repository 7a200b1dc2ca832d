"""Generated single-op kernels for layout, resampling and group norm (graphmode/backends/cpu/
layout_kernels.py, resample.py, group_norm.py). Each table's cases are generated as the CPU
binding does for a plan step, compiled into ONE shared library (a module fixture) and
compared with the op's reference (ATen): the copies (pad, concat, stack, repeat, gather,
index_select, upsample nearest) bit for bit, NaN and the sign of zero included; bilinear
and group norm within fp32 rounding. Then an index out of range (the step raises, nothing
outside the input is read) and what each lowering refuses (the reference op runs those).
Nothing here asserts on a timing.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch

from graphmode.backends.cpu.build import KernelBuilder
from graphmode.backends.cpu.catalog import native_source
from graphmode.backends.cpu.index_maps import INDEX_MAP_OPS
from graphmode.backends.cpu.kernels import run_with_tensors
from graphmode.backends.cpu.lowering import NATIVE, ops_in
from graphmode.errors import BackendError
from graphmode.ir.ops import get_op

_PROBE = KernelBuilder(Path(tempfile.gettempdir()) / "graphmode-test-probe")
needs_cxx = pytest.mark.skipif(not _PROBE.compiler_available(), reason="no C++ compiler on this machine")
G = torch.Generator().manual_seed(0)


def randn(*shape):
    x = torch.randn(*shape, generator=G)
    flat = x.view(-1)
    if flat.numel() > 8:                      # NaN and both zeros travel as they are
        flat[1], flat[3], flat[5] = float("nan"), -0.0, 0.0
    return x


def randint(lo, hi, *shape, dtype=torch.int64):
    return torch.randint(lo, hi, shape, generator=G, dtype=dtype)


def aten(fn, *args, **kwargs):
    """An ATen-reference op's attrs for `fn(*args, **kwargs)` (tensor i given as `{"$in": i}`)."""
    return {"overload": fn, "args": list(args), "kwargs": kwargs}


def T(i):
    return {"$in": i}


CASES = {
    # pad (constant): last dim only, two dims, every dim, -inf, an int64 value, a zero-size input dim
    "pad_last": ("pad", [randn(2, 3, 5)], {"pads": [1, 2], "value": 0.5}),
    "pad_hw": ("pad", [randn(1, 3, 7, 9)], {"pads": [0, 1, 2, 0], "value": 0.0}),
    "pad_all": ("pad", [randn(3, 4, 5)], {"pads": [1, 1, 2, 0, 0, 3], "value": -float("inf")}),
    "pad_int": ("pad", [randint(-5, 5, 4, 6)], {"pads": [2, 2, 1, 1], "value": 7}),
    "pad_big": ("pad", [randn(32, 64, 64)], {"pads": [1, 1, 1, 1], "value": 0.0}),
    "pad_empty": ("pad", [randn(2, 0, 3)], {"pads": [0, 0, 1, 1], "value": 2.0}),
    # concat: along the last / a middle / the first dim, three inputs, an empty piece, bool
    "concat_last": ("concat", [randn(2, 3), randn(2, 5)], {"dim": 1}),
    "concat_mid": ("concat", [randn(2, 3, 4), randn(2, 1, 4), randn(2, 0, 4)], {"dim": -2}),
    "concat_first": ("concat", [randn(3, 5), randn(1, 5)], {"dim": 0}),
    "concat_bool": ("concat", [randint(0, 2, 4, 3) > 0, randint(0, 2, 4, 2) > 0], {"dim": 1}),
    "concat_big": ("concat", [randn(8, 128, 96), randn(8, 128, 32)], {"dim": 2}),
    "concat_all_empty": ("concat", [randn(0, 1, 0), randn(0, 1, 0)], {"dim": 2}),   # no copy; still compiles
    # stack: new first / middle / last dim, int32
    "stack_first": ("stack", [randn(3, 5), randn(3, 5)], aten("default", [T(0), T(1)])),
    "stack_mid": ("stack", [randn(3, 5), randn(3, 5), randn(3, 5)], aten("default", [T(0), T(1), T(2)], 1)),
    "stack_last": ("stack", [randint(0, 9, 4, 2, dtype=torch.int32)] * 2, aten("default", [T(0), T(1)], -1)),
    "stack_repeated": ("stack", [randn(2, 3), randn(2, 3)], aten("default", [T(1), T(0), T(1)], 1)),
    # repeat: tiling every dim, new leading dims, a size-1 dim repeated, zero repeats
    "repeat_tile": ("repeat", [randn(3, 5)], aten("default", T(0), [2, 3])),
    "repeat_lead": ("repeat", [randn(3, 5)], aten("default", T(0), [2, 1, 2])),
    "repeat_unit": ("repeat", [randn(4, 1)], aten("default", T(0), [1, 6])),
    "repeat_zero": ("repeat", [randn(2, 3)], aten("default", T(0), [0, 2])),
    "repeat_big": ("repeat", [randn(16, 1, 64)], aten("default", T(0), [1, 64, 2])),
    # gather: along the last / the first dim, an index smaller than the input off dim
    "gather_last": ("gather", [randn(3, 6), randint(0, 6, 3, 4)], {"dim": 1}),
    "gather_first": ("gather", [randn(5, 4, 3), randint(0, 5, 2, 4, 2)], {"dim": 0}),
    "gather_mid_neg": ("gather", [randint(-9, 9, 3, 7, 2), randint(0, 7, 3, 9, 2)], {"dim": -2}),
    # index_select: rows, columns, a middle dim, int32 index, a repeated index, a 0-d index
    "isel_rows": ("index_select", [randn(6, 8), randint(0, 6, 4)], {"dim": 0}),
    "isel_cols": ("index_select", [randn(4, 6), randint(0, 6, 9)], {"dim": 1}),
    "isel_mid_i32": ("index_select", [randn(2, 7, 3), randint(0, 7, 5, dtype=torch.int32)], {"dim": 1}),
    "isel_scalar": ("index_select", [randn(5, 3), torch.tensor(4)], {"dim": 0}),
}


# index maps (index_maps.py): reflection / replication / circular padding in 1-3 d, flip, nearest(-exact)
# 1-d / 3-d / 2-d: bit for bit as well
INDEX_MAPS = {
    "reflect1d": ("reflection_pad1d", [randn(2, 3, 7)], aten("default", T(0), [3, 2])),
    "reflect2d": ("reflection_pad2d", [randn(1, 2, 5, 6)], aten("default", T(0), [1, 2, 4, 0])),
    "reflect3d_f64": ("reflection_pad3d", [randn(1, 1, 3, 4, 5).double()], aten("default", T(0), [1, 1, 2, 0, 1, 2])),
    "replicate2d": ("replication_pad2d", [randn(2, 3, 4, 4)], aten("default", T(0), [3, 3, 0, 5])),
    "replicate1d": ("replication_pad1d", [randn(3, 6)], aten("default", T(0), [4, 1])),
    "circular": ("_pad_circular", [randn(1, 2, 5, 6)], aten("default", T(0), [2, 1, 1, 3])),
    "flip": ("flip", [randn(3, 4, 5)], aten("default", T(0), [0, 2])),
    "nearest1d": ("upsample_nearest1d", [randn(2, 3, 6)], aten("vec", T(0), [13], None)),
    "nearest3d": ("upsample_nearest3d", [randn(1, 2, 3, 4, 3)], aten("vec", T(0), None, [1.5, 2.0, 0.7])),
    "nearest_exact2d": ("_upsample_nearest_exact2d", [randn(1, 2, 5, 7)], aten("vec", T(0), [9, 4], None)),
    "reflect_big": ("reflection_pad2d", [randn(4, 32, 64, 64)], aten("default", T(0), [1, 1, 1, 1])),
}
CASES.update(INDEX_MAPS)


def _ref(op, ins, attrs):
    return get_op(op).ref([t.clone() for t in ins], attrs, {})[0].contiguous()


def _build(tmp_path_factory, cases):
    """Every case of `cases` (name -> (op, inputs, attrs)) generated over outputs shaped as
    the reference's, then compiled into one library."""
    if not _PROBE.compiler_available():
        pytest.skip("no C++ compiler")
    sources = {}
    for name, (op, ins, attrs) in cases.items():
        outs = [torch.empty_like(t) for t in get_op(op).ref([t.clone() for t in ins], attrs, {})]
        ks = native_source(op, ins, outs, attrs, {}, [f"in{i}" for i in range(len(ins))],
                           ["out", "mean", "rstd"][:len(outs)])
        assert ks is not None, f"{name}: the lowering refused a case it should cover"
        sources[name] = ks
    return sources, KernelBuilder(tmp_path_factory.mktemp("kcache"), threads=2).build_many(list(sources.values()))


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return _build(tmp_path_factory, CASES)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if not a.is_floating_point():
        return torch.equal(a, b)
    nan = torch.isnan(a)
    return torch.equal(nan, torch.isnan(b)) and torch.equal(a[~nan], b[~nan]) and \
        torch.equal(torch.signbit(a[~nan]), torch.signbit(b[~nan]))


@needs_cxx
@pytest.mark.parametrize("name", list(CASES))
def test_matches_aten_bit_for_bit(built, name):
    sources, kernels = built
    op, ins, attrs = CASES[name]
    ks = sources[name]
    got = run_with_tensors(kernels[ks.symbol], dict(zip(ks.inputs, ins)), source=ks)["out"]
    assert _same(got, _ref(op, ins, attrs)), f"{name}: {ks.pattern} differs from ATen"


def test_registered_and_parallel_only_for_large_work(built):
    sources, _ = built
    assert {"pad", "concat", "stack", "repeat", "gather", "index_select", *INDEX_MAP_OPS} <= ops_in(NATIVE)
    assert sources["pad_big"].parallel and sources["concat_big"].parallel and sources["repeat_big"].parallel
    assert not sources["pad_last"].parallel and not sources["concat_last"].parallel
    assert sources["reflect_big"].parallel and not sources["reflect2d"].parallel


@needs_cxx
@pytest.mark.parametrize("name,bad", [("gather_last", [(0, 0, 6), (2, 3, -1)]),
                                      ("isel_cols", [(2, 6), (5, -1)])])
def test_index_out_of_range_raises_and_never_reads_outside(built, name, bad):
    """As ATen raises, the bound step raises a BackendError; the out-of-range elements (or
    rows) are zeros, never a read outside x, and the rest is exact."""
    sources, kernels = built
    op, (x, idx), attrs = CASES[name]
    ks = sources[name]
    assert ks.status
    idx = idx.clone()
    for *pos, v in bad:
        idx[tuple(pos)] = v
    got = torch.full_like(_ref(op, [x, CASES[name][1][1]], attrs), float("nan"))
    step = kernels[ks.symbol].bind([x.data_ptr(), idx.data_ptr(), got.data_ptr()])
    with pytest.raises(BackendError, match="index out of range"):
        step()
    ok = (idx >= 0) & (idx < x.shape[attrs["dim"]])
    want = _ref(op, [x, torch.where(ok, idx, 0)], attrs)
    if op == "gather":
        assert torch.equal(got[~ok], torch.zeros(2)) and _same(got[ok], want[ok])
    else:
        assert torch.equal(got[:, ~ok], torch.zeros(4, 2)) and _same(got[:, ok], want[:, ok])
    kernels[ks.symbol].bind([x.data_ptr(), CASES[name][1][1].data_ptr(), got.data_ptr()])()   # count was reset


def _refused(op, ins, out, attrs):
    return native_source(op, ins, [out], attrs, {}, [f"in{i}" for i in range(len(ins))], ["out"]) is None


def test_lowerings_refuse_what_they_do_not_cover():
    x = randn(3, 4)
    assert _refused("pad", [x], torch.empty(3, 2), {"pads": [-1, -1], "value": 0.0})         # a crop
    assert _refused("pad", [x], torch.empty(3, 6), {"pads": [1, 1], "value": float("nan")})
    assert _refused("pad", [x.long()], torch.empty(3, 6, dtype=torch.int64), {"pads": [1, 1], "value": 0.5})
    assert _refused("pad", [x > 0], torch.empty(3, 6, dtype=torch.bool), {"pads": [1, 1], "value": 0.0})
    assert _refused("concat", [x, x.double()], torch.empty(3, 8, dtype=torch.float64), {"dim": 1})  # promotes
    assert _refused("concat", [x, randn(2, 4)], torch.empty(5, 4), {"dim": 1})                  # shapes differ off dim
    assert _refused("stack", [x, x], torch.empty(2, 3, 4), aten("default", [T(1), T(2)]))        # no input 2
    assert _refused("repeat", [x], torch.empty(3, 8), aten("default", T(0), [2]))                # fewer repeats
    assert _refused("gather", [x, randint(0, 4, 3, 4, dtype=torch.int32)], torch.empty(3, 4), {"dim": 1})
    assert _refused("gather", [x, randint(0, 4, 4, 4)], torch.empty(4, 4), {"dim": 1})          # index too big
    assert _refused("index_select", [x, randint(0, 4, 2, 2)], torch.empty(3, 4), {"dim": 1})    # 2-d index
    buf = randn(24)
    assert _refused("concat", [buf[:12].view(3, 4)], buf[6:18].view(3, 4), {"dim": 1})            # overlapping


# ------------------------------------------------------------------------------ resampling

RESAMPLE = {
    # nearest: scales given (vec), sizes given (vec and default), 2x, downsampling, odd sizes, f64
    "nearest_scales": ("upsample_nearest2d", randn(1, 2, 4, 5), aten("vec", T(0), None, [2.0, 1.5])),
    "nearest_size": ("upsample_nearest2d", randn(2, 3, 5, 7), aten("vec", T(0), [11, 13], None)),
    "nearest_default": ("upsample_nearest2d", randn(1, 2, 6, 6), aten("default", T(0), [12, 12])),
    "nearest_down": ("upsample_nearest2d", randn(1, 2, 9, 10), aten("vec", T(0), [4, 3], None)),
    "nearest_f64_scales": ("upsample_nearest2d", randn(1, 1, 3, 3).double(), aten("default", T(0), [7, 5], 2.5, 1.7)),
    # bilinear: align_corners both ways, sizes or scales, up and down, odd sizes, one output row
    "bilinear_ac": ("upsample_bilinear2d", randn(1, 2, 4, 5), aten("vec", T(0), [7, 8], True, None)),
    "bilinear_scales": ("upsample_bilinear2d", randn(1, 2, 4, 5), aten("vec", T(0), None, False, [1.5, 2.0])),
    "bilinear_size": ("upsample_bilinear2d", randn(2, 3, 13, 11), aten("vec", T(0), [29, 17], False, None)),
    "bilinear_down_ac": ("upsample_bilinear2d", randn(1, 3, 17, 19), aten("vec", T(0), [5, 6], True, None)),
    "bilinear_down": ("upsample_bilinear2d", randn(1, 3, 17, 19), aten("default", T(0), [5, 6], False)),
    "bilinear_row_ac": ("upsample_bilinear2d", randn(1, 1, 3, 4), aten("vec", T(0), [1, 9], True, None)),
    "bilinear_same_h": ("upsample_bilinear2d", randn(1, 2, 6, 4), aten("default", T(0), [6, 10], False, 1.0, 2.5)),
    "bilinear_big": ("upsample_bilinear2d", randn(1, 64, 32, 32), aten("vec", T(0), None, False, [2.0, 2.0])),
}


@pytest.fixture(scope="module")
def resample_built(tmp_path_factory):
    return _build(tmp_path_factory, {name: (op, [x], attrs) for name, (op, x, attrs) in RESAMPLE.items()})


@needs_cxx
@pytest.mark.parametrize("name", list(RESAMPLE))
def test_resampling_matches_aten(resample_built, name):
    """Nearest bit for bit (ATen's own index table); bilinear within fp32 rounding of the
    weights (the NaN of the input spreads to the same outputs)."""
    sources, kernels = resample_built
    op, x, attrs = RESAMPLE[name]
    ks = sources[name]
    got = run_with_tensors(kernels[ks.symbol], {"in0": x}, source=ks)["out"]
    want = _ref(op, [x], attrs)
    if op == "upsample_nearest2d":
        assert _same(got, want), f"{name}: {ks.pattern} differs from ATen"
        return
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan), name
    assert torch.allclose(got[~nan], want[~nan], rtol=1e-6, atol=1e-6), \
        f"{name}: max |diff| {(got[~nan] - want[~nan]).abs().max():.3g}"


def test_resampling_refuses_what_it_does_not_cover():
    x = randn(1, 2, 4, 5)
    y = torch.empty(1, 2, 8, 10)
    assert _refused("upsample_bilinear2d", [x.double()], y.double(), aten("vec", T(0), [8, 10], False, None))
    assert _refused("upsample_bilinear2d", [x[0]], y[0], aten("vec", T(0), [8, 10], False, None))          # 3-d
    assert _refused("upsample_bilinear2d", [x], torch.empty(1, 2, 8, 9), aten("vec", T(0), [8, 10], False, None))
    assert _refused("upsample_nearest2d", [x.half()], y.half(), aten("vec", T(0), [8, 10], None))
    assert _refused("upsample_nearest2d", [x], torch.empty(1, 2, 8, 9), aten("vec", T(0), [8, 10], None))


# ------------------------------------------------------------------------------ group norm

NORMS = {
    "gn_affine": ("group_norm", [randn(2, 4, 3, 3), randn(4), randn(4)], aten("default", T(0), 2, T(1), T(2), 1e-5)),
    "gn_plain": ("group_norm", [randn(3, 6, 5)], aten("default", T(0), 3)),
    "gn_weight_only": ("group_norm", [randn(1, 8, 7, 5) * 30 + 100, randn(8)], aten("default", T(0), 8, T(1), None, 1e-3)),
    "gn_one_group": ("group_norm", [randn(2, 6, 4, 4), randn(6), randn(6)], aten("default", T(0), 1, T(1), T(2))),
    "gn_big": ("group_norm", [randn(2, 64, 32, 32), randn(64), randn(64)], aten("default", T(0), 32, T(1), T(2))),
    "native_gn": ("native_group_norm", [randn(2, 4, 3, 3), randn(4), randn(4)],
                  aten("default", T(0), T(1), T(2), 2, 4, 9, 2, 1e-5)),
}


@pytest.fixture(scope="module")
def norms_built(tmp_path_factory):
    return _build(tmp_path_factory, NORMS)


@needs_cxx
@pytest.mark.parametrize("name", list(NORMS))
def test_group_norm_matches_aten(norms_built, name):
    """Within fp32 rounding (ATen's moments are fp32 Welford, ours are summed in double);
    the mean and rstd outputs of native_group_norm too."""
    sources, kernels = norms_built
    op, ins, attrs = NORMS[name]
    ks = sources[name]
    got = run_with_tensors(kernels[ks.symbol], dict(zip(ks.inputs, ins)), source=ks)
    want = get_op(op).ref([t.clone() for t in ins], attrs, {})
    for key, w in zip(["out", "mean", "rstd"], want):
        assert got[key].shape == w.shape and torch.allclose(got[key], w, rtol=1e-5, atol=1e-5, equal_nan=True), \
            f"{name} {key}: max |diff| {(got[key] - w).abs().max():.3g}"
    assert ks.parallel == (name == "gn_big")


def test_group_norm_refuses_what_it_does_not_cover():
    x = randn(2, 4, 3)
    assert _refused("group_norm", [x.double()], x.double(), aten("default", T(0), 2))
    assert _refused("group_norm", [x], x.clone(), aten("default", T(0), 3))                  # 4 channels, 3 groups
    assert _refused("group_norm", [x, randn(2)], x.clone(), aten("default", T(0), 2, T(1)))  # weight not per channel




def test_index_maps_refuse_what_is_not_a_separable_gather():
    x = randn(2, 3, 4)
    assert _refused("flip", [x.long()], torch.empty(2, 3, 4, dtype=torch.int64), aten("default", T(0), [0]))
    assert _refused("reflection_pad1d", [x], torch.empty(2, 3, 12), aten("default", T(0), [4, 4]))  # ATen refuses
    assert _refused("reflection_pad1d", [x], torch.empty(2, 3, 7), aten("default", T(0), [2, 2]))   # not its shape


# ------------------------------------------------------------------------------- end to end

class _Decoder(torch.nn.Module):
    """A decoder block's layout ops: conv, group norm, both resamplings, a cropping and a
    padding pad, concat, topk."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(4, 8, 3, padding=1)
        self.gn = torch.nn.GroupNorm(2, 8)

    def forward(self, x):
        h = self.gn(self.conv(x))
        u = torch.nn.functional.interpolate(h, scale_factor=2, mode="bilinear", align_corners=False)
        n = torch.nn.functional.interpolate(h, size=(11, 13), mode="nearest")
        y = torch.cat([u, torch.nn.functional.pad(n, (0, -1, 1, 0))], 1)
        y = torch.nn.functional.pad(y, (1, 1, 1, 1), value=0.5)
        v, i = torch.topk(y.flatten(2), 3, dim=-1)
        return y, v, i


@needs_cxx
def test_decoder_block_runs_native_layout_steps_and_matches_eager(tmp_path):
    """Captured, planned and bound as a model is: the layout ops run as native steps (the
    cropping pad as the reference op), topk as its ATen out step, and the outputs are eager's."""
    import graphmode
    from graphmode.backends.cpu.build import builder_for
    from graphmode.backends.cpu.executor import CpuExecutable
    from graphmode.capture.zoo import ModelBundle
    from graphmode.recipe import load_recipe
    from graphmode.runtime.build import attach_bodies, build_plan
    from graphmode.verify.numerics import rel_l2
    torch.manual_seed(0)
    m = _Decoder().eval()
    x = torch.randn(2, 4, 6, 6, generator=G)
    bundle = ModelBundle("decoder", m, {"x": x}, {"x": [2, 4, 6, 6]}, ["y", "v", "i"])
    recipe = {"version": 1, "name": "decoder", "inputs": [{"name": "x", "dtype": "f32", "shape": [2, 4, 6, 6]}],
              "exe_mode": "graph", "targets": ["host"]}
    cm = graphmode.compile(bundle, load_recipe(recipe), cache_dir=tmp_path)
    plan = attach_bodies(build_plan(cm.graph, cm.recipe, {}), cm.graph)
    exe = CpuExecutable(plan, cm.graph.constants, builder=builder_for(tmp_path / "kernels", 2), threads=2,
                        tactics=False)
    for op in ("group_norm", "upsample_bilinear2d", "upsample_nearest2d", "concat", "pad"):
        assert f"native:{op}" in exe.step_names, exe.step_names
    assert "aten:topk" in exe.step_names and not exe.kernel_report["fallbacks"]
    out = exe.run({"x": x})
    with torch.inference_mode():
        ref = m(x)
    for name, r in zip(plan.outputs, ref):
        assert out[name].dtype == r.dtype and rel_l2(out[name].double(), r.double()) < 1e-5, name
