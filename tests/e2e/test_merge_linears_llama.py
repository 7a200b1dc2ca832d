"""merge_linears on a small Hugging Face Llama: the decoder's paged graph keeps one GEMM for
q/k/v and one for gate/up per layer and decodes token for token as transformers does; the
whole-sequence graph's logits are bit-identical with and without the pass at f32, bf16, int8 and
int4 weights (each output column is the same weight row times the same input)."""
from __future__ import annotations

import warnings

import pytest
import torch

import graphmode
from graphmode.capture.families import _DECODER, _hf
from graphmode.capture.spec import bundle_from_module
from graphmode.passes.registry import PRESETS, with_merged_linears

CFG = {**_DECODER, "hidden_size": 64, "intermediate_size": 128}      # in = 64, 128: whole int4 groups of 32
EX = {"input_ids": torch.randint(3, 100, (2, 8), generator=torch.Generator().manual_seed(0)),
      "attention_mask": torch.ones(2, 8, dtype=torch.long)}
INPUTS = [{"name": "input_ids", "dtype": "i64", "shape": ["batch", "seq"]},
          {"name": "attention_mask", "dtype": "i64", "shape": ["batch", "seq"], "role": "attention_mask"}]
MERGED = with_merged_linears(PRESETS["default"])        # the pass is opt-in


@pytest.fixture(scope="module")
def llama():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lm = _hf("LlamaForCausalLM", "LlamaConfig", **CFG, tie_word_embeddings=False, initializer_range=0.3)
    return lm, bundle_from_module(lm, EX, {k: ["batch", "seq"] for k in EX})


def _compile(bundle, recipe, cache):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return graphmode.compile(bundle, recipe, cache_dir=cache)


@pytest.mark.slow      # a decoder compile of its own: ~30 s on 2 busy cores
def test_paged_llama_runs_one_gemm_for_qkv_and_one_for_gate_up(llama, tmp_path):
    from graphmode.decode.api import engine_of
    lm, bundle = llama
    recipe = {"version": 1, "name": "decoder", "exe_mode": "graph", "codegen": {"kernel_selection": "heuristic"},
              "inputs": INPUTS, "dims": {"batch": {"buckets": [1, 2]}, "seq": {"buckets": [8, 16], "min": 2}},
              "memory": {"kv_cache": {"page_size": 4, "max_pages_per_seq": 8, "layers": 2, "kv_heads": 2,
                                      "head_dim": 16}}, "optimize": {"passes": MERGED}}
    cm = _compile(bundle, recipe, tmp_path)
    low = engine_of(cm).lowered
    merge = next(p for p in low.optimize_report.passes.passes if p.name == "merge_linears")
    assert merge.stats == {"merged": 4, "linears_before": 10, "parts": [2, 3]}
    gemms = [n for n in low.graph.iter_nodes(recursive=True) if n.op == "linear"]
    assert len(gemms) == 2 * 4 + 1                   # per layer qkv, o, gate_up, down (was 7); the head
    prompts = torch.tensor([[5, 17, 9, 44, 3, 61], [0, 0, 8, 23, 71, 12]])
    mask = (prompts != 0).long()
    ours = cm.generate(prompts, mask, max_new_tokens=10)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = lm.generate(prompts, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
    assert torch.equal(ours, ref), (ours.tolist(), ref.tolist())


@pytest.mark.slow      # eight compiles of the whole-sequence graph: minutes on 2 busy cores
@pytest.mark.parametrize("weights", ["f32", "bf16", "int8", "int4"])
def test_whole_sequence_logits_are_bit_identical_merged_or_not(llama, weights, tmp_path):
    _, bundle = llama
    logits = []
    for passes in (MERGED, PRESETS["default"]):
        recipe = {"version": 1, "name": "seq", "exe_mode": "graph", "codegen": {"kernel_selection": "heuristic"},
                  "inputs": INPUTS, "dims": {"batch": {"buckets": [1, 2]}, "seq": {"buckets": [8]}},
                  "precision": {"weights": weights, "group_size": 32}, "optimize": {"passes": passes}}
        cm = _compile(bundle, recipe, tmp_path)
        ops = cm.graph.op_counts()
        assert ops.get("linear", 0) + ops.get("qlinear", 0) > 0
        out = cm(**EX)
        logits.append(out["logits"] if isinstance(out, dict) else getattr(out, "logits", out))
    assert torch.equal(logits[0], logits[1])
