"""The decode engine: compiled prefill/decode plans over a paged KV cache, and a scheduler that
batches sequences continuously at decode-step boundaries.

A step admits waiting sequences while pages are free (prefill, one batch per step), then runs
one decode step for every running sequence. A sequence that needs a page when the pool is
empty preempts the youngest running sequence, which gives its pages back and is recomputed
from its tokens later (counted in `stats["preemptions"]`): the pool never grows and never
holds more than the recipe's memory proof counted.
"""
from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch

from graphmode.decode.kvcache import KVLayout, PagedKVCache
from graphmode.decode.lm import CausalLMForward, lm_config
from graphmode.passes.to_paged import to_paged
from graphmode.decode.sampling import SamplingParams, choose
from graphmode.errors import ContractViolation, GraphmodeError, RecipeError
from graphmode.progress import OnStage, stage


@dataclass
class Sequence_:
    id: int
    prompt: list[int]
    params: SamplingParams
    generated: list[int] = field(default_factory=list)
    state: str = "waiting"                       # waiting | running | finished
    finish_reason: str | None = None
    gen: torch.Generator | None = None
    arrived: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    cached: int = 0                              # tokens whose K/V are in the cache
    on_token: Callable[[int, int], None] | None = None

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.generated

    @property
    def done(self) -> bool:
        return self.state == "finished"


def kv_layout(recipe: Any, cfg: dict[str, Any]) -> KVLayout:
    """The pool the recipe's memory proof counts (graphmode.recipe.facts.kv_pool_pages)."""
    from graphmode.recipe.facts import kv_params, kv_pool_pages
    p = kv_params(recipe)
    if p is None:
        raise RecipeError("decoding needs a paged KV cache in the recipe", where="memory.kv_cache",
                          fix="add memory.kv_cache {page_size, max_pages_per_seq, layers, kv_heads, head_dim}")
    want = {"layers": cfg["layers"], "kv_heads": cfg["kv_heads"], "head_dim": cfg["head_dim"]}
    for k, v in want.items():
        if p.get(k) is not None and v is not None and p[k] != v:
            raise RecipeError(f"memory.kv_cache.{k} is {p[k]}, the model has {v}", where=f"memory.kv_cache.{k}",
                              value=p[k], fix=f"set {k}: {v}")
    return KVLayout(layers=int(p["layers"] or cfg["layers"]), kv_heads=int(p["kv_heads"] or cfg["kv_heads"]),
                    head_dim=int(p["head_dim"] or cfg["head_dim"]), page_size=int(p["page_size"]),
                    pages=int(kv_pool_pages(recipe)), max_pages_per_seq=int(p["max_pages_per_seq"]),
                    dtype=str(p["dtype"]))


class DecodeEngine:
    """Compiled prefill and decode plans of one causal LM under one recipe."""

    def __init__(self, lm: torch.nn.Module, recipe: Any, target: Any = None, *, cache_dir=None,
                 threads: int | None = None, on_stage: OnStage | None = None):
        """`on_stage` hears the capture and passes of the decoder graph and its plan builds
        (graphmode/progress.py)."""
        from graphmode.capture.torch_import import import_torch
        from graphmode.compiler import ModelSource, optimize
        from graphmode.runtime.compiled import CompiledModel
        self.recipe = recipe
        self.cfg = lm_config(lm)
        self.layout = kv_layout(recipe, self.cfg)
        self.cache = PagedKVCache(self.layout)
        dims = {d: recipe.dim_range(d) for d in recipe.dims}
        if "batch" not in dims or "seq" not in dims:
            raise RecipeError("a decoder recipe needs dims batch and seq", where="dims",
                              fix="declare dims batch (sequences per step) and seq (prompt length)")
        self.batch_buckets = recipe.dim_buckets()["batch"]
        self.seq_buckets = recipe.dim_buckets()["seq"]
        self.max_prompt = dims["seq"][1]
        fwd = CausalLMForward(lm).eval()
        ex = {"input_ids": torch.randint(0, int(self.cfg["vocab"] or 2), (2, 3)), "position_ids":
              torch.arange(3).repeat(2, 1)}
        seq_hi = max(3, dims["seq"][1])
        with stage(on_stage, "capture", detail="decoder"):
            graph, cap = import_torch(fwd, ex, {k: ["batch", "seq"] for k in ex},
                                      {"batch": (max(1, dims["batch"][0]), max(2, dims["batch"][1])),
                                       "seq": (2, seq_hi)}, name="lm")
        if cap.fallbacks:
            raise GraphmodeError(f"the model has ops graphmode cannot compile: "
                                 f"{', '.join(f.target for f in cap.fallbacks)}", where="model",
                                 fix="decoding runs in graph mode only")
        paged = to_paged(graph, self.cache.k, self.cache.v, self.layout.max_pages_per_seq)
        paged.graph.dims["seq"] = (1, seq_hi)
        opt, _ = optimize(paged.graph, recipe, target, buckets=[], on_stage=on_stage)
        src = ModelSource("lm-decode", fwd, ex, {k: ["batch", "seq"] for k in ex})
        self._cm = CompiledModel(src, recipe, target, paged.graph, opt, None, mode="graph", cache_dir=cache_dir,
                                 threads=threads, on_stage=on_stage)
        self._cm.spill_constants()    # the transposed weights the passes made: the kernels pack their own
        self.lock = threading.RLock()
        # batch_invariant: every sequence runs alone (batch-1 plans, its own prefill bucket) and
        # holds the pages of its whole answer from admission, so it is never preempted and
        # recomputed under another shape: its logits are bit-identical whoever else is running
        self.invariant = getattr(recipe, "determinism", "default") == "batch_invariant"
        self.on_logits: Callable[[Sequence_, torch.Tensor], None] | None = None   # verification hook
        self.waiting: deque[Sequence_] = deque()
        self.running: list[Sequence_] = []
        self._ids = itertools.count()
        self.stats = {"prefill_steps": 0, "decode_steps": 0, "preemptions": 0, "generated_tokens": 0}

    # ---- plans --------------------------------------------------------------------------
    def _bucket(self, values: Sequence[int], n: int, what: str) -> int:
        for v in values:
            if v >= n:
                return v
        raise ContractViolation(f"{what} {n} is above the largest bucket {values[-1]}", where=f"dims.{what}",
                                value=n, fix=f"send at most {values[-1]}")

    def _run(self, env: dict[str, int], inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        exe = self._cm.executable(env)
        return exe.run(inputs)["logits"][:, 0, :]

    def prepare(self, rows: int, longest: int) -> None:
        """Build the plans `rows` sequences whose longest prompt is `longest` will use (a
        prefill bucket and every decode batch bucket up to theirs), so timing starts warm."""
        top = self._bucket(self.batch_buckets, min(rows, self.batch_buckets[-1]), "batch")   # more rows: waves
        self._build([{"batch": top, "seq": self._bucket(self.seq_buckets, longest, "seq")}]
                    + [{"batch": b, "seq": 1} for b in self.batch_buckets if b <= top])

    def warmup(self) -> None:
        self._build([{"batch": b, "seq": s} for b in self.batch_buckets for s in (1, *self.seq_buckets)])

    def _build(self, envs: list[dict[str, int]]) -> None:
        """Build these plans now, as one `plans` stage (bucket N of M)."""
        envs = [e for i, e in enumerate(envs) if e not in envs[:i]]
        with stage(self._cm.on_stage, "plans", total=len(envs)) as plans:
            for env in envs:
                self._cm.executable(env, report_build=False)
                plans.step(self._cm.bucket_key(env))

    # ---- requests -----------------------------------------------------------------------
    def add(self, prompt: Sequence[int], params: SamplingParams,
            on_token: Callable[[int, int], None] | None = None) -> Sequence_:
        prompt = [int(t) for t in prompt]
        vocab = int(self.cfg["vocab"] or 0)
        if not prompt:
            raise ContractViolation("empty prompt", where="prompt", fix="send at least one token")
        if vocab and not all(0 <= t < vocab for t in prompt):
            raise ContractViolation(f"token ids must be in [0, {vocab})", where="prompt",
                                    value=[t for t in prompt if not 0 <= t < vocab][:5])
        if len(prompt) > self.max_prompt:
            raise ContractViolation(f"the prompt has {len(prompt)} tokens, the contract's seq allows at most "
                                    f"{self.max_prompt}", where="dims.seq", value=len(prompt),
                                    fix=f"send at most {self.max_prompt} prompt tokens")
        if len(prompt) + params.max_new_tokens > self.layout.max_tokens:
            raise ContractViolation(f"{len(prompt)} prompt + {params.max_new_tokens} new tokens exceed the "
                                    f"{self.layout.max_tokens} tokens a sequence's pages hold", where="max_new_tokens",
                                    value=params.max_new_tokens,
                                    fix=f"ask for at most {self.layout.max_tokens - len(prompt)} new tokens")
        if self.cache.pages_for(len(prompt) + params.max_new_tokens) > self.layout.pages:
            raise ContractViolation("this request alone needs more pages than the pool has", where="max_new_tokens",
                                    value=params.max_new_tokens, fix="ask for fewer tokens")
        gen = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        with self.lock:
            s = Sequence_(next(self._ids), prompt, params, gen=gen, on_token=on_token)
            self.waiting.append(s)
        return s

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one scheduler step -------------------------------------------------------------
    def step(self) -> list[Sequence_]:
        """Admit what fits, prefill it, decode every running sequence once. Returns the
        sequences that finished in this step."""
        with self.lock:
            finished: list[Sequence_] = []
            admitted = self._admit()
            if admitted:
                finished += self._prefill(admitted)
            decoding = [s for s in self.running if not s.done and s.cached < len(s.tokens)]
            if decoding:
                finished += self._decode(decoding)
            self.running = [s for s in self.running if not s.done]
            return finished

    def _admit(self) -> list[Sequence_]:
        out: list[Sequence_] = []
        room = self.batch_buckets[-1] - len(self.running)
        while self.waiting and len(out) < room:
            s = self.waiting[0]
            need = len(s.tokens) + 1
            if self.invariant:                    # the whole answer's pages, now
                need = min(len(s.prompt) + s.params.max_new_tokens, self.layout.max_tokens)
            if not self.cache.can_hold(s.id, need):
                break
            self.waiting.popleft()
            self.cache.reserve(s.id, need)
            out.append(s)
        return out

    def _prefill(self, seqs: list[Sequence_]) -> list[Sequence_]:
        if self.invariant and len(seqs) > 1:
            return [f for s in seqs for f in self._prefill([s])]
        lens = [len(s.tokens) for s in seqs]
        b = self._bucket(self.batch_buckets, len(seqs), "batch")
        L = self._bucket(self.seq_buckets, max(lens), "seq")
        ids = torch.zeros(b, L, dtype=torch.int64)
        for i, s in enumerate(seqs):
            ids[i, :lens[i]] = torch.tensor(s.tokens, dtype=torch.int64)
        n = torch.zeros(b, dtype=torch.int64)
        n[:len(seqs)] = torch.tensor(lens)
        inputs = {"input_ids": ids, "position_ids": torch.arange(L).repeat(b, 1),
                  "block_table": self.cache.block_table([s.id for s in seqs], b),
                  "start": torch.zeros(b, dtype=torch.int64), "lens": n, "last": (n - 1).clamp(min=0)}
        logits = self._run({"batch": b, "seq": L}, inputs)
        self.stats["prefill_steps"] += 1
        for s, k in zip(seqs, lens):
            s.cached = k
            s.state = "running"
            self.running.append(s)
        return self._emit(seqs, logits)

    def _decode(self, seqs: list[Sequence_]) -> list[Sequence_]:
        for s in list(seqs):                     # the new token needs a slot: maybe a new page
            if s.state != "running":             # preempted for an earlier one in this loop
                continue
            while not self.cache.can_hold(s.id, len(s.tokens)):
                victim = self._preempt(exclude=s)
                if victim is None:
                    raise GraphmodeError("the KV pool cannot hold one running sequence", where="memory.kv_cache")
                if victim in seqs:
                    seqs.remove(victim)
            self.cache.reserve(s.id, len(s.tokens))
        if not seqs:
            return []
        if self.invariant and len(seqs) > 1:
            return [f for s in seqs for f in self._decode([s])]
        b = self._bucket(self.batch_buckets, len(seqs), "batch")
        inputs = self._decode_inputs(b, [(s.id, s.tokens[-1], s.cached) for s in seqs])
        logits = self._run({"batch": b, "seq": 1}, inputs)
        self.stats["decode_steps"] += 1
        for s in seqs:
            s.cached += 1
        return self._emit(seqs, logits)

    def _decode_inputs(self, b: int, rows: Sequence[tuple[int, int, int]]) -> dict[str, torch.Tensor]:
        """Decode-plan inputs for bucket `b`: per row (sequence id, its last token, tokens cached)."""
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

    @contextmanager
    def decode_probe(self, batch: int, context: int) -> Iterator[tuple[Any, dict[str, torch.Tensor]]]:
        """The decode plan for `batch` sequences `context` tokens long and inputs that run it,
        their pages held meanwhile (each run writes the same slot again): what
        `graphmode profile --decode` times. Only while no request is being served."""
        with self.lock:
            if self.has_work:
                raise GraphmodeError("the engine is serving requests", where="decode_probe",
                                     fix="profile an idle engine")
            if batch not in self.batch_buckets:
                raise ContractViolation(f"batch {batch} is not a batch bucket", where="dims.batch", value=batch,
                                        fix=f"one of {self.batch_buckets}")
            if not 1 <= context < self.layout.max_tokens:
                raise ContractViolation(f"context {context} is outside what a sequence's pages hold", where="context",
                                        value=context, fix=f"1 .. {self.layout.max_tokens - 1}")
            ids = [-1 - i for i in range(batch)]
            if self.cache.pages_for(context + 1) * batch > self.layout.pages:
                raise ContractViolation(f"{batch} sequences of {context + 1} tokens need more pages than the pool has",
                                        where="memory.kv_cache", value=(batch, context), fix="a smaller batch or context")
            try:
                for sid in ids:
                    self.cache.reserve(sid, context + 1)
                vocab = max(1, int(self.cfg["vocab"] or 1))
                inputs = self._decode_inputs(batch, [(sid, (7 * i + 1) % vocab, context) for i, sid in enumerate(ids)])
                yield self._cm.executable({"batch": batch, "seq": 1}), inputs
            finally:
                for sid in ids:
                    self.cache.release(sid)

    def _preempt(self, exclude: Sequence_) -> Sequence_ | None:
        """Recompute policy: the youngest running sequence gives its pages back and waits at
        the head of the queue with its tokens so far as its prompt."""
        cands = [s for s in self.running if s is not exclude and not s.done]
        if not cands:
            return None
        victim = max(cands, key=lambda s: s.arrived)
        self.cache.release(victim.id)
        self.running.remove(victim)
        victim.state, victim.cached = "waiting", 0
        self.waiting.appendleft(victim)
        self.stats["preemptions"] += 1
        return victim

    def _emit(self, seqs: list[Sequence_], logits: torch.Tensor) -> list[Sequence_]:
        finished = []
        now = time.perf_counter()
        for i, s in enumerate(seqs):
            if self.on_logits is not None:
                self.on_logits(s, logits[i])
            tok = choose(logits[i], s.params, s.gen)
            s.generated.append(tok)
            self.stats["generated_tokens"] += 1
            if s.first_token_at is None:
                s.first_token_at = now
            stop = None
            if tok in s.params.eos:
                stop = "eos"
            elif any(seq and s.generated[-len(seq):] == list(seq) for seq in s.params.stop):
                stop = "stop"
            elif len(s.generated) >= s.params.max_new_tokens:
                stop = "length"
            if s.on_token is not None:
                s.on_token(s.id, tok)
            if stop:
                s.state, s.finish_reason = "finished", stop
                self.cache.release(s.id)
                finished.append(s)
        return finished

    # ---- whole-batch generation (the API of transformers' generate) ---------------------
    def stream(self, prompts: list[list[int]], params: SamplingParams) -> Iterator[dict[int, list[int]]]:
        """Yields {prompt index: tokens new in this step} after every step until every prompt is
        done (a step can add two tokens to a sequence: its prefill's and its first decode's)."""
        ready: list[tuple[int, int]] = []
        seqs = [self.add(p, params, on_token=lambda sid, tok: ready.append((sid, tok))) for p in prompts]
        index = {s.id: i for i, s in enumerate(seqs)}
        try:
            while not all(s.done for s in seqs):
                self.step()
                if ready:
                    out: dict[int, list[int]] = {}
                    for sid, tok in ready:
                        out.setdefault(index[sid], []).append(tok)
                    ready.clear()
                    yield out
        finally:
            for s in seqs:                      # an abandoned stream gives its pages back
                if not s.done:
                    self.cancel(s)

    def cancel(self, s: Sequence_) -> None:
        with self.lock:
            if s in self.waiting:
                self.waiting.remove(s)
            if s in self.running:
                self.running.remove(s)
            self.cache.release(s.id)
            s.state, s.finish_reason = "finished", s.finish_reason or "cancelled"
