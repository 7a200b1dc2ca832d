"""PyTorch -> IR: torch.export with the recipe's dynamic dims, ATen lowering, translation.

`run_decompositions(decomp_table={})` keeps high-level ATen ops (linear, layer_norm,
scaled_dot_product_attention) — better fusion units, and the default core-ATen table
fails on GPT-2 (see shared/NOTES.md). Every ATen op either maps to core IR ops through a
converter (`graphmode/capture/aten/`) or becomes an explicit `fallback` node listed in the
capture report with the model's source line.
"""
from __future__ import annotations

import operator
import re
import time
from pathlib import Path
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import sympy
import torch
import torch.utils._pytree as pytree

from graphmode.capture.aten import convert
from graphmode.capture.aten.spectral import Complex, spectral, takes_complex
from graphmode.capture.export_errors import ROPE_FIX, ROPE_WHY, export_failure, quiet_export_logs, shown_path
from graphmode.capture.fast_paths import eager_fast_paths
from graphmode.capture.module_moves import unchanged_moves_kept
from graphmode.capture.self_changes import refuse_self_changes
from graphmode.capture.tail import DataNumber, Tail, as_tail_dim, unbacked
from graphmode.capture.trace_copy import traced_copy
from graphmode.errors import CaptureError, GraphmodeError
from graphmode.ir.graph import Graph, clean_name
from graphmode.ir.types import TORCH_TO_DTYPE, TensorType, dim_str, normalize_dim, settle_on, sym


@dataclass
class Fallback:
    target: str
    reason: str
    loc: str
    count: int = 1
    excluded: bool = False     # the recipe's capture settings asked for it (vs. no lowering exists)


@dataclass
class CaptureReport:
    source: str
    seconds: float
    aten_ops: dict[str, int] = field(default_factory=dict)
    fallbacks: list[Fallback] = field(default_factory=list)
    out_spec: str | None = None          # pytree spec of the module's outputs (treespec_dumps)
    output_names: list[str] = field(default_factory=list)   # one per user output (graph.outputs' first ones)
    # what eager returns (graphmode/capture/outputs.py spec), when known: the compiled model returns it
    output_structure: dict | None = None
    # inputs the model updates in place: the graph's last outputs are their new values, in this order
    mutated_inputs: list[str] = field(default_factory=list)
    locs: dict[str, str] = field(default_factory=dict)   # IR value -> the model source line that made it
    # ops after a size only the data decides (capture/tail.py): the graph's outputs are its inputs
    tail: Graph | None = None
    # capture.exclude_ops entries no op of the model matched (a notice: nothing runs as that island)
    unmatched_excludes: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"source": self.source, "seconds": round(self.seconds, 3), "aten_ops": self.aten_ops,
                "fallbacks": [f.__dict__ for f in self.fallbacks], "output_names": self.output_names}


_SYM_FNS = {operator.mul: operator.mul, operator.add: operator.add, operator.sub: operator.sub,
            operator.floordiv: lambda a, b: sympy.floor(sympy.sympify(a) / b),
            operator.truediv: operator.truediv, operator.neg: operator.neg,
            operator.mod: lambda a, b: sympy.Mod(sympy.sympify(a), b)}
_COMPARISONS = {operator.le: sympy.Le, operator.lt: sympy.Lt, operator.ge: sympy.Ge, operator.gt: sympy.Gt,
                operator.eq: sympy.Eq, operator.ne: sympy.Ne}
_SKIP = {"aten._assert_tensor_metadata.default", "aten._assert_scalar.default",
         "aten.sym_constrain_range_for_size.default", "aten.sym_constrain_range.default",
         "aten._assert_async.msg"}


def dim_value(g: Graph, d: sympy.Expr) -> str:
    """A dim expression used as a number (`x.sum(1) / x.shape[1]`): a 0-d i64 tensor holding it,
    as arange(d, d + 1) read as a scalar (the padding analysis knows that value is the dim's)."""
    one, = g.add_node("arange", [], [TensorType("i64", (1,))],
                      {"start": dim_str(d), "end": dim_str(d + 1), "step": 1, "dtype": "i64"})
    out, = g.add_node("reshape", [one], [TensorType("i64", ())], {"shape": []})
    return out


def float_dim_value(g: Graph, d: sympy.Expr, where: str) -> str:
    """A float computed from dims (a resize's scale, 4 / floor(W / 8)) as a 0-d f32 tensor: its
    numerator and denominator as dim values, divided. It was taken for an integer and failed
    at every call (an arange of 1/2)."""
    num, den = sympy.fraction(sympy.together(d))
    roots = any(not p.exp.is_Integer for p in sympy.sympify(d).atoms(sympy.Pow))      # sqrt(seq): no ratio
    if roots or sympy.sympify(d).has(sympy.Float) or any(sympy.sympify(x).is_integer is False for x in (num, den)) \
            or not all(sympy.sympify(x).free_symbols or sympy.sympify(x).is_Integer for x in (num, den)):
        raise CaptureError(f"a float computed from the dims ({d}) that graphmode cannot write as a ratio of sizes",
                           where=f"node {where}", fix="compute it from tensors, or run the model with exe_mode: eager")
    f32 = TensorType("f32", ())
    parts = []
    for x in (num, den):
        v, = g.add_node("cast", [dim_value(g, sympy.sympify(x))], [f32], {"dtype": "f32"})
        parts.append(v)
    if den == 1:
        return parts[0]
    out, = g.add_node("div", parts, [f32])
    return out


class _Importer:
    def __init__(self, ep: torch.export.ExportedProgram, name: str, input_dims: Mapping[str, Sequence],
                 dims: Mapping[str, tuple[int, int]], excluded: Callable[[str, str], bool]):
        self.ep = ep
        self.g = Graph(clean_name(name))
        self.g.dims = dict(dims)
        self.input_dims = input_dims
        self.excluded = excluded
        self.env: dict[Any, Any] = {}     # fx node -> value name | sympy expr | python value | tuple
        self.subs: dict[sympy.Symbol, sympy.Expr] = {}
        self.fallbacks: dict[tuple[str, str], Fallback] = {}
        self.aten_ops: dict[str, int] = {}
        self.locs: dict[str, str] = {}
        self._const_cache: dict[tuple, str] = {}
        self.fqn_prefix = ""                   # "model." when the module is graphmode's output-flattening wrapper
        self.mutated_inputs: list[str] = []    # inputs updated in place: one graph output each, after the user's
        self._node: torch.fx.Node | None = None   # the node being translated (for messages)
        self.tail = Tail(self)                 # what runs after the plan: ops on data-dependent sizes
        self.unbacked_ok = False               # True while the tail is translated

    # ---- symbols ---------------------------------------------------------------------
    def _bind_symbols(self, user_inputs: list[tuple[str, torch.fx.Node]]) -> None:
        for name, node in user_inputs:
            val = node.meta.get("val")
            names = self.input_dims.get(name)
            if val is None or names is None:
                continue
            for size, dname in zip(val.shape, names):
                if isinstance(size, torch.SymInt) and isinstance(dname, str):
                    expr = size.node.expr
                    if isinstance(expr, sympy.Symbol):
                        self.subs[expr] = sym(dname)

    def dim(self, v) -> Any:
        """SymInt / int -> int or canonical sympy expr over recipe dims."""
        if isinstance(v, torch.SymInt):
            expr = v.node.expr.xreplace(self.subs)
            unknown = [s for s in expr.free_symbols if s.name not in self.g.dims]
            if unknown and self.unbacked_ok and len(unbacked(expr)) == len(unknown):
                return normalize_dim(as_tail_dim(expr))
            if unknown:
                raise _unmapped_size(expr, unknown, self._node)
            return settle_on(normalize_dim(expr), self.g.dims)
        if isinstance(v, torch.fx.Node):
            r = self.env[v]
            return r
        return int(v)

    def attr_dim(self, v):
        """A size (SymInt, int or IR dim) as an attribute value: an int or a dim expression string."""
        d = v if isinstance(v, sympy.Basic) else self.dim(v)
        d = normalize_dim(d)
        return d if isinstance(d, int) else dim_str(d)

    def ttype(self, val: torch.Tensor) -> TensorType:
        return TensorType(TORCH_TO_DTYPE[val.dtype], tuple(self.dim(s) for s in val.shape))

    # ---- values ----------------------------------------------------------------------
    def const(self, value, dtype: str | None = None) -> str:
        if isinstance(value, bool):
            dtype = dtype or "bool"
        elif isinstance(value, int):
            dtype = dtype or "i64"
        else:
            dtype = dtype or "f32"
        key = (repr(value), dtype)
        if key not in self._const_cache:
            from graphmode.ir.types import DTYPES
            name = self.g.fresh_name(f"c{len(self._const_cache)}")
            self.g.add_constant(name, torch.tensor(value, dtype=DTYPES[dtype]), role="const")
            self._const_cache[key] = name
        return self._const_cache[key]

    def operand(self, a) -> str:
        if isinstance(a, torch.fx.Node):
            v = self.env[a]
            if isinstance(v, str):
                return v
            if isinstance(v, (int, float, bool)):
                return self.const(v)
            if isinstance(v, sympy.Expr) and isinstance(a.meta.get("val"), torch.SymFloat):
                return float_dim_value(self.g, v, where=a.name)
            if isinstance(v, sympy.Expr) and v.is_integer is not False:
                return dim_value(self.g, v)
            if isinstance(v, DataNumber):
                raise v.refusal()
            if isinstance(v, Complex):
                raise CaptureError("the model returns the complex result of torch.stft, and graphmode has no "
                                   "complex dtype", where=f"node {a.name}",
                                   fix="return torch.view_as_real(...) of it (real and imaginary parts on a last "
                                       "axis of 2), or its abs()")
            raise CaptureError(f"symbolic value {v} used as a tensor", where=f"node {a.name}",
                               fix="compute it from tensors (a float size, such as x.shape[1] / 2, is not captured)")
        if isinstance(a, (int, float, bool)):
            return self.const(a)
        raise CaptureError(f"unsupported operand {a!r}")

    def emit(self, node: torch.fx.Node, op: str, inputs: list[str], attrs: dict | None = None) -> str:
        val = node.meta["val"]
        out, = self.g.add_node(op, inputs, [self.ttype(val)], attrs, names=[clean_name(node.name)])
        self.env[node] = out
        return out

    # ---- translation -----------------------------------------------------------------
    def translate(self, node: torch.fx.Node) -> None:
        target = node.target
        tname = str(target)
        if tname in _SKIP:
            return
        if target is operator.getitem:
            src, idx = node.args
            got = self.env[src]
            self.env[node] = got[idx] if isinstance(got, (tuple, list)) and -len(got) <= idx < len(got) else None
            if self.env[node] is None:
                held = f"{len(got)} values" if isinstance(got, (tuple, list)) else "a single value"
                raise CaptureError(f"output {idx} of {getattr(src, 'target', src)} taken at {node.name}, which "
                                   f"graphmode holds as {held}", fix="report this as a capture bug, with the model")
            return
        if isinstance(target, torch._ops.HigherOrderOperator):    # torch.cond, while_loop, map: a graph each
            raise _control_flow(node, tname)
        if not isinstance(target, torch._ops.OpOverload):
            self._sym_op(node)
            return
        self.aten_ops[tname] = self.aten_ops.get(tname, 0) + 1
        short = tname.split(".")[1] if tname.startswith("aten.") else tname
        if takes_complex(self, node, tname) and not self.excluded(tname, short):
            spectral(self, node, tname)              # stft's complex result as real math (capture/aten/spectral.py)
            return
        _check_dtypes(node, tname, self.excluded(tname, short))
        if self.excluded(tname, short):
            self._fallback(node, "excluded by recipe capture settings", excluded=True)
            return
        if not convert(self, node, tname):
            sym = [a for a in pytree.tree_leaves((node.args, node.kwargs))
                   if isinstance(a, torch.SymInt) or isinstance(getattr(a, "meta", {}).get("val"), torch.SymInt)]
            self._fallback(node, "no graphmode lowering for this op with an argument computed from a dynamic dim "
                                 f"({self._sym_text(sym[0])})" if sym else "no graphmode lowering for this op")

    def _sym_text(self, arg: Any) -> str:
        try:
            return dim_str(normalize_dim(self.dim(arg)))
        except Exception:  # noqa: BLE001 - naming it is a courtesy
            return str(arg)

    def _sym_op(self, node: torch.fx.Node) -> None:
        """Python arithmetic on SymInts (operator.mul, sym_size...) evaluated symbolically."""
        args = [self.env[a] if isinstance(a, torch.fx.Node) else a for a in node.args]
        read = [a for a in args if isinstance(a, DataNumber)]
        r = read[0] if read else sym_value(node, args)
        self.env[node] = settle_on(normalize_dim(r), self.g.dims) if isinstance(r, (sympy.Basic, int)) \
            and not isinstance(r, sympy.logic.boolalg.Boolean) else r

    def encode_call(self, node: torch.fx.Node) -> tuple[list[str], list, dict]:
        return encode_call(self, node)

    def _fallback(self, node: torch.fx.Node, reason: str, excluded: bool = False) -> None:
        ins, args, kwargs = self.encode_call(node)
        loc = _source_loc(node)
        vals = node.meta["val"]
        vals = list(vals) if isinstance(vals, (tuple, list)) else [vals]
        if any(isinstance(v, (tuple, list)) for v in vals):
            raise CaptureError(f"op {node.target} returns a list of tensors among its outputs, which an eager "
                               "island cannot return", where=loc,
                               fix="exclude the op from the model (or compute it outside the compiled part)")
        tensors = [v for v in vals if isinstance(v, torch.Tensor)]
        if not tensors and isinstance(node.meta["val"], (torch.SymInt, torch.SymFloat, torch.SymBool)):
            self.env[node] = DataNumber(str(node.target), loc)      # t.item(): fine for an assert only
            return
        names = [clean_name(node.name if i == 0 else f"{node.name}_{i}") for i in range(len(tensors))]
        outs = self.g.add_node("fallback", ins, [self.ttype(v) for v in tensors],
                               {"target": str(node.target), "args": args, "kwargs": kwargs, "loc": loc},
                               names=names)
        self.env[node] = outs[0] if len(outs) == 1 and not isinstance(node.meta["val"], (tuple, list)) else tuple(outs)
        key = (str(node.target), loc)
        if key in self.fallbacks:
            self.fallbacks[key].count += 1
        else:
            self.fallbacks[key] = Fallback(str(node.target), reason, loc, excluded=excluded)

    # ---- driver ----------------------------------------------------------------------
    def run(self) -> Graph:
        ep = self.ep
        sig = ep.graph_signature
        state = dict(ep.state_dict)
        state.update(getattr(ep, "constants", {}) or {})
        param_names = {**sig.inputs_to_parameters, **sig.inputs_to_buffers,
                       **getattr(sig, "inputs_to_lifted_tensor_constants", {})}
        user_inputs = [n for n in ep.graph.nodes if n.op == "placeholder" and n.name in sig.user_inputs]
        user_names = self._user_input_names(user_inputs)
        self._bind_symbols(list(zip(user_names, user_inputs)))
        for n in ep.graph.nodes:
            if n.op == "placeholder":
                if n.name in param_names:
                    fqn = param_names[n.name]
                    t = state[fqn].detach()
                    if t.dtype not in TORCH_TO_DTYPE:
                        raise CaptureError(f"parameter or buffer {fqn!r} is a {t.dtype} tensor: graphmode has no "
                                           f"{str(t.dtype).replace('torch.', '')} dtype", where=f"model.{fqn}",
                                           fix="store it as real tensors of a graphmode dtype (f32, ...)")
                    self.env[n] = self.g.add_constant(self.g.fresh_name(clean_name(fqn)), t, role="param")
                elif n in user_inputs:
                    nm = user_names[user_inputs.index(n)]
                    val = n.meta["val"]
                    if not isinstance(val, torch.Tensor):
                        raise CaptureError(f"input {nm!r} is not a tensor", fix="pass tensors only")
                    self.env[n] = self.g.add_input(clean_name(nm), self.ttype(val))
                else:
                    raise CaptureError(f"torch.export lifted {n.name!r} out of the model: an object that is neither "
                                       "a tensor input, a parameter nor a buffer (a torch.Generator or another script "
                                       "object made in forward)", where="model",
                                       fix="create it outside forward, or draw random numbers without a generator "
                                           "object")
            elif n.op == "call_function":
                if self.tail.takes(n):
                    continue
                first, self._node = len(self.g.nodes), n
                self.translate(n)
                if len(self.g.nodes) > first:
                    loc = _source_loc(n)
                    for made in self.g.nodes[first:]:
                        for o in made.outputs:
                            self.locs[o] = loc
            elif n.op == "output":
                if self.tail:
                    self.tail.translate()
                self._outputs(n, {p.name: nm for p, nm in zip(user_inputs, user_names)})
        for o in self.g.outputs:
            v = self.g.values[o]
            if v.role == "intermediate":
                self.g.values[o] = v.__class__(o, v.type, "output")
        return self.g

    def _outputs(self, node: torch.fx.Node, input_names: dict[str, str]) -> None:
        """The graph's outputs from the export signature's output kinds: the user's outputs first,
        then the new values of inputs the model updates in place (`mutated_inputs`: the runtime
        copies them into the caller's tensors). An in-place update of a buffer or parameter is
        refused: the compiled graph holds them as constants."""
        def value(o: Any) -> str:
            if isinstance(o, torch.fx.Node):
                v = self.env[o]
                return v if isinstance(v, str) else self.operand(o)
            return self.const(o)

        leaves = pytree.tree_leaves(node.args[0])
        specs = list(self.ep.graph_signature.output_specs)
        if len(specs) != len(leaves):       # no signature to go by: every leaf is a user output
            self.g.outputs = [value(o) for o in leaves]
            return
        user, mutated = [], []
        for o, spec in zip(leaves, specs):
            kind = spec.kind.name
            if kind == "USER_OUTPUT":
                user.append(value(o))
            elif kind == "USER_INPUT_MUTATION":
                name = input_names.get(spec.target, spec.target)
                mutated.append((name, value(o)))
            elif kind in ("BUFFER_MUTATION", "PARAMETER_MUTATION"):
                what = "buffer" if kind == "BUFFER_MUTATION" else "parameter"
                op, loc = _maker(o)
                fqn = spec.target[len(self.fqn_prefix):] if spec.target.startswith(self.fqn_prefix) else spec.target
                if fqn.endswith("inv_freq"):      # a rotary embedding that rescales with each call's positions
                    raise CaptureError(f"the model updates its rotary embedding's {fqn!r} in place ({op} at {loc}). "
                                       + ROPE_WHY, where="model.config.rope_scaling", fix=ROPE_FIX)
                raise CaptureError(f"the model updates its {what} {fqn!r} in place ({op} at {loc}); a "
                                   f"compiled graph holds its {what}s as constants, so the update would be lost",
                                   where=f"model {self.g.name}",
                                   fix="put the module in eval mode (model.eval(): batch norm stops updating its "
                                       "running statistics), renormalise weights once before compiling instead of "
                                       "per call (embedding's max_norm), or move the update out of forward")
            else:
                raise CaptureError(f"the exported program has a {kind} output ({spec.target})",
                                   where=f"model {self.g.name}", fix="compile the inference forward pass")
        self.mutated_inputs = [name for name, _ in mutated]
        if self.tail:
            late = [name for name, v in mutated if v not in self.g.values]
            if late:
                raise CaptureError(f"the model updates its input {late[0]!r} in place after a size only the data "
                                   "decides (x[mask], nonzero, unique)", where=f"inputs.{late[0]}",
                                   fix="return the new value instead of updating the input in place")
            user = self.tail.finish(user, self.g)
        self.g.outputs = user + [v for _, v in mutated]

    def _user_input_names(self, user_inputs: list[torch.fx.Node]) -> list[str]:
        spec = self.ep.call_spec.in_spec if self.ep.call_spec else None
        try:
            args_spec, kwargs_spec = spec.children() if spec is not None else (None, None)
            keys = list(kwargs_spec.context) if kwargs_spec is not None else []
        except Exception:  # noqa: BLE001 - fall back to placeholder names
            keys = []
        if len(keys) == len(user_inputs):
            return keys
        return [n.name for n in user_inputs]


def encode_call(imp: _Importer, node: torch.fx.Node) -> tuple[list[str], list, dict]:
    """The node's arguments as JSON (tensors as {"$in": i} into the returned inputs, sizes as
    {"$dim": ...}, dtypes as {"$dtype": ...}): how eager islands and ATen-reference ops keep them."""
    ins: list[str] = []

    def enc(a):
        if isinstance(a, torch.fx.Node):
            v = imp.env[a]
            if isinstance(v, str):
                ins.append(v)
                return {"$in": len(ins) - 1}
            if isinstance(v, sympy.Basic):
                return {"$dim": dim_str(v)}
            if isinstance(v, DataNumber):
                raise v.refusal()
            return v
        if isinstance(a, torch.SymInt):
            return {"$dim": dim_str(imp.dim(a))}
        if isinstance(a, torch.dtype):
            return {"$dtype": TORCH_TO_DTYPE[a]}
        if isinstance(a, torch.device):
            return {"$device": str(a)}
        if isinstance(a, (list, tuple)):
            return [enc(x) for x in a]
        if a is None or isinstance(a, (int, float, bool, str)):
            return a
        return str(a)

    args = [enc(a) for a in node.args]
    kwargs = {k: enc(v) for k, v in node.kwargs.items()
              if k not in ("layout", "pin_memory", "memory_format") or v is not None and k == "memory_format"}
    kwargs.pop("memory_format", None)
    return ins, args, kwargs


_TORCH_DIR = str(Path(torch.__file__).parent)


def _maker(node: Any) -> tuple[str, str]:
    """(ATen op, model source line) that computed an output node (through getitem)."""
    if not isinstance(node, torch.fx.Node):
        return "a constant", "?"
    if node.target is operator.getitem and isinstance(node.args[0], torch.fx.Node):
        node = node.args[0]
    return str(node.target), _source_loc(node)


def _unmapped_size(expr: Any, unknown: list, node: torch.fx.Node | None) -> CaptureError:
    """A size over symbols no recipe dim names: torch's unbacked symbols (u0, u1, ...) are sizes
    known only from the data (a boolean-mask index, nonzero, unique); others are dims the
    recipe does not declare."""
    at = f" at {_source_loc(node)} ({node.target})" if node is not None else ""
    if all(re.fullmatch(r"u\d+", str(s)) for s in unknown):
        return CaptureError(f"a tensor's size{at} depends on the data ({expr}: the count of elements a boolean "
                            "mask, nonzero or unique selects), which no recipe dim bounds: graphmode plans every "
                            "buffer from the recipe's dims", where="model",
                            fix="keep the shape fixed: torch.where(mask, x, 0) or a masked sum instead of x[mask], "
                                "or run the model with exe_mode: eager")
    return CaptureError(f"symbolic size {expr}{at} uses symbols {unknown} that map to no recipe dim",
                        fix="declare every dynamic input dim in the recipe's inputs/dims")


def sym_value(node: torch.fx.Node, args: list) -> Any:
    """The value of a Python op on sizes: arithmetic, sym_max/sym_min, or a comparison (what an
    assert on sizes checks; aten._assert_scalar is skipped, so an operand that is no size is None)."""
    if node.target in _COMPARISONS:
        try:
            return _COMPARISONS[node.target](*[sympy.sympify(a) for a in args])
        except (TypeError, sympy.SympifyError):
            return None
    fn = _SYM_FNS.get(node.target)
    name = getattr(node.target, "__name__", "")
    if name in ("sym_not", "and_", "or_"):    # torch's own checks on sizes (x[m].argmax(0): not empty)
        if not all(isinstance(a, (bool, sympy.logic.boolalg.Boolean)) for a in args):
            return None
        return {"sym_not": sympy.Not, "and_": sympy.And, "or_": sympy.Or}[name](*args)
    if fn is None and name in ("sym_max", "sym_min"):
        fn = sympy.Max if name == "sym_max" else sympy.Min
    if fn is None:
        raise CaptureError(f"unsupported python op {getattr(node.target, '__name__', node.target)} on sizes "
                           f"at {_source_loc(node)}", where=node.name,
                           fix="rewrite that line to compute on tensors, or run the model with exe_mode: eager")
    return fn(*[sympy.sympify(a) if not isinstance(a, (int, float)) else a for a in args])


def _source_loc(node: torch.fx.Node) -> str:
    """The innermost frame of the model's own code (not torch's internals) that made `node`."""
    trace = node.meta.get("stack_trace") or ""
    frames = []
    for ln in trace.strip().splitlines():
        ln = ln.strip()
        if ln.startswith('File "'):
            path, _, rest = ln[len('File "'):].partition('", line ')
            frames.append((path, rest.split(",")[0]))
    own = [f for f in frames if not f[0].startswith(_TORCH_DIR)]
    if own or frames:
        path, line = (own or frames)[-1]
        return f"{shown_path(path)}:{line}"
    stack = node.meta.get("nn_module_stack")
    if stack:
        last = list(stack.values())[-1]
        return last[0] if isinstance(last, tuple) else str(stack)
    return node.name


def _control_flow(node: torch.fx.Node, tname: str) -> CaptureError:
    return CaptureError(f"{getattr(node.target, '__name__', tname)} at {_source_loc(node)}: graphmode captures one "
                        "graph without control flow, and cannot run this op's branches", where=f"node {node.name}",
                        fix="compute both branches and pick with torch.where (one graph), or run the model with "
                            "exe_mode: eager")


def make_excluder(include_ops: Sequence[str] = (), exclude_ops: Sequence[str] = ()) -> Callable[[str, str], bool]:
    """Ops are named by ATen short name ('softmax') or full overload ('aten.softmax.int')."""
    inc, exc = set(include_ops), set(exclude_ops)
    matched: set[str] = set()

    def excluded(full: str, short: str) -> bool:
        names = {full, short, full.rsplit(".", 1)[0]}
        if inc and not (names & inc):
            return True
        matched.update(names & exc)
        return bool(names & exc)
    excluded.matched = matched            # type: ignore[attr-defined]  # what exclude_ops met (a notice)
    return excluded


def _refuse_grad_regions(ep) -> None:
    """torch.export records a `with torch.enable_grad():` inside forward as a grad-mode region,
    which its own decomposition then fails on with an IndexError: say what it is instead."""
    hop = getattr(torch.ops.higher_order, "wrap_with_set_grad_enabled", None)
    for n in ep.graph.nodes:
        if hop is not None and n.target is hop:
            raise CaptureError("the model switches autograd on inside forward (torch.enable_grad() or "
                               "torch.set_grad_enabled(True)), which torch.export keeps as a grad-mode region that "
                               "its decomposition cannot take", where="model",
                               fix="leave autograd as the caller has it in the inference forward (remove the "
                                   "enable_grad block); gradients are not part of a compiled inference call")


def _check_dtypes(node: torch.fx.Node, tname: str, excluded: bool = False) -> None:
    """Every tensor the op makes or takes has an IR dtype (no complex, no float8, ...): refuse
    here, naming the op, rather than fail later on a dtype nothing downstream knows. An op
    capture.exclude_ops names is no way round it: an eager island takes and gives graphmode
    tensors, and the value would leave the island."""
    vals = pytree.tree_leaves(node.meta.get("val"))
    vals += [a.meta.get("val") for a in node.all_input_nodes]
    vals += [a for a in pytree.tree_leaves((node.args, node.kwargs)) if isinstance(a, torch.dtype)]
    for v in vals:
        dt = v.dtype if isinstance(v, torch.Tensor) else v
        if isinstance(dt, torch.dtype) and dt not in TORCH_TO_DTYPE:
            name = str(dt).replace("torch.", "")
            island = (f"; capture.exclude_ops cannot make it an eager island: an island's inputs and outputs "
                      f"are graphmode tensors, and this {name} value would cross into the graph"
                      if excluded else "")
            raise CaptureError(f"op {tname} at {_source_loc(node)} uses a {dt} tensor: graphmode has no "
                               f"{name} dtype{island}", where=f"node {node.name}",
                               fix=f"keep the model's tensors in {', '.join(sorted(TORCH_TO_DTYPE.values()))} "
                                   "(complex math as separate real and imaginary parts; a spectrogram computed "
                                   "before the model, as its input), or run the model with exe_mode: eager")


def _refuse_sparse_constants(ep) -> None:
    """A sparse (or other non-strided) parameter or buffer the forward reads: graphmode's graph
    holds dense tensors (the padding analysis and the planner crashed on one)."""
    for name, t in (*ep.state_dict.items(), *ep.constants.items()):
        if isinstance(t, torch.Tensor) and t.layout is not torch.strided:
            raise CaptureError(f"the model's {name} is a {str(t.layout).replace('torch.', '')} tensor, and graphmode "
                               "compiles dense ones", where=f"model.{name}", value=str(t.layout),
                               fix="keep it dense in the module (register the buffer as t.to_dense()), or run the "
                                   "model with exe_mode: eager")


def export_program(module: torch.nn.Module, example_inputs: Mapping[str, torch.Tensor],
                   input_dims: Mapping[str, Sequence], dims: Mapping[str, tuple[int, int]]):
    """torch.export with one torch Dim per recipe dim (dims with min == max stay static)."""
    from torch.export import Dim
    tdims = {}
    for name, (lo, hi) in dims.items():
        if hi > lo:
            tdims[name] = Dim(clean_name(name), min=lo, max=hi)  # examples are >= 2: no 0/1 specialisation
    dynamic = {}
    for inp in example_inputs:
        names = input_dims.get(inp, [])
        dynamic[inp] = {i: tdims[d] for i, d in enumerate(names) if isinstance(d, str) and d in tdims} or None
    traced = traced_copy(module)
    try:
        with torch.no_grad(), quiet_export_logs(), eager_fast_paths(traced), unchanged_moves_kept(), \
                refuse_self_changes(traced, "model", "torch.export traced it"):
            ep = torch.export.export(traced, (), dict(example_inputs), dynamic_shapes=dynamic, strict=False)
            _refuse_grad_regions(ep)
            _refuse_sparse_constants(ep)
            ep = ep.run_decompositions(decomp_table={})
    except GraphmodeError:
        raise                   # a refusal of ours, raised while the model was traced: already says what to do
    except Exception as e:  # noqa: BLE001 - torch raises many types; report them uniformly
        raise export_failure(e, "check the recipe's dims against the model (a dim the model specialises must "
                                "be static in the recipe), or exclude the offending op", module=module,
                             ranges=dims) from e
    return ep


def _import_decomposing(ep, importer: Callable[[Any], "_Importer"], prefix: str):
    """(program, importer, graph): `ep` imported, then imported again with the ops it could not
    lower decomposed by torch where that lowers more of them (graphmode/capture/decompose.py);
    a few rounds, since a decomposition may bring ops of its own with no lowering."""
    from graphmode.capture.decompose import decomposable, decompose

    def run(ep):
        imp = importer(ep)
        imp.fqn_prefix = prefix
        g = imp.run()
        g.prune_values()
        return imp, g

    def islands(imp) -> int:
        return sum(f.count for f in imp.fallbacks.values())

    best = cur = (ep, *run(ep))
    tried: set = set()
    for _ in range(4):
        table = decomposable(cur[0], {f.target for f in cur[1].fallbacks.values() if not f.excluded})
        table = {op: fn for op, fn in table.items() if op not in tried}
        tried |= set(table)
        new = decompose(cur[0], table) if table else None
        if new is None:
            break
        try:
            cur = (new, *run(new))
        except GraphmodeError:
            break               # the decomposition's own ops refuse (a complex intermediate): keep the island
        if islands(cur[1]) < islands(best[1]):
            best = cur
    ep, imp, g = best
    return ep, imp, g


def example_sizes(dims: Mapping[str, tuple[int, int]]) -> dict[str, int]:
    """Distinct, non-1 sizes inside each range so export does not specialise or merge dims."""
    primes = [3, 5, 7, 11, 13, 17, 19, 23]
    out = {}
    for i, (name, (lo, hi)) in enumerate(sorted(dims.items())):
        want = primes[i % len(primes)]
        out[name] = min(max(want, lo, 2 if hi >= 2 else lo), hi)
    return out


def import_torch(module: torch.nn.Module, example_inputs: Mapping[str, torch.Tensor],
                 input_dims: Mapping[str, Sequence], dims: Mapping[str, tuple[int, int]], *,
                 name: str = "model", include_ops: Sequence[str] = (), exclude_ops: Sequence[str] = (),
                 output_names: Sequence[str] = (), output_structure: dict | None = None
                 ) -> tuple[Graph, CaptureReport]:
    """Export `module` with the recipe's dims and translate it; `output_names` and
    `output_structure` (graphmode/capture/outputs.py) say what its outputs are called and how
    eager returns them (default: `output`, or `output_0`, `output_1`, ...)."""
    t0 = time.perf_counter()
    ep = export_program(module, example_inputs, input_dims, dims)
    from graphmode.capture.zoo import OutputFlattener
    prefix = "model." if isinstance(module, OutputFlattener) else ""
    excluder = make_excluder(include_ops, exclude_ops)
    ep, imp, g = _import_decomposing(ep, lambda ep: _Importer(ep, name, input_dims, dims, excluder), prefix)
    report = CaptureReport(source="torch.export", seconds=time.perf_counter() - t0,
                           aten_ops=dict(sorted(imp.aten_ops.items())),
                           fallbacks=sorted(imp.fallbacks.values(), key=lambda f: (f.target, f.loc)),
                           locs=imp.locs, unmatched_excludes=[e for e in exclude_ops if e not in excluder.matched])
    try:
        report.out_spec = pytree.treespec_dumps(ep.call_spec.out_spec)
    except Exception:  # noqa: BLE001 - optional metadata
        report.out_spec = None
    report.mutated_inputs = list(imp.mutated_inputs)
    report.tail = imp.tail.graph if imp.tail else None
    users = report.tail.outputs if report.tail is not None else g.outputs[:len(g.outputs) - len(imp.mutated_inputs)]
    report.output_names = list(output_names) or (["output"] if len(users) == 1 else
                                                 [f"output_{i}" for i in range(len(users))])
    report.output_structure = output_structure
    return g, report
