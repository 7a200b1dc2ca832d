"""The conformance runner: every class reached by a real worker subprocess (a segfault and a hang
included, each contained), the sample picker, the JSON and Markdown reports."""
from __future__ import annotations

import json

from graphmode.conformance import Case, pick_sample, run_suite
from graphmode.conformance import report

TOY = "conformance_toy_suite:ToySuite"


def test_every_class_in_worker_processes(tmp_path):
    run = run_suite(TOY, jobs=2, timeout_s=3, log_path=tmp_path / "log")
    got = {r.id: r.outcome for r in run.results}
    assert got == {"case0_pass": "pass", "case1_wrong": "wrong", "case2_refused": "refused", "case3_crash": "crash",
                   "case4_segv": "crash", "case5_hang": "hang", "case6_pass": "pass"}
    by_id = {r.id: r for r in run.results}
    assert "Frobnicate" in by_id["case2_refused"].detail and "CaptureError" in by_id["case2_refused"].detail
    assert by_id["case3_crash"].detail.startswith("KeyError: 'missing' at conformance_toy_suite.py:")
    assert "SIGSEGV" in by_id["case4_segv"].detail
    assert "3 s" in by_id["case5_hang"].detail
    assert by_id["case0_pass"].others == {"Other": "pass"}
    assert run.counts() == {"pass": 2, "wrong": 1, "refused": 1, "crash": 2, "hang": 1}
    assert run.versions["toy"] == "1.0" and "torch" in run.versions and "graphmode" in run.versions


def test_a_worker_replaced_after_it_dies_keeps_going():
    run = run_suite(TOY, jobs=1, timeout_s=3, options={"kinds": "segv,pass,hang,pass"})
    assert [r.outcome for r in run.results] == ["crash", "pass", "hang", "pass"]


def test_sample_is_spread_over_ops_and_stable():
    cases = [Case(f"{op}_{i}", op) for op in "abcdef" for i in range(10)]
    s = pick_sample(cases, 12)
    assert len(s) == 12 and {c.op for c in s} == set("abcdef")
    assert all(sum(c.op == op for c in s) == 2 for op in "abcdef")
    assert {c.id for c in s} == {c.id for c in pick_sample(list(reversed(cases)), 12)}   # not order-dependent
    assert pick_sample(cases, 3) == pick_sample(cases, 3) and len({c.op for c in pick_sample(cases, 3)}) == 3
    assert len(pick_sample(cases, 1000)) == 60


def test_reports_json_markdown_and_publish(tmp_path):
    run = run_suite(TOY, jobs=1, timeout_s=3, options={"kinds": "pass,wrong,refused,pass"})
    js, md = report.write(run, tmp_path)
    back = report.load(js)
    assert [r.to_json() for r in back.results] == [r.to_json() for r in run.results]
    assert json.loads(js.read_text())["counts"] == {"pass": 2, "wrong": 1, "refused": 1, "crash": 0, "hang": 0}
    text = md.read_text()
    assert "| all | 4 | 2 (50%) | 1 | 1 | 0 | 0 | 2 (50%) |" in text
    assert "| even-numbered cases | 2 | 1 (50%) | 0 | 1 | 0 | 0 | 1 (50%) |" in text
    assert "`case1_wrong` (Opwrong): **wrong**: output 0: 1 of 4 elements differ" in text
    assert "| Oprefused | 1 | 0 (0%) | 0 | 1 | 0 | 0 | 0 (0%) | CaptureError: onnx toy.onnx node #0" in text
    assert "toy 1.0" in text
    doc = tmp_path / "conformance.md"
    doc.write_text("# Conformance\n\nintro\n\n<!-- conformance:other:begin -->\nkeep\n<!-- conformance:other:end -->\n")
    report.publish(run, doc)
    report.publish(run, doc)           # replaced, not appended twice
    out = doc.read_text()
    assert out.count("<!-- conformance:toy:begin -->") == 1 and "keep" in out and "intro" in out
    assert out.count("| all | 4 |") == 1
