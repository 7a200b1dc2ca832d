"""Benchmark output: a rich table, `<name>.json` (the rows, a plain list), `<name>.meta.json`
(machine, versions, method), `<name>.md` and `<name>.png` (speed-up vs eager per shape).

Every view shows the rows' flags (quality.py) next to their numbers: a flagged ratio is
hatched in the chart and footnoted in the table, an eager-fallback row has no ratio and no
bar, and a `--quick` run charts numerics, not ratios (its timings are not measurements).

`graphmode bench decode` writes a side-by-side table per model (engines x scenarios), the
goals, `<name>.json`, `<name>.meta.json` (with the goals) and `<name>.md` (both tables, every
row in full, flags and their notes)."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from graphmode.bench.quality import LEGEND, QUICK_NOTE, RATIO_CAP, doubtful_ratio

if TYPE_CHECKING:
    from graphmode.bench.harness import BenchResult


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


CONTENDED = ("contended median", "contended vs best other", "slowdown")
CONTENDED_SHORT = ("busy", "/best busy", "slowdown")


def quiet_rows(res: BenchResult) -> list[dict]:
    """The rows of the quiet condition (every row of a run without `--contend`)."""
    return [r for r in res.rows if r.get("condition", "quiet") == "quiet"]


def contended_of(res: BenchResult) -> dict[tuple, dict]:
    """(model, shape, label) -> the contended row of that engine (empty without `--contend`)."""
    return {(r["model"], tuple(r["shape"]), r["label"]): r for r in res.rows if r.get("condition") == "contended"}


def _contended_cells(r: dict, busy: dict[tuple, dict]) -> list[str]:
    """The contended columns beside quiet row `r`: median, ratio to the best other engine
    under the same contention, and slowdown = contended / quiet median."""
    c = busy.get((r["model"], tuple(r["shape"]), r["label"]))
    if c is None or c["status"] != "ok":
        return ["-", "-", "-"]
    return [_ms(c.get("median_ms")), _vs_best(c), _x(c.get("slowdown"))]


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


NARROW_DROPS = ("p90", "floor", "xfloor", "setup", "RSS")    # left out under NARROW_COLUMNS (in the .md and .json)
NARROW_COLUMNS = 120


def rich_table(res: BenchResult, width: int | None = None):
    """The terminal table; on a terminal narrower than NARROW_COLUMNS the secondary columns
    (NARROW_DROPS) are left out rather than every column squeezed past reading."""
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
    busy = contended_of(res)
    if busy:
        caption += (f"\nbusy = the same rounds with {m.get('contend')} CPU burner(s) running: median, /best among "
                    "the contended engines, slowdown = busy / quiet median")
    legend = _legend(res)
    if legend:
        caption += "\nflags: " + "; ".join(legend)
    t = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1),
              caption=caption, caption_justify="left")
    cols = SHORT[:-1] + (CONTENDED_SHORT if busy else ()) + SHORT[-1:]
    keep = [i for i, c in enumerate(cols) if not (width is not None and width < NARROW_COLUMNS and c in NARROW_DROPS)]
    if len(keep) < len(cols):
        t.caption = (t.caption or "") + f"\n(narrow terminal: {', '.join(NARROW_DROPS)} are in the .md and .json)"
    for c in (cols[i] for i in keep):
        t.add_column(c, justify="right" if c not in ("model", "shape", "engine", "status", "flags") else "left",
                     no_wrap=c not in ("engine", "flags"), overflow="fold")
    prev = None
    notes = []
    for r in quiet_rows(res):
        key = (r["model"], tuple(r["shape"]))
        if prev is not None and key != prev:
            t.add_section()
        prev = key
        cells = _cells(r, full=False)
        if busy:
            cells[-1:-1] = _contended_cells(r, busy)
        cells[1] = "x".join(map(str, r["shape"]))
        style = "dim" if r["status"] != "ok" else ("bold" if r["engine"] == "graphmode" else None)
        if r.get("flags") and r["status"] == "ok" and not m.get("quick"):
            style = "yellow" if style is None else f"{style} yellow"
        t.add_row(*(escape(cells[i]) for i in keep), style=style)   # labels like graphmode[avx2] are not markup
        if r["status"] != "ok":
            notes.append(f"{r['model']} {cells[1]} {r['label']}: {r['reason']}")
    return t, notes


SPEED_GOAL = 0.90        # graphmode median / the best other engine's, per shape
FLOOR_GOAL = 1.10        # or, where the shape is memory-bound, graphmode median / its roofline floor
RSS_GOAL = 1.2           # graphmode's peak RSS added by setup + first call / ONNX Runtime's
CONTENDED_GOAL = 1.0     # under --contend: graphmode median / the best other engine's, both contended


def goals(res: BenchResult) -> list[str]:
    """One line per benchmarked shape: the speed goal (<= SPEED_GOAL x the best other engine,
    or <= FLOOR_GOAL x the floor where the shape is memory-bound) and the memory goal (peak
    RSS <= RSS_GOAL x ONNX Runtime's), each met / NOT met with the numbers; empty under --quick."""
    if res.meta.get("quick"):
        return []
    by_shape: dict[tuple, dict[str, dict]] = {}
    for r in quiet_rows(res):        # by engine: graphmode's label carries its ISA cap (graphmode[avx2])
        if r["status"] == "ok":
            by_shape.setdefault((r["model"], tuple(r["shape"])), {}).setdefault(r["engine"], r)
    busy: dict[tuple, dict[str, dict]] = {}
    for r in res.rows:
        if r.get("condition") == "contended" and r["status"] == "ok":
            busy.setdefault((r["model"], tuple(r["shape"])), {}).setdefault(r["engine"], r)
    out, firsts = [], {}
    for model, shape in by_shape:
        firsts.setdefault(model, shape)
    for (model, shape), rows in by_shape.items():
        g = rows.get("graphmode")
        if g is None or g.get("eager_fallback"):
            continue
        parts = []
        ratio, floor = g.get("ratio_vs_best_other"), g.get("x_floor")
        if ratio is not None:
            mem_bound = g.get("floor_bound") == "memory"
            # a row under its floor (flagged `floor`) says the floor is wrong there, not that the goal holds
            floor_ok = mem_bound and floor is not None and 1.0 <= floor <= FLOOR_GOAL
            ok = ratio <= SPEED_GOAL or floor_ok
            note = f"{ratio:.2f}x {g.get('best_other_engine')}"
            if mem_bound and floor:
                note += f", {floor:.2f}x the memory-bound floor" + (" (under it: the floor is in doubt)"
                                                                      if floor < 1.0 else "")
            ci = g.get("ratio_vs_best_other_ci95")
            if ci:
                note += f"; per-round ratio {ci[0]:.2f}-{ci[1]:.2f} at 95%"
                if ci[0] <= SPEED_GOAL < ci[1] and not floor_ok:
                    note += ", which this run does not settle"
            note += f"; goal <= {SPEED_GOAL:.2f}x" + (f", or <= {FLOOR_GOAL:.2f}x the floor" if mem_bound else "")
            parts.append(f"speed {'met' if ok else 'NOT met'} ({note})")
        ort = rows.get("onnxruntime")
        # setup (an export, a compile) lands on a model's first shape: what later ones add is leftovers
        if ort is not None and ort.get("peak_rss_mb") and g.get("peak_rss_mb") is not None and \
                firsts[model] == shape:
            x = g["peak_rss_mb"] / ort["peak_rss_mb"]
            parts.append(f"peak RSS {'met' if x <= RSS_GOAL else 'NOT met'} ({g['peak_rss_mb']:.0f} MB, "
                         f"{x:.2f}x onnxruntime's {ort['peak_rss_mb']:.0f} MB; goal <= {RSS_GOAL:.1f}x)")
        parts += contended_goals(busy.get((model, shape), {}))
        shared = [f for f in g.get("flags") or () if f in ("load", "starved")]
        if parts and shared:
            parts.append(f"timed on a busy host ({', '.join(shared)}): rerun on a quiet one before reading these")
        if parts:
            out.append(f"{model} {'x'.join(map(str, shape))}: " + "; ".join(parts))
    return out


def contended_goals(rows: dict[str, dict]) -> list[str]:
    """The contended goals of one shape from its contended rows (by engine): graphmode <=
    CONTENDED_GOAL x the best other engine under the same burners, and its slowdown (contended
    / quiet) no worse than ONNX Runtime's."""
    g = rows.get("graphmode")
    if g is None or g.get("eager_fallback"):
        return []
    parts = []
    ratio = g.get("ratio_vs_best_other")
    if ratio is not None:
        ci = g.get("ratio_vs_best_other_ci95")
        parts.append(f"contended speed {'met' if ratio <= CONTENDED_GOAL else 'NOT met'} ({ratio:.2f}x "
                     f"{g.get('best_other_engine')}" + (f"; per-round ratio {ci[0]:.2f}-{ci[1]:.2f} at 95%" if ci else "")
                     + f"; goal <= {CONTENDED_GOAL:.1f}x)")
    ort = rows.get("onnxruntime")
    if g.get("slowdown") and ort is not None and ort.get("slowdown"):
        parts.append(f"slowdown {'met' if g['slowdown'] <= ort['slowdown'] else 'NOT met'} "
                     f"({g['slowdown']:.2f}x, onnxruntime's {ort['slowdown']:.2f}x)")
    return parts


def markdown(res: BenchResult) -> str:
    m = res.meta
    v = m["versions"]
    busy = contended_of(res)
    cols = COLUMNS[:-1] + (CONTENDED if busy else ()) + COLUMNS[-1:]
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
             *([f"- OpenMP wait (torch's and graphmode's threads): " + ", ".join(
                 f"{k}={x if x is not None else 'unset'}" for k, x in m["openmp_env"].items())]
               if m.get("openmp_env") else []),
             *[f"- {k} set up with {x}" for k, x in (m.get("method", {}).get("engine_settings") or {}).items()],
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
             f"- graphmode recipe: {m.get('recipe')}",
             *([f"- contended: {m['method']['contend']}; the contended columns' ratio is to the best other "
                "engine under the same contention"] if busy else []), ""]
    cells = []
    for r in quiet_rows(res):
        cells.append(_cells(r))
        if busy:
            cells[-1][-1:-1] = _contended_cells(r, busy)
        if r["engine"] == "graphmode" and r["status"] == "ok" and not r.get("eager_fallback"):
            cells[-1][2] = f"**{cells[-1][2]}**"
            cells[-1][4] = f"**{cells[-1][4]}**"
    lines += _md_table(list(cols), cells) + _flag_notes(res.rows, m.get("warnings"))
    met = [] if m.get("between_buckets") else goals(res)
    if m.get("between_buckets"):
        from graphmode.bench.between import summary_lines, way_lines
        lines += ["", "Between buckets (graphmode padded to its bucket, split, or in hybrid mode eager, whichever "
                  "measured fastest per shape, or in a plan of the request's own value once it recurs "
                  "(runtime/exact.py, built during setup); eager at the request's own shape):", ""]
        lines += [f"- {x}" for x in summary_lines(quiet_rows(res))]
        if ways := way_lines(quiet_rows(res)):
            lines += ["", "Per shape, the ways graphmode tried (best ms of each) and the one it runs:", ""]
            lines += [f"- {x}" for x in ways]
    if met:
        lines += ["", f"Goals: graphmode <= {SPEED_GOAL:.2f}x the best other engine (or <= {FLOOR_GOAL:.2f}x the "
                  f"floor on a memory-bound shape); peak RSS <= {RSS_GOAL:.1f}x ONNX Runtime's (at a model's first "
                  "shape, where its setup is counted)"
                  + (f"; contended: <= {CONTENDED_GOAL:.2f}x the best other engine and a slowdown no worse than "
                     "ONNX Runtime's" if busy else "") + ":", ""]
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
    for r in quiet_rows(res):
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


# ---- shared by both reports --------------------------------------------------------------

def _md_table(head: list[str], lines: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(str(c).replace("|", "\\|") for c in line) + " |" for line in lines]
    return out


def _flag_notes(rows: list[dict], warnings: list[str] | None) -> list[str]:
    """The meaning of every flag some row carries, then the run's notes on flagged rows."""
    used = {f for r in rows for f in r.get("flags") or ()}
    lines = []
    if used:
        lines += ["", "Flags (a flagged number is shown, but is not a clean measurement):", ""]
        lines += [f"- `{c}`: {t}" for c, t in LEGEND.items() if c in used]
    if warnings:
        lines += ["", "Notes on flagged rows:", ""] + [f"- {w}" for w in warnings]
    return lines


def _write(out_dir: str | Path, name: str, rows: list[dict], meta: dict, md: str) -> dict[str, Path]:
    """`<name>.json` (the rows, a plain list), `<name>.meta.json` and `<name>.md` in `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / f"{name}.json", "meta": out / f"{name}.meta.json", "md": out / f"{name}.md"}
    paths["json"].write_text(json.dumps(rows, indent=1, default=str) + "\n", encoding="utf-8")
    paths["meta"].write_text(json.dumps(meta, indent=1, default=str) + "\n", encoding="utf-8")
    paths["md"].write_text(md, encoding="utf-8")
    return paths


def write_results(res: BenchResult, out_dir: str | Path, name: str = "bench") -> dict[str, Path]:
    paths = _write(out_dir, name, res.rows, res.meta, markdown(res))
    if not any(r.get("status") == "ok" for r in res.rows):
        return paths                       # nothing measured: no chart
    paths["png"] = Path(out_dir) / f"{name}.png"
    try:
        chart(res, paths["png"])
    except Exception as e:  # noqa: BLE001 - a chart problem must not lose the measured data
        paths.pop("png")
        res.meta["chart_error"] = f"{type(e).__name__}: {e}"
        paths["meta"].write_text(json.dumps(res.meta, indent=1, default=str) + "\n", encoding="utf-8")
    return paths


# ---- decoders (`graphmode bench decode`) ----------------------------------------------------

def _num(v: Any, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _tokens_match(r: dict) -> str:
    m = r.get("tokens_match")
    return "-" if not m else f"{m['same']}/{m['of']}"


def _decode_columns(rows: list[dict]) -> list[tuple[str, str]]:
    """(scenario, header) in the order the run measured them."""
    seen = dict.fromkeys(r["scenario"] for r in rows)
    out = []
    for sc in seen:
        r = next(x for x in rows if x["scenario"] == sc)
        head = f"TTFT p{r['prompt']} ms" if r["kind"] == "ttft" else f"b{r['batch']} tok/s"
        out.append((sc, head + (" busy" if r.get("condition") == "contended" else "")))
    return out


def _decode_cell(r: dict | None) -> str:
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


def decode_summary(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    """One line per (model, engine): each scenario's metric side by side, the batch-1
    bandwidth bound and the engine's fraction of it, tokens equal to transformers eager's,
    setup and warm-up (lazy compiles) time, flags; then graphmode's speed-up per scenario
    over eager and over the best other engine."""
    cols = _decode_columns(rows)
    head = ["model", "engine"] + [h for _, h in cols] + ["b1 bound tok/s", "b1 of bound", "tokens = eager",
                                                         "setup s", "warm-up s", "flags"]
    lines = []
    for model in dict.fromkeys(r["model"] for r in rows):
        for label in dict.fromkeys(r["label"] for r in rows if r["model"] == model):
            mine = {r["scenario"]: r for r in rows if r["model"] == model and r["label"] == label}
            b1 = next((r for r in mine.values() if r["kind"] == "decode" and r["batch"] == 1
                       and r.get("condition", "quiet") == "quiet"), None)
            same = [r["tokens_match"] for r in mine.values() if r.get("tokens_match")]
            match = f"{sum(m['same'] for m in same)}/{sum(m['of'] for m in same)}" if same else "-"
            flags = sorted({f for r in mine.values() for f in r.get("flags") or ()})
            warm = [r["warmup_s"] for r in mine.values() if r.get("warmup_s") is not None]
            any_row = next(iter(mine.values()))
            lines.append([model, label] + [_decode_cell(mine.get(sc)) for sc, _ in cols] +
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


def decode_goal_lines(goals: list[dict]) -> list[list[str]]:
    mark = {True: "met", False: "NOT met", None: "n/a"}
    return [[g["model"], g["goal"], g["target"], "-" if g["value"] is None else f"{g['value']:.2f}",
             mark[g["met"]], g["detail"]] for g in goals]


def decode_failures(rows: list[dict]) -> list[str]:
    seen = {}
    for r in rows:
        if r["status"] != "ok":
            seen.setdefault((r["model"], r["label"]), r["reason"])
    return [f"{m} {label}: {why}" for (m, label), why in seen.items()]


def decode_rich_tables(res) -> list[Any]:
    from rich import box
    from rich.markup import escape       # cells hold engine names such as graphmode[int8]: text, not markup
    from rich.table import Table
    m = res.meta
    title = f"graphmode bench decode — {m['cpu_model']}, {m['threads']} thread(s), {m['date']}"
    if m.get("quick"):
        title += f"\n{QUICK_NOTE}"
    head, lines = decode_summary(res.rows)
    bw = m["bandwidth"]
    t = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1),
              caption=f"TTFT = median ms to the first token (batch 1); bN tok/s = median decode tokens/s at batch N; "
                      f"bound = tokens/s if a step only read its weights + KV at {bw['floor_uses_gbps']} GB/s; "
                      + (f"busy = the same rounds with {m['contend']} CPU burner(s) running; " if m.get("contend") else "")
                      + "graphmode vs X = X's time / graphmode's (> 1: graphmode faster); * = flagged (see the .md)",
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
    for line in decode_goal_lines(res.goals):
        g.add_row(*map(escape, line), style={"met": "green", "NOT met": "red"}.get(line[4]))
    return [t, g]


DECODE_ROW_COLUMNS = ("model", "scenario", "engine", "status", "TTFT ms", "median ms", "p90 ms", "tok/s", "bound tok/s",
               "of bound", "x eager", "x best other", "tokens = eager", "warm-up s", "rounds", "load max", "CPU/wall",
               "flags")


def _decode_full(r: dict) -> list[str]:
    status = r["status"] if r["status"] == "ok" else f"{r['status']}: {r['reason']}"
    best = r.get("ratio_vs_best_other")
    return [r["model"], r["scenario"], r["label"], status, _num(r.get("ttft_ms")), _num(r.get("median_ms"), 2),
            _num(r.get("p90_ms"), 2), _num(r.get("decode_tok_s"), 2), _num(r.get("floor_tok_s")),
            "-" if r.get("of_floor") is None else f"{r['of_floor']:.0%}", _speedup(r, "ratio_vs_eager"),
            "-" if not best else f"{1 / best:.2f}x ({r['best_other_engine']})", _tokens_match(r), _num(r.get("warmup_s")),
            str(r.get("iters") or "-"), _num(r.get("load_max"), 2), _num(r.get("cpu_per_wall"), 2),
            ",".join(r.get("flags") or ())]


def decode_markdown(res) -> str:
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
        f"bound (a ceiling on tok/s: the bandwidth floor on time per token) = {meth['floor']}"
        + (f"; it assumes {meth['floor_assumes']}" if meth.get("floor_assumes") else "") + "; TTFT = "
        f"{meth['ttft']}", ""]
    head, rows = decode_summary(res.rows)
    lines += ["## Side by side", ""] + _md_table(head, rows)
    lines += ["", "## Goals (issue 15, item 9)", ""]
    lines += _md_table(["model", "goal", "target", "value", "verdict", "detail"], decode_goal_lines(res.goals))
    fails = decode_failures(res.rows)
    if fails:
        lines += ["", "Engines that did not run:", ""] + [f"- {f}" for f in fails]
    lines += ["", "## Every row", ""] + _md_table(list(DECODE_ROW_COLUMNS), [_decode_full(r) for r in res.rows])
    lines += _flag_notes(res.rows, m.get("warnings"))
    return "\n".join(lines) + "\n"


def write_decode_results(res, out_dir: str | Path, name: str = "decode") -> dict[str, Path]:
    return _write(out_dir, name, res.rows, {**res.meta, "goals": res.goals}, decode_markdown(res))


# ---- decode_goals (issue 15, item 9) -------------------------------------------------------------

def decode_goals(rows: list[dict[str, Any]], quick: bool = False) -> list[dict[str, Any]]:
    """Each goal per model: met (True/False) or None (not measurable in this run, with why;
    never judged from a --quick run, whose timings are not measurements)."""
    out = []
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model and r["status"] == "ok" and r.get("condition", "quiet") == "quiet"]
        busy = [r for r in rows if r["model"] == model and r["status"] == "ok" and r.get("condition") == "contended"]

        def pick(kind, batch=None, prompt=None, engine=None, dtype=None, not_engine=None, variant="default"):
            return [r for r in mine if r["kind"] == kind and (batch is None or r["batch"] == batch)
                    and (prompt is None or r["prompt"] == prompt)
                    and (engine is None or (r["engine"] == engine and r.get("variant", "default") == variant))
                    and (dtype is None or r["dtype"] == dtype) and r["engine"] != not_engine]

        def goal(name, target, value, need, detail):
            met = None if value is None else (value >= need if target.startswith(">=") else value <= need)
            if quick and met is not None:
                met, detail = None, f"not judged (--quick): {detail}"
            out.append({"model": model, "goal": name, "target": target, "value": value, "met": met,
                        "detail": detail})

        gm1 = next(iter(pick("decode", batch=1, engine="graphmode")), None)
        alt1 = max(pick("decode", batch=1, dtype="f32", not_engine="graphmode"),
                   key=lambda r: r["decode_tok_s"], default=None)
        goal("decode b1 fp32 vs best fp32 alternative", ">= 1.2x",
             _div(gm1 and gm1["decode_tok_s"], alt1 and alt1["decode_tok_s"]), 1.2,
             _vs(gm1, alt1, "decode_tok_s", "tok/s", ("graphmode decode b1", "fp32 alternative's decode b1")))
        goal("decode b1 fp32 vs the floor", ">= 0.8", gm1 and gm1["of_floor"], 0.8,
             f"graphmode {gm1['decode_tok_s']:.1f} tok/s, floor {gm1['floor_tok_s']:.1f}"
             if gm1 and gm1.get("floor_tok_s") else "not measured: no graphmode decode b1 row with a floor")
        q8 = next(iter(pick("decode", batch=1, engine="llama_cpp", variant="q8_0")), None)
        gm8 = next(iter(pick("decode", batch=1, engine="graphmode", variant="int8")), None)
        goal("int8 decode b1 vs llama.cpp q8_0", ">= 1.0x", _div(gm8 and gm8["decode_tok_s"], q8 and q8["decode_tok_s"]),
             1.0, _vs(gm8, q8, "decode_tok_s", "tok/s") if gm8 and q8 else
             "not measured: needs graphmode[int8] and llama_cpp[q8_0] rows at batch 1" +
             (f" (graphmode[int8]: {gm8['decode_tok_s']:.1f} tok/s)" if gm8 else ""))
        for b in (1, 4):
            for kind in ("q4_0", "q4_K_M"):
                q4 = next(iter(pick("decode", batch=b, engine="llama_cpp", variant=kind)), None)
                for var in ("int4", "int4_q8"):
                    gm4 = next(iter(pick("decode", batch=b, engine="graphmode", variant=var)), None)
                    if var != "int4" and gm4 is None:
                        continue                                  # an opt-in row: a goal only when run
                    goal(f"{var} decode b{b} vs llama.cpp {kind}", ">= 1.0x",
                         _div(gm4 and gm4["decode_tok_s"], q4 and q4["decode_tok_s"]), 1.0,
                         _vs(gm4, q4, "decode_tok_s", "tok/s") if gm4 and q4 else
                         f"not measured: needs graphmode[{var}] and llama_cpp[{kind}] rows at batch {b}" +
                         (f" (graphmode[{var}]: {gm4['decode_tok_s']:.1f} tok/s)" if gm4 else ""))
        gm16 = next(iter(pick("decode", batch=16, engine="graphmode")), None)
        sc16 = next(iter(pick("decode", batch=16, engine="static_compile")), None)
        goal("decode b16 throughput vs static-cache torch.compile", ">= 1.5x",
             _div(gm16 and gm16["decode_tok_s"], sc16 and sc16["decode_tok_s"]), 1.5,
             _vs(gm16, sc16, "decode_tok_s", "tok/s", ("graphmode decode b16 (--batches)",
                                                        "static_compile decode b16 (--engines)")))
        gm512 = next(iter(pick("ttft", prompt=512, engine="graphmode")), None)
        alt512 = min(pick("ttft", prompt=512, not_engine="graphmode"), key=lambda r: r["ttft_ms"], default=None)
        goal("TTFT p512 vs best alternative", "<= 0.8x", _div(gm512 and gm512["ttft_ms"], alt512 and alt512["ttft_ms"]),
             0.8, _vs(gm512, alt512, "ttft_ms", "ms",
                      ("graphmode TTFT p512 (--prompt-lens)", "alternative's TTFT p512")))
        for b in sorted({r["batch"] for r in busy if r["kind"] == "decode"} & {1, 4}):
            q, c = _vs_llama(mine, b), _vs_llama(busy, b)
            goal(f"decode b{b} vs llama.cpp f32, contended / quiet", ">= 1.0x", _div(c and c[0], q and q[0]), 1.0,
                 f"graphmode / llama.cpp tok/s: {q[0]:.2f} quiet ({q[1]}), {c[0]:.2f} contended ({c[1]})"
                 if q and c else "not measured: needs graphmode and llama_cpp[f32] decode rows in both conditions")
    return out


def _vs_llama(rows: list[dict[str, Any]], batch: int) -> tuple[float, str] | None:
    """graphmode's decode tok/s over llama.cpp f32's at `batch` among `rows` (one condition)."""
    def one(engine: str, variant: str) -> dict | None:
        return next((r for r in rows if r["kind"] == "decode" and r["batch"] == batch and r["engine"] == engine
                     and r.get("variant", "default") == variant and r.get("decode_tok_s")), None)
    gm, ll = one("graphmode", "default"), one("llama_cpp", "f32")
    if gm is None or ll is None:
        return None
    return gm["decode_tok_s"] / ll["decode_tok_s"], f"{gm['decode_tok_s']:.1f} vs {ll['decode_tok_s']:.1f}"


def _div(a, b):
    return round(a / b, 4) if a and b else None


def _vs(mine, other, key, unit, rows=("graphmode", "alternative")):
    """The goal's comparison, or which of its two rows (`rows`: what each is) this run lacks."""
    if mine is None or other is None:
        return "not measured: no " + " and no ".join(w for w, r in zip(rows, (mine, other)) if r is None) + " row"
    return f"graphmode {mine[key]:.1f} {unit} vs {other['label']} {other[key]:.1f} {unit}"
