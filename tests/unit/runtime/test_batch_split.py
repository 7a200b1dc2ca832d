"""A batch between buckets runs padded or cut into buckets it fills exactly, whichever measured
faster, and only when the model's rows never meet (analysis.padding.positions_independent).
Real compiles of tiny models; outputs compared with eager; nothing asserts on speed."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn as nn

import graphmode
from graphmode.analysis.padding import positions_independent
from graphmode.runtime.split import Chooser, chunks

HERE = Path(__file__).resolve()


class _Rows(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 8)

    def forward(self, x):
        return self.b(torch.relu(self.a(x))).softmax(-1), self.a(x).sum(-1)


class _FirstRow(_Rows):
    """Every row reads row 0: padding is safe (row 0 is always real), cutting the batch is not."""

    def forward(self, x):
        y = self.a(x)
        return y + y[0:1]


def rows():
    return _Rows().eval(), {"x": torch.randn(2, 16)}, {"x": ["batch", 16]}


def first_row():
    return _FirstRow().eval(), {"x": torch.randn(2, 16)}, {"x": ["batch", 16]}


RECIPE = {"version": 1, "name": "split", "inputs": [{"name": "x", "dtype": "f32", "shape": ["batch", 16]}],
          "dims": {"batch": {"buckets": [1, 2, 4]}}, "exe_mode": "graph", "codegen": {"kernel_selection": "heuristic"}}


@pytest.mark.parametrize("n, want", [(3, [2, 1]), (7, [4, 2, 1]), (4, [4]), (0, [])])
def test_chunks(n, want):
    assert chunks(n, [1, 2, 4]) == want
    assert chunks(3, [2, 4]) == []        # a remainder no bucket fills


def test_chooser_tries_each_way_once_then_keeps_the_faster():
    c = Chooser()
    key = (3, (("batch", 4),))
    assert c.choose(key) == "pad"
    c.record(key, "pad", 0.010)
    assert c.choose(key) == "split"
    c.record(key, "split", 0.004)
    assert c.choose(key) == "split"
    c.record(key, "pad", 0.002)           # the best time seen per way decides
    assert c.choose(key) == "pad" and c.report() == {"3@(('batch', 4),)": {"pad": 2.0, "split": 4.0}}


def test_a_batch_of_3_runs_padded_and_split_and_matches_eager(tmp_path):
    cm = graphmode.compile(f"{HERE}:rows", RECIPE, "host", cache_dir=tmp_path)
    assert positions_independent(cm.graph, "batch")
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(1))
    ref = _Rows().eval()(x)
    ways = []
    for _ in range(6):
        got = cm(x=x)
        ways.append("split" if "split" in cm.last_path else "pad")
        assert cm.last_path["bucket"] == {"batch": 4}
        for g, r in zip(got, ref):
            assert g.shape == r.shape and torch.allclose(g, r, rtol=1e-5, atol=1e-6)
    assert "pad" in ways and "split" in ways
    assert cm.last_path.get("split", [2, 1]) == [2, 1]
    assert set(cm.split_chooser.report()["3@(('batch', 4),)"]) == {"pad", "split"}


def test_rows_that_meet_are_never_split(tmp_path):
    cm = graphmode.compile(f"{HERE}:first_row", RECIPE, "host", cache_dir=tmp_path)
    assert cm.exact_dims == [] and not positions_independent(cm.graph, "batch")
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(1))
    ref = _FirstRow().eval()(x)
    for _ in range(4):
        got = cm(x=x)
        got = got[0] if isinstance(got, (tuple, list)) else got
        assert torch.allclose(got, ref, rtol=1e-5, atol=1e-6) and "split" not in cm.last_path
