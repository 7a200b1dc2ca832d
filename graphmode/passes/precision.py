"""precision: run float ops in the recipe's compute dtype, with per-op overrides.

Every f32 value an op reads is cast (once, cached per value) to the dtype that op computes
in: `precision.compute`, or `precision.overrides[op]` (e.g. softmax and layer_norm kept in
f32). Shape and data-movement ops keep whatever dtype they receive. Graph outputs are cast
back to their captured dtype under their original names, so callers see no change. With
compute f32 and no overrides the pass changes nothing. Runs before constant_fold, which then
folds the casts of weights into low-precision constants.
"""
from __future__ import annotations

from graphmode.ir.graph import Graph, Node
from graphmode.ir.ops import get_op
from graphmode.ir.types import FLOAT_DTYPES
from graphmode.passes.base import PassContext, PassResult, register_pass


@register_pass("precision")
def run(graph: Graph, ctx: PassContext) -> PassResult:
    opts = ctx.opts("precision")
    compute = opts.compute
    overrides = dict(opts.overrides)
    if compute == "f32" and all(v == "f32" for v in overrides.values()):
        return PassResult(graph, False, {"compute": compute})
    _unmatched(graph, {op: dt for op, dt in overrides.items() if dt != compute})
    g = graph.clone(nodes=[])
    casts: dict[tuple[str, str], str] = {}
    n_casts = 0
    lowered: dict[str, int] = {}

    def as_dtype(v: str, dt: str) -> str:
        nonlocal n_casts
        ty = g.type_of(v)
        if ty.dtype == dt or ty.dtype not in FLOAT_DTYPES:
            return v
        key = (v, dt)
        if key not in casts:
            casts[key], = g.add_node("cast", [v], [ty.with_dtype(dt)], {"dtype": dt},
                                     names=[g.fresh_name(f"{v}_{dt}")])
            n_casts += 1
        return casts[key]

    for n in graph.nodes:
        spec = get_op(n.op)
        if n.op == "fallback":   # eager islands see the dtypes they were captured with
            g.nodes.append(n.with_(inputs=tuple(as_dtype(i, graph.values[i].type.dtype) for i in n.inputs)))
            continue
        if n.op in ("fused", "cast") or not spec.has("compute_dtype"):
            g.nodes.append(n)
            if n.op not in ("fused", "cast"):   # data movement: types follow the inputs
                _retype(g, n)
            continue
        want = overrides.get(n.op, compute)
        ins = [as_dtype(i, want) for i in n.inputs]
        node = n.with_(inputs=tuple(ins))
        g.nodes.append(node)
        _retype(g, node)
        if want != "f32":
            lowered[n.op] = lowered.get(n.op, 0) + 1
    # graph outputs keep their captured dtypes and names
    outputs = []
    for o in graph.outputs:
        want = graph.values[o].type.dtype
        if g.type_of(o).dtype != want:
            inner = g.fresh_name(f"{o}_{g.type_of(o).dtype}")
            _rename(g, o, inner)
            g.add_node("cast", [inner], [g.type_of(inner).with_dtype(want)], {"dtype": want}, names=[o])
            g.values[o] = g.values[o].__class__(o, g.values[o].type, "output")
        outputs.append(o)
    g.outputs = outputs
    return PassResult(g, True, {"compute": compute, "casts": n_casts, "lowered": dict(sorted(lowered.items()))})


def _unmatched(graph: Graph, overrides: dict[str, str]) -> None:
    """Say which overrides name an op this graph does not have: they change nothing (the
    recipe check refuses a name no op has; one a capture replaced, softmax and matmul inside
    an attention captured as sdpa, is only known here)."""
    ops: set[str] = set()

    def walk(gr: Graph) -> None:
        for n in gr.nodes:
            ops.add(n.op)
            if n.body is not None:
                walk(n.body)
    walk(graph)
    missing = sorted(op for op in overrides if op not in ops)
    if not missing:
        return
    import warnings

    from graphmode.errors import GraphmodeNotice
    inside = " (this graph's attention is one sdpa op: override sdpa)" if "sdpa" in ops and set(missing) & {
        "softmax", "matmul", "bmm"} else ""
    warnings.warn(GraphmodeNotice(
        f"precision.overrides: {', '.join(missing)}: this graph has no such op, so the override changes "
        f"nothing{inside}; its ops with a compute dtype: {', '.join(sorted(o for o in ops if _computes(o)))}"))


def _computes(op: str) -> bool:
    try:
        return get_op(op).has("compute_dtype")
    except Exception:  # noqa: BLE001 - an op the registry does not know computes nothing we can cast
        return False


def _retype(g: Graph, n: Node) -> None:
    """Re-infer a node's output types from its (possibly re-typed) inputs."""
    out_types = get_op(n.op).infer([g.type_of(i) for i in n.inputs], n.attrs)
    for o, t in zip(n.outputs, out_types):
        old = g.values[o]
        g.values[o] = old.__class__(o, t, old.role)


def _rename(g: Graph, old: str, new: str) -> None:
    v = g.values.pop(old)
    g.values[new] = v.__class__(new, v.type, "intermediate")
    g.nodes = [m.with_(inputs=tuple(new if i == old else i for i in m.inputs),
                       outputs=tuple(new if o == old else o for o in m.outputs)) for m in g.nodes]
