"""Autoscaling the replicas of `graphmode serve --replicas` on the recipe's SLA.

The contract monitor of every replica already counts what the decision needs: its request
latency histogram (`graphmode_request_latency_seconds`) and its queue depth (requests waiting
to be batched, a decoder's sequences waiting for KV pages). Each replica pushes that registry
to the cluster's coordinator every second (cluster_control). Every `window_s` the coordinator
turns two successive pushes into one window per replica (`window`: the requests answered in
between, their p99 from the histogram's difference, the queue depth now) and `decide`s:

  * **up** one replica when, for `up_windows` windows in a row, some replica's p99 was over
    the recipe's `sla.p99_ms` by more than `margin` (with at least `min_samples` requests
    behind it), or the mean queue depth per replica was over `queue_bound`;
  * **down** one when, for `down_windows` windows in a row (longer: hysteresis), every p99
    was under `down_fraction` of the SLA and the queue under `down_fraction` of its bound
    (an idle cluster counts as under);
  * **hold** otherwise, and while a replica is starting or stopping (the running count is
    not the target yet): the streaks start again once the new count serves;
  * always within `min_replicas` .. `max_replicas`.

`decide` is a pure function of (rule, previous state, windows, running and target counts).
Ray Serve applies the result through its own mechanism: `sla_policy` is the deployment's
custom autoscaling policy (`autoscaling_config.policy`), which Ray's controller calls about
every 0.1 s; it asks the coordinator without blocking the controller and returns the last
answer. This module imports nothing of graphmode at module level: Ray copies it (by value)
into its controller.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any, Mapping

LATENCY = "graphmode_request_latency_seconds"
QUEUES = ("graphmode_queue_depth", "graphmode_num_requests_waiting")


@dataclass(frozen=True)
class ScaleRule:
    """When to add or remove a replica (see the module's docstring)."""
    min_replicas: int
    max_replicas: int
    sla_p99_ms: float | None          # the recipe's sla.p99_ms; None: the queue depth alone decides
    queue_bound: float                # waiting requests per replica (mean) above which it scales up
    margin: float = 0.2               # up when p99 > SLA * (1 + margin)
    up_windows: int = 3
    down_windows: int = 15
    down_fraction: float = 0.5        # "well under": p99 < SLA * this and queue <= bound * this
    min_samples: int = 10             # a replica's p99 counts only with this many requests in the window
    window_s: float = 2.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class ReplicaWindow:
    """One replica over one window."""
    requests: float                   # answered in the window
    p99_ms: float | None              # None: no request answered
    queue_depth: float                # waiting now


@dataclass(frozen=True)
class ScaleState:
    """The autoscaler's last decision, its streaks, and why (shown in GET /v1/recipe)."""
    desired: int
    running: int = 0
    over: int = 0                     # windows in a row over the SLA or the queue bound
    under: int = 0                    # windows in a row well under both
    why: str = "no window judged yet"
    windows: int = 0
    p99_ms: float | None = None       # the worst replica's, last window
    queue_depth: float | None = None  # mean per replica, last window
    changed: str | None = None        # why the count last changed

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for k in ("p99_ms", "queue_depth"):
            d[k] = round(d[k], 3) if d[k] is not None else None
        return d


def decide(rule: ScaleRule, state: ScaleState, windows: Mapping[str, ReplicaWindow], running: int,
           target: int) -> ScaleState:
    """The replica count to aim for after one more window (see the module's docstring)."""
    lo, hi = rule.min_replicas, rule.max_replicas
    clamp = min(hi, max(lo, target))
    base = replace(state, running=running, windows=state.windows + 1)
    if running != target:
        return replace(base, desired=clamp, over=0, under=0,
                       why=f"waiting: {running} replica(s) serving, {target} asked for")
    if not windows:
        return replace(base, desired=clamp, why="waiting: no metrics from the replicas yet")
    judged = {r: w.p99_ms for r, w in windows.items() if w.p99_ms is not None and w.requests >= rule.min_samples}
    worst = max(judged, key=lambda r: judged[r]) if judged else None
    p99 = judged[worst] if worst is not None else None
    queue = sum(w.queue_depth for w in windows.values()) / len(windows)
    sla = rule.sla_p99_ms
    causes = []
    if sla is not None and p99 is not None and p99 > sla * (1 + rule.margin):
        causes.append(f"p99 {p99:.1f} ms on replica {worst} > sla.p99_ms {sla:g} ms + {rule.margin:.0%}")
    if queue > rule.queue_bound:
        causes.append(f"queue depth {queue:.1f} per replica > {rule.queue_bound:g}")
    calm = (not causes and queue <= rule.queue_bound * rule.down_fraction
            and (sla is None or p99 is None or p99 < sla * rule.down_fraction))
    over, under = (base.over + 1 if causes else 0), (base.under + 1 if calm else 0)
    seen = replace(base, over=over, under=under, p99_ms=p99, queue_depth=queue)
    state = _judged(rule, seen, causes, calm, clamp, p99, queue)
    return replace(state, changed=state.why) if state.desired != clamp else state


def _judged(rule: ScaleRule, seen: ScaleState, causes: list[str], calm: bool, clamp: int, p99: float | None,
            queue: float) -> ScaleState:
    lo, hi, over, under = rule.min_replicas, rule.max_replicas, seen.over, seen.under
    if causes:
        cause = " and ".join(causes)
        if over < rule.up_windows:
            return replace(seen, desired=clamp, why=f"over ({over} of {rule.up_windows} windows): {cause}")
        if clamp >= hi:
            return replace(seen, desired=hi, over=0, why=f"at max_replicas {hi}: {cause}")
        return replace(seen, desired=clamp + 1, over=0, why=f"up to {clamp + 1}: {cause} for {over} windows")
    if calm:
        quiet = ("idle" if p99 is None else f"p99 {p99:.1f} ms") + f", queue depth {queue:.1f} per replica"
        if under < rule.down_windows:
            return replace(seen, desired=clamp, why=f"under ({under} of {rule.down_windows} windows): {quiet}")
        if clamp <= lo:
            return replace(seen, desired=lo, under=0, why=f"at min_replicas {lo}: {quiet}")
        return replace(seen, desired=clamp - 1, under=0, why=f"down to {clamp - 1}: {quiet} for {under} windows")
    return replace(seen, desired=clamp, why="within the SLA" + (f" (p99 {p99:.1f} ms)" if p99 is not None else ""))


def sla_p99(recipe: Any) -> float | None:
    """The recipe's overall `sla.p99_ms`, the autoscaler's bound (per-bucket entries and p50
    bounds are the drift probe's, not used here)."""
    value = getattr(getattr(recipe, "sla", None), "p99_ms", None)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


# ---- windows out of the replicas' Prometheus registries ---------------------------------------

@dataclass(frozen=True)
class Reading:
    """What one push of a replica's registry says: its latency histogram (cumulative count per
    upper bound, summed over recipe versions and buckets) and its queue depth."""
    buckets: tuple[tuple[float, float], ...]
    queue_depth: float


def reading(text: bytes) -> Reading:
    from prometheus_client.parser import text_string_to_metric_families
    buckets: dict[float, float] = {}
    queue = 0.0
    for fam in text_string_to_metric_families(text.decode()):
        if fam.name == LATENCY:
            for s in fam.samples:
                if s.name == LATENCY + "_bucket":
                    le = float(s.labels["le"])
                    buckets[le] = buckets.get(le, 0.0) + s.value
        elif fam.name in QUEUES:
            queue += sum(s.value for s in fam.samples)
    return Reading(tuple(sorted(buckets.items())), queue)


def window(before: Reading | None, now: Reading) -> ReplicaWindow:
    """The requests answered between two readings of one replica and their p99 (a counter that
    went back, a restarted process, counts from zero)."""
    old = dict(before.buckets) if before is not None else {}
    delta = [(le, n - old.get(le, 0.0)) for le, n in now.buckets]
    if any(d < 0 for _, d in delta):
        delta = list(now.buckets)
    count = delta[-1][1] if delta else 0.0
    p99 = histogram_quantile(0.99, delta)
    return ReplicaWindow(count, p99 * 1e3 if p99 is not None else None, now.queue_depth)


def histogram_quantile(q: float, cumulative: list[tuple[float, float]]) -> float | None:
    """Prometheus' histogram_quantile: linear within the bucket that holds rank q * count; a
    rank in the +Inf bucket is the largest finite bound. None for an empty histogram."""
    if not cumulative or cumulative[-1][1] <= 0:
        return None
    rank = q * cumulative[-1][1]
    lower, below = 0.0, 0.0
    for le, n in cumulative:
        if n >= rank:
            if math.isinf(le):
                return lower
            return lower + (le - lower) * ((rank - below) / (n - below) if n > below else 1.0)
        lower, below = le, n
    return lower


# ---- Ray Serve's side: the deployment's custom autoscaling policy -----------------------------

def sla_policy(ctx: Any) -> tuple[int, dict[str, Any]]:
    """Ray Serve's autoscaling policy for the replicas, called by Ray's controller about every
    0.1 s. Ray copies this function by value, with the globals it names, into its controller
    and pickles it again with the deployment's config: so it holds nothing itself and hands
    over to cluster_control.ask_coordinator, imported (by name) in the controller."""
    from graphmode.serve.cluster_control import ask_coordinator
    return ask_coordinator(ctx)
