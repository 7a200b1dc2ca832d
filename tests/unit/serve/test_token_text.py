"""Logprobs entries under a byte-level tokenizer: a multi-byte character split over tokens."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from graphmode.serve.completions import Completion
from graphmode.serve.token_text import TokenText

TEXT = "Hello world, héllo 日本語 über ñandú"


@pytest.fixture(scope="module")
def tok():
    """A byte-level BPE with few merges: CJK characters stay split over their UTF-8 bytes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    t.train_from_iterator(["Hello world, hello there héllo über"] * 20, trainers.BpeTrainer(
        vocab_size=280, special_tokens=["<|end|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=t, eos_token="<|end|>")


def stray_byte(tok, b: int) -> int:
    """The id of the token that is the single byte `b`."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    return tok.convert_tokens_to_ids(bytes_to_unicode()[b])


def test_split_characters_are_named_by_their_bytes_and_offsets_index_the_text(tok):
    tt = TokenText(tok)
    ids = tok.encode(TEXT) + [stray_byte(tok, 0xA3)] + tok.encode("8")   # a lone continuation byte: one U+FFFD
    text = tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    names, offsets = [tt.name(t) for t in ids], tt.offsets(ids, 0, 0)
    assert any(n.startswith("bytes:\\xe6") for n in names)
    assert b"".join(tt.bytes(t) for t in ids).decode("utf-8", "replace") == text
    for n, o in zip(names, offsets):
        if not n.startswith("bytes:"):
            assert text[o:o + len(n)] == n, (n, o)
    assert offsets == sorted(offsets) and offsets[-1] == len(text) - 1 and text[-2:] == "\ufffd8"
    assert tt.offsets(ids, 5, 7) == [7 + o for o in offsets[5:]]


def test_distinct_ids_get_distinct_names(tok):
    tt = TokenText(tok)
    parts = [t for t in tok.encode("日本語") if tt.name(t).startswith("bytes:")]
    assert len(parts) >= 3 and len(set(tt.names(parts))) == len(set(parts))
    assert tt.names([5, 5]) == [tt.name(5)] * 2
    assert TokenText(None).name(7) == "token_id:7" and TokenText(None).offsets([1, 2], 0, 3) == [0, 0]


def test_ids_past_the_tokenizers_pieces_are_named_by_id(tok):
    """A model's vocabulary padded past its tokenizer's (Qwen2: 151,936 rows over ~151,665
    pieces): such ids decode to "", and two of them in one top_logprobs were "" and token_id:ID."""
    tt = TokenText(tok)
    past = [len(tok) + 3, len(tok) + 9]
    assert tt.names(past) == [f"token_id:{t}" for t in past] and tt.bytes(past[0]) is None


def test_streamed_offsets_continue_where_the_last_chunk_ended(tok):
    """The offsets of a choice's second chunk start where the first chunk's text ended."""
    ids = tok.encode(" 日本語 über")
    req = SimpleNamespace(sequences=[([1, 2], None)], stop_text=(), params=SimpleNamespace(
        stop=(), min_tokens=0, logprobs=2), chat=False, echo=False, keep_stop=False, echo_text="", skip_special=True)

    def lp(t):
        return (-1.0, [(t, -1.0), (stray_byte(tok, 0x97), -2.0)])

    def run(chunks):
        c = Completion(req, [None], asyncio.Queue(), None, "m", "v", tok)
        out = []
        for part in chunks:
            out += c._choice(0, part, [lp(t) for t in part], "", None, chunk=True)["logprobs"]["text_offset"]
        return out
    whole = run([ids])
    assert run([ids[:3], ids[3:]]) == whole == TokenText(tok).offsets(ids, 0, 0)
