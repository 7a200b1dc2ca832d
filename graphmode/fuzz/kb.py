"""Damaged knowledge-base files and malformed `kb import` files, through the real CLI.

A small knowledge base (two machines, two models, three recipes, measurements) is written
once with the store's own API. Cell cases copy it, put a bad value in one cell with raw SQL
(SQLite takes any value in any column), and run a `kb` reading command: it must answer
(skipping what is damaged, with a warning) or refuse clearly, and no stored control
character may reach the terminal raw. Import cases mutate one line of its export (a field
of the wrong type, out of range, unknown; a line that is not an object; numbers JSON cannot
hold; deep nesting) or use a special file, and must be refused naming the line, leaving the
knowledge base as it was; mutations that keep every field valid must be imported.
"""
from __future__ import annotations

import json
import random
import shutil
import sqlite3
import tempfile
from pathlib import Path
from typing import Any

from graphmode.fuzz.worker import special_file

ESC = "\x1b[2J\x1b[31mX\x07\u202e"
# values that are wrong for a column of each kind (the fuzzer's own notion, not the store's)
BAD = {"real": ["fast", b"\x00\xff", float("inf"), "1e999", -1.0],
       "int": ["x", 1.5, -3, "9" * 30, b"\x01"],
       "text": [5, 1.5, b"\xff\xfe", None, "x" * 3_000_000, ESC],
       "json": ["{", "[1, 2]", "null", '{"a": NaN}', "[" * 5000, '"text"', "1e999", "5"]}
COLUMNS = {  # table -> column -> kind
    "hardware": {"fingerprint": "text", "name": "text", "cores": "int", "simd": "json", "bandwidth_gbps": "real",
                 "target": "json", "created": "real"},
    "models": {"name": "text", "family": "text", "params": "int", "op_histogram": "json", "layer_shapes": "json",
               "inputs": "json", "created": "real"},
    "recipes": {"hash": "text", "name": "text", "body": "json", "origin": "text", "generated_on": "int",
                "created": "real"},
    "performance": {"uid": "text", "source": "text", "status": "text", "reason": "text", "bucket": "json",
                    "p50_ms": "real", "p99_ms": "real", "throughput": "real", "threads": "int", "extra": "json",
                    "created": "real", "recipe": "int"}}
READERS = (["ls"], ["ls", "--json"], ["query"], ["query", "--json", "--sort", "p99_ms"],
           ["query", "--where", "p99_ms<5"], ["show", "@"], ["show", "@", "--json"], ["export"])
FIELD_BAD = {"real": ["fast", [1.0], {"a": 1}, True, -1.0, 2 ** 64 * -1], "int": ["3", 1.5, 2 ** 63, -7, True],
             "text": [5, ["a"], {"a": 1}, 1.5], "json": ["fast", 5, 1.5]}
LINE_BAD = ["[1, 2]", "1e999", '{"entity": "graphmode-kb", "schema": NaN}', "9" * 5000, "[" * 100000,
            '{"entity": "spaceship"}', '"text"', "{", '{"entity": "hardware"}', '{"entity": null}']


def setup(work: Path) -> dict[str, Any]:
    from graphmode.kb.store import KnowledgeBase
    path = work / "kb.sqlite"
    with KnowledgeBase(path) as kb:
        for h in range(2):
            hw = {"fingerprint": f"hw{h}", "name": f"host{h}", "kind": "cpu", "cpu_model": f"cpu {h}", "isa": "x86_64",
                  "arch": "zen3", "cores": 2 + h, "simd": ["avx2"], "bandwidth_gbps": 10.0, "peak_f32_gflops": 100.0,
                  "target": {"name": f"host{h}"}, "created": 1.7e9}
            for m in range(2):
                model = {"fingerprint": f"m{m}", "name": f"mlp{m}", "family": "mlp", "params": 10 + m,
                         "op_histogram": {"linear": 2}, "layer_shapes": [[[4, 4], 2]],
                         "inputs": {"x": ["f32", ["*", 4]]}, "created": 1.7e9}
                recipe = {"hash": f"r{h}{m}abcdef", "name": f"rec{h}{m}", "body": {"name": f"rec{h}{m}", "version": 1},
                          "ir_hash": None, "graphmode_version": "0", "torch_version": "0", "origin": "measured",
                          "parent": None, "created": 1.7e9}
                for i in range(2):
                    kb.add(hw, model, recipe, {
                        "uid": f"u{h}{m}{i}", "source": "bench", "status": "ok" if i else "violates", "reason": "slow",
                        "bucket": {"batch": i + 1}, "p50_ms": 1.0 + i, "p99_ms": 2.0 + i, "p99_over_p50": 2.0,
                        "throughput": 10.0, "peak_memory_mb": 1.0, "compile_s": 0.1, "numerics_err": 0.0, "threads": 1,
                        "graphmode_version": "0", "torch_version": "0", "extra": {}, "created": 1.7e9 + i})
        kb.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        lines = [json.dumps(x) for x in kb.export_lines()]
    (work / "export.jsonl").write_text("\n".join(lines) + "\n")
    return {"kb": str(path), "export": str(work / "export.jsonl"), "work": str(work)}


def cases(rng: random.Random, n: int, ctx: dict[str, Any]) -> list[dict[str, Any]]:
    lines = Path(ctx["export"]).read_text().splitlines()
    out: list[dict[str, Any]] = []
    specials = [{"kind": "import-special", "what": w, "expect": "invalid"}
                for w in ("fifo", "dev-zero", "folder", "missing", "binary", "empty-object")]
    out += specials + [{"kind": "kb-special", "what": w, "expect": "invalid"} for w in ("fifo", "dev-zero", "folder")]
    while len(out) < n:
        k = rng.choice(["cell", "cell", "field", "line", "valid"])
        if k == "cell":
            table = rng.choice(sorted(COLUMNS))
            col = rng.choice(sorted(COLUMNS[table]))
            kind = COLUMNS[table][col]
            out.append({"kind": "cell", "table": table, "column": col, "value": rng.randrange(len(BAD[kind])),
                        "row": rng.randrange(1, 4), "reader": rng.randrange(len(READERS)), "expect": "either"})
        elif k == "field":
            i = rng.randrange(1, len(lines))
            item = json.loads(lines[i])
            cols = COLUMNS[{"model": "models", "recipe": "recipes"}.get(item["entity"], item["entity"])]
            col = rng.choice(sorted(c for c in cols if c in item and c not in ("recipe", "generated_on")))
            out.append({"kind": "field", "line": i, "column": col,
                        "value": rng.randrange(len(FIELD_BAD[cols[col]])), "expect": "invalid"})
        elif k == "line":
            out.append({"kind": "line", "at": rng.randrange(len(lines) + 1), "text": rng.randrange(len(LINE_BAD)),
                        "expect": "invalid"})
        else:                                  # every field still valid: must be imported
            i = rng.randrange(1, len(lines))
            out.append({"kind": "valid", "line": i, "name": rng.choice(["x", ESC, "ü" * 50, "[bold]y[/]"]),
                        "expect": "valid"})
    for i, c in enumerate(out[:n]):
        c["id"] = f"{i:03d}-{c['kind']}-" + "-".join(str(c[k]) for k in ("table", "column", "what") if k in c)
    return out[:n]


def _cli(*args: str) -> tuple[str, str]:
    from typer.testing import CliRunner

    from graphmode.cli.app import _register, app
    from graphmode.fuzz.outcome import from_exception
    _register()
    res = CliRunner().invoke(app, list(args))
    if res.exception is not None and not isinstance(res.exception, SystemExit):
        return from_exception(res.exception)
    if "\x1b" in res.output or "\x07" in res.output:
        return "invalid-accepted", "a stored control character reached the terminal raw"
    if "Traceback" in res.output:
        return "traceback", res.output.strip().splitlines()[-1]
    return ("accepted", "") if res.exit_code == 0 else ("refused", (res.output.strip().splitlines() or [""])[-1])


def _counts(path: str) -> list:
    db = sqlite3.connect(path)
    try:
        return [db.execute(f"SELECT count(*) FROM {t}").fetchone()[0] for t in COLUMNS]
    finally:
        db.close()


def execute(case: dict[str, Any], ctx: dict[str, Any]) -> tuple[str, str]:
    with tempfile.TemporaryDirectory(dir=ctx["work"], prefix="case-") as tmp:
        kb = Path(tmp) / "kb.sqlite"
        k = case["kind"]
        if k == "kb-special":              # the knowledge base itself is not a file
            special_file(kb, case["what"])
            return _cli("kb", "ls", "--kb", str(kb))
        shutil.copyfile(ctx["kb"], kb)
        if k == "cell":
            kind = COLUMNS[case["table"]][case["column"]]
            db = sqlite3.connect(kb)
            try:
                db.execute(f"UPDATE {case['table']} SET {case['column']} = ? WHERE id = ?",
                           (BAD[kind][case["value"]], case["row"]))
                db.commit()
            except sqlite3.IntegrityError as e:      # the schema's own constraint keeps that value out
                return "refused", f"SQLite refuses to store it: {e}"
            finally:
                db.close()
            args = [a if a != "@" else "r00" for a in READERS[case["reader"]]]
            return _cli("kb", *args, "--kb", str(kb))
        lines = Path(ctx["export"]).read_text().splitlines()
        f = Path(tmp) / "import.jsonl"
        if k == "field":
            item = json.loads(lines[case["line"]])
            table = {"model": "models", "recipe": "recipes"}.get(item["entity"], item["entity"])
            item[case["column"]] = FIELD_BAD[COLUMNS[table][case["column"]]][case["value"]]
            lines[case["line"]] = json.dumps(item)
        elif k == "line":
            lines.insert(case["at"], LINE_BAD[case["text"]])
        elif k == "valid":
            item = json.loads(lines[case["line"]])
            item["name" if "name" in item else "reason"] = case["name"]
            if "uid" in item:
                item["uid"] += "-new"
            lines[case["line"]] = json.dumps(item)
        if k == "import-special":
            special_file(f, case["what"])
        else:
            f.write_text("\n".join(lines) + "\n")
        fresh = Path(tmp) / "fresh.sqlite"
        shutil.copyfile(ctx["kb"], fresh)
        before = _counts(str(fresh))
        outcome, detail = _cli("kb", "import", str(f), "--kb", str(fresh))
        if outcome == "refused" and _counts(str(fresh)) != before:
            return "traceback", "a refused import changed the knowledge base"
        if outcome == "accepted":        # what was imported must read back
            for args in (["ls"], ["query"], ["export"]):
                after = _cli("kb", *args, "--kb", str(fresh))
                if after[0] != "accepted":
                    return after[0], f"after the import, kb {args[0]}: {after[1]}"
        return outcome, detail
