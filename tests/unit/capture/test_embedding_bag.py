"""nn.EmbeddingBag (recommendation models' sparse features) runs in graph mode as an
ATen-reference op: every mode, padding_idx, per-sample weights, 2-d bags and a dynamic number
of ids and bags match eager; an id outside the table is refused before the plan runs, naming
the input, and offsets torch's kernel rejects come back as a graphmode error naming the op."""
from __future__ import annotations

import warnings

import pytest
import torch

import graphmode
from graphmode.errors import ContractViolation


class Bags(torch.nn.Module):
    def __init__(self, weighted: bool = False, **kw):
        super().__init__()
        self.bag = torch.nn.EmbeddingBag(40, 6, **kw)
        self.weighted = weighted

    def forward(self, ids, offsets, weights):
        return self.bag(ids, offsets, per_sample_weights=weights if self.weighted else None)


def _recipe(n="n", bags="bags", buckets=None) -> dict:
    dims = {d: {"min": 1, "max": 16, "buckets": buckets or [4, 8, 16]} for d in (n, bags) if isinstance(d, str)}
    return {"version": 1, "name": "bags", "exe_mode": "graph", "dims": dims,
            "inputs": [{"name": "ids", "dtype": "i64", "shape": [n]},
                       {"name": "offsets", "dtype": "i64", "shape": [bags]},
                       {"name": "weights", "dtype": "f32", "shape": [n]}],
            "codegen": {"kernel_selection": "heuristic"}}


def _request(n: int, bags: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 40, (n,), generator=g)
    ids[0] = 0                                                   # the padding row, where one is set
    cuts = torch.sort(torch.randperm(n - 1, generator=g)[:bags - 1] + 1).values
    return ids, torch.cat([torch.zeros(1, dtype=torch.int64), cuts]), torch.rand(n, generator=g)


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


@pytest.mark.parametrize("kw", [dict(mode="sum"), dict(mode="mean"), dict(mode="max"), dict(mode="sum", padding_idx=0),
                                dict(mode="mean", padding_idx=0), dict(mode="sum", weighted=True),
                                dict(mode="sum", include_last_offset=True)])
def test_every_mode_matches_eager_in_graph_mode_at_static_shapes(kw, tmp_path):
    torch.manual_seed(0)
    model = Bags(**kw).eval()
    cm = graphmode.compile(model, _recipe(10, 4), example_inputs=_request(10, 4, 9), cache_dir=tmp_path)
    assert cm.capture_report.fallbacks == []
    for seed in range(3):
        args = _request(10, 4, seed)
        torch.testing.assert_close(cm(*args), model(*args), rtol=1e-6, atol=1e-6)


def test_a_dynamic_count_of_ids_and_bags_runs_at_each_shape(tmp_path):
    torch.manual_seed(0)
    model = Bags(mode="mean").eval()
    cm = graphmode.compile(model, _recipe(buckets=list(range(1, 17))), example_inputs=_request(8, 3, 9),
                           cache_dir=tmp_path)                    # every size a bucket: nothing padded
    assert cm.capture_report.fallbacks == []
    for n, bags in [(10, 4), (7, 3), (16, 16), (5, 1)]:
        args = _request(n, bags, n)
        torch.testing.assert_close(cm(*args), model(*args), rtol=1e-6, atol=1e-6)


def test_ids_outside_the_table_and_bad_offsets_are_refused_naming_them(tmp_path):
    model = Bags(mode="sum").eval()
    cm = graphmode.compile(model, _recipe(10, 4), example_inputs=_request(10, 4, 9), cache_dir=tmp_path)
    ids, offsets, weights = _request(10, 4, 0)
    bad = ids.clone()
    bad[3] = 40
    with pytest.raises(ContractViolation, match="input 'ids' holds 40 at position \\[3\\]") as e:
        cm(bad, offsets, weights)
    assert e.value.where == "inputs.ids" and "[0, 39]" in e.value.fix
    with pytest.raises(ContractViolation, match="embedding_bag .* failed on this request: offsets\\[0\\]") as e:
        cm(ids, offsets + 1, weights)                             # eager raises here too
    assert e.value.kind == "input" and "aten:embedding_bag" in e.value.where
    torch.testing.assert_close(cm(ids, offsets, weights), model(ids, offsets, weights))   # and it still answers
