"""Refuse a malformed ONNX model at import, before any converter runs.

Why one place: the converters trust the node they translate (a Conv's `group`, a pool's
pads, a Gather's indices, the graph's output types). A model that breaks the ONNX spec, or
a limit graphmode's kernels have, would otherwise import cleanly and crash in a kernel or
in onnxruntime (the reference) at the first call. `validate_onnx` runs, in order:

1. the signature (`check_signature`, also used by `spec.load_onnx_spec`, which reads a
   model without its weights): at least one graph output, unique output names, tensor
   types graphmode has a dtype for, static dims in [0, MAX_DIM]; then the opset
   (`capture/onnx/opsets.py`: a model written for another opset is relabelled or converted
   when every node means the same, before the checker, whose message would blame a node);
2. `onnx.checker.check_model` on a weightless view of the model (SSA, topological order,
   schemas, attribute names and types, input counts, ir_version);
3. the op types the importer translates (all listed at once);
4. graphmode's per-op attribute ranges: each op's check, registered with its handler
   (`@_handles(op, check=...)` in capture/onnx/convert_*.py, the shared parts in
   capture/onnx/checks.py), on the types of a lenient inference pass: each message names
   the attribute, its value and the fix, which ONNX's own messages do not (theirs get the
   node's input types as the value instead);
5. strict shape inference with type checks and data propagation (what
   `check_model(full_check=True)` adds, plus `data_prop`), then every inferred static dim
   must lie in [0, MAX_DIM]. Range / ConstantOfShape sizes are checked before any inference
   (`_constant_sizes`): ONNX's data propagation materialises them.

ONNX's errors name the op type and node; they are re-raised as CaptureErrors whose `where`
is the node (`node_where`), the same form the importer's own errors use.
"""
from __future__ import annotations

import math
import re
from collections import Counter, defaultdict
from typing import Any, Callable, Collection, Mapping

from graphmode.capture.onnx.checks import (MAX_DIM, ONNX_DTYPES, SUPPORTED_TYPES, WIDENED, CheckedNode, ValueTypes,
                                           node_attrs, node_where, type_name)
from graphmode.errors import CaptureError

__all__ = ["validate_onnx", "check_signature", "MIN_OPSET", "LIGHT_LIMIT"]

MIN_OPSET = 7               # older models are refused; 7..10 are relabelled or converted (capture/onnx/opsets.py)
LIGHT_LIMIT = 4096          # initializers above this many elements reach the checker as typed inputs
DATA_PROP_LIMIT = 2 ** 16   # longest constant-sized 1-d tensor ONNX's data propagation may materialise
MAX_FOLD = 2 ** 24          # longest constant Range the importer folds into a tensor
# 0/1 attributes the converters read as booleans
_FLAGS = ("transA", "transB", "ceil_mode", "count_include_pad", "storage_order", "keepdims", "allowzero",
          "noop_with_empty_axes", "upper", "training_mode", "exclusive", "reverse", "detect_positive",
          "detect_negative")


# ---------------------------------------------------------------------------- 1. signature


def check_signature(model, where: str) -> None:
    """Graph inputs/outputs/initializers graphmode can bind: no weights are read."""
    g = model.graph
    if not g.output:
        raise CaptureError("the graph declares no outputs, so the model computes nothing", where=where,
                           fix="re-export the model so that it returns at least one tensor")
    dup = sorted(n for n, c in Counter(o.name for o in g.output).items() if c > 1)
    if dup:
        raise CaptureError(f"graph output name(s) {dup} are declared more than once", where=where, value=dup,
                           fix="give every graph output its own value (add an Identity node for a repeated one)")
    inits = {i.name for i in g.initializer}
    for kind, vis in (("input", [v for v in g.input if v.name not in inits]), ("output", list(g.output))):
        for vi in vis:
            _check_value_type(vi, kind, where)
    for init in g.initializer:
        if init.data_type not in ONNX_DTYPES and init.data_type not in WIDENED:
            raise CaptureError(f"initializer {init.name!r} has element type {type_name(init.data_type)}, which "
                               "graphmode has no dtype for", where=where, value=type_name(init.data_type),
                               fix=f"store it as one of {SUPPORTED_TYPES}")
        bad = [d for d in init.dims if not 0 <= d <= MAX_DIM]
        if bad:
            raise CaptureError(f"initializer {init.name!r} has dims {list(init.dims)}; each must be in "
                               f"[0, {MAX_DIM}]", where=where, value=list(init.dims),
                               fix="the file is corrupt or was edited by hand: re-export the model")


def _check_value_type(vi, kind: str, where: str) -> None:
    head = f"graph {kind} {vi.name!r}"
    fix_type = ("declare it with onnx.helper.make_tensor_value_info(name, TensorProto.FLOAT, shape), or "
                "re-export the model")
    if not vi.HasField("type"):
        raise CaptureError(f"{head} has no type", where=where, fix=fix_type)
    if not vi.type.HasField("tensor_type"):
        raise CaptureError(f"{head} is a {vi.type.WhichOneof('value')}, not a tensor", where=where,
                           value=vi.type.WhichOneof("value"),
                           fix="graphmode binds tensor inputs and outputs only: re-export with tensors")
    tt = vi.type.tensor_type
    if tt.elem_type not in ONNX_DTYPES:
        raise CaptureError(f"{head} has element type {type_name(tt.elem_type)}, which graphmode has no dtype for",
                           where=where, value=type_name(tt.elem_type),
                           fix=f"use one of {SUPPORTED_TYPES} (cast it in the model); " + fix_type)
    if tt.HasField("shape"):
        for i, d in enumerate(tt.shape.dim):
            if d.HasField("dim_param") and not isinstance(d.dim_param, str):      # protobuf's bytes: not UTF-8
                raise CaptureError(f"{head} dim {i}'s name is not UTF-8 text: the file is damaged", where=where,
                                   value=d.dim_param,
                                   fix="copy the file again whole, or re-export the model")
            if d.HasField("dim_value") and not 0 <= d.dim_value <= MAX_DIM:
                raise CaptureError(f"{head} dim {i} is {d.dim_value}; a static dim must be in [0, {MAX_DIM}]",
                                   where=where, value=d.dim_value,
                                   fix="give the dim its real size, or a name (dim_param) to make it dynamic")


# ---------------------------------------------------------------------------- 2./5. ONNX's checks


def _light(model):
    """The model with large initializers presented as typed graph inputs.

    Serialising a GPT-2 sized model for the checker costs seconds; the checks are about
    the graph's structure and types, so only small initializers (whose values shape
    inference may need: shapes, axes) keep their data.
    """
    from onnx import helper
    gp = model.graph
    small, big = [], []
    for init in gp.initializer:
        (big if math.prod(init.dims) > LIGHT_LIMIT else small).append(init)
    declared = {v.name for v in gp.input}
    light_graph = helper.make_graph(
        list(gp.node), gp.name or "main", list(gp.input) + [
            helper.make_tensor_value_info(i.name, i.data_type, list(i.dims)) for i in big if i.name not in declared],
        list(gp.output), initializer=small, value_info=list(gp.value_info))
    light = helper.make_model(light_graph, opset_imports=list(model.opset_import), ir_version=model.ir_version)
    light.functions.extend(model.functions)
    return light


_NODE_REFS = (re.compile(r"\(op_type:(?P<op>[\w.]+), node name: (?P<name>[^)]*)\)"),
              re.compile(r"[Nn]ame: (?P<name>\S*) OpType: (?P<op>[\w.]+)"),
              re.compile(r"Node\((?P<name>[^)]*)\) with schema\(\S*?::(?P<op>\w+):"))


def _onnx_error(e: Exception, model, label: str, what: str, fix: str,
                describe: Callable[[Any], list[str]] | None = None) -> CaptureError:
    """An onnx checker / inference exception as a CaptureError whose `where` is the node it names.

    Strict inference reports the first broken node and then one error per node downstream
    that lost its input type; only the first is the cause.
    """
    text = " ".join(ln.strip() for ln in str(e).strip().splitlines() if ln.strip()) or type(e).__name__
    text = re.sub(r"^\[\w+\] Inference error\(s\): ", "", text)
    hits = list(_NODE_REFS[0].finditer(text))
    if len(hits) > 1:
        text = text[:hits[1].start()].rstrip() + f" (and {len(hits) - 1} follow-on error(s) in later nodes)"
    if len(text) > 600:
        text = text[:600] + "..."
    where, value = f"onnx {label}", None
    ref = next((m for p in _NODE_REFS for m in [p.search(text)] if m), None)
    if ref is not None:
        found = [(i, n) for i, n in enumerate(model.graph.node)
                 if n.op_type == ref["op"] and n.name == ref["name"].strip()]
        if found:
            idx, n = found[0]
            where = node_where(label, idx, n)
            attr = re.search(r"[Aa]ttribute:? '?(\w+)'?", text)
            if attr:
                value = node_attrs(n).get(attr.group(1))
            if value is None and describe is not None:
                value = describe(n)
        else:
            where = f"onnx {label} {ref['op']} node {ref['name'].strip()!r}"
    return CaptureError(f"{what}: {text}", where=where, value=value, fix=fix)


def _run_checker(light, model, label: str) -> None:
    import onnx
    try:
        onnx.checker.check_model(light)
    except Exception as e:  # noqa: BLE001 - onnx.checker.ValidationError and friends
        raise _onnx_error(e, model, label, "ONNX model fails onnx.checker",
                          "the model breaks the ONNX spec here: re-export it; if it was edited by hand, fix the "
                          "node or value named above") from None


def _lenient_types(light, data_prop: bool):
    """What ONNX infers on its own, ignoring the model's value_info (a wrong declaration there is
    the strict pass's to report, not something the attribute rules should trust). Best effort:
    inference stops propagating past a broken node."""
    import onnx
    bare = onnx.ModelProto()
    bare.CopyFrom(light)
    del bare.graph.value_info[:]
    try:
        return onnx.shape_inference.infer_shapes(bare, data_prop=data_prop)
    except Exception:  # noqa: BLE001 - the strict pass reports it
        return bare


def _strict_types(light, model, label: str, types: "ValueTypes", data_prop: bool):
    import onnx
    try:
        return onnx.shape_inference.infer_shapes(light, check_type=True, strict_mode=True, data_prop=data_prop)
    except Exception as e:  # noqa: BLE001 - onnx.shape_inference.InferenceError and friends
        raise _onnx_error(e, model, label, "ONNX model fails strict shape inference",
                          "the node's inputs or attributes are inconsistent (onnx.shape_inference.infer_shapes("
                          "m, check_type=True, strict_mode=True) reproduces this): re-export the model, or fix the "
                          "node named above", describe=types.describe_inputs) from None


# ---------------------------------------------------------------------------- 3. opset, op types


def _check_opset(model, label: str):
    """(the model as the importer reads it, its opset as written): see capture/onnx/opsets.py."""
    from onnx import defs

    from graphmode.capture.onnx.opsets import bring_in, model_opset
    opset = model_opset(model)
    if opset is not None and opset > defs.onnx_opset_version():
        raise CaptureError(f"ONNX opset {opset} is newer than the installed onnx package knows "
                           f"({defs.onnx_opset_version()})", where=f"onnx {label}", value=opset,
                           fix="re-export with an opset the installed onnx knows, or upgrade onnx")
    return bring_in(model, label)


def _check_op_types(model, label: str, supported: Collection[str], origins: Mapping[str, tuple[int, Any]]) -> None:
    bad: dict[str, list[str]] = defaultdict(list)
    for i, n in enumerate(model.graph.node):
        if n.domain in ("", "ai.onnx") and n.op_type in supported:
            continue
        key = n.op_type if n.domain in ("", "ai.onnx") else f"{n.domain}::{n.op_type}"
        origin = origins.get(n.output[0]) if n.output else None
        if origin is not None:      # a node of a function body: the file's node it expands, named
            j, call = origin
            bad[call.op_type].append(f"{call.name or f'#{j} -> {call.output[0]}'}: its function body uses {key}")
            continue
        bad[key].append(n.name or f"#{i} -> {n.output[0] if n.output else '?'}")
    bad = {k: list(dict.fromkeys(v)) for k, v in bad.items()}
    if bad:
        parts = []
        for op, names in sorted(bad.items()):
            shown = ", ".join(names[:5]) + (f", ... {len(names) - 5} more" if len(names) > 5 else "")
            parts.append(f"{op} x{len(names)} ({shown})")
        raise CaptureError(f"ONNX model uses {sum(len(v) for v in bad.values())} node(s) of "
                           f"{len(bad)} op type(s) graphmode cannot import: " + "; ".join(parts),
                           where=f"onnx {label}", value=sorted(bad),
                           fix="an ONNX file's nodes have no per-op fallback (a PyTorch model's unsupported ATen ops run "
                               "eagerly as islands): re-export without these ops (another opset or exporter; "
                               "ONNX Runtime's QOperator format -> its QDQ format), replace them in the model, "
                               "or compile the PyTorch module instead")


# ---------------------------------------------------------------------------- 4. attribute ranges


def _constant_sizes(g: ValueTypes) -> bool:
    """Range / ConstantOfShape sized by constants, checked before ONNX's inference sees them.

    ONNX's data propagation stores every value of such a 1-d output (~140 bytes each: a
    corrupt size of 2**40 is an out-of-memory kill, not an error), and the importer folds a
    constant Range into a tensor. Returns whether data propagation is affordable here.
    """
    affordable = True
    for idx, n in enumerate(g.model.graph.node):
        if n.op_type not in ("Range", "ConstantOfShape"):
            continue
        nd = CheckedNode(g, idx, n)
        if n.op_type == "Range":
            vals = [nd.const(i) for i in range(3)]
            if vals[2] is not None and vals[2].size == 1 and vals[2].reshape(-1)[0] == 0:
                raise nd.fail(f"delta {nd.input(2)!r} is 0, so the range never ends", 0, "use a non-zero delta")
            if any(v is None or v.size != 1 for v in vals):
                continue
            start, limit, delta = (v.reshape(-1)[0].item() for v in vals)
            if not all(math.isfinite(v) for v in (start, limit, delta)):
                raise nd.fail(f"start={start}, limit={limit}, delta={delta}: they must be finite", [start, limit, delta],
                              "fix the Range inputs in the model")
            count = max(0, math.ceil((limit - start) / delta))
            if count > MAX_FOLD:
                raise nd.fail(f"start={start}, limit={limit}, delta={delta} makes {count} elements; graphmode folds a "
                              f"constant Range at import and allows at most {MAX_FOLD}", count,
                              "compute the range from a run-time shape, or make it smaller")
        else:
            shape = nd.const(0)
            if shape is None:
                continue
            vals = [int(v) for v in shape.reshape(-1)]
            if any(not 0 <= v <= MAX_DIM for v in vals):
                raise nd.fail(f"shape {nd.input(0)!r} = {vals}: every dim must be in [0, {MAX_DIM}]", vals,
                              "fix the shape in the model")
            count = vals[0] if len(vals) == 1 else 0   # only 1-d outputs are propagated as data
        affordable = affordable and count <= DATA_PROP_LIMIT
    return affordable


def _check_attributes(g: ValueTypes, checks: Mapping[str, Callable[[CheckedNode], None]]) -> None:
    for idx, n in enumerate(g.model.graph.node):
        nd = CheckedNode(g, idx, n)
        for f in _FLAGS:
            nd.flag(f)
        check = checks.get(n.op_type)
        if check is not None:
            check(nd)


def _check_inferred_dims(inferred, model, label: str) -> None:
    """Every inferred static dim in [0, MAX_DIM]: a huge Expand/ConstantOfShape/Reshape target is refused
    at the node that makes it, not in the memory planner."""
    producer = {o: i for i, n in enumerate(model.graph.node) for o in n.output}
    for vi in list(inferred.graph.value_info) + list(inferred.graph.output):
        if not vi.type.HasField("tensor_type") or not vi.type.tensor_type.HasField("shape"):
            continue
        dims = [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in
                vi.type.tensor_type.shape.dim]
        bad = [d for d in dims if isinstance(d, int) and not 0 <= d <= MAX_DIM]
        if bad and vi.name in producer:
            idx = producer[vi.name]
            raise CaptureError(f"{model.graph.node[idx].op_type} output {vi.name!r} would have shape {dims}; a dim "
                               f"must be in [0, {MAX_DIM}]", where=node_where(label, idx, model.graph.node[idx]),
                               value=bad[0], fix="fix the target shape / sizes this node reads")


# ---------------------------------------------------------------------------- entry point


def _reads(node) -> set[str]:
    """The values `node` reads: its inputs, and what its subgraphs (If, Loop, Scan bodies) read
    from outside themselves."""
    out = set(node.input)
    for a in node.attribute:
        for sub in ([a.g] if a.HasField("g") else []) + list(a.graphs):
            inner = {v.name for v in sub.input} | {t.name for t in sub.initializer} | \
                {o for n in sub.node for o in n.output}
            out |= {x for n in sub.node for x in _reads(n)} - inner
    return out


def topo_sorted(model):
    """`model` with its top-level nodes in an order where each comes after the nodes it reads
    (the order kept where it already is one). ONNX asks for that order, ONNX Runtime does not:
    onnxconverter's fp16 pass with keep_io_types appends the input casts at the end. A graph
    with a cycle, or a node reading a value nothing makes, is left for the checker to name."""
    import onnx
    g = model.graph
    made = {v.name for v in g.input} | {t.name for t in g.initializer} | {""}
    maker = {o: i for i, n in enumerate(g.node) for o in n.output}
    reads = [_reads(n) for n in g.node]
    seen = set(made)
    for n, r in zip(g.node, reads):
        if not r <= seen | {x for x in r if x not in maker}:
            break
        seen.update(n.output)
    else:
        return model                               # already in order
    import heapq
    if any(x not in made and x not in maker for n in g.node for x in n.input):
        return model
    needs = [{maker[x] for x in r if x not in made and x in maker} for r in reads]
    users: dict[int, list[int]] = {}
    for i, deps in enumerate(needs):
        for d in deps:
            users.setdefault(d, []).append(i)
    waiting = [len(d) for d in needs]
    ready = [i for i, w in enumerate(waiting) if w == 0]
    order = []
    while ready:                                  # Kahn's order, the model's own among the ready ones
        i = heapq.heappop(ready)
        order.append(i)
        for u in users.get(i, ()):
            waiting[u] -= 1
            if waiting[u] == 0:
                heapq.heappush(ready, u)
    if len(order) != len(g.node):                  # a cycle
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    del out.graph.node[:]
    out.graph.node.extend(g.node[i] for i in order)
    return out


def validate_onnx(model, label: str, supported_ops: Collection[str],
                  checks: Mapping[str, Callable[[CheckedNode], None]],
                  origins: Mapping[str, tuple[int, Any]] | None = None) -> tuple[Any, int, list]:
    """Refuse `model` with a CaptureError unless graphmode can import and run it; `checks`
    holds each op type's attribute check (the importer's, registered with the handlers);
    `origins` maps the nodes function bodies brought in to the file's nodes they expand
    (functions.body_origins), so an error names the node the user wrote.

    Returns the model as the importer reads it (relabelled or converted to a known opset),
    its default-domain opset as written and ONNX's inferred value_info (the importer
    cross-checks its own types against it).
    """
    check_signature(model, f"onnx {label}")
    model, opset = _check_opset(model, label)
    light = _light(model)
    _run_checker(light, model, label)
    _check_op_types(model, label, supported_ops, origins or {})
    types = ValueTypes(model, light, label, origins)
    data_prop = _constant_sizes(types)
    types.add_types(_lenient_types(light, data_prop))
    _check_attributes(types, checks)
    inferred = _strict_types(light, model, label, types, data_prop)
    _check_inferred_dims(inferred, model, label)
    return model, opset, list(inferred.graph.value_info)
