"""A GEMM that differs from one tuned before only in its epilogue keeps the candidates that ran
near the lead's best: the best of the candidates it may run, not of the lead's."""
from __future__ import annotations

from dataclasses import replace

from graphmode.backends.cpu.epilogue import Epilogue
from graphmode.backends.cpu.gemm import GemmProblem
from graphmode.backends.cpu.tactics import ATEN, Selection
from graphmode.backends.cpu.tactics.candidates import CONFIGS, candidate_names
from graphmode.backends.cpu.tactics.narrowing import SIBLING_MARGIN, sibling_exclusions

# a SwiGLU up projection: C (the gate's buffer) is an operand of its epilogue, silu(gate) * acc
UP = GemmProblem("linear", 1, 1, 1536, 576)
SWIGLU = Epilogue(stmts=("res = {ACC} * ({0} / (1.0f + expf(-{0})));",), kinds=("full",), operands=("gate",))
UP_SWIGLU = replace(UP, epi=SWIGLU, c_aliases_operand=True)


def names(p: GemmProblem) -> list[str]:
    return candidate_names(p, simd=("avx512f", "avx2", "fma"), threads=2, configs=CONFIGS, generated=True)


def test_an_aliasing_epilogue_rules_out_k_blocks():
    lead, follower = names(UP), names(UP_SWIGLU)
    blocked = [n for n in lead if "_k256_" in n]
    assert blocked and not set(blocked) & set(follower)
    assert len([n for n in follower if n != ATEN]) >= 2


def test_a_k_blocked_lead_winner_does_not_rule_out_every_kernel_the_follower_may_run():
    lead_names, follower = names(UP), names(UP_SWIGLU)
    unblocked = [n for n in follower if n != ATEN]
    # the lead's best is a K-blocked kernel the follower may not run; the follower's own
    # candidates ran 1.10x and 1.26x that (as a Llama's up projection did, 2026-12-07)
    times = {ATEN: 337e-6}
    times.update({n: 90e-6 for n in lead_names if "_k256_" in n})
    times.update({n: (99e-6 if i == 0 else 113e-6) for i, n in enumerate(unblocked)})
    out = sibling_exclusions(follower, Selection(UP, winner=min(times, key=times.get), policy="latency_first",
                                                 timings_s=times))
    kept = [n for n in follower if n not in out]
    assert unblocked[0] in kept and ATEN in kept, out
    assert all(times[n] > SIBLING_MARGIN * times[unblocked[0]] for n in out)


def test_a_lead_timed_on_none_of_the_followers_candidates_narrows_nothing():
    lead_names, follower = names(UP), names(UP_SWIGLU)
    times = {n: 90e-6 for n in lead_names if "_k256_" in n}
    assert sibling_exclusions(follower, Selection(UP, winner=next(iter(times)), policy="latency_first",
                                                  timings_s=times)) is None
