"""JSON form of the IR (structure) with constant data in a safetensors file beside it."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

import torch
from safetensors.torch import load_file, save_file

from graphmode.errors import IRError
from graphmode.ir.graph import Graph, Node, constant_digest
from graphmode.ir.printer import INLINE_LIMIT, inline_data
from graphmode.ir.parser import _data_tensor
from graphmode.ir.types import TensorType

FORMAT = "graphmode-ir"
FORMAT_VERSION = 1


def _node_json(g: Graph, n: Node) -> dict[str, Any]:
    d: dict[str, Any] = {"op": n.op, "inputs": list(n.inputs),
                         "outputs": [{"name": o, "type": g.values[o].type.to_json()} for o in n.outputs]}
    if n.attrs:
        d["attrs"] = dict(n.attrs)
    if n.body is not None:
        d["body"] = [_node_json(n.body, m) for m in n.body.nodes]
    return d


def graph_to_json(g: Graph) -> dict[str, Any]:
    consts = []
    for name in sorted(g.constants):
        t = g.constants[name]
        c = {"name": name, "role": g.values[name].role, "type": g.values[name].type.to_json(),
             "digest": constant_digest(t)}
        if t.numel() <= INLINE_LIMIT:
            c["data"] = json.loads(inline_data(t)) if t.dim() else inline_data(t)
        consts.append(c)
    return {"format": FORMAT, "version": FORMAT_VERSION, "name": g.name,
            "dims": {k: list(v) for k, v in sorted(g.dims.items())},
            "inputs": [{"name": i, "type": g.values[i].type.to_json()} for i in g.inputs],
            "outputs": list(g.outputs), "constants": consts,
            "nodes": [_node_json(g, n) for n in g.nodes]}


def _node_from_json(d: Mapping, g: Graph, scope: dict[str, TensorType]) -> Node:
    outs = [(o["name"], TensorType.from_json(o["type"])) for o in d["outputs"]]
    body = None
    if "body" in d:
        body = Graph(f"{g.name}.{outs[0][0]}")
        for a in d["inputs"]:
            body.add_input(a, scope[a])
        inner = dict(scope)
        for nd in d["body"]:
            node = _node_from_json(nd, body, inner)
            body.nodes.append(node)
        body.outputs = [o for o, _ in outs]
    for name, ty in outs:
        g.add_value(name, ty)
        scope[name] = ty
    return Node(d["op"], tuple(d["inputs"]), tuple(o for o, _ in outs), dict(d.get("attrs", {})), body)


def graph_from_json(d: Mapping[str, Any], constants: Mapping[str, torch.Tensor] | None = None) -> Graph:
    if d.get("format") != FORMAT or d.get("version") != FORMAT_VERSION:
        raise IRError("not a graphmode IR document", value=(d.get("format"), d.get("version")),
                      fix=f"expected format {FORMAT!r} version {FORMAT_VERSION}")
    constants = constants or {}
    g = Graph(d["name"])
    g.dims = {k: (int(v[0]), int(v[1])) for k, v in d.get("dims", {}).items()}
    for i in d["inputs"]:
        g.add_input(i["name"], TensorType.from_json(i["type"]))
    scope = {n: v.type for n, v in g.values.items()}
    for c in d["constants"]:
        ty = TensorType.from_json(c["type"])
        if "data" in c:
            data = c["data"]
            t = _data_tensor(json.dumps(data) if not isinstance(data, str) else data, ty)
        else:
            t = constants.get(c["name"])
            if t is None or constant_digest(t) != c["digest"]:
                raise IRError(f"constant %{c['name']} is missing or does not match digest {c['digest']}",
                              fix="load the graph with the constants file saved beside it")
        g.add_value(c["name"], ty, c["role"])
        g.constants[c["name"]] = t
        scope[c["name"]] = ty
    for nd in d["nodes"]:
        g.nodes.append(_node_from_json(nd, g, scope))
    g.outputs = list(d["outputs"])
    for o in g.outputs:
        v = g.values[o]
        if v.role == "intermediate":
            g.values[o] = v.__class__(o, v.type, "output")
    return g


def save_graph(g: Graph, path: str | Path) -> None:
    """Write `<path>.json` (structure) and `<path>.safetensors` (large constants)."""
    path = Path(path)
    big = {k: v.detach().contiguous() for k, v in g.constants.items() if v.numel() > INLINE_LIMIT}
    path.with_suffix(".json").write_text(json.dumps(graph_to_json(g), indent=1))
    save_file(big, str(path.with_suffix(".safetensors")))


def load_graph(path: str | Path) -> Graph:
    path = Path(path)
    try:
        doc = json.loads(path.with_suffix(".json").read_text())
        consts = load_file(str(path.with_suffix(".safetensors")))
    except (OSError, json.JSONDecodeError, Exception) as e:  # safetensors raises its own errors
        raise IRError(f"cannot read graph {path}: {e}", fix="recompile to regenerate it") from None
    return graph_from_json(doc, consts)
