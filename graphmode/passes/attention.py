"""Decomposed attention as rewrite rules (the fuse pass's first step): the block

    matmul(softmax(mask(scale(matmul(q', k^T))), -1), v)

becomes one `sdpa(q, k, v[, mask]) {scale}` node, for the forms eager code writes:

- scale: `* c`, `c *` or `/ c` by a scalar constant on the scores, on q, on k or on k^T;
  the factors multiply into sdpa's `scale`;
- key: `k^T` as a permute of k (reused, or permuted back when the permute is not the plain
  last-two swap), or any value (permuted back by a new node);
- mask: none; additive `+ mask` (float, any broadcastable shape); `where(keep, s, -inf)`
  -> a bool mask; `where(drop, -inf, s)` (masked_fill) -> `logical_not(drop)`; and
  finite fills of at most -1e4 (`-1e9`, `-10000`, `finfo.min`), as `where(keep, s, fill)` or
  masked_fill `where(drop, fill, s)` -> the additive mask `where(keep, 0, fill)` (one per
  mask and fill, shared by every layer that uses them);
- grouped-query attention: k and v may have fewer heads than q (size-1 batch dims that
  broadcast to q's, as in multi-query attention), or be repeated to q's heads
  (expand + reshape) before the block: sdpa broadcasts the same way matmul did.

Why the finite fills are exact: a masked score s becomes `s*scale + fill` instead of
`fill`. On a row with an attended key both weigh exp(<= -1e4) = 0. On a row with none
(every key masked) the original averages v uniformly; so does the rewrite whenever
`s*scale + fill` rounds to `fill`, which holds for `finfo.min` (|s| < 1e31) and -1e9
(|s| < 32) — with -10000 such a row follows the scores instead. A -inf fill gives NaN on
such rows where torch's sdpa gives 0: every sdpa made here is `nan_empty_rows`, so the
rewrite answers what the softmax written out answers.

Every intermediate must have one reader (the block is rewritten whole or not at all); the
nodes the block consumed are erased by the engine.

Then, on every sdpa (made here or captured): `attention_heads_layout` folds the heads/seq
swaps around it — permute [0, 2, 1, 3] on each of q, k and v, and on the result when that is
its only reader — into `layout: bshd`, where q, k, v and the result stay [batch, seq, heads,
dim] as the projections write them. BERT- and GPT-style layers permute four times per layer
only to get heads first; the kernel reads the rows strided instead (MiniLM (8,128): 24
copies, 1.1 ms of 55 ms).
"""
from __future__ import annotations

import math

import torch

from graphmode.errors import IRError
from graphmode.ir.ops import broadcast_shapes
from graphmode.ir.types import FLOAT_DTYPES, same_dims
from graphmode.passes.pattern import Match, Pat
from graphmode.passes.rewrite import Rewriter, Rule, RuleSet

LARGE_NEGATIVE = -1e4    # a fill at most this masks like -inf: exp(fill - max) is 0 in every float dtype


def _scalar_factor(tag: str):
    def check(m: Match) -> bool:
        c = m.scalar(tag)
        node = m.node(f"{tag}_op")
        if c is None or c == 0 or not math.isfinite(c) or node is None:
            return False
        data = node.inputs[1] if node.inputs[0] == m[tag] else node.inputs[0]
        return m.view.type_of(data).matches(m.view.type_of(node.outputs[0]))   # the constant broadcasts nothing
    return check


def scaled(inner: Pat, tag: str, name: str | None = None) -> Pat:
    """`inner`, or `inner` times / divided by a nonzero scalar constant bound as `tag`."""
    c = Pat.const(tag)
    return Pat.either(Pat("mul", inner, c, commute=True, single_use=True, name=f"{tag}_op", where=_scalar_factor(tag)),
                      Pat("div", inner, c, single_use=True, name=f"{tag}_op", where=_scalar_factor(tag)),
                      inner, name=name)


def factor(m: Match, tag: str) -> float:
    node = m.node(f"{tag}_op")
    if node is None:
        return 1.0
    c = m.scalar(tag)
    return c if node.op == "mul" else 1.0 / c


_KEY = Pat.either(Pat("permute", scaled(Pat.var("k"), "k_scale"), name="k_perm", single_use=True),
                  Pat("permute", scaled(Pat.var("k"), "k_scale"), name="k_perm"),
                  scaled(Pat.var("kt"), "kt_scale"))
SCORES = scaled(Pat("matmul", scaled(Pat.var("q"), "q_scale"), _KEY, name="mm1", single_use=True), "s_scale",
                name="scores")


def _row_softmax(m: Match) -> bool:
    dim, rank = m.node("sm").attrs.get("dim"), m.type("sm").rank
    return rank >= 1 and dim in (-1, rank - 1)


def attention(logits: Pat) -> Pat:
    """matmul([identity](softmax(logits, -1)), v)."""
    sm = Pat("softmax", logits, name="sm", single_use=True, where=_row_softmax)
    return Pat("matmul", Pat.either(Pat("identity", sm, single_use=True), sm), Pat.var("v"), name="root",
               where=lambda m: m["v"] != m.root.inputs[0])


def _key(rw: Rewriter, m: Match) -> str:
    """k ([.., Lk, D]) from what the first matmul read as k^T."""
    kt = m.node("mm1").inputs[1]
    perm = m.node("k_perm")
    if perm is not None:
        rank = len(perm.attrs["perm"])
        p = [d + rank if d < 0 else d for d in perm.attrs["perm"]]
        back = p[:-2] + [p[-1], p[-2]]
        if back == list(range(rank)):
            return m["k"]
        return rw.add("permute", [m["k"]], {"perm": back}, name=rw.fresh(f"{kt}_k"))
    rank = m.type("kt").rank
    swap = list(range(rank - 2)) + [rank - 1, rank - 2]
    return rw.add("permute", [m["kt"]], {"perm": swap}, name=rw.fresh(f"{kt}_k"))


def _fits(rw: Rewriter, m: Match, k: str) -> bool:
    """q, k, v make an sdpa whose result is the root's: float, equal ranks, k/v batch dims
    that broadcast to q's, matching head dims."""
    tq, tk, tv, tout = m.type("q"), rw.type_of(k), m.type("v"), m.type("root")
    if not (tq.rank == tk.rank == tv.rank >= 2) or tq.dtype not in FLOAT_DTYPES:
        return False
    if not tq.dtype == tk.dtype == tv.dtype == tout.dtype:
        return False
    try:
        batch = broadcast_shapes(tq.shape[:-2], tk.shape[:-2], tv.shape[:-2])
    except IRError:
        return False
    return (same_dims(batch, tq.shape[:-2]) and same_dims(tq.shape[-1:], tk.shape[-1:])
            and same_dims(tk.shape[-2:-1], tv.shape[-2:-1])
            and tout.matches(tq.with_shape(tq.shape[:-1] + tv.shape[-1:])))


def _sdpa(rw: Rewriter, m: Match, mask: str | None = None) -> str | None:
    if mask is not None and mask in (m["q"], m.node("mm1").inputs[1], m["v"]):
        return None
    k = _key(rw, m)
    if not _fits(rw, m, k):
        return None
    scale = factor(m, "s_scale") * factor(m, "q_scale") * factor(m, "k_scale") * factor(m, "kt_scale")
    return rw.add("sdpa", [m["q"], k, m["v"]] + ([mask] if mask is not None else []),
                  {"is_causal": False, "scale": scale, "nan_empty_rows": True})


def _logits_keep_scores(m: Match) -> bool:
    """The mask op's result has the scores' type: the mask broadcasts into them, not them up."""
    return m.type("logits").matches(m.type("scores"))


def _additive(rw: Rewriter, m: Match) -> str | None:
    if m.type("mask").dtype != m.type("logits").dtype:
        return None
    return _sdpa(rw, m, m["mask"])


class _FillMasks:
    """Builds (once per condition, fill and orientation) the mask sdpa takes for a `where`."""

    def __init__(self):
        self.made: dict[tuple, str] = {}

    def __call__(self, rw: Rewriter, m: Match, keep: bool) -> str | None:
        fill = m.scalar("fill")
        dtype = m.type("logits").dtype
        if fill is None or m.type("cond").dtype != "bool" or not (fill == -math.inf or fill <= LARGE_NEGATIVE):
            return None
        key = (m["cond"], fill, keep, dtype)
        mask = self.made.get(key)
        if mask is None or rw.index_of(mask) is None:      # not made yet, or not before this block
            if fill == -math.inf:
                mask = m["cond"] if keep else rw.add("logical_not", [m["cond"]], name=rw.fresh(f"{m['cond']}_keep"))
            else:
                zero = rw.add_const(f"{m['cond']}_zero", torch.zeros((), dtype=rw.constant(m["fill"]).dtype))
                mask = rw.add("where", [m["cond"], zero, m["fill"]] if keep else [m["cond"], m["fill"], zero],
                              name=rw.fresh(f"{m['cond']}_additive"))
                if rw.type_of(mask).dtype != dtype:
                    return None
        out = _sdpa(rw, m, mask)
        if out is not None and mask != m["cond"]:
            self.made[key] = mask
        return out


HEAD_SWAP = [0, 2, 1, 3]


def _is_head_swap(perm) -> bool:
    return [d + 4 if d < 0 else d for d in perm or ()] == HEAD_SWAP


def _head_swap(rw: Rewriter, value: str):
    """The permute [0, 2, 1, 3] that made `value`, or None."""
    p = rw.producer(value)
    if p is None or p.op != "permute" or rw.type_of(value).rank != 4:
        return None
    return p if _is_head_swap(p.attrs.get("perm")) else None


def _heads_layout(rw: Rewriter, m: Match) -> str | None:
    """permute(sdpa(permute(q), permute(k), permute(v)[, mask]), [0, 2, 1, 3]), every permute
    the heads/seq swap -> sdpa(q, k, v[, mask]) {layout: bshd}: the kernel reads the heads in
    place (strided rows) instead of four copies per layer."""
    att = m.node("att")
    if att.attrs.get("layout", "bhsd") != "bhsd":
        return None
    perms = [_head_swap(rw, x) for x in att.inputs[:3]]
    if any(p is None for p in perms):
        return None
    for p in {id(p): p for p in perms}.values():
        if rw.single_use(p.outputs[0]):
            rw.claim(p)
    return rw.add("sdpa", [p.inputs[0] for p in perms] + list(att.inputs[3:]), {**att.attrs, "layout": "bshd"})


def rules(heads_layout: bool = True) -> RuleSet:
    """The attention rules, with a fresh cache of built masks (one per pass run); without
    `heads_layout` every sdpa stays heads-first (to_paged reads heads from its q, k, v)."""
    fill_mask = _FillMasks()
    layout = [Rule("attention_heads_layout",
                   Pat("permute", Pat("sdpa", name="att", single_use=True), name="root",
                       where=lambda m: m.type("root").rank == 4 and _is_head_swap(m.root.attrs.get("perm"))),
                   _heads_layout)] if heads_layout else []
    return RuleSet([
        Rule("attention", attention(SCORES), _sdpa),
        Rule("attention_additive_mask",
             attention(Pat("add", SCORES, Pat.var("mask"), commute=True, single_use=True, name="logits",
                           where=_logits_keep_scores)),
             _additive),
        Rule("attention_where_mask",
             attention(Pat("where", Pat.var("cond"), SCORES, Pat.const("fill"), single_use=True, name="logits",
                           where=_logits_keep_scores)),
             lambda rw, m: fill_mask(rw, m, keep=True)),
        Rule("attention_masked_fill",
             attention(Pat("where", Pat.var("cond"), Pat.const("fill"), SCORES, single_use=True, name="logits",
                           where=_logits_keep_scores)),
             lambda rw, m: fill_mask(rw, m, keep=False)),
    ] + layout)


def scores_written(graph) -> str:
    """`: written as matmul -> add -> maximum -> softmax`: the ops between the first softmax and
    the product that makes its scores (data movement left out), what the attention is instead."""
    made = graph.producers()
    soft = next((n for n in graph.nodes if n.op == "softmax"), None)
    chain, v = ["softmax"], soft.inputs[0] if soft is not None else None
    while v in made and len(chain) < 8:
        n = made[v]
        if n.op not in ("reshape", "permute", "expand", "cast", "contiguous"):
            chain.append(n.op)
        if n.op in ("matmul", "bmm", "einsum", "linear"):
            return ": written as " + " -> ".join(reversed(chain))
        v = n.inputs[0] if n.inputs else None
    return ""
