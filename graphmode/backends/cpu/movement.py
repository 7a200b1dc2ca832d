"""Generated data-movement kernels (NATIVE lowerings): permute, slice, index, cast,
logical_and/or, arange.

Each is a microsecond or less of bytes behind several microseconds of ATen dispatch, view
construction and `copy_` (tens of them inside a plan run, with cold caches); a ctypes call
into a fixed loop nest costs well under one. Results are ATen's bit for bit. Index values
are read at run time: one out of range (ATen raises IndexError) makes its output block
zeros instead of reading outside the tensor, and the bound step raises.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from graphmode.backends.cpu.abi import KernelSource, status_export
from graphmode.backends.cpu.attrs import int_attr
from graphmode.backends.cpu.cexpr import INTS, STYPE, convert
from graphmode.backends.cpu.emit import PAR_THRESHOLD
from graphmode.backends.cpu.lowering import NATIVE, Claim, OpCall, claimed, lowers, refused
from graphmode.backends.cpu.native import finish, lin, loop_nest
from graphmode.backends.cpu.omp_loops import omp_for
from graphmode.backends.cpu.tensors import dtype_of, overlaps, row_major_strides, shape_text
from graphmode.ir.types import eval_dim, normalize_dim

ELEM_TYPES = {1: "int8_t", 2: "int16_t", 4: "int32_t", 8: "int64_t"}   # element moves by item size
TILE = 16          # transpose tile edge (elements): a 16x16 fp32 tile is 1 KiB of each side
# Copies run on all threads only from PAR_THRESHOLD elements, as fused elementwise nests do.
# Measured here (inputs just written by another op, quiet machine): a 196-393 KB head permute
# or qkv slice took 5-13 us on one thread and the same on two (ATen's two-thread copy_:
# 10-17 us), and every parallel region stalls for milliseconds when other processes hold
# the other core.
COPY_PAR_ELEMS = PAR_THRESHOLD


# ------------------------------------------------------------------------------ dense copies

def copy_body(shape: Sequence[int], strides: Sequence[int], base: int, item: int) -> tuple[list[str], bool]:
    """Copy the strided view (`shape`, element `strides`, element offset `base`) of `p0` into
    the contiguous `p1`. Unit dims are dropped and dims that stay adjacent in both are merged,
    so MiniLM's head permute [1,16,12,32] -> [1,12,16,32] becomes rows of 32 contiguous
    floats (one inlined memcpy each); a true transpose runs in TILE x TILE tiles so that both
    sides stay in cache lines."""
    dims: list[list[int]] = []
    for n, s in zip(shape, strides):
        n = int(n)
        if n == 1:
            continue
        if dims and dims[-1][1] == s * n:
            dims[-1] = [dims[-1][0] * n, s]
        else:
            dims.append([n, s])
    numel = math.prod(int(n) for n in shape)
    lines = ["  const char* __restrict src = (const char*)p0;", "  char* __restrict dst = (char*)p1;"]
    if numel == 0:
        return lines, False
    par = numel >= COPY_PAR_ELEMS
    ostr = row_major_strides([n for n, _ in dims])
    if not dims:
        return lines + [f"  __builtin_memcpy(dst, src + {base * item}L, {item});"], False
    et = ELEM_TYPES[item]
    if dims[-1][1] == 1:                    # contiguous rows
        run = dims[-1][0]
        outer = dims[:-1]
        names = [f"i{k}" for k in range(len(outer))]
        src_off = lin(names, [s for _, s in outer], base)
        dst_off = lin(names, ostr[:-1])
        body = [f"__builtin_memcpy(dst + ({dst_off}) * {item}L, src + ({src_off}) * {item}L, {run * item});"]
        loops = [(v, n, 1) for v, (n, _) in zip(names, outer)]
        par = par and bool(loops)
        if not loops:
            return lines + ["  " + body[0]], False
        return lines + loop_nest(loops, body, par=par), par
    unit = next((k for k, (_, s) in enumerate(dims) if s == 1), None)
    last = len(dims) - 1
    if unit is None:                        # a strided gather (slice with step > 1): element loop
        names = [f"i{k}" for k in range(len(dims))]
        src_off = lin(names, [s for _, s in dims], base)
        dst_off = lin(names, ostr)
        body = [f"(({et}*)dst)[{dst_off}] = ((const {et}*)src)[{src_off}];"]
        loops = [(v, n, 1) for v, (n, _) in zip(names, dims)]
        return lines + loop_nest(loops, body, par=par), par
    # transpose: tiles over (unit-stride input dim, last output dim)
    others = [k for k in range(len(dims)) if k not in (unit, last)]
    names = {k: f"i{k}" for k in others}
    nu, nl = dims[unit][0], dims[last][0]
    sl = dims[last][1]
    src_off = lin([names[k] for k in others], [dims[k][1] for k in others], base)
    dst_off = lin([names[k] for k in others], [ostr[k] for k in others])
    body = [f"const {et}* __restrict s = (const {et}*)src + {src_off};",
            f"{et}* __restrict d = ({et}*)dst + {dst_off};",
            f"const long ae = ta + {TILE}L < {nu}L ? ta + {TILE}L : {nu}L;",
            f"const long be = tb + {TILE}L < {nl}L ? tb + {TILE}L : {nl}L;",
            "for (long a = ta; a < ae; ++a)",
            f"  for (long b = tb; b < be; ++b) d[a * {ostr[unit]}L + b] = s[a + b * {sl}L];"]
    loops = [(names[k], dims[k][0], 1) for k in others] + [("ta", nu, TILE), ("tb", nl, TILE)]
    return lines + loop_nest(loops, body, par=par), par


def _copy(call: OpCall, shape: Sequence[int], strides: Sequence[int], base: int, pattern: str) -> Claim:
    """The claim of a copy of the strided view (`shape`, `strides`, `base`) of the input
    into the contiguous output."""
    x, y = call.ins[0], call.outs[0]
    item = x.element_size()
    if x.dtype != y.dtype or item not in ELEM_TYPES:
        return refused(f"{call.op} from {x.dtype} to {y.dtype}", value=str(y.dtype))
    if overlaps(call.ins, call.outs):
        return refused("the output shares memory with the input")
    if tuple(int(d) for d in y.shape) != tuple(int(d) for d in shape):
        return refused(f"the output shape is not the {call.op}'s", value=tuple(y.shape))

    def make() -> KernelSource:
        body, par = copy_body(shape, strides, base, item)
        return finish(call.op, call, body, parallel=par, pattern=pattern)
    return claimed(make)


@lowers("permute", tier=NATIVE)
def permute(call: OpCall) -> Claim:
    x = call.ins[0]
    r = x.dim()
    perm = call.attrs.get("perm")
    if not isinstance(perm, (list, tuple)) or len(perm) != r or any(int_attr(p) is None for p in perm):
        return refused("perm is not one int per dim", value=perm)
    perm = [p + r if p < 0 else p for p in perm]
    if sorted(perm) != list(range(r)):
        return refused("perm is not a permutation", value=perm)
    xs = row_major_strides(x.shape)
    return _copy(call, [int(x.shape[p]) for p in perm], [xs[p] for p in perm], 0,
                 f"permute {shape_text(x)} {list(perm)}")


@lowers("slice", tier=NATIVE)
def slice_(call: OpCall) -> Claim:
    x, a = call.ins[0], call.attrs
    r = x.dim()
    dim, start, step = int_attr(a.get("dim")), int_attr(a.get("start", 0)), int_attr(a.get("step", 1))
    if dim is None or start is None or step is None or step <= 0 or not -r <= dim < r:
        return refused("dim, start or step is not one ATen slices with", value=dict(a))
    dim = dim + r if dim < 0 else dim
    try:
        end = eval_dim(normalize_dim(a.get("end", 2 ** 62)), call.env)
    except Exception:  # noqa: BLE001 - an end we cannot evaluate here: ATen's step evaluates it
        return refused("the end does not evaluate at this bucket", value=a.get("end"))
    idx = range(*slice(start, end, step).indices(int(x.shape[dim])))
    shape = [int(d) for d in x.shape]
    shape[dim] = len(idx)
    xs = row_major_strides(x.shape)
    strides = list(xs)
    strides[dim] *= step
    base = idx.start * xs[dim] if len(idx) else 0
    return _copy(call, shape, strides, base, f"slice {shape_text(x)} dim{dim} [{idx.start}:{idx.stop}:{step}]")


@lowers("index", tier=NATIVE)
def index(call: OpCall) -> Claim:
    """x[..., i0, i1, ...] with integer index tensors on consecutive dims (torch puts the
    broadcast index shape in their place). An index out of range is never read: its block is
    zeroed, counted, and the bound step raises (as ATen raises IndexError)."""
    x, idx, y = call.ins[0], list(call.ins[1:]), call.outs[0]
    dims = call.attrs.get("dims")
    r = x.dim()
    if not isinstance(dims, (list, tuple)) or len(dims) != len(idx) or not idx or \
            any(int_attr(d) is None for d in dims):
        return refused("dims is not one int per index tensor", value=dims)
    dims = [d + r if d < 0 else d for d in dims]
    if dims != list(range(dims[0], dims[0] + len(dims))) or dims[-1] >= r or dims[0] < 0:
        return refused("the indexed dims are not consecutive dims of the input", value=dims)
    if x.dtype != y.dtype or x.element_size() not in ELEM_TYPES:
        return refused(f"index from {x.dtype} to {y.dtype}", value=str(y.dtype))
    if overlaps(call.ins, call.outs):
        return refused("the output shares memory with an input")
    if any(t.dtype not in (torch.int64, torch.int32) for t in idx):
        return refused("an index tensor is not int64 or int32")
    try:
        bshape = list(torch.broadcast_shapes(*(tuple(t.shape) for t in idx)))
    except RuntimeError:
        return refused("the index tensors do not broadcast together")
    pre_shape = [int(d) for d in x.shape[:dims[0]]]
    post_shape = [int(d) for d in x.shape[dims[-1] + 1:]]
    if [int(d) for d in y.shape] != pre_shape + bshape + post_shape:
        return refused("the output shape is not the index's", value=tuple(y.shape))
    return claimed(lambda: _index(call, dims, bshape, pre_shape, post_shape))


def _index(call: OpCall, dims: list[int], bshape: list[int], pre_shape: list[int], post_shape: list[int]
           ) -> KernelSource:
    x, idx, y = call.ins[0], list(call.ins[1:]), call.outs[0]
    item = x.element_size()
    xs = row_major_strides(x.shape)
    inner = math.prod(post_shape) * item
    npre, nb = math.prod(pre_shape), math.prod(bshape)
    if y.numel() == 0:
        return finish("index", call, ["  (void)p0;"])
    bst = row_major_strides(bshape)
    lines = ["  const char* __restrict src = (const char*)p0;",
             f"  char* __restrict dst = (char*)p{len(call.ins)};"]
    for k, t in enumerate(idx):
        ct = STYPE[dtype_of(t)]
        lines.append(f"  const {ct}* __restrict x{k} = (const {ct}*)p{k + 1};")
    body = ["long off = 0;", "bool ok = true;"]
    for k, t in enumerate(idx):
        # the index tensor's element for broadcast position b: its own (right-aligned) dims,
        # stride 0 where it broadcasts
        tshape = [1] * (len(bshape) - t.dim()) + [int(d) for d in t.shape]
        tst = row_major_strides(tshape)
        terms = []
        for j, (n, bs) in enumerate(zip(bshape, bst)):
            if tshape[j] == 1 or tst[j] == 0:
                continue
            coord = f"(b / {bs}L)" if bs != 1 else "b"
            coord = f"({coord} % {n}L)" if j > 0 else coord
            terms.append(f"{coord} * {tst[j]}L" if tst[j] != 1 else coord)
        pos = " + ".join(terms) or "0"
        size = int(x.shape[dims[k]])
        body += [f"long v{k} = (long)x{k}[{pos}];",
                 f"if (v{k} < 0) v{k} += {size}L;",
                 f"ok = ok && v{k} >= 0 && v{k} < {size}L;",
                 f"off += v{k} * {xs[dims[k]]}L;"]
    pre_stride = xs[dims[0]] * int(x.shape[dims[0]]) if dims[0] > 0 else 0
    body += [f"char* d = dst + (p * {nb}L + b) * {inner}L;",
             f"if (ok) __builtin_memcpy(d, src + (p * {pre_stride}L + off) * {item}L, {inner});",
             f"else {{ __builtin_memset(d, 0, {inner}); __atomic_fetch_add(&@SYM@_bad, 1L, __ATOMIC_RELAXED); }}"]
    par = y.numel() >= COPY_PAR_ELEMS and npre * nb > 1
    lines += loop_nest([("p", npre, 1), ("b", nb, 1)], body, par=par)
    return finish("index", call, lines, pre=status_export("@SYM@_bad"), parallel=par,
                  pattern=f"index {shape_text(x)} dims{dims} -> {shape_text(y)}",
                  status="index out of range: dims " + ", ".join(f"{d} take {-int(x.shape[d])} to {int(x.shape[d]) - 1}"
                                                                 for d in dims))


# ------------------------------------------------------------------------- small elementwise

@lowers("cast", tier=NATIVE)
def cast(call: OpCall) -> Claim:
    x, y = call.ins[0], call.outs[0]
    sd, dd = dtype_of(x), dtype_of(y)
    if call.attrs.get("dtype") != dd or x.shape != y.shape:
        return refused("the output is not the cast's", value=(dd, tuple(y.shape)))
    if overlaps(call.ins, call.outs):
        return refused("the output shares memory with the input")
    expr = convert(sd, dd, "x[i]")
    if expr is None:
        return refused(f"C's conversion from {sd} to {dd} is not torch's", value=(sd, dd))

    def make() -> KernelSource:
        n = x.numel()
        par = n >= PAR_THRESHOLD
        body = [f"  const {STYPE[sd]}* __restrict x = (const {STYPE[sd]}*)p0;",
                f"  {STYPE[dd]}* __restrict y = ({STYPE[dd]}*)p1;",
                "  " + omp_for(n, n, simd=True) if par else "  #pragma omp simd",
                f"  for (long i = 0; i < {n}L; ++i) y[i] = {expr};"]
        return finish("cast", call, body, parallel=par, pattern=f"cast {shape_text(x)} {sd}->{dd}")
    return claimed(make)


def _broadcast_loops(out_shape: Sequence[int], operands: Sequence[Sequence[int]]):
    """Loop dims (size, stride per operand) of a broadcast over a contiguous output: unit dims
    dropped, dims merged where every operand stays contiguous across them."""
    r = len(out_shape)
    per = []
    for shp in operands:
        shp = [1] * (r - len(shp)) + [int(d) for d in shp]
        st = row_major_strides(shp)
        per.append([0 if shp[j] == 1 else st[j] for j in range(r)])
    ost = row_major_strides(out_shape)
    dims: list[list] = []
    for j in range(r):
        n = int(out_shape[j])
        if n == 1:
            continue
        ss = [p[j] for p in per] + [ost[j]]
        if dims and all(a == b * n for a, b in zip(dims[-1][1], ss)):
            dims[-1] = [dims[-1][0] * n, ss]
        else:
            dims.append([n, ss])
    return dims


@lowers("logical_and", "logical_or", tier=NATIVE)
def logical(call: OpCall) -> Claim:
    a, b = call.ins
    y = call.outs[0]
    dts = [dtype_of(a), dtype_of(b)]
    if y.dtype != torch.bool or any(d not in STYPE for d in dts):
        return refused(f"{call.op} of {dts} into {y.dtype}", value=dts)
    if overlaps(call.ins, call.outs):
        return refused("the output shares memory with an input")
    try:
        same = list(torch.broadcast_shapes(a.shape, b.shape)) == list(y.shape)
    except RuntimeError:
        same = False
    if not same:
        return refused("the output shape is not the broadcast of the inputs", value=tuple(y.shape))

    def make() -> KernelSource:
        c = {"logical_and": "&", "logical_or": "|"}[call.op]
        dims = _broadcast_loops([int(d) for d in y.shape], [a.shape, b.shape])
        names = [f"i{k}" for k in range(len(dims))]
        ia = lin(names, [s[0] for _, s in dims])
        ib = lin(names, [s[1] for _, s in dims])
        iy = lin(names, [s[2] for _, s in dims])
        lines = [f"  const {STYPE[dts[0]]}* __restrict a = (const {STYPE[dts[0]]}*)p0;",
                 f"  const {STYPE[dts[1]]}* __restrict b = (const {STYPE[dts[1]]}*)p1;",
                 "  uint8_t* __restrict y = (uint8_t*)p2;"]
        body = [f"y[{iy}] = (uint8_t)((a[{ia}] != 0) {c} (b[{ib}] != 0));"]
        par = y.numel() >= PAR_THRESHOLD and len(dims) > 0
        lines += loop_nest([(v, n, 1) for v, (n, _) in zip(names, dims)], body, par=par)
        return finish(call.op, call, lines, parallel=par, pattern=f"{call.op} {shape_text(a)}, {shape_text(b)}")
    return claimed(make)


@lowers("arange", tier=NATIVE)
def arange(call: OpCall) -> Claim:
    """Integer dtypes only: a float arange rounds per ATen's vector code path."""
    y, a = call.outs[0], call.attrs
    dt = dtype_of(y)
    if dt not in INTS or y.dim() != 1 or call.ins:
        return refused(f"arange of {dt} (integers only)", value=dt)
    try:
        start = eval_dim(normalize_dim(a.get("start", 0)), call.env)
        end = eval_dim(normalize_dim(a["end"]), call.env)
    except Exception:  # noqa: BLE001 - ATen's step evaluates what we cannot
        return refused("start or end does not evaluate at this bucket", value=(a.get("start"), a.get("end")))
    step = int_attr(a.get("step", 1))
    if step is None or step == 0 or len(range(start, end, step)) != int(y.shape[0]):
        return refused("the step or the output length is not the arange's", value=step)

    def make() -> KernelSource:
        ct = STYPE[dt]
        body = [f"  {ct}* __restrict y = ({ct}*)p0;",
                "  #pragma omp simd",
                f"  for (long i = 0; i < {int(y.shape[0])}L; ++i) y[i] = ({ct})({start}L + i * {step}L);"]
        return finish("arange", call, body, pattern=f"arange {start}:{end}:{step} {dt}")
    return claimed(make)


__all__ = ["COPY_PAR_ELEMS", "ELEM_TYPES", "TILE", "copy_body", "arange", "cast", "index", "logical", "permute", "slice_"]
