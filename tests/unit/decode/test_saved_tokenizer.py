"""A decoder artifact's tokenizer (graphmode/decode/saved.py): saved only when its files load
back as the same tokenizer, so a loaded `.gm` encodes prompts as the model it was saved from."""
from __future__ import annotations

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from graphmode.runtime.tokenizer_files import check_reloads
from graphmode.errors import GraphmodeError


def word_level() -> PreTrainedTokenizerFast:
    t = Tokenizer(models.WordLevel({"<unk>": 0, "a": 1, "b": 2}, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=t, unk_token="<unk>")


class EncodesItsOwnWay(PreTrainedTokenizerFast):
    """What its files cannot hold: an encode() of its own."""

    def encode(self, text, **kw):
        return [2]


def test_a_tokenizer_that_loads_back_as_itself_is_saved(tmp_path):
    tok = word_level()
    tok.save_pretrained(tmp_path)
    check_reloads(tok, str(tmp_path))


def test_a_tokenizer_that_loads_back_as_another_is_refused_naming_the_difference(tmp_path):
    tok = word_level()
    tok.__class__ = EncodesItsOwnWay
    tok.save_pretrained(tmp_path)
    with pytest.raises(GraphmodeError, match=r"does not load back .* encodes as \[2\] but loads back as \[") as e:
        check_reloads(tok, str(tmp_path))
    assert e.value.where == "tokenizer" and "save without one" in e.value.fix
