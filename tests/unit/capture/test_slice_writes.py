"""Writes into a slice (`y[:, 0] = 7.0`, `y[:, 0] = z`, a write into an input, `empty_like` then
`copy_`) in graph mode: fill.Tensor and copy lower to a cast and expand of the source, and
select_scatter pads along every axis but the one it writes at, where an index below the dim's
smallest size stays real (`-1` names a padded position: refused)."""
from __future__ import annotations

import pytest
import torch

import graphmode
from graphmode.verdict import ContractRefused


class Writes(torch.nn.Module):
    def forward(self, x, z):
        y = x.clone()
        y[:, 0] = 7.0                     # fill.Tensor + select_scatter
        y[:, 2] = z                       # copy + select_scatter
        e = torch.empty_like(x)
        e.copy_(x * 2)
        x[:, 1] = 3.0                     # a write into the caller's input
        return y, e + x


class LastColumn(torch.nn.Module):
    def forward(self, x):
        y = x.clone()
        y[:, -1] = 7.0
        return y


def _recipe(seq_min: int) -> dict:
    return {"version": 1, "name": "w", "exe_mode": "graph", "targets": ["host"],
            "inputs": [{"name": "x", "dtype": "f32", "shape": ["batch", "seq"]}, {"name": "z", "dtype": "f32",
                                                                                  "shape": ["batch"]}],
            "dims": {"batch": {"min": 1, "max": 4, "buckets": [2, 4]}, "seq": {"min": seq_min, "max": 8, "buckets": [8]}}}


def test_writes_into_slices_run_in_graph_mode_with_padding_and_match_eager(tmp_path):
    cm = graphmode.compile(Writes(), _recipe(4), cache_dir=tmp_path)
    assert not cm.capture_report.fallbacks
    for b, s in [(3, 5), (4, 8), (1, 6)]:
        x, z = torch.randn(b, s), torch.randn(b)
        x1, x2 = x.clone(), x.clone()
        got, want = cm(x=x1, z=z), Writes()(x2, z)
        assert all(torch.equal(g, w) for g, w in zip(got, want)) and torch.equal(x1, x2)


def test_a_write_at_a_negative_index_along_a_padded_dim_is_refused(tmp_path):
    rec = _recipe(4)
    rec["inputs"] = rec["inputs"][:1]
    with pytest.raises(ContractRefused, match=r"select_scatter.default writes at index -1 along padded dim seq"):
        graphmode.compile(LastColumn(), rec, cache_dir=tmp_path)
    rec["dims"]["seq"] = {"min": 4, "max": 8, "buckets": [4, 5, 6, 7, 8]}        # never padded: compiles
    cm = graphmode.compile(LastColumn(), rec, cache_dir=tmp_path)
    x = torch.randn(3, 5)
    assert torch.equal(cm(x), LastColumn()(x))


class IndexedWrites(torch.nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim

    def forward(self, x, src):
        idx = torch.tensor([0, 1, 1, 3])
        return (x.index_add(self.dim, idx, src), x.index_copy(self.dim, torch.tensor([2, 0, 3, 1]), src),
                x.index_fill(self.dim, idx, -1.0))


def test_index_writes_along_a_static_dim_pad_the_batch_and_along_a_padded_dim_are_refused(tmp_path):
    """index_add/index_copy/index_fill along a static axis: self and source line up on every
    other axis, so a padded batch is safe (their 1-d index made them opaque to the analysis)."""
    rec = {"version": 1, "name": "ix", "exe_mode": "graph", "targets": ["host"],
           "inputs": [{"name": "x", "dtype": "f32", "shape": ["batch", 4, 16]},
                      {"name": "src", "dtype": "f32", "shape": ["batch", 4, 16]}],
           "dims": {"batch": {"min": 1, "max": 8, "buckets": [2, 8]}}}
    cm = graphmode.compile(IndexedWrites(1), rec, cache_dir=tmp_path)
    for b in (1, 3, 8):
        x, src = torch.randn(b, 4, 16), torch.randn(b, 4, 16)
        assert all(torch.equal(g, w) for g, w in zip(cm(x=x, src=src), IndexedWrites(1)(x, src)))
    rec["inputs"][1]["shape"] = [4, 4, 16]
    rec["dims"]["batch"] = {"min": 4, "max": 8, "buckets": [6, 8]}
    with pytest.raises(ContractRefused, match=r"index_add.default along padded dim batch"):
        graphmode.compile(IndexedWrites(0), rec, cache_dir=tmp_path)
