"""The ONNX importer: loading, validation, the node walk, the handler registry and `import_onnx`.
The importer's value state (`values.py`), IR emission (`emission.py`) and input binding
(`inputs.py`) are its mixins; handlers (one per ONNX op type) live in the convert_* modules."""
from __future__ import annotations


import os
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

from graphmode.capture.onnx.emission import Emitter
from graphmode.capture.onnx.fold import DIM_RANGES, KNOWN_LIMIT, _Known, _Unfoldable, _objarr
from graphmode.capture.onnx.functions import body_origins, expand_functions, has_body
from graphmode.capture.onnx.inputs import InputBinder, with_shapes
from graphmode.capture.onnx.values import (ValueState, _attr_dim, _same_shape, _shape_attr,  # noqa: F401
                                           _to_tensor, _vname)   # the handlers' helpers, imported from here
from graphmode.capture.onnx.checks import CheckedNode, body_where
from graphmode.capture.onnx.validate import topo_sorted, validate_onnx
from graphmode.capture.torch_import import CaptureReport, Fallback
from graphmode.capture.tail import binds, data_symbols, split_tail
from graphmode.errors import CaptureError, IRError
from graphmode.ir.graph import Graph, clean_name
from graphmode.ir.types import Dim, dim_str


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


# an op the importer needs a static extent for: a recipe dim (buckets or not) stays a symbol
STATIC_AXIS_FIX = ("write that axis as a fixed size in the recipe's inputs[].shape (an integer, e.g. "
                   "[batch, 7, 16]): a dim with buckets stays symbolic in the graph")


def as_text(v: Any) -> str:
    """An ONNX string attribute (stored as bytes) as text."""
    return v.decode() if isinstance(v, bytes) else str(v)


class _Importer(ValueState, Emitter, InputBinder):
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
        self.init_values: dict[tuple[int, str], tuple] = {}   # (id(graph), name) -> (graph, value): read once
        self.undecided: dict[str, str] = {}    # a value computed from dims whose fold the recipe's ranges left open
        self.folded = 0
        self.runtime_dims = 0                            # symbolic shape values used as tensor data
        self.op_map: dict[str, Counter] = defaultdict(Counter)
        self.fallbacks: dict[tuple[str, str], Fallback] = {}
        self.node = None
        self.node_idx = -1
        self.extra_value_info: list = []
        self.origins: dict[str, tuple[int, Any]] = {}    # a function body's node -> the file's node it expands
        self.advised: dict[tuple, bool] = {}             # (declared, inferred) dims: do they agree anywhere

    # ---- errors --------------------------------------------------------------------------
    def where(self) -> str:
        if self.node is None:
            return f"onnx {self.label}"
        return body_where(self.label, self.node_idx, self.node, self.origins)

    def fail(self, msg: str, fix: str | None = None, value: Any = None) -> CaptureError:
        return CaptureError(msg, where=self.where(), value=value,
                            fix=fix or "re-export the model so this node has static attributes, or compile the "
                                       "PyTorch module itself with graphmode.compile(module)")

    def static_dim_error(self, d: Dim, size: int, what: str) -> CaptureError:
        """The refusal of a node that needs `d` (a recipe dim) to be `size`: naming the recipe field
        (inputs[k].shape[axis]) of the input axis that carries it, where one does."""
        axes = [(v, ax) for v in self.g.inputs for ax, x in enumerate(self.g.values[v].type.shape) if x == d]
        shown, rng = dim_str(d), self.g.dims.get(dim_str(d))
        msg = f"{what} must be {size}, but it is {shown} here" + (f", which ranges over {list(rng)}" if rng else "")
        if not axes:
            return self.fail(msg + f": ONNX Runtime runs this node only where {shown} = {size}",
                             fix=f"make {shown} {size} in the recipe (the input dims it is made of)")
        v, ax = axes[0]
        onnx_name = next((k for k, x in self.ir.items() if x == v), v)
        field = f"{self.recipe_field.get(onnx_name, 'inputs[]')}.shape"
        example = [size if i == ax else dim_str(x) if not isinstance(x, int) else x
                   for i, x in enumerate(self.g.values[v].type.shape)]
        return self.fail(msg + f" (input {onnx_name!r} axis {ax}): ONNX Runtime runs the model only with {size} there",
                         value=shown, fix=f"declare {size} in {field}[{ax}] (e.g. {example}) and compile with that "
                                          "recipe; a recipe drafted from the file takes an axis it leaves unnamed "
                                          "as a dim")

    # ---- driver --------------------------------------------------------------------------
    def run(self) -> Graph:
        gp = self.gp
        init_names = {i.name for i in gp.initializer}
        for vi in list(self.extra_value_info) + list(gp.value_info) + list(gp.output):
            if vi.type.HasField("tensor_type"):
                self.declared[vi.name] = vi.type.tensor_type
        self.bind_inputs(init_names)
        self.bind_initializers(gp)
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
        self.tail = split_tail(self.g)     # NonZero, Compress and what reads them: run after the plan
        return self.g

    def bind_initializers(self, graph, names: dict[str, str] | None = None) -> None:
        """A graph's initializers as values (small ones known, for folding); `names` renames a
        subgraph's. Each is read once per graph: an unrolled body's copies share one constant
        (keyed by the graph proto, held so its id stays unique: a proto's wrappers are not)."""
        from onnx import numpy_helper
        for init in graph.initializer:
            key = (id(graph), init.name)
            if key not in self.init_values:
                name = (names or {}).get(init.name, init.name)
                t = self._init_tensor(init, numpy_helper)
                value = _Known.of(t, source=name) if t.numel() <= KNOWN_LIMIT else (t, "param")
                self.init_values[key] = (graph, value)
            value = self.init_values[key][1]
            (self.known if isinstance(value, _Known) else self.big)[(names or {}).get(init.name, init.name)] = value

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
            err = self.fail(e.message, fix=e.fix or "check the model with onnx.checker.check_model(m, full_check=True)")
            err.meeting = getattr(e, "meeting", None)       # two dims the graph ties (a draft joins them)
            raise err from None
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
        """Drop nodes nothing reads; keep a NonZero whose count alone is used (Size(NonZero(m))):
        the tail learns the count from the tensor it makes."""
        live, used = set(self.g.outputs), set()
        keep = []
        for n in reversed(self.g.nodes):
            if any(o in live for o in n.outputs) or binds(n, self.g) & used:
                keep.append(n)
                live.update(n.inputs)
                used |= data_symbols(n, self.g)
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

    def attr_text(self, n, key: str, default: str = "") -> str:
        """A string attribute as text: ONNX stores them as bytes."""
        return as_text(self.attr(n, key, default))

    def opt_in(self, n, i: int) -> str | None:
        return n.input[i] if len(n.input) > i and n.input[i] else None

    def need_known(self, name: str, what: str) -> _Known:
        k = self.kn(name)
        if k is None and name in self.undecided:
            raise self.fail(f"{what} ({name!r}) is computed from the dims, and the recipe's ranges leave it open: "
                            f"{self.undecided[name]}", fix="narrow those dims to one side of it with dims.D.min / max "
                            "(buckets alone admit every value from min, 1 unless given, up to the largest: a smaller "
                            "request is padded), a recipe for each side; or make the value a constant in the file")
        if k is None:
            raise self.fail(f"{what} ({name!r}) is computed from run-time tensor data, and graphmode needs it "
                            "when it imports the model (shapes, axes, counts and control flow are fixed at "
                            "compile time)",
                            fix="make it a constant in the file (an initializer or Constant node; onnx-simplifier "
                                "folds one computed from static shapes), or declare the graph input it comes "
                                "from constant in the recipe (inputs[].value)")
        return k

    def ints_of(self, name: str, what: str) -> list[int]:
        try:
            return self.need_known(name, what).ints(what)
        except _Unfoldable as e:
            raise self.fail(str(e)) from None


# ------------------------------------------------------------------------------ handlers

_HANDLERS: dict[str, Callable[[_Importer, Any], None]] = {}
_CHECKS: dict[str, Callable[[CheckedNode], None]] = {}


def _handles(*ops: str, check: Callable[[CheckedNode], None] | None = None):
    """Register the decorated function as the handler of `ops`, and `check` as their attribute
    check: what `validate_onnx` runs on each such node before any handler does (its message
    names the attribute, value and fix), so a handler may trust the node it translates."""
    def deco(fn):
        for o in ops:
            _HANDLERS[o] = fn
            if check is not None:
                _CHECKS[o] = check
        return fn
    return deco


def supported_onnx_ops() -> list[str]:
    """ONNX op types (default domain) the importer translates."""
    return sorted(_HANDLERS)


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


def _refusal_of(e: CaptureError, n, origins: Mapping[str, tuple[int, Any]],
                refused: Mapping[str, CaptureError]) -> CaptureError:
    """The error to raise for `e`: where the function body of an op whose converter refused it fails
    too (a float Range's body is a Loop), the converter's own refusal, which names the node of the
    file and says what it takes; else `e`. `n` is the failing node (None: the validator failed,
    which after a refusal only the bodies brought in can make it do)."""
    if not refused:
        return e
    if n is None:
        return list(refused.values())[-1]
    origin = origins.get(n.output[0]) if n.output else None
    return refused.get(origin[1].op_type, e) if origin is not None else e


def make_onnx_excluder(include_ops: Sequence[str] = (), exclude_ops: Sequence[str] = ()) -> Callable[[str, str], bool]:
    """An ONNX node is excluded when its op type ('Softmax'), lower-cased type ('softmax') or the core
    op it lowers to ('softmax', 'layer_norm') is excluded (or missing from a non-empty include list)."""
    inc, exc = set(include_ops), set(exclude_ops)
    matched: set[str] = set()

    def excluded(onnx_op: str, ir_op: str) -> bool:
        names = {onnx_op, onnx_op.lower(), ir_op, f"onnx::{onnx_op}"}
        if inc and not (names & inc):
            return True
        matched.update(names & exc)
        return bool(names & exc)
    excluded.matched = matched            # type: ignore[attr-defined]  # what exclude_ops met (a notice)
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
    loaded = topo_sorted(with_shapes(_load(path_or_model, label), input_dims, label))
    converted = set(supported_onnx_ops())
    refused: dict[str, CaptureError] = {}    # op -> its converter's refusal, the op then imported by its body
    excluder = make_onnx_excluder(include_ops, exclude_ops)
    while True:
        model = expand_functions(loaded, converted)
        origins = body_origins(loaded, model)
        try:
            model, opset, inferred = validate_onnx(model, label, converted, _CHECKS, origins)
        except CaptureError as e:
            raise _refusal_of(e, None, origins, refused) from None
        gname = name or (Path(str(path_or_model)).stem if is_path else (model.graph.name or "onnx_model"))
        imp = _Importer(model, label, gname, dims, input_dims, excluder, input_values)
        imp.extra_value_info = inferred if check_types else []
        imp.origins = origins
        ranges = DIM_RANGES.set(dict(dims) if dims is not None else None)
        try:
            g = imp.run()
            break
        except CaptureError as e:
            # a converter that refuses a node (an attribute or output it does not cover) leaves the
            # op to its function body, when the schema has one
            n = imp.node
            if n is None or n.op_type not in converted or not has_body(n.op_type, n.domain, opset):
                raise _refusal_of(e, n, origins, refused) from None
            refused[n.op_type] = e
            converted.discard(n.op_type)
        finally:
            DIM_RANGES.reset(ranges)
    ops = Counter(n.op_type for n in model.graph.node)
    report = OnnxCaptureReport(source="onnx", seconds=time.perf_counter() - t0, aten_ops=dict(sorted(ops.items())),
                               fallbacks=sorted(imp.fallbacks.values(), key=lambda f: (f.target, f.loc)),
                               output_names=[o.name for o in model.graph.output], opset=opset,
                               producer=f"{model.producer_name} {model.producer_version}".strip(),
                               folded_nodes=imp.folded, runtime_dims=imp.runtime_dims,
                               op_map={k: dict(sorted(v.items())) for k, v in sorted(imp.op_map.items())},
                               tail=imp.tail, unmatched_excludes=[e for e in exclude_ops if e not in excluder.matched])
    return g, report
