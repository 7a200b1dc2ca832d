"""rel_l2, the numerics check every compiled path is held to: float64 over blocks of the
flattened tensors (whole-tensor float64 copies of a batch-8 conv output were the peak of a
bucket build), the same value as the whole-tensor formula, NaN and shape mismatches loud."""
from __future__ import annotations

import math

import pytest
import torch

import graphmode.verify.numerics as numerics
from graphmode.verify.numerics import rel_l2


@pytest.mark.parametrize("chunk", [7, 1000, 1 << 20])
def test_blockwise_rel_l2_is_the_whole_tensor_value(monkeypatch, chunk):
    monkeypatch.setattr(numerics, "REL_L2_CHUNK", chunk)
    gen = torch.Generator().manual_seed(0)
    e = torch.randn(37, 53, generator=gen)
    a = e + 1e-4 * torch.randn(37, 53, generator=gen)
    whole = ((a.double() - e.double()).norm() / e.double().norm()).item()
    assert math.isclose(rel_l2(a, e), whole, rel_tol=1e-12)
    assert math.isclose(rel_l2(a.t().contiguous().t(), e), whole, rel_tol=1e-12)    # strided views too
    assert rel_l2(e, e) == 0.0


def test_rel_l2_edges():
    nan, inf = float("nan"), float("inf")
    assert rel_l2(torch.tensor([1.0, nan]), torch.tensor([1.0, 2.0])) == inf        # a NaN eager does not have
    assert rel_l2(torch.tensor([1.0, 2.0]), torch.tensor([1.0, nan])) == inf        # a NaN eager has, missing
    assert rel_l2(torch.tensor([1.0, nan, -inf]), torch.tensor([1.0, nan, -inf])) == 0.0    # eager's own
    assert rel_l2(torch.tensor([1.1, nan]), torch.tensor([1.0, nan])) == pytest.approx(0.1)
    assert rel_l2(torch.tensor([1.0, inf]), torch.tensor([1.0, -inf])) == inf
    assert rel_l2(torch.ones(3), torch.ones(4)) == float("inf")
    assert rel_l2(torch.ones(3), torch.zeros(3)) == pytest.approx(math.sqrt(3))        # reference 0: the error
    assert rel_l2(torch.tensor([1, 2]), torch.tensor([1, 2])) == 0.0
    assert rel_l2(torch.tensor([1, 2]), torch.tensor([1, 3])) == 1.0


def test_a_failing_reference_is_named_as_what_it_is():
    """An ONNX model's reference is ONNX Runtime: its failure was reported as eager PyTorch's."""
    import pytest
    import torch

    from graphmode.errors import GraphmodeError
    from graphmode.verify.eager import run_reference

    def ort(inputs):
        raise RuntimeError("[ONNXRuntimeError] : 2 : INVALID_ARGUMENT")
    with pytest.raises(GraphmodeError, match=r"^dims: ONNX Runtime fails at \{'seq': 3\}.*INVALID_ARGUMENT"):
        run_reference(ort, {"x": torch.ones(1, 3)}, {"seq": 3}, "ONNX Runtime")


def test_a_proposed_fix_is_a_recipe_graphmode_accepts():
    """verify --fix proposed dropping quantize_weights for an int8 error beyond its bound (a
    pass list the recipe then refused), and `mul: f32` again for a mul already overridden."""
    from graphmode.recipe import load_recipe
    from graphmode.recipe.semantics import check_semantics
    from graphmode.recipe.fixes import propose_fix
    from graphmode.verify.bisect import Divergence
    base = {"version": 1, "name": "m", "inputs": [{"name": "x", "dtype": "f32", "shape": ["batch", 8]}],
            "dims": {"batch": {"buckets": [2]}}}

    def fixed(precision, div):
        rec = load_recipe({**base, "precision": precision})
        change = propose_fix(rec, div)
        data = {**base, "precision": {**precision, **change.get("precision", {})}, **{
            k: v for k, v in change.items() if k != "precision"}}
        data["optimize"] = {k: v for k, v in data.get("optimize", {}).items() if v is not None}
        assert not check_semantics(load_recipe(data)).errors, change
        return change
    assert fixed({"weights": "int8"}, Divergence("quantize_weights", "%y = qlinear(%x)", "qlinear", 0.2, "pass")) \
        == {"precision": {"weights": "bf16"}}
    assert fixed({"compute": "bf16"}, Divergence("precision", "%y = mul(%x)", "mul", 0.1, "pass")) \
        == {"precision": {"overrides": {"mul": "f32"}}}
    assert fixed({"compute": "bf16", "overrides": {"mul": "f32"}}, Divergence("precision", "%y = mul(%x)", "mul",
                                                                             0.1, "pass"))["precision"]["compute"] == "f32"
    change = fixed({"weights": "int8"}, Divergence("constant_fold", "%y = add(%x)", "add", 0.1, "pass"))
    assert "constant_fold" not in change["optimize"]["passes"] and change["precision"] == {"weights": "f32"}


def test_a_rank_group_that_differs_is_told_to_widen_its_wire_or_verify_at_one_process():
    """verify cannot bisect across ranks (each holds its own shard): the wire is the knob."""
    from graphmode.recipe import load_recipe
    from graphmode.recipe.fixes import propose_fix
    from graphmode.verify.bisect import Divergence
    base = {"version": 1, "name": "m", "inputs": [{"name": "x", "dtype": "f32", "shape": ["batch", 8]}],
            "dims": {"batch": {"buckets": [2]}}}

    def group(wire):
        return load_recipe({**base, "parallel": {"tensor": 2, "device_group": ["r0", "r1"],
                                                 "links": {"lo": {"bandwidth_gbps": 10, "latency_us": 5}},
                                                 "comm": {"dtype": wire}}})
    div = Divergence(None, None, None, 0.2, "parallel", {"ranks": 2, "comm": "int8"})
    assert propose_fix(group("int8"), div) == {"parallel": {"comm": {"dtype": "bf16"}}}
    assert propose_fix(group("bf16"), div) == {"parallel": {"comm": {"dtype": "f32"}}}
    assert propose_fix(group("f32"), div) is None
    assert "tensor: 1" in div.describe() and "widen parallel.comm.dtype" in div.describe()
    assert "widen" not in Divergence(None, None, None, 0.2, "parallel", {"ranks": 2, "comm": "f32"}).describe()


def test_a_pass_divergence_gives_the_nodes_own_error_beside_the_outputs():
    """'first diverging node %linear = qlinear(...) (rel L2 8.85e-02)' printed the outputs'
    worst error as if it were the node's; the node's own stayed in the detail (trial T)."""
    from graphmode.verify.bisect import Divergence
    div = Divergence("quantize_weights", "%y = qlinear(%x, %w)", "qlinear", 0.0885, "pass", {"node_rel_l2": 0.003})
    text = div.describe()
    assert "its own rel L2 3.00e-03" in text and "the outputs' rel L2 8.85e-02" in text
    assert "its own" not in Divergence("p", None, None, 0.5, "pass", {"node_rel_l2": 0.0}).describe()
