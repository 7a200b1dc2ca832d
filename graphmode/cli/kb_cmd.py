"""`graphmode kb ls|show|query|recommend|export|import`: the knowledge base of recipes, models,
hardware and what each recipe achieved.

The file: `--kb PATH`, else $GRAPHMODE_KB (one file a team or a CI fleet shares, whatever
the recipe), else kb/kb.sqlite under the cache root. Reading commands never create it.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, List, Optional

import typer
import yaml
from rich import box
from rich.table import Table
from rich.text import Text

from graphmode.cli.app import app, console, err_console
from graphmode.cli.options import MODEL_SPEC_HELP, CacheDir, KbPath, kb_file
from graphmode.cli.progress import progress
from graphmode.kb.render import shown, terminal_safe
from graphmode.progress import stage


kb_app = typer.Typer(name="kb", no_args_is_help=True, add_completion=False,
                     help="The knowledge base: recipes, models, hardware and the performance each recipe achieved.")
app.add_typer(kb_app, name="kb")


SOURCES = ("bench", "profile", "verify", "tune", "serve")       # what writes measurements
STATUSES = ("ok", "violates", "failed")
ORIGINS = ("init", "tune", "measured")                            # how a recipe came to the base


def _one_of(value: Optional[str], choices: tuple[str, ...], flag: str) -> None:
    """A filter of a fixed vocabulary: an unknown value is refused, not answered with no rows."""
    if value is not None and value not in choices:
        from graphmode.errors import GraphmodeError
        raise GraphmodeError(f"unknown value {value!r}", where=flag, fix=f"one of {', '.join(choices)}")


def _nothing_named(db: Any, model: Optional[str], family: Optional[str]) -> None:
    """When a --model or --family filter matched nothing: the names the base holds."""
    for col, v, flag in (("name", model, "--model"), ("family", family, "--family")):
        if v is None:
            continue
        known = sorted({r[col] for r in db.rows(f"SELECT DISTINCT {col} FROM models") if r[col]})
        if v not in known:
            console.print(f"{flag} {v!r}: no such {col} in the knowledge base; it holds "
                          f"{', '.join(known[:20]) or 'none'}" + (" ..." if len(known) > 20 else ""),
                          markup=False, highlight=False)


def _open(path: Path):
    """The knowledge base for reading, or None (said on stderr) when there is none yet."""
    from graphmode.kb import KnowledgeBase
    if not path.exists():
        err_console.print(f"no knowledge base at {path} yet: graphmode bench, profile, verify, tune, serve and "
                          "recipe init record into it", markup=False, highlight=False)
        return None
    return KnowledgeBase(path)


MAX_IMPORT_BYTES = 1 << 30         # one export file (a fleet's KB exports to a few MiB)
_WHOLE = ("time", "recipe", "hash", "model", "#")        # columns kept on one line: the others fold


CELL_CHARS = 200        # a longer stored value is cut in tables (rich folds long cells slowly)


class _Table(Table):
    """A table whose cells are shown as plain text (no markup read from stored names), with
    control characters escaped and long values cut."""

    def add_row(self, *cells: Any, **kw: Any) -> None:
        super().add_row(*(c if isinstance(c, Text) else Text(terminal_safe(c, CELL_CHARS, lines=False))
                          for c in cells), **kw)


def _say(text: str) -> None:
    """A line about stored data: printed as plain text, control characters escaped."""
    console.print(terminal_safe(text), markup=False, highlight=False, soft_wrap=True)


def _table(title: str, *cols: str) -> Table:
    t = _Table(title=terminal_safe(title, lines=False), title_justify="left", box=box.SIMPLE_HEAD, show_edge=False,
               pad_edge=False)
    for c in cols:
        t.add_column(c, overflow="fold", no_wrap=c in _WHOLE)
    return t


def _when(t: float | None) -> str:
    import datetime as dt
    return "-" if t is None else dt.datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M")


def _machine(r: dict[str, Any]) -> str:
    return f"{r['hw_name']} ({r['cpu_model']})" if r.get("cpu_model") else r["hw_name"]


_PERF_SQL = """SELECT p.*, r.hash AS recipe_hash, r.name AS recipe_name, m.name AS model_name, m.family AS family,
    h.name AS hw_name, h.cpu_model AS cpu_model, h.fingerprint AS hw_fingerprint
    FROM performance p JOIN recipes r ON r.id = p.recipe JOIN models m ON m.id = p.model
    JOIN hardware h ON h.id = p.hardware"""
_WHERE_FIELDS = ("p50_ms", "p99_ms", "p99_over_p50", "throughput", "peak_memory_mb", "compile_s", "numerics_err",
                 "threads")
_OPS = ("<=", ">=", "!=", "<", ">", "=")


def _perf_json(r: dict[str, Any]) -> dict[str, Any]:
    keep = ("uid", "recipe_hash", "recipe_name", "model_name", "family", "hw_name", "cpu_model", "source", "status",
            "reason", "bucket", "p50_ms", "p99_ms", "p99_over_p50", "throughput", "peak_memory_mb", "compile_s",
            "numerics_err", "threads", "graphmode_version", "torch_version", "extra", "created")
    return {k: r.get(k) for k in keep}


def _perf_table(title: str, rows: list[dict[str, Any]]) -> Table:
    t = _table(title, "time", "recipe", "model", "hardware", "source", "status", "bucket", "threads", "p50 ms",
               "p99 ms", "p99/p50", "items/s", "mem MB", "compile s", "rel L2")
    for r in rows:
        b = ",".join(f"{k}={v}" for k, v in (r["bucket"] or {}).items()) or "-"
        st = {"ok": "green", "violates": "yellow", "failed": "red"}.get(r["status"], "white")
        t.add_row(_when(r["created"]), r["recipe_hash"], r["model_name"], _machine(r), r["source"],
                  Text(terminal_safe(r["status"], CELL_CHARS, lines=False), style=st), b, str(r["threads"] or "-"), shown(r["p50_ms"]), shown(r["p99_ms"]),
                  shown(r["p99_over_p50"]), shown(r["throughput"]), shown(r["peak_memory_mb"]), shown(r["compile_s"]),
                  "-" if r["numerics_err"] is None else f"{r['numerics_err']:.1e}")
    return t


def _reasons(rows: list[dict[str, Any]]) -> None:
    for r in rows:
        if r["status"] != "ok" and r.get("reason"):
            _say(f"  {r['recipe_hash']} {r['source']} {r['status']}: {r['reason']}")


@kb_app.command("ls")
def ls_cmd(model: Optional[str] = typer.Option(None, "--model", help="model name"),
           family: Optional[str] = typer.Option(None, "--family", help="architecture family (bert, gpt2, ...)"),
           hardware: Optional[str] = typer.Option(None, "--hardware", help="target name or CPU model substring"),
           origin: Optional[str] = typer.Option(None, "--origin", help="init | tune | measured"),
           limit: int = typer.Option(50, "--limit", min=1, max=10 ** 9),
           kb: Optional[Path] = KbPath, cache_dir: Optional[Path] = CacheDir,
           as_json: bool = typer.Option(False, "--json")) -> None:
    """Recipes in the knowledge base, newest first, with how many measurements and the best numbers."""
    _one_of(origin, ORIGINS, "--origin")
    db = _open(kb_file(kb, cache_dir))
    if db is None:
        if as_json:
            print("[]")
        return
    with db:
        rows = db.rows("""SELECT r.hash, r.name, r.origin, r.parent, r.created, m.name AS model_name, m.family,
            h.name AS hw_name, h.cpu_model,
            (SELECT count(*) FROM performance p WHERE p.recipe = r.id) AS measured,
            (SELECT count(*) FROM performance p WHERE p.recipe = r.id AND p.status = 'ok') AS ok,
            (SELECT min(p99_ms) FROM performance p WHERE p.recipe = r.id AND p.status = 'ok') AS best_p99,
            (SELECT max(throughput) FROM performance p WHERE p.recipe = r.id AND p.status = 'ok') AS best_tput,
            (SELECT count(DISTINCT p.hardware) FROM performance p WHERE p.recipe = r.id) AS machines
            FROM recipes r LEFT JOIN models m ON m.id = r.optimized_for LEFT JOIN hardware h ON h.id = r.generated_on
            WHERE (? IS NULL OR m.name = ?) AND (? IS NULL OR m.family = ?) AND (? IS NULL OR r.origin = ?)
              AND (? IS NULL OR h.name = ? OR h.cpu_model LIKE '%' || ? || '%')
            ORDER BY r.created DESC LIMIT ?""",
                       (model, model, family, family, origin, origin, hardware, hardware, hardware, limit + 1))
        if not rows and not as_json:
            _nothing_named(db, model, family)
    more, rows = len(rows) > limit, rows[:limit]      # one past the limit: whether there are more
    if as_json:
        print(json.dumps(rows, indent=1))
        return
    t = _table(f"{len(rows)} recipe(s) in {db.path}" + (f" (the newest {limit}; --limit shows more)" if more else ""),
               "hash", "name", "origin", "model", "generated on", "measured",
               "ok", "machines", "best p99 ms", "best items/s", "created")
    for r in rows:
        t.add_row(r["hash"], r["name"], r["origin"] + (f" from {r['parent']}" if r["parent"] else ""),
                  f"{r['model_name']} ({r['family']})", _machine(r), str(r["measured"]), str(r["ok"]),
                  str(r["machines"]), shown(r["best_p99"]), shown(r["best_tput"]), _when(r["created"]))
    console.print(t)


@kb_app.command("show")
def show_cmd(recipe: str = typer.Argument(..., help="recipe content hash (a unique prefix is enough)"),
             kb: Optional[Path] = KbPath, cache_dir: Optional[Path] = CacheDir,
             as_json: bool = typer.Option(False, "--json")) -> None:
    """One recipe: its content, where it came from, and every measurement of it on every machine."""
    from graphmode.kb import KbError
    path = kb_file(kb, cache_dir)
    db = _open(path)
    if db is None:
        raise KbError(f"no recipe {recipe!r}: there is no knowledge base yet", where=str(path),
                      fix="record measurements first (graphmode bench / tune / verify)")
    with db:
        found = db.rows("SELECT r.*, m.name AS model_name, m.family, h.name AS hw_name, h.cpu_model FROM recipes r "
                        "LEFT JOIN models m ON m.id = r.optimized_for LEFT JOIN hardware h ON h.id = r.generated_on "
                        "WHERE r.hash LIKE ? || '%'", (recipe,))
        if len(found) != 1:
            near = terminal_safe(", ".join(r["hash"] for r in db.rows("SELECT hash FROM recipes ORDER BY created "
                                                                      "DESC LIMIT 10")), 400, lines=False)
            raise KbError(f"{'no' if not found else str(len(found))} recipe(s) whose hash starts with {recipe!r}",
                          where="recipe", value=recipe,
                          fix=("give more characters of the hash" if found else
                               f"recent hashes: {near or 'none'} (graphmode kb ls)"))
        r = found[0]
        perf = db.rows(_PERF_SQL + " WHERE r.hash = ? ORDER BY p.created", (r["hash"],))
    if as_json:
        print(json.dumps({"recipe": {k: r[k] for k in ("hash", "name", "origin", "parent", "ir_hash",
                                                       "graphmode_version", "torch_version", "created", "body")},
                          "model": {"name": r["model_name"], "family": r["family"]},
                          "generated_on": r["hw_name"], "performance": [_perf_json(p) for p in perf]}, indent=1))
        return
    _say(f"recipe {r['hash']} {r['name']}: {r['origin']}"
         + (f" from {r['parent']}" if r["parent"] else "") + f", for {r['model_name']} ({r['family']}), "
         f"generated on {_machine(r)} at {_when(r['created'])}; IR {r['ir_hash'] or '-'}, graphmode "
         f"{r['graphmode_version']}, torch {r['torch_version']}")
    _say(yaml.safe_dump(_in_schema_order(r["body"]), sort_keys=False, default_flow_style=None, width=110).rstrip())
    machines = sorted({_machine(p) for p in perf})
    console.print(_perf_table(f"{len(perf)} measurement(s) on {len(machines)} machine(s)", perf))
    _reasons(perf)


def _in_schema_order(body: dict[str, Any]) -> dict[str, Any]:
    """A stored recipe's fields in the order they are documented (without validating it: a
    stored body is shown as it is, and proving a stranger's recipe can take long)."""
    from graphmode.recipe import Recipe
    order = {k: i for i, k in enumerate(Recipe.model_fields)}
    return {k: body[k] for k in sorted(body, key=lambda k: order.get(k, len(order)))}


def _where(exprs: List[str]) -> tuple[str, list[Any]]:
    from graphmode.errors import GraphmodeError
    sql, args = [], []
    for e in exprs:
        op = next((o for o in _OPS if o in e), None)
        field_, _, value = e.partition(op) if op else (e, None, "")
        field_ = field_.strip()
        if op is None or field_ not in _WHERE_FIELDS:
            raise GraphmodeError(f"cannot read the filter {e!r}", where="--where", value=e,
                                 fix=f"write FIELD OP VALUE, FIELD one of {', '.join(_WHERE_FIELDS)}, OP one of "
                                     f"{' '.join(_OPS)} (e.g. --where 'p99_ms<20')")
        try:
            num = float(value)
        except ValueError:
            raise GraphmodeError(f"{value.strip()!r} is not a number", where="--where", value=e,
                                 fix="compare with a number, e.g. p99_over_p50<=2") from None
        sql.append(f"p.{field_} {op} ?")
        args.append(num)
    return (" AND ".join(sql), args)


@kb_app.command("query")
def query_cmd(model: Optional[str] = typer.Option(None, "--model", help="model name"),
              family: Optional[str] = typer.Option(None, "--family"),
              recipe: Optional[str] = typer.Option(None, "--recipe", help="recipe hash prefix"),
              hardware: Optional[str] = typer.Option(None, "--hardware", help="target name or CPU model substring"),
              source: Optional[str] = typer.Option(None, "--source", help="bench | profile | verify | tune | serve"),
              status: Optional[str] = typer.Option(None, "--status", help="ok | violates | failed"),
              where: List[str] = typer.Option([], "--where", help="metric filter like 'p99_ms<20' (repeatable)"),
              sort: str = typer.Option("created", "--sort", help="created or a metric (p99_ms, throughput, ...)"),
              limit: int = typer.Option(100, "--limit", min=1, max=10 ** 9),
              kb: Optional[Path] = KbPath, cache_dir: Optional[Path] = CacheDir,
              as_json: bool = typer.Option(False, "--json")) -> None:
    """Measurements, filtered: by model, family, recipe, hardware, source, status and metric bounds."""
    from graphmode.errors import GraphmodeError
    _one_of(source, SOURCES, "--source")
    _one_of(status, STATUSES, "--status")
    if sort not in ("created",) + _WHERE_FIELDS:
        raise GraphmodeError(f"cannot sort by {sort!r}", where="--sort",
                             fix=f"one of created, {', '.join(_WHERE_FIELDS)}")
    conds, args = ["1 = 1"], []
    for col, v in (("m.name", model), ("m.family", family), ("p.source", source), ("p.status", status)):
        if v is not None:
            conds.append(f"{col} = ?")
            args.append(v)
    if recipe is not None:
        conds.append("r.hash LIKE ? || '%'")
        args.append(recipe)
    if hardware is not None:
        conds.append("(h.name = ? OR h.cpu_model LIKE '%' || ? || '%')")
        args += [hardware, hardware]
    extra, more = _where(where)
    if extra:
        conds.append(extra)
        args += more
    desc = "DESC" if sort in ("created", "throughput") else "ASC"
    db = _open(kb_file(kb, cache_dir))
    rows: list[dict[str, Any]] = []
    if db is not None:
        with db:
            rows = db.rows(_PERF_SQL + f" WHERE {' AND '.join(conds)} ORDER BY p.{sort} IS NULL, p.{sort} {desc} "
                           "LIMIT ?", args + [limit + 1])
            if not rows and not as_json:
                _nothing_named(db, model, family)
    more, rows = len(rows) > limit, rows[:limit]
    if as_json:
        print(json.dumps([_perf_json(r) for r in rows], indent=1))
        return
    console.print(_perf_table(f"{len(rows)} measurement(s)" + (f" (the first {limit} by {sort}, {'highest' if desc == 'DESC' else 'lowest'} first; --limit shows more)"
                                                                if more else ""), rows))
    _reasons(rows)


@kb_app.command("recommend")
def recommend_cmd(model: str = typer.Option(..., "--model", help=MODEL_SPEC_HELP),
                  target: Optional[str] = typer.Option(None, "--target", help="target name or file (default host)"),
                  objective: str = typer.Option("latency", "--objective", help="latency | throughput"),
                  limit: int = typer.Option(5, "--limit", min=1, max=10 ** 9),
                  out: Optional[Path] = typer.Option(None, "--out", help="write a recipe for this model with the "
                                                     "top recommendation's precision, fusion and kernel selection"),
                  dim: List[str] = typer.Option([], "--dim", help="with --out: a dim's range, e.g. --dim seq=2:128"),
                  kb: Optional[Path] = KbPath, cache_dir: Optional[Path] = CacheDir,
                  as_json: bool = typer.Option(False, "--json")) -> None:
    """The best measured recipes for a model on a target: nearest architecture, same or most similar
    hardware, ranked by the objective."""
    from graphmode.cli.recipe_init_cmd import parse_ranges
    from graphmode.kb.draft import draft_recipe
    from graphmode.kb.recommend import check_objective
    from graphmode.paths import cache_layout
    from graphmode.recipe import recipe_hash
    check_objective(objective)
    path = kb_file(kb, cache_dir)
    with progress() as on_stage, stage(on_stage, "draft", detail=f"{model}: capture, passes, proof"):
        draft = draft_recipe(model, target=target or "host", kb_path=path, objective=objective,
                             ranges=parse_ranges(dim), target_cache_dir=cache_layout(cache_dir).targets, record=False)
    recs = draft.recommendations[:limit]
    if out is not None:
        out.write_text(draft.yaml(), encoding="utf-8")
    if as_json:
        print(json.dumps({"model": {k: draft.model[k] for k in ("name", "family", "fingerprint", "params")},
                          "hardware": draft.hardware["name"], "objective": objective,
                          "recommendations": [r.to_json(objective) for r in recs],
                          "written": str(out) if out else None}, indent=1, default=str))
        return
    _say(f"model {draft.model['name']} ({draft.model['family']}, {draft.model['params']:,} parameters, "
         f"fingerprint {draft.model['fingerprint']}) on {draft.hardware['name']}, {objective}-first")
    if not recs:
        console.print(f"no measured recipe in {path} yet: `graphmode recipe init` drafts one, `graphmode tune` "
                      "measures it", markup=False, highlight=False)
    t = _table(f"{len(recs)} recommendation(s) from {path}", "#", "recipe", "measured with", "distance",
               "hardware", "similarity", "p99 ms", "p50 ms", "items/s", "vs best beside it", "measurements")
    for i, r in enumerate(recs, 1):
        t.add_row(str(i), f"{r.recipe['hash']} {r.recipe['name']}", f"{r.model['name']} ({r.model['family']})",
                  f"{r.model_distance:g}", r.hardware["name"], f"{r.hardware_similarity:g}",
                  shown(r.best.get("p99_ms")), shown(r.best.get("p50_ms")), shown(r.best.get("throughput")),
                  f"{r.relative:.3g}x" if r.relative is not None else "- (alone)",
                  f"{r.measurements} ({', '.join(r.sources)})")
    if recs:
        console.print(t)
        _say(f"why #1: {recs[0].why(objective)}")
    if out is not None:
        from graphmode.kb.draft import MAX_KNOB_DISTANCE
        near = [r for r in draft.recommendations if r.model_distance <= MAX_KNOB_DISTANCE]
        knobs = (f"precision, fusion and kernel selection from {near[0].recipe['hash']} {near[0].recipe['name']}"
                 if near else f"graphmode's defaults: #1 is at distance {recs[0].model_distance:g}, farther than "
                 f"{MAX_KNOB_DISTANCE:g}, and its knobs say nothing about this model" if recs else
                 "graphmode's defaults (nothing measured yet)")
        console.print(f"wrote {out} (recipe {recipe_hash(draft.recipe)}, {draft.report.verdict} on "
                      f"{draft.report.target.name}) with {knobs}", markup=False, highlight=False, soft_wrap=True)
        if near:
            _say_other_ranges(draft.recipe, near[0])


def _say_other_ranges(written: Any, top: Any) -> None:
    """The written recipe's dims are the draft's, not the measured recipe's: where their ranges
    differ, #1's numbers were measured at other shapes than the written recipe admits."""
    from graphmode.recipe import load_recipe
    try:
        body = top.recipe["body"]
        measured = load_recipe(json.loads(body) if isinstance(body, str) else body)
    except Exception:  # noqa: BLE001 - a damaged body: nothing to compare (kb show says why)
        return
    differ = [f"{d} {written.dim_range(d)[0]}..{written.dim_range(d)[1]} (#1: {measured.dim_range(d)[0]}.."
              f"{measured.dim_range(d)[1]})" for d in written.dims if d in measured.dims
              and written.dim_range(d) != measured.dim_range(d)]
    if differ:
        console.print(f"its dims are this draft's, not #1's: {', '.join(differ)}; #1's p99 was measured at #1's "
                      f"shapes (--dim NAME=LO:HI writes other ranges)", markup=False, highlight=False, soft_wrap=True)


@kb_app.command("export")
def export_cmd(out: Optional[Path] = typer.Option(None, "--out", help="JSON-lines file (default stdout)"),
               kb: Optional[Path] = KbPath, cache_dir: Optional[Path] = CacheDir) -> None:
    """Every entity as JSON lines (referenced by fingerprint and hash, never by row id)."""
    if out is not None:
        from graphmode.paths import writable_output
        out = writable_output(out, "--out")
    db = _open(kb_file(kb, cache_dir))
    lines = []
    if db is not None:
        with db:
            lines = [json.dumps(x, sort_keys=True) for x in db.export_lines()]
    text = "".join(line + "\n" for line in lines)
    if out is None:
        sys.stdout.write(text)
    else:
        out.write_text(text, encoding="utf-8")
        err_console.print(f"wrote {len(lines)} line(s) to {out}", highlight=False)


@kb_app.command("import")
def import_cmd(files: List[Path] = typer.Argument(..., help="files written by `graphmode kb export`"),
               kb: Optional[Path] = KbPath, cache_dir: Optional[Path] = CacheDir,
               as_json: bool = typer.Option(False, "--json")) -> None:
    """Merge exports from other machines; entries already present are skipped (deduplicated)."""
    from graphmode.kb import KbError, KnowledgeBase
    from graphmode.untrusted import UntrustedFileError, parse_json, read_bytes
    path = kb_file(kb, cache_dir)
    totals: list[dict[str, Any]] = []
    texts = []              # every export read before the knowledge base is opened (or created)
    for f in files:
        try:
            texts.append((f, read_bytes(f, limit=MAX_IMPORT_BYTES).decode("utf-8")))
        except UntrustedFileError as e:
            raise KbError(f"cannot read the export: {e.message}", where=str(f),
                          fix="pass a file written by `graphmode kb export`; nothing was imported") from None
        except UnicodeDecodeError as e:
            raise KbError(f"the export is not UTF-8 text ({e.reason} at byte {e.start})", where=str(f),
                          fix="pass a file written by `graphmode kb export`; nothing was imported") from None
    parsed = []             # ... and parsed: a truncated export creates no knowledge base, imports no file of several
    for f, text in texts:
        items = []
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    items.append(parse_json(line))
                except ValueError as e:
                    raise KbError(f"line {n} is not JSON: {e}", where=f"{f}:{n}",
                                  fix="import a file written by `graphmode kb export`; nothing was imported") from None
        parsed.append((f, items))
    with KnowledgeBase(path) as db:
        for f, items in parsed:
            totals.append({"file": str(f), **db.import_lines(iter(items), str(f))})
        counts = db.counts()
    if as_json:
        print(json.dumps({"imported": totals, "now": counts}, indent=1))
        return
    for c in totals:
        console.print(f"{c['file']}: added {c['hardware']} hardware, {c['model']} model(s), {c['recipe']} recipe(s), "
                      f"{c['performance']} measurement(s); {c['skipped']} already present", highlight=False)
    console.print(f"{path} now holds " + ", ".join(f"{n} {t}" for t, n in counts.items()), highlight=False)
