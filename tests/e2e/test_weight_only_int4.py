"""int4 weights end to end (recipe `precision.weights: int4`): the tiny GPT-2 of tiny_decoders.py
compiled with symmetric group-32 int4 linears runs them as int4 qlinear kernels, equals its own
IR (the reference ops over the same packed weights) to f32 rounding, stores about a sixth of
the f32 linear bytes, holds the weight-only contract against the f32 model (no confident
top-1 flip), and decodes greedy tokens its own full-sequence logits pick. A compiled MLP with
asymmetric int4 weights survives a `.gm` save and load. No timing assertions."""
from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch

import graphmode
from graphmode.ir.interpreter import interpret
from graphmode.verify.numerics import WEIGHT_ONLY, rel_l2, top1_agreement

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import tiny_decoders  # noqa: E402


def _logits(out):
    return out if isinstance(out, torch.Tensor) else out.logits if hasattr(out, "logits") else out[0]


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    from graphmode.capture.spec import bundle_from_module
    lm, ex, dims = tiny_decoders.gpt2()
    bundle = bundle_from_module(lm, ex, dims, name="tiny-gpt2")
    rec = tiny_decoders.recipe("tiny-int4", precision={"compute": "f32", "weights": "int4", "group_size": 32})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return lm, graphmode.compile(bundle, rec, cache_dir=tmp_path_factory.mktemp("int4"))


def _ids():
    g = torch.Generator().manual_seed(1)
    return torch.randint(3, tiny_decoders.VOCAB, (4, 32), generator=g)


def test_linears_are_int4_and_a_sixth_of_the_bytes(gpt2):
    _lm, cm = gpt2
    g = cm.graph
    q = [n for n in g.nodes if n.op == "qlinear"]
    assert len(q) == 9 and "linear" not in g.op_counts()
    stored = f32 = 0
    for n in q:
        w, s = g.constants[n.inputs[1]], g.constants[n.inputs[2]]
        assert w.dtype == torch.uint8 and s.shape == (w.shape[0], 2 * w.shape[1] // 32)
        stored += w.numel() + s.numel() * 4
        f32 += w.numel() * 2 * 4
    assert stored / f32 == pytest.approx((0.5 + 4 / 32) / 4)          # 4 bits + an f32 scale per 32 weights


def test_compiled_equals_its_ir_over_the_packed_weights(gpt2):
    """The kernels are exact: the compiled model equals the IR's reference ops (dequantize,
    then an f32 linear) over the same packed weights to the f32 tolerance."""
    _lm, cm = gpt2
    ids = _ids()
    feeds = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    with torch.inference_mode():
        got = _logits(cm(**feeds))
    want = next(iter(interpret(cm.graph, feeds).values()))
    assert rel_l2(got, want) < 1e-5


def test_logits_hold_the_weight_only_contract(gpt2):
    lm, cm = gpt2
    ids = _ids()
    with torch.inference_mode():
        got = _logits(cm(input_ids=ids, attention_mask=torch.ones_like(ids)))
        want = lm(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    err, top1 = rel_l2(got, want), top1_agreement(got, want)
    assert 1e-2 < err < WEIGHT_ONLY["int4"], err
    assert top1.positions == 128 and top1.flips == 0 and top1.share >= 0.6, top1


@pytest.mark.slow     # a decode engine of its own: the kernel and contract tests stay in the default run
def test_greedy_decoding_picks_its_own_arg_max(gpt2):
    """Decode (the paged graph, int4 too) takes each token its full-sequence logits rank first."""
    _lm, cm = gpt2
    prompts = torch.tensor([[5, 6, 7, 8, 9, 10], [40, 41, 42, 43, 44, 45]])
    out = cm.generate(prompts, max_new_tokens=8)
    with torch.inference_mode():
        logits = _logits(cm(input_ids=out[:, :-1], attention_mask=torch.ones_like(out[:, :-1])))
    assert torch.equal(logits[:, 5:].argmax(-1), out[:, 6:])


@pytest.mark.slow     # a compile and a .gm round trip; the symmetric path is checked by default
def test_asymmetric_int4_survives_save_and_load(tmp_path):
    """Linear(64, 64) packs (groups of 32); Linear(16, 64) stays f32 (16 is no multiple of 32)."""
    from graphmode.capture.spec import bundle_from_module
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64)).eval()
    x = torch.randn(4, 16)
    rec = {"version": 1, "name": "mlp-int4", "inputs": [{"name": "input", "dtype": "f32", "shape": ["batch", 16]}],
           "dims": {"batch": {"buckets": [4]}}, "codegen": {"kernel_selection": "heuristic"},
           "precision": {"weights": "int4", "group_size": 32, "int4_scheme": "asymmetric"}}
    cm = graphmode.compile(bundle_from_module(model, (x,)), rec, cache_dir=tmp_path / "c")
    assert cm.graph.op_counts().get("qlinear") == 1 and cm.graph.constants["model.0.weight"].dtype == torch.float32
    with torch.inference_mode():
        want = model(x)
        got = _logits(cm(x))
    assert rel_l2(got, want) < WEIGHT_ONLY["int4"]
    cm.save(tmp_path / "m.gm")
    loaded = graphmode.load(tmp_path / "m.gm", cache_dir=tmp_path / "fresh")
    with torch.inference_mode():
        assert torch.equal(_logits(loaded(x)), got)


@pytest.mark.slow
def test_verify_holds_int4_to_the_top1_contract(tmp_path):
    """`graphmode verify` on an int4 recipe: the int4 error bound, top-1 judged, no confident flip."""
    import json

    import yaml
    from typer.testing import CliRunner

    from graphmode.cli.app import _register, app
    _register()
    rec = tmp_path / "int4.yaml"
    rec.write_text(yaml.safe_dump(tiny_decoders.recipe("tiny-int4", precision={"weights": "int4"})))
    res = CliRunner().invoke(app, ["verify", "--model", f"{HERE / 'tiny_decoders.py'}:gpt2", "--recipe", str(rec),
                                   "--max-buckets", "2", "--json", "--cache-dir", str(tmp_path / "c")])
    assert res.exit_code == 0, res.output
    d = json.loads(res.output[res.output.index("{"):])
    assert d["ok"] and d["cases"]
    for case in d["cases"]:
        (o,) = case["outputs"]
        assert o["tolerance"] == WEIGHT_ONLY["int4"] and o["rel_l2"] > 1e-2
        assert o["top1"]["judged"] and o["top1"]["confident_flips"] == 0


@pytest.mark.slow     # a compile of its own; the q8 kernels and reference run in the default unit tests
def test_q8_activations_hold_the_contract_and_decode(tmp_path):
    """`int4_activations: q8`: every qlinear carries act q8, the compiled model equals its IR
    (int4.q8_linear over the same codes) to f32 rounding, holds the weight-only contract
    against the f32 model, and its decode engine takes the tokens its logits rank first."""
    from graphmode.capture.spec import bundle_from_module
    lm, ex, dims = tiny_decoders.gpt2()
    rec = tiny_decoders.recipe("tiny-int4-q8", precision={"compute": "f32", "weights": "int4",
                                                          "int4_activations": "q8"})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cm = graphmode.compile(bundle_from_module(lm, ex, dims, name="tiny-gpt2"), rec, cache_dir=tmp_path / "c")
    q = [n for n in cm.graph.nodes if n.op == "qlinear"]
    assert len(q) == 9 and all(n.attrs.get("act") == "q8" for n in q)
    ids = _ids()
    feeds = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    with torch.inference_mode():
        got = _logits(cm(**feeds))
        want = lm(**feeds).logits
    assert rel_l2(got, next(iter(interpret(cm.graph, feeds).values()))) < 1e-5
    err, top1 = rel_l2(got, want), top1_agreement(got, want)
    assert 1e-2 < err < WEIGHT_ONLY["int4"], err
    assert top1.positions == 128 and top1.flips == 0 and top1.share >= 0.6, top1
    prompts = torch.tensor([[5, 6, 7, 8, 9, 10], [40, 41, 42, 43, 44, 45]])
    out = cm.generate(prompts, max_new_tokens=8)
    with torch.inference_mode():
        logits = _logits(cm(input_ids=out[:, :-1], attention_mask=torch.ones_like(out[:, :-1])))
    assert torch.equal(logits[:, 5:].argmax(-1), out[:, 6:])
