"""Mutated recipes through load -> semantics -> proofs: a Recipe (maybe refused by its proofs)
or a RecipeError/ConstraintError, nothing else, within the case's time.

Bases are the shipped example recipes. Mutations: a value anywhere replaced by one of another
type or out of range, a key deleted or an unknown one added, lines deleted, duplicated,
re-indented or cut, random bytes; plus known-invalid recipes that must be refused.
"""
from __future__ import annotations

import copy
import random
from pathlib import Path
from typing import Any

import yaml

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "recipes"
ODD = [None, True, False, 0, -1, 1, 2 ** 31, 2 ** 63, -(2 ** 63) - 1, 10 ** 40, 1.5, -0.0, 1e308, float("inf"),
       float("nan"), "", "x", "f16", "batch", "seq", "*", "${target.memory_mb}", "${nope}", "1e3", ".inf", "0x10",
       "\x1b[31m", "a" * 10000, [], [1, 2], {}, {"a": 1}, [[[[[]]]]], {"min": 5, "max": 2}]
# (why, edit) recipes the contract says are invalid
INVALID: list[tuple[str, dict[str, Any]]] = [
    ("dims min above max", {"dims": {"batch": {"min": 8, "max": 2}}}),
    ("a bucket of 0", {"dims": {"batch": {"buckets": [0, 2]}}}),
    ("a negative bucket", {"dims": {"batch": {"buckets": [-4]}}}),
    ("an unknown dtype", {"inputs": [{"name": "x", "dtype": "f128", "shape": ["batch", 16]}]}),
    ("an input without a shape", {"inputs": [{"name": "x", "dtype": "f32"}]}),
    ("an unknown exe_mode", {"exe_mode": "turbo"}),
    ("an unknown top-level key", {"surprise": 1}),
    ("version 99", {"version": 99}),
    ("pad_value true on an f32 input", {"inputs": [{"name": "x", "dtype": "f32", "shape": ["batch", 16],
                                                    "pad_value": True}]}),
    ("pad_value true on an i64 input", {"inputs": [{"name": "x", "dtype": "i64", "shape": ["batch", 16],
                                                    "pad_value": True}]}),
]
BASE: dict[str, Any] = {"version": 1, "name": "fuzz", "inputs": [{"name": "x", "dtype": "f32", "shape": ["batch", 16]}],
                        "dims": {"batch": {"min": 1, "max": 8}}, "targets": ["host"]}


def setup(work: Path) -> dict[str, Any]:
    return {"bases": {p.name: p.read_text() for p in sorted(EXAMPLES.glob("*.yaml"))}}


def _paths(v: Any, at: tuple = ()) -> list[tuple]:
    out = [at]
    if isinstance(v, dict):
        for k, x in v.items():
            out += _paths(x, at + (k,))
    elif isinstance(v, list):
        for i, x in enumerate(v):
            out += _paths(x, at + (i,))
    return out


def _mutate_structure(data: Any, rng: random.Random) -> Any:
    for _ in range(rng.randint(1, 3)):
        paths = [p for p in _paths(data) if p]
        if not paths:
            break
        p = rng.choice(paths)
        holder = data
        for k in p[:-1]:
            holder = holder[k]
        op = rng.choice(["set", "set", "delete", "add"])
        if op == "set":
            holder[p[-1]] = copy.deepcopy(rng.choice(ODD))
        elif op == "delete":
            del holder[p[-1]]
        elif isinstance(holder, dict):
            holder[rng.choice(["zzz", "memory", "dims", "kv_cache", "range", "pad_value"])] = copy.deepcopy(rng.choice(ODD))
    return data


def _mutate_text(text: str, rng: random.Random) -> str:
    lines = text.splitlines(keepends=True)
    for _ in range(rng.randint(1, 3)):
        if not lines:
            break
        i = rng.randrange(len(lines))
        op = rng.choice(["delete", "dup", "indent", "tab", "bytes", "truncate"])
        if op == "delete":
            del lines[i]
        elif op == "dup":
            lines.insert(i, lines[i])
        elif op == "indent":
            lines[i] = " " * rng.randint(1, 5) + lines[i].lstrip(" ")
        elif op == "tab":
            lines[i] = "\t" + lines[i]
        elif op == "bytes":
            lines[i] = "".join(chr(rng.randrange(1, 0x2FF)) for _ in range(rng.randint(1, 20))) + "\n"
        else:
            lines = lines[:i]
    return "".join(lines)


def cases(rng: random.Random, n: int, ctx: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for why, edit in INVALID:
        out.append({"kind": "invalid", "data": {**BASE, **edit}, "why": why, "expect": "invalid"})
    names = sorted(ctx["bases"])
    while len(out) < n:
        base = rng.choice(names)
        text = ctx["bases"][base]
        if rng.random() < 0.5:
            data = _mutate_structure(yaml.safe_load(text), rng)
            try:
                text = yaml.safe_dump(data, allow_unicode=True)
            except (yaml.YAMLError, ValueError, RecursionError):
                continue
            out.append({"kind": "structure", "base": base, "text": text, "expect": "either"})
        else:
            out.append({"kind": "text", "base": base, "text": _mutate_text(text, rng), "expect": "either"})
    for i, c in enumerate(out[:n]):
        c["id"] = f"{i:04d}-{c['kind']}-" + (c.get("base") or c.get("why", "")).replace(" ", "_")[:40]
        c["timeout_s"] = 60
    return out[:n]


def execute(case: dict[str, Any], ctx: dict[str, Any]) -> tuple[str, str]:
    from graphmode.errors import ConstraintError, RecipeError
    from graphmode.recipe import load_recipe, validate
    from graphmode.targets import get_target
    recipe = load_recipe(case["data"] if "data" in case else case["text"])
    report = validate(recipe, get_target("cpu_avx2"), timeout_ms=500)
    try:
        report.raise_for_errors()
    except (RecipeError, ConstraintError) as e:
        return "refused", str(e)
    return "accepted", ""
