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
from graphmode.runtime.split import Chooser, chunks, shape_key

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


class _Scan(_Rows):
    """A prefix scan along the batch: padding at the end is safe, a cut is not (the second
    piece's rows lose the first piece's); so is a seq-first causal encoder named `batch`."""

    def forward(self, x):
        return self.a(x).cumsum(0)


def scan():
    return _Scan().eval(), {"x": torch.randn(2, 16)}, {"x": ["batch", 16]}


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


def test_chooser_times_each_way_twice_in_turn_then_keeps_the_faster():
    c = Chooser()
    key = shape_key({"batch": 3}, {"batch": 4})
    for way, s in (("padded", 0.010), ("split", 0.004), ("padded", 0.011), ("split", 0.005)):
        assert c.choose(key) == way and not c.settled(key, ("padded", "split"))
        c.record(key, way, s)
    assert c.settled(key, ("padded", "split")) and c.choose(key) == "split" == c.chosen(key)
    c.record(key, "padded", 0.002)           # the best time seen per way decides
    assert c.choose(key) == "padded"
    assert c.report() == {"batch=3@batch=4": {"padded": 2.0, "split": 4.0, "chosen": "padded"}}


def test_chooser_explores_eager_only_where_allowed_and_keeps_the_fastest():
    c = Chooser(tries=1)
    key = shape_key({"batch": 3, "seq": 50}, {"batch": 4, "seq": 94})
    ways = ("padded", "split", "eager")
    for way, s in (("padded", 0.030), ("split", 0.024), ("eager", 0.020)):
        assert c.choose(key, ways) == way
        c.record(key, way, s)
    assert c.choose(key, ways) == "eager"
    assert c.choose(key, ("padded", "split")) == "split"       # graph mode: eager is never a way
    assert c.report()["batch=3,seq=50@batch=4,seq=94"]["chosen"] == "eager"


def test_chooser_remembers_a_bounded_number_of_shapes():
    c = Chooser(max_shapes=2)
    for b in (1, 2):
        c.record(shape_key({"batch": b}, {"batch": 4}), "split", 0.001)
    late = shape_key({"batch": 3}, {"batch": 4})
    assert c.choose(late, ("padded", "split")) == "padded"
    c.record(late, "padded", 0.5)
    assert len(c.best) == 2 and c.choose(late, ("padded", "split")) == "padded"


def test_a_batch_of_3_runs_padded_and_split_and_matches_eager(tmp_path):
    cm = graphmode.compile(f"{HERE}:rows", RECIPE, "host", cache_dir=tmp_path)
    assert positions_independent(cm.graph, "batch")
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(1))
    ref = _Rows().eval()(x)
    ways = []
    for i in range(7):
        got = cm(x=x)
        ways.append("split" if "split" in cm.last_path else "padded")
        if i == 0:              # split is offered once its parts' plans (batch 2, batch 1) are built, in the background
            assert ways == ["padded"] and cm.wait_for_builds(timeout=600)
            assert cm.is_built({"batch": 2}) and cm.is_built({"batch": 1})
        assert cm.last_path["bucket"] == {"batch": 4}
        for g, r in zip(got, ref):
            assert g.shape == r.shape and torch.allclose(g, r, rtol=1e-5, atol=1e-6)
    assert "padded" in ways and "split" in ways
    assert cm.last_path.get("split", [2, 1]) == [2, 1]
    assert set(cm.shape_chooser.report()["batch=3@batch=4"]) == {"padded", "split", "chosen"}
    assert cm.events["eager_choice"] == 0 and not cm.eager_candidate           # graph mode never runs eager


@pytest.mark.parametrize("spec,cls", [("first_row", _FirstRow), ("scan", _Scan)])
def test_rows_that_meet_are_never_split(spec, cls, tmp_path):
    cm = graphmode.compile(f"{HERE}:{spec}", RECIPE, "host", cache_dir=tmp_path)
    assert cm.exact_dims == [] and not positions_independent(cm.graph, "batch")
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = cls().eval()(x)
    for _ in range(6):
        got = cm(x=x)
        got = got[0] if isinstance(got, (tuple, list)) else got
        assert torch.allclose(got, ref, rtol=1e-5, atol=1e-6) and "split" not in cm.last_path


def test_hybrid_mode_may_run_a_shape_between_buckets_eagerly_and_says_so(tmp_path):
    """exe_mode hybrid: eager at the request's own shape is a third way, tried once; its calls
    are eager's outputs, counted as `eager_choice` events and by the monitor (not as violations)."""
    from graphmode.monitor import ContractMonitor
    cm = graphmode.compile(f"{HERE}:rows", dict(RECIPE, exe_mode="hybrid"), "host", cache_dir=tmp_path)
    cm.monitor = ContractMonitor(cm.recipe)
    assert cm.eager_candidate
    cm.warmup()                  # every plan built: no call below builds one, so each is timed
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(1))
    ref = _Rows().eval()(x)
    paths = []
    for _ in range(7):
        got = cm(x=x)
        paths.append(cm.last_path["path"] if "split" not in cm.last_path else "split")
        for g, r in zip(got, ref):
            assert g.shape == r.shape and torch.allclose(g, r, rtol=1e-5, atol=1e-6)
        if cm.last_path["path"] == "eager":
            assert cm.last_path["reason"] == "faster at this shape" and cm.last_path["bucket"] == {"batch": 4}
            for g, r in zip(got, ref):
                assert torch.equal(g, r)                       # eager's outputs, by definition
    assert paths[:6] == ["graph", "split", "eager"] * 2             # each way timed twice, in turn
    ways = cm.metrics()["between_buckets"]["batch=3@batch=4"]
    assert set(ways) == {"padded", "split", "eager", "chosen"}
    assert cm.events["eager_choice"] == paths.count("eager") >= 1
    snap = cm.monitor.snapshot()
    assert snap["fallbacks"] == {"faster at this shape": paths.count("eager")} and snap["health_score"] == 1.0
    cm(x=x[:2])                                                # a bucket's own shape is never a choice
    assert cm.last_path == {"path": "graph", "bucket": {"batch": 2}}


def test_no_eager_candidate_without_the_module(tmp_path):
    """A loaded artifact has plans, not the module: hybrid or not, there is nothing eager to run."""
    cm = graphmode.compile(f"{HERE}:rows", dict(RECIPE, exe_mode="hybrid"), "host", cache_dir=tmp_path)
    cm.save(tmp_path / "m.gm")
    loaded = graphmode.load(tmp_path / "m.gm")
    assert loaded.mode == "hybrid" and not loaded.eager_candidate
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(1))
    for _ in range(4):
        loaded(x=x)
        assert loaded.last_path["path"] == "graph"
    assert "eager" not in loaded.shape_chooser.report()["batch=3@batch=4"]
