"""The link between ranks, measured, and the cost model's communication time beside it.

`measure_link` runs in every rank process and times `reps` f32 all_reduces of each size the
way a call meets them: before each one every rank computes for `gap_s` (a small matmul loop on
its own threads, as a plan's kernels between two collectives), with no barrier. A barrier
before each all_reduce (what this probe did first) finds both ranks awake and just synchronised,
the best case: on a 2-core host a collective inside a call paid ~6x that, the time for the
scheduler to wake the peer blocked in its receive and give it a core after it had computed
(docs/tensor-parallel.md, "Measuring it"). `link_samples` keeps, of each all_reduce, the least
time any rank spent in it (that rank arrived last: the other's wait for it is not link time,
the rule `link_time` applies to a call), and the mean per size. `graphmode bench
--tensor-parallel` and `graphmode profile` probe after every timed call as many all_reduces
of each size as a call makes (`round_samples`), so the probe and the calls meet the same load. `fit_link` fits the cost
model's ring all_reduce (`recipe/parallel_cost.py`: 2 (n-1)/n * bytes / B + 2 (n-1) L) to those
means, weighting every size by its own time so the small messages decide the latency and the
large ones the bandwidth: the numbers a recipe's `links` entry (or the host target's nominal
`loopback`) should hold; for a plan, `around` keeps the sizes it sends and their neighbours
(the link as its calls meet it). `compute_gap` is the gap a call's own traces show.

`predict_comm` prices the collectives of a rank's sharded graph at one shape on a link, and
`compare` lines them up per collective with what the communicator measured in a call
(`TensorParallelModel.last_comm[r]["per_op"]`): `graphmode bench --tensor-parallel` and
`graphmode profile` print that table.
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Mapping, Sequence

SIZES = (4, 4 << 10, 64 << 10, 512 << 10, 2 << 20)     # bytes of one f32 all_reduce
REPS = 15
Probe = Sequence[Sequence[tuple[int, Sequence[float]]]]     # per rank: (bytes, seconds of each all_reduce) per size


def measure_link(sizes: Sequence[int], reps: int, gap_s: float = 0.0) -> list[tuple[int, list[float]]]:
    """(bytes, seconds of each of `reps` f32 all_reduces) per size on the default process group,
    each after `gap_s` of compute (module doc); every rank must call it with the same arguments."""
    import torch
    import torch.distributed as dist
    out = []
    work = torch.randn(64, 64)
    for nbytes in sizes:
        t = torch.ones(max(1, nbytes // 4), dtype=torch.float32)
        dist.all_reduce(t)                   # first use of this size: buffers, connections
        dist.barrier()                       # the ranks start each size together, then run free
        times = []
        for _ in range(reps):
            _compute(work, gap_s)
            t0 = time.perf_counter()
            dist.all_reduce(t)
            times.append(time.perf_counter() - t0)
        out.append((t.numel() * 4, times))
    return out


def _compute(work: Any, seconds: float) -> None:
    """Keep this rank's threads busy for `seconds`, as a plan's kernels between two collectives."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        work @ work


def link_samples(per_rank: Probe) -> list[tuple[int, float]]:
    """(bytes, mean seconds) per size from every rank's `measure_link`: of each all_reduce the
    least time any rank spent in it (the rank that arrived last), then the mean over reps. The
    mean, not the median: a step's communication is a sum of collectives, and on a shared host
    their times have a long tail (a woken rank that waits a time slice for a core) that the sum
    pays and a median would drop."""
    return [(row[0][0], statistics.fmean(min(ts) for ts in zip(*(times for _, times in row))))
            for row in zip(*per_rank)]


def round_samples(probes: Sequence[Probe]) -> list[tuple[int, float]]:
    """(bytes, seconds) per size from several `measure_link` rounds (one after each timed call):
    each round's `link_samples` mean, then the median over rounds. That is the statistic a call's
    communication is measured with (its collectives summed, the median over calls), so a round
    of as many all_reduces as a call makes meets the long tail as a call does; a mean over every
    round's all_reduces swung by 30% between two runs of MiniLM 1x16 (one 30 ms wake-up in 60)."""
    per_round = [link_samples(p) for p in probes]
    return [(rows[0][0], statistics.median(t for _, t in rows)) for rows in zip(*per_round)]


def compute_gap(calls: Sequence[Sequence[Mapping[str, Any]]]) -> float:
    """Seconds a rank computes between two collectives in a call, median over `calls` (one
    `TensorParallelModel.last_comm` each): the rank that waited least, its run time less its
    time in collectives, spread over the stretches before, between and after them (0 for a
    call with none)."""
    gaps = []
    for ranks in calls:
        r = min(ranks, key=lambda x: x["comm_s"])
        if r["collectives"]:
            gaps.append(max(0.0, r["run_s"] - r["comm_s"]) / (r["collectives"] + 1))
    return statistics.median(gaps) if gaps else 0.0


def around(samples: Sequence[tuple[int, float]], sizes: Sequence[int]) -> list[tuple[int, float]]:
    """The samples a link is fitted to for a plan that sends `sizes`: at each size, and the
    nearest probed size below and above it. On a shared host an all_reduce's time is not
    linear in its size over 4 B-2 MiB (the scheduler's wake-ups, not the wire, set it; a fit
    over every size missed a call's by 57-67% at MiniLM batch 1), so the line is drawn where the
    calls are. All of them when `sizes` is empty or none was probed."""
    got = sorted(samples)
    keep: set[int] = set()
    for size in sizes:
        at = [i for i, (b, _) in enumerate(got) if b == size]
        if at:
            keep.update(i for i in (at[0] - 1, at[0], at[0] + 1) if 0 <= i < len(got))
    return [got[i] for i in sorted(keep)] or got


def fit_link(samples: Sequence[tuple[int, float]], world: int) -> dict[str, float]:
    """{bandwidth_gbps, latency_us, worst_err, bandwidth_resolved}: the ring all_reduce model
    fitted to (bytes, seconds) samples by least squares on relative error; worst_err is the
    largest |model / measured - 1| over the samples. Samples whose time does not grow with
    size, or grows by under a tenth of the latency at the largest (messages too small for the
    wire to show), leave the bandwidth unresolved (bandwidth_resolved False)."""
    import numpy as np
    n = max(2, world)
    b = np.array([float(s[0]) for s in samples])
    t = np.array([float(s[1]) for s in samples])
    a = np.stack([np.ones_like(b), b], axis=1) / t[:, None]          # t = c0 + c1 * bytes, relative
    (c0, c1), *_ = np.linalg.lstsq(a, np.ones_like(t), rcond=None)
    resolved = bool(c1 > 0)
    if not resolved:                 # the times did not grow with size (noise): latency alone
        c0, c1 = float(np.sum(1 / t) / np.sum(1 / t ** 2)), 1e-15
    c0, c1 = max(float(c0), 1e-9), max(float(c1), 1e-15)
    if resolved and c1 * float(b.max()) < 0.1 * c0:     # messages too small for the wire to show: latency decides
        resolved = False
    model = c0 + c1 * b
    return {"bandwidth_gbps": 2 * (n - 1) / n / c1 / 1e9, "latency_us": c0 / (2 * (n - 1)) * 1e6,
            "worst_err": float(np.max(np.abs(model / t - 1))), "bandwidth_resolved": resolved}


def plan_sizes(collectives: Sequence[Any], spec: Any, env: Mapping[str, int]) -> list[int]:
    """The wire bytes of the all_reduces of a rank's sharded graph at `env`: probed beside the
    fixed sizes, so the link fitted is measured at the sizes the calls send."""
    from graphmode.recipe.smt import evaluate
    return sorted({int(evaluate(c.wire_bytes(spec.comm.dtype), dict(env)))
                   for c in collectives if c.op == "all_reduce"})


def predict_comm(collectives: Sequence[Any], spec: Any, env: Mapping[str, int],
                 link: Mapping[str, float] | None = None) -> dict[str, dict[str, float]]:
    """Per collective kind, {calls, bytes, seconds} the cost model gives one step at `env`: the
    collectives of a rank's sharded graph on the group's link (`spec.link_for()`, resolved), or
    on `link` = {bandwidth_gbps, latency_us} when given."""
    from graphmode.recipe.parallel_cost import seconds
    from graphmode.recipe.smt import evaluate
    if link is None:
        _, ls = spec.link_for()
        link = {"bandwidth_gbps": float(ls.bandwidth_gbps), "latency_us": float(ls.latency_us)}
    out: dict[str, dict[str, float]] = {}
    for c in collectives:
        nb = float(evaluate(c.wire_bytes(spec.comm.dtype), dict(env)))
        s = c.count * float(seconds(c.op, nb, spec.tensor, link["bandwidth_gbps"] * 1e9, link["latency_us"] / 1e6,
                                    spec.comm.dtype))
        row = out.setdefault(c.op, {"calls": 0, "bytes": 0.0, "seconds": 0.0})
        row["calls"] += c.count
        row["bytes"] += c.count * nb
        row["seconds"] += s
    return out


def compare(measured: Mapping[str, Mapping[str, float]], predicted: Mapping[str, Mapping[str, float]],
            calibrated: Mapping[str, Mapping[str, float]] | None = None) -> list[dict[str, Any]]:
    """One row per collective kind (and a total): calls, bytes and ms measured vs predicted, err
    = predicted / measured - 1 (and the same on the calibrated link when given)."""
    rows = []
    for op in sorted(set(measured) | set(predicted)) + ["total"]:
        m = _total(measured) if op == "total" else measured.get(op, {})
        p = _total(predicted) if op == "total" else predicted.get(op, {})
        row = {"collective": op, "calls": int(m.get("calls", 0)), "predicted_calls": int(p.get("calls", 0)),
               "bytes": float(m.get("bytes", 0)), "predicted_bytes": float(p.get("bytes", 0)),
               "ms": 1e3 * float(m.get("seconds", 0.0)), "predicted_ms": 1e3 * float(p.get("seconds", 0.0))}
        row["err"] = _err(row["predicted_ms"], row["ms"])
        if calibrated is not None:
            c = _total(calibrated) if op == "total" else calibrated.get(op, {})
            row["calibrated_ms"] = 1e3 * float(c.get("seconds", 0.0))
            row["calibrated_err"] = _err(row["calibrated_ms"], row["ms"])
        rows.append(row)
    return rows


def _total(per_op: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
    return {k: sum(float(r.get(k, 0)) for r in per_op.values()) for k in ("calls", "bytes", "seconds")}


def _err(pred: float, meas: float) -> float | None:
    return pred / meas - 1 if meas > 0 else None


def median_per_op(calls: Sequence[Mapping[str, Mapping[str, float]]]) -> dict[str, dict[str, float]]:
    """Per collective kind, the median over calls of one call's counters (`last_comm[r]["per_op"]`)."""
    ops = {op for c in calls for op in c}
    zero = {"calls": 0, "bytes": 0, "seconds": 0.0}
    return {op: {k: statistics.median(float(c.get(op, zero)[k]) for c in calls) for k in zero} for op in ops}


def link_time(traces: Sequence[Sequence[tuple[str, int, float]]]) -> dict[str, dict[str, float]]:
    """Per collective kind, {calls, bytes, seconds} of one call from every rank's trace of it
    ((collective, bytes, seconds) in order, the same collectives on every rank): each
    collective's time is the least any rank waited in it, the rank that arrived last, whose
    wait is the link's alone."""
    out: dict[str, dict[str, float]] = {}
    for row in zip(*traces):
        op, nb = row[0][0], row[0][1]
        r = out.setdefault(op, {"calls": 0, "bytes": 0, "seconds": 0.0})
        r["calls"] += 1
        r["bytes"] += nb
        r["seconds"] += min(x[2] for x in row)
    return out
