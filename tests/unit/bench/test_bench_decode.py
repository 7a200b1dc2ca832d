"""`graphmode bench decode`: its pure parts on hand-made rows (ratios, agreement, the bandwidth
bound, goals, the --quick verdict, the tables and files) and short real runs on the tiny
models: transformers generating past its end-of-sequence token, an engine failing mid-run,
and the quick bench with graphmode (marked slow). Nothing here asserts on how fast anything is."""
from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from graphmode.bench import engines, floors, harness, report
from graphmode.bench.engines import HFEngine, parse_decode_engines
from graphmode.bench.harness import QUICK, DecodeConfig, DecodeResult, run_decode_bench
from graphmode.bench.models import TINY_GPT2, load_decode_cases, tiny_gpt2
from graphmode.decode.api import causal_lm
from graphmode.errors import GraphmodeError


def row(engine: str, scenario: str = "decode b1 ctx16", *, ms: float | None = 10.0, status: str = "ok",
        model: str = "m", **kw) -> dict:
    kind = "ttft" if scenario.startswith("ttft") else "decode"
    batch = int(scenario.split()[1][1:]) if kind == "decode" else 1
    prompt = int(scenario.split()[1][1:]) if kind == "ttft" else 16
    r = {"model": model, "scenario": scenario, "kind": kind, "batch": batch, "prompt": prompt, "engine": engine,
         "label": engines.DECODE_LABELS[engine], "dtype": "f32", "status": status, "skipped": False,
         "reason": None if status == "ok" else "boom", "median_ms": ms if status == "ok" else None,
         "ttft_ms": ms if status == "ok" else None, "flags": [], "tokens_match": None, "setup_s": 1.0,
         "warmup_s": 2.0, "floor_tok_s": None, "of_floor": None,
         "decode_tok_s": (batch * 1e3 / ms) if status == "ok" and kind == "decode" and ms else None}
    r.update(kw)
    return r


# ---- pure functions ------------------------------------------------------------------------

def test_parse_engines_expands_llama_cpp_and_refuses_unknown_names():
    assert parse_decode_engines("eager,llama_cpp,graphmode") == [
        ("eager", None), ("llama_cpp", "f32"), ("llama_cpp", "q8_0"), ("llama_cpp", "q4_0"), ("llama_cpp", "q4_K_M"),
        ("graphmode", None)]
    assert parse_decode_engines("llama_cpp[q8_0],llama_cpp[q8_0]") == [("llama_cpp", "q8_0")]
    with pytest.raises(GraphmodeError, match="unknown decode engine") as e:
        parse_decode_engines("eager,vllm")
    assert e.value.where == "--engines" and "graphmode" in e.value.fix
    with pytest.raises(GraphmodeError, match="q4_0"):
        parse_decode_engines("llama_cpp[q4_1]")


def test_agreement_counts_tokens_up_to_each_rows_first_difference():
    ref = [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert harness._agreement(ref, ref) == {"same": 8, "of": 8, "first": 2, "rows": 2}
    assert harness._agreement([[1, 2, 9, 4], [5, 6, 7, 8]], ref) == {"same": 6, "of": 8, "first": 2,
                                                                    "rows": 2}   # 4 after a miss don't count
    assert harness._agreement([[1, 2], [0, 6, 7, 8]], ref) == {"same": 2, "of": 8, "first": 1, "rows": 2}


def test_ratios_against_eager_and_the_best_other_engine():
    rows = [row("eager", ms=40.0), row("static_compile", ms=20.0), row("graphmode", ms=10.0),
            row("llama_cpp", status="failed")]
    harness._decode_ratios(rows)
    eager, sc, gm, failed = rows
    assert gm["ratio_vs_eager"] == 0.25 and gm["speedup_vs_eager"] == 4.0
    assert gm["ratio_vs_best_other"] == 0.5 and gm["best_other_engine"] == "transformers static+compile"
    assert sc["ratio_vs_best_other"] == 1.0 and eager["ratio_vs_eager"] == 1.0
    assert failed["ratio_vs_eager"] is None and failed["ratio_vs_best_other"] is None
    alone = [row("graphmode", ms=10.0)]                    # nothing to compare with: no ratios, no crash
    harness._decode_ratios(alone)
    assert alone[0]["ratio_vs_eager"] is None and alone[0]["ratio_vs_best_other"] is None


def test_bandwidth_bound():
    # 1 GB of weights at 10 GB/s, no KV: 10 tokens/s per sequence; a batch shares the weight reads
    assert floors.floor_tok_s(1e9, 0.0, 1, 100, 10.0) == pytest.approx(10.0)
    assert floors.floor_tok_s(1e9, 0.0, 4, 100, 10.0) == pytest.approx(40.0)
    assert floors.floor_tok_s(1e9, 1e6, 1, 1000, 10.0) == pytest.approx(5.0)     # + 1 GB of K/V per step


def test_decode_bytes_reads_the_head_once_and_tables_not_at_all():
    lm = causal_lm(tiny_gpt2())
    w, kv = floors.decode_bytes(lm, "f32")
    tables = lm.transformer.wpe.weight.numel()              # the tied token table is the head: read in full
    total = sum(p.numel() for p in lm.parameters())         # parameters() yields the tied weight once
    assert w == (total - tables) * 4
    assert kv == 2 * TINY_GPT2["n_layer"] * TINY_GPT2["n_head"] * (TINY_GPT2["n_embd"] // TINY_GPT2["n_head"]) * 4
    w8, _ = floors.decode_bytes(lm, "q8_0")
    w4, _ = floors.decode_bytes(lm, "int4")
    assert w4 < w8 < w


def test_goals_are_judged_only_outside_quick():
    rows = [row("eager", ms=40.0), row("graphmode", ms=10.0, floor_tok_s=1000.0, of_floor=0.1),
            row("graphmode", "ttft p512", ms=50.0), row("eager", "ttft p512", ms=100.0)]
    full = {g["goal"]: g for g in report.decode_goals(rows)}
    vs_alt = full["decode b1 fp32 vs best fp32 alternative"]
    assert vs_alt["value"] == 4.0 and vs_alt["met"] is True
    assert full["decode b1 fp32 vs the floor"]["met"] is False
    assert full["TTFT p512 vs best alternative"]["value"] == 0.5 and full["TTFT p512 vs best alternative"]["met"]
    b16 = full["decode b16 throughput vs static-cache torch.compile"]
    assert b16["met"] is None and "not measured" in b16["detail"]
    # the missing rows are named: graphmode's decode row exists, only b16 and static_compile are absent
    assert b16["detail"] == ("not measured: no graphmode decode b16 (--batches) and no static_compile decode b16 "
                             "(--engines) row")
    quick = {g["goal"]: g for g in report.decode_goals(rows, quick=True)}
    assert all(g["met"] is None for g in quick.values())
    assert quick["decode b1 fp32 vs best fp32 alternative"]["detail"].startswith("not judged (--quick)")


def test_quick_verdict_skips_unavailable_engines_and_catches_token_mismatches():
    ok = row("graphmode", tokens_match={"same": 4, "of": 4})
    absent = row("llama_cpp", status="failed", skipped=True, reason="not installed (pip install llama-cpp-python)")
    assert DecodeResult([row("eager"), ok, absent], {}, []).quick_failures() == []
    broken = row("static_compile", status="failed", reason="RuntimeError: boom")
    wrong = row("graphmode", tokens_match={"same": 3, "of": 4})
    lone = row("graphmode", tokens_match=None)
    bad = DecodeResult([broken, wrong, lone], {}, []).quick_failures()
    assert len(bad) == 3
    assert "failed: RuntimeError: boom" in bad[0] and "differ from transformers eager" in bad[1]
    assert "add eager to --engines" in bad[2]


def test_flag_floor_marks_rows_above_the_bandwidth_ceiling():
    rows = [row("graphmode", floor_tok_s=50.0, of_floor=2.0), row("eager", floor_tok_s=50.0, of_floor=0.5)]
    for r in rows:
        r["notes"] = []
    floors.flag_floor(rows)
    assert rows[0]["flags"] == ["floor"] and "ceiling" in rows[0]["notes"][0] and rows[1]["flags"] == []


def test_summary_puts_engines_side_by_side_with_graphmode_speedups():
    rows = []
    for sc, eager_ms, gm_ms in (("ttft p8", 20.0, 10.0), ("decode b1 ctx16", 40.0, 20.0)):
        group = [row("eager", sc, ms=eager_ms), row("graphmode", sc, ms=gm_ms),
                 row("ort_genai", sc, status="failed", skipped=True, reason="not installed"),
                 row("static_compile", sc, status="failed", reason="RuntimeError: boom")]
        harness._decode_ratios(group)
        rows += group
    head, lines = report.decode_summary(rows)
    assert head[2:4] == ["TTFT p8 ms", "b1 tok/s"]
    by = {line[1]: line for line in lines}
    assert by["graphmode"][2:4] == ["10.0", "50.00"] and by["transformers eager"][2:4] == ["20.0", "25.00"]
    assert by["ORT GenAI"][2:4] == ["n/a", "n/a"] and by["transformers static+compile"][2:4] == ["failed"] * 2
    assert by["graphmode vs eager"][2:4] == ["2.00x", "2.00x"]
    assert by["graphmode vs best other"][2:4] == ["2.00x", "2.00x"]
    assert by["graphmode"][head.index("warm-up s")] == "4.0"             # its two scenarios' warm-up runs
    assert report.decode_failures(rows) == ["m ORT GenAI: not installed",
                                            "m transformers static+compile: RuntimeError: boom"]


def test_results_files(tmp_path):
    rows = [row("eager", ms=40.0), row("graphmode", ms=10.0, tokens_match={"same": 4, "of": 4})]
    harness._decode_ratios(rows)
    meta = {"cpu_model": "test cpu", "cores": 2, "threads": 2, "date": "2026-12-01", "quick": True,
            "versions": {"torch": torch.__version__}, "bandwidth": {"read_gbps_measured": 10.0,
                                                                     "host_probe_gbps": None, "floor_uses_gbps": 10.0},
            "models": [{"model": "m", "class": "GPT2LMHeadModel", "params_m": 0.1}],
            "method": {"prompt_lens": [8], "batches": [1], "context": 16, "new_tokens": 4, "warmup": 1, "iters": 2,
                       "min_iters": 2, "budget_s_per_scenario": 300.0, "floor": "f", "ttft": "t"}}
    res = DecodeResult(rows, meta, report.decode_goals(rows, quick=True))
    paths = report.write_decode_results(res, tmp_path / "out", "decode-quick")
    assert json.loads(paths["json"].read_text()) == rows
    assert json.loads(paths["meta"].read_text())["goals"] == res.goals
    md = paths["md"].read_text()
    assert "**Not a measurement.**" in md and "| m | graphmode vs eager | 4.00x |" in md
    assert "| 4.00x | 4.00x (transformers eager) | 4/4 |" in md


def test_bad_arguments_exit_2():
    import graphmode.cli.bench_cmd  # noqa: F401  (registers `bench decode`)
    from graphmode.cli.app import app
    for args, needle in ((["--prompt-lens", "8,x"], "--prompt-lens"), (["--batches", "0"], "--batches"),
                         (["--engines", "eager,vllm"], "unknown decode engine"),
                         # it ran llama.cpp alone and said graphmode's tokens equal eager's
                         (["--engines", "llama_cpp"], "leaves out eager and graphmode"),
                         (["--engines", "graphmode"], "leaves out eager")):
        res = CliRunner().invoke(app, ["bench", "decode", "--quick", *args])
        assert res.exit_code == 2 and needle in res.output and "Traceback" not in res.output, res.output


# ---- real runs on the tiny models ------------------------------------------------------------

def _shared(lm, new: int = 6):
    return engines.DecodeShared("tiny-gpt2", None, lm, {}, 1, 1, 16 + new)


def test_transformers_engines_generate_past_end_of_sequence():
    """`generate` fills an unset eos_token_id from the model's config: the engine must not stop
    early where graphmode (asked for `new` tokens, no end-of-sequence) goes on."""
    lm = causal_lm(tiny_gpt2())
    prompts = torch.randint(3, 256, (1, 8), generator=torch.Generator().manual_seed(1))
    eng = HFEngine()
    eng.setup(_shared(lm))
    free = eng.run(prompts, 6).tokens[0]
    lm.generation_config.eos_token_id = free[2]               # greedy would now meet "end of sequence"
    try:
        got = eng.run(prompts, 6)
    finally:
        lm.generation_config.eos_token_id = TINY_GPT2["eos_token_id"]
    assert got.tokens[0] == free and len(free) == 6
    assert 0 < got.first_s <= got.end_s and got.decode_from_s == got.first_s


class _Flaky(HFEngine):
    """transformers eager that breaks on its fourth call: the first scenario's warm-up and two
    rounds succeed, the second scenario's warm-up fails."""
    name = "flaky"

    def run(self, prompts, new):
        self.calls = getattr(self, "calls", 0) + 1
        if self.calls == 4:
            raise RuntimeError("decode exploded\nsecond line")
        return super().run(prompts, new)


def test_an_engine_failing_mid_run_is_a_failed_row(monkeypatch):
    monkeypatch.setitem(engines.DECODE_ENGINES, "flaky", _Flaky)
    cfg = DecodeConfig(**{**QUICK, "prompt_lens": (8,), "batches": (1, 2)},
                       engines=[("eager", None), ("flaky", None)], threads=1, quick=True)
    res = run_decode_bench(load_decode_cases(["tiny-gpt2"], True), cfg)
    rows = {(r["scenario"], r["engine"]): r for r in res.rows}
    assert rows[("ttft p8", "flaky")]["status"] == "ok"                       # measured before it broke
    bad = rows[("decode b1 ctx16", "flaky")]
    assert bad["status"] == "failed" and bad["reason"] == "RuntimeError: decode exploded" and not bad["skipped"]
    later = rows[("decode b2 ctx16", "flaky")]
    assert later["status"] == "failed" and later["reason"].startswith("not run: it failed in decode b1 ctx16")
    assert all(r["status"] == "ok" for r in res.rows if r["engine"] == "eager")
    assert any("decode exploded" in f for f in res.quick_failures())


@pytest.mark.slow                        # ~100 s on 2 loaded cores: graphmode's plans for 2 models x 6 buckets
def test_quick_bench_with_graphmode_on_the_tiny_models(tmp_path):
    """The --quick run in-process: graphmode's greedy tokens equal transformers eager's on
    both tiny models, an engine that is not installed says so and fails nothing, and the
    rows carry what the tables print."""
    cfg = DecodeConfig(**QUICK, engines=parse_decode_engines("eager,ort_genai,graphmode"), threads=1, quick=True,
                       cache_dir=tmp_path / "cache")
    res = run_decode_bench(load_decode_cases([], True), cfg)
    assert res.quick_failures() == [], res.quick_failures()
    assert {r["model"] for r in res.rows} == {"tiny-gpt2", "tiny-llama"}
    assert len(res.rows) == 2 * 3 * len(cfg.scenarios())
    for r in res.rows:
        if r["engine"] == "ort_genai":
            assert r["status"] == "failed" and r["skipped"] and r["reason"].startswith("not installed")
            continue
        assert r["status"] == "ok", r
        assert r["ttft_ms"] > 0 and r["warmup_s"] > 0 and "quick" in r["flags"]
        if r["kind"] == "decode":
            assert r["decode_tok_s"] > 0 and r["floor_tok_s"] > 0
        if r["engine"] == "graphmode":
            m = r["tokens_match"]
            assert m["same"] == m["of"] == r["batch"] * r["new_tokens"]
            assert r["ratio_vs_eager"] > 0 and r["best_other_engine"] == "transformers eager"
    assert all(g["met"] is None for g in res.goals)
    assert res.meta["quick"] and res.meta["bandwidth"]["floor_uses_gbps"] > 0
    # the repeated system prompt: 28 + 4 tokens, one cached page of 16, same token off and on
    pc = res.meta["prefix_cache"]
    assert [r["model"] for r in pc] == ["tiny-gpt2", "tiny-llama"]
    assert all(r["hit_rate"] == 0.5 and r["tokens_match"] == {"same": 2, "of": 2} for r in pc), pc


def test_graphmode_variants_are_engine_variants():
    from graphmode.bench.engines import make_decode_engine, parse_decode_engines
    from graphmode.errors import GraphmodeError
    assert parse_decode_engines("eager,graphmode,graphmode[batch_invariant],graphmode[int8]") == [
        ("eager", None), ("graphmode", None), ("graphmode", "batch_invariant"), ("graphmode", "int8")]
    with pytest.raises(GraphmodeError, match="batch_invariant.*int8"):
        parse_decode_engines("graphmode[fast]")
    assert [make_decode_engine("graphmode", v).dtype for v in (None, "batch_invariant", "int8", "bf16", "int4")] == [
        "f32", "f32", "int8", "bf16", "int4"]
    # the bf16 KV pool is what the variant's bound counts; the merged A/B keeps f32 weights and KV
    kv, merged = make_decode_engine("graphmode", "kv_bf16"), make_decode_engine("graphmode", "merged")
    assert (kv.dtype, kv.kv_dtype, merged.dtype, merged.kv_dtype) == ("f32", "bf16", "f32", "f32")


def test_int8_goal_and_quick_verdict_use_the_int8_variant():
    """graphmode[int8] is judged against llama.cpp q8_0, and in --quick by the weight-only top-1
    bound instead of token identity."""
    rows = [row("graphmode", ms=10.0, variant="int8", dtype="int8"),
            row("llama_cpp", ms=20.0, dtype="q8_0", variant="q8_0"), row("llama_cpp", ms=30.0, variant="f32")]
    g = {x["goal"]: x for x in report.decode_goals(rows)}["int8 decode b1 vs llama.cpp q8_0"]
    assert g["value"] == 2.0 and g["met"] is True
    lone = {x["goal"]: x for x in report.decode_goals(rows[1:])}["int8 decode b1 vs llama.cpp q8_0"]
    # the terminal table prints engine names in brackets as text, not as rich markup
    from rich.console import Console
    from graphmode.bench.report import decode_rich_tables
    meta = {"cpu_model": "cpu", "threads": 2, "date": "today", "bandwidth": {"floor_uses_gbps": 10.0}}
    con = Console(width=400, record=True)
    for t in decode_rich_tables(DecodeResult(rows, meta, [lone])):
        con.print(t)
    assert "graphmode[int8] and llama_cpp[q8_0]" in con.export_text()
    diverged = row("graphmode", variant="int8", tokens_match={"same": 40, "of": 100, "first": 4, "rows": 4})
    flipped = row("graphmode", variant="int8", tokens_match={"same": 97, "of": 100, "first": 3, "rows": 4})
    bad = DecodeResult([diverged, flipped], {}, []).quick_failures()
    assert len(bad) == 1 and "first new token differs" in bad[0] and "'first': 3" in bad[0]



def test_int4_goals_are_against_llama_cpp_q4_at_b1_and_b4():
    """graphmode[int4] is judged against llama.cpp q4_0 and q4_K_M at batch 1 and 4; without
    llama.cpp the goal says what is missing and still shows graphmode's tok/s."""
    rows = [row("graphmode", ms=10.0, variant="int4", dtype="int4"),
            row("llama_cpp", ms=20.0, dtype="q4_0", variant="q4_0"),
            row("llama_cpp", ms=5.0, dtype="q4_K_M", variant="q4_K_M")]
    g = {x["goal"]: x for x in report.decode_goals(rows)}
    assert g["int4 decode b1 vs llama.cpp q4_0"]["value"] == 2.0 and g["int4 decode b1 vs llama.cpp q4_0"]["met"]
    assert g["int4 decode b1 vs llama.cpp q4_K_M"]["met"] is False
    assert g["int4 decode b4 vs llama.cpp q4_0"]["met"] is None
    lone = {x["goal"]: x for x in report.decode_goals(rows[:1])}["int4 decode b1 vs llama.cpp q4_0"]
    assert lone["met"] is None and "needs graphmode[int4] and llama_cpp[q4_0]" in lone["detail"]
    assert "(graphmode[int4]: " in lone["detail"]


def test_the_ratio_rows_are_graphmode_default_not_a_variant():
    """With graphmode[int8] in the run, 'graphmode vs ...' still speaks of plain graphmode."""
    from graphmode.bench.report import decode_summary
    rows = [row("eager", ms=40.0), row("graphmode", ms=20.0, variant="default"),
            row("graphmode", ms=10.0, variant="int8", dtype="int8")]
    for r in rows:
        r.setdefault("variant", "default")
    harness._decode_ratios(rows)
    _, lines = decode_summary(rows)
    vs_eager = next(ln for ln in lines if ln[1] == "graphmode vs eager")
    assert vs_eager[2] == "2.00x"          # 40 / 20, not the int8 variant's 4.00x


# ---- --contend ---------------------------------------------------------------------------

def test_contended_rounds_are_busy_scenarios_beside_the_quiet_ones():
    """A real run with one burner on the tiny model: every scenario has a `<scenario> busy`
    row per engine, timed in the same rounds, shown as its own column; tokens are checked on
    the quiet rows only."""
    cfg = DecodeConfig(**{**QUICK, "prompt_lens": (8,), "batches": (1,)}, engines=[("eager", None)], threads=1,
                       quick=True, contend=1)
    res = run_decode_bench(load_decode_cases(["tiny-gpt2"], True), cfg)
    by = {(r["scenario"], r["condition"]): r for r in res.rows}
    assert set(by) == {("ttft p8", "quiet"), ("ttft p8 busy", "contended"), ("decode b1 ctx16", "quiet"),
                       ("decode b1 ctx16 busy", "contended")}
    busy = by["decode b1 ctx16 busy", "contended"]
    assert busy["status"] == "ok" and busy["contend"] == 1 and busy["iters"] == QUICK["iters"]
    assert res.quick_failures() == [] and res.meta["contend"] == 1
    head, _ = report.decode_summary(res.rows)
    assert head[2:6] == ["TTFT p8 ms", "TTFT p8 ms busy", "b1 tok/s", "b1 tok/s busy"]


def test_contended_goal_is_the_llama_cpp_ratio_no_worse_than_quiet():
    def pair(gm_ms, ll_ms, busy):
        sc = "decode b1 ctx16" + (" busy" if busy else "")
        cond = {"condition": "contended" if busy else "quiet"}
        return [row("graphmode", sc, ms=gm_ms, **cond), row("llama_cpp", sc, ms=ll_ms, variant="f32", **cond)]
    rows = pair(10.0, 20.0, False) + pair(30.0, 40.0, True)      # graphmode 2x llama.cpp quiet, 1.33x busy
    g = {x["goal"]: x for x in report.decode_goals(rows)}["decode b1 vs llama.cpp f32, contended / quiet"]
    assert g["value"] == pytest.approx(0.6667, abs=1e-3) and g["met"] is False
    assert "2.00 quiet" in g["detail"] and "1.33 contended" in g["detail"]
    # the quiet goals read only the quiet rows
    assert {x["goal"]: x for x in report.decode_goals(rows)}["decode b1 fp32 vs best fp32 alternative"]["value"] == 2.0
