"""The ONNX importer's value state: what each ONNX value is (a known value folded at import
time, an IR value, or a large constant not yet in the graph), how one becomes an IR operand,
and the cross-check of every value's type against the model's declared types."""
from __future__ import annotations

import re
from typing import Any, Sequence

import numpy as np
import sympy
import torch

from graphmode.capture.onnx.fold import KNOWN_LIMIT, _Known, _is_sym, _objarr, _py
from graphmode.capture.onnx.checks import ONNX_DTYPES as _ONNX_DTYPES, WIDENED
from graphmode.errors import IRError
from graphmode.ir.graph import clean_name
from graphmode.ir.ops import OPS
from graphmode.ir.types import Dim, TensorType, dim_str, dims_equal, normalize_dim



def _to_tensor(arr: np.ndarray, onnx_type: int | None = None) -> torch.Tensor:
    """A writable torch copy of an ONNX numpy array (bfloat16 arrives as 16-bit words)."""
    if (onnx_type == 16 or str(arr.dtype) == "bfloat16") and arr.dtype.itemsize == 2:
        return torch.from_numpy(np.array(arr, copy=True).view(np.int16)).view(torch.bfloat16)
    if onnx_type == 16:   # an onnx that widened bf16 to float32
        return torch.from_numpy(np.array(arr, dtype=np.float32, copy=True)).to(torch.bfloat16)
    if onnx_type in WIDENED:      # int4 / uint4 weights (QDQ 4-bit): one byte each, the same values
        return torch.from_numpy(np.array(arr, dtype=np.int8 if WIDENED[onnx_type] == "i8" else np.uint8))
    return torch.from_numpy(np.array(arr, copy=True))


def _vname(onnx_name: str) -> str:
    """'/bert/encoder/layer.0/attention/self/Reshape_output_0' -> 'bert.encoder.layer.0.attention.self.Reshape'."""
    n = onnx_name.strip("/").replace("/", ".")
    n = re.sub(r"_output_0(?=$|_)", "", n)
    return clean_name(n or "v")


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


class ValueState:
    """Mixin of _Importer: `known`, `ir` and `big` map ONNX value names to what they are."""

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
                parts.append(self._dim_as_value(v, k.dtype, hint))
            else:
                run.append(v)
        flush()
        most = OPS["concat"].arity[1]
        while len(parts) > 1:        # a concat takes at most `most` inputs: a tree of them (the 782
            parts = [p[0] if len(p) == 1 else self.emit("concat", p, {"dim": 0}, hint=hint)   # indices of a resize)
                     for p in (parts[i:i + most] for i in range(0, len(parts), most))]
        out = parts[0]
        if k.shape != (k.arr.size,):
            out = self.emit("reshape", [out], {"shape": list(k.shape)}, hint=hint)
        return out

    def _dim_as_value(self, v: Any, dtype: str, hint: str) -> str:
        """A size used as a number: a one-element arange at the dims' values; a float multiple of
        one (x.shape[0] * 0.25, exported as Cast then Mul) as that arange times the same f32
        constant, so it rounds as the exporter's own product does."""
        coeff, term = sympy.sympify(v).as_coeff_Mul()
        if not (term.is_integer and (coeff.is_Integer or coeff.is_Float or coeff.is_Rational)) or \
                (not coeff.is_Integer and dtype not in ("f32", "f64", "f16", "bf16")):
            raise self.fail(f"the model uses {dim_str(v)} as a value, which is no whole multiple of its dims",
                            fix="compute it from tensors (cast the size to float before scaling it)")
        term = normalize_dim(term)
        out = self.emit("arange", [], {"start": dim_str(term), "end": dim_str(normalize_dim(term + 1)),
                                       "step": 1, "dtype": dtype}, hint=f"{hint}_dim")
        if coeff != 1:
            c = self.scalar(float(coeff) if not coeff.is_Integer else int(coeff), dtype, f"{hint}_scale")
            out = self.emit("mul", [out, c], {}, hint=f"{hint}_dim")
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
            if want is None or _data_sized(g):     # NonZero's count: the exporter's sample, not a contract
                continue
            if not _deq(want, g):
                raise self.fail(f"value {name!r} dim {i}: the importer inferred {dim_str(g)}, the ONNX model "
                                f"declares {dim_str(want) if not isinstance(want, int) else want}",
                                fix="name the model's dims with the recipe's dims in inputs[].shape, or re-export "
                                    "with dynamic axes on every dynamic input dim")


def data_length_error(imp, what: str, size: Dim):
    """The refusal of an op the importer needs a known extent for, over a data-dependent length."""
    return imp.fail(f"{what} over a length only the data decides ({dim_str(size)}: what a NonZero, Compress or "
                    "Unique kept) is not imported yet", fix="apply it before the selection (on the whole tensor, "
                    "then select), or run the model with exe_mode: eager (ONNX Runtime)")


def _data_sized(d: Dim) -> bool:
    """A dim only the data decides (capture/tail.py's data_u<k>)."""
    from graphmode.capture.tail import is_data_dim
    return not isinstance(d, int) and any(is_data_dim(x.name) for x in d.free_symbols)
