"""A decoder recipe must hold one admissible sequence: the longest prompt its contract admits
plus one new token fits a sequence's pages and the pool, and its seq_dim is the prompt length
(#30: such recipes were "valid", then refused a prompt inside the contract with "ask for at
most -16 new tokens")."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from graphmode.recipe import load_recipe, validate

ROOT = Path(__file__).resolve().parents[3]
CPU = "cpu_avx2"


def _decoder(**kv) -> dict:
    r = yaml.safe_load((ROOT / "examples/recipes/gpt2_decoder.yaml").read_text())
    r["memory"]["kv_cache"].update(kv)
    return r


@pytest.mark.parametrize("kv,field,fix", [
    ({"pages": 10}, "memory.kv_cache.pages", "pages: 64 or more"),
    ({"pages": 63}, "memory.kv_cache.pages", "pages: 64 or more"),
    ({"seq_dim": "batch"}, "memory.kv_cache.seq_dim", "seq_dim: the prompt-length dim")])
def test_slots_that_cannot_hold_one_sequence_are_malformed(kv, field, fix):
    rep = validate(load_recipe(_decoder(**kv)), CPU)
    assert rep.verdict == "malformed", rep.verdict
    err = next(e for e in rep.errors if e.where == field)
    assert fix in (err.fix or ""), err


def test_max_pages_per_seq_is_proved_for_the_longest_prompt_and_one_token():
    rep = validate(load_recipe(_decoder(max_pages_per_seq=1)), CPU)
    p = next(p for p in rep.proofs if p.name == "memory.kv_cache.max_pages_per_seq")
    assert rep.verdict == "refused" and p.status == "refuted"
    assert p.counterexample["seq"] == 1023 and "> max_pages_per_seq" in p.message
    assert p.detail["fix"] == "memory.kv_cache.max_pages_per_seq >= 64, or dims.seq at most 15"
    # a prompt that exactly fills its pages leaves no room for a token: refused too
    r = _decoder()
    r["dims"]["seq"]["max"] = 1024
    p = next(p for p in validate(load_recipe(r), CPU).proofs if p.name == "memory.kv_cache.max_pages_per_seq")
    assert p.status == "refuted" and p.counterexample["seq"] == 1024


@pytest.mark.parametrize("name", ["gpt2_decoder", "gpt2_decoder_int8"])
def test_the_example_decoder_recipes_hold_their_longest_prompt(name):
    rep = validate(load_recipe(ROOT / f"examples/recipes/{name}.yaml"), CPU)
    p = next(p for p in rep.proofs if p.name == "memory.kv_cache.max_pages_per_seq")
    assert p.status == "proved" and "1023 + 1 needs 64" in p.message, p.message
