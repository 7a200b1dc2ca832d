"""Weight-only quantized linear (`qlinear`, backends/cpu/wgemm.py): the generated kernel reads
int8 / bf16 weights as stored and matches the op's reference (dequantize, then an f32 linear)
to fp32 rounding, over the shapes where its tiling has edges: one row (decode), rows and
columns that leave partial tiles, K shorter than a vector and with a tail, the threaded split,
with and without bias, on both paths (dot products below PANEL_ROWS rows, widened panels
through the f32 micro-kernels from there). Other ISA paths run in test_isa_paths.py. No timing assertions."""
from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch

from graphmode.backends.cpu.build import KernelBuilder
from graphmode.backends.cpu.catalog import claim_native, native_source
from graphmode.backends.cpu.kernels import run_with_tensors
from graphmode.backends.cpu.lowering import OpCall
from graphmode.backends.cpu.wgemm import PANEL_ROWS
from graphmode.ir.ops import get_op
from graphmode.passes.quantize_weights import quantize
from graphmode.verify.numerics import rel_l2

_PROBE = KernelBuilder(Path(tempfile.gettempdir()) / "graphmode-test-probe")
needs_cxx = pytest.mark.skipif(not _PROBE.compiler_available(), reason="no C++ compiler on this machine")

G = torch.Generator().manual_seed(0)

# (leading dims of x, N, K, bias, stored dtype)
SHAPES = {
    "decode_row": ((1,), 96, 64, True, "int8"),
    "decode_row_bf16": ((1, 1), 50, 40, False, "bf16"),
    "partial_tiles": ((7,), 13, 33, True, "int8"),
    "k_below_a_vector": ((3,), 9, 5, True, "bf16"),
    "batched_3d": ((2, 5), 21, 70, False, "int8"),
    "threaded_prefill": ((40,), 300, 200, True, "int8"),
    "threaded_bf16": ((33,), 129, 160, True, "bf16"),
    "threaded_panels_whole_blocks": ((64,), 64, 48, False, "int8"),
    "dot_below_the_panel_rows": ((31,), 40, 24, True, "int8"),
}


def _case(lead, n, k, bias, dt):
    x = torch.randn(*lead, k, generator=G)
    w, scale = quantize(torch.randn(n, k, generator=G), dt)
    ins = [x, w, scale] + ([torch.randn(n, generator=G)] if bias else [])
    return ins, get_op("qlinear").ref(ins, {}, {})[0]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    if not _PROBE.compiler_available():
        pytest.skip("no C++ compiler")
    cases, sources = {}, []
    for name, shape in SHAPES.items():
        ins, want = _case(*shape)
        src = native_source("qlinear", ins, [torch.empty_like(want)], {}, {}, [f"{name}_{i}" for i in range(len(ins))],
                            [f"{name}_y"])
        assert src is not None, name
        cases[name] = (ins, want, src)
        sources.append(src)
    builder = KernelBuilder(tmp_path_factory.mktemp("wgemm"), threads=2)
    return cases, builder.build_many(sources)


@needs_cxx
@pytest.mark.parametrize("name", list(SHAPES))
def test_kernel_matches_the_reference(built, name):
    cases, kernels = built
    ins, want, src = cases[name]
    got = run_with_tensors(kernels[src.symbol], dict(zip(src.inputs, ins)), source=src)[src.outputs[0]]
    assert got.shape == want.shape and rel_l2(got, want) < 1e-6, (name, rel_l2(got, want))
    assert ("omp parallel" in src.source) == name.startswith("threaded"), name
    rows = shape_rows(SHAPES[name][0])
    assert ("(panels)" in src.pattern) == (rows >= PANEL_ROWS), name


def shape_rows(lead) -> int:
    out = 1
    for d in lead:
        out *= d
    return out


def test_quantized_weights_are_what_the_reference_reads():
    """int8: symmetric per output row, within half a step of the f32 weight, an all-zero row
    stays zero; bf16: round to nearest, unit scale."""
    w = torch.randn(5, 33, generator=G)
    w[2] = 0.0
    q, scale = quantize(w, "int8")
    assert q.dtype == torch.int8 and scale.shape == (5,) and int(q.abs().max()) == 127
    deq = q.float() * scale[:, None]
    assert torch.all((deq - w).abs() <= scale[:, None] / 2 + 1e-7)
    assert torch.equal(q[2], torch.zeros(33, dtype=torch.int8)) and scale[2] == 1.0
    b, ones = quantize(w, "bf16")
    assert b.dtype == torch.bfloat16 and torch.equal(ones, torch.ones(5)) and torch.equal(b, w.bfloat16())


def test_lowering_refuses_what_it_does_not_cover():
    x, w, s = torch.randn(2, 8), torch.randn(4, 8), torch.ones(4)
    y = torch.empty(2, 4)
    for ins, why in [([x, w.half(), s], "int8 or bf16"), ([x.double(), w.to(torch.int8), s], "input"),
                     ([x, w.to(torch.int8), torch.ones(3)], "scale and bias")]:
        _low, c = claim_native(OpCall("qlinear", ins, [y], {}, {}, ["x", "w", "s"], ["y"]))
        assert not c and why in c.why, (c.why, why)
