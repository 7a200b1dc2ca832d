"""Padding safety: per-rule cases on hand-written IR, and a soundness check on real captures —
every model the analysis calls safe gives eager's answer when padded, and the unsafe ones
really do change (so the check can fail)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from graphmode.analysis.padding import analyze_padding
from graphmode.ir import interpret, parse_graph
from graphmode.verify.numerics import rel_l2


def verdict(text: str, pads=("b", "s"), pad_values=None, constants=None):
    g = parse_graph(text, constants)
    return analyze_padding(g, pad_values or {"x": 0.5, "m": 0}, pads)


def status(rep, dim: str) -> str:
    return rep.dims[dim].status


HEAD = 'graph @t(%x: f32[b,s,4], %m: i64[b,s]) -> (%y) {\n  dims b=1..4 s=2..16\n'


def ir(*lines: str, out_type: str = "") -> str:
    return HEAD + "".join(f"  {ln}\n" for ln in lines) + "  return %y\n}"


@pytest.mark.parametrize("body,want", [
    # reductions over the padded axis
    (['%y: f32[b,4] = sum(%x) {"dims": [1]}'], "unsafe"),
    (['%y: f32[b,4] = mean(%x) {"dims": [1]}'], "unsafe"),
    (['%y: f32[b,4] = amax(%x) {"dims": [1]}'], "unsafe"),
    (['%y: f32[b,s,4] = softmax(%x) {"dim": 1}'], "unsafe"),
    (['%y: f32[b,s,4] = layer_norm(%x) {"normalized_rank": 2}'], "unsafe"),
    # reductions elsewhere, prefix scans and reading real positions only
    (['%y: f32[b,s] = mean(%x) {"dims": [2]}'], "safe"),
    (['%y: f32[b,s,4] = cumsum(%x) {"dim": 1}'], "safe"),
    (['%y: f32[b,1,4] = slice(%x) {"dim": 1, "start": 0, "end": 2, "step": 1}'], "safe"),
    (['%y: f32[b,1,4] = slice(%x) {"dim": 1, "start": 0, "end": 3, "step": 1}'], "unsafe"),   # s may be 2
    (['%y: f32[b,1,4] = slice(%x) {"dim": 1, "start": -1, "end": 4611686018427387904, "step": 1}'], "unsafe"),
    (['%y: f32[b,s-1,4] = slice(%x) {"dim": 1, "start": 1, "end": 4611686018427387904, "step": 1}'], "safe"),
    # an end counted from the padded size keeps real positions in the result's padding (x[:, :-1].sum(1))
    (['%z: f32[b,s-1,4] = slice(%x) {"dim": 1, "start": 0, "end": -1, "step": 1}',
      '%y: f32[b,4] = sum(%z) {"dims": [1]}'], "unsafe"),
    (['%z: f32[b,s-1,4] = slice(%x) {"dim": 1, "start": 0, "end": "s-1", "step": 1}',
      '%y: f32[b,4] = sum(%z) {"dims": [1]}'], "unsafe"),
    (['%y: f32[b,s-1,4] = slice(%x) {"dim": 1, "start": 0, "end": -1, "step": 1}'], "safe"),
    # a mask's zeros cancel a contraction only where the other side is finite (0 * NaN = NaN)
    (['%mf: f32[b,s] = cast(%m) {"dtype": "f32"}', '%y: f32[b,4] = einsum(%mf, %x) {"equation": "bs,bsd->bd"}'],
     "safe"),
    (['%mf: f32[b,s] = cast(%m) {"dtype": "f32"}', '%z: f32[b,s,4] = sub(%x, %x)', '%r: f32[b,s,4] = div(%x, %z)',
      '%y: f32[b,4] = einsum(%mf, %r) {"equation": "bs,bsd->bd"}'], "unsafe"),          # 0.5 / 0 = inf there
    (['%mf: f32[b,s] = cast(%m) {"dtype": "f32"}', '%m3: f32[b,1,s] = reshape(%mf) {"shape": ["b", 1, "s"]}',
      '%z: f32[b,s,4] = sub(%x, %x)', '%r: f32[b,s,4] = div(%x, %z)', '%y: f32[b,1,4] = matmul(%m3, %r)'], "unsafe"),
    (['%mf: f32[b,s] = cast(%m) {"dtype": "f32"}', '%m3: f32[b,1,s] = reshape(%mf) {"shape": ["b", 1, "s"]}',
      '%y: f32[b,1,4] = matmul(%m3, %x)'], "safe"),
    # a masked sum: the mask's padded positions are the pad value 0
    (['%mf: f32[b,s] = cast(%m) {"dtype": "f32"}', '%m3: f32[b,s,1] = reshape(%mf) {"shape": ["b", "s", 1]}',
      '%xm: f32[b,s,4] = mul(%x, %m3)', '%y: f32[b,4] = sum(%xm) {"dims": [1]}'], "safe"),
    # contraction over the padded axis needs zeros
    (['%xt: f32[b,4,s] = permute(%x) {"perm": [0, 2, 1]}', '%y: f32[b,4,4] = matmul(%xt, %x)'], "unsafe"),
    # reshapes that merge and split the padded axes back
    (['%f: f32[b*s,4] = reshape(%x) {"shape": ["b*s", 4]}', '%y: f32[b,s,4] = reshape(%f) {"shape": ["b", "s", 4]}'],
     "safe"),
    (['%f: f32[b*s*4] = reshape(%x) {"shape": ["b*s*4"]}', '%y: f32[b,s*4] = reshape(%f) {"shape": ["b", "s*4"]}'],
     "safe"),       # each row's real positions come first (s outer, 4 inner): sliced back to s*4
    (['%t: f32[b,4,s] = permute(%x) {"perm": [0, 2, 1]}', '%y: f32[b,4*s] = reshape(%t) {"shape": ["b", "4*s"]}'],
     "unsafe"),     # s inner: every row's padding sits between real positions
    # a split of s it cannot follow taints s, not the leading b it followed whole (SegFormer's
    # batch was refused for its h * w split back into h and w)
    (['%f: f32[b,s*4] = reshape(%x) {"shape": ["b", "s*4"]}', '%y: f32[b,2,2*s] = reshape(%f) {"shape": ["b", 2, "2*s"]}'],
     "unsafe"),
    # concatenating along the padded axis puts padding in the middle
    (['%y: f32[b,2*s,4] = concat(%x, %x) {"dim": 1}'], "unsafe"),
    # ATen-reference pointwise ops keep padding where it is (padded positions: unknown values)
    (['%y: f32[b,s,4] = erfc(%x) {"overload": "default", "args": [{"$in": 0}], "kwargs": {}}'], "safe"),
    (['%y: f32[b,s,4] = addcmul(%x, %x, %x) {"overload": "default", "args": [{"$in": 0}, {"$in": 1}, {"$in": 2}], '
      '"kwargs": {"value": 0.5}}'], "safe"),
    (['%e: f32[b,s,4] = erfc(%x) {"overload": "default", "args": [{"$in": 0}], "kwargs": {}}',
      '%y: f32[b,4] = sum(%e) {"dims": [1]}'], "unsafe"),
    # einsum: kept letters pass padding through; a sum over padded positions that are not zero is unsafe
    (['%y: f32[b,s,s] = einsum(%x, %x) {"equation": "bsd,btd->bst"}'], "safe"),
    (['%y: f32[b,s] = einsum(%x, %x) {"equation": "bsd,bsd->bs"}'], "safe"),
    (['%y: f32[b,4,4] = einsum(%x, %x) {"equation": "bsd,bse->bde"}'], "unsafe"),
    (['%y: f32[b,4] = einsum(%x) {"equation": "bsd->bd"}'], "unsafe"),
])
def test_rules(body, want):
    rep = verdict(ir(*body))
    assert status(rep, "s") == want, rep.lines()
    assert status(rep, "b") == "safe", rep.lines()


@pytest.mark.parametrize("op", ["remainder", "fmod", "floor_divide"])
def test_an_integer_division_by_the_pad_value_zero_is_unsafe(op):
    """Padded with 0, an integer divisor raises in the padded run (ZeroDivisionError) where eager,
    with no padding, answers: unsafe unless the divisor's input pads with a nonzero value."""
    attrs = ' {"overload": "default", "args": [{"$in": 0}, {"$in": 1}], "kwargs": {}}' if op == "floor_divide" else ""
    body = ir(f"%y: i64[b,s] = {op}(%m, %m){attrs}")
    rep = verdict(body)
    assert status(rep, "s") == status(rep, "b") == "unsafe", rep.lines()
    assert "zero divisor raises" in rep.dims["s"].findings[0].reason and "pad_value" in rep.dims["s"].findings[0].reason
    rep = verdict(body, pad_values={"x": 0.5, "m": 1})
    assert status(rep, "s") == status(rep, "b") == "safe", rep.lines()


def _island(target: str, args: str, outs: str = "%y: f32[b,s]") -> str:
    return ir(f'{outs} = fallback(%x) {{"target": "{target}", "args": [{{"$in": 0}}, {args}]}}')


@pytest.mark.parametrize("text,b,s", [
    # eager islands along `dim` that drop it or keep it, with one or two outputs: other axes pass through
    (_island("aten.var.dim", "[2]"), "safe", "safe"),
    (_island("aten.var.dim", "[1]", "%y: f32[b,4]"), "safe", "unsafe"),
    (_island("aten.topk.default", "2, -1", "%y: f32[b,s,2], %i: i64[b,s,2]"), "safe", "safe"),
    (_island("aten.median.dim", "2", "%y: f32[b,s], %i: i64[b,s]"), "safe", "safe"),
    (_island("aten.sort.default", "1", "%y: f32[b,s,4], %i: i64[b,s,4]"), "safe", "unsafe"),
    # prefix scans: padding at the end stays at the end (values and indices)
    (_island("aten.cumprod.default", "1", "%y: f32[b,s,4]"), "safe", "safe"),
    (_island("aten.cummax.default", "1", "%y: f32[b,s,4], %i: i64[b,s,4]"), "safe", "safe"),
    (_island("aten.logcumsumexp.default", "0", "%y: f32[b,s,4]"), "safe", "safe"),
    # renorm's `dim` is the axis kept apart: each x[:, :, k] is normalised over batch and seq
    (_island("aten.renorm.default", "2, 2, 1.0", "%y: f32[b,s,4]"), "unsafe", "unsafe"),
])
def test_islands_along_a_dim(text, b, s):
    rep = verdict(text)
    assert (status(rep, "b"), status(rep, "s")) == (b, s), rep.lines()


def test_islands_on_each_element():
    """one_hot and bucketize map each element on its own; one_hot raises on a class outside its
    range, so padding must hold one (the mask input's pad value 0 here, not 12)."""
    one_hot = ir('%h: i64[b,s,10] = fallback(%m) {"target": "aten.one_hot.default", "args": [{"$in": 0}, 10]}',
                 '%y: f32[b,s,10] = cast(%h) {"dtype": "f32"}')
    assert verdict(one_hot).safe
    rep = verdict(one_hot, pad_values={"x": 0.5, "m": 12})
    assert status(rep, "b") == status(rep, "s") == "unsafe"
    bucketize = ir('%y: i64[b,s,4] = fallback(%x, %bounds) {"target": "aten.bucketize.Tensor", '
                   '"args": [{"$in": 0}, {"$in": 1}]}').replace("s=2..16\n", "s=2..16\n  param %bounds: f32[3] = "
                                                                   "[-0.5, 0.0, 0.5]\n")
    assert verdict(bucketize).safe


def test_static_aten_reference_ops_follow_symbolic_dims_and_are_read_as_their_aten_op():
    """Their types come from torch's meta kernels on concrete shapes: over symbolic dims, an
    output size that is an input's dim at three sizes of each symbol follows it (logsumexp over
    s keeps b), one that follows none (repeat's 2*b) is refused. Padding reads the ATen op's
    schema as an island's: along `dim` unsafe, the other axes pass through."""
    from graphmode.errors import GraphmodeError
    from graphmode.ir.ops import OPS
    from graphmode.ir.types import TensorType
    x = parse_graph(ir('%y: f32[b,s,4] = identity(%x)')).values["x"].type
    attrs = {"overload": "default", "args": [{"$in": 0}, [1], True], "kwargs": {}}
    assert [t.text() for t in OPS["logsumexp"].infer([x], attrs)] == ["f32[b,1,4]"]
    assert OPS["logsumexp"].infer([TensorType("f32", (2, 5, 4))], attrs) == [TensorType("f32", (2, 1, 4))]
    with pytest.raises(GraphmodeError, match="static shapes only"):
        OPS["repeat"].infer([x], {"overload": "default", "args": [{"$in": 0}, [2, 1, 1]], "kwargs": {}})
    rep = verdict(ir('%y: f32[b,1,4] = logsumexp(%x) {"overload": "default", "args": [{"$in": 0}, [1], true], '
                     '"kwargs": {}}'))
    assert status(rep, "s") == "unsafe" and "aten.logsumexp.default along padded dim s" in "\n".join(rep.lines())
    assert status(rep, "b") == "safe"
    rep = verdict(ir('%y: f32[b,2*s,4] = repeat(%x) {"overload": "default", "args": [{"$in": 0}, [1, 2, 1]], '
                     '"kwargs": {}}'))
    assert status(rep, "b") == "safe" and status(rep, "s") == "unsafe"
    assert "aten.repeat.default tiles padded dim s" in "\n".join(rep.lines())
    rep = verdict(ir('%y: f32[b,s,4] = cartesian_prod(%x) {"overload": "default", "args": [[{"$in": 0}]], '
                     '"kwargs": {}}'))
    assert status(rep, "b") == "unsafe" and "graphmode cannot see how it uses padded positions" in "\n".join(rep.lines())


def test_additive_mask_makes_softmax_over_keys_safe():
    text = ir('%xt: f32[b,4,s] = permute(%x) {"perm": [0, 2, 1]}',
              '%sc: f32[b,s,s] = matmul(%x, %xt)',
              '%mf: f32[b,s] = cast(%m) {"dtype": "f32"}',
              '%inv: f32[b,s] = sub(%one, %mf)',
              '%neg: f32[b,s] = mul(%inv, %min)',
              '%neg3: f32[b,1,s] = reshape(%neg) {"shape": ["b", 1, "s"]}',
              '%sm: f32[b,s,s] = add(%sc, %neg3)',
              '%p: f32[b,s,s] = softmax(%sm) {"dim": -1}',
              '%y: f32[b,s,4] = matmul(%p, %x)')
    text = text.replace("{\n  dims", "{\n  dims").replace(
        "dims b=1..4 s=2..16\n", "dims b=1..4 s=2..16\n  const %one: f32[] = 1.0\n  const %min: f32[] = -3.4028234663852886e+38\n")
    consts = {"one": torch.tensor(1.0), "min": torch.tensor(torch.finfo(torch.float32).min)}
    assert status(verdict(text, constants=consts), "s") == "safe"
    assert verdict(text, constants=consts).masked == ["s"]
    unmasked = text.replace("%sm: f32[b,s,s] = add(%sc, %neg3)", "%sm: f32[b,s,s] = add(%sc, %sc)")
    rep = verdict(unmasked, constants=consts)
    assert status(rep, "s") == "unsafe" and rep.dims["s"].findings[0].op == "softmax"


def test_sdpa_needs_a_mask_covering_the_keys_or_causal_attention():
    def text(mask: str, causal: str) -> str:
        return ('graph @t(%q: f32[b,2,s,8], %m: bool[b,s]) -> (%y) {\n  dims b=1..4 s=2..16\n'
                '  %m4: bool[b,1,1,s] = reshape(%m) {"shape": ["b", 1, 1, "s"]}\n'
                f'  %y: f32[b,2,s,8] = sdpa(%q, %q, %q{mask}) {{"is_causal": {causal}, "scale": 0.5}}\n'
                '  return %y\n}')
    assert status(verdict(text(", %m4", "false")), "s") == "safe"
    assert verdict(text(", %m4", "false")).masked == ["s"]     # safe by the mask: the runtime checks requests
    assert status(verdict(text("", "true")), "s") == "safe"
    assert verdict(text("", "true")).masked == []              # causal with padding at the end: always safe
    rep = verdict(text("", "false"))
    assert status(rep, "s") == "unsafe" and "no mask covers" in rep.dims["s"].findings[0].reason
    # a mask padded with True (attend) does not cover the padding
    assert status(verdict(text(", %m4", "false"), pad_values={"m": True}), "s") == "unsafe"


def test_sdpa_in_the_heads_layout_is_judged_on_its_seq_axis():
    """`layout: bshd` (q, k, v [b, s, heads, d]): the keys are axis 1, and padding the heads or
    the head dim is found there too."""
    def text(mask: str, causal: str, shape: str = "b,s,2,8") -> str:
        return (f'graph @t(%q: f32[{shape}], %m: bool[b,s]) -> (%y) {{\n  dims b=1..4 s=2..16\n'
                '  %m4: bool[b,1,1,s] = reshape(%m) {"shape": ["b", 1, 1, "s"]}\n'
                f'  %y: f32[{shape}] = sdpa(%q, %q, %q{mask}) {{"is_causal": {causal}, "layout": "bshd", "scale": 0.5}}\n'
                '  return %y\n}')
    assert status(verdict(text(", %m4", "false")), "s") == "safe"
    assert verdict(text(", %m4", "false")).masked == ["s"]
    assert status(verdict(text("", "true")), "s") == "safe"
    rep = verdict(text("", "false"))
    assert status(rep, "s") == "unsafe" and "no mask covers" in rep.dims["s"].findings[0].reason
    rep = verdict(text("", "true", "b,2,s,8"))        # s as the heads axis: no causal cover for that
    assert status(rep, "s") == "safe"                  # heads are batch-like: each on its own
    rep = verdict(text("", "true", "b,2,8,s"))        # s as the head dim
    assert status(rep, "s") == "unsafe" and "head dim" in rep.dims["s"].findings[0].reason


def test_unpadded_dims_are_not_analysed():
    rep = verdict(ir('%y: f32[b,4] = mean(%x) {"dims": [1]}'), pads=("b",))
    assert status(rep, "s") == "not padded" and rep.safe


# ---------------------------------------------------------------------------------- real captures


class Pool(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.lin, self.kind = nn.Embedding(50, 16), nn.Linear(16, 16), kind

    def forward(self, ids, mask):
        h = self.lin(self.emb(ids))
        k = self.kind
        if k == "mean":
            return h.mean(1)
        if k == "softmax_pool":
            return (torch.softmax(h[..., 0], 1)[..., None] * h).sum(1)
        if k == "cumsum_last":
            return h.cumsum(1)[:, -1]
        if k == "masked_mean":
            m = mask[..., None].float()
            return (h * m).sum(1) / m.sum(1).clamp(min=1e-9)
        if k == "eager_attention":        # BERT's eager path: additive finfo.min mask
            sc = h @ h.transpose(1, 2) / 4.0 + (1.0 - mask[:, None, :].float()) * torch.finfo(torch.float32).min
            return torch.softmax(sc, -1) @ h
        if k == "masked_fill_attention":
            sc = (h @ h.transpose(1, 2)).masked_fill(~mask[:, None, :].bool(), float("-inf"))
            return torch.softmax(sc, -1) @ h
        if k == "causal":
            q = h.view(h.shape[0], h.shape[1], 2, 8).transpose(1, 2)
            return F.scaled_dot_product_attention(q, q, q, is_causal=True).transpose(1, 2).reshape(h.shape)
        if k == "packed_causal":          # transformers' packed-sequence mask (position ids, no attention mask)
            b, t = ids.shape
            pos = torch.arange(t)[None].expand(b, t)
            seg = (torch.diff(pos, prepend=pos[:, :1] - 1, dim=-1) != 1).cumsum(-1)
            bi, qi, ki = torch.arange(b)[:, None, None, None], torch.arange(t)[None, None, :, None], \
                torch.arange(t)[None, None, None, :]
            m = (pos[bi, ki] <= pos[bi, qi]) & (seg[bi, qi] == seg[bi, ki])
            q = h.view(b, t, 2, 8).transpose(1, 2)
            return F.scaled_dot_product_attention(q, q, q, attn_mask=m).transpose(1, 2).reshape(h.shape)
        if k == "cat_before":             # fixed rows, then the padded ones: the padding stays last
            return torch.cat([h[:, :1] * 2, h], 1)
        if k == "cat_after":              # the padded rows, then fixed ones: padding in the middle
            return torch.cat([h, h[:, :1]], 1)
        if k == "first_token":
            return h[:, 0]
        if k == "row_stats":              # eager islands along the feature axis only
            return h.var(-1) + h.topk(2, -1).values.sum(-1), h.median(-1).values, h.sort(-1).indices
        if k == "last_token":             # the size as a value: padded, it is the bucket's
            t = h.shape[1]
            return h * (torch.arange(t) == t - 1)[None, :, None]
        if k == "from_the_end":
            return h + (h.shape[1] - torch.arange(h.shape[1]))[None, :, None]
        if k == "length":
            return h + torch.full((h.shape[0], 1, 1), h.shape[1])
        if k == "scans":                  # prefix scans as eager islands, read at the first position
            return (h.cumprod(1)[:, 0] + h.logcumsumexp(1)[:, 0], h.cummax(1).indices[:, 0])
        if k == "renorm":                 # each feature column normalised over batch and seq together
            return (torch.renorm(h, 2, 2, 1.0),)
        raise ValueError(k)


SAFE = ["masked_mean", "eager_attention", "masked_fill_attention", "causal", "packed_causal", "cat_before",
        "first_token", "row_stats", "scans"]
UNSAFE = ["mean", "softmax_pool", "cumsum_last", "last_token", "from_the_end", "length", "cat_after"]
RECIPE = {"version": 1, "name": "pad", "dims": {"batch": {"buckets": [1, 2, 4]}, "seq": {"buckets": [8, 16], "min": 2}},
          "inputs": [{"name": "ids", "dtype": "i64", "shape": ["batch", "seq"], "pad_value": 0},
                     {"name": "mask", "dtype": "i64", "shape": ["batch", "seq"], "pad_value": 0}]}


def _capture(kind: str):
    import graphmode
    from graphmode.capture.spec import bundle_from_module
    ex = {"ids": torch.randint(0, 50, (2, 8)), "mask": torch.ones(2, 8, dtype=torch.long)}
    b = bundle_from_module(Pool(kind).eval(), ex, {"ids": ["batch", "seq"], "mask": ["batch", "seq"]})
    g, rep, _ = graphmode.capture(b, RECIPE)
    return b, g, rep


def _padded_error(b, g, real=(3, 5), bucket=(4, 8)) -> float:
    """Worst rel L2 between eager on the real request and the captured graph on its padded form."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 50, real, generator=gen)
    mask = torch.ones(real, dtype=torch.long)
    mask[0, -2:] = 0                      # a real request with its own masked tail
    want = b.module(ids=ids, mask=mask)
    pad = (0, bucket[1] - real[1], 0, bucket[0] - real[0])
    got = interpret(g, {"ids": F.pad(ids, pad, value=0), "mask": F.pad(mask, pad, value=0)})
    worst = 0.0
    for w, o in zip(want, g.outputs):
        t = got[o][tuple(slice(0, n) for n in w.shape)]
        worst = max(worst, rel_l2(t, w))
    return worst


@pytest.mark.parametrize("kind", SAFE + UNSAFE)
def test_verdict_matches_what_padding_does(kind):
    b, g, rep = _capture(kind)
    pr = analyze_padding(g, {"ids": 0, "mask": 0}, ["batch", "seq"], locs=rep.locs)
    err = _padded_error(b, g)
    if kind in SAFE:
        assert pr.safe, pr.lines()
        assert err < 1e-5, (kind, err)
    else:
        assert pr.unsafe_dims == ["seq"], pr.lines()
        f = pr.dims["seq"].findings[0]
        assert f.loc and f.loc.endswith(".py:" + f.loc.rsplit(":", 1)[1]) and "test_padding_analysis.py" in f.loc
        assert err > 1e-3, (kind, err)       # the refusal is not a false alarm


def test_an_island_whose_dim_is_the_one_kept_apart_is_unsafe_on_every_other():
    """renorm(h, p, dim=2) normalises each h[:, :, k] over batch and seq: read as an op along
    dim 2, padded batch and seq were called safe and the padded plan answered 0.1-0.3 off."""
    b, g, rep = _capture("renorm")
    pr = analyze_padding(g, {"ids": 0, "mask": 0}, ["batch", "seq"], locs=rep.locs)
    assert pr.unsafe_dims == ["batch", "seq"], pr.lines()
    assert _padded_error(b, g) > 1e-3


class FlatPick(nn.Module):
    """Rows picked from the flattened [batch*seq, d] activations by a flat position, as a
    recommender picks each sequence's last item."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(50, 8)

    def forward(self, ids, pick):
        b, t = ids.shape
        return self.emb(ids).reshape(b * t, -1).index_select(0, pick)


def test_an_index_into_flattened_batch_and_seq_rows_is_unsafe_for_both():
    """Trial AB: only the flattened axis' outer factor (batch) was called unsafe, so seq padded
    from 10 to 16 moved every row a flat index names (rel L2 0.99, no fallback)."""
    import graphmode
    from graphmode.capture.spec import bundle_from_module
    ex = {"ids": torch.randint(0, 50, (4, 10)), "pick": torch.tensor([0, 12, 39])}
    b = bundle_from_module(FlatPick().eval(), ex, {"ids": ["batch", "seq"], "pick": [3]})
    rec = {**RECIPE, "inputs": [RECIPE["inputs"][0], {"name": "pick", "dtype": "i64", "shape": [3]}]}
    g, rep, _ = graphmode.capture(b, rec)
    pr = analyze_padding(g, {"ids": 0}, ["batch", "seq"], locs=rep.locs)
    assert pr.unsafe_dims == ["batch", "seq"], pr.lines()
    assert "gather over padded dim seq" in pr.dims["seq"].findings[0].reason
    (want,) = b.module(**ex)
    got = interpret(g, {"ids": F.pad(ex["ids"], (0, 6)), "pick": ex["pick"]})[g.outputs[0]]
    assert rel_l2(got, want) > 1e-3          # the refusal is not a false alarm


class BufferCausal(nn.Module):
    """nanoGPT's attention: the causal mask a buffer, sliced to the sequence."""

    def __init__(self, mask: torch.Tensor):
        super().__init__()
        self.register_buffer("bias", mask.view(1, 1, 32, 32))

    def forward(self, x):
        t = x.shape[1]
        q = x[:, None]
        att = (q @ q.transpose(-2, -1)).masked_fill(self.bias[:, :, :t, :t] == 0, float("-inf"))
        return (att.softmax(-1) @ q)[:, 0]


@pytest.mark.parametrize("mask,safe", [(torch.ones(32, 32).tril(), True), (torch.ones(32, 32).tril().bool(), True),
                                       (torch.ones(32, 32).triu(), False)], ids=["tril", "bool", "triu"])
def test_a_causal_mask_kept_as_a_buffer_pads_the_sequence(mask, safe, tmp_path):
    """Sliced from a constant, its padded columns were unknown to the analysis, so every seq
    between buckets ran eagerly; a buffer that is not lower-triangular stays unsafe."""
    import graphmode
    model = BufferCausal(mask).eval()
    rec = {"version": 1, "name": "bc", "exe_mode": "hybrid", "on_violation": "eager",
           "inputs": [{"name": "x", "dtype": "f32", "shape": ["batch", "seq", 8]}],
           "dims": {"batch": {"buckets": [2]}, "seq": {"buckets": [8, 16], "min": 1}}}
    cm = graphmode.compile(model, rec, cache_dir=tmp_path)
    x = torch.randn(2, 5, 8)
    with torch.no_grad():
        assert rel_l2(cm(x), model(x)) < 1e-5
    assert cm.last_path["path"] == ("graph" if safe else "eager"), cm.last_path


class PerSample(nn.Module):
    """Reflect and edge padding, resampling and 1-d pools (ATen-reference ops): each sample alone."""

    def forward(self, x):
        y = F.pad(x, (2, 2), mode="reflect") + F.pad(x, (2, 2), mode="replicate")
        y = F.interpolate(y, scale_factor=2, mode="linear") + F.interpolate(y, scale_factor=2, mode="nearest")
        v, i = F.max_pool1d(y, 3, return_indices=True)
        return F.avg_pool1d(y, 3) + v, i


def test_per_sample_reference_ops_pad_the_batch(tmp_path):
    """They had no padding rule, so a batch between buckets ran eagerly."""
    import graphmode
    rec = {"version": 1, "name": "ps", "exe_mode": "hybrid", "on_violation": "error",
           "inputs": [{"name": "x", "dtype": "f32", "shape": ["batch", 4, 16]}], "dims": {"batch": {"buckets": [4]}}}
    cm = graphmode.compile(PerSample(), rec, cache_dir=tmp_path)
    x = torch.randn(3, 4, 16)
    got, want = cm(x), PerSample()(x)
    assert rel_l2(got[0], want[0]) < 1e-6 and torch.equal(got[1], want[1])
    assert cm.last_path == {"path": "graph", "bucket": {"batch": 4}}


# GPT-2's capture alone is 10-28 s: slow set; its padded decode (tests/e2e/test_decode.py) stays in
@pytest.mark.parametrize("name", ["minilm", pytest.param("gpt2", marks=pytest.mark.slow)])
def test_builtin_transformers_are_safe_to_pad(captured, name):
    g, rep = captured(name)
    pad_values = {"input_ids": 0, "attention_mask": 0, "token_type_ids": 0}
    pr = analyze_padding(g, pad_values, ["batch", "seq"])
    assert pr.safe, pr.lines()
    # without the mask's zero padding the same models are refused: the mask is what makes it safe
    if name == "minilm":
        pr = analyze_padding(g, {**pad_values, "attention_mask": 1}, ["batch", "seq"])
        assert pr.unsafe_dims == ["seq"], pr.lines()


def test_verdict_for_one_dim_does_not_depend_on_padding_another():
    """Splitting an unpadded merged axis ([4*b] -> [b, 4], as multi-head attention does) is fine
    whether or not b itself is padded."""
    text = ('graph @t(%x: f32[b,s,64]) -> (%y) {\n  dims b=1..4 s=2..16\n'
            '  %p: f32[b,s,4,16] = reshape(%x) {"shape": ["b", "s", 4, 16]}\n'
            '  %q: f32[b,4,s,16] = permute(%p) {"perm": [0, 2, 1, 3]}\n'
            '  %f: f32[4*b,s,16] = reshape(%q) {"shape": ["4*b", "s", 16]}\n'
            '  %y: f32[b,4,s,16] = reshape(%f) {"shape": ["b", 4, "s", 16]}\n'
            '  return %y\n}')
    for pads in (("s",), ("b", "s")):
        assert status(verdict(text, pads=pads, pad_values={"x": 0.5}), "s") == "safe", pads


def test_a_batch_major_merge_slices_back_but_rows_cut_apart_do_not_rejoin():
    """[b*s, 4] with only b padded holds its real rows first (flash-attention's unpadding
    flattens so): safe to pad b and slice back; with s padded too the padding interleaves. Cut
    into pieces (a split request, merged serving), such an output cannot be rejoined by rows."""
    from graphmode.analysis.padding import positions_independent
    text = ir('%y: f32[b*s,4] = reshape(%x) {"shape": ["b*s", 4]}')
    assert status(verdict(text, pads=("b",)), "b") == "safe"
    assert status(verdict(text), "b") == "unsafe"
    assert not positions_independent(parse_graph(text), "b")


@pytest.mark.parametrize("index, want", [("[0, 1]", "safe"), ("[1, 2]", "unsafe"), ("[-1, 0]", "unsafe")])
def test_constant_indices_below_the_smallest_size_read_real_positions(index, want):
    """x.index_select(1, tensor([0, 1])) with s >= 2: every admissible request holds both
    positions, so padding s cannot reach them (index 2, or -1, could name a padded position)."""
    rep = verdict(ir(f'param %i: i64[2] = {index}', '%c: i64[2] = identity(%i)',
                     '%y: f32[b,2,4] = index_select(%x, %c) {"dim": 1}'))
    assert status(rep, "s") == want and status(rep, "b") == "safe"
    if want == "unsafe":
        assert "gather over padded dim s at indices that can name padded positions" in "\n".join(rep.lines())


def test_constant_indices_keep_their_bounds_through_reshape_and_expand():
    """torch.gather(m, 1, tensor([[0, 1]]).expand(b, 2)): the bounds of a constant index survive
    the layout ops that only copy its values."""
    rep = verdict(ir('param %i: i64[2] = [0, 1]', '%r: i64[1,2] = reshape(%i) {"shape": [1, 2]}',
                     '%e: i64[b,2] = expand(%r) {"shape": ["b", 2]}', '%y: i64[b,2] = gather(%m, %e) {"dim": 1}'))
    assert status(rep, "s") == "safe" and status(rep, "b") == "safe"


@pytest.mark.parametrize("kernel,attrs,out_s,want", [
    ((1, 1), {}, "s", "safe"),                                # SqueezeBERT's position-wise conv1d
    ((1, 3), {"padding": [0, 1]}, "s", "unsafe"),              # a window over seq
    ((1, 1), {"stride": [1, 2]}, "floor((s+1)/2)", "unsafe"),  # a stride folds positions together
    ((1, 1), {"padding": [0, 1]}, "s+2", "unsafe"),            # zeros before position 0 shift it
])
def test_a_convolution_of_kernel_one_along_the_padded_axis_pads_it(kernel, attrs, out_s, want):
    """Every conv window tainted every spatial axis: SqueezeBERT (kernel 1, stride 1) was drafted
    with seq unsafe to pad, and every request between buckets ran eagerly."""
    import json
    kh, kw = kernel
    text = (f'graph @t(%x: f32[b,s,4], %w: f32[8,4,{kh},{kw}]) -> (%y) {{\n  dims b=1..4 s=2..16\n'
            '  %t: f32[b,4,s] = permute(%x) {"perm": [0, 2, 1]}\n'
            '  %u: f32[b,4,1,s] = reshape(%t) {"shape": ["b", 4, 1, "s"]}\n'
            f'  %y: f32[b,8,1,{out_s}] = conv2d(%u, %w) {json.dumps(attrs)}\n  return %y\n}}')
    rep = analyze_padding(parse_graph(text), {"x": 0.5}, ("b", "s"))
    assert status(rep, "s") == want and status(rep, "b") == "safe", rep.lines()
