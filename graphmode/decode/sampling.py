"""Next-token choice: penalties and min_tokens, then greedy, or sampling with temperature / top-k /
top-p in transformers' order; the log-probabilities a request asks for."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from graphmode.errors import GraphmodeError

MAX_LOGPROBS = 20            # top logprobs per token (vLLM's default max_logprobs)


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 16
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None                   # vLLM's / transformers': drop tokens under min_p x the top probability
    eos_token_id: int | tuple[int, ...] | None = None
    seed: int | None = None
    stop: tuple[tuple[int, ...], ...] = ()       # token-id sequences that end generation: on_token and
    #   `generated` see each token as it is chosen; ChoiceOutput (the server, the CLI) cuts the stop sequence
    presence_penalty: float = 0.0                # OpenAI's: minus this from the logit of each token generated so far
    frequency_penalty: float = 0.0               # ... minus this times how often it was generated
    repetition_penalty: float = 1.0              # transformers' / vLLM's: prompt and generated tokens' logits / this
    min_tokens: int = 0                          # no end-of-sequence or stop before this many tokens
    logprobs: int | None = None                  # None: none; k: the chosen token's logprob and the k most likely
    logit_bias: tuple[tuple[int, float], ...] = ()   # OpenAI's: (token, bias in [-100, 100]) added to its logit

    def __post_init__(self):
        def bad(field: str, value, fix: str):
            raise GraphmodeError(f"invalid sampling parameter {field}", where=field, value=value, fix=fix)
        if not isinstance(self.max_new_tokens, int) or isinstance(self.max_new_tokens, bool) or self.max_new_tokens < 1:
            bad("max_new_tokens", self.max_new_tokens, "a positive integer")
        if self.do_sample and not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                                   and self.temperature > 0):      # greedy ignores it, as transformers' generate does
            bad("temperature", self.temperature, "a finite number > 0 to sample (greedy: do_sample=False, where "
                                                 "temperature is not used)")
        if self.top_k is not None and (not isinstance(self.top_k, int) or isinstance(self.top_k, bool)
                                       or self.top_k < 1):
            bad("top_k", self.top_k, "a positive integer or null")
        if self.top_p is not None and not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            bad("top_p", self.top_p, "a number in (0, 1] or null")
        if self.min_p is not None and not (isinstance(self.min_p, (int, float)) and 0 <= self.min_p <= 1):
            bad("min_p", self.min_p, "a number in [0, 1] or null (0: off)")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and -2 <= v <= 2):
                bad(name, v, "a number in [-2, 2]")
        if not (isinstance(self.repetition_penalty, (int, float)) and math.isfinite(self.repetition_penalty)
                and self.repetition_penalty > 0):
            bad("repetition_penalty", self.repetition_penalty, "a finite number > 0 (1: off)")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_new_tokens:
            bad("min_tokens", self.min_tokens, f"an integer in [0, max_new_tokens = {self.max_new_tokens}]")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            bad("logprobs", self.logprobs, f"an integer in [0, {MAX_LOGPROBS}] or null")
        for t, v in self.logit_bias:
            if type(t) is not int or t < 0 or not (isinstance(v, (int, float)) and math.isfinite(v) and -100 <= v <= 100):
                bad("logit_bias", {t: v}, "token ids >= 0 with biases in [-100, 100]")

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1
                    or self.logit_bias)

    @property
    def eos(self) -> frozenset[int]:
        e = self.eos_token_id
        return frozenset() if e is None else frozenset([e] if isinstance(e, int) else e)


def adjusted(logits: torch.Tensor, params: SamplingParams, prompt: Sequence[int], generated: Sequence[int]
             ) -> torch.Tensor:
    """One row of logits after the penalties and `min_tokens`, in vLLM's order: repetition
    (over prompt and generated tokens: a positive logit is divided by it, a negative one
    multiplied), then frequency and presence (generated tokens only, as OpenAI defines them),
    then `logit_bias`;
    before `min_tokens` tokens, end-of-sequence and single-token stops cannot be chosen."""
    x = logits.float()
    if params.penalized:
        x = x.clone()
        vocab = x.numel()
        if params.repetition_penalty != 1:
            seen = torch.tensor(sorted({t for t in (*prompt, *generated) if 0 <= t < vocab}), dtype=torch.int64)
            if seen.numel():
                v = x[seen]
                x[seen] = torch.where(v > 0, v / params.repetition_penalty, v * params.repetition_penalty)
        if generated and (params.frequency_penalty or params.presence_penalty):
            counts = torch.bincount(torch.tensor(list(generated), dtype=torch.int64), minlength=vocab)[:vocab].float()
            x -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).float()
        for t, v in params.logit_bias:
            if t < vocab:
                x[t] += v
    if len(generated) < params.min_tokens:
        banned = [t for t in (*params.eos, *(s[0] for s in params.stop if len(s) == 1)) if 0 <= t < x.numel()]
        if banned:
            x = x.clone() if x is logits else x
            x[banned] = float("-inf")
    return x


def top_logprobs(logits: torch.Tensor, token: int, k: int) -> tuple[float, list[tuple[int, float]]]:
    """The model's log-probability of `token` and its `k` most likely tokens (from the raw
    logits, as vLLM reports them by default: before penalties and temperature)."""
    lp = torch.log_softmax(logits.float(), -1)
    top = torch.topk(lp, min(k, lp.numel())) if k else None
    return float(lp[token]), ([] if top is None else list(zip(top.indices.tolist(), top.values.tolist())))


def prompt_logprobs(logits: torch.Tensor, tokens: list[int], k: int) -> list[tuple[Any, Any]]:
    """Each prompt token's log-probability given the tokens before it and the `k` most likely
    tokens there, from the logits at every position (vLLM's prompt logprobs, what OpenAI's
    `echo` with `logprobs` returns); the first token has none: (None, None)."""
    return [(None, None)] + [top_logprobs(logits[j - 1], tokens[j], k) for j in range(1, len(tokens))]


def ranked_prompt_logprobs(logits: torch.Tensor, tokens: list[int], k: int
                           ) -> list[dict[int, tuple[float, int]] | None]:
    """vLLM's `prompt_logprobs`: per prompt token after the first, {token id: (logprob, rank)}
    of the token itself and the `k` most likely there (rank 1 = the most likely; ties share
    the better rank), from the logits at every position; the first token has none."""
    lp = torch.log_softmax(logits[:len(tokens) - 1].float(), -1)
    out: list[dict[int, tuple[float, int]] | None] = [None]
    for j in range(1, len(tokens)):
        row, t = lp[j - 1], tokens[j]
        d = {t: (float(row[t]), int((row > row[t]).sum()) + 1)}
        if k:
            top = torch.topk(row, min(k, row.numel()))
            for u, v in zip(top.indices.tolist(), top.values.tolist()):
                d.setdefault(u, (v, int((row > v).sum()) + 1))
        out.append(d)
    return out


def choose(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None) -> int:
    """One token from one row of logits (already `adjusted`)."""
    x = logits.float()
    if not params.do_sample:
        return int(torch.argmax(x))
    x = x / params.temperature
    if not torch.isfinite(x.max()):            # a temperature so small the logits overflow: its limit, greedy
        return int(torch.argmax(logits.float()))
    if params.top_k is not None and params.top_k < x.numel():
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p is not None and params.top_p < 1:
        sorted_x, order = torch.sort(x, descending=False)
        cum = torch.softmax(sorted_x, -1).cumsum(-1)
        drop = cum <= 1 - params.top_p
        drop[-1] = False                              # always keep the most likely token
        x = x.masked_fill(drop.scatter(0, order, drop), float("-inf"))
    probs = torch.softmax(x, -1)
    if params.min_p:                                  # after temperature, top-k and top-p, as vLLM applies it
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    return int(torch.multinomial(probs, 1, generator=gen))
