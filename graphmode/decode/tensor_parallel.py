"""Tensor-parallel decoding: N rank processes run one decode engine's steps together.

Every rank builds the decode engine of its shard (`DecodeEngine.build(..., rank=r)`: the paged
graph through the `shard` pass, so its KV pools hold its kv_heads / N heads, and every bucket's
plan built before it reports ready). The scheduler and sampling run on rank 0 only, as in vLLM:
each step rank 0 broadcasts the step's inputs (bucket, token ids, positions, block tables,
starts, lengths: one fixed-size int64 tensor, one `broadcast` per step) and runs its plan; the
other ranks receive it and run the same plan on their shard. The collectives inside the plans
(the row-parallel all_reduces, the LM head's all_gather) join them; rank 0 samples from the
gathered logits. Admission, preemption and the prefix cache decide page ids on rank 0, and as
every rank runs every step with rank 0's block tables, every pool holds the same pages.

The caller's process holds neither weights nor pools: `TensorParallelDecoder.generate` / `stream`
send the prompts to rank 0 (and "follow" to the others) and read rank 0's new tokens per step.
"""
from __future__ import annotations

import os
from contextlib import closing
from typing import Any, Iterator, Sequence

import torch

from graphmode.decode.api import MODEL_EOS, _steps
from graphmode.decode.engine import DecodeEngine
from graphmode.decode.lm import INPUTS
from graphmode.decode.runner import ModelRunner
from graphmode.decode.tp_engine import KEEPALIVE, MARGIN_S, RemoteEngine, engine_loop
from graphmode.errors import ContractViolation, GraphmodeError
from graphmode.parallel.comm import active
from graphmode.parallel.launch import NotOnRanks, RankDriver, launch, stats_delta



class StepCodec:
    """One step's plan inputs <-> one int64 tensor of a fixed size (so the other ranks can wait
    for it without a size first): [go, batch, seq, then every input flattened in INPUTS order];
    go = 0 ends the ranks' loop."""

    def __init__(self, batch_max: int, seq_max: int, max_pages: int):
        self.size = 3 + batch_max * (2 * seq_max + max_pages + 3)
        self.max_pages = max_pages

    def encode(self, env: dict[str, int] | None, inputs: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        t = torch.zeros(self.size, dtype=torch.int64)
        if env is None:
            return t
        parts = [torch.tensor([1, env["batch"], env["seq"]])] + [inputs[k].reshape(-1) for k in INPUTS]
        flat = torch.cat(parts)
        t[:flat.numel()] = flat
        return t

    def decode(self, t: torch.Tensor) -> tuple[dict[str, int], dict[str, torch.Tensor]] | None:
        if int(t[0]) == 0:
            return None
        b, s = int(t[1]), int(t[2])
        shapes = {"input_ids": (b, s), "position_ids": (b, s), "block_table": (b, self.max_pages),
                  "start": (b,), "lens": (b,), "last": (b,)}
        out, at = {}, 3
        for k in INPUTS:
            n = int(torch.Size(shapes[k]).numel())
            out[k] = t[at:at + n].reshape(shapes[k]).clone()
            at += n
        return {"batch": b, "seq": s}, out


class BroadcastRunner(ModelRunner):
    """Rank 0's model runner: each step's inputs go to the other ranks before its plan runs."""

    def __init__(self, base: ModelRunner, comm: Any, codec: StepCodec):
        super().__init__(base.cm, base.cache, base.batch_buckets, base.seq_buckets)
        self.comm, self.codec = comm, codec

    running = False      # between a step's broadcast and the end of rank 0's own run of it

    def _run(self, env: dict[str, int], inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        self.running = True
        self.comm.broadcast(self.codec.encode(env, inputs), 0)
        out = super()._run(env, inputs)
        self.running = False
        return out

    def stop(self) -> None:
        """The other ranks leave their step loop."""
        self.comm.broadcast(self.codec.encode(None), 0)

    def keepalive(self) -> None:
        """No step yet: the other ranks keep waiting (their wait restarts its timeout)."""
        t = self.codec.encode(None)
        t[0] = KEEPALIVE
        self.comm.broadcast(t, 0)


class RankDecoder:
    """What one rank holds: its decode engine (the launcher's `cm` for a decoder recipe). Rank 0
    runs requests (`rank_generate`), the others follow its steps (`rank_follow`)."""

    def __init__(self, engine: DecodeEngine, rank: int, comm: Any, comm_timeout_s: float = 60.0, *,
                 tokenizer: Any = None):
        self.engine, self.rank, self.comm, self.comm_timeout_s = engine, rank, comm, comm_timeout_s
        self.tokenizer = tokenizer      # saved with the rank's file (decode/saved.py), rank 0's read at load
        layout = engine.layout
        runner = engine.runner
        self.codec = StepCodec(runner.batch_buckets[-1], runner.seq_buckets[-1], layout.max_pages_per_seq)
        if rank == 0:
            engine.runner = BroadcastRunner(runner, comm, self.codec)
        self.graph = runner.cm.graph
        self.last_path: dict = {}
        self.rank_info = {"kv_heads": layout.kv_heads, "kv_pool_bytes": engine.cache.bytes,
                          "proof_kv_bytes": proof_kv_bytes(engine), "eos": engine.cfg.get("eos"),
                          "vocab": engine.cfg.get("vocab")}

    def save(self, path: Any, *, rank: int) -> dict:
        """This rank's shard as its `.gm` (the group's "save" message: runtime/rank_artifacts.py)."""
        from graphmode.decode.saved import save_engine
        return save_engine(self.engine, path, rank=rank, tokenizer=self.tokenizer)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise NotOnRanks("a tensor-parallel decoder's ranks hold the paged decode graph, not the whole-sequence "
                         "forward", where="parallel", fix="generate / stream, or parallel.tensor: 1 to call it")

    def sample_inputs(self, env: Any, seed: int = 0) -> Any:
        return self()

    def _counters(self) -> tuple:
        c = self.comm
        return c.calls, c.bytes, c.seconds, c.stats()

    def _meta(self, before: tuple, **more: Any) -> dict:
        c = self.comm
        return {"collectives": c.calls - before[0], "comm_bytes": c.bytes - before[1],
                "comm_s": c.seconds - before[2], "per_op": stats_delta(c.stats(), before[3]), **more}

    def rank_generate(self, conn: Any, prompts: list[list[int]], params: Any) -> None:
        """Rank 0: run the prompts to the end, ("step", {prompt: new tokens}) after each step
        that chose any; a ("cancel",) from the caller cancels the rest. The other ranks are
        released at the end whatever happens (a refused prompt included)."""
        eng, runner = self.engine, self.engine.runner
        before, counts = self._counters(), dict(eng.stats)
        ended = False
        try:
            with torch.inference_mode(), closing(_steps(eng, prompts, params)) as steps:   # closed: cancelled
                for out in steps:
                    conn.send(("step", out))
                    if conn.poll() and conn.recv()[0] == "cancel":
                        break
            ended = True
        finally:
            try:
                runner.stop()
            except Exception:  # noqa: BLE001 - a broken group: the error that broke it is raised
                if ended:
                    raise
        stats = {k: v - counts.get(k, 0) for k, v in eng.stats.items()}
        conn.send(("ok", None, self._meta(before, stats=stats)))

    def rank_engine(self, conn: Any) -> None:
        """Rank 0: serve a `RemoteEngine`'s add / cancel / step messages (decode/tp_engine.py)."""
        engine_loop(self, conn, keepalive_s=self.comm_timeout_s / 4)

    def keepalive(self) -> None:
        self.engine.runner.keepalive()

    def rank_follow(self, conn: Any) -> None:
        """Ranks 1..N-1: run each step rank 0 broadcasts until it says stop."""
        before, steps = self._counters(), 0
        cm = self.engine.runner.cm
        buf = torch.zeros(self.codec.size, dtype=torch.int64)
        with torch.inference_mode():
            while True:
                got = self.comm.broadcast(buf, 0)
                if int(got[0]) == KEEPALIVE:
                    continue
                step = self.codec.decode(got)
                if step is None:
                    break
                cm.executable(step[0]).run(step[1])
                steps += 1
        conn.send(("ok", None, self._meta(before, steps=steps)))


def proof_kv_bytes(engine: DecodeEngine) -> int:
    """The KV term of the rank's memory proof: its lowering's, or for a loaded file (proved at
    its compile) the same term of the recipe (recipe/constraints.py: the pool over the ranks)."""
    if engine.lowered is not None:
        return int(engine.lowered.proof.model.memory_terms["kv_cache"])
    from graphmode.recipe.facts import kv_cache_bytes
    rec = engine.runner.cm.recipe
    return -(-int(kv_cache_bytes(rec)) // rec.parallel.tensor)


def compile_rank(model: Any, recipe: Any, target: Any, *, mode: str | None = None, cache_dir: Any = None,
                 threads: int | None = None, warmup: bool = True, rank: int = 0,
                 on_stage: Any = None) -> RankDecoder:
    """A rank's decode engine (`RankDriver.compile` for a decoder recipe): its shard, its plans.
    `model` is anything graphmode.compile takes, or the transformers causal LM itself."""
    from graphmode.capture.source import resolve_model
    from graphmode.decode.api import causal_lm
    src = model if hasattr(model, "get_output_embeddings") else resolve_model(model, recipe)
    lm = src if src is model else causal_lm(src)
    eng = DecodeEngine.build(lm, recipe, target, cache_dir=cache_dir, threads=threads, rank=rank, on_stage=on_stage)
    if warmup:
        eng.warmup()
    return RankDecoder(eng, rank, active(), float(recipe.parallel.comm.timeout_s),
                       tokenizer=getattr(getattr(src, "bundle", None), "tokenizer", None))


class TensorParallelDecoder:
    """The ranks of a decoder recipe under `parallel.tensor` N > 1, used like a decoding
    CompiledModel: `generate` / `stream` (transformers' API, as graphmode/decode/api.py), and
    `ranks` (per rank: pid, weight bytes, KV pool bytes and heads, the proof's KV term),
    `last_comm` (per rank, the last request's collectives) and `last_stats` (rank 0's engine
    counts). A context manager; `close()` stops the ranks."""

    captured_graph = None           # each rank captured and holds its own (the knowledge base reads these)
    _graph_hash = None

    def __init__(self, tp: Any, *, threads: int | None = None):
        self.tp = tp
        self.threads = threads          # each rank's
        self.cfg = {"eos": tp.ranks[0].get("eos"), "vocab": tp.ranks[0].get("vocab")}
        self.last_comm: list[dict] = []
        self.last_stats: dict = {}
        self._engine: RemoteEngine | None = None

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name == "tp":
            raise AttributeError(name)
        return getattr(self.tp, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise NotOnRanks("a tensor-parallel decoder's ranks hold the paged decode graph, not the whole-sequence "
                         "forward", where="parallel", fix="generate / stream, or parallel.tensor: 1 to call it")

    def stream(self, input_ids: Any, attention_mask: Any = None, *, max_new_tokens: int = 20,
               do_sample: bool = False, temperature: float = 1.0, top_k: int | None = None,
               top_p: float | None = None, eos_token_id: Any = MODEL_EOS, seed: int | None = None
               ) -> Iterator[dict[int, list[int]]]:
        """Yields {row: new tokens} after every decode step that chose any."""
        from graphmode.decode.api import _prompts, sampling_params
        _, prompts = _prompts(input_ids, attention_mask)
        params = sampling_params(self, max_new_tokens, do_sample, temperature, top_k, top_p, eos_token_id, seed)
        yield from self._steps(prompts, params)

    def generate(self, input_ids: Any, attention_mask: Any = None, *, max_new_tokens: int = 20,
                 pad_token_id: int | None = None, **kw: Any) -> torch.Tensor:
        """Each row as given followed by its new tokens (early finishers padded), as
        transformers' generate."""
        from graphmode.decode.api import _prompts, sampling_params
        ids, prompts = _prompts(input_ids, attention_mask)
        params = sampling_params(self, max_new_tokens, kw.pop("do_sample", False), kw.pop("temperature", 1.0),
                                 kw.pop("top_k", None), kw.pop("top_p", None), kw.pop("eos_token_id", MODEL_EOS),
                                 kw.pop("seed", None))
        if kw:
            raise ContractViolation(f"unknown generate argument(s) {sorted(kw)}", where="generate",
                                    fix="max_new_tokens, do_sample, temperature, top_k, top_p, eos_token_id, "
                                        "pad_token_id, seed")
        new: list[list[int]] = [[] for _ in prompts]
        for step in self._steps(prompts, params):
            for i, toks in step.items():
                new[i].extend(toks)
        pad = pad_token_id if pad_token_id is not None else (min(params.eos) if params.eos else 0)
        out = torch.full((ids.shape[0], ids.shape[1] + max(len(n) for n in new)), pad, dtype=ids.dtype)
        out[:, :ids.shape[1]] = ids
        for i, n in enumerate(new):
            out[i, ids.shape[1]:ids.shape[1] + len(n)] = torch.tensor(n, dtype=ids.dtype)
        return out

    def _steps(self, prompts: Sequence[list[int]], params: Any) -> Iterator[dict[int, list[int]]]:
        tp = self.tp
        if self._engine is not None:
            raise NotOnRanks("rank 0 serves a decode engine driven step by step (engine()); generate / stream "
                             "would interleave with it", where="parallel", fix="add requests to the engine instead")
        wait_s = tp.timeout_s + MARGIN_S
        tp.send({0: ("method", "generate", (list(prompts), params)),
                 **{r: ("method", "follow", ()) for r in range(1, tp.world)}})
        ended = False
        try:
            while True:
                rep = tp.receive(0, wait_s, "decode step")
                if rep[0] != "step":
                    break
                yield rep[1]
            ended = True
        finally:
            if not ended and tp._down is None:       # abandoned: rank 0 cancels, its last messages are read
                tp.send({0: ("cancel",)})
                while (rep := tp.receive(0, wait_s, "cancelled decode"))[0] == "step":
                    pass
            if tp._down is None:
                self.last_comm = [rep[2] if rep[0] == "ok" else {}] + [
                    r[2] for r in tp.collect(list(range(1, tp.world)), wait_s, "decode steps")]
        if rep[0] == "error":
            raise rep[1]                 # a refused request (ContractViolation): the group stays up
        self.last_stats = dict(rep[2].get("stats", {}))

    def engine(self) -> RemoteEngine:
        """Rank 0's decode engine, driven from here step by step (the server's decode loop,
        `graphmode generate`): started once; `generate` / `stream` are refused meanwhile."""
        if self._engine is None:
            tp = self.tp
            tp.send({0: ("method", "engine", ()), **{r: ("method", "follow", ()) for r in range(1, tp.world)}})
            rep = tp.receive(0, tp.timeout_s + MARGIN_S, "decode engine start")
            if rep[0] != "ready":
                raise rep[1]
            self._engine = RemoteEngine(tp, rep[1])
        return self._engine

    def close(self) -> None:
        if self._engine is not None and self.tp._down is None:
            try:
                self._engine.close()
            except Exception:  # noqa: BLE001 - the group is stopped below whatever happened
                pass
        self.tp.close()

    def __enter__(self) -> "TensorParallelDecoder":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def launch_decoder(model: Any, recipe: Any, target: Any, *, cache_dir: Any = None, threads: int | None = None,
                   driver: RankDriver | None = None, on_stage: Any = None) -> TensorParallelDecoder:
    """Start the `parallel.tensor` ranks of a decoder recipe (module doc); returns once every
    rank has built its engine and plans (`on_stage` hears rank 0's), or raises the first rank's
    error (typed)."""
    if recipe.memory.kv_cache is None:
        raise GraphmodeError("tensor-parallel decoding needs a paged KV cache", where="memory.kv_cache",
                             fix="add memory.kv_cache to the recipe")
    threads = threads or max(1, (os.cpu_count() or 1) // recipe.parallel.tensor)
    return TensorParallelDecoder(launch(model, recipe, target, driver=driver or decoder_driver(), mode="graph",
                                       cache_dir=cache_dir, threads=threads, on_stage=on_stage), threads=threads)


def decoder_driver() -> RankDriver:
    """What a decoder recipe's rank needs (its decode engine: `compile_rank`), for `launch` and torchrun."""
    from graphmode.capture.source import resolve_model
    from graphmode.compile_report import graph_collectives
    from graphmode.runtime.rank_artifacts import save_group
    return RankDriver(compile=compile_rank, resolve_model=resolve_model, collectives=graph_collectives,
                      save=save_group)
