"""Generated copy kernels for the ops that assemble or pick whole elements (NATIVE
lowerings): pad (constant), concat, stack, repeat, gather, index_select.

Like movement.py's copies, each is bytes behind ATen's dispatch and view handling, so a
fixed loop nest with every shape baked in replaces it; results are ATen's bit for bit.
Index values are read at run time: one out of range (ATen raises) makes its output element
or row zeros instead of reading outside the tensor, and the bound step raises. What a
lowering does not cover (another dtype in the output, negative pads, a non-constant
value) is refused, so the reference op runs it.
"""
from __future__ import annotations

import math
from typing import Any, Mapping

import torch

from graphmode.backends.cpu.abi import KernelSource, status_export
from graphmode.backends.cpu.attrs import int_attr
from graphmode.backends.cpu.cexpr import STYPE, lit
from graphmode.backends.cpu.lowering import NATIVE, Claim, OpCall, claimed, lowers, refused
from graphmode.backends.cpu.movement import COPY_PAR_ELEMS, ELEM_TYPES, copy_body
from graphmode.backends.cpu.native import finish, lin, loop_nest
from graphmode.backends.cpu.omp_loops import omp_for
from graphmode.backends.cpu.tensors import dtype_of, overlaps, row_major_strides, shape_text
from graphmode.ir.ops.aten_meta import overload


def aten_args(call: OpCall) -> dict[str, Any] | None:
    """The arguments of an ATen-reference op's call by schema name (defaults filled in;
    tensor inputs stay `{"$in": i}`), or None when they do not bind to its schema."""
    try:
        schema = overload(call.op, call.attrs.get("overload", "default"))._schema
    except (AttributeError, RuntimeError):
        return None
    args, kwargs = list(call.attrs.get("args", [])), dict(call.attrs.get("kwargs", {}))
    out: dict[str, Any] = {}
    positional = [a for a in schema.arguments if not a.kwarg_only]
    if len(args) > len(positional):
        return None
    for i, a in enumerate(schema.arguments):
        if not a.kwarg_only and i < len(args):
            out[a.name] = args[i]
        elif a.name in kwargs:
            out[a.name] = kwargs.pop(a.name)
        elif a.has_default_value():
            out[a.name] = a.default_value
        else:
            return None
    return None if kwargs else out


def is_input(v: Any, i: int) -> bool:
    return isinstance(v, Mapping) and v.get("$in") == i


def _same_dtype_copy(call: OpCall) -> Claim | None:
    """Why a byte copy from every input into the output cannot run `call`, or None."""
    y = call.outs[0]
    if any(x.dtype != y.dtype for x in call.ins) or y.element_size() not in ELEM_TYPES:
        return refused(f"{call.op} into {y.dtype} from {[str(x.dtype) for x in call.ins]}", value=str(y.dtype))
    if overlaps(call.ins, call.outs):
        return refused("the output shares memory with an input")
    return None


# ------------------------------------------------------------------------ concat / stack

def _rows(call: OpCall, outer: int, widths: list[int], pattern: str, sources: list[int] | None = None) -> Claim:
    """Each of `outer` output rows is the pieces' rows side by side (piece k is a row of
    `widths[k]` elements of input `sources[k]`, by default input k): concat along a dim,
    stack along a new one."""
    why = _same_dtype_copy(call)
    if why is not None:
        return why
    if outer * sum(widths) != call.outs[0].numel():
        return refused(f"the output is not the {call.op} of the inputs", value=tuple(call.outs[0].shape))

    src = sources if sources is not None else list(range(len(widths)))

    def make() -> KernelSource:
        item, total, n = call.outs[0].element_size(), sum(widths), len(call.ins)
        lines = [f"  const char* __restrict s{k} = (const char*)p{k};" for k in range(n)]
        lines.append(f"  char* __restrict dst = (char*)p{n};")
        body, off = [], 0
        for k, w in zip(src, widths):
            if w:
                body.append(f"__builtin_memcpy(dst + (o * {total}L + {off}L) * {item}L, s{k} + o * {w * item}L, "
                            f"{w * item});")
            off += w
        par = call.outs[0].numel() >= COPY_PAR_ELEMS and outer > 1
        if not body:            # every piece empty: nothing to copy (the declarations keep the pointers used)
            return finish(call.op, call, lines + ["  (void)dst;"] + [f"  (void)s{k};" for k in range(n)],
                          pattern=pattern)
        lines += loop_nest([("o", outer, 1)], body, par=par)
        return finish(call.op, call, lines, parallel=par, pattern=pattern)
    return claimed(make)


@lowers("concat", tier=NATIVE)
def concat(call: OpCall) -> Claim:
    y, r = call.outs[0], call.outs[0].dim()
    dim = int_attr(call.attrs.get("dim"))
    if dim is None or r == 0 or not -r <= dim < r or any(x.dim() != r for x in call.ins):
        return refused("dim is not a dim of every input (or an input has another rank)", value=call.attrs.get("dim"))
    dim = dim + r if dim < 0 else dim
    for x in call.ins:
        if any(int(x.shape[j]) != int(y.shape[j]) for j in range(r) if j != dim):
            return refused("an input's shape differs from the output's off the concat dim", value=tuple(x.shape))
    inner = math.prod(int(d) for d in y.shape[dim + 1:])
    return _rows(call, math.prod(int(d) for d in y.shape[:dim]), [int(x.shape[dim]) * inner for x in call.ins],
                 f"concat {'+'.join(shape_text(x) for x in call.ins)} dim{dim}")


@lowers("stack", tier=NATIVE)
def stack(call: OpCall) -> Claim:
    a = aten_args(call)
    tensors = a.get("tensors") if a is not None else None
    if not isinstance(tensors, list) or not tensors or \
            not all(isinstance(v, Mapping) and v.get("$in") in range(len(call.ins)) for v in tensors):
        return refused("the stacked tensors are not the op's inputs", value=call.attrs.get("args"))
    sources = [v["$in"] for v in tensors]
    n = len(sources)
    x0, y = call.ins[0], call.outs[0]
    dim = int_attr(a["dim"])
    r = x0.dim() + 1
    if dim is None or not -r <= dim < r or any(x.shape != x0.shape for x in call.ins):
        return refused("dim is out of range or the inputs differ in shape", value=a["dim"])
    dim = dim + r if dim < 0 else dim
    if [int(d) for d in y.shape] != [int(d) for d in x0.shape[:dim]] + [n] + [int(d) for d in x0.shape[dim:]]:
        return refused("the output shape is not the stack's", value=tuple(y.shape))
    inner = math.prod(int(d) for d in x0.shape[dim:])
    return _rows(call, math.prod(int(d) for d in x0.shape[:dim]), [inner] * n,
                 f"stack {n}x{shape_text(x0)} dim{dim}", sources)


# ------------------------------------------------------------------------------ repeat / pad

@lowers("repeat", tier=NATIVE)
def repeat(call: OpCall) -> Claim:
    """x tiled `repeats` times: output dim j (size r_j * s_j) as the pair (copy, position),
    a strided view of x with stride 0 over the copies, copied as movement.py copies views."""
    a = aten_args(call)
    reps = a.get("repeats") if a is not None else None
    if not isinstance(reps, (list, tuple)) or not is_input(a.get("self"), 0) or len(call.ins) != 1 \
            or any(int_attr(v) is None or int_attr(v) < 0 for v in reps):
        return refused("repeats is not a list of non-negative ints", value=reps)
    x, y = call.ins[0], call.outs[0]
    if len(reps) < x.dim():
        return refused("fewer repeats than input dims", value=reps)
    xshape = [1] * (len(reps) - x.dim()) + [int(d) for d in x.shape]
    if [int(d) for d in y.shape] != [r * s for r, s in zip(reps, xshape)]:
        return refused("the output shape is not the repeat's", value=tuple(y.shape))
    why = _same_dtype_copy(call)
    if why is not None:
        return why
    xs = row_major_strides(xshape)
    shape = [d for pair in zip(reps, xshape) for d in pair]
    strides = [s for st in xs for s in (0, st)]

    def make() -> KernelSource:
        body, par = copy_body(shape, strides, 0, x.element_size())
        return finish("repeat", call, body, parallel=par, pattern=f"repeat {shape_text(x)} {list(reps)}")
    return claimed(make)


@lowers("pad", tier=NATIVE)
def pad(call: OpCall) -> Claim:
    """Constant padding with non-negative amounts: the output filled with the value, then
    the input copied into its interior row by row (negative amounts crop: the reference op)."""
    x, y = call.ins[0], call.outs[0]
    pads, r = call.attrs.get("pads"), x.dim()
    if not isinstance(pads, (list, tuple)) or len(pads) % 2 or len(pads) // 2 > r \
            or any(int_attr(p) is None or int_attr(p) < 0 for p in pads):
        return refused("pads are not non-negative (before, after) int pairs over the input's dims", value=pads)
    dt = dtype_of(y)
    value = call.attrs.get("value", 0.0)
    if dt not in STYPE or dt == "bool" or x.dtype != y.dtype:
        return refused(f"pad of {dt}", value=dt)
    if not isinstance(value, (int, float)) or math.isnan(value) or \
            (dt not in ("f32", "f64") and (math.isinf(value) or value != int(value))):
        return refused(f"a pad value of {value!r} in {dt}", value=value)
    before = [0] * r
    for i in range(len(pads) // 2):
        before[r - 1 - i] = pads[2 * i]
    want = list(int(d) for d in x.shape)
    for i in range(len(pads) // 2):
        want[r - 1 - i] += pads[2 * i] + pads[2 * i + 1]
    if [int(d) for d in y.shape] != want or overlaps(call.ins, call.outs):
        return refused("the output is not the pad's (or shares memory with the input)", value=tuple(y.shape))

    def make() -> KernelSource:
        ct = STYPE[dt]
        par = y.numel() >= COPY_PAR_ELEMS
        lines = [f"  const {ct}* __restrict src = (const {ct}*)p0;", f"  {ct}* __restrict dst = ({ct}*)p1;",
                 "  " + omp_for(y.numel(), y.numel(), simd=True) if par else "  #pragma omp simd",
                 f"  for (long i = 0; i < {y.numel()}L; ++i) dst[i] = ({ct}){lit(value, dt if dt in ('f32', 'f64') else 'i64')};"]
        if x.numel():
            ost = row_major_strides(y.shape)
            names = [f"i{k}" for k in range(r - 1)]
            run = int(x.shape[-1])
            src = lin(names, row_major_strides(x.shape)[:-1])
            dst = lin(names, ost[:-1], sum(b * s for b, s in zip(before, ost)))
            body = [f"__builtin_memcpy(dst + {dst}, src + {src}, {run * y.element_size()});"]
            lines += loop_nest([(v, int(n), 1) for v, n in zip(names, x.shape[:-1])], body, par=par and r > 1)
        return finish("pad", call, lines, parallel=par, pattern=f"pad {shape_text(x)} {list(pads)}")
    return claimed(make)


# ------------------------------------------------------------------------ gather / index_select

def _index_dim(call: OpCall) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor] | Claim:
    x, idx, y = call.ins[0], call.ins[1], call.outs[0]
    r = x.dim()
    dim = int_attr(call.attrs.get("dim"))
    if dim is None or r == 0 or not -r <= dim < r:
        return refused("dim is not a dim of the input", value=call.attrs.get("dim"))
    why = _same_dtype_copy(type(call)(call.op, [x], call.outs, call.attrs, call.env))
    if why is not None or overlaps([idx], call.outs):
        return why or refused("the output shares memory with the index")
    return (dim + r if dim < 0 else dim), x, idx, y


@lowers("gather", tier=NATIVE)
def gather(call: OpCall) -> Claim:
    """out[..., i_d, ...] = x[..., index[..., i_d, ...], ...] element by element."""
    got = _index_dim(call)
    if isinstance(got, Claim):
        return got
    dim, x, idx, y = got
    if idx.dtype != torch.int64 or idx.dim() != x.dim() or y.shape != idx.shape or \
            any(int(idx.shape[j]) > int(x.shape[j]) for j in range(x.dim()) if j != dim):
        return refused("the index is not an int64 tensor of the input's rank within its shape", value=tuple(idx.shape))

    def make() -> KernelSource:
        et, size = ELEM_TYPES[x.element_size()], int(x.shape[dim])
        if y.numel() == 0:
            return finish("gather", call, ["  (void)p0;"])
        names = [f"i{k}" for k in range(x.dim())]
        xs = row_major_strides(x.shape)
        src = lin([n for j, n in enumerate(names) if j != dim], [s for j, s in enumerate(xs) if j != dim])
        pos = lin(names, row_major_strides(idx.shape))
        lines = [f"  const {et}* __restrict src = (const {et}*)p0;", "  const int64_t* __restrict ix = (const int64_t*)p1;",
                 f"  {et}* __restrict dst = ({et}*)p2;"]
        body = [f"const long v = (long)ix[{pos}];",
                f"if (v >= 0 && v < {size}L) dst[{pos}] = src[{src} + v * {xs[dim]}L];",
                f"else {{ dst[{pos}] = 0; __atomic_fetch_add(&@SYM@_bad, 1L, __ATOMIC_RELAXED); }}"]
        par = y.numel() >= COPY_PAR_ELEMS
        lines += loop_nest([(v, int(n), 1) for v, n in zip(names, idx.shape)], body, par=par)
        return finish("gather", call, lines, pre=status_export("@SYM@_bad"), parallel=par,
                      status=f"index out of range: dim {dim} takes 0 to {size - 1}",
                      pattern=f"gather {shape_text(x)} dim{dim} {shape_text(idx)}")
    return claimed(make)


@lowers("index_select", tier=NATIVE)
def index_select(call: OpCall) -> Claim:
    """Whole rows (everything after `dim`) picked by a 1-d index, one memcpy each."""
    got = _index_dim(call)
    if isinstance(got, Claim):
        return got
    dim, x, idx, y = got
    n = idx.numel()
    if idx.dtype not in (torch.int64, torch.int32) or idx.dim() > 1:
        return refused("the index is not a 1-d int64 or int32 tensor", value=(str(idx.dtype), tuple(idx.shape)))
    if [int(d) for d in y.shape] != [int(d) if j != dim else n for j, d in enumerate(x.shape)]:
        return refused("the output shape is not the index_select's", value=tuple(y.shape))

    def make() -> KernelSource:
        item, size = x.element_size(), int(x.shape[dim])
        pre, post = math.prod(int(d) for d in x.shape[:dim]), math.prod(int(d) for d in x.shape[dim + 1:])
        if y.numel() == 0:
            return finish("index_select", call, ["  (void)p0;"])
        ct = STYPE[dtype_of(idx)]
        lines = ["  const char* __restrict src = (const char*)p0;", f"  const {ct}* __restrict ix = (const {ct}*)p1;",
                 "  char* __restrict dst = (char*)p2;"]
        body = ["const long v = (long)ix[b];", f"char* d = dst + (p * {n}L + b) * {post * item}L;",
                f"if (v >= 0 && v < {size}L) __builtin_memcpy(d, src + (p * {size}L + v) * {post * item}L, {post * item});",
                f"else {{ __builtin_memset(d, 0, {post * item}); __atomic_fetch_add(&@SYM@_bad, 1L, __ATOMIC_RELAXED); }}"]
        par = y.numel() >= COPY_PAR_ELEMS and pre * n > 1
        lines += loop_nest([("p", pre, 1), ("b", n, 1)], body, par=par)
        return finish("index_select", call, lines, pre=status_export("@SYM@_bad"), parallel=par,
                      status=f"index out of range: dim {dim} takes 0 to {size - 1}",
                      pattern=f"index_select {shape_text(x)} dim{dim} [{n}]")
    return claimed(make)


__all__ = ["aten_args", "is_input", "concat", "stack", "repeat", "pad", "gather", "index_select"]
