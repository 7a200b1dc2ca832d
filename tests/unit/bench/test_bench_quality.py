"""Benchmark rows say when they are not measurements: load above the cores, a starved
process, rounds that disagree, implausible ratios, eager fallbacks, --quick. The machine's
state is fed in through `Probe` (a load average and a CPU clock the test controls) or as
synthetic rows; nothing here asserts on how fast anything ran."""
from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
import torch

from graphmode.bench import floors, harness
from graphmode.bench.harness import BenchResult
from graphmode.bench.models import ModelCase
from graphmode.bench import quality
from graphmode.bench.quality import RATIO_CAP, Probe, judge, warning_lines
from graphmode.bench.report import bars, markdown, rich_table

TINY = f"{Path(__file__).resolve().parent / 'test_bench.py'}:tiny_mlp"
# a quiet machine whatever the host's load: its CPU clock moves with the wall clock, its threads never
# wait for a CPU (never starved)
QUIET = Probe(loadavg=lambda: [0.1, 0.1, 0.1], cpu_time=time.perf_counter, waited=lambda: 0.0, cores=2)


def _row(engine: str, median: float, **kw) -> dict:
    r = {"model": "m", "model_name": "m", "shape": [1, 16], "engine": engine, "label": engine, "status": "ok",
         "reason": None, "skipped": False, "threads": 2, "median_ms": median, "p90_ms": median, "spread": 1.05,
         "load_max": 0.5, "cpu_per_wall": 1.9, "eager_fallback": None, "eager_islands": 0, "rel_l2_err": 0.0,
         "numerics_ok": True}
    r.update(kw)
    return r


def _judged(rows: list[dict], cores: int = 2, quick: bool = False) -> dict[str, dict]:
    harness._ratios(rows)
    judge(rows, cores, quick=quick)
    return {r["label"]: r for r in rows}


def _result(rows: list[dict], **meta) -> BenchResult:
    m = {"date": "2026-12-01T00:00:00+00:00", "cpu_model": "cpu", "cores": 2, "usable_cores": 2, "threads": 2,
         "versions": {"torch": "x"}, "method": {"warmup": 1, "iters": 3, "min_iters": 3, "budget_s_per_shape": 1.0,
                                                 "rewarm": 0}, "warnings": warning_lines(rows, meta.get("quick"))}
    m.update(meta)
    return BenchResult(rows, m)


def test_clean_rows_carry_no_flags():
    by = _judged([_row("eager", 10.0), _row("onnxruntime", 6.0), _row("graphmode", 5.0)])
    assert all(r["flags"] == [] and r["notes"] == [] for r in by.values())
    assert by["graphmode"]["speedup_vs_eager"] == pytest.approx(2.0)
    assert [b["kind"] for b in bars(_result(list(by.values())))] == ["bar"] * 3


def test_the_176x_row_is_flagged_and_not_charted_as_a_measurement():
    """The issue's case: under load, graphmode charted 176x over eager with no warning."""
    rows = [_row("eager", 176.0, load_max=5.6, spread=2.4), _row("onnxruntime", 90.0, load_max=5.6),
            _row("graphmode", 1.0, load_max=5.6)]
    by = _judged(rows)
    g = by["graphmode"]
    assert {"load", "ratio", "gap", "baseline"} <= set(g["flags"])
    assert "beyond the 20x sanity bound" in " ".join(g["notes"]) and "5.60 on 2" in " ".join(g["notes"])
    assert set(by["eager"]["flags"]) == {"load", "spread"}
    chart = {b["label"]: b for b in bars(_result(rows))}
    assert chart["graphmode"]["kind"] == "capped" and chart["graphmode"]["value"] == RATIO_CAP
    assert chart["onnxruntime"]["kind"] == "flagged"          # its ratio leans on a flagged eager
    warn = warning_lines(rows)
    assert len(warn) == 3 and warn[2].startswith("m 1x16 graphmode: ")
    md = markdown(_result(rows))
    assert "| **graphmode** | ok | **1.00** |" in md and md.count("| load,ratio,gap,baseline |") == 1
    assert "- `ratio`: more than 20x" in md and "Notes on flagged rows" in md
    table, _ = rich_table(_result(rows))
    assert "flags" in [c.header for c in table.columns]


@pytest.mark.parametrize("kw, flag", [({"load_max": 2.5}, "load"), ({"threads": 4}, "load"),
                                      ({"cpu_per_wall": 0.4}, "starved"), ({"spread": 1.8}, "spread")])
def test_each_timing_condition_flags_its_row(kw, flag):
    by = _judged([_row("eager", 10.0), _row("graphmode", 8.0, **kw)])
    assert by["graphmode"]["flags"] == [flag] and by["eager"]["flags"] == []
    assert _judged([_row("eager", 10.0), _row("graphmode", 8.0, **kw)], cores=8)["graphmode"]["flags"] == (
        [] if flag == "load" else [flag])           # on 8 cores neither load 2.5 nor 4 threads is too many


def test_starved_is_time_waited_for_a_cpu_whatever_the_thread_count():
    """A 2-thread engine given one core gets ~1 CPU-s per wall-s (not under 0.75) but its threads
    waited ~1 s per wall-s on the run queue: starved. An engine whose threads idled (0.4 CPU-s
    per wall-s) without waiting is not."""
    by = _judged([_row("eager", 10.0), _row("graphmode", 8.0, cpu_per_wall=1.0, waited_per_wall=0.95),
                  _row("onnxruntime", 9.0, cpu_per_wall=0.4, waited_per_wall=0.01)])
    assert by["graphmode"]["flags"] == ["starved"] and "waited for a CPU 0.95 s" in by["graphmode"]["notes"][0]
    assert by["onnxruntime"]["flags"] == [] and by["eager"]["flags"] == []


def test_the_run_queue_wait_is_summed_over_the_process_s_threads(tmp_path):
    from graphmode.targets.host import run_queue_wait_s
    for tid, stat in (("101", "5000 2500000000 7\n"), ("102", "9 500000000 1\n"), ("103", "garbage")):
        (tmp_path / tid).mkdir()
        (tmp_path / tid / "schedstat").write_text(stat)
    assert run_queue_wait_s(tmp_path) == pytest.approx(3.0)
    assert run_queue_wait_s(tmp_path / "missing") is None
    live = run_queue_wait_s()
    assert live is None or live >= 0.0


def test_a_busy_probe_s_run_queue_wait_flags_the_harness_s_rows():
    """The real harness with a run-queue clock that grows a second per reading: every timed
    call waited; the row says how much and is starved."""
    from graphmode.capture.spec import resolve_model_spec
    case = ModelCase(TINY, "tiny", resolve_model_spec(TINY), [{"batch": 2}])
    cfg = harness.BenchConfig(engines=[("eager", None)], threads=1, iters=3, min_iters=3, warmup=1, rewarm=0)
    clock = iter(range(10**6))
    probe = Probe(loadavg=lambda: [0.1, 0.1, 0.1], cpu_time=time.perf_counter, waited=lambda: float(next(clock)),
                  cores=2)
    (row,) = harness.run_bench([case], cfg, probe=probe).rows
    assert row["waited_per_wall"] > 1 and "starved" in row["flags"], row


def test_eager_fallback_row_has_no_ratio_and_no_bar():
    rows = [_row("eager", 10.0), _row("graphmode", 10.1, eager_fallback="20/20 calls (shape outside contract)")]
    by = _judged(rows)
    g = by["graphmode"]
    # timing flags (load/starved/spread) depend on the host; the verdict flag must not
    assert [f for f in g["flags"] if f not in quality.TIMING_FLAGS] == ["fallback"]
    assert g["ratio_vs_eager"] is None and g["speedup_vs_eager"] is None
    assert "not graph-mode speed" in g["notes"][0]
    assert bars(_result(rows))[1]["kind"] == "eager fallback"
    md = markdown(_result(rows))
    assert "| graphmode (eager fallback) |" in md and "**graphmode" not in md


def test_quick_rows_say_they_are_not_measurements():
    rows = [_row("eager", 10.0, load_max=7.0), _row("graphmode", 0.05, rel_l2_err=3e-8)]
    by = _judged(rows, quick=True)
    assert "quick" in by["graphmode"]["flags"] and "ratio" in by["graphmode"]["flags"]
    assert warning_lines(rows, quick=True) == []              # timing flags of a smoke run are not warned about
    res = _result(rows, quick=True)
    assert [(b["kind"], b["value"]) for b in bars(res)] == [("bar", 0.0), ("bar", 3e-8)]   # numerics, not ratios
    assert "**Not a measurement.**" in markdown(res)
    table, _ = rich_table(res)
    assert "timings are not measurements" in str(table.title)


def test_hybrid_islands_are_named_but_keep_their_ratio():
    rows = [_row("eager", 10.0), _row("graphmode", 6.0, eager_islands=1,
                                      execution={"mode": "hybrid", "island_ops": ["aten.gelu.default"]})]
    g = _judged(rows)["graphmode"]
    assert g["flags"] == ["islands"] and g["notes"] == ["islands: hybrid: 1 op(s) ran as eager islands "
                                                        "(aten.gelu.default)"]
    assert g["speedup_vs_eager"] == pytest.approx(10 / 6, rel=1e-3) and bars(_result(rows))[1]["kind"] == "bar"


def test_harness_flags_rows_from_an_injected_busy_machine():
    """The real harness on the tiny model with a probe that reports load 9 on 2 cores and a
    CPU clock that never moves (the process got no CPU): every row is flagged."""
    from graphmode.capture.spec import resolve_model_spec
    case = ModelCase(TINY, "tiny", resolve_model_spec(TINY), [{"batch": 2}])
    cfg = harness.BenchConfig(engines=[("eager", None)], threads=1, iters=4, min_iters=4, warmup=1, rewarm=0)
    busy = Probe(loadavg=lambda: [9.0, 8.0, 7.0], cpu_time=lambda: 1.0, waited=lambda: None, cores=2)
    (row,) = harness.run_bench([case], cfg, probe=busy).rows
    assert row["load_max"] == 9.0 and row["cpu_per_wall"] == 0.0 and len(row["rounds_ms"]) == 4
    assert row["waited_per_wall"] is None              # no run-queue figure: judged by CPU per wall
    assert {"load", "starved"} <= set(row["flags"])
    res = harness.run_bench([case], cfg, probe=QUIET)
    (row,) = res.rows
    assert row["load_max"] == pytest.approx(0.1) and "load" not in row["flags"] and "starved" not in row["flags"]
    assert res.meta["usable_cores"] == 2 and res.meta["loadavg_start"] == [0.1, 0.1, 0.1]


def test_graphmode_in_eager_mode_is_reported_as_a_fallback(tmp_path):
    """A recipe with exe_mode eager: graphmode's CompiledModel runs PyTorch, and its row says so
    (from the model's own events) instead of showing that time as graph-mode speed."""
    from graphmode.capture.spec import resolve_model_spec
    recipe = tmp_path / "eager.yaml"
    recipe.write_text("version: 1\nname: tiny-eager\nexe_mode: eager\ninputs: [{name: x, dtype: f32, shape: "
                      "[batch, 32]}]\ndims: {batch: {buckets: [4]}}\n")
    case = ModelCase(TINY, "tiny", resolve_model_spec(TINY), [{"batch": 4}])
    cfg = harness.BenchConfig(engines=[("eager", None), ("graphmode", None)], threads=1, iters=3, min_iters=3,
                              warmup=1, rewarm=0, recipe=str(recipe), cache_dir=tmp_path / "cache")
    res = harness.run_bench([case], cfg, probe=QUIET)
    g = res.rows[1]
    assert g["status"] == "ok" and g["numerics_ok"]
    assert g["eager_fallback"] == "5/5 calls (exe_mode eager)" and g["execution"]["mode"] == "eager"
    # timing flags (load/starved/spread) depend on the host; the verdict flag must not
    assert [f for f in g["flags"] if f not in quality.TIMING_FLAGS] == ["fallback"]
    assert g["ratio_vs_eager"] is None and g["ratio_vs_best_other"] is None
    assert any("graphmode: fallback" in w for w in res.meta["warnings"])


# ----------------------------------------------------------------------------- the roofline floor

FLOOR = {"floor_ms": 2.0, "floor_bound": "memory", "floor_flops": 1e9, "floor_bytes": 3e7}


def test_floor_is_each_rows_time_over_the_shapes_roofline():
    rows = [_row("eager", 10.0), _row("graphmode", 5.0), _row("onnxruntime", None, status="failed", reason="x")]
    _judged(rows)
    quality.apply_floor(rows, FLOOR)
    by = {r["label"]: r for r in rows}
    assert by["eager"]["x_floor"] == 5.0 and by["graphmode"]["x_floor"] == 2.5
    assert by["onnxruntime"]["x_floor"] is None and by["onnxruntime"]["floor_ms"] == 2.0
    assert all(r["floor_bound"] == "memory" and r["floor_note"] is None and "floor" not in r["flags"] for r in rows)
    none = [_row("eager", 10.0)]
    _judged(none)
    quality.apply_floor(none, {"floor_note": "no target"})
    assert none[0]["x_floor"] is None and none[0]["floor_ms"] is None and none[0]["floor_note"] == "no target"


def test_a_row_below_its_floor_is_flagged_as_a_probe_problem():
    rows = [_row("eager", 10.0), _row("graphmode", 1.5)]
    _judged(rows)
    quality.apply_floor(rows, FLOOR)
    g = rows[1]
    assert g["x_floor"] == 0.75 and g["flags"] == ["floor"] and "floor" not in rows[0]["flags"]
    assert "0.75x its roofline floor" in g["notes"][0] and "probe under-measured" in g["notes"][0]
    assert warning_lines(rows) == [f"m 1x16 graphmode: {g['notes'][0]}"]
    assert warning_lines(rows, quick=True) == []           # a smoke run's timings are not measurements
    assert not quality.doubtful_ratio(g)                    # its ratio vs eager is not what is in doubt


def test_model_roofline_is_the_larger_of_compute_and_memory_time():
    from graphmode.bench.profile import model_roofline
    from graphmode.targets import get_target
    t = get_target("cpu_avx2")
    s, bound = model_roofline(t, {"flops": 4e9, "bytes": 1e3})
    assert bound == "compute" and s == pytest.approx(4e9 / t.peak("f32"))
    s, bound = model_roofline(t, {"flops": 1e3, "bytes": 4e9, "n_ops": 9.0})
    assert bound == "memory" and s == pytest.approx(4e9 / (t.memory_bandwidth_gbps * 1e9))
    s, _ = model_roofline(t, {"flops": 4e9, "bytes": 1e3}, "bf16")
    assert s == pytest.approx(4e9 / t.peak("bf16"))


def test_shape_floor_says_why_there_is_none():
    from graphmode.targets import get_target
    t = get_target("cpu_avx2")
    assert "no target" in floors.shape_floor(None, {"batch": 1}, None)["floor_note"]
    assert "did not compile" in floors.shape_floor(None, {"batch": 1}, t)["floor_note"]
    assert "boom" in floors.shape_floor(RuntimeError("boom"), {"batch": 1}, t)["floor_note"]


def test_floor_columns_in_markdown_and_table():
    rows = [_row("eager", 10.0), _row("graphmode", 5.0)]
    _judged(rows)
    quality.apply_floor(rows, FLOOR)
    md = markdown(_result(rows, target={"peak_f32_gflops": 150.0, "memory_bandwidth_gbps": 19.0}))
    assert "| vs best other | floor ms | x floor |" in md and "| 0.50x | 2 | 2.5x |" in md
    assert "at 150.0 GFLOP/s f32 peak and 19.0 GB/s" in md
    table, _ = rich_table(_result(rows))
    assert {"floor", "xfloor"} <= {c.header for c in table.columns} and "xfloor = median / floor" in str(table.caption)


def test_harness_rows_carry_the_floor_of_the_shape():
    """The real harness on the tiny model: graphmode's compiler counts the work, a target whose
    bandwidth is absurdly low puts the floor above every measured time, and the rows say so."""
    from graphmode.capture.spec import resolve_model_spec
    from graphmode.targets import get_target
    slow = get_target("cpu_avx2").model_copy(update={"memory_bandwidth_gbps": 1e-9})
    case = ModelCase(TINY, "tiny", resolve_model_spec(TINY), [{"batch": 2}])
    cfg = harness.BenchConfig(engines=[("eager", None), ("graphmode", None)], threads=1, iters=3, min_iters=3,
                              warmup=1, rewarm=0)
    res = harness.run_bench([case], cfg, probe=QUIET, target=slow)
    for r in res.rows:
        assert r["status"] == "ok" and r["floor_bound"] == "memory" and r["floor_flops"] > 0
        assert r["floor_ms"] == pytest.approx(r["floor_bytes"] / 1e-9 / 1e9 * 1e3, rel=1e-3)
        assert r["x_floor"] == pytest.approx(r["median_ms"] / r["floor_ms"], rel=1e-3) and r["x_floor"] < 1
        assert "floor" in r["flags"]
    assert "x_floor" in res.meta["method"] and any("roofline floor" in w for w in res.meta["warnings"])


def test_a_doubtful_host_probe_is_a_run_warning():
    """The floors rest on the host probe; a probe that says it ran on shared cores says so in the run."""
    from graphmode.targets import get_target
    t = get_target("cpu_avx2")
    assert floors._probe_warning(t) == [] and floors._probe_warning(None) == []
    busy = t.model_copy(update={"groups": {**(t.groups or {}), "cpu": {"probe_note": "the FMA chains reached 90"}}})
    (w,) = floors._probe_warning(busy)
    assert w.startswith("host probe: the FMA chains reached 90") and "floors are low" in w


def test_the_report_says_how_an_engine_was_set_up_beyond_its_defaults():
    """ONNX Runtime runs without spinning (it stole the next engine's cores); a reader comparing
    with their own ORT numbers (1.75x faster with spinning on a small CNN) was not told."""
    from graphmode.bench.harness import ENGINE_SETTINGS
    rows = [_row("eager", 10.0), _row("onnxruntime", 6.0), _row("graphmode", 5.0)]
    res = _result(rows)
    res.meta["method"]["engine_settings"] = ENGINE_SETTINGS
    assert "- onnxruntime set up with intra_op and inter_op allow_spinning=0" in markdown(res)


class _BigTable(torch.nn.Module):
    """A 20,000 x 64 token table (5.1 MB) then one 64 x 64 linear: a request reads 16 rows."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.lin = torch.nn.Embedding(20_000, 64), torch.nn.Linear(64, 64)

    def forward(self, ids):
        return self.lin(self.emb(ids))


@pytest.fixture(scope="module")
def big_table(tmp_path_factory):
    import graphmode
    rec = {"version": 1, "name": "t", "inputs": [{"name": "ids", "dtype": "i64", "shape": ["batch", "seq"]}],
           "dims": {"batch": {"buckets": [1]}, "seq": {"buckets": [16]}}, "exe_mode": "graph",
           "codegen": {"kernel_selection": "heuristic"}}
    m = _BigTable().eval()
    return graphmode.compile((m, {"ids": torch.randint(0, 20_000, (1, 16))}, {"ids": ["batch", "seq"]}), rec,
                             cache_dir=tmp_path_factory.mktemp("big-table"))


def test_a_lookup_table_counts_the_rows_a_request_reads_not_the_whole_table(big_table):
    """The floor counted every weight as read: a 51 MB table behind 16 looked-up rows made every
    engine 'faster than its floor' and a 3x loss 'met' as 0.12x the floor (trial Z)."""
    from graphmode.bench.profile import facts_at, lookup_table_bytes
    from graphmode.targets import get_target
    cm = big_table
    table, picked = lookup_table_bytes(cm.graph, {"batch": 1, "seq": 16})
    assert table == 20_000 * 64 * 4 and picked == 16 * 64 * 4
    facts = facts_at(cm, cm.recipe, get_target("cpu_avx2"), {"batch": 1, "seq": 16})
    assert facts["bytes"] < 100_000         # the linear's 16.6 KB, 16 rows, activations: not the 5.1 MB table


def test_the_probe_reads_frame_the_untimed_calls_not_the_timed_one():
    """Reading /proc right before the timed call slowed a sub-millisecond call ~20% (trial Z):
    the reads come before the untimed calls, and the conditions cover the whole span."""
    from graphmode.bench.rounds import Conditions, measured
    events = []

    class P:
        def waited(self):
            events.append("probe")
            return 0.0

        def cpu_time(self):
            return time.process_time()
    cond = Conditions()
    _, dt = measured(cond, P(), 1.0, lambda: events.append("call"), untimed=2)
    assert events == ["probe", "call", "call", "call", "probe"]
    assert 0 <= dt <= cond.wall_s and cond.loads == [1.0]


def test_the_memory_proof_prepares_no_copy_of_a_lookup_table(big_table):
    """memory.weight_growth counted the 5.1 MB table 2.5x over as prepared copies no kernel makes
    (only GEMM and conv weights are packed): a draft for an embedding-heavy model asked for 3.5x
    its weights (trial Z: 214 MB for a 51 MB table, where compile reported 0 MB prepared)."""
    from graphmode.compile_report import model_facts
    from graphmode.recipe.constraints import PREPARED, build_constraint_model
    from graphmode.targets import get_target
    cm = big_table
    facts = model_facts(cm.graph, 0)
    linear = (64 * 64 + 64) * 4
    assert facts.weights_bytes == 20_000 * 64 * 4 + linear and facts.prepared_from_bytes == linear
    terms = build_constraint_model(cm.recipe, get_target("cpu_avx2"), facts).memory_terms
    assert int(terms[PREPARED]) == math.ceil(linear * cm.recipe.memory.weight_growth)
