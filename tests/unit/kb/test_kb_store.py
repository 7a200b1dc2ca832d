"""The knowledge-base file on a real SQLite database: entities and relations, deduplication,
export/import between machines, a schema migration, two processes writing at once, and
damaged files (a clear KbError naming the file and the fix; the file left as it was)."""
from __future__ import annotations

import json
import multiprocessing as mp
import sqlite3

import pytest
from kb_helpers import recipe_data, subject
from kb_writer import write_many

from graphmode.kb import KbError, KnowledgeBase
from graphmode.kb.record import perf, record
from graphmode.kb.store import SCHEMA_VERSION
from graphmode.recipe import load_recipe, recipe_hash


def _measure(path, subj, n=1, **metrics):
    rows = [perf("bench", bucket={"batch": 2}, p50_ms=1.0 + i, p99_ms=2.0 + i, throughput=100.0 - i, **metrics)
            for i in range(n)]
    assert record(path, subj, rows) is None


def test_records_entities_and_relations(tmp_path):
    path = tmp_path / "kb.sqlite"
    subj = subject()
    _measure(path, subj, n=3, numerics_err=1e-7)
    _measure(path, subject(recipe_data("mlp-b")), n=1)            # same model and machine, another recipe
    with KnowledgeBase(path) as kb:
        assert kb.counts() == {"hardware": 1, "models": 1, "recipes": 2, "performance": 4}
        (r,) = kb.rows("SELECT * FROM recipes WHERE name = 'mlp-a'")
        hw = kb.rows("SELECT * FROM hardware")[0]
        model = kb.rows("SELECT * FROM models")[0]
        assert r["generated_on"] == hw["id"] and r["optimized_for"] == model["id"]       # generated-on, optimized-for
        assert r["hash"] == recipe_hash(subj.recipe) and r["ir_hash"] == "ir16" and r["torch_version"]
        assert recipe_hash(load_recipe(r["body"])) == r["hash"]                           # the body is the recipe
        perf_rows = kb.rows("SELECT * FROM performance WHERE recipe = ?", (r["id"],))     # achieves
        assert len(perf_rows) == 3 and {p["source"] for p in perf_rows} == {"bench"}
        assert perf_rows[0]["bucket"] == {"batch": 2} and perf_rows[0]["numerics_err"] == 1e-7
        assert hw["name"] == "cpu_avx2" and hw["kind"] == "cpu" and hw["target"]["name"] == "cpu_avx2"
        assert model["params"] == 16 * 16 + 16 + 16 * 4 + 4 and model["layer_shapes"] == [[[16, 16], 1], [[4, 16], 1]]
        assert kb.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert kb.db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION


def test_the_same_row_is_kept_once(tmp_path):
    path = tmp_path / "kb.sqlite"
    hw, model, recipe = subject().entities()
    row = dict(perf("verify", numerics_err=0.0), uid="same")
    with KnowledgeBase(path) as kb:
        assert kb.add(hw, model, recipe, row) is True
        assert kb.add(hw, model, recipe, row) is False
        assert kb.counts()["performance"] == 1


def test_a_measurement_that_is_not_finite_is_recorded_without_it_not_as_a_damaged_row(tmp_path):
    """A verify whose outputs went NaN recorded numerics_err inf, and the row read back as damaged."""
    path = tmp_path / "kb.sqlite"
    assert record(path, subject(), [perf("verify", status="violates", numerics_err=float("inf"), p50_ms=1.0)]) is None
    with KnowledgeBase(path) as kb:
        (row,) = kb.rows("SELECT * FROM performance")          # read back, not skipped as damaged
    assert row["numerics_err"] is None and row["p50_ms"] == 1.0 and row["extra"]["not_finite"] == ["numerics_err"]


def test_export_import_merges_machines_and_deduplicates(tmp_path):
    a, b, team = tmp_path / "a.sqlite", tmp_path / "b.sqlite", tmp_path / "team.sqlite"
    _measure(a, subject(target="cpu_avx2"), n=3)
    _measure(b, subject(target="h100_sxm"), n=2)            # the same recipe and model on another machine
    _measure(b, subject(recipe_data("mlp-b"), target="h100_sxm", width=32), n=1)
    files = []
    for src in (a, b):
        with KnowledgeBase(src) as kb:
            lines = list(kb.export_lines())
        assert lines[0]["entity"] == "graphmode-kb" and all("id" not in x for x in lines)
        f = tmp_path / f"{src.stem}.jsonl"
        f.write_text("".join(json.dumps(x) + "\n" for x in lines))
        files.append(f)
    with KnowledgeBase(team) as kb:
        first = kb.import_lines((json.loads(x) for x in files[0].read_text().splitlines()), "a")
        second = kb.import_lines((json.loads(x) for x in files[1].read_text().splitlines()), "b")
        again = kb.import_lines((json.loads(x) for x in files[0].read_text().splitlines()), "a")
        assert first == {"hardware": 1, "model": 1, "recipe": 1, "performance": 3, "skipped": 0}
        # b's first model and recipe are a's: skipped
        assert second == {"hardware": 1, "model": 1, "recipe": 1, "performance": 3, "skipped": 2}
        assert again["skipped"] == 6 and again["performance"] == 0
        assert kb.counts() == {"hardware": 2, "models": 2, "recipes": 2, "performance": 6}
        history = kb.rows("SELECT h.name FROM performance p JOIN recipes r ON r.id = p.recipe "
                          "JOIN hardware h ON h.id = p.hardware WHERE r.name = 'mlp-a'")
        assert sorted(x["name"] for x in history) == ["cpu_avx2"] * 3 + ["h100_sxm"] * 2
        before = kb.counts()
        bad = [json.loads(x) for x in files[1].read_text().splitlines()]
        bad.insert(3, {"entity": "performance", "recipe": "nope"})
        with pytest.raises(KbError, match=r"b-bad:4") as e:
            kb.import_lines(iter(bad), "b-bad")
        assert "graphmode kb export" in e.value.fix
        assert kb.counts() == before                                  # one transaction: nothing half-imported


def test_migrates_an_old_file_and_refuses_a_newer_one(tmp_path):
    path = tmp_path / "kb.sqlite"
    sqlite3.connect(path).execute("CREATE TABLE notes (x)").connection.close()     # schema version 0
    with KnowledgeBase(path) as kb:
        assert kb.db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        assert kb.counts()["recipes"] == 0
        assert kb.rows("SELECT count(*) AS n FROM notes")[0]["n"] == 0          # what was there stays
    con = sqlite3.connect(path)
    con.execute(f"PRAGMA user_version={SCHEMA_VERSION + 1}")
    con.close()
    with pytest.raises(KbError, match=f"schema version {SCHEMA_VERSION + 1}") as e:
        KnowledgeBase(path)
    assert e.value.where == str(path) and "upgrade graphmode" in e.value.fix


@pytest.mark.parametrize("round_", range(3))       # the race on creating the file lost ~2 rounds in 5
def test_two_processes_writing_at_once(tmp_path, round_):
    path = tmp_path / "shared.sqlite"                   # created by whichever process gets there first
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(2)                            # both start writing (and creating the file) together
    n = 30
    procs = [ctx.Process(target=write_many, args=(str(path), name, n, barrier)) for name in ("one", "two")]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
    assert [p.exitcode for p in procs] == [0, 0]
    with KnowledgeBase(path) as kb:
        assert kb.counts() == {"hardware": 1, "models": 1, "recipes": 2, "performance": 2 * n}
        assert kb.db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"


def test_a_file_held_locked_is_waited_for_then_a_clear_error(tmp_path, monkeypatch):
    """Switching to WAL gets SQLITE_BUSY without SQLite's busy handler; we retry up to the timeout."""
    path = tmp_path / "kb.sqlite"
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("CREATE TABLE x (y)")
    holder.execute("BEGIN EXCLUSIVE")
    monkeypatch.setattr("graphmode.kb.store.BUSY_TIMEOUT_S", 0.3)
    with pytest.raises(KbError, match="stayed locked by another process") as e:
        KnowledgeBase(path)
    assert e.value.where == str(path) and "let the other graphmode process finish" in e.value.fix
    holder.execute("COMMIT")
    holder.close()
    with KnowledgeBase(path) as kb:                    # once it is free, the same file opens and is WAL
        assert kb.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def _damaged(path, how: str) -> bytes:
    if how == "garbage":
        path.write_bytes(b"this is not a database, it is a text file\n" * 200)
    else:                                                # a real knowledge base, cut in half
        for i in range(40):
            _measure(path, subject(recipe_data(f"r{i}", description="x" * 2000)), n=2)
        with sqlite3.connect(path) as con:
            con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    return path.read_bytes()


@pytest.mark.parametrize("how", ["garbage", "truncated"])
def test_a_damaged_file_is_a_clear_error_and_is_left_alone(tmp_path, how):
    path = tmp_path / "kb.sqlite"
    before = _damaged(path, how)
    with pytest.raises(KbError) as e:
        with KnowledgeBase(path) as kb:
            kb.rows("SELECT * FROM performance")
    err = e.value
    assert err.where == str(path) and err.exit_code == 2
    assert "damaged" in err.message and f"mv {path} {path}.corrupt" in err.fix
    warning = record(path, subject(), [perf("bench", p50_ms=1.0)])      # a measuring command keeps its result
    assert warning.startswith("knowledge base: not recorded:") and str(path) in warning
    assert path.read_bytes() == before                                  # nothing rewritten, nothing lost
    other = tmp_path / "other.sqlite"                                   # another file is unaffected
    _measure(other, subject())
    with KnowledgeBase(other) as kb:
        assert kb.counts()["performance"] == 1


def test_a_folder_or_unwritable_place_is_a_clear_error(tmp_path):
    (tmp_path / "dir.sqlite").mkdir()
    with pytest.raises(KbError, match="is a folder"):
        KnowledgeBase(tmp_path / "dir.sqlite")
    (tmp_path / "file").write_text("x")
    with pytest.raises(KbError, match="cannot create the folder"):
        KnowledgeBase(tmp_path / "file" / "kb.sqlite")


def test_a_file_this_process_cannot_write_is_read_and_never_written(tmp_path, monkeypatch):
    """A team's file on a read-only mount: every read (kb ls, recommend, recipe init) failed with
    "cannot write the knowledge base while reading its header". (The mount is not made here:
    `os.access` answers as it does on one; SQLite opens the real file read-only.)"""
    import os
    path = tmp_path / "team.sqlite"
    _measure(path, subject(), n=2)
    before = path.read_bytes()
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if mode == os.W_OK else real(p, mode, **kw))
    with KnowledgeBase(path) as kb:
        assert kb.readonly and kb.counts()["performance"] == 2
    said = record(path, subject(), [perf("bench", bucket={"batch": 2}, p50_ms=1.0, p99_ms=2.0, throughput=1.0)])
    assert "not recorded" in said and "cannot write the knowledge base" in said     # a warning; the command goes on
    assert path.read_bytes() == before
