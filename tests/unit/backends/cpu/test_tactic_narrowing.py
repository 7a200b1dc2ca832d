"""A GEMM that differs from one tuned before only in its epilogue keeps the candidates that ran
near the lead's best: the best of the candidates it may run, not of the lead's."""
from __future__ import annotations

from dataclasses import replace

import torch

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


def _step(p):
    """A stand-in plan step of shape `p` over one constant weight (what within_workspace reads)."""
    import types
    return types.SimpleNamespace(b=torch.zeros(1))


def test_a_conv_winner_whose_workspace_the_budget_cannot_hold_gives_way_to_one_that_fits():
    """A drafted CNN recipe (budget 4 MB: weights, prepared copies and a 3 MB arena at batch
    32, +25%) ran an im2col winner with a 3.3 MB workspace: 6.5 MB held, a memory violation the
    monitor counted and nothing before it refused (trial S). Now the fastest candidate that
    fits in what the budget leaves runs, else ATen; each loser says why."""
    from graphmode.backends.cpu.conv import ConvProblem
    from graphmode.backends.cpu.tactics.narrowing import within_workspace, workspace_bytes
    conv = ConvProblem(32, 3, 32, 32, 16, 3, 3, (1, 1), (1, 1), bias=True)
    cands = [n for n in names(conv) if n != ATEN]
    by_ws = sorted(cands, key=lambda n: workspace_bytes(conv, n))
    small, big = by_ws[0], by_ws[-1]
    assert workspace_bytes(conv, big) > 2 * workspace_bytes(conv, small) > 0
    times = {ATEN: 3e-3, big: 1e-3, small: 2e-3}
    sel = Selection(conv, winner=big, policy="latency_first", timings_s=times)
    room = workspace_bytes(conv, big) + (2 << 20)
    assert within_workspace([sel], {conv: [_step(conv)]}, room)[0].winner == big     # it fits: unchanged
    tight = workspace_bytes(conv, small) + 10 * (2 << 10)
    out = within_workspace([sel], {conv: [_step(conv)]}, tight)[0]
    assert out.winner in (small, ATEN) and "memory.budget_mb" in out.rejected[big]
    if out.winner == small:
        assert workspace_bytes(conv, small) <= tight
    none = within_workspace([sel], {conv: [_step(conv)]}, 0)[0]
    assert none.winner == ATEN and workspace_bytes(conv, none.winner) == 0
    gemm = Selection(UP, winner=names(UP)[1], policy="latency_first", timings_s={})
    assert within_workspace([gemm], {UP: [_step(UP)]}, 0)[0] is gemm     # a GEMM binds no workspace
