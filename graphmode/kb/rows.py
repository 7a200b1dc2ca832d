"""What each knowledge-base column may hold, checked on the way in (`kb import`) and out (every read).

SQLite stores whatever a writer hands it in any column (a REAL column takes the text "fast"), and
a knowledge base is shared: files are copied between machines and merged from exports. So a
value is typed here, not by the schema: `entity_problem` refuses an imported line naming the
field, and `row_problem` finds a damaged cell in a row read back (the row is then skipped with
a warning, store.py). JSON columns are parsed strictly (graphmode/untrusted.py: finite numbers,
bounded nesting) and must have the structure the code reading them walks.
"""
from __future__ import annotations

import math
from typing import Any, Callable

from graphmode.untrusted import parse_json

MAX_TEXT = 1 << 20              # characters in one text cell (a recipe body is a few KiB)
MAX_CREATED = 1e11              # seconds since 1970 (year 5138): datetime cannot show more
INT64 = 1 << 63
Check = Callable[[Any], "str | None"]


def _text(v: Any) -> str | None:
    if not isinstance(v, str):
        return f"must be text, not {type(v).__name__}"
    return f"holds {len(v)} characters, more than {MAX_TEXT}" if len(v) > MAX_TEXT else None


def _number(lo: float, hi: float = math.inf) -> Check:
    def check(v: Any) -> str | None:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            return f"must be a number, not {type(v).__name__}"
        if isinstance(v, float) and not math.isfinite(v):
            return "must be a finite number"
        if not lo <= v <= hi:
            return f"must lie in [{lo:g}, {hi:g}]"
        return None
    return check


def _integer(lo: int, hi: int = INT64 - 1) -> Check:
    def check(v: Any) -> str | None:
        if isinstance(v, bool) or not isinstance(v, int):
            return f"must be an integer, not {type(v).__name__}"
        return None if lo <= v <= hi else f"must lie in [{lo}, {hi}]"
    return check


def _all(items: Any, check: Check) -> str | None:
    for i, x in enumerate(items):
        why = check(x)
        if why is not None:
            return f"item {i}: {why}"
    return None


def _list_of(check: Check) -> Check:
    return lambda v: f"must be a list, not {type(v).__name__}" if not isinstance(v, list) else _all(v, check)


def _dict_of(check: Check) -> Check:
    def go(v: Any) -> str | None:
        if not isinstance(v, dict):
            return f"must be an object, not {type(v).__name__}"
        bad = next((k for k in v if not isinstance(k, str)), None)
        return f"key {bad!r} is not text" if bad is not None else _all(v.values(), check)
    return go


def _any(v: Any) -> str | None:
    return None


def _layer(v: Any) -> str | None:
    if not (isinstance(v, list) and len(v) == 2):
        return "must be [shape, count]"
    return _list_of(_integer(0))(v[0]) or _integer(0)(v[1])


def _input(v: Any) -> str | None:
    return None if isinstance(v, list) and v and isinstance(v[0], str) else "must be [dtype, shape]"


_OBJECT = _dict_of(_any)
_METRIC = _number(0.0)
_CREATED = _number(0.0, MAX_CREATED)
_COUNT = _integer(0)
_THREADS = _integer(1, 1 << 20)

# column -> (check, may be null, stored as JSON text)
COLUMNS: dict[str, tuple[Check, bool, bool]] = {
    "id": (_integer(1), False, False),
    "fingerprint": (_text, False, False), "name": (_text, False, False), "kind": (_text, False, False),
    "cpu_model": (_text, True, False), "isa": (_text, True, False), "arch": (_text, True, False),
    "cores": (_integer(0, 1 << 20), True, False), "simd": (_list_of(_text), False, True),
    "bandwidth_gbps": (_METRIC, True, False), "peak_f32_gflops": (_METRIC, True, False),
    "target": (_OBJECT, False, True), "created": (_CREATED, False, False),
    "family": (_text, False, False), "params": (_COUNT, False, False),
    "op_histogram": (_dict_of(_COUNT), False, True), "layer_shapes": (_list_of(_layer), False, True),
    "inputs": (_dict_of(_input), False, True),
    "hash": (_text, False, False), "body": (_OBJECT, False, True), "ir_hash": (_text, True, False),
    "graphmode_version": (_text, True, False), "torch_version": (_text, True, False),
    "generated_on": (_integer(1), True, False), "optimized_for": (_integer(1), True, False),
    "origin": (_text, False, False), "parent": (_text, True, False),
    "uid": (_text, False, False), "recipe": (_integer(1), False, False), "hardware": (_integer(1), False, False),
    "model": (_integer(1), False, False), "source": (_text, False, False), "status": (_text, False, False),
    "reason": (_text, True, False), "bucket": (_dict_of(_integer(0)), True, True),
    **{m: (_METRIC, True, False) for m in ("p50_ms", "p99_ms", "p99_over_p50", "throughput", "peak_memory_mb",
                                           "compile_s", "numerics_err")},
    "threads": (_THREADS, True, False), "extra": (_OBJECT, False, True),
    # what the CLI's queries name their joined and aggregated columns (a LEFT JOIN may give null)
    **{a: (_text, True, False) for a in ("recipe_hash", "recipe_name", "model_name", "hw_name", "hw_fingerprint")},
    **{a: (_COUNT, False, False) for a in ("n", "measured", "ok", "machines")},
    "best_p99": (_METRIC, True, False), "best_tput": (_METRIC, True, False),
}
NULLABLE_IN_JOINS = ("family", "cpu_model")
JSON_COLUMNS = tuple(c for c, (_, _, js) in COLUMNS.items() if js)
REAL_COLUMNS = ("bandwidth_gbps", "peak_f32_gflops", "created", "p50_ms", "p99_ms", "p99_over_p50", "throughput",
                "peak_memory_mb", "compile_s", "numerics_err")   # stored as floats (an int past 2**63 fits none)

# what an exported line of each entity holds: its table's columns, references by fingerprint/hash
_REFS = {"recipe": ("generated_on", "optimized_for"), "performance": ("recipe", "hardware", "model")}


def cell_problem(column: str, value: Any, *, decoded: bool) -> str | None:
    """Why `value` cannot be `column`'s (None: it can). `decoded`: JSON columns hold the parsed
    value (an import line), else the stored text (a row read back)."""
    spec = COLUMNS.get(column)
    if spec is None:
        return None
    check, nullable, is_json = spec
    if value is None:
        return None if nullable or column in NULLABLE_IN_JOINS else "must not be empty"
    if is_json and not decoded:
        if not isinstance(value, str):
            return f"must be JSON text, not {type(value).__name__}"
        try:
            value = parse_json(value)
        except ValueError as e:
            return f"is not valid JSON ({e})"
    return check(value)


def decode(row: dict[str, Any]) -> dict[str, Any]:
    """A row read back with its JSON columns parsed (call after `row_problem` found nothing)."""
    return {k: parse_json(v) if k in JSON_COLUMNS and isinstance(v, str) else v for k, v in row.items()}


def row_problem(row: dict[str, Any]) -> str | None:
    """The first damaged cell of a row read back, as `column: why (value)`, or None."""
    for k, v in row.items():
        why = cell_problem(k, v, decoded=False)
        if why is not None:
            return f"{k} {why} (holds {_shown(v)})"
    return None


def entity_problem(kind: str, item: dict[str, Any], cols: tuple[str, ...], key: str | None) -> str | None:
    """Why an imported line of entity `kind` (its table columns `cols`) is not one `kb export`
    writes: an unknown field, a missing key, or a wrongly typed value; None when it is."""
    refs = _REFS.get(kind, ())
    allowed = set(cols) | set(refs) | {"entity"}
    unknown = sorted(k for k in item if k not in allowed)
    if unknown:
        return f"field {unknown[0]!r} is not one of a {kind} line's ({', '.join(sorted(allowed - {'entity'}))})"
    if key is not None and not item.get(key):
        return f"field {key!r} is missing"
    for c in cols:
        why = cell_problem(c, item.get(c), decoded=True)
        if why is not None:
            return f"field {c!r} {why} (holds {_shown(item.get(c))})"
    for r in refs:
        v = item.get(r)
        if v is not None and _text(v) is not None or (v is None and kind == "performance"):
            return f"field {r!r} must be the {'hash' if r == 'recipe' else 'fingerprint'} it refers to, as text"
    return None


def _shown(v: Any) -> str:
    from graphmode.errors import short_value
    s = short_value(v, 60)
    return s if isinstance(s, str) and s is not v else repr(s)


__all__ = ["COLUMNS", "JSON_COLUMNS", "REAL_COLUMNS", "cell_problem", "decode", "entity_problem", "row_problem"]
