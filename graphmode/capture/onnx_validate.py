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
4. graphmode's per-op attribute ranges (`_RULES`), on the types of a lenient inference
   pass: each message names the attribute, its value and the fix, which ONNX's own
   messages do not (theirs get the node's input types as the value instead);
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
from typing import Any, Callable, Collection, Sequence

import numpy as np

from graphmode.errors import CaptureError

__all__ = ["validate_onnx", "check_signature", "node_where", "ONNX_DTYPES", "MIN_OPSET",
           "MAX_DIM", "MAX_WINDOW", "LIGHT_LIMIT"]

MIN_OPSET = 7               # older models are refused; 7..10 are relabelled or converted (capture/onnx/opsets.py)
MAX_DIM = 2 ** 31 - 1       # a static dim above this is a corrupt model, not a big one
MAX_WINDOW = 2 ** 16 - 1    # kernel / stride / dilation / pad bound (the kernels index with int32)
LIGHT_LIMIT = 4096          # initializers above this many elements reach the checker as typed inputs
DATA_PROP_LIMIT = 2 ** 16   # longest constant-sized 1-d tensor ONNX's data propagation may materialise
MAX_FOLD = 2 ** 24          # longest constant Range the importer folds into a tensor

ONNX_DTYPES = {1: "f32", 2: "u8", 3: "i8", 4: "u16", 5: "i16", 6: "i32", 7: "i64", 9: "bool", 10: "f16", 11: "f64",
               12: "u32", 13: "u64", 16: "bf16"}
_AUTO_PAD = ("NOTSET", "SAME_UPPER", "SAME_LOWER", "VALID")
# 0/1 attributes the converters read as booleans
_FLAGS = ("transA", "transB", "ceil_mode", "count_include_pad", "storage_order", "keepdims", "allowzero",
          "noop_with_empty_axes", "upper", "training_mode", "exclusive", "reverse", "detect_positive",
          "detect_negative")


def node_where(label: str, idx: int, n) -> str:
    """How every ONNX error names a node: file, index, op type and name (or first output)."""
    return f"onnx {label} node #{idx} {n.op_type} {n.name or (n.output[0] if n.output else '')!r}"


def _type_name(elem: int) -> str:
    from onnx import TensorProto
    try:
        return TensorProto.DataType.Name(elem)
    except ValueError:
        return str(elem)


_SUPPORTED_TYPES = ", ".join(sorted(_type_name(t) for t in ONNX_DTYPES))


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
        if init.data_type not in ONNX_DTYPES:
            raise CaptureError(f"initializer {init.name!r} has element type {_type_name(init.data_type)}, which "
                               "graphmode has no dtype for", where=where, value=_type_name(init.data_type),
                               fix=f"store it as one of {_SUPPORTED_TYPES}")
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
        raise CaptureError(f"{head} has element type {_type_name(tt.elem_type)}, which graphmode has no dtype for",
                           where=where, value=_type_name(tt.elem_type),
                           fix=f"use one of {_SUPPORTED_TYPES} (cast it in the model); " + fix_type)
    if tt.HasField("shape"):
        for i, d in enumerate(tt.shape.dim):
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
                value = _attrs(n).get(attr.group(1))
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


def _strict_types(light, model, label: str, types: "_Graph", data_prop: bool):
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


def _check_op_types(model, label: str, supported: Collection[str]) -> None:
    bad: dict[str, list[str]] = defaultdict(list)
    for i, n in enumerate(model.graph.node):
        key = n.op_type if n.domain in ("", "ai.onnx") else f"{n.domain}::{n.op_type}"
        if n.domain not in ("", "ai.onnx") or n.op_type not in supported:
            bad[key].append(n.name or f"#{i} -> {n.output[0] if n.output else '?'}")
    if bad:
        parts = []
        for op, names in sorted(bad.items()):
            shown = ", ".join(names[:5]) + (f", ... {len(names) - 5} more" if len(names) > 5 else "")
            parts.append(f"{op} x{len(names)} ({shown})")
        raise CaptureError(f"ONNX model uses {sum(len(v) for v in bad.values())} node(s) of "
                           f"{len(bad)} op type(s) graphmode cannot import: " + "; ".join(parts),
                           where=f"onnx {label}", value=sorted(bad),
                           fix="ONNX models have no eager fallback: re-export without these ops (another opset or "
                               "exporter), replace them in the model, or compile the PyTorch module instead "
                               "(import_torch keeps unsupported ATen ops as fallback nodes)")


# ---------------------------------------------------------------------------- 4. attribute ranges

Dims = list  # per dim: int (static), str (named) or None (unknown)


def _attrs(n) -> dict[str, Any]:
    from onnx import helper
    out = {}
    for a in n.attribute:
        v = helper.get_attribute_value(a)
        out[a.name] = v.decode(errors="replace") if isinstance(v, bytes) else (list(v) if isinstance(v, Sequence)
                                                                              and not isinstance(v, str) else v)
    return out


class _Node:
    """One node as the rules see it: decoded attributes, its inputs' inferred dims, constants."""

    def __init__(self, v: "_Graph", idx: int, n):
        self.g, self.idx, self.n = v, idx, n
        self.op = n.op_type
        self.attrs = _attrs(n)

    def fail(self, msg: str, value: Any, fix: str) -> CaptureError:
        return CaptureError(f"{self.op} {msg}", where=node_where(self.g.label, self.idx, self.n), value=value,
                            fix=fix)

    def input(self, i: int) -> str | None:
        return self.n.input[i] if len(self.n.input) > i and self.n.input[i] else None

    def dims(self, i: int) -> Dims | None:
        name = self.input(i)
        return self.g.dims.get(name) if name else None

    def const(self, i: int) -> np.ndarray | None:
        name = self.input(i)
        return self.g.const(name) if name else None

    def flag(self, key: str) -> None:
        v = self.attrs.get(key)
        if v is not None and v not in (0, 1):
            raise self.fail(f"attribute {key}={v}: a flag must be 0 or 1", v, f"set {key} to 0 or 1")

    def ints(self, key: str, n: int | None, lo: int, hi: int = MAX_WINDOW) -> list[int] | None:
        """An int-list attribute of length `n` with every value in [lo, hi] (None when absent)."""
        vals = self.attrs.get(key)
        if vals is None:
            return None
        if n is not None and len(vals) != n:
            raise self.fail(f"attribute {key}={vals} has {len(vals)} value(s); this node needs {n}", vals,
                            f"give {key} {n} values (or drop it to use the default)")
        bad = [x for x in vals if not lo <= x <= hi]
        if bad:
            raise self.fail(f"attribute {key}={vals}: {bad[0]} is outside [{lo}, {hi}]", vals,
                            f"every {key} value must be in [{lo}, {hi}]; re-export the model with valid {key}")
        return list(vals)

    def axis(self, key: str, default: int | None, rank: int | None, extra: int = 0) -> None:
        a = self.attrs.get(key, default)
        if a is not None and rank is not None and not -rank <= a < rank + extra:
            raise self.fail(f"attribute {key}={a} is out of range for a rank-{rank} input "
                            f"(valid: {-rank}..{rank + extra - 1})", a, f"use an {key} in that range")


class _Graph:
    """The model as the rules see it: value types (initializers, then inferred) and small constants."""

    def __init__(self, model, light, label: str):
        self.label = label
        self.model = model
        self.dims: dict[str, Dims | None] = {}
        self.elem: dict[str, int] = {}
        for init in model.graph.initializer:
            self.elem[init.name] = init.data_type
            self.dims[init.name] = [int(d) for d in init.dims]
        self._small = {i.name: i for i in light.graph.initializer}
        self._constants = {n.output[0]: n for n in model.graph.node if n.op_type == "Constant" and n.output}
        self._cache: dict[str, np.ndarray | None] = {}

    def add_types(self, inferred) -> None:
        gi = inferred.graph
        for vi in list(gi.input) + list(gi.value_info) + list(gi.output):
            if vi.type.HasField("tensor_type"):
                tt = vi.type.tensor_type
                self.elem[vi.name] = tt.elem_type
                self.dims[vi.name] = None if not tt.HasField("shape") else [
                    int(d.dim_value) if d.HasField("dim_value") else (d.dim_param or None) for d in tt.shape.dim]

    def describe_inputs(self, n) -> list[str]:
        """A node's inputs as 'name: TYPE[dims]' (what ONNX's messages call by schema names: W, B...)."""
        out = []
        for name in n.input:
            if not name:
                continue
            dims = self.dims.get(name)
            shape = "?" if dims is None else ",".join("?" if d is None else str(d) for d in dims)
            out.append(f"{name}: {_type_name(self.elem[name]) if name in self.elem else '?'}[{shape}]")
        return out

    def const(self, name: str) -> np.ndarray | None:
        """A small initializer's or a Constant node's value (None when run-time or unreadable)."""
        if name not in self._cache:
            from onnx import numpy_helper
            value = None
            try:
                if name in self._small:
                    value = numpy_helper.to_array(self._small[name])
                elif name in self._constants:
                    a = _attrs(self._constants[name])
                    if "value" in a:
                        value = numpy_helper.to_array(a["value"])
                    for key, dt in (("value_int", np.int64), ("value_ints", np.int64), ("value_float", np.float32),
                                    ("value_floats", np.float32)):
                        if key in a:
                            value = np.array(a[key], dtype=dt)
            except Exception:  # noqa: BLE001 - the importer reports unreadable tensors with their name
                value = None
            self._cache[name] = value
        return self._cache[name]


def _window(nd: _Node, sp: int | None, x: Dims | None, kernel: Sequence[int] | None, ceil: bool) -> None:
    """Strides, dilations, pads and auto_pad of a Conv/pool; every output spatial dim >= 1."""
    if sp is None and kernel is not None:   # the input's rank is unknown (an earlier node is broken)
        sp = len(kernel)
    strides = nd.ints("strides", sp, 1) or [1] * (sp or 0)
    dil = nd.ints("dilations", sp, 1) or [1] * (sp or 0)
    auto = nd.attrs.get("auto_pad", "NOTSET") or "NOTSET"
    if auto not in _AUTO_PAD:
        raise nd.fail(f"attribute auto_pad={auto!r} is not one of {', '.join(_AUTO_PAD)}", auto,
                      "use NOTSET with explicit pads (what torch.onnx.export writes)")
    if auto != "NOTSET" and "pads" in nd.attrs:
        raise nd.fail(f"sets both auto_pad={auto} and pads={nd.attrs['pads']}; ONNX allows one of them", auto,
                      "drop pads, or set auto_pad to NOTSET")
    pads = nd.ints("pads", 2 * sp if sp is not None else None, 0) or [0] * (2 * (sp or 0))
    if nd.op in ("MaxPool", "AveragePool") and kernel is not None and len(pads) == 2 * len(kernel):
        for i, k in enumerate(kernel):   # else a window can lie wholly in the padding (no value to pool)
            if max(pads[i], pads[i + len(kernel)]) >= k:
                raise nd.fail(f"attribute pads={pads}: spatial dim {i} pads {max(pads[i], pads[i + len(kernel)])}, "
                              f"not less than its kernel {k} (ONNX Runtime's rule too)", pads,
                              "pad less than the kernel, or pad the input with an explicit Pad node")
    if x is None or kernel is None or sp is None or len(x) != sp + 2:
        return
    for i in range(sp):
        size = x[2 + i]
        if not isinstance(size, int) or auto in ("SAME_UPPER", "SAME_LOWER"):
            continue
        lo, hi = (pads[i], pads[i + sp]) if auto == "NOTSET" else (0, 0)
        num = size + lo + hi - dil[i] * (kernel[i] - 1) - 1
        out = (-(-num // strides[i]) if ceil else num // strides[i]) + 1
        if out < 1 or num < 0:
            raise nd.fail(f"spatial dim {i}: the window (kernel {kernel[i]}, dilation {dil[i]}) is larger than the "
                          f"padded input ({size} + pads {lo}+{hi}), so the output would be empty", list(kernel),
                          "use a smaller kernel or dilation, or more padding, or feed a larger input")


def _spatial(nd: _Node, *ranked: Dims | None) -> int | None:
    rank = next((len(d) for d in ranked if d is not None), None)
    if rank is not None and rank < 3:
        raise nd.fail(f"input has rank {rank}; it needs [N, C, spatial...] (rank >= 3)", rank,
                      "feed an NCHW tensor")
    return rank - 2 if rank is not None else None


def _conv(nd: _Node) -> None:
    x, w = nd.dims(0), nd.dims(1)
    sp = _spatial(nd, x, w)
    if x is not None and w is not None and len(x) != len(w):
        raise nd.fail(f"weight {nd.input(1)!r} has rank {len(w)}, the input has rank {len(x)}", w,
                      "a Conv weight is [out_channels, in_channels / group, kernel...]")
    kernel = nd.ints("kernel_shape", sp, 1)
    wk = w[2:] if w is not None else None
    if kernel is not None and wk is not None and any(isinstance(a, int) and a != b for a, b in zip(wk, kernel)):
        raise nd.fail(f"attribute kernel_shape={kernel} does not match the weight {nd.input(1)!r} {w}", kernel,
                      f"drop kernel_shape (it follows from the weight) or set it to {wk}")
    if kernel is None and wk is not None and all(isinstance(k, int) for k in wk):
        kernel = list(wk)
        bad = [k for k in kernel if not 1 <= k <= MAX_WINDOW]
        if bad:
            raise nd.fail(f"weight {nd.input(1)!r} {w} has a kernel size {bad[0]} outside [1, {MAX_WINDOW}]", w,
                          "re-export the model with a valid weight")
    group = nd.attrs.get("group", 1)
    if not 1 <= group <= MAX_DIM:
        raise nd.fail(f"attribute group={group} must be >= 1", group, "use group=1 for a dense convolution")
    cin = x[1] if x is not None else None
    if w is not None and isinstance(w[0], int) and w[0] % group:
        raise nd.fail(f"attribute group={group} does not divide the weight's {w[0]} output channels "
                      f"(weight {nd.input(1)!r} {w})", group, "use a group that divides both channel counts")
    if isinstance(cin, int) and w is not None and isinstance(w[1], int) and w[1] * group != cin:
        raise nd.fail(f"attribute group={group}: the weight {nd.input(1)!r} {w} takes {w[1]} channel(s) per group, "
                      f"so the input needs {w[1] * group} channels, but it has {cin}", group,
                      f"set group to {cin // w[1] if w[1] and cin % w[1] == 0 else 'in_channels / weight.shape[1]'} "
                      "or re-export the model")
    b = nd.dims(2)
    if b is not None and w is not None and (len(b) != 1 or isinstance(b[0], int) and isinstance(w[0], int)
                                            and b[0] != w[0]):
        raise nd.fail(f"bias {nd.input(2)!r} has shape {b}, the weight has {w[0]} output channels", b,
                      f"give the bias shape [{w[0]}]")
    _window(nd, sp, x, kernel, ceil=False)


def _pool(nd: _Node) -> None:
    x = nd.dims(0)
    sp = _spatial(nd, x)
    for f in ("ceil_mode", "count_include_pad", "storage_order"):
        nd.flag(f)
    kernel = nd.ints("kernel_shape", sp, 1)
    _window(nd, sp, x, kernel, ceil=bool(nd.attrs.get("ceil_mode", 0)))


def _gemm(nd: _Node) -> None:
    for key in ("alpha", "beta"):
        v = nd.attrs.get(key)
        if v is not None and not math.isfinite(v):
            raise nd.fail(f"attribute {key}={v} is not finite", v, f"set {key} to a finite number (default 1.0)")
    a, b, c = nd.dims(0), nd.dims(1), nd.dims(2)
    if a is None or b is None or len(a) != 2 or len(b) != 2:
        return
    ta, tb = nd.attrs.get("transA", 0), nd.attrs.get("transB", 0)
    (m, ka), (kb, n) = (a[::-1] if ta else a), (b[::-1] if tb else b)
    if isinstance(ka, int) and isinstance(kb, int) and ka != kb:
        raise nd.fail(f"inputs A {nd.input(0)!r} {a} (transA={ta}) and B {nd.input(1)!r} {b} (transB={tb}) do not "
                      f"multiply: inner dims {ka} and {kb}", [a, b],
                      "fix transA/transB or the weight's layout (a torch Linear weight [out, in] needs transB=1)")
    if c is None:
        return
    want = [m, n]
    ok = len(c) <= 2 and all(cd == 1 or not isinstance(cd, int) or not isinstance(t, int) or cd == t
                             for cd, t in zip(c[::-1], want[::-1]))
    if not ok:
        raise nd.fail(f"input C {nd.input(2)!r} {c} does not broadcast to the product's shape {want}", c,
                      f"give C a shape that broadcasts to {want} (e.g. [{n}])")


def _batch_norm(nd: _Node) -> None:
    x = nd.dims(0)
    ch = x[1] if x is not None and len(x) >= 2 else None
    for i, what in ((1, "scale"), (2, "B"), (3, "mean"), (4, "var")):
        d = nd.dims(i)
        if d is not None and (len(d) != 1 or isinstance(ch, int) and isinstance(d[0], int) and d[0] != ch):
            raise nd.fail(f"input {what} {nd.input(i)!r} has shape {d}; it needs one value per channel ({ch})", d,
                          f"give {what} the shape [{ch}]")
    _finite_eps(nd)


def _finite_eps(nd: _Node) -> None:
    eps = nd.attrs.get("epsilon")
    if eps is not None and not (math.isfinite(eps) and eps >= 0):
        raise nd.fail(f"attribute epsilon={eps} must be finite and >= 0", eps, "use e.g. epsilon=1e-5")


def _layer_norm(nd: _Node) -> None:
    x = nd.dims(0)
    nd.axis("axis", -1, len(x) if x is not None else None)
    _finite_eps(nd)
    if x is None:
        return
    axis = nd.attrs.get("axis", -1) % len(x)
    want = x[axis:]
    for i, what in ((1, "Scale"), (2, "B")):
        d = nd.dims(i)
        if d is not None and (len(d) != len(want) or any(isinstance(p, int) and isinstance(q, int) and p != q
                                                         for p, q in zip(d, want))):
            raise nd.fail(f"input {what} {nd.input(i)!r} has shape {d}; graphmode needs exactly the normalized "
                          f"shape {want} (axis {nd.attrs.get('axis', -1)})", d,
                          f"store {what} with shape {want} (expand it in the model if it was broadcast)")


def _reshape(nd: _Node) -> None:
    s = nd.const(1)
    if s is None:
        return
    vals = [int(v) for v in s.reshape(-1)]
    if sum(v == -1 for v in vals) > 1 or any(v < -1 for v in vals) or \
            (nd.attrs.get("allowzero", 0) and 0 in vals and -1 in vals):
        raise nd.fail(f"shape {nd.input(1)!r} = {vals} is invalid: at most one -1, no value below -1 (and with "
                      "allowzero=1 no 0 next to a -1)", vals, "re-export the model with a valid target shape")


def _gather(nd: _Node) -> None:
    x = nd.dims(0)
    rank = len(x) if x is not None else None
    nd.axis("axis", 0, rank)
    idx = nd.const(1)
    if idx is None or rank is None or not np.issubdtype(idx.dtype, np.integer):
        return
    size = x[nd.attrs.get("axis", 0) % rank]
    if isinstance(size, int) and idx.size and (int(idx.min()) < -size or int(idx.max()) >= size):
        bad = int(idx.max()) if int(idx.max()) >= size else int(idx.min())
        raise nd.fail(f"constant indices {nd.input(1)!r} hold {bad}, out of range for a dim of size {size} "
                      f"(valid: {-size}..{size - 1})", bad, "fix the indices in the model")


def _transpose(nd: _Node) -> None:
    perm, x = nd.attrs.get("perm"), nd.dims(0)
    if perm is not None and x is not None and sorted(perm) != list(range(len(x))):
        raise nd.fail(f"attribute perm={perm} is not a permutation of the input's {len(x)} axes", perm,
                      f"give perm as an ordering of {list(range(len(x)))}")


def _axis_of(extra: int = 0, default: int | None = 0) -> Callable[[_Node], None]:
    def rule(nd: _Node) -> None:
        x = nd.dims(0)
        nd.axis("axis", default, len(x) if x is not None else None, extra)
    return rule


def _axes(nd: _Node) -> None:
    """Squeeze/Unsqueeze/Reduce*: axes in range and distinct."""
    x = nd.dims(0)
    vals = nd.attrs.get("axes")
    if vals is None:
        c = nd.const(1)
        vals = [int(v) for v in c.reshape(-1)] if c is not None and np.issubdtype(c.dtype, np.integer) else None
    if vals is None or x is None:
        return
    rank = len(x) + (len(vals) if nd.op == "Unsqueeze" else 0)
    norm = [v % rank if -rank <= v < rank else None for v in vals]
    if None in norm or len(set(norm)) != len(norm):
        raise nd.fail(f"axes {vals} must be distinct and in {-rank}..{rank - 1}", vals,
                      "fix the axes in the model")


def _split(nd: _Node) -> None:
    x = nd.dims(0)
    rank = len(x) if x is not None else None
    nd.axis("axis", 0, rank)
    sizes = nd.attrs.get("split")
    if sizes is None and nd.const(1) is not None:
        sizes = [int(v) for v in nd.const(1).reshape(-1)]
    if sizes is None or rank is None:
        return
    dim = x[nd.attrs.get("axis", 0) % rank]
    if any(s < 0 for s in sizes) or isinstance(dim, int) and sum(sizes) != dim or len(sizes) != len(nd.n.output):
        raise nd.fail(f"split sizes {sizes} must be >= 0, one per output ({len(nd.n.output)}), and sum to the "
                      f"split dim ({dim})", sizes, "fix the split sizes in the model")


def _cumsum(nd: _Node) -> None:
    x, a = nd.dims(0), nd.const(1)
    if x is not None and a is not None and a.size == 1 and not -len(x) <= int(a.reshape(-1)[0]) < len(x):
        raise nd.fail(f"axis {nd.input(1)!r} = {int(a.reshape(-1)[0])} is out of range for a rank-{len(x)} input",
                      int(a.reshape(-1)[0]), f"use an axis in {-len(x)}..{len(x) - 1}")


def _constant(nd: _Node) -> None:
    t = nd.attrs.get("value")
    if t is not None and t.data_type not in ONNX_DTYPES:
        raise nd.fail(f"value has element type {_type_name(t.data_type)}, which graphmode has no dtype for",
                      _type_name(t.data_type), f"use one of {_SUPPORTED_TYPES}, or remove the constant")


_RULES: dict[str, Callable[[_Node], None]] = {
    "Conv": _conv, "MaxPool": _pool, "AveragePool": _pool, "Gemm": _gemm, "BatchNormalization": _batch_norm,
    "LayerNormalization": _layer_norm, "Reshape": _reshape, "Gather": _gather, "Transpose": _transpose,
    "Softmax": _axis_of(default=-1), "LogSoftmax": _axis_of(default=-1), "Concat": _axis_of(default=None),
    "Flatten": _axis_of(extra=1, default=1), "Split": _split, "Squeeze": _axes, "Unsqueeze": _axes,
    "CumSum": _cumsum, "Constant": _constant,
    **{op: _axes for op in ("ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL2",
                            "ReduceSumSquare")},
}


def _constant_sizes(g: _Graph) -> bool:
    """Range / ConstantOfShape sized by constants, checked before ONNX's inference sees them.

    ONNX's data propagation stores every value of such a 1-d output (~140 bytes each: a
    corrupt size of 2**40 is an out-of-memory kill, not an error), and the importer folds a
    constant Range into a tensor. Returns whether data propagation is affordable here.
    """
    affordable = True
    for idx, n in enumerate(g.model.graph.node):
        if n.op_type not in ("Range", "ConstantOfShape"):
            continue
        nd = _Node(g, idx, n)
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


def _check_attributes(g: _Graph) -> None:
    for idx, n in enumerate(g.model.graph.node):
        nd = _Node(g, idx, n)
        for f in _FLAGS:
            nd.flag(f)
        rule = _RULES.get(n.op_type)
        if rule is not None:
            rule(nd)


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


def validate_onnx(model, label: str, supported_ops: Collection[str]) -> tuple[int, list]:
    """Refuse `model` with a CaptureError unless graphmode can import and run it.

    Returns the model as the importer reads it (relabelled or converted to a known opset),
    its default-domain opset as written and ONNX's inferred value_info (the importer
    cross-checks its own types against it).
    """
    check_signature(model, f"onnx {label}")
    model, opset = _check_opset(model, label)
    light = _light(model)
    _run_checker(light, model, label)
    _check_op_types(model, label, supported_ops)
    types = _Graph(model, light, label)
    data_prop = _constant_sizes(types)
    types.add_types(_lenient_types(light, data_prop))
    _check_attributes(types)
    inferred = _strict_types(light, model, label, types, data_prop)
    _check_inferred_dims(inferred, model, label)
    return model, opset, list(inferred.graph.value_info)
