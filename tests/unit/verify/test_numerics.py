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
