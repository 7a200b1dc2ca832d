"""generate()'s prompts: token ids and a mask, checked before anything is decoded."""
from __future__ import annotations

import pytest
import torch

from graphmode.decode.api import _prompts
from graphmode.errors import ContractViolation


def test_a_left_padded_mask_drops_the_padding_from_each_prompt():
    ids, prompts = _prompts(torch.tensor([[0, 5, 6], [7, 8, 9]]), torch.tensor([[0, 1, 1], [1, 1, 1]]))
    assert prompts == [[5, 6], [7, 8, 9]] and ids.shape == (2, 3)


@pytest.mark.parametrize("which", ["input_ids", "attention_mask"])
def test_meta_tensors_are_refused_naming_the_input(which):
    """Trial AC: meta ids reached torch's 'Cannot copy out of meta tensor; no data!'."""
    ids, mask = torch.tensor([[1, 5, 9, 77]]), torch.ones(1, 4, dtype=torch.long)
    args = {"input_ids": ids, "attention_mask": mask}
    args[which] = args[which].to("meta")
    with pytest.raises(ContractViolation) as e:
        _prompts(args["input_ids"], args["attention_mask"])
    assert e.value.where == which and "meta" in e.value.message and e.value.fix
