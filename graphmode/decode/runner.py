"""The model runner: a scheduled batch -> the plan's inputs -> its executable -> logits.

One compiled graph (the causal LM after `to_paged`) serves both kinds of step: a prefill
runs the plan of a (batch, prompt-length) bucket over the prompts, right-padded, each from
its first token not in the cache (`seq.cached`: a prefix cache hit; its new tokens attend to
the cached pages through the block table, as a decode step's token does); a decode
step runs the plan of a batch bucket at seq = 1 over each sequence's last token. Rows past
the batch's sequences and positions past a sequence's length are padding the graph never
reads (`lens` is 0 there, and the head reads each row at `last`). The block tables come from
the KV cache manager; the pools themselves are the graph's state, written by every run.

`invariant` (determinism: batch_invariant): a decode batch runs as one step in bucket b only
where neither b's plan nor the smallest bucket's (what a sequence alone runs) has a step
whose rows may be other bits at another row count (the executable's `batch_variant_steps`:
backends/cpu/invariance.py); elsewhere its sequences run one at a time, the reason logged
once per bucket and kept in `variant_buckets`, so bit-identity is never silently lost.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

import torch

from graphmode.decode.kvcache import PagedKVCache
from graphmode.decode.scheduler import Sequence_
from graphmode.errors import ContractViolation
from graphmode.progress import stage

log = logging.getLogger("graphmode.decode")


def plan_envs(batch_buckets: Sequence[int], seq_buckets: Sequence[int]) -> list[dict[str, int]]:
    """Every plan a decode engine may run: each batch bucket at seq 1 (decode) and at each prompt bucket."""
    return [{"batch": b, "seq": s} for b in batch_buckets for s in dict.fromkeys((1, *seq_buckets))]


def plan_count(recipe: Any) -> int:
    """How many plans a decoder recipe's engine builds at warm-up."""
    buckets = recipe.dim_buckets()
    return len(plan_envs(buckets["batch"], buckets.get("seq", [])))


def bucket(values: Sequence[int], n: int, what: str) -> int:
    """The smallest of `values` (ascending) that holds `n`."""
    for v in values:
        if v >= n:
            return v
    raise ContractViolation(f"{what} {n} is above the largest bucket {values[-1]}", where=f"dims.{what}",
                            value=n, fix=f"send at most {values[-1]}")


class ModelRunner:
    def __init__(self, cm: Any, cache: PagedKVCache, batch_buckets: list[int], seq_buckets: list[int], *,
                 invariant: bool = False):
        self.cm = cm                               # the CompiledModel of the paged graph
        self.cache = cache
        self.batch_buckets = batch_buckets
        self.seq_buckets = seq_buckets
        self.invariant = invariant
        self._variant: dict[int, list[str]] = {}   # decode bucket -> why it may not batch (empty: it may)

    def _run(self, env: dict[str, int], inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        weights = getattr(self.cm, "frozen_weights", None)     # a runner's tests hand it a stand-in model
        if weights is not None:
            weights.check()                     # the model updated in place since compile: refused
        exe = self.cm.executable(env)
        return exe.run(inputs)["logits"][:, 0, :]

    def prefill(self, seqs: list[Sequence_]) -> torch.Tensor:
        """Logits of each sequence's next token after its whole prompt (row i: seqs[i]), its
        tokens from `cached` on computed (padding positions stay 0: never read).

        A preempted sequence comes back with its prompt and what it generated, which may be
        longer than the largest seq bucket (the contract bounds prompts, not what they grow
        to): its leading tokens go through in chunks of that bucket first, each attending the
        keys and values the chunks before it cached, as a prefix-cache hit does."""
        top = max(self.seq_buckets)
        while True:
            long = [s for s in seqs if len(s.tokens) - s.cached > top]
            if not long:
                break
            self._prefill(long, top)
            for s in long:
                s.cached += top
        return self._prefill(seqs)

    def _prefill(self, seqs: list[Sequence_], chunk: int | None = None) -> torch.Tensor:
        """One prefill step over each sequence's uncached tokens, at most `chunk` of them."""
        lens = [len(s.tokens) - s.cached if chunk is None else min(chunk, len(s.tokens) - s.cached) for s in seqs]
        b = bucket(self.batch_buckets, len(seqs), "batch")
        L = 1 if max(lens) == 1 else bucket(self.seq_buckets, max(lens), "seq")   # one token: the decode step's plan
        ids = torch.zeros(b, L, dtype=torch.int64)
        pos = torch.zeros(b, L, dtype=torch.int64)
        start = torch.zeros(b, dtype=torch.int64)
        for i, s in enumerate(seqs):
            ids[i, :lens[i]] = torch.tensor(s.tokens[s.cached:s.cached + lens[i]], dtype=torch.int64)
            pos[i, :lens[i]] = torch.arange(s.cached, s.cached + lens[i])
            start[i] = s.cached
        n = torch.zeros(b, dtype=torch.int64)
        n[:len(seqs)] = torch.tensor(lens)
        inputs = {"input_ids": ids, "position_ids": pos, "block_table": self.cache.block_table([s.id for s in seqs], b),
                  "start": start, "lens": n, "last": (n - 1).clamp(min=0)}
        return self._run({"batch": b, "seq": L}, inputs)

    def decode(self, seqs: list[Sequence_]) -> torch.Tensor:
        """Logits after each sequence's last token, the one not yet in the cache (under
        `invariant`, one sequence at a time where bucket b may not batch them bit for bit)."""
        b = bucket(self.batch_buckets, len(seqs), "batch")
        if self.invariant and len(seqs) > 1 and self.batch_variant(b):
            return torch.cat([self.decode([s])[:1] for s in seqs])      # each without its padding rows
        inputs = self.decode_inputs(b, [(s.id, s.tokens[-1], s.cached) for s in seqs])
        return self._run({"batch": b, "seq": 1}, inputs)

    def verify(self, seqs: list[Sequence_], drafts: list[list[int]]) -> torch.Tensor:
        """Speculative verification in one decode step: per sequence a row for its pending token
        and one per draft at the positions after it (decode/speculative.py); logits per row."""
        rows = [(s.id, tok, s.cached + j) for s, d in zip(seqs, drafts) for j, tok in enumerate([s.tokens[-1], *d])]
        b = bucket(self.batch_buckets, len(rows), "batch")
        return self._run({"batch": b, "seq": 1}, self.decode_inputs(b, rows))

    def decode_inputs(self, b: int, rows: Sequence[tuple[int, int, int]]) -> dict[str, torch.Tensor]:
        """Decode-plan inputs for bucket `b`: per row (sequence id, a token, its position: the
        tokens cached before it)."""
        ids = torch.zeros(b, 1, dtype=torch.int64)
        pos = torch.zeros(b, 1, dtype=torch.int64)
        start = torch.zeros(b, dtype=torch.int64)
        n = torch.zeros(b, dtype=torch.int64)
        for i, (_sid, tok, cached) in enumerate(rows):
            ids[i, 0] = tok
            pos[i, 0] = start[i] = cached
            n[i] = 1
        return {"input_ids": ids, "position_ids": pos, "block_table": self.cache.block_table([r[0] for r in rows], b),
                "start": start, "lens": n, "last": torch.zeros(b, dtype=torch.int64)}

    def batch_variant(self, b: int) -> list[str]:
        """Why decode bucket `b` may give a row other bits than the smallest bucket (empty: it
        may not: its steps and the smallest bucket's are all row invariant)."""
        if b not in self._variant:
            why: list[str] = []
            for size in dict.fromkeys((self.batch_buckets[0], b)):
                exe = self.cm.executable({"batch": size, "seq": 1})
                steps = getattr(exe, "batch_variant_steps", None)
                why += ([f"batch {size}: {w}" for w in steps()] if steps is not None else
                        [f"batch {size}: the {type(exe).__name__} does not say which steps are batch invariant"])
            if why:
                log.warning("determinism batch_invariant: decode batch bucket %d runs its sequences one at a time: %s",
                            b, "; ".join(why[:3]) + (f" (+{len(why) - 3} more)" if len(why) > 3 else ""))
            self._variant[b] = why
        return self._variant[b]

    @property
    def variant_buckets(self) -> dict[int, list[str]]:
        """The decode buckets asked so far that run one sequence at a time, and why."""
        return {b: why for b, why in self._variant.items() if why}

    # ---- plans built before they are timed --------------------------------------------------
    def prepare(self, rows: int, longest: int, decode_rows: int | None = None) -> None:
        """Build the plans `rows` sequences whose longest prompt is `longest` will use (a
        prefill bucket and every decode batch bucket up to theirs, or up to `decode_rows`'
        when decode steps hold more rows: speculative drafts), so timing starts warm."""
        top = bucket(self.batch_buckets, min(rows, self.batch_buckets[-1]), "batch")   # more rows: waves
        dec = bucket(self.batch_buckets, min(max(rows, decode_rows or 0), self.batch_buckets[-1]), "batch")
        self._build([{"batch": top, "seq": bucket(self.seq_buckets, longest, "seq")}]
                    + [{"batch": b, "seq": 1} for b in self.batch_buckets if b <= dec])

    def envs(self) -> list[dict[str, int]]:
        return plan_envs(self.batch_buckets, self.seq_buckets)

    def warmup(self, built: Callable[[int, int], None] | None = None) -> None:
        self._build(self.envs(), built)

    def _build(self, envs: list[dict[str, int]], built: Callable[[int, int], None] | None = None) -> None:
        """Build these plans now, as one `plans` stage (bucket N of M) to the model's `on_stage`;
        `built(n, of)` after each (a server's reload progress)."""
        envs = [e for i, e in enumerate(envs) if e not in envs[:i]]
        with stage(self.cm.on_stage, "plans", total=len(envs)) as plans:
            for i, env in enumerate(envs):
                self.cm.executable(env, report_build=False)
                plans.step(self.cm.bucket_key(env))
                if built is not None:
                    built(i + 1, len(envs))
