"""The core op set: one table of op specs (shape/dtype inference, reference semantics, cost).

Every importer (torch.export, ONNX) lowers into these ops; every pass, planner and backend
reads them from here. Semantics follow PyTorch's eager functions named in `ref`. A dim in
an attribute (e.g. `reshape.shape`) may be an int or a symbolic expression string over the
recipe dims; the interpreter evaluates it in the current dim environment. See docs/ops.md.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import sympy
import torch
import torch.nn.functional as F

from graphmode.errors import IRError
from graphmode.ir.types import DTYPES, TORCH_TO_DTYPE, Dim, TensorType, dims_equal, eval_dim, normalize_dim

Env = Mapping[str, int]
InferFn = Callable[[list[TensorType], Mapping[str, Any]], list[TensorType]]
RefFn = Callable[[list[torch.Tensor], Mapping[str, Any], Env], list[torch.Tensor]]


@dataclass(frozen=True)
class OpSpec:
    name: str
    kind: str                      # elementwise | reduction | norm | gemm | conv | pool | attention | shape | data | fused | fallback
    arity: tuple[int, int]         # min, max number of inputs
    infer: InferFn
    ref: RefFn
    attrs: tuple[str, ...] = ()    # attribute names the op understands
    inplace: bool = False          # output may reuse input 0's buffer (same shape/dtype)
    view: bool = False             # output is a re-interpretation of input 0's bytes (reshape)
    doc: str = ""
    flops_per_elem: float = 1.0    # elementwise cost, per output element


OPS: dict[str, OpSpec] = {}


def register(spec: OpSpec) -> OpSpec:
    OPS[spec.name] = spec
    return spec


def get_op(name: str) -> OpSpec:
    spec = OPS.get(name)
    if spec is None:
        import difflib
        near = difflib.get_close_matches(name, OPS, n=3)
        raise IRError(f"unknown op {name!r}", fix=f"did you mean {', '.join(near)}?" if near else
                      "see docs/ops.md for the core op set")
    return spec


# ---------------------------------------------------------------------------------- helpers

def eval_shape(shape: Sequence, env: Env) -> list[int]:
    return [eval_dim(normalize_dim(d), env) for d in shape]


def broadcast_shapes(*shapes: Sequence[Dim]) -> tuple[Dim, ...]:
    rank = max(len(s) for s in shapes)
    out: list[Dim] = []
    for i in range(rank):
        cur: Dim = 1
        for s in shapes:
            j = i - (rank - len(s))
            if j < 0:
                continue
            d = s[j]
            if isinstance(d, int) and d == 1:
                continue
            if isinstance(cur, int) and cur == 1:
                cur = d
            elif not dims_equal(cur, d):
                raise IRError(f"shapes {[list(map(str, s)) for s in shapes]} do not broadcast at dim {i}",
                              fix="insert an explicit expand/reshape")
        out.append(cur)
    return tuple(out)


def _result_dtype(types: list[TensorType]) -> str:
    """torch's type promotion, where 0-d tensors act like scalars (same category rules)."""
    tensors = [torch.empty((1,) * t.rank if t.rank else (), dtype=DTYPES[t.dtype], device="meta") for t in types]
    dt = tensors[0]
    for t in tensors[1:]:
        dt = torch.empty((1,) * max(dt.dim(), t.dim()) if (dt.dim() or t.dim()) else (),
                         dtype=torch.result_type(dt, t), device="meta")
    return TORCH_TO_DTYPE[dt.dtype]


def norm_axis(axis: int, rank: int) -> int:
    a = axis + rank if axis < 0 else axis
    if not 0 <= a < max(rank, 1):
        raise IRError(f"axis {axis} out of range for rank {rank}")
    return a


def _same(ins, attrs):
    return [ins[0]]


# ---------------------------------------------------------------------------------- elementwise

_UNARY: dict[str, tuple[Callable, float, str]] = {
    "neg": (torch.neg, 1, "-x"),
    "exp": (torch.exp, 8, "e^x"),
    "log": (torch.log, 8, "natural log"),
    "sqrt": (torch.sqrt, 4, "square root"),
    "rsqrt": (torch.rsqrt, 4, "1/sqrt(x)"),
    "reciprocal": (torch.reciprocal, 2, "1/x"),
    "abs": (torch.abs, 1, "|x|"),
    "tanh": (torch.tanh, 10, "hyperbolic tangent"),
    "sigmoid": (torch.sigmoid, 10, "1/(1+e^-x)"),
    "relu": (torch.relu, 1, "max(x, 0)"),
    "erf": (torch.erf, 10, "error function"),
    "sin": (torch.sin, 10, "sine"),
    "cos": (torch.cos, 10, "cosine"),
    "silu": (F.silu, 12, "x*sigmoid(x)"),
    "logical_not": (torch.logical_not, 1, "not x (bool)"),
    "identity": (lambda x: x.clone(), 0, "copy (clone/contiguous/alias after capture)"),
}

for _name, (_fn, _cost, _doc) in _UNARY.items():
    def _mk(fn):
        return lambda ins, attrs, env: [fn(ins[0])]
    _infer = (lambda ins, attrs: [ins[0].with_dtype("bool")]) if _name == "logical_not" else _same
    register(OpSpec(_name, "elementwise", (1, 1), _infer, _mk(_fn), inplace=True, doc=_doc,
                    flops_per_elem=_cost))

register(OpSpec("gelu", "elementwise", (1, 1), _same,
                lambda ins, a, env: [F.gelu(ins[0], approximate=a.get("approximate", "none"))],
                attrs=("approximate",), inplace=True, flops_per_elem=14,
                doc="GELU; approximate='none' (erf) or 'tanh'"))
register(OpSpec("clamp", "elementwise", (1, 1), _same,
                lambda ins, a, env: [torch.clamp(ins[0], a.get("min"), a.get("max"))],
                attrs=("min", "max"), inplace=True, doc="clamp to [min, max] (either may be null)"))
register(OpSpec("cast", "elementwise", (1, 1), lambda ins, a: [ins[0].with_dtype(a["dtype"])],
                lambda ins, a, env: [ins[0].to(DTYPES[a["dtype"]])], attrs=("dtype",),
                doc="convert to dtype (torch .to semantics)"))

_BINARY: dict[str, tuple[Callable, bool, str]] = {
    "add": (torch.add, False, "a + b"), "sub": (torch.sub, False, "a - b"),
    "mul": (torch.mul, False, "a * b"), "div": (torch.div, False, "a / b (true division)"),
    "pow": (torch.pow, False, "a ** b"), "maximum": (torch.maximum, False, "elementwise max"),
    "minimum": (torch.minimum, False, "elementwise min"),
    "eq": (torch.eq, True, "a == b"), "ne": (torch.ne, True, "a != b"), "lt": (torch.lt, True, "a < b"),
    "le": (torch.le, True, "a <= b"), "gt": (torch.gt, True, "a > b"), "ge": (torch.ge, True, "a >= b"),
    "logical_and": (torch.logical_and, True, "a and b"), "logical_or": (torch.logical_or, True, "a or b"),
}


def _binary_infer(is_bool: bool, name: str):
    def infer(ins, attrs):
        shape = broadcast_shapes(ins[0].shape, ins[1].shape)
        dt = "bool" if is_bool else _result_dtype(ins)
        if name == "div" and dt not in ("f32", "f64", "f16", "bf16"):
            dt = "f32"
        return [TensorType(dt, shape)]
    return infer


for _name, (_fn, _is_bool, _doc) in _BINARY.items():
    def _mk2(fn):
        return lambda ins, attrs, env: [fn(ins[0], ins[1])]
    register(OpSpec(_name, "elementwise", (2, 2), _binary_infer(_is_bool, _name), _mk2(_fn),
                    inplace=not _is_bool, doc=_doc + " (numpy broadcasting, torch type promotion)"))


def _where_infer(ins, attrs):
    return [TensorType(_result_dtype(ins[1:]), broadcast_shapes(*(t.shape for t in ins)))]


register(OpSpec("where", "elementwise", (3, 3), _where_infer,
                lambda ins, a, env: [torch.where(ins[0], ins[1], ins[2])], doc="cond ? a : b"))

# ---------------------------------------------------------------------------------- reductions


def _reduce_infer(ins, attrs):
    t = ins[0]
    dims = sorted({norm_axis(d, t.rank) for d in attrs.get("dims", range(t.rank))})
    keep = attrs.get("keepdim", False)
    shape = [(1 if i in dims else d) for i, d in enumerate(t.shape)] if keep else \
        [d for i, d in enumerate(t.shape) if i not in dims]
    return [t.with_shape(shape)]


def _mk_reduce(fn):
    def ref(ins, a, env):
        dims = a.get("dims", list(range(ins[0].dim())))
        return [fn(ins[0], dim=list(dims), keepdim=a.get("keepdim", False))]
    return ref


register(OpSpec("sum", "reduction", (1, 1), _reduce_infer, _mk_reduce(torch.sum), attrs=("dims", "keepdim"),
                doc="sum over dims"))
register(OpSpec("mean", "reduction", (1, 1), _reduce_infer, _mk_reduce(torch.mean), attrs=("dims", "keepdim"),
                doc="mean over dims"))
register(OpSpec("amax", "reduction", (1, 1), _reduce_infer, _mk_reduce(torch.amax), attrs=("dims", "keepdim"),
                doc="max over dims"))
register(OpSpec("amin", "reduction", (1, 1), _reduce_infer, _mk_reduce(torch.amin), attrs=("dims", "keepdim"),
                doc="min over dims"))
register(OpSpec("softmax", "reduction", (1, 1), _same,
                lambda ins, a, env: [torch.softmax(ins[0], a["dim"])], attrs=("dim",), flops_per_elem=5,
                doc="softmax along dim"))
register(OpSpec("log_softmax", "reduction", (1, 1), _same,
                lambda ins, a, env: [torch.log_softmax(ins[0], a["dim"])], attrs=("dim",), flops_per_elem=5,
                doc="log-softmax along dim"))


register(OpSpec("cumsum", "reduction", (1, 1),
                lambda ins, a: [ins[0].with_dtype("i64" if ins[0].dtype in ("bool", "u8", "i8", "i16", "i32")
                                                  else ins[0].dtype)],
                lambda ins, a, env: [torch.cumsum(ins[0], a["dim"])], attrs=("dim",),
                doc="inclusive prefix sum along dim (integer inputs accumulate in i64)"))


def _layer_norm_ref(ins, a, env):
    x = ins[0]
    n = a.get("normalized_rank", 1)
    w = ins[1] if len(ins) > 1 else None
    b = ins[2] if len(ins) > 2 else None
    return [F.layer_norm(x, tuple(x.shape[-n:]), w, b, a.get("eps", 1e-5))]


register(OpSpec("layer_norm", "norm", (1, 3), _same, _layer_norm_ref, attrs=("normalized_rank", "eps"),
                flops_per_elem=8, doc="layer norm over the last `normalized_rank` dims; inputs x, [weight, [bias]]"))
register(OpSpec("batch_norm", "norm", (5, 5), _same,
                lambda ins, a, env: [F.batch_norm(ins[0], ins[3], ins[4], ins[1], ins[2], False, 0.0,
                                                  a.get("eps", 1e-5))],
                attrs=("eps",), flops_per_elem=4,
                doc="inference batch norm over channel dim 1; inputs x, weight, bias, running_mean, running_var"))

# ---------------------------------------------------------------------------------- GEMM / conv


def _matmul_infer(ins, attrs):
    a, b = ins
    if a.rank < 1 or b.rank < 1:
        raise IRError("matmul needs operands of rank >= 1")
    if a.rank == 1 or b.rank == 1:
        raise IRError("matmul with a rank-1 operand: reshape it to rank 2 first")
    if not dims_equal(a.shape[-1], b.shape[-2]):
        raise IRError(f"matmul inner dims differ: {a.text()} @ {b.text()}")
    batch = broadcast_shapes(a.shape[:-2], b.shape[:-2])
    return [TensorType(_result_dtype(ins), batch + (a.shape[-2], b.shape[-1]))]


register(OpSpec("matmul", "gemm", (2, 2), _matmul_infer,
                lambda ins, a, env: [torch.matmul(ins[0], ins[1])], doc="batched matmul (torch.matmul), rank >= 2"))


def _linear_infer(ins, attrs):
    x, w = ins[0], ins[1]
    if w.rank != 2 or not dims_equal(x.shape[-1], w.shape[1]):
        raise IRError(f"linear: input {x.text()} does not match weight {w.text()} ([out, in])")
    return [TensorType(x.dtype, x.shape[:-1] + (w.shape[0],))]


register(OpSpec("linear", "gemm", (2, 3), _linear_infer,
                lambda ins, a, env: [F.linear(ins[0], ins[1], ins[2] if len(ins) > 2 else None)],
                doc="x @ w.T (+ b); w is [out, in]"))


def _conv_out(size: Dim, k: int, s: int, p: int, d: int, ceil: bool = False) -> Dim:
    num = size + 2 * p - d * (k - 1) - 1
    if isinstance(num, int):
        return (-(-num // s) if ceil else num // s) + 1
    return normalize_dim((sympy.ceiling(num / s) if ceil else sympy.floor(num / s)) + 1)


def _pair(v, n=2):
    return list(v) if isinstance(v, (list, tuple)) else [v] * n


def _conv_infer(ins, a):
    x, w = ins[0], ins[1]
    if x.rank != 4 or w.rank != 4:
        raise IRError(f"conv2d expects 4-d input and weight, got {x.text()} and {w.text()}")
    s, p, d = _pair(a.get("stride", 1)), _pair(a.get("padding", 0)), _pair(a.get("dilation", 1))
    h = _conv_out(x.shape[2], w.shape[2], s[0], p[0], d[0])
    wd = _conv_out(x.shape[3], w.shape[3], s[1], p[1], d[1])
    return [TensorType(x.dtype, (x.shape[0], w.shape[0], h, wd))]


register(OpSpec("conv2d", "conv", (2, 3), _conv_infer,
                lambda ins, a, env: [F.conv2d(ins[0], ins[1], ins[2] if len(ins) > 2 else None,
                                              _pair(a.get("stride", 1)), _pair(a.get("padding", 0)),
                                              _pair(a.get("dilation", 1)), a.get("groups", 1))],
                attrs=("stride", "padding", "dilation", "groups"), doc="2-d convolution, NCHW, weight OIHW"))


def _pool_infer(ins, a):
    x = ins[0]
    k = _pair(a["kernel"])
    s = _pair(a.get("stride") or a["kernel"])
    p, d = _pair(a.get("padding", 0)), _pair(a.get("dilation", 1))
    ceil = a.get("ceil_mode", False)
    return [x.with_shape(x.shape[:2] + (_conv_out(x.shape[2], k[0], s[0], p[0], d[0], ceil),
                                       _conv_out(x.shape[3], k[1], s[1], p[1], d[1], ceil)))]


register(OpSpec("max_pool2d", "pool", (1, 1), _pool_infer,
                lambda ins, a, env: [F.max_pool2d(ins[0], _pair(a["kernel"]), _pair(a.get("stride") or a["kernel"]),
                                                  _pair(a.get("padding", 0)), _pair(a.get("dilation", 1)),
                                                  a.get("ceil_mode", False))],
                attrs=("kernel", "stride", "padding", "dilation", "ceil_mode"), doc="2-d max pooling, NCHW"))
register(OpSpec("avg_pool2d", "pool", (1, 1), _pool_infer,
                lambda ins, a, env: [F.avg_pool2d(ins[0], _pair(a["kernel"]), _pair(a.get("stride") or a["kernel"]),
                                                  _pair(a.get("padding", 0)), a.get("ceil_mode", False),
                                                  a.get("count_include_pad", True))],
                attrs=("kernel", "stride", "padding", "ceil_mode", "count_include_pad"), doc="2-d average pooling"))
register(OpSpec("adaptive_avg_pool2d", "pool", (1, 1),
                lambda ins, a: [ins[0].with_shape(ins[0].shape[:2] + tuple(_pair(a["output_size"])))],
                lambda ins, a, env: [F.adaptive_avg_pool2d(ins[0], _pair(a["output_size"]))],
                attrs=("output_size",), doc="adaptive average pooling to output_size (global pool = [1, 1])"))


def _sdpa_infer(ins, a):
    q, k, v = ins[:3]
    return [TensorType(q.dtype, q.shape[:-1] + (v.shape[-1],))]


def _sdpa_ref(ins, a, env):
    mask = ins[3] if len(ins) > 3 else None
    return [F.scaled_dot_product_attention(ins[0], ins[1], ins[2], attn_mask=mask,
                                           is_causal=a.get("is_causal", False), scale=a.get("scale"))]


register(OpSpec("sdpa", "attention", (3, 4), _sdpa_infer, _sdpa_ref, attrs=("is_causal", "scale"),
                doc="scaled dot-product attention softmax(q k^T * scale + mask) v; mask bool (keep) or additive"))

# ---------------------------------------------------------------------------------- shape / data


def resolve_reshape(in_shape: Sequence[Dim], target: Sequence) -> tuple[Dim, ...]:
    target = [normalize_dim(d) for d in target]
    if sum(1 for d in target if isinstance(d, int) and d == -1) > 1:
        raise IRError("reshape: at most one -1 allowed")
    if any(isinstance(d, int) and d == -1 for d in target):
        total = sympy.Integer(1)
        for d in in_shape:
            total *= d
        known = sympy.Integer(1)
        for d in target:
            if not (isinstance(d, int) and d == -1):
                known *= d
        rest = normalize_dim(sympy.simplify(total / known))
        target = [rest if (isinstance(d, int) and d == -1) else d for d in target]
    return tuple(target)


def _reshape_infer(ins, a):
    out = resolve_reshape(ins[0].shape, a["shape"])
    n_in, n_out = ins[0].numel(), TensorType(ins[0].dtype, out).numel()
    if not dims_equal(n_in, n_out):
        raise IRError(f"reshape {ins[0].text()} to {[str(d) for d in out]} changes the element count")
    return [ins[0].with_shape(out)]


register(OpSpec("reshape", "shape", (1, 1), _reshape_infer,
                lambda ins, a, env: [ins[0].reshape(eval_shape(a["shape"], env))], attrs=("shape",), view=True,
                doc="reshape (view semantics, contiguous row-major); shape entries int, -1 or dim expressions"))
register(OpSpec("permute", "shape", (1, 1),
                lambda ins, a: [ins[0].with_shape(tuple(ins[0].shape[p] for p in a["perm"]))],
                lambda ins, a, env: [ins[0].permute(a["perm"])], attrs=("perm",),
                doc="permute dims (materialised as a copy by backends)"))


def _expand_infer(ins, a):
    shape = [normalize_dim(d) for d in a["shape"]]
    x = ins[0].shape
    lead = len(shape) - len(x)
    out = []
    for i, d in enumerate(shape):
        src = x[i - lead] if i >= lead else None
        out.append(src if (isinstance(d, int) and d == -1) else d)
    broadcast_shapes(x, out)
    return [ins[0].with_shape(out)]


register(OpSpec("expand", "shape", (1, 1), _expand_infer,
                lambda ins, a, env: [ins[0].expand(eval_shape(a["shape"], env))], attrs=("shape",),
                doc="broadcast to shape (-1 keeps the dim)"))


def _slice_len(size: Dim, start: int, end, step: int) -> Dim:
    end_d = normalize_dim(end)
    if isinstance(size, int) and isinstance(end_d, int):
        return len(range(*slice(start, end_d, step).indices(size)))
    if isinstance(end_d, int) and end_d >= 2 ** 31:
        end_d = size
    if isinstance(end_d, int) and end_d < 0:
        end_d = normalize_dim(size + end_d)
    s = start if start >= 0 else normalize_dim(size + start)
    stop = sympy.Min(sympy.sympify(end_d), sympy.sympify(size))
    if isinstance(stop, sympy.Min):
        # undecidable without the dim ranges: export guards guaranteed end <= size
        stop = sympy.sympify(end_d)
    return normalize_dim(sympy.ceiling((stop - s) / step))


def _slice_infer(ins, a):
    t = ins[0]
    dim = norm_axis(a["dim"], t.rank)
    shape = list(t.shape)
    shape[dim] = _slice_len(shape[dim], a.get("start", 0), a.get("end", 2 ** 62), a.get("step", 1))
    return [t.with_shape(shape)]


def _slice_ref(ins, a, env):
    x = ins[0]
    dim = a["dim"]
    end = eval_dim(normalize_dim(a.get("end", 2 ** 62)), env)
    idx = [slice(None)] * x.dim()
    idx[dim] = slice(a.get("start", 0), end, a.get("step", 1))
    return [x[tuple(idx)]]


register(OpSpec("slice", "shape", (1, 1), _slice_infer, _slice_ref, attrs=("dim", "start", "end", "step"),
                doc="x[start:end:step] along dim (python slice clipping)"))


def _concat_infer(ins, a):
    dim = norm_axis(a["dim"], ins[0].rank)
    total = sum((t.shape[dim] for t in ins), start=0)
    shape = list(ins[0].shape)
    shape[dim] = normalize_dim(total)
    return [TensorType(_result_dtype(ins), shape)]


register(OpSpec("concat", "shape", (1, 64), _concat_infer,
                lambda ins, a, env: [torch.cat(list(ins), a["dim"])], attrs=("dim",), doc="concatenate along dim"))
register(OpSpec("embedding", "data", (2, 2),
                lambda ins, a: [TensorType(ins[0].dtype, ins[1].shape + (ins[0].shape[1],))],
                lambda ins, a, env: [F.embedding(ins[1], ins[0])], doc="rows of table (input 0) at indices (input 1)"))
register(OpSpec("index_select", "data", (2, 2),
                lambda ins, a: [ins[0].with_shape(tuple(ins[1].shape[0] if i == norm_axis(a["dim"], ins[0].rank) else d
                                                        for i, d in enumerate(ins[0].shape)))],
                lambda ins, a, env: [torch.index_select(ins[0], a["dim"], ins[1])], attrs=("dim",),
                doc="select entries along dim by a 1-d index"))



def _index_infer(ins, a):
    x, idx = ins[0], ins[1:]
    dims = list(a["dims"])
    bshape = broadcast_shapes(*(t.shape for t in idx))
    rest = [d for i, d in enumerate(x.shape) if i not in dims]
    consecutive = dims == list(range(dims[0], dims[0] + len(dims)))
    if consecutive:
        shape = list(x.shape[:dims[0]]) + list(bshape) + list(x.shape[dims[-1] + 1:])
    else:
        shape = list(bshape) + rest
    return [x.with_shape(shape)]


def _index_ref(ins, a, env):
    key: list = [slice(None)] * ins[0].dim()
    for d, t in zip(a["dims"], ins[1:]):
        key[d] = t
    return [ins[0][tuple(key)]]


register(OpSpec("index", "data", (2, 9), _index_infer, _index_ref, attrs=("dims",),
                doc="advanced indexing x[..., i0, ..., i1] with integer index tensors on `dims` (torch rules)"))

def _arange_infer(ins, a):
    start, end, step = normalize_dim(a.get("start", 0)), normalize_dim(a["end"]), a.get("step", 1)
    n = normalize_dim(sympy.ceiling((sympy.sympify(end) - start) / step))
    return [TensorType(a.get("dtype", "i64"), (n,))]


register(OpSpec("arange", "data", (0, 0), _arange_infer,
                lambda ins, a, env: [torch.arange(eval_dim(normalize_dim(a.get("start", 0)), env),
                                                  eval_dim(normalize_dim(a["end"]), env), a.get("step", 1),
                                                  dtype=DTYPES[a.get("dtype", "i64")])],
                attrs=("start", "end", "step", "dtype"), doc="[start, end) by step; end may be symbolic"))
register(OpSpec("full", "data", (0, 0), lambda ins, a: [TensorType(a.get("dtype", "f32"), tuple(a["shape"]))],
                lambda ins, a, env: [torch.full(eval_shape(a["shape"], env), a["value"],
                                                dtype=DTYPES[a.get("dtype", "f32")])],
                attrs=("shape", "value", "dtype"), doc="a tensor filled with value; shape may be symbolic"))
register(OpSpec("triu", "data", (1, 1), _same, lambda ins, a, env: [torch.triu(ins[0], a.get("diagonal", 0))],
                attrs=("diagonal",), doc="upper triangle (last two dims)"))
register(OpSpec("tril", "data", (1, 1), _same, lambda ins, a, env: [torch.tril(ins[0], a.get("diagonal", 0))],
                attrs=("diagonal",), doc="lower triangle (last two dims)"))

# ---------------------------------------------------------------------------------- regions


def _fused_infer(ins, a):  # types are carried by the body; the verifier checks them there
    raise IRError("fused nodes take their types from their body")


def _fused_ref(ins, a, env):
    raise IRError("fused nodes are interpreted through their body")


register(OpSpec("fused", "fused", (0, 1024), _fused_infer, _fused_ref, attrs=("kind", "pattern"),
                doc="a region of ops (its body) executed as one kernel; kind: elementwise | reduction | "
                    "gemm_epilogue | attention | norm"))


def _fallback_infer(ins, a):
    raise IRError("fallback nodes carry their output types")


def _fallback_ref(ins, a, env):
    from graphmode.ir.fallback import run_fallback
    return run_fallback(ins, a, env)


register(OpSpec("fallback", "fallback", (0, 1024), _fallback_infer, _fallback_ref, attrs=("target", "args", "loc"),
                doc="an op graphmode does not compile (excluded or unsupported): runs eagerly via torch.ops"))

# ---------------------------------------------------------------------------------- cost


def flops_of(op: str, in_shapes: list[tuple[int, ...]], out_shapes: list[tuple[int, ...]], attrs=None) -> float:
    """Arithmetic work of one node with concrete shapes (multiply-add = 2 FLOPs)."""
    spec = OPS[op]
    out_n = math.prod(out_shapes[0]) if out_shapes else 0
    if spec.kind == "gemm":
        k = in_shapes[0][-1]
        return 2.0 * out_n * k
    if spec.kind == "conv":
        w = in_shapes[1]
        return 2.0 * out_n * w[1] * w[2] * w[3]
    if spec.kind == "attention":
        q, k = in_shapes[0], in_shapes[1]
        lq, lk, d = q[-2], k[-2], q[-1]
        batch = math.prod(q[:-2])
        return 4.0 * batch * lq * lk * d + 5.0 * batch * lq * lk
    if spec.kind in ("shape", "data"):
        return 0.0
    if spec.kind in ("reduction", "norm"):
        return spec.flops_per_elem * math.prod(in_shapes[0])
    return spec.flops_per_elem * out_n
