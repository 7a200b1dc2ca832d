"""IR core: text/JSON round trips, stable hashing, verifier, interpreter vs eager, op docs."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from graphmode.errors import ContractViolation, IRError
from graphmode.ir import (Graph, TensorType, graph_from_json, graph_to_json, interpret, load_graph, parse_graph,
                          save_graph, verify_graph)
from graphmode.ir.graph import Node
from graphmode.verify.numerics import rel_l2

ROOT = Path(__file__).resolve().parents[3]


def small_graph() -> Graph:
    torch.manual_seed(0)
    g = Graph("small", dims={"batch": (1, 8), "seq": (2, 64)})
    g.add_input("x", TensorType("f32", ("batch", "seq", 8)))
    g.add_input("mask", TensorType("bool", ("batch", "seq")))
    g.add_constant("w", torch.randn(4, 8))
    g.add_constant("b", torch.randn(4))
    g.add_constant("half", torch.tensor(0.5), role="const")
    y, = g.add_node("linear", ["x", "w", "b"], [TensorType("f32", ("batch", "seq", 4))])
    z, = g.add_node("gelu", [y], [TensorType("f32", ("batch", "seq", 4))], {"approximate": "tanh"})
    s, = g.add_node("mul", [z, "half"], [TensorType("f32", ("batch", "seq", 4))])
    r, = g.add_node("reshape", [s], [TensorType("f32", ("batch*seq", 4))], {"shape": [-1, 4]})
    m, = g.add_node("reshape", ["mask"], [TensorType("bool", ("batch*seq", 1))], {"shape": ["batch*seq", 1]})
    out, = g.add_node("where", [m, r, "half"], [TensorType("f32", ("batch*seq", 4))])
    g.outputs = [out]
    return g


def test_text_round_trip_is_identical():
    g = small_graph()
    verify_graph(g)
    text = g.text()
    g2 = parse_graph(text, g.constants)
    assert g2.text() == text
    assert g2.equals(g)
    assert g2.structural_hash() == g.structural_hash()


def test_graph_name_is_a_label_not_structure():
    """The CLI names a model after its builder (m.py:build_mlp -> mlp... or build), Python after
    its class: the same model must hash alike so a cache warmed from one serves the other."""
    g = small_graph()
    renamed = g.clone()
    renamed.name = "another_name"
    assert renamed.structural_hash() == g.structural_hash()
    assert renamed.structural_hash(named=True) != g.structural_hash(named=True)
    assert "graph @another_name(" in renamed.text()


def test_run_time_state_parses_without_its_bytes_as_zeros_and_other_constants_do_not():
    """A decoder's KV pool is run-time state: a .gm stores its type only (runtime/artifact.py)."""
    g = small_graph()
    g.add_constant("pool", torch.randn(3, 2, 4).to(torch.bfloat16), role="state")
    text = g.text()
    g2 = parse_graph(text, {k: v for k, v in g.constants.items() if k != "pool"})
    pool = g2.constants["pool"]
    assert pool.shape == (3, 2, 4) and pool.dtype == torch.bfloat16 and not pool.any()
    assert g2.structural_hash() == g.structural_hash()        # state bytes are not in the hash
    with pytest.raises(IRError, match="has no data"):
        parse_graph(text, {k: v for k, v in g.constants.items() if k != "w"})


def test_text_form_is_readable_and_typed():
    text = small_graph().text()
    assert "graph @small(%x: f32[batch,seq,8], %mask: bool[batch,seq]) -> (%where) {" in text
    assert '%gelu: f32[batch,seq,4] = gelu(%linear) {"approximate": "tanh"}' in text
    assert "%reshape: f32[batch*seq,4] = reshape(%mul)" in text
    assert "const %half: f32[] = 0.5" in text


def test_json_and_file_round_trip(tmp_path):
    g = small_graph()
    g2 = graph_from_json(graph_to_json(g), g.constants)
    assert g2.equals(g)
    save_graph(g, tmp_path / "g")
    assert load_graph(tmp_path / "g").equals(g)


def test_corrupt_constant_file_is_detected(tmp_path):
    g = small_graph()
    g.add_constant("big", torch.randn(64))
    save_graph(g, tmp_path / "g")
    other = Graph("o")
    other.add_constant("big", torch.zeros(64))
    from safetensors.torch import save_file
    save_file({"big": torch.zeros(64), "w": g.constants["w"]}, str(tmp_path / "g.safetensors"))
    with pytest.raises(IRError, match="digest"):
        load_graph(tmp_path / "g")


def test_fused_body_round_trips():
    g = small_graph()
    body = Graph("small.gelu")
    body.add_input("linear", g.type_of("linear"))
    body.add_input("half", g.type_of("half"))
    body.add_node("gelu", ["linear"], [g.type_of("gelu")], {"approximate": "tanh"}, names=["gelu"])
    body.add_node("mul", ["gelu", "half"], [g.type_of("mul")], names=["mul"])
    body.outputs = ["mul"]
    nodes = [g.nodes[0], Node("fused", ("linear", "half"), ("mul",), {"kind": "elementwise"}, body)] + g.nodes[3:]
    f = g.clone(nodes=nodes)
    del f.values["gelu"]
    verify_graph(f)
    text = f.text()
    assert '= fused(%linear, %half) {"kind": "elementwise"} {' in text
    f2 = parse_graph(text, f.constants)
    assert f2.text() == text
    x = {"x": torch.randn(2, 5, 8), "mask": torch.rand(2, 5) > 0.5}
    assert rel_l2(interpret(f2, x)["where"], interpret(g, x)["where"]) == 0.0


def test_verifier_names_the_broken_node():
    g = small_graph()
    bad = g.clone(nodes=[g.nodes[1], g.nodes[0]] + g.nodes[2:])
    with pytest.raises(IRError, match="used before it is defined"):
        verify_graph(bad)
    g2 = small_graph()
    g2.values["gelu"] = g2.values["gelu"].__class__("gelu", TensorType("f32", ("batch", "seq", 5)))
    with pytest.raises(IRError, match=r"node #1 gelu .*declared type"):
        verify_graph(g2)
    with pytest.raises(IRError, match="unknown op"):
        verify_graph(small_graph().clone(nodes=[Node("gelux", ("x",), ("linear",))]))


def test_parser_reports_line_numbers():
    text = small_graph().text().replace("= gelu(%linear)", "= gelu(%linear) {bad json")
    with pytest.raises(IRError) as e:
        parse_graph(text, small_graph().constants)
    assert e.value.line is not None


def test_interpreter_binds_dims_and_rejects_bad_shapes():
    g = small_graph()
    out = interpret(g, {"x": torch.randn(3, 7, 8), "mask": torch.ones(3, 7, dtype=torch.bool)})
    assert out["where"].shape == (21, 4)
    with pytest.raises(ContractViolation, match="dim 'seq' is 7"):
        interpret(g, {"x": torch.randn(3, 7, 8), "mask": torch.ones(3, 6, dtype=torch.bool)})
    with pytest.raises(ContractViolation, match="missing input"):
        interpret(g, {"x": torch.randn(3, 7, 8)})


@pytest.mark.parametrize("name,shapes", [
    ("minilm", [{"batch": 1, "seq": 16}, {"batch": 3, "seq": 37}]),
    ("gpt2", [{"batch": 1, "seq": 16}, {"batch": 2, "seq": 9}]),
    ("resnet18", [{"batch": 1}, {"batch": 2}]),
])
def test_captured_models_match_eager_without_fallback(captured, bundle, name, shapes):
    g, report = captured(name)
    assert report.fallbacks == []
    verify_graph(g)
    b = bundle(name)
    for env in shapes:
        inputs = b.make_inputs(env, seed=1)
        with torch.inference_mode():
            ref = b.module(**inputs)
        ref = ref[0] if isinstance(ref, (tuple, list)) else ref
        got = interpret(g, inputs)[g.outputs[0]]
        assert rel_l2(got, ref) < 1e-5, (name, env)


def test_excluded_op_becomes_a_counted_fallback_with_location(bundle):
    from graphmode.capture.torch_import import import_torch
    b = bundle("resnet18")
    g, rep = import_torch(b.module, b.example_inputs, b.input_dims, {"batch": (1, 4)}, name="r",
                          exclude_ops=["max_pool2d"])
    assert [(f.target, f.count) for f in rep.fallbacks] == [("aten.max_pool2d.default", 1)]
    assert ".py:" in rep.fallbacks[0].loc  # file:line of the model code that called it
    assert sum(1 for n in g.nodes if n.op == "fallback") == 1
    x = b.make_inputs({"batch": 2}, seed=0)
    with torch.inference_mode():
        ref = b.module(**x)[0]
    assert rel_l2(interpret(g, x)[g.outputs[0]], ref) < 1e-5


def test_graph_hash_is_stable_across_processes(captured):
    g, _ = captured("resnet18")
    code = ("import sys; sys.path.insert(0, 'tests'); from conftest import _captured; "
            "print(_captured('resnet18')[0].structural_hash())")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == g.structural_hash()



def test_dims_equal_decides_floors_and_ceilings_over_the_integers():
    """A strided slice's ceiling(H/2) is floor(H/2 + 1/2), a ceil-mode pool's ceiling(H/2 - 5/2) + 1
    is floor(H/2) - 1: sympy.simplify does not see it, and the verifier called graphmode's own
    pass broken (x[:, :, ::2, ::2] over a dynamic H)."""
    import sympy

    from graphmode.ir.types import dims_equal, dims_equal_on, sym
    h, w = sym("H"), sym("W")
    half = sympy.Rational(1, 2)
    assert dims_equal(sympy.floor(h / 2 + half), sympy.ceiling(h / 2))
    assert dims_equal(sympy.ceiling(h / 2 - 5 * half) + 1, sympy.floor(h / 2) - 1)
    assert dims_equal(sympy.floor(sympy.floor(h / 2) / 4), sympy.floor(h / 8))
    assert not dims_equal(sympy.floor(h / 2), sympy.floor(h / 3))
    assert not dims_equal(sympy.floor(h / 2) * w, sympy.floor(h * w / 2))        # H = 1, W = 2
    # torch.export's specialisation by a range: equal there only
    assert dims_equal_on(sympy.floor(h / 32), 1, {"H": (32, 40)})
    assert not dims_equal_on(sympy.floor(h / 32), 1, {"H": (32, 64)}) and not dims_equal(sympy.floor(h / 32), 1)


def test_a_strided_slice_over_dynamic_dims_compiles_and_matches_eager(tmp_path):
    import graphmode

    class _Every2nd(torch.nn.Module):
        def forward(self, x):
            return (x * 2 + 1)[:, :, ::2, ::2]
    rec = {"version": 1, "name": "s", "inputs": [{"name": "x", "dtype": "f32", "shape": ["batch", 3, "H", "W"]}],
           "dims": {"batch": {"buckets": [1, 2]}, "H": {"min": 4, "max": 16}, "W": {"min": 4, "max": 16}}}
    cm = graphmode.compile(_Every2nd(), rec, cache_dir=tmp_path)
    x = torch.randn(1, 3, 7, 9)
    assert torch.equal(cm(x), _Every2nd()(x))


def test_a_min_or_max_the_ranges_decide_settles_to_its_winner():
    """MPT's ALiBi table sliced x[..., -seq:] has torch.export's length 128 - Max(0, 128 - seq):
    seq over seq <= 128, and only as seq did it broadcast against the scores (a PassError)."""
    import sympy

    from graphmode.ir.types import settle_on, sym
    seq = sym("seq")
    assert settle_on(128 - sympy.Max(0, 128 - seq), {"seq": (1, 128)}) == seq
    assert settle_on(sympy.Min(seq, 16), {"seq": (1, 16)}) == seq
    kept = sympy.Min(seq, 16)
    assert settle_on(kept, {"seq": (1, 64)}) == kept         # both win somewhere: kept as it is
    assert settle_on(sympy.Max(seq * seq, 2 * seq), {"seq": (2, 8)}) == seq ** 2


@pytest.mark.slow     # ~5 s; a position-biased decoder is refused in test_decoder_recipes
def test_mpt_with_alibi_compiles_its_forward_pass(tmp_path):
    import warnings

    import transformers

    import graphmode
    torch.manual_seed(0)
    m = transformers.MptForCausalLM(transformers.MptConfig(vocab_size=100, d_model=32, n_layers=1, n_heads=4,
                                                           max_seq_len=32)).eval()
    rec = {"version": 1, "name": "mpt", "inputs": [{"name": "input_ids", "dtype": "i64", "shape": [1, "seq"]}],
           "dims": {"seq": {"min": 1, "max": 24, "buckets": [8, 24]}}, "on_violation": "eager",
           "exe_mode": "hybrid"}           # its ALiBi slice starts at 32 - seq: an eager island
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cm = graphmode.compile(m, rec, cache_dir=tmp_path)
    ids = torch.randint(0, 100, (1, 8))
    torch.testing.assert_close(cm(input_ids=ids).logits, m(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


def test_a_difference_that_expands_to_zero_has_degree_zero_not_a_crash():
    """MobileViT's dims: sympy's degree of a zero polynomial is -oo, and int() of it raised TypeError."""
    import sympy

    from graphmode.ir.types import _degree
    h = sympy.Symbol("H", integer=True, positive=True)
    assert _degree((h + 1) ** 2 - h ** 2 - 2 * h - 1, h) == 0
    assert _degree(h ** 2 + 3 * h, h) == 2
