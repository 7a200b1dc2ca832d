"""Padding made safe by a mask holds only while every real row keeps a real unmasked position
(analysis/padding.py `masked`). A request whose mask already holds its pad value can mask a
row whole (a batch row of zeros, or the query rows of a query x key mask, as DeBERTa builds);
a softmax over such a row spreads evenly over every position, the padded ones too, so padding
it changed the answer silently (rel L2 0.2-0.4); so do the query rows before the first real
token of a left-padded request under a causal mask written out with a finite fill. Such a request now runs unpadded: in eager
PyTorch under on_violation: eager, else refused naming the input; a key mask with a real
position in every row is still padded (a tokenizer's padded batch), and the server does not
merge a hazardous request with others."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

import graphmode
from graphmode.capture.spec import bundle_from_module
from graphmode.errors import ContractViolation
from graphmode.verify.numerics import rel_l2


class QueryKeyMask(nn.Module):
    """DeBERTa's pattern: mask[:, None, :] * mask[:, :, None], masked_fill with finfo.min."""

    def __init__(self):
        super().__init__()
        self.q, self.k = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x, mask):
        m = mask[:, None, :] * mask[:, :, None]
        sc = (self.q(x) @ self.k(x).transpose(-1, -2)).masked_fill(m == 0, torch.finfo(torch.float32).min)
        return sc.softmax(-1) @ x


class KeyMask(nn.Module):
    """BERT's pattern: an additive key mask; a batch row whose mask is all zeros."""

    def forward(self, x, mask):
        sc = x @ x.transpose(-1, -2) + (1 - mask[:, None, :].float()) * torch.finfo(torch.float32).min
        return sc.softmax(-1) @ x


class CausalMask(nn.Module):
    """A decoder's eager attention (GPT-2, Llama, Mistral, Qwen2 with attn_implementation eager):
    a position triangle and the key mask, filled with finfo.min. With left padding the query
    rows before the first real token are masked whole: eager spreads them over every key, and
    padding seq added keys there (rel L2 0.1-0.2 at those rows)."""

    def forward(self, x, mask):
        s = x.shape[1]
        pos = torch.arange(s)
        keep = (pos[None, :] <= pos[:, None])[None] & mask[:, None, :].bool()
        sc = (x @ x.transpose(-1, -2)).masked_fill(~keep, torch.finfo(torch.float32).min)
        return sc.softmax(-1) @ x


class CausalSdpa(nn.Module):
    """The same mask into one sdpa: a row masked whole is 0 whatever the keys, so padding stays."""

    def forward(self, x, mask):
        s = x.shape[1]
        pos = torch.arange(s)
        keep = (pos[None, :] <= pos[:, None])[None] & mask[:, None, :].bool()
        return torch.nn.functional.scaled_dot_product_attention(x[:, None], x[:, None], x[:, None],
                                                                attn_mask=keep[:, None])[:, 0]


class CausalSdpaFloatMask(nn.Module):
    """The same mask as an additive float mask with a finite fill (Falcon's ALiBi path): eager
    spreads a row masked whole over every key, so padding keys changes it."""

    def forward(self, x, mask):
        s = x.shape[1]
        pos = torch.arange(s)
        keep = (pos[None, :] <= pos[:, None])[None] & mask[:, None, :].bool()
        bias = torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)
        return torch.nn.functional.scaled_dot_product_attention(x[:, None], x[:, None], x[:, None],
                                                                attn_mask=bias[:, None])[:, 0]


class KeyMaskPositionBias(nn.Module):
    """T5's pattern: a relative position bias [q, k] and a key mask broadcast along the queries,
    one float mask into sdpa. Only keys are masked: a request's own padding positions keep real
    keys, so padding the request further changes nothing (it was refused as a query x key mask)."""

    def __init__(self):
        super().__init__()
        self.bias = nn.Embedding(33, 1)

    def forward(self, x, mask):
        s = x.shape[1]
        pos = torch.arange(s)
        b = self.bias((pos[None, :] - pos[:, None]).clamp(-16, 16) + 16)[..., 0]
        keep = mask[:, None, :].bool().expand(-1, s, -1)
        m = torch.where(keep, b, torch.finfo(torch.float32).min)
        return torch.nn.functional.scaled_dot_product_attention(x[:, None], x[:, None], x[:, None],
                                                                attn_mask=m[:, None])[:, 0]


def _compile(model: nn.Module, on_violation: str, cache):
    r = {"version": 1, "name": "masked", "exe_mode": "graph", "on_violation": on_violation,
         "inputs": [{"name": "x", "dtype": "f32", "shape": ["batch", "seq", 8]},
                    {"name": "mask", "dtype": "i64", "shape": ["batch", "seq"], "pad_value": 0,
                     "role": "attention_mask"}],
         "dims": {"batch": {"buckets": [2]}, "seq": {"buckets": [8, 16], "min": 1}}}
    ex = {"x": torch.randn(2, 8, 8), "mask": torch.ones(2, 8, dtype=torch.long)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return graphmode.compile(bundle_from_module(model, ex, {"x": ["batch", "seq", None], "mask": ["batch", "seq"]}),
                                 r, cache_dir=cache)


@pytest.mark.parametrize("kind", [QueryKeyMask, KeyMask, CausalMask])
def test_a_request_with_masked_positions_is_not_padded_and_gets_eagers_answer(kind, tmp_path):
    torch.manual_seed(0)
    model = kind().eval()
    cm = _compile(model, "eager", tmp_path)
    assert cm.masked_dims == ["seq"] and "seq" not in cm.exact_dims
    assert cm.query_key_dims == (["seq"] if kind is not KeyMask else [])
    x, mask = torch.randn(2, 5, 8), torch.ones(2, 5, dtype=torch.long)
    assert rel_l2(cm(x, mask), model(x, mask)) < 1e-5 and cm.last_path["path"] == "graph"   # still padded
    mask[1, 2:] = 0
    if kind is KeyMask:              # a key mask with a real position in every row: still padded, still right
        with torch.no_grad():
            assert rel_l2(cm(x, mask), model(x, mask)) < 1e-5 and cm.last_path["path"] == "graph"
        mask[1] = 0                  # a row masked whole
    with torch.no_grad():
        want = model(x, mask)
    assert rel_l2(cm(x, mask), want) < 1e-5
    assert cm.last_path == {"path": "eager", "reason": "unsafe padding on seq"}
    x8, m8 = torch.randn(2, 8, 8), mask.new_zeros(2, 8)        # at a bucket value: nothing is padded
    m8[0, :3] = 1
    with torch.no_grad():
        assert rel_l2(cm(x8, m8), model(x8, m8)) < 1e-5 and cm.last_path["path"] == "graph"


def test_a_key_mask_beside_a_position_bias_is_padded_until_a_row_is_masked_whole(tmp_path):
    torch.manual_seed(0)
    model = KeyMaskPositionBias().eval()
    cm = _compile(model, "eager", tmp_path)
    assert cm.masked_dims == ["seq"] and cm.query_key_dims == []
    x, mask = torch.randn(2, 5, 8), torch.ones(2, 5, dtype=torch.long)
    mask[1, 2:] = 0                                          # the request's own padding, right and left
    mask[0, :2] = 0
    with torch.no_grad():
        assert rel_l2(cm(x, mask), model(x, mask)) < 1e-5 and cm.last_path["path"] == "graph"
        mask[1] = 0                                          # a row masked whole: eager spreads it over the keys
        assert rel_l2(cm(x, mask), model(x, mask)) < 1e-5
    assert cm.last_path == {"path": "eager", "reason": "unsafe padding on seq"}


def test_t5s_key_mask_beside_its_relative_position_bias_pads_a_padded_batch(tmp_path):
    """A tokenizer-padded batch of T5 (its mask masks keys; the relative position bias comes from
    positions and a table) was refused at every seq between buckets as a query x key mask."""
    import transformers
    torch.manual_seed(0)
    m = transformers.T5EncoderModel(transformers.T5Config(vocab_size=100, d_model=32, d_kv=8, d_ff=64,
                                                          num_layers=1, num_heads=4)).eval()
    cm = _compiled_on_tokens(m, {"batch": {"buckets": [2]}, "seq": {"buckets": [8, 16], "min": 1}}, tmp_path)
    assert cm.masked_dims == ["seq"] and cm.query_key_dims == []
    _padded_batch_matches_eager(cm, m, 2, 11, masked_from=6)
    assert cm.last_path == {"path": "graph", "bucket": {"batch": 2, "seq": 16}}


def _compiled_on_tokens(m, dims: dict, tmp_path, **extra):
    """`m` compiled for input_ids and attention_mask [batch, seq] (pad 0) over `dims`."""
    r = {"version": 1, "name": "tokens", "exe_mode": "graph", "on_violation": "error", **extra,
         "inputs": [{"name": n, "dtype": "i64", "shape": ["batch", "seq"], "pad_value": 0}
                    for n in ("input_ids", "attention_mask")], "dims": dims}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return graphmode.compile(m, r, cache_dir=tmp_path)


def _padded_batch_matches_eager(cm, m, batch: int, seq: int, masked_from: int) -> None:
    """A tokenizer's padded batch (its last row right-padded from `masked_from`) answers as eager."""
    ids, mask = torch.randint(3, 100, (batch, seq)), torch.ones(batch, seq, dtype=torch.long)
    mask[-1, masked_from:] = 0
    with torch.no_grad():
        want = m(input_ids=ids, attention_mask=mask).last_hidden_state
    assert rel_l2(cm(input_ids=ids, attention_mask=mask).last_hidden_state, want) < 1e-5


def test_a_left_padded_request_to_causal_attention_in_one_sdpa_is_still_padded(tmp_path):
    torch.manual_seed(0)
    model = CausalSdpa().eval()
    cm = _compile(model, "error", tmp_path)
    assert cm.query_key_dims == []
    x, mask = torch.randn(2, 5, 8), torch.ones(2, 5, dtype=torch.long)
    mask[0, :3] = 0                          # left padding: rows 0-2 of batch 0 attend no key
    with torch.no_grad():
        assert rel_l2(cm(x, mask), model(x, mask)) < 1e-5 and cm.last_path["path"] == "graph"


class CausalTrilFloatMask(nn.Module):
    """The triangle from tril of ones, or sliced from a buffer (older Hugging Face decoders): a
    pattern made from positions, as the comparison is."""

    def __init__(self, buffer: bool):
        super().__init__()
        self.register_buffer("tri", torch.ones(32, 32).tril().bool())
        self.buffer = buffer

    def forward(self, x, mask):
        s = x.shape[1]
        tri = self.tri[:s, :s] if self.buffer else torch.ones(s, s).tril().bool()
        keep = tri[None] & mask[:, None, :].bool()
        bias = torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)
        return torch.nn.functional.scaled_dot_product_attention(x[:, None], x[:, None], x[:, None],
                                                                attn_mask=bias[:, None])[:, 0]


@pytest.mark.parametrize("make", [CausalSdpaFloatMask, lambda: CausalTrilFloatMask(False),
                                  lambda: CausalTrilFloatMask(True)], ids=["compare", "tril", "buffer"])
def test_a_left_padded_request_under_a_float_query_key_mask_runs_eager(make, tmp_path):
    torch.manual_seed(0)
    model = make().eval()
    cm = _compile(model, "eager", tmp_path)
    assert cm.query_key_dims == ["seq"]
    x, mask = torch.randn(2, 5, 8), torch.ones(2, 5, dtype=torch.long)
    mask[0, :3] = 0                          # rows 0-2 of batch 0: every key masked, spread evenly by eager
    with torch.no_grad():
        assert rel_l2(cm(x, mask), model(x, mask)) < 1e-5 and cm.last_path["path"] == "eager"
        assert rel_l2(cm(x, torch.ones(2, 5, dtype=torch.long)), model(x, torch.ones(2, 5, dtype=torch.long))) < 1e-5
    assert cm.last_path["path"] == "graph"


def test_without_eager_fallback_the_request_is_refused_naming_the_input(tmp_path):
    cm = _compile(QueryKeyMask().eval(), "error", tmp_path)
    mask = torch.ones(2, 5, dtype=torch.long)
    mask[0, 4] = 0
    with pytest.raises(ContractViolation, match="input 'mask' holds its pad value 0 along seq, and the model may build "
                                                "a query x key mask") as e:
        cm(torch.randn(2, 5, 8), mask)
    assert e.value.where == "dims.seq" and "[8, 16]" in e.value.fix


class CountMask(nn.Module):
    def forward(self, ids, mask):
        return mask.bool().sum(-1), (ids != 0).sum(), (ids > 3).to(torch.int32).prod(-1)


def test_counting_a_mask_compiles_and_widens_to_int64_as_torch_does(tmp_path):
    """sum / prod of bool and narrower integers give int64 (the canonicalize pass refused the
    graph: 'declared type i64 differs from inferred bool')."""
    model = CountMask().eval()
    ex = (torch.randint(0, 9, (2, 6)), torch.ones(2, 6, dtype=torch.long))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cm = graphmode.compile((model, ex), cache_dir=tmp_path)
    ids, mask = torch.randint(0, 9, (3, 6)), torch.randint(0, 2, (3, 6))
    for got, want in zip(cm(ids, mask), model(ids, mask)):
        assert got.dtype == want.dtype == torch.int64 and torch.equal(got, want)


class KeyMaskNegInf(nn.Module):
    """Attention written out with masked_fill(-inf): a row with every key masked is NaN in eager."""

    def forward(self, x, mask):
        sc = (x @ x.transpose(-1, -2)).masked_fill(mask[:, None, :] == 0, float("-inf"))
        return sc.softmax(-1) @ x


def test_a_row_masked_whole_answers_nan_as_the_softmax_written_out_does(tmp_path):
    """The attention pass turns the block into one sdpa, whose torch answer for a row with no
    key is 0; the block's own answer is NaN, and that is what the compiled model returns."""
    model = KeyMaskNegInf().eval()
    cm = _compile(model, "error", tmp_path)
    x, mask = torch.randn(2, 8, 8), torch.ones(2, 8, dtype=torch.long)
    mask[1] = 0
    got, want = cm(x, mask), model(x, mask)
    assert cm.last_path["path"] == "graph" and "native:sdpa" in cm.executable({"batch": 2, "seq": 8}).step_names
    assert torch.isnan(want[1]).all() and torch.isnan(got[1]).all()
    assert rel_l2(got[0], want[0]) < 1e-5


class SizeAsNumber(nn.Module):
    """A mean written with the size: `x.sum(1) / x.shape[1]` (and a scale by it); integer uses of
    it answered the bucket's size in graph mode (lengths 16 for a request of 5)."""

    def forward(self, x):
        t = x.shape[1]       # as integers too: lengths, a position counted from the end, the last position
        return (x.sum(1) / t, x * (t - 1), torch.full((x.shape[0],), t), t - torch.arange(t),
                torch.arange(t) == t - 1)


def test_a_dims_size_used_as_a_number_compiles_and_is_never_padded(tmp_path):
    """It was refused ('symbolic value seq used as a tensor'); captured, the size is the
    bucket's when padded, so a request that would be padded along it runs unpadded."""
    r = {"version": 1, "name": "size", "on_violation": "eager", "exe_mode": "hybrid",
         "inputs": [{"name": "x", "dtype": "f32", "shape": ["batch", "seq"]}],
         "dims": {"batch": {"buckets": [2, 4]}, "seq": {"buckets": [8, 16], "min": 1}}}
    model = SizeAsNumber().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cm = graphmode.compile(bundle_from_module(model, {"x": torch.randn(2, 8)}, {"x": ["batch", "seq"]}), r,
                               cache_dir=tmp_path)
    assert cm.exact_dims == ["seq"]
    for shape, path in (((2, 8), "graph"), ((4, 16), "graph"), ((2, 5), "eager"), ((3, 8), "graph")):
        x = torch.randn(*shape)
        for got, want in zip(cm(x), model(x)):
            assert torch.equal(got, want) if not want.is_floating_point() else rel_l2(got, want) < 1e-5, shape
        assert cm.last_path["path"] == path, (shape, cm.last_path)


@pytest.mark.slow     # ~5 s; a relative-position model pads in the T5 test
def test_deberta_with_relative_attention_pads_its_batch(tmp_path):
    """DeBERTa-v2's relative position index is expanded to batch x heads rows; that axis read as
    one padded extent 4*batch with no known layout, its batch was called unsafe to pad ('a layout
    that cannot be sliced back') and every batch off a bucket ran eagerly."""
    import transformers as T
    torch.manual_seed(0)
    m = T.DebertaV2Model(T.DebertaV2Config(hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                           intermediate_size=64, vocab_size=100, max_position_embeddings=64,
                                           relative_attention=True, pos_att_type=["p2c", "c2p"],
                                           position_buckets=8)).eval()
    cm = _compiled_on_tokens(m, {"batch": {"buckets": [1, 4]}, "seq": {"buckets": [8]}}, tmp_path,
                             codegen={"kernel_selection": "heuristic"})
    assert cm.verdict.padding.dims["batch"].safe
    _padded_batch_matches_eager(cm, m, 3, 8, masked_from=5)
    assert cm.last_path == {"path": "graph", "bucket": {"batch": 4, "seq": 8}}


class MaskFromIds(nn.Module):
    """An attention mask the model builds from its token ids (`ids == 0`, as XLM-style models and
    many ONNX exports do), from an input not named like a mask."""

    def __init__(self):
        super().__init__()
        self.emb, self.q, self.k = nn.Embedding(50, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, tokens):
        x = self.emb(tokens)
        scores = self.q(x) @ self.k(x).transpose(1, 2)
        scores = scores.masked_fill((tokens == 0)[:, None, :], torch.finfo(torch.float32).min)
        return torch.softmax(scores, -1) @ x


def test_a_mask_built_from_the_ids_is_checked_like_a_declared_one(tmp_path):
    """The verdict padded seq 'by masking' from `tokens == 0`, but only inputs named like a mask
    were checked at run time: a row of padding at a non-bucket length spread its softmax over the
    bucket's padded keys too (rel L2 0.13-0.19 against ONNX Runtime and eager, no warning)."""
    torch.manual_seed(0)
    m = MaskFromIds().eval()
    r = {"version": 1, "name": "ids-mask", "exe_mode": "graph", "on_violation": "eager",
         "inputs": [{"name": "tokens", "dtype": "i64", "shape": ["batch", "seq"], "pad_value": 0}],
         "dims": {"batch": {"buckets": [2]}, "seq": {"buckets": [8], "min": 1}}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cm = graphmode.compile(bundle_from_module(m, {"tokens": torch.randint(1, 50, (2, 8))},
                                                  {"tokens": ["batch", "seq"]}), r, cache_dir=tmp_path)
    assert cm.masked_dims == ["seq"] and cm.mask_sources == ["tokens"]
    toks = torch.tensor([[5, 7, 9, 0, 0], [3, 4, 6, 8, 2]])
    with torch.no_grad():
        assert rel_l2(cm(toks), m(toks)) < 1e-5 and cm.last_path["path"] == "graph"      # still padded
        toks[1] = 0                                                                      # a row of padding
        assert rel_l2(cm(toks), m(toks)) < 1e-5 and cm.last_path["path"] == "eager"
