"""`graphmode run` holds its measured calls to the recipe's SLA (graphmode/cli/run_cmd.py): the
proof predicts latency with the target's cost model, so a bound it "proved" could be missed by
2-7x on this host with nothing said."""
from __future__ import annotations

from graphmode.cli.run_cmd import sla_misses
from graphmode.recipe import load_recipe


def recipe(sla: dict):
    return load_recipe({"version": 1, "name": "r", "inputs": [{"name": "x", "dtype": "f32", "shape": ["batch", 4]}],
                        "dims": {"batch": {"buckets": [1, 4]}}, "sla": sla})


def test_a_bound_the_calls_miss_is_named_with_what_was_measured():
    times = [1.0] * 98 + [5.0, 6.0]                 # median 1 ms, nearest-rank p99 5 ms
    assert sla_misses(recipe({"p50_ms": 2, "p99_ms": 10}), {"batch": 1}, times) == []
    (miss,) = sla_misses(recipe({"p50_ms": 2, "p99_ms": 4}), {"batch": 1}, times)
    assert miss == {"field": "sla.p99_ms", "which": "p99", "bound_ms": 4.0, "measured_ms": 5.0}


def test_a_per_bucket_entry_governs_the_shapes_it_matches():
    r = recipe({"p99_ms": 100, "per_bucket": [{"match": {"batch": 4}, "p50_ms": 0.5}]})
    assert sla_misses(r, {"batch": 1}, [1.0, 1.0]) == []
    assert [m["field"] for m in sla_misses(r, {"batch": 4}, [1.0, 1.0])] == ["sla.per_bucket[0].p50_ms"]
    no_sla = load_recipe({"version": 1, "name": "r", "inputs": [{"name": "x", "dtype": "f32", "shape": ["batch", 4]}],
                          "dims": {"batch": {"buckets": [1, 4]}}})
    assert sla_misses(no_sla, {"batch": 1}, [1e6]) == []


def test_the_reported_path_is_the_one_the_timed_calls_took():
    """A hybrid model ran its first call in graph mode, then chose eager (faster at this shape):
    `run` labelled the eager time as graph-mode latency."""
    from graphmode.cli.run_cmd import _timed_path
    first = {"path": "graph", "bucket": {"batch": 64}}
    eager = {"path": "eager", "reason": "faster at this shape", "bucket": {"batch": 64}}
    assert _timed_path(first, [eager] * 3) == {**eager, "timed_calls": {"eager": 3}}
    assert _timed_path(first, [first] * 2 + [eager])["path"] == "graph"
    assert _timed_path(first, [first] * 2) == first
    assert _timed_path(first, []) == first
    # a request between buckets ran padded (warm-up) and then in its own plan: the timed calls' bucket
    own = {"path": "graph", "bucket": {"batch": 50}}
    assert _timed_path(first, [own] * 3) == {**own, "timed_calls": {"graph batch=50": 3}}
