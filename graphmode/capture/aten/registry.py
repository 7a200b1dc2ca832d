"""The ATen converter registry: `converts` registers a converter per overload, `bind` normalises
a call's arguments against its schema, and `convert` dispatches one call (a registered
converter, else the op database's one-to-one entry, else False: a fallback)."""
from __future__ import annotations

from typing import Any, Callable

import torch

from graphmode.capture.aten.emit import aten_reference
from graphmode.ir.ops import OPS, aten_table


Converter = Callable[[Any, torch.fx.Node, dict], bool]
CONVERTERS: dict[str, Converter] = {}
_MISSING = object()

# arguments that do not change what an inference forward computes
_INERT = {"layout", "device", "pin_memory", "memory_format", "non_blocking", "copy", "sparse_grad", "scale_grad_by_freq",
          "sparse", "padding_idx", "cudnn_enabled", "momentum"}


def converts(*overloads: str) -> Callable[[Converter], Converter]:
    def deco(fn: Converter) -> Converter:
        for o in overloads:
            CONVERTERS[o] = fn
        return fn
    return deco


def bind(node: torch.fx.Node) -> dict[str, Any]:
    """{argument name: value} for an ATen call, defaults filled in from the schema."""
    out: dict[str, Any] = {}
    schema = node.target._schema
    for i, arg in enumerate(schema.arguments):
        if not arg.kwarg_only and i < len(node.args):
            out[arg.name] = node.args[i]
        elif arg.name in node.kwargs:
            out[arg.name] = node.kwargs[arg.name]
        elif arg.has_default_value():
            out[arg.name] = arg.default_value
        else:
            out[arg.name] = _MISSING
    return out


def is_default(node: torch.fx.Node, name: str, value: Any) -> bool:
    for arg in node.target._schema.arguments:
        if arg.name == name:
            return arg.has_default_value() and value == arg.default_value or value is None
    return False


def convert(imp, node: torch.fx.Node, tname: str) -> bool:
    """Convert one ATen call; False: no converter covers it (the importer records a fallback)."""
    fn = CONVERTERS.get(tname)
    if fn is not None:
        return fn(imp, node, bind(node))
    op = aten_table().get(tname)
    if op is not None:
        return one_to_one(imp, node, op)
    return False


def one_to_one(imp, node: torch.fx.Node, op: str) -> bool:
    spec = OPS[op]
    if spec.has("aten_reference"):
        return aten_reference(imp, node, op)
    a = bind(node)
    inputs: list[str] = []
    attrs: dict[str, Any] = {}
    for arg in node.target._schema.arguments:
        v = a[arg.name]
        ty = str(arg.type)
        if arg.name in spec.attrs:
            if isinstance(v, torch.fx.Node):
                return False                # a size computed at run time (tril(diagonal=sk - sq)): no attribute holds it
            attrs[arg.name] = v
        elif ty.startswith("List[Tensor]") or ty == "Tensor[]":
            inputs += [imp.operand(t) for t in v]
        elif ty.startswith(("Tensor", "Optional[Tensor]")):
            if v is not None and v is not _MISSING:
                inputs.append(imp.operand(v))
        elif ty in ("Scalar", "number") and arg.name in ("self", "other", "exponent"):
            inputs.append(imp.operand(v))
        elif arg.name not in _INERT and not is_default(node, arg.name, v):
            return False                    # an argument the core op does not model
    if "dim" in attrs and isinstance(attrs["dim"], int):
        attrs["dim"] = int(attrs["dim"])
    imp.emit(node, op, inputs, attrs)
    return True
