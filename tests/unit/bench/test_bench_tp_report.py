"""`graphmode bench --tensor-parallel`'s Markdown (graphmode/bench/tensor_parallel.py): the
calibrated column names the link measured as the calls meet it, per shape. No ranks."""
from __future__ import annotations

from graphmode.bench.tensor_parallel import markdown


def _link(gap_ms: float, bw: float, lat: float) -> dict:
    return {"gap_ms": gap_ms, "samples": [{"bytes": 4, "ms": 0.2}, {"bytes": 24576, "ms": 0.5}], "bandwidth_gbps": bw,
            "latency_us": lat, "worst_err": 0.1,
            "nominal": {"name": "loopback", "bandwidth_gbps": 1.0, "latency_us": 100.0}}


def test_the_report_shows_the_back_to_back_link_and_each_shapes_link_as_the_calls_meet_it():
    comm = [{"collective": "all_reduce", "calls": 13, "bytes": 319488.0, "ms": 10.0, "predicted_ms": 3.0, "err": -0.7,
             "calibrated_ms": 9.0, "calibrated_err": -0.1},
            {"collective": "total", "calls": 13, "bytes": 319488.0, "ms": 10.0, "predicted_ms": 3.0, "err": -0.7,
             "calibrated_ms": 9.0, "calibrated_err": -0.1}]
    row = {"model": "minilm", "shape": "1x16", "tp1_ms": 4.0, "tp2_ms": 20.0, "speedup": 0.2,
           "rank_run_ms": [18.0, 18.5],
           "ipc_ms": 1.5, "weights_mb_whole": 90.0, "weights_mb_per_rank": [45.0, 45.0], "rel_l2_vs_tp1": 1e-6,
           "comm": comm, "link": _link(0.6, 1.5, 340.0)}
    res = {"rows": [row], "link": _link(0.0, 3.0, 220.0),
           "meta": {"world": 2, "threads_tp1": 2, "threads_per_rank": 1, "iters": 20, "loadavg_start": [1.0, 1.0, 1.0],
                    "loadavg_end": [1.0, 1.0, 1.0]}}
    md = markdown(res)
    assert "| minilm | 1x16 | all_reduce | 13 | 319488 | 10.000 | 3.000 | -70% | 9.000 | -10% |" in md
    assert "back to back: 3.00 GB/s, 220 us" in md
    assert "- minilm 1x16: 0.60 ms apart, 1.50 GB/s, 340 us" in md


def test_profile_names_no_bandwidth_when_the_probe_did_not_resolve_one(capsys):
    from graphmode.cli.bench_tp import print_tp_profile
    comm = [{"collective": "total", "calls": 1, "bytes": 64.0, "ms": 1.0, "predicted_ms": 0.2, "err": -0.8,
             "calibrated_ms": 0.9, "calibrated_err": -0.1}]
    prof = {"model": "m", "bucket": {"batch": 1}, "runs": 3, "call_ms": 2.0, "rank_run_ms": [1.5, 1.5],
            "weights_mb_per_rank": [1.0, 1.0], "comm": comm}
    print_tp_profile([dict(prof, link=dict(_link(0.2, 2.0, 300.0), bandwidth_resolved=True))])
    assert "links: {loopback: {bandwidth_gbps: 2, latency_us: 300}}" in " ".join(capsys.readouterr().out.split())
    print_tp_profile([dict(prof, link=dict(_link(0.2, 1e6, 300.0), bandwidth_resolved=False))])
    out = " ".join(capsys.readouterr().out.split())
    assert "the bandwidth not resolved" in out and "links: {" not in out
