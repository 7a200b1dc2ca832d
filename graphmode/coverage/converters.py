"""Which IR ops each registered importer converter emits, read from the converters' code.

The converter registries map an ATen overload or an ONNX op type to a function, but do not
declare what it produces, and a table written next to them would drift. So the coverage
table reads each function's source once and follows it with the registry key bound: every
`emit(..., op, ...)` / `add_node(op, ...)` call it can reach counts, with the op argument
evaluated where it depends on the key (`str(node.target).split(".")[1]`, `n.op_type ==
"MaxPool"`, `_BINARY[op]`), branches that cannot run for the key skipped, and helpers
called with their arguments bound. An op argument it cannot evaluate is reported as
unresolved (a test keeps that list empty), never guessed.
"""
from __future__ import annotations

import ast
import builtins
import functools
import inspect
import textwrap
from dataclasses import dataclass, field
from typing import Any, Callable

from graphmode.ir.graph import Graph
from graphmode.ir.ops import OPS

_UNKNOWN = None          # an abstract value: a list of the concrete values an expression may have, or this
_MAX_VALUES = 64
_MAX_DEPTH = 6
_STR_METHODS = {"split", "rsplit", "strip", "lstrip", "rstrip", "lower", "upper", "startswith", "endswith",
                "replace", "partition"}
_DATA = (str, int, float, bool, type(None), tuple, frozenset, dict, list, set)


@dataclass
class Emits:
    """What one converter emits for one key: IR ops, and op arguments it could not evaluate
    (as `function: source` text)."""

    ops: set[str] = field(default_factory=set)
    unresolved: list[str] = field(default_factory=list)


def _union(*vals):
    if any(v is _UNKNOWN for v in vals):
        return _UNKNOWN
    out: list = []
    for v in vals:
        for x in v:
            if x not in out:
                out.append(x)
    return out if len(out) <= _MAX_VALUES else _UNKNOWN


class _Walker:
    """Follows one converter for one registry key (`subject`: the source text that reads the
    key, e.g. `str(node.target)`)."""

    def __init__(self, key: str, subject: str, op_index: dict[str, int]):
        self.key, self.subject, self.op_index = key, subject, op_index
        self._subject_type = type(ast.parse(subject, mode="eval").body)
        self.out = Emits()
        self._active: set[tuple] = set()

    # ---- functions -------------------------------------------------------------------
    def function(self, fn: Callable, bound: dict[str, Any], depth: int = 0) -> None:
        memo = (fn, tuple(sorted((k, repr(v)) for k, v in bound.items())))
        if depth > _MAX_DEPTH or memo in self._active:
            return
        self._active.add(memo)
        node = _parsed(fn)
        args = node.args
        env: dict[str, Any] = {a.arg: _UNKNOWN for a in args.posonlyargs + args.args + args.kwonlyargs}
        env.update(bound)
        self.block(node.body, env, fn, depth)
        self._active.discard(memo)

    def _bind(self, target: Callable, call: ast.Call, env, fn) -> dict[str, Any]:
        params = inspect.signature(target).parameters.values()
        positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        bound: dict[str, Any] = {}
        for p, a in zip(positional, call.args):
            if isinstance(a, ast.Starred):
                break
            bound[p.name] = self.ev(a, env, fn)
        names = {p.name for p in params if p.kind != p.POSITIONAL_ONLY}
        for kw in call.keywords:
            if kw.arg in names:
                bound[kw.arg] = self.ev(kw.value, env, fn)
        return bound

    # ---- statements ------------------------------------------------------------------
    def block(self, stmts, env, fn, depth):
        """Walk `stmts`; the environment after them, or None when they always return or raise."""
        for s in stmts:
            env = self.stmt(s, env, fn, depth)
            if env is None:
                return None
        return env

    def stmt(self, s, env, fn, depth):
        if isinstance(s, (ast.Return, ast.Raise)):
            for e in (getattr(s, "value", None), getattr(s, "exc", None)):
                if e is not None:
                    self.scan(e, env, fn, depth)
            return None
        if isinstance(s, ast.If):
            self.scan(s.test, env, fn, depth)
            t = self.ev(s.test, env, fn)
            body = self.block(s.body, dict(env), fn, depth) if t is _UNKNOWN or any(t) else None
            other = self.block(s.orelse, dict(env), fn, depth) if t is _UNKNOWN or not all(t) else None
            return _join(body, other)
        if isinstance(s, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            if s.value is None:
                return env
            self.scan(s.value, env, fn, depth)
            val = self.ev(s.value, env, fn) if not isinstance(s, ast.AugAssign) else _UNKNOWN
            for t in (s.targets if isinstance(s, ast.Assign) else [s.target]):
                for name in ast.walk(t):
                    if isinstance(name, ast.Name):
                        env[name.id] = val if t is name else _UNKNOWN
            return env
        if isinstance(s, (ast.For, ast.While)):
            self.scan(s.iter if isinstance(s, ast.For) else s.test, env, fn, depth)
            inner = dict(env)
            if isinstance(s, ast.For):
                for name in ast.walk(s.target):
                    if isinstance(name, ast.Name):
                        inner[name.id] = _UNKNOWN
            return _join(env, self.block(s.body + s.orelse, inner, fn, depth))
        if isinstance(s, ast.With):
            for item in s.items:
                self.scan(item.context_expr, env, fn, depth)
            return self.block(s.body, env, fn, depth)
        if isinstance(s, ast.Try):
            envs = [self.block(s.body + s.orelse, dict(env), fn, depth)]
            envs += [self.block(h.body, dict(env), fn, depth) for h in s.handlers]
            out = _join(*envs)
            return self.block(s.finalbody, out, fn, depth) if out is not None else None
        if isinstance(s, (ast.FunctionDef, ast.ClassDef, ast.Import, ast.ImportFrom)):
            return env
        for child in ast.iter_child_nodes(s):
            if isinstance(child, ast.expr):
                self.scan(child, env, fn, depth)
        return env

    # ---- calls -----------------------------------------------------------------------
    def scan(self, e: ast.expr, env, fn, depth) -> None:
        """Record the emits of every call in `e` (branches of a conditional expression that
        cannot run for the key are skipped)."""
        if isinstance(e, ast.IfExp):
            self.scan(e.test, env, fn, depth)
            t = self.ev(e.test, env, fn)
            if t is _UNKNOWN or any(t):
                self.scan(e.body, env, fn, depth)
            if t is _UNKNOWN or not all(t):
                self.scan(e.orelse, env, fn, depth)
            return
        if isinstance(e, ast.Lambda):
            return
        for child in ast.iter_child_nodes(e):
            if isinstance(child, ast.expr):
                self.scan(child, env, fn, depth)
        if isinstance(e, ast.Call):
            self.call(e, env, fn, depth)

    def call(self, c: ast.Call, env, fn, depth) -> None:
        f = c.func
        if isinstance(f, ast.Attribute) and f.attr in self.op_index:
            i = self.op_index[f.attr]
            arg = next((kw.value for kw in c.keywords if kw.arg == "op"), c.args[i] if len(c.args) > i else None)
            vals = self.ev(arg, env, fn) if arg is not None else _UNKNOWN
            if vals is _UNKNOWN or not vals or any(v not in OPS for v in vals):
                self.out.unresolved.append(f"{fn.__module__}.{fn.__name__}: {ast.unparse(c)[:120]}")
            else:
                self.out.ops.update(vals)
            return
        if isinstance(f, ast.Name) and f.id not in env:
            target = fn.__globals__.get(f.id)
            if inspect.isfunction(target) and target.__module__.startswith("graphmode."):
                self.function(target, self._bind(target, c, env, fn), depth + 1)

    # ---- expressions -----------------------------------------------------------------
    def ev(self, e: ast.expr, env, fn):
        """The values `e` may have for this key, or _UNKNOWN."""
        if type(e) is self._subject_type and ast.unparse(e) == self.subject:
            return [self.key]
        if isinstance(e, ast.Constant):
            return [e.value]
        if isinstance(e, ast.Name):
            if e.id in env:
                return env[e.id]
            g = fn.__globals__.get(e.id, _UNKNOWN)
            return [g] if isinstance(g, _DATA) else _UNKNOWN
        if isinstance(e, ast.IfExp):
            t = self.ev(e.test, env, fn)
            if t is _UNKNOWN:
                return _union(self.ev(e.body, env, fn), self.ev(e.orelse, env, fn))
            parts = ([self.ev(e.body, env, fn)] if any(t) else []) + ([self.ev(e.orelse, env, fn)] if not all(t)
                                                                     else [])
            return _union(*parts)
        if isinstance(e, ast.BoolOp):
            return self._boolop(e, env, fn)
        if isinstance(e, ast.UnaryOp) and isinstance(e.op, ast.Not):
            v = self.ev(e.operand, env, fn)
            return _UNKNOWN if v is _UNKNOWN else _union([not x for x in v])
        if isinstance(e, ast.Compare) and len(e.ops) == 1:
            return self._apply(lambda a, b: _compare(e.ops[0], a, b), self.ev(e.left, env, fn),
                               self.ev(e.comparators[0], env, fn))
        if isinstance(e, (ast.Tuple, ast.List, ast.Set)):
            items = [self.ev(x, env, fn) for x in e.elts]
            if any(v is _UNKNOWN or len(v) != 1 for v in items):
                return _UNKNOWN
            flat = [v[0] for v in items]
            return [tuple(flat) if isinstance(e, ast.Tuple) else (set(flat) if isinstance(e, ast.Set) else flat)]
        if isinstance(e, ast.Subscript):
            return self._apply(lambda a, b: a[b], self.ev(e.value, env, fn), self.ev(e.slice, env, fn))
        if isinstance(e, ast.Call):
            return self._call_value(e, env, fn)
        return _UNKNOWN

    def _boolop(self, e: ast.BoolOp, env, fn):
        is_and = isinstance(e.op, ast.And)
        out: list = []
        for k, operand in enumerate(e.values):
            v = self.ev(operand, env, fn)
            if v is _UNKNOWN:
                return _UNKNOWN
            last = k == len(e.values) - 1
            passes = [x for x in v if (bool(x) if is_and else not bool(x))]
            stops = [x for x in v if x not in passes]
            out = _union(out, v if last else stops)
            if out is _UNKNOWN:
                return _UNKNOWN
            if not passes:
                break
        return out

    def _call_value(self, e: ast.Call, env, fn):
        f = e.func
        args = [self.ev(a, env, fn) for a in e.args]
        if any(a is _UNKNOWN or len(a) != 1 for a in args) or e.keywords:
            return _UNKNOWN
        args = [a[0] for a in args]
        if isinstance(f, ast.Name) and f.id == "str" and f.id not in env and fn.__globals__.get("str", builtins.str) \
                is builtins.str and len(args) == 1:
            return [str(args[0])]
        if isinstance(f, ast.Attribute):
            recv = self.ev(f.value, env, fn)
            if recv is _UNKNOWN:
                return _UNKNOWN
            out: list = []
            for r in recv:
                if isinstance(r, str) and f.attr in _STR_METHODS or isinstance(r, dict) and f.attr == "get":
                    try:
                        out = _union(out, [getattr(r, f.attr)(*args)])
                    except (TypeError, ValueError):
                        return _UNKNOWN
                else:
                    return _UNKNOWN
            return out
        return _UNKNOWN

    @staticmethod
    def _apply(op: Callable[[Any, Any], Any], left, right):
        if left is _UNKNOWN or right is _UNKNOWN:
            return _UNKNOWN
        out: list = []
        for a in left:
            for b in right:
                try:
                    out = _union(out, [op(a, b)])
                except (KeyError, IndexError):
                    continue            # e.g. `_BINARY[op]` for a unary op: that path does not exist
                except TypeError:
                    return _UNKNOWN
                if out is _UNKNOWN:
                    return _UNKNOWN
        return out


@functools.lru_cache(maxsize=None)
def _parsed(fn: Callable) -> ast.FunctionDef:
    return ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]


def _compare(op: ast.cmpop, a, b) -> bool:
    table = {ast.Eq: lambda: a == b, ast.NotEq: lambda: a != b, ast.In: lambda: a in b,
             ast.NotIn: lambda: a not in b, ast.Is: lambda: a is b, ast.IsNot: lambda: a is not b}
    f = table.get(type(op))
    if f is None:
        raise TypeError(f"comparison {type(op).__name__}")
    return f()


def _join(*envs):
    live = [e for e in envs if e is not None]
    if not live:
        return None
    out = dict(live[0])
    for e in live[1:]:
        for k, v in e.items():
            out[k] = _union(out[k], v) if k in out else v
    return out


def _op_index(*methods: Callable) -> dict[str, int]:
    """method name -> the position of its `op` parameter (self not counted)."""
    return {m.__name__: [p for p in inspect.signature(m).parameters if p != "self"].index("op") for m in methods}


def converter_emits(registry: dict[str, Callable], subject: str, *emit_methods: Callable) -> dict[str, Emits]:
    """key -> what its converter emits, for a registry of key -> function whose code reads
    the key as `subject` and emits through `emit_methods` (or `Graph.add_node`)."""
    index = _op_index(*emit_methods, Graph.add_node)
    out: dict[str, Emits] = {}
    for key, fn in registry.items():
        w = _Walker(key, subject, index)
        w.function(fn, {})
        out[key] = w.out
    return out


def torch_emits() -> dict[str, Emits]:
    """ATen overload -> what its conversion emits: a registered converter's, else its op
    database entry's (ops captured one-to-one)."""
    from graphmode.capture.aten import CONVERTERS
    from graphmode.capture.torch_import import _Importer
    from graphmode.ir.ops import aten_table
    out = {k: Emits({op}) for k, op in aten_table().items()}
    out.update(converter_emits(CONVERTERS, "str(node.target)", _Importer.emit))
    return out


def onnx_emits() -> dict[str, Emits]:
    """ONNX op type -> what its handler emits."""
    from graphmode.capture.onnx import importer
    return converter_emits(importer._HANDLERS, "n.op_type", importer._Importer.emit, importer._Importer.emit_aten)


__all__ = ["Emits", "converter_emits", "torch_emits", "onnx_emits"]
