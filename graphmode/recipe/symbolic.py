"""Target-relative values: `${target.memory_mb * 0.5}` and named bank groups.

A recipe value written as `${ expr }` is resolved against the chosen target at load time,
so one recipe serves several chips. `expr` is a tiny arithmetic language, parsed with
`ast` and walked over a whitelist (never `eval`):

    numbers, + - * / // % and ** (constant integer exponent in [-64, 64]), unary -, (...),
    min(a, b, ...), max(a, b, ...), floor(x), ceil(x), round(x), abs(x),
    target.<field>                numeric Target fields (memory_bytes, compute_units, ...)
    target.memory_mb / memory_gb  derived sizes (MB = 2**20 bytes)
    target.peak_flops.<dtype>     FLOP/s;  target.peak_tflops.<dtype> in TFLOP/s
    target.groups.<group>.<name>.<field>   a number in one of the target's named groups,
                                  `<name>` may be an entry's alias (e.g.
                                  target.groups.memory_banks.high_bandwidth.bandwidth_gbps)

Bounded so that any text evaluates at once: at most 200 characters, 100 syntax nodes and
32 levels of nesting; every constant and intermediate result within +-1e100.

`memory.bank_affinity: [high_bandwidth]` names entries (or aliases) of the target's
`groups.memory_banks`; they resolve to the union of the entries' `ids`.
"""
from __future__ import annotations

import ast
import math
import re
from typing import Any, Callable

from graphmode.errors import TargetError
from graphmode.recipe.lines import join
from graphmode.targets.registry import resolve_group

SYM_RE = re.compile(r"\$\{(.*)\}", re.S)       # used with fullmatch: `$` would accept a trailing newline
MAX_EXPR_CHARS = 200
MAX_EXPR_NODES = 100
MAX_EXPR_DEPTH = 32
# Every constant and intermediate result stays within this magnitude, so the next + - * / of
# two of them is still a finite float (and an int of a few hundred bits); `**` is refused
# *before* it is computed when its result would exceed it (9**64**64 would never finish).
MAX_MAGNITUDE = 1e100

NUMERIC_FIELDS = ("compute_units", "vector_width_bits", "registers_per_core", "l1_bytes", "l2_bytes",
                  "llc_bytes", "memory_bytes", "memory_bandwidth_gbps", "launch_overhead_us")
DERIVED_FIELDS = ("memory_mb", "memory_gb")
MAP_FIELDS = ("peak_flops", "peak_tflops")
FUNCS = {"min": min, "max": max, "floor": math.floor, "ceil": math.ceil, "round": round, "abs": abs}
_BINOPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
           ast.Div: lambda a, b: a / b, ast.FloorDiv: lambda a, b: a // b, ast.Mod: lambda a, b: a % b,
           ast.Pow: lambda a, b: a ** b}
VALID_REFS = ("target." + "|".join(NUMERIC_FIELDS + DERIVED_FIELDS)
              + ", target.peak_flops.<dtype>, target.peak_tflops.<dtype>, target.groups.<group>.<name>.<field>")


class SymbolicError(ValueError):
    """A `${...}` expression is malformed or cannot be resolved on this target."""


def is_symbolic(value: Any) -> bool:
    return isinstance(value, str) and SYM_RE.fullmatch(value.strip()) is not None


def walk(value: Any, path: str, fn: Callable[[Any, str], Any]) -> Any:
    """`value` (nested dicts and lists) with every leaf replaced by fn(leaf, its field path)."""
    if isinstance(value, dict):
        return {k: walk(v, join(path, k), fn) for k, v in value.items()}
    if isinstance(value, list):
        return [walk(v, join(path, i), fn) for i, v in enumerate(value)]
    return fn(value, path)


def symbolic_paths(recipe: Any) -> list[str]:
    """Field paths of every `${...}` value of a recipe, plus bank names under memory.bank_affinity:
    what resolving on a target will replace."""
    out: list[str] = []

    def visit(v: Any, path: str) -> Any:
        if is_symbolic(v):
            out.append(path)
        return v
    walk(recipe.model_dump(mode="python", exclude={"targets"}), "", visit)
    out += [f"memory.bank_affinity[{i}]" for i, b in enumerate(recipe.memory.bank_affinity) if isinstance(b, str)]
    return out


def has_symbolic(recipe: Any) -> bool:
    """True when some value of the recipe still needs a target."""
    return bool(symbolic_paths(recipe))


def parse(text: str) -> ast.Expression:
    """Parse and statically check a `${...}` expression; raises SymbolicError."""
    m = SYM_RE.fullmatch(text.strip())
    if not m:
        raise SymbolicError("not a ${...} expression")
    body = m.group(1).strip()
    if not body:
        raise SymbolicError("empty ${} expression")
    if len(body) > MAX_EXPR_CHARS:
        raise SymbolicError(f"expression longer than {MAX_EXPR_CHARS} characters")
    try:
        tree = ast.parse(body, mode="eval")
    except SyntaxError as e:
        raise SymbolicError(f"syntax error in ${{{body}}}: {e.msg}") from None
    except (ValueError, RecursionError, MemoryError):      # NUL bytes; nesting the parser refuses
        raise SymbolicError(f"cannot parse ${{{body}}}") from None
    if sum(1 for _ in ast.walk(tree)) > MAX_EXPR_NODES:
        raise SymbolicError(f"expression has more than {MAX_EXPR_NODES} syntax nodes; simplify it")
    _check(tree.body, 0)
    return tree


def _attr_path(node: ast.AST) -> list[str] | None:
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return parts[::-1]
    return None


def _check_ref(parts: list[str]) -> None:
    if parts[0] != "target":
        raise SymbolicError(f"unknown name {parts[0]!r}; only target.<field> may be referenced")
    rest = parts[1:]
    ok = ((len(rest) == 1 and rest[0] in NUMERIC_FIELDS + DERIVED_FIELDS)
          or (len(rest) == 2 and rest[0] in MAP_FIELDS)
          or (len(rest) >= 3 and rest[0] == "groups"))
    if not ok:
        raise SymbolicError(f"unknown reference {'.'.join(parts)!r}; valid: {VALID_REFS}")


def _check(node: ast.AST, depth: int) -> None:
    if depth > MAX_EXPR_DEPTH:
        raise SymbolicError(f"expression nested more than {MAX_EXPR_DEPTH} levels deep")
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
            raise SymbolicError(f"only numbers are allowed as constants, not {node.value!r}")
        if not abs(node.value) <= MAX_MAGNITUDE:      # also inf (1e999) and nan
            raise SymbolicError(f"constant {node.value!r} is outside +-{MAX_MAGNITUDE:g}")
    elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
        r = node.right
        if isinstance(r, ast.UnaryOp) and isinstance(r.op, (ast.USub, ast.UAdd)):   # `-2` parses as -(2)
            r = r.operand
        if not (isinstance(r, ast.Constant) and type(r.value) is int and abs(r.value) <= 64):
            raise SymbolicError("the exponent of ** must be an integer constant in [-64, 64]")
        _check(node.left, depth + 1)
    elif isinstance(node, ast.BinOp):
        if type(node.op) not in _BINOPS:
            raise SymbolicError(f"operator {type(node.op).__name__} not allowed; use + - * / // % **")
        _check(node.left, depth + 1)
        _check(node.right, depth + 1)
    elif isinstance(node, ast.UnaryOp):
        if not isinstance(node.op, (ast.USub, ast.UAdd)):
            raise SymbolicError(f"operator {type(node.op).__name__} not allowed")
        _check(node.operand, depth + 1)
    elif isinstance(node, ast.Call):
        if not isinstance(node.func, ast.Name) or node.func.id not in FUNCS or node.keywords:
            raise SymbolicError(f"only these functions may be called: {', '.join(FUNCS)}")
        if not node.args:
            raise SymbolicError(f"{node.func.id}() needs an argument")
        for a in node.args:
            _check(a, depth + 1)
    elif isinstance(node, (ast.Attribute, ast.Name)):
        parts = _attr_path(node)
        if parts is None:
            raise SymbolicError("only target.<field> references are allowed")
        _check_ref(parts)
    else:
        raise SymbolicError(f"{type(node).__name__} is not allowed in ${{...}} expressions")


def _lookup(parts: list[str], target: Any) -> float:
    rest = parts[1:]
    name = getattr(target, "name", "?")
    if rest[0] in NUMERIC_FIELDS:
        return getattr(target, rest[0])
    if rest[0] == "memory_mb":
        return target.memory_bytes / 2**20
    if rest[0] == "memory_gb":
        return target.memory_bytes / 2**30
    if rest[0] in MAP_FIELDS:
        v = target.peak_flops.get(rest[1])
        if v is None:
            raise SymbolicError(f"target {name!r} has no peak_flops for {rest[1]!r}; "
                                f"it has: {', '.join(sorted(target.peak_flops)) or 'none'}")
        return v / 1e12 if rest[0] == "peak_tflops" else v
    try:
        v: Any = resolve_group(target, rest[1], rest[2])
    except TargetError as e:
        raise SymbolicError(f"{e.message}; {e.fix}" if e.fix else e.message) from None
    if set(v) == {"name", "value"}:
        v = v["value"]
    for i, key in enumerate(rest[3:]):
        if not isinstance(v, dict) or key not in v:
            have = ", ".join(sorted(k for k in v if k != "name")) if isinstance(v, dict) else "nothing"
            raise SymbolicError(f"target {name!r}: {'.'.join(['groups'] + rest[1:3 + i])} has no {key!r} "
                                f"(it has: {have})")
        v = v[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise SymbolicError(f"target.{'.'.join(rest)} is {v!r} on {name!r}, not a number")
    return v


def _bounded(v: float, what: str) -> float:
    if not abs(v) <= MAX_MAGNITUDE:                  # nan compares False too
        raise SymbolicError(f"{what} is {v:.3g}, outside +-{MAX_MAGNITUDE:g}" if math.isfinite(v) else
                            f"{what} is {v}")
    return v


def _pow(a: float, b: int) -> float:
    """a ** b, refused before computing when |result| would exceed MAX_MAGNITUDE."""
    if a == 0 and b < 0:
        raise SymbolicError("division by zero (0 raised to a negative power)")
    if a != 0 and b * math.log10(abs(a)) > math.log10(MAX_MAGNITUDE):
        raise SymbolicError(f"{float(a):.3g} ** {b} would be above {MAX_MAGNITUDE:g}")
    return a ** b


def _eval(node: ast.AST, target: Any) -> float:
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.BinOp):
        a, b = _eval(node.left, target), _eval(node.right, target)
        try:
            v = _pow(a, b) if isinstance(node.op, ast.Pow) else _BINOPS[type(node.op)](a, b)
        except ZeroDivisionError:
            raise SymbolicError("division by zero") from None
        return _bounded(v, "an intermediate result")
    if isinstance(node, ast.UnaryOp):
        v = _eval(node.operand, target)
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.Call):
        return _bounded(FUNCS[node.func.id](*[_eval(a, target) for a in node.args]), f"{node.func.id}(...)")
    return _bounded(_lookup(_attr_path(node), target), ".".join(_attr_path(node)))


def evaluate(text: str, target: Any) -> float:
    """Value of a `${...}` expression on `target`; raises SymbolicError."""
    tree = parse(text)
    try:
        return _eval(tree.body, target)
    except (OverflowError, ValueError, TypeError) as e:
        if isinstance(e, SymbolicError):
            raise
        raise SymbolicError(f"cannot evaluate: {e}") from None


def resolve_banks(names: list[str | int], target: Any) -> tuple[list[int] | None, list[tuple[int, str]]]:
    """Resolve bank names through `target.groups.memory_banks` (names or aliases -> `ids`).

    Returns (bank ids, or None when the target declares no memory banks; [(index, problem)]).
    """
    if not names:
        return [], []
    if not target.groups.get("memory_banks"):
        return None, []
    out: list[int] = []
    problems: list[tuple[int, str]] = []
    for i, n in enumerate(names):
        if isinstance(n, int):
            ids = [n]
        else:
            try:
                ids = resolve_group(target, "memory_banks", n).get("ids", [])
            except TargetError as e:
                problems.append((i, f"{e.message}; {e.fix}" if e.fix else e.message))
                continue
        out.extend(x for x in ids if x not in out)
    return out, problems
