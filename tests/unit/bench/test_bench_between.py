"""`graphmode bench --between-buckets`: the contract recipe, the sampled request shapes, the
per-model summary against the goals, and one real run of the harness with a per-model recipe
on a tiny model (no assertion on speed)."""
from __future__ import annotations

from pathlib import Path

import pytest

from graphmode.bench import between, harness
from graphmode.bench.models import ModelCase
from graphmode.bench.quality import Probe
from graphmode.capture.spec import resolve_model_spec
from graphmode.recipe import load_recipe

TINY = f"{Path(__file__).resolve().parent / 'test_bench.py'}:tiny_mlp"
QUIET = Probe(loadavg=lambda: [0.1, 0.1, 0.1], waited=lambda: 0.0, cores=2)


class _Text:
    """The bits of a bundle the sampler reads: a text model's dims."""
    dim_names = ["batch", "seq"]


def test_samples_fall_between_buckets_inside_the_contract():
    buckets = {"batch": [1, 2, 4], "seq": [4, 10, 22, 46, 94, 128]}
    envs = between.sample_envs(_Text(), 12, seed=0, buckets=buckets)
    assert envs[0] == {"batch": 3, "seq": 50} and len(envs) == 13
    assert len({tuple(e.values()) for e in envs}) == 13
    for e in envs:
        assert 1 <= e["batch"] <= 4 and 2 <= e["seq"] <= 128
        assert not (e["batch"] in buckets["batch"] and e["seq"] in buckets["seq"])
    assert between.sample_envs(_Text(), 12, seed=0, buckets=buckets) == envs      # seeded


def test_contract_recipe_pads_ids_with_1_and_declares_the_mask():
    b = resolve_model_spec("graphmode.capture.families:distilbert")      # the same inputs, smaller
    rec = between.contract_recipe(b, "distilbert")
    loaded = load_recipe(rec)
    assert loaded.dim_buckets() == {"batch": [1, 2, 4], "seq": [4, 10, 22, 46, 94, 128]}
    ins = {i["name"]: i for i in rec["inputs"]}
    assert ins["input_ids"]["pad_value"] == 1 and ins["attention_mask"]["role"] == "attention_mask"
    m, ex, dims = between.mixer()
    assert m(**ex).shape == (2, 100) and dims == {"pixel_values": ["batch", 3, between.IMG, between.IMG]}


def _row(model, shape, engine, ratio, bucket=None):
    return {"model": model, "shape": shape, "engine": engine, "ratio_vs_eager": ratio, "condition": "quiet",
            "setup_detail": {"bucket": bucket}}


def test_summary_is_the_worst_and_the_mean_against_the_goals():
    rows = [_row("t5", [3, 50], "eager", 1.0), _row("t5", [3, 50], "graphmode", 1.2, {"batch": 4, "seq": 94}),
            _row("t5", [1, 7], "graphmode", 0.3), _row("vit", [3, 3, 64, 64], "graphmode", 0.8),
            _row("vit", [2, 3, 64, 64], "graphmode", 0.7)]
    by = {s["model"]: s for s in between.summary(rows)}
    assert by["t5"]["max"] == 1.2 and by["t5"]["max_at"] == [3, 50] and by["t5"]["mean"] == 0.75
    assert by["t5"]["met"] is False and by["vit"]["met"] is True
    lines = between.summary_lines(rows)
    assert lines[0].startswith("t5: between buckets NOT met: worst 1.20x eager at 3x50 (bucket {'batch': 4, 'seq': 94})")
    rows.append(_row("vit", [1, 3, 64, 64], "graphmode", None))            # a shape that did not run
    assert {s["model"]: s for s in between.summary(rows)}["vit"]["met"] is None


def test_the_report_says_which_way_each_shape_runs():
    ways = {"padded": 30.0, "split": 24.0, "eager": 20.0, "chosen": "eager"}
    rows = [_row("t5", [3, 50], "graphmode", 0.99, {"batch": 4, "seq": 94}), _row("t5", [1, 7], "graphmode", 0.5)]
    rows[0]["execution"] = {"ways": ways}
    assert between.summary(rows)[0]["chosen"] == {"eager": 1, "padded": 1}
    assert between.summary_lines(rows)[0].endswith("; ran 1 eager, 1 padded")
    assert between.way_lines(rows) == ["t5 3x50: runs eager (best ms: padded 30.00, split 24.00, eager 20.00)"]
    assert between.contract_recipe(resolve_model_spec(TINY), "tiny")["exe_mode"] == "hybrid"


def test_a_shape_that_runs_in_a_plan_of_its_own_is_not_called_padded():
    """The settle calls build a recurring value's own plan (runtime/exact.py): the summary said
    'ran 3 padded' for shapes timed in exact plans."""
    own = _row("t5", [3, 50], "graphmode", 0.6, {"batch": 4, "seq": 50})
    own["setup_detail"]["exact_plan"] = True
    rows = [own, _row("t5", [1, 7], "graphmode", 0.5, {"batch": 1, "seq": 10})]
    assert between.summary(rows)[0]["chosen"] == {"in its own plan": 1, "padded": 1}


def test_a_model_without_batch_or_seq_dims_is_refused_by_name():
    from graphmode.errors import GraphmodeError

    class _Static:
        dim_names: list[str] = []
    with pytest.raises(GraphmodeError, match="dims are none") as e:
        between.contract_recipe(_Static(), "static")
    assert e.value.where == "--model"


@pytest.mark.slow                    # a graphmode compile: ~15 s quiet, ~55 s on 2 loaded cores
def test_harness_runs_each_case_with_its_own_recipe(tmp_path):
    """A case's recipe (batch buckets 1, 2, 4) wins over the run's: batch 3 runs in bucket 4."""
    bundle = resolve_model_spec(TINY)
    rec = between.contract_recipe(bundle, "tiny")
    case = ModelCase(TINY, "tiny", bundle, [{"batch": 3}], recipe=rec)
    cfg = harness.BenchConfig(engines=[("eager", None), ("graphmode", None)], threads=1, iters=3, min_iters=3,
                              warmup=1, rewarm=0, cache_dir=tmp_path)
    res = harness.run_bench([case], cfg, probe=QUIET)
    g = next(r for r in res.rows if r["engine"] == "graphmode")
    assert g["status"] == "ok" and g["numerics_ok"] and g["setup_detail"]["bucket"] == {"batch": 4}
    assert g["ratio_vs_eager"] > 0 and between.summary(res.rows)[0]["timed"] == 1
    ways = g["execution"]["ways"]            # settled in setup: every way timed, the chosen one named
    assert g["setup_detail"]["settle_calls"] >= 2 and ways["chosen"] in ways and {"padded", "eager"} <= set(ways)
    # `padded` says how the timed calls ran (the chosen way), not that the shape needed a bigger bucket
    assert g["setup_detail"]["padded"] == (ways["chosen"] == "padded") and not g["setup_detail"]["exact_plan"]
