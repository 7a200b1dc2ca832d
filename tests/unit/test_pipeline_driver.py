"""The one pipeline driver: `lower_model` returns a `Lowered` (graph, verdict, proof, facts,
stage timings) that the compiled model keeps, so the server reads the proof instead of
proving again; a report reads how far a refused model got."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import graphmode.recipe as recipe_pkg
from graphmode.compiler import lower_model
from graphmode.recipe import load_recipe

RECIPE = {"version": 1, "name": "mlp-driver", "inputs": [{"name": "input", "dtype": "f32", "shape": ["batch", 16]}],
          "dims": {"batch": {"buckets": [1, 2]}}, "codegen": {"kernel_selection": "heuristic"}}


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4)).eval(), (torch.randn(2, 16),)


@pytest.fixture
def proofs(monkeypatch):
    """Counts the recipe proofs run (every prover imports `validate` from graphmode.recipe)."""
    calls = []
    real = recipe_pkg.validate

    def counted(*a, **k):
        calls.append(a[0].name)
        return real(*a, **k)

    monkeypatch.setattr(recipe_pkg, "validate", counted)
    return calls


def test_compiled_model_keeps_the_drivers_result(tmp_path, proofs):
    import graphmode
    cm = graphmode.compile(_mlp(), load_recipe(RECIPE), cache_dir=tmp_path)
    low = cm.lowered
    assert low is not None and cm.proof is low.proof and low.proof.ok
    assert low.graph is cm.graph and low.verdict is cm.verdict
    assert low.facts.weights_bytes == (16 * 8 + 8 + 8 * 4 + 4) * 4
    assert set(low.timings) == {"capture", "passes", "proof"} and all(s >= 0 for s in low.timings.values())
    assert proofs == ["mlp-driver"]                        # proved once, by the driver
    x = torch.randn(2, 16)
    torch.testing.assert_close(cm(x), _mlp()[0](x), rtol=1e-5, atol=1e-6)


def test_without_the_proof_the_driver_stops_after_the_graphs_facts():
    low = lower_model(_mlp(), load_recipe(RECIPE), prove_graph=False)
    assert low.graph is not None and low.proof is None and low.facts.weights_bytes > 0
    assert "proof" not in low.timings


def test_the_server_reads_the_proof_instead_of_proving_again(tmp_path, proofs):
    from graphmode.serve.server import ModelServer, ServeConfig
    srv = ModelServer(_mlp(), RECIPE, config=ServeConfig(cache_dir=tmp_path, target="host"))
    before = len(proofs)
    dep = srv._build(srv.recipe, "initial")
    assert proofs[before:] == ["mlp-driver"]               # the driver's proof, read by the server
    assert dep.cm.proof.ok and dep.facts is dep.cm.lowered.facts
    srv.executor.shutdown(wait=False)
    srv.builder.shutdown(wait=False)
    srv.sandbox.close()


class _Rrelu(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 16)

    def forward(self, x):
        return nn.functional.rrelu(self.lin(x), training=False)   # aten.rrelu has no lowering: a graph break


def test_a_refused_verdict_is_reported_without_passes_or_proof():
    from graphmode.compile_report import report_of
    from graphmode.errors import GraphmodeError
    r = load_recipe(dict(RECIPE, exe_mode="graph", inputs=[{"name": "x", "dtype": "f32", "shape": ["batch", 8]}]))
    model = (_Rrelu().eval(), (torch.randn(2, 8),))
    with pytest.raises(GraphmodeError):
        lower_model(model, r)                              # refused at the verdict by default
    low = lower_model(model, r, refuse=False)
    assert not low.verdict.ok and low.graph is None and low.proof is None
    rep = report_of(low, r, "host")
    assert rep.passes is None and rep.contract is low.verdict and rep.nodes_captured == len(low.captured.nodes)


def test_no_module_outside_the_driver_reruns_its_stages():
    """capture -> verdict -> passes -> proof run in compiler.lower_model (or capture_model +
    relower); the entry points above it (CLI commands, the server, the decode engine, the
    drafter, tune) call the driver, not its stages."""
    root = Path(__file__).resolve().parents[2] / "graphmode"
    stage_call = re.compile(r"(?<![\w.])(checked_capture|capture|optimize|prove)\(")
    offenders = []
    for sub in ("cli", "serve", "decode", "runtime", "kb", "tune"):
        for p in (root / sub).rglob("*.py"):
            offenders += [f"{p.relative_to(root)}: {m.group(0)}" for m in stage_call.finditer(p.read_text())]
    assert not offenders, offenders


def test_relower_runs_the_rest_of_the_pipeline_for_another_recipe(proofs):
    """tune and the drafter capture once and relower per recipe: the same graph and proof as
    lowering from scratch, without capturing again."""
    from graphmode.compiler import capture_model, relower
    first = capture_model(_mlp(), load_recipe(RECIPE))
    assert first.graph is None and first.proof is None and first.verdict.ok and set(first.timings) == {"capture"}
    other = load_recipe(dict(RECIPE, name="mlp-nofuse", optimize={"fusion": {"enabled": False}}))
    low = relower(first, other)
    fresh = lower_model(_mlp(), other)
    assert low.captured is first.captured and low.recipe is other and low.proof.ok
    assert low.graph.structural_hash() == fresh.graph.structural_hash()
    assert low.graph.structural_hash() != lower_model(_mlp(), load_recipe(RECIPE)).graph.structural_hash()
    assert set(low.timings) == {"capture", "passes", "proof"}
    assert proofs == ["mlp-nofuse"] * 2 + ["mlp-driver"]


def test_reprove_proves_the_same_graph_under_a_recipe_that_lowers_alike():
    from graphmode.compiler import reprove
    from graphmode.errors import RecipeError
    low = lower_model(_mlp(), load_recipe(RECIPE), prove_graph=False)
    budget = load_recipe(dict(RECIPE, memory={"budget_mb": 64}))
    proved = reprove(low, budget)
    assert proved.graph is low.graph and proved.proof.ok and proved.recipe is budget and "proof" in proved.timings
    with pytest.raises(RecipeError, match="changes the passes"):
        reprove(low, load_recipe(dict(RECIPE, optimize={"fusion": {"enabled": False}})))


def test_the_server_takes_a_spec_returning_the_module_alone(tmp_path):
    """`graphmode serve --model file.py:fn` with fn returning the module alone and a recipe that
    declares its inputs: compile, run and generate took it; the server raised BareModuleError."""
    from graphmode.serve.server import ModelServer, ServeConfig
    spec = tmp_path / "bare_mlp.py"
    spec.write_text("import torch\n\ndef mlp():\n    torch.manual_seed(0)\n"
                    "    return torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))\n")
    srv = ModelServer(f"{spec}:mlp", RECIPE, config=ServeConfig(cache_dir=tmp_path, target="host"))
    try:
        dep = srv._build(srv.recipe, "initial")
        x = torch.randn(2, 16)
        torch.testing.assert_close(dep.cm(x), _mlp()[0](x), rtol=1e-5, atol=1e-6)
    finally:
        srv.executor.shutdown(wait=False)
        srv.builder.shutdown(wait=False)
        srv.sandbox.close()
