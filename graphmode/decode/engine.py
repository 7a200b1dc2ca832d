"""The decode engine: add, step, cancel and stats over three parts, in vLLM's shape — the
scheduler (scheduler.py: which sequences run, admission and preemption over the KV pages),
the model runner (runner.py: a batch through the compiled paged graph to logits) and output
processing (output.py: sampling and stops). `drive` is the one loop over its steps: the
generate API, the `generate` CLI, the server's decode thread and the bench all run it.

A step admits waiting sequences while pages are free (prefill, one batch per step), then runs
one decode step for every running sequence. A sequence that needs a page when the pool is
empty preempts the youngest running sequence, which gives its pages back and is recomputed
from its tokens later (counted in `stats["preemptions"]`): the pool never grows and never
holds more than the recipe's memory proof counted. With `decode.speculative` (speculative.py),
a decode step also carries each sequence's prompt-lookup drafts in the batch rows it leaves
free and emits every draft the model agrees with, plus the model's own next token.

Automatic prefix caching (`memory.kv_cache.prefix_caching`, on by default as in vLLM, off
under `determinism: batch_invariant`): a prompt's leading full pages already computed for
another sequence are shared, and only the rest is prefilled (prefix_cache.py); the stats
count the prompt tokens looked up and found (`prefix_cache_queries`, `prefix_cache_hits`).

The engine is built through the pipeline driver (`compiler.lower_model`): the causal LM is
captured as `(input_ids, position_ids) -> logits` under the recipe's decode contract
(`decode_contract`), given the verdict, rewritten onto the paged cache by the `to_paged` pass
ahead of the recipe's passes, and proved; `lowered` keeps the verdict and the proof.
"""
from __future__ import annotations

import itertools
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

import torch

from graphmode.decode.kvcache import KVLayout, PagedKVCache
from graphmode.decode.lm import CausalLMForward, lm_config
from graphmode.decode.output import sample
from graphmode.decode.prefix_cache import PagedPrefixCache
from graphmode.decode.runner import ModelRunner
from graphmode.decode.sampling import SamplingParams
from graphmode.decode.scheduler import NoPrefixCache, Scheduler, Sequence_
from graphmode.decode.speculative import Speculator, speculator_of
from graphmode.errors import ContractViolation, GraphmodeError, RecipeError
from graphmode.progress import OnStage


def kv_layout(recipe: Any, cfg: dict[str, Any], world: int = 1) -> KVLayout:
    """The pool the recipe's memory proof counts (graphmode.recipe.facts.kv_pool_pages): under
    tensor parallelism (`world` ranks, attention split by heads) one rank's, its kv_heads / world
    heads (a head count that does not split is refused, naming parallel.tensor)."""
    from graphmode.recipe.facts import kv_params, kv_pool_pages
    p = kv_params(recipe)
    if p is None:
        raise RecipeError("decoding needs a paged KV cache in the recipe", where="memory.kv_cache",
                          fix="add memory.kv_cache {page_size, max_pages_per_seq, layers, kv_heads, head_dim}")
    if cfg.get("v_head_dim", cfg["head_dim"]) != cfg["head_dim"]:
        raise RecipeError(f"the model's value heads are {cfg['v_head_dim']} wide and its key heads {cfg['head_dim']} "
                          "(multi-head latent attention): a cache page holds K and V heads of one head_dim",
                          where="memory.kv_cache", value=cfg["head_dim"],
                          fix="remove memory.kv_cache and compile the forward pass (logits); decode it eagerly")
    want = {"layers": cfg["layers"], "kv_heads": cfg["kv_heads"], "head_dim": cfg["head_dim"]}
    for k, v in want.items():
        if p.get(k) is not None and v is not None and p[k] != v:
            raise RecipeError(f"memory.kv_cache.{k} is {p[k]}, the model has {v}", where=f"memory.kv_cache.{k}",
                              value=p[k], fix=f"set {k}: {v}")
    kv_heads = int(p["kv_heads"] or cfg["kv_heads"])
    if world > 1:
        if kv_heads % world or (cfg.get("heads") and int(cfg["heads"]) % world):
            raise RecipeError(f"parallel.tensor {world} does not divide the model's {cfg.get('heads')} attention "
                              f"heads / {kv_heads} KV heads: a rank's KV cache holds whole heads",
                              where="parallel.tensor", value=world,
                              fix=f"a tensor degree dividing {kv_heads} (the KV heads), or parallel.tensor: 1")
        kv_heads //= world
    return KVLayout(layers=int(p["layers"] or cfg["layers"]), kv_heads=kv_heads,
                    head_dim=int(p["head_dim"] or cfg["head_dim"]), page_size=int(p["page_size"]),
                    pages=int(kv_pool_pages(recipe)), max_pages_per_seq=int(p["max_pages_per_seq"]),
                    dtype=str(p["dtype"]))


def _check_pools_split(pools: Any, layout: KVLayout, recipe: Any) -> None:
    """Under tensor parallelism each rank's pools hold its share of the KV heads (what the memory
    proof counts per rank). Where the shard pass left a layer's attention whole (a projection
    it has no rule to split by heads), the pools are whole: refused naming why, not as a
    mismatch of recipes."""
    world = recipe.parallel.tensor if recipe.parallel is not None else 1
    whole = sorted({i for pool in pools for i, t in enumerate(pool)
                    if t.dim() == 4 and int(t.shape[2]) != layout.kv_heads})
    if world > 1 and whole:
        every = len(whole) == len(pools[0])
        raise RecipeError(f"parallel.tensor {world}: {'this model' if every else f'layer(s) {whole} of this model'}'s "
                          f"attention is not split by heads in its decode graph (each rank would hold all "
                          f"{layout.kv_heads * world} KV heads, beyond the per-rank KV pool the memory proof counts): "
                          + ("a projection ahead of its attention has no rule to split it by heads" if every else
                             "a projection ahead of those layers' attention has no rule to split it by heads (or a "
                             "width before it, an MLP intermediate size say, does not split over the ranks)"),
                          where="parallel.tensor", value=world,
                          fix="decode this model with parallel.tensor: 1 (its forward pass runs tensor-parallel)"
                          if every else "parallel.strategy {mlp: replicate} (the MLP whole on every rank), or "
                                        "parallel.tensor: 1")


def decode_contract(recipe: Any) -> Any:
    """The recipe as the decode graph's contract: the captured forward's inputs (token ids and
    their positions, [batch, seq]) in place of the whole-sequence ones, no whole-sequence
    outputs, and `to_paged` ahead of the recipe's passes; every other field (dims, memory and
    its KV cache, precision, SLAs) is the recipe's, so its proof is the recipe's."""
    from graphmode.recipe.schema import InputSpec
    inputs = [InputSpec(name=n, dtype="i64", shape=["batch", "seq"]) for n in ("input_ids", "position_ids")]
    # the preset's passes, spelled out (a recipe gives a preset or a pass list, not both)
    optimize = recipe.optimize.model_copy(update={"passes": ["to_paged", *recipe.pipeline()], "preset": None})
    return recipe.model_copy(update={"inputs": inputs, "outputs": {}, "optimize": optimize})


def check_decoder_recipe(lm: torch.nn.Module, recipe: Any) -> None:
    """What `generate` and `serve` refuse of a decoder recipe for `lm` before they capture it (ALiBi,
    a KV cache of other sizes than the model's, a narrower compute, dims the paged graph cannot
    take): `recipe validate --model` refuses the same, for the same reasons."""
    from graphmode.decode.lm import refuse_alibi, refuse_no_lm_head
    refuse_no_lm_head(lm)
    refuse_alibi(lm)
    _shape(recipe, lm_config(lm))


def decode_mode(recipe: Any) -> str:
    """graph, or hybrid where the recipe keeps ops without a lowering as eager islands (MoE routing)."""
    return "hybrid" if recipe.exe_mode == "hybrid" else "graph"


def lower_decoder(lm: torch.nn.Module, recipe: Any, target: Any = None, *, on_stage: OnStage | None = None,
                  rank: int = 0, name: str = "lm") -> Any:
    """The causal LM's paged graph through `compiler.lower_model` (a `Lowered`); `on_stage` hears
    its capture, passes and proof (graphmode/progress.py). Under `parallel`, `rank`'s shard (its
    pools hold its KV heads only). `name`: the model's (a saved .gm answers to it when served)."""
    from graphmode.compiler import ModelSource, lower_model
    from graphmode.decode.lm import refuse_alibi
    refuse_alibi(lm)
    cfg = lm_config(lm)
    dims = {d: recipe.dim_range(d) for d in recipe.dims}
    fwd = CausalLMForward(lm).eval()
    ex = {"input_ids": torch.randint(0, int(cfg["vocab"] or 2), (2, 3)), "position_ids": torch.arange(3).repeat(2, 1)}
    src = ModelSource(name, fwd, ex, {k: ["batch", "seq"] for k in ex}, masks_padding=True,
                      capture_dims={"batch": (max(1, dims["batch"][0]), max(2, dims["batch"][1])),
                                    "seq": (2, max(3, dims["seq"][1]))})
    return lower_model(src, decode_contract(recipe), target, mode=decode_mode(recipe), on_stage=on_stage, rank=rank)


def prefix_caching(kv: Any, invariant: bool) -> bool:
    """Whether the engine shares computed prompt pages: the recipe's choice, on by default
    (vLLM's), off under batch_invariant, where a prefill from a cached prefix would run under
    another shape than the sequence alone (asking for both is refused)."""
    on = getattr(kv, "prefix_caching", None)
    if on and invariant:
        raise RecipeError("prefix caching prefills a prompt after a prefix another sequence computed, under "
                          "another shape than alone: batch_invariant cannot keep its logits",
                          where="memory.kv_cache.prefix_caching", value=True,
                          fix="remove prefix_caching (off under batch_invariant) or determinism")
    return (not invariant) if on is None else bool(on)


def _pools(graph: Any, layers: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The K and V pools `to_paged` put in the graph, by layer."""
    try:
        return ([graph.constants[f"kv.k.{i}"] for i in range(layers)],
                [graph.constants[f"kv.v.{i}"] for i in range(layers)])
    except KeyError as e:
        raise GraphmodeError(f"the decode graph has no KV pool {e.args[0]}", where="memory.kv_cache.layers",
                             fix="a graphmode bug: the to_paged pass makes one pool per layer") from None


def _shape(recipe: Any, cfg: dict[str, Any]) -> tuple[KVLayout, int | None, tuple[int, int]]:
    """(this process's KV pool, the model's positions, the prompt lengths the recipe admits),
    or RecipeError naming what does not fit the decode graph (dims batch and seq, a prompt
    with room for a new token)."""
    par = recipe.parallel
    world = par.tensor if par is not None and par.strategy.get("attention") == "head" else 1
    layout = kv_layout(recipe, cfg, world)
    dims = {d: recipe.dim_range(d) for d in recipe.dims}
    kv = recipe.memory.kv_cache
    bd, sd = kv.batch_dim, kv.seq_dim
    narrow = {op: d for op, d in recipe.precision.overrides.items() if d != "f32"}
    if recipe.precision.compute != "f32" or narrow:
        # the paged attention and its KV pools are f32 kernels; only the weights narrow (quantize_weights)
        raise RecipeError("decoding computes in f32 (its paged attention and KV pools are f32 kernels): "
                          f"precision.compute {recipe.precision.compute}"
                          + (f", overrides {narrow}" if narrow else "") + " is for a forward pass",
                          where="precision.compute" if not narrow else "precision.overrides",
                          value=recipe.precision.compute if not narrow else narrow,
                          fix="set precision.compute: f32 (and no narrower overrides); precision.weights: bf16, int8 "
                              "or int4 narrows the weights decoding reads")
    if bd not in dims or sd not in dims:
        raise RecipeError(f"a decoder recipe needs dims {bd} and {sd}", where="dims",
                          fix=f"declare dims {bd} (sequences per step) and {sd} (prompt length), the "
                              "memory.kv_cache batch_dim and seq_dim")
    if (bd, sd) != ("batch", "seq"):
        raise RecipeError(f"the decode graph's dims are batch and seq; memory.kv_cache names {bd} and {sd}",
                          where="memory.kv_cache.batch_dim", value=[bd, sd],
                          fix="name the decoder recipe's dims batch and seq (batch_dim: batch, seq_dim: seq)")
    context = int(cfg["context"]) if cfg.get("context") else None   # the model's positions
    window = cfg.get("sliding_window")
    longest = min(layout.page_size * layout.max_pages_per_seq, context or 1 << 62)
    if window is not None and longest > window:
        # the paged attention attends every cached token: past the window it would answer other tokens
        raise RecipeError(f"the model attends over a sliding window of {window} tokens, which graphmode's paged "
                          f"attention does not apply, and a sequence may hold {longest}", where=
                          "memory.kv_cache.max_pages_per_seq", value=layout.max_pages_per_seq,
                          fix=(f"max_pages_per_seq at most {window // layout.page_size}" if window >= layout.page_size
                               else f"page_size at most {1 << (window.bit_length() - 1)} with pages that hold at most "
                                    f"{window} tokens") + " (sequences within the window decode exactly)")
    min_prompt, max_prompt = dims[sd]
    if context is not None and max_prompt + 1 > context:
        raise RecipeError(f"dims.{sd} admits prompts of {max_prompt} tokens, but the model has "
                          f"{context} positions: no room for a new token", where=f"dims.{sd}.max",
                          value=max_prompt, fix=f"{sd} at most {context - 1}")
    return layout, context, (min_prompt, max_prompt)


class DecodeEngine:
    """A thin composition: requests in (`add`), one scheduled step at a time (`step`), `cancel`,
    `stats`. `DecodeEngine.build` compiles a causal LM under a decoder recipe; the parts can be
    composed directly (the scheduler's tests run it over a fake runner, no model)."""

    def __init__(self, runner: Any, scheduler: Scheduler, cfg: dict[str, Any], *, max_prompt: int,
                 min_prompt: int = 1, seq_dim: str = "seq", context: int | None = None, lowered: Any = None,
                 speculator: Speculator | None = None):
        self.runner = runner
        self.scheduler = scheduler
        self.cache = scheduler.cache
        self.layout = scheduler.cache.layout
        self.cfg = cfg
        self.max_prompt, self.min_prompt, self.seq_dim = max_prompt, min_prompt, seq_dim
        self.context = context          # the model's positions (None: the config does not say)
        self.lowered = lowered          # compiler.Lowered: the paged graph, its verdict and its proof
        self.speculator = speculator    # decode.speculative: drafts verified in the decode step (speculative.py)
        self._cm = getattr(runner, "cm", None)
        self.lock = threading.RLock()
        self.on_logits: Callable[[Sequence_, torch.Tensor], None] | None = None   # verification hook
        self._ids = itertools.count()
        self._counts = {"prefill_steps": 0, "decode_steps": 0, "generated_tokens": 0}

    @classmethod
    def build(cls, lm: torch.nn.Module, recipe: Any, target: Any = None, *, cache_dir=None,
              threads: int | None = None, on_stage: OnStage | None = None, rank: int = 0,
              name: str = "lm") -> "DecodeEngine":
        """Compiled prefill and decode plans of one causal LM under one recipe; `on_stage` hears
        the decoder graph's capture, passes and proof, and its plan builds (graphmode/progress.py).
        Under `parallel.tensor` N > 1, `rank`'s engine: its shard of the graph and its pool of
        KV heads / N (decode/tensor_parallel.py runs the N engines in step)."""
        from graphmode.runtime.compiled import CompiledModel
        cfg = lm_config(lm)
        par = recipe.parallel
        if par is not None and par.tensor > 1:
            from graphmode.ir.communicator import active
            if active() is None:
                raise GraphmodeError(f"parallel.tensor {par.tensor}: a rank's decode engine runs inside the group of "
                                     "ranks, and this process has none", where="parallel.tensor", value=par.tensor,
                                     fix="graphmode.compile(model, recipe) starts the ranks (its generate / stream "
                                         "decode on them), or parallel.tensor: 1 for one process")
        from graphmode.decode.lm import refuse_no_lm_head
        refuse_no_lm_head(lm)
        _shape(recipe, cfg)           # refused before the capture
        low = lower_decoder(lm, recipe, target, on_stage=on_stage, rank=rank, name=name)
        cm = CompiledModel.from_lowered(low, recipe, target, mode=decode_mode(recipe), cache_dir=cache_dir, threads=threads,
                                        on_stage=on_stage)
        cm.spill_constants()          # the transposed weights the passes made: the kernels pack their own
        return cls.over(cm, recipe, cfg, lowered=low)

    @classmethod
    def over(cls, cm: Any, recipe: Any, cfg: dict[str, Any], *, lowered: Any = None) -> "DecodeEngine":
        """The engine over a compiled paged graph: a fresh lowering's (`build`, which passes its
        `lowered`) or a loaded `.gm` artifact's (decode/saved.py: no lowering, no module)."""
        layout, context, (min_prompt, max_prompt) = _shape(recipe, cfg)
        kv = recipe.memory.kv_cache
        pools = _pools(cm.graph, layout.layers)
        _check_pools_split(pools, layout, recipe)
        cache = PagedKVCache(layout, pools=pools)
        buckets = recipe.dim_buckets()
        # batch_invariant: every prompt is prefilled alone, every sequence holds the pages of its
        # whole answer from admission (never preempted and recomputed under another shape), and
        # decode steps are batched where the plans' kernels keep each row's bits at any batch
        # size (the runner checks; one sequence at a time elsewhere): its logits are
        # bit-identical whoever else is running
        invariant = getattr(recipe, "determinism", "default") == "batch_invariant"
        prefix = prefix_caching(kv, invariant)
        scheduler = Scheduler(cache, buckets["batch"][-1], invariant=invariant,
                              prefix_cache=PagedPrefixCache(cache) if prefix else None)
        runner = ModelRunner(cm, cache, buckets["batch"], buckets["seq"], invariant=invariant)
        return cls(runner, scheduler, cfg, max_prompt=max_prompt, min_prompt=min_prompt, seq_dim="seq",
                   context=context, lowered=lowered, speculator=speculator_of(recipe, buckets["batch"][-1],
                                                                              invariant=invariant))

    def room(self, prompt: int) -> int:
        """New tokens a prompt of `prompt` tokens leaves: within its pages and the model's positions."""
        return min(self.layout.sequence_tokens, self.context or self.layout.max_tokens) - prompt

    @property
    def batch_buckets(self) -> list[int]:
        return self.runner.batch_buckets

    @property
    def waiting(self):
        return self.scheduler.waiting

    @property
    def running(self) -> list[Sequence_]:
        return self.scheduler.running

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    @property
    def stats(self) -> dict[str, int]:
        """Step and token counts, the prompt tokens looked up in and found by the prefix cache;
        with decode.speculative, the draft tokens proposed and accepted."""
        sch = self.scheduler
        out = {"prefill_steps": self._counts["prefill_steps"], "decode_steps": self._counts["decode_steps"],
               "preemptions": sch.preemptions, "generated_tokens": self._counts["generated_tokens"],
               "prefix_cache_queries": sch.prefix_queries, "prefix_cache_hits": sch.prefix_hits}
        if self.speculator is not None:
            out.update(draft_tokens=self.speculator.proposed, accepted_tokens=self.speculator.accepted)
        return out

    @property
    def prefix_caching(self) -> bool:
        return not isinstance(self.scheduler.prefix_cache, NoPrefixCache)

    @prefix_caching.setter
    def prefix_caching(self, on: bool) -> None:
        """Match and key prompt prefixes from now on (or not): what `bench decode` switches
        between requests. Pages kept already stay evictable; an engine built without a
        prefix cache has none to switch on."""
        with self.lock:
            reclaimer = self.cache.reclaimer
            if on and reclaimer is None:
                raise RecipeError("this engine was built without prefix caching",
                                  where="memory.kv_cache.prefix_caching",
                                  fix="build it with prefix_caching: true (not under determinism: batch_invariant)")
            self.scheduler.prefix_cache = reclaimer if on else NoPrefixCache()

    def prepare(self, rows: int, longest: int) -> None:
        self.runner.prepare(rows, longest, self.runner.batch_buckets[-1] if self.speculator is not None else None)

    def warmup(self, built: Callable[[int, int], None] | None = None) -> None:
        self.runner.warmup(built)

    # ---- requests -----------------------------------------------------------------------
    def add(self, prompt: Sequence[int], params: SamplingParams,
            on_token: Callable[[int, int], None] | None = None) -> Sequence_:
        """Queue a sequence (it runs from the next step); refuses what the recipe cannot hold."""
        prompt = [int(t) for t in prompt]
        vocab = int(self.cfg["vocab"] or 0)
        if not prompt:
            raise ContractViolation("empty prompt", where="prompt", fix="send at least one token")
        if vocab and not all(0 <= t < vocab for t in prompt):
            raise ContractViolation(f"token ids must be in [0, {vocab})", where="prompt",
                                    value=[t for t in prompt if not 0 <= t < vocab][:5])
        bias = [t for t, _ in params.logit_bias if vocab and not 0 <= t < vocab]
        if bias:
            raise ContractViolation(f"logit_bias token ids must be in [0, {vocab})", where="logit_bias",
                                    value=bias[:5], fix="bias token ids the model knows")
        stops = [t for seq in params.stop for t in seq if vocab and not 0 <= t < vocab]
        if stops:                                # a token the model never makes: that stop could never match
            raise ContractViolation(f"stop token ids must be in [0, {vocab})", where="stop", value=stops[:5],
                                    fix="stop on token ids the model knows")
        if len(prompt) > self.max_prompt:
            raise ContractViolation(f"the prompt has {len(prompt)} tokens, the contract's {self.seq_dim} allows at "
                                    f"most {self.max_prompt}", where=f"dims.{self.seq_dim}", value=len(prompt),
                                    fix=f"send at most {self.max_prompt} prompt tokens")
        if len(prompt) < self.min_prompt:
            raise ContractViolation(f"the prompt has {len(prompt)} token(s), the contract's {self.seq_dim} needs at "
                                    f"least {self.min_prompt}", where=f"dims.{self.seq_dim}", value=len(prompt),
                                    fix=f"send at least {self.min_prompt} prompt tokens (or lower dims."
                                        f"{self.seq_dim}.min in the recipe)")
        most = self.room(len(prompt))          # the hint names a value both limits admit
        limits = [(self.layout.max_tokens, "tokens a sequence's pages hold")]
        if self.context is not None:
            limits.append((self.context, "positions of the model"))
        for limit, what in sorted(limits):        # the tighter limit is the one named
            if len(prompt) + params.max_new_tokens > limit:
                raise ContractViolation(f"{len(prompt)} prompt + {params.max_new_tokens} new tokens exceed the "
                                        f"{limit} {what}", where="max_new_tokens", value=params.max_new_tokens,
                                        fix=f"ask for at most {most} new tokens")
        if self.cache.pages_for(len(prompt) + params.max_new_tokens) > self.layout.pages:
            raise ContractViolation(f"{len(prompt)} prompt + {params.max_new_tokens} new tokens need more pages than "
                                    f"the pool's {self.layout.pages} hold", where="max_new_tokens",
                                    value=params.max_new_tokens, fix=f"ask for at most {most} new tokens")
        gen = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        with self.lock:
            s = Sequence_(next(self._ids), prompt, params, gen=gen, on_token=on_token)
            self.scheduler.add(s)
        return s

    def cancel(self, s: Sequence_) -> None:
        """End `s` now (finish reason "cancelled" unless it had one): its pages go back."""
        with self.lock:
            self.scheduler.finish(s, "cancelled")

    # ---- one step -----------------------------------------------------------------------
    def step(self) -> list[Sequence_]:
        """Admit what fits, prefill it, decode every running sequence once. Returns the
        sequences that finished in this step."""
        with self.lock:
            finished: list[Sequence_] = []
            for batch in self.scheduler.admit():
                logits = self._finite(self.runner.prefill(batch), batch)
                self._counts["prefill_steps"] += 1
                self.scheduler.prefilled(batch)
                finished += self._emit(batch, logits)
            for batch in self.scheduler.decoding():
                drafts = self.speculator.drafts(batch, self.cache) if self.speculator is not None else []
                if any(drafts):
                    finished += self._verify(batch, drafts)
                    continue
                logits = self._finite(self.runner.decode(batch), batch)
                self._counts["decode_steps"] += 1
                self.scheduler.decoded(batch)
                finished += self._emit(batch, logits)
            return finished

    def _verify(self, seqs: list[Sequence_], drafts: list[list[int]]) -> list[Sequence_]:
        """One decode step over `seqs` and their drafts (decode/speculative.py)."""
        logits = self.runner.verify(seqs, drafts)
        self._finite(logits, seqs, rows=sum(1 + len(d) for d in drafts))
        self._counts["decode_steps"] += 1
        finished = []
        for v in self.speculator.accept(seqs, drafts, logits, self.cache, self.on_logits):
            self._counts["generated_tokens"] += v.emitted
            if v.stop:
                self.scheduler.finish(v.seq, v.stop)
                finished.append(v.seq)
            else:                                   # pages its accepted drafts filled are reusable
                self.scheduler.prefix_cache.insert(v.seq)
        return finished

    def _finite(self, logits: torch.Tensor, seqs: list[Sequence_], rows: int | None = None) -> torch.Tensor:
        """`logits` when their first `rows` (default: one per sequence of `seqs`, the bucket's
        padding rows after them) are finite. A NaN or inf row has no next token to choose (argmax
        of NaN picked token 0, step after step): refused, naming the likely cause (an f16 KV
        cache holds values up to 65504 only; a model whose weights hold NaN/inf)."""
        if bool(torch.isfinite(logits[:len(seqs) if rows is None else rows]).all()):
            return logits
        bad = [s.id for i, s in enumerate(seqs) if rows is None and not bool(torch.isfinite(logits[i]).all())]
        half = self.layout.dtype == "f16"
        raise ContractViolation(
            f"the model's logits are not finite (NaN or inf) for sequence(s) {bad or [s.id for s in seqs]}: no next "
            "token can be chosen" + (": the f16 KV cache overflows past 65504 on this model's keys or values"
                                     if half else ""), where="memory.kv_cache.dtype" if half else "model",
            value=self.layout.dtype if half else None,
            fix="memory.kv_cache.dtype: bf16 (f32's range) or f32" if half else
                "check the model's weights for NaN/inf (eager PyTorch gives NaN here too)")

    def _emit(self, seqs: list[Sequence_], logits: torch.Tensor) -> list[Sequence_]:
        finished = []
        for s, stop in sample(seqs, logits, self.on_logits):
            self._counts["generated_tokens"] += 1
            if stop:
                self.scheduler.finish(s, stop)
                finished.append(s)
        return finished

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
                rows = [(sid, (7 * i + 1) % vocab, context) for i, sid in enumerate(ids)]
                inputs = self.runner.decode_inputs(batch, rows)
                yield self._cm.executable({"batch": batch, "seq": 1}), inputs
            finally:
                for sid in ids:
                    self.cache.release(sid)


def drive(engine: DecodeEngine, seqs: Sequence[Sequence_] | None = None) -> Iterator[list[Sequence_]]:
    """The loop over engine steps: steps until `seqs` are done (with None, while the engine has
    work) and yields after each step the sequences that finished in it. Tokens reach their
    sequences' `on_token` listeners as they are chosen, inside the step. Closed before the end
    (the caller stopped reading), the unfinished ones among `seqs` are cancelled: their pages
    come back."""
    try:
        while not all(s.done for s in seqs) if seqs is not None else engine.has_work:
            yield engine.step()
    finally:
        for s in seqs or ():
            if not s.done:
                engine.cancel(s)
