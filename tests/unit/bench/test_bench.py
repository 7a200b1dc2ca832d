"""`graphmode bench` and `graphmode profile` on a tiny model: the rows, their keys and
ratios, failures reported with a reason, per-instruction profiles and the calibration fit.
Nothing here asserts on how fast anything is."""
from __future__ import annotations

import json
import math
import sys
from fractions import Fraction
from pathlib import Path

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

THIS = Path(__file__).resolve()
TINY = f"{THIS}:tiny_mlp"
ROW_KEYS = {"model", "shape", "engine", "status", "median_ms", "p90_ms", "ratio_vs_eager", "rel_l2_err", "setup_s",
            "reason", "ratio_vs_best_other", "peak_rss_mb", "numerics_ok", "floor_ms", "floor_bound", "floor_flops",
            "floor_bytes", "x_floor"}


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(32, 64)
        self.fc2 = nn.Linear(64, 16)
        self.norm = nn.LayerNorm(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.fc2(torch.nn.functional.gelu(self.fc1(x))) + 1.0)


def tiny_mlp():
    """The model spec `<this file>:tiny_mlp`: (module, example inputs, symbolic dims)."""
    g = torch.Generator().manual_seed(0)
    m = _Tiny()
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return m.eval(), {"x": torch.randn(3, 32, generator=g)}, {"x": ["batch", 32]}


@pytest.fixture()
def cli(tmp_path, monkeypatch):
    import graphmode.cli.bench_cmd  # noqa: F401  (registers `bench`)
    import graphmode.cli.profile_cmd  # noqa: F401  (registers `profile`)
    from graphmode.cli.app import app
    monkeypatch.setenv("GRAPHMODE_CACHE_DIR", str(tmp_path / "cache"))
    runner = CliRunner()

    def run(*args: str):
        res = runner.invoke(app, list(args))
        assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
        return res
    return run


class _EightPositions(nn.Module):
    def __init__(self):
        super().__init__()
        self.pos = nn.Parameter(torch.randn(8, 4))

    def forward(self, x):
        return x + self.pos[: x.shape[1]]          # eager fails past 8 positions, as a model past its max positions


def eight_positions():
    return _EightPositions().eval(), {"x": torch.randn(2, 8, 4)}, {"x": ["batch", "seq", 4]}


def test_a_shape_eager_cannot_run_is_a_failed_row_and_bad_outputs_are_refused_first(cli, tmp_path):
    """`bench --shape 1x600` on MiniLM (512 positions) ended in a 29-frame traceback; `--out` a
    file failed after the whole run, losing it; `--name ../x` wrote outside --out; `--engines ""`
    ran every engine."""
    spec = f"{Path(__file__).resolve()}:eight_positions"
    res = cli("bench", "--model", spec, "--shape", "2x9x4", "--engines", "eager", "--quick", "--out",
              str(tmp_path / "r"), "--json")
    rows = json.loads(res.stdout)
    assert rows and all(r["status"] == "failed" and "eager PyTorch fails at this shape" in r["reason"] for r in rows)
    afile = tmp_path / "afile"
    afile.write_text("x")
    for args, where in ((["--out", str(afile)], "--out"), (["--name", "../escape"], "--name"),
                        (["--engines", ""], "--engines")):
        res = cli("bench", "--model", TINY, *args)
        assert res.exit_code == 2 and where in res.output and "Traceback" not in res.output, res.output
    assert afile.read_text() == "x" and not (tmp_path.parent / "escape.json").exists()


def test_quick_bench_rows_files_and_ratios(cli, tmp_path):
    out = tmp_path / "results"
    res = cli("bench", "--model", TINY, "--shape", "4x32", "--engines", "eager,onnxruntime,openvino,graphmode",
              "--quick", "--threads", "1", "--out", str(out), "--json")
    assert res.exit_code == 0, res.output
    rows = json.loads((out / "quick.json").read_text())
    assert rows == json.loads(res.stdout)
    assert [r["engine"] for r in rows] == ["eager", "onnxruntime", "openvino", "graphmode"]
    for r in rows:
        assert ROW_KEYS <= set(r), ROW_KEYS - set(r)
        assert r["model"] == "tiny_mlp" and r["shape"] == [4, 32]
    by = {r["engine"]: r for r in rows}
    for e in ("eager", "onnxruntime", "graphmode"):
        r = by[e]
        assert r["status"] == "ok", r["reason"]
        assert r["numerics_ok"] and r["rel_l2_err"] < 1e-4
        assert r["iters"] == 3 and r["median_ms"] > 0 and r["p90_ms"] >= r["median_ms"] * 0.999
        assert r["setup_s"] >= 0
        assert r["ratio_vs_eager"] == pytest.approx(r["median_ms"] / by["eager"]["median_ms"], rel=1e-3)
    best = min((by["eager"], by["onnxruntime"]), key=lambda r: r["median_ms"])
    assert by["graphmode"]["ratio_vs_best_other"] == pytest.approx(
        by["graphmode"]["median_ms"] / best["median_ms"], rel=1e-3)
    assert by["graphmode"]["best_other_engine"] == best["label"]
    assert by["eager"]["rel_l2_err"] == 0.0
    floor = by["graphmode"]["floor_ms"]            # one floor per shape, on the probed host
    assert floor > 0 and by["graphmode"]["floor_bound"] in ("compute", "memory")
    assert by["graphmode"]["floor_flops"] > 0 and by["graphmode"]["floor_bytes"] > 0
    for e in ("eager", "onnxruntime", "graphmode"):
        assert by[e]["floor_ms"] == floor
        assert by[e]["x_floor"] == pytest.approx(by[e]["median_ms"] / floor, rel=1e-3)
    ov = by["openvino"]
    if ov["status"] != "ok":                    # not installed here: a reported failure, never dropped
        assert ov["reason"] and ov["median_ms"] is None and ov["ratio_vs_eager"] is None
    meta = json.loads((out / "quick.meta.json").read_text())
    assert meta["cpu_model"] and meta["cores"] >= 1 and meta["threads"] == 1
    assert meta["versions"]["torch"] == torch.__version__ and "onnxruntime" in meta["versions"]
    assert "simd" in meta and meta["date"]
    md = (out / "quick.md").read_text()
    assert "| tiny_mlp | (4,32) | **graphmode** |" in md
    assert "| floor ms | x floor |" in md and f"| {by['graphmode']['x_floor']:.3g}x |" in md
    assert (out / "quick.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("quick", [True, pytest.param(False, marks=pytest.mark.slow)])   # one run: ~20 s
def test_a_run_fails_when_graphmode_fails(cli, tmp_path, quick):
    """A recipe graphmode cannot compile (a memory budget below the weights): graphmode is
    reported failed with the reason and the run exits non-zero (a full run exited 0); the other
    engines still ran. (A shape outside its dims is refused before any engine runs:
    test_a_recipe_that_cannot_run_a_shape_or_the_model_is_refused_before_timing.)"""
    recipe = tmp_path / "r.yaml"
    recipe.write_text("version: 1\nname: tiny\ninputs: [{name: x, dtype: f32, shape: [batch, 32]}]\n"
                      "dims: {batch: {buckets: [1, 4]}}\nmemory: {budget_mb: 0.001}\n")
    out = tmp_path / "results"
    res = cli("bench", "--model", TINY, "--shape", "4x32", "--engines", "eager,graphmode",
              *(["--quick"] if quick else ["--iters", "2", "--warmup", "1", "--name", "quick"]),
              "--threads", "1", "--recipe", str(recipe), "--out", str(out))
    assert res.exit_code == 1
    assert ("quick check failed" if quick else "graphmode failed") in res.output and "graphmode" in res.output
    rows = json.loads((out / "quick.json").read_text())
    g = next(r for r in rows if r["engine"] == "graphmode")
    assert g["status"] == "failed" and "budget" in g["reason"] and not g["skipped"]
    assert next(r for r in rows if r["engine"] == "eager")["status"] == "ok"


def test_engine_failing_mid_run_is_reported(monkeypatch):
    from graphmode.bench import engines, harness
    from graphmode.bench.models import ModelCase
    from graphmode.capture.spec import resolve_model_spec

    class Flaky(engines.EagerEngine):
        name = "flaky"
        calls = 0

        def __call__(self):
            Flaky.calls += 1
            if Flaky.calls == 4:
                raise RuntimeError("kernel exploded\nsecond line")
            return super().__call__()

    monkeypatch.setitem(engines.ENGINES, "flaky", Flaky)
    bundle = resolve_model_spec(TINY)
    case = ModelCase(TINY, "tiny", bundle, [{"batch": 2}])
    cfg = harness.BenchConfig(engines=[("eager", None), ("flaky", None)], threads=1, iters=5, min_iters=5, warmup=1)
    res = harness.run_bench([case], cfg)
    flaky = res.rows[1]
    assert flaky["status"] == "failed" and flaky["reason"] == "RuntimeError: kernel exploded"
    assert flaky["median_ms"] is None and res.rows[0]["status"] == "ok" and res.rows[0]["iters"] == 5
    assert res.quick_failures() == ["tiny 2x32 flaky: failed: RuntimeError: kernel exploded"]


def test_shapes_and_engines_parse():
    from graphmode.bench.engines import parse_engines
    from graphmode.bench.models import load_cases, parse_shape
    from graphmode.capture.spec import resolve_model_spec
    from graphmode.errors import GraphmodeError

    b = resolve_model_spec(TINY)
    assert parse_shape("4x32", b) == {"batch": 4}
    assert parse_shape("4", b) == {"batch": 4}
    assert parse_shape("batch=4", b) == {"batch": 4}
    assert parse_shape("4x31", b) is None and parse_shape("1x2x3", b) is None
    with pytest.raises(GraphmodeError, match="cannot parse shape"):
        parse_shape("4xa", b)
    with pytest.raises(GraphmodeError, match="no --shape fits"):
        load_cases([TINY], ["1x2x3"])
    assert parse_engines("eager,graphmode", ["max-autotune"]) == [("eager", None), ("graphmode", None),
                                                                 ("torch_compile", "max-autotune")]
    with pytest.raises(GraphmodeError, match="unknown engine"):
        parse_engines("eager,tensorrt")
    # the default run compares against torch.compile's max-autotune too; a smoke run leaves it out
    assert ("torch_compile", "max-autotune") in parse_engines(None)
    assert parse_engines(None, quick=True) == [("eager", None), ("torch_compile", None), ("onnxruntime", None),
                                               ("openvino", None), ("graphmode", None)]
    assert parse_engines("torch_compile[freezing], graphmode") == [("torch_compile", "freezing"), ("graphmode", None)]


@pytest.fixture(scope="module")
def tiny_profile():
    import graphmode
    from graphmode.bench.models import auto_recipe
    from graphmode.bench.profile import profile_bucket
    from graphmode.capture.spec import resolve_model_spec
    from graphmode.recipe import load_recipe
    from graphmode.targets import get_target

    bundle = resolve_model_spec(TINY)
    rec = load_recipe(auto_recipe(bundle, [{"batch": 4}, {"batch": 64}]))
    cm = graphmode.compile(bundle, rec, "host", cache_dir=False, threads=1)
    target = get_target("host")
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        profs = [profile_bucket(cm, rec, {"batch": b}, target, runs=15, model="tiny", threads=1) for b in (4, 64)]
    finally:
        torch.set_num_threads(prev)
    return target, profs


def test_profile_rows_sum_to_the_run(tiny_profile):
    target, profs = tiny_profile
    p = profs[1]
    # a lone linear is ATen's, or a generated kernel once its step's tuning chose one
    assert p.n_steps >= 3 and {s.name for s in p.steps} & {"aten:linear", "kernel:linear"}
    assert sum(s.time_s for s in p.steps) == pytest.approx(p.steps_sum_s)
    assert sum(s.share for s in p.steps) == pytest.approx(1.0)
    # the steps plus the executor's own (paired) gap account for the run, within noise
    assert 0.25 * p.run_s <= p.steps_sum_s + max(p.gap_s, 0.0) <= 4 * p.run_s
    lin = next(s for s in p.steps if s.name.endswith(":linear"))
    assert lin.flops > 0 and lin.bytes > 0
    assert lin.roofline_s > 0 and lin.bound in ("compute", "memory") and lin.gflops > 0
    assert lin.shape_class == "narrow" and lin.cost_kind == "gemm"      # 32x64 and 64x16 weights
    assert p.eager_ops and p.eager_ops >= 4 and p.dispatch_us > 0
    assert p.facts["flops"] > 0 and p.facts["n_ops"] >= 1
    d = p.to_json(top=2)
    assert len(d["top"]) == 2 and d["top"][0]["time_s"] >= d["top"][1]["time_s"]


def test_an_op_whose_tuned_step_chose_a_generated_kernel_is_named_a_kernel():
    """A depthwise conv is bound as an ATen call whose step tuning may switch to the `dw`
    kernel: the profile named it `aten:conv2d` while the generated kernel ran."""
    from types import SimpleNamespace

    from graphmode.bench.profile import _ran_as
    assert _ran_as("aten:conv2d", SimpleNamespace(tactic="dw")) == "kernel:conv2d"
    assert _ran_as("aten:conv2d", SimpleNamespace(tactic="aten")) == "aten:conv2d"
    assert _ran_as("aten:mean", lambda: None) == "aten:mean"
    assert _ran_as("kernel:gemm_epilogue", SimpleNamespace(tactic="aten")) == "kernel:gemm_epilogue"


def _step(index, kind, flops, nbytes, const_bytes, time_s, name=None, in_shapes=(), out_shapes=()):
    from graphmode.bench.profile import StepRow
    return StepRow(index=index, node_index=index, name=name or f"aten:{kind}", cost_kind=kind, body_ops=[],
                   in_shapes=list(in_shapes), out_shapes=list(out_shapes), flops=flops, bytes=nbytes, time_s=time_s,
                   share=0.0, gflops=None, gbps=None, roofline_s=0.0, bound="", roofline_frac=None,
                   const_bytes=const_bytes)


def test_steps_above_the_roofline_are_named_with_their_cause():
    """GPT-2's case: a GEMM streaming 9.4 MB of weights at ~19 GB/s on a probe of 8.4 GB/s is
    the probe under-measuring; an elementwise op on fresh activations beating it is cache; a
    GEMM above the f32 peak is the peak. Steps under their roofline are not listed."""
    from graphmode.bench.profile import roofline_breaches
    from graphmode.targets import get_target
    t = get_target("cpu_avx2").model_copy(update={"memory_bandwidth_gbps": 8.4, "llc_bytes": 32 * 2**20,
                                                  "peak_flops": {"f32": 150e9}})
    w = 768 * 3072 * 4
    steps = [_step(0, "gemm", 2 * 16 * 768 * 3072, w + 4 * 16 * (768 + 3072), w, 0.5e-3),     # ~19.1 GB/s
             _step(1, "elementwise", 1e5, 1e6, 0.0, 1e-5),                                   # 100 GB/s, activations
             _step(2, "gemm", 2 * 512**3, 3 * 4 * 512**2, 2 * 512**2, 1e-3),                 # 268 GFLOP/s
             _step(3, "gemm", 2 * 16 * 768 * 3072, w + 4 * 16 * (768 + 3072), w, 2e-3)]      # 4.8 GB/s: fine
    by = {b["step"]: b for b in roofline_breaches(steps, t, weights_bytes=500e6)}
    assert set(by) == {0, 1, 2}
    assert by[0]["cause"] == "probe" and by[0]["unit"] == "GB/s" and by[0]["probe"] == 8.4
    assert by[0]["achieved"] == pytest.approx(steps[0].bytes / 0.5e-3 / 1e9, rel=1e-3) and by[0]["roofline_frac"] > 2
    assert "probe under-measured" in by[0]["why"] and "8.4 GB/s" in by[0]["why"] and "#0 aten:gemm" in by[0]["why"]
    assert by[1]["cause"] == "cache" and "activations" in by[1]["why"]
    assert by[2]["cause"] == "peak" and by[2]["unit"] == "GFLOP/s" and by[2]["probe"] == 150.0
    assert "--reprobe" in by[2]["why"]            # a probe taken on a busy host is the usual cause here
    small = {b["step"]: b for b in roofline_breaches(steps, t, weights_bytes=10e6)}    # weights fit in the LLC
    assert small[0]["cause"] == "cache" and "fit in the 32 MiB LLC" in small[0]["why"]
    # an embedding counts its whole 154 MB table but reads one row; an argmax reads all it counts
    table = 50257 * 768 * 4
    gathers = [_step(0, "data", 0.0, table, table, 5e-5, "aten:embedding", [[50257, 768], [1, 1]], [[1, 1, 768]]),
               _step(1, "reduction", 0.0, table, 0.0, 5e-5, "aten:argmax", [[50257, 768]], [[50257]])]
    by = {b["step"]: b for b in roofline_breaches(gathers, t, weights_bytes=500e6)}
    assert by[0]["cause"] == "gather" and "indexes" in by[0]["why"] and by[1]["cause"] != "gather"


def test_profile_flags_real_steps_against_a_low_probe(tiny_profile):
    """The profiled tiny model against the host's own numbers and against a probe 10^4x lower:
    every breach is a step whose achieved rate beats the target's."""
    from graphmode.bench.profile import roofline_breaches
    target, profs = tiny_profile
    p = profs[1]
    assert p.weights_bytes > 0 and any(s.const_bytes > 0 for s in p.steps)
    assert p.above_roofline == roofline_breaches(p.steps, target, p.weights_bytes)
    assert p.to_json()["above_roofline"] == p.above_roofline
    low = target.model_copy(update={"memory_bandwidth_gbps": target.memory_bandwidth_gbps * 1e-4})
    got = roofline_breaches(p.steps, low, p.weights_bytes)
    assert got and {b["step"] for b in got} <= {s.index for s in p.steps}
    for b in got:
        assert b["achieved"] > b["probe"] and b["roofline_frac"] > 1 and b["why"]


def test_calibration_fit_reproduces_the_measurements_it_was_fitted_on(tiny_profile, tmp_path):
    """What the fit guarantees by construction, on real profiled buckets: fitted on one bucket,
    the cost model gives back that bucket's measured steps plus executor gaps, and the
    recipe's latency model its measured run; fitted on both, the totals over both. (Whether
    a fit pooled over buckets beats the raw roofline on each one depends on the host's noise
    at microsecond scale; test_calibration_fit_recovers_known_efficiencies checks accuracy.)"""
    from graphmode.bench.profile import (
        SampleStore, _step, fit_calibration, predict_bucket, predict_recipe_model, prediction_table, within)
    from graphmode.targets.cost import Calibration
    target, profs = tiny_profile
    store = SampleStore(tmp_path / "host.samples.json", target.name)
    for p in profs:
        store.add(p)
    store.save()
    assert set(SampleStore(tmp_path / "host.samples.json", target.name).buckets) == {p.key for p in profs}
    samples = list(store.buckets.values())

    def measured(bk):
        return sum(_step(st)[3] for st in bk["steps"]) + bk["gap_s"]

    for bk in samples:
        alone = fit_calibration(target, [bk])
        assert predict_bucket(target, bk, alone) == pytest.approx(measured(bk), rel=1e-2)
        assert predict_recipe_model(target, bk, alone) == pytest.approx(bk["run_s"], rel=1e-2)
    cal = fit_calibration(target, samples)
    assert Calibration.load(cal.save(tmp_path / "host.json")) == cal and cal.model_efficiency
    assert sum(predict_bucket(target, bk, cal) for bk in samples) == pytest.approx(
        sum(measured(bk) for bk in samples), rel=1e-2)
    rows = prediction_table(target, store.buckets, cal)
    assert {r.key for r in rows} == {p.key for p in profs} and all(r.calibrated_s > 0 for r in rows)
    assert isinstance(within(rows), bool)


def test_calibration_fit_recovers_known_efficiencies():
    """Synthetic steps: square GEMMs at 80 % of roofline, skinny ones at 30 %, elementwise at
    10 %, tiny ops dispatch-bound; 2 µs executor gap per instruction."""
    from graphmode.bench.profile import _roof, cost_key, fit_calibration, predict_bucket
    from graphmode.targets import get_target
    t = get_target("cpu_avx2")
    gap = 2e-6
    work = [("gemm", 2 * 512**3, 3 * 4 * 512**2, 0.8), ("gemm", 2 * 16 * 768**2, 4 * (768**2 + 2 * 16 * 768), 0.3),
            ("elementwise", 1e6, 8e6, 0.1), ("shape", 0.0, 512.0, 0.01)]
    steps = [[k, f * i, b * i, _roof(t, k, f * i, b * i) / e] for i in (1, 2, 3) for k, f, b, e in work]
    run_s = sum(s[3] for s in steps) + gap * len(steps)
    sample = {"model": "synthetic", "bucket": {"batch": 1}, "threads": 1, "run_s": run_s, "gap_s": gap * len(steps),
              "n_steps": len(steps), "steps": steps, "facts": {}}
    cal = fit_calibration(t, [sample])
    for k, f, b, e in work:
        assert cal.efficiency(cost_key(t, k, f, b)) == pytest.approx(e, rel=1e-3)
    assert cost_key(t, *work[0][:3]).split("|")[1] != cost_key(t, *work[1][:3]).split("|")[1]
    skinny = cost_key(t, *work[1][:3]).rpartition("|")[0]          # gemm|ai4-16
    assert cal.efficiency(skinny + "|unseen-size") == cal.op_efficiency[skinny]
    assert cal.efficiency("gemm") == cal.op_efficiency["gemm"] and cal.efficiency("conv") == cal.default_efficiency
    assert cal.overhead_us == pytest.approx(gap * 1e6, rel=1e-3)
    assert predict_bucket(t, sample, cal) == pytest.approx(run_s, rel=1e-3)
    assert predict_bucket(t, sample, None) < 0.5 * run_s


def test_steps_faster_than_the_roofline_are_capped_at_efficiency_one():
    """A tiny model whose weights sit in cache fitted gemm efficiencies of 1.4-1.9: the proof of
    a larger model then predicted a latency below the physical floor."""
    from graphmode.bench.profile import _roof, cost_key, fit_calibration
    from graphmode.targets import get_target
    t = get_target("cpu_avx2")
    work = [("gemm", 2 * 64**3, 3 * 4 * 64**2, 1.8), ("elementwise", 1e6, 8e6, 0.5)]
    steps = [[k, f, b, _roof(t, k, f, b) / e] for k, f, b, e in work]
    sample = {"model": "tiny", "bucket": {"batch": 1}, "threads": 1, "run_s": sum(s[3] for s in steps),
              "gap_s": 0.0, "n_steps": len(steps), "steps": steps, "facts": {}}
    cal = fit_calibration(t, [sample])
    assert cal.efficiency(cost_key(t, *work[0][:3])) == 1.0
    assert cal.efficiency(cost_key(t, *work[1][:3])) == pytest.approx(0.5, rel=1e-3)
    assert max(cal.op_efficiency.values()) <= 1.0 and cal.default_efficiency <= 1.0
    assert "ran faster than the roofline" in cal.note and "capped at efficiency 1" in cal.note


def test_recipe_latency_model_uses_the_calibration():
    from graphmode.recipe import load_recipe
    from graphmode.recipe.constraints import build_constraint_model
    from graphmode.errors import TargetError
    from graphmode.targets import get_target
    from graphmode.targets.cost import Calibration
    t = get_target("cpu_avx2")
    rec = load_recipe(str(THIS.parents[3] / "examples" / "recipes" / "resnet18_cpu.yaml"))
    plain = build_constraint_model(rec, t)
    cal = Calibration(target=t.name, model_efficiency=0.25, overhead_us=100.0)
    cm = build_constraint_model(rec, t, calibration=cal)
    assert cm.peak_flops == plain.peak_flops * Fraction(1, 4) and cm.bandwidth == plain.bandwidth * Fraction(1, 4)
    assert cm.launch_overhead_s == Fraction(1, 10_000)
    lat = {"batch": 1}
    import sympy
    a = float(plain.latency_s().subs({s: lat[s.name] for s in plain.latency_s().free_symbols}))
    b = float(cm.latency_s().subs({s: lat[s.name] for s in cm.latency_s().free_symbols}))
    assert b > a and math.isfinite(b) and sympy  # slower once calibrated to 25 % efficiency
    with pytest.raises(TargetError, match="another target"):
        build_constraint_model(rec, t, calibration=Calibration(target="a100_sxm"))


def test_profile_cli_calibrates_and_saves(cli, tmp_path):
    cal = tmp_path / "cal" / "host.json"
    res = cli("profile", "--model", TINY, "--shape", "8x32", "--runs", "5", "--threads", "1", "--calibrate",
              "--calibration", str(cal), "--json")
    assert res.exit_code == 0, res.output
    d = json.loads(res.stdout)
    assert d["saved"] and cal.is_file() and cal.with_name("host.samples.json").is_file()
    (p,) = d["profiles"]
    assert p["bucket"] == {"batch": 8} and p["n_steps"] == len(p["steps"]) and p["top"]
    assert p["eager_dispatch_us_per_op"] > 0 and p["executor_overhead_us_per_instruction"] >= 0
    (row,) = d["predictions"]
    assert row["measured_s"] > 0 and row["calibrated_err"] is not None
    assert math.isfinite(row["roofline_err"])   # its sign is a timing, not a property of the code
    res = cli("profile", "--model", TINY, "--shape", "8x32", "--runs", "3", "--threads", "1",
              "--calibration", str(cal), "--no-eager")
    assert res.exit_code == 0, res.output
    assert "top 15 instructions" in res.output and "predicted vs measured" in res.output
    assert "executor overhead" in res.output
    before = json.loads(cal.read_text())
    res = cli("profile", "--refit", "--threads", "1", "--calibration", str(cal), "--json")   # nothing measured
    assert res.exit_code == 0, res.output
    d = json.loads(res.stdout)
    assert d["profiles"] == [] and len(d["predictions"]) == 1 and d["saved"]
    assert json.loads(cal.read_text())["op_efficiency"] == before["op_efficiency"]
    from graphmode.cli.app import main
    with pytest.raises(SystemExit) as e:                                       # neither --model nor --refit
        main(["profile", "--calibration", str(cal)])
    assert e.value.code == 2
    # a calibration it cannot save is refused before measuring (it ended in a PermissionError after the runs)
    res = cli("profile", "--model", TINY, "--shape", "8x32", "--runs", "3", "--calibrate",
              "--calibration", str(cal / "inside.json"))
    assert res.exit_code != 0 and "--calibration" in res.output and "is a file" in res.output
    assert "top 15 instructions" not in res.output


def test_profile_cli_flags_kernels_above_a_low_probe(cli, tmp_path):
    """A host probe (cached under the CLI's cache folder) that reads 0.001 GB/s: every step beats
    its roofline, and the output says so instead of printing the percentage as fact."""
    from graphmode.targets import host as H
    key = H.detect_host_facts(threads=1).cache_key(torch.__version__)
    probe = {"threads": 1, "gemm_f32_gflops": 50.0, "copy_gbps": 0.001, "read_gbps": 0.001, "read_variant": "read",
             "dispatch_us": 2.0, "probe_seconds": 0.1}
    assert H.save_probe_cache(tmp_path / "cache" / "targets" / H.CACHE_FILE, key, probe)
    res = cli("profile", "--model", TINY, "--shape", "8x32", "--runs", "3", "--threads", "1", "--no-eager")
    assert res.exit_code == 0, res.output
    assert "%!" in res.output and "instruction(s) ran above the" in res.output      # table mark + what it means
    assert "above the probe's 0.001 GB/s" in res.output


def test_calibration_keeps_the_roofline_it_was_fitted_against():
    """The host probe may measure another bandwidth later: a calibration predicts with the
    peak and bandwidth it was fitted on, so its predictions do not move."""
    from graphmode.bench.profile import fit_calibration, predict_bucket
    from graphmode.recipe.constraints import ConstraintModel, apply_calibration
    from graphmode.targets import get_target
    t = get_target("cpu_avx2")
    steps = [["elementwise", 1e6, 8e7, 2e-2], ["gemm", 2e9, 1e7, 3e-2]]
    sample = {"model": "m", "bucket": {"batch": 1}, "run_s": 5e-2, "gap_s": 0.0, "n_steps": 2, "steps": steps,
              "facts": {"flops": 2e9, "bytes": 9e7, "n_ops": 2}}
    cal = fit_calibration(t, [sample])
    assert cal.reference_bandwidth_gbps == t.memory_bandwidth_gbps and cal.reference_peak_flops == t.peak_flops
    slower = t.model_copy(update={"memory_bandwidth_gbps": t.memory_bandwidth_gbps / 2})
    assert predict_bucket(slower, sample, cal) == pytest.approx(predict_bucket(t, sample, cal))
    assert predict_bucket(t, sample, cal) == pytest.approx(5e-2, rel=1e-3)
    cm = ConstraintModel(domains={}, memory_terms={"x": 9 * 10**7}, budget_bytes=None, budget_source="",
                         flops=2 * 10**9, bytes_moved=9 * 10**7, n_ops=2, peak_flops=Fraction(1),
                         bandwidth=Fraction(1), compute_dtype="f32")
    cm = apply_calibration(cm, slower, cal)
    assert float(cm.bandwidth) == pytest.approx(t.memory_bandwidth_gbps * 1e9 * cal.model_efficiency)


def test_profile_cli_decode_times_the_engine_step(cli, tmp_path):
    """`profile --decode BxC` times the decode engine's step of a decoder recipe; without such
    a recipe, or with a malformed shape, it is refused with the option named."""
    import yaml
    e2e = Path(__file__).resolve().parents[2] / "e2e"
    sys.path.insert(0, str(e2e))
    import tiny_decoders
    rec = tmp_path / "dec.yaml"
    rec.write_text(yaml.safe_dump(tiny_decoders.recipe()))
    spec = f"{e2e / 'tiny_decoders.py'}:gpt2"
    res = cli("profile", "--model", spec, "--recipe", str(rec), "--decode", "2x9", "--runs", "3", "--threads", "1",
              "--no-eager", "--json")
    assert res.exit_code == 0, res.output
    (p,) = json.loads(res.stdout)["profiles"]
    assert p["bucket"] == {"batch": 2, "context": 9} and p["model"].endswith("-decode")
    assert sum(s["name"] == "native:paged_attention" for s in p["steps"]) == 2
    for bad in (["--decode", "2by9", "--recipe", str(rec)], ["--decode", "1x8"]):
        res = cli("profile", "--model", spec, *bad, "--runs", "1", "--no-eager")
        assert res.exit_code != 0 and "--decode" in res.output


def test_goals_report_speed_and_peak_rss_against_the_thresholds():
    from graphmode.bench.harness import BenchResult
    from graphmode.bench.report import goals

    def row(label, **kw):
        return {"model": "m", "shape": [1, 8], "label": label, "engine": label, "status": "ok", **kw}
    rows = [row("onnxruntime", median_ms=10.0, peak_rss_mb=100.0),
            row("graphmode", median_ms=8.0, ratio_vs_best_other=0.8, best_other_engine="onnxruntime",
                x_floor=1.5, floor_bound="compute", peak_rss_mb=130.0)]
    (line,) = goals(BenchResult(rows, {}))
    # each verdict says its threshold (a "0.96x ... NOT met" read as a contradiction)
    assert line.startswith("m 1x8: speed met (0.80x onnxruntime; goal <= 0.90x)") and \
        "peak RSS NOT met (130 MB, 1.30x onnxruntime's 100 MB; goal <= 1.2x)" in line
    rows[1].update(ratio_vs_best_other=0.95, x_floor=1.05, floor_bound="memory", peak_rss_mb=110.0)
    (line,) = goals(BenchResult(rows, {}))
    assert "speed met (0.95x onnxruntime, 1.05x the memory-bound floor; goal <= 0.90x, or <= 1.10x the floor)" \
        in line and "peak RSS met" in line
    rows[1].update(x_floor=0.91)        # under its floor: the floor is wrong there (a trial: a whole token table)
    assert "speed NOT met (0.95x onnxruntime, 0.91x the memory-bound floor (under it: the floor is in doubt)" \
        in goals(BenchResult(rows, {}))[0]
    rows[1].update(x_floor=1.2, label="graphmode[avx2]")          # an ISA-capped run labels the engine
    assert "speed NOT met" in goals(BenchResult(rows, {}))[0]
    assert goals(BenchResult(rows, {"quick": True})) == []
    # the paired interval is reported, and a verdict it straddles is called unsettled
    rows[1].update(ratio_vs_best_other=0.88, floor_bound="compute", ratio_vs_best_other_ci95=[0.84, 0.93])
    assert "speed met (0.88x onnxruntime; per-round ratio 0.84-0.93 at 95%, which this run does not settle;" \
        in goals(BenchResult(rows, {}))[0]
    # a second shape of the model: its RSS is leftovers of the first's setup, not judged
    later = [dict(r, shape=[4, 8]) for r in rows]
    assert [("peak RSS" in line) for line in goals(BenchResult(rows + later, {}))] == [True, False]
    rows[1].update(ratio_vs_best_other_ci95=[0.84, 0.89])
    assert "0.84-0.89 at 95%; goal" in goals(BenchResult(rows, {}))[0]
    rows[1].update(flags=["load"])              # a verdict from a busy host says so
    assert goals(BenchResult(rows, {}))[0].endswith("timed on a busy host (load): rerun on a quiet one before "
                                                    "reading these")


def test_median_interval_is_the_binomial_order_statistics():
    from graphmode.bench.harness import median_interval
    xs = [float(i) for i in range(1, 21)][::-1]
    assert median_interval(xs) == (6.0, 15.0)                      # P(Bin(20, .5) <= 5) = 0.021 <= 0.025
    assert median_interval(xs[:6]) == (15.0, 20.0)                 # 6 samples: min and max (96.9%)
    assert median_interval(xs[:5]) is None                         # 5 cannot reach 95%


def test_paired_interval_cancels_drift_that_moves_both_engines():
    """A host that slows down mid-run moves both medians; the per-round ratios do not move."""
    from graphmode.bench.harness import _ratios
    slow = [1.0] * 10 + [3.0] * 10                                 # the host's speed per round
    ort = [10.0 * f for f in slow]
    gm = [8.0 * f * (1.0 + 0.01 * (i % 3)) for i, f in enumerate(slow)]

    def row(engine, times):
        return {"model": "m", "shape": [1], "label": engine, "engine": engine, "status": "ok",
                "median_ms": sorted(times)[len(times) // 2], "rounds_ms": times, "eager_fallback": None}
    rows = [row("onnxruntime", ort), row("graphmode", gm), row("eager", [50.0] * 20)]
    _ratios(rows)
    lo, hi = rows[1]["ratio_vs_best_other_ci95"]
    assert 0.8 <= lo <= hi <= 0.82 and rows[1]["best_other_engine"] == "onnxruntime"
    assert rows[0]["ratio_vs_best_other_ci95"] is None             # only graphmode's ratio is the goal's


def test_isa_run_says_which_engines_keep_the_hosts_isa(monkeypatch):
    """`--isa avx2` holds graphmode to AVX2; unless the process started with torch's and oneDNN's
    own caps, the run's warnings say the other engines' kernels were not held to it."""
    from graphmode.bench.harness import BenchResult
    from graphmode.bench.machine import isa_env_missing
    from graphmode.cli.bench_cmd import _mark_isa
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "avx2")                # case does not matter to oneDNN
    assert isa_env_missing("avx2") == {"ATEN_CPU_CAPABILITY": "avx2"}
    res = BenchResult([{"engine": "graphmode", "label": "graphmode"}, {"engine": "eager", "label": "eager"}], {})
    _mark_isa(res, "avx2", True, ["avx2", "fma", "avx512f"])
    assert res.rows[0]["label"] == "graphmode[avx2]" and res.rows[0]["isa"] == "avx2" and "isa" not in res.rows[1]
    (w,) = res.meta["warnings"]
    assert "ATEN_CPU_CAPABILITY=avx2" in w and "ONEDNN_MAX_CPU_ISA" not in w and "cannot be held" in w
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    capped = BenchResult([{"engine": "graphmode", "label": "graphmode"}], {})
    _mark_isa(capped, "avx2", True, ["avx2", "fma", "avx512f"])
    assert "warnings" not in capped.meta
    plain = BenchResult([{"engine": "graphmode", "label": "graphmode"}], {})
    _mark_isa(plain, "auto", False, ["avx2", "fma"])                # no --isa: nothing to say
    assert "warnings" not in plain.meta and plain.rows[0]["label"] == "graphmode"
    monkeypatch.delenv("ATEN_CPU_CAPABILITY")
    best = BenchResult([{"engine": "graphmode", "label": "graphmode"}], {})
    _mark_isa(best, "avx2", True, ["avx2", "fma"])                  # the host's best: the others run it anyway
    assert "warnings" not in best.meta and best.rows[0]["label"] == "graphmode[avx2]"


def test_an_engine_whose_outputs_failed_the_check_is_no_baseline():
    """'best other' could be ONNX Runtime with 'ok, numerics off': a fast wrong answer."""
    from graphmode.bench.rounds import set_ratios

    def row(engine, ms, ok=True):
        return {"engine": engine, "label": engine, "median_ms": ms, "numerics_ok": ok}
    rows = [row("eager", 10.0), row("onnxruntime", 2.0, ok=False), row("openvino", 4.0), row("graphmode", 3.0)]
    assert set_ratios(rows)["engine"] == "openvino" and rows[3]["ratio_vs_best_other"] == 0.75


def test_a_recipe_that_cannot_run_a_shape_or_the_model_is_refused_before_timing(cli, tmp_path):
    """It was a failed graphmode row (no fix) after every other engine had been timed (trial Z)."""
    import yaml
    rec = {"version": 1, "name": "r", "inputs": [{"name": "x", "dtype": "f32", "shape": ["batch", 32]}],
           "dims": {"batch": {"buckets": [1, 4]}}}
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(rec))
    res = cli("bench", "--model", TINY, "--recipe", str(path), "--shape", "8x32", "--engines", "eager,graphmode",
              "--iters", "3")
    assert res.exit_code != 0 and "outside the recipe's dims.batch [1, 4]" in res.output and "eager" not in \
        res.output.split("error")[0]
    rec["inputs"][0]["name"] = "y"
    path.write_text(yaml.safe_dump(rec))
    res = cli("bench", "--model", TINY, "--recipe", str(path), "--shape", "4x32", "--engines", "eager,graphmode",
              "--iters", "3")
    assert res.exit_code != 0 and "declares inputs ['y']" in res.output and "['x']" in res.output


def test_an_interrupted_bench_says_so_and_writes_nothing(cli, tmp_path, monkeypatch):
    """Ctrl-C exited 130 without a word (trial Z): it says nothing was written, and why."""
    import graphmode.bench.harness as harness

    def interrupted(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(harness, "run_bench", interrupted)
    out = tmp_path / "results"
    res = cli("bench", "--model", TINY, "--shape", "4x32", "--engines", "eager", "--iters", "2", "--out", str(out))
    assert res.exit_code == 130 and "interrupted: nothing written" in res.output
    assert not any(out.glob("*.json"))


def test_any_interrupted_command_says_so(cli, monkeypatch):
    """click ended a Ctrl-C with exit 130 and no word (profile, in a trial)."""
    import graphmode.bench.models as models

    def interrupted(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(models, "load_cases", interrupted)
    res = cli("profile", "--model", TINY, "--shape", "4x32", "--runs", "2")
    assert res.exit_code == 130 and "interrupted (Ctrl-C)" in res.output
