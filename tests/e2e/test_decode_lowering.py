"""A decoder recipe lowers each graph once, when something needs it (issue 25: "the server
compiles the model twice"): `graphmode.compile` lowers nothing, `generate` lowers the paged
graph only, the first forward call the whole-sequence graph (once, whichever thread asks),
and a recipe that graph refuses is refused at that call with the same typed error every
time, never lowered again. Lowerings are counted as the driver's finished `capture` stages
(graphmode/progress.py), on the tiny GPT-2 of tiny_decoders.py."""
from __future__ import annotations

import threading
import warnings

import pytest
import torch
import tiny_decoders

import graphmode
from graphmode.capture.spec import bundle_from_module
from graphmode.errors import GraphmodeError


class Lowerings:
    """An `on_stage` that counts finished capture stages: one per lower_model."""

    def __init__(self):
        self.count = 0

    def __call__(self, s) -> None:
        if s.name == "capture" and s.finished:
            self.count += 1


def _compile(cache, **over):
    lm, ex, dims = tiny_decoders.gpt2()
    seen = Lowerings()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cm = graphmode.compile(bundle_from_module(lm, ex, dims), tiny_decoders.recipe(**over), cache_dir=cache,
                               on_stage=seen)
    return lm, cm, seen


def test_compile_lowers_nothing_and_the_first_use_lowers_the_whole_sequence_once(tmp_path):
    _, cm, seen = _compile(tmp_path)
    assert seen.count == 0 and cm.pending and "graph" not in vars(cm)
    threads = [threading.Thread(target=cm.lower_now) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen.count == 1 and not cm.pending        # two threads asked: lowered once
    assert cm.proof.ok and cm.graph is cm.lowered.graph and cm.verdict is cm.lowered.verdict
    cm.lower_now()
    assert seen.count == 1


@pytest.mark.slow
def test_generate_lowers_the_paged_graph_only_and_a_forward_call_the_whole_sequence(tmp_path):
    """(slow: it builds the prefill, decode and one whole-sequence plan)"""
    lm, cm, seen = _compile(tmp_path)
    out = cm.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=3)
    with torch.inference_mode():
        want = lm.generate(torch.tensor([[5, 6, 7]]), attention_mask=torch.ones(1, 3, dtype=torch.long),
                           max_new_tokens=3, do_sample=False, pad_token_id=tiny_decoders.EOS)
    assert out.tolist() == want.tolist()
    assert seen.count == 1 and cm.pending            # the decode engine's graph, and nothing else
    cm.generate(torch.tensor([[9, 10]]), max_new_tokens=2)
    assert seen.count == 1                           # the engine is built once
    ids = torch.tensor([[5, 6, 7, 8, 9], [11, 12, 13, 14, 15]])
    mask = torch.ones_like(ids)
    got = cm(input_ids=ids, attention_mask=mask).logits
    assert seen.count == 2 and not cm.pending
    cm(input_ids=ids[:1], attention_mask=mask[:1])
    assert seen.count == 2
    with torch.inference_mode():
        ref = lm(input_ids=ids, attention_mask=mask).logits
    assert float((got - ref).norm() / ref.norm()) < 1e-5


def test_a_recipe_the_whole_sequence_graph_refuses_is_refused_at_the_forward_call(tmp_path):
    """The paged graph has no whole-sequence outputs to declare, so a wrong `outputs` passes
    compile; the first forward call is refused naming the field, and so is every later one,
    without another lowering."""
    _, cm, seen = _compile(tmp_path, outputs={"logits": ["batch", "seq", 99]})    # the vocabulary is 100
    ids = torch.tensor([[5, 6, 7]])
    errors = []
    for _ in range(2):
        with pytest.raises(GraphmodeError) as e:
            cm(input_ids=ids, attention_mask=torch.ones_like(ids))
        errors.append(e.value)
    assert "outputs.logits" in str(errors[0].to_dict()) and type(errors[1]) is type(errors[0])
    assert seen.count == 1 and cm.pending


def test_a_request_outside_the_recipes_range_is_refused_before_any_lowering(tmp_path):
    """The server's first /v1/infer past seq's max lowered the whole-sequence graph (seconds) to
    answer 422; the recipe alone refuses it."""
    from graphmode.errors import ContractViolation
    _, cm, seen = _compile(tmp_path)
    ids = torch.ones(1, 60, dtype=torch.long)
    with pytest.raises(ContractViolation, match=r"dim 'seq' = 60 is outside the recipe's range") as e:
        cm(input_ids=ids, attention_mask=torch.ones_like(ids))
    assert e.value.where == "dims.seq" and seen.count == 0 and cm.pending
