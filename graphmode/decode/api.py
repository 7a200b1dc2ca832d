"""`CompiledModel.generate` / `stream`: transformers' `generate` API over the decode engine
(`graphmode.compile` attaches this module to a model whose recipe declares memory.kv_cache).

Prompts come as transformers gives them: `input_ids` [batch, length] with an optional
`attention_mask` (left or right padding, or none). The result is transformers' too: each
row as it was given, followed by its new tokens; a row that finished early (end-of-sequence)
is padded with `pad_token_id` (the model config's, else its end-of-sequence id). Each sequence is computed as if it ran alone (its own
positions from 0, its own pages), batched with the others at every step.
"""
from __future__ import annotations

import threading
from contextlib import closing, nullcontext
from typing import Any, Iterator, Sequence

import torch

from graphmode.decode.engine import drive
from graphmode.decode.sampling import SamplingParams
from graphmode.errors import ContractViolation, GraphmodeError


_ENGINE_LOCK = threading.Lock()      # one engine per model, whichever thread asks first


class _ModelEos:
    """`eos_token_id` left out: the model's own (its generation config's, else its config's).
    An explicit None stops at no token, as transformers' generate does."""

    def __repr__(self) -> str:
        return "the model's eos_token_id"


MODEL_EOS: Any = _ModelEos()


def _say_what_checks_narrow_weights(recipe: Any) -> None:
    """Tokens from narrow weights differ from the f32 model's by design, and decoding checks
    nothing (a model whose top-1 int8 flips was decoded from Python without a word, while
    `graphmode verify` refused it): a notice, from the CLI, the API and the server alike."""
    weights = recipe.precision.weights
    if weights != "f32":
        import warnings

        from graphmode.errors import GraphmodeNotice
        warnings.warn(GraphmodeNotice(
            f"{weights} weights change the model's answers by their rounding, and decoding checks nothing: "
            "`graphmode verify --model <the model> --recipe <this recipe>` holds them to the weight-only contract "
            "(top-1 agreement with the f32 model)"), stacklevel=4)


def engine_of(cm: Any):
    """The model's decode engine, built once, on first use, from its recipe's KV cache: its own
    lowering of the paged graph (the whole-sequence graph of a decoder recipe is lowered only
    for a forward call: graphmode/runtime/deferred.py). For the ranks of a tensor-parallel
    recipe (`TensorParallelDecoder`): rank 0's engine, driven from here (decode/tp_engine.py)."""
    remote = getattr(type(cm), "engine", None)
    if remote is not None:
        return cm.engine()
    eng = getattr(cm, "_decoder", None)
    if eng is not None:
        return eng
    # a DeferredModel's lowering lock too: its whole-sequence lowering and this one never overlap
    with _ENGINE_LOCK, getattr(cm, "lowering_lock", None) or nullcontext():
        eng = getattr(cm, "_decoder", None)
        if eng is None:
            _say_what_checks_narrow_weights(cm.recipe)
        if eng is None and (getattr(cm, "artifact", None) or {}).get("decoder") is not None:
            from graphmode.decode.saved import engine_over      # a loaded .gm: its plans, no module
            eng = cm._decoder = engine_over(cm)
        elif eng is None:
            from graphmode.decode.engine import DecodeEngine
            lm = causal_lm(cm.source)
            eng = DecodeEngine.build(lm, cm.recipe, cm.target, cache_dir=cm.cache_dir, threads=cm.threads,
                                     on_stage=cm.on_stage, name=getattr(cm.source, "name", None) or "lm")
            cm._decoder = eng
    return eng


def causal_lm(model: Any, where: str = "model") -> torch.nn.Module:
    """The transformers *ForCausalLM inside a ModelBundle or ModelSource (its `raw_module` for
    the built-ins, whose `module` is a wrapper), or the model itself (a spec returning it alone,
    as `serve` keeps it), or GraphmodeError naming `where`."""
    bundle = getattr(model, "bundle", None) or model
    for m in (getattr(bundle, "raw_module", None), getattr(model, "module", None), getattr(bundle, "module", None),
              model if isinstance(model, torch.nn.Module) else None):
        if m is not None and hasattr(m, "config") and hasattr(m, "get_output_embeddings"):
            return m
    raise GraphmodeError("decoding needs a causal language model (a transformers *ForCausalLM)", where=where,
                         value=getattr(model, "name", None),
                         fix="give gpt2 or a model spec returning a transformers *ForCausalLM (or a bundle of one)")


def _prompts(input_ids: Any, attention_mask: Any) -> tuple[torch.Tensor, list[list[int]]]:
    ids = input_ids if isinstance(input_ids, torch.Tensor) else torch.tensor(input_ids, dtype=torch.int64)
    if ids.dim() == 1:
        ids = ids[None]
    if ids.dim() != 2 or ids.dtype not in (torch.int64, torch.int32):
        raise ContractViolation("input_ids must be integer token ids of shape [batch, length]", where="input_ids",
                                value=(tuple(ids.shape), str(ids.dtype)))
    mask = attention_mask
    if mask is not None and not isinstance(mask, torch.Tensor):
        mask = torch.tensor(mask)
    for name, t in (("input_ids", ids), ("attention_mask", mask)):
        if t is not None and t.device.type != "cpu":       # a meta tensor has no values to read
            raise ContractViolation(f"{name} is a {t.device.type} tensor: generation reads its values on the CPU",
                                    kind="input", where=name, value=str(t.device),
                                    fix=f"pass a CPU tensor with data ({name}.cpu(); a meta tensor has none)")
    if mask is None:
        return ids, [row.tolist() for row in ids]
    if mask.shape != ids.shape:
        raise ContractViolation("attention_mask must have input_ids' shape", where="attention_mask",
                                value=tuple(mask.shape))
    return ids, [row[m.bool()].tolist() for row, m in zip(ids, mask)]


def sampling_params(eng: Any, max_new_tokens: int, do_sample: bool, temperature: float, top_k: int | None,
                    top_p: float | None, eos_token_id: Any, seed: int | None,
                    stop: Sequence[Sequence[int]] = (), **more: Any) -> SamplingParams:
    eos = eng.cfg.get("eos") if eos_token_id is MODEL_EOS else eos_token_id
    if isinstance(eos, (list, tuple)):
        eos = tuple(int(e) for e in eos)
    vocab = int(eng.cfg.get("vocab") or 0)
    given = [] if eos_token_id is MODEL_EOS or eos is None else [eos] if isinstance(eos, int) else list(eos)
    if vocab and any(not 0 <= e < vocab for e in given):       # a token never generated: it would never stop
        raise GraphmodeError(f"eos_token_id must be in [0, {vocab})", where="eos_token_id",
                             value=[e for e in given if not 0 <= e < vocab][:5],
                             fix="an id of the model's vocabulary (or leave it out: the model's own)")
    if top_k == 0 and type(top_k) is int:       # transformers' generate: 0 filters nothing
        top_k = None
    try:
        return SamplingParams(max_new_tokens=max_new_tokens, do_sample=do_sample, temperature=temperature,
                              top_k=top_k, top_p=top_p, eos_token_id=eos, seed=seed,
                              stop=tuple(tuple(s) for s in stop), **more)
    except GraphmodeError as e:
        if e.where not in _OURS:
            raise
        raise GraphmodeError(e.message.replace(e.where, _OURS[e.where]), where=_OURS[e.where], value=e.value,
                             fix=e.fix) from None


_OURS = {"min_tokens": "min_new_tokens"}    # SamplingParams' field -> the generate() argument it came from


# transformers' generate arguments graphmode's decode engine does not run, and what does
_NOT_RUN = {"num_beams": "beam search is not implemented: greedy (do_sample=False) or sampling (do_sample=True)",
            "num_return_sequences": "repeat the prompt in input_ids: each row samples on its own",
            "no_repeat_ngram_size": "repetition_penalty, or the server's presence/frequency penalties",
            "max_length": "max_new_tokens (tokens after the prompt)",
            "output_scores": "the server's logprobs (/v1/completions)",
            "return_dict_in_generate": "the token ids tensor is what generate returns",
            **dict.fromkeys(("stop", "stop_strings", "stop_token_ids"),
                            "stop sequences are the engine's: engine_of(cm).add(prompt, SamplingParams(stop=((id, "
                            "...),))), the server's `stop`, or `graphmode generate --stop/--stop-ids`")}


def _transformers_kwargs(fn: str, kw: dict[str, Any]) -> dict[str, Any]:
    """transformers' names the engine runs (repetition_penalty, min_new_tokens), as its
    SamplingParams; any other argument is refused naming it (it was a bare TypeError)."""
    more = {}
    for k, v in kw.items():
        if k == "repetition_penalty":
            more["repetition_penalty"] = v
        elif k == "min_new_tokens":
            more["min_tokens"] = v
        elif k == "min_p":
            more["min_p"] = v or None             # transformers' generate: 0 or None filters nothing
        else:
            raise GraphmodeError(f"{fn}() does not take {k}", where=k, value=v,
                                 fix=_NOT_RUN.get(k, "its arguments: max_new_tokens, do_sample, temperature, top_k, "
                                                     "top_p, min_p, eos_token_id, pad_token_id, seed, "
                                                     "repetition_penalty, min_new_tokens"))
    return more


def _of_row(e: ContractViolation, row: int, rows: int) -> ContractViolation:
    """A prompt's refusal naming its row of input_ids (a batch's), with a fix where it had none."""
    if e.where != "prompt":
        return e
    what = "input_ids" + (f" row {row}" if rows > 1 else "")
    fix = ("send at least one token: a row of input_ids with at least one position unmasked in attention_mask"
           if e.message == "empty prompt" else
           e.fix or f"use token ids the model's vocabulary holds ({e.message.split('must be in ')[-1]})")
    return ContractViolation(e.message, kind=e.kind, where=what, value=e.value, fix=fix)


def _steps(eng: Any, prompts: list[list[int]], params: SamplingParams) -> Iterator[dict[int, list[int]]]:
    """{prompt index: tokens new in this step} after every step until every prompt is done (a
    step can add two tokens to a sequence: its prefill's and its first decode's)."""
    ready: list[tuple[int, int]] = []
    seqs = []
    try:
        for row, p in enumerate(prompts):
            try:
                seqs.append(eng.add(p, params, on_token=lambda sid, tok: ready.append((sid, tok))))
            except ContractViolation as e:
                raise _of_row(e, row, len(prompts)) from None
    except BaseException:
        for s in seqs:
            eng.cancel(s)
        raise
    index = {s.id: i for i, s in enumerate(seqs)}
    with closing(drive(eng, seqs)) as steps:       # an abandoned stream gives its pages back
        for _ in steps:
            if ready:
                out: dict[int, list[int]] = {}
                for sid, tok in ready:
                    out.setdefault(index[sid], []).append(tok)
                ready.clear()
                yield out


def generate(cm: Any, input_ids: Any, attention_mask: Any = None, *, max_new_tokens: int = 20,
             do_sample: bool = False, temperature: float = 1.0, top_k: int | None = None,
             top_p: float | None = None, eos_token_id: Any = MODEL_EOS, pad_token_id: int | None = None,
             seed: int | None = None, **kw: Any) -> torch.Tensor:
    more = _transformers_kwargs("generate", kw)
    eng = engine_of(cm)
    ids, prompts = _prompts(input_ids, attention_mask)
    params = sampling_params(eng, max_new_tokens, do_sample, temperature, top_k, top_p, eos_token_id, seed, **more)
    new: list[list[int]] = [[] for _ in prompts]
    for step in _steps(eng, prompts, params):
        for i, toks in step.items():
            new[i].extend(toks)
    pad = next((p for p in (pad_token_id, eng.cfg.get("pad"), min(params.eos) if params.eos else None)
                if p is not None), 0)     # as transformers: the config's pad token, else end-of-sequence
    width = max(len(n) for n in new)
    out = torch.full((ids.shape[0], ids.shape[1] + width), pad, dtype=ids.dtype)
    out[:, :ids.shape[1]] = ids
    for i, n in enumerate(new):
        out[i, ids.shape[1]:ids.shape[1] + len(n)] = torch.tensor(n, dtype=ids.dtype)
    return out


def save(cm: Any, path: Any, **kw: Any) -> dict[str, Any]:
    """`CompiledModel.save` of a decoder: its decode engine's paged graph and plans (decode/saved.py)."""
    from graphmode.decode.saved import save as save_decoder
    return save_decoder(cm, path, **kw)


def stream(cm: Any, input_ids: Any, attention_mask: Any = None, *, max_new_tokens: int = 20,
           do_sample: bool = False, temperature: float = 1.0, top_k: int | None = None,
           top_p: float | None = None, eos_token_id: Any = MODEL_EOS, pad_token_id: int | None = None,
           seed: int | None = None, **kw: Any) -> Iterator[dict[int, list[int]]]:
    """Yields {row: new tokens} after every decode step (TTFT is the first yield); it pads
    nothing, so `pad_token_id` (taken as generate takes it) changes nothing."""
    more = _transformers_kwargs("stream", kw)
    eng = engine_of(cm)
    _, prompts = _prompts(input_ids, attention_mask)
    params = sampling_params(eng, max_new_tokens, do_sample, temperature, top_k, top_p, eos_token_id, seed, **more)
    yield from _steps(eng, prompts, params)
