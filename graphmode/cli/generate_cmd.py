"""`graphmode generate`: decode a causal LM under a decoder recipe (one with memory.kv_cache),
greedy or sampled, printed at the end or streamed, with its time to first token and decode
tokens/s.

What can be refused without compiling is refused before the compile (a GPT-2 small compile
takes a minute): a recipe without a KV cache, ids that do not parse or are outside the
vocabulary, a prompt longer than the contract's `seq`, text for a model without a tokenizer.
The plans a request runs are built before the clock starts, so TTFT is the request's, not
the compiler's.
"""
from __future__ import annotations

import json
import time
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, List, Optional

import typer

from graphmode.cli.app import app, err_console
from graphmode.cli.options import THREADS_HELP, CacheDir, drafted, model_bundle
from graphmode.cli.progress import progress
from graphmode.decode.output import encode_text
from graphmode.errors import ContractViolation, GraphmodeError, RecipeError
from graphmode.progress import stage

# the engine's and SamplingParams' field names -> the flag a user set (None: the prompt flag)
FLAGS = {"max_new_tokens": "--max-tokens", "temperature": "--temperature", "top_k": "--top-k", "top_p": "--top-p",
         "dims.seq": None, "prompt": None}


def parse_ids(text: str, where: str) -> list[int]:
    """'464,2068' -> [464, 2068]; anything else is refused naming the flag."""
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",")]
    except ValueError:
        raise GraphmodeError(f"cannot parse token ids {text!r}", where=where,
                             fix="write comma-separated integer token ids, e.g. 464,2068") from None
    return ids


def check_ids(seqs: list[list[int]], vocab: int, where: str) -> None:
    for i, s in enumerate(seqs):
        if not s:
            raise GraphmodeError("no token ids", where=f"{where} #{i + 1}", fix="give at least one token")
        bad = [t for t in s if not 0 <= t < vocab]
        if bad:
            raise GraphmodeError(f"token ids must be in [0, {vocab}) for this model", where=f"{where} #{i + 1}",
                                 value=bad[:5], fix=f"use ids below the vocabulary size {vocab}")


@dataclass
class Request:
    """The prompts and stops as token ids, checked against the model and the recipe: everything
    that can be refused before a compile."""

    bundle: Any
    lm: Any                                       # None for a .gm artifact: `cfg` holds its sizes
    cfg: dict[str, Any]                           # decode/lm.py lm_config: vocabulary, end-of-sequence ids
    tokenizer: Any
    flag: str                                     # the prompt's flag, for errors
    prompts: list[list[int]]
    stop_text: tuple[str, ...]
    stop_ids: list[list[int]]

    @property
    def longest(self) -> int:
        return max(len(p) for p in self.prompts)

    @classmethod
    def checked(cls, model: str, rec: Any, prompt: list[str], prompt_ids: list[str], stop: list[str],
                stop_ids: list[str], loaded: Any = None, bundle: Any = None) -> "Request":
        """`loaded`: the `.gm` artifact `model` names, loaded (its sizes and tokenizer are saved in it);
        `bundle`: the model as a draft already resolved it."""
        from graphmode.decode.api import causal_lm
        from graphmode.decode.lm import lm_config
        flag = "--prompt" if prompt else "--prompt-ids"
        stops = [parse_ids(s, "--stop-ids") for s in stop_ids]
        if loaded is not None:
            bundle = lm = None
            # one process's file holds its sizes; a group's rank 0 reported them at start
            cfg = dict(loaded.artifact["decoder"]) if hasattr(loaded, "artifact") else dict(loaded.cfg)
            tok = getattr(loaded, "tokenizer", None)
        else:
            bundle = bundle or model_bundle(model)
            lm = causal_lm(bundle, "--model")
            cfg, tok = lm_config(lm), getattr(bundle, "tokenizer", None)
        if tok is None and (prompt or stop):
            raise GraphmodeError(f"model {model!r} has no tokenizer, so text cannot become token ids",
                                 where="--prompt" if prompt else "--stop",
                                 fix="send token ids: --prompt-ids 464,2068 (and --stop-ids 13), or use a model spec "
                                     "whose bundle carries a tokenizer (a .gm keeps the one it was saved with)")
        for text in [*prompt, *stop]:
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                raise GraphmodeError("the text is not valid Unicode (a lone surrogate: bytes the shell could not "
                                     "decode)", where=flag if text in prompt else "--stop", value=text.encode(
                                         "utf-8", "backslashreplace").decode(), fix="send UTF-8 text") from None
        prompts = [encode_text(tok, p, flag) for p in prompt] if prompt else [parse_ids(p, flag) for p in prompt_ids]
        vocab = int(cfg["vocab"])
        check_ids(prompts, vocab, flag)
        check_ids(stops, vocab, "--stop-ids")
        req = cls(bundle, lm, cfg, tok, flag, prompts, tuple(stop), stops)
        lo, hi = rec.dim_range("seq") if "seq" in rec.dims else (None, None)
        if hi is not None and req.longest > hi:
            raise ContractViolation(f"a prompt has {req.longest} tokens, the recipe's seq allows at most {hi}",
                                    where=flag, value=req.longest,
                                    fix=f"shorten the prompt to {hi} tokens, or raise dims.seq in the recipe")
        shortest = min(len(p) for p in prompts)
        if lo is not None and shortest < lo:
            raise ContractViolation(f"a prompt has {shortest} token(s), the recipe's seq needs at least {lo}",
                                    where=flag, value=shortest,
                                    fix=f"send at least {lo} tokens, or lower dims.seq.min in the recipe")
        return req

    def check_room(self, rec: Any, max_tokens: int) -> None:
        """Prompt and new tokens must fit in one sequence's KV pages."""
        from graphmode.recipe.facts import kv_params
        kv = kv_params(rec)
        room = kv["page_size"] * kv["max_pages_per_seq"]
        context = self.cfg.get("context")
        if self.longest + max_tokens > room:
            more = "" if isinstance(context, int) and context <= room else \
                ", or raise memory.kv_cache.max_pages_per_seq"        # pages past the model's positions never help
            raise ContractViolation(f"{self.longest} prompt + {max_tokens} new tokens exceed the {room} tokens a "
                                    "sequence's KV pages hold" + (f" (the model has {context} positions)"
                                                                  if not more else ""),
                                    where="--max-tokens", value=max_tokens,
                                    fix=f"ask for at most {room - self.longest} new tokens{more}")


def drafted_decoder(model: str) -> tuple[Any, Any]:
    """(the model, its drafted recipe) for `generate` without --recipe, as `graphmode.compile(model)`
    drafts one: a causal LM gets memory.kv_cache; one the decode engine cannot run is refused
    with the drafter's reason."""
    d = drafted(model)
    if d.recipe.memory.kv_cache is None:
        why = d.notes.get("memory.kv_cache", "the model is not a causal LM")
        fix = ("run the model's forward pass with graphmode run" if "cannot decode on graphmode's KV cache" in why
               else "give a decoder recipe (--recipe, with memory.kv_cache), or run the model's forward pass with "
                    "graphmode run")
        raise RecipeError(f"no --recipe, and the recipe drafted for {model} has no KV cache: {why}", where="--recipe",
                          fix=fix)
    return d.source.bundle, d.recipe


def artifact_recipe(model: str, recipe: Optional[str]) -> Any:
    """The recipe a `.gm` `model` was compiled with (None when `model` is not one); a
    `--recipe` other than it is refused: the artifact's plans are that recipe's."""
    from graphmode.recipe import load_recipe
    from graphmode.runtime.artifact import is_artifact, recipe_of
    if not is_artifact(model):
        return None
    own = recipe_of(model)
    if own.memory.kv_cache is None:
        raise RecipeError("this .gm was compiled under a recipe without a KV cache: it answers forward calls, "
                          "not generation", where="--model", value=model,
                          fix="save the causal LM under a decoder recipe (graphmode compile --recipe "
                              "examples/recipes/gpt2_decoder.yaml --save lm.gm), or graphmode run it")
    if recipe is not None and load_recipe(recipe).hash() != own.hash():
        raise RecipeError(f"--recipe {recipe} is not the recipe the artifact was compiled with ({own.name} "
                          f"#{own.hash()})", where="--recipe", value=recipe,
                          fix="drop --recipe (the artifact holds its own), or compile and save again under it")
    return own


def _as_flag(e: GraphmodeError, prompt_flag: str) -> GraphmodeError:
    """The same error, `where` naming the flag behind the field."""
    if e.where not in FLAGS:
        return e
    return type(e)(e.message, where=FLAGS[e.where] or prompt_flag, value=e.value, fix=e.fix)


def sampling(cfg: dict[str, Any], max_tokens: int, temperature: float, top_k: Optional[int], top_p: Optional[float],
             seed: Optional[int], stop_ids: list[list[int]], ignore_eos: bool = False):
    """SamplingParams from the flags (temperature 0 = greedy), ending at the model's
    end-of-sequence token as `generate` does (not with `ignore_eos`, as vLLM's); built before
    the compile, so bad values fail fast."""
    from types import SimpleNamespace

    from graphmode.decode.api import MODEL_EOS, sampling_params
    if not temperature >= 0:                               # NaN too
        raise GraphmodeError("temperature must be a number >= 0", where="--temperature", value=temperature,
                             fix="0 for greedy decoding, > 0 to sample")
    if top_p is not None and not 0 < top_p <= 1:          # the value first: then whether it applies
        raise GraphmodeError("--top-p is a probability mass", where="--top-p", value=top_p, fix="a number in (0, 1]")
    if top_k is not None and top_k < 1:
        raise GraphmodeError("--top-k counts tokens", where="--top-k", value=top_k, fix="a positive integer")
    greedy = temperature == 0
    if greedy and (top_k is not None or top_p is not None):
        raise GraphmodeError("--top-k and --top-p shape sampling, and --temperature 0 decodes greedily",
                             where="--top-k" if top_k is not None else "--top-p",
                             fix="set --temperature above 0 (e.g. 0.8) to sample, or drop --top-k/--top-p")
    try:
        return sampling_params(SimpleNamespace(cfg=cfg), max_tokens, not greedy,
                               1.0 if greedy else temperature, top_k, top_p, None if ignore_eos else MODEL_EOS,
                               seed, stop_ids)
    except GraphmodeError as e:
        raise _as_flag(e, "--prompt") from None


class Row:
    """One prompt's sequence: its output (stop strings and ids held back and cut as the
    server's completions do), token times and finish reason."""

    def __init__(self, index: int, prompt: list[int], out: Any):
        self.index, self.prompt, self.out = index, prompt, out
        self.seq: Any = None
        self.times: list[float] = []           # when the engine produced each token
        self.first_seen: float | None = None    # when the step that produced the first one returned
        self.text = ""
        self.shown = 0                         # ids printed so far (streaming)
        self.finish_reason: str | None = None

    @property
    def tokens(self) -> list[int]:
        return self.out.tokens[:self.out.sent_tokens]

    def timings(self, t0: float) -> dict[str, Any]:
        span = self.times[-1] - self.times[0] if len(self.times) > 1 else 0.0
        return {"ttft_ms": round((self.first_seen - t0) * 1e3, 3) if self.first_seen else None,
                "decode_tok_s": round((len(self.times) - 1) / span, 3) if span > 0 else None}


def submit(eng: Any, prompts: list[list[int]], params: Any, tokenizer: Any, stop_text: tuple[str, ...],
           prompt_flag: str) -> list[Row]:
    """Queue every prompt (nothing runs until the engine steps)."""
    from graphmode.decode.output import ChoiceOutput
    rows = [Row(i, p, ChoiceOutput(i, tokenizer, stop_text, params.stop)) for i, p in enumerate(prompts)]
    by_id: dict[int, Row] = {}

    def on_token(sid: int, tok: int) -> None:
        r = by_id[sid]
        r.times.append(time.perf_counter())
        r.out.tokens.append(tok)

    try:
        for r in rows:
            r.seq = eng.add(r.prompt, params, on_token=on_token)
            by_id[r.seq.id] = r
    except GraphmodeError as e:
        raise _as_flag(e, prompt_flag) from None
    return rows


def run(eng: Any, rows: list[Row], on_chunk: Callable[[Row, list[int], str], None] | None = None
        ) -> tuple[float, float]:
    """Drive the engine until every row is done; `on_chunk(row, ids, text)` gets what can be
    shown after each step. Returns the start and end times."""
    from graphmode.decode.engine import drive
    t0 = time.perf_counter()
    with closing(drive(eng, [r.seq for r in rows])) as steps:
        for _ in steps:
            now = time.perf_counter()
            for r in rows:
                if r.finish_reason is not None:
                    continue
                if r.first_seen is None and r.times:
                    r.first_seen = now
                ids, text = r.out.release(r.seq.finish_reason if r.seq.done else None)
                r.text += text
                if r.out.finish_reason is not None:            # the engine ended it, or a stop string matched
                    hit = r.out.finish_reason == "stop" and r.seq.finish_reason in (None, "length")
                    r.finish_reason = "stop" if hit else r.seq.finish_reason
                    if not r.seq.done:
                        eng.cancel(r.seq)                      # the others need not wait for it
                if on_chunk is not None and (ids or text):
                    on_chunk(r, ids, text)
    return t0, time.perf_counter()


def summary(rows: list[Row], t0: float, t1: float) -> dict[str, Any]:
    """TTFT: until every row's first token reached the caller (the engine hands tokens over when
    its step returns); decode tokens/s of the batch: tokens past each row's first / the time
    from the last first token produced to the last token produced."""
    seen = [r.first_seen for r in rows if r.first_seen is not None]
    firsts = [r.times[0] for r in rows if r.times]
    lasts = [r.times[-1] for r in rows if r.times]
    after = sum(max(len(r.times) - 1, 0) for r in rows)
    span = max(lasts) - max(firsts) if firsts else 0.0
    return {"ttft_ms": round((max(seen) - t0) * 1e3, 3) if seen else None,
            "decode_tok_s": round(after / span, 3) if span > 0 and after else None,
            "total_ms": round((t1 - t0) * 1e3, 3), "new_tokens": sum(len(r.times) for r in rows)}


def printer(as_json: bool, text: bool, batch: bool) -> Callable[[Row, list[int], str], None]:
    """--stream: text as it comes (or ids, space-separated); a batch's chunks one per line,
    `[row] ...`; with --json one JSON line per chunk."""
    def on_chunk(r: Row, ids: list[int], piece: str) -> None:
        if as_json:
            print(json.dumps({"index": r.index, "tokens": ids, "text": piece if text else None}), flush=True)
            return
        if not text:
            piece = (" " if r.shown and not batch else "") + " ".join(map(str, ids))
        r.shown += len(ids)
        print(f"[{r.index}] {piece}" if batch else piece, end="\n" if batch else "", flush=True)
    return on_chunk


@app.command("generate")
def generate_cmd(
    model: str = typer.Option(..., "--model", help="gpt2 | HF folder (save_pretrained) | file.py:function | "
                              "module:function "
                              "(a causal LM) | a decoder's .gm (graphmode compile --save)"),
    recipe: Optional[str] = typer.Option(None, "--recipe", help="a decoder recipe: one with memory.kv_cache (a .gm "
                                         "holds its own; without one, drafted as graphmode.compile(model) does)"),
    prompt: Optional[List[str]] = typer.Option(None, "--prompt", help="prompt text (needs the model's tokenizer); "
                                               "repeat for a batch"),
    prompt_ids: Optional[List[str]] = typer.Option(None, "--prompt-ids", help="prompt token ids, e.g. 464,2068; "
                                                   "repeat for a batch"),
    max_tokens: int = typer.Option(16, "--max-tokens", help="new tokens per prompt at most"),
    temperature: float = typer.Option(0.0, "--temperature", help="0 = greedy; > 0 samples"),
    top_k: Optional[int] = typer.Option(None, "--top-k", help="sample from the k most likely tokens"),
    top_p: Optional[float] = typer.Option(None, "--top-p", help="sample from the smallest set with this mass"),
    seed: Optional[int] = typer.Option(None, "--seed", help="sampling seed: the same seed gives the same tokens"),
    stop: Optional[List[str]] = typer.Option(None, "--stop", help="stop string, cut from the output (needs the "
                                             "tokenizer); repeatable"),
    stop_ids: Optional[List[str]] = typer.Option(None, "--stop-ids", help="stop token-id sequence, e.g. 13,13, cut "
                                                 "from the output; repeatable"),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="do not stop at the model's end-of-sequence token "
                                    "(vLLM's ignore_eos): --max-tokens tokens unless a stop matches"),
    stream: bool = typer.Option(False, "--stream", help="print tokens as they are generated"),
    threads: Optional[int] = typer.Option(None, "--threads", min=1, max=1024, help=THREADS_HELP),
    cache_dir: Optional[Path] = CacheDir,
    as_json: bool = typer.Option(False, "--json", help="tokens, text, finish_reason and timings as JSON "
                                 "(with --stream: one JSON line per chunk, then the result on one line)"),
) -> None:
    """Generate tokens with a causal LM compiled under a decoder recipe."""
    import graphmode
    from graphmode.compiler import compile as gm_compile, tensor_parallel
    from graphmode.decode.api import engine_of
    from graphmode.paths import cache_layout
    from graphmode.recipe import load_recipe, validate
    from graphmode.targets import get_target

    if bool(prompt) == bool(prompt_ids):
        raise GraphmodeError("give the prompt as text or as token ids (one of the two)", where="--prompt/--prompt-ids",
                             fix="--prompt 'some text' (a model with a tokenizer) or --prompt-ids 464,2068; "
                                 "repeat either for a batch")
    log = (lambda s: None) if as_json else (lambda s: err_console.print(s, markup=False, highlight=False,
                                                                      soft_wrap=True))
    rec = saved = artifact_recipe(model, recipe)
    bundle = None
    if rec is None and recipe is None:       # as graphmode.compile(model): a drafted decoder recipe
        bundle, rec = drafted_decoder(model)
        log(f"no --recipe: drafted {rec.name} ({rec.hash()}); `graphmode recipe init --model {model} -o r.yaml` "
            "writes it out with where each value came from")
    elif rec is None:
        rec = load_recipe(recipe)
    if rec.memory.kv_cache is None:
        if saved is None:           # a model that cannot decode says why, not "add a KV cache" (then refused)
            from graphmode.decode.api import causal_lm
            from graphmode.decode.lm import refuse_alibi
            bundle = bundle or model_bundle(model)
            refuse_alibi(causal_lm(bundle, "--model"))
        raise RecipeError("generating needs a paged KV cache, and this recipe has none", where="memory.kv_cache",
                          value=recipe, fix="add memory.kv_cache {page_size, max_pages_per_seq, layers, kv_heads, "
                                            "head_dim} (see examples/recipes/gpt2_decoder.yaml)")
    with progress() as on_stage:     # loading the model, then the decode engine's capture, passes and plans
        with stage(on_stage, "load", detail=model):
            loaded = graphmode.load(model, cache_dir=cache_dir, threads=threads, on_stage=on_stage) \
                if saved is not None else None
            req = Request.checked(model, rec, prompt or [], prompt_ids or [], stop or [], stop_ids or [], loaded,
                                  bundle)
        params = sampling(req.cfg, max_tokens, temperature, top_k, top_p, seed, req.stop_ids, ignore_eos)
        req.check_room(rec, max_tokens)

        t0 = time.perf_counter()
        host = get_target("host", cache_dir=cache_layout(cache_dir).targets)
        with stage(on_stage, "proof"):
            # refused or malformed stops here; a bound left unproved for want of the model's facts
            # (no `model:` section) is proved by the decode engine with its graph's own (a .gm: at its compile)
            rep = validate(rec, host)
            if rep.verdict in ("malformed", "refused"):
                rep.raise_for_errors()
        ranks = tensor_parallel(rec)
        if loaded is not None:      # its plans are built: nothing to capture or compile
            cm = loaded
        elif ranks > 1:      # graphmode.compile starts the ranks; rank 0's engine is driven from here
            with stage(on_stage, "ranks", detail=f"{ranks} processes compile their shards"):
                # the transformers model crosses to the ranks pickled (a bundle's wrapper need not pickle)
                cm = graphmode.compile(req.lm, rec, host, cache_dir=cache_dir, threads=threads, on_stage=on_stage)
        else:              # no whole-sequence graph: it would never run; the decode engine captures its own
            cm = gm_compile(req.bundle, rec, host, mode="eager", cache_dir=cache_dir, threads=threads,
                            on_stage=on_stage)
        try:
            eng = engine_of(cm)
            rows = submit(eng, req.prompts, params, req.tokenizer, req.stop_text, req.flag)
            eng.prepare(len(req.prompts), req.longest)
        except BaseException:
            if ranks > 1:
                cm.close()           # a refused prompt: the ranks stop too
            raise
    setup_s = time.perf_counter() - t0
    log(f"{model}: {'loaded' if loaded is not None else 'compiled'} under recipe {rec.name} and built its plans "
        f"in {setup_s:.1f}s"
        + (f" ({ranks} tensor-parallel ranks)" if ranks > 1 else ""))

    text, batch = req.tokenizer is not None, len(req.prompts) > 1
    before = dict(eng.stats)
    try:
        t_start, t_end = run(eng, rows, printer(as_json, text, batch) if stream else None)
        spec = _speculation(before, dict(eng.stats))
    finally:
        if ranks > 1:
            cm.close()
    timing = summary(rows, t_start, t_end)
    result = {"model": model, "recipe": rec.name,
              "choices": [{"index": r.index, "prompt_tokens": len(r.prompt), "tokens": r.tokens,
                           "text": r.text if text else None, "finish_reason": r.finish_reason, **r.timings(t_start)}
                          for r in rows],
              "timings": {**timing, "setup_s": round(setup_s, 3)}, **({"speculative": spec} if spec else {})}
    if as_json:
        print(json.dumps(result, indent=None if stream else 2))
        return
    if stream and not batch:
        print()
    elif not stream:
        for c in result["choices"]:
            piece = c["text"] if text else " ".join(map(str, c["tokens"]))
            print(f"[{c['index']}] {piece}" if batch else piece)
    ttft = "-" if timing["ttft_ms"] is None else f"{timing['ttft_ms']:.1f} ms"
    tps = "-" if timing["decode_tok_s"] is None else f"{timing['decode_tok_s']:.1f} tok/s"
    shown = sum(len(r.tokens) for r in rows)
    cut = f" ({timing['new_tokens']} generated, stop sequences cut)" if shown != timing["new_tokens"] else ""
    drafts = (f"; speculative: {spec['accepted_tokens']} of {spec['draft_tokens']} draft tokens accepted over "
              f"{spec['decode_steps']} decode steps" if spec else "")
    log(f"{shown} new token(s){cut}, finish: {', '.join(r.finish_reason for r in rows)}; "
        f"TTFT {ttft}, decode {tps}{drafts}")


def _speculation(before: dict[str, int], after: dict[str, int]) -> dict[str, Any] | None:
    """This run's draft tokens proposed and accepted (decode.speculative), from the engine's counters."""
    if "draft_tokens" not in after:
        return None
    out = {k: after.get(k, 0) - before.get(k, 0) for k in ("draft_tokens", "accepted_tokens", "decode_steps")}
    out["accept_rate"] = round(out["accepted_tokens"] / out["draft_tokens"], 4) if out["draft_tokens"] else None
    return out
