"""Parser for the IR text form written by printer.py."""
from __future__ import annotations

import json
import re
from typing import Mapping

import torch

from graphmode.errors import IRError
from graphmode.ir.graph import Graph, Node, constant_digest
from graphmode.ir.types import DTYPES, TensorType

_HEADER = re.compile(r"^graph @(?P<name>[\w.]+)\((?P<ins>.*)\) -> \((?P<outs>.*)\) \{$")
_CONST = re.compile(r"^(?P<role>param|const|state) %(?P<name>[\w.]+): (?P<type>\S+)"
                    r"(?: = (?P<data>.+)| #(?P<digest>[0-9a-f]+))?$")
_NODE = re.compile(r"^(?P<outs>%.+?) = (?P<op>[\w.:]+)\((?P<args>[^)]*)\)(?P<rest>.*)$")
_TYPE = re.compile(r"^(?P<dtype>\w+)\[(?P<dims>.*)\](?:@(?P<layout>\w+))?$")


def split_top(text: str, sep: str = ",") -> list[str]:
    """Split on `sep` outside brackets/parentheses."""
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == sep and depth == 0:
            parts.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    tail = "".join(cur).strip()
    if tail or parts:
        parts.append(tail)
    return [p for p in parts if p != ""]


def parse_type(text: str) -> TensorType:
    m = _TYPE.match(text.strip())
    if not m:
        raise IRError(f"cannot parse type {text!r}", fix="write e.g. f32[batch,seq,384]")
    dims = [int(d) if re.fullmatch(r"-?\d+", d) else d for d in split_top(m["dims"])]
    return TensorType(m["dtype"], tuple(dims), m["layout"] or "row_major")


def _typed_names(text: str) -> list[tuple[str, TensorType]]:
    out = []
    for part in split_top(text):
        name, _, ty = part.partition(":")
        out.append((name.strip().lstrip("%"), parse_type(ty)))
    return out


def _data_tensor(data: str, ty: TensorType) -> torch.Tensor:
    vals = json.loads(data)
    conv = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}
    fix = (lambda v: conv.get(v, v) if isinstance(v, str) else v)
    vals = [fix(v) for v in vals] if isinstance(vals, list) else fix(vals)
    return torch.tensor(vals, dtype=DTYPES[ty.dtype]).reshape(tuple(int(d) for d in ty.shape))


class _Lines:
    def __init__(self, text: str):
        self.lines = [(i + 1, ln.strip()) for i, ln in enumerate(text.splitlines()) if ln.strip()]
        self.pos = 0

    def next(self) -> tuple[int, str]:
        if self.pos >= len(self.lines):
            raise IRError("unexpected end of IR text", fix="close every graph/body with '}'")
        self.pos += 1
        return self.lines[self.pos - 1]


def _parse_node(lines: _Lines, lineno: int, line: str, scope: dict[str, TensorType], gname: str) -> tuple[Node, list]:
    m = _NODE.match(line)
    if not m:
        raise IRError(f"cannot parse line: {line}", line=lineno)
    outs = _typed_names(m["outs"])
    args = [a.strip().lstrip("%") for a in split_top(m["args"])]
    rest = m["rest"].strip()
    has_body = rest == "{" or rest.endswith(" {")
    if has_body:
        rest = rest[:-1].strip()
    try:
        attrs = json.loads(rest) if rest else {}
    except json.JSONDecodeError as e:
        raise IRError(f"bad attribute JSON: {e}", line=lineno, value=rest) from None
    body = None
    if has_body:
        body = Graph(f"{gname}.{outs[0][0]}")
        for a in args:
            if a not in scope:
                raise IRError(f"body input %{a} is not defined", line=lineno)
            body.add_input(a, scope[a])
        inner_scope = dict(scope)
        while True:
            ln, text = lines.next()
            if text == "}":
                break
            node, new_vals = _parse_node(lines, ln, text, inner_scope, body.name)
            for name, ty in new_vals:
                body.add_value(name, ty)
                inner_scope[name] = ty
            body.nodes.append(node)
        body.outputs = [o for o, _ in outs]
    node = Node(m["op"], tuple(args), tuple(o for o, _ in outs), attrs, body)
    return node, outs


def parse_graph(text: str, constants: Mapping[str, torch.Tensor] | None = None) -> Graph:
    """Parse IR text. Constants printed by digest must be supplied in `constants`."""
    constants = constants or {}
    lines = _Lines(text)
    lineno, head = lines.next()
    m = _HEADER.match(head)
    if not m:
        raise IRError("IR text must start with 'graph @name(...) -> (...) {'", line=lineno, value=head)
    g = Graph(m["name"])
    for name, ty in _typed_names(m["ins"]):
        g.add_input(name, ty)
    declared_outs = [o.strip().lstrip("%") for o in split_top(m["outs"])]
    scope = {n: v.type for n, v in g.values.items()}
    while True:
        lineno, line = lines.next()
        if line == "}":
            break
        if line.startswith("dims "):
            for item in line[5:].split():
                k, _, rng = item.partition("=")
                lo, _, hi = rng.partition("..")
                g.dims[k] = (int(lo), int(hi))
        elif line.startswith(("param %", "const %", "state %")):
            c = _CONST.match(line)
            if not c:
                raise IRError(f"cannot parse constant: {line}", line=lineno)
            ty = parse_type(c["type"])
            if c["data"] is not None:
                t = _data_tensor(c["data"], ty)
            else:
                t = constants.get(c["name"])
                if t is None and c["role"] == "state":
                    # run-time state (a decoder's KV pool) is not stored: it starts empty, as at compile
                    t = torch.zeros(tuple(int(d) for d in ty.shape), dtype=DTYPES[ty.dtype])
                if t is None:
                    raise IRError(f"constant %{c['name']} has no data", line=lineno,
                                  fix="pass its tensor in `constants` (serialize.load_graph does)")
                if c["role"] != "state" and constant_digest(t) != c["digest"]:
                    raise IRError(f"constant %{c['name']} does not match its digest #{c['digest']}",
                                  line=lineno, fix="the constant file is corrupt or from another graph")
            g.add_value(c["name"], ty, c["role"])
            g.constants[c["name"]] = t
            scope[c["name"]] = ty
        elif line.startswith("return"):
            outs = [o.strip().lstrip("%") for o in split_top(line[len("return"):])]
            if outs != declared_outs:
                raise IRError("return list differs from the header's outputs", line=lineno)
            g.outputs = outs
        else:
            node, new_vals = _parse_node(lines, lineno, line, scope, g.name)
            for name, ty in new_vals:
                g.add_value(name, ty)
                scope[name] = ty
            g.nodes.append(node)
    for o in g.outputs:
        if o in g.values and g.values[o].role == "intermediate":
            g.values[o] = g.values[o].__class__(o, g.values[o].type, "output")
    return g
