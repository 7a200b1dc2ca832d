"""SLA drift: a sliding-window latency probe, a token bucket and the renegotiation policy.

Everything here takes an injected `clock` (seconds, monotonic) so tests drive time by hand;
nothing sleeps or starts a thread. The server calls `SlaDriftProbe.observe` per request and
`tick` periodically, and hands each `DriftEvent` to a `Renegotiator`, which switches to the
next validated recipe variant at most as often as its `TokenBucket` allows, so a storm of
drift events cannot become a storm of recompiles.
"""
from __future__ import annotations

import math
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any, Callable, Sequence

from graphmode.errors import GraphmodeError

Clock = Callable[[], float]


# ---- SLA targets -----------------------------------------------------------------------------

@dataclass(frozen=True)
class SlaTarget:
    """The latency bounds one request is held to. `key` names the recipe entry they came from."""
    key: str                       # "sla" or "sla.per_bucket[i]"
    p50_ms: float | None = None
    p99_ms: float | None = None


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def sla_target(recipe: Any, dims: dict[str, int] | None) -> SlaTarget | None:
    """The SLA entry that governs a request of `dims`: the first `sla.per_bucket` entry whose
    `match` holds the request's dim values (bounds it leaves out come from the overall
    `sla`), else the overall `sla`; None when the recipe sets no latency bound."""
    sla = getattr(recipe, "sla", None)
    if sla is None:
        return None
    p50, p99 = _num(sla.p50_ms), _num(sla.p99_ms)
    for i, entry in enumerate(sla.per_bucket):
        if dims is None:
            break
        ok = True
        for d, sel in entry.match.items():
            lo, hi = (sel, sel) if isinstance(sel, int) else (sel[0], sel[1])
            if d not in dims or not lo <= dims[d] <= hi:
                ok = False
                break
        if ok:
            e50, e99 = _num(entry.p50_ms), _num(entry.p99_ms)
            return SlaTarget(f"sla.per_bucket[{i}]", e50 if e50 is not None else p50,
                             e99 if e99 is not None else p99)
    if p50 is None and p99 is None:
        return None
    return SlaTarget("sla", p50, p99)


def sla_bounds(recipe: Any) -> list[tuple[str, str, float]]:
    """Every numeric latency bound of the recipe: (entry: "sla" or "sla.per_bucket[i]", "p50" | "p99", ms)."""
    sla = getattr(recipe, "sla", None)
    if sla is None:
        return []
    entries = [("sla", sla)] + [(f"sla.per_bucket[{i}]", e) for i, e in enumerate(sla.per_bucket)]
    return [(name, q, v) for name, e in entries for q in ("p50", "p99")
            if (v := _num(getattr(e, f"{q}_ms"))) is not None]


def window_misses(recipe: Any, window_ms: float) -> str | None:
    """Why a server's batch window alone misses the recipe's tightest latency bound (a request may
    wait that long for its batch before its model call starts; the SLA proof counts the model's
    time, not the server's batching), or None."""
    named = [(v, f"{entry}.{q}_ms") for entry, q, v in sla_bounds(recipe)]
    if window_ms <= 0 or not named or min(named)[0] > window_ms:
        return None
    v, k = min(named)
    return (f"the batch window (--batch-window-ms {window_ms:g}) is at least {k} {v:g} ms: a request that waits "
            "for its batch to fill misses that bound before its model call starts (the recipe's SLA proof counts "
            "the model's time, not the server's batching); lower --batch-window-ms (0 runs each request at once)")


def quantile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank quantile of an ascending sequence (p99 of 100 samples is the 99th)."""
    if not sorted_values:
        return math.nan
    rank = max(1, math.ceil(q * len(sorted_values)))
    return float(sorted_values[min(rank, len(sorted_values)) - 1])


# ---- drift probe -----------------------------------------------------------------------------

@dataclass(frozen=True)
class DriftEvent:
    """`windows` consecutive windows whose `quantile` latency exceeded target * (1 + margin)."""
    time: float
    sla: str                 # the SLA entry that drifted ("sla" / "sla.per_bucket[i]")
    quantile: str            # "p99" | "p50"
    observed_ms: float
    target_ms: float
    margin: float
    windows: int
    samples: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        return (f"{self.quantile} {self.observed_ms:.1f} ms > {self.sla}.{self.quantile}_ms {self.target_ms:g} ms "
                f"+ {self.margin:.0%} for {self.windows} consecutive window(s) ({self.samples} samples)")


class SlaDriftProbe:
    """p50/p99 of request latency over a sliding window, checked every `step_s` seconds.

    A window is evaluated at t = start + k*step over the samples in (t - window_s, t]. It
    *breaches* when, for some SLA entry with at least `min_samples` samples, p99 (or p50)
    exceeds that entry's bound by more than `margin` (0.2 = 20 %); it is *clean* when every
    entry with enough samples is within bounds; with too few samples it is neither and the
    streak is left as it is (an idle server neither drifts nor recovers). `consecutive`
    breaching windows in a row raise one `DriftEvent` and restart the count.
    """

    def __init__(self, *, window_s: float = 10.0, step_s: float | None = None, margin: float = 0.2,
                 consecutive: int = 3, min_samples: int = 10, clock: Clock = time.monotonic,
                 max_samples: int = 200_000):
        if window_s <= 0:
            raise GraphmodeError("the SLA window must be positive", where="sla_window_s", value=window_s)
        if step_s is not None and step_s <= 0:
            raise GraphmodeError("the SLA window step must be positive", where="sla_step_s", value=step_s)
        if margin < 0:
            raise GraphmodeError("the SLA margin must be >= 0", where="sla_margin", value=margin,
                                 fix="0.2 means 20 % over the recipe's bound")
        if consecutive < 1 or min_samples < 1:
            raise GraphmodeError("consecutive windows and min samples must be >= 1", where="sla_windows",
                                 value=(consecutive, min_samples))
        self.window_s = float(window_s)
        self.step_s = float(step_s if step_s is not None else window_s)
        self.margin = float(margin)
        self.consecutive = int(consecutive)
        self.min_samples = int(min_samples)
        self.clock = clock
        self._samples: deque[tuple[float, str, float]] = deque(maxlen=max_samples)
        self._targets: dict[str, SlaTarget] = {}
        self._lock = threading.Lock()
        self.streak = 0
        self.windows_evaluated = 0
        self.last_window: dict[str, dict[str, float]] = {}
        self._next_eval = self.clock() + self.step_s

    def reset(self) -> None:
        with self._lock:
            self._samples.clear()
            self.streak = 0
            self._next_eval = self.clock() + self.step_s

    def observe(self, latency_ms: float, target: SlaTarget | None) -> list[DriftEvent]:
        """Record one request's latency against its SLA entry; returns drift events raised by
        windows that closed before this sample."""
        now = self.clock()
        with self._lock:
            events = self._advance(now)
            if target is not None and (target.p50_ms is not None or target.p99_ms is not None):
                self._targets[target.key] = target
                self._samples.append((now, target.key, float(latency_ms)))
        return events

    def tick(self) -> list[DriftEvent]:
        """Close the windows that ended by now (call periodically so windows close without traffic)."""
        with self._lock:
            return self._advance(self.clock())

    # -- internals
    def _advance(self, now: float) -> list[DriftEvent]:
        events: list[DriftEvent] = []
        while now >= self._next_eval:
            t = self._next_eval
            if not self._samples or self._samples[-1][0] <= t - self.window_s:
                # every later window up to now is empty: skip them (they change nothing)
                skip = max(0, math.floor((now - t) / self.step_s))
                self._next_eval = t + (skip + 1) * self.step_s
                self._samples.clear()
                continue
            ev = self._evaluate(t)
            if ev is not None:
                events.append(ev)
            self._next_eval = t + self.step_s
        return events

    def _evaluate(self, t: float) -> DriftEvent | None:
        lo = t - self.window_s
        while self._samples and self._samples[0][0] <= lo:
            self._samples.popleft()
        by_key: dict[str, list[float]] = {}
        for ts, key, ms in self._samples:
            if ts <= t:
                by_key.setdefault(key, []).append(ms)
        self.windows_evaluated += 1
        worst: tuple[float, str, str, float, float, int] | None = None   # (ratio, key, q, obs, target, n)
        judged = False
        stats: dict[str, dict[str, float]] = {}
        for key, vals in by_key.items():
            if len(vals) < self.min_samples:
                continue
            judged = True
            vals.sort()
            tgt = self._targets[key]
            p50, p99 = quantile(vals, 0.5), quantile(vals, 0.99)
            stats[key] = {"p50_ms": p50, "p99_ms": p99, "samples": len(vals)}
            for q, obs, bound in (("p99", p99, tgt.p99_ms), ("p50", p50, tgt.p50_ms)):
                if bound is not None and obs > bound * (1.0 + self.margin):
                    ratio = obs / bound
                    if worst is None or ratio > worst[0]:
                        worst = (ratio, key, q, obs, bound, len(vals))
        self.last_window = stats
        if not judged:
            return None
        if worst is None:
            self.streak = 0
            return None
        self.streak += 1
        if self.streak < self.consecutive:
            return None
        windows, self.streak = self.streak, 0
        _, key, q, obs, bound, n = worst
        return DriftEvent(t, key, q, obs, bound, self.margin, windows, n)


# ---- rate limiting and renegotiation ----------------------------------------------------------

class TokenBucket:
    """`capacity` tokens, refilled at `refill_per_s`; `try_take` never blocks."""

    def __init__(self, capacity: float = 1.0, refill_per_s: float = 1.0 / 300.0, *, clock: Clock = time.monotonic):
        if capacity < 1 or refill_per_s < 0:
            raise GraphmodeError("a token bucket needs capacity >= 1 and a refill rate >= 0",
                                 where="renegotiate", value=(capacity, refill_per_s))
        self.capacity = float(capacity)
        self.refill_per_s = float(refill_per_s)
        self.clock = clock
        self._tokens = float(capacity)
        self._last = clock()
        self._lock = threading.Lock()

    def _refill(self) -> None:
        now = self.clock()
        self._tokens = min(self.capacity, self._tokens + (now - self._last) * self.refill_per_s)
        self._last = now

    @property
    def tokens(self) -> float:
        with self._lock:
            self._refill()
            return self._tokens

    def try_take(self, n: float = 1.0) -> bool:
        with self._lock:
            self._refill()
            if self._tokens >= n:
                self._tokens -= n
                return True
            return False

    def refund(self, n: float = 1.0) -> None:
        with self._lock:
            self._tokens = min(self.capacity, self._tokens + n)


OUTCOMES = ("renegotiated", "rate_limited", "no_variant", "busy")


class Renegotiator:
    """Moves to the next validated variant on drift, at most as often as `bucket` allows.

    `apply(index, variant, event) -> bool` starts the switch (compile, warm up, swap) and says
    whether it started; False (e.g. a reload already running) gives the token back. A
    variant is used once, in order: after variant i the next drift goes to variant i + 1,
    also when switching to i failed later (a broken variant is skipped, not retried).
    """

    def __init__(self, variants: Sequence[Any], apply: Callable[[int, Any, DriftEvent], bool], *,
                 bucket: TokenBucket | None = None):
        self.variants = list(variants)
        self.apply = apply
        self.bucket = bucket or TokenBucket()
        self.position = -1                    # -1: still on the recipe the server started with
        self.history: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    def remaining(self) -> int:
        return len(self.variants) - 1 - self.position

    def on_drift(self, event: DriftEvent) -> str:
        with self._lock:
            nxt = self.position + 1
            if nxt >= len(self.variants):
                outcome = "no_variant"
            elif not self.bucket.try_take():
                outcome = "rate_limited"
            elif self.apply(nxt, self.variants[nxt], event):
                self.position = nxt
                outcome = "renegotiated"
            else:
                self.bucket.refund()
                outcome = "busy"
            self.history.append({"time": event.time, "event": event.to_dict(), "outcome": outcome,
                                 "variant": nxt if outcome == "renegotiated" else None})
            if len(self.history) > 1000:
                del self.history[:500]
            return outcome
