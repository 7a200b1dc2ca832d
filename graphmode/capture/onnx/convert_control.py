"""ONNX control flow (If, Loop, Scan) unrolled at import time.

The IR has no control flow, and a recipe fixes every extent, so an If whose condition is
known, a Loop whose trip count (or condition) is known at each step, and a Scan over a static
sequence length are expanded into their subgraphs' nodes: one copy per iteration, its internal
values renamed `<node output>/it<i>/<name>`, outer values read by name as ONNX scoping says.
Scan outputs are stacked along their axis. A condition or trip count computed from run-time
data is refused by name, as is unrolling past MAX_UNROLL iterations.
"""
from __future__ import annotations

from graphmode.capture.onnx.fold import _Known, _objarr
from graphmode.capture.onnx.importer import _Importer, _handles, _shape_attr

MAX_UNROLL = 4096


def _renamed(graph, prefix: str) -> tuple[list, dict[str, str]]:
    """The subgraph's nodes with its inputs and internal values renamed under `prefix` (outer
    values keep their names), and the renaming."""
    import onnx
    mapping = {v.name: prefix + v.name for v in [*graph.input, *graph.initializer]}
    mapping.update({o: prefix + o for n in graph.node for o in n.output if o})
    nodes = []
    for n in graph.node:
        c = onnx.NodeProto()
        c.CopyFrom(n)
        c.input[:] = [mapping.get(i, i) for i in n.input]
        c.output[:] = [mapping.get(o, o) for o in n.output]
        for a in c.attribute:              # nested subgraphs read the renamed values by name too
            for g in ([a.g] if a.HasField("g") else []) + list(a.graphs):
                _rename_reads(g, mapping)
        nodes.append(c)
    return nodes, mapping


def _rename_reads(graph, mapping: dict[str, str]) -> None:
    """Rename, in place, the outer values a (nested) subgraph reads (ONNX forbids shadowing, so a
    name in `mapping` is never one of the subgraph's own)."""
    for n in graph.node:
        n.input[:] = [mapping.get(i, i) for i in n.input]
        for a in n.attribute:
            for g in ([a.g] if a.HasField("g") else []) + list(a.graphs):
                _rename_reads(g, mapping)
    for o in graph.output:
        o.name = mapping.get(o.name, o.name)


def _known_scalar(imp: _Importer, name: str, what: str):
    k = imp.need_known(name, what)
    if k.arr.size == 1 and not k.concrete:       # e.g. a loop over the batch: graphmode unrolls it at import
        dims = sorted({str(s) for v in k.arr.flat if hasattr(v, "free_symbols") for s in v.free_symbols})
        expr = str(k.arr.flat[0])
        raise imp.fail(f"{what} follows the dims {', '.join(dims)}{'' if expr in dims else f' ({expr})'}: graphmode "
                       "unrolls control flow when it imports the model, so the count must be one number",
                       fix=f"make {' and '.join(dims)} static: write the size as a number in the recipe's "
                           "inputs[].shape in its place (a recipe per size you serve), or export the model with a "
                           "static size")
    if not k.concrete or k.arr.size != 1:
        raise imp.fail(f"{what} must be a constant scalar", fix="declare it constant in the recipe (inputs[].value)")
    return k.tensor().reshape(-1)[0].item()


def _run_body(imp: _Importer, graph, prefix: str) -> list[str]:
    """Translate one copy of `graph` (its inputs already bound under `prefix`); its outputs' names."""
    nodes, mapping = _renamed(graph, prefix)
    imp.bind_initializers(graph, mapping)       # a branch's or body's own constants
    imp.translate_subgraph(nodes)
    return [mapping.get(o.name, o.name) for o in graph.output]


def _stack(imp: _Importer, parts: list[str], axis: int, out: str) -> None:
    """Stack same-shaped values along a new `axis` into ONNX value `out`."""
    ups = []
    for p in parts:
        t = imp.type_of(p)
        a = axis + t.rank + 1 if axis < 0 else axis
        shape = list(t.shape[:a]) + [1] + list(t.shape[a:])
        ups.append(imp.emit("reshape", [imp.operand(p)], {"shape": _shape_attr(shape)}, hint=out))
    if len(ups) == 1:
        imp.ir[out] = ups[0]
        imp.check_declared(out)
        return
    a = axis + imp.g.type_of(ups[0]).rank if axis < 0 else axis
    imp.emit("concat", ups, {"dim": a}, out=out)


@_handles("If")
def _if(imp: _Importer, n) -> None:
    cond = bool(_known_scalar(imp, n.input[0], "If condition"))
    branch = imp.attr(n, "then_branch" if cond else "else_branch")
    outs = _run_body(imp, branch, f"{n.output[0]}/{'then' if cond else 'else'}/")
    for o, src in zip(n.output, outs):
        if o:
            imp.alias(o, src)


@_handles("Loop")
def _loop(imp: _Importer, n) -> None:
    body = imp.attr(n, "body")
    trip = int(_known_scalar(imp, n.input[0], "Loop trip count")) if imp.opt_in(n, 0) else None
    cond = bool(_known_scalar(imp, n.input[1], "Loop condition")) if imp.opt_in(n, 1) else True
    carried = list(n.input[2:])
    n_scan = len(body.output) - 1 - len(carried)
    collected: list[list[str]] = [[] for _ in range(n_scan)]
    names = [v.name for v in body.input]
    i = 0
    while cond and (trip is None or i < trip):
        if i >= MAX_UNROLL:
            raise imp.fail(f"Loop runs more than {MAX_UNROLL} iterations", fix="a shorter loop, or a static one")
        prefix = f"{n.output[0] or n.name}/it{i}/"
        imp.set_known(prefix + names[0], _Known(_objarr([i], ()), "i64"))
        imp.set_known(prefix + names[1], _Known(_objarr([True], ()), "bool"))
        for b, src in zip(names[2:], carried):
            imp.alias(prefix + b, src)
        outs = _run_body(imp, body, prefix)
        cond = bool(_known_scalar(imp, outs[0], "Loop condition (computed by the body)"))
        carried = outs[1:1 + len(carried)]
        for j, v in enumerate(outs[1 + len(carried):]):
            collected[j].append(v)
        i += 1
    for o, src in zip(n.output, carried):
        if o:
            imp.alias(o, src)
    for o, parts in zip(n.output[len(carried):], collected):
        if not o:
            continue
        if not parts:
            raise imp.fail("a Loop scan output of zero iterations has no shape to build")
        _stack(imp, parts, 0, o)


@_handles("Scan")
def _scan(imp: _Importer, n) -> None:
    if imp.opset < 9:
        raise imp.fail("Scan before opset 9 (with a batch axis)", fix="export with opset 9 or later")
    body = imp.attr(n, "body")
    m = int(imp.attr(n, "num_scan_inputs"))
    n_state = len(n.input) - m
    states, scans = list(n.input[:n_state]), list(n.input[n_state:])
    in_axes = list(imp.attr(n, "scan_input_axes", [0] * m))
    in_dirs = list(imp.attr(n, "scan_input_directions", [0] * m))
    k = len(body.output) - n_state
    out_axes = list(imp.attr(n, "scan_output_axes", [0] * k))
    out_dirs = list(imp.attr(n, "scan_output_directions", [0] * k))
    lengths = set()
    for j, s in enumerate(scans):
        t = imp.type_of(s)
        in_axes[j] = in_axes[j] + t.rank if in_axes[j] < 0 else in_axes[j]
        lengths.add(t.shape[in_axes[j]])
    if len(lengths) != 1 or not isinstance(next(iter(lengths)), int):
        raise imp.fail(f"Scan over sequence lengths {sorted(map(str, lengths))}: one static length is needed",
                       fix="pin the sequence dim in the recipe")
    length = next(iter(lengths))
    if length > MAX_UNROLL:
        raise imp.fail(f"Scan over {length} steps (more than {MAX_UNROLL})")
    names = [v.name for v in body.input]
    collected: list[list[str]] = [[] for _ in range(k)]
    for t_ in range(length):
        prefix = f"{n.output[0] or n.name}/it{t_}/"
        for b, src in zip(names[:n_state], states):
            imp.alias(prefix + b, src)
        for j, (b, src) in enumerate(zip(names[n_state:], scans)):
            pos = t_ if not in_dirs[j] else length - 1 - t_
            st = imp.type_of(src)
            ax = in_axes[j]
            sl = imp.emit("slice", [imp.operand(src)], {"dim": ax, "start": pos, "end": pos + 1, "step": 1},
                          hint=prefix + b)
            shape = list(st.shape[:ax]) + list(st.shape[ax + 1:])
            imp.ir[prefix + b] = imp.emit("reshape", [sl], {"shape": _shape_attr(shape)}, hint=prefix + b)
        outs = _run_body(imp, body, prefix)
        states = outs[:n_state]
        for j, v in enumerate(outs[n_state:]):
            collected[j].append(v)
    for o, src in zip(n.output, states):
        if o:
            imp.alias(o, src)
    for j, o in enumerate(n.output[n_state:]):
        if o:
            parts = collected[j] if not out_dirs[j] else collected[j][::-1]
            _stack(imp, parts, out_axes[j], o)
