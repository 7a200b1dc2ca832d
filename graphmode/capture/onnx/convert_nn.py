"""ONNX converters: MatMul/Gemm (as linear), convolutions (1-d and 2-d), pools."""
from __future__ import annotations

import math


import torch

from graphmode.ir.types import Dim, TensorType

from graphmode.capture.onnx.checks import MAX_DIM, MAX_WINDOW, CheckedNode, check_window, spatial_rank
from graphmode.capture.onnx.fold import _Known, _objarr
from graphmode.capture.onnx.convert_core import _empty_extreme
from graphmode.capture.onnx.importer import STATIC_AXIS_FIX, _Importer, _attr_dim, _handles, _shape_attr, _vname
from graphmode.capture.onnx.pooling import pool_by_windows


# ---- gemm / conv / pool


def _weight_t(imp: _Importer, name: str, transpose: bool, scale: float = 1.0) -> str:
    """A 2-d constant as a linear weight [out, in] (transposed copy cached per initializer)."""
    key = f"{name}|{transpose}|{scale}"
    if key in imp.transposed:
        return imp.transposed[key]
    tied = _tied_transpose(imp, name) if transpose and scale == 1.0 else None
    if tied is not None:
        v = imp.operand(tied)
    elif not transpose and scale == 1.0:
        v = imp.operand(name)
    else:
        w = imp.const_tensor(name)
        w = (w.t() if transpose else w).contiguous()
        if scale != 1.0:
            w = w * scale
        k = imp.kn(name)
        src = (k.source if k is not None else None) or name
        role = "param" if (name in imp.big and imp.big[name][1] == "param") or (k is not None and k.source) else "const"
        v = imp.g.add_constant(imp.g.fresh_name(_vname(src) + ("_t" if transpose else "") + ("_s" if scale != 1.0 else "")),
                               w, role=role)
    imp.transposed[key] = v
    return v


def _tied_transpose(imp: _Importer, name: str) -> str | None:
    """Another parameter initializer holding exactly `name`'s transpose (exporters constant-fold
    `wte.T` for a tied LM head): reuse it instead of materialising a transposed copy."""
    if name not in imp.big:
        return None
    t, _ = imp.big[name]
    if t.dim() != 2:
        return None
    want = (t.shape[1], t.shape[0])
    for other, (o, role) in imp.big.items():
        if other != name and role == "param" and tuple(o.shape) == want and o.dtype == t.dtype \
                and torch.equal(o[:1], t.t()[:1]) and torch.equal(o, t.t()):
            return other
    return None


def _bias_consumer(imp: _Importer, out: str, n_out: Dim) -> tuple[int, str] | None:
    """(node index, bias name) when `out`'s only consumer is `Add(out, 1-d constant [n_out])`."""
    users = imp.consumers.get(out, [])
    if len(users) != 1 or out in imp.graph_outputs:
        return None
    j = users[0]
    add = imp.gp.node[j]
    if add.op_type != "Add" or len(add.input) != 2 or list(add.input).count(out) != 1:
        return None
    if imp.excluded("Add", "add"):
        return None
    other = add.input[1] if add.input[0] == out else add.input[0]
    if not imp.has(other) or not imp.is_const(other):
        return None
    bt = imp.type_of(other)
    if bt.rank != 1 or not isinstance(n_out, int) or bt.shape[0] != n_out:
        return None
    return j, other


def _linear(imp: _Importer, n, x: str, w: str, bias: str | None, out: str) -> None:
    """linear(x, w[, bias]); a following `Add(out, bias)` is folded into the linear node."""
    wt = imp.g.type_of(w)
    if bias is None:
        hit = _bias_consumer(imp, out, wt.shape[0])
        if hit is not None:
            j, bname = hit
            b = imp.operand(bname)
            if imp.g.type_of(b).dtype == imp.g.type_of(x).dtype:
                imp.skip.add(j)
                imp.emit("linear", [x, w, b], {}, out=imp.gp.node[j].output[0])
                return
    imp.emit("linear", [x, w] + ([bias] if bias else []), {}, out=out)


def _inner_dims(imp: _Importer, k_a: Dim, k_b: Dim, a_n: str, b_n: str) -> None:
    """A product's inner dims where one is a size and the other a dim of the recipe's: ONNX Runtime
    runs it only at that size (a [None, None] input times a [4, 5] weight takes 4 columns), so
    the recipe must say so where it declares the input."""
    for d, size, of in ((k_a, k_b, b_n), (k_b, k_a, a_n)):
        if isinstance(size, int) and not isinstance(d, int):
            raise imp.static_dim_error(d, size, f"the inner dim of this product (set by {of!r})")


@_handles("MatMul")
def _matmul(imp: _Importer, n) -> None:
    a_n, b_n = n.input[0], n.input[1]
    at, bt = imp.type_of(a_n), imp.type_of(b_n)
    out = n.output[0]
    _inner_dims(imp, at.shape[-1], bt.shape[-2] if bt.rank >= 2 else bt.shape[0], a_n, b_n)
    if imp.is_const(b_n) and bt.rank == 2 and at.rank >= 2 and not imp.is_const(a_n):
        _linear(imp, n, imp.operand(a_n), _weight_t(imp, b_n, True), None, out)
        return
    a, b = imp.operand(a_n), imp.operand(b_n)
    if at.rank >= 2 and bt.rank >= 2:
        imp.emit("matmul", [a, b], {}, out=out)
        return
    # rank-1 operands: numpy semantics via reshapes
    a2 = imp.emit("reshape", [a], {"shape": [1, _attr_dim(at.shape[0])]}, hint=f"{out}_a") if at.rank == 1 else a
    b2 = imp.emit("reshape", [b], {"shape": [_attr_dim(bt.shape[0]), 1]}, hint=f"{out}_b") if bt.rank == 1 else b
    m = imp.emit("matmul", [a2, b2], {}, hint=f"{out}_mm")
    mt = imp.g.type_of(m)
    shape = list(mt.shape)
    if bt.rank == 1:
        shape.pop(-1)
    if at.rank == 1:
        shape.pop(-2 if bt.rank != 1 else -1)
    imp.emit("reshape", [m], {"shape": _shape_attr(shape)}, out=out)


def _check_gemm(nd: CheckedNode) -> None:
    for key in ("alpha", "beta"):
        v = nd.attrs.get(key)
        if v is not None and not math.isfinite(v):
            raise nd.fail(f"attribute {key}={v} is not finite", v, f"set {key} to a finite number (default 1.0)")
    a, b, c = nd.dims(0), nd.dims(1), nd.dims(2)
    if a is None or b is None or len(a) != 2 or len(b) != 2:
        return
    ta, tb = nd.attrs.get("transA", 0), nd.attrs.get("transB", 0)
    (m, ka), (kb, n) = (a[::-1] if ta else a), (b[::-1] if tb else b)
    if isinstance(ka, int) and isinstance(kb, int) and ka != kb:
        raise nd.fail(f"inputs A {nd.input(0)!r} {a} (transA={ta}) and B {nd.input(1)!r} {b} (transB={tb}) do not "
                      f"multiply: inner dims {ka} and {kb}", [a, b],
                      "fix transA/transB or the weight's layout (a torch Linear weight [out, in] needs transB=1)")
    if c is None:
        return
    want = [m, n]
    ok = len(c) <= 2 and all(cd == 1 or not isinstance(cd, int) or not isinstance(t, int) or cd == t
                             for cd, t in zip(c[::-1], want[::-1]))
    if not ok:
        raise nd.fail(f"input C {nd.input(2)!r} {c} does not broadcast to the product's shape {want}", c,
                      f"give C a shape that broadcasts to {want} (e.g. [{n}])")


@_handles("Gemm", check=_check_gemm)
def _gemm(imp: _Importer, n) -> None:
    a_n, b_n = n.input[0], n.input[1]
    c_n = imp.opt_in(n, 2)
    alpha, beta = float(imp.attr(n, "alpha", 1.0)), float(imp.attr(n, "beta", 1.0))
    ta, tb = bool(imp.attr(n, "transA", 0)), bool(imp.attr(n, "transB", 0))
    out = n.output[0]
    at, bt = imp.type_of(a_n), imp.type_of(b_n)
    _inner_dims(imp, at.shape[0 if ta else 1], bt.shape[1 if tb else 0], a_n, b_n)
    a = imp.operand(a_n)
    if ta:
        a = imp.emit("permute", [a], {"perm": [1, 0]}, hint=f"{out}_aT")
    bias = None
    c_done = c_n is None or beta == 0.0
    if c_n and not c_done and imp.is_const(c_n):
        ct = imp.type_of(c_n)
        if ct.rank <= 2 and (ct.rank <= 1 or ct.shape[0] == 1):          # a scalar, a row or one value per output
            cvec = imp.const_tensor(c_n).reshape(-1)
            if beta != 1.0:
                cvec = cvec * beta
            bt_ = imp.type_of(b_n)
            n_out = bt_.shape[0] if tb else bt_.shape[1]
            if isinstance(n_out, int) and cvec.numel() in (n_out, 1):
                if cvec.numel() == 1 and n_out != 1:
                    cvec = cvec.expand(n_out)
                k = imp.kn(c_n)
                src = k.source if k is not None and k.source and beta == 1.0 and ct.rank == 1 else None
                if src is not None:
                    bias = imp.operand(c_n)
                else:
                    bias = imp.g.add_constant(imp.g.fresh_name(_vname(c_n)), cvec.contiguous(), role="param")
                c_done = True
    if imp.is_const(b_n) and imp.type_of(b_n).rank == 2:
        w = _weight_t(imp, b_n, not tb, alpha)
        if c_done:
            imp.emit("linear", [a, w] + ([bias] if bias else []), {}, out=out)
            return
        y = imp.emit("linear", [a, w], {}, hint=f"{out}_mm")
    else:
        b = imp.operand(b_n)
        if tb:
            b = imp.emit("permute", [b], {"perm": [1, 0]}, hint=f"{out}_bT")
        y = imp.emit("matmul", [a, b], {}, hint=f"{out}_mm")
        if alpha != 1.0:
            y = imp.emit("mul", [y, imp.materialise(_Known(_objarr([alpha], ()), imp.g.type_of(y).dtype), "alpha")],
                         {}, hint=f"{out}_alpha")
        if c_done:
            if bias is not None:
                y = imp.emit("add", [y, bias], {}, out=out)
            else:
                imp.ir[out] = y
                imp.check_declared(out)
            return
    c = imp.operand(c_n)
    if beta != 1.0:
        c = imp.emit("mul", [c, imp.materialise(_Known(_objarr([beta], ()), imp.g.type_of(c).dtype), "beta")], {},
                     hint=f"{out}_beta")
    imp.emit("add", [y, c], {}, out=out)


def _pads(imp: _Importer, n, x_t: TensorType, kernel: list[int], strides: list[int], dil: list[int]) -> list[int]:
    """ONNX pads [x1_begin, x2_begin, ..., x1_end, x2_end] for the node's spatial dims."""
    rank = len(kernel)
    auto = imp.attr_text(n, "auto_pad", "NOTSET")
    if auto in ("NOTSET", ""):
        return list(imp.attr(n, "pads", [0] * (2 * rank)))
    if auto == "VALID":
        return [0] * (2 * rank)
    pads = [0] * (2 * rank)       # SAME_UPPER / SAME_LOWER: needs static spatial dims
    for i in range(rank):
        size = x_t.shape[2 + i]
        if not isinstance(size, int):
            raise imp.fail(f"auto_pad={auto} over a symbolic spatial dim", fix="export with explicit pads")
        out = -(-size // strides[i])
        total = max(0, (out - 1) * strides[i] + (kernel[i] - 1) * dil[i] + 1 - size)
        lo = total // 2 if auto == "SAME_UPPER" else total - total // 2
        pads[i], pads[i + rank] = lo, total - lo
    return pads


def _window(imp: _Importer, n, x: str, kernel: list[int], fill: float | None):
    """Lift a 1-d window op to 2-d (over a height of 1) and turn asymmetric padding into an
    explicit `pad` (with `fill`: 0 for conv, -inf for max pooling; None refuses it).
    Returns (x as 4-d, kernel, strides, dilations, symmetric pads, lifted)."""
    xt = imp.g.type_of(x)
    rank = xt.rank - 2
    if rank not in (1, 2):
        raise imp.fail(f"only 1-d and 2-d {n.op_type} are supported, input is {xt.text()}",
                       fix="reshape 3-d windows into 2-d in the model")
    strides = list(imp.attr(n, "strides", [1] * rank))
    dil = list(imp.attr(n, "dilations", [1] * rank))
    pads = _pads(imp, n, xt, kernel, strides, dil)
    if rank == 1:
        x = imp.emit("reshape", [x], {"shape": _shape_attr(list(xt.shape[:2]) + [1, xt.shape[2]])},
                     hint=f"{n.output[0]}_2d")
        kernel, strides, dil, pads = [1] + kernel, [1] + strides, [1] + dil, [0, pads[0], 0, pads[1]]
    if pads[0] != pads[2] or pads[1] != pads[3]:
        if fill is None:
            raise imp.fail(f"asymmetric padding {pads} is not supported here", fix="pad explicitly in the model")
        extra = [pads[1] - min(pads[1], pads[3]), pads[3] - min(pads[1], pads[3]),
                 pads[0] - min(pads[0], pads[2]), pads[2] - min(pads[0], pads[2])]
        x = imp.emit("pad", [x], {"pads": extra, "value": fill}, hint=f"{n.output[0]}_pad")
        pads = [min(pads[0], pads[2]), min(pads[1], pads[3])] * 2
    return x, kernel, strides, dil, pads[:2], rank == 1


def _emit_window(imp: _Importer, n, op: str, ins: list[str], attrs: dict, lifted: bool) -> None:
    """Emit the 2-d op into the node's output, or (lifted 1-d op) reshape its result back to 1-d."""
    if not lifted:
        imp.emit(op, ins, attrs, out=n.output[0])
        return
    y = imp.emit(op, ins, attrs, hint=n.output[0])
    t = imp.g.type_of(y)
    imp.emit("reshape", [y], {"shape": _shape_attr(list(t.shape[:2]) + [t.shape[3]])}, out=n.output[0])


def _check_conv(nd: CheckedNode) -> None:
    x, w = nd.dims(0), nd.dims(1)
    sp = spatial_rank(nd, x, w)
    if x is not None and w is not None and len(x) != len(w):
        raise nd.fail(f"weight {nd.input(1)!r} has rank {len(w)}, the input has rank {len(x)}", w,
                      "a Conv weight is [out_channels, in_channels / group, kernel...]")
    kernel = nd.ints("kernel_shape", sp, 1)
    wk = w[2:] if w is not None else None
    if kernel is not None and wk is not None and any(isinstance(a, int) and a != b for a, b in zip(wk, kernel)):
        raise nd.fail(f"attribute kernel_shape={kernel} does not match the weight {nd.input(1)!r} {w}", kernel,
                      f"drop kernel_shape (it follows from the weight) or set it to {wk}")
    if kernel is None and wk is not None and all(isinstance(k, int) for k in wk):
        kernel = list(wk)
        bad = [k for k in kernel if not 1 <= k <= MAX_WINDOW]
        if bad:
            raise nd.fail(f"weight {nd.input(1)!r} {w} has a kernel size {bad[0]} outside [1, {MAX_WINDOW}]", w,
                          "re-export the model with a valid weight")
    group = nd.attrs.get("group", 1)
    if not 1 <= group <= MAX_DIM:
        raise nd.fail(f"attribute group={group} must be >= 1", group, "use group=1 for a dense convolution")
    cin = x[1] if x is not None else None
    if w is not None and isinstance(w[0], int) and w[0] % group:
        raise nd.fail(f"attribute group={group} does not divide the weight's {w[0]} output channels "
                      f"(weight {nd.input(1)!r} {w})", group, "use a group that divides both channel counts")
    if isinstance(cin, int) and w is not None and isinstance(w[1], int) and w[1] * group != cin:
        raise nd.fail(f"attribute group={group}: the weight {nd.input(1)!r} {w} takes {w[1]} channel(s) per group, "
                      f"so the input needs {w[1] * group} channels, but it has {cin}", group,
                      f"set group to {cin // w[1] if w[1] and cin % w[1] == 0 else 'in_channels / weight.shape[1]'} "
                      "or re-export the model")
    b = nd.dims(2)
    if b is not None and w is not None and (len(b) != 1 or isinstance(b[0], int) and isinstance(w[0], int)
                                            and b[0] != w[0]):
        raise nd.fail(f"bias {nd.input(2)!r} has shape {b}, the weight has {w[0]} output channels", b,
                      f"give the bias shape [{w[0]}]")
    check_window(nd, sp, x, kernel, ceil=False)


@_handles("Conv", check=_check_conv)
def _conv(imp: _Importer, n) -> None:
    w = imp.operand(n.input[1])
    wt = imp.g.type_of(w)
    kernel = list(imp.attr(n, "kernel_shape", wt.shape[2:]))
    x, kernel, strides, dil, pads, lifted = _window(imp, n, imp.operand(n.input[0]), kernel, 0.0)
    if lifted:
        w = imp.emit("reshape", [w], {"shape": _shape_attr(list(wt.shape[:2]) + [1, wt.shape[2]])},
                     hint=f"{n.output[0]}_w2d")
    ins = [x, w] + ([imp.operand(n.input[2])] if imp.opt_in(n, 2) else [])
    attrs = {"stride": strides, "padding": pads, "dilation": dil, "groups": int(imp.attr(n, "group", 1))}
    _emit_window(imp, n, "conv2d", ins, attrs, lifted)


def _check_pool(nd: CheckedNode) -> None:
    x = nd.dims(0)
    sp = spatial_rank(nd, x)
    for f in ("ceil_mode", "count_include_pad", "storage_order"):
        nd.flag(f)
    kernel = nd.ints("kernel_shape", sp, 1)
    check_window(nd, sp, x, kernel, ceil=bool(nd.attrs.get("ceil_mode", 0)))


@_handles("MaxPool", "AveragePool", check=_check_pool)
def _pool(imp: _Importer, n) -> None:
    is_max = n.op_type == "MaxPool"
    count_pad = bool(imp.attr(n, "count_include_pad", 0))
    xt = imp.type_of(n.input[0])
    if is_max and len(n.output) > 1 and n.output[1] and (imp.consumers.get(n.output[1]) or
                                                          n.output[1] in {o.name for o in imp.gp.output}):
        _max_pool_with_indices(imp, n, xt)
        return
    rank, kernel = xt.rank - 2, list(imp.attr(n, "kernel_shape"))
    strides = list(imp.attr(n, "strides", [1] * rank))
    dil = list(imp.attr(n, "dilations", [1] * rank))
    pads = _pads(imp, n, xt, kernel, strides, dil)
    ceil = bool(imp.attr(n, "ceil_mode", 0))
    symmetric = pads[:rank] == pads[rank:]
    # torch's pools: 1-d/2-d, pads of at most half the window; asymmetric pads become an explicit
    # pad, exact unless ceil mode (its last-window rule would then see the pad as input) or an
    # average that must not count the padding; averages without dilation
    torch_ok = rank in (1, 2) and all(max(pads[i], pads[i + rank]) <= ((k - 1) * dil[i] + 1) // 2
                                      for i, k in enumerate(kernel)) and \
        (symmetric or (not ceil and (is_max or count_pad))) and (is_max or all(d == 1 for d in dil))
    if not torch_ok:
        y = pool_by_windows(imp, n, imp.operand(n.input[0]), "max" if is_max else "avg", kernel, strides, dil, pads,
                            ceil, count_pad)
        imp.ir[n.output[0]] = y
        imp.check_declared(n.output[0])
        return
    fill = _empty_extreme(xt.dtype, True) if is_max else 0.0
    x, kernel, strides, dil, pads, lifted = _window(imp, n, imp.operand(n.input[0]), kernel, fill)
    if is_max:
        _emit_window(imp, n, "max_pool2d", [x], {"kernel": kernel, "stride": strides, "padding": pads,
                                                 "dilation": dil, "ceil_mode": ceil}, lifted)
    else:
        _emit_window(imp, n, "avg_pool2d", [x], {"kernel": kernel, "stride": strides, "padding": pads,
                                                 "ceil_mode": ceil, "count_include_pad": count_pad}, lifted)


def _max_pool_with_indices(imp: _Importer, n, xt) -> None:
    """MaxPool's second output: each max's position in the whole input flattened (row-major, or
    column-major over H and W with storage_order=1): torch's per-plane index plus the plane's
    offset. 2-d windows with symmetric pads of at most half the window (torch's own pool)."""
    kernel = list(imp.attr(n, "kernel_shape"))
    strides, dil = list(imp.attr(n, "strides", [1] * len(kernel))), list(imp.attr(n, "dilations", [1] * len(kernel)))
    pads = _pads(imp, n, xt, kernel, strides, dil)
    plane = [d for d in xt.shape[1:]]
    if len(kernel) != 2 or pads[:2] != pads[2:] or any(p > ((k - 1) * d + 1) // 2 for p, k, d in
                                                       zip(pads, kernel, dil)) or not all(isinstance(d, int)
                                                                                          for d in plane):
        raise imp.fail("MaxPool's indices output is supported for 2-d windows with symmetric pads of at most half "
                       "the window over static channels, height and width", value=xt.text(),
                       fix="use only the pooled values, or re-export with such a window")
    c, h, w = plane
    vals, idx = imp.emit_aten("max_pool2d_with_indices", [imp.operand(n.input[0])],
                              [{"$in": 0}, kernel, strides, pads[:2], dil, bool(imp.attr(n, "ceil_mode", 0))],
                              hint=n.output[0])
    y = n.output[1]
    if imp.attr(n, "storage_order", 0):           # (row, col) -> col * H + row
        col = imp.emit("remainder", [idx, imp.scalar(w, "i64", f"{y}_w")], {}, hint=f"{y}_col")
        rows = imp.emit("cast", [imp.emit("sub", [idx, col], {}, hint=f"{y}_rows")], {"dtype": "f64"}, hint=f"{y}_rows")
        row = imp.emit("cast", [imp.emit("div", [rows, imp.scalar(float(w), "f64", f"{y}_wf")], {}, hint=f"{y}_row")],
                       {"dtype": "i64"}, hint=f"{y}_row")     # (idx - col) / W is exact in f64
        idx = imp.emit("add", [imp.emit("mul", [col, imp.scalar(h, "i64", f"{y}_h")], {}, hint=f"{y}_cols"), row],
                       {}, hint=f"{y}_cm")
    planes = imp.emit("arange", [], {"start": 0, "end": c, "step": 1, "dtype": "i64"}, hint=f"{y}_c")
    planes = imp.emit("mul", [imp.emit("reshape", [planes], {"shape": [1, c, 1, 1]}, hint=f"{y}_c"),
                              imp.scalar(h * w, "i64", f"{y}_hw")], {}, hint=f"{y}_coff")
    batch = imp.emit("arange", [], {"start": 0, "end": _shape_attr([xt.shape[0]])[0], "step": 1, "dtype": "i64"},
                     hint=f"{y}_n")
    batch = imp.emit("mul", [imp.emit("reshape", [batch], {"shape": _shape_attr([xt.shape[0], 1, 1, 1])},
                                      hint=f"{y}_n"), imp.scalar(c * h * w, "i64", f"{y}_chw")], {}, hint=f"{y}_noff")
    idx = imp.emit("add", [idx, imp.emit("add", [batch, planes], {}, hint=f"{y}_off")], {}, hint=y)
    for out, v in ((n.output[0], vals), (y, idx)):
        imp.ir[out] = v
        imp.check_declared(out)


@_handles("GlobalAveragePool", "GlobalMaxPool")
def _global_pool(imp: _Importer, n) -> None:
    x = imp.operand(n.input[0])
    xt = imp.g.type_of(x)
    if n.op_type == "GlobalAveragePool" and xt.rank == 4:
        imp.emit("adaptive_avg_pool2d", [x], {"output_size": [1, 1]}, out=n.output[0])
    else:
        imp.emit("mean" if n.op_type == "GlobalAveragePool" else "amax", [x],
                 {"dims": list(range(2, xt.rank)), "keepdim": True}, out=n.output[0])


def _conv_transpose3d(imp: _Importer, n, ins: list[str], strides, dil, out_pad, pads, groups: int) -> None:
    """conv_transpose3d (an ATen-reference op): symmetric pads only."""
    if pads[:3] != pads[3:] or any(p < 0 for p in pads) or \
            any(o >= max(s, d) for o, s, d in zip(out_pad, strides, dil)):
        raise imp.fail(f"3-d ConvTranspose with pads {pads} and output_padding {out_pad}: only symmetric pads "
                       "(and output_padding below the stride or dilation) are supported", value=pads)
    args = [{"$in": 0}, {"$in": 1}, {"$in": 2} if len(ins) > 2 else None, strides, pads[:3], out_pad, groups, dil]
    y = imp.emit_aten("conv_transpose3d", ins, args, overload="input", hint=n.output[0])[0]
    imp.ir[n.output[0]] = y
    imp.check_declared(n.output[0])


@_handles("ConvTranspose")
def _conv_transpose(imp: _Importer, n) -> None:
    """conv_transpose2d (1-d lifted to a height of 1; 3-d: `_conv_transpose3d`). ONNX's pads, output_padding, output_shape
    and auto_pad come down to a crop (or zero extension) per side of the unpadded result, which
    a symmetric case folds into conv_transpose2d's own padding."""
    x, w = imp.operand(n.input[0]), imp.operand(n.input[1])
    xt, wt = imp.g.type_of(x), imp.g.type_of(w)
    rank = xt.rank - 2
    if rank not in (1, 2, 3) or wt.rank != xt.rank:
        raise imp.fail(f"only 1-d, 2-d and 3-d ConvTranspose are supported, input is {xt.text()}")
    sizes = list(xt.shape[2:])
    kernel = list(imp.attr(n, "kernel_shape", wt.shape[2:]))
    strides = list(imp.attr(n, "strides", [1] * rank))
    dil = list(imp.attr(n, "dilations", [1] * rank))
    out_pad = list(imp.attr(n, "output_padding", [0] * rank))
    out_shape = imp.attr(n, "output_shape", None)
    auto = imp.attr_text(n, "auto_pad", "NOTSET")
    full = [(sizes[i] - 1) * strides[i] + dil[i] * (kernel[i] - 1) + 1 for i in range(rank)]
    if out_shape is not None or auto in ("SAME_UPPER", "SAME_LOWER"):
        if not all(isinstance(s, int) for s in sizes):
            raise imp.fail("ConvTranspose output_shape / auto_pad over symbolic spatial dims")
        target = list(out_shape)[-rank:] if out_shape is not None else [sizes[i] * strides[i] for i in range(rank)]
        total = [full[i] + out_pad[i] - target[i] for i in range(rank)]
        if auto == "SAME_UPPER":
            begin = [t // 2 for t in total]
        else:
            begin = [t - t // 2 for t in total]
        pads = begin + [total[i] - begin[i] for i in range(rank)]
    elif auto == "VALID":
        pads = [0] * (2 * rank)
    else:
        pads = list(imp.attr(n, "pads", [0] * (2 * rank)))
    groups = int(imp.attr(n, "group", 1))
    bias = imp.operand(n.input[2]) if imp.opt_in(n, 2) else None
    if rank == 3:
        _conv_transpose3d(imp, n, [x, w] + ([bias] if bias else []), strides, dil, out_pad, pads, groups)
        return
    if rank == 1:
        x = imp.emit("reshape", [x], {"shape": _shape_attr(list(xt.shape[:2]) + [1, xt.shape[2]])},
                     hint=f"{n.output[0]}_2d")
        w = imp.emit("reshape", [w], {"shape": _shape_attr(list(wt.shape[:2]) + [1, wt.shape[2]])},
                     hint=f"{n.output[0]}_w2d")
        strides, dil, out_pad, pads = [1] + strides, [1] + dil, [0] + out_pad, [0, pads[0], 0, pads[1]]
    symmetric = pads[0] == pads[2] and pads[1] == pads[3] and all(p >= 0 for p in pads) and \
        all(o < max(s, d) for o, s, d in zip(out_pad, strides, dil))
    attrs = {"stride": strides, "dilation": dil, "groups": groups}
    if symmetric:
        y = imp.emit("conv_transpose2d", [x, w] + ([bias] if bias else []),
                     dict(attrs, padding=pads[:2], output_padding=out_pad), hint=n.output[0])
    else:
        y = imp.emit("conv_transpose2d", [x, w], dict(attrs, padding=[0, 0], output_padding=[0, 0]),
                     hint=n.output[0])
        # crop pads[begin] and pads[end] - output_padding per side (a negative crop extends with zeros)
        crop = [-pads[1], out_pad[1] - pads[3], -pads[0], out_pad[0] - pads[2]]
        y = imp.emit("pad", [y], {"pads": crop, "value": 0.0}, hint=n.output[0])
        if bias:
            c = imp.g.type_of(y).shape[1]
            b = imp.emit("reshape", [bias], {"shape": _shape_attr([1, c, 1, 1])}, hint=f"{n.output[0]}_bias")
            y = imp.emit("add", [y, b], {}, hint=n.output[0])
    if rank == 1:
        t = imp.g.type_of(y)
        imp.emit("reshape", [y], {"shape": _shape_attr(list(t.shape[:2]) + [t.shape[3]])}, out=n.output[0])
    else:
        imp.ir[n.output[0]] = y
        imp.check_declared(n.output[0])


_GRID_MODES = {"bilinear": "bilinear", "linear": "bilinear", "nearest": "nearest", "bicubic": "bicubic",
               "cubic": "bicubic"}


@_handles("GridSample")
def _grid_sample(imp: _Importer, n) -> None:
    mode = imp.attr_text(n, "mode", "linear")
    pad = imp.attr_text(n, "padding_mode", "zeros")
    xt = imp.type_of(n.input[0])
    if mode not in _GRID_MODES or pad not in ("zeros", "border", "reflection"):
        raise imp.fail(f"GridSample mode {mode!r} padding_mode {pad!r}")
    if xt.rank not in (4, 5) or (xt.rank == 5 and _GRID_MODES[mode] == "bicubic"):
        raise imp.fail(f"GridSample {mode} over {xt.text()}: 2-d, or 3-d without cubic, is supported")
    imp.emit("grid_sampler", [imp.operand(n.input[0]), imp.operand(n.input[1])],
             {"mode": _GRID_MODES[mode], "padding_mode": pad, "align_corners": bool(imp.attr(n, "align_corners", 0))},
             out=n.output[0])


@_handles("Col2Im")
def _col2im(imp: _Importer, n) -> None:
    """Sliding blocks summed back into an image: col2im (an ATen-reference op), 2-d images with
    symmetric pads (the ones ATen's col2im takes)."""
    x = imp.operand(n.input[0])
    image = imp.ints_of(n.input[1], "Col2Im image_shape")
    block = imp.ints_of(n.input[2], "Col2Im block_shape")
    if len(image) != 2 or len(block) != 2:
        raise imp.fail(f"Col2Im of a {len(image)}-d image: only 2-d images are supported", value=image)
    dil = list(imp.attr(n, "dilations", [1, 1]))
    strides = list(imp.attr(n, "strides", [1, 1]))
    pads = list(imp.attr(n, "pads", [0, 0, 0, 0]))
    if pads[:2] != pads[2:]:
        raise imp.fail(f"Col2Im pads {pads}: only symmetric pads are supported", value=pads)
    y = imp.emit_aten("col2im", [x], [{"$in": 0}, image, block, dil, pads[:2], strides], hint=n.output[0])[0]
    imp.ir[n.output[0]] = y
    imp.check_declared(n.output[0])


@_handles("MaxUnpool")
def _max_unpool(imp: _Importer, n) -> None:
    """max_unpool2d (an ATen-reference op). ONNX's indices count over the whole (N, C, H, W)
    default-sized output, ATen's over one (H, W) plane: the remainder by the plane's size. A larger
    output_shape keeps each value where the default size puts it, zeros after (as onnx's reference)."""
    x = imp.operand(n.input[0])
    xt = imp.g.type_of(x)
    if xt.rank != 4:
        raise imp.fail(f"MaxUnpool of {xt.text()}: only 2-d (N, C, H, W) inputs are supported")
    kernel = list(imp.attr(n, "kernel_shape"))
    strides = list(imp.attr(n, "strides", [1, 1]))
    pads = list(imp.attr(n, "pads", [0, 0, 0, 0]))
    sizes = list(xt.shape)
    if not all(isinstance(d, int) for d in sizes):
        raise imp.fail(f"MaxUnpool of {xt.text()}: symbolic dims", fix=STATIC_AXIS_FIX)
    size = [(sizes[2 + i] - 1) * strides[i] - pads[i] - pads[i + 2] + kernel[i] for i in range(2)]
    extra = [0, 0]
    if imp.opt_in(n, 2):
        shape = imp.ints_of(n.input[2], "MaxUnpool output_shape")
        extra = [shape[2 + i] - size[i] for i in range(2)]
        if shape[:2] != sizes[:2] or min(extra) < 0:
            raise imp.fail(f"MaxUnpool output_shape {shape} is smaller than the default {sizes[:2] + size}",
                           value=shape)
    idx = imp.operand(n.input[1])
    plane = imp.scalar(size[0] * size[1], imp.g.type_of(idx).dtype, f"{n.output[0]}_plane")
    idx = imp.emit("remainder", [idx, plane], {}, hint=f"{n.output[0]}_idx")
    y = imp.emit_aten("max_unpool2d", [x, idx], [{"$in": 0}, {"$in": 1}, size], hint=n.output[0])[0]
    if any(extra):
        y = imp.emit("pad", [y], {"pads": [0, extra[1], 0, extra[0]], "value": 0.0}, hint=n.output[0])
    imp.ir[n.output[0]] = y
    imp.check_declared(n.output[0])
