"""`graphmode cache explain --timings`: each timing-cache entry with the conditions it was
timed under and what the next plan build does with it, from entries written by the real
TimingCache (no compiler or timing needed)."""
from __future__ import annotations

import json

from typer.testing import CliRunner

from graphmode.backends.cpu.tactics import timing
from graphmode.backends.cpu.tactics.cache import TimingCache, retime_reason, timed_busy
from graphmode.cli.app import _register, app
from graphmode.paths import cache_layout

_register()


def _key(m: int) -> dict:
    return {"version": 2, "op": "linear", "batch": 1, "m": m, "n": 64, "k": 32, "threads": 2, "candidates": {}}


def _entry(**kw) -> dict:
    e = {"timings_s": {"aten": 2e-5, "avx2_6x16": 1e-5}, "medians_s": {}, "mins_s": {}, "rejected": {},
         "noisy": False, "tries": 1, "load": 0.5, "cores": 2, "cpu_per_wall": 1.9, "starved": False, "digests": {}}
    e.update(kw)
    return e


def test_entries_say_how_they_were_timed_and_what_the_next_build_does(tmp_path, monkeypatch):
    cache = TimingCache(cache_layout(tmp_path).tactics)
    cache.put(_key(1), _entry(), reps=3)
    cache.put(_key(2), _entry(starved=True, noisy=True, tries=3, load=5.0, cpu_per_wall=0.3), reps=3)
    cache.put(_key(3), _entry(noisy=True, tries=1), reps=3)
    (cache_layout(tmp_path).tactics / "gemm-broken.json").write_text("{not json")
    monkeypatch.setattr(timing, "machine_load", lambda: (0.4, 2))         # the host is quiet now
    res = CliRunner().invoke(app, ["cache", "explain", "--timings", "--cache-dir", str(tmp_path), "--json"])
    assert res.exit_code == 0, res.output
    rows = {r.get("shape", {}).get("m", r["file"]): r for r in json.loads(res.output)}
    assert rows[1]["conditions"] == "quiet" and rows[1]["next_build"] == "uses it"
    assert rows[1]["fastest"] == "avx2_6x16" and rows[1]["fastest_us"] == 10.0 and rows[1]["cpu_per_wall"] == 1.9
    assert rows[2]["conditions"] == "starved" and rows[2]["next_build"].startswith("timed starved, and the host is quiet")
    assert rows[3]["conditions"] == "noisy" and rows[3]["next_build"] == "noisy: re-timing 1 of 2"
    assert rows["gemm-broken.json"]["unreadable"]
    monkeypatch.setattr(timing, "machine_load", lambda: (6.0, 2))         # busy: the starved entry waits
    res = CliRunner().invoke(app, ["cache", "explain", "--timings", "--cache-dir", str(tmp_path), "--json"])
    busy = {r.get("shape", {}).get("m"): r for r in json.loads(res.output)}
    assert busy[2]["next_build"] == "uses it until a build finds the host quiet"
    # two entries of one shape told apart: the field that differs is shown (it looked like a duplicate)
    cache.put(dict(_key(1), bias=True, epilogue="relu"), _entry(), reps=3)
    res = CliRunner().invoke(app, ["cache", "explain", "--timings", "--cache-dir", str(tmp_path), "--json"])
    variants = [r["variant"] for r in json.loads(res.output) if r.get("shape", {}).get("m") == 1]
    assert sorted(map(str, variants)) == ["{'bias': True, 'epilogue': 'relu'}", "{}"]


def test_the_retiming_policy():
    assert retime_reason(_entry(noisy=True, tries=2), 2, 0.1, 2) == "noisy: re-timing 2 of 2"
    assert retime_reason(_entry(noisy=True, tries=3), 2, 0.1, 2) is None
    assert retime_reason(_entry(starved=True, tries=9), 2, 1.5, 2).startswith("timed starved")
    assert retime_reason(_entry(starved=True, tries=9), 2, 2.5, 2) is None            # busy now: deferred
    assert retime_reason(_entry(starved=True, noisy=True), 0, 0.1, 2) is None          # frozen (an artifact)
    old = {k: v for k, v in _entry(load=7.0, noisy=True, tries=3).items() if k not in ("starved", "cpu_per_wall")}
    assert timed_busy(old) and retime_reason(old, 2, 0.1, 2).startswith("timed on a busy host")
    assert not timed_busy(_entry())


def test_explain_without_a_model_or_timings_is_a_clear_error(tmp_path):
    res = CliRunner().invoke(app, ["cache", "explain", "--cache-dir", str(tmp_path)])
    assert res.exit_code == 2 and "--timings" in res.output


def test_onnx_exports_are_listed_and_cleared_with_onnx_and_a_file_cache_dir_is_refused(tmp_path):
    """The ONNX exports were most of a cache (87 of 88 MB) and neither `cache ls` nor `clear`
    named them; `--cache-dir` a file ran uncached with a log line only."""
    exports = cache_layout(tmp_path).onnx / "bench"
    exports.mkdir(parents=True)
    (exports / "m.onnx").write_bytes(b"\0" * 4096)
    res = CliRunner().invoke(app, ["cache", "ls", "--cache-dir", str(tmp_path)])
    assert res.exit_code == 0 and "ONNX exports" in res.output and "1 file(s)" in res.output, res.output
    res = CliRunner().invoke(app, ["cache", "clear", "--cache-dir", str(tmp_path)])
    assert res.exit_code == 0 and (exports / "m.onnx").exists()                 # only with --onnx
    res = CliRunner().invoke(app, ["cache", "clear", "--onnx", "--cache-dir", str(tmp_path)])
    assert res.exit_code == 0 and "removed 1 ONNX export file(s)" in res.output and not exports.exists()
    afile = tmp_path / "afile"
    afile.write_text("x")
    res = CliRunner().invoke(app, ["cache", "ls", "--cache-dir", str(afile / "sub")])
    assert res.exit_code == 2 and "is a file" in " ".join(res.output.replace("│", " ").split())
