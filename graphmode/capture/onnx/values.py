"""The ONNX importer's value state: what each ONNX value is (a known value folded at import
time, an IR value, or a large constant not yet in the graph), how one becomes an IR operand,
and the cross-check of every value's type against the model's declared types."""
from __future__ import annotations

import itertools
import re
from typing import Any, Sequence

import numpy as np
import sympy
import torch

from graphmode.capture.onnx.fold import KNOWN_LIMIT, _Known, _is_sym, _objarr, _py
from graphmode.capture.onnx.checks import ONNX_DTYPES as _ONNX_DTYPES, WIDENED
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
            if not isinstance(p, str):             # not UTF-8 (protobuf gives bytes): a name that checks nothing
                return None
            if p in self.dimmap:
                return self.dimmap[p]
            return declared_expr(p, self.dimmap)   # dynamo's "2*s27", "Min(32, s27)", "(s27//2)"
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
            if not _deq(want, g) and not self._advisory(want, g):
                fixed = isinstance(g, int) and not isinstance(want, int)
                raise self.fail(f"value {name!r} dim {i}: the importer inferred {dim_str(g)}, the ONNX model "
                                f"declares {dim_str(want) if not isinstance(want, int) else want}"
                                + (" (a dynamic axis where the graph's arithmetic gives a fixed size: the "
                                   "file's declared shape is wrong)" if fixed else ""),
                                fix=f"clear {name!r}'s declared shape in the file (its graph output or value_info "
                                    "entry: ONNX Runtime passes over it with a warning, graphmode checks it against "
                                    "its own), or re-export with dynamic axes only where sizes vary" if fixed
                                else "name the model's dims with the recipe's dims in inputs[].shape, or re-export "
                                     "with dynamic axes on every dynamic input dim")

    def _advisory(self, want: Dim, got: Dim) -> bool:
        """Whether a declared dim with Min / Max / floor / Mod that differs from the importer's may be
        passed over: dynamo writes the length of pos[:seq] over a 32-row table as Min(32, seq), which
        is the importer's seq wherever the model runs (seq <= 32: the IR's slice assumes it, and the
        index analysis bounds seq by it). It is advisory where the two agree at some dim values of
        the ranges; where they agree at none the importer and the model disagree, which is refused.
        The declared expression never replaces the importer's type."""
        if isinstance(want, int) or not want.has(sympy.Min, sympy.Max, sympy.floor, sympy.ceiling, sympy.Mod):
            return False
        if (want, got) not in self.advised:
            self.advised[want, got] = agrees_somewhere(want, got, self.g.dims)
        return self.advised[want, got]


_TORCH_SIZE_FUNCS = {
    "Min": sympy.Min, "Max": sympy.Max, "Mod": sympy.Mod, "PythonMod": sympy.Mod, "floor": sympy.floor,
    "ceiling": sympy.ceiling, "Abs": sympy.Abs, "FloorDiv": lambda a, b: sympy.floor(a / b),
    "CeilDiv": lambda a, b: sympy.ceiling(a / b), "IntTrueDiv": lambda a, b: a / b,
    "FloatTrueDiv": lambda a, b: a / b, "ToFloat": lambda a: a, "FloorToInt": sympy.floor,
    "CeilToInt": sympy.ceiling, "TruncToInt": sympy.floor,    # sizes are not negative: trunc is floor
}
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# what a size expression is written with: names, numbers, + - * / // %, parentheses and commas
# (the text is the file's, and is evaluated: no attribute, subscript, string, power or long text)
_SIZE_TEXT = re.compile(r"[A-Za-z0-9_+\-*/%(), ]{1,200}")


def declared_expr(text: str, dimmap: dict) -> Dim | None:
    """A value_info dim_param written as an expression over the model's dim names (torch.export's
    size expressions as dynamo writes them: Min, Max, Mod, //, FloorDiv, CeilToInt(IntTrueDiv(..)))
    with each name replaced by the importer's dim for it; None where it names another (unk__N) or
    does not parse: such a declaration says nothing the importer can check."""
    if not _SIZE_TEXT.fullmatch(text) or "**" in text or "__" in text:
        return None
    names = [t for t in dict.fromkeys(_NAME.findall(text)) if t not in _TORCH_SIZE_FUNCS]
    if not names or any(t not in dimmap for t in names):
        return None
    local = {t: sympy.Symbol(f"_d{i}", integer=True, positive=True) for i, t in enumerate(names)}
    try:
        e = sympy.parse_expr(text, local_dict={**local, **_TORCH_SIZE_FUNCS})
        e = sympy.sympify(e).xreplace({local[t]: sympy.sympify(dimmap[t]) for t in names})
        return normalize_dim(e)
    except Exception:  # noqa: BLE001 - SyntaxError, TypeError, IRError...: not a size expression
        return None


SAMPLES = 512       # grid points agrees_somewhere evaluates at most


def _sample_values(lo: int, hi: int, n: int) -> list[int]:
    """The smallest and largest values of [lo, hi] and points spread between (powers of two and
    their neighbours: where Min / Max / floor change winner for tables and strides)."""
    pts = set(range(lo, min(hi, lo + 8) + 1)) | {hi, max(lo, hi - 1)}
    k = 1
    while k <= hi:
        pts |= {v for v in (k - 1, k, k + 1) if lo <= v <= hi}
        k *= 2
    pts |= {lo + (hi - lo) * i // 8 for i in range(9)}
    ordered = sorted(pts)
    if len(ordered) <= n:
        return ordered
    return sorted({ordered[i * (len(ordered) - 1) // (n - 1)] for i in range(n)})   # both ends kept


def agrees_somewhere(a: Dim, b: Dim, ranges: dict) -> bool:
    """Whether dims `a` and `b` are equal at some point of `ranges` (sampled: the value of every
    symbol at the ends of its range and spread inside it); symbols without a range take 1..4096."""
    diff = sympy.sympify(a) - sympy.sympify(b)
    syms = sorted(diff.free_symbols, key=lambda x: x.name)
    if not syms:
        return diff == 0
    per = max(2, int(SAMPLES ** (1 / len(syms))))
    spans = [_sample_values(*ranges.get(x.name, (1, 4096)), per) for x in syms]
    for pt in itertools.islice(itertools.product(*spans), SAMPLES):
        v = diff.xreplace(dict(zip(syms, map(sympy.Integer, pt))))
        if v == 0 or (not v.is_Number and sympy.simplify(v) == 0):
            return True
    return False


def data_length_error(imp, what: str, size: Dim):
    """The refusal of an op the importer needs a known extent for, over a data-dependent length."""
    return imp.fail(f"{what} over a length only the data decides ({dim_str(size)}: what a NonZero, Compress or "
                    "Unique kept) is not imported yet", fix="apply it before the selection (on the whole tensor, "
                    "then select), or run the model with exe_mode: eager (ONNX Runtime)")


def _data_sized(d: Dim) -> bool:
    """A dim only the data decides (capture/tail.py's data_u<k>)."""
    from graphmode.capture.tail import is_data_dim
    return not isinstance(d, int) and any(is_data_dim(x.name) for x in d.free_symbols)
