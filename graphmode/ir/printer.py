"""Stable text form of the IR (an API: `parse_graph(print_graph(g))` gives back `g`).

    graph @name(%x: f32[batch,seq,384], %mask: i64[batch,seq]) -> (%y) {
      dims batch=1..32 seq=2..512
      param %w: f32[384,384] #3f2a1c0d9e8b7a61
      const %c0: f32[] = 0.125
      %t: f32[batch,seq,384] = linear(%x, %w) {"k": 1}
      %y: f32[batch,seq,384] = fused(%t) {"kind": "elementwise"} {
        %u: f32[batch,seq,384] = gelu(%t)
        ...
      }
      return %y
    }

Constants with at most `INLINE_LIMIT` elements print their data inline; larger ones print
a content digest and are carried beside the text (JSON + safetensors, see serialize.py).
"""
from __future__ import annotations

import json
import math

import torch

from graphmode.ir.graph import Graph, Node, constant_digest, constant_digests

INLINE_LIMIT = 16


def _json_scalar(x):
    if isinstance(x, float):
        if math.isnan(x):
            return "nan"
        if math.isinf(x):
            return "inf" if x > 0 else "-inf"
    return x


def inline_data(t: torch.Tensor) -> str:
    data = t.detach().cpu().reshape(-1)
    if data.dtype == torch.bool:
        vals = [bool(v) for v in data.tolist()]
    elif data.is_floating_point():
        vals = [_json_scalar(float(v)) for v in data.double().tolist()]
    else:
        vals = [int(v) for v in data.tolist()]
    if t.dim() == 0:
        return json.dumps(vals[0])
    return json.dumps(vals)


def format_attrs(attrs) -> str:
    return json.dumps(attrs, sort_keys=True, separators=(", ", ": ")) if attrs else ""


def _node_line(g: Graph, n: Node, indent: str) -> list[str]:
    outs = ", ".join(f"%{o}: {g.values[o].type.text()}" for o in n.outputs)
    args = ", ".join(f"%{i}" for i in n.inputs)
    line = f"{indent}{outs} = {n.op}({args})"
    a = format_attrs(n.attrs)
    if a:
        line += f" {a}"
    if n.body is None:
        return [line]
    lines = [line + " {"]
    for m in n.body.nodes:
        lines += _node_line(n.body, m, indent + "  ")
    lines.append(indent + "}")
    return lines


def print_graph(g: Graph) -> str:
    ins = ", ".join(f"%{i}: {g.values[i].type.text()}" for i in g.inputs)
    outs = ", ".join(f"%{o}" for o in g.outputs)
    lines = [f"graph @{g.name}({ins}) -> ({outs}) {{"]
    if g.dims:
        lines.append("  dims " + " ".join(f"{k}={lo}..{hi}" for k, (lo, hi) in sorted(g.dims.items())))
    constant_digests(t for k, t in g.constants.items() if g.values[k].role != "state" and t.numel() > INLINE_LIMIT)
    for name in sorted(g.constants):
        v = g.values[name]
        t = g.constants[name]
        head = f"  {v.role} %{name}: {v.type.text()}"
        if v.role == "state":            # mutable run-time data: its type is all the IR says
            lines.append(head)
        elif t.numel() <= INLINE_LIMIT:
            lines.append(f"{head} = {inline_data(t)}")
        else:
            lines.append(f"{head} #{constant_digest(t)}")
    for n in g.nodes:
        lines += _node_line(g, n, "  ")
    lines.append(f"  return {outs}")
    lines.append("}")
    return "\n".join(lines) + "\n"
