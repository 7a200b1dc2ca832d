"""Decode benchmark output: a side-by-side table per model (engines x scenarios), the goals,
`<name>.json` (the rows, a plain list), `<name>.meta.json` (machine, bandwidth, method,
goals) and `<name>.md` (both tables, every row in full, flags and their notes)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from graphmode.bench.quality import LEGEND, QUICK_NOTE


def _num(v: Any, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _match(r: dict) -> str:
    m = r.get("tokens_match")
    return "-" if not m else f"{m['same']}/{m['of']}"


def _columns(rows: list[dict]) -> list[tuple[str, str]]:
    """(scenario, header) in the order the run measured them."""
    seen = dict.fromkeys(r["scenario"] for r in rows)
    out = []
    for sc in seen:
        r = next(x for x in rows if x["scenario"] == sc)
        out.append((sc, f"TTFT p{r['prompt']} ms" if r["kind"] == "ttft" else f"b{r['batch']} tok/s"))
    return out


def _cell(r: dict | None) -> str:
    if r is None:
        return "-"
    if r["status"] != "ok":
        return "n/a" if r.get("skipped") else "failed"
    v = _num(r["ttft_ms"]) if r["kind"] == "ttft" else _num(r["decode_tok_s"], 2)
    return v + ("*" if r.get("flags") else "")


def _speedup(r: dict | None, key: str) -> str:
    """graphmode's row as a speed-up (> 1: graphmode is faster) from its time ratio `key`."""
    v = r.get(key) if r and r["status"] == "ok" else None
    return "-" if not v else f"{1 / v:.2f}x"


def summary(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    """One line per (model, engine): each scenario's metric side by side, the batch-1
    bandwidth bound and the engine's fraction of it, tokens equal to transformers eager's,
    setup and warm-up (lazy compiles) time, flags; then graphmode's speed-up per scenario
    over eager and over the best other engine."""
    cols = _columns(rows)
    head = ["model", "engine"] + [h for _, h in cols] + ["b1 bound tok/s", "b1 of bound", "tokens = eager",
                                                         "setup s", "warm-up s", "flags"]
    lines = []
    for model in dict.fromkeys(r["model"] for r in rows):
        for label in dict.fromkeys(r["label"] for r in rows if r["model"] == model):
            mine = {r["scenario"]: r for r in rows if r["model"] == model and r["label"] == label}
            b1 = next((r for r in mine.values() if r["kind"] == "decode" and r["batch"] == 1), None)
            same = [r["tokens_match"] for r in mine.values() if r.get("tokens_match")]
            match = f"{sum(m['same'] for m in same)}/{sum(m['of'] for m in same)}" if same else "-"
            flags = sorted({f for r in mine.values() for f in r.get("flags") or ()})
            warm = [r["warmup_s"] for r in mine.values() if r.get("warmup_s") is not None]
            any_row = next(iter(mine.values()))
            lines.append([model, label] + [_cell(mine.get(sc)) for sc, _ in cols] +
                         [_num(b1 and b1.get("floor_tok_s")),
                          "-" if not b1 or b1.get("of_floor") is None else f"{b1['of_floor']:.0%}", match,
                          _num(any_row.get("setup_s")), _num(sum(warm)) if warm else "-", ",".join(flags)])
        gm = {r["scenario"]: r for r in rows if r["model"] == model and r["engine"] == "graphmode"
              and r.get("variant", "default") == "default"}      # not graphmode[int8] and the like
        if gm:
            for what, key in (("graphmode vs eager", "ratio_vs_eager"),
                              ("graphmode vs best other", "ratio_vs_best_other")):
                lines.append([model, what] + [_speedup(gm.get(sc), key) for sc, _ in cols] + [""] * 6)
    return head, lines


def goal_lines(goals: list[dict]) -> list[list[str]]:
    mark = {True: "met", False: "NOT met", None: "n/a"}
    return [[g["model"], g["goal"], g["target"], "-" if g["value"] is None else f"{g['value']:.2f}",
             mark[g["met"]], g["detail"]] for g in goals]


def failures(rows: list[dict]) -> list[str]:
    seen = {}
    for r in rows:
        if r["status"] != "ok":
            seen.setdefault((r["model"], r["label"]), r["reason"])
    return [f"{m} {label}: {why}" for (m, label), why in seen.items()]


def rich_tables(res) -> list[Any]:
    from rich import box
    from rich.markup import escape       # cells hold engine names such as graphmode[int8]: text, not markup
    from rich.table import Table
    m = res.meta
    title = f"graphmode bench decode — {m['cpu_model']}, {m['threads']} thread(s), {m['date']}"
    if m.get("quick"):
        title += f"\n{QUICK_NOTE}"
    head, lines = summary(res.rows)
    bw = m["bandwidth"]
    t = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1),
              caption=f"TTFT = median ms to the first token (batch 1); bN tok/s = median decode tokens/s at batch N; "
                      f"bound = tokens/s if a step only read its weights + KV at {bw['floor_uses_gbps']} GB/s; "
                      "graphmode vs X = X's time / graphmode's (> 1: graphmode faster); * = flagged (see the .md)",
              caption_justify="left")
    for h in head:
        t.add_column(h, justify="left" if h in ("model", "engine", "flags") else "right", overflow="fold")
    prev = None
    for line in lines:
        if prev is not None and line[0] != prev:
            t.add_section()
        prev = line[0]
        t.add_row(*map(escape, line), style="bold" if line[1].startswith("graphmode") else None)
    g = Table(title="goals (issue 15, item 9)", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    for h in ("model", "goal", "target", "value", "verdict", "detail"):
        g.add_column(h)
    for line in goal_lines(res.goals):
        g.add_row(*map(escape, line), style={"met": "green", "NOT met": "red"}.get(line[4]))
    return [t, g]


def _md_table(head: list[str], lines: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(str(c).replace("|", "\\|") for c in line) + " |" for line in lines]
    return out


ROW_COLUMNS = ("model", "scenario", "engine", "status", "TTFT ms", "median ms", "p90 ms", "tok/s", "bound tok/s",
               "of bound", "x eager", "x best other", "tokens = eager", "warm-up s", "rounds", "load max", "CPU/wall",
               "flags")


def _full(r: dict) -> list[str]:
    status = r["status"] if r["status"] == "ok" else f"{r['status']}: {r['reason']}"
    best = r.get("ratio_vs_best_other")
    return [r["model"], r["scenario"], r["label"], status, _num(r.get("ttft_ms")), _num(r.get("median_ms"), 2),
            _num(r.get("p90_ms"), 2), _num(r.get("decode_tok_s"), 2), _num(r.get("floor_tok_s")),
            "-" if r.get("of_floor") is None else f"{r['of_floor']:.0%}", _speedup(r, "ratio_vs_eager"),
            "-" if not best else f"{1 / best:.2f}x ({r['best_other_engine']})", _match(r), _num(r.get("warmup_s")),
            str(r.get("iters") or "-"), _num(r.get("load_max"), 2), _num(r.get("cpu_per_wall"), 2),
            ",".join(r.get("flags") or ())]


def markdown(res) -> str:
    m = res.meta
    v = m["versions"]
    bw = m["bandwidth"]
    meth = m["method"]
    lines = ([f"# graphmode decode smoke run, --quick ({m['date']})", "", f"**Not a measurement.** {QUICK_NOTE}.", ""]
             if m.get("quick") else [f"# graphmode decode benchmark ({m['date']})", ""])
    lines += [
        f"- CPU: {m['cpu_model']}, {m['cores']} core(s), SIMD: {' '.join(m.get('simd') or []) or 'n/a'}; "
        f"threads: {m['threads']} for every engine; wall time {m.get('wall_s')} s",
        f"- load average (1/5/15 min) at start {m.get('loadavg_start')}, at end {m.get('loadavg_end')}, highest "
        f"1-min during the timed rounds {m.get('loadavg_max')} ({m.get('usable_cores')} usable core(s))",
        f"- memory bandwidth: {bw['read_gbps_measured']} GB/s measured read, host probe {bw['host_probe_gbps']} GB/s; "
        f"the floor uses {bw['floor_uses_gbps']} GB/s",
        "- models: " + "; ".join(f"{x['model']} ({x['class']}, {x['params_m']} M parameters, random init)"
                                 for x in m["models"]),
        "- versions: " + ", ".join(f"{k} {x}" for k, x in v.items() if x),
        f"- method: prompts of {meth['prompt_lens']} tokens for TTFT (batch 1, one new token); decode at batches "
        f"{meth['batches']} with {meth['context']}-token prompts and {meth['new_tokens']} greedy new tokens "
        f"(end-of-sequence ignored); {meth['warmup']} warm-up run(s) per engine and scenario, then up to "
        f"{meth['iters']} interleaved rounds (≥ {meth['min_iters']}, ≤ {meth['budget_s_per_scenario']:g} s per "
        "scenario), medians; decode tok/s = batch × (new − 1) / (last token − first token); "
        f"bound (a ceiling on tok/s: the bandwidth floor on time per token) = {meth['floor']}; TTFT = "
        f"{meth['ttft']}", ""]
    head, rows = summary(res.rows)
    lines += ["## Side by side", ""] + _md_table(head, rows)
    lines += ["", "## Goals (issue 15, item 9)", ""]
    lines += _md_table(["model", "goal", "target", "value", "verdict", "detail"], goal_lines(res.goals))
    fails = failures(res.rows)
    if fails:
        lines += ["", "Engines that did not run:", ""] + [f"- {f}" for f in fails]
    lines += ["", "## Every row", ""] + _md_table(list(ROW_COLUMNS), [_full(r) for r in res.rows])
    used = {f for r in res.rows for f in r.get("flags") or ()}
    if used:
        lines += ["", "Flags (a flagged number is shown, but is not a clean measurement):", ""]
        lines += [f"- `{c}`: {t}" for c, t in LEGEND.items() if c in used]
    if m.get("warnings"):
        lines += ["", "Notes on flagged rows:", ""] + [f"- {w}" for w in m["warnings"]]
    return "\n".join(lines) + "\n"


def write_results(res, out_dir: str | Path, name: str = "decode") -> dict[str, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / f"{name}.json", "meta": out / f"{name}.meta.json", "md": out / f"{name}.md"}
    paths["json"].write_text(json.dumps(res.rows, indent=1, default=str) + "\n", encoding="utf-8")
    paths["meta"].write_text(json.dumps({**res.meta, "goals": res.goals}, indent=1, default=str) + "\n",
                             encoding="utf-8")
    paths["md"].write_text(markdown(res), encoding="utf-8")
    return paths
