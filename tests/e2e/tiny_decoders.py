"""Tiny causal LMs for the serving tests, loadable as `path/to/tiny_decoders.py:function` model
specs: the GPT-2 of test_decode.py (2 layers, 4 heads of 8, vocab 100, random weights), without
a tokenizer (`gpt2`) and with a 100-word whitespace tokenizer (`gpt2_words`)."""
from __future__ import annotations

import warnings

import torch

VOCAB = 100
EOS = 2
WORDS = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(3, VOCAB)]


def _lm():
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    cfg = GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=64, bos_token_id=1,
                     eos_token_id=EOS, initializer_range=0.3, use_cache=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return GPT2LMHeadModel(cfg).eval()


def _inputs():
    ex = {"input_ids": torch.randint(3, VOCAB, (2, 8)), "attention_mask": torch.ones(2, 8, dtype=torch.long)}
    return ex, {k: ["batch", "seq"] for k in ex}


def gpt2():
    ex, dims = _inputs()
    return _lm(), ex, dims


def gpt2_alone():
    """The model alone, no example inputs: a causal LM's config names them."""
    return _lm()


def gpt2_f16_overflow():
    """`gpt2` with its attention values scaled up 1e6 and its output projection down (the same
    function): its V cache holds values past f16's 65504."""
    model, (ex, dims) = _lm(), _inputs()
    with torch.no_grad():
        for block in model.transformer.h:
            block.attn.c_attn.weight[:, 64:].mul_(1e6)       # the V columns of c_attn (n_embd 32)
            block.attn.c_attn.bias[64:].mul_(1e6)
            block.attn.c_proj.weight.div_(1e6)
    return model, ex, dims


def greedy_reference(prompt: list[int], n: int) -> list[int]:
    """transformers' greedy generate on the same weights: the new tokens."""
    lm = gpt2()[0]
    with warnings.catch_warnings(), torch.inference_mode():
        warnings.simplefilter("ignore")
        out = lm.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def tokenizer():
    """Words `w3` ... `w99` split on whitespace; decoding joins them with spaces."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def gpt2_words():
    from graphmode.capture.spec import bundle_from_module
    ex, dims = _inputs()
    bundle = bundle_from_module(_lm(), ex, dims, name="gpt2-words")
    bundle.tokenizer = tokenizer()
    return bundle


def recipe(name: str = "tiny-decoder", **over) -> dict:
    """A decoder recipe for these models: 3 batch x 2 prompt-length buckets, 4-token pages."""
    r = {"version": 1, "name": name, "exe_mode": "graph", "codegen": {"kernel_selection": "heuristic"},
         "inputs": [{"name": "input_ids", "dtype": "i64", "shape": ["batch", "seq"]},
                    {"name": "attention_mask", "dtype": "i64", "shape": ["batch", "seq"], "role": "attention_mask"}],
         "dims": {"batch": {"buckets": [1, 2, 4]}, "seq": {"buckets": [8, 32], "min": 2}},
         "memory": {"kv_cache": {"page_size": 4, "max_pages_per_seq": 12, "layers": 2, "kv_heads": 4,
                                 "head_dim": 8}}}
    r.update(over)
    return r
