"""Which ONNX opsets the importer reads, and how a model written for another one is brought in.

The converters know each op as defined at opsets KNOWN_MIN..KNOWN_MAX (plus the ops defined
later that `NEWER` lists with the newest definition their converter knows). Most version bumps
of an op only widen its type list or add an attribute or optional input with a default, so a
node written for opset 7 or 28 usually *means the same* as at a known opset. That is decided
per node, from the op's schemas, for what the node uses: an attribute or optional input that
one definition has and the other lacks is harmless when the node does not use it; a changed
default is harmless when the node sets the attribute. When every node agrees, the model is
read as is (a model below KNOWN_MIN is relabelled to KNOWN_MIN); when a node of an older model
does not, onnx's version converter upgrades the model; otherwise CaptureError names the nodes.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Any

from graphmode.errors import CaptureError

KNOWN_MIN, KNOWN_MAX = 11, 22
OLDEST = 1                   # opsets below KNOWN_MIN go through the version converter when a node needs it
# ops defined after KNOWN_MAX: the newest definition their converter knows
NEWER: dict[str, int] = {"CumProd": 26, "TensorScatter": 24, "BitCast": 26, "DepthToSpace": 28, "SpaceToDepth": 28}


@lru_cache(maxsize=None)
def _versions(op: str, domain: str) -> tuple[int, ...]:
    from onnx import defs
    return tuple(sorted({s.since_version for s in defs.get_all_schemas_with_history()
                         if s.name == op and s.domain == domain}))


@lru_cache(maxsize=None)
def _schema(op: str, version: int, domain: str = ""):
    from onnx import defs
    try:
        return defs.get_schema(op, version, domain)
    except Exception:  # noqa: BLE001 - onnx.defs.SchemaError: no definition at that opset
        return None


def _default(attr):
    from onnx import helper
    return str(helper.get_attribute_value(attr.default_value)) if attr.default_value.name else None


def _same_for(node, a, b) -> bool:
    """Does `node` mean the same under schemas `a` and `b` (for the attributes and inputs it uses)?"""
    used = {x.name for x in node.attribute}
    for name in set(a.attributes) | set(b.attributes):
        x, y = a.attributes.get(name), b.attributes.get(name)
        if x is None or y is None:
            present = x or y
            if name in used or present.required:
                return False
            continue
        if int(x.type) != int(y.type) or x.required != y.required:
            return False
        if name not in used and _default(x) != _default(y):
            return False
    for formal_a, formal_b, actual in ((a.inputs, b.inputs, list(node.input)), (a.outputs, b.outputs,
                                                                                list(node.output))):
        for i in range(max(len(formal_a), len(formal_b))):
            x = formal_a[i] if i < len(formal_a) else None
            y = formal_b[i] if i < len(formal_b) else None
            if x is None or y is None:
                if i < len(actual) and actual[i]:
                    return False
                continue
            if int(x.option) != int(y.option):
                return False
    return True


def node_span(node, opset: int) -> tuple[int, int] | None:
    """(earliest, latest) definition versions of `node`'s op that mean the same for it as the
    definition at `opset`; None for an op ONNX does not define there."""
    here = _schema(node.op_type, opset, node.domain)
    if here is None:
        return None
    vs = _versions(node.op_type, node.domain)
    i = vs.index(here.since_version)
    lo = hi = i
    while lo > 0 and _same_for(node, _schema(node.op_type, vs[lo - 1], node.domain), here):
        lo -= 1
    while hi + 1 < len(vs) and not _schema(node.op_type, vs[hi + 1], node.domain).deprecated and \
            _same_for(node, _schema(node.op_type, vs[hi + 1], node.domain), here):
        hi += 1
    latest = vs[hi + 1] - 1 if hi + 1 < len(vs) else 10 ** 6
    return vs[lo], latest


def model_opset(model) -> int | None:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)


def _misfits(model, opset: int) -> tuple[list[str], list[str]]:
    """Nodes read differently at every known opset: (newer than known, older than known)."""
    newer, older = [], []
    for i, n in enumerate(model.graph.node):
        if n.domain not in ("", "ai.onnx"):
            continue                   # refused with the other unsupported ops
        span = node_span(n, opset)
        if span is None:
            continue
        lo, hi = span
        label = f"#{i} {n.op_type} {n.name or (n.output[0] if n.output else '')!r} (as of opset {lo})"
        if lo > NEWER.get(n.op_type, KNOWN_MAX):
            newer.append(label)
        elif hi < KNOWN_MIN:
            older.append(label)
    return newer, older


# ops that broadcast before opset 7 only where the node says `broadcast: 1` (opset 7 made them
# broadcast always): read at a known opset, a node without it would broadcast shapes it refuses
LEGACY_BROADCAST = frozenset({"Add", "Sub", "Mul", "Div", "Pow", "And", "Or", "Xor", "Equal", "Greater", "Less",
                              "Gemm"})


def _check_legacy_broadcast(model, where: str) -> None:
    """A node of an opset-1..6 model from LEGACY_BROADCAST without `broadcast: 1` must have
    inputs of one shape (Gemm: C of the output's shape); CaptureError where they differ or cannot
    be told from the model (reading it at opset 7+ would broadcast them, an answer it never had)."""
    import onnx
    strict = [(i, n) for i, n in enumerate(model.graph.node) if n.domain in ("", "ai.onnx")
              and n.op_type in LEGACY_BROADCAST
              and not any(a.name == "broadcast" and a.i == 1 for a in n.attribute)]
    if not strict:
        return
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception:  # noqa: BLE001 - no shapes to compare: every such node is unchecked below
        inferred = model
    g = inferred.graph

    def dims(t) -> tuple | None:
        if not t.HasField("shape"):
            return None
        out = tuple(d.dim_value if d.HasField("dim_value") else d.dim_param or None for d in t.shape.dim)
        return None if None in out else out
    shapes = {v.name: dims(v.type.tensor_type) for v in (*g.input, *g.value_info, *g.output)}
    shapes.update({t.name: tuple(t.dims) for t in g.initializer})
    for i, n in strict:
        a, b = (n.output[0], n.input[2]) if n.op_type == "Gemm" else (n.input[0], n.input[1]) \
            if len(n.input) >= 2 else (None, None)
        if n.op_type == "Gemm" and len(n.input) < 3:
            continue                                   # no C: nothing to broadcast
        sa, sb = shapes.get(a), shapes.get(b)
        if sa is None or sb is None or sa != sb:
            seen = f"{list(sa) if sa is not None else 'unknown'} and {list(sb) if sb is not None else 'unknown'}"
            raise CaptureError(f"#{i} {n.op_type} {n.name or (n.output[0] if n.output else '')!r}: before opset 7 "
                               f"its operands must have one shape unless the node sets broadcast=1; they are {seen}",
                               where=f"{where} node {n.name or i}", value=seen,
                               fix="set the attribute broadcast=1 on the node (the old rule), or re-export the model "
                                   "with opset_version 7 or later")


def _relabel(model, version: int):
    import onnx
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for o in out.opset_import:
        if o.domain in ("", "ai.onnx"):
            o.version = version
    return out


def _lifted(model, opset: int) -> tuple[Any, int]:
    """A model that uses an op newer than the opset it imports (ONNX Runtime's optimizer writes
    LayerNormalization, an opset-17 op, into opset-14 models, and ORT runs them): read at the
    opset that defines every op, when each other node means the same there as at its own."""
    nodes = [n for n in model.graph.node if n.domain in ("", "ai.onnx")]
    later = [next((v for v in _versions(n.op_type, n.domain) if v > opset), None) for n in nodes
             if _schema(n.op_type, opset, n.domain) is None]
    if not later or None in later:
        return model, opset
    lift = max(later)
    spans = [node_span(n, opset) for n in nodes]
    if any(span is not None and span[1] < lift for span in spans):
        return model, opset
    return _relabel(model, lift), lift


def bring_in(model, label: str):
    """`model` as the importer reads it (relabelled or converted when needed) and its opset as
    written; CaptureError when no known definition fits a node."""
    opset = model_opset(model)
    where = f"onnx {label}"
    if opset is None:
        raise CaptureError("the model imports no default-domain (ai.onnx) opset", where=where,
                           fix="re-export the model with an opset_import for the default domain")
    model, opset = _lifted(model, opset)
    if KNOWN_MIN <= opset <= KNOWN_MAX:
        return model, opset
    if opset < 7:
        _check_legacy_broadcast(model, where)
    if opset < OLDEST:
        raise CaptureError(f"ONNX opset {opset} is older than graphmode reads (opsets {OLDEST} and later)",
                           where=where, value=opset,
                           fix="re-export with a current exporter (torch.onnx.export(..., opset_version=17))")
    newer, older = _misfits(model, opset)
    if newer:
        known = ", ".join(f"{k} to opset {v}" for k, v in sorted(NEWER.items()))
        raise CaptureError(f"opset {opset} defines these nodes differently from opsets {KNOWN_MIN}..{KNOWN_MAX}, "
                           f"which graphmode reads{' (and ' + known + ')' if known else ''}: " + "; ".join(newer[:5])
                           + (f"; ... {len(newer) - 5} more" if len(newer) > 5 else ""), where=where, value=opset,
                           fix=f"re-export with opset_version={KNOWN_MAX} (or convert with "
                               f"onnx.version_converter.convert_version(model, {KNOWN_MAX}))")
    scans = [f"#{i} Scan {n.name or n.output[0]!r}" for i, n in enumerate(model.graph.node)
             if n.op_type == "Scan" and n.domain in ("", "ai.onnx")]
    if opset < 9 and scans:
        # onnx's version converter drops Scan-8's batch axis from the model's inputs and outputs,
        # so the converted model would no longer take the data its users feed
        raise CaptureError(f"Scan before opset 9 has a batch axis, which graphmode does not read: {scans[0]}",
                           where=where, value=opset, fix="re-export the model with opset_version 9 or later")
    if older:
        from onnx import version_converter
        try:
            converted = version_converter.convert_version(model, KNOWN_MIN)
        except Exception as e:  # noqa: BLE001 - the converter raises RuntimeError / ConvertError
            msg = str(e).strip().splitlines()
            raise CaptureError(f"opset {opset} defines these nodes differently from opset {KNOWN_MIN} and later, "
                               f"and onnx's version converter cannot upgrade the model "
                               f"({msg[0][:200] if msg else type(e).__name__}): " + "; ".join(older[:5]),
                               where=where, value=opset,
                               fix=f"re-export with opset_version {KNOWN_MIN} or later") from None
        still_newer, still_older = _misfits(converted, model_opset(converted))
        if still_newer or still_older:
            raise CaptureError(f"opset {opset} model converted to opset {KNOWN_MIN} still has nodes graphmode cannot "
                               "read: " + "; ".join((still_newer + still_older)[:5]), where=where, value=opset,
                               fix=f"re-export with opset_version {KNOWN_MIN} or later")
        return converted, opset
    return (_relabel(model, KNOWN_MIN) if opset < KNOWN_MIN else model), opset
