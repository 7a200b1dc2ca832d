"""The loop schedule of the generated kernels (graphmode/backends/cpu/omp_loops.py): which loops
the policy makes claimable and with what chunk, the recipe field and build flag that choose
the schedule, and kernels built static, dynamic and guided giving bit-identical results (each
iteration writes its own outputs). Nothing here asserts on a timing.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch

from graphmode.backends.cpu.backend import CpuBackend
from graphmode.backends.cpu.build import KernelBuilder, builder_for
from graphmode.backends.cpu.catalog import native_source
from graphmode.backends.cpu.gemm import GemmConfig, GemmProblem, chunks_for, generate_gemm
from graphmode.backends.cpu.kernels import run_with_tensors
from graphmode.backends.cpu.omp_loops import (MAX_CHUNKS, MIN_CHUNK_WORK, MIN_CHUNKS, SCHEDULES, chunk_for,
                                              claim_loops, omp_for, resolve_schedule, schedule_flags)
from graphmode.backends.reference import ReferenceBackend
from graphmode.errors import BackendError, RecipeErrors
from graphmode.recipe import load_recipe
from graphmode.recipe.hashing import canonical_json
from graphmode.runtime.build import backend_options

_PROBE = KernelBuilder(Path(tempfile.gettempdir()) / "graphmode-test-probe")
needs_cxx = pytest.mark.skipif(not _PROBE.compiler_available(), reason="no C++ compiler on this machine")
G = torch.Generator().manual_seed(0)


def test_which_loops_are_claimable_and_their_chunk():
    assert chunk_for(MIN_CHUNKS - 1, None) is None                 # too few iterations to balance
    assert chunk_for(16, None) == 1
    assert chunk_for(6400, None) == 6400 // MAX_CHUNKS              # at most MAX_CHUNKS claims
    assert chunk_for(64, 64 * MIN_CHUNK_WORK) == 1                  # each iteration a chunk's worth
    assert chunk_for(64, 16 * MIN_CHUNK_WORK) == 4                  # 4 iterations make a chunk
    assert chunk_for(64, 4 * MIN_CHUNK_WORK) is None                # 4 chunks: too few, static
    assert chunk_for(48, None, align=4) == 4                        # whole groups of 4
    assert chunk_for(24, None, align=4) is None                     # 6 groups only
    assert omp_for(4) == "#pragma omp parallel for schedule(static) num_threads(gm_nt())"
    assert omp_for(32, collapse=2, simd=True) == \
        "#pragma omp parallel for simd collapse(2) schedule(GM_SCHED(1)) num_threads(gm_nt())"
    assert omp_for(32, region=False) == "#pragma omp for schedule(GM_SCHED(1))"
    assert omp_for(4, fixed="dynamic, 1", threads="T") == "#pragma omp parallel for schedule(dynamic, 1) num_threads(T)"


def test_gemm_tasks_are_split_finer_where_panels_allow():
    """(units, panels, threads) -> panel chunks per unit: a multiple of the per-thread split, up to
    MIN_CHUNKS tasks (so a dynamic schedule has chunks to claim), never more than the panels."""
    assert chunks_for(1, 12, 2) == 8 and chunks_for(1, 4, 2) == 4 and chunks_for(1, 1, 2) == 1
    assert chunks_for(3, 12, 2) == 4                # 12 tasks: a multiple of 2 threads
    assert chunks_for(16, 12, 2) == 1 and chunks_for(1, 12, 1) == 1


def test_auto_builds_the_pool_only_where_openmp_threads_sleep_soon():
    from graphmode.backends.cpu.omp_loops import DEFAULT_SCHEDULE, auto_schedule
    assert DEFAULT_SCHEDULE == "claim"
    for env in ({"GOMP_SPINCOUNT": "1000"}, {"OMP_WAIT_POLICY": "passive"}, {"OMP_WAIT_POLICY": "PASSIVE "},
                {"GOMP_SPINCOUNT": "0"}):
        assert auto_schedule(env) == "claim", env
    for env in ({}, {"GOMP_SPINCOUNT": "300000"}, {"GOMP_SPINCOUNT": "infinite"}, {"OMP_WAIT_POLICY": "active"},
                {"GOMP_SPINCOUNT": "-5"}):    # torch's team spins for ms after each ATen op: kernels share it
        assert auto_schedule(env) == "dynamic", env


def test_schedule_names_and_flags():
    assert resolve_schedule(None) == resolve_schedule("auto") in SCHEDULES
    assert schedule_flags("static") == ()
    assert schedule_flags("dynamic") == ("-DGM_SCHEDULE_DYNAMIC",)
    assert schedule_flags("guided") == ("-DGM_SCHEDULE_GUIDED",)
    assert schedule_flags("claim") == ("-DGM_SCHEDULE_CLAIM",)
    with pytest.raises(BackendError, match="unknown loop schedule") as e:
        KernelBuilder(tempfile.gettempdir(), schedule="fair")
    assert e.value.where == "codegen.schedule" and "dynamic" in e.value.fix
    root = Path(tempfile.gettempdir()) / "graphmode-test-omp-loops"
    assert builder_for(root, 2, None, "dynamic") is builder_for(root, 2, None, "dynamic") \
        is not builder_for(root, 2, None, "static")


def _recipe(schedule: str | None = None):
    r = {"version": 1, "name": "sched", "inputs": [{"name": "input", "dtype": "f32", "shape": ["batch", 16]}],
         "dims": {"batch": {"buckets": [4]}}, "codegen": {"kernel_selection": "heuristic"}}
    if schedule is not None:
        r["codegen"]["schedule"] = schedule
    return load_recipe(r)


def test_recipe_field():
    plain = _recipe()
    assert plain.codegen.schedule == "auto" and '"schedule":' not in canonical_json(plain)   # old stamps hold
    assert _recipe("auto").hash() == plain.hash() != _recipe("dynamic").hash() != _recipe("guided").hash()
    with pytest.raises(RecipeErrors, match="codegen.schedule"):
        _recipe("fair")
    # the field reaches a backend that generates kernels only, and only when set
    assert backend_options(CpuBackend(), _recipe("dynamic"))["schedule"] == "dynamic"
    assert "schedule" not in backend_options(CpuBackend(), plain)
    assert "schedule" not in backend_options(ReferenceBackend(), _recipe("dynamic"))


def _kernels():
    """(source, inputs by name) of kernels with a claimable loop, one per generator family."""
    out = []

    def native(op, ins, out_shape, attrs, dtype=torch.float32):
        names = [f"in{i}" for i in range(len(ins))]
        ks = native_source(op, ins, [torch.empty(out_shape, dtype=dtype)], attrs, {}, names, ["out"])
        assert ks is not None, op
        out.append((ks, dict(zip(names, ins))))

    x = torch.randn(1, 64, 112, 112, generator=G)
    native("max_pool2d", [x], (1, 64, 56, 56), {"kernel": [3, 3], "stride": [2, 2], "padding": [1, 1],
                                                "dilation": 1, "ceil_mode": False})                  # pool.py
    native("cast", [x], x.shape, {"dtype": "f64"}, torch.float64)                                    # movement.py
    q, k, v = (torch.randn(1, 16, 64, 32, generator=G) for _ in range(3))
    native("sdpa", [q, k, v], (1, 16, 64, 32), {"is_causal": True, "scale": None})                   # attention.py
    p = GemmProblem("matmul", 16, 64, 64, 64, b_packed=False, b_batched=True)                      # gemm.py
    src = generate_gemm(p, GemmConfig("portable", 4, 16, 0, 0), threads=2)
    out.append((src, {"a": torch.randn(16, 64, 64, generator=G), "b": torch.randn(16, 64, 64, generator=G)}))
    return out


def _same_bits(kernels, tmp_path, schedules) -> None:
    """Build `kernels` once per schedule: every output bit for bit the static build's, and each
    library calls the libgomp loop entry of its schedule (the flag reached the compiler)."""
    for src, _ in kernels:
        assert "schedule(GM_SCHED(" in src.source, src.pattern
    results = {}
    for sched in ("static", *schedules):
        b = KernelBuilder(tmp_path / sched, threads=2, schedule=sched)
        built = b.build_many([s for s, _ in kernels])
        text = b.library_path([s for s, _ in kernels]).read_bytes()
        if sched == "claim":       # loops the pool takes call it; those inside a region stay dynamic
            assert b"gm_set_pool" in text and b"GOMP_loop_nonmonotonic_guided_start" not in text
        else:
            assert (b"GOMP_loop_nonmonotonic_dynamic_start" in text) == (sched == "dynamic"), sched
            assert (b"GOMP_loop_nonmonotonic_guided_start" in text) == (sched == "guided"), sched
        results[sched] = [run_with_tensors(built[s.symbol], dict(ins), source=s) for s, ins in kernels]
    for sched in schedules:
        for (src, _), a, b in zip(kernels, results["static"], results[sched]):
            for name in a:
                assert a[name].shape == b[name].shape
                assert torch.equal(a[name].contiguous().view(torch.uint8), b[name].contiguous().view(torch.uint8)), \
                    (src.pattern, sched)


@needs_cxx
def test_static_and_dynamic_builds_are_bit_identical(tmp_path):
    _same_bits(_kernels(), tmp_path, ("dynamic",))


@needs_cxx
def test_claim_builds_are_bit_identical(tmp_path):
    """The claim schedule's loops run on the work-claiming pool (claim_pool.py): same bits."""
    from graphmode.backends.cpu import claim_pool
    kernels = _kernels()
    rewritten = [claim_loops(s.source)[1] for s, _ in kernels]
    assert rewritten == [1, 1, 1, 1], rewritten    # the pool, cast, attention (a region) and GEMM loops
    _same_bits(kernels, tmp_path, ("claim",))
    assert claim_pool.stats()["jobs"] > 0


@needs_cxx
@pytest.mark.slow
def test_guided_builds_are_bit_identical(tmp_path):
    _same_bits(_kernels(), tmp_path, ("guided",))


def test_bench_variant_is_a_schedule():
    """`graphmode bench --engines "graphmode,graphmode[dynamic]"`: a variant of the graphmode engine
    is a loop schedule; another is refused as unavailable before anything is compiled."""
    from graphmode.bench.engines import EngineUnavailable, GraphmodeEngine, parse_engines
    assert parse_engines("graphmode,graphmode[dynamic]") == [("graphmode", None), ("graphmode", "dynamic")]
    assert GraphmodeEngine("dynamic").label == "graphmode[dynamic]"
    with pytest.raises(EngineUnavailable, match="loop schedule"):
        GraphmodeEngine("fair").setup(None, {}, {})
