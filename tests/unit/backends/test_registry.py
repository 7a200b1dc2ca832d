"""Backends by name: the registry, capabilities as data, the reference backend as the numeric
oracle, the null backend planning and generating without running, and the runtime reaching
whichever backend a model names through the registry only."""
from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch

import graphmode
from graphmode.backends import Backend, Capabilities, Executable, backends, get_backend, register
from graphmode.backends.cpu.build import KernelBuilder
from graphmode.backends.reference import ReferenceBackend
from graphmode.errors import BackendError
from graphmode.recipe import load_recipe
from graphmode.runtime.build import attach_bodies, build_plan
from graphmode.verify.numerics import rel_l2

needs_cxx = pytest.mark.skipif(not KernelBuilder(Path(tempfile.gettempdir()) / "graphmode-test-probe")
                               .compiler_available(), reason="no C++ compiler on this machine")


class _Block(torch.nn.Module):
    """A GEMM with a fused epilogue, a row kernel (layer_norm) and a native op (permute)."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(16, 24)
        self.norm = torch.nn.LayerNorm(24)

    def forward(self, x):
        h = self.norm(torch.nn.functional.gelu(self.fc(x)))
        return h.permute(1, 0, 2).contiguous() * 2.0


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    torch.manual_seed(0)
    m = _Block().eval()
    rec = load_recipe({"version": 1, "name": "backends", "exe_mode": "graph", "targets": ["host"],
                       "inputs": [{"name": "x", "dtype": "f32", "shape": ["batch", 5, 16]}],
                       "dims": {"batch": {"buckets": [3]}}, "codegen": {"kernel_selection": "heuristic"}})
    return m, graphmode.compile(m, rec, cache_dir=tmp_path_factory.mktemp("cache"), threads=2)


def _plan(cm):
    return attach_bodies(build_plan(cm.graph, cm.recipe, {"batch": 3}), cm.graph)


def test_builtins_and_capabilities_are_data():
    got = backends()
    assert {"cpu", "reference", "null"} <= set(got)
    for name, b in got.items():
        assert isinstance(b, Backend) and b.name == name and isinstance(b.capabilities, Capabilities)
    cpu, ref, null = got["cpu"].capabilities, got["reference"].capabilities, got["null"].capabilities
    assert cpu.executes and cpu.generates_kernels and "latency_first" in cpu.kernel_selection and not cpu.oracle
    assert ref.oracle and ref.executes and not ref.generates_kernels and ref.kernel_selection == ()
    assert not null.executes and null.generates_kernels and null.device == "none"


def test_unknown_backend_names_the_candidates():
    with pytest.raises(BackendError) as e:
        get_backend("tpu")
    assert "'tpu'" in str(e.value) and "cpu, null, reference" in str(e.value)


def test_reference_backend_is_the_oracle(model):
    m, cm = model
    exe = get_backend("reference").executable(_plan(cm), cm.graph.constants)
    assert isinstance(exe, Executable) and exe.generated == 0
    assert exe.step_names and all(n.startswith("ref:") for n in exe.step_names)
    x = torch.randn(3, 5, 16)
    with torch.inference_mode():
        want = m(x)
    got = exe.run({"x": x})[exe.plan.outputs[0]]
    assert rel_l2(got, want) < 1e-6


def test_null_backend_plans_and_generates_but_runs_nothing(model):
    _m, cm = model
    exe = get_backend("null").executable(_plan(cm), cm.graph.constants)
    kinds = {n.split(":")[0] for n in exe.step_names}
    assert exe.sources and exe.generated == len(exe.sources) and {"kernel", "native"} <= kinds
    for ks in exe.sources.values():      # every kernel is whole C++ with the ABI's two exports
        assert f"GM_EXPORT void {ks.symbol}(" in ks.source and f"{ks.packed_symbol}(void** p)" in ks.source
    assert exe.kernel_report["fallbacks"] == {}
    with pytest.raises(BackendError, match="runs nothing"):
        exe.run({"x": torch.randn(3, 5, 16)})


@needs_cxx
def test_cpu_backend_compiles_what_the_null_backend_generates(model, tmp_path):
    _m, cm = model
    plan = _plan(cm)
    null = get_backend("null").executable(plan, cm.graph.constants)
    cpu = get_backend("cpu").executable(plan, cm.graph.constants, kernel_dir=tmp_path / "kernels", threads=2,
                                        kernel_selection=False)
    rep = cpu.kernel_report
    assert rep["generated"] + rep.get("native", 0) == len(null.sources) == cpu.generated
    assert cpu.step_names == null.step_names


class _Recording:
    """A backend of its own: the reference backend's executables, counted."""

    name = "recording"
    capabilities = Capabilities(device="cpu", executes=True, generates_kernels=False, oracle=True)

    def __init__(self):
        self.built: list[dict] = []

    def executable(self, plan, constants, *, kernel_dir=None, threads=None, kernel_selection=None):
        self.built.append(dict(plan.env))
        return ReferenceBackend().executable(plan, constants)


def test_runtime_builds_executables_through_the_registry(model):
    m, cm = model
    rec = _Recording()
    register(rec)
    x = torch.randn(3, 5, 16)
    with torch.inference_mode():
        want = m(x)
    try:
        cm.device, cm._executables = "recording", {}
        assert rel_l2(cm(x), want) < 1e-6
        assert rec.built == [{"batch": 3}]
        assert all(n.startswith("ref:") for n in cm.executable({"batch": 3}).step_names)
        cm.device, cm._executables = "no-such-device", {}
        with pytest.raises(BackendError, match="no backend 'no-such-device'"):
            cm(x)
    finally:
        cm.device, cm._executables = "cpu", {}
