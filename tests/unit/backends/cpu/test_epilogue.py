"""Epilogues fused into the store of generated GEMMs and convolutions (backends/cpu/epilogue.py).

Which groups qualify (operand broadcast kinds, a kept GEMM result, non-f32), GEMM kernels
with an epilogue against torch for several blockings (one K block and several, with C
aliasing the residual), and the executor path: a plan whose linear+GELU, linear+residual
and conv+add+ReLU groups run as one kernel each and match eager. No timing assertions.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch

import graphmode
from graphmode.backends.cpu.build import KernelBuilder
from graphmode.backends.cpu.epilogue import tile_epilogue
from graphmode.backends.cpu.gemm import GemmConfig, GemmProblem, generate_gemm, pack_b
from graphmode.backends.cpu.groups import specialize
from graphmode.errors import BackendError
from graphmode.recipe import load_recipe
from graphmode.verify.numerics import rel_l2

_PROBE = KernelBuilder(Path(tempfile.gettempdir()) / "graphmode-test-probe")
needs_cxx = pytest.mark.skipif(not _PROBE.compiler_available(), reason="no C++ compiler on this machine")


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = torch.nn.Linear(48, 130)
        self.l2 = torch.nn.Linear(130, 48)
        self.l3 = torch.nn.Linear(48, 48)
        self.scale = torch.nn.Parameter(torch.randn(48))

    def forward(self, x):
        h = torch.nn.functional.gelu(self.l1(x))          # epilogue: gelu
        y = self.l2(h) + x                                 # epilogue: residual add (full)
        return torch.tanh(self.l3(y)) * self.scale + y     # tanh, per-column mul, add


def _recipe(name, shape, dims):
    return load_recipe({"version": 1, "name": name, "exe_mode": "graph", "targets": ["host"],
                        "inputs": [{"name": "x", "dtype": "f32", "shape": shape}], "dims": dims})


@pytest.fixture(scope="module")
def block(tmp_path_factory):
    torch.manual_seed(0)
    m = _Block().eval()
    cm = graphmode.compile(m, _recipe("epi", ["batch", "seq", 48], {"batch": {"buckets": [2]},
                                                                      "seq": {"buckets": [3, 37]}}),
                           cache_dir=tmp_path_factory.mktemp("epi"), threads=2)
    return m, cm


def _groups(cm, env):
    return [specialize(n, env) for n in cm.graph.nodes if n.op == "fused" and n.attrs.get("kind") == "gemm_epilogue"]


def test_epilogue_kinds(block):
    _, cm = block
    env = {"batch": 2, "seq": 3}
    epis = [tile_epilogue(n, {}) for n in _groups(cm, env)]
    assert len(epis) == 3 and all(e is not None for e in epis)
    kinds = sorted(e.kinds for e in epis)
    assert kinds == [(), ("full",), ("last", "full")] or kinds == [(), ("full",), ("full", "last")], kinds
    gelu = next(e for e in epis if not e.kinds)
    assert gelu.text == "gelu" and any("gm_erff" in s for s in gelu.stmts) and gelu.stmts[-1].startswith("const float res")
    assert len({e.digest for e in epis}) == 3
    acc = torch.randn(2, 3, 130)
    assert torch.allclose(gelu.reference(acc, []), torch.nn.functional.gelu(acc))


@needs_cxx
@pytest.mark.parametrize("cfg", [GemmConfig("avx512", 8, 32), GemmConfig("avx512", 6, 48, 16),
                                 GemmConfig("avx2", 6, 16, 7, 12), GemmConfig("portable", 4, 16, 0, 0, par="serial")],
                         ids=lambda c: c.name)
def test_gemm_kernels_apply_the_epilogue(block, cfg, tmp_path):
    _, cm = block
    env = {"batch": 2, "seq": 37}
    builder = KernelBuilder(tmp_path / "k", threads=2)
    g = torch.Generator().manual_seed(2)
    for node in _groups(cm, env):
        epi = tile_epilogue(node, {})
        gemm = node.body.nodes[0]
        w = cm.graph.constants[gemm.inputs[1]]
        bias = cm.graph.constants[gemm.inputs[2]]
        n, k = w.shape
        m = 2 * 37
        a = torch.randn(m, k, generator=g)
        ops = [torch.randn(*(m, n) if kd == "full" else (n,), generator=g) for kd in epi.kinds]
        acc = torch.addmm(bias, a, w.t())
        shape = (2, 37, n)
        ref = epi.reference(acc.view(shape), [o.view(shape) if o.dim() == 2 else o for o in ops]).reshape(m, n)
        for alias in ([False, True] if "full" in epi.kinds else [False]):
            p = GemmProblem("linear", 1, m, n, k, bias=True, epi=epi, c_aliases_operand=alias)
            if alias and cfg.kc and cfg.kc < k:
                with pytest.raises(BackendError, match="aliases"):
                    generate_gemm(p, cfg, threads=2)
                continue
            src = generate_gemm(p, cfg, threads=2)
            kern = builder.build_many([src])[src.symbol]
            full = [i for i, kd in enumerate(epi.kinds) if kd == "full"]
            c = ops[full[0]].clone() if alias else torch.full((m, n), float("nan"))
            args = [a, pack_b(w, cfg.nr, transposed=True), bias] + [c if alias and i == full[0] else o
                                                                   for i, o in enumerate(ops)] + [c]
            kern([t.data_ptr() for t in args])
            assert rel_l2(c, ref) < 1e-5, (p.text, cfg.name, alias)


@needs_cxx
def test_executor_fuses_epilogues_and_matches_eager(block):
    m, cm = block
    for seq in (3, 37):
        x = torch.randn(2, seq, 48)
        with torch.inference_mode():
            ref = m(x)
        assert rel_l2(cm(x), ref) < 1e-5
        exe = cm.executable({"batch": 2, "seq": seq})
        assert exe.kernel_report.get("fused_epilogues") == 3, exe.kernel_report
        gemms = exe.tactics_report["gemms"]
        assert {g["gemm"].split(" f32")[0].split("+", 1)[1] for g in gemms} == {"bias+gelu", "bias+add",
                                                                                  "bias+tanh+mul+add"}


class _Res(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = torch.nn.Conv2d(8, 8, 3, padding=1)
        self.c2 = torch.nn.Conv2d(8, 8, 3, padding=1)
        self.down = torch.nn.Conv2d(8, 16, 1, stride=2)

    def forward(self, x):
        h = torch.relu(self.c1(x))
        h = torch.relu(self.c2(h) + x)
        return self.down(h) * 0.5


@needs_cxx
def test_conv_epilogues_fused_and_match_eager(tmp_path):
    torch.manual_seed(1)
    m = _Res().eval()
    cm = graphmode.compile(m, _recipe("res", ["batch", 8, 11, 13], {"batch": {"buckets": [1, 2]}}),
                           cache_dir=tmp_path, threads=2)
    for batch in (1, 2):
        x = torch.randn(batch, 8, 11, 13)
        with torch.inference_mode():
            ref = m(x)
        assert rel_l2(cm(x), ref) < 1e-5
        exe = cm.executable({"batch": batch})
        texts = [g["gemm"] for g in exe.tactics_report["gemms"]]
        assert any("+bias+relu" in t for t in texts) and any("+bias+add+relu" in t for t in texts), texts
        assert exe.kernel_report.get("fused_epilogues", 0) >= 2


class _NewGelu(torch.nn.Module):
    """GPT-2's MLP activation: its scalars are graph constants, which must become literals
    (a runtime `powf(x, c)` would keep the tile loop scalar)."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(32, 96)

    def forward(self, x):
        h = self.fc(x)
        return 0.5 * h * (1.0 + torch.tanh(0.7978845608028654 * (h + 0.044715 * torch.pow(h, 3.0))))


@needs_cxx
def test_scalar_constants_are_inlined(tmp_path):
    torch.manual_seed(3)
    m = _NewGelu().eval()
    cm = graphmode.compile(m, _recipe("newgelu", ["batch", 32], {"batch": {"buckets": [8]}}), cache_dir=tmp_path,
                           threads=2)
    (node,) = _groups(cm, {"batch": 8})
    epi = tile_epilogue(node, {}, constants=cm.graph.constants)
    assert epi is not None and epi.kinds == () and not any("powf" in s for s in epi.stmts), epi.stmts
    x = torch.randn(8, 32)
    with torch.inference_mode():
        assert rel_l2(cm(x), m(x)) < 1e-5
    exe = cm.executable({"batch": 8})
    assert exe.kernel_report.get("fused_epilogues") == 1
    (g,) = exe.tactics_report["gemms"]
    assert g["shape"]["epilogue_kinds"] == [] and g["shape"]["epilogue"] == epi.digest   # the plan inlined them too


class _Conv1dGelu(torch.nn.Module):
    """Whisper's stem: Conv1d arrives as a 1xW conv2d and a reshape dropping the unit dim."""

    def __init__(self):
        super().__init__()
        self.c1 = torch.nn.Conv1d(16, 32, 3, padding=1)
        self.c2 = torch.nn.Conv1d(32, 32, 3, stride=2, padding=1)

    def forward(self, x):
        return torch.nn.functional.gelu(self.c2(torch.nn.functional.gelu(self.c1(x))))


@needs_cxx
def test_a_conv1d_epilogue_reads_its_conv_through_the_reshape(tmp_path):
    """The reshape between the conv and its GELU sent the whole group, conv included, to the
    reference interpreter ("op 'reshape' is not supported"): 10x ONNX Runtime's time."""
    torch.manual_seed(4)
    m = _Conv1dGelu().eval()
    cm = graphmode.compile(m, _recipe("conv1d", ["batch", 16, 32], {"batch": {"buckets": [3]}}), cache_dir=tmp_path,
                           threads=2)
    assert all("reshape" in n.attrs["pattern"] for n in cm.graph.nodes if n.op == "fused")
    x = torch.randn(3, 16, 32)
    with torch.inference_mode():
        assert rel_l2(cm(x), m(x)) < 1e-5
    exe = cm.executable({"batch": 3})
    assert exe.kernel_report["generated"] == 2 and not exe.kernel_report["fallbacks"], exe.kernel_report
    assert [g["shape"]["op"] for g in exe.tactics_report["gemms"]] == ["conv2d", "conv2d"]
