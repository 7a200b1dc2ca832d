"""ATen calls on IR types: the call an ATen-reference op's attributes describe (`call`, run on
real or meta tensors), and the output types torch's meta kernels give it: at static shapes, and
over symbolic dims where they are exact (a write keeps self's shape, a resampling to a fixed size
or by an exact scale, sizes that follow an input dim)."""
from __future__ import annotations

import functools
from typing import Any, Mapping, Sequence

import sympy
import torch
import torch.utils._pytree as pytree

from graphmode.errors import IRError
from graphmode.ir.types import DTYPES, TORCH_TO_DTYPE, TensorType, exact_scale, normalize_dim


@functools.lru_cache(maxsize=None)
def overload(op: str, name: str):
    """torch.ops.aten.<op>.<name>."""
    return getattr(getattr(torch.ops.aten, op), name)


def _materialise(arg: Any, ins: Sequence[Any]) -> Any:
    if isinstance(arg, dict):
        if "$in" in arg:
            return ins[arg["$in"]]
        if "$dtype" in arg:
            return DTYPES[arg["$dtype"]]
        if "$device" in arg:
            return torch.device(arg["$device"])
        if "$dim" in arg:
            raise IRError("an ATen-reference op got a symbolic size argument", fix="static sizes only")
        return {k: _materialise(v, ins) for k, v in arg.items()}
    if isinstance(arg, list):
        return [_materialise(a, ins) for a in arg]
    return arg


def arguments(ins: Sequence[Any], attrs: Mapping[str, Any]) -> tuple[list, dict]:
    """The positional and keyword arguments the attributes describe, on `ins`."""
    return _materialise(list(attrs.get("args", [])), ins), _materialise(dict(attrs.get("kwargs", {})), ins)


def call(op: str, ins: Sequence[Any], attrs: Mapping[str, Any]) -> list:
    """The ATen call the attributes describe, on `ins` (tensors, real or meta); its tensor outputs."""
    args, kwargs = arguments(ins, attrs)
    out = overload(op, attrs.get("overload", "default"))(*args, **kwargs)
    return [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]


def meta(t: TensorType, shape: Sequence[int]) -> torch.Tensor:
    return torch.empty(tuple(shape), dtype=DTYPES[t.dtype], device="meta")


# ops whose meta kernel sizes some outputs otherwise than the CPU kernel and torch.export's fake
# tensors do (embedding_bag's offset2bag and max_indices in sum/mean mode): typed on fake CPU tensors
_FAKE_TYPED = frozenset({"embedding_bag"})


def _on_fake_cpu(op: str, metas: list[torch.Tensor], attrs: Mapping[str, Any]) -> list[torch.Tensor]:
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        return call(op, [torch.empty(m.shape, dtype=m.dtype) for m in metas], attrs)


def meta_types(op: str, metas: list[torch.Tensor], attrs: Mapping[str, Any]) -> list[TensorType]:
    try:
        outs = _on_fake_cpu(op, metas, attrs) if op in _FAKE_TYPED else call(op, metas, attrs)
    except IRError:
        raise
    except Exception as e:  # noqa: BLE001 - torch's own refusal of these arguments, or no meta kernel
        raise IRError(f"{op}: torch cannot derive the output types of {attrs}: {type(e).__name__}: "
                      f"{str(e).splitlines()[0] if str(e) else ''}", fix="keep the op as an eager island") from None
    bad = [o.dtype for o in outs if o.dtype not in TORCH_TO_DTYPE]
    if bad:
        raise IRError(f"{op} makes a {bad[0]} tensor, which graphmode has no dtype for")
    return [TensorType(TORCH_TO_DTYPE[o.dtype], tuple(int(s) for s in o.shape)) for o in outs]


# writes into a copy of `self` (args[0] is input 0): the output has self's shape at every size
WRITES = frozenset({"scatter", "scatter_add", "scatter_reduce", "index_copy", "index_add", "index_fill",
                    "index_reduce", "select_scatter", "slice_scatter", "diagonal_scatter", "masked_scatter",
                    "index_put", "put"})


def written_type(op: str, ins: list[TensorType], attrs: Mapping[str, Any]) -> TensorType | None:
    """The type of a write op over symbolic dims: self's shape, and the dtype the op gives at one
    size of each dim (the call is checked there; other sizes are ATen's to check at run time).
    None for other ops."""
    if op not in WRITES or not ins or list(attrs.get("args", []))[:1] != [{"$in": 0}]:
        return None
    syms = sorted({s for t in ins for d in t.shape if not isinstance(d, int) for s in sympy.sympify(d).free_symbols},
                  key=str)
    at = {s: 5 + 2 * k for k, s in enumerate(syms)}
    sizes = [[d if isinstance(d, int) else int(sympy.sympify(d).subs(at)) for d in t.shape] for t in ins]
    if any(v < 0 for shape in sizes for v in shape):
        return None
    out = meta_types(op, [meta(t, shape) for t, shape in zip(ins, sizes)], attrs)
    return ins[0].with_dtype(out[0].dtype) if len(out) == 1 and list(out[0].shape) == sizes[0] else None


# sizes each symbol takes at the points `_followed` derives types at: three distinct primes per
# symbol, large enough for an op's own size checks (topk's k, a kernel size) and apart per symbol
_POINTS = ((61, 67, 71, 73, 79, 83), (89, 97, 101, 103, 107, 109), (113, 127, 131, 137, 139, 149))


def followed_types(op: str, ins: list[TensorType], attrs: Mapping[str, Any]) -> list[TensorType] | None:
    """The output types over symbolic dims of an op whose every output size is a constant or one
    of its inputs' sizes (sort, topk, median along a dim, cummax, glu of a static axis, ...):
    torch's own types at three sizes of each symbol, each output size matched to the input dim
    it equals at all three. None where a size follows neither (a product, a window count): the
    capture then checks these types against torch.export's symbolic ones, so no match is guessed."""
    syms = sorted({s for t in ins for d in t.shape if not isinstance(d, int) for s in sympy.sympify(d).free_symbols},
                  key=str)
    if len(syms) > len(_POINTS[0]):
        return None
    points = [{sym: pt[k] for k, sym in enumerate(syms)} for pt in _POINTS]
    dims = {d for t in ins for d in t.shape if not isinstance(d, int)}

    def at(d, pt) -> int:
        return d if isinstance(d, int) else int(sympy.sympify(d).subs(pt))

    runs = []
    for pt in points:
        sizes = [[at(d, pt) for d in t.shape] for t in ins]
        if any(v < 0 for shape in sizes for v in shape):
            return None
        try:
            runs.append(meta_types(op, [meta(t, shape) for t, shape in zip(ins, sizes)], attrs))
        except IRError:
            return None
    out = []
    for j, first in enumerate(runs[0]):
        if any(len(r) != len(runs[0]) or r[j].dtype != first.dtype or len(r[j].shape) != len(first.shape)
               for r in runs):
            return None
        shape = []
        for k in range(len(first.shape)):
            got = [r[j].shape[k] for r in runs]
            if len(set(got)) == 1:
                shape.append(got[0])
                continue
            match = [d for d in sorted(dims, key=str) if [at(d, pt) for pt in points] == got]
            if not match:
                return None
            shape.append(match[0])
        out.append(first.with_shape(tuple(shape)))
    return out


def resampled_type(op: str, ins: list[TensorType], attrs: Mapping[str, Any]) -> TensorType | None:
    """The type of `F.interpolate` over symbolic spatial dims, where it is exact: to a fixed size,
    or by scale factors whose doubles are fractions of 16 at most, for which torch's
    floor(size * scale) in doubles is the exact floor (a 2x upsample: 2 * H). None otherwise."""
    args = list(attrs.get("args", []))
    if "upsample" not in op or attrs.get("overload") != "vec" or len(ins) != 1 or len(args) < 3 or attrs.get("kwargs"):
        return None
    x, (size, scales) = ins[0], (args[1], args[-1])
    k = x.rank - 2
    if isinstance(size, list) and len(size) == k and all(isinstance(v, int) for v in size):
        return x.with_shape(x.shape[:2] + tuple(size))
    if size is not None or not (isinstance(scales, list) and len(scales) == k):
        return None
    exact = [exact_scale(v) for v in scales]
    if None in exact:
        return None
    return x.with_shape(x.shape[:2] + tuple(normalize_dim(sympy.floor(sympy.sympify(d) * f))
                                            for d, f in zip(x.shape[2:], exact)))


def static_types(op: str, ins: list[TensorType], attrs: Mapping[str, Any]) -> list[TensorType]:
    """The output types of ATen op `op` on `ins`: torch's meta kernels at static shapes; over
    symbolic dims, a write's, a resampling's or sizes that follow input dims, else refused."""
    for t in ins:
        if not all(isinstance(d, int) for d in t.shape):
            resampled = resampled_type(op, ins, attrs) if "upsample" in op else written_type(op, ins, attrs)
            if resampled is not None:
                return [resampled]
            followed = followed_types(op, ins, attrs)
            if followed is not None:
                return followed
            raise IRError(f"{op} with a symbolic dim in input {t.text()}: its output types are derived "
                          "for static shapes only, or where each output size is a constant or an input's dim",
                          fix="make that dim static in the recipe (one value); a PyTorch model can instead keep "
                              "the op in eager under exe_mode: hybrid (an ONNX model has no eager module)")
    return meta_types(op, [meta(t, t.shape) for t in ins], attrs)
