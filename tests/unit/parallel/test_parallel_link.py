"""The loopback link fit and the communication comparison of `graphmode bench --tensor-parallel`
and `graphmode profile` (graphmode/parallel/link.py): pure arithmetic, no ranks."""
from __future__ import annotations

import pytest
import sympy

import graphmode.recipe  # noqa: F401  (first: the recipe package and graphmode.parallel import each other)
from graphmode.recipe.parallel_cost import Collective
from graphmode.parallel.link import (around, compare, compute_gap, fit_link, link_samples, link_time, median_per_op,
                                     plan_sizes, predict_comm, round_samples)
from graphmode.recipe.parallel_spec import ParallelSpec


def spec(bw: float = 2.0, lat: float = 50.0, dtype: str = "f32") -> ParallelSpec:
    return ParallelSpec.model_validate({"tensor": 2, "device_group": ["a", "b"],
                                        "links": {"lo": {"bandwidth_gbps": bw, "latency_us": lat}},
                                        "comm": {"dtype": dtype}})


def test_the_fit_recovers_the_ring_model_it_was_sampled_from():
    bw, lat, n = 3.0e9, 80e-6, 2
    samples = [(b, 2 * (n - 1) / n * b / bw + 2 * (n - 1) * lat) for b in (4, 4096, 65536, 1 << 20, 4 << 20)]
    fit = fit_link(samples, n)
    assert fit["bandwidth_gbps"] == pytest.approx(3.0, rel=1e-6)
    assert fit["latency_us"] == pytest.approx(80.0, rel=1e-6)
    assert fit["worst_err"] < 1e-6 and fit["bandwidth_resolved"]


def test_times_that_do_not_grow_with_size_fit_the_latency_alone():
    fit = fit_link([(4, 2e-3), (4096, 1e-3), (1 << 20, 1e-3)], 2)     # noise: the largest is not the slowest
    assert not fit["bandwidth_resolved"] and fit["bandwidth_gbps"] > 1e5
    assert 1e-3 / 2 * 1e6 < fit["latency_us"] < 2e-3 / 2 * 1e6


def test_a_plans_link_is_fitted_at_the_sizes_it_sends_and_their_neighbours():
    """The probe of a busy 2-core host (MiniLM 1x16, ms): not linear over 4 B-2 MiB; a fit over
    every size priced the call's 24 KiB all_reduces at a third of the probe's own 1.31 ms."""
    samples = [(4, 0.258e-3), (4096, 1.025e-3), (24576, 1.306e-3), (65536, 1.69e-3), (524288, 2.952e-3),
               (2097152, 2.801e-3)]
    near = around(samples, [24576])
    assert [b for b, _ in near] == [4096, 24576, 65536]
    local, every = fit_link(near, 2), fit_link(samples, 2)

    def at(fit, b):
        return (b / (fit["bandwidth_gbps"] * 1e9) + 2 * fit["latency_us"] * 1e-6) * 1e3
    assert at(local, 24576) == pytest.approx(1.306, rel=0.1)
    assert at(every, 24576) < 0.6 * 1.306
    assert [b for b, _ in around(samples, [4, 2097152])] == [4, 4096, 524288, 2097152]   # the ends: one neighbour
    assert around(samples, []) == around(samples, [100]) == sorted(samples)     # none probed: every size


def test_probe_samples_keep_each_all_reduces_least_wait_over_ranks_then_the_mean():
    r0 = [(4, [1.0, 5.0, 2.0]), (8, [3.0, 3.0, 9.0])]
    r1 = [(4, [4.0, 1.0, 6.0]), (8, [1.0, 7.0, 8.0])]      # all_reduce i of a size: min over ranks
    assert link_samples([r0, r1]) == [(4, pytest.approx(4 / 3)), (8, pytest.approx(4.0))]   # the tail counts


def test_compute_gap_is_the_least_waiting_ranks_compute_per_stretch_median_over_calls():
    def call(run, comm, n=3):
        return [{"run_s": run, "comm_s": comm, "collectives": n},
                {"run_s": run, "comm_s": comm + 1.0, "collectives": n}]
    calls = [call(10.0, 2.0), call(6.0, 2.0), call(14.0, 2.0)]
    assert compute_gap(calls) == pytest.approx((10.0 - 2.0) / 4)   # 3 collectives: 4 stretches around them
    assert compute_gap([call(1.0, 0.0, 0)]) == 0.0 and compute_gap([]) == 0.0


def test_predicted_communication_is_the_cost_models_ring_per_collective_kind():
    s = sympy.Symbol("seq")
    cols = [Collective("all_reduce", 2 * s * 32, 32, 5), Collective("all_gather", 2 * s * 100, 100, 1)]
    p = predict_comm(cols, spec(), {"seq": 16})
    ar_bytes = 4 * 2 * 16 * 32
    assert p["all_reduce"]["calls"] == 5 and p["all_reduce"]["bytes"] == 5 * ar_bytes
    assert p["all_reduce"]["seconds"] == pytest.approx(5 * (ar_bytes / 2e9 + 2 * 50e-6))
    ag_bytes = 4 * 2 * 16 * 100
    assert p["all_gather"]["seconds"] == pytest.approx(0.5 * ag_bytes / 2e9 + 50e-6)
    assert plan_sizes(cols, spec(), {"seq": 16}) == [ar_bytes]        # the link probe adds the plan's own sizes
    on = predict_comm(cols, spec(), {"seq": 16}, {"bandwidth_gbps": 1.0, "latency_us": 200.0})
    assert on["all_reduce"]["seconds"] == pytest.approx(5 * (ar_bytes / 1e9 + 2 * 200e-6))


def test_compare_lines_up_measured_and_predicted_with_a_total():
    measured = {"all_reduce": {"calls": 5, "bytes": 100, "seconds": 0.002}}
    predicted = {"all_reduce": {"calls": 5, "bytes": 100, "seconds": 0.001},
                 "all_gather": {"calls": 1, "bytes": 10, "seconds": 0.001}}
    rows = compare(measured, predicted, measured)
    assert [r["collective"] for r in rows] == ["all_gather", "all_reduce", "total"]
    ar = rows[1]
    assert ar["ms"] == pytest.approx(2.0) and ar["err"] == pytest.approx(-0.5) and ar["calibrated_err"] == 0
    assert rows[0]["err"] is None                       # nothing measured: no error to state
    assert rows[2]["calls"] == 5 and rows[2]["predicted_calls"] == 6 and rows[2]["err"] == pytest.approx(0.0)


def test_median_per_op_over_calls():
    calls = [{"all_reduce": {"calls": 5, "bytes": 10, "seconds": s}} for s in (1.0, 3.0, 2.0)]
    assert median_per_op(calls)["all_reduce"] == {"calls": 5, "bytes": 10, "seconds": 2.0}


def test_link_time_takes_each_collectives_least_wait_over_ranks():
    r0 = [("all_reduce", 64, 0.005), ("all_reduce", 64, 0.001), ("all_gather", 128, 0.002)]
    r1 = [("all_reduce", 64, 0.001), ("all_reduce", 64, 0.004), ("all_gather", 128, 0.003)]
    t = link_time([r0, r1])
    assert t["all_reduce"] == {"calls": 2, "bytes": 128, "seconds": pytest.approx(0.002)}
    assert t["all_gather"] == {"calls": 1, "bytes": 128, "seconds": pytest.approx(0.002)}


def test_probe_rounds_are_each_a_mean_then_the_median_over_rounds_as_calls_are_measured():
    round1 = [[(4, [1.0, 3.0]), (8, [2.0])], [(4, [3.0, 1.0]), (8, [4.0])]]       # per rank: (bytes, times)
    round2 = [[(4, [5.0, 5.0]), (8, [6.0])], [(4, [7.0, 9.0]), (8, [0.5])]]
    round3 = [[(4, [30.0, 2.0]), (8, [1.0])], [(4, [30.0, 2.0]), (8, [1.0])]]    # one long wake-up
    # min over ranks per all_reduce, each round's mean (1, 5, 16 | 2, 0.5, 1), the median of the rounds
    assert round_samples([round1, round2, round3]) == [(4, 5.0), (8, 1.0)]
