"""Prompt-lookup (n-gram) speculative decoding: draft tokens copied from the sequence itself,
verified in one batched step of the compiled decode plans (recipe `decode.speculative`).

Proposal: for n from `ngram_max` down to `ngram_min`, the latest earlier occurrence of the
sequence's last n tokens (prompt and generated); the up to `num_tokens` tokens that followed
it are the drafts. Text that repeats its prompt (code edits, quoting, summaries, lists) gets
long runs of right guesses at no model cost.

Verification: a decode step at seq = 1 reads every weight once for all its rows, so a row
costs little next to the step. A sequence with k drafts takes k + 1 rows of one step: its
pending token at position p and draft j at p + j, every row with the sequence's block table
(start = its position, lens = 1). `paged_attention` writes every row's keys and values before
any row attends (rows may share pages: ir/ops/kv.py), so row j sees positions 0 .. p + j —
the rows compute what one chunk of k + 1 tokens would, and each yields the logits after its
token. Using rows rather than a longer query keeps the plans the recipe already proves (the
graph's head reads one position per row): drafts only fill batch rows the step leaves free
(the largest batch bucket less the running sequences), so a full batch decodes without them.

Acceptance: row j's logits choose the next token exactly as decoding without drafts would
(penalties, min_tokens, logprobs, greedy or sampled with the sequence's generator, one draw
per token); while it equals draft j the next row is valid and is read too. For greedy this
is token-for-token plain greedy. For sampling it is the standard rejection rule for a draft
that is one token with probability 1 (accept it with probability p(draft), else draw from p
without it, renormalized) — drawing x ~ p and keeping x is that rule — and it consumes the
generator as decoding without drafts does, so a seeded request draws the same tokens.
The keys/values written for rejected drafts are past the sequence's new length: the next
step overwrites them before anything reads them, and pages holding only them are freed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from graphmode.decode.output import emit
from graphmode.errors import RecipeError

if TYPE_CHECKING:
    from graphmode.decode.kvcache import PagedKVCache
    from graphmode.decode.scheduler import Sequence_


@dataclass(frozen=True)
class NgramProposer:
    """Drafts from the latest earlier occurrence of a sequence's last n tokens."""
    num_tokens: int = 4
    ngram_max: int = 3
    ngram_min: int = 1

    def propose(self, tokens: Sequence[int], limit: int | None = None) -> list[int]:
        """Up to min(num_tokens, limit) tokens that followed the longest (n <= ngram_max, then
        the latest) earlier match of the last n tokens; [] when none matches. A match whose
        continuation reaches the end of the sequence (a loop of period p: only p tokens follow the
        latest match) repeats it, so a loop's draft fills every row it may."""
        k = self.num_tokens if limit is None else min(self.num_tokens, limit)
        size = len(tokens)
        if k <= 0 or size < 2:
            return []
        toks = list(tokens)
        for n in range(min(self.ngram_max, size - 1), self.ngram_min - 1, -1):
            tail = toks[size - n:]
            for i in range(size - n - 1, -1, -1):          # a match followed by at least one token
                if toks[i + n - 1] == tail[-1] and toks[i:i + n] == tail:
                    cont = toks[i + n:i + n + k]
                    return cont if len(cont) == k else [cont[j % len(cont)] for j in range(k)]
        return []


@dataclass
class Verified:
    """One sequence after a verify step: tokens emitted, drafts accepted, why it ends."""
    seq: "Sequence_"
    emitted: int
    accepted: int
    stop: str | None


class Speculator:
    """Proposes drafts for a decode batch within the rows a step has free and the pages the pool
    has free (drafts never preempt), then accepts from the verify step's logits."""

    def __init__(self, proposer: NgramProposer, max_rows: int):
        self.proposer = proposer
        self.max_rows = max_rows
        self.proposed = 0
        self.accepted = 0

    def drafts(self, seqs: list["Sequence_"], cache: "PagedKVCache") -> list[list[int]]:
        """Each sequence's drafts (row i: seqs[i]), their pages reserved. A sequence gets no
        more than its answer has room for: k drafts can emit k + 1 tokens."""
        free = self.max_rows - len(seqs)
        out: list[list[int]] = []
        for s in seqs:
            room = min(free, s.params.max_new_tokens - len(s.generated) - 1)
            d = self.proposer.propose(s.tokens, room) if room > 0 else []
            while d and not cache.can_hold(s.id, len(s.tokens) + len(d)):
                d.pop()
            if d:
                cache.reserve(s.id, len(s.tokens) + len(d))
            free -= len(d)
            out.append(d)
        return out

    def accept(self, seqs: list["Sequence_"], drafts: list[list[int]], logits: torch.Tensor, cache: "PagedKVCache",
               on_logits: Callable[["Sequence_", torch.Tensor], None] | None = None) -> list[Verified]:
        """Tokens from the verify step's rows (per sequence: its pending token's row, then one
        per draft), each sequence's cache length moved past its accepted drafts and the pages
        that held only rejected ones freed."""
        out = []
        row = 0
        for s, d in zip(seqs, drafts):
            emitted = accepted = 0
            stop = None
            for j in range(len(d) + 1):
                stop = emit(s, logits[row + j], on_logits)
                emitted += 1
                if j == len(d) or s.generated[-1] != d[j]:
                    break
                accepted += 1
                if stop:
                    break
            row += len(d) + 1
            s.cached += 1 + accepted           # the pending token and the accepted drafts
            if not stop:
                cache.trim(s.id, len(s.tokens))
            self.proposed += len(d)
            self.accepted += accepted
            out.append(Verified(s, emitted, accepted, stop))
        return out


def speculator_of(recipe: Any, max_rows: int, *, invariant: bool) -> Speculator | None:
    """The recipe's `decode.speculative` as a Speculator (None when it has none), or RecipeError
    where speculation cannot keep its promise."""
    spec = getattr(getattr(recipe, "decode", None), "speculative", None)
    if spec is None:
        return None
    if invariant:
        raise RecipeError("decode.speculative verifies drafts as extra batch rows, so a sequence's logits would "
                          "depend on how many drafts it has: determinism batch_invariant cannot hold",
                          where="decode.speculative", fix="remove decode.speculative or determinism: batch_invariant")
    if max_rows < 2:
        raise RecipeError(f"decode.speculative verifies drafts as extra batch rows; the largest batch bucket is "
                          f"{max_rows}: no row is ever free for a draft", where="decode.speculative",
                          value=max_rows, fix="add a larger dims.batch bucket (num_tokens + 1 rows for one "
                                              "sequence), or remove decode.speculative")
    return Speculator(NgramProposer(spec.num_tokens, spec.ngram_max, spec.ngram_min), max_rows)
