"""A decode step's outputs: each sequence's next token (sampled from its row of logits), why it
ends (end-of-sequence token, a stop sequence, its length), and what a caller sees of it
(`ChoiceOutput`: its tokens and text less a matched stop sequence, token ids or text; while
streaming, a tail that may still start a stop sequence is held back). The OpenAI completions
and the `generate` CLI release tokens through `ChoiceOutput`.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable

import torch

from graphmode.decode.sampling import adjusted, choose, top_logprobs
from graphmode.errors import GraphmodeError

if TYPE_CHECKING:
    from graphmode.decode.scheduler import Sequence_

FINISH = {"eos": "stop", "stop": "stop", "length": "length"}      # engine reason -> OpenAI's


def encode_text(tokenizer: Any, text: str, where: str, **options: Any) -> list[int]:
    """`text`'s token ids; a tokenizer that cannot encode it (a WordLevel vocabulary without its
    unknown token, a malformed special token) is the request's error, naming the tokenizer's words."""
    try:
        ids = list(tokenizer.encode(text, **options))
    except Exception as e:  # noqa: BLE001 - the tokenizers library raises plain Exception
        raise GraphmodeError(f"the model's tokenizer cannot encode this text: {str(e)[:200]}", where=where,
                             value=text[:80], fix="send token ids instead, or text the tokenizer's vocabulary "
                                                  "covers") from None
    if not ids and text.strip():      # a tokenizer class that does not match the folder's vocabulary (trial AI)
        raise GraphmodeError(f"the model's tokenizer ({type(tokenizer).__name__}) gives no token ids for this "
                             "non-empty text", where=where, value=text[:80],
                             fix="send token ids instead, or check that the tokenizer transformers "
                                 "loads for the model (tokenizer_class in tokenizer_config.json) is the one its "
                                 "vocabulary was made for")
    return ids


def stop_reason(s: "Sequence_") -> str | None:
    """Why `s` ends with its last token: "eos", "stop" (a stop sequence), "length", or None."""
    tok = s.generated[-1]
    if len(s.generated) < s.params.min_tokens:
        return None
    if tok in s.params.eos:
        return "eos"
    if any(seq and s.generated[-len(seq):] == list(seq) for seq in s.params.stop):
        return "stop"
    if len(s.generated) >= s.params.max_new_tokens:
        return "length"
    return None


def sample(seqs: list["Sequence_"], logits: torch.Tensor,
           on_logits: Callable[["Sequence_", torch.Tensor], None] | None = None
           ) -> list[tuple["Sequence_", str | None]]:
    """Each sequence's next token from its row of `logits` (row i: seqs[i]), by `emit`; with
    why the sequence ends now (or None)."""
    return [(s, emit(s, logits[i], on_logits)) for i, s in enumerate(seqs)]


def emit(s: "Sequence_", logits: torch.Tensor,
         on_logits: Callable[["Sequence_", torch.Tensor], None] | None = None) -> str | None:
    """`s`'s next token from its `logits` row after its penalties, appended to it (with its
    logprobs when asked for) and told to its `on_token` listener as it is chosen; why the
    sequence ends now (or None). `on_logits` sees the row first (a verification hook)."""
    if on_logits is not None:
        on_logits(s, logits)
    row = adjusted(logits, s.params, s.prompt, s.generated)
    tok = choose(row, s.params, s.gen)
    if s.params.logprobs is not None:
        s.logprobs.append(top_logprobs(logits, tok, s.params.logprobs))
    s.generated.append(tok)
    if s.first_token_at is None:
        s.first_token_at = time.perf_counter()
    stop = stop_reason(s)
    if s.on_token is not None:
        s.on_token(s.id, tok)
    return stop


class ChoiceOutput:
    """What the client sees of one sequence: its tokens and text less a matched stop
    sequence; while streaming, a tail that may still start a stop sequence is held back."""

    def __init__(self, index: int, tokenizer: Any, stop_text: tuple[str, ...], stop_ids: tuple[tuple[int, ...], ...],
                 min_tokens: int = 0, keep_stop: bool = False, skip_special: bool = True):
        self.index = index
        self.skip_special = skip_special               # vLLM's skip_special_tokens
        self.keep_stop = keep_stop                     # vLLM's include_stop_str_in_output
        self.min_tokens = min_tokens                   # a stop string counts from this many tokens on
        self.tokenizer = tokenizer
        self.stop_text = stop_text
        self.stop_ids = stop_ids
        self.tokens: list[int] = []
        self.sent_tokens = 0
        self.sent_text = 0
        self.finish_reason: str | None = None          # OpenAI's, once finished

    def release(self, engine_reason: str | None = None) -> tuple[list[int], str]:
        """New tokens and text that can be shown now; with `engine_reason` (the sequence ended)
        everything that is left. Sets `finish_reason` when a stop string matched: the answer's
        tokens then end with the one that completed it (tokens the engine made before the
        cancel reached it are dropped, so the answer does not depend on timing)."""
        final = engine_reason is not None
        n = len(self.tokens)
        if engine_reason == "stop" and not self.keep_stop:
            n -= max((len(s) for s in self.stop_ids if s and self.tokens[-len(s):] == list(s)), default=0)
        elif not final:
            n -= self._held_ids()
        text = self._decode(self.tokens[:n])
        hit = self._stop_at(text) if n >= self.min_tokens else -1
        if hit >= 0:
            n = next(m for m in range(max(self.sent_tokens, self.min_tokens), n + 1)
                     if self._stop_at(self._decode(self.tokens[:m])) >= 0)
            del self.tokens[n:]
            text = self._decode(self.tokens)
            at = self._stop_at(text)
            end = at + max((len(s) for s in self.stop_text if text.startswith(s, at)), default=0) if self.keep_stop \
                else at
            text, final = text[:end], True
            self.finish_reason = "stop"
        elif final:
            self.finish_reason = FINISH.get(engine_reason, engine_reason)
        else:
            text = text[:len(text) - self._held_text(text)]
        toks = self.tokens[self.sent_tokens:n]
        self.sent_tokens = max(self.sent_tokens, n)
        delta = text[self.sent_text:]
        self.sent_text = max(self.sent_text, len(text))
        return toks, delta

    def _stop_at(self, text: str) -> int:
        """Where the first stop string starts in `text` (-1: none). The sent text cannot hold
        the start of one: a tail that could begin one is held back until it cannot."""
        return min((i for i in (text.find(s, self.sent_text) for s in self.stop_text) if i >= 0), default=-1)

    def _decode(self, ids: list[int]) -> str:
        if self.tokenizer is None or not ids:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special, clean_up_tokenization_spaces=False)

    def _held_ids(self) -> int:
        """Length of the longest tail of tokens that may be (or already is) a stop sequence: a
        whole match is held too, the engine's "stop" that ends the sequence is on its way."""
        t = self.tokens
        return max((k for s in self.stop_ids for k in range(min(len(s), len(t)), 0, -1)
                    if t[-k:] == list(s[:k])), default=0)

    def _held_text(self, text: str) -> int:
        """Characters at the end of `text` that may start a stop string, or are an incomplete
        multi-byte character (the tokenizer writes U+FFFD until its last byte arrives)."""
        held = max((k for s in self.stop_text for k in range(min(len(s) - 1, len(text)), 0, -1)
                    if text.endswith(s[:k])), default=0)
        tail = len(text) - len(text.rstrip("\ufffd"))
        return max(held, tail)
