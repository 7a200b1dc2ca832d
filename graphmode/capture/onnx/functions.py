"""ONNX ops defined by a function body, imported through that body.

Many ONNX ops (Attention, RMSNormalization, RotaryEmbedding, the loss ops, Celu, Mish,
GroupNormalization, CenterCropPad, ...) come with a function in their schema: the op written
in simpler ONNX ops, the definition runtimes without a kernel fall back to. An op the
importer has no converter for is replaced by its body (onnx's inliner, which also builds the
context-dependent bodies that depend on the node's attributes and input types) before the
model is validated, so the body's ops go through the same checks and converters as any other
node. Inlining repeats while a body brings in another such op (SoftmaxCrossEntropyLoss ->
NegativeLogLikelihoodLoss). `import_onnx` also falls back to the body of an op whose converter
refuses a node (an attribute or an output it does not cover). Functions the model defines
itself (onnxscript's, a custom domain's) are inlined the same way.
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


def _body(node, opset: int, types: dict):
    """The FunctionProto defining `node` at `opset`, built for its input types (a context-dependent
    body depends on them; an omitted optional input gets an empty type); None where a present
    input's type is unknown or the schema cannot build one."""
    from onnx import FunctionProto, TypeProto, defs
    schema = defs.get_schema(node.op_type, opset, "")
    if schema.has_function:
        versions, build = schema.function_opset_versions, schema.get_function_with_opset_version
    else:
        if any(x and x not in types for x in node.input):
            return None
        args = [(types[x] if x else TypeProto()).SerializeToString() for x in node.input]
        versions = schema.context_dependent_function_opset_versions
        build = lambda v: schema.get_context_dependent_function_with_opset_version(  # noqa: E731
            v, node.SerializeToString(), args)
    usable = [v for v in versions if v <= opset]
    if not usable:
        return None
    body = FunctionProto()
    try:
        body.ParseFromString(build(max(usable)))
    except Exception:  # noqa: BLE001 - onnx raises on bodies it cannot build for these types
        return None
    return body


def _renamed(nodes, rename, attrs: dict, prefix: str) -> list:
    """Copies of a body's `nodes` with their edges renamed and `ref_attr_name` attributes bound to
    the calling node's `attrs` (dropped where it leaves them unset: the inner op's default).
    A subgraph (Scan, Loop, If) renames what it defines with `prefix` and what it reads from
    the enclosing scope with `rename`."""
    import onnx
    out = []
    for inner in nodes:
        n = onnx.NodeProto()
        n.CopyFrom(inner)
        del n.input[:], n.output[:], n.attribute[:]
        n.input.extend(rename(x) for x in inner.input)
        n.output.extend(rename(x) for x in inner.output)
        for a in inner.attribute:
            if a.ref_attr_name:
                if a.ref_attr_name in attrs:
                    bound = n.attribute.add()
                    bound.CopyFrom(attrs[a.ref_attr_name])
                    bound.name = a.name
                continue
            b = n.attribute.add()
            b.CopyFrom(a)
            if a.type == onnx.AttributeProto.GRAPH:
                _rename_graph(b.g, rename, attrs, prefix)
        out.append(n)
    return out


def _rename_graph(g, outer, attrs: dict, prefix: str) -> None:
    local = {v.name for v in (*g.input, *g.output)} | {t.name for t in g.initializer} \
        | {o for n in g.node for o in n.output}

    def rename(x: str) -> str:
        return "" if not x else prefix + x if x in local else outer(x)
    for v in (*g.input, *g.output, *g.value_info):
        v.name = rename(v.name)
    for t in g.initializer:
        t.name = rename(t.name)
    nodes = _renamed(g.node, rename, attrs, prefix)
    del g.node[:]
    g.node.extend(nodes)


def _expand_each(model, ops: set[str], opset: int):
    """`model` with each top-level node of `ops` replaced by its body, built here node by node: the
    route for what onnx's inliner cannot build (it cannot type an omitted optional input, which
    LinearAttention's and Attention's bodies test for). A node whose body cannot be built stays."""
    import onnx
    try:
        inferred = onnx.shape_inference.infer_shapes(model).graph
    except Exception:  # noqa: BLE001 - without inferred types only the graph's own are known
        inferred = model.graph
    types = {v.name: v.type for v in (*inferred.input, *inferred.value_info, *inferred.output)}
    for t in model.graph.initializer:
        types.setdefault(t.name, onnx.helper.make_tensor_type_proto(t.data_type, list(t.dims)))
    taken = {x for n in model.graph.node for x in (*n.input, *n.output)} | set(types)
    out = onnx.ModelProto()
    out.CopyFrom(model)
    nodes = []
    for i, n in enumerate(model.graph.node):
        body = _body(n, opset, types) if n.op_type in ops and n.domain in ("", "ai.onnx") else None
        if body is None:
            nodes.append(n)
            continue
        prefix = f"{n.op_type}_{i}_"
        while any(x.startswith(prefix) for x in taken):
            prefix += "_"
        io = dict(zip(body.input, n.input))
        io.update((f, a) for f, a in zip(body.output, n.output) if a)
        nodes.extend(_renamed(body.node, lambda x: io.get(x, prefix + x) if x else "",
                              {a.name: a for a in n.attribute}, prefix))
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    return out


def expand_functions(model, handled: Collection[str]):
    """`model` with every node whose op has no converter but a function body replaced by that
    body (the model unchanged when there is none); a node whose body cannot be built stays,
    for the op-type check to refuse by name."""
    from onnx import inliner

    from graphmode.capture.onnx.opsets import model_opset
    if model.functions:     # the model's own functions (onnxscript writes them): their bodies, first
        try:
            model = inliner.inline_local_functions(model)
        except Exception:  # noqa: BLE001 - a body the inliner cannot build: its node is refused by name
            pass
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
            expanded = _expand_each(model, set(todo), opset)
            if expanded.graph.node == model.graph.node:
                return model
            model = expanded
    return model


def body_origins(before, after) -> dict[str, tuple[int, object]]:
    """{first output of each node a function body brought into `after`: (index, node) of the node
    of `before` (the user's file) it stands for}, so an error inside a body names what the user
    wrote (a Bernoulli, not its body's RandomUniformLike). Bodies replace their node in place, in
    order, and every other node is copied unchanged: the nodes between two unchanged ones are the
    bodies of the expanded nodes between them, each ending once it has made all its node's outputs."""
    if after is before:
        return {}
    orig = list(before.graph.node)
    same = {n.SerializeToString(): i for i, n in enumerate(orig)}
    out: dict[str, tuple[int, object]] = {}
    pending: list = []
    at = 0
    for n in after.graph.node:
        j = same.get(n.SerializeToString())
        if j is None:
            pending.append(n)
            continue
        _attribute(pending, [(i, orig[i]) for i in range(at, j)], out)
        pending, at = [], j + 1
    _attribute(pending, [(i, orig[i]) for i in range(at, len(orig))], out)
    return out


def _attribute(nodes: list, calls: list, out: dict) -> None:
    """Give each of `nodes` (bodies, in order) the call of `calls` whose body it belongs to."""
    k, made = 0, set()
    for n in nodes:
        if k >= len(calls):
            return
        i, call = calls[k]
        if n.output and not (n.op_type == call.op_type and list(n.output) == list(call.output)):
            out[n.output[0]] = (i, call)
        made.update(n.output)
        if {o for o in call.output if o} <= made and k + 1 < len(calls):
            k, made = k + 1, set()
