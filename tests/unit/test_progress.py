"""graphmode.progress: the library reports its stages to a callback and prints nothing itself;
compile hears capture, passes (one step per pass), proof, and warm-up the plans, bucket N of M."""
from __future__ import annotations

from pathlib import Path

import torch

import graphmode
from graphmode.progress import Stage, stage

TINY = f"{Path(__file__).resolve().parents[1] / 'e2e' / 'tiny_models.py'}:mlp"
RECIPE = {"version": 1, "name": "mlp-progress", "inputs": [{"name": "input", "dtype": "f32", "shape": ["batch", 16]}],
          "dims": {"batch": {"buckets": [1, 2, 4]}}, "codegen": {"kernel_selection": "heuristic"}}


def test_a_stage_reports_its_start_steps_and_end_and_no_end_when_it_fails():
    seen: list[Stage] = []
    with stage(seen.append, "plans", total=2, detail="two buckets") as plans:
        plans.step("batch=1")
        plans.step("batch=2")
    assert [(s.name, s.done, s.total, s.detail, s.finished) for s in seen] == [
        ("plans", 0, 2, "two buckets", False), ("plans", 1, 2, "batch=1", False), ("plans", 2, 2, "batch=2", False),
        ("plans", 2, 2, "two buckets", True)]
    seen.clear()
    try:
        with stage(seen.append, "capture"):
            raise ValueError("boom")
    except ValueError:
        pass
    assert [s.finished for s in seen] == [False]
    with stage(None, "nobody listens") as quiet:       # no callback: nothing to do, nothing fails
        quiet.step("x")


def test_compile_and_warmup_report_every_stage_and_print_nothing(tmp_path, capsys):
    seen: list[Stage] = []
    cm = graphmode.compile(TINY, dict(RECIPE), cache_dir=tmp_path, on_stage=seen.append)
    cm.warmup()
    names = [s.name for s in seen if s.done == 0 and not s.finished]
    assert names == ["capture", "passes", "proof", "plans"]
    assert all(any(s.name == n and s.finished for s in seen) for n in names), "a stage never ended"
    passes = [s for s in seen if s.name == "passes" and s.done and not s.finished]
    assert [s.detail for s in passes] == cm.recipe.pipeline() and passes[-1].done == passes[-1].total
    plans = [s for s in seen if s.name == "plans" and s.done and not s.finished]
    assert [(s.done, s.total, s.detail) for s in plans] == [
        (1, 3, "batch=1 (built)"), (2, 3, "batch=2 (built)"), (3, 3, "batch=4 (built)")]
    out = capsys.readouterr()
    assert out.out == "" and out.err == ""

    seen.clear()            # a second model over the same cache: every bucket comes from it
    again = graphmode.compile(TINY, dict(RECIPE), cache_dir=tmp_path, on_stage=seen.append)
    again(torch.randn(2, 16))      # a bucket built on first use: a one-step stage
    lazy = [s for s in seen if s.name == "plans"]
    assert [(s.done, s.total, s.finished) for s in lazy] == [(0, 1, False), (1, 1, False), (1, 1, True)]
    assert lazy[1].detail == "batch=2 (from the cache)"
