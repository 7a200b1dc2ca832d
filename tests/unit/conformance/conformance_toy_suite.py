"""A suite whose cases end in every class on purpose, for the conformance runner's tests.
Runs in the runner's worker subprocesses (imported by "conformance_toy_suite:ToySuite")."""
from __future__ import annotations

import os
import signal
import time

from graphmode.conformance import Case, Judged, judge
from graphmode.errors import CaptureError


def _pass():
    return None


def _wrong():
    return "output 0: 1 of 4 elements differ"


def _refuse():
    raise CaptureError("Frobnicate is not supported", where="onnx toy.onnx node #0 Frobnicate")


def _crash():
    return {}["missing"]


def _segfault():
    os.kill(os.getpid(), signal.SIGSEGV)


def _hang():
    while True:
        time.sleep(1)


BEHAVIOUR = {"pass": _pass, "wrong": _wrong, "refused": _refuse, "crash": _crash, "segv": _segfault, "hang": _hang}


class ToySuite:
    name = "toy"
    title = "Toy suite"
    subsets = {"even": "even-numbered cases"}
    others = ("Other",)

    def __init__(self, kinds: str = "pass,wrong,refused,crash,segv,hang,pass", cache_dir: str | None = None):
        self.kinds = kinds.split(",")

    def versions(self) -> dict[str, str]:
        return {"toy": "1.0"}

    def cases(self) -> list[Case]:
        return [Case(f"case{i}_{k}", f"Op{k}", ("even",) if i % 2 == 0 else (), k) for i, k in enumerate(self.kinds)]

    def run_case(self, case: Case) -> Judged:
        j = judge(BEHAVIOUR[case.payload])
        j.others["Other"] = "pass" if case.payload == "pass" else "fail"
        return j
