"""Benchmark output: a rich table, `<name>.json` (the rows, a plain list), `<name>.meta.json`
(machine, versions, method), `<name>.md` and `<name>.png` (speed-up vs eager per shape).

Every view shows the rows' flags (quality.py) next to their numbers: a flagged ratio is
hatched in the chart and footnoted in the table, an eager-fallback row has no ratio and no
bar, and a `--quick` run charts numerics, not ratios (its timings are not measurements)."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from graphmode.bench.harness import BenchResult
from graphmode.bench.quality import LEGEND, QUICK_NOTE, RATIO_CAP, doubtful_ratio


def _ms(v: Any) -> str:
    return "-" if v is None else (f"{v:.2f}" if v < 100 else f"{v:.1f}")


def _x(v: Any) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _vs_best(r: dict) -> str:
    """The ratio to the best other engine, with graphmode's paired 95% interval where it has one."""
    ci = r.get("ratio_vs_best_other_ci95")
    return _x(r.get("ratio_vs_best_other")) + (f" ({ci[0]:.2f}-{ci[1]:.2f})" if ci else "")


def _err(v: Any) -> str:
    return "-" if v is None else f"{v:.1e}"


def _shape(r: dict) -> str:
    return "(" + ",".join(map(str, r["shape"])) + ")"


COLUMNS = ("model", "shape", "engine", "status", "median ms", "p90 ms", "vs eager", "vs best other",
           "floor ms", "x floor", "rel L2", "setup s", "peak RSS MB", "flags")
SHORT = ("model", "shape", "engine", "status", "median", "p90", "/eager", "/best", "floor", "xfloor", "relL2",
         "setup", "RSS", "flags")


def _floor(v: Any) -> str:
    return "-" if v is None else f"{v:.3g}"


def _label(r: dict) -> str:
    return f"{r['label']} (eager fallback)" if r.get("eager_fallback") else r["label"]


def _status(r: dict, full: bool) -> str:
    if r["status"] != "ok":
        return f"{r['status']}: {r['reason']}" if full else ("n/a" if r.get("skipped") else "failed")
    return "ok" if r.get("numerics_ok") is not False else "ok, numerics off"


def _cells(r: dict, full: bool = True) -> list[str]:
    status = _status(r, full)
    return [r["model"], _shape(r), _label(r), status, _ms(r.get("median_ms")), _ms(r.get("p90_ms")),
            _x(r.get("ratio_vs_eager")), _vs_best(r), _floor(r.get("floor_ms")),
            "-" if r.get("x_floor") is None else f"{r['x_floor']:.3g}x", _err(r.get("rel_l2_err")),
            "-" if r.get("setup_s") is None else f"{r['setup_s']:.1f}",
            "-" if r.get("peak_rss_mb") is None else f"{r['peak_rss_mb']:.0f}", ",".join(r.get("flags") or ())]


def _roof(meta: dict) -> str:
    """The roofline the floors were computed on (meta.target, from the host probe)."""
    t = meta.get("target") or {}
    if not t:
        return "no target"
    return f"{t.get('peak_f32_gflops')} GFLOP/s f32 peak and {t.get('memory_bandwidth_gbps')} GB/s"


def _legend(res: BenchResult) -> list[str]:
    """`code: meaning` for each flag that some row carries."""
    used = {f for r in res.rows for f in r.get("flags") or ()}
    return [f"{code}: {text}" for code, text in LEGEND.items() if code in used]


def rich_table(res: BenchResult):
    from rich import box
    from rich.markup import escape
    from rich.table import Table
    m = res.meta
    title = f"graphmode bench — {m['cpu_model']}, {m['threads']} thread(s), {m['date']}"
    if m.get("quick"):
        title += f"\n{QUICK_NOTE}"
    caption = ("ms = median / p90 latency; /eager, /best = median over eager's and over the fastest "
               "non-graphmode engine's (< 1 is faster); floor = the shape's roofline ms on this host, "
               "max(FLOPs / peak, bytes / bandwidth), xfloor = median / floor; setup s; RSS = peak MB added by setup")
    legend = _legend(res)
    if legend:
        caption += "\nflags: " + "; ".join(legend)
    t = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1),
              caption=caption, caption_justify="left")
    for c in SHORT:
        t.add_column(c, justify="right" if c not in ("model", "shape", "engine", "status", "flags") else "left",
                     no_wrap=c not in ("engine", "flags"), overflow="fold")
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
        if r.get("flags") and r["status"] == "ok" and not m.get("quick"):
            style = "yellow" if style is None else f"{style} yellow"
        t.add_row(*map(escape, cells), style=style)     # engine labels such as graphmode[avx2] are not markup
        if r["status"] != "ok":
            notes.append(f"{r['model']} {cells[1]} {r['label']}: {r['reason']}")
    return t, notes


SPEED_GOAL = 0.90        # graphmode median / the best other engine's, per shape
FLOOR_GOAL = 1.10        # or, where the shape is memory-bound, graphmode median / its roofline floor
RSS_GOAL = 1.2           # graphmode's peak RSS added by setup + first call / ONNX Runtime's


def goals(res: BenchResult) -> list[str]:
    """One line per benchmarked shape: the speed goal (<= SPEED_GOAL x the best other engine,
    or <= FLOOR_GOAL x the floor where the shape is memory-bound) and the memory goal (peak
    RSS <= RSS_GOAL x ONNX Runtime's), each met / NOT met with the numbers; empty under --quick."""
    if res.meta.get("quick"):
        return []
    by_shape: dict[tuple, dict[str, dict]] = {}
    for r in res.rows:        # by engine: graphmode's label carries its ISA cap (graphmode[avx2])
        if r["status"] == "ok":
            by_shape.setdefault((r["model"], tuple(r["shape"])), {}).setdefault(r["engine"], r)
    out = []
    for (model, shape), rows in by_shape.items():
        g = rows.get("graphmode")
        if g is None or g.get("eager_fallback"):
            continue
        parts = []
        ratio, floor = g.get("ratio_vs_best_other"), g.get("x_floor")
        if ratio is not None:
            mem_bound = g.get("floor_bound") == "memory"
            floor_ok = mem_bound and floor is not None and floor <= FLOOR_GOAL
            ok = ratio <= SPEED_GOAL or floor_ok
            note = f"{ratio:.2f}x {g.get('best_other_engine')}"
            if mem_bound and floor:
                note += f", {floor:.2f}x the memory-bound floor"
            ci = g.get("ratio_vs_best_other_ci95")
            if ci:
                note += f"; per-round ratio {ci[0]:.2f}-{ci[1]:.2f} at 95%"
                if ci[0] <= SPEED_GOAL < ci[1] and not floor_ok:
                    note += ", which this run does not settle"
            parts.append(f"speed {'met' if ok else 'NOT met'} ({note})")
        ort = rows.get("onnxruntime")
        if ort is not None and ort.get("peak_rss_mb") and g.get("peak_rss_mb") is not None:
            x = g["peak_rss_mb"] / ort["peak_rss_mb"]
            parts.append(f"peak RSS {'met' if x <= RSS_GOAL else 'NOT met'} ({g['peak_rss_mb']:.0f} MB, "
                         f"{x:.2f}x onnxruntime's {ort['peak_rss_mb']:.0f} MB)")
        if parts:
            out.append(f"{model} {'x'.join(map(str, shape))}: " + "; ".join(parts))
    return out


def markdown(res: BenchResult) -> str:
    m = res.meta
    v = m["versions"]
    head = [f"# graphmode smoke run, --quick ({m['date']})", "", f"**Not a measurement.** {QUICK_NOTE}; run "
            "`graphmode bench` without `--quick` for numbers.", ""] if m.get("quick") else \
        [f"# graphmode benchmark ({m['date']})", ""]
    lines = head + [
             f"- CPU: {m['cpu_model']}, {m['cores']} core(s), SIMD: {' '.join(m.get('simd') or []) or 'n/a'}",
             *([f"- kernels' ISA: graphmode {m['isa']}; torch {m['engine_isa']['torch']}; oneDNN "
                f"{m['engine_isa']['onednn']}; MLAS {m['engine_isa']['mlas']}"] if m.get("engine_isa") and m.get("isa")
               else []),
             f"- threads: {m['threads']} for every engine; wall time {m.get('wall_s', '?')} s; load average "
             f"(1/5/15 min) at start {m.get('loadavg_start')}, at end {m.get('loadavg_end')}, highest 1-min "
             f"during the timed rounds {m.get('loadavg_max')} ({m.get('usable_cores', m['cores'])} usable core(s))",
             "- versions: " + ", ".join(f"{k} {x}" for k, x in v.items() if x) +
             ("; openvino not installed" if not v.get("openvino") else ""),
             f"- method: {m['method']['warmup']} warm-up call(s), up to {m['method']['iters']} interleaved "
             f"round-robin rounds (≥ {m['method']['min_iters']}, ≤ {m['method']['budget_s_per_shape']:g} s per "
             f"shape), each engine {m['method'].get('rewarm', 0)} untimed + 1 timed call per round; median and "
             "p90 per engine; `vs eager` = median / eager median (< 1 is faster); "
             "`vs best other` = median / fastest non-graphmode engine (graphmode: in brackets, the 95% interval "
             "of the median of its per-round ratios to that engine, distribution-free); `floor ms` = the shape's "
             f"roofline time on this host, max(FLOPs / peak, bytes / bandwidth) at {_roof(m)}, and `x floor` = "
             "median / floor ms; rel L2 = max over outputs of ‖out − eager‖ / ‖eager‖",
             f"- graphmode recipe: {m.get('recipe')}", "",
             "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in res.rows:
        cells = _cells(r)
        if r["engine"] == "graphmode" and r["status"] == "ok" and not r.get("eager_fallback"):
            cells[2] = f"**{cells[2]}**"
            cells[4] = f"**{cells[4]}**"
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    legend = _legend(res)
    if legend:
        lines += ["", "Flags (a flagged number is shown, but is not a clean measurement):", ""]
        lines += [f"- `{x.split(':', 1)[0]}`:{x.split(':', 1)[1]}" for x in legend]
    if m.get("warnings"):
        lines += ["", "Notes on flagged rows:", ""] + [f"- {w}" for w in m["warnings"]]
    met = goals(res)
    if met:
        lines += ["", f"Goals: graphmode <= {SPEED_GOAL:.2f}x the best other engine (or <= {FLOOR_GOAL:.2f}x the "
                  f"floor on a memory-bound shape); peak RSS <= {RSS_GOAL:.1f}x ONNX Runtime's:", ""]
        lines += [f"- {x}" for x in met]
    lines += ["", "Peak RSS: resident MB added at the peak of the engine's setup + first call for that shape, "
              "over what the process held before (model-level work such as graphmode's capture or the ONNX "
              "export is in the first shape's row). Setup: engine setup + first call; graphmode's compile and "
              "the ONNX export are per model and charged to each shape."]
    return "\n".join(lines) + "\n"


def bars(res: BenchResult) -> list[dict[str, Any]]:
    """What the chart draws, per row: `value` (speed-up vs eager, or under --quick the rel L2
    vs eager) and `kind`: `bar`, `flagged` (hatched, see its flags), `capped` (beyond the
    RATIO_CAP sanity bound: drawn at the bound, labelled as such), or no bar with a reason:
    `eager fallback`, `failed`, `not installed`."""
    quick = bool(res.meta.get("quick"))
    out = []
    for r in res.rows:
        b = {"model": r["model"], "shape": tuple(r["shape"]), "label": r["label"], "value": None, "kind": None}
        if r["status"] != "ok":
            b["kind"] = "not installed" if r.get("skipped") else "failed"
        elif quick:
            b.update(value=r.get("rel_l2_err"), kind="bar" if r.get("numerics_ok") else "flagged")
        elif r.get("eager_fallback"):
            b["kind"] = "eager fallback"
        elif r.get("speedup_vs_eager"):
            x = r["speedup_vs_eager"]
            if x > RATIO_CAP:
                b.update(value=RATIO_CAP, kind="capped")
            else:
                b.update(value=x, kind="flagged" if doubtful_ratio(r) else "bar")
        else:
            b["kind"] = "no ratio"
        out.append(b)
    return out


def chart(res: BenchResult, path: Path) -> Path | None:
    """Grouped bars per (model, shape) and engine: speed-up vs eager, flagged ones hatched and
    implausible ones cut at the sanity bound; under --quick the numerics, not the timings."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    quick = bool(res.meta.get("quick"))
    specs = bars(res)
    groups: list[tuple[str, tuple]] = []
    labels: list[str] = []
    for b in specs:
        if (b["model"], b["shape"]) not in groups:
            groups.append((b["model"], b["shape"]))
        if b["label"] not in labels:
            labels.append(b["label"])
    if not groups or not labels:
        return None
    fig, ax = plt.subplots(figsize=(max(6.5, 1.7 * len(groups) + 2.5), 5.0))
    width = 0.8 / len(labels)
    palette = plt.get_cmap("tab10").colors
    floor = 1e-12                       # rel L2 of eager against itself is 0: drawn at the floor
    top = 1.0
    any_flagged = False
    for j, lab in enumerate(labels):
        color = palette[j % len(palette)]
        drawn = False
        for b in (b for b in specs if b["label"] == lab):
            x = groups.index((b["model"], b["shape"])) - 0.4 + width * (j + 0.5)
            if b["value"] is None:
                ax.text(x, floor if quick else 0.02, f"{lab}: {b['kind']}", rotation=90, ha="center", va="bottom",
                        fontsize=7, color="gray")
                continue
            v = max(b["value"], floor) if quick else b["value"]
            hatch = "//" if b["kind"] in ("flagged", "capped") else None
            any_flagged |= hatch is not None
            bar = ax.bar([x], [v], width, label=None if drawn else lab, color=color, hatch=hatch,
                         edgecolor="black" if hatch else color, linewidth=0.5)
            drawn = True
            top = max(top, v)
            if len(specs) <= 40:
                text = (f"> {RATIO_CAP:g}?" if b["kind"] == "capped" else
                        f"{b['value']:.0e}" if quick else f"{b['value']:.2f}" + ("!" if hatch else ""))
                ax.bar_label(bar, labels=[text], fontsize=6, padding=1)
    m = res.meta
    if quick:
        tol = next((r.get("tol") for r in res.rows if r.get("tol")), None)
        if tol:
            ax.axhline(tol, color="red", linewidth=0.8, linestyle="--")
        ax.set_yscale("log")
        ax.set_ylabel("rel L2 vs eager (below the red line: matches)")
        ax.set_title(f"--quick smoke run: numerics only; its timings are not measurements ({m['date'][:10]})",
                     fontsize=9)
    else:
        ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
        ax.set_ylabel("speed-up vs eager (eager median / engine median)")
        ax.set_ylim(0, top * 1.18 if math.isfinite(top) else 2)
        title = f"{m['cpu_model']}, {m['threads']} thread(s), median latency, {m['date'][:10]}"
        if any_flagged:
            title += f"\nhatched, '!': flagged (load, spread, ...; see the .md); '> {RATIO_CAP:g}?': beyond the sanity bound"
        ax.set_title(title, fontsize=9)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([f"{g}\n({','.join(map(str, s))})" for g, s in groups], fontsize=8)
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
