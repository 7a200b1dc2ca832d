"""A model that switches itself to another algorithm while graphmode runs it on examples is refused
and left as it was (graphmode/capture/self_changes.py)."""
from __future__ import annotations

import copy

import pytest
import torch

import graphmode
from graphmode.errors import CaptureError


class SwitchesOnShortInputs(torch.nn.Module):
    """BigBird's way: a sequence too short for the configured path switches the model for good."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.mode = "sparse"
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        if self.mode == "sparse" and x.shape[1] < 16:
            self.mode = "full"
            self.lin = torch.nn.Linear(8, 8)            # a switch may swap submodules as well
        return self.lin(x) * (2.0 if self.mode == "sparse" else 1.0)


def test_a_model_that_switches_itself_is_refused_and_put_back():
    m = SwitchesOnShortInputs().eval()
    before = copy.deepcopy(m)
    lin = m.lin
    with pytest.raises(CaptureError, match=r"mode: 'sparse' -> 'full'") as e:
        graphmode.compile((m, (torch.randn(2, 8, 8),)))
    assert "before compiling" in e.value.fix
    assert m.mode == "sparse" and m.lin is lin
    x = torch.randn(2, 32, 8)
    assert torch.equal(m(x), before(x))


class CountsCalls(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.calls = torch.nn.Linear(8, 4), 0

    def forward(self, x):
        self.calls += 1                                  # bookkeeping, not a switch of behaviour
        return self.lin(x)


def test_numbers_a_module_counts_are_not_switches():
    m = CountsCalls().eval()
    cm = graphmode.compile((m, (torch.randn(2, 8),)))
    assert m.calls == 0, "graphmode's own runs leave the counter as it was"
    x = torch.randn(2, 8)
    assert torch.allclose(cm(x), m(x), atol=1e-6)


class RunningMean(torch.nn.Module):
    """State the answer depends on, replaced each call (`self.rm = ...`, not an in-place update)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("rm", torch.zeros(4))

    def forward(self, x):
        self.rm = self.rm * 0.9 + 0.1 * x.mean(0)
        return x - self.rm


class ScalesBySteps(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.step = 1

    def forward(self, x):
        self.step += 1
        return x * self.step


class CountsInBuffer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x):
        self.count.add_(1)
        return x * 2


@pytest.mark.parametrize("make,what", [(RunningMean, "rm"), (ScalesBySteps, "step")])
def test_state_the_answer_depends_on_is_refused_and_put_back(make, what):
    """The compiled model would answer with the state of one moment (the running mean after the
    example run; the step count at capture) while eager moves on each call."""
    m = make().eval()
    before = copy.deepcopy(m)
    with pytest.raises(CaptureError, match=rf"changes its own state each call \({what}.*answer depends on it"):
        graphmode.compile((m, (torch.randn(2, 4),)))
    x = torch.randn(3, 4)
    assert torch.equal(m(x), before(x)), "graphmode's runs left the state as it was"


def test_a_buffer_updated_in_place_is_put_back_when_the_compile_is_refused():
    m = CountsInBuffer().eval()
    with pytest.raises(CaptureError, match="updates its buffer 'count' in place"):
        graphmode.compile((m, (torch.randn(2, 4),)))
    assert float(m.count) == 0.0


def test_bigbird_block_sparse_captured_on_a_short_example_is_refused():
    """transformers' BigBird set attention_type 'original_full' on graphmode's short example and the
    compiled model held full attention at every length (rel L2 7.5e-3 at 128 tokens)."""
    import transformers as T
    cfg = T.BigBirdConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                          vocab_size=100, max_position_embeddings=128, block_size=4, num_random_blocks=2)
    m = T.BigBirdModel(cfg).eval()
    with pytest.raises(CaptureError, match="attention_type: 'block_sparse' -> 'original_full'"):
        graphmode.compile(m)
    assert m.attention_type == "block_sparse"
    assert type(m.encoder.layer[0].attention.self).__name__ == "BigBirdBlockSparseAttention"
