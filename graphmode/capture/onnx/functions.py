"""ONNX ops defined by a function body, imported through that body.

Many ONNX ops (Attention, RMSNormalization, RotaryEmbedding, the loss ops, Celu, Mish,
GroupNormalization, CenterCropPad, ...) come with a function in their schema: the op written
in simpler ONNX ops, the definition runtimes without a kernel fall back to. An op the
importer has no converter for is replaced by its body (onnx's inliner, which also builds the
context-dependent bodies that depend on the node's attributes and input types) before the
model is validated, so the body's ops go through the same checks and converters as any other
node. Inlining repeats while a body brings in another such op (SoftmaxCrossEntropyLoss ->
NegativeLogLikelihoodLoss). `import_onnx` also falls back to the body of an op whose converter
refuses a node (an attribute or an output it does not cover).
"""
from __future__ import annotations

from typing import Collection

MAX_ROUNDS = 4


def has_body(op: str, domain: str, opset: int) -> bool:
    from onnx import defs
    try:
        s = defs.get_schema(op, opset, domain)
    except Exception:  # noqa: BLE001 - onnx.defs.SchemaError: not an op at this opset
        return False
    return bool(s.has_function or s.has_context_dependent_function)


def _with_defaults(model, ops: set[str], opset: int):
    """A copy of `model` whose nodes of `ops` spell out every attribute they leave at its default:
    a body refers to the node's attributes by name, and the inliner does not fill in the schema's
    defaults (MeanVarianceNormalization's `axes` would silently become every axis)."""
    import onnx
    from onnx import defs
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for n in out.graph.node:
        if n.op_type not in ops or n.domain not in ("", "ai.onnx"):
            continue
        schema = defs.get_schema(n.op_type, opset, "")
        have = {a.name for a in n.attribute}
        for name, attr in schema.attributes.items():
            if name not in have and attr.default_value.name:
                n.attribute.append(attr.default_value)
    return out


def expand_functions(model, handled: Collection[str]):
    """`model` with every node whose op has no converter but a function body replaced by that
    body (the model unchanged when there is none); a failure of the inliner leaves the node for
    the op-type check to refuse by name."""
    from onnx import inliner

    from graphmode.capture.onnx.opsets import model_opset
    for _ in range(MAX_ROUNDS):
        opset = model_opset(model) or 0
        todo = sorted({n.op_type for n in model.graph.node if n.domain in ("", "ai.onnx")
                       and n.op_type not in handled and has_body(n.op_type, "", opset)})
        if not todo:
            return model
        model = _with_defaults(model, set(todo), opset)
        try:
            model = inliner.inline_selected_functions(model, [("", op) for op in todo], inline_schema_functions=True)
        except Exception:  # noqa: BLE001 - the inliner raises RuntimeError on bodies it cannot build
            return model
    return model
