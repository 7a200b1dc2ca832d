"""The ONNX importer: loading, validation, the value/graph state, the handler registry and
`import_onnx`. Handlers (one per ONNX op type) live in the convert_* modules."""
from __future__ import annotations


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

from graphmode.capture.onnx.functions import expand_functions, has_body
from graphmode.capture.onnx_validate import node_where, validate_onnx
from graphmode.capture.onnx_validate import ONNX_DTYPES as _ONNX_DTYPES
from graphmode.capture.torch_import import CaptureReport, Fallback
from graphmode.errors import CaptureError, IRError
from graphmode.ir.graph import Graph, clean_name
from graphmode.ir.ops import aten_call, get_op
from graphmode.ir.types import Dim, TensorType, dim_str, dims_equal, normalize_dim, sym

from graphmode.capture.onnx.fold import DEFAULT_RANGE, KNOWN_LIMIT, _Known, _Unfoldable, _is_sym, _objarr, _py


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


# ------------------------------------------------------------------------------ importer

_UNSIGNED = frozenset({"u16", "u32", "u64"})
# ops torch runs on u16/u32/u64 tensors (moves, casts, equality); the rest go through int64
_UNSIGNED_NATIVE = frozenset({"cast", "identity", "reshape", "permute", "expand", "slice", "concat", "index",
                              "eq", "full"})
_U64_AS_I64 = frozenset({"add", "sub", "mul", "eq", "ne", "neg", "bitwise_and", "bitwise_or", "bitwise_xor",
                         "bitwise_not", "bitwise_left_shift"})
_U64_ORDERED = frozenset({"lt", "le", "gt", "ge", "maximum", "minimum"})


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
                 input_dims: Mapping[str, Sequence] | None, excluded: Callable[[str, str], bool],
                 input_values: Mapping[str, torch.Tensor] | None = None):
        from onnx import numpy_helper  # noqa: F401 - imported here so a missing onnx fails in import_onnx
        self.m = model
        self.label = label
        self.gp = model.graph
        self.g = Graph(clean_name(name))
        self.user_dims = dict(dims) if dims is not None else None
        self.input_dims = dict(input_dims or {})
        self.input_values = dict(input_values or {})
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
        if op not in _UNSIGNED_NATIVE and any(self.g.type_of(i).dtype in _UNSIGNED for i in inputs):
            return self._emit_unsigned(op, inputs, attrs, out=out, hint=hint)
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

    def _emit_unsigned(self, op: str, inputs: list[str], attrs: dict, *, out: str | None, hint: str | None) -> str:
        """`op` on u16/u32/u64 values, which torch has almost no kernels for: computed on int64 and
        cast back. Exact for u16/u32 (their values fit int64); for u64 only where int64 bit patterns
        give the same bits (add, sub, mul, eq, ne: arithmetic modulo 2**64)."""
        types = [self.g.type_of(i) for i in inputs]
        unsigned = next(t.dtype for t in types if t.dtype in _UNSIGNED)
        # u64 order: shifting both sides by -2**63 (wrapping) maps unsigned order onto signed order
        ordered = unsigned == "u64" and op in _U64_ORDERED
        if unsigned == "u64" and op not in _U64_AS_I64 and not ordered:
            raise self.fail(f"{op} on uint64 values is not supported: torch has no uint64 kernels for it, and "
                            "int64 divides differently above 2**63",
                            fix="cast the values to int64 in the model where they fit")
        want = get_op(op).infer(types, attrs)[0].dtype
        h = hint or out or op
        shift = self.scalar(-2 ** 63, "i64", f"{h}_shift") if ordered else None
        wide = []
        for i, t in zip(inputs, types):
            if t.dtype in _UNSIGNED:
                i = self.emit("cast", [i], {"dtype": "i64"}, hint=f"{h}_i64")
                if shift is not None:
                    i = self.emit("add", [i, shift], {}, hint=f"{h}_i64")
            wide.append(i)
        if want not in _UNSIGNED:
            return self.emit(op, wide, attrs, out=out, hint=hint)
        r = self.emit(op, wide, attrs, hint=f"{h}_i64")
        if shift is not None:
            r = self.emit("sub", [r, shift], {}, hint=f"{h}_i64")
        return self.emit("cast", [r], {"dtype": want}, out=out, hint=hint)

    def _fallback(self, op: str, inputs: list[str], attrs: dict, otype: TensorType, name: str) -> None:
        n = self.node
        call = aten_call(op, attrs, [self.g.type_of(i) for i in inputs])
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
                    if static is not None and isinstance(w, str) and self._fixed_dim(w) == static:
                        wd = static     # a recipe dim pinned to the model's own fixed extent
                    if static is not None and (not isinstance(wd, int) or wd != static):
                        raise CaptureError(f"input {vi.name!r} dim {i} is fixed to {static} in the model, but "
                                           f"input_dims says {w!r}", where=f"onnx {self.label}", value=static,
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
            if vi.name in self.input_values:
                self._bind_constant_input(vi.name, ty)
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

    def _bind_constant_input(self, name: str, ty: TensorType) -> None:
        """An input the recipe declares constant: known to the converters (shape-like data folds),
        still a graph input (the runtime checks each call's value against the declared one)."""
        t = self.input_values[name]
        if list(t.shape) != list(ty.shape) or TensorType.of(t).dtype != ty.dtype:
            raise CaptureError(f"input {name!r} is {ty.text()} in the model, but its declared value is "
                               f"{TensorType.of(t).text()}", where=f"onnx {self.label}",
                               fix="give the value in the input's dtype and shape")
        self.known[name] = _Known.of(t)

    def _fixed_dim(self, name: str) -> int | None:
        """The one value a recipe dim admits (`d: 3` or min == max), else None."""
        lo_hi = (self.user_dims or {}).get(name)
        return lo_hi[0] if lo_hi is not None and lo_hi[0] == lo_hi[1] else None

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
            self.translate(n)
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

    def translate(self, n) -> None:
        """Run node `n`'s converter; every failure becomes a CaptureError naming the node."""
        handler = _HANDLERS.get(n.op_type) if n.domain in ("", "ai.onnx") else None
        if handler is None:
            raise self.fail(f"{n.op_type} (in a subgraph) is not an op graphmode imports",
                            fix="see supported_onnx_ops()")
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

    def translate_subgraph(self, nodes) -> None:
        """Translate the nodes of a subgraph (If branch, Loop/Scan body) in place, as if they were
        the model's own; errors name the subgraph node (and keep the parent's index)."""
        saved = self.node
        try:
            for n in nodes:
                self.node = n
                self.translate(n)
        finally:
            self.node = saved

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
    def scalar(self, value, dtype: str, hint: str) -> str:
        """A 0-d constant (or a symbolic dim as a run-time scalar) of `dtype`."""
        return self.materialise(_Known(_objarr([value], ()), dtype), hint)


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
                check_types: bool = True, input_values: Mapping[str, torch.Tensor] | None = None
                ) -> tuple[Graph, OnnxCaptureReport]:
    """Import an ONNX model (path, bytes or onnx.ModelProto) into an IR graph.

    `input_dims` maps ONNX input names to dim names/ints (default: the model's own dim_params,
    e.g. `batch`, `seq`); `dims` gives each dim's (min, max) range (default: the zoo's ranges
    for batch/seq, else DEFAULT_RANGE). Every value's IR type is cross-checked against the
    model's value_info / output types and, with `check_types`, ONNX shape inference.
    `input_values` holds the inputs a recipe declares constant (`inputs[].value`): converters
    read them as known values, so axes, sizes or pads given as inputs fold. Every
    failure is a CaptureError naming the file, the node and the fix.
    """
    t0 = time.perf_counter()
    try:
        import onnx  # noqa: F401
    except ImportError:  # pragma: no cover - onnx is a hard dependency
        raise CaptureError("the onnx package is not installed", fix="pip install onnx") from None
    is_path = isinstance(path_or_model, (str, os.PathLike))
    label = str(path_or_model) if is_path else (name or "<in-memory model>")
    loaded = _load(path_or_model, label)
    converted = set(supported_onnx_ops())
    while True:
        model = expand_functions(loaded, converted)
        model, opset, inferred = validate_onnx(model, label, converted)
        gname = name or (Path(str(path_or_model)).stem if is_path else (model.graph.name or "onnx_model"))
        imp = _Importer(model, label, gname, dims, input_dims, make_onnx_excluder(include_ops, exclude_ops),
                        input_values)
        imp.extra_value_info = inferred if check_types else []
        try:
            g = imp.run()
            break
        except CaptureError:
            # a converter that refuses a node (an attribute or output it does not cover) leaves the
            # op to its function body, when the schema has one
            n = imp.node
            if n is None or n.op_type not in converted or not has_body(n.op_type, n.domain, opset):
                raise
            converted.discard(n.op_type)
    ops = Counter(n.op_type for n in model.graph.node)
    report = OnnxCaptureReport(source="onnx", seconds=time.perf_counter() - t0, aten_ops=dict(sorted(ops.items())),
                               fallbacks=sorted(imp.fallbacks.values(), key=lambda f: (f.target, f.loc)),
                               output_names=[o.name for o in model.graph.output], opset=opset,
                               producer=f"{model.producer_name} {model.producer_version}".strip(),
                               folded_nodes=imp.folded, runtime_dims=imp.runtime_dims,
                               op_map={k: dict(sorted(v.items())) for k, v in sorted(imp.op_map.items())})
    return g, report
