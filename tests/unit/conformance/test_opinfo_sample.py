"""A CI-sized run of the OpInfo conformance suite (graphmode/conformance/opinfo_suite.py): OpInfo
entries spread over the database in a fixed order, one f32 sample each, in graph and in hybrid
mode, through real worker subprocesses (as `graphmode conformance opinfo` runs them). No case
may be wrong, crash or hang; refusals are allowed. The full run: `make conformance`."""
from __future__ import annotations

from graphmode.conformance import run_suite

OPS = 16


def test_opinfo_sample_has_no_wrong_answer_crash_or_hang(tmp_path):
    run = run_suite("opinfo", jobs=1, timeout_s=180, log_path=tmp_path / "workers.log",
                    options={"cache_dir": str(tmp_path / "cache"), "ops": OPS, "inductor_every": 0})
    bad = [f"{r.id}: {r.outcome}: {r.detail}" for r in run.results if r.outcome in ("wrong", "crash", "hang")]
    assert not bad, "\n".join(bad)
    assert len(run.results) == 2 * OPS and {r.tags[0] for r in run.results} == {"graph", "hybrid"}
    passed = {mode: sum(r.outcome == "pass" for r in run.results if mode in r.tags) for mode in ("graph", "hybrid")}
    assert passed["graph"] >= OPS // 2 and passed["hybrid"] >= passed["graph"], passed
