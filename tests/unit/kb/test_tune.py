"""Tuning on tiny models with real trials (compiled, checked against eager, timed): the search
space, the Pareto set, the budget, the journal that resumes an interrupted run, and trials
that violate the contract or fail, kept with their reasons. Nothing asserts a speed."""
from __future__ import annotations

import json
import time

import pytest
from kb_helpers import recipe_data, spec

from graphmode.errors import GraphmodeError
from graphmode.recipe import load_recipe
from graphmode.recipe.buckets import synthesize_buckets
from graphmode.targets import get_target
from graphmode.tune.journal import Journal
from graphmode.tune.search import pareto, run_search
from graphmode.tune.space import Axis, apply, baseline, describe, key_of, search_space
from graphmode.tune.trial import TrialCutOff, TrialResult, TrialRunner
from graphmode.tune.version import next_version_path, write_version


def test_search_space_stays_under_the_padding_bound_and_the_tolerance():
    rec = load_recipe(recipe_data(dims={"batch": {"min": 1, "max": 16, "max_padding": 0.5}}))
    tgt = get_target("cpu_avx2")
    axes = {a.name: a for a in search_space(rec, tgt, objective="latency", tol=1e-5, max_buckets=None,
                                            threads=[2, 1])}
    assert list(axes) == ["precision", "fusion", "fusion.max_ops", "dims.batch", "threads", "kernel_selection"]
    assert axes["precision"].values == [{"compute": "f32"}] and "does not compute in bf16" in axes["precision"].notes[0]
    bf16 = tgt.model_copy(update={"dtypes": tgt.dtypes + ["bf16"]})
    strict = search_space(rec, bf16, objective="latency", tol=1e-5, max_buckets=None, threads=[1])
    assert "needs --tol >= 0.02" in strict[0].notes[0] and len(strict[0].values) == 1
    dims = axes["dims.batch"].values
    assert dims[0] == {"min": 1, "max": 16, "max_padding": 0.5} and dims[-1] == {"min": 1, "max": 16}   # exact last
    for v in dims:
        s = synthesize_buckets(1, 16, max_padding=v.get("max_padding", 0.0))
        assert s.feasible and float(s.worst_padding) <= 0.5
    assert axes["threads"].values == [2, 1] and axes["kernel_selection"].values == ["heuristic", "latency_first"]
    loose = {a.name: a for a in search_space(rec, bf16, objective="throughput", tol=2e-2, max_buckets=None,
                                             threads=[1])}
    assert loose["precision"].values[1]["compute"] == "bf16" and "threads" not in loose
    assert loose["kernel_selection"].values == ["heuristic", "throughput_first"]
    cfg = dict(baseline(list(axes.values())), **{"fusion.max_ops": 8, "dims.batch": dims[-1], "threads": 1})
    data = apply(recipe_data(dims={"batch": {"min": 1, "max": 16, "max_padding": 0.5}}), cfg)
    assert data["optimize"]["fusion"]["max_ops"] == 8 and data["dims"]["batch"] == {"min": 1, "max": 16}
    assert describe(cfg, baseline(list(axes.values()))) == "fusion.max_ops=8, dims.batch=exact, threads=1"


def test_pareto_keeps_the_non_dominated_trials_that_kept_the_contract():
    def t(i, p99, tput, mem, comp, status="ok"):
        return TrialResult(i, {"i": i}, status, metrics={"p99_ms": p99, "throughput": tput, "peak_memory_mb": mem,
                                                         "compile_s": comp})
    trials = [t(0, 1.0, 100, 5, 1), t(1, 2.0, 50, 5, 1), t(2, 0.5, 100, 9, 1), t(3, 0.1, 1e6, 1, 0, "violates")]
    assert [r.index for r in pareto(trials)] == [0, 2]


def test_the_best_is_never_a_trial_another_beats_on_every_axis(tmp_path):
    """tune wrote trial 8 as the best while trial 10, 0.2% faster at p99 (under MIN_GAIN, so the
    descent kept 8), had 13% more items/s and a tenth of the compile time: 8 was not even in the
    Pareto table it printed."""
    metrics = {1: (0.3158, 10588, 8.25), 2: (0.3151, 11964, 0.83)}     # value of axis a -> p99, items/s, compile

    def run(cfg, index, deadline):
        p99, tput, comp = metrics.get(cfg["a"], (0.40, 9000, 1.0))
        return TrialResult(index, cfg, "ok", metrics={"p99_ms": p99, "p50_ms": p99, "throughput": tput,
                                                     "peak_memory_mb": 4, "compile_s": comp})
    res = run_search(run, [Axis("a", [0, 1, 2])], budget_s=60, objective="latency",
                     journal=Journal(tmp_path / "j", "r"))
    assert res.best.config == {"a": 2} and res.best in res.pareto


def test_a_gain_that_does_not_repeat_leaves_the_recipe_as_written(tmp_path):
    """Trial a=1 timed once in a quiet moment (1 ms against the baseline's 3): measured again
    beside the baseline it is no faster, so the recipe as written stays; a gain that repeats
    is kept, with both measurements in the result."""
    def runner(flaky: bool):
        seen = {}

        def run(cfg, index, deadline):
            n = seen[cfg["a"]] = seen.get(cfg["a"], 0) + 1
            p99 = 1.0 if cfg["a"] == 1 and (n == 1 or not flaky) else 3.0
            return TrialResult(index, cfg, "ok", metrics={"p99_ms": p99, "p50_ms": p99, "throughput": 1 / p99,
                                                         "peak_memory_mb": 4, "compile_s": 1})
        return run
    res = run_search(runner(True), [Axis("a", [0, 1])], budget_s=60, objective="latency",
                     journal=Journal(tmp_path / "j", "r"))
    assert res.best.config == {"a": 0} and not res.confirmation["held"]
    assert res.confirmation["best"].metrics["p99_ms"] == 3.0
    res = run_search(runner(False), [Axis("a", [0, 1])], budget_s=60, objective="latency",
                     journal=Journal(tmp_path / "k", "r"))
    assert res.best.config == {"a": 1} and res.confirmation["held"]


def test_a_best_found_while_the_recipe_as_written_breaks_its_contract_must_keep_it_again(tmp_path):
    """The recipe as written broke its jitter bound, so the best was written from one timing,
    with no `measured again` line (trial S); the docs say the best is always confirmed. Now it
    is measured again and must keep the contract, else no version is written."""
    def runner(flaky: bool):
        seen = {}

        def run(cfg, index, deadline):
            n = seen[cfg["a"]] = seen.get(cfg["a"], 0) + 1
            ok = cfg["a"] == 1 and (n == 1 or not flaky)
            return TrialResult(index, cfg, "ok" if ok else "violates", reason=None if ok else "p99/p50 above 2",
                               metrics={"p99_ms": 2.0, "p50_ms": 1.0, "throughput": 1.0, "peak_memory_mb": 4,
                                        "compile_s": 1})
        return run
    res = run_search(runner(True), [Axis("a", [0, 1])], budget_s=60, objective="latency",
                     journal=Journal(tmp_path / "j", "r"))
    assert res.best is None and res.confirmation == dict(res.confirmation, held=False, contract=True)
    res = run_search(runner(False), [Axis("a", [0, 1])], budget_s=60, objective="latency",
                     journal=Journal(tmp_path / "k", "r"))
    assert res.best.config == {"a": 1} and res.confirmation["held"] and res.confirmation["best"].status == "ok"


def test_a_recipe_that_does_not_describe_the_model_stops_at_the_baseline(tmp_path):
    """A recipe naming an input the model lacks (exit 2): each of 13 trials failed the same way
    and the run ended 'no configuration kept the contract'. No knob fixes it: the baseline's
    own error is raised, and nothing else runs."""
    from graphmode.verdict import ContractRefused, Issue
    ran = []

    def run(cfg, index, deadline):
        ran.append(cfg)
        err = ContractRefused([Issue("mismatch", "the model has no input 'token_type_ids'", "inputs[2].name",
                                     "token_type_ids", "name the model's inputs")])
        return TrialResult(index, cfg, "failed", f"ContractRefused: {err.render()}", error=err)
    with pytest.raises(ContractRefused) as e:
        run_search(run, [Axis("a", [0, 1, 2])], budget_s=60, objective="latency", journal=Journal(tmp_path / "j", "r"))
    assert e.value.exit_code == 2 and len(ran) == 1


@pytest.fixture(scope="module")
def mlp_runner(kb_cache):
    data = recipe_data(dims={"batch": {"min": 1, "max": 8, "max_padding": 0.5}})
    return data, TrialRunner(spec("mlp"), data, get_target("host"), tol=1e-5, measure_s=0.2, cache_dir=kb_cache)


def _axes(data):
    rec = load_recipe(data)
    axes = search_space(rec, get_target("host"), objective="latency", tol=1e-5, max_buckets=None, threads=[1])
    return [a for a in axes if a.name == "fusion.max_ops"]


def test_a_journal_line_edited_by_hand_is_skipped_not_replayed(tmp_path):
    """A p99 of "fast" crashed the report with a raw traceback; -5 ms and NaN won the search and
    were written into the tuned recipe's header."""
    from graphmode.tune.trial import TrialResult
    good = TrialResult(0, {"threads": 1}, "ok", None, {"p50_ms": 0.5, "p99_ms": 0.6, "throughput": None}, "h", 1.0, 3)
    j = Journal(tmp_path / "r.tune.jsonl", "r")
    j.append(good)
    for i, bad in enumerate(("fast", -5, float("nan"), True)):
        forged = dict(good.to_json(), index=i + 1, config={"threads": i + 2},
                      metrics=dict(good.metrics, p99_ms=bad))
        with open(j.path, "a") as f:
            f.write(json.dumps({"run": "r", "kind": "trial", "trial": forged}) + "\n")
    with open(j.path, "a") as f:
        f.write(json.dumps({"run": "r", "kind": "trial", "trial": dict(good.to_json(), status="best")}) + "\n")
    back = Journal(j.path, "r")
    assert list(back.load()) == [good.key] and back.skipped == 5


def test_interrupted_search_resumes_from_the_journal(mlp_runner, tmp_path):
    data, runner = mlp_runner
    axes = _axes(data)
    journal = Journal(tmp_path / "r.tune.jsonl", "run-1")
    seen = []

    def interrupt_after_two(r):
        seen.append(r)
        if len(seen) == 2:
            raise KeyboardInterrupt              # Ctrl-C between two trials
    with pytest.raises(KeyboardInterrupt):
        run_search(runner.run, axes, budget_s=600, objective="latency", journal=journal, on_trial=interrupt_after_two)
    lines = [json.loads(x) for x in journal.path.read_text().splitlines()]
    assert [x["kind"] for x in lines] == ["trial", "trial"] and all(x["run"] == "run-1" for x in lines)
    res = run_search(runner.run, axes, budget_s=600, objective="latency", journal=Journal(journal.path, "run-1"))
    assert [t.replayed for t in res.trials[:2]] == [True, True] and not any(t.replayed for t in res.trials[2:])
    assert [t.key for t in res.trials[:2]] == [r.key for r in seen]
    assert res.trials[0].metrics == seen[0].metrics and res.resumed == 2
    # `tune --fresh` starts the run over; interrupted, the same command without --fresh resumes it
    # (the fresh run had a key of its own, so nothing ever matched its trials)
    fresh = Journal(journal.path, "run-1")
    fresh.start({"fresh": True})
    assert fresh.load() == {}
    fresh.append(res.trials[0])
    assert list(Journal(journal.path, "run-1").load()) == [res.trials[0].key]
    alternatives = sum(len(a.values) - 1 for a in axes)
    assert len(res.trials) >= 1 + alternatives and res.stopped == "converged"
    assert len({t.key for t in res.trials}) == len(res.trials)
    for t in res.trials:
        assert t.status in ("ok", "violates", "failed")
        if t.status == "ok":
            assert t.metrics["numerics_err"] <= 1e-5 and t.metrics["p50_ms"] > 0 and t.samples >= 3
            assert t.metrics["p99_ms"] >= t.metrics["p50_ms"] and t.metrics["p99_over_p50"] >= 1.0
    other = run_search(runner.run, axes[:1], budget_s=600, objective="latency", journal=Journal(journal.path, "run-2"))
    assert other.resumed == 0                     # another run key: nothing replayed


def test_the_budget_bounds_the_search(mlp_runner, tmp_path):
    """A trial starts only while the budget still fits the longest one so far, and the search
    stops there. The budget's clock is a fake one that advances one unit per (real) trial, so
    the test does not depend on how fast the host runs them: with the wall clock and a budget
    of 3x a warm trial, one of this VM's slow periods made the baseline alone outlast it."""
    data, runner = mlp_runner
    rec = load_recipe(data)
    axes = search_space(rec, get_target("host"), objective="latency", tol=1e-5, max_buckets=None, threads=[1])
    assert sum(len(a.values) - 1 for a in axes) >= 9
    now, starts = [0.0], []

    def run(cfg, index, deadline):
        r = runner.run(cfg, index)                  # the real trial; the budget runs on the fake clock
        now[0] += 1.0
        r.seconds = 1.0
        return r
    res = run_search(run, axes, budget_s=3.5, objective="latency", journal=Journal(tmp_path / "j", "b"),
                     on_trial=lambda r: starts.append(now[0] - r.seconds), clock=lambda: now[0], start=0.0)
    assert res.stopped == "budget" and len(res.trials) == 3 and starts == [0.0, 1.0, 2.0]
    with pytest.raises(TrialCutOff):
        runner.run(baseline(axes), 0, deadline=time.monotonic())
    with pytest.raises(GraphmodeError, match="ended before the recipe as written was measured") as e:
        run_search(runner.run, axes, budget_s=1e-3, objective="latency", journal=Journal(tmp_path / "k", "c"))
    assert e.value.where == "--budget-s"


def test_violating_and_failing_trials_are_kept_and_the_fix_is_written(kb_cache, tmp_path):
    data = {"version": 1, "name": "pool", "inputs": [{"name": "input_ids", "dtype": "i64", "shape": ["batch", "seq"]}],
            "dims": {"batch": {"buckets": [1, 2]}, "seq": {"min": 2, "max": 12, "max_padding": 0.5}},
            "codegen": {"kernel_selection": "heuristic"}, "targets": ["host"]}
    path = tmp_path / "pool.yaml"
    path.write_text(json.dumps(data))
    runner = TrialRunner(spec("mean_pool"), data, get_target("host"), tol=1e-5, measure_s=0.2, cache_dir=kb_cache)
    axes = [a for a in search_space(load_recipe(data), get_target("host"), objective="latency", tol=1e-5,
                                    max_buckets=None, threads=[1]) if a.name == "dims.seq"]
    axes.append(Axis("fusion.max_ops", [32, 0]))            # not a valid recipe: the trial fails
    res = run_search(runner.run, axes, budget_s=600, objective="latency", journal=Journal(tmp_path / "j", "p"))
    base = res.trials[0]
    assert base.status == "violates" and "padding seq" in base.reason          # the verdict refuses padded seq
    failed = [t for t in res.trials if t.config.get("fusion.max_ops") == 0]
    assert failed and failed[0].status == "failed" and "optimize.fusion.max_ops" in failed[0].reason
    best = res.best
    assert best is not None and best.config["dims.seq"] == {"min": 2, "max": 12} and best.status == "ok"
    assert [t.index for t in res.pareto] == [best.index]
    out, rec, new = write_version(path, data, base, best, objective="latency", hardware="host", trials=len(res.trials))
    assert new and out == tmp_path / "pool.v2.yaml" and out.is_file()
    text = out.read_text()
    assert "tuned by graphmode tune from pool.yaml" in text and f"tune (trial {best.index}): dims.seq was" in text
    assert load_recipe(out) == rec and rec.dims["seq"].max_padding is None
    assert next_version_path(path) == next_version_path(out) == tmp_path / "pool.v3.yaml"
    assert write_version(path, data, base, best, objective="latency", hardware="host", trials=1)[::2] == (out, False)
    assert key_of(best.config) == best.key


def test_a_weight_only_trial_is_held_to_the_weight_only_contract(kb_cache):
    """tune compared an int8 recipe with eager at the f32 tolerance, so the trial that
    `graphmode verify` passes was recorded 'violates' (and the knowledge base learnt it)."""
    data = recipe_data(dims={"batch": {"buckets": [2, 4]}}, precision={"weights": "int8"})
    runner = TrialRunner(spec("mlp"), data, get_target("host"), tol=1e-5, measure_s=0.1, cache_dir=kb_cache)
    res = runner.run(baseline([]), 0)
    assert res.status == "ok", res.reason
    assert 1e-5 < res.metrics["numerics_err"] < 6e-2      # a rounding error, within int8's bound


def test_a_knob_that_leaves_the_compiled_graph_as_it_was_is_not_timed_again(kb_cache):
    """Dropping the attention pattern from a CNN changed nothing it compiled, and timed again its
    noise was "confirmed +5.8%"; the same graph and plan knobs are the same trial's numbers."""
    data = recipe_data(dims={"batch": {"buckets": [2, 4]}})
    runner = TrialRunner(spec("mlp"), data, get_target("host"), tol=1e-5, measure_s=0.1, cache_dir=kb_cache)
    first = runner.run({"fusion.max_ops": 64}, 0)
    small = runner.run({"fusion.max_ops": 8}, 1)           # an MLP's groups are smaller than either
    assert small.ir_hash == first.ir_hash and small.same_as == 0 and small.metrics == first.metrics
    assert TrialResult.from_json(small.to_json()).same_as == 0          # journaled
    threads = runner.run({"fusion.max_ops": 8, "threads": 1}, 2)       # another plan knob: timed
    again = runner.run({"fusion.max_ops": 64}, 0)          # tune's confirmation of a trial: measured again
    copy_again = runner.run({"fusion.max_ops": 8}, 1)      # ... even of one that took another's numbers
    assert threads.same_as is None and again.same_as is None and again.samples > 0 and copy_again.same_as is None


def test_the_recipe_as_written_keeps_every_dim_field_in_every_trial():
    """recipe init gives a dim whose few buckets pad more than half `exact_plans`; tune rebuilt
    each dim from its range and padding only, so trial 0 ("recipe as written") was another
    recipe (another hash, no measurements under the file's) and every version it wrote lost
    exact_plans, unannounced (trial S)."""
    data = recipe_data(dims={"batch": {"min": 1, "max": 16, "max_padding": 0.75, "exact_plans": 4}})
    rec = load_recipe(data)
    axes = search_space(rec, get_target("host"), objective="latency", tol=1e-5, max_buckets=None, threads=[1])
    dims = next(a for a in axes if a.name == "dims.batch")
    assert all(v["exact_plans"] == 4 for v in dims.values) and len(dims.values) > 1
    assert load_recipe(apply(data, baseline(axes))).hash() == rec.hash()


def test_the_recipes_own_padding_bound_is_tried_as_it_is():
    """A recipe's own bound (here the 5/6 two buckets over [1, 36] pad at worst) was tried
    rounded to 4 places, below it, which needs more buckets than the recipe has: 'padding <=
    0.3333 needs more than 4 buckets' of a recipe at 1/3 with 4 (trial S)."""
    data = recipe_data(dims={"batch": {"min": 1, "max": 36, "max_buckets": 2}})
    axes = search_space(load_recipe(data), get_target("host"), objective="latency", tol=1e-5, max_buckets=None,
                        threads=[1])
    dims = next(a for a in axes if a.name == "dims.batch")
    assert not any(n.startswith("padding <= 0.8333 ") for n in dims.notes), dims.notes


def test_a_journal_is_held_by_one_tune_at_a_time(tmp_path):
    """Two tunes of one recipe at once interleaved their trials under one run key (trial S)."""
    from graphmode.errors import GraphmodeError
    first = Journal(tmp_path / "r.tune.jsonl", "run")
    first.hold()
    second = Journal(tmp_path / "r.tune.jsonl", "run")
    with pytest.raises(GraphmodeError, match="another graphmode tune is running") as e:
        second.hold()
    assert e.value.where == "--recipe" and "tune a copy" in e.value.fix
    first.release()
    second.hold()                  # free again once the first ends
    second.release()


def test_each_tune_session_is_its_own_comparison_and_a_resume_keeps_it(tmp_path):
    """Two journals of one recipe's content (a copy under another name, as the concurrent-tune
    refusal advises) had one run key, so the knowledge base pooled their trials as one run and
    ranked a recipe by a comparison across the two (trial Z)."""
    a, b = Journal(tmp_path / "a.tune.jsonl", "r"), Journal(tmp_path / "b.tune.jsonl", "r")
    sa, sb = a.session(False), b.session(False)
    assert sa != sb
    a.start({"session": sa})
    assert Journal(tmp_path / "a.tune.jsonl", "r").session(False) == sa          # resumed: the same session
    assert Journal(tmp_path / "a.tune.jsonl", "r").session(True) not in (sa, sb)  # --fresh: a new one


def test_a_journal_that_cannot_be_written_is_a_clear_error(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("")                   # a file where the journal's folder should be
    j = Journal(blocked / "r.tune.jsonl", "r")
    j.hold()
    with pytest.raises(GraphmodeError, match="the tuning journal cannot be written") as e:
        j.start({"session": "s"})
    assert e.value.where == "--recipe" and "a folder you can write" in e.value.fix
