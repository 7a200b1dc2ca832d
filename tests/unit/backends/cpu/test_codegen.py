"""Generated C++ kernels for fused groups (graphmode/backends/cpu): numerics against the
reference interpreter, generated-source content, the library cache, the no-compiler path.

Every numeric case is compiled into ONE shared library (a module fixture), as the executor
does per plan; the cache tests build one tiny library of their own.
"""
from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from graphmode.backends.cpu.build import KernelBuilder
from graphmode.backends.cpu.codegen import PAR_THRESHOLD, generate, split_gemm_epilogue
from graphmode.backends.cpu.kernels import run_with_tensors
from graphmode.errors import BackendError
from graphmode.ir import parse_graph
from graphmode.ir.interpreter import run_node
from graphmode.ir.types import DTYPES
from graphmode.verify.numerics import rel_l2

_PROBE = KernelBuilder(Path(tempfile.gettempdir()) / "graphmode-test-probe")
needs_cxx = pytest.mark.skipif(not _PROBE.compiler_available(), reason="no C++ compiler on this machine")

# ------------------------------------------------------------------------------ cases (IR text)

CASES: dict[str, str] = {
    "bias_gelu_erf": """graph @g(%x: f32[4,8,96], %b: f32[96]) -> (%y) {
  %y: f32[4,8,96] = fused(%x, %b) {"kind": "elementwise"} {
    %a: f32[4,8,96] = add(%x, %b)
    %y: f32[4,8,96] = gelu(%a)
  }
  return %y
}""",
    "bias_gelu_big": """graph @g(%x: f32[128,1536], %b: f32[1536]) -> (%y) {
  %y: f32[128,1536] = fused(%x, %b) {"kind": "elementwise"} {
    %a: f32[128,1536] = add(%x, %b)
    %y: f32[128,1536] = gelu(%a)
  }
  return %y
}""",
    "gelu_tanh_op": """graph @g(%x: f32[16,3072]) -> (%y) {
  %y: f32[16,3072] = fused(%x) {"kind": "elementwise"} {
    %y: f32[16,3072] = gelu(%x) {"approximate": "tanh"}
  }
  return %y
}""",
    # GPT-2's NewGELU as captured: 0.5*x*(1+tanh(sqrt(2/pi)*(x+0.044715*x^3)))
    "gpt2_gelu_chain": """graph @g(%x: f32[2,16,768]) -> (%y) {
  const %c05: f32[] = 0.5
  const %c1: f32[] = 1.0
  const %c3: f32[] = 3.0
  const %ck: f32[] = 0.044715
  const %cs: f32[] = 0.7978845608028654
  %y: f32[2,16,768] = fused(%x, %c05, %c1, %c3, %ck, %cs) {"kind": "elementwise"} {
    %p: f32[2,16,768] = pow(%x, %c3)
    %q: f32[2,16,768] = mul(%p, %ck)
    %r: f32[2,16,768] = add(%x, %q)
    %s: f32[2,16,768] = mul(%r, %cs)
    %t: f32[2,16,768] = tanh(%s)
    %u: f32[2,16,768] = add(%t, %c1)
    %v: f32[2,16,768] = mul(%x, %c05)
    %y: f32[2,16,768] = mul(%v, %u)
  }
  return %y
}""",
    "scalar_ops": """graph @g(%x: f32[3,5,7], %s: f32[]) -> (%y) {
  const %two: i64[] = 2
  %y: f32[3,5,7] = fused(%x, %s, %two) {"kind": "elementwise"} {
    %a: f32[3,5,7] = mul(%x, %s)
    %b: f32[3,5,7] = pow(%a, %two)
    %c: f32[3,5,7] = sub(%b, %x)
    %d: f32[3,5,7] = clamp(%c) {"max": 2.5, "min": -1.0}
    %e: f32[3,5,7] = maximum(%d, %s)
    %y: f32[3,5,7] = div(%e, %s)
  }
  return %y
}""",
    "mask_broadcast": """graph @g(%sc: f32[2,4,16,16], %m: f32[2,1,1,16]) -> (%o) {
  const %scale: f32[] = 0.125
  %o: f32[2,4,16,16] = fused(%sc, %scale, %m) {"kind": "elementwise"} {
    %a: f32[2,4,16,16] = mul(%sc, %scale)
    %o: f32[2,4,16,16] = add(%a, %m)
  }
  return %o
}""",
    "softmax_scale_mask": """graph @g(%sc: f32[2,4,16,16], %m: f32[2,1,1,16]) -> (%p) {
  const %scale: f32[] = 0.125
  %p: f32[2,4,16,16] = fused(%sc, %scale, %m) {"kind": "reduction"} {
    %a: f32[2,4,16,16] = mul(%sc, %scale)
    %b: f32[2,4,16,16] = add(%a, %m)
    %p: f32[2,4,16,16] = softmax(%b) {"dim": -1}
  }
  return %p
}""",
    "softmax_big": """graph @g(%x: f32[12,128,128]) -> (%p) {
  %p: f32[12,128,128] = fused(%x) {"kind": "reduction"} {
    %p: f32[12,128,128] = softmax(%x) {"dim": 2}
  }
  return %p
}""",
    "causal_softmax_bool": """graph @g(%sc: f32[2,3,8,8], %keep: bool[1,1,8,8]) -> (%p) {
  const %neg: f32[] = -1000000000.0
  %p: f32[2,3,8,8] = fused(%sc, %keep, %neg) {"kind": "reduction"} {
    %a: f32[2,3,8,8] = where(%keep, %sc, %neg)
    %p: f32[2,3,8,8] = softmax(%a) {"dim": -1}
  }
  return %p
}""",
    "log_softmax": """graph @g(%x: f32[6,50]) -> (%p) {
  %p: f32[6,50] = fused(%x) {"kind": "reduction"} {
    %p: f32[6,50] = log_softmax(%x) {"dim": -1}
  }
  return %p
}""",
    "residual_layer_norm": """graph @g(%x: f32[2,16,384], %r: f32[2,16,384], %w: f32[384], %bb: f32[384]) -> (%h, %y) {
  %h: f32[2,16,384], %y: f32[2,16,384] = fused(%x, %r, %w, %bb) {"kind": "norm"} {
    %h: f32[2,16,384] = add(%x, %r)
    %y: f32[2,16,384] = layer_norm(%h, %w, %bb) {"eps": 1e-05}
  }
  return %h, %y
}""",
    "layer_norm_big": """graph @g(%x: f32[128,384], %w: f32[384], %bb: f32[384]) -> (%y) {
  %y: f32[128,384] = fused(%x, %w, %bb) {"kind": "norm"} {
    %y: f32[128,384] = layer_norm(%x, %w, %bb) {"eps": 1e-12}
  }
  return %y
}""",
    "layer_norm_noaffine_epilogue": """graph @g(%x: f32[5,33]) -> (%y) {
  const %c: f32[] = 2.0
  %y: f32[5,33] = fused(%x, %c) {"kind": "norm"} {
    %n: f32[5,33] = layer_norm(%x) {"eps": 1e-05}
    %y: f32[5,33] = mul(%n, %c)
  }
  return %y
}""",
    "rms_norm_mean": """graph @g(%x: f32[4,10,64], %w: f32[64]) -> (%y, %rs) {
  const %two: f32[] = 2.0
  const %eps: f32[] = 1e-06
  %y: f32[4,10,64], %rs: f32[4,10,1] = fused(%x, %w, %two, %eps) {"kind": "reduction"} {
    %sq: f32[4,10,64] = pow(%x, %two)
    %ms: f32[4,10,1] = mean(%sq) {"dims": [-1], "keepdim": true}
    %ae: f32[4,10,1] = add(%ms, %eps)
    %rs: f32[4,10,1] = rsqrt(%ae)
    %xn: f32[4,10,64] = mul(%x, %rs)
    %y: f32[4,10,64] = mul(%xn, %w)
  }
  return %y, %rs
}""",
    "amax_nokeep": """graph @g(%x: f32[4,6,40], %s: f32[6]) -> (%m) {
  %m: f32[4,6] = fused(%x, %s) {"kind": "reduction"} {
    %a: f32[4,6] = amax(%x) {"dims": [2], "keepdim": false}
    %m: f32[4,6] = mul(%a, %s)
  }
  return %m
}""",
    "sum_sub_keepdim": """graph @g(%x: f32[7,30]) -> (%c, %s) {
  %c: f32[7,30], %s: f32[7,1] = fused(%x) {"kind": "reduction"} {
    %s: f32[7,1] = sum(%x) {"dims": [1], "keepdim": true}
    %c: f32[7,30] = sub(%x, %s)
  }
  return %c, %s
}""",
    "int_sum": """graph @g(%i: i64[8,5]) -> (%s) {
  %s: i64[8,1] = fused(%i) {"kind": "reduction"} {
    %s: i64[8,1] = sum(%i) {"dims": [-1], "keepdim": true}
  }
  return %s
}""",
    "masks_cast_where": """graph @g(%x: f32[4,16], %mask: bool[4,16], %im: i64[4,16]) -> (%y, %z, %k, %f) {
  const %ninf: f32[] = -10000.0
  const %z0: f32[] = 0.0
  %y: f32[4,16], %z: f32[4,16], %k: bool[4,16], %f: i32[4,16] = fused(%x, %mask, %im, %ninf, %z0) {"kind": "elementwise"} {
    %y: f32[4,16] = where(%mask, %x, %ninf)
    %g: bool[4,16] = gt(%x, %z0)
    %k: bool[4,16] = logical_and(%g, %mask)
    %c: f32[4,16] = cast(%im) {"dtype": "f32"}
    %z: f32[4,16] = mul(%c, %x)
    %nm: bool[4,16] = logical_not(%mask)
    %f: i32[4,16] = cast(%nm) {"dtype": "i32"}
  }
  return %y, %z, %k, %f
}""",
    "bert_ext_mask": """graph @bert_mask(%am: i64[2,1,1,12]) -> (%e) {
  const %one: f32[] = 1.0
  const %big: f32[] = -3.4028234663852886e+38
  %e: f32[2,1,1,12] = fused(%am, %one, %big) {"kind": "elementwise"} {
    %c: f32[2,1,1,12] = cast(%am) {"dtype": "f32"}
    %s: f32[2,1,1,12] = sub(%one, %c)
    %e: f32[2,1,1,12] = mul(%s, %big)
  }
  return %e
}""",
    "int_ops": """graph @g(%i: i64[6,9], %j: i64[9], %k: i32[6,9]) -> (%a, %d, %c) {
  const %two: i64[] = 2
  %a: i64[6,9], %d: f32[6,9], %c: bool[6,9] = fused(%i, %j, %k, %two) {"kind": "elementwise"} {
    %p: i64[6,9] = pow(%i, %two)
    %m: i64[6,9] = mul(%p, %j)
    %a: i64[6,9] = maximum(%m, %i)
    %d: f32[6,9] = div(%i, %j)
    %c: bool[6,9] = le(%k, %i)
  }
  return %a, %d, %c
}""",
    "multi_shape_outputs": """graph @g(%x: f32[4,8], %mk: f32[1,8]) -> (%a, %m2) {
  const %big: f32[] = -10000.0
  %a: f32[4,8], %m2: f32[1,8] = fused(%x, %mk, %big) {"kind": "elementwise"} {
    %m2: f32[1,8] = mul(%mk, %big)
    %a: f32[4,8] = add(%x, %m2)
  }
  return %a, %m2
}""",
    "inplace_relu": """graph @g(%x: f32[8,64], %b: f32[64]) -> (%y) {
  %y: f32[8,64] = fused(%x, %b) {"kind": "elementwise"} {
    %a: f32[8,64] = add(%x, %b)
    %y: f32[8,64] = relu(%a)
  }
  return %y
}""",
    "unary_zoo": """graph @g(%x: f32[3,41]) -> (%y) {
  %y: f32[3,41] = fused(%x) {"kind": "elementwise"} {
    %a: f32[3,41] = abs(%x)
    %b: f32[3,41] = sqrt(%a)
    %c: f32[3,41] = log(%b)
    %d: f32[3,41] = sigmoid(%c)
    %e: f32[3,41] = silu(%d)
    %f: f32[3,41] = exp(%e)
    %g: f32[3,41] = reciprocal(%f)
    %h: f32[3,41] = neg(%g)
    %i: f32[3,41] = minimum(%h, %x)
    %j: f32[3,41] = erf(%i)
    %k: f32[3,41] = sin(%j)
    %l: f32[3,41] = cos(%k)
    %y: f32[3,41] = add(%l, %e)
  }
  return %y
}""",
    "f64_chain": """graph @g(%x: f64[4,33], %b: f64[33]) -> (%y) {
  %y: f64[4,33] = fused(%x, %b) {"kind": "elementwise"} {
    %a: f64[4,33] = add(%x, %b)
    %g: f64[4,33] = gelu(%a)
    %y: f64[4,33] = tanh(%g)
  }
  return %y
}""",
    "f64_softmax": """graph @g(%x: f64[5,17]) -> (%p) {
  %p: f64[5,17] = fused(%x) {"kind": "reduction"} {
    %p: f64[5,17] = softmax(%x) {"dim": -1}
  }
  return %p
}""",
    "gemm_epilogue": """graph @g(%x: f32[8,32], %w: f32[64,32], %bl: f32[64], %res: f32[8,64]) -> (%y) {
  %y: f32[8,64] = fused(%x, %w, %bl, %res) {"kind": "gemm_epilogue"} {
    %g: f32[8,64] = linear(%x, %w, %bl)
    %ge: f32[8,64] = gelu(%g)
    %y: f32[8,64] = add(%ge, %res)
  }
  return %y
}""",
    "gemm_epilogue_keep": """graph @g(%x: f32[8,32], %w: f32[64,32]) -> (%g2, %y2) {
  %g2: f32[8,64], %y2: f32[8,64] = fused(%x, %w) {"kind": "gemm_epilogue"} {
    %g2: f32[8,64] = linear(%x, %w)
    %y2: f32[8,64] = tanh(%g2)
  }
  return %g2, %y2
}""",
}


def _load(name: str):
    g = parse_graph(CASES[name])
    node = next(n for n in g.nodes if n.op == "fused")
    types = {k: v.type for k, v in g.values.items()}
    return g, node, types


INT_RANGE = {"bert_mask": (0, 2)}   # attention masks are 0/1


def _inputs(g, node, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    lo, hi = INT_RANGE.get(g.name, (1, 6))
    out = []
    for name in node.inputs:
        if name in g.constants:
            out.append(g.constants[name])
            continue
        ty = g.values[name].type
        shape = tuple(int(d) for d in ty.shape)
        dt = DTYPES[ty.dtype]
        if dt == torch.bool:
            t = torch.randint(0, 2, shape, generator=gen).bool()
        elif dt.is_floating_point:
            t = (torch.randn(shape, generator=gen, dtype=torch.float64) * 1.5).to(dt)
        else:
            t = torch.randint(lo, hi, shape, generator=gen).to(dt)
        out.append(t)
    return out


def _close(name: str, got: torch.Tensor, ref: torch.Tensor, dtype: str) -> None:
    ref = ref.to(DTYPES[dtype])
    assert got.dtype == ref.dtype and got.shape == ref.shape, name
    if got.is_floating_point() and not torch.isfinite(ref).all():
        assert torch.equal(torch.isinf(got) & (got > 0), torch.isinf(ref) & (ref > 0)), name
        assert torch.equal(torch.isinf(got) & (got < 0), torch.isinf(ref) & (ref < 0)), name
        assert torch.equal(torch.isnan(got), torch.isnan(ref)), name
        fin = torch.isfinite(ref)
        got, ref = got[fin], ref[fin]
    if dtype == "f64":
        assert rel_l2(got, ref) < 1e-10, name
    elif dtype == "f32":
        assert rel_l2(got, ref) < 1e-5, (name, rel_l2(got, ref))
    else:
        assert torch.equal(got, ref), name


# which cases get `constants` (the executor passes the plan's constants: 1-element ones fold)
FOLD = {"gpt2_gelu_chain", "softmax_scale_mask", "rms_norm_mean", "masks_cast_where"}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Every case generated, then compiled into one library (one build_many)."""
    if not _PROBE.compiler_available():
        pytest.skip("no C++ compiler")
    cache = tmp_path_factory.mktemp("kcache")
    b = KernelBuilder(cache)
    gen = {}
    for name in CASES:
        g, node, types = _load(name)
        gen[name] = (g, node, types, generate(node, types, constants=g.constants if name in FOLD else None))
    # the GPT-2 chain once more with its scalars read at run time (pointers, std::pow path)
    g, node, types = _load("gpt2_gelu_chain")
    gen["gpt2_gelu_chain_unfolded"] = (g, node, types, generate(node, types))
    kernels = b.build_many([ks for *_, ks in gen.values()])
    assert b.stats["compiles"] == 1
    return b, gen, kernels


def _run_case(built, name: str, seed: int = 0):
    _b, gen, kernels = built
    g, node, types, ks = gen[name]
    args = _inputs(g, node, seed)
    feed = dict(zip(node.inputs, args))
    got = run_with_tensors(kernels[ks.symbol], {n: feed[n] for n in ks.inputs if n in feed})
    with torch.inference_mode():
        ref = dict(zip(node.outputs, run_node(node, args, {})))
    return ks, got, ref, types, feed


ELEMENTWISE_AND_ROW = [n for n in CASES if not n.startswith("gemm_")] + ["gpt2_gelu_chain_unfolded"]


@needs_cxx
@pytest.mark.parametrize("name", ELEMENTWISE_AND_ROW)
def test_matches_interpreter(built, name):
    ks, got, ref, types, _ = _run_case(built, name)
    assert set(got) == set(ks.outputs)
    for o in ks.outputs:
        _close(f"{name}:{o}", got[o], ref[o], types[o].dtype)


@needs_cxx
def test_gelu_matches_torch_functional(built):
    for name, approx in (("bias_gelu_big", "none"), ("gelu_tanh_op", "tanh"), ("gpt2_gelu_chain", "tanh")):
        ks, got, _ref, _types, feed = _run_case(built, name, seed=3)
        x = feed["x"] + feed["b"] if "b" in feed else feed["x"]
        assert rel_l2(got[ks.outputs[0]], F.gelu(x, approximate=approx)) < 1e-5, name


@needs_cxx
def test_folded_and_unfolded_constants(built):
    _b, gen, _k = built
    folded, unfolded = gen["gpt2_gelu_chain"][3], gen["gpt2_gelu_chain_unfolded"][3]
    assert folded.inputs == ("x",) and set(folded.folded) == {"c05", "c1", "c3", "ck", "cs"}
    assert "__builtin_powf" not in folded.source and "* l" in folded.source   # pow(x, 3) -> x*x*x
    assert len(unfolded.inputs) == 6 and "__builtin_powf" in unfolded.source
    assert folded.symbol != unfolded.symbol


@needs_cxx
def test_special_values(built):
    """inf / nan / huge inputs: the vectorised exp/tanh/erf agree with torch elementwise."""
    _b, gen, kernels = built
    g, node, types, ks = gen["unary_zoo"]
    x = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-30, -1e-30, 88.8, -88.8, 100.0,
                      -100.0, 1e-3, 0.5, -0.5, 3.9, -3.9, 5.0, 1e4, -1e4, 0.62, -0.63] + [0.1 * i for i in range(-50, 52)],
                     dtype=torch.float32)[:123].reshape(3, 41)
    got = run_with_tensors(kernels[ks.symbol], {"x": x})["y"]
    with torch.inference_mode():
        ref = run_node(node, [x], {})[0]
    assert torch.equal(torch.isnan(got), torch.isnan(ref))
    ok = ~torch.isnan(ref)
    assert torch.allclose(got[ok], ref[ok], rtol=2e-6, atol=1e-7)


@needs_cxx
def test_math_accuracy_sweep(tmp_path):
    """exp, tanh, erf, sigmoid, silu, gelu over a dense range: within a few ulp of float64."""
    ops = ["exp", "tanh", "erf", "sigmoid", "silu", "gelu", "log", "rsqrt"]
    lines = [f'    %{o}_y: f32[20000] = {o}(%xx)' for o in ops]
    text = ("graph @m(%xx: f32[20000]) -> (" + ", ".join(f"%{o}_y" for o in ops) + ") {\n  "
            + ", ".join(f"%{o}_y: f32[20000]" for o in ops) + ' = fused(%xx) {"kind": "elementwise"} {\n'
            + "\n".join(lines) + "\n  }\n  return " + ", ".join(f"%{o}_y" for o in ops) + "\n}")
    g = parse_graph(text)
    node = g.nodes[0]
    ks = generate(node, {k: v.type for k, v in g.values.items()})
    k = KernelBuilder(tmp_path).build(ks)
    x = torch.cat([torch.linspace(-90, 90, 10000), torch.linspace(-6, 6, 10000)]).float()
    got = run_with_tensors(k, {"xx": x})
    xd = x.double()
    want = {"exp": xd.exp(), "tanh": xd.tanh(), "erf": torch.erf(xd), "sigmoid": torch.sigmoid(xd),
            "silu": F.silu(xd), "gelu": F.gelu(xd), "log": xd.log(), "rsqrt": xd.rsqrt()}
    for o in ops:
        w = want[o]
        y = got[f"{o}_y"].double()
        fin = torch.isfinite(w) & (w.abs() > 1e-30) & (w.abs() < 3.0e38)
        # gelu = 0.5x(1+erf(x/sqrt2)) cancels for x << 0 (in torch too): bound the error by |x|
        scale = torch.maximum(w.abs(), xd.abs()) if o == "gelu" else w.abs()
        ulp = torch.finfo(torch.float32).eps * scale[fin]
        err = ((y[fin] - w[fin]).abs() / ulp).max().item()
        assert err < 4.0, (o, err)
        assert torch.equal(torch.isnan(y), torch.isnan(w)), o


@needs_cxx
def test_nan_propagation_in_amax(built):
    _b, gen, kernels = built
    g, node, types, ks = gen["amax_nokeep"]
    args = _inputs(g, node, 1)
    args[0][1, 2, 7] = float("nan")
    got = run_with_tensors(kernels[ks.symbol], dict(zip(node.inputs, args)))["m"]
    ref = run_node(node, args, {})[0]
    assert torch.isnan(got[1, 2]) and torch.isnan(ref[1, 2])
    assert torch.equal(torch.isnan(got), torch.isnan(ref))
    ok = ~torch.isnan(ref)
    assert rel_l2(got[ok], ref[ok]) < 1e-6


@needs_cxx
def test_inplace_alias(built):
    _b, gen, kernels = built
    g, node, types, ks = gen["inplace_relu"]
    assert "x" in ks.may_alias["y"] and "b" not in ks.may_alias["y"]
    x, b = _inputs(g, node, 2)
    ref = run_node(node, [x, b], {})[0]
    buf = x.clone()
    out = run_with_tensors(kernels[ks.symbol], {"x": buf, "b": b}, out={"y": buf})
    assert out["y"].data_ptr() == buf.data_ptr()
    assert rel_l2(buf, ref) < 1e-6
    # the LayerNorm group may write its outputs over its same-shaped inputs as well
    ln = gen["residual_layer_norm"][3]
    assert set(ln.may_alias["h"]) == {"x", "r"} and set(ln.may_alias["y"]) == {"x", "r"}
    g2, node2, _t, _ = gen["residual_layer_norm"]
    a = _inputs(g2, node2, 4)
    ref_h, ref_y = run_node(node2, a, {})
    xb, rb = a[0].clone(), a[1].clone()
    run_with_tensors(kernels[ln.symbol], {"x": xb, "r": rb, "w": a[2], "bb": a[3]}, out={"h": xb, "y": rb})
    assert rel_l2(xb, ref_h) < 1e-6 and rel_l2(rb, ref_y) < 1e-5


@needs_cxx
def test_no_alias_across_passes(built):
    """The softmax input is read again after the first pass when it is not buffered."""
    _b, gen, _k = built
    ks = gen["sum_sub_keepdim"][3]
    assert ks.may_alias["c"] == ("x",)        # written in the last pass, x read there last
    assert ks.may_alias["s"] == ()
    assert gen["multi_shape_outputs"][3].may_alias["m2"] == ("mk",)


@needs_cxx
def test_gemm_epilogue_split_and_inplace(built):
    _b, gen, kernels = built
    g, node, types, ks = gen["gemm_epilogue"]
    gemm, epi = split_gemm_epilogue(node)
    assert gemm.op == "linear" and [n.op for n in epi] == ["gelu", "add"]
    assert ks.gemm is gemm and ks.inputs[0] == "g" and set(ks.inputs) == {"g", "res"}
    assert "g" in ks.may_alias["y"]
    x, w, bl, res = _inputs(g, node, 5)
    ref = run_node(node, [x, w, bl, res], {})[0]
    y = torch.empty(8, 64)
    torch.addmm(bl, x, w.t(), out=y)            # the executor's GEMM, into the output buffer
    run_with_tensors(kernels[ks.symbol], {"g": y, "res": res}, out={"y": y})
    assert rel_l2(y, ref) < 1e-5
    # a GEMM output that is also a group output must survive: not offered for aliasing
    g2, node2, _t, ks2 = gen["gemm_epilogue_keep"]
    assert ks2.outputs == ("y2",) and ks2.may_alias["y2"] == ()
    x2, w2 = _inputs(g2, node2, 6)
    ref_g, ref_y = run_node(node2, [x2, w2], {})
    gbuf = x2 @ w2.t()
    out = run_with_tensors(kernels[ks2.symbol], {"g2": gbuf})
    assert rel_l2(out["y2"], ref_y) < 1e-6 and torch.equal(gbuf, ref_g)


@needs_cxx
def test_threads_and_bind(built):
    _b, gen, kernels = built
    g, node, types, ks = gen["bias_gelu_big"]
    k = kernels[ks.symbol]
    x, b = _inputs(g, node, 7)
    ref = run_with_tensors(k, {"x": x, "b": b})["y"]
    k.set_threads(1)
    assert k.library.threads == 1
    y = torch.empty_like(x)
    run = k.bind([x.data_ptr(), b.data_ptr(), y.data_ptr()])
    run()
    assert torch.equal(y, ref)
    k.set_threads(0)
    with pytest.raises(BackendError):
        k([x.data_ptr()])


# ------------------------------------------------------------------------------ source content

def test_source_content():
    _g, node, types = _load("bias_gelu_big")
    big = generate(node, types)
    assert "#pragma omp parallel for" in big.source and "#pragma omp simd" in big.source
    assert big.parallel and big.kind == "elementwise"
    _g, node, types = _load("bias_gelu_erf")
    small = generate(node, types)
    assert "omp parallel" not in small.source and "#pragma omp simd" in small.source
    assert "j < 96" in small.source                       # sizes are compile-time constants
    _g, node, types = _load("softmax_big")
    sm = generate(node, types)
    assert sm.kind == "rowwise" and "#pragma omp parallel" in sm.source and "gm_expf" in sm.source
    assert "reduction(max:acc)" in sm.source
    # fully contiguous operands collapse to one dim
    _g, node, types = _load("gelu_tanh_op")
    assert "const int64_t b0 = 0;" in generate(node, types).source or "tile %" in generate(node, types).source
    assert PAR_THRESHOLD > 0


def test_identical_groups_share_a_symbol():
    text = CASES["bias_gelu_erf"]
    a = parse_graph(text)
    b = parse_graph(text.replace("%x", "%hidden").replace("%b", "%bias").replace("%a", "%t0").replace("%y", "%out"))
    ka = generate(a.nodes[0], {k: v.type for k, v in a.values.items()})
    kb = generate(b.nodes[0], {k: v.type for k, v in b.values.items()})
    assert ka.symbol == kb.symbol and ka.source == kb.source
    assert kb.inputs == ("hidden", "bias") and kb.outputs == ("out",)


@pytest.mark.parametrize("text,needle", [
    ("""graph @g(%x: f32[4,8]) -> (%y) {
  %y: f32[32] = fused(%x) {"kind": "elementwise"} {
    %y: f32[32] = reshape(%x) {"shape": [32]}
  }
  return %y
}""", "reshape"),
    ("""graph @g(%x: f32[4,8]) -> (%y) {
  %y: f32[4,8] = fused(%x) {"kind": "reduction"} {
    %y: f32[4,8] = softmax(%x) {"dim": 0}
  }
  return %y
}""", "softmax"),
    ("""graph @g(%x: f32[4,8]) -> (%y) {
  %y: f32[4,8] = fused(%x) {"kind": "reduction"} {
    %a: f32[4,8] = softmax(%x) {"dim": -1}
    %y: f32[4,8] = softmax(%a) {"dim": -1}
  }
  return %y
}""", "softmax"),
    ("""graph @g(%x: f16[4,8]) -> (%y) {
  %y: f16[4,8] = fused(%x) {"kind": "elementwise"} {
    %y: f16[4,8] = relu(%x)
  }
  return %y
}""", "f16"),
    ("""graph @g(%q: f32[1,2,4,8], %k: f32[1,2,4,8], %v: f32[1,2,4,8]) -> (%y) {
  %y: f32[1,2,4,8] = fused(%q, %k, %v) {"kind": "attention"} {
    %y: f32[1,2,4,8] = sdpa(%q, %k, %v)
  }
  return %y
}""", "attention"),
    ("""graph @g(%x: f32[4,8], %w: f32[8,8]) -> (%y) {
  %y: f32[4,8] = fused(%x, %w) {"kind": "gemm_epilogue"} {
    %y: f32[4,8] = relu(%x)
  }
  return %y
}""", "relu"),
])
def test_unsupported_raises_backend_error(text, needle):
    g = parse_graph(text)
    with pytest.raises(BackendError) as ei:
        generate(g.nodes[0], {k: v.type for k, v in g.values.items()})
    assert needle in str(ei.value)


# ------------------------------------------------------------------------------ build / cache

def _tiny():
    g = parse_graph("""graph @t(%x: f32[4,8]) -> (%y) {
  %y: f32[4,8] = fused(%x) {"kind": "elementwise"} {
    %y: f32[4,8] = sigmoid(%x)
  }
  return %y
}""")
    return generate(g.nodes[0], {k: v.type for k, v in g.values.items()})


@needs_cxx
def test_cache_hit_then_corrupt_rebuild(tmp_path, monkeypatch):
    import graphmode.backends.cpu.build as build_mod
    ks = _tiny()
    b1 = KernelBuilder(tmp_path)
    k1 = b1.build(ks)
    assert b1.stats["compiles"] == 1
    path = b1.library_path([ks])
    assert path.exists() and path.with_name(path.stem + ".so.seal").exists() and path.with_suffix(".cpp").exists()
    mtime = path.stat().st_mtime_ns
    b2 = KernelBuilder(tmp_path)
    b2.build(ks)
    assert b2.stats == {"compiles": 0, "cache_hits": 1, "rebuilds": 0, "compile_s": 0.0, "precompiled_header": 0}
    monkeypatch.setattr(build_mod, "_LOADED", {})   # as a fresh process: verify + dlopen from disk
    b2b = KernelBuilder(tmp_path)
    b2b.build(ks)
    assert b2b.stats["compiles"] == 0 and b2b.stats["cache_hits"] == 1
    assert path.stat().st_mtime_ns == mtime
    # truncate the cached library (as a new file: the loaded mapping stays valid)
    data = path.read_bytes()
    tmp = path.with_name("corrupt.tmp")
    tmp.write_bytes(data[: len(data) // 3])
    os.replace(tmp, path)
    b3 = KernelBuilder(tmp_path)
    k3 = b3.build(ks)
    assert b3.stats["rebuilds"] == 1 and b3.stats["compiles"] == 1
    assert path.read_bytes() != data[: len(data) // 3]
    x = torch.randn(4, 8)
    assert rel_l2(run_with_tensors(k3, {"x": x})["y"], torch.sigmoid(x)) < 1e-6
    assert rel_l2(run_with_tensors(k1, {"x": x})["y"], torch.sigmoid(x)) < 1e-6


def test_no_compiler(tmp_path, caplog):
    b = KernelBuilder(tmp_path, compiler="/nonexistent/c++")
    with caplog.at_level(logging.WARNING, logger="graphmode.backends.cpu"):
        assert b.compiler_available() is False
    assert any("no working C++ compiler" in r.message for r in caplog.records)
    with pytest.raises(BackendError) as ei:
        b.build(_tiny())
    assert "no working C++ compiler" in str(ei.value) and "/nonexistent/c++" in str(ei.value)
    # a second builder with the same missing compiler does not warn again
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="graphmode.backends.cpu"):
        assert KernelBuilder(tmp_path, compiler="/nonexistent/c++").compiler_available() is False
    assert not caplog.records


@needs_cxx
def test_parallel_parts_build(tmp_path):
    """Many kernels: split into parts compiled concurrently, linked into one library."""
    srcs = []
    for k, op in enumerate(["exp", "tanh", "sigmoid", "relu", "neg", "abs", "sqrt", "erf"]):
        g = parse_graph(f"""graph @p(%x: f32[3,{k + 2}]) -> (%y) {{
  %y: f32[3,{k + 2}] = fused(%x) {{"kind": "elementwise"}} {{
    %y: f32[3,{k + 2}] = {op}(%x)
  }}
  return %y
}}""")
        srcs.append((op, generate(g.nodes[0], {n: v.type for n, v in g.values.items()})))
    b = KernelBuilder(tmp_path, jobs=2)
    ks = b.build_many([s for _, s in srcs])
    assert b.stats["compiles"] == 1 and len(ks) == 8
    for op, s in srcs:
        x = torch.rand(s.types["x"].shape) + 0.1
        y = run_with_tensors(ks[s.symbol], {"x": x})["y"]
        assert rel_l2(y, getattr(torch, op)(x)) < 1e-6, op


# ------------------------------------------------------------------------------ real models

def _single_op_group(graph, n, types):
    from graphmode.ir.graph import Graph, Node
    body = Graph(f"{graph.name}.{n.outputs[0]}")
    for i in n.inputs:
        if i not in body.values:
            body.add_input(i, types[i])
    for o in n.outputs:
        body.add_value(o, types[o])
    body.nodes.append(n)
    body.outputs = list(n.outputs)
    return Node("fused", tuple(body.inputs), tuple(n.outputs), {"kind": "elementwise"}, body)


@needs_cxx
@pytest.mark.slow
@pytest.mark.parametrize("model", ["minilm", "gpt2"])
def test_real_model_ops(model, captured, bundle, tmp_path):
    """Every elementwise/row op of the captured model, as a one-op group at a concrete
    bucket, against the values the interpreter computes for the whole model."""
    from graphmode.backends.cpu.codegen import ELEMENTWISE_OPS, ROW_REDUCTIONS
    from graphmode.ir.interpreter import interpret
    from graphmode.ir.types import TensorType
    graph, _ = captured(model)
    vals = interpret(graph, bundle(model).make_inputs({"batch": 2, "seq": 16}), keep_all=True)
    types = {k: TensorType.of(v) for k, v in vals.items()}
    groups, skipped = [], []
    for n in graph.nodes:
        if n.op in ELEMENTWISE_OPS or n.op in ROW_REDUCTIONS:
            node = _single_op_group(graph, n, types)
            try:
                groups.append((node, generate(node, types, constants=graph.constants)))
            except BackendError as e:
                skipped.append((n.op, e.message))
    assert len(groups) > 20
    assert len(skipped) <= len(groups) // 4, skipped
    kernels = KernelBuilder(tmp_path).build_many([ks for _, ks in groups])
    for node, ks in groups:
        got = run_with_tensors(kernels[ks.symbol], {i: vals[i] for i in ks.inputs}, source=ks)
        for o in ks.outputs:
            _close(f"{model}:{node.body.nodes[0].op}:{o}", got[o], vals[o], types[o].dtype)


@needs_cxx
def test_broken_kernel_does_not_sink_the_plan(tmp_path):
    import dataclasses
    good = _tiny()
    bad = dataclasses.replace(good, symbol="gm_broken_0", source=good.source.replace(good.symbol, "gm_broken_0")
                              .replace("const float l1", "const float* l1"))
    b = KernelBuilder(tmp_path)
    with pytest.raises(BackendError, match="compilation failed"):
        b.build_many([good, bad])
    ks = b.build_many([good, bad], strict=False)
    assert set(ks) == {good.symbol} and set(b.failures) == {"gm_broken_0"}
    x = torch.randn(4, 8)
    assert rel_l2(run_with_tensors(ks[good.symbol], {"x": x})["y"], torch.sigmoid(x)) < 1e-6


def test_symbolic_body_with_concrete_types():
    """Bodies keep the recipe's symbolic dims; `types` of the inputs pin the bucket."""
    from graphmode.ir.types import TensorType
    g = parse_graph("""graph @g(%x: f32[batch,seq,64], %m: i64[batch,seq]) -> (%y) {
  dims batch=1..8 seq=2..128
  %y: f32[batch,seq,64] = fused(%x, %m) {"kind": "norm"} {
    %mf: f32[batch,seq] = cast(%m) {"dtype": "f32"}
    %y: f32[batch,seq,64] = layer_norm(%x) {"eps": 1e-05}
  }
  return %y
}""")
    ks = generate(g.nodes[0], {"x": TensorType("f32", (2, 5, 64)), "m": TensorType("i64", (2, 5))})
    assert ks.inputs == ("x",) and tuple(ks.types["y"].shape) == (2, 5, 64)
    assert "r < 10" in ks.source and "j < 64" in ks.source
    with pytest.raises(BackendError, match="no concrete shape"):
        generate(g.nodes[0], {})


@needs_cxx
def test_compiler_without_openmp_degrades(tmp_path, caplog):
    """A compiler that rejects -fopenmp: kernels still build (serial, simd pragmas kept)."""
    fake = tmp_path / "cxx-no-omp"
    fake.write_text(f"#!/bin/sh\nfor a in \"$@\"; do [ \"$a\" = -fopenmp ] && exit 1; done\nexec {_PROBE.compiler} \"$@\"\n")
    fake.chmod(0o755)
    with caplog.at_level(logging.WARNING, logger="graphmode.backends.cpu"):
        b = KernelBuilder(tmp_path / "cache", compiler=str(fake))
        assert b.compiler_available()
    assert "-fopenmp" not in b.flags and "-fopenmp-simd" in b.flags
    assert any("-fopenmp" in r.message for r in caplog.records)
    _g, node, types = _load("bias_gelu_big")
    ks = generate(node, types)
    k = b.build(ks)
    assert k.library.threads == 1
    x, bias = torch.randn(128, 1536), torch.randn(1536)
    assert rel_l2(run_with_tensors(k, {"x": x, "b": bias})["y"], F.gelu(x + bias)) < 1e-5


def test_a_compiler_that_cannot_write_its_temporary_files_is_named_as_such(tmp_path, monkeypatch):
    """A full TMPDIR was reported as 'no working C++ compiler ... install g++' with g++ there
    (trial AA): the compiler's own 'No space left on device' is what the warning names now."""
    from types import SimpleNamespace

    import graphmode.backends.cpu.toolchain as toolchain
    real = toolchain.run

    def full(cmd, timeout=None):
        if "--version" in cmd:
            return real(cmd, timeout=timeout)
        return SimpleNamespace(returncode=1, stdout="", stderr="x.cpp:1: fatal error: error closing ccX.s: "
                               "No space left on device\ncompilation terminated.\n")
    monkeypatch.setattr(toolchain, "run", full)
    monkeypatch.setattr(toolchain, "_PROBES", {})
    tc = toolchain.Toolchain("c++", ["-O2"], tmp_path)
    assert tc.cxx is None and "cannot compile kernels" in tc.why and "No space left on device" in tc.why
    assert "set TMPDIR" in tc.why and "install g++" not in tc.why


def test_cxx_from_the_environment_is_the_compiler_or_is_said_to_be_ignored(tmp_path, monkeypatch, caplog):
    """CXX=/nonexistent was silently ignored (trial AA); a CXX that names a compiler is used."""
    import shutil

    import graphmode.backends.cpu.toolchain as toolchain
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    with caplog.at_level(logging.WARNING, logger="graphmode.backends.cpu"):
        tc = toolchain.Toolchain(None, ["-O2"], tmp_path)
    assert tc.requested is None and any("CXX='/nonexistent/c++' names no executable" in r.message
                                         for r in caplog.records)
    found = shutil.which("g++") or shutil.which("c++")
    if found:
        monkeypatch.setenv("CXX", found)
        assert toolchain.Toolchain(None, ["-O2"], tmp_path).requested == found
