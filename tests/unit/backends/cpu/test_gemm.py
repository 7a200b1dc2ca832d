"""Generated GEMM kernels and tactic selection (graphmode/backends/cpu/gemm.py, tactics/).

Numerics of every micro-kernel configuration against torch on awkward shapes (compiled into
one library, as a plan does), packing, the timing cache, the policies, the rejection of a
wrong candidate and the executor path. Nothing here asserts on a timing.
"""
from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import pytest
import torch

from graphmode.backends.cpu import tactics as tac
from graphmode.backends.cpu.tactics import candidates
from graphmode.backends.cpu.tactics import tuning as tac_tuning
from graphmode.backends.cpu.tactics import weights as tac_weights
from graphmode.backends.cpu.build import KernelBuilder
from graphmode.backends.cpu.abi import KernelSource
from graphmode.backends.cpu.gemm import GemmConfig, GemmProblem, generate_gemm, pack_b, packed_numel
from graphmode.backends.cpu.isa import host_isas
from graphmode.backends.cpu.tactics import ATEN, TacticsContext, problem_of
from graphmode.errors import BackendError
from graphmode.verify.numerics import rel_l2

_PROBE = KernelBuilder(Path(tempfile.gettempdir()) / "graphmode-test-probe")
needs_cxx = pytest.mark.skipif(not _PROBE.compiler_available(), reason="no C++ compiler on this machine")

# every ISA gets its own configs; on a host without one, its `#if` falls back to portable C,
# so the numerics hold everywhere (the ISA list only decides what the tuner offers)
CONFIGS = [GemmConfig("avx512", 8, 32), GemmConfig("avx512", 6, 48, 16, 12), GemmConfig("avx512", 12, 32, 7, 0, 4),
           GemmConfig("avx512", 16, 16),                  # 16 rows in one tile: M = 17 leaves a 1-row tail
           GemmConfig("avx2", 6, 16, 8, 0, par="serial"), GemmConfig("avx2", 4, 24),
           GemmConfig("portable", 4, 16, 16, 8), GemmConfig("portable", 3, 8, 0, 0, par="serial")]

# (op, batch, m, n, k, bias, b_packed, b_batched)
PROBLEMS = [
    ("linear", 1, 1, 17, 5, True, True, False),
    ("linear", 1, 3, 70, 33, True, True, False),
    ("linear", 1, 17, 45, 100, False, True, False),
    ("linear", 1, 16, 96, 64, True, True, False),
    ("linear", 1, 130, 1100, 24, True, True, False),   # parallel (>= 1 MFLOP), several m-blocks
    ("matmul", 3, 5, 37, 19, False, False, True),        # batched, runtime B, masked loads on N
    ("matmul", 12, 16, 16, 64, False, False, True),      # attention-like
    ("matmul", 2, 7, 40, 9, False, False, False),        # one B for every batch entry
    ("matmul", 1, 17, 33, 20, False, True, False),       # constant B [K, N], packed
]


def _operands(p: GemmProblem, nr: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(p.batch, p.m, p.k, generator=g)
    bias = torch.randn(p.n, generator=g) if p.bias else None
    if p.op == "linear":
        w = torch.randn(p.n, p.k, generator=g)
        ref = a @ w.t()
        b = pack_b(w, nr, transposed=True)
    else:
        w = torch.randn(*((p.batch,) if p.b_batched else ()), p.k, p.n, generator=g)
        ref = a @ w
        b = pack_b(w, nr, transposed=False) if p.b_packed else w
    if bias is not None:
        ref = ref + bias
    return a, b, bias, ref


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    if not _PROBE.compiler_available():
        pytest.skip("no C++ compiler")
    builder = KernelBuilder(tmp_path_factory.mktemp("kcache"), threads=2)
    cases = []
    for spec in PROBLEMS:
        p = GemmProblem(*spec)
        for cfg in CONFIGS:
            cases.append((p, cfg, generate_gemm(p, cfg, threads=2)))
    kernels = builder.build_many([c[2] for c in cases])
    return cases, kernels, builder


@needs_cxx
@pytest.mark.parametrize("spec", PROBLEMS, ids=lambda s: f"{s[0]}-{s[1]}x{s[2]}x{s[3]}x{s[4]}"
                         f"{'-bias' if s[5] else ''}{'-packed' if s[6] else ''}")
def test_kernels_match_torch(built, spec):
    cases, kernels, _ = built
    p = GemmProblem(*spec)
    for q, cfg, src in cases:
        if q != p:
            continue
        a, b, bias, ref = _operands(p, cfg.nr)
        c = torch.full((p.batch, p.m, p.n), float("nan"))
        ptrs = [a.data_ptr(), b.data_ptr()] + ([bias.data_ptr()] if bias is not None else []) + [c.data_ptr()]
        kernels[src.symbol](ptrs)
        assert rel_l2(c, ref) < 1e-5, (p.text, cfg.name)


@needs_cxx
def test_bind_and_threads(built):
    """A bound kernel (fixed addresses) gives the same result, at 1 thread and at 2."""
    cases, kernels, _ = built
    p, cfg, src = next(c for c in cases if c[0].m == 130)
    a, b, bias, ref = _operands(p, cfg.nr, seed=3)
    for n in (1, 2):
        kernels[src.symbol].set_threads(n)
        c = torch.zeros(p.batch, p.m, p.n)
        kernels[src.symbol].bind([a.data_ptr(), b.data_ptr(), bias.data_ptr(), c.data_ptr()])()
        assert rel_l2(c, ref) < 1e-5
    kernels[src.symbol].set_threads(2)


def test_source_content():
    p = GemmProblem("linear", 1, 16, 384, 384, True)
    s = generate_gemm(p, GemmConfig("avx512", 8, 32), threads=2)
    assert s.inputs == ("a", "b", "bias") and s.outputs == ("c",) and s.kind == "gemm"
    assert "#pragma omp parallel for" in s.source and "gm_gemm_ukr_avx512<8, 2, 16, false>" in s.source
    assert "#if defined(__AVX512F__)" in s.source and "gm_gemm_ukr_c<" in s.source      # portable fallback
    assert "_MM_MALLOC_H_INCLUDED" in s.source                                        # no <stdlib.h> clash
    serial = generate_gemm(p, GemmConfig("avx512", 8, 32, par="serial"), threads=2)
    assert "omp parallel" not in serial.source and serial.symbol != s.symbol
    small = generate_gemm(GemmProblem("linear", 1, 2, 8, 8), GemmConfig("avx512", 8, 32), threads=2)
    assert "omp parallel" not in small.source                                         # below PAR_FLOPS
    assert generate_gemm(p, GemmConfig("avx512", 8, 32), threads=2).symbol == s.symbol  # deterministic
    with pytest.raises(BackendError, match="registers"):
        generate_gemm(p, GemmConfig("avx2", 8, 32), threads=2)
    with pytest.raises(BackendError, match="f32"):
        generate_gemm(GemmProblem("linear", 1, 4, 4, 4, dtype="f64"), GemmConfig("avx512", 8, 32), threads=2)


def test_config_names_round_trip():
    for cfg in CONFIGS + [GemmConfig("avx512", 8, 32, 256, 64, 4, "serial")]:
        assert GemmConfig.parse(cfg.name) == cfg
    with pytest.raises(BackendError):
        GemmConfig("avx2", 6, 12)          # nr not a multiple of the vector width
    with pytest.raises(BackendError):
        GemmConfig("avx512", 8, 32, mc=12)  # mc not a multiple of mr


def unpack_b(packed: torch.Tensor, n: int, *, transposed: bool) -> torch.Tensor:
    """Inverse of `pack_b`."""
    npan, k, nr = packed.shape
    wn = packed.transpose(1, 2).reshape(npan * nr, k)[:n]
    return wn.contiguous() if transposed else wn.t().contiguous()


@pytest.mark.parametrize("n,k,nr", [(17, 5, 16), (64, 3, 32), (70, 33, 48), (1, 1, 8)])
def test_packing_round_trip(n, k, nr):
    w = torch.randn(n, k)
    pk = pack_b(w, nr, transposed=True)
    assert pk.shape == (-(-n // nr), k, nr) and pk.numel() == packed_numel(n, k, nr)
    assert torch.equal(unpack_b(pk, n, transposed=True), w)
    if n % nr:
        assert not pk[n // nr, :, n % nr:].any()          # the last panel is zero-padded
    assert torch.equal(pk[0, 2 % k, : min(nr, n)], w[: min(nr, n), 2 % k])
    b = torch.randn(k, n)
    assert torch.equal(unpack_b(pack_b(b, nr, transposed=False), n, transposed=False), b)


def test_host_isas():
    assert host_isas(["avx2", "fma", "avx512f"]) == ["avx512", "avx2", "portable"]
    assert host_isas(["avx2", "fma"]) == ["avx2", "portable"]
    assert host_isas(["avx2"]) == ["portable"]
    assert host_isas(["neon"]) == ["portable"]


def test_problem_of():
    w, b = torch.randn(6, 4), torch.randn(6)
    x, y = torch.randn(2, 3, 4), torch.empty(2, 3, 6)
    consts = {w.data_ptr()}
    assert problem_of("linear", [x, w, b], [y], consts) == GemmProblem("linear", 1, 6, 6, 4, bias=True)
    assert problem_of("linear", [x, w], [y], set()) is None                  # weight not a constant
    assert problem_of("linear", [x.double(), w.double()], [y.double()], consts) is None
    q, kt = torch.randn(2, 5, 8), torch.randn(2, 8, 7)
    assert problem_of("matmul", [q, kt], [torch.empty(2, 5, 7)]) == \
        GemmProblem("matmul", 2, 5, 7, 8, b_packed=False, b_batched=True)
    assert problem_of("matmul", [q, torch.randn(1, 8, 7)], [torch.empty(2, 5, 7)]) is None   # broadcast batch
    assert problem_of("matmul", [q.view(1, 2, 5, 8), kt.view(1, 2, 8, 7)], [torch.empty(1, 2, 5, 7)]) == \
        GemmProblem("matmul", 2, 5, 7, 8, b_packed=False, b_batched=True)                 # 4-D attention
    assert problem_of("matmul", [q.transpose(1, 2), kt[:, :5]], [torch.empty(2, 8, 7)]) is None  # strided


def _ctx(tmp_path: Path, **kw) -> TacticsContext:
    kw.setdefault("builder", KernelBuilder(tmp_path / "kernels", threads=2))
    kw.setdefault("simd", ["avx2", "fma"] + (["avx512f"] if "avx512f" in _host_simd() else []))
    kw.setdefault("llc_bytes", 32 << 20)
    kw.setdefault("reps", 3)
    kw.setdefault("budget_s", 0.0)
    kw.setdefault("retune_noisy", 0)     # this machine is shared: a noisy first timing must still be reused
    return TacticsContext(tmp_path / "tactics", 2, **kw)


def _host_simd() -> list[str]:
    try:
        from graphmode.targets import get_target
        return list(get_target("host").simd)
    except Exception:  # noqa: BLE001
        return []


SMALL = GemmProblem("linear", 1, 16, 96, 64, bias=True)


@needs_cxx
def test_cache_persisted_and_reused(tmp_path):
    ctx = _ctx(tmp_path)
    sel = ctx.select(SMALL)
    assert ctx.stats["timing_runs"] > 0 and ctx.stats["cache_misses"] == 1 and not sel.from_cache
    assert set(sel.timings_s) == set(ctx.candidates(SMALL)) and sel.winner in sel.timings_s
    assert ctx.select(SMALL).from_cache and ctx.stats["timed_shapes"] == 1   # same context: cached too
    files = list((tmp_path / "tactics").glob("gemm-*.json"))
    assert len(files) == 1
    entry = json.loads(files[0].read_text())
    assert entry["key"]["m"] == 16 and "avx2" in entry["key"]["target"] and entry["key"]["threads"] == 2
    report = sel.to_json()
    assert report["winner"] == sel.winner and "aten" in report["timings_us"]

    again = _ctx(tmp_path)              # a new plan build in the same cache folder
    sel2 = again.select(SMALL)
    assert again.stats["timing_runs"] == 0 and again.stats["cache_hits"] == 1
    assert sel2.from_cache and sel2.winner == sel.winner and sel2.timings_s == pytest.approx(sel.timings_s)

    # a timing taken on a busy machine is measured again (up to `retune_noisy` times)
    path = files[0]
    noisy = dict(entry, noisy=True, tries=1, starved=False, load=0.0)   # noisy alone: not timed on a busy host
    path.write_text(json.dumps(noisy))
    retry = _ctx(tmp_path, retune_noisy=1)
    retry.select(SMALL)
    assert retry.stats["timed_shapes"] == 1 and json.loads(path.read_text())["tries"] == 2
    path.write_text(json.dumps(dict(noisy, tries=2)))
    settled = _ctx(tmp_path, retune_noisy=1)
    assert settled.select(SMALL).from_cache and settled.stats["timing_runs"] == 0

    other = _ctx(tmp_path, simd=["avx2", "fma"], configs={"avx2": [GemmConfig("avx2", 6, 16)]})
    other.select(SMALL)                  # another candidate set / target identity: tuned again
    assert other.stats["timing_runs"] > 0


def _stopped_clock() -> float:
    return 1.0        # the process's CPU time never moves: every timing is starved


_full_clock = time.perf_counter      # CPU time as fast as the wall clock: the process had a CPU throughout


@needs_cxx
def test_a_starved_timing_is_marked_and_replaced_by_the_first_quiet_build(tmp_path, monkeypatch):
    """Timed while the process got no CPU (a CPU clock that stands still): timed once more at
    once, cached as starved with its conditions; a later build on a busy host uses it as it is
    (timing would be starved again), the first build on a quiet host times it again and
    replaces it; and a starved timing never replaces an entry the process had the CPUs for."""
    monkeypatch.setattr(tac_tuning, "machine_load", lambda: (9.0, 2))
    starved = _ctx(tmp_path, cpu_clock=_stopped_clock, retune_noisy=1)
    sel = starved.select(SMALL)
    assert sel.starved and sel.cpu_per_wall == 0.0 and sel.noisy
    path = next((tmp_path / "tactics").glob("gemm-*.json"))
    entry = json.loads(path.read_text())
    assert entry["starved"] is True and entry["cpu_per_wall"] == 0.0 and entry["load"] == 9.0 and entry["cores"] == 2
    assert "timed starved (0.00 CPU-s per wall-s)" in tac.timing_doubts(sel, (ATEN,))

    path.write_text(json.dumps(dict(entry, tries=2)))         # its noisy re-timings are spent
    busy = _ctx(tmp_path, retune_noisy=1, cpu_clock=_full_clock)
    assert busy.select(SMALL).from_cache and busy.stats["timing_runs"] == 0     # deferred: the host is busy

    monkeypatch.setattr(tac_tuning, "machine_load", lambda: (0.5, 2))
    quiet = _ctx(tmp_path, retune_noisy=1, cpu_clock=_full_clock)
    fresh = quiet.select(SMALL)
    assert quiet.stats["timed_shapes"] == 1 and not fresh.starved and fresh.cpu_per_wall == pytest.approx(1.0, rel=0.01)
    replaced = json.loads(path.read_text())
    assert replaced["starved"] is False and replaced["tries"] == 3 and replaced["load"] == 0.5
    frozen = _ctx(tmp_path, retune_noisy=0)                  # an artifact's context never re-times
    path.write_text(json.dumps(dict(entry, tries=2)))
    assert frozen.select(SMALL).from_cache and frozen.stats["timing_runs"] == 0

    noisy_quiet = dict(replaced, noisy=True, tries=1)        # not starved, but its samples disagreed
    path.write_text(json.dumps(noisy_quiet))
    retry = _ctx(tmp_path, cpu_clock=_stopped_clock, retune_noisy=1)
    kept = retry.select(SMALL)
    assert retry.stats["timed_shapes"] == 1 and kept.from_cache and not kept.starved
    after = json.loads(path.read_text())
    assert after["starved"] is False and after["timings_s"] == noisy_quiet["timings_s"] and after["tries"] == 2


@needs_cxx
def test_cached_winner_is_rechecked_by_its_output_digest(tmp_path, monkeypatch):
    """A timing cache hit runs its winner once more. Output bits equal to those that passed
    when it was timed pass without running ATen (a warm start's checks were a third of it);
    other bits (another weight under the same key, an entry without or with a wrong digest)
    are compared with ATen as before."""
    ctx = _ctx(tmp_path)
    sel = ctx.select(SMALL)
    path = next((tmp_path / "tactics").glob("gemm-*.json"))
    entry = json.loads(path.read_text())
    generated = [n for n in sel.timings_s if n != ATEN]
    assert generated and set(entry["digests"]) == set(generated)      # every candidate that passed
    fastest = dict(entry["timings_s"], **{ATEN: 1.0}, **{generated[0]: 1e-9})
    path.write_text(json.dumps(dict(entry, timings_s=fastest)))      # a generated winner, whatever timed best

    refs: list[int] = []
    real = candidates.aten_gemm
    monkeypatch.setattr(candidates, "aten_gemm", lambda *a: (refs.append(1), real(*a))[1])

    def hit(**kw) -> tac.Selection:
        c = _ctx(tmp_path)
        got = c.select(SMALL, **kw)
        assert got.from_cache and got.winner == generated[0] and c.stats["checks"] == 1
        return got

    hit()
    assert refs == []                                   # same bits: ATen did not run
    hit(b=torch.randn(SMALL.n, SMALL.k))
    assert len(refs) == 1                               # another weight: compared with ATen, passes
    for digests in ({}, {generated[0]: "0" * 32}):
        path.write_text(json.dumps(dict(entry, timings_s=fastest, digests=digests)))
        hit()
    assert len(refs) == 3


@needs_cxx
def test_heuristic_does_no_timing(tmp_path):
    ctx = _ctx(tmp_path, policy="heuristic")
    sel = ctx.select(SMALL)
    assert ctx.stats["timing_runs"] == 0 and not sel.timings_s
    assert sel.winner == ctx.candidates(SMALL)[1]          # the first generated configuration
    assert not list((tmp_path / "tactics").glob("*.json"))
    f64 = GemmProblem("linear", 1, 4, 8, 8, dtype="f64")
    assert ctx.candidates(f64) == [ATEN]


def test_unknown_policy(tmp_path):
    with pytest.raises(BackendError, match="latency_first"):
        TacticsContext(tmp_path, 2, policy="fastest", simd=[], llc_bytes=1)


@needs_cxx
def test_failing_candidate_is_rejected(tmp_path, monkeypatch):
    """A kernel that returns without computing anything would be the fastest candidate; it
    fails the check against ATen and may not win, under either policy."""
    real = candidates.generate_gemm
    bad_cfg = GemmConfig("avx2", 6, 16, par="serial")   # SMALL is below the parallel threshold: all serial

    def broken(p, cfg, threads):
        s = real(p, cfg, threads)
        if cfg != bad_cfg:
            return s
        sym = s.symbol + "_broken"
        body = (f"GM_EXPORT void {sym}(void* p0, void* p1, void* p2, void* p3) {{ (void)p0; (void)p1; (void)p2; "
                f"(void)p3; }}\nGM_EXPORT void {sym}_packed(void** p) {{ {sym}(p[0], p[1], p[2], p[3]); }}\n")
        return KernelSource(symbol=sym, source=body, inputs=s.inputs, outputs=s.outputs, types=s.types,
                            kind="gemm")

    monkeypatch.setattr(candidates, "generate_gemm", broken)
    for policy in ("latency_first", "heuristic"):
        ctx = _ctx(tmp_path / policy, policy=policy, simd=["avx2", "fma"],
                   configs={"avx2": [bad_cfg, GemmConfig("avx2", 4, 24)]})
        sel = ctx.select(SMALL)
        assert bad_cfg.name in sel.rejected and "rel L2" in sel.rejected[bad_cfg.name]
        assert sel.winner != bad_cfg.name and bad_cfg.name not in sel.timings_s
        assert ctx.stats["rejected"] >= (1 if policy != "heuristic" else 0)
        if policy == "heuristic":
            assert sel.winner == ATEN


@needs_cxx
def test_throughput_policy_and_report(tmp_path):
    ctx = _ctx(tmp_path, policy="throughput_first")
    p = GemmProblem("matmul", 4, 9, 21, 13, b_packed=False, b_batched=True)
    sel = ctx.select(p)
    best = max(sel.timings_s, key=lambda n: p.flops / sel.timings_s[n])
    assert sel.winner == best
    rep = ctx.report()
    assert rep["policy"] == "throughput_first" and rep["gemms"][0]["gemm"] == p.text
    assert sel.text().startswith(p.text)


# ---- the executor path -------------------------------------------------------------------------

class _Mlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = torch.nn.Linear(24, 40)
        self.l2 = torch.nn.Linear(40, 17, bias=False)

    def forward(self, x):
        h = torch.nn.functional.gelu(self.l1(x))
        s = torch.matmul(h, h.transpose(-1, -2))          # batched runtime matmul
        return self.l2(h) + 0.5, s


def _recipe():
    from graphmode.recipe import load_recipe
    return load_recipe({"version": 1, "name": "gemm-test", "exe_mode": "graph", "targets": ["host"],
                        "inputs": [{"name": "x", "dtype": "f32", "shape": ["batch", "seq", 24]}],
                        "dims": {"batch": {"buckets": [2]}, "seq": {"buckets": [3, 17]}}})


@needs_cxx
def test_executor_with_tactics_matches_eager(tmp_path, monkeypatch):
    import graphmode
    from graphmode.backends.cpu.executor import CpuExecutable
    from graphmode.backends.cpu.build import builder_for

    torch.manual_seed(0)
    module = _Mlp().eval()
    cm = graphmode.compile(module, _recipe(), cache_dir=tmp_path, threads=2)
    for seq in (3, 17):
        x = torch.randn(2, seq, 24)
        with torch.inference_mode():
            ref = module(x)
        got = cm(x)                                     # the runtime's own executable (tactics on)
        for g, r in zip(got, ref):
            assert rel_l2(g, r) < 1e-5
        exe = cm.executable({"batch": 2, "seq": seq})
        assert exe.tactics is not None and exe.tactics_report["steps"]["total"] >= 3
        assert (tmp_path / "tactics").is_dir()
        # the heuristic policy puts a generated kernel on every GEMM: numerics still hold
        heur = CpuExecutable(exe.plan, cm.graph.constants, builder=builder_for(tmp_path / "kernels", 2),
                             threads=2, tactics="heuristic")
        rep = heur.tactics_report
        assert rep["steps"]["generated"] == rep["steps"]["total"] >= 3, rep
        lines = tac.report_lines(rep)
        assert lines[0].startswith("GEMM tactics (heuristic") and len(lines) == 1 + len(rep["gemms"])
        assert {g["shape"]["op"] for g in rep["gemms"]} == {"linear", "matmul"}
        out = heur.run({"x": x})
        for name, r in zip(exe.plan.outputs, ref):
            assert rel_l2(out[name], r) < 1e-5
        # a second executable over the same constants shares the packed weights, and its
        # checks read them: nothing is packed again
        packs: list[int] = []
        monkeypatch.setattr(tac_weights, "pack_b", lambda *a, **k: (packs.append(1), pack_b(*a, **k))[1])
        twin = CpuExecutable(exe.plan, cm.graph.constants, builder=builder_for(tmp_path / "kernels", 2),
                             threads=2, tactics="heuristic")
        shared = {k: h.t.data_ptr() for k, h in heur.tactics.packed.items()}
        assert shared and shared == {k: h.t.data_ptr() for k, h in twin.tactics.packed.items()}
        assert packs == [] and twin.tactics.stats["checks"] > 0
        monkeypatch.undo()
        off = CpuExecutable(exe.plan, cm.graph.constants, builder=builder_for(tmp_path / "kernels", 2),
                            threads=2, tactics=False)
        assert off.tactics is None and off.tactics_report == {}


def test_a_decode_gemv_is_offered_threads_for_its_weights_bytes_not_its_flops():
    """A batch-1 GEMV over a 576x576 f32 weight is 0.66 MFLOP (under PAR_FLOPS) but reads 1.3 MB:
    threaded and serial candidates are both timed; a small one stays serial."""
    from graphmode.backends.cpu.gemm import PAR_FLOPS, worth_threads
    from graphmode.backends.cpu.tactics.candidates import CONFIGS, candidate_names
    gemv, tiny = GemmProblem("linear", 1, 1, 576, 576), GemmProblem("linear", 1, 1, 64, 256)
    assert gemv.flops < PAR_FLOPS and worth_threads(gemv) and not worth_threads(tiny)
    names = candidate_names(gemv, simd=("avx512f", "avx2", "fma"), threads=2, configs=CONFIGS, generated=True)
    assert any(n.endswith("_serial") for n in names) and any(not n.endswith("_serial") for n in names[1:])
    names = candidate_names(tiny, simd=("avx512f", "avx2", "fma"), threads=2, configs=CONFIGS, generated=True)
    assert all(n.endswith("_serial") for n in names[1:])
