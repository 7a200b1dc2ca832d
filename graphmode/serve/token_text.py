"""How one token is written in an OpenAI logprobs entry, and where it starts in the text.

A byte-level tokenizer (GPT-2, Llama 3, Qwen) splits a multi-byte character over tokens: each
part decodes alone to U+FFFD, so different tokens had one name (top_logprobs lost entries
under one key) and text offsets summed from those names pointed past the text. A token that
does not decode to itself is named by its bytes as OpenAI does (`bytes:\\xe6\\x97`), from the
tokenizer's byte alphabet (a ByteLevel decoder's, SentencePiece's `<0xE6>` pieces), or
`token_id:ID` where the bytes are not known. A text offset counts the characters the tokens
before it complete: from their bytes under a byte-level tokenizer, else the length of the
text they decode to less a trailing character still missing bytes.
"""
from __future__ import annotations

import codecs
import functools
import re
from typing import Any

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_MISSING = "\ufffd"


@functools.lru_cache(maxsize=1)
def _byte_alphabet() -> dict[str, int]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    return {c: b for b, c in bytes_to_unicode().items()}


class TokenText:
    """Names, bytes and text offsets of token ids under one tokenizer (None: ids only)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self.byte_level = decoder is not None and "ByteLevel" in repr(decoder)

    def bytes(self, t: int) -> bytes | None:
        """The token's own bytes, or None where the tokenizer does not say them."""
        text = self._alone(t)
        if text is not None and _MISSING not in text:
            return text.encode()
        try:
            piece = self.tokenizer.convert_ids_to_tokens(t)
        except Exception:  # noqa: BLE001 - a tokenizer without pieces: the bytes are not known
            return None
        if not isinstance(piece, str):
            return None
        m = _BYTE_PIECE.fullmatch(piece)
        if m:
            return bytes([int(m.group(1), 16)])
        alphabet = _byte_alphabet()
        if self.byte_level and piece and all(c in alphabet for c in piece):
            return bytes(alphabet[c] for c in piece)
        return None

    def name(self, t: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{t}"                       # vLLM's spelling without a tokenizer
        text = self._alone(t)
        if text is not None and _MISSING not in text:
            return text
        raw = self.bytes(t)
        if raw is None:
            return f"token_id:{t}"
        try:
            return raw.decode("utf-8")                   # a token whose text is U+FFFD itself
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    def names(self, ids: list[int]) -> list[str]:
        """Distinct names for distinct ids (a top_logprobs dict's keys): a name already taken
        by another id is written `token_id:ID`."""
        out, seen = [], {}
        for t in ids:
            n = self.name(t)
            if seen.setdefault(n, t) != t:
                n = f"token_id:{t}"
            out.append(n)
        return out

    def offsets(self, ids: list[int], start: int, base: int) -> list[int]:
        """Text offsets of ids[start:], in a text that is `base` characters of something else
        followed by ids decoded as the answer's text is (special tokens skipped)."""
        if self.tokenizer is None:
            return [0] * (len(ids) - start)
        raws = [self.bytes(t) for t in ids] if self.byte_level else [None]
        if all(r is not None for r in raws):           # the bytes themselves: a lone stray byte is a character
            skipped = set(getattr(self.tokenizer, "all_special_ids", ()) or ())
            utf8, n, out = codecs.getincrementaldecoder("utf-8")("replace"), base, []
            for j, (t, raw) in enumerate(zip(ids, raws)):
                if j >= start:
                    out.append(n)
                n += 0 if t in skipped else len(utf8.decode(raw))
            return out
        return [base + len(self._decoded(ids[:j]).rstrip(_MISSING)) for j in range(start, len(ids))]

    def _decoded(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def _alone(self, t: int) -> str | None:
        """The token decoded alone; None for an id the tokenizer has no piece for (a model's
        vocabulary padded past its tokenizer's, as Qwen2's 151,936 rows over ~151,665 pieces),
        which decodes to "" and would be named "" with no bytes."""
        try:
            if self.tokenizer.convert_ids_to_tokens(t) is None:
                return None
            return self.tokenizer.decode([t], clean_up_tokenization_spaces=False)
        except Exception:  # noqa: BLE001 - an id the tokenizer cannot decode alone
            return None
