"""What the ONNX validator (capture/onnx/validate.py) and each op's check share: the limits,
the dtypes graphmode binds, how an error names a node, and the node as a check sees it
(decoded attributes, its inputs' inferred dims, small constants).

An op's check lives beside its handler in `convert_*.py` and is registered with it
(`@_handles("Conv", check=...)`, capture/onnx/importer.py), so adding an op is one place;
the helpers below are the checks several ops share (windows, axes, epsilon).
"""
from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import numpy as np

from graphmode.errors import CaptureError

MAX_DIM = 2 ** 31 - 1       # a static dim above this is a corrupt model, not a big one
MAX_WINDOW = 2 ** 16 - 1    # kernel / stride / dilation / pad bound (the kernels index with int32)

ONNX_DTYPES = {1: "f32", 2: "u8", 3: "i8", 4: "u16", 5: "i16", 6: "i32", 7: "i64", 9: "bool", 10: "f16", 11: "f64",
               12: "u32", 13: "u64", 16: "bf16"}
# initializers read one value a byte: UINT4 / INT4 (4-bit QDQ weights and zero points)
WIDENED = {21: "u8", 22: "i8"}
_AUTO_PAD = ("NOTSET", "SAME_UPPER", "SAME_LOWER", "VALID")


def node_where(label: str, idx: int, n) -> str:
    """How every ONNX error names a node: file, index, op type and name (or first output)."""
    return f"onnx {label} node #{idx} {n.op_type} {n.name or (n.output[0] if n.output else '')!r}"


def body_where(label: str, idx: int, n, origins: dict) -> str:
    """`node_where`, for a node a function body brought in (`origins`, functions.body_origins):
    the node of the user's file it expands, then the body's node."""
    origin = origins.get(n.output[0]) if n.output else None
    if origin is None:
        return node_where(label, idx, n)
    inner = n.name or (n.output[0] if n.output else "")
    return f"{node_where(label, *origin)} (its function body's {n.op_type} {inner!r})"


def type_name(elem: int) -> str:
    from onnx import TensorProto
    try:
        return TensorProto.DataType.Name(elem)
    except ValueError:
        return str(elem)


SUPPORTED_TYPES = ", ".join(sorted(type_name(t) for t in ONNX_DTYPES))


Dims = list  # per dim: int (static), str (named) or None (unknown)


def node_attrs(n) -> dict[str, Any]:
    from onnx import helper
    out = {}
    for a in n.attribute:
        v = helper.get_attribute_value(a)
        out[a.name] = v.decode(errors="replace") if isinstance(v, bytes) else (list(v) if isinstance(v, Sequence)
                                                                              and not isinstance(v, str) else v)
    return out


class CheckedNode:
    """One node as the rules see it: decoded attributes, its inputs' inferred dims, constants."""

    def __init__(self, v: "ValueTypes", idx: int, n):
        self.g, self.idx, self.n = v, idx, n
        self.op = n.op_type
        self.attrs = node_attrs(n)

    def fail(self, msg: str, value: Any, fix: str) -> CaptureError:
        return CaptureError(f"{self.op} {msg}", where=body_where(self.g.label, self.idx, self.n, self.g.origins),
                            value=value, fix=fix)

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


class ValueTypes:
    """The model as the rules see it: value types (initializers, then inferred) and small constants."""

    def __init__(self, model, light, label: str, origins: dict | None = None):
        self.label = label
        self.model = model
        self.origins = dict(origins or {})     # a function body's node -> the file's node (functions.py)
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
            out.append(f"{name}: {type_name(self.elem[name]) if name in self.elem else '?'}[{shape}]")
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
                    a = node_attrs(self._constants[name])
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


def check_window(nd: CheckedNode, sp: int | None, x: Dims | None, kernel: Sequence[int] | None, ceil: bool) -> None:
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


def spatial_rank(nd: CheckedNode, *ranked: Dims | None) -> int | None:
    rank = next((len(d) for d in ranked if d is not None), None)
    if rank is not None and rank < 3:
        raise nd.fail(f"input has rank {rank}; it needs [N, C, spatial...] (rank >= 3)", rank,
                      "feed an NCHW tensor")
    return rank - 2 if rank is not None else None


def check_epsilon(nd: CheckedNode) -> None:
    eps = nd.attrs.get("epsilon")
    if eps is not None and not (math.isfinite(eps) and eps >= 0):
        raise nd.fail(f"attribute epsilon={eps} must be finite and >= 0", eps, "use e.g. epsilon=1e-5")


def axis_check(extra: int = 0, default: int | None = 0) -> Callable[[CheckedNode], None]:
    def rule(nd: CheckedNode) -> None:
        x = nd.dims(0)
        nd.axis("axis", default, len(x) if x is not None else None, extra)
    return rule


def check_axes(nd: CheckedNode) -> None:
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
