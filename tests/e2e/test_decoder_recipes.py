"""Decoder recipes as users write them: one naming an optimize preset (what `graphmode recipe
init` drafts) decodes, where the decode contract added a pass list beside the preset and was
refused ("give either a preset or a pass list"); a model attending over a sliding window
(Mistral) decodes exactly while its sequences fit the window, and a recipe whose sequences may
outgrow it is refused naming max_pages_per_seq (the paged attention attends every cached
token: it answered the no-window model's tokens, silently)."""
from __future__ import annotations

import warnings

import pytest
import torch

import graphmode
from graphmode.capture.families import _DECODER, _hf
from graphmode.errors import RecipeError
from tiny_decoders import greedy_reference, recipe

PROMPT = [5, 6, 7, 8, 9]


def test_a_decoder_recipe_with_an_optimize_preset_decodes(tmp_path):
    from tiny_decoders import gpt2
    lm = gpt2()[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cm = graphmode.compile(lm, recipe(optimize={"preset": "default"}), cache_dir=tmp_path)
    out = cm.generate(torch.tensor([PROMPT]), max_new_tokens=6)
    assert out[0, len(PROMPT):].tolist() == greedy_reference(PROMPT, 6)


def _mistral():
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _hf("MistralForCausalLM", "MistralConfig", **_DECODER, sliding_window=8, initializer_range=0.3)


def _mistral_recipe(pages: int) -> dict:
    return recipe("mistral", dims={"batch": {"buckets": [1]}, "seq": {"buckets": [6], "min": 2}},
                  memory={"kv_cache": {"page_size": 4, "max_pages_per_seq": pages, "layers": 2, "kv_heads": 2,
                                       "head_dim": 8}})


def test_a_sliding_window_model_decodes_exactly_within_its_window_and_is_refused_past_it(tmp_path):
    lm = _mistral()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cm = graphmode.compile(lm, _mistral_recipe(2), cache_dir=tmp_path)           # 8 tokens: the window
        ids = torch.tensor([PROMPT])
        ours = cm.generate(ids, max_new_tokens=3)
        ref = lm.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False,
                          pad_token_id=0)
        assert torch.equal(ours, ref), (ours.tolist(), ref.tolist())
        wide = graphmode.compile(lm, _mistral_recipe(12), cache_dir=tmp_path)
        with pytest.raises(RecipeError, match="sliding window of 8 tokens") as e:
            wide.generate(ids, max_new_tokens=3)
    assert e.value.where == "memory.kv_cache.max_pages_per_seq" and "at most 2" in e.value.fix


def test_pages_for_more_tokens_than_the_model_has_positions_bound_the_answer_by_the_positions(tmp_path):
    """A chat without max_tokens fills what is usable (vLLM's rule), and the hint for too many
    new tokens names a count both limits admit (it named the pages' room, also refused)."""
    from graphmode.decode.api import engine_of
    from graphmode.decode.sampling import SamplingParams
    from graphmode.errors import ContractViolation
    from graphmode.serve.completions import usable_tokens
    from tiny_decoders import gpt2
    rec = recipe(memory={"kv_cache": {"page_size": 4, "max_pages_per_seq": 20, "layers": 2, "kv_heads": 4,
                                      "head_dim": 8}})          # 80 tokens of pages, 64 positions
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eng = engine_of(graphmode.compile(gpt2()[0], rec, mode="eager", cache_dir=tmp_path))   # the paged graph only
    assert usable_tokens(eng) == 64 and eng.room(3) == 61
    with pytest.raises(ContractViolation, match="exceed the 64 positions of the model") as e:
        eng.add([5, 6, 7], SamplingParams(max_new_tokens=70))
    assert "at most 61 new tokens" in e.value.fix
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        small = engine_of(graphmode.compile(gpt2()[0], recipe(), mode="eager", cache_dir=tmp_path))  # 48 tokens
    with pytest.raises(ContractViolation, match="exceed the 48 tokens a sequence's pages hold") as e:
        small.add([5, 6, 7], SamplingParams(max_new_tokens=100))      # the tighter limit is named, not the positions
    assert "at most 45 new tokens" in e.value.fix                # not 61: the pages hold 48


@pytest.mark.slow     # ~40 s on 2 busy cores (two drafts and a decode); the window's refusal is the next tests'
def test_a_draft_for_a_sliding_window_model_keeps_its_sequences_within_the_window_or_drafts_no_cache(tmp_path):
    """`recipe init` drafted 16-token pages for a model with an 8-token window: a decoder recipe
    every entry point then refused, whatever max_pages_per_seq (the fix said 'at most 0')."""
    from graphmode.kb.draft import draft_recipe
    lm = _mistral()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        past = draft_recipe(lm, ranges={"batch": (1, 2), "seq": (2, 20)}, kb_path=None)
        within = draft_recipe(lm, ranges={"batch": (1, 2), "seq": (2, 6)}, kb_path=None)
    assert "kv_cache" not in past.data["memory"] and "--dim seq=1:7" in past.notes["memory.kv_cache"]
    kv = within.data["memory"]["kv_cache"]
    assert kv["page_size"] * kv["max_pages_per_seq"] <= 8 and kv["page_size"] * kv["max_pages_per_seq"] >= 7
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cm = graphmode.compile(lm, within.recipe, cache_dir=tmp_path)
        ids = torch.tensor([PROMPT])
        ref = lm.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False, pad_token_id=0)
        assert torch.equal(cm.generate(ids, max_new_tokens=2), ref)


@pytest.mark.slow     # ~13 s; grouped KV heads (Llama's) decode in test_decode.py
def test_a_multi_query_falcon_drafts_one_kv_head_and_decodes_exactly(tmp_path):
    """Falcon's original architecture says multi-query by a flag only: the draft asked for 4 KV
    heads, to_paged found 1 and said so, and the fix it gave was then refused ('the model has 4')."""
    lm = _hf("FalconForCausalLM", "FalconConfig", hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
             multi_query=True, new_decoder_architecture=False, parallel_attn=True, vocab_size=100,
             max_position_embeddings=64, bos_token_id=1, eos_token_id=2, initializer_range=0.5)
    d, ref = _drafted_decodes_exactly(lm, tmp_path)
    assert d.data["memory"]["kv_cache"]["kv_heads"] == 1
    assert len(set(ref[0, len(PROMPT):].tolist())) > 1           # the tokens say something


def _drafted_decodes_exactly(lm, tmp_path):
    """(the draft for prompts of 2-6 tokens, transformers' greedy tokens) once graphmode's
    generate on the draft gave the same tokens."""
    from graphmode.kb.draft import draft_recipe
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        d = draft_recipe(lm, ranges={"batch": (1, 2), "seq": (2, 6)}, kb_path=None)
        cm = graphmode.compile(lm, d.recipe, cache_dir=tmp_path)
        ids = torch.tensor([PROMPT])
        ref = lm.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert torch.equal(cm.generate(ids, max_new_tokens=6), ref), ref.tolist()
    return d, ref


def test_attention_biased_by_position_is_refused_not_decoded_without_its_bias(tmp_path):
    """Falcon with ALiBi adds its position biases in the sdpa's mask; the paged attention dropped
    that mask and decoded other tokens (logits off by ~0.4), silently. Its config says ALiBi: refused
    before capture; with a config that does not say it (the module keeps its biases), the mask
    evaluated at 8 tokens refuses it."""
    from graphmode.errors import CaptureError, PassError
    lm = _hf("FalconForCausalLM", "FalconConfig", hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
             alibi=True, multi_query=False, new_decoder_architecture=False, parallel_attn=False, bias=True,
             vocab_size=100, max_position_embeddings=64, bos_token_id=1, eos_token_id=2)
    rec = recipe("falcon-alibi", memory={"kv_cache": {"page_size": 4, "max_pages_per_seq": 4, "layers": 2,
                                                      "kv_heads": 4, "head_dim": 8}})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cm = graphmode.compile(lm, rec, cache_dir=tmp_path)
        with pytest.raises(CaptureError, match="ALiBi position biases") as e:
            cm.generate(torch.tensor([PROMPT]), max_new_tokens=2)
        assert "without memory.kv_cache" in e.value.fix
        lm.config.alibi = False                   # what the config says; FalconModel.use_alibi stays
        cm = graphmode.compile(lm, rec, cache_dir=tmp_path)
        with pytest.raises(PassError, match="attends by more than the causal mask") as e:
            cm.generate(torch.tensor([PROMPT]), max_new_tokens=2)
    assert "without memory.kv_cache" in e.value.fix


@pytest.mark.parametrize("family", ["mixtral", pytest.param("gptj", marks=pytest.mark.slow)])   # gptj: ~20 s
def test_drafted_recipes_decode_families_with_islands_and_stacks_exactly(family, tmp_path):
    """A mixture of experts routes tokens with ops graphmode runs as eager islands: its draft is
    hybrid and decodes so (decoding forced graph mode, and the fix it named was the recipe's own
    mode). GPT-J's rotary stacks its halves: torch.stack fell to an island, so it could not decode."""
    from graphmode.kb.draft import draft_recipe
    if family == "mixtral":
        lm = _hf("MixtralForCausalLM", "MixtralConfig", **_DECODER, num_local_experts=4, num_experts_per_tok=2,
                 sliding_window=None, initializer_range=0.3)
    else:
        lm = _hf("GPTJForCausalLM", "GPTJConfig", n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_positions=64,
                 vocab_size=100, initializer_range=0.3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        d = draft_recipe(lm, ranges={"batch": (1, 2), "seq": (2, 6)}, kb_path=None)
        assert d.data["exe_mode"] == ("hybrid" if family == "mixtral" else "graph") and "kv_cache" in d.data["memory"]
        cm = graphmode.compile(lm, d.recipe, cache_dir=tmp_path)
        ids = torch.tensor([PROMPT, [9, 8, 7, 6, 5]])
        ref = lm.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False, pad_token_id=0)
        assert torch.equal(cm.generate(ids, max_new_tokens=5), ref), ref.tolist()


# granite scales the logits after the head as cohere does: slow set
@pytest.mark.slow      # ~21 s each on 2 busy cores; decoding exactly stays in test_decode.py
@pytest.mark.parametrize("family", ["granite", "cohere", "gemma2"])
def test_logits_scaled_or_capped_after_the_head_decode_exactly(family, tmp_path):
    """Granite divides its logits by logits_scaling, Cohere multiplies by logit_scale, Gemma 2
    soft-caps them (tanh(x / c) * c): decoding refused them all ('the model's output is not a
    linear head') after the draft had promised a KV cache."""
    from graphmode.kb.draft import draft_recipe
    cfg = {"granite": ("GraniteForCausalLM", "GraniteConfig", {"logits_scaling": 4.0}),
           "cohere": ("CohereForCausalLM", "CohereConfig", {"logit_scale": 0.5}),
           "gemma2": ("Gemma2ForCausalLM", "Gemma2Config", {"final_logit_softcapping": 3.0, "head_dim": 8,
                                                            "attn_logit_softcapping": None, "sliding_window": 64})}
    cls, conf, extra = cfg[family]
    lm = _hf(cls, conf, **_DECODER, **extra, initializer_range=0.3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        d = draft_recipe(lm, ranges={"batch": (1, 2), "seq": (2, 6)}, kb_path=None)
        assert "kv_cache" in d.data["memory"], d.notes["memory.kv_cache"]
        cm = graphmode.compile(lm, d.recipe, cache_dir=tmp_path)
        ids = torch.tensor([PROMPT])
        ref = lm.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False, pad_token_id=0)
        assert torch.equal(cm.generate(ids, max_new_tokens=5), ref), ref.tolist()
        out = lm(ids).logits[0, -1]
        with torch.no_grad():
            first = []
            from graphmode.decode.api import engine_of
            engine_of(cm).on_logits = lambda s, lg: first.append(lg.clone())
            cm.generate(ids, max_new_tokens=1)
        assert (first[0].reshape(-1) - out).abs().max() < 1e-4


@pytest.mark.slow     # ~15 s; GPT-2's sdpa form decodes exactly in test_decode.py
def test_gpt2_with_its_attention_written_out_decodes_exactly(tmp_path):
    """GPT-2 with attn_implementation 'eager' (matmul, softmax, matmul): to_paged puts it in sdpa
    form itself and reads the heads from q, k, v, so that sdpa must stay heads-first (the fuse
    pass's heads layout folded its permutes, and to_paged then read seq as the KV heads)."""
    from tiny_decoders import _lm
    lm = _lm()
    lm.config._attn_implementation = "eager"
    cm = graphmode.compile(lm, recipe(name="gpt2-eager-attn"), cache_dir=tmp_path)
    for prompt in ([5, 6, 7, 8, 9], list(range(10, 30))):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            ref = lm.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                              pad_token_id=0)
        assert torch.equal(cm.generate(ids, max_new_tokens=6), ref), ref.tolist()


def _deepseek_v3(v_head_dim: int):
    lm = _hf("DeepseekV3ForCausalLM", "DeepseekV3Config", vocab_size=100, hidden_size=32, num_hidden_layers=1,
             num_attention_heads=2, num_key_value_heads=2, intermediate_size=64, moe_intermediate_size=16,
             n_routed_experts=2, num_experts_per_tok=1, n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=8,
             q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=v_head_dim, n_group=1, topk_group=1,
             max_position_embeddings=64, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
             initializer_range=0.3)
    return lm


@pytest.mark.slow     # ~19 s: a DeepSeek-style decode
def test_multi_head_latent_attention_drafts_the_key_width_and_decodes_exactly(tmp_path):
    """DeepSeek-V3's config.head_dim is the rotary part of a key head only: the draft asked for a
    cache of 8, to_paged said 16, and the fix to 16 was refused ('the model has 8'), a loop. Value
    heads of another width cannot share a page's head_dim: no cache is drafted, saying why."""
    from graphmode.kb.draft import draft_recipe
    d, _ = _drafted_decodes_exactly(_deepseek_v3(16), tmp_path)
    assert d.data["memory"]["kv_cache"]["head_dim"] == 16
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        wide_v = draft_recipe(_deepseek_v3(24), ranges={"batch": (1, 2), "seq": (2, 6)}, kb_path=None)
    assert "kv_cache" not in wide_v.data["memory"]
    assert "value heads are 24 wide and its key heads 16" in wide_v.notes["memory.kv_cache"]


@pytest.mark.slow     # ~9 s; the window's refusal: the sliding-window test
def test_a_window_note_gives_way_to_what_stops_decoding_anyway(tmp_path):
    """GPT-Neo (a local-attention window, attention written as matmuls): the draft said to keep
    seq inside the window, and the recipe that did was drafted without a cache for its attention."""
    from graphmode.kb.draft import draft_recipe
    lm = _hf("GPTNeoForCausalLM", "GPTNeoConfig", hidden_size=32, num_layers=2, num_heads=4, vocab_size=100,
             max_position_embeddings=64, attention_types=[[["global", "local"], 1]], window_size=8,
             bos_token_id=1, eos_token_id=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        past = draft_recipe(lm, ranges={"batch": (1, 2), "seq": (2, 20)}, kb_path=None)
        within = draft_recipe(lm, ranges={"batch": (1, 2), "seq": (2, 6)}, kb_path=None)
    assert "kv_cache" not in within.data["memory"] and "one sdpa" in within.notes["memory.kv_cache"]
    assert "kv_cache" not in past.data["memory"] and "one sdpa" in past.notes["memory.kv_cache"]
    assert "--dim seq=" not in past.notes["memory.kv_cache"]


@pytest.mark.slow
def test_a_state_space_lm_is_not_told_to_give_dims_for_decoding():
    """Mamba passed as itself: torch.export fixes seq (its scan), and the draft's note told the
    user to pass the model itself or give dims batch and seq, which fails the same way."""
    from graphmode.kb.draft import draft_recipe
    lm = _hf("MambaForCausalLM", "MambaConfig", hidden_size=16, state_size=4, num_hidden_layers=1, vocab_size=100,
             expand=2, conv_kernel=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        d = draft_recipe(lm, kb_path=None, record=False)
    note = d.notes["memory.kv_cache"]
    assert d.fixed_dims == ["seq"] and "cannot keep seq dynamic" in note and "--dim" not in note


def test_attention_that_is_not_one_sdpa_is_said_as_it_is_written():
    """XGLM clamps its scores at the float minimum before the softmax: the refusal to draft a KV
    cache said 'soft-capped or otherwise rewritten logits' without the ops."""
    from graphmode.kb.draft import draft_recipe
    lm = _hf("XGLMForCausalLM", "XGLMConfig", d_model=32, num_layers=1, attention_heads=4, ffn_dim=64, vocab_size=100,
             max_position_embeddings=64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        d = draft_recipe(lm, ranges={"batch": (1, 2), "seq": (2, 6)}, kb_path=None, record=False)
    assert "written as matmul -> add -> maximum -> softmax" in d.notes["memory.kv_cache"]
