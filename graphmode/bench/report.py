"""Benchmark output: a rich table, `<name>.json` (the rows, a plain list), `<name>.meta.json`
(machine, versions, method), `<name>.md` and `<name>.png` (speed-up vs eager per shape)."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from graphmode.bench.harness import BenchResult


def _ms(v: Any) -> str:
    return "-" if v is None else (f"{v:.2f}" if v < 100 else f"{v:.1f}")


def _x(v: Any) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _err(v: Any) -> str:
    return "-" if v is None else f"{v:.1e}"


def _shape(r: dict) -> str:
    return "(" + ",".join(map(str, r["shape"])) + ")"


COLUMNS = ("model", "shape", "engine", "status", "median ms", "p90 ms", "vs eager", "vs best other",
           "rel L2", "setup s", "peak RSS MB")
SHORT = ("model", "shape", "engine", "status", "median", "p90", "/eager", "/best", "relL2", "setup", "RSS")


def _status(r: dict, full: bool) -> str:
    if r["status"] != "ok":
        return f"{r['status']}: {r['reason']}" if full else ("n/a" if r.get("skipped") else "failed")
    return "ok" if r.get("numerics_ok") is not False else "ok, numerics off"


def _cells(r: dict, full: bool = True) -> list[str]:
    status = _status(r, full)
    return [r["model"], _shape(r), r["label"], status, _ms(r.get("median_ms")), _ms(r.get("p90_ms")),
            _x(r.get("ratio_vs_eager")), _x(r.get("ratio_vs_best_other")), _err(r.get("rel_l2_err")),
            "-" if r.get("setup_s") is None else f"{r['setup_s']:.1f}",
            "-" if r.get("peak_rss_mb") is None else f"{r['peak_rss_mb']:.0f}"]


def rich_table(res: BenchResult):
    from rich import box
    from rich.table import Table
    m = res.meta
    t = Table(title=f"graphmode bench — {m['cpu_model']}, {m['threads']} thread(s), {m['date']}",
              title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1),
              caption="ms = median / p90 latency; /eager, /best = median over eager's and over the fastest "
                      "non-graphmode engine's (< 1 is faster); setup s; RSS = peak MB added by setup",
              caption_justify="left")
    for c in SHORT:
        t.add_column(c, justify="right" if c not in ("model", "shape", "engine", "status") else "left",
                     no_wrap=c not in ("engine",))
    prev = None
    notes = []
    for r in res.rows:
        key = (r["model"], tuple(r["shape"]))
        if prev is not None and key != prev:
            t.add_section()
        prev = key
        cells = _cells(r, full=False)
        cells[1] = "x".join(map(str, r["shape"]))
        style = "dim" if r["status"] != "ok" else ("bold" if r["engine"] == "graphmode" else None)
        t.add_row(*cells, style=style)
        if r["status"] != "ok":
            notes.append(f"{r['model']} {cells[1]} {r['label']}: {r['reason']}")
    return t, notes


def markdown(res: BenchResult) -> str:
    m = res.meta
    v = m["versions"]
    lines = [f"# graphmode benchmark ({m['date']})", "",
             f"- CPU: {m['cpu_model']}, {m['cores']} core(s), SIMD: {' '.join(m.get('simd') or []) or 'n/a'}",
             f"- threads: {m['threads']} for every engine; wall time {m.get('wall_s', '?')} s; load average "
             f"(1/5/15 min) at start {m.get('loadavg_start')}, at end {m.get('loadavg_end')}",
             "- versions: " + ", ".join(f"{k} {x}" for k, x in v.items() if x) +
             ("; openvino not installed" if not v.get("openvino") else ""),
             f"- method: {m['method']['warmup']} warm-up call(s), up to {m['method']['iters']} interleaved "
             f"round-robin rounds (≥ {m['method']['min_iters']}, ≤ {m['method']['budget_s_per_shape']:g} s per "
             f"shape), each engine {m['method'].get('rewarm', 0)} untimed + 1 timed call per round; median and "
             "p90 per engine; `vs eager` = median / eager median (< 1 is faster); "
             "`vs best other` = median / fastest non-graphmode engine; rel L2 = max over outputs of "
             "‖out − eager‖ / ‖eager‖",
             f"- graphmode recipe: {m.get('recipe')}", "",
             "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in res.rows:
        cells = _cells(r)
        if r["engine"] == "graphmode" and r["status"] == "ok":
            cells[2] = f"**{cells[2]}**"
            cells[4] = f"**{cells[4]}**"
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    lines += ["", "Peak RSS: resident MB added at the peak of the engine's setup + first call for that shape, "
              "over what the process held before (model-level work such as graphmode's capture or the ONNX "
              "export is in the first shape's row). Setup: engine setup + first call; graphmode's compile and "
              "the ONNX export are per model and charged to each shape."]
    return "\n".join(lines) + "\n"


def chart(res: BenchResult, path: Path) -> Path | None:
    """Grouped bars: speed-up vs eager per (model, shape) and engine; failed engines marked."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups: list[tuple[str, tuple]] = []
    for r in res.rows:
        k = (r["model"], tuple(r["shape"]))
        if k not in groups:
            groups.append(k)
    labels = []
    for r in res.rows:
        if r["label"] not in labels:
            labels.append(r["label"])
    if not groups or not labels:
        return None
    fig, ax = plt.subplots(figsize=(max(6.5, 1.7 * len(groups) + 2.5), 5.0))
    width = 0.8 / len(labels)
    by = {(r["model"], tuple(r["shape"]), r["label"]): r for r in res.rows}
    palette = plt.get_cmap("tab10").colors
    top = 1.0
    for j, lab in enumerate(labels):
        xs, ys = [], []
        color = palette[j % len(palette)]
        for i, (model, shape) in enumerate(groups):
            r = by.get((model, shape, lab))
            x = i - 0.4 + width * (j + 0.5)
            if r is None:
                continue
            if r["status"] == "ok" and r.get("speedup_vs_eager"):
                xs.append(x)
                ys.append(r["speedup_vs_eager"])
            else:
                ax.text(x, 0.02, f"{lab}: " + ("not installed" if r.get("skipped") else "failed"), rotation=90,
                        ha="center", va="bottom", fontsize=7, color="gray")
        if ys:
            top = max(top, max(ys))
            bars = ax.bar(xs, ys, width, label=lab, color=color)
            if len(groups) * len(labels) <= 40:
                ax.bar_label(bars, fmt="%.2f", fontsize=6, padding=1)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([f"{m}\n({','.join(map(str, s))})" for m, s in groups], fontsize=8)
    ax.set_ylabel("speed-up vs eager (eager median / engine median)")
    ax.set_ylim(0, top * 1.18 if math.isfinite(top) else 2)
    m = res.meta
    ax.set_title(f"{m['cpu_model']}, {m['threads']} thread(s), median latency, {m['date'][:10]}", fontsize=9)
    ax.legend(fontsize=8, ncol=min(len(labels), 5), loc="upper center", bbox_to_anchor=(0.5, -0.14),
              frameon=False)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_results(res: BenchResult, out_dir: str | Path, name: str = "bench") -> dict[str, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / f"{name}.json", "meta": out / f"{name}.meta.json", "md": out / f"{name}.md",
             "png": out / f"{name}.png"}
    paths["json"].write_text(json.dumps(res.rows, indent=1, default=str) + "\n", encoding="utf-8")
    paths["meta"].write_text(json.dumps(res.meta, indent=1, default=str) + "\n", encoding="utf-8")
    paths["md"].write_text(markdown(res), encoding="utf-8")
    try:
        chart(res, paths["png"])
    except Exception as e:  # noqa: BLE001 - a chart problem must not lose the measured data
        paths.pop("png")
        res.meta["chart_error"] = f"{type(e).__name__}: {e}"
        paths["meta"].write_text(json.dumps(res.meta, indent=1, default=str) + "\n", encoding="utf-8")
    return paths
