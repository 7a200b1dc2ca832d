"""Contract monitoring: SLA targets, the drift probe on an injected clock, the token bucket,
renegotiation under a storm of drift events, the ContractMonitor's counting and health
score, Prometheus registries per monitor, and the hook into a real CompiledModel."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from graphmode.errors import ContractViolation, GraphmodeError
from graphmode.monitor import (ContractMonitor, DriftEvent, PromMetrics, Renegotiator, SlaDriftProbe, SlaTarget,
                               TokenBucket, monitored, quantile, sla_target)
from graphmode.recipe import load_recipe


class Clock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


def recipe(**over) -> object:
    r = {"version": 1, "name": "mlp",
         "inputs": [{"name": "x", "dtype": "f32", "shape": ["batch", 8]}],
         "dims": {"batch": {"buckets": [1, 2, 4]}}, "targets": ["host"]}
    r.update(over)
    return load_recipe(r)


def samples(text: bytes | str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted label items): value} of a Prometheus exposition."""
    if isinstance(text, bytes):
        text = text.decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def total(text, name: str, **labels) -> float:
    return sum(v for (n, ls), v in samples(text).items()
               if n == name and all(dict(ls).get(k) == w for k, w in labels.items()))


# ---- SLA targets and quantiles ------------------------------------------------------------------

def test_quantile_is_nearest_rank():
    vals = list(range(1, 101))
    assert quantile(vals, 0.99) == 99 and quantile(vals, 0.5) == 50 and quantile(vals, 1.0) == 100
    assert quantile([7.0], 0.99) == 7.0


def test_sla_target_picks_the_first_matching_entry_and_inherits_missing_bounds():
    r = recipe(sla={"p99_ms": 100, "p50_ms": 40,
                    "per_bucket": [{"match": {"batch": 1}, "p99_ms": 10},
                                   {"match": {"batch": [2, 3]}, "p50_ms": 20}]})
    assert sla_target(r, {"batch": 1}) == SlaTarget("sla.per_bucket[0]", 40, 10)
    assert sla_target(r, {"batch": 3}) == SlaTarget("sla.per_bucket[1]", 20, 100)
    assert sla_target(r, {"batch": 4}) == SlaTarget("sla", 40, 100)
    assert sla_target(recipe(), {"batch": 1}) is None


def test_a_batch_window_past_the_tightest_latency_bound_is_named():
    """`serve --batch-window-ms 5` with sla.p99_ms 0.5 was proved and served, and every request that
    waited for a batch missed the bound (trial U): the server now warns with the bound it misses."""
    from graphmode.monitor import window_misses
    r = recipe(sla={"p99_ms": 100, "per_bucket": [{"match": {"batch": 1}, "p50_ms": 4}]})
    why = window_misses(r, 5.0)
    assert why is not None and "sla.per_bucket[0].p50_ms 4 ms" in why and "--batch-window-ms 5" in why
    assert window_misses(r, 3.0) is None and window_misses(r, 0.0) is None and window_misses(recipe(), 5.0) is None


# ---- drift probe -----------------------------------------------------------------------------------

TGT = SlaTarget("sla", None, 10.0)


def slot(probe: SlaDriftProbe, clock: Clock, k: int, ms: float, n: int = 5, base: float = 1000.0,
         width: float = 1.0) -> list[DriftEvent]:
    """n samples of `ms` inside slot k = (base + k*width, base + (k+1)*width)."""
    events = []
    for i in range(n):
        clock.t = base + width * (k + 0.1 + 0.8 * i / n)
        events += probe.observe(ms, TGT)
    return events


def close(probe: SlaDriftProbe, clock: Clock, k: int, base: float = 1000.0, width: float = 1.0):
    clock.t = base + width * (k + 1.05)
    return probe.tick()


def test_drift_needs_n_consecutive_breaching_windows_then_restarts_the_count():
    clock = Clock()
    probe = SlaDriftProbe(window_s=1.0, margin=0.2, consecutive=3, min_samples=5, clock=clock)
    events = []
    for k in range(3):                    # three windows of 5 samples at 13 ms > 10 * 1.2
        events += slot(probe, clock, k, 13.0)
    events += close(probe, clock, 2)
    assert len(events) == 1
    ev = events[0]
    assert (ev.sla, ev.quantile, ev.observed_ms, ev.target_ms, ev.windows) == ("sla", "p99", 13.0, 10.0, 3)
    assert "p99 13.0 ms > sla.p99_ms 10 ms" in ev.describe()
    assert probe.streak == 0
    for k in (3, 4):                      # two more breaching windows: not yet a second event
        events += slot(probe, clock, k, 13.0)
    events += close(probe, clock, 4)
    assert len(events) == 1 and probe.streak == 2


def test_a_clean_window_resets_the_streak_and_the_margin_is_respected():
    clock = Clock()
    probe = SlaDriftProbe(window_s=1.0, margin=0.2, consecutive=2, min_samples=5, clock=clock)
    ev = slot(probe, clock, 0, 13.0)
    ev += slot(probe, clock, 1, 12.0)     # exactly bound * (1 + margin): within the margin
    ev += slot(probe, clock, 2, 13.0)
    ev += close(probe, clock, 2)
    assert ev == [] and probe.streak == 1


def test_thin_windows_are_not_judged_and_idle_time_neither_drifts_nor_hangs():
    clock = Clock()
    probe = SlaDriftProbe(window_s=1.0, margin=0.0, consecutive=2, min_samples=5, clock=clock)
    ev = slot(probe, clock, 0, 50.0)
    ev += slot(probe, clock, 1, 50.0, n=2)   # only 2 samples: neither breach nor reset
    ev += close(probe, clock, 1)
    assert ev == [] and probe.streak == 1
    clock.t += 1e7                           # a long idle period: skipped, not iterated
    assert probe.tick() == [] and probe.streak == 1
    base = probe._next_eval                  # the next window boundary after the gap
    ev = slot(probe, clock, 0, 50.0, base=base)
    assert ev + close(probe, clock, 0, base=base) != []   # completes the streak


def test_sliding_windows_overlap_when_the_step_is_shorter():
    clock = Clock()
    probe = SlaDriftProbe(window_s=2.0, step_s=0.5, margin=0.0, consecutive=3, min_samples=5, clock=clock)
    ev = slot(probe, clock, 0, 30.0, width=0.5)   # 5 slow samples in (1000, 1000.5)
    for k in range(3):                            # they stay in the next windows while < 2 s old
        ev += close(probe, clock, k, width=0.5)
    assert len(ev) == 1 and ev[0].windows == 3 and ev[0].samples == 5


def test_probe_rejects_bad_options():
    with pytest.raises(GraphmodeError, match="margin"):
        SlaDriftProbe(margin=-1)
    with pytest.raises(GraphmodeError, match="window"):
        SlaDriftProbe(window_s=0)


# ---- token bucket and renegotiation ---------------------------------------------------------------

def test_token_bucket_refills_at_its_rate_up_to_capacity():
    clock = Clock()
    b = TokenBucket(2, 0.5, clock=clock)
    assert b.try_take() and b.try_take() and not b.try_take()
    clock.advance(1.0)
    assert not b.try_take()
    clock.advance(1.0)
    assert b.try_take() and not b.try_take()
    clock.advance(100)
    assert b.tokens == 2.0
    b.try_take()
    b.refund()
    assert b.tokens == 2.0


def _event(t: float) -> DriftEvent:
    return DriftEvent(t, "sla", "p99", 50.0, 10.0, 0.2, 3, 100)


def test_a_storm_of_drift_events_triggers_one_renegotiation_per_token():
    clock = Clock()
    applied = []
    r = Renegotiator(["v0", "v1"], lambda i, v, ev: applied.append((i, v)) or True,
                     bucket=TokenBucket(1, 1 / 100, clock=clock))
    outcomes = [r.on_drift(_event(clock())) for _ in range(50)]
    assert applied == [(0, "v0")]
    assert outcomes.count("renegotiated") == 1 and outcomes.count("rate_limited") == 49
    clock.advance(100)
    assert r.on_drift(_event(clock())) == "renegotiated" and applied[-1] == (1, "v1")
    clock.advance(1000)
    assert r.on_drift(_event(clock())) == "no_variant" and r.remaining() == 0
    assert r.bucket.tokens == 1.0          # no_variant did not spend the token


def test_a_busy_reload_gives_the_token_back_and_keeps_the_position():
    clock = Clock()
    r = Renegotiator(["v0"], lambda i, v, ev: False, bucket=TokenBucket(1, 0.0, clock=clock))
    assert r.on_drift(_event(0)) == "busy"
    assert r.position == -1 and r.bucket.tokens == 1.0
    assert r.history[-1]["outcome"] == "busy"


# ---- ContractMonitor --------------------------------------------------------------------------------

def test_failed_and_timed_out_requests_lower_health():
    """Health counted contract violations only: a server whose every request failed with a 500
    reported graphmode_health_score 1.0."""
    mon = ContractMonitor(recipe(), version="v1", target="host", metrics=PromMetrics())
    mon.observe_request(0.001, "batch=1", {"batch": 1})
    mon.request_status("error")
    mon.request_status("timeout")
    mon.request_status("cancelled")          # the client went away: not the model's failure
    assert (mon.operations, mon.violated_operations) == (3, 2) and mon.health_score == pytest.approx(1 / 3)
    assert not mon.violations               # not contract violations: failures


def test_a_version_served_again_continues_its_health_from_the_exported_counters():
    """A reload back to an earlier version made a new monitor whose score restarted at 1.0 while
    graphmode_operations_total of the same version kept counting: the gauge disagreed with it."""
    metrics = PromMetrics()
    first = ContractMonitor(recipe(), version="v1", target="host", metrics=metrics)
    for _ in range(2):
        first.refused("shape")
        first.observe_request(0.001, "batch=1", {"batch": 1})
    again = ContractMonitor(recipe(), version="v1", target="host", metrics=metrics)    # v2 served between
    for _ in range(4):
        again.observe_request(0.001, "batch=1", {"batch": 1})
    assert (again.operations, again.violated_operations) == (8, 2) and again.health_score == pytest.approx(0.75)
    assert total(metrics.text(), "graphmode_health_score", version="v1") == pytest.approx(0.75)
    assert total(metrics.text(), "graphmode_operations_total", version="v1") == 8


def test_monitor_counts_operations_violations_and_health_into_its_own_registry():
    r = recipe(sla={"p99_ms": 10})
    m1, m2 = PromMetrics(), PromMetrics()     # two registries in one process: no clash
    mon = ContractMonitor(r, version="v1", target="host", metrics=m1)
    other = ContractMonitor(r, version="v2", target="host", metrics=m2)
    mon.on_event("compile", {"bucket": "batch=1"})
    mon.on_event("cache_hit", {"bucket": "batch=2"})
    assert mon.observe_request(0.005, "batch=1", {"batch": 1}) == set()
    assert mon.observe_request(0.050, "batch=1", {"batch": 1}) == {"latency"}
    mon.refused("shape")
    with mon.collect() as kinds:              # what a runtime eager fallback reports
        mon.on_event("violation", {"kind": "shape"})
        mon.on_event("fallback", {"reason": "shape outside contract"})
    assert kinds == {"shape", "fallback"}
    mon.observe_request(0.001, "eager", {"batch": 9}, kinds)
    other.refused("input")
    assert mon.operations == 4 and mon.violated_operations == 3
    assert mon.health_score == pytest.approx(0.25)
    assert dict(mon.violations) == {"latency": 1, "shape": 2, "fallback": 1}
    snap = mon.snapshot()
    assert snap["requests"] == {"ok": 3, "contract": 1} and snap["compiles"] == {"compile": 1, "cache_hit": 1}
    assert snap["latency_ms"]["count"] == 3 and snap["latency_ms"]["max"] == pytest.approx(50.0)
    text = m1.text()
    assert total(text, "graphmode_health_score", version="v1") == pytest.approx(0.25)
    assert total(text, "graphmode_operations_total", version="v1") == 4
    assert total(text, "graphmode_contract_violations_total", kind="shape") == 2
    assert total(text, "graphmode_contract_violations_total", kind="latency", bucket="batch=1") == 1
    assert total(text, "graphmode_compile_events_total", event="compile", bucket="batch=1") == 1
    assert total(text, "graphmode_fallback_events_total", bucket="eager") == 1
    assert total(text, "graphmode_requests_total", status="ok") == 3
    assert total(text, "graphmode_request_latency_seconds_count", bucket="batch=1") == 2
    assert total(text, "graphmode_contract_violations_total", version="v2") == 0     # only in m2
    assert total(m2.text(), "graphmode_contract_violations_total", kind="input") == 1


def test_monitor_feeds_the_probe_and_calls_drift_handlers():
    clock = Clock()
    probe = SlaDriftProbe(window_s=1.0, consecutive=1, min_samples=3, margin=0.0, clock=clock)
    metrics = PromMetrics()
    mon = ContractMonitor(recipe(sla={"p99_ms": 10}), version="v", metrics=metrics, probe=probe)
    seen = []
    mon.on_drift(seen.append)
    for _ in range(3):                    # inside the first window (1000, 1001]
        clock.advance(0.3)
        mon.observe_request(0.020, "batch=1", {"batch": 1})
    clock.advance(0.2)
    assert mon.tick() and len(seen) == 1
    assert total(metrics.text(), "graphmode_sla_drift_events_total", sla="sla", quantile="p99") == 1
    assert mon.snapshot()["drift_events"][0]["observed_ms"] == pytest.approx(20.0)


def test_memory_check_counts_plans_over_budget():
    r = recipe(memory={"budget_mb": 1})
    arena = {"batch=1": 100_000, "batch=2": 200_000, "batch=4": 2_000_000}
    cm = SimpleNamespace(recipe=r, target=None,
                         graph=SimpleNamespace(constants={"w": torch.zeros(1000, 100)}),   # 400 kB
                         executable=lambda env: SimpleNamespace(
                             plan=SimpleNamespace(arena_bytes=arena[f"batch={env['batch']}"])))
    metrics = PromMetrics()
    mon = ContractMonitor(r, version="v", metrics=metrics)
    assert mon.check_memory(cm) == ["batch=4"]
    assert mon.operations == 3 and mon.violations["memory"] == 1
    text = metrics.text()
    assert total(text, "graphmode_arena_bytes", bucket="batch=2") == 200_000
    assert total(text, "graphmode_weights_bytes") == 400_000
    assert total(text, "graphmode_contract_violations_total", kind="memory", bucket="batch=4") == 1


# ---- on a real CompiledModel ------------------------------------------------------------------------

class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 4)

    def forward(self, x):
        return torch.relu(self.fc(x))


@pytest.fixture(scope="module")
def mlp_model(tmp_path_factory):
    import graphmode
    torch.manual_seed(0)
    return graphmode.compile(MLP().eval(), recipe(on_violation="eager"),
                             cache_dir=tmp_path_factory.mktemp("cache"))


def test_compiled_model_carries_a_monitor_and_keeps_its_metric_keys(mlp_model):
    cm = mlp_model
    model = monitored(cm, metrics=True)
    assert cm.monitor is model.monitor
    x = torch.randn(3, 8)
    out = model(x=x)
    (ref,) = cm.source.reference({"x": x})          # eager's outputs, flattened
    assert isinstance(out, torch.Tensor) and torch.allclose(out, ref, atol=1e-5)   # a Tensor, as the MLP returns
    model(x=torch.randn(6, 8))                      # outside [1, 4]: eager fallback, counted
    with pytest.raises(ContractViolation):
        model(x=torch.randn(2, 8).double())         # wrong dtype: an input violation
    m = cm.metrics()
    assert {"events", "health_score", "buckets_compiled"} <= set(m)
    c = m["contract"]
    assert c["operations"] == 3 and c["violated_operations"] == 2
    assert c["violations"] == {"shape": 1, "fallback": 1, "input": 1}
    assert c["health_score"] == pytest.approx(1 / 3)
    assert c["compiles"].get("compile", 0) + c["compiles"].get("cache_hit", 0) >= 1
    text = model.monitor.metrics.text()
    assert total(text, "graphmode_requests_total", status="ok", bucket="batch=4") == 1
    assert total(text, "graphmode_requests_total", status="ok", bucket="eager") == 1
    assert total(text, "graphmode_fallback_events_total") == 1


def test_memory_check_counts_what_an_executable_holds_beyond_its_arena():
    """Prepared weight copies and conv workspaces count as the static proof counts them: a
    plan whose arena fits beside the weights but whose packed copies do not is over budget."""
    r = recipe(memory={"budget_mb": 1})
    held = {1: {"arena_bytes": 200_000, "prepared_weights_bytes": 100_000, "workspace_bytes": 0},
            2: {"arena_bytes": 200_000, "prepared_weights_bytes": 400_000, "workspace_bytes": 100_000}}
    cm = SimpleNamespace(recipe=r, target=None,
                         graph=SimpleNamespace(constants={"w": torch.zeros(1000, 100)}),   # 400 kB
                         executable=lambda env: SimpleNamespace(
                             plan=SimpleNamespace(arena_bytes=200_000),
                             memory_report=lambda: dict(held[env["batch"]])))
    mon = ContractMonitor(r, version="v", metrics=PromMetrics())
    assert mon.check_memory(cm, [{"batch": 1}, {"batch": 2}]) == ["batch=2"]      # 1.1 MB > 1 MiB
    assert mon.snapshot()["held_bytes"] == {"batch=1": 300_000, "batch=2": 700_000}


def test_the_exposition_has_no_created_series_and_leaves_the_process_switch_alone():
    """Trial AD: a replica's /metrics carried 20 `_created` gauges under their counters' help
    text: only the CLI's process had turned them off, with prometheus_client's global switch."""
    from prometheus_client import CollectorRegistry, Counter, generate_latest
    m = PromMetrics()
    m.requests.labels("v1", "host", "batch=1", "ok").inc()
    m.latency.labels("v1", "host", "batch=1").observe(0.01)
    text = m.text().decode()
    names = {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}
    assert "graphmode_requests_total" in names and not any(n.endswith("_created") for n in names), names
    own = CollectorRegistry()                 # a library user's own registry keeps prometheus_client's default
    Counter("app_events", "events", registry=own).inc()
    assert b"app_events_created" in generate_latest(own)
