"""ONNX -> IR: load, validate, translate every node into the core op set.

Why the importer evaluates shape code itself: exported ONNX graphs compute every
reshape/expand target at run time (`Shape -> Gather -> Unsqueeze -> Concat -> Reshape`),
while the IR wants those targets as attributes with symbolic dims (`reshape.shape =
[batch, seq, 12, 32]`) so that passes, the planner and the recipe checks can reason
about them. So each ONNX value is one of

* a *known* value: a small tensor whose elements are ints, floats, bools or sympy
  expressions over the recipe dims (shapes, shape arithmetic, small constants). Ops on
  known values are folded at import time (`_Known`, numpy object arrays); only when a
  known value feeds a real computation is it materialised as an IR constant (or, for a
  symbolic element such as `seq`, as `arange(start=seq, end=seq+1)`);
* an IR value (a tensor computed at run time), with its `TensorType` from the op table's
  `infer`, cross-checked against the ONNX `value_info` / output types when present;
* a large initializer, turned into a `param` constant the first time a node uses it.

Besides the shape folding, the translation makes the IR look like the torch.export one:
`MatMul(x, W)` with a constant 2-d `W` and `Gemm` become `linear` (transposed weight; a
tied `wte.T` initializer is recognised and shared), a following `Add(bias)` is folded
into it, `Gather` on a constant 2-d table becomes `embedding`, `Identity`/`Dropout` and
no-op reshapes/expands disappear. Activation chains (the exporter's erf-GELU) are kept
as elementwise ops for the fusion pass.

Before any node is translated, `onnx_validate.validate_onnx` refuses a malformed model
(onnx.checker, strict shape inference, attribute ranges, graph signature): the handlers
below may trust attribute values and types.

Limitations (each raises CaptureError naming the file, node and fix):
ops outside `supported_onnx_ops()` (all are listed with counts and node names before
anything is translated: ONNX has no eager fallback, so they cannot become `fallback`
nodes), control flow (If/Loop/Scan), non-default op domains, shapes that depend on
tensor *data* (e.g. Reshape to a shape read from an input's values), symbolic Slice
starts, negative Slice steps on run-time tensors, asymmetric Conv/Pool padding,
1-d/3-d convolutions, opsets outside [MIN_OPSET, MAX_OPSET]. Not checked: Squeeze
without axes treats a symbolic dim as != 1; `embedding`/`index` assume non-negative
run-time indices. Excluded ops (`exclude_ops` / `include_ops`, matched against the ONNX
op type or the core op it lowers to) become `fallback` nodes calling the equivalent
`torch.ops.aten` function (`_aten_call`); one without an equivalent raises CaptureError.
"""
from __future__ import annotations

import math
import os
import re
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import sympy
import torch

from graphmode.capture.onnx_validate import MAX_OPSET, MIN_OPSET, node_where, validate_onnx
from graphmode.capture.onnx_validate import ONNX_DTYPES as _ONNX_DTYPES
from graphmode.capture.torch_import import CaptureReport, Fallback
from graphmode.errors import CaptureError, IRError
from graphmode.ir.graph import Graph, clean_name
from graphmode.ir.ops import broadcast_shapes, get_op, norm_axis, resolve_reshape
from graphmode.ir.types import DTYPES, Dim, TensorType, dim_str, dims_equal, normalize_dim, sym

__all__ = ["import_onnx", "OnnxCaptureReport", "supported_onnx_ops", "MIN_OPSET", "MAX_OPSET"]

KNOWN_LIMIT = 4096          # tensors up to this many elements are tracked as known values
BIG_END = 2 ** 62           # the IR's "to the end" slice bound
DEFAULT_RANGE = (1, 4096)   # dim range when neither `dims` nor the zoo defaults name the dim

_INT_DTYPES = frozenset({"u8", "i8", "i16", "i32", "i64"})
_FLOAT_DTYPES = frozenset({"f16", "bf16", "f32", "f64"})


class _Unfoldable(Exception):
    """A known-value fold that cannot be decided at import time (run the op instead)."""


# ------------------------------------------------------------------------------ known values


def _objarr(values: Sequence, shape: Sequence[int] | None = None) -> np.ndarray:
    vals = list(values)
    a = np.empty(len(vals), dtype=object)
    for i, v in enumerate(vals):
        a[i] = v
    return a.reshape(tuple(shape) if shape is not None else (len(vals),))


def _py(v: Any) -> Any:
    """One element in canonical form: python int/float/bool or a canonical sympy expr."""
    if isinstance(v, (bool, np.bool_)):
        return bool(v)
    if isinstance(v, (int, np.integer)):
        return int(v)
    if isinstance(v, (float, np.floating)):
        return float(v)
    if isinstance(v, sympy.Basic):
        if v is sympy.true or v is sympy.false:
            return bool(v)
        if v.is_Integer:
            return int(v)
        if v.is_Number:
            return float(v)
        return normalize_dim(v)
    return v


def _is_sym(v: Any) -> bool:
    return isinstance(v, sympy.Basic)


@dataclass
class _Known:
    """A tensor whose elements are known at import time (possibly symbolic)."""

    arr: np.ndarray          # dtype=object, elements from `_py`
    dtype: str
    source: str | None = None  # initializer name when this is an unchanged initializer

    def __post_init__(self):
        if not isinstance(self.arr, np.ndarray):      # numpy returns bare elements for 0-d results
            self.arr = _objarr([self.arr], ())
        elif self.arr.dtype != object:
            self.arr = _objarr(list(self.arr.flat), self.arr.shape)

    @staticmethod
    def of(t: torch.Tensor, source: str | None = None) -> "_Known":
        from graphmode.ir.types import TORCH_TO_DTYPE
        return _Known(_objarr([_py(v) for v in t.flatten().tolist()], tuple(t.shape)), TORCH_TO_DTYPE[t.dtype],
                      source)

    @property
    def concrete(self) -> bool:
        return not any(_is_sym(v) for v in self.arr.flat)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.arr.shape)

    def tensor(self) -> torch.Tensor:
        vals = list(self.arr.flat)
        if self.dtype == "bool":
            vals = [bool(v) for v in vals]
        return torch.tensor(vals, dtype=DTYPES[self.dtype]).reshape(self.shape)

    def ints(self, what: str) -> list[int]:
        out = []
        for v in self.arr.flat:
            if _is_sym(v) or isinstance(v, float) and not float(v).is_integer():
                raise _Unfoldable(f"{what} must be concrete integers, got {[dim_str(x) if _is_sym(x) else x for x in self.arr.flat]}")
            out.append(int(v))
        return out

    def dims(self) -> list[Dim]:
        """Elements as dims (ints or sympy expressions)."""
        return [v if _is_sym(v) else int(v) for v in self.arr.flat]


def _ufunc(fn: Callable, *arrs: np.ndarray) -> np.ndarray:
    """Elementwise `fn` over object arrays with broadcasting (0-d results stay arrays)."""
    r = np.frompyfunc(fn, len(arrs), 1)(*arrs)
    return r if isinstance(r, np.ndarray) else _objarr([r], ())


def _trunc_div(a: int, b: int) -> int:
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b >= 0) else -q


def _decide(expr, kind: str) -> bool:
    """Decide `expr == 0` / `< 0` / `<= 0` with every dim symbol positive."""
    e = sympy.sympify(expr)
    if e.is_Number:
        v = float(e)
        return {"eq": v == 0, "lt": v < 0, "le": v <= 0}[kind]
    res = {"eq": e.is_zero, "lt": e.is_negative, "le": e.is_nonpositive}[kind]
    if res is None:
        raise _Unfoldable(f"cannot decide {dim_str(normalize_dim(e))} {'==' if kind == 'eq' else '<' if kind == 'lt' else '<='} 0 "
                          "for every dim value")
    return bool(res)


def _smax(a, b):
    if not _is_sym(a) and not _is_sym(b):
        return max(a, b)
    try:
        return b if _decide(a - b, "le") else a
    except _Unfoldable:
        return sympy.Max(a, b)


def _smin(a, b):
    if not _is_sym(a) and not _is_sym(b):
        return min(a, b)
    try:
        return a if _decide(a - b, "le") else b
    except _Unfoldable:
        return sympy.Min(a, b)


def _sym_div(is_int: bool):
    def div(a, b):
        if not _is_sym(a) and not _is_sym(b):
            return _trunc_div(int(a), int(b)) if is_int else a / b
        if is_int:
            q = sympy.floor(sympy.sympify(a) / b)   # dims are positive: floor == trunc
            return q
        return sympy.sympify(a) / b
    return div


_SYM_BINARY: dict[str, Callable[[bool], Callable]] = {
    "Add": lambda i: (lambda a, b: a + b),
    "Sub": lambda i: (lambda a, b: a - b),
    "Mul": lambda i: (lambda a, b: a * b),
    "Div": _sym_div,
    "Max": lambda i: _smax,
    "Min": lambda i: _smin,
    "Equal": lambda i: (lambda a, b: _decide(a - b, "eq")),
    "Less": lambda i: (lambda a, b: _decide(a - b, "lt")),
    "LessOrEqual": lambda i: (lambda a, b: _decide(a - b, "le")),
    "Greater": lambda i: (lambda a, b: _decide(b - a, "lt")),
    "GreaterOrEqual": lambda i: (lambda a, b: _decide(b - a, "le")),
}


# ------------------------------------------------------------------------------ report


@dataclass
class OnnxCaptureReport(CaptureReport):
    """CaptureReport for ONNX: `aten_ops` holds the ONNX op-type counts of the source graph."""

    opset: int = 0
    producer: str = ""
    folded_nodes: int = 0                       # ONNX nodes evaluated at import time (no IR node)
    runtime_dims: int = 0                       # symbolic dims fed to tensor math (arange(start=d, end=d+1))
    op_map: dict[str, dict[str, int]] = field(default_factory=dict)   # ONNX op -> IR ops emitted

    def to_json(self) -> dict:
        d = super().to_json()
        d.update({"opset": self.opset, "producer": self.producer, "folded_nodes": self.folded_nodes,
                  "runtime_dims": self.runtime_dims, "op_map": self.op_map})
        return d


# ------------------------------------------------------------------------------ excluded ops -> aten


def _dimarg(d):
    return d if isinstance(d, int) else {"$dim": d if isinstance(d, str) else dim_str(d)}


def _aten_call(op: str, attrs: Mapping[str, Any], n_in: int) -> tuple[str, list, dict] | None:
    """The torch.ops.aten call equivalent to one core op (for `fallback` nodes), or None."""
    ins = [{"$in": i} for i in range(n_in)]
    unary = {"neg", "exp", "log", "sqrt", "rsqrt", "reciprocal", "abs", "tanh", "sigmoid", "relu", "erf", "sin",
             "cos", "silu", "logical_not"}
    binary = {"add": "add.Tensor", "sub": "sub.Tensor", "mul": "mul.Tensor", "div": "div.Tensor",
              "pow": "pow.Tensor_Tensor", "maximum": "maximum.default", "minimum": "minimum.default",
              "eq": "eq.Tensor", "ne": "ne.Tensor", "lt": "lt.Tensor", "le": "le.Tensor", "gt": "gt.Tensor",
              "ge": "ge.Tensor", "logical_and": "logical_and.default", "logical_or": "logical_or.default"}
    a = attrs
    if op in unary:
        return f"aten.{op}.default", ins, {}
    if op in binary:
        return f"aten.{binary[op]}", ins, {}
    table: dict[str, Callable[[], tuple[str, list, dict]]] = {
        "identity": lambda: ("aten.clone.default", ins, {}),
        "where": lambda: ("aten.where.self", ins, {}),
        "gelu": lambda: ("aten.gelu.default", ins, {"approximate": a.get("approximate", "none")}),
        "cast": lambda: ("aten._to_copy.default", ins, {"dtype": {"$dtype": a["dtype"]}}),
        "softmax": lambda: ("aten._softmax.default", ins + [a["dim"], False], {}),
        "log_softmax": lambda: ("aten._log_softmax.default", ins + [a["dim"], False], {}),
        "sum": lambda: ("aten.sum.dim_IntList", ins + [list(a["dims"]), a.get("keepdim", False)], {}),
        "mean": lambda: ("aten.mean.dim", ins + [list(a["dims"]), a.get("keepdim", False)], {}),
        "amax": lambda: ("aten.amax.default", ins + [list(a["dims"]), a.get("keepdim", False)], {}),
        "amin": lambda: ("aten.amin.default", ins + [list(a["dims"]), a.get("keepdim", False)], {}),
        "matmul": lambda: ("aten.matmul.default", ins, {}),
        "linear": lambda: ("aten.linear.default", ins, {}),
        "batch_norm": lambda: ("aten.batch_norm.default", [ins[0], ins[1], ins[2], ins[3], ins[4], False, 0.0,
                                                           a.get("eps", 1e-5), False], {}),
        "conv2d": lambda: ("aten.conv2d.default", [ins[0], ins[1], ins[2] if n_in > 2 else None,
                                                   list(a["stride"]), list(a["padding"]), list(a["dilation"]),
                                                   a["groups"]], {}),
        "max_pool2d": lambda: ("aten.max_pool2d.default", ins + [list(a["kernel"]), list(a["stride"]),
                                                                 list(a["padding"]), list(a["dilation"]),
                                                                 a["ceil_mode"]], {}),
        "avg_pool2d": lambda: ("aten.avg_pool2d.default", ins + [list(a["kernel"]), list(a["stride"]),
                                                                 list(a["padding"]), a["ceil_mode"],
                                                                 a["count_include_pad"]], {}),
        "adaptive_avg_pool2d": lambda: ("aten.adaptive_avg_pool2d.default", ins + [list(a["output_size"])], {}),
        "reshape": lambda: ("aten.reshape.default", ins + [[_dimarg(d) for d in a["shape"]]], {}),
        "permute": lambda: ("aten.permute.default", ins + [list(a["perm"])], {}),
        "expand": lambda: ("aten.expand.default", ins + [[_dimarg(d) for d in a["shape"]]], {}),
        "slice": lambda: ("aten.slice.Tensor", ins + [a["dim"], a.get("start", 0), _dimarg(a.get("end", BIG_END)),
                                                      a.get("step", 1)], {}),
        "concat": lambda: ("aten.cat.default", [ins, a["dim"]], {}),
        "embedding": lambda: ("aten.embedding.default", ins, {}),
        "index_select": lambda: ("aten.index_select.default", [ins[0], a["dim"], ins[1]], {}),
        "index": lambda: ("aten.index.Tensor", [ins[0], [ins[1 + a["dims"].index(d)] if d in a["dims"] else None
                                                        for d in range(max(a["dims"]) + 1)]], {}),
        "arange": lambda: ("aten.arange.start_step", [_dimarg(a.get("start", 0)), _dimarg(a["end"]),
                                                      a.get("step", 1)], {"dtype": {"$dtype": a.get("dtype", "i64")}}),
        "full": lambda: ("aten.full.default", [[_dimarg(d) for d in a["shape"]], a["value"]],
                         {"dtype": {"$dtype": a.get("dtype", "f32")}}),
        "triu": lambda: ("aten.triu.default", ins + [a.get("diagonal", 0)], {}),
        "tril": lambda: ("aten.tril.default", ins + [a.get("diagonal", 0)], {}),
        "cumsum": lambda: ("aten.cumsum.default", ins + [a["dim"]], {}),
        "clamp": lambda: ("aten.clamp.default", ins + [a.get("min"), a.get("max")], {}),
    }
    if op == "layer_norm":
        return None  # needs the normalized shape: built by the importer (it knows the input type)
    fn = table.get(op)
    return fn() if fn else None


# ------------------------------------------------------------------------------ importer


def _to_tensor(arr: np.ndarray, onnx_type: int | None = None) -> torch.Tensor:
    """A writable torch copy of an ONNX numpy array (bfloat16 arrives as 16-bit words)."""
    if (onnx_type == 16 or str(arr.dtype) == "bfloat16") and arr.dtype.itemsize == 2:
        return torch.from_numpy(np.array(arr, copy=True).view(np.int16)).view(torch.bfloat16)
    if onnx_type == 16:   # an onnx that widened bf16 to float32
        return torch.from_numpy(np.array(arr, dtype=np.float32, copy=True)).to(torch.bfloat16)
    return torch.from_numpy(np.array(arr, copy=True))


def _vname(onnx_name: str) -> str:
    """'/bert/encoder/layer.0/attention/self/Reshape_output_0' -> 'bert.encoder.layer.0.attention.self.Reshape'."""
    n = onnx_name.strip("/").replace("/", ".")
    n = re.sub(r"_output_0(?=$|_)", "", n)
    return clean_name(n or "v")


class _Importer:
    def __init__(self, model, label: str, name: str, dims: Mapping[str, tuple[int, int]] | None,
                 input_dims: Mapping[str, Sequence] | None, excluded: Callable[[str, str], bool]):
        from onnx import numpy_helper  # noqa: F401 - imported here so a missing onnx fails in import_onnx
        self.m = model
        self.label = label
        self.gp = model.graph
        self.g = Graph(clean_name(name))
        self.user_dims = dict(dims) if dims is not None else None
        self.input_dims = dict(input_dims or {})
        self.excluded = excluded
        self.opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
        self.known: dict[str, _Known] = {}
        self.ir: dict[str, str] = {}
        self.big: dict[str, tuple[torch.Tensor, str]] = {}  # onnx name -> (tensor, role) not yet in the graph
        self.declared: dict[str, Any] = {}               # onnx name -> TypeProto.tensor_type
        self.dimmap: dict[str, Dim] = {}                 # dim_param -> recipe dim expression
        self.consumers: dict[str, list[int]] = defaultdict(list)
        self.graph_outputs = [o.name for o in self.gp.output]
        self.skip: set[int] = set()
        self.const_cache: dict[tuple, str] = {}
        self.transposed: dict[str, str] = {}
        self.mat_cache: dict[int, str] = {}              # id(known value / array) -> IR constant
        self.folded = 0
        self.runtime_dims = 0                            # symbolic shape values used as tensor data
        self.op_map: dict[str, Counter] = defaultdict(Counter)
        self.fallbacks: dict[tuple[str, str], Fallback] = {}
        self.node = None
        self.node_idx = -1
        self.extra_value_info: list = []

    # ---- errors --------------------------------------------------------------------------
    def where(self) -> str:
        if self.node is None:
            return f"onnx {self.label}"
        return node_where(self.label, self.node_idx, self.node)

    def fail(self, msg: str, fix: str | None = None, value: Any = None) -> CaptureError:
        return CaptureError(msg, where=self.where(), value=value,
                            fix=fix or "re-export the model so this node has static attributes, or import the "
                                       "PyTorch module with import_torch")

    # ---- value access -------------------------------------------------------------------
    def has(self, name: str) -> bool:
        return name in self.known or name in self.ir or name in self.big

    def type_of(self, name: str) -> TensorType:
        if name in self.known:
            k = self.known[name]
            return TensorType(k.dtype, k.shape)
        if name in self.ir:
            return self.g.type_of(self.ir[name])
        if name in self.big:
            return TensorType.of(self.big[name][0])
        raise self.fail(f"value {name!r} is used before it is defined (or is an unsupported optional input)")

    def kn(self, name: str) -> _Known | None:
        return self.known.get(name) if name else None

    def is_const(self, name: str) -> bool:
        """Known at import time (concrete) or a constant tensor: no run-time input."""
        if name in self.known:
            return self.known[name].concrete
        if name in self.big:
            return True
        return name in self.ir and self.ir[name] in self.g.constants

    def const_tensor(self, name: str) -> torch.Tensor:
        if name in self.known:
            return self.known[name].tensor()
        if name in self.big:
            return self._big_tensor(name)
        return self.g.constants[self.ir[name]]

    def _big_tensor(self, name: str) -> torch.Tensor:
        return self.big[name][0]

    def const_source(self, name: str) -> tuple[torch.Tensor, str] | None:
        """(tensor, role) of a large constant (initializer or folded), else None."""
        if name in self.big:
            return self.big[name]
        v = self.ir.get(name)
        if v is not None and v in self.g.constants:
            return self.g.constants[v], self.g.values[v].role
        return None

    def set_big(self, name: str, t: torch.Tensor, role: str) -> None:
        """A constant derived from another at import time (a view where possible: no copy)."""
        self.big[name] = (t, role)
        self.check_declared(name)

    def operand(self, name: str) -> str:
        """The IR value for an ONNX value, materialising known values and initializers."""
        if name in self.ir:
            return self.ir[name]
        if name in self.big:
            t, role = self.big[name]
            v = self.mat_cache.get(id(t))   # aliases (Identity) share one constant
            if v is None:
                v = self.g.add_constant(self.g.fresh_name(_vname(name)), t.contiguous(), role=role)
                self.mat_cache[id(t)] = v
            self.ir[name] = v
            return v
        k = self.known.get(name)
        if k is None:
            raise self.fail(f"value {name!r} is used before it is defined")
        v = self.mat_cache.get(id(k))
        if v is None:
            v = self.mat_cache[id(k)] = self.materialise(k, name)
        self.ir[name] = v
        return v

    def materialise(self, k: _Known, hint: str) -> str:
        if k.concrete:
            t = k.tensor()
            if k.source is not None:
                key = ("source", k.source)
                if key not in self.const_cache:
                    self.const_cache[key] = self.g.add_constant(self.g.fresh_name(_vname(k.source)), t, role="param")
                return self.const_cache[key]
            key = (k.dtype, k.shape, tuple(repr(v) for v in k.arr.flat))
            if key not in self.const_cache:
                self.const_cache[key] = self.g.add_constant(self.g.fresh_name(_vname(hint)), t, role="const")
            return self.const_cache[key]
        if k.dtype == "bool":
            raise self.fail(f"a symbolic boolean value ({hint!r}) is used as a tensor")
        parts: list[str] = []
        run: list = []

        def flush():
            if run:
                parts.append(self.materialise(_Known(_objarr(run), k.dtype), f"{hint}_c"))
                run.clear()
        for v in k.arr.flat:
            if _is_sym(v):
                self.runtime_dims += 1
                flush()
                parts.append(self.emit("arange", [], {"start": dim_str(v), "end": dim_str(normalize_dim(v + 1)),
                                                      "step": 1, "dtype": k.dtype}, hint=f"{hint}_dim"))
            else:
                run.append(v)
        flush()
        out = parts[0] if len(parts) == 1 else self.emit("concat", parts, {"dim": 0}, hint=hint)
        if k.shape != (k.arr.size,):
            out = self.emit("reshape", [out], {"shape": list(k.shape)}, hint=hint)
        return out

    def set_known(self, name: str, k: _Known) -> None:
        k.arr = _objarr([_py(v) for v in k.arr.flat], k.arr.shape)
        self.known[name] = k
        self.check_declared(name)

    def set_tensor(self, name: str, t: torch.Tensor) -> None:
        """A value computed at import time from constants: known if small, else a constant."""
        if t.numel() <= KNOWN_LIMIT:
            self.set_known(name, _Known.of(t))
        else:
            v = self.g.add_constant(self.g.fresh_name(_vname(name)), t.contiguous(), role="const")
            self.ir[name] = v
            self.check_declared(name)

    def alias(self, out: str, src: str) -> None:
        if src in self.known:
            self.known[out] = self.known[src]
        elif src in self.big:
            self.big[out] = self.big[src]
        else:
            self.ir[out] = self.operand(src)
        self.check_declared(out)

    # ---- emission -----------------------------------------------------------------------
    def emit(self, op: str, inputs: list[str], attrs: dict, *, out: str | None = None,
             hint: str | None = None) -> str:
        """Add one IR node (inputs are IR value names); `out` binds it to an ONNX value."""
        spec = get_op(op)
        types = [self.g.type_of(i) for i in inputs]
        try:
            otype = spec.infer(types, attrs)[0]
        except IRError as e:
            raise self.fail(e.message if e.message.startswith(f"{op}:") else f"{op}: {e.message}",
                            fix=e.fix or "the node's inputs do not fit together for the recipe's dims: fix the "
                                         "shapes named above in the model (or the dims in the recipe)") from None
        except (KeyError, IndexError, TypeError, ValueError) as e:
            raise self.fail(f"{op}: cannot infer the output type ({type(e).__name__}: {e})") from None
        name = self.g.fresh_name(_vname(out or hint or op))
        n = self.node
        if n is not None and self.excluded(n.op_type, op):
            self._fallback(op, inputs, attrs, otype, name)
        else:
            self.g.add_node(op, inputs, [otype], attrs, names=[name])
        if n is not None:
            self.op_map[n.op_type][op] += 1
        if out is not None:
            self.ir[out] = name
            self.check_declared(out)
        return name

    def _fallback(self, op: str, inputs: list[str], attrs: dict, otype: TensorType, name: str) -> None:
        n = self.node
        call = _aten_call(op, attrs, len(inputs))
        if op == "layer_norm":
            xt = self.g.type_of(inputs[0])
            k = attrs.get("normalized_rank", 1)
            ins = [{"$in": i} for i in range(len(inputs))]
            call = ("aten.layer_norm.default", [ins[0], [_dimarg(d) for d in xt.shape[-k:]],
                                                 ins[1] if len(ins) > 1 else None, ins[2] if len(ins) > 2 else None,
                                                 attrs.get("eps", 1e-5)], {})
        if call is None:
            raise self.fail(f"{n.op_type} is excluded from compilation (recipe capture include/exclude ops), but "
                            f"its core op {op!r} has no eager torch equivalent, and ONNX has no eager fallback",
                            fix=f"remove {n.op_type!r} from capture.exclude_ops (or add it to include_ops)")
        target, args, kwargs = call
        loc = n.name or n.output[0]
        self.g.add_node("fallback", inputs, [otype], {"target": target, "args": args, "kwargs": kwargs, "loc": loc},
                        names=[name])
        key = (target, n.op_type)
        if key in self.fallbacks:
            self.fallbacks[key].count += 1
        else:
            self.fallbacks[key] = Fallback(target, f"ONNX {n.op_type} excluded by recipe capture settings", loc)

    # ---- types: cross-check with value_info ---------------------------------------------
    def _declared_dim(self, d) -> Dim | None:
        if d.HasField("dim_value"):
            return int(d.dim_value)
        if d.HasField("dim_param"):
            p = d.dim_param
            if p in self.dimmap:
                return self.dimmap[p]
            try:   # an expression over the model's dim names (dynamo exports: "2*seq")
                e = normalize_dim(p)
            except IRError:
                return None
            free = getattr(e, "free_symbols", set())
            if not free or any(s.name not in self.dimmap for s in free):
                return None   # unk__N and other names the inputs do not define
            return normalize_dim(e.xreplace({s: sympy.sympify(self.dimmap[s.name]) for s in free}))
        return None

    def check_declared(self, name: str) -> None:
        tt = self.declared.get(name)
        if tt is None:
            return
        got = self.type_of(name)
        want_dt = _ONNX_DTYPES.get(tt.elem_type)
        if want_dt is not None and want_dt != got.dtype:
            raise self.fail(f"value {name!r}: the importer inferred dtype {got.dtype}, the ONNX model declares "
                            f"{want_dt}", fix="this is an importer bug or an inconsistent model; run "
                                              "onnx.checker.check_model(m, full_check=True)")
        if not tt.HasField("shape"):
            return
        dims = list(tt.shape.dim)
        if len(dims) != got.rank:
            raise self.fail(f"value {name!r}: the importer inferred {got.text()}, the ONNX model declares rank "
                            f"{len(dims)}", fix="check the model with onnx.checker.check_model(m, full_check=True)")
        for i, (d, g) in enumerate(zip(dims, got.shape)):
            want = self._declared_dim(d)
            if want is None:
                continue
            if not _deq(want, g):
                raise self.fail(f"value {name!r} dim {i}: the importer inferred {dim_str(g)}, the ONNX model "
                                f"declares {dim_str(want) if not isinstance(want, int) else want}",
                                fix="map the model's dim names to the recipe dims with input_dims, or re-export "
                                    "with dynamic axes on every dynamic input dim")

    # ---- inputs --------------------------------------------------------------------------
    def bind_inputs(self, init_names: set[str]) -> None:
        onnx_inputs = [vi for vi in self.gp.input if vi.name not in init_names]
        names = [vi.name for vi in onnx_inputs]
        unknown = [n for n in self.input_dims if n not in names]
        if unknown:
            raise CaptureError(f"input_dims names input(s) {unknown} that the ONNX model does not have",
                               where=f"onnx {self.label}", fix=f"the model's inputs are {names}")
        for vi in onnx_inputs:   # validate_onnx checked: tensor types with a graphmode dtype
            tt = vi.type.tensor_type
            dtype = _ONNX_DTYPES[tt.elem_type]
            want = self.input_dims.get(vi.name)
            dims_p = list(tt.shape.dim) if tt.HasField("shape") else None
            if dims_p is None and want is None:
                raise CaptureError(f"input {vi.name!r} has no shape in the model", where=f"onnx {self.label}",
                                   fix="pass input_dims={name: [dim names or ints]}")
            rank = len(dims_p) if dims_p is not None else len(want)
            if want is not None and len(want) != rank:
                raise CaptureError(f"input {vi.name!r} has rank {rank} in the model but input_dims gives "
                                   f"{len(want)} dims", where=f"onnx {self.label}", value=list(want),
                                   fix="give one entry per dim")
            shape: list[Dim] = []
            for i in range(rank):
                d = dims_p[i] if dims_p is not None else None
                w = want[i] if want is not None else None
                static = int(d.dim_value) if d is not None and d.HasField("dim_value") else None
                param = d.dim_param if d is not None and d.HasField("dim_param") else None
                if w is not None:
                    wd = normalize_dim(w)
                    if static is not None and (not isinstance(wd, int) or wd != static):
                        raise CaptureError(f"input {vi.name!r} dim {i} is fixed to {static} in the model, but "
                                           f"input_dims says {w!r}", where=f"onnx {self.label}",
                                           fix="re-export with a dynamic axis there (dynamic_axes / dynamic_shapes)"
                                               f" or declare it as {static} in the recipe")
                    dim = wd
                elif static is not None:
                    dim = static
                elif param is not None:
                    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", param):
                        raise CaptureError(f"input {vi.name!r} dim {i} is named {param!r}, which is not a dim name",
                                           where=f"onnx {self.label}", fix="pass input_dims to name the dims")
                    dim = sym(param)
                else:
                    raise CaptureError(f"input {vi.name!r} dim {i} has neither a size nor a name",
                                       where=f"onnx {self.label}", fix="pass input_dims to name the dims")
                if param is not None:
                    prev = self.dimmap.setdefault(param, dim)
                    if not _deq(prev, dim):
                        raise CaptureError(f"model dim {param!r} maps to both {dim_str(prev) if not isinstance(prev, int) else prev} "
                                           f"and {dim_str(dim) if not isinstance(dim, int) else dim}",
                                           where=f"onnx {self.label} input {vi.name!r}",
                                           fix="make input_dims consistent across inputs")
                shape.append(dim)
            ty = TensorType(dtype, tuple(shape))
            self.ir[vi.name] = self.g.add_input(self.g.fresh_name(clean_name(vi.name)), ty)
        used: set[str] = set()
        for n in self.g.inputs:
            for d in self.g.values[n].type.shape:
                if not isinstance(d, int):
                    used |= {s.name for s in d.free_symbols}
        if self.user_dims is not None:
            missing = sorted(used - set(self.user_dims))
            if missing:
                raise CaptureError(f"input dims {missing} have no range in dims", where=f"onnx {self.label}",
                                   value=sorted(self.user_dims),
                                   fix="declare every dynamic dim in the recipe's dims (or map the model's dim "
                                       "names with input_dims)")
            self.g.dims = dict(self.user_dims)
        else:
            from graphmode.capture.zoo import DEFAULT_DIM_RANGES
            self.g.dims = {d: DEFAULT_DIM_RANGES.get(d, DEFAULT_RANGE) for d in sorted(used)}

    # ---- driver --------------------------------------------------------------------------
    def run(self) -> Graph:
        from onnx import numpy_helper
        gp = self.gp
        init_names = {i.name for i in gp.initializer}
        for vi in list(self.extra_value_info) + list(gp.value_info) + list(gp.output):
            if vi.type.HasField("tensor_type"):
                self.declared[vi.name] = vi.type.tensor_type
        self.bind_inputs(init_names)
        for init in gp.initializer:
            t = self._init_tensor(init, numpy_helper)
            if t.numel() <= KNOWN_LIMIT:
                self.known[init.name] = _Known.of(t, source=init.name)
            else:
                self.big[init.name] = (t, "param")
        for idx, n in enumerate(gp.node):
            for i in n.input:
                if i:
                    self.consumers[i].append(idx)
        for idx, n in enumerate(gp.node):
            if idx in self.skip:
                continue
            self.node, self.node_idx = n, idx
            n_ir = len(self.g.nodes)
            handler = _HANDLERS[n.op_type]
            try:
                handler(self, n)
            except CaptureError:
                raise
            except _Unfoldable as e:
                raise self.fail(str(e)) from None
            except IRError as e:   # shapes that do not broadcast, bad axes...
                raise self.fail(e.message, fix=e.fix or "check the model with onnx.checker.check_model("
                                                        "m, full_check=True)") from None
            except Exception as e:  # noqa: BLE001 - every failure names the node
                raise self.fail(f"cannot translate: {type(e).__name__}: {e}",
                                fix="report this as an importer bug, with the model") from e
            if len(self.g.nodes) == n_ir:
                self.folded += 1
            for o in n.output:
                users = [j for j in self.consumers.get(o, []) if j not in self.skip]
                if o and not self.has(o) and (users or o in self.graph_outputs):
                    raise self.fail(f"output {o!r} of {n.op_type} is used but was not produced")
        self.node, self.node_idx = None, -1
        outs = []
        for o in self.graph_outputs:
            v = self.operand(o)
            if v in self.g.inputs or v in self.g.constants or v in outs:
                v = self.emit("identity", [v], {}, hint=o)
            outs.append(v)
        outs = [self._name_output(o, v) for o, v in zip(self.graph_outputs, outs)]
        self.g.outputs = outs
        for o in outs:
            val = self.g.values[o]
            if val.role == "intermediate":
                self.g.values[o] = val.__class__(o, val.type, "output")
        self._dead_code()
        self.g.prune_values()
        return self.g

    def _init_tensor(self, init, numpy_helper) -> torch.Tensor:
        try:
            return _to_tensor(numpy_helper.to_array(init), init.data_type)
        except CaptureError:
            raise
        except Exception as e:  # noqa: BLE001 - truncated raw_data, missing external data...
            raise CaptureError(f"cannot read initializer {init.name!r}: {type(e).__name__}: {e}",
                               where=f"onnx {self.label}",
                               fix="re-export the model; keep external-data files next to the .onnx file") from None

    def _name_output(self, onnx_name: str, v: str) -> str:
        """Give a graph output the ONNX output's name when an alias (Identity, a no-op Reshape,
        a folded bias Add) left it with an inner value's name."""
        want = clean_name(onnx_name)
        if v == want or want in self.g.values or v in self.g.inputs or v in self.g.constants:
            return v
        val = self.g.values.pop(v)
        self.g.values[want] = val.__class__(want, val.type, val.role)
        sub = (lambda names: [want if x == v else x for x in names])
        self.g.nodes = [n.with_(inputs=sub(n.inputs), outputs=sub(n.outputs)) if v in n.inputs or v in n.outputs
                        else n for n in self.g.nodes]
        for k, iv in self.ir.items():
            if iv == v:
                self.ir[k] = want
        return want

    def _dead_code(self) -> None:
        live = set(self.g.outputs)
        keep = []
        for n in reversed(self.g.nodes):
            if any(o in live for o in n.outputs):
                keep.append(n)
                live.update(n.inputs)
        self.g.nodes = keep[::-1]

    # ---- helpers for handlers --------------------------------------------------------------
    def attr(self, n, key: str, default: Any = None) -> Any:
        from onnx import helper
        for a in n.attribute:
            if a.name == key:
                return helper.get_attribute_value(a)
        return default

    def opt_in(self, n, i: int) -> str | None:
        return n.input[i] if len(n.input) > i and n.input[i] else None

    def need_known(self, name: str, what: str) -> _Known:
        k = self.kn(name)
        if k is None:
            raise self.fail(f"{what} ({name!r}) depends on run-time tensor data, so it cannot be an attribute",
                            fix="the IR needs shapes/axes known at compile time; re-export with the value constant")
        return k

    def ints_of(self, name: str, what: str) -> list[int]:
        try:
            return self.need_known(name, what).ints(what)
        except _Unfoldable as e:
            raise self.fail(str(e)) from None


# ------------------------------------------------------------------------------ handlers

_HANDLERS: dict[str, Callable[[_Importer, Any], None]] = {}


def _handles(*ops: str):
    def deco(fn):
        for o in ops:
            _HANDLERS[o] = fn
        return fn
    return deco


def supported_onnx_ops() -> list[str]:
    """ONNX op types (default domain) the importer translates."""
    return sorted(_HANDLERS)


def _attr_dim(d: Dim):
    return d if isinstance(d, int) else dim_str(d)


def _shape_attr(shape: Sequence[Dim]) -> list:
    return [_attr_dim(normalize_dim(d)) for d in shape]


def _deq(a: Dim, b: Dim) -> bool:
    """dims_equal without sympy.simplify for the common cases (dims are canonical)."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    if a == b:
        return True
    if isinstance(a, int) or isinstance(b, int):
        return False        # a canonical non-constant expression never equals a constant
    e = sympy.expand(a - b)
    if e == 0:
        return True
    return dims_equal(a, b) if e.has(sympy.Function) else False


def _same_shape(a: Sequence[Dim], b: Sequence[Dim]) -> bool:
    return len(a) == len(b) and all(_deq(x, y) for x, y in zip(a, b))


@_handles("Constant")
def _constant(imp: _Importer, n) -> None:
    from onnx import numpy_helper
    out = n.output[0]
    for a in n.attribute:
        if a.name == "value":
            arr = numpy_helper.to_array(a.t)
            break
        if a.name == "value_float":
            arr = np.array(a.f, dtype=np.float32)
            break
        if a.name == "value_floats":
            arr = np.array(list(a.floats), dtype=np.float32)
            break
        if a.name == "value_int":
            arr = np.array(a.i, dtype=np.int64)
            break
        if a.name == "value_ints":
            arr = np.array(list(a.ints), dtype=np.int64)
            break
    else:
        raise imp.fail("Constant with a string or sparse value is not supported",
                       fix="only numeric tensor constants can be imported")
    t = _to_tensor(arr, a.t.data_type if a.name == "value" else None)
    if t.numel() <= KNOWN_LIMIT:
        imp.set_known(out, _Known.of(t))
    else:
        imp.big[out] = (t, "const")
        imp.check_declared(out)


@_handles("Identity", "Dropout")
def _identity(imp: _Importer, n) -> None:
    if n.op_type == "Dropout" and len(n.output) > 1 and n.output[1] and imp.consumers.get(n.output[1]):
        raise imp.fail("the Dropout mask output is used", fix="export the model in eval mode")
    imp.alias(n.output[0], n.input[0])


@_handles("Shape")
def _shape(imp: _Importer, n) -> None:
    t = imp.type_of(n.input[0])
    dims = list(t.shape)
    start, end = imp.attr(n, "start", 0), imp.attr(n, "end", None)
    dims = dims[slice(start, end)]
    imp.set_known(n.output[0], _Known(_objarr(dims), "i64"))


@_handles("Size")
def _size(imp: _Importer, n) -> None:
    imp.set_known(n.output[0], _Known(_objarr([imp.type_of(n.input[0]).numel()], ()), "i64"))


# ---- elementwise

_UNARY = {"Neg": "neg", "Abs": "abs", "Sqrt": "sqrt", "Reciprocal": "reciprocal", "Exp": "exp", "Log": "log",
          "Tanh": "tanh", "Erf": "erf", "Relu": "relu", "Sigmoid": "sigmoid", "Sin": "sin", "Cos": "cos",
          "Not": "logical_not"}
_BINARY = {"Add": "add", "Sub": "sub", "Mul": "mul", "Div": "div", "Pow": "pow", "Equal": "eq", "Less": "lt",
           "LessOrEqual": "le", "Greater": "gt", "GreaterOrEqual": "ge", "And": "logical_and",
           "Or": "logical_or", "Xor": "ne", "Max": "maximum", "Min": "minimum", "Sum": "add"}
_BOOL_OUT = {"Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "And", "Or", "Xor", "Not", "IsNaN",
             "IsInf"}
_SYM_UNARY = {"Neg": lambda v: -v, "Abs": lambda v: abs(v) if not _is_sym(v) else sympy.Abs(v),
              "Sqrt": lambda v: math.sqrt(v) if not _is_sym(v) else sympy.sqrt(v)}


def _torch_eval(op: str, ts: list[torch.Tensor], attrs: dict, int_div: bool = False) -> torch.Tensor:
    if int_div:
        return torch.div(ts[0], ts[1], rounding_mode="trunc")
    return get_op(op).ref(ts, attrs, {})[0]


def _fold_elementwise(imp: _Importer, n, irop: str, ins: list[str], out_dtype: str) -> bool:
    """Evaluate at import time when every input is known; False when it must run."""
    ks = [imp.kn(i) for i in ins]
    if any(k is None for k in ks):
        return False
    is_int = ks[0].dtype in _INT_DTYPES
    if all(k.concrete for k in ks):
        ts = [k.tensor() for k in ks]
        r = ts[0] if len(ts) > 1 else _torch_eval(irop, ts, {})
        for t in ts[1:]:   # variadic Sum/Max/Min fold pairwise
            r = _torch_eval(irop, [r, t], {}, int_div=(n.op_type == "Div" and is_int))
        imp.set_tensor(n.output[0], r.to(DTYPES[out_dtype]))
        return True
    shape = broadcast_shapes(*(k.shape for k in ks))
    if math.prod(int(s) for s in shape) > KNOWN_LIMIT:
        return False
    try:
        if len(ks) == 1:
            fn = _SYM_UNARY.get(n.op_type)
            if fn is None:
                return False
            res = _ufunc(fn, ks[0].arr)
        else:
            mk = _SYM_BINARY.get(n.op_type if n.op_type not in ("Sum",) else "Add")
            if mk is None:
                return False
            f = mk(is_int)
            res = ks[0].arr
            for k in ks[1:]:
                res = _ufunc(f, res, k.arr)
    except _Unfoldable:
        return False
    res = res.reshape(tuple(int(s) for s in shape))
    imp.set_known(n.output[0], _Known(res, out_dtype))
    return True


@_handles(*_UNARY, *_BINARY, "IsNaN", "IsInf")
def _elementwise(imp: _Importer, n) -> None:
    op = n.op_type
    ins = [i for i in n.input if i]
    in_dtype = imp.type_of(ins[0]).dtype
    out_dtype = "bool" if op in _BOOL_OUT else in_dtype
    if op in ("IsNaN", "IsInf"):
        if op == "IsInf" and not (imp.attr(n, "detect_positive", 1) and imp.attr(n, "detect_negative", 1)):
            raise imp.fail("IsInf with detect_positive/detect_negative off is not supported")
        x = imp.operand(ins[0])
        if op == "IsNaN":
            imp.emit("ne", [x, x], {}, out=n.output[0])
        else:
            a = imp.emit("abs", [x], {}, hint=f"{n.output[0]}_abs")
            inf = imp.materialise(_Known(_objarr([math.inf], ()), in_dtype), "inf")
            imp.emit("eq", [a, inf], {}, out=n.output[0])
        return
    irop = _UNARY.get(op) or _BINARY[op]
    if _fold_elementwise(imp, n, irop, ins, out_dtype):
        return
    if len(ins) == 1 and op in _UNARY:
        imp.emit(irop, [imp.operand(ins[0])], {}, out=n.output[0])
        return
    if op == "Div" and in_dtype in _INT_DTYPES:
        # ONNX integer division truncates; the core div is true division
        fs = [imp.emit("cast", [imp.operand(i)], {"dtype": "f64"}, hint=f"{n.output[0]}_f") for i in ins]
        q = imp.emit("div", fs, {}, hint=f"{n.output[0]}_q")
        imp.emit("cast", [q], {"dtype": in_dtype}, out=n.output[0])
        return
    vals = [imp.operand(i) for i in ins]
    if len(vals) == 1:   # variadic Sum/Max/Min with one input
        imp.alias(n.output[0], ins[0])
        return
    cur = vals[0]
    for v in vals[1:-1]:
        cur = imp.emit(irop, [cur, v], {}, hint=n.output[0])
    last_dtype = get_op(irop).infer([imp.g.type_of(cur), imp.g.type_of(vals[-1])], {})[0].dtype
    if last_dtype == out_dtype:
        imp.emit(irop, [cur, vals[-1]], {}, out=n.output[0])
    else:   # torch promotion differs from ONNX (e.g. int ** float): cast back to ONNX's type
        cur = imp.emit(irop, [cur, vals[-1]], {}, hint=n.output[0])
        imp.emit("cast", [cur], {"dtype": out_dtype}, out=n.output[0])


@_handles("Cast", "CastLike")
def _cast(imp: _Importer, n) -> None:
    src = n.input[0]
    if n.op_type == "Cast":
        to = _ONNX_DTYPES.get(imp.attr(n, "to"))
    else:
        to = imp.type_of(n.input[1]).dtype
    if to is None:
        raise imp.fail(f"Cast to element type {imp.attr(n, 'to')} is not supported",
                       fix=f"use one of {sorted(set(_ONNX_DTYPES.values()))}")
    k = imp.kn(src)
    if k is not None:
        if k.concrete:
            imp.set_tensor(n.output[0], k.tensor().to(DTYPES[to]))
            return
        try:
            def conv(v):
                if not _is_sym(v):
                    return torch.tensor(v).to(DTYPES[to]).item()
                if to in _INT_DTYPES:
                    return v if v.is_integer else sympy.floor(v)
                if to in _FLOAT_DTYPES:
                    return v
                return not _decide(v, "eq")
            imp.set_known(n.output[0], _Known(_ufunc(conv, k.arr), to))
            return
        except _Unfoldable:
            pass
    if imp.type_of(src).dtype == to:
        imp.alias(n.output[0], src)
        return
    c = imp.const_source(src)
    if c is not None:   # e.g. f16 weights cast to f32: convert once, not per call
        imp.set_big(n.output[0], c[0].to(DTYPES[to]), c[1])
        return
    imp.emit("cast", [imp.operand(src)], {"dtype": to}, out=n.output[0])


@_handles("Where")
def _where(imp: _Importer, n) -> None:
    c, a, b = (imp.kn(i) for i in n.input)
    if c is not None and a is not None and b is not None and c.concrete:
        if a.concrete and b.concrete:
            imp.set_tensor(n.output[0], torch.where(c.tensor(), a.tensor(), b.tensor()))
            return
        shape = broadcast_shapes(c.shape, a.shape, b.shape)
        res = np.where(c.arr.astype(bool), a.arr, b.arr)
        imp.set_known(n.output[0], _Known(np.asarray(res, dtype=object).reshape(tuple(int(s) for s in shape)), a.dtype))
        return
    imp.emit("where", [imp.operand(i) for i in n.input], {}, out=n.output[0])


@_handles("Clip")
def _clip(imp: _Importer, n) -> None:
    lo_n, hi_n = imp.opt_in(n, 1), imp.opt_in(n, 2)
    lo = hi = None
    for which, nm in (("min", lo_n), ("max", hi_n)):
        if nm:
            k = imp.need_known(nm, f"Clip {which}")
            if not k.concrete or k.arr.size != 1:
                raise imp.fail(f"Clip {which} must be a constant scalar", value=str(k.arr.tolist()))
            if which == "min":
                lo = k.tensor().item()
            else:
                hi = k.tensor().item()
    imp.emit("clamp", [imp.operand(n.input[0])], {"min": lo, "max": hi}, out=n.output[0])


@_handles("Gelu")
def _gelu(imp: _Importer, n) -> None:
    approx = imp.attr(n, "approximate", b"none")
    approx = approx.decode() if isinstance(approx, bytes) else str(approx)
    if approx not in ("none", "tanh"):
        raise imp.fail(f"Gelu approximate={approx!r}", fix="use 'none' or 'tanh'")
    imp.emit("gelu", [imp.operand(n.input[0])], {"approximate": approx}, out=n.output[0])


@_handles("LeakyRelu", "HardSigmoid", "HardSwish", "Softplus")
def _activations(imp: _Importer, n) -> None:
    x = imp.operand(n.input[0])
    dt = imp.g.type_of(x).dtype
    out = n.output[0]

    def c(v):
        return imp.materialise(_Known(_objarr([float(v)], ()), dt), f"{out}_c")
    if n.op_type == "LeakyRelu":
        zero = c(0.0)
        pos = imp.emit("gt", [x, zero], {}, hint=f"{out}_pos")
        neg = imp.emit("mul", [x, c(imp.attr(n, "alpha", 0.01))], {}, hint=f"{out}_neg")
        imp.emit("where", [pos, x, neg], {}, out=out)
    elif n.op_type in ("HardSigmoid", "HardSwish"):
        alpha = imp.attr(n, "alpha", 0.2) if n.op_type == "HardSigmoid" else 1 / 6
        beta = imp.attr(n, "beta", 0.5)
        t = imp.emit("mul", [x, c(alpha)], {}, hint=f"{out}_a")
        t = imp.emit("add", [t, c(beta)], {}, hint=f"{out}_b")
        if n.op_type == "HardSigmoid":
            imp.emit("clamp", [t], {"min": 0.0, "max": 1.0}, out=out)
        else:
            t = imp.emit("clamp", [t], {"min": 0.0, "max": 1.0}, hint=f"{out}_hs")
            imp.emit("mul", [x, t], {}, out=out)
    else:  # Softplus = log(exp(x) + 1)
        e = imp.emit("exp", [x], {}, hint=f"{out}_exp")
        e = imp.emit("add", [e, c(1.0)], {}, hint=f"{out}_p1")
        imp.emit("log", [e], {}, out=out)


# ---- softmax / norms / reductions


@_handles("Softmax", "LogSoftmax")
def _softmax(imp: _Importer, n) -> None:
    op = "softmax" if n.op_type == "Softmax" else "log_softmax"
    x = imp.operand(n.input[0])
    t = imp.g.type_of(x)
    axis = norm_axis(imp.attr(n, "axis", -1 if imp.opset >= 13 else 1), t.rank)
    if imp.opset >= 13 or axis == t.rank - 1:
        imp.emit(op, [x], {"dim": axis}, out=n.output[0])
        return
    # opset < 13: softmax over the input coerced to 2-d at `axis`
    lead = normalize_dim(math.prod(t.shape[:axis]) if all(isinstance(d, int) for d in t.shape[:axis])
                         else sympy.Mul(*t.shape[:axis]))
    flat = imp.emit("reshape", [x], {"shape": [_attr_dim(lead), -1]}, hint=f"{n.output[0]}_2d")
    s = imp.emit(op, [flat], {"dim": 1}, hint=f"{n.output[0]}_sm")
    imp.emit("reshape", [s], {"shape": _shape_attr(t.shape)}, out=n.output[0])


@_handles("LayerNormalization")
def _layer_norm(imp: _Importer, n) -> None:
    for extra in n.output[1:]:
        if extra and imp.consumers.get(extra):
            raise imp.fail("the Mean/InvStdDev outputs of LayerNormalization are used",
                           fix="only the normalized output is supported")
    x = imp.operand(n.input[0])
    t = imp.g.type_of(x)
    axis = norm_axis(imp.attr(n, "axis", -1), t.rank)
    ins = [x] + [imp.operand(i) for i in n.input[1:] if i]
    imp.emit("layer_norm", ins, {"normalized_rank": t.rank - axis, "eps": float(imp.attr(n, "epsilon", 1e-5))},
             out=n.output[0])


@_handles("BatchNormalization")
def _batch_norm(imp: _Importer, n) -> None:
    if imp.attr(n, "training_mode", 0):
        raise imp.fail("BatchNormalization in training mode", fix="export the model in eval mode")
    for extra in n.output[1:]:
        if extra and imp.consumers.get(extra):
            raise imp.fail("BatchNormalization running-stat outputs are used", fix="export in eval mode")
    imp.emit("batch_norm", [imp.operand(i) for i in n.input[:5]], {"eps": float(imp.attr(n, "epsilon", 1e-5))},
             out=n.output[0])


_REDUCE = {"ReduceMean": "mean", "ReduceSum": "sum", "ReduceMax": "amax", "ReduceMin": "amin",
           "ReduceProd": None, "ReduceL2": None, "ReduceSumSquare": None}


@_handles(*_REDUCE)
def _reduce(imp: _Importer, n) -> None:
    x_name = n.input[0]
    t = imp.type_of(x_name)
    axes_in = imp.opt_in(n, 1)
    if axes_in:
        axes = imp.ints_of(axes_in, f"{n.op_type} axes")
    else:
        axes = imp.attr(n, "axes", None)
        axes = list(axes) if axes is not None else []
    keep = bool(imp.attr(n, "keepdims", 1))
    if not axes:
        if imp.attr(n, "noop_with_empty_axes", 0):
            imp.alias(n.output[0], x_name)
            return
        axes = list(range(t.rank))
    axes = sorted({norm_axis(a, t.rank) for a in axes})
    k = imp.kn(x_name)
    if k is not None and not k.concrete and n.op_type in ("ReduceSum", "ReduceProd", "ReduceMax", "ReduceMin"):
        fn = {"ReduceSum": lambda a, b: a + b, "ReduceProd": lambda a, b: a * b,
              "ReduceMax": _smax, "ReduceMin": _smin}[n.op_type]
        arr = k.arr
        for ax in reversed(axes):
            arr = np.frompyfunc(fn, 2, 1).reduce(arr, axis=ax, keepdims=keep)
            arr = arr if isinstance(arr, np.ndarray) else _objarr([arr], ())
        imp.set_known(n.output[0], _Known(np.asarray(arr, dtype=object), k.dtype))
        return
    if k is not None and k.concrete:
        tt = k.tensor()
        fns = {"ReduceMean": lambda: tt.float().mean(axes, keepdim=keep).to(tt.dtype) if not tt.is_floating_point()
               else tt.mean(axes, keepdim=keep), "ReduceSum": lambda: tt.sum(axes, keepdim=keep).to(tt.dtype),
               "ReduceMax": lambda: tt.amax(axes, keepdim=keep), "ReduceMin": lambda: tt.amin(axes, keepdim=keep),
               "ReduceProd": lambda: _prod(tt, axes, keep), "ReduceL2": lambda: (tt * tt).sum(axes, keepdim=keep).sqrt(),
               "ReduceSumSquare": lambda: (tt * tt).sum(axes, keepdim=keep)}
        imp.set_tensor(n.output[0], fns[n.op_type]())
        return
    x = imp.operand(x_name)
    attrs = {"dims": axes, "keepdim": keep}
    op = _REDUCE[n.op_type]
    if op is not None:
        imp.emit(op, [x], attrs, out=n.output[0])
    elif n.op_type in ("ReduceL2", "ReduceSumSquare"):
        sq = imp.emit("mul", [x, x], {}, hint=f"{n.output[0]}_sq")
        if n.op_type == "ReduceSumSquare":
            imp.emit("sum", [sq], attrs, out=n.output[0])
        else:
            s = imp.emit("sum", [sq], attrs, hint=f"{n.output[0]}_sum")
            imp.emit("sqrt", [s], {}, out=n.output[0])
    else:
        raise imp.fail("ReduceProd over run-time data is not supported (no core product op)")


def _prod(t: torch.Tensor, axes: list[int], keep: bool) -> torch.Tensor:
    for ax in reversed(axes):
        t = t.prod(ax, keepdim=keep)
    return t


@_handles("CumSum")
def _cumsum(imp: _Importer, n) -> None:
    if imp.attr(n, "exclusive", 0) or imp.attr(n, "reverse", 0):
        raise imp.fail("CumSum with exclusive/reverse is not supported")
    x = imp.operand(n.input[0])
    ax = imp.ints_of(n.input[1], "CumSum axis")[0]
    imp.emit("cumsum", [x], {"dim": norm_axis(ax, imp.g.type_of(x).rank)}, out=n.output[0])


# ---- gemm / conv / pool


def _weight_t(imp: _Importer, name: str, transpose: bool, scale: float = 1.0) -> str:
    """A 2-d constant as a linear weight [out, in] (transposed copy cached per initializer)."""
    key = f"{name}|{transpose}|{scale}"
    if key in imp.transposed:
        return imp.transposed[key]
    tied = _tied_transpose(imp, name) if transpose and scale == 1.0 else None
    if tied is not None:
        v = imp.operand(tied)
    elif not transpose and scale == 1.0:
        v = imp.operand(name)
    else:
        w = imp.const_tensor(name)
        w = (w.t() if transpose else w).contiguous()
        if scale != 1.0:
            w = w * scale
        k = imp.kn(name)
        src = (k.source if k is not None else None) or name
        role = "param" if (name in imp.big and imp.big[name][1] == "param") or (k is not None and k.source) else "const"
        v = imp.g.add_constant(imp.g.fresh_name(_vname(src) + ("_t" if transpose else "") + ("_s" if scale != 1.0 else "")),
                               w, role=role)
    imp.transposed[key] = v
    return v


def _tied_transpose(imp: _Importer, name: str) -> str | None:
    """Another parameter initializer holding exactly `name`'s transpose (exporters constant-fold
    `wte.T` for a tied LM head): reuse it instead of materialising a transposed copy."""
    if name not in imp.big:
        return None
    t, _ = imp.big[name]
    if t.dim() != 2:
        return None
    want = (t.shape[1], t.shape[0])
    for other, (o, role) in imp.big.items():
        if other != name and role == "param" and tuple(o.shape) == want and o.dtype == t.dtype \
                and torch.equal(o[:1], t.t()[:1]) and torch.equal(o, t.t()):
            return other
    return None


def _bias_consumer(imp: _Importer, out: str, n_out: Dim) -> tuple[int, str] | None:
    """(node index, bias name) when `out`'s only consumer is `Add(out, 1-d constant [n_out])`."""
    users = imp.consumers.get(out, [])
    if len(users) != 1 or out in imp.graph_outputs:
        return None
    j = users[0]
    add = imp.gp.node[j]
    if add.op_type != "Add" or len(add.input) != 2 or list(add.input).count(out) != 1:
        return None
    if imp.excluded("Add", "add"):
        return None
    other = add.input[1] if add.input[0] == out else add.input[0]
    if not imp.has(other) or not imp.is_const(other):
        return None
    bt = imp.type_of(other)
    if bt.rank != 1 or not isinstance(n_out, int) or bt.shape[0] != n_out:
        return None
    return j, other


def _linear(imp: _Importer, n, x: str, w: str, bias: str | None, out: str) -> None:
    """linear(x, w[, bias]); a following `Add(out, bias)` is folded into the linear node."""
    wt = imp.g.type_of(w)
    if bias is None:
        hit = _bias_consumer(imp, out, wt.shape[0])
        if hit is not None:
            j, bname = hit
            b = imp.operand(bname)
            if imp.g.type_of(b).dtype == imp.g.type_of(x).dtype:
                imp.skip.add(j)
                imp.emit("linear", [x, w, b], {}, out=imp.gp.node[j].output[0])
                return
    imp.emit("linear", [x, w] + ([bias] if bias else []), {}, out=out)


@_handles("MatMul")
def _matmul(imp: _Importer, n) -> None:
    a_n, b_n = n.input[0], n.input[1]
    at, bt = imp.type_of(a_n), imp.type_of(b_n)
    out = n.output[0]
    if imp.is_const(b_n) and bt.rank == 2 and at.rank >= 2 and not imp.is_const(a_n):
        _linear(imp, n, imp.operand(a_n), _weight_t(imp, b_n, True), None, out)
        return
    a, b = imp.operand(a_n), imp.operand(b_n)
    if at.rank >= 2 and bt.rank >= 2:
        imp.emit("matmul", [a, b], {}, out=out)
        return
    # rank-1 operands: numpy semantics via reshapes
    a2 = imp.emit("reshape", [a], {"shape": [1, _attr_dim(at.shape[0])]}, hint=f"{out}_a") if at.rank == 1 else a
    b2 = imp.emit("reshape", [b], {"shape": [_attr_dim(bt.shape[0]), 1]}, hint=f"{out}_b") if bt.rank == 1 else b
    m = imp.emit("matmul", [a2, b2], {}, hint=f"{out}_mm")
    mt = imp.g.type_of(m)
    shape = list(mt.shape)
    if bt.rank == 1:
        shape.pop(-1)
    if at.rank == 1:
        shape.pop(-2 if bt.rank != 1 else -1)
    imp.emit("reshape", [m], {"shape": _shape_attr(shape)}, out=out)


@_handles("Gemm")
def _gemm(imp: _Importer, n) -> None:
    a_n, b_n = n.input[0], n.input[1]
    c_n = imp.opt_in(n, 2)
    alpha, beta = float(imp.attr(n, "alpha", 1.0)), float(imp.attr(n, "beta", 1.0))
    ta, tb = bool(imp.attr(n, "transA", 0)), bool(imp.attr(n, "transB", 0))
    out = n.output[0]
    a = imp.operand(a_n)
    if ta:
        a = imp.emit("permute", [a], {"perm": [1, 0]}, hint=f"{out}_aT")
    bias = None
    c_done = c_n is None or beta == 0.0
    if c_n and not c_done and imp.is_const(c_n):
        ct = imp.type_of(c_n)
        if ct.rank <= 2 and (ct.rank == 1 or ct.shape[0] == 1):
            cvec = imp.const_tensor(c_n).reshape(-1)
            if beta != 1.0:
                cvec = cvec * beta
            bt_ = imp.type_of(b_n)
            n_out = bt_.shape[0] if tb else bt_.shape[1]
            if isinstance(n_out, int) and cvec.numel() in (n_out, 1):
                if cvec.numel() == 1 and n_out != 1:
                    cvec = cvec.expand(n_out)
                k = imp.kn(c_n)
                src = k.source if k is not None and k.source and beta == 1.0 and ct.rank == 1 else None
                if src is not None:
                    bias = imp.operand(c_n)
                else:
                    bias = imp.g.add_constant(imp.g.fresh_name(_vname(c_n)), cvec.contiguous(), role="param")
                c_done = True
    if imp.is_const(b_n) and imp.type_of(b_n).rank == 2:
        w = _weight_t(imp, b_n, not tb, alpha)
        if c_done:
            imp.emit("linear", [a, w] + ([bias] if bias else []), {}, out=out)
            return
        y = imp.emit("linear", [a, w], {}, hint=f"{out}_mm")
    else:
        b = imp.operand(b_n)
        if tb:
            b = imp.emit("permute", [b], {"perm": [1, 0]}, hint=f"{out}_bT")
        y = imp.emit("matmul", [a, b], {}, hint=f"{out}_mm")
        if alpha != 1.0:
            y = imp.emit("mul", [y, imp.materialise(_Known(_objarr([alpha], ()), imp.g.type_of(y).dtype), "alpha")],
                         {}, hint=f"{out}_alpha")
        if c_done:
            if bias is not None:
                y = imp.emit("add", [y, bias], {}, out=out)
            else:
                imp.ir[out] = y
                imp.check_declared(out)
            return
    c = imp.operand(c_n)
    if beta != 1.0:
        c = imp.emit("mul", [c, imp.materialise(_Known(_objarr([beta], ()), imp.g.type_of(c).dtype), "beta")], {},
                     hint=f"{out}_beta")
    imp.emit("add", [y, c], {}, out=out)


def _pads2d(imp: _Importer, n, x_t: TensorType, kernel: list[int], strides: list[int], dil: list[int]) -> list[int]:
    auto = imp.attr(n, "auto_pad", b"NOTSET")
    auto = auto.decode() if isinstance(auto, bytes) else auto
    if auto in ("NOTSET", ""):
        pads = list(imp.attr(n, "pads", [0, 0, 0, 0]))
    elif auto == "VALID":
        pads = [0, 0, 0, 0]
    else:  # SAME_UPPER / SAME_LOWER: needs static spatial dims
        pads = [0, 0, 0, 0]
        for i in range(2):
            size = x_t.shape[2 + i]
            if not isinstance(size, int):
                raise imp.fail(f"auto_pad={auto} over a symbolic spatial dim", fix="export with explicit pads")
            out = -(-size // strides[i])
            total = max(0, (out - 1) * strides[i] + (kernel[i] - 1) * dil[i] + 1 - size)
            lo = total // 2 if auto == "SAME_UPPER" else total - total // 2
            pads[i], pads[i + 2] = lo, total - lo
    if len(pads) != 4 or pads[0] != pads[2] or pads[1] != pads[3]:
        raise imp.fail(f"asymmetric padding {pads} is not supported", fix="pad explicitly in the model")
    return pads[:2]


def _need_2d(imp: _Importer, t: TensorType) -> None:
    if t.rank != 4:
        raise imp.fail(f"only 2-d (NCHW) {imp.node.op_type} is supported, input is {t.text()}",
                       fix="reshape 1-d/3-d convolutions into 2-d in the model")


@_handles("Conv")
def _conv(imp: _Importer, n) -> None:
    x = imp.operand(n.input[0])
    xt = imp.g.type_of(x)
    _need_2d(imp, xt)
    w = imp.operand(n.input[1])
    wt = imp.g.type_of(w)
    kernel = list(imp.attr(n, "kernel_shape", wt.shape[2:]))
    strides = list(imp.attr(n, "strides", [1, 1]))
    dil = list(imp.attr(n, "dilations", [1, 1]))
    pads = _pads2d(imp, n, xt, kernel, strides, dil)
    ins = [x, w] + ([imp.operand(n.input[2])] if imp.opt_in(n, 2) else [])
    imp.emit("conv2d", ins, {"stride": strides, "padding": pads, "dilation": dil, "groups": int(imp.attr(n, "group", 1))},
             out=n.output[0])


@_handles("MaxPool", "AveragePool")
def _pool(imp: _Importer, n) -> None:
    if len(n.output) > 1 and n.output[1] and imp.consumers.get(n.output[1]):
        raise imp.fail("MaxPool indices output is used", fix="only the pooled values are supported")
    x = imp.operand(n.input[0])
    xt = imp.g.type_of(x)
    _need_2d(imp, xt)
    kernel = list(imp.attr(n, "kernel_shape"))
    strides = list(imp.attr(n, "strides", [1, 1]))
    dil = list(imp.attr(n, "dilations", [1, 1]))
    pads = _pads2d(imp, n, xt, kernel, strides, dil)
    ceil = bool(imp.attr(n, "ceil_mode", 0))
    if n.op_type == "MaxPool":
        if imp.attr(n, "storage_order", 0):
            raise imp.fail("MaxPool storage_order=1 is not supported")
        imp.emit("max_pool2d", [x], {"kernel": kernel, "stride": strides, "padding": pads, "dilation": dil,
                                     "ceil_mode": ceil}, out=n.output[0])
    else:
        if dil != [1, 1]:
            raise imp.fail("AveragePool with dilations is not supported")
        imp.emit("avg_pool2d", [x], {"kernel": kernel, "stride": strides, "padding": pads, "ceil_mode": ceil,
                                     "count_include_pad": bool(imp.attr(n, "count_include_pad", 0))}, out=n.output[0])


@_handles("GlobalAveragePool", "GlobalMaxPool")
def _global_pool(imp: _Importer, n) -> None:
    x = imp.operand(n.input[0])
    xt = imp.g.type_of(x)
    if n.op_type == "GlobalAveragePool" and xt.rank == 4:
        imp.emit("adaptive_avg_pool2d", [x], {"output_size": [1, 1]}, out=n.output[0])
    else:
        imp.emit("mean" if n.op_type == "GlobalAveragePool" else "amax", [x],
                 {"dims": list(range(2, xt.rank)), "keepdim": True}, out=n.output[0])


# ---- shape / data movement


def _emit_reshape(imp: _Importer, src: str, shape: Sequence[Dim], out: str) -> None:
    t = imp.type_of(src)
    if _same_shape(t.shape, shape):
        imp.alias(out, src)
        return
    k = imp.kn(src)
    static = all(isinstance(d, int) for d in shape)
    if k is not None and static:
        imp.set_known(out, _Known(k.arr.reshape(tuple(shape)), k.dtype))
        return
    c = imp.const_source(src)
    if c is not None and static:
        imp.set_big(out, c[0].reshape(tuple(shape)), c[1])
        return
    imp.emit("reshape", [imp.operand(src)], {"shape": _shape_attr(shape)}, out=out)


def _resolve_reshape(in_shape: Sequence[Dim], target: Sequence[Dim]) -> tuple[Dim, ...]:
    """The op table's resolve_reshape, with a cheap exact division for the usual polynomial dims."""
    target = [normalize_dim(d) for d in target]
    holes = [i for i, d in enumerate(target) if isinstance(d, int) and d == -1]
    if not holes:
        return tuple(target)
    if len(holes) == 1:
        total = sympy.Mul(*in_shape) if in_shape else sympy.Integer(1)
        known = sympy.Mul(*[d for d in target if not (isinstance(d, int) and d == -1)])
        q = sympy.cancel(sympy.sympify(total) / known)
        if q.is_polynomial() and not q.has(sympy.Function):
            if sympy.fraction(sympy.together(q))[1] == 1:
                target[holes[0]] = normalize_dim(q)
                return tuple(target)
    return resolve_reshape(in_shape, target)


@_handles("Reshape")
def _reshape(imp: _Importer, n) -> None:
    src = n.input[0]
    t = imp.type_of(src)
    target = imp.need_known(n.input[1], "Reshape shape").dims()
    allowzero = imp.attr(n, "allowzero", 0)
    if not allowzero:
        target = [t.shape[i] if isinstance(d, int) and d == 0 else d for i, d in enumerate(target)]
    try:
        shape = _resolve_reshape(t.shape, target)
    except IRError as e:
        raise imp.fail(f"Reshape: {e.message}") from None
    _emit_reshape(imp, src, shape, n.output[0])


@_handles("Flatten")
def _flatten(imp: _Importer, n) -> None:
    t = imp.type_of(n.input[0])
    axis = imp.attr(n, "axis", 1)
    axis = axis + t.rank if axis < 0 else axis

    def prod(ds):
        p: Any = 1
        for d in ds:
            p = p * d
        return normalize_dim(p)
    _emit_reshape(imp, n.input[0], [prod(t.shape[:axis]), prod(t.shape[axis:])], n.output[0])


def _axes_arg(imp: _Importer, n, what: str) -> list[int] | None:
    ax_in = imp.opt_in(n, 1)
    if ax_in:
        return imp.ints_of(ax_in, f"{what} axes")
    a = imp.attr(n, "axes", None)
    return list(a) if a is not None else None


@_handles("Unsqueeze")
def _unsqueeze(imp: _Importer, n) -> None:
    t = imp.type_of(n.input[0])
    axes = _axes_arg(imp, n, "Unsqueeze") or []
    r = t.rank + len(axes)
    axes = sorted(norm_axis(a, r) for a in axes)
    shape = list(t.shape)
    for a in axes:
        shape.insert(a, 1)
    _emit_reshape(imp, n.input[0], shape, n.output[0])


@_handles("Squeeze")
def _squeeze(imp: _Importer, n) -> None:
    t = imp.type_of(n.input[0])
    axes = _axes_arg(imp, n, "Squeeze")
    if axes is None:
        axes = [i for i, d in enumerate(t.shape) if isinstance(d, int) and d == 1]
    axes = {norm_axis(a, t.rank) for a in axes}
    for a in axes:
        if not (isinstance(t.shape[a], int) and t.shape[a] == 1):
            raise imp.fail(f"Squeeze of dim {a} of size {dim_str(t.shape[a]) if not isinstance(t.shape[a], int) else t.shape[a]}, not 1")
    _emit_reshape(imp, n.input[0], [d for i, d in enumerate(t.shape) if i not in axes], n.output[0])


@_handles("Transpose")
def _transpose(imp: _Importer, n) -> None:
    t = imp.type_of(n.input[0])
    perm = list(imp.attr(n, "perm", list(range(t.rank))[::-1]))
    if perm == list(range(t.rank)):
        imp.alias(n.output[0], n.input[0])
        return
    k = imp.kn(n.input[0])
    if k is not None:
        imp.set_known(n.output[0], _Known(np.transpose(k.arr, perm), k.dtype))
        return
    c = imp.const_source(n.input[0])
    if c is not None:   # e.g. the dynamo exporter's Transpose(wte) feeding the LM head MatMul
        imp.set_big(n.output[0], c[0].permute(perm), c[1])
        return
    imp.emit("permute", [imp.operand(n.input[0])], {"perm": perm}, out=n.output[0])


@_handles("Concat")
def _concat(imp: _Importer, n) -> None:
    ins = [i for i in n.input if i]
    t0 = imp.type_of(ins[0])
    axis = norm_axis(imp.attr(n, "axis"), t0.rank)
    ks = [imp.kn(i) for i in ins]
    if all(k is not None for k in ks):
        imp.set_known(n.output[0], _Known(np.concatenate([k.arr for k in ks], axis=axis), ks[0].dtype))
        return
    # drop empty pieces (static 0-size along axis), they are legal in ONNX
    ins = [i for i in ins if not (isinstance(imp.type_of(i).shape[axis], int) and imp.type_of(i).shape[axis] == 0)]
    if len(ins) == 1:
        imp.alias(n.output[0], ins[0])
        return
    imp.emit("concat", [imp.operand(i) for i in ins], {"dim": axis}, out=n.output[0])


@_handles("Split")
def _split(imp: _Importer, n) -> None:
    t = imp.type_of(n.input[0])
    axis = norm_axis(imp.attr(n, "axis", 0), t.rank)
    outs = list(n.output)
    sp_in = imp.opt_in(n, 1)
    if sp_in:
        sizes = imp.ints_of(sp_in, "Split sizes")
    elif imp.attr(n, "split", None) is not None:
        sizes = list(imp.attr(n, "split"))
    else:
        size = t.shape[axis]
        if not isinstance(size, int):
            raise imp.fail(f"Split of symbolic dim {dim_str(size)} into equal parts",
                           fix="give explicit split sizes in the model")
        parts = imp.attr(n, "num_outputs", len(outs))
        chunk = -(-size // parts)
        sizes = [min(chunk, size - i * chunk) for i in range(parts)]
    k = imp.kn(n.input[0])
    start = 0
    for o, s in zip(outs, sizes):
        if o:
            if k is not None:
                idx = [slice(None)] * t.rank
                idx[axis] = slice(start, start + s)
                imp.set_known(o, _Known(k.arr[tuple(idx)], k.dtype))
            else:
                imp.emit("slice", [imp.operand(n.input[0])], {"dim": axis, "start": start, "end": start + s, "step": 1},
                         out=o)
        start += s


@_handles("Slice")
def _slice(imp: _Importer, n) -> None:
    src = n.input[0]
    t = imp.type_of(src)
    starts = imp.need_known(n.input[1], "Slice starts").dims()
    ends = imp.need_known(n.input[2], "Slice ends").dims()
    axes = imp.ints_of(n.input[3], "Slice axes") if imp.opt_in(n, 3) else list(range(len(starts)))
    steps = imp.ints_of(n.input[4], "Slice steps") if imp.opt_in(n, 4) else [1] * len(starts)
    k = imp.kn(src)
    specs = []
    for s, e, a, st in zip(starts, ends, axes, steps):
        a = norm_axis(a, t.rank)
        if st == 0:
            raise imp.fail("Slice step 0")
        if not isinstance(s, int):
            raise imp.fail(f"Slice start {dim_str(s)} is symbolic", fix="only the end of a slice may be symbolic")
        if isinstance(e, int) and e >= BIG_END:
            e = BIG_END
        if isinstance(e, int) and e <= -BIG_END:
            e = -BIG_END
        specs.append((a, s, e, st))
    if k is not None and all(isinstance(e, int) for _, _, e, _ in specs):
        idx = [slice(None)] * t.rank
        for a, s, e, st in specs:
            idx[a] = slice(s, e, st)
        imp.set_known(n.output[0], _Known(k.arr[tuple(idx)], k.dtype))
        return
    cur = imp.operand(src)
    todo = [sp for sp in specs if not (sp[1] == 0 and sp[3] == 1 and isinstance(sp[2], int) and sp[2] >= BIG_END)]
    if not todo:
        imp.alias(n.output[0], src)
        return
    for j, (a, s, e, st) in enumerate(todo):
        if st < 0:
            raise imp.fail("Slice with a negative step is not supported (no core flip op)")
        last = j == len(todo) - 1
        cur = imp.emit("slice", [cur], {"dim": a, "start": s, "end": _attr_dim(e), "step": st},
                       out=n.output[0] if last else None, hint=n.output[0])


@_handles("Gather")
def _gather(imp: _Importer, n) -> None:
    data, idx = n.input[0], n.input[1]
    dt, it = imp.type_of(data), imp.type_of(idx)
    axis = norm_axis(imp.attr(n, "axis", 0), dt.rank)
    kd, ki = imp.kn(data), imp.kn(idx)
    size = dt.shape[axis]
    if kd is not None and ki is not None and ki.concrete:
        ids = np.array([int(v) + (size if int(v) < 0 else 0) for v in ki.arr.flat], dtype=np.int64).reshape(ki.shape)
        imp.set_known(n.output[0], _Known(np.take(kd.arr, ids, axis=axis), kd.dtype))
        return
    out = n.output[0]
    if axis == 0 and dt.rank == 2 and imp.is_const(data) and it.dtype in ("i64", "i32"):
        imp.emit("embedding", [imp.operand(data), imp.operand(idx)], {}, out=out)
        return
    x = imp.operand(data)
    if ki is not None and ki.concrete and it.rank == 0:
        i = int(ki.arr.flat[0])
        if i < 0 and not isinstance(size, int):
            end = i + 1 if i != -1 else BIG_END
        else:
            i = i + size if i < 0 else i
            end = i + 1
        s = imp.emit("slice", [x], {"dim": axis, "start": i, "end": end, "step": 1}, hint=f"{out}_sel")
        shape = [d for j, d in enumerate(dt.shape) if j != axis]
        imp.emit("reshape", [s], {"shape": _shape_attr(shape)}, out=out)
        return
    if ki is not None and ki.concrete and isinstance(size, int):
        ids = torch.tensor([int(v) + (size if int(v) < 0 else 0) for v in ki.arr.flat], dtype=torch.int64)
        if it.rank == 1:
            imp.emit("index_select", [x, imp.materialise(_Known.of(ids), f"{out}_idx")], {"dim": axis}, out=out)
            return
        i_v = imp.materialise(_Known.of(ids.reshape(ki.shape)), f"{out}_idx")
    else:
        i_v = imp.operand(idx)
    if it.rank == 1:
        imp.emit("index_select", [x, i_v], {"dim": axis}, out=out)
    else:
        imp.emit("index", [x, i_v], {"dims": [axis]}, out=out)


@_handles("GatherND")
def _gather_nd(imp: _Importer, n) -> None:
    if imp.attr(n, "batch_dims", 0):
        raise imp.fail("GatherND with batch_dims > 0 is not supported")
    x = imp.operand(n.input[0])
    it = imp.type_of(n.input[1])
    depth = it.shape[-1]
    if not isinstance(depth, int):
        raise imp.fail("GatherND with a symbolic index depth")
    ind = imp.operand(n.input[1])
    idx = []
    for j in range(depth):
        s = imp.emit("slice", [ind], {"dim": it.rank - 1, "start": j, "end": j + 1, "step": 1},
                     hint=f"{n.output[0]}_i{j}")
        idx.append(imp.emit("reshape", [s], {"shape": _shape_attr(it.shape[:-1])}, hint=f"{n.output[0]}_i{j}"))
    imp.emit("index", [x] + idx, {"dims": list(range(depth))}, out=n.output[0])


@_handles("Expand")
def _expand(imp: _Importer, n) -> None:
    src = n.input[0]
    t = imp.type_of(src)
    target = imp.need_known(n.input[1], "Expand shape").dims()
    try:
        shape = broadcast_shapes(t.shape, target)
    except IRError as e:
        raise imp.fail(f"Expand: {e.message}") from None
    if _same_shape(shape, t.shape):
        imp.alias(n.output[0], src)
        return
    k = imp.kn(src)
    if k is not None and all(isinstance(d, int) for d in shape) and math.prod(shape) <= KNOWN_LIMIT:
        imp.set_known(n.output[0], _Known(np.broadcast_to(k.arr, tuple(shape)).copy(), k.dtype))
        return
    imp.emit("expand", [imp.operand(src)], {"shape": _shape_attr(shape)}, out=n.output[0])


@_handles("ConstantOfShape")
def _constant_of_shape(imp: _Importer, n) -> None:
    from onnx import numpy_helper
    shape = imp.need_known(n.input[0], "ConstantOfShape shape").dims()
    v = imp.attr(n, "value", None)
    val = torch.from_numpy(numpy_helper.to_array(v).copy()).reshape(-1) if v is not None else torch.zeros(1)
    if all(isinstance(d, int) for d in shape) and math.prod(shape) <= KNOWN_LIMIT:
        imp.set_tensor(n.output[0], val.expand(*shape).clone() if shape else val.reshape(()).clone())
        return
    from graphmode.ir.types import TORCH_TO_DTYPE
    dt = TORCH_TO_DTYPE[val.dtype]
    scalar = val.item()
    imp.emit("full", [], {"shape": _shape_attr(shape), "value": scalar, "dtype": dt}, out=n.output[0])


@_handles("Range")
def _range(imp: _Importer, n) -> None:
    ks = [imp.need_known(i, f"Range {w}") for i, w in zip(n.input, ("start", "limit", "delta"))]
    start, limit, delta = (k.arr.flat[0] for k in ks)
    dtype = ks[0].dtype
    if all(not _is_sym(v) for v in (start, limit, delta)):
        imp.set_tensor(n.output[0], torch.arange(start, limit, delta, dtype=DTYPES[dtype]))
        return
    if _is_sym(delta) or dtype not in _INT_DTYPES or int(delta) != delta:
        raise imp.fail("Range with a symbolic or non-integer step is not supported")
    imp.emit("arange", [], {"start": _attr_dim(normalize_dim(start)), "end": _attr_dim(normalize_dim(limit)),
                            "step": int(delta), "dtype": dtype}, out=n.output[0])


@_handles("Trilu")
def _trilu(imp: _Importer, n) -> None:
    k = imp.ints_of(n.input[1], "Trilu k")[0] if imp.opt_in(n, 1) else 0
    op = "triu" if imp.attr(n, "upper", 1) else "tril"
    imp.emit(op, [imp.operand(n.input[0])], {"diagonal": k}, out=n.output[0])


# ------------------------------------------------------------------------------ entry point


def _load(path_or_model, label: str):
    import onnx
    if isinstance(path_or_model, onnx.ModelProto):
        return path_or_model
    if isinstance(path_or_model, (bytes, bytearray)):
        try:
            return onnx.load_model_from_string(bytes(path_or_model))
        except Exception as e:  # noqa: BLE001 - protobuf raises DecodeError and friends
            raise CaptureError(f"not a valid ONNX model: {type(e).__name__}: {e}", where=f"onnx {label}",
                               fix="pass the bytes of a serialized onnx.ModelProto") from None
    p = Path(os.fspath(path_or_model))
    if not p.exists():
        raise CaptureError("ONNX file not found", where=f"onnx {label}", value=str(p),
                           fix="check the path (relative paths are resolved against the working directory)")
    if not p.is_file():
        raise CaptureError("ONNX path is not a file", where=f"onnx {label}", value=str(p),
                           fix="give the path of the .onnx file itself")
    try:
        return onnx.load(str(p))
    except Exception as e:  # noqa: BLE001 - DecodeError, external-data errors...
        msg = str(e).strip().splitlines()
        raise CaptureError(f"not a readable ONNX model: {type(e).__name__}: {msg[0] if msg else ''}",
                           where=f"onnx {label}",
                           fix="re-export the model (torch.onnx.export / graphmode.capture.onnx_export.export_onnx); "
                               "keep external-data files next to the .onnx file") from None


def make_onnx_excluder(include_ops: Sequence[str] = (), exclude_ops: Sequence[str] = ()) -> Callable[[str, str], bool]:
    """An ONNX node is excluded when its op type ('Softmax'), lower-cased type ('softmax') or the core
    op it lowers to ('softmax', 'layer_norm') is excluded (or missing from a non-empty include list)."""
    inc, exc = set(include_ops), set(exclude_ops)

    def excluded(onnx_op: str, ir_op: str) -> bool:
        names = {onnx_op, onnx_op.lower(), ir_op, f"onnx::{onnx_op}"}
        if inc and not (names & inc):
            return True
        return bool(names & exc)
    return excluded


def import_onnx(path_or_model, *, dims: Mapping[str, tuple[int, int]] | None = None,
                input_dims: Mapping[str, Sequence] | None = None, name: str | None = None,
                include_ops: Sequence[str] = (), exclude_ops: Sequence[str] = (),
                check_types: bool = True) -> tuple[Graph, OnnxCaptureReport]:
    """Import an ONNX model (path, bytes or onnx.ModelProto) into an IR graph.

    `input_dims` maps ONNX input names to dim names/ints (default: the model's own dim_params,
    e.g. `batch`, `seq`); `dims` gives each dim's (min, max) range (default: the zoo's ranges
    for batch/seq, else DEFAULT_RANGE). Every value's IR type is cross-checked against the
    model's value_info / output types and, with `check_types`, ONNX shape inference. Every
    failure is a CaptureError naming the file, the node and the fix.
    """
    t0 = time.perf_counter()
    try:
        import onnx  # noqa: F401
    except ImportError:  # pragma: no cover - onnx is a hard dependency
        raise CaptureError("the onnx package is not installed", fix="pip install onnx") from None
    is_path = isinstance(path_or_model, (str, os.PathLike))
    label = str(path_or_model) if is_path else (name or "<in-memory model>")
    model = _load(path_or_model, label)
    opset, inferred = validate_onnx(model, label, supported_onnx_ops())
    gname = name or (Path(str(path_or_model)).stem if is_path else (model.graph.name or "onnx_model"))
    imp = _Importer(model, label, gname, dims, input_dims, make_onnx_excluder(include_ops, exclude_ops))
    imp.extra_value_info = inferred if check_types else []
    g = imp.run()
    ops = Counter(n.op_type for n in model.graph.node)
    report = OnnxCaptureReport(source="onnx", seconds=time.perf_counter() - t0, aten_ops=dict(sorted(ops.items())),
                               fallbacks=sorted(imp.fallbacks.values(), key=lambda f: (f.target, f.loc)),
                               output_names=[o.name for o in model.graph.output], opset=opset,
                               producer=f"{model.producer_name} {model.producer_version}".strip(),
                               folded_nodes=imp.folded, runtime_dims=imp.runtime_dims,
                               op_map={k: dict(sorted(v.items())) for k, v in sorted(imp.op_map.items())})
    return g, report
