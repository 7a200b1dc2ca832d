"""Eager execution of `fallback` nodes: ops graphmode keeps in the graph but does not compile.

A fallback node records the torch op (`target`, e.g. "aten.cumsum.default") and its
arguments as JSON, with tensor operands written as {"$in": i} (the node's i-th input) and
symbolic ints as {"$dim": "seq*2"}. The runtime calls the op through `torch.ops`.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

from graphmode.errors import IRError
from graphmode.ir.types import DTYPES, eval_dim, normalize_dim


def resolve_target(target: str):
    ns, _, rest = target.partition(".")
    op_name, _, overload = rest.partition(".")
    try:
        packet = getattr(getattr(torch.ops, ns), op_name)
        return getattr(packet, overload or "default")
    except AttributeError:
        raise IRError(f"fallback target {target!r} is not a torch op",
                      fix="fallback targets look like 'aten.cumsum.default'") from None


def _materialise(arg: Any, ins: list[torch.Tensor], env: Mapping[str, int]) -> Any:
    if isinstance(arg, dict):
        if "$in" in arg:
            return ins[arg["$in"]]
        if "$dim" in arg:
            return eval_dim(normalize_dim(arg["$dim"]), env)
        if "$dtype" in arg:
            return DTYPES[arg["$dtype"]]
        if "$device" in arg:
            return torch.device(arg["$device"])
        return {k: _materialise(v, ins, env) for k, v in arg.items()}
    if isinstance(arg, list):
        return [_materialise(a, ins, env) for a in arg]
    return arg


def run_fallback(ins: list[torch.Tensor], attrs: Mapping[str, Any], env: Mapping[str, int]) -> list[torch.Tensor]:
    fn = resolve_target(attrs["target"])
    args = _materialise(attrs.get("args", []), ins, env)
    kwargs = _materialise(attrs.get("kwargs", {}), ins, env)
    out = fn(*args, **kwargs)
    if isinstance(out, torch.Tensor):
        return [out]
    return [o for o in out if isinstance(o, torch.Tensor)]
