"""The generated fused sdpa kernel (graphmode/backends/cpu/attention.py, a native lowering).

Every case is generated from tensors exactly as the CPU binding does for a plan step, all
compiled into ONE library (a module fixture), and compared with
`F.scaled_dot_product_attention` (the IR op's reference): shapes with Sq != Sk and head dims
16/32/64/80 (and E != D), bool and additive masks broadcast over batch / heads / query rows /
keys, is_causal alone and with a mask, custom scales, fully masked rows, NaN scores, and the
`bshd` layout (q, k, v and the output [b, s, h, d], the head permutes folded in). The same
kernels are then built for AVX2 and for plain x86-64 (the `#if` fallbacks), what the generator
refuses is checked, and a compiled MiniLM runs its attention as `native:sdpa` steps.
Nothing here asserts on a timing.
"""
from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from graphmode.backends.cpu.attention import PAR_FLOPS, problem_of
from graphmode.backends.cpu.build import DEFAULT_FLAGS, KernelBuilder
from graphmode.backends.cpu.kernels import run_with_tensors
from graphmode.backends.cpu.catalog import native_source
from graphmode.backends.cpu.lowering import NATIVE, ops_in
from graphmode.ir.ops import OPS
from graphmode.verify.numerics import rel_l2

_PROBE = KernelBuilder(Path(tempfile.gettempdir()) / "graphmode-test-probe")
needs_cxx = pytest.mark.skipif(not _PROBE.compiler_available(), reason="no C++ compiler on this machine")

G = torch.Generator().manual_seed(0)
NEG = float("-inf")


def randn(*shape):
    return torch.randn(*shape, generator=G)


def keep(*shape, p=0.7):
    return torch.rand(*shape, generator=G) < p


def padding(b, sk, lens, *, dtype=torch.bool, shape=None):
    """A key-padding mask [b, 1, 1, sk] (True / 0.0 = attend), keys from lens[i] on masked."""
    m = torch.arange(sk)[None, :] < torch.tensor(lens)[:, None]
    m = m.view(b, 1, 1, sk)
    if shape is not None:
        m = m.expand(*shape).contiguous()
    return m if dtype == torch.bool else torch.where(m, 0.0, NEG)


@dataclass
class Case:
    name: str
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    mask: torch.Tensor | None = None
    causal: bool = False
    scale: float | None = None
    nan_empty: bool = False           # the IR op's nan_empty_rows (an sdpa the attention pass made)
    layout: str = "bhsd"              # "bshd": the kernel reads q, k, v and writes out as [b, s, h, d]

    @property
    def ins(self):
        qkv = [self.q, self.k, self.v]
        if self.layout == "bshd":
            qkv = [t.transpose(1, 2).contiguous() for t in qkv]
        return qkv + ([self.mask] if self.mask is not None else [])

    @property
    def names(self):
        return ["q", "k", "v", "mask"][:len(self.ins)]

    @property
    def attrs(self):
        return ({"is_causal": self.causal, "scale": self.scale} | ({"nan_empty_rows": True} if self.nan_empty else {})
                | ({"layout": "bshd"} if self.layout == "bshd" else {}))

    def ref(self):
        out = F.scaled_dot_product_attention(self.q, self.k, self.v, attn_mask=self.mask, is_causal=self.causal,
                                             scale=self.scale)
        return out.transpose(1, 2).contiguous() if self.layout == "bshd" else out

    def source(self):
        q, v = self.ins[0], self.ins[2]
        out = torch.empty(q.shape[:-1] + (v.shape[-1],))
        return native_source("sdpa", self.ins, [out], self.attrs, {}, self.names, ["out"])


def qkv(b, h, sq, sk, d, e=None):
    lead = (b, h) if b else (h,)
    return randn(*lead, sq, d), randn(*lead, sk, d), randn(*lead, sk, e or d)


def _cases() -> list[Case]:
    c = []
    # what the models pass: MiniLM [1,12,S,32] + bool padding mask [B,1,S,S]; GPT-2 [1,12,S,64] +
    # bool causal&padding mask [B,1,S,S] (is_causal False); GPT-2 without a mask: is_causal
    c.append(Case("minilm_1x128", *qkv(1, 12, 128, 128, 32), mask=padding(1, 128, [128], shape=(1, 1, 128, 128)),
                  scale=32 ** -0.5))
    c.append(Case("minilm_2x16_padded", *qkv(2, 12, 16, 16, 32), mask=padding(2, 16, [16, 9], shape=(2, 1, 16, 16))))
    causal = torch.ones(40, 40, dtype=torch.bool).tril()
    c.append(Case("gpt2_causal_mask", *qkv(2, 12, 40, 40, 64),
                  mask=(causal[None, None] & padding(2, 40, [40, 31])).contiguous(), scale=0.125))
    c.append(Case("gpt2_is_causal", *qkv(1, 12, 128, 128, 64), causal=True))
    # shapes: Sq != Sk both ways, head dims 16 / 80, E != D, Sk not a multiple of 16, one row / one key
    c.append(Case("sq_lt_sk_d16", *qkv(2, 3, 20, 45, 16)))
    c.append(Case("sq_gt_sk_d80_e24", *qkv(1, 5, 45, 20, 80, 24), scale=0.3))
    c.append(Case("long_sk_300", *qkv(1, 2, 33, 300, 32), mask=keep(1, 2, 33, 300)))
    c.append(Case("one_query_row", *qkv(2, 4, 1, 37, 64)))
    c.append(Case("one_key", *qkv(1, 3, 7, 1, 16)))
    c.append(Case("causal_sq_lt_sk", *qkv(1, 2, 20, 45, 32), causal=True))
    c.append(Case("causal_sq_gt_sk", *qkv(1, 2, 45, 20, 32), causal=True, scale=0.05))
    # mask kinds and broadcasts
    c.append(Case("bool_full", *qkv(2, 3, 37, 53, 32), mask=keep(2, 3, 37, 53)))
    c.append(Case("bool_2d_rows_masked", *qkv(2, 3, 37, 53, 32),
                  mask=torch.cat([keep(30, 53), torch.zeros(7, 53, dtype=torch.bool)]).roll(5, 0)))
    c.append(Case("bool_per_row_keys_bcast", *qkv(2, 3, 19, 23, 16), mask=keep(2, 3, 19, 1, p=0.6)))
    c.append(Case("bool_heads_only", *qkv(2, 3, 17, 29, 32), mask=keep(3, 1, 29)))
    c.append(Case("f32_padding_bcast", *qkv(2, 3, 37, 53, 32), mask=padding(2, 53, [53, 20], dtype=torch.float32)))
    c.append(Case("f32_full_random", *qkv(2, 3, 21, 35, 64), mask=randn(2, 3, 21, 35)))
    m = randn(21, 35)
    m[3] = NEG
    m[10, 5:] = NEG
    c.append(Case("f32_2d_rows_neg_inf", *qkv(2, 3, 21, 35, 16), mask=m))
    c.append(Case("bool_mask_and_causal", *qkv(1, 4, 30, 30, 32), mask=keep(1, 1, 30, 30), causal=True))
    c.append(Case("f32_mask_and_causal", *qkv(1, 4, 30, 30, 32), mask=randn(30, 30), causal=True))
    mm = keep(2, 1, 24, 24)
    mm[1, 0, :, 18:] = False          # right padding: the extent scan stops before the padded keys
    mm[0, 0, 4] = False
    c.append(Case("bool_all_false_block", *qkv(2, 2, 24, 24, 32), mask=mm))
    c.append(Case("three_dim_q", *qkv(0, 6, 33, 33, 32), mask=keep(33, 33)))
    c.append(Case("two_dim_q", randn(9, 16), randn(12, 16), randn(12, 80), mask=keep(9, 12)))
    # a whole query block without any attended key (written as zeros without computing)
    z = torch.ones(64, 64, dtype=torch.bool)
    z[:32] = False
    c.append(Case("masked_query_block", *qkv(1, 2, 64, 64, 32), mask=z))
    return c


# the same problems with the head permutes folded in (the fuse pass's attention_heads_layout):
# q, k, v and the output [b, s, h, d], read and written with strided rows
BSHD = ("minilm_1x128", "minilm_2x16_padded", "gpt2_causal_mask", "gpt2_is_causal", "sq_gt_sk_d80_e24",
        "causal_sq_lt_sk", "bool_full", "bool_all_false_block", "f32_full_random", "long_sk_300",
        "masked_query_block", "bool_2d_rows_masked")
CASES = _cases()
CASES += [Case(c.name + "_bshd", c.q, c.k, c.v, c.mask, c.causal, c.scale, layout="bshd")
          for c in CASES if c.name in BSHD]


def _nan_cases() -> list[Case]:
    """NaN in one q row (head 0) and in one key (head 1), with a bool and an additive mask."""
    c = []
    for sk in (9, 40):
        q, k, v = qkv(1, 2, 6, sk, 16)
        q[0, 0, 2, 3] = float("nan")
        k[0, 1, 4, 0] = float("nan")
        m = keep(6, sk, p=0.6)
        m[1] = False
        m[3, 4] = True
        c.append(Case(f"nan_bool_{sk}", q, k, v, mask=m))
        c.append(Case(f"nan_f32_{sk}", q, k, v, mask=torch.where(m, 0.0, NEG)))
    return c


NAN_CASES = _nan_cases()
# the dead-row cases again as the attention pass makes them from a softmax written out: NaN rows
EMPTY_NAN_CASES = [Case(c.name + "_empty_nan", c.q, c.k, c.v, c.mask, c.causal, c.scale, nan_empty=True)
                   for c in CASES if c.name in ("bool_2d_rows_masked", "f32_2d_rows_neg_inf", "masked_query_block")]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    if not _PROBE.compiler_available():
        pytest.skip("no C++ compiler")
    builder = KernelBuilder(tmp_path_factory.mktemp("kcache"), threads=2)
    sources = {c.name: c.source() for c in CASES + NAN_CASES + EMPTY_NAN_CASES}
    assert all(s is not None for s in sources.values()), [n for n, s in sources.items() if s is None]
    return sources, builder.build_many(list(sources.values()))


def _run(case: Case, ks, kernels) -> torch.Tensor:
    return run_with_tensors(kernels[ks.symbol], dict(zip(case.names, case.ins)), source=ks)["out"]


def test_registered():
    assert "sdpa" in ops_in(NATIVE)


@needs_cxx
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_matches_torch(case, built):
    sources, kernels = built
    got = _run(case, sources[case.name], kernels)
    ref = case.ref()
    assert not torch.isnan(ref).any()
    assert rel_l2(got, ref) < 1e-5, case.name


@needs_cxx
def test_fully_masked_rows_are_zero_like_torch(built):
    sources, kernels = built
    for name, rows in (("bool_2d_rows_masked", None), ("f32_2d_rows_neg_inf", [3]), ("masked_query_block", None),
                       ("masked_query_block_bshd", None), ("bool_2d_rows_masked_bshd", None)):
        case = next(c for c in CASES if c.name == name)
        got, ref = _run(case, sources[name], kernels), case.ref()
        if case.layout == "bshd":                # rows of every head, heads-first again
            got, ref = got.transpose(1, 2), ref.transpose(1, 2)
        dead = ~(case.mask if case.mask.dtype == torch.bool else case.mask > NEG).any(-1)
        if rows is not None:
            assert dead.nonzero().flatten().tolist() == rows
        assert dead.any()
        assert (ref[..., dead, :] == 0).all() and (got[..., dead, :] == 0).all()
        assert rel_l2(got, ref) < 1e-5, name          # and the rows around them untouched


@needs_cxx
def test_empty_rows_are_nan_where_the_softmax_was_written_out(built):
    """`nan_empty_rows`: a row attending no key is NaN, as `softmax(masked scores) @ v` gives in
    eager (torch's sdpa gives 0); the kernel agrees with the op's reference and with the
    decomposed softmax row for row, also where a whole query block is dead."""
    sources, kernels = built
    for case in EMPTY_NAN_CASES:
        got = _run(case, sources[case.name], kernels)
        (ref,) = OPS["sdpa"].ref(case.ins, case.attrs, {})
        s = (case.q @ case.k.transpose(-2, -1)) * (case.scale or case.q.shape[-1] ** -0.5)
        s = s.masked_fill(~case.mask, NEG) if case.mask.dtype == torch.bool else s + case.mask
        eager = s.softmax(-1) @ case.v
        dead = torch.isnan(eager)
        assert dead.any() and torch.equal(torch.isnan(got), dead) and torch.equal(torch.isnan(ref), dead), case.name
        assert (got[~dead] - eager[~dead]).abs().max() < 1e-5 and (ref[~dead] - eager[~dead]).abs().max() < 1e-5


@needs_cxx
def test_nan_scores_poison_their_rows_like_torch(built):
    """With a mask torch adds 0 / -inf, so a NaN score (NaN in a q row, or in a key that a
    row masks) makes that row NaN; the other rows are untouched."""
    sources, kernels = built
    for case in NAN_CASES:
        got, ref = _run(case, sources[case.name], kernels), case.ref()
        assert torch.isnan(ref).any() and torch.equal(torch.isnan(got), torch.isnan(ref)), case.name
        fin = ~torch.isnan(ref)
        assert fin.any() and (got[fin] - ref[fin]).abs().max() < 1e-5


@needs_cxx
@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64"])
def test_isa_fallbacks(march, tmp_path):
    """The AVX2 and portable-C paths (what a host without AVX-512 compiles) give the same numbers."""
    flags = tuple(f"-march={march}" if f == "-march=native" else f for f in DEFAULT_FLAGS)
    builder = KernelBuilder(tmp_path, flags=flags, threads=2)
    if f"-march={march}" not in builder.flags:
        pytest.skip(f"compiler rejects -march={march}")
    picked = [c for c in CASES if c.name in ("sq_gt_sk_d80_e24", "gpt2_causal_mask", "sq_gt_sk_d80_e24_bshd")]
    sources = {c.name: c.source() for c in picked}
    kernels = builder.build_many(list(sources.values()))
    for c in picked:
        assert rel_l2(_run(c, sources[c.name], kernels), c.ref()) < 1e-5, c.name


def test_source_shape():
    ks = CASES[0].source()
    assert ks.symbol.startswith("gm_attn_") and ks.inputs == ("q", "k", "v", "mask") and ks.outputs == ("out",)
    assert "#if defined(__AVX512F__)" in ks.source and "#elif defined(__AVX2__)" in ks.source
    assert "@SYM@" not in ks.source and ks.kind == "attention" and ks.parallel
    assert ks.types["mask"].dtype == "bool" and ks.types["out"].shape == (1, 12, 128, 32)
    small = Case("small", *qkv(1, 1, 4, 4, 16)).source()
    assert not small.parallel and "omp parallel" not in small.source
    assert problem_of(CASES[0].ins, [torch.empty(1, 12, 128, 32)], CASES[0].attrs).flops >= PAR_FLOPS
    # identical instances (every layer of a model) share one symbol; another mask layout does not
    again = Case("again", *qkv(1, 12, 128, 128, 32), mask=CASES[0].mask.clone(), scale=32 ** -0.5).source()
    other = Case("other", *qkv(1, 12, 128, 128, 32), mask=keep(1, 12, 128, 128), scale=32 ** -0.5).source()
    assert again.symbol == ks.symbol and other.symbol != ks.symbol


def _refused(q, k, v, mask=None, attrs=None, out=None):
    ins = [q, k, v] + ([mask] if mask is not None else [])
    out = out if out is not None else torch.empty(q.shape[:-1] + (v.shape[-1],), dtype=q.dtype)
    return native_source("sdpa", ins, [out], attrs or {"is_causal": False, "scale": None}, {},
                         ["q", "k", "v", "mask"][:len(ins)], ["out"]) is None


def test_what_stays_with_aten():
    q, k, v = qkv(1, 2, 8, 8, 16)
    assert not _refused(q, k, v)
    assert _refused(q.double(), k.double(), v.double())                      # f64
    assert _refused(q, k, v, keep(8, 8).to(torch.float16))                   # f16 mask
    assert _refused(q, k, v, keep(8, 8).to(torch.int64))                     # integer mask
    assert _refused(q, k[:, :1].contiguous(), v[:, :1].contiguous())         # k/v broadcast over heads
    assert _refused(q, k, v, keep(3, 1, 2, 8, 8))                            # mask of higher rank than q
    assert _refused(q, k, v, keep(1, 3, 8, 8))                               # mask does not broadcast
    assert _refused(q, k, v, attrs={"is_causal": False, "scale": None, "dropout_p": 0.1})
    assert _refused(q, k, v, attrs={"is_causal": False, "scale": float("inf")})
    assert _refused(*qkv(1, 1, 4, 4, 300))                                   # head dim beyond 256
    assert _refused(randn(1, 1, 2, 4, 16), randn(1, 1, 2, 4, 16), randn(1, 1, 2, 4, 16))   # 5-D
    assert _refused(q, k, v, out=torch.empty(1, 2, 16, 8).transpose(-1, -2))               # strided output
    assert _refused(q.transpose(-1, -2).contiguous().transpose(-1, -2), k, v)  # strided q


@needs_cxx
def test_compiled_minilm_runs_native_sdpa(bundle, tmp_path):
    import graphmode
    from graphmode.recipe import load_recipe
    b = bundle("minilm")
    rec = {"version": 1, "name": "minilm-native-sdpa",
           "inputs": [{"name": n, "dtype": "i64", "shape": ["batch", "seq"]}
                      for n in ("input_ids", "attention_mask", "token_type_ids")],
           "dims": {"batch": {"buckets": [2]}, "seq": {"buckets": [32]}}, "exe_mode": "graph", "targets": ["host"]}
    cm = graphmode.compile(b, load_recipe(rec), cache_dir=tmp_path)
    x = b.make_inputs({"batch": 2, "seq": 32}, seed=3)
    assert (x["attention_mask"] == 0).any()            # the second row is padded
    out = cm(**x)
    with torch.inference_mode():
        ref = b.module(**x)
    for o, r in zip(out, ref):
        assert rel_l2(o, r) < 1e-5
    exe = cm.executable({"batch": 2, "seq": 32})
    names = exe.step_names
    assert names.count("native:sdpa") == 6 and not any(n.endswith(":sdpa") and n != "native:sdpa" for n in names)
