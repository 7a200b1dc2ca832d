"""PyTorch -> IR: torch.export with the recipe's dynamic dims, ATen lowering, translation.

`run_decompositions(decomp_table={})` keeps high-level ATen ops (linear, layer_norm,
scaled_dot_product_attention) — better fusion units, and the default core-ATen table
fails on GPT-2 (see shared/NOTES.md). Every ATen op either maps to a core IR op through
`_TRANSLATE` or becomes an explicit `fallback` node listed in the capture report.
"""
from __future__ import annotations

import operator
import time
from pathlib import Path
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import sympy
import torch
import torch.utils._pytree as pytree

from graphmode.errors import CaptureError
from graphmode.ir.graph import Graph, clean_name
from graphmode.ir.types import TORCH_TO_DTYPE, TensorType, dim_str, normalize_dim, sym


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
    output_names: list[str] = field(default_factory=list)
    locs: dict[str, str] = field(default_factory=dict)   # IR value -> the model source line that made it

    def to_json(self) -> dict:
        return {"source": self.source, "seconds": round(self.seconds, 3), "aten_ops": self.aten_ops,
                "fallbacks": [f.__dict__ for f in self.fallbacks], "output_names": self.output_names}


_SKIP = {"aten._assert_tensor_metadata.default", "aten._assert_scalar.default",
         "aten.sym_constrain_range_for_size.default", "aten.sym_constrain_range.default",
         "aten._assert_async.msg"}
_IDENTITY = {"aten.clone.default", "aten.contiguous.default", "aten.alias.default", "aten.detach.default",
             "aten.lift_fresh_copy.default", "aten.dropout.default", "aten.feature_dropout.default",
             "aten._to_copy.default_same", "aten.native_dropout.default"}
_VIEWS = {"aten.view.default", "aten.reshape.default", "aten._unsafe_view.default", "aten.unsqueeze.default",
          "aten.squeeze.dim", "aten.squeeze.dims", "aten.squeeze.default", "aten.flatten.using_ints",
          "aten.unflatten.int", "aten.view_as.default"}
_UNARY = {"aten.neg.default": "neg", "aten.exp.default": "exp", "aten.log.default": "log",
          "aten.sqrt.default": "sqrt", "aten.rsqrt.default": "rsqrt", "aten.reciprocal.default": "reciprocal",
          "aten.abs.default": "abs", "aten.tanh.default": "tanh", "aten.sigmoid.default": "sigmoid",
          "aten.relu.default": "relu", "aten.relu_.default": "relu", "aten.erf.default": "erf",
          "aten.sin.default": "sin", "aten.cos.default": "cos", "aten.silu.default": "silu",
          "aten.logical_not.default": "logical_not", "aten.bitwise_not.default": "logical_not"}
_BINARY = {"add": "add", "sub": "sub", "mul": "mul", "div": "div", "pow": "pow", "maximum": "maximum",
           "minimum": "minimum", "eq": "eq", "ne": "ne", "lt": "lt", "le": "le", "gt": "gt", "ge": "ge",
           "logical_and": "logical_and", "logical_or": "logical_or", "bitwise_and": "logical_and",
           "bitwise_or": "logical_or", "__and__": "logical_and", "__or__": "logical_or"}


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
            if unknown:
                raise CaptureError(f"symbolic size {expr} uses symbols {unknown} that map to no recipe dim",
                                   fix="declare every dynamic input dim in the recipe's inputs/dims")
            return normalize_dim(expr)
        if isinstance(v, torch.fx.Node):
            r = self.env[v]
            return r
        return int(v)

    def dim_attr(self, v):
        d = self.dim(v)
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
            raise CaptureError(f"symbolic value {v} used as a tensor", fix="unsupported dynamic scalar")
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
            self.env[node] = self.env[src][idx] if isinstance(self.env[src], (tuple, list)) else None
            if self.env[node] is None:
                raise CaptureError(f"getitem on a single value at {node.name}")
            return
        if not isinstance(target, torch._ops.OpOverload):
            self._sym_op(node)
            return
        self.aten_ops[tname] = self.aten_ops.get(tname, 0) + 1
        short = tname.split(".")[1] if tname.startswith("aten.") else tname
        if self.excluded(tname, short):
            self._fallback(node, "excluded by recipe capture settings", excluded=True)
            return
        try:
            handled = self._aten(node, tname, short)
        except CaptureError:
            raise
        if not handled:
            self._fallback(node, "no graphmode lowering for this op")

    def _sym_op(self, node: torch.fx.Node) -> None:
        """Python arithmetic on SymInts (operator.mul, sym_size...) evaluated symbolically."""
        args = [self.env[a] if isinstance(a, torch.fx.Node) else a for a in node.args]
        fns = {operator.mul: operator.mul, operator.add: operator.add, operator.sub: operator.sub,
               operator.floordiv: lambda a, b: sympy.floor(sympy.sympify(a) / b),
               operator.truediv: operator.truediv, operator.neg: operator.neg}
        fn = fns.get(node.target)
        if fn is None and getattr(node.target, "__name__", "") in ("sym_max", "sym_min"):
            fn = sympy.Max if node.target.__name__ == "sym_max" else sympy.Min
        if fn is None:
            raise CaptureError(f"unsupported python op {node.target} at {node.name}",
                               fix="rewrite the model code to avoid it, or exclude the region")
        r = fn(*[sympy.sympify(a) if not isinstance(a, (int, float)) else a for a in args])
        self.env[node] = normalize_dim(r) if isinstance(r, (sympy.Basic, int)) else r

    def _fallback(self, node: torch.fx.Node, reason: str, excluded: bool = False) -> None:
        ins: list[str] = []

        def enc(a):
            if isinstance(a, torch.fx.Node):
                v = self.env[a]
                if isinstance(v, str):
                    ins.append(v)
                    return {"$in": len(ins) - 1}
                if isinstance(v, sympy.Basic):
                    return {"$dim": dim_str(v)}
                return v
            if isinstance(a, torch.SymInt):
                return {"$dim": dim_str(self.dim(a))}
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
        loc = _source_loc(node)
        vals = node.meta["val"]
        vals = list(vals) if isinstance(vals, (tuple, list)) else [vals]
        tensors = [v for v in vals if isinstance(v, torch.Tensor)]
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

    def _aten(self, node: torch.fx.Node, tname: str, short: str) -> bool:  # noqa: C901 - one table
        a, kw = node.args, node.kwargs
        x = lambda i: self.operand(a[i])  # noqa: E731
        val = node.meta.get("val")
        if tname in _IDENTITY or tname in ("aten.dropout.default",):
            self.emit(node, "identity", [x(0)])
            return True
        if tname in _VIEWS:
            self.emit(node, "reshape", [x(0)], {"shape": [self.dim_attr(s) for s in val.shape]})
            return True
        if tname in _UNARY:
            self.emit(node, _UNARY[tname], [x(0)])
            return True
        if short in _BINARY or short.rstrip("_") in _BINARY:
            op = _BINARY[short] if short in _BINARY else _BINARY[short.rstrip("_")]
            if short.startswith("div") and (kw.get("rounding_mode") or (len(a) > 2 and a[2])):
                return False
            lhs, rhs = x(0), x(1)
            alpha = kw.get("alpha", 1)
            if alpha != 1 and op in ("add", "sub"):
                rhs, = self.g.add_node("mul", [rhs, self.const(alpha)],
                                       [TensorType(self.g.type_of(rhs).dtype, self.g.type_of(rhs).shape)])
            self.emit(node, op, [lhs, rhs])
            return True
        if short == "rsub":
            self.emit(node, "sub", [x(1), x(0)])
            return True
        if short in ("gelu",):
            self.emit(node, "gelu", [x(0)], {"approximate": kw.get("approximate", a[1] if len(a) > 1 else "none")})
            return True
        if tname in ("aten.softmax.int", "aten._softmax.default", "aten._safe_softmax.default"):
            self.emit(node, "softmax", [x(0)], {"dim": int(a[1])})
            return True
        if tname in ("aten.log_softmax.int", "aten._log_softmax.default"):
            self.emit(node, "log_softmax", [x(0)], {"dim": int(a[1])})
            return True
        if tname in ("aten.linear.default",):
            ins = [x(0), x(1)] + ([x(2)] if len(a) > 2 and a[2] is not None else [])
            self.emit(node, "linear", ins)
            return True
        if tname == "aten.addmm.default":
            bias, inp, w = x(0), x(1), x(2)
            wt = self.g.type_of(w)
            w_t, = self.g.add_node("permute", [w], [wt.with_shape((wt.shape[1], wt.shape[0]))], {"perm": [1, 0]})
            self.emit(node, "linear", [inp, w_t, bias])
            return True
        if tname in ("aten.mm.default", "aten.bmm.default", "aten.matmul.default"):
            self.emit(node, "matmul", [x(0), x(1)])
            return True
        if tname == "aten.layer_norm.default":
            ins = [x(0)] + [self.operand(t) for t in a[2:4] if t is not None]
            eps = a[4] if len(a) > 4 else kw.get("eps", 1e-5)
            self.emit(node, "layer_norm", ins, {"normalized_rank": len(a[1]), "eps": float(eps)})
            return True
        if tname == "aten.native_layer_norm.default":
            ins = [x(0)] + [self.operand(t) for t in a[2:4] if t is not None]
            out, = self.g.add_node("layer_norm", ins, [self.ttype(val[0])],
                                   {"normalized_rank": len(a[1]), "eps": float(a[4])}, names=[clean_name(node.name)])
            self.env[node] = (out, None, None)
            return True
        if tname == "aten.scaled_dot_product_attention.default":
            mask = kw.get("attn_mask", a[3] if len(a) > 3 else None)
            if kw.get("dropout_p", a[4] if len(a) > 4 else 0.0):
                return False
            ins = [x(0), x(1), x(2)] + ([self.operand(mask)] if mask is not None else [])
            attrs = {"is_causal": bool(kw.get("is_causal", a[5] if len(a) > 5 else False))}
            scale = kw.get("scale", a[6] if len(a) > 6 else None)
            if scale is not None:
                attrs["scale"] = float(scale)
            self.emit(node, "sdpa", ins, attrs)
            return True
        if tname == "aten.embedding.default":
            self.emit(node, "embedding", [x(0), x(1)])
            return True
        if tname in ("aten.permute.default",):
            self.emit(node, "permute", [x(0)], {"perm": [int(p) % len(val.shape) for p in a[1]]})
            return True
        if tname in ("aten.transpose.int", "aten.t.default"):
            rank = len(val.shape)
            d0, d1 = (a[1], a[2]) if len(a) > 2 else (0, 1)
            perm = list(range(rank))
            perm[d0 % rank], perm[d1 % rank] = perm[d1 % rank], perm[d0 % rank]
            self.emit(node, "permute", [x(0)], {"perm": perm})
            return True
        if tname in ("aten.expand.default",):
            self.emit(node, "expand", [x(0)], {"shape": [self.dim_attr(s) for s in val.shape]})
            return True
        if tname == "aten.slice.Tensor":
            dim = a[1] if len(a) > 1 else 0
            start = a[2] if len(a) > 2 and a[2] is not None else 0
            end = a[3] if len(a) > 3 and a[3] is not None else 2 ** 62
            step = a[4] if len(a) > 4 else 1
            start_d = self.dim(start)
            if not isinstance(start_d, int):
                return False
            end_d = self.dim(end) if not (isinstance(end, int) and end >= 2 ** 62) else 2 ** 62
            self.emit(node, "slice", [x(0)], {"dim": int(dim) % len(val.shape), "start": start_d,
                                                "end": end_d if isinstance(end_d, int) else dim_str(end_d),
                                                "step": int(step)})
            return True
        if tname == "aten.select.int":
            src = x(0)
            st = self.g.type_of(src)
            dim = int(a[1]) % st.rank
            idx = self.dim(a[2])
            if not isinstance(idx, int):
                return False
            shape = list(st.shape)
            shape[dim] = 1
            if idx < 0:
                idx_end = idx + 1 if idx != -1 else 2 ** 62
            else:
                idx_end = idx + 1
            s, = self.g.add_node("slice", [src], [st.with_shape(shape)],
                                 {"dim": dim, "start": idx, "end": idx_end, "step": 1})
            self.emit(node, "reshape", [s], {"shape": [self.dim_attr(v) for v in val.shape]})
            return True
        if tname in ("aten.split.Tensor", "aten.split_with_sizes.default", "aten.chunk.default"):
            src = x(0)
            st = self.g.type_of(src)
            dim = int(kw.get("dim", a[2] if len(a) > 2 else 0)) % st.rank
            outs, start = [], 0
            for i, piece in enumerate(val):
                length = self.dim(piece.shape[dim])
                if not isinstance(length, int):
                    return False
                o, = self.g.add_node("slice", [src], [self.ttype(piece)],
                                     {"dim": dim, "start": start, "end": start + length, "step": 1},
                                     names=[clean_name(f"{node.name}_{i}")])
                outs.append(o)
                start += length
            self.env[node] = tuple(outs)
            return True
        if tname == "aten.cat.default":
            ins = [self.operand(t) for t in a[0]]
            self.emit(node, "concat", ins, {"dim": int(a[1] if len(a) > 1 else kw.get("dim", 0)) % len(val.shape)})
            return True
        if tname in ("aten.where.self",):
            self.emit(node, "where", [x(0), x(1), x(2)])
            return True
        if tname in ("aten.masked_fill.Scalar", "aten.masked_fill.Tensor"):
            src = x(0)
            fill = self.const(a[2], self.g.type_of(src).dtype) if not isinstance(a[2], torch.fx.Node) else x(2)
            self.emit(node, "where", [x(1), fill, src])
            return True
        if tname in ("aten.to.dtype", "aten._to_copy.default", "aten.to.dtype_layout", "aten.type_as.default"):
            dt = TORCH_TO_DTYPE[val.dtype]
            self.emit(node, "cast", [x(0)], {"dtype": dt})
            return True
        if tname in ("aten.mean.dim", "aten.sum.dim_IntList", "aten.amax.default", "aten.amin.default"):
            op = {"mean": "mean", "sum": "sum", "amax": "amax", "amin": "amin"}[short]
            dims = a[1] if len(a) > 1 else kw.get("dim")
            rank = len(self.g.type_of(x(0)).shape)
            dims = list(range(rank)) if dims is None else [int(d) % rank for d in (dims if isinstance(dims, (list, tuple)) else [dims])]
            keep = bool(a[2] if len(a) > 2 else kw.get("keepdim", False))
            if kw.get("dtype") is not None:
                return False
            self.emit(node, op, [x(0)], {"dims": dims, "keepdim": keep})
            return True
        if tname in ("aten.arange.default", "aten.arange.start", "aten.arange.start_step"):
            nums = list(a)
            start, end, step = (0, nums[0], 1) if len(nums) == 1 else (nums[0], nums[1], nums[2] if len(nums) > 2 else 1)
            s, e = self.dim(start), self.dim(end)
            if not isinstance(s, int) or not isinstance(step, int):
                return False
            self.emit(node, "arange", [], {"start": s, "end": e if isinstance(e, int) else dim_str(e), "step": step,
                                           "dtype": TORCH_TO_DTYPE[val.dtype]})
            return True
        if tname in ("aten.full.default", "aten.zeros.default", "aten.ones.default", "aten.new_ones.default",
                     "aten.new_zeros.default", "aten.new_full.default", "aten.ones_like.default",
                     "aten.zeros_like.default", "aten.full_like.default", "aten.scalar_tensor.default"):
            value = {"zeros": 0, "new_zeros": 0, "zeros_like": 0, "ones": 1, "new_ones": 1, "ones_like": 1}.get(short)
            if value is None:
                value = a[1] if short in ("full", "full_like") else a[2] if short == "new_full" else a[0]
            if isinstance(value, torch.fx.Node):
                return False
            dt = TORCH_TO_DTYPE[val.dtype]
            value = bool(value) if dt == "bool" else (int(value) if dt.startswith(("i", "u")) else float(value))
            self.emit(node, "full", [], {"shape": [self.dim_attr(s) for s in val.shape], "value": value, "dtype": dt})
            return True
        if tname in ("aten.tril.default", "aten.triu.default"):
            self.emit(node, short, [x(0)], {"diagonal": int(a[1] if len(a) > 1 else 0)})
            return True
        if tname in ("aten.conv2d.default", "aten.convolution.default"):
            if short == "convolution" and a[6]:
                return False  # transposed
            ins = [x(0), x(1)] + ([x(2)] if a[2] is not None else [])
            if short == "conv2d":
                stride, pad, dil, groups = (list(a[3]) if len(a) > 3 else [1, 1], list(a[4]) if len(a) > 4 else [0, 0],
                                            list(a[5]) if len(a) > 5 else [1, 1], a[6] if len(a) > 6 else 1)
            else:
                stride, pad, dil, groups = list(a[3]), list(a[4]), list(a[5]), a[8]
            if isinstance(pad, str) or len(self.g.type_of(ins[0]).shape) != 4:
                return False
            self.emit(node, "conv2d", ins, {"stride": stride, "padding": pad, "dilation": dil, "groups": int(groups)})
            return True
        if tname in ("aten.batch_norm.default", "aten._native_batch_norm_legit_no_training.default"):
            if short == "batch_norm":
                ins = [x(0), x(1), x(2), x(3), x(4)]
                if a[5]:  # training
                    return False
                eps = a[7]
            else:
                ins = [x(0), x(1), x(2), x(3), x(4)]
                eps = a[6]
            out, = self.g.add_node("batch_norm", ins, [self.ttype(val[0] if isinstance(val, (tuple, list)) else val)],
                                   {"eps": float(eps)}, names=[clean_name(node.name)])
            self.env[node] = (out, None, None) if isinstance(val, (tuple, list)) else out
            return True
        if tname in ("aten.max_pool2d.default", "aten.max_pool2d_with_indices.default"):
            k = list(a[1])
            stride = list(a[2]) if len(a) > 2 and a[2] else k
            attrs = {"kernel": k, "stride": stride, "padding": list(a[3]) if len(a) > 3 else [0, 0],
                     "dilation": list(a[4]) if len(a) > 4 else [1, 1], "ceil_mode": bool(a[5]) if len(a) > 5 else False}
            ty = self.ttype(val[0] if isinstance(val, (tuple, list)) else val)
            out, = self.g.add_node("max_pool2d", [x(0)], [ty], attrs, names=[clean_name(node.name)])
            self.env[node] = (out, None) if isinstance(val, (tuple, list)) else out
            return True
        if tname == "aten.avg_pool2d.default":
            k = list(a[1])
            self.emit(node, "avg_pool2d", [x(0)], {"kernel": k, "stride": list(a[2]) if len(a) > 2 and a[2] else k,
                                                   "padding": list(a[3]) if len(a) > 3 else [0, 0],
                                                   "ceil_mode": bool(a[4]) if len(a) > 4 else False,
                                                   "count_include_pad": bool(a[5]) if len(a) > 5 else True})
            return True
        if tname in ("aten.adaptive_avg_pool2d.default", "aten._adaptive_avg_pool2d.default"):
            self.emit(node, "adaptive_avg_pool2d", [x(0)], {"output_size": [int(v) for v in a[1]]})
            return True
        if tname == "aten.cumsum.default":
            if kw.get("dtype") is not None:
                return False
            self.emit(node, "cumsum", [x(0)], {"dim": int(a[1]) % len(val.shape)})
            return True
        if tname == "aten.diff.default":
            return self._diff(node)
        if tname == "aten.index.Tensor":
            idx = list(a[1])
            dims = [i for i, t in enumerate(idx) if t is not None]
            if not dims or any(self.g.type_of(self.operand(idx[d])).dtype == "bool" for d in dims):
                return False
            self.emit(node, "index", [x(0)] + [self.operand(idx[d]) for d in dims], {"dims": dims})
            return True
        if tname == "aten.index_select.default":
            self.emit(node, "index_select", [x(0), x(2)], {"dim": int(a[1])})
            return True
        if tname == "aten.clamp.default":
            self.emit(node, "clamp", [x(0)], {"min": a[1] if len(a) > 1 else None, "max": a[2] if len(a) > 2 else None})
            return True
        if tname == "aten.sym_size.int":
            self.env[node] = self.dim(node.meta["val"])
            return True
        return False

    def _diff(self, node: torch.fx.Node) -> bool:
        """diff(x, n=1, dim, prepend, append) = y[1:] - y[:-1] with y = cat(prepend, x, append)."""
        a, kw = node.args, node.kwargs
        n = a[1] if len(a) > 1 else kw.get("n", 1)
        if n != 1:
            return False
        x = self.operand(a[0])
        xt = self.g.type_of(x)
        dim = int(a[2] if len(a) > 2 else kw.get("dim", -1)) % xt.rank
        pre = a[3] if len(a) > 3 else kw.get("prepend")
        app = a[4] if len(a) > 4 else kw.get("append")
        parts = [self.operand(t) for t in (pre, a[0], app) if t is not None]
        y = x
        if len(parts) > 1:
            shape = list(xt.shape)
            shape[dim] = sum((self.g.type_of(p).shape[dim] for p in parts), start=0)
            y, = self.g.add_node("concat", parts, [xt.with_shape(shape)], {"dim": dim})
        yt = self.g.type_of(y)
        shape = list(yt.shape)
        shape[dim] = yt.shape[dim] - 1
        hi, = self.g.add_node("slice", [y], [yt.with_shape(shape)], {"dim": dim, "start": 1, "end": 2 ** 62, "step": 1})
        lo, = self.g.add_node("slice", [y], [yt.with_shape(shape)], {"dim": dim, "start": 0, "end": -1, "step": 1})
        self.emit(node, "sub", [hi, lo])
        return True

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
                    self.env[n] = self.g.add_constant(self.g.fresh_name(clean_name(fqn)), t, role="param")
                elif n in user_inputs:
                    nm = user_names[user_inputs.index(n)]
                    val = n.meta["val"]
                    if not isinstance(val, torch.Tensor):
                        raise CaptureError(f"input {nm!r} is not a tensor", fix="pass tensors only")
                    self.env[n] = self.g.add_input(clean_name(nm), self.ttype(val))
                else:
                    raise CaptureError(f"unsupported placeholder {n.name}")
            elif n.op == "call_function":
                first = len(self.g.nodes)
                self.translate(n)
                if len(self.g.nodes) > first:
                    loc = _source_loc(n)
                    for made in self.g.nodes[first:]:
                        for o in made.outputs:
                            self.locs[o] = loc
            elif n.op == "output":
                outs = []
                for o in pytree.tree_leaves(n.args[0]):
                    if isinstance(o, torch.fx.Node):
                        v = self.env[o]
                        outs.append(v if isinstance(v, str) else self.operand(o))
                    else:
                        outs.append(self.const(o))
                self.g.outputs = outs
        for o in self.g.outputs:
            v = self.g.values[o]
            if v.role == "intermediate":
                self.g.values[o] = v.__class__(o, v.type, "output")
        return self.g

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


_TORCH_DIR = str(Path(torch.__file__).parent)


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
        return f"{path}:{line}"
    stack = node.meta.get("nn_module_stack")
    if stack:
        last = list(stack.values())[-1]
        return last[0] if isinstance(last, tuple) else str(stack)
    return node.name


def make_excluder(include_ops: Sequence[str] = (), exclude_ops: Sequence[str] = ()) -> Callable[[str, str], bool]:
    """Ops are named by ATen short name ('softmax') or full overload ('aten.softmax.int')."""
    inc, exc = set(include_ops), set(exclude_ops)

    def excluded(full: str, short: str) -> bool:
        names = {full, short, full.rsplit(".", 1)[0]}
        if inc and not (names & inc):
            return True
        return bool(names & exc)
    return excluded


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
    import logging
    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    level = fake_log.level
    fake_log.setLevel(logging.CRITICAL)     # a failing export logs a traceback there; the CaptureError says it
    try:
        with torch.no_grad():
            ep = torch.export.export(module, (), dict(example_inputs), dynamic_shapes=dynamic, strict=False)
            ep = ep.run_decompositions(decomp_table={})
    except Exception as e:  # noqa: BLE001 - torch raises many types; report them uniformly
        msg = str(e).strip().splitlines()
        raise CaptureError(f"torch.export failed: {type(e).__name__}: {msg[0] if msg else ''}",
                           fix="check the recipe's dims against the model (a dim the model specialises must "
                               "be static in the recipe), or exclude the offending op") from e
    finally:
        fake_log.setLevel(level)
    return ep


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
                 output_names: Sequence[str] = ()) -> tuple[Graph, CaptureReport]:
    t0 = time.perf_counter()
    ep = export_program(module, example_inputs, input_dims, dims)
    imp = _Importer(ep, name, input_dims, dims, make_excluder(include_ops, exclude_ops))
    g = imp.run()
    g.prune_values()
    report = CaptureReport(source="torch.export", seconds=time.perf_counter() - t0,
                           aten_ops=dict(sorted(imp.aten_ops.items())),
                           fallbacks=sorted(imp.fallbacks.values(), key=lambda f: (f.target, f.loc)),
                           locs=imp.locs)
    try:
        report.out_spec = pytree.treespec_dumps(ep.call_spec.out_spec)
    except Exception:  # noqa: BLE001 - optional metadata
        report.out_spec = None
    report.output_names = list(output_names) or list(g.outputs)
    return g, report
