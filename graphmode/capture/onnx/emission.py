"""The ONNX importer's emission of IR nodes: the op table's type inference, u16/u32/u64 values
computed on int64, ATen-reference ops with several outputs, and the eager `fallback` nodes of
ops a recipe excludes (the torch.ops.aten call equivalent to each core op)."""
from __future__ import annotations

from graphmode.capture.onnx.values import _vname
from graphmode.capture.torch_import import Fallback
from graphmode.errors import IRError
from graphmode.ir.ops import aten_call, get_op
from graphmode.ir.types import TensorType

_UNSIGNED = frozenset({"u16", "u32", "u64"})
# ops torch runs on u16/u32/u64 tensors (moves, casts, equality); the rest go through int64
_UNSIGNED_NATIVE = frozenset({"cast", "identity", "reshape", "permute", "expand", "slice", "concat", "index",
                              "eq", "full"})
_U64_AS_I64 = frozenset({"add", "sub", "mul", "eq", "ne", "neg", "bitwise_and", "bitwise_or", "bitwise_xor",
                         "bitwise_not", "bitwise_left_shift"})
_U64_ORDERED = frozenset({"lt", "le", "gt", "ge", "maximum", "minimum"})


class Emitter:
    """Mixin of _Importer: every IR node a handler adds goes through `emit` (or `emit_aten`)."""

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
            err = self.fail(e.message if e.message.startswith(f"{op}:") else f"{op}: {e.message}",
                            fix=e.fix or "the node's inputs do not fit together for the recipe's dims: fix the "
                                         "shapes named above in the model (or the dims in the recipe)")
            err.meeting = getattr(e, "meeting", None)       # two dims the graph ties (a draft joins them)
            raise err from None
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
            self.fallbacks[key] = Fallback(target, f"ONNX {n.op_type} excluded by recipe capture settings", loc,
                                           excluded=True)

    def emit_aten(self, op: str, inputs: list[str], args: list, kwargs: dict | None = None, *,
                  overload: str = "default", hint: str) -> list[str]:
        """One ATen-reference node (`ir/ops/aten_ref.py`: `args`/`kwargs` of the ATen call, `{"$in": i}`
        for input i), all its outputs (sort and topk give two); their IR names."""
        attrs = {"overload": overload, "args": args, "kwargs": dict(kwargs or {})}
        n = self.node
        if n is not None and self.excluded(n.op_type, op):
            raise self.fail(f"{n.op_type} is excluded from compilation, but it lowers to the ATen-reference op "
                            f"{op!r}, and ONNX has no eager fallback",
                            fix=f"remove {n.op_type!r} from capture.exclude_ops")
        types = get_op(op).infer([self.g.type_of(i) for i in inputs], attrs)
        names = [self.g.fresh_name(_vname(f"{hint}_{k}" if k else hint)) for k in range(len(types))]
        outs = self.g.add_node(op, inputs, types, attrs, names=names)
        if n is not None:
            self.op_map[n.op_type][op] += 1
        return outs
