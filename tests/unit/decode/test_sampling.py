"""Next-token choice (graphmode.decode.sampling): the penalties against transformers' own
logits processors, min_tokens, and the log-probabilities a request asks for."""
from __future__ import annotations

import pytest
import torch

from graphmode.decode.sampling import SamplingParams, adjusted, choose, prompt_logprobs, top_logprobs
from graphmode.errors import GraphmodeError


def test_repetition_penalty_is_transformers():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor
    torch.manual_seed(0)
    x = torch.randn(50) * 3
    prompt, generated = [3, 7, 7], [11, 3, 40]
    want = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([prompt + generated]), x[None].clone())[0]
    got = adjusted(x, SamplingParams(repetition_penalty=1.7), prompt, generated)
    assert torch.equal(got, want) and not torch.equal(got, x)


def test_presence_and_frequency_penalties_count_generated_tokens_only():
    x = torch.zeros(10)
    got = adjusted(x, SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), [1, 1, 1], [2, 2, 5])
    want = torch.zeros(10)
    want[2] = -(0.5 + 2 * 0.25)
    want[5] = -(0.5 + 0.25)
    assert torch.equal(got, want) and torch.equal(x, torch.zeros(10))          # the engine's row is untouched


def test_logit_bias_is_added_after_the_penalties():
    x = torch.zeros(10)
    got = adjusted(x, SamplingParams(logit_bias=((3, -100.0), (4, 2.5)), presence_penalty=1), [], [4])
    assert (float(got[3]), float(got[4]), float(got[5])) == (-100.0, 1.5, 0.0)


def test_min_tokens_bans_end_of_sequence_and_single_stop_tokens():
    x = torch.zeros(10)
    x[2] = x[4] = 5.0
    p = SamplingParams(max_new_tokens=8, min_tokens=2, eos_token_id=2, stop=((4,), (6, 7)))
    assert choose(adjusted(x, p, [1], []), p, None) not in (2, 4)
    assert choose(adjusted(x, p, [1], [3, 3]), p, None) in (2, 4)          # two tokens made: allowed again
    assert torch.isfinite(adjusted(x, p, [1], [3])[6])                      # a longer stop sequence is not banned


def test_top_logprobs_are_the_raw_distribution():
    x = torch.tensor([1.0, 3.0, 2.0, 0.0])
    lp, top = top_logprobs(x, 0, 2)
    want = torch.log_softmax(x, -1)
    assert lp == pytest.approx(float(want[0])) and [t for t, _ in top] == [1, 2]
    assert top_logprobs(x, 3, 0)[1] == []


def test_prompt_logprobs_score_each_token_by_the_position_before_it():
    logits = torch.tensor([[1.0, 3.0, 2.0], [0.0, 0.0, 5.0], [2.0, 1.0, 0.0]])
    got = prompt_logprobs(logits, [1, 2, 0], 1)
    assert got[0] == (None, None) and len(got) == 3
    want = torch.log_softmax(logits, -1)
    assert got[1][0] == pytest.approx(float(want[0, 2])) and got[1][1][0][0] == 1
    assert got[2][0] == pytest.approx(float(want[1, 0])) and got[2][1][0][0] == 2


@pytest.mark.parametrize("field,value", [("presence_penalty", 2.5), ("frequency_penalty", float("nan")),
                                         ("repetition_penalty", 0), ("min_tokens", 17), ("logprobs", 21)])
def test_bad_parameters_are_refused_naming_the_field(field, value):
    with pytest.raises(GraphmodeError) as e:
        SamplingParams(**{field: value})
    assert e.value.where == field and e.value.fix


def test_min_p_keeps_the_tokens_transformers_keeps():
    """vLLM clients send min_p (it was a 400 'unknown field'); transformers' generate takes it."""
    from transformers.generation.logits_process import MinPLogitsWarper
    torch.manual_seed(0)
    x = torch.randn(40) * 2
    params = SamplingParams(do_sample=True, temperature=0.7, min_p=0.15)
    kept = MinPLogitsWarper(0.15)(None, (x / 0.7)[None])[0] > float("-inf")
    gen = torch.Generator().manual_seed(0)
    drawn = {choose(x, params, gen) for _ in range(3000)}
    assert drawn <= set(kept.nonzero().flatten().tolist()) and len(drawn) > 1 and 1 < int(kept.sum()) < 40
    with pytest.raises(GraphmodeError, match="min_p"):
        SamplingParams(min_p=1.5)


def test_a_request_takes_min_p():
    import json

    from graphmode.serve.openai_request import parse_completion
    doc = {"prompt": [5, 6], "temperature": 0.8, "min_p": 0.1}
    assert parse_completion(json.dumps(doc).encode(), tokenizer=None, eos=2).params.min_p == 0.1
    assert parse_completion(json.dumps(dict(doc, min_p=0)).encode(), tokenizer=None, eos=2).params.min_p is None
