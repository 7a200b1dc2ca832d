"""Autoscaling on the recipe's SLA without Ray: the decision (table-driven: windows of p99 and
queue depth -> the replica count, with hysteresis and the min/max bounds), the windows read
out of real Prometheus registries (p99 from a histogram's difference), the rule built from
the recipe and the flags, and the coordinator judging the replicas' pushes once per window."""
from __future__ import annotations

from pathlib import Path

import pytest

from graphmode.monitor.prom import PromMetrics
from graphmode.recipe import load_recipe
from graphmode.serve.autoscale import (ReplicaWindow, ScaleRule, ScaleState, decide, histogram_quantile, reading,
                                       window)
from graphmode.serve.cluster import ClusterConfig, Served, scale_rule
from graphmode.serve.cluster_control import Coordinator
from graphmode.serve.server import ServeConfig

RULE = ScaleRule(min_replicas=1, max_replicas=3, sla_p99_ms=50.0, queue_bound=4.0, margin=0.2, up_windows=2,
                 down_windows=3, down_fraction=0.5, min_samples=10, window_s=1.0)
SLOW = {"a": ReplicaWindow(100, 80.0, 0)}            # p99 over 50 ms + 20 %
EDGE = {"a": ReplicaWindow(100, 59.0, 0)}            # over the SLA but within the margin
QUEUED = {"a": ReplicaWindow(100, 10.0, 9)}          # fast, but 9 waiting (bound 4)
FAST = {"a": ReplicaWindow(100, 10.0, 0)}            # well under: p99 < 25 ms, nothing waiting
FEW = {"a": ReplicaWindow(3, 500.0, 0)}              # too few requests to judge the p99
IDLE = {"a": ReplicaWindow(0, None, 0)}
SLOW_ONE_OF_TWO = {"a": ReplicaWindow(100, 10.0, 0), "b": ReplicaWindow(50, 90.0, 1)}


def run(windows: list, current: int = 1, rule: ScaleRule = RULE) -> list[int]:
    """Feed windows in order (the count follows each decision at once); the desired count after each."""
    state, out = ScaleState(desired=current), []
    for w in windows:
        state = decide(rule, state, w, current, current)
        current = state.desired
        out.append(current)
    return out


@pytest.mark.parametrize("windows, start, expected", [
    ([SLOW, SLOW], 1, [1, 2]),                      # up after up_windows in a row
    ([SLOW, FAST, SLOW], 1, [1, 1, 1]),             # a calm window breaks the streak
    ([SLOW, EDGE, SLOW], 1, [1, 1, 1]),             # within the margin is not over
    ([QUEUED, QUEUED], 1, [1, 2]),                  # the queue bound alone scales up
    ([FEW, FEW, FEW], 1, [1, 1, 1]),                # a p99 of 3 requests does not count
    ([SLOW] * 6, 1, [1, 2, 2, 3, 3, 3]),            # one at a time, never past max_replicas
    ([SLOW_ONE_OF_TWO] * 2, 2, [2, 3]),             # the worst replica's p99 decides
    ([FAST] * 3, 2, [2, 2, 1]),                     # down after the (longer) down_windows
    ([IDLE] * 6, 3, [3, 3, 2, 2, 2, 1]),            # an idle cluster shrinks to min_replicas ...
    ([IDLE] * 4, 1, [1, 1, 1, 1]),                  # ... and no further
    ([FAST, FAST, EDGE, FAST, FAST], 2, [2, 2, 2, 2, 2]),   # between calm and over: both streaks restart
    ([SLOW, SLOW, FAST, FAST, FAST], 1, [1, 2, 2, 2, 1]),  # up, then down once well under for long enough
])
def test_windows_to_replicas(windows, start, expected):
    assert run(windows, start) == expected


def test_the_reason_names_the_cause_and_the_streak():
    state = decide(RULE, ScaleState(desired=1), SLOW, 1, 1)
    assert state.desired == 1 and state.over == 1
    assert state.why == "over (1 of 2 windows): p99 80.0 ms on replica a > sla.p99_ms 50 ms + 20%"
    state = decide(RULE, state, SLOW, 1, 1)
    assert (state.desired, state.over) == (2, 0) and state.why.startswith("up to 2: p99 80.0 ms") \
        and state.p99_ms == 80.0 and state.queue_depth == 0
    assert state.changed == state.why                          # kept until the count changes again
    held = decide(RULE, state, EDGE, 2, 2)
    assert held.why.startswith("within the SLA") and held.changed == state.why
    at_max = decide(RULE, ScaleState(desired=3, over=1), QUEUED, 3, 3)
    assert at_max.desired == 3 and at_max.why == "at max_replicas 3: queue depth 9.0 per replica > 4"


def test_it_holds_while_a_replica_starts_and_without_metrics():
    started = decide(RULE, ScaleState(desired=2, over=1), SLOW, 1, 2)
    assert (started.desired, started.over) == (2, 0) and started.why == "waiting: 1 replica(s) serving, 2 asked for"
    assert decide(RULE, ScaleState(desired=1), {}, 1, 1).why == "waiting: no metrics from the replicas yet"
    assert decide(RULE, ScaleState(desired=5), FAST, 5, 5).desired == 3     # outside the bounds: clamped


def test_without_an_sla_the_queue_depth_decides():
    rule = ScaleRule(min_replicas=1, max_replicas=2, sla_p99_ms=None, queue_bound=4.0, up_windows=1,
                     down_windows=1)
    assert run([SLOW], 1, rule) == [1]          # a slow p99 means nothing without an SLA
    assert run([QUEUED], 1, rule) == [2]
    assert run([SLOW], 2, rule) == [1]


def test_histogram_quantile_interpolates_like_prometheus():
    inf = float("inf")
    assert histogram_quantile(0.99, []) is None
    assert histogram_quantile(0.99, [(0.1, 0), (inf, 0)]) is None
    assert histogram_quantile(0.5, [(0.1, 50), (0.2, 100), (inf, 100)]) == pytest.approx(0.1)
    assert histogram_quantile(0.99, [(0.1, 50), (0.2, 100), (inf, 100)]) == pytest.approx(0.198)
    assert histogram_quantile(0.99, [(0.1, 1), (inf, 100)]) == pytest.approx(0.1)     # in +Inf: the last bound


def test_a_window_is_the_difference_of_two_pushes_of_a_real_registry():
    m = PromMetrics()
    for _ in range(100):
        m.latency.labels("v1", "cpu", "batch=1").observe(0.003)
    first = reading(m.text())
    assert window(None, first).requests == 100
    for _ in range(99):                                    # the next window: 99 at 40 ms, 1 at 2 s, in two buckets
        m.latency.labels("v2", "cpu", "batch=4").observe(0.04)
    m.latency.labels("v2", "cpu", "batch=1").observe(2.0)
    m.queue_depth.labels("cpu").set(3)
    w = window(first, reading(m.text()))
    assert w.requests == 100 and w.queue_depth == 3
    assert 25.0 < w.p99_ms <= 50.0                         # the 99th request is in the (25, 50] ms bucket
    assert window(reading(m.text()), first).requests == 100   # counts that went back: a restart, from zero


def test_the_rule_comes_from_the_recipe_and_the_flags():
    rec = load_recipe({"version": 1, "name": "enc", "inputs": [{"name": "x", "dtype": "f32", "shape": ["batch", 4]}],
                       "dims": {"batch": {"buckets": [1, 8]}}, "sla": {"p99_ms": 40}})
    assert scale_rule(rec, ClusterConfig(replicas=2), ServeConfig()) is None      # a fixed count
    rule = scale_rule(rec, ClusterConfig(min_replicas=1, max_replicas=4, scale_up_windows=5),
                      ServeConfig(sla_margin=0.1, sla_min_samples=20))
    assert (rule.min_replicas, rule.max_replicas, rule.sla_p99_ms, rule.queue_bound) == (1, 4, 40.0, 8.0)
    assert (rule.margin, rule.min_samples, rule.up_windows, rule.down_windows) == (0.1, 20, 5, 15)


def test_the_coordinator_judges_the_pushes_once_per_window(tmp_path, monkeypatch):
    model = f"{Path(__file__).resolve().parents[3] / 'tests/e2e/tiny_models.py'}:mlp"
    rec = load_recipe({"version": 1, "name": "mlp", "exe_mode": "eager", "sla": {"p99_ms": 10},
                       "inputs": [{"name": "input", "dtype": "f32", "shape": ["batch", 16]}],
                       "dims": {"batch": {"buckets": [1, 2]}}})
    clock = [1000.0]
    monkeypatch.setattr("graphmode.serve.cluster_control.time.monotonic", lambda: clock[0])
    served = Served(model, rec, False, 0.0, model)
    rule = ScaleRule(min_replicas=1, max_replicas=2, sla_p99_ms=None, queue_bound=4.0, up_windows=2, window_s=2.0)
    c = Coordinator(served, rec, ServeConfig(cache_dir=tmp_path), ClusterConfig(max_replicas=2), rule)
    try:
        assert c.autoscaler()["why"] == "no window judged yet" and c.autoscaler()["rule"]["sla_p99_ms"] == 10.0
        m = PromMetrics()
        c.push("r1", m.text())
        assert c.scale(1, 1)["desired"] == 1               # the first window: nothing answered yet
        for _ in range(20):
            m.latency.labels("v", "cpu", "batch=1").observe(0.09)     # 90 ms against the recipe's 10 ms
        c.push("r1", m.text())
        assert c.scale(1, 1)["windows"] == 1               # within the window: the last decision again
        clock[0] += 2.0
        assert c.scale(1, 1)["over"] == 1
        for _ in range(20):
            m.latency.labels("v", "cpu", "batch=1").observe(0.09)
        c.push("r1", m.text())
        clock[0] += 2.0
        got = c.scale(1, 1)
        assert got["desired"] == 2 and "sla.p99_ms 10 ms" in got["why"]
        view = c.autoscaler()
        assert view["state"] == "on" and view["desired"] == 2 and view["why"].startswith("up to 2")
        fixed = Coordinator(served, rec, ServeConfig(cache_dir=tmp_path), ClusterConfig())
        assert fixed.autoscaler()["state"] == "off"
        fixed.sandbox.close()
    finally:
        c.sandbox.close()
