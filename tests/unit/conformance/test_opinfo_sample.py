"""A CI-sized run of the OpInfo conformance suite (graphmode/conformance/opinfo_suite.py): f32
OpInfo samples through graphmode in graph and in hybrid mode, in real worker subprocesses (as
`graphmode conformance opinfo` runs them). No case may be wrong, crash or hang; refusals are
allowed. The full run: `make conformance` (tables in docs/conformance.md)."""
from __future__ import annotations

import pytest

from graphmode.conformance import run_suite

# the first OpInfo entries in the suite's fixed hash order (`OpInfoSuite(ops=N).sample_names()`,
# torch 2.13), named here so that only the worker imports the database (~10 s); a name a later
# torch drops is a crash of its case, which fails the test loudly
SAMPLES = ["_softmax_backward_data#0", "atan#0", "conj_physical#0", "constant_pad_nd#0", "diagonal_copy#0",
           "fft.hfft2#0", "lgamma#0", "nanquantile#0"]


def test_opinfo_sample_has_no_wrong_answer_crash_or_hang(tmp_path):
    ids = [f"{mode}:{s}" for s in SAMPLES for mode in ("graph", "hybrid")]
    run = run_suite("opinfo", jobs=1, timeout_s=120, log_path=tmp_path / "workers.log",
                    options={"cache_dir": str(tmp_path / "cache"), "ids": ids, "inductor_every": 0})
    bad = [f"{r.id}: {r.outcome}: {r.detail}" for r in run.results if r.outcome in ("wrong", "crash", "hang")]
    assert not bad, "\n".join(bad)
    assert [r.id for r in run.results] == ids
    passed = {mode: sum(r.outcome == "pass" for r in run.results if mode in r.tags) for mode in ("graph", "hybrid")}
    assert passed["graph"] >= len(SAMPLES) // 2 and passed["hybrid"] >= passed["graph"], passed


@pytest.mark.slow
def test_opinfo_entries_spread_over_the_database(tmp_path):
    """16 entries picked by the suite itself (the parent imports the database too)."""
    ops = 16
    run = run_suite("opinfo", jobs=1, timeout_s=180, log_path=tmp_path / "workers.log",
                    options={"cache_dir": str(tmp_path / "cache"), "ops": ops, "inductor_every": 0})
    bad = [f"{r.id}: {r.outcome}: {r.detail}" for r in run.results if r.outcome in ("wrong", "crash", "hang")]
    assert not bad, "\n".join(bad)
    assert len(run.results) == 2 * ops and {r.tags[0] for r in run.results} == {"graph", "hybrid"}
