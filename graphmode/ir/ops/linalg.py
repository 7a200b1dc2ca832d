"""Contractions and windows: matmul, linear, conv2d, pools, scaled dot-product attention."""
from __future__ import annotations

import math

import sympy
import torch
import torch.nn.functional as F

from graphmode.errors import IRError
from graphmode.ir.ops import int4
from graphmode.ir.ops.spec import OpSpec, Sample, broadcast_shapes, pair, randn, register, result_dtype
from graphmode.ir.types import Dim, TensorType, dims_equal, normalize_dim


def _matmul_infer(ins, attrs):
    a, b = ins
    if a.rank < 1 or b.rank < 1:
        raise IRError("matmul needs operands of rank >= 1")
    if a.rank == 1 or b.rank == 1:
        raise IRError("matmul with a rank-1 operand: reshape it to rank 2 first")
    if not dims_equal(a.shape[-1], b.shape[-2]):
        raise IRError(f"matmul inner dims differ: {a.text()} @ {b.text()}")
    batch = broadcast_shapes(a.shape[:-2], b.shape[:-2])
    return [TensorType(result_dtype(ins), batch + (a.shape[-2], b.shape[-1]))]


register(OpSpec("matmul", "gemm", (2, 2), _matmul_infer,
                lambda ins, a, env: [torch.matmul(ins[0], ins[1])], traits=frozenset({"gemm"}),
                aten=("aten.mm.default", "aten.bmm.default"),
                doc="batched matmul (torch.matmul), rank >= 2 (a 1-d operand is captured through a reshape)",
                samples=lambda: [Sample(randn((3, 5), (5, 4))), Sample(randn((2, 3, 5), (2, 5, 4))),
                                 Sample(randn((2, 1, 3, 5), (4, 5, 6)))], padding="matmul"))


def _linear_infer(ins, attrs):
    x, w = ins[0], ins[1]
    if w.rank != 2 or not dims_equal(x.shape[-1], w.shape[1]):
        raise IRError(f"linear: input {x.text()} does not match weight {w.text()} ([out, in])")
    return [TensorType(x.dtype, x.shape[:-1] + (w.shape[0],))]


register(OpSpec("linear", "gemm", (2, 3), _linear_infer,
                lambda ins, a, env: [F.linear(ins[0], ins[1], ins[2] if len(ins) > 2 else None)],
                traits=frozenset({"gemm"}), doc="x @ w.T (+ b); w is [out, in]",
                samples=lambda: [Sample(randn((2, 3, 8), (5, 8), (5,))), Sample(randn((4, 8), (6, 8)))],
                padding="linear"))


# Weight-only quantized linear: the activations stay f32, the weight is stored narrow and read
# as it is by the backend's kernel (decode at small batch is bound by reading weights).
# u8 weights are int4 codes packed two a byte with group-wise scales (ir/ops/int4.py).
WEIGHT_DTYPES = ("bf16", "i8", "u8")


def dequantize(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The f32 weight a stored (w, scale) pair stands for: w * scale per output row (int8,
    bf16), or the int4 groups' (q - z) * s (packed u8)."""
    if w.dtype == torch.uint8:
        return int4.dequantize(w, scale)
    return w.float() * scale.float()[:, None]


def _int4_scale_ok(x, w, scale) -> bool:
    """scale [N, K/G(, 2)] for packed w [N, K/2] under x [..., K], with G one of int4.GROUPS."""
    if not dims_equal(x.shape[-1], 2 * w.shape[1]) or scale.rank not in (2, 3) or scale.shape[0] != w.shape[0]:
        return False
    if scale.rank == 3 and scale.shape[2] != 2:
        return False
    groups = scale.shape[1]
    return isinstance(groups, int) and groups > 0 and (2 * w.shape[1]) % groups == 0 \
        and int4.group_of(w.shape, scale.shape) in int4.GROUPS


def _qlinear_infer(ins, attrs):
    x, w, scale = ins[0], ins[1], ins[2]
    if w.dtype not in WEIGHT_DTYPES:
        raise IRError(f"qlinear: weight dtype {w.dtype} is not a stored weight dtype", fix=" or ".join(WEIGHT_DTYPES))
    if x.dtype != "f32" or scale.dtype != "f32":
        raise IRError(f"qlinear: input {x.text()} and scale {scale.text()} must be f32")
    if w.rank != 2:
        raise IRError(f"qlinear: weight {w.text()} must be [out, in] (int4: [out, in / 2])")
    if w.dtype == "u8":
        if not _int4_scale_ok(x, w, scale):
            raise IRError(f"qlinear: int4 input {x.text()}, packed weight {w.text()} ([out, in / 2]) and scale "
                          f"{scale.text()} ([out, in / G] or [out, in / G, 2]) do not match",
                          fix=f"a group G of {', '.join(map(str, int4.GROUPS))} that divides in")
    elif not dims_equal(x.shape[-1], w.shape[1]) or scale.shape != (w.shape[0],):
        raise IRError(f"qlinear: input {x.text()}, weight {w.text()} ([out, in]) and scale {scale.text()} ([out]) "
                      "do not match")
    if len(ins) > 3 and (ins[3].dtype != "f32" or ins[3].shape != (w.shape[0],)):
        raise IRError(f"qlinear: bias {ins[3].text()} must be f32 [out]")
    act = attrs.get("act", "f32")
    if act not in int4.ACTIVATIONS:
        raise IRError(f"qlinear: act {act!r} is not an activation format", fix=" or ".join(int4.ACTIVATIONS))
    if act == "q8" and (w.dtype != "u8" or scale.rank != 2 or int4.group_of(w.shape, scale.shape) != int4.Q8_BLOCK):
        raise IRError(f"qlinear: act q8 needs int4 symmetric group-32 weights; got weight {w.text()}, scale "
                      f"{scale.text()}", fix="act: f32, or weights int4 with group_size 32 and int4_scheme symmetric")
    return [TensorType("f32", x.shape[:-1] + (w.shape[0],))]


def _qlinear_ref(ins, attrs, env):
    bias = ins[3] if len(ins) > 3 else None
    if attrs.get("act", "f32") == "q8":
        return [int4.q8_linear(ins[0], ins[1], ins[2], bias)]
    return [F.linear(ins[0], dequantize(ins[1], ins[2]), bias)]


def _qlinear_samples():
    def make(wdt):
        def f(g):
            w = torch.randn(6, 40, generator=g)
            if wdt == torch.int8:
                scale = w.abs().amax(1) / 127
                return [torch.randn(3, 40, generator=g), torch.round(w / scale[:, None]).to(torch.int8), scale,
                        torch.randn(6, generator=g)]
            return [torch.randn(2, 3, 40, generator=g), w.to(torch.bfloat16), torch.ones(6)]
        return f

    def int4_sample(scheme, group, bias):
        def f(g):
            w = torch.randn(5, 2 * group, generator=g)
            return ([torch.randn(3, 2 * group, generator=g), *int4.quantize(w, group, scheme)]
                    + ([torch.randn(5, generator=g)] if bias else []))
        return f
    return [Sample(make(torch.int8), note="int8, per-row scale, bias"), Sample(make(torch.bfloat16), note="bf16"),
            Sample(int4_sample("symmetric", 32, True), note="int4 symmetric, group 32, bias"),
            Sample(int4_sample("asymmetric", 64, False), note="int4 asymmetric, group 64"),
            Sample(int4_sample("symmetric", 32, True), {"act": "q8"}, note="int4 group 32, q8 activations, bias")]


register(OpSpec("qlinear", "gemm", (3, 4), _qlinear_infer, _qlinear_ref, attrs=("act",),
                doc="weight-only quantized linear: x @ (w * scale[:, None]).T (+ b); w is [out, in] i8 or bf16, "
                    "scale [out] f32 (ones for bf16), x and the result f32; or w u8 [out, in / 2]: int4 codes "
                    "two a byte with group-wise scale [out, in / G] (symmetric) or (scale, zero) [out, in / G, 2] "
                    "(ir/ops/int4.py); act q8 (int4 symmetric group 32 only): x quantized to int8 per block of "
                    "32 as llama.cpp q8_0 for integer dot products",
                samples=_qlinear_samples, padding="opaque"))


def conv_out(size: Dim, k: int, s: int, p: int, d: int, ceil: bool = False) -> Dim:
    num = size + 2 * p - d * (k - 1) - 1
    if isinstance(num, int):
        out = (-(-num // s) if ceil else num // s) + 1
        if ceil and (out - 1) * s >= size + p:     # torch: the last window must start inside the input
            out -= 1
        return out
    return normalize_dim((sympy.ceiling(num / s) if ceil else sympy.floor(num / s)) + 1)


def _conv_infer(ins, a):
    x, w = ins[0], ins[1]
    if x.rank != 4 or w.rank != 4:
        raise IRError(f"conv2d expects 4-d input and weight, got {x.text()} and {w.text()}")
    s, p, d = pair(a.get("stride", 1)), pair(a.get("padding", 0)), pair(a.get("dilation", 1))
    h = conv_out(x.shape[2], w.shape[2], s[0], p[0], d[0])
    wd = conv_out(x.shape[3], w.shape[3], s[1], p[1], d[1])
    return [TensorType(x.dtype, (x.shape[0], w.shape[0], h, wd))]


register(OpSpec("conv2d", "conv", (2, 3), _conv_infer,
                lambda ins, a, env: [F.conv2d(ins[0], ins[1], ins[2] if len(ins) > 2 else None,
                                              pair(a.get("stride", 1)), pair(a.get("padding", 0)),
                                              pair(a.get("dilation", 1)), a.get("groups", 1))],
                attrs=("stride", "padding", "dilation", "groups"), traits=frozenset({"gemm"}),
                doc="2-d convolution, NCHW, weight OIHW (conv1d is captured as conv2d over a height of 1)",
                samples=lambda: [Sample(randn((2, 3, 8, 8), (4, 3, 3, 3), (4,)), {"padding": [1, 1]}),
                                 Sample(randn((1, 4, 9, 9), (4, 1, 3, 3)), {"stride": [2, 2], "groups": 4})],
                padding="window"))


def _pool_infer(ins, a):
    x = ins[0]
    k = pair(a["kernel"])
    s = pair(a.get("stride") or a["kernel"])
    p, d = pair(a.get("padding", 0)), pair(a.get("dilation", 1))
    ceil = a.get("ceil_mode", False)
    return [x.with_shape(x.shape[:2] + (conv_out(x.shape[2], k[0], s[0], p[0], d[0], ceil),
                                       conv_out(x.shape[3], k[1], s[1], p[1], d[1], ceil)))]


register(OpSpec("max_pool2d", "pool", (1, 1), _pool_infer,
                lambda ins, a, env: [F.max_pool2d(ins[0], pair(a["kernel"]), pair(a.get("stride") or a["kernel"]),
                                                  pair(a.get("padding", 0)), pair(a.get("dilation", 1)),
                                                  a.get("ceil_mode", False))],
                attrs=("kernel", "stride", "padding", "dilation", "ceil_mode"), doc="2-d max pooling, NCHW",
                samples=lambda: [Sample(randn((2, 3, 8, 8)), {"kernel": [3, 3], "stride": [2, 2], "padding": [1, 1]})],
                padding="window"))
register(OpSpec("avg_pool2d", "pool", (1, 1), _pool_infer,
                lambda ins, a, env: [F.avg_pool2d(ins[0], pair(a["kernel"]), pair(a.get("stride") or a["kernel"]),
                                                  pair(a.get("padding", 0)), a.get("ceil_mode", False),
                                                  a.get("count_include_pad", True))],
                attrs=("kernel", "stride", "padding", "ceil_mode", "count_include_pad"), doc="2-d average pooling",
                samples=lambda: [Sample(randn((2, 3, 8, 8)), {"kernel": [2, 2]})], padding="window"))
register(OpSpec("adaptive_avg_pool2d", "pool", (1, 1),
                lambda ins, a: [ins[0].with_shape(ins[0].shape[:2] + tuple(pair(a["output_size"])))],
                lambda ins, a, env: [F.adaptive_avg_pool2d(ins[0], pair(a["output_size"]))],
                attrs=("output_size",),
                doc="adaptive average pooling to output_size (global pool = [1, 1]; 1-d pools capture as [1, n])",
                samples=lambda: [Sample(randn((2, 3, 7, 7)), {"output_size": [1, 1]}),
                                 Sample(randn((2, 3, 1, 9)), {"output_size": [1, 3]})], padding="window"))


SDPA_LAYOUTS = ("bhsd", "bshd")


def _sdpa_infer(ins, a):
    q, k, v = ins[:3]
    layout = a.get("layout", "bhsd")
    if layout not in SDPA_LAYOUTS:
        raise IRError(f"sdpa layout {layout!r} is not one of {', '.join(SDPA_LAYOUTS)}")
    if layout == "bshd" and not q.rank == k.rank == v.rank == 4:
        raise IRError(f"sdpa layout 'bshd' takes 4-d q, k, v [batch, seq, heads, dim], got {q.text()}, "
                      f"{k.text()}, {v.text()}")
    return [TensorType(q.dtype, q.shape[:-1] + (v.shape[-1],))]


def _sdpa_ref(ins, a, env):
    if a.get("layout", "bhsd") == "bshd":     # the head permutes the layout pass folded in
        heads = [t.transpose(1, 2) for t in ins[:3]]
        out = _sdpa_ref(heads + list(ins[3:]), {**a, "layout": "bhsd"}, env)[0]
        return [out.transpose(1, 2).contiguous()]
    q, k, v = ins[:3]
    mask = ins[3] if len(ins) > 3 else None
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=a.get("is_causal", False),
                                         scale=a.get("scale"))
    if not a.get("nan_empty_rows"):
        return [out]
    # a row that attends no key: torch's sdpa gives 0, the softmax it was written as gives NaN
    scale = a.get("scale")
    logits = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]) if scale is None else scale)
    if mask is not None:
        logits = logits.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else logits + mask
    if a.get("is_causal", False):
        logits = logits.masked_fill(torch.ones(logits.shape[-2:], dtype=torch.bool).triu(1), -math.inf)
    empty = ~(logits > -math.inf).any(-1, keepdim=True)
    return [out.masked_fill(empty, math.nan)]


register(OpSpec("sdpa", "attention", (3, 4), _sdpa_infer, _sdpa_ref,
                attrs=("is_causal", "scale", "nan_empty_rows", "layout"),
                traits=frozenset({"precision_sensitive"}),
                doc="scaled dot-product attention softmax(q k^T * scale + mask) v; mask bool (keep) or additive; "
                    "a row attending no key is 0 as in torch, NaN under nan_empty_rows (a decomposed softmax's answer); "
                    "layout bshd: q, k, v and the result are [batch, seq, heads, dim] (the head permutes folded in), "
                    "the mask stays [batch, heads, q, k]",
                samples=lambda: [Sample(randn((1, 2, 5, 8), (1, 2, 5, 8), (1, 2, 5, 8))),
                                 Sample(randn((1, 2, 6, 8), (1, 2, 6, 8), (1, 2, 6, 8)), {"is_causal": True}),
                                 Sample(lambda g: [torch.randn(2, 2, 4, 8, generator=g), torch.randn(2, 2, 4, 8, generator=g),
                                                   torch.randn(2, 2, 4, 8, generator=g),
                                                   torch.tensor([True, True, False, True]).reshape(1, 1, 1, 4)
                                                   .expand(2, 1, 1, 4).clone()], {"scale": 0.3}),
                                 Sample(lambda g: [torch.randn(2, 2, 3, 8, generator=g), torch.randn(2, 2, 4, 8, generator=g),
                                                   torch.randn(2, 2, 4, 8, generator=g),
                                                   torch.tensor([[True] * 4, [False] * 4, [True, False, False, True]])
                                                   .reshape(1, 1, 3, 4)], {"nan_empty_rows": True}),
                                 Sample(lambda g: [torch.randn(2, 5, 3, 8, generator=g), torch.randn(2, 6, 3, 8, generator=g),
                                                   torch.randn(2, 6, 3, 4, generator=g),
                                                   torch.rand(2, 1, 5, 6, generator=g) > 0.3], {"layout": "bshd"})],
                padding="attention"))


def _conv_t_infer(ins, a):
    x, w = ins[0], ins[1]
    if x.rank != 4 or w.rank != 4:
        raise IRError(f"conv_transpose2d expects 4-d input and weight, got {x.text()} and {w.text()}")
    s, p, d = pair(a.get("stride", 1)), pair(a.get("padding", 0)), pair(a.get("dilation", 1))
    op = pair(a.get("output_padding", 0))
    hw = tuple(normalize_dim((x.shape[2 + i] - 1) * s[i] - 2 * p[i] + d[i] * (w.shape[2 + i] - 1) + op[i] + 1)
               for i in range(2))
    return [TensorType(x.dtype, (x.shape[0], w.shape[1] * a.get("groups", 1)) + hw)]


register(OpSpec("conv_transpose2d", "conv", (2, 3), _conv_t_infer,
                lambda ins, a, env: [F.conv_transpose2d(ins[0], ins[1], ins[2] if len(ins) > 2 else None,
                                                        pair(a.get("stride", 1)), pair(a.get("padding", 0)),
                                                        pair(a.get("output_padding", 0)), a.get("groups", 1),
                                                        pair(a.get("dilation", 1)))],
                attrs=("stride", "padding", "output_padding", "groups", "dilation"),
                aten=("aten.conv_transpose2d.input",),
                doc="2-d transposed convolution, NCHW, weight (in, out/groups, kh, kw)",
                samples=lambda: [Sample(randn((1, 4, 5, 5), (4, 3, 3, 3), (3,)), {"stride": [2, 2], "padding": [1, 1]}),
                                 Sample(randn((2, 4, 3, 4), (4, 2, 2, 3)), {"stride": [2, 1], "output_padding": [1, 0],
                                                                           "groups": 2, "dilation": [1, 2]})],
                padding="window"))


def _grid_infer(ins, a):
    x, grid = ins[0], ins[1]
    if x.rank not in (4, 5) or grid.rank != x.rank or not (isinstance(grid.shape[-1], int)
                                                         and grid.shape[-1] == x.rank - 2):
        raise IRError(f"grid_sampler expects an (N, C, *spatial) input and an (N, *out, {x.rank - 2}) grid, got "
                      f"{x.text()} and {grid.text()}")
    return [TensorType(x.dtype, x.shape[:2] + grid.shape[1:-1])]


register(OpSpec("grid_sampler", "data", (2, 2), _grid_infer,
                lambda ins, a, env: [F.grid_sample(ins[0], ins[1], mode=a.get("mode", "bilinear"),
                                                   padding_mode=a.get("padding_mode", "zeros"),
                                                   align_corners=a.get("align_corners", False))],
                attrs=("mode", "padding_mode", "align_corners"), traits=frozenset({"index_dependent"}),
                doc="sample input at grid's normalised coordinates (torch.nn.functional.grid_sample: mode bilinear, "
                    "nearest or bicubic; padding zeros, border or reflection; 2-d and 3-d)",
                samples=lambda: [Sample(lambda g: [torch.randn(1, 2, 4, 5, generator=g),
                                                   torch.rand(1, 3, 3, 2, generator=g) * 2.4 - 1.2]),
                                 Sample(lambda g: [torch.randn(2, 1, 3, 4, generator=g),
                                                   torch.rand(2, 2, 5, 2, generator=g) * 2 - 1],
                                        {"mode": "bicubic", "padding_mode": "reflection", "align_corners": True}),
                                 Sample(lambda g: [torch.randn(1, 2, 3, 4, 5, generator=g),
                                                   torch.rand(1, 2, 2, 2, 3, generator=g) * 2.2 - 1.1],
                                        {"mode": "nearest", "padding_mode": "border"})], padding="opaque"))


def _einsum_infer(ins, a):
    import re
    eq = a["equation"].replace(" ", "")
    lhs, arrow, rhs = eq.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(ins):
        raise IRError(f"einsum {eq!r} names {len(terms)} operands, got {len(ins)}")
    sizes: dict[str, Dim] = {}
    ell: tuple = ()
    for term, t in zip(terms, ins):
        letters = term.replace("...", "")
        n_ell = t.rank - len(letters)
        if n_ell < 0 or (n_ell and "..." not in term):
            raise IRError(f"einsum {eq!r}: operand {term!r} does not fit {t.text()}")
        head = term.split("...")[0] if "..." in term else term
        dims = list(t.shape)
        ell_dims = tuple(dims[len(head):len(head) + n_ell]) if "..." in term else ()
        if ell_dims:
            ell = broadcast_shapes(ell, ell_dims)
        rest = dims[:len(head)] + dims[len(head) + n_ell:]
        for ch, d in zip(letters, rest):
            if ch in sizes and isinstance(sizes[ch], int) and sizes[ch] == 1:
                sizes[ch] = d
            elif ch not in sizes or (isinstance(d, int) and d == 1):
                sizes.setdefault(ch, d)
    if not arrow:      # implicit output: the ellipsis, then the letters used once, sorted
        rhs = ("..." if ell else "") + "".join(sorted(c for c in set(re.sub(r"[^a-zA-Z]", "", lhs))
                                                      if lhs.count(c) == 1))
    out: list[Dim] = []
    for part in re.findall(r"\.\.\.|[a-zA-Z]", rhs):
        out.extend(ell if part == "..." else [sizes[part]])
    return [TensorType(result_dtype(list(ins)), tuple(out))]


register(OpSpec("einsum", "gemm", (1, 8), _einsum_infer,
                lambda ins, a, env: [torch.einsum(a["equation"], *ins)], attrs=("equation",),
                aten=(), doc="Einstein summation over the operands (torch.einsum)",
                samples=lambda: [Sample(randn((2, 3, 4), (2, 4, 5)), {"equation": "bij,bjk->bik"}),
                                 Sample(randn((3, 3)), {"equation": "ii"}),
                                 Sample(randn((2, 5, 3), (3,)), {"equation": "...j,j->..."})], padding="einsum"))
