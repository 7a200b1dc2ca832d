"""A synthesised dim's recurring values become buckets of their own (dims.D.exact_plans,
runtime/exact.py): the refinement logic, the recipe check, and a real compile whose requests
run in the refined bucket and match eager. Nothing asserts on speed."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn as nn

import graphmode
from graphmode.capture.spec import GraphmodeNotice
from graphmode.recipe import check_semantics, load_recipe
from graphmode.runtime.exact import RECUR, ExactValues

HERE = Path(__file__).resolve()


class _Tokens(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 8)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def tokens():
    return _Tokens().eval(), {"x": torch.randn(2, 4, 16)}, {"x": ["batch", "seq", 16]}


RECIPE = {"version": 1, "name": "exact", "inputs": [{"name": "x", "dtype": "f32", "shape": ["batch", "seq", 16]}],
          "dims": {"batch": {"buckets": [1, 2]}, "seq": {"min": 2, "max": 16, "max_padding": 0.5, "exact_plans": 1}},
          "exe_mode": "graph", "codegen": {"kernel_selection": "heuristic"}}


def test_a_value_gets_its_bucket_on_its_third_request_and_holds_smaller_ones():
    ev = ExactValues(load_recipe(dict(RECIPE, dims={**RECIPE["dims"], "seq": {**RECIPE["dims"]["seq"],
                                                                              "exact_plans": 2}})))
    bucket = {"batch": 1, "seq": 10}
    got = [ev.refine({"batch": 1, "seq": 6}, bucket)["seq"] for _ in range(RECUR + 1)]
    assert got == [10] * (RECUR - 1) + [6, 6] and ev.report() == {"seq": [6]}
    assert ev.refine({"batch": 1, "seq": 5}, bucket)["seq"] == 6             # padded to 6, not 10
    assert ev.refine({"batch": 1, "seq": 5}, bucket, exact=["seq"])["seq"] == 10   # unsafe to pad: exact only
    assert ev.refine({"batch": 1, "seq": 7}, bucket)["seq"] == 10            # above 6: the recipe's bucket
    for _ in range(RECUR):
        ev.refine({"batch": 1, "seq": 8}, bucket)
    for _ in range(RECUR):
        ev.refine({"batch": 1, "seq": 9}, bucket)                            # past exact_plans: 2
    assert ev.report() == {"seq": [6, 8]}
    assert ExactValues(load_recipe(dict(RECIPE, dims={"batch": {"buckets": [1, 2]}, "seq": {"buckets": [4, 16]}}))
                       ).refine({"seq": 6, "batch": 1}, {"seq": 16, "batch": 1}) == {"seq": 16, "batch": 1}


def test_exact_plans_refine_explicit_buckets_too():
    """A draft keeps batch 1 as a bucket of its own beside exact_plans (a recipe of max_buckets
    alone synthesised [2, 6, 14, 32], and a lone request ran eagerly)."""
    rec = load_recipe(dict(RECIPE, dims={"batch": {"buckets": [1, 4], "exact_plans": 2}, "seq": RECIPE["dims"]["seq"]}))
    assert not [e for e in check_semantics(rec).errors if e.where.startswith("dims.batch")]
    ev = ExactValues(rec)
    for _ in range(RECUR):
        got = ev.refine({"batch": 3, "seq": 16}, {"batch": 4, "seq": 16})
    assert got == {"batch": 3, "seq": 16}
    assert load_recipe(RECIPE).hash() != load_recipe(dict(RECIPE, dims={**RECIPE["dims"], "seq": {
        "min": 2, "max": 16, "max_padding": 0.5}})).hash()


def test_a_recurring_seq_runs_in_its_own_bucket_and_matches_eager(tmp_path):
    """The value's plan builds in the background from its third request on: that request and any
    before the plan is ready run padded in the recipe's bucket, never waiting for it."""
    cm = graphmode.compile(f"{HERE}:tokens", RECIPE, "host", cache_dir=tmp_path)
    ref_model = _Tokens().eval()
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(1))
    seqs = []

    def call():
        got = cm(x=x)
        seqs.append(cm.last_path["bucket"]["seq"])
        assert got.shape == (2, 5, 8) and torch.allclose(got, ref_model(x), rtol=1e-5, atol=1e-6)
    for _ in range(RECUR):
        call()
    assert seqs[-1] > 5 and cm.metrics()["exact_values"] == {"seq": [5]}      # padded: its plan is building
    assert cm.wait_for_builds(timeout=600) and cm.is_built({"batch": 2, "seq": 5})
    assert cm.metrics()["plans_building"] == [] and cm.events["compile"] >= 1
    assert cm.events["compile_failed"] == 0
    call()
    call()
    assert seqs[-2:] == [5, 5] and seqs[0] > 5
    with pytest.warns(GraphmodeNotice, match=r"recurring values \(\{'seq': \[5\]\}.* are not saved"):
        cm.save(tmp_path / "m.gm")                  # a .gm holds the recipe's buckets: said, not silent


def test_a_recurring_value_whose_plan_fails_to_build_stays_padded_and_says_so(tmp_path, monkeypatch):
    cm = graphmode.compile(f"{HERE}:tokens", RECIPE, "host", cache_dir=tmp_path)
    import graphmode.runtime.build as build

    real = build.build_executable

    def refuse(model, env):
        if env["seq"] == 5:
            raise RuntimeError("no room for this plan")
        return real(model, env)
    monkeypatch.setattr(build, "build_executable", refuse)
    x = torch.randn(2, 5, 16)
    for _ in range(RECUR):
        cm(x=x)
    assert cm.wait_for_builds(timeout=600)
    assert cm.events["compile_failed"] == 1 and cm.metrics()["exact_values"] == {"seq": []}
    failed = [e for e in cm.event_log if e["event"] == "compile_failed"]
    assert failed[0]["bucket"] == "batch=2,seq=5" and "no room for this plan" in failed[0]["error"]
    for _ in range(RECUR):                        # not tried again
        cm(x=x)
    assert cm.last_path["bucket"]["seq"] > 5 and not cm.is_built({"batch": 2, "seq": 5})
    assert cm.wait_for_builds(timeout=600) and cm.events["compile_failed"] == 1


def test_at_exit_the_queued_builds_are_dropped_and_the_one_in_flight_finishes():
    """A daemon thread still inside a kernel build while the interpreter tore down aborted the
    process (exit 134) after the script's results (a trial: 1 run in 6)."""
    import threading

    from graphmode.runtime.plans import _Background

    started, release, built = threading.Event(), threading.Event(), []

    class Model:
        bucket_key = staticmethod(lambda env: f"seq={env['seq']}")

        def executable(self, env, report_build=True):
            started.set()
            assert release.wait(60)
            built.append(env["seq"])

    b = _Background(Model())
    b.put({"seq": 5})
    b.put({"seq": 7})
    assert started.wait(60)
    closing = threading.Thread(target=b.close, args=(60,))
    closing.start()
    while not b.closed:            # close() holds the queue empty before it waits for the build
        closing.join(0.01)
    assert b.queue == [] and closing.is_alive()        # waiting for seq 5's build
    release.set()
    closing.join(60)
    assert not closing.is_alive() and built == [5] and b.current is None
    b.put({"seq": 9})              # nothing is queued once closed
    assert b.queue == [] and b.pending() == []


@pytest.mark.slow       # a fresh interpreter compiles: ~8 s; the close itself is the unit test above
def test_a_script_that_ends_while_a_plan_builds_exits_cleanly(tmp_path):
    import subprocess
    import sys
    script = (f"import graphmode, torch\n"
              f"cm = graphmode.compile({str(HERE) + ':tokens'!r}, {RECIPE!r}, 'host', cache_dir={str(tmp_path)!r})\n"
              "x = torch.randn(2, 5, 16)\n"
              f"for _ in range({RECUR}):\n    cm(x=x)\n"
              "print('building', cm.metrics()['plans_building'])\n")
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0 and "terminate called" not in res.stderr, res.stderr[-2000:]
    assert "building" in res.stdout        # (its plan is queued at the third call, whose kernels take a while)
