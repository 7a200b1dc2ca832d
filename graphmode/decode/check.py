"""The decode path against eager: what `graphmode verify` checks of a decoder recipe besides its
whole-sequence graph.

Two prompts of different lengths are decoded greedily together through the decode engine (the
paged graph, its KV cache at `memory.kv_cache.dtype`, the scheduler's batching); every step's
logits are compared with the eager model's at the same position, teacher-forced on the tokens the
engine chose (so one changed pick does not make every later step a different sequence). The
bound is the recipe's: f32's tolerance, a narrow KV cache's or narrow weights' wider one, and for
either narrow, no confident top-1 flip (numerics.Top1). A whole-sequence check alone passed an
f16 cache that drifted, or overflowed to NaN, only at decode time.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch

from graphmode.errors import GraphmodeNotice

from graphmode.verify.numerics import TOLERANCE, Top1, rel_l2, top1_agreement

MAX_NEW_TOKENS = 8


@dataclass
class DecodeCheck:
    prompts: list[int]                 # prompt lengths
    steps: int                         # logit rows compared (one per new token)
    rel_l2: float
    tolerance: float
    kv_dtype: str
    top1: Top1 | None = None           # judged where the KV cache or the weights are narrow
    worst_step: int = 0                # (prompt index, step) of the largest error, for the report
    worst_prompt: int = 0

    @property
    def ok(self) -> bool:
        return self.rel_l2 <= self.tolerance and (self.top1 is None or self.top1.flips == 0)

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"name": "decode logits", "rel_l2": self.rel_l2, "tolerance": self.tolerance,
                             "kv_dtype": self.kv_dtype, "prompt_lengths": self.prompts, "steps": self.steps,
                             "worst": {"prompt": self.worst_prompt, "step": self.worst_step}}
        if self.top1 is not None:
            d["top1"] = {"share": self.top1.share, "agree": self.top1.agree, "positions": self.top1.positions,
                         "confident_flips": self.top1.flips, "judged": True,
                         "max_changed_lead": round(self.top1.max_lead, 4)}
        return d


def check_decode(cm: Any, recipe: Any, *, seed: int = 0) -> DecodeCheck:
    """Greedy decoding of two prompts through `cm`'s decode engine against the eager model."""
    from graphmode.decode.api import causal_lm, engine_of, sampling_params
    from graphmode.verify.bisect import checked_precision, tolerance_for
    from graphmode.verify.numerics import WEIGHT_ONLY
    with warnings.catch_warnings():          # (its notice on narrow weights points at this very check)
        warnings.filterwarnings("ignore", message=".*decoding checks nothing", category=GraphmodeNotice)
        eng = engine_of(cm)
    lm = causal_lm(cm.source)
    vocab = int(eng.cfg.get("vocab") or lm.config.vocab_size)
    first = max(eng.min_prompt, 2)
    page = recipe.memory.kv_cache.page_size
    # the longer prompt ends a few tokens before a page boundary, so its new tokens cross into the next page
    lengths = sorted({first, min(eng.max_prompt, max(first + 5, page - 3))})
    new = max(1, min(MAX_NEW_TOKENS, *(eng.room(n) for n in lengths)))
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]
    params = sampling_params(eng, new, False, 1.0, None, None, None, None)
    rows: dict[int, list[torch.Tensor]] = {}
    eng.on_logits = lambda s, row: rows.setdefault(s.id, []).append(row.detach().float().clone())
    try:
        seqs = [eng.add(p, params) for p in prompts]
        while not all(s.done for s in seqs):
            eng.step()
    finally:
        eng.on_logits = None
    got, want = [], []
    with torch.inference_mode():
        for p, s in zip(prompts, seqs):
            steps = torch.stack(rows[s.id])
            full = torch.tensor([p + s.generated[:len(steps) - 1]])
            ref = lm(input_ids=full, use_cache=False).logits[0, len(p) - 1:].float()
            got.append(steps)
            want.append(ref[:len(steps)])
    got_all, want_all = torch.cat(got), torch.cat(want)
    compute, weights = checked_precision(recipe)
    kv = recipe.memory.kv_cache.dtype or recipe.precision.compute
    tol = max(tolerance_for("f32", compute), TOLERANCE.get(kv, 0.0), WEIGHT_ONLY.get(weights, 0.0))
    narrow = kv != "f32" or weights != "f32"
    errs = [(rel_l2(g[i:i + 1], w[i:i + 1]), k, i) for k, (g, w) in enumerate(zip(got, want)) for i in range(len(g))]
    _, worst_prompt, worst_step = max(errs)
    return DecodeCheck(lengths, len(got_all), rel_l2(got_all, want_all), tol, kv,
                       top1_agreement(got_all, want_all) if narrow else None, worst_step, worst_prompt)


__all__ = ["DecodeCheck", "check_decode"]
