"""ATen converters of the network ops: reductions and normalisations, GEMM / conv /
attention, and pools."""
from __future__ import annotations

import operator

from graphmode.capture.aten.emit import aten_reference, axis, emit_checked, emit_on_rank1, repeat_heads
from graphmode.capture.aten.registry import converts
from graphmode.ir.graph import clean_name
from graphmode.ir.ops import OPS, pair
from graphmode.ir.types import TORCH_TO_DTYPE


# ---------------------------------------------------------------------------------- reductions

def _operand_as(imp, a) -> str | None:
    """`self`, cast to the call's `dtype` argument where it has one (sum/mean/cumsum(x, dtype=d)
    compute on x.to(d), as eager does); None for a dtype graphmode has not."""
    x = imp.operand(a["self"])
    dt = a.get("dtype")
    if dt is None:
        return x
    if dt not in TORCH_TO_DTYPE:
        return None
    x, = imp.g.add_node("cast", [x], [imp.g.type_of(x).with_dtype(TORCH_TO_DTYPE[dt])], {"dtype": TORCH_TO_DTYPE[dt]})
    return x


@converts("aten.mean.dim", "aten.sum.dim_IntList", "aten.amax.default", "aten.amin.default")
def _reduce(imp, node, a):
    op = str(node.target).split(".")[1]
    x = _operand_as(imp, a)
    if x is None:
        return False
    rank = imp.g.type_of(x).rank
    if rank == 0:
        emit_on_rank1(imp, node, op, x, {"dims": [0], "keepdim": True})
        return True
    dims = a["dim"]
    dims = [axis(d, rank) for d in (dims if isinstance(dims, (list, tuple)) else [dims])] if dims not in (None, [], ()) \
        else list(range(rank))        # dim=None or [] reduces every axis (torch semantics)
    imp.emit(node, op, [x], {"dims": dims, "keepdim": bool(a["keepdim"])})
    return True


@converts("aten.sum.default", "aten.mean.default")
def _reduce_all(imp, node, a):
    x = _operand_as(imp, a)
    if x is None:
        return False
    if imp.g.type_of(x).rank == 0:
        emit_on_rank1(imp, node, str(node.target).split(".")[1], x, {"dims": [0], "keepdim": True})
        return True
    imp.emit(node, str(node.target).split(".")[1], [x], {"dims": list(range(imp.g.type_of(x).rank)),
                                                         "keepdim": False})
    return True


@converts("aten.argmax.default", "aten.argmin.default")
def _arg(imp, node, a):
    x = imp.operand(a["self"])
    op = str(node.target).split(".")[1]
    if a["dim"] is None:            # over the flattened tensor (keepdim: a shape of ones)
        xt = imp.g.type_of(x)
        flat, = imp.g.add_node("reshape", [x], [xt.with_shape((xt.numel(),))], {"shape": [-1]})
        out_t = imp.ttype(node.meta["val"])
        y, = imp.g.add_node(op, [flat], [out_t.with_shape(())], {"dim": 0, "keepdim": False})
        imp.emit(node, "reshape", [y], {"shape": [1] * out_t.rank})
        return True
    if imp.g.type_of(x).rank == 0:
        emit_on_rank1(imp, node, op, x, {"dim": 0, "keepdim": True})
        return True
    imp.emit(node, op, [x], {"dim": axis(a["dim"], imp.g.type_of(x).rank), "keepdim": bool(a["keepdim"])})
    return True


@converts("aten.softmax.int", "aten._softmax.default", "aten.log_softmax.int", "aten._log_softmax.default")
def _softmax(imp, node, a):
    op = "log_softmax" if "log_softmax" in str(node.target) else "softmax"
    x = imp.operand(a["self"])
    if a.get("half_to_float"):
        return False
    if a.get("dtype") is not None and TORCH_TO_DTYPE.get(a["dtype"]) != imp.g.type_of(x).dtype:
        if a["dtype"] not in TORCH_TO_DTYPE:
            return False
        x, = imp.g.add_node("cast", [x], [imp.g.type_of(x).with_dtype(TORCH_TO_DTYPE[a["dtype"]])],
                            {"dtype": TORCH_TO_DTYPE[a["dtype"]]})     # softmax(x, dtype=d) = softmax(x.to(d))
    rank = imp.g.type_of(x).rank
    if rank == 0:
        emit_on_rank1(imp, node, op, x, {"dim": 0})
    else:
        imp.emit(node, op, [x], {"dim": axis(a["dim"], rank)})
    return True


@converts("aten._safe_softmax.default")
def _safe_softmax(imp, node, a):
    """softmax, except that a row with every entry -inf gives zeros (not NaN): where(amax == -inf, 0, softmax)."""
    x = imp.operand(a["self"])
    xt = imp.g.type_of(x)
    if a.get("dtype") is not None and TORCH_TO_DTYPE.get(a["dtype"]) != xt.dtype or xt.rank == 0:
        return False
    dim = axis(a["dim"], xt.rank)
    row = xt.with_shape(tuple(1 if i == dim else d for i, d in enumerate(xt.shape)))
    top, = imp.g.add_node("amax", [x], [row], {"dims": [dim], "keepdim": True})
    masked, = imp.g.add_node("eq", [top, imp.const(float("-inf"), xt.dtype)], [row.with_dtype("bool")])
    sm, = imp.g.add_node("softmax", [x], [xt], {"dim": dim})
    imp.emit(node, "where", [masked, imp.const(0.0, xt.dtype), sm])
    return True


@converts("aten.cumsum.default")
def _cumsum(imp, node, a):
    x = _operand_as(imp, a)
    if x is None:
        return False
    xt = imp.g.type_of(x)
    if xt.rank == 0:
        emit_on_rank1(imp, node, "cumsum", x, {"dim": 0})
        return True
    attrs = {"dim": axis(a["dim"], xt.rank)}
    acc, = OPS["cumsum"].infer([xt], attrs)
    if a.get("dtype") is None or acc.dtype == xt.dtype:
        imp.emit(node, "cumsum", [x], attrs)
    else:       # cumsum(x, dtype=int32): the IR's op accumulates in i64, the same bits modulo 2**32
        s, = imp.g.add_node("cumsum", [x], [acc], attrs)
        imp.emit(node, "cast", [s], {"dtype": xt.dtype})
    return True


@converts("aten.layer_norm.default")
def _layer_norm(imp, node, a):
    ins = [imp.operand(a["input"])] + [imp.operand(t) for t in (a["weight"], a["bias"]) if t is not None]
    if a["weight"] is None and a["bias"] is not None:
        return False
    imp.emit(node, "layer_norm", ins, {"normalized_rank": len(a["normalized_shape"]), "eps": float(a["eps"])})
    return True


def _reads_statistics(node) -> bool:
    """A norm whose mean/rstd outputs (1 and 2) are read: the IR's norm makes the normalised
    output only, so the op is left to torch's decomposition (graphmode/capture/decompose.py)."""
    return any(u.target is operator.getitem and u.args[1] != 0 for u in node.users)


@converts("aten.native_layer_norm.default")
def _native_layer_norm(imp, node, a):
    if a["weight"] is None and a["bias"] is not None or _reads_statistics(node):
        return False
    ins = [imp.operand(a["input"])] + [imp.operand(t) for t in (a["weight"], a["bias"]) if t is not None]
    out, = imp.g.add_node("layer_norm", ins, [imp.ttype(node.meta["val"][0])],
                          {"normalized_rank": len(a["normalized_shape"]), "eps": float(a["eps"])},
                          names=[clean_name(node.name)])
    imp.env[node] = (out, None, None)
    return True


@converts("aten.batch_norm.default", "aten._native_batch_norm_legit_no_training.default")
def _batch_norm(imp, node, a):
    if a.get("training") or _reads_statistics(node):
        return False
    ins = [imp.operand(a[k]) for k in ("input", "weight", "bias", "running_mean", "running_var")]
    val = node.meta["val"]
    out, = imp.g.add_node("batch_norm", ins, [imp.ttype(val[0] if isinstance(val, (tuple, list)) else val)],
                          {"eps": float(a["eps"])}, names=[clean_name(node.name)])
    imp.env[node] = (out, None, None) if isinstance(val, (tuple, list)) else out
    return True


# ---------------------------------------------------------------------------------- GEMM / conv / attention

@converts("aten.linear.default")
def _linear(imp, node, a):
    ins = [imp.operand(a["input"]), imp.operand(a["weight"])] + ([imp.operand(a["bias"])] if a["bias"] is not None
                                                                 else [])
    imp.emit(node, "linear", ins)
    return True


@converts("aten.matmul.default")
def _matmul(imp, node, a):
    """torch.matmul: a 1-d operand is a row (left) or a column (right) vector whose unit axis
    is dropped from the result; rank >= 2 operands are the IR's batched matmul."""
    x, y = imp.operand(a["self"]), imp.operand(a["other"])
    xt, yt = imp.g.type_of(x), imp.g.type_of(y)
    if xt.rank == 0 or yt.rank == 0:
        return False
    if xt.rank == 1:
        x, = imp.g.add_node("reshape", [x], [xt.with_shape((1, xt.shape[0]))], {"shape": [1, imp.attr_dim(xt.shape[0])]})
    if yt.rank == 1:
        y, = imp.g.add_node("reshape", [y], [yt.with_shape((yt.shape[0], 1))], {"shape": [imp.attr_dim(yt.shape[0]), 1]})
    if xt.rank > 1 and yt.rank > 1:
        imp.emit(node, "matmul", [x, y])
        return True
    out_t, = OPS["matmul"].infer([imp.g.type_of(x), imp.g.type_of(y)], {})
    z, = imp.g.add_node("matmul", [x, y], [out_t])
    imp.emit(node, "reshape", [z], {"shape": [imp.attr_dim(d) for d in node.meta["val"].shape]})
    return True


@converts("aten.addmm.default")
def _addmm(imp, node, a):
    if a["beta"] != 1 or a["alpha"] != 1:
        return _scaled_addmm(imp, node, a)
    w = imp.operand(a["mat2"])
    wt = imp.g.type_of(w)
    w_t, = imp.g.add_node("permute", [w], [wt.with_shape((wt.shape[1], wt.shape[0]))], {"perm": [1, 0]})
    imp.emit(node, "linear", [imp.operand(a["mat1"]), w_t, imp.operand(a["self"])])
    return True


@converts("aten.baddbmm.default")
def _baddbmm(imp, node, a):
    """beta * self + alpha * (batch1 @ batch2): known ops, so padding a batch axis is analysed
    (an aten reference op is opaque to it: nn.MultiheadAttention's weights were refused)."""
    if not all(imp.g.type_of(imp.operand(a[k])).dtype in ("f32", "f16", "bf16", "f64") for k in ("batch1", "batch2")):
        return False
    return _scaled_addmm(imp, node, {"self": a["self"], "mat1": a["batch1"], "mat2": a["batch2"],
                                     "beta": a["beta"], "alpha": a["alpha"]})


def _scaled_addmm(imp, node, a) -> bool:
    """beta * self + alpha * (mat1 @ mat2); beta 0 ignores self (its NaN and inf too), as torch does."""
    m1, m2 = imp.operand(a["mat1"]), imp.operand(a["mat2"])
    mm, = imp.g.add_node("matmul", [m1, m2], OPS["matmul"].infer([imp.g.type_of(m1), imp.g.type_of(m2)], {}))
    if a["beta"] == 0:
        return emit_checked(imp, node, "mul", [mm, imp.const(a["alpha"])])
    if a["alpha"] != 1:
        mm, = imp.g.add_node("mul", [mm, imp.const(a["alpha"])], [imp.g.type_of(mm)])
    x = imp.operand(a["self"])
    if a["beta"] != 1:
        x, = imp.g.add_node("mul", [x, imp.const(a["beta"])], [imp.g.type_of(x)])
    return emit_checked(imp, node, "add", [x, mm])


def _conv(imp, node, a, spatial: int) -> bool:
    """conv1d/conv2d (`a`: the schema-normalised args of any conv overload) with int or
    'same'/'valid' padding -> conv2d (1-d over a height of 1), asymmetric 'same' padding as
    an explicit pad."""
    x, w = imp.operand(a["input"]), imp.operand(a["weight"])
    b = imp.operand(a["bias"]) if a["bias"] is not None else None
    stride, padding, dilation, groups = a["stride"], a["padding"], a["dilation"], a["groups"]
    xt, wt = imp.g.type_of(x), imp.g.type_of(w)
    if xt.rank != spatial + 2 or wt.rank != spatial + 2:
        return False
    stride, dilation = pair(stride, spatial), pair(dilation, spatial)
    k = [wt.shape[2 + i] for i in range(spatial)]
    if not all(isinstance(v, int) for v in k):
        return False
    pre = None
    if isinstance(padding, str):
        if padding == "valid":
            padding = [0] * spatial
        elif padding == "same":
            if any(s != 1 for s in stride):
                return False
            total = [d * (kk - 1) for d, kk in zip(dilation, k)]
            lo = [t // 2 for t in total]
            if any(t - l != l for t, l in zip(total, lo)):       # asymmetric: pad explicitly first
                pre = [v for i in reversed(range(spatial)) for v in (lo[i], total[i] - lo[i])]
                padding = [0] * spatial
            else:
                padding = lo
        else:
            return False
    padding = pair(padding, spatial)
    if pre is not None:
        shape = list(xt.shape)
        for i in range(spatial):
            shape[2 + i] = shape[2 + i] + pre[2 * (spatial - 1 - i)] + pre[2 * (spatial - 1 - i) + 1]
        x, = imp.g.add_node("pad", [x], [xt.with_shape(shape)], {"pads": pre, "value": 0.0})
        xt = imp.g.type_of(x)
    if spatial == 1:      # [N, C, L] -> [N, C, 1, L]; weight [O, C/g, K] -> [O, C/g, 1, K]
        x, = imp.g.add_node("reshape", [x], [xt.with_shape(xt.shape[:2] + (1,) + xt.shape[2:])],
                            {"shape": [imp.attr_dim(d) for d in xt.shape[:2]] + [1, imp.attr_dim(xt.shape[2])]})
        w, = imp.g.add_node("reshape", [w], [wt.with_shape(wt.shape[:2] + (1,) + wt.shape[2:])],
                            {"shape": list(wt.shape[:2]) + [1, wt.shape[2]]})
        stride, padding, dilation = [1] + stride, [0] + padding, [1] + dilation
    ins = [x, w] + ([b] if b is not None else [])
    attrs = {"stride": list(stride), "padding": list(padding), "dilation": list(dilation), "groups": int(groups)}
    if spatial == 1:
        out_t = imp.ttype(node.meta["val"])
        y, = imp.g.add_node("conv2d", ins, [out_t.with_shape(out_t.shape[:2] + (1,) + out_t.shape[2:])], attrs)
        imp.emit(node, "reshape", [y], {"shape": [imp.attr_dim(d) for d in out_t.shape]})
    else:
        imp.emit(node, "conv2d", ins, attrs)
    return True


@converts("aten.conv2d.default", "aten.conv2d.padding", "aten.conv1d.default", "aten.conv1d.padding")
def _conv_nd(imp, node, a):
    return _conv(imp, node, a, 1 if "conv1d" in str(node.target) else 2)


@converts("aten.convolution.default")
def _convolution(imp, node, a):
    if a["transposed"]:
        return False
    spatial = len(a["stride"])
    if spatial not in (1, 2):
        return False
    return _conv(imp, node, a, spatial)


@converts("aten.scaled_dot_product_attention.default")
def _sdpa(imp, node, a):
    if a["dropout_p"]:
        return False
    q, k, v = imp.operand(a["query"]), imp.operand(a["key"]), imp.operand(a["value"])
    if a.get("enable_gqa"):
        k, v = (repeat_heads(imp, t, imp.g.type_of(q)) for t in (k, v))
        if k is None or v is None:
            return False
    ins = [q, k, v] + ([imp.operand(a["attn_mask"])] if a["attn_mask"] is not None else [])
    attrs = {"is_causal": bool(a["is_causal"])}
    if a["scale"] is not None:
        attrs["scale"] = float(a["scale"])
    imp.emit(node, "sdpa", ins, attrs)
    return True


# ---------------------------------------------------------------------------------- pools

def _pooled(imp, op: str, x: str, attrs: dict) -> str:
    """A 2-d window op over `x`; an unbatched [C, H, W] input runs on its [1, C, H, W] view."""
    xt = imp.g.type_of(x)
    if xt.rank == 4:
        return imp.g.add_node(op, [x], [OPS[op].infer([xt], attrs)[0]], attrs)[0]
    x4, = imp.g.add_node("reshape", [x], [xt.with_shape((1,) + xt.shape)], {"shape": [1] + [imp.attr_dim(d) for d in
                                                                                           xt.shape]})
    out_t = OPS[op].infer([imp.g.type_of(x4)], attrs)[0]
    y4, = imp.g.add_node(op, [x4], [out_t], attrs)
    return imp.g.add_node("reshape", [y4], [out_t.with_shape(out_t.shape[1:])],
                          {"shape": [imp.attr_dim(d) for d in out_t.shape[1:]]})[0]


def _unbatched(imp, node, op: str, x: str, attrs: dict) -> None:
    imp.env[node] = _pooled(imp, op, x, attrs)


@converts("aten.max_pool2d.default", "aten.max_pool2d_with_indices.default")
def _max_pool(imp, node, a):
    val = node.meta["val"]
    if isinstance(val, (tuple, list)) and any(u.target is operator.getitem and u.args[1] == 1 for u in node.users):
        return aten_reference(imp, node, "max_pool2d_with_indices")     # the indices are used
    k = pair(a["kernel_size"])
    attrs = {"kernel": k, "stride": pair(a["stride"]) if a["stride"] else k, "padding": pair(a["padding"]),
             "dilation": pair(a["dilation"]), "ceil_mode": bool(a["ceil_mode"])}
    x = imp.operand(a["self"])
    if imp.g.type_of(x).rank == 3 and not isinstance(val, (tuple, list)):
        _unbatched(imp, node, "max_pool2d", x, attrs)
        return True
    if imp.g.type_of(x).rank != 4:
        return False
    ty = imp.ttype(val[0] if isinstance(val, (tuple, list)) else val)
    out, = imp.g.add_node("max_pool2d", [x], [ty], attrs, names=[clean_name(node.name)])
    imp.env[node] = (out, None) if isinstance(val, (tuple, list)) else out
    return True


@converts("aten.avg_pool2d.default")
def _avg_pool(imp, node, a):
    k = pair(a["kernel_size"])
    divisor = a.get("divisor_override")
    if divisor is not None and a["ceil_mode"]:
        return False            # a window past the edge: not a fixed multiple of the window's mean
    attrs = {"kernel": k, "stride": pair(a["stride"]) if a["stride"] else k, "padding": pair(a["padding"]),
             "ceil_mode": bool(a["ceil_mode"]),
             "count_include_pad": bool(a["count_include_pad"]) or divisor is not None}
    x = imp.operand(a["self"])
    if imp.g.type_of(x).rank not in (3, 4):
        return False
    if divisor is None:
        if imp.g.type_of(x).rank == 3:
            _unbatched(imp, node, "avg_pool2d", x, attrs)
        else:
            imp.emit(node, "avg_pool2d", [x], attrs)
        return True
    # sum / divisor: every window lies inside the padded input (no ceil mode), so the mean over
    # the window with its padding counted is sum / (kh * kw)
    mean = _pooled(imp, "avg_pool2d", x, attrs)
    imp.emit(node, "mul", [mean, imp.const(k[0] * k[1] / divisor, imp.g.type_of(x).dtype)])
    return True


_GRID_MODES = ("bilinear", "nearest", "bicubic")
_GRID_PADDING = ("zeros", "border", "reflection")


@converts("aten.grid_sampler.default", "aten.grid_sampler_3d.default")
def _grid_sampler(imp, node, a):
    """F.grid_sample's ATen form: mode and padding as torch's enum values."""
    mode, pad = a["interpolation_mode"], a["padding_mode"]
    if not (0 <= mode < len(_GRID_MODES) and 0 <= pad < len(_GRID_PADDING)):
        return False
    imp.emit(node, "grid_sampler", [imp.operand(a["input"]), imp.operand(a["grid"])],
             {"mode": _GRID_MODES[mode], "padding_mode": _GRID_PADDING[pad], "align_corners": bool(a["align_corners"])})
    return True


@converts("aten.adaptive_avg_pool2d.default", "aten._adaptive_avg_pool2d.default")
def _adaptive_pool(imp, node, a):
    x = imp.operand(a["self"])
    attrs = {"output_size": [int(v) for v in a["output_size"]]}
    if imp.g.type_of(x).rank == 3:                # unbatched [C, H, W]: the IR op's layout is [N, C, H, W]
        _unbatched(imp, node, "adaptive_avg_pool2d", x, attrs)
        return True
    if imp.g.type_of(x).rank != 4:
        return False
    imp.emit(node, "adaptive_avg_pool2d", [x], attrs)
    return True


@converts("aten.adaptive_avg_pool1d.default")
def _adaptive_pool1d(imp, node, a):
    """[N, C, L] -> adaptive_avg_pool2d over [N, C, 1, L] to [1, out] -> [N, C, out]."""
    x = imp.operand(a["self"])
    xt = imp.g.type_of(x)
    if xt.rank != 3:
        return False
    out = int(a["output_size"][0])
    x4, = imp.g.add_node("reshape", [x], [xt.with_shape(xt.shape[:2] + (1, xt.shape[2]))],
                         {"shape": [imp.attr_dim(d) for d in xt.shape[:2]] + [1, imp.attr_dim(xt.shape[2])]})
    y, = imp.g.add_node("adaptive_avg_pool2d", [x4], [xt.with_shape(xt.shape[:2] + (1, out))],
                        {"output_size": [1, out]})
    imp.emit(node, "reshape", [y], {"shape": [imp.attr_dim(d) for d in xt.shape[:2]] + [out]})
    return True
