"""Which candidates a plan rules out before anything is built or timed.

Each rule returns the excluded candidates of a shape with the reason (reported among the
shape's rejected candidates): the plan's weight budget (`weight_budget_exclusions`), the same
conv tuned before at batch 1 (`one_image_exclusions`), and a shape that differs from one
tuned before only in its epilogue (`sibling_exclusions`). ATen is never ruled out. After
timing, a conv winner whose workspace the memory budget cannot hold gives way to the next
that fits (`within_workspace`).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Mapping, Sequence

from graphmode.backends.cpu.conv import ConvProblem
from graphmode.backends.cpu.gemm import GemmProblem
from graphmode.backends.cpu.tactics.candidates import conv_config, conv_kind, prepared_bytes
from graphmode.backends.cpu.tactics.selection import Selection
from graphmode.backends.cpu.tactics.steps import ATEN, GemmStep

PACKING_SLACK = 1.25     # a prepared weight up to this multiple of its source is packing, not growth
BUDGET_SLACK_BYTES = 1 << 20   # tiny weights are not held to a ratio (an 8-column layer packs to 32 columns)
SUBPROBLEM_MARGIN = 1.25  # a batched conv keeps the candidates this close to the best at batch 1 ...
SUBPROBLEM_KEEP = 2       # ... at most this many
SIBLING_MARGIN = 1.10     # a GEMM/conv that differs from one tuned before only in its epilogue keeps the
SIBLING_KEEP = 2          # candidates this close to that one's best, at most this many

Exclusions = dict[GemmProblem, dict[str, str]]


def weight_budget_exclusions(by_problem: Mapping[GemmProblem, Sequence[GemmStep]],
                             candidates: Callable[[GemmProblem], list[str]],
                             weight_growth: float) -> tuple[Exclusions, int]:
    """The candidates whose prepared weights could take the plan past `weight_growth` x the
    bytes of the constant weights they are prepared from, and the budget in bytes. The plan's
    worst case (each shape at its largest remaining candidate) shrinks by dropping the largest
    candidates of the shape whose FLOPs per weight byte they add are fewest (a Winograd
    F(4x4) weight is 4x the conv's: on a 7x7 map it buys least), until it fits or no shape has
    a candidate more than PACKING_SLACK x its weight. Excluding before timing also keeps
    timing's transient buffers in the budget."""
    excluded: Exclusions = {}
    sizes: dict[GemmProblem, dict[str, int]] = {}
    own: dict[GemmProblem, int] = {}
    for p, steps in by_problem.items():
        if not p.b_packed:
            continue
        weights = {(s.b.data_ptr(), tuple(s.b.shape)): s.b for s in steps}
        own[p] = sum(t.numel() * t.element_size() for t in weights.values())
        per = {n: prepared_bytes(p, n) for n in candidates(p)}
        sizes[p] = {n: own[p] if b is None else b * len(weights) for n, b in per.items()}
    budget = weight_growth * sum(own.values()) + BUDGET_SLACK_BYTES

    def worst() -> int:
        return sum(max(v.values()) for v in sizes.values() if v)
    def extra(q: GemmProblem) -> int:       # what the largest remaining candidate adds over the weight
        return max(sizes[q].values()) - own[q]
    while sizes and worst() > budget:
        # packing pads a weight to whole panels (a few %): only a real growth is worth a candidate
        shrinkable = [q for q in sizes if extra(q) > (PACKING_SLACK - 1) * own[q]]
        if not shrinkable:
            break
        p = min(shrinkable, key=lambda q: q.flops / max(extra(q), 1))    # FLOPs per byte it adds
        top = max(sizes[p].values())
        for n in [n for n, b in sizes[p].items() if b == top]:
            del sizes[p][n]
            excluded.setdefault(p, {})[n] = (
                f"its prepared weights ({top / 2**20:.1f} MiB) would take the plan past "
                f"memory.weight_growth {weight_growth:g}x the model's weights")
    return excluded, int(budget)


def one_image_exclusions(candidates: Sequence[str], names_at_one: Sequence[str],
                         cached_at_one: Mapping[str, Any]) -> dict[str, str] | None:
    """A conv over a batch keeps only the generated candidates of the algorithms (Winograd
    F(4x4), F(2x2), im2col) within SUBPROBLEM_MARGIN of the best (at most SUBPROBLEM_KEEP)
    in `cached_at_one`, the timing cache's entry of the same conv at batch 1 (a smaller bucket
    of the plan, tuned before, over candidates `names_at_one`), plus ATen: the others are
    neither built nor timed. An algorithm's cost is per image, so one image ranks them; the
    blocking within one (the tile chunk follows the batch's tile count) and the survivors are
    still checked and timed at the real batch. (A ResNet-18 batch-8 bucket built ~60
    candidate kernels, 10 s of its 19 s.) None when the entry ranks no algorithm."""
    by_kind: dict[str, float] = {}
    for n, t in cached_at_one["timings_s"].items():
        if n != ATEN and n in names_at_one and n not in cached_at_one["rejected"] and t > 0:
            by_kind[conv_kind(n)] = min(t, by_kind.get(conv_kind(n), t))
    if not by_kind:
        return None
    best = min(by_kind.values())
    keep = sorted((k for k, t in by_kind.items() if t <= SUBPROBLEM_MARGIN * best), key=by_kind.get)
    keep = keep[:SUBPROBLEM_KEEP]
    out: dict[str, str] = {}
    for n in candidates[1:]:
        k = conv_kind(n)
        if k not in keep:
            out[n] = (f"{k} ran {by_kind[k] / best:.2f}x the best at batch 1 (timing cache)" if k in by_kind
                      else f"{k} was no contender at batch 1 (timing cache)")
    return out


def sibling_exclusions(candidates: Sequence[str], lead: Selection) -> dict[str, str] | None:
    """A shape that is `lead.problem` but for its epilogue (applied at the store: the same cost
    for every candidate) keeps only the generated candidates that ran within SIBLING_MARGIN of
    the best in `lead`'s timing (at most SIBLING_KEEP), plus ATen: the others are neither built
    nor timed. The survivors are still checked and timed with the real epilogue. (ResNet-18's
    eleven 3x3 stride-1 convs are four shapes.) The best is the best of `candidates`: a
    blocking the epilogue rules out (K blocks where C is an epilogue operand, a SwiGLU's up
    projection written over its gate) is no yardstick; measured against one, every kernel that
    may run was dropped and a Llama's up projection fell back to ATen at 3.7x the time. None
    when `lead` has no timing of a candidate."""
    times = {n: t for n, t in lead.timings_s.items() if t > 0 and n not in lead.rejected and n in candidates}
    if not times:
        return None
    best = min(times.values())
    keep = sorted((n for n, t in times.items() if n != ATEN and t <= SIBLING_MARGIN * best), key=times.get)
    keep = keep[:SIBLING_KEEP]
    return {n: (f"ran {times[n] / best:.2f}x the best for {lead.problem.text} (the same but for the epilogue)"
                if n in times else f"was no contender for {lead.problem.text} (the same but for the epilogue)")
            for n in candidates[1:] if n not in keep}




def workspace_bytes(p: GemmProblem, name: str) -> int:
    """The conv workspace candidate `name` binds for `p` (0: ATen, a GEMM, a conv that needs none)."""
    if name == ATEN or not isinstance(p, ConvProblem):
        return 0
    return conv_config(name).workspace_numel(p) * 4


def within_workspace(selections: Sequence[Selection], by_problem: Mapping[GemmProblem, Sequence[GemmStep]],
                     memory_left: int | None) -> list[Selection]:
    """The selections with every conv winner whose workspace does not fit what the memory
    budget leaves (`memory_left`: budget - weights - the plan's arena) after the winners'
    prepared weights replaced by its fastest timed candidate whose workspace fits and whose
    prepared weight is no larger (else ATen, which needs neither), as TensorRT keeps tactics
    inside its workspace limit. One buffer serves every conv of a plan (weights.py), so the
    largest winner's workspace is what the plan holds. `by_problem`: each shape's steps (a
    prepared copy per distinct constant weight); `memory_left` None: no limit."""
    if memory_left is None:
        return list(selections)
    weights_of = {p: len({(s.b.data_ptr(), tuple(s.b.shape)) for s in steps}) for p, steps in by_problem.items()}
    prepared = sum((prepared_bytes(s.problem, s.winner) or 0) * weights_of.get(s.problem, 1) for s in selections)
    left = memory_left - prepared
    out = []
    for sel in selections:
        p, need = sel.problem, workspace_bytes(sel.problem, sel.winner)
        if need <= max(left, 0):
            out.append(sel)
            continue
        own = prepared_bytes(p, sel.winner) or 0
        fits = [n for n, _ in sorted(sel.timings_s.items(), key=lambda kv: kv[1])
                if n not in sel.rejected and workspace_bytes(p, n) <= max(left, 0)
                and (prepared_bytes(p, n) or 0) <= own]
        why = (f"its workspace ({need / 2**20:.2f} MiB) would take the plan past memory.budget_mb "
               f"({max(left, 0) / 2**20:.2f} MiB left after the weights, their prepared copies and the activations)")
        out.append(replace(sel, winner=fits[0] if fits else ATEN, rejected={**sel.rejected, sel.winner: why}))
    return out


__all__ = ["weight_budget_exclusions", "one_image_exclusions", "sibling_exclusions", "within_workspace",
           "workspace_bytes", "PACKING_SLACK", "BUDGET_SLACK_BYTES", "SUBPROBLEM_MARGIN", "SUBPROBLEM_KEEP",
           "SIBLING_MARGIN", "SIBLING_KEEP"]
