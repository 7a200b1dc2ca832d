"""Tiny transformers for the tensor-parallel tests, loadable as `path/to/tiny_tp.py:function`
model specs: a two-layer MLP, a BERT encoder (MiniLM's architecture: 2 layers, 4 heads of 8, vocab 96), the
GPT-2 LM of tiny_decoders.py (2 layers, 4 heads of 8, vocab 100; and with an odd vocab, 257), a Llama-style GQA
decoder (4 query heads, 2 KV heads), a Phi-3 one (the same heads through a fused qkv_proj) and ResNet-18 on 32x32 images; random weights."""
from __future__ import annotations

import warnings

import torch

LOOPBACK = {"bandwidth_gbps": "${target.groups.interconnects.loopback.bandwidth_gbps}",
            "latency_us": "${target.groups.interconnects.loopback.latency_us}"}


def bert(hidden: int = 32, heads: int = 4, layers: int = 2):
    from transformers import BertConfig, BertModel
    torch.manual_seed(0)
    cfg = BertConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                     intermediate_size=2 * hidden, vocab_size=96, max_position_embeddings=64, initializer_range=0.3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = BertModel(cfg, add_pooling_layer=False).eval()
    ex = {"input_ids": torch.randint(0, 96, (2, 8)), "attention_mask": torch.ones(2, 8, dtype=torch.long)}
    return model, ex, {k: ["batch", "seq"] for k in ex}


def bert_three_heads():
    """The BERT encoder with 3 heads of 8: they do not split over 2 ranks, so the shard pass
    gathers the projections and every rank runs the whole attention."""
    return bert(hidden=24, heads=3, layers=1)


def gpt2():
    import importlib.util
    from pathlib import Path
    spec = importlib.util.spec_from_file_location("tiny_decoders", Path(__file__).with_name("tiny_decoders.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.gpt2()


def gpt2_odd_vocab():
    """The tiny GPT-2 with a vocabulary of 257 (a prime, like GPT-2's 50257 it divides by no rank
    count): the shard pass pads it, 129 rows a rank at TP=2."""
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    cfg = GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=257, n_positions=64, initializer_range=0.3,
                     bos_token_id=1, eos_token_id=2, use_cache=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = GPT2LMHeadModel(cfg).eval()
    ex = {"input_ids": torch.randint(0, 257, (2, 8)), "attention_mask": torch.ones(2, 8, dtype=torch.long)}
    return model, ex, {k: ["batch", "seq"] for k in ex}


def llama(intermediate: int = 64, kv_heads: int = 2):
    """A Llama-style decoder with grouped-query attention: 4 query heads over 2 KV heads."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=intermediate, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=kv_heads, vocab_size=100, max_position_embeddings=64, use_cache=False,
                      initializer_range=0.3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = LlamaForCausalLM(cfg).eval()
    ex = {"input_ids": torch.randint(3, 100, (2, 8)), "attention_mask": torch.ones(2, 8, dtype=torch.long)}
    return model, ex, {k: ["batch", "seq"] for k in ex}


def llama_odd_mlp():
    """An MLP 65 wide: it does not split over 2 ranks and runs whole; the attention still splits."""
    return llama(65)


def llama_one_kv_head():
    """Multi-query attention (4 query heads over 1 KV head): its KV cache does not split over 2 ranks."""
    return llama(kv_heads=1)


def phi3():
    """A Phi-3 decoder with grouped-query attention (4 query heads over 2 KV heads): its fused
    qkv_proj is read as blocks of unequal width (q 32 | k 16 | v 16), each split across ranks."""
    from transformers import Phi3Config, Phi3ForCausalLM
    torch.manual_seed(0)
    cfg = Phi3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=100, max_position_embeddings=64, use_cache=False,
                     initializer_range=0.3, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = Phi3ForCausalLM(cfg).eval()
    ex = {"input_ids": torch.randint(3, 100, (2, 8)), "attention_mask": torch.ones(2, 8, dtype=torch.long)}
    return model, ex, {k: ["batch", "seq"] for k in ex}


def resnet18():
    """graphmode's ResNet-18 on 32x32 images, 10 classes (for the batch strategy)."""
    from graphmode.capture.zoo import build_resnet18
    return build_resnet18(image_size=32, num_classes=10)


def mlp():
    """Linear 16 -> 32, ReLU, Linear 32 -> 4: one column- then row-parallel pair, one all_reduce."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).eval()
    return model, {"input": torch.randn(2, 16)}, {"input": ["batch", 16]}


class _OddLM(torch.nn.Module):
    """Embedding of 17 rows, tanh, the tied table as LM head: the smallest odd vocabulary."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(17, 8)

    def forward(self, input_ids):
        return torch.nn.functional.linear(torch.tanh(self.emb(input_ids)), self.emb.weight)


def odd_lm():
    torch.manual_seed(0)
    return _OddLM().eval(), {"input_ids": torch.randint(0, 17, (2, 4))}, {"input_ids": ["batch", 4]}


ODD_LM_INPUTS = [{"name": "input_ids", "dtype": "i64", "shape": ["batch", 4]}]
MLP_INPUTS = [{"name": "input", "dtype": "f32", "shape": ["batch", 16]}]
MLP_DIMS = {"batch": {"buckets": [2], "min": 1}}


def recipe(name: str, tensor: int = 2, *, inputs: list | None = None, dims: dict | None = None, **parallel) -> dict:
    """The transformers' inputs (one bucket: batch 2, seq 16; a request is padded up to it), split
    over `tensor` ranks on loopback, 30 s per collective."""
    r = {"version": 1, "name": name, "exe_mode": "graph", "codegen": {"kernel_selection": "heuristic"},
         "inputs": inputs or [{"name": "input_ids", "dtype": "i64", "shape": ["batch", "seq"]},
                              {"name": "attention_mask", "dtype": "i64", "shape": ["batch", "seq"],
                               "role": "attention_mask"}],
         "dims": dims or {"batch": {"buckets": [2], "min": 1}, "seq": {"buckets": [16], "min": 2}}}
    if tensor > 1:
        r["parallel"] = {"tensor": tensor, "device_group": [f"rank{i}" for i in range(tensor)],
                         "links": {"loopback": LOOPBACK}, "comm": {"timeout_s": 30}}
        r["parallel"].update(parallel)
    return r
