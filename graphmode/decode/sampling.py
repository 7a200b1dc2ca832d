"""Next-token choice: greedy, or sampling with temperature / top-k / top-p, in transformers' order."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from graphmode.errors import GraphmodeError


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 16
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    seed: int | None = None
    stop: tuple[tuple[int, ...], ...] = ()       # token-id sequences that end generation (not emitted)

    def __post_init__(self):
        def bad(field: str, value, fix: str):
            raise GraphmodeError(f"invalid sampling parameter {field}", where=field, value=value, fix=fix)
        if not isinstance(self.max_new_tokens, int) or isinstance(self.max_new_tokens, bool) or self.max_new_tokens < 1:
            bad("max_new_tokens", self.max_new_tokens, "a positive integer")
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and self.temperature > 0):
            bad("temperature", self.temperature, "a finite number > 0 (use do_sample=False for greedy)")
        if self.top_k is not None and (not isinstance(self.top_k, int) or isinstance(self.top_k, bool)
                                       or self.top_k < 1):
            bad("top_k", self.top_k, "a positive integer or null")
        if self.top_p is not None and not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            bad("top_p", self.top_p, "a number in (0, 1] or null")

    @property
    def eos(self) -> frozenset[int]:
        e = self.eos_token_id
        return frozenset() if e is None else frozenset([e] if isinstance(e, int) else e)


def choose(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None) -> int:
    """One token from one row of logits."""
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
    return int(torch.multinomial(probs, 1, generator=gen))
