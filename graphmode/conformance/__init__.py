"""Conformance: suites nobody here wrote (the ONNX backend node tests, PyTorch OpInfo), run
through graphmode case by case, each case ending in exactly one class.

    pass     graphmode's outputs match the suite's expected outputs
    wrong    graphmode returned outputs, and they do not match (worse than a refusal)
    refused  a graphmode error (GraphmodeError) naming the op or field
    crash    any other exception, or the worker process died (a signal)
    hang     no answer within the per-case timeout (the worker is killed)

`runner.run_suite` runs the cases in worker subprocesses (`worker.py`), so a hang or a
segfault is contained and classified; `report` writes the results as JSON and as a Markdown
table. A suite is one module (`onnx_suite.py`, `opinfo_suite.py`) with a class following
`runner.Suite`, named in `runner.SUITES`.
"""
from __future__ import annotations

from graphmode.conformance.runner import (OUTCOMES, Case, CaseResult, Judged, Suite, SuiteRun, get_suite, judge,
                                          pick_sample, run_suite)

__all__ = ["OUTCOMES", "Case", "CaseResult", "Judged", "Suite", "SuiteRun", "get_suite", "judge", "pick_sample",
           "run_suite"]
