"""The generated paged KV-cache attention kernel (graphmode/backends/cpu/paged.py, a native lowering).

Every case is generated from tensors as the CPU binding does for a plan step, compiled into
one library per ISA path (AVX-512, AVX2, portable; the paths this host cannot run are built
only), and run against the op's reference (ir/ops/kv.py) on copies of the same pools: the
output within rel L2 1e-5 and the pools after the call bit-identical (written slots, and
every page not written unchanged). Cases: decode at contexts on both sides of page
boundaries, chunked prefill (start > 0), grouped-query heads, head dims with vector tails,
padded rows and an empty sequence in a batch of distinct tables, work large enough to run
threaded. Then invalid lens / start / tables: never read or written, counted, raised by the
call. Nothing here asserts on a timing.
"""
from __future__ import annotations

import math
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from graphmode.backends.cpu.build import KernelBuilder
from graphmode.backends.cpu.catalog import native_source
from graphmode.backends.cpu.isa import ISAS, host_isas, host_simd
from graphmode.backends.cpu.lowering import NATIVE, ops_in
from graphmode.backends.cpu.paged import STATUS
from graphmode.errors import BackendError
from graphmode.ir.ops import get_op
from graphmode.verify.numerics import rel_l2

_PROBE = KernelBuilder(Path(tempfile.gettempdir()) / "graphmode-test-probe")
needs_cxx = pytest.mark.skipif(not _PROBE.compiler_available(), reason="no C++ compiler on this machine")
HOST = host_isas(host_simd())
NAMES = ["q", "k", "v", "k_pool", "v_pool", "block_table", "start", "lens"]

G = torch.Generator().manual_seed(0)


def randn(*shape):
    return torch.randn(*shape, generator=G)


@dataclass
class Case:
    """One shape, and the (start, lens) of each run of its kernel."""

    name: str
    b: int
    h: int
    kvh: int
    s: int
    d: int
    e: int
    pages: int
    page: int
    table: list
    runs: list                       # [(start list, lens list)]
    scale: float | None = None
    kv: torch.dtype = torch.float32  # the pools' dtype

    def inputs(self, start, lens) -> list[torch.Tensor]:
        return [randn(self.b, self.h, self.s, self.d), randn(self.b, self.kvh, self.s, self.d),
                randn(self.b, self.kvh, self.s, self.e), randn(self.pages, self.page, self.kvh, self.d).to(self.kv),
                randn(self.pages, self.page, self.kvh, self.e).to(self.kv), torch.tensor(self.table),
                torch.tensor(start), torch.tensor(lens)]

    def source(self):
        ins = self.inputs([0] * self.b, [1] * self.b)
        return native_source("paged_attention", ins, [torch.empty(self.b, self.h, self.s, self.e)],
                             {"scale": self.scale}, {}, NAMES, ["out"])


CASES = [
    # GPT-2-like decode: one query row, contexts 16 (slot 15 of page 0), 17 (a new page), 41, 64 (full table)
    Case("decode", 1, 4, 4, 1, 64, 64, 9, 16, [[3, 0, 7, 5]], [([15], [1]), ([16], [1]), ([40], [1]), ([63], [1])],
         scale=0.125),
    # decode rows over contexts split in parts of 64 positions (paged.SPLIT): 1, 2 and 9 parts, a part of one
    # position, grouped-query heads with an E tail, a padded row and an empty sequence, enough work to thread
    Case("decode_split", 4, 6, 2, 1, 64, 40, 40, 16, [[(7 * i + j) % 40 for j in range(37)] for i in range(4)],
         [([63, 64, 520, 0], [1, 1, 1, 1]), ([127, 128, 575, 9], [1, 1, 0, 1]), ([560, 0, 200, 65], [1, 1, 1, 0])]),
    # chunked prefill: a chunk at start 13 over pages of 8, grouped-query heads (4 over 2), E != D with tails
    Case("chunked_prefill_gqa", 1, 4, 2, 20, 40, 20, 8, 8, [[6, 2, 0, 5, 1]], [([13], [20]), ([0], [7])]),
    # a batch of distinct tables: a padded row block (lens < seq), an empty sequence, decode-like rows
    Case("batch_padded_empty", 3, 6, 2, 12, 32, 48, 14, 4, [[0, 1, 2, 3, 4, 5], [13, 12, 11, 10, 9, 8],
                                                             [7, 6, 9, 8, 11, 10]],
         [([0, 5, 9], [12, 7, 0]), ([10, 2, 0], [3, 0, 12]), ([23, 23, 0], [1, 1, 1])]),
    # enough work to run on the OpenMP team: prefills of up to 64 rows, 12 heads over 3 KV heads
    Case("threaded_prefill", 2, 12, 3, 64, 64, 64, 20, 16, [[0, 2, 4, 6, 8, 10, 12, 14, 16, 18],
                                                             [1, 3, 5, 7, 9, 11, 13, 15, 17, 19]],
         [([0, 30], [64, 50]), ([64, 90], [1, 64])]),
    # head dims below one vector (the tiny decoders of tests/e2e/test_decode.py), pages of 4
    Case("tiny_head_dim", 2, 4, 2, 3, 8, 8, 10, 4, [[9, 0, 4, 2], [1, 3, 5, 7]], [([5, 0], [3, 2]), ([13, 2], [1, 1])]),
    # bf16 pools (memory.kv_cache.dtype: bf16): written rounded as torch rounds, read widened; decode and
    # a GQA prefill with vector tails
    Case("bf16_decode", 1, 4, 4, 1, 64, 64, 9, 16, [[3, 0, 7, 5]], [([15], [1]), ([40], [1])], scale=0.125,
         kv=torch.bfloat16),
    Case("bf16_prefill_gqa", 2, 4, 2, 9, 40, 20, 12, 8, [[6, 2, 0, 5], [1, 3, 4, 7]], [([13, 0], [9, 5])],
         kv=torch.bfloat16),
    # f16 pools (llama.cpp's default cache), alike (a prefill reads them through the same loads): decode
    # split over parts, grouped-query heads, an E tail
    Case("f16_decode_split", 2, 4, 2, 1, 64, 40, 12, 16, [[(5 * i + j) % 12 for j in range(9)] for i in range(2)],
         [([70, 0], [1, 1]), ([140, 63], [1, 1])], kv=torch.float16),
]
BY_NAME = {c.name: c for c in CASES}


def _reference(case: Case, ins: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ref = [t.clone() for t in ins]
    out = get_op("paged_attention").ref(ref, {"scale": case.scale}, {})[0]
    return out, ref[3], ref[4]


def _check(case: Case, kernel, ks) -> None:
    for start, lens in case.runs:
        ins = case.inputs(start, lens)
        want, kp, vp = _reference(case, ins)
        got = torch.full((case.b, case.h, case.s, case.e), float("nan"))
        kernel([t.data_ptr() for t in ins + [got]])
        bits = (lambda t: t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32))   # NaN too
        assert torch.equal(bits(ins[3]), bits(kp)) and torch.equal(bits(ins[4]), bits(vp)), (case.name, start, lens)
        assert rel_l2(got, want) < 1e-5, (case.name, start, lens, rel_l2(got, want))
        for i, n in enumerate(lens):      # padded rows and empty sequences: exactly zero
            assert (got[i, :, max(n, 0):] == 0).all()


@pytest.fixture(scope="module", params=ISAS)
def lib(request, isa_builder):
    """Every case's kernel in one library per ISA cap."""
    isa = request.param
    builder = isa_builder(isa, "paged")
    sources = {c.name: c.source() for c in CASES}
    assert all(s is not None for s in sources.values()), [n for n, s in sources.items() if s is None]
    return isa, sources, builder.build_many(list(sources.values()))


def test_registered():
    assert "paged_attention" in ops_in(NATIVE)


@needs_cxx
@pytest.mark.parametrize("name", list(BY_NAME))
def test_matches_reference_and_writes_the_same_pools(lib, name):
    isa, sources, kernels = lib
    if isa not in HOST:
        pytest.skip(f"this host runs {', '.join(HOST)}: the {isa} path is built but cannot run here")
    ks = sources[name]
    _check(BY_NAME[name], kernels[ks.symbol], ks)


def test_parallel_is_decided_per_call():
    """Whether the team runs depends on lens / start, so every kernel carries the parallel region."""
    ks = BY_NAME["decode"].source()
    assert ks.parallel and "nt = work >= PAR_WORK" in ks.source and ks.status == STATUS
    assert ks.args == tuple(NAMES) + ("out",)
    assert "if(work >= PAR_WORK" in BY_NAME["threaded_prefill"].source().source


@needs_cxx
def test_sequences_outside_their_table_are_refused_and_counted(lib):
    """lens above seq, a negative start, positions past the table's reach, a page id outside the
    pool: those sequences are never read or written (zeros out, pools unchanged) and the call
    raises naming the op; the valid one is exact; the count is reset for the next call."""
    isa, sources, kernels = lib
    if isa not in HOST:
        pytest.skip(f"{isa} cannot run here")
    case = BY_NAME["batch_padded_empty"]
    ks = sources[case.name]
    kernel = kernels[ks.symbol]
    bad_runs = [([0, 0, 0], [13, 4, 3]),             # lens 13 > seq 12
                ([-1, 2, 0], [1, 4, 3]),             # start < 0
                ([19, 2, 0], [6, 4, 3])]             # 19 + 6 > 6 pages x 4
    for start, lens in bad_runs:
        ins = case.inputs(start, lens)
        want, kp, vp = _reference(case, [t if k != 7 else torch.tensor([0, 4, 3]) for k, t in enumerate(ins)])
        pools = ins[3].clone(), ins[4].clone()
        got = torch.full((case.b, case.h, case.s, case.e), float("nan"))
        with pytest.raises(BackendError, match=r"outside its block table or pool \(1 invalid\)"):
            kernel([t.data_ptr() for t in ins + [got]])
        assert (got[0] == 0).all()
        assert rel_l2(got[1:], want[1:]) < 1e-5
        # sequence 0 wrote nothing: the pools are the reference's with sequence 0 empty
        assert torch.equal(ins[3], kp) and torch.equal(ins[4], vp)
        assert not torch.equal(ins[3], pools[0])
    ins = case.inputs([0, 0, 0], [4, 4, 4])
    ins[5][1, 0] = 14                                  # a page past the pool, needed by sequence 1
    ins[5][2, 5] = -1                                  # ... and one that sequence 2 never reaches
    pools = ins[3].clone(), ins[4].clone()
    want, kp, vp = _reference(case, [t if k != 7 else torch.tensor([4, 0, 4]) for k, t in enumerate(ins)])
    got = torch.full((case.b, case.h, case.s, case.e), float("nan"))
    step = kernel.bind([t.data_ptr() for t in ins + [got]])
    with pytest.raises(BackendError, match=r"paged_attention: .* \(1 invalid\)") as e:
        step()
    assert e.value.where == ks.pattern
    assert (got[1] == 0).all() and rel_l2(got, want) < 1e-5
    assert torch.equal(ins[3], kp) and torch.equal(ins[4], vp)
    ins[5][1, 0] = 13
    ins[3].copy_(pools[0])
    ins[4].copy_(pools[1])
    want, kp, vp = _reference(case, ins)
    step()                                             # valid now, and the count was reset
    assert rel_l2(got, want) < 1e-5 and torch.equal(ins[3], kp) and torch.equal(ins[4], vp)


def _refused(**over) -> bool:
    c = BY_NAME["decode"]
    ins = c.inputs([0], [1])
    for k, t in over.items():
        ins[NAMES.index(k)] = t
    e = ins[4].shape[-1]
    return native_source("paged_attention", ins, [torch.empty(1, c.h, 1, e)], {"scale": None}, {}, NAMES,
                         ["out"]) is None


def test_what_stays_with_the_reference():
    assert not _refused()
    assert _refused(v_pool=torch.zeros(9, 16, 4, 64, dtype=torch.bfloat16))       # f32 keys, bf16 values
    assert _refused(k_pool=torch.zeros(9, 16, 4, 64, dtype=torch.float16))       # f16 keys, f32 values
    assert _refused(k_pool=torch.zeros(9, 16, 4, 64, dtype=torch.float64),
                    v_pool=torch.zeros(9, 16, 4, 64, dtype=torch.float64))        # f64 pools
    assert _refused(lens=torch.tensor([1], dtype=torch.int32))
    assert _refused(block_table=torch.zeros(2, 4, dtype=torch.int64))             # a table row per sequence
    assert _refused(q=randn(1, 3, 1, 64))                                          # 3 heads over 4 kv heads
    assert _refused(q=randn(1, 4, 1, 300), k=randn(1, 4, 1, 300), k_pool=randn(9, 16, 4, 300))   # dim > 256
    pool = randn(9, 16, 4, 64)
    assert _refused(k_pool=pool, v_pool=pool)                                      # one pool for k and v
    c = BY_NAME["decode"]
    assert native_source("paged_attention", c.inputs([0], [1]), [torch.empty(1, 4, 1, 64)], {"scale": math.inf},
                         {}, NAMES, ["out"]) is None


@needs_cxx
def test_bf16_pools_round_as_torch_does(lib):
    """Keys written to bf16 pools: ties to even, inf, values past the bf16 range, -0 and
    subnormals exactly as torch's .to(torch.bfloat16); a NaN stays a NaN (torch itself writes
    0x7FC0 on its scalar path and 0xFFFF on its vector path; the kernel writes 0x7FC0)."""
    isa, sources, kernels = lib
    if isa not in HOST:
        pytest.skip(f"this host runs {', '.join(HOST)}")
    case = BY_NAME["bf16_decode"]
    ks = sources[case.name]
    ins = case.inputs([20], [1])
    specials = torch.tensor([1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, -(1.0 + 2 ** -8), float("inf"), float("nan"),
                             3.4e38, -0.0, 1e-40])     # ties to even (down, up), inf, NaN, overflow, -0, subnormal
    ins[1][0, 0, 0, :len(specials)] = specials
    _, kp, _ = _reference(case, ins)
    got = torch.empty(case.b, case.h, case.s, case.e)
    kernels[ks.symbol]([t.data_ptr() for t in ins + [got]])
    nan = kp.isnan()
    assert torch.equal(ins[3].isnan(), nan) and int(nan.sum()) == 1
    assert torch.equal(ins[3].view(torch.int16)[~nan], kp.view(torch.int16)[~nan])



@needs_cxx
def test_f16_pools_round_as_torch_does(lib):
    """Keys and values written to f16 pools bit for bit as torch's .to(torch.float16): ties to
    even at both ends of the normal range, the largest half and the halfway point past it (inf),
    overflow, inf, -0, half subnormals (and their ties), f32 values below them; a NaN stays NaN.
    The output reads them widened exactly, as the reference does."""
    isa, sources, kernels = lib
    if isa not in HOST:
        pytest.skip(f"this host runs {', '.join(HOST)}")
    case = BY_NAME["f16_decode_split"]
    ks = sources[case.name]
    ins = case.inputs([20, 3], [1, 1])
    specials = torch.tensor([1.0 + 2 ** -11, 1.0 + 3 * 2 ** -11, -(1.0 + 2 ** -11), 65504.0, 65519.0, 65520.0,
                             1e6, float("inf"), -float("inf"), -0.0, 2 ** -14, 2 ** -14 - 2 ** -25, 2 ** -24,
                             1.5 * 2 ** -24, 2.5 * 2 ** -24, 2 ** -26, 1e-40, float("nan"), -3.0 * 2 ** -20])
    ins[1][0, 0, 0, :len(specials)] = specials / 4          # the keys at the top of their range too
    ins[1][1, 1, 0, :len(specials)] = specials
    ins[2][0, 1, 0, :len(specials)] = specials
    want, kp, vp = _reference(case, ins)
    got = torch.empty(case.b, case.h, case.s, case.e)
    kernels[ks.symbol]([t.data_ptr() for t in ins + [got]])
    for mine, theirs in ((ins[3], kp), (ins[4], vp)):
        nan = theirs.isnan()
        assert torch.equal(mine.isnan(), nan)
        assert torch.equal(mine.view(torch.int16)[~nan], theirs.view(torch.int16)[~nan])
    assert int(vp.isnan().sum()) == 1 and bool(vp.isinf().any())
    fine = want.isfinite()
    assert torch.equal(got.isfinite(), fine) and rel_l2(got[fine], want[fine]) < 1e-5
