"""Small models for the knowledge-base and tuning tests, loadable as `<this file>:function` specs.

`encoder_small` and `encoder_large` are one family (`TinyEncoder`, whose config names it
"tinyenc", like a transformers config) at two widths; `mean_pool` reduces over the sequence
without a mask, so padding `seq` is unsafe for it."""
from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

from graphmode.capture.spec import bundle_from_module


class TinyEncoder(nn.Module):
    def __init__(self, hidden: int, vocab: int = 64, positions: int = 24):
        super().__init__()
        self.config = SimpleNamespace(model_type="tinyenc", max_position_embeddings=positions)
        self.emb, self.lin, self.norm = nn.Embedding(vocab, hidden), nn.Linear(hidden, hidden), nn.LayerNorm(hidden)

    def forward(self, input_ids, attention_mask):
        h = self.norm(F.gelu(self.lin(self.emb(input_ids))))
        m = attention_mask[..., None].to(h.dtype)
        return (h * m).sum(1) / m.sum(1).clamp(min=1e-9)


class MeanPool(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.lin = nn.Embedding(64, 16), nn.Linear(16, 8)

    def forward(self, input_ids):
        return self.lin(self.emb(input_ids)).mean(1)          # padding seq changes the divisor


def _tokens(batch: int = 2, seq: int = 8) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.randint(0, 64, (batch, seq)), "attention_mask": torch.ones(batch, seq, dtype=torch.long)}


def _encoder(hidden: int):
    torch.manual_seed(0)
    return TinyEncoder(hidden).eval(), _tokens(), {"input_ids": ["batch", "seq"], "attention_mask": ["batch", "seq"]}


def encoder_small():
    return _encoder(16)


def encoder_large():
    return _encoder(24)


def _mean_pool(seq_max: int):
    torch.manual_seed(0)
    b = bundle_from_module(MeanPool().eval(), {"input_ids": torch.randint(0, 64, (2, 8))},
                           {"input_ids": ["batch", "seq"]}, name="mean_pool")
    b.dim_ranges = {"batch": (1, 4), "seq": (2, seq_max)}
    return b


def mean_pool():
    return _mean_pool(12)


def mean_pool_long():
    return _mean_pool(128)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def mlp():
    torch.manual_seed(0)
    return MLP().eval(), {"x": torch.randn(4, 16)}, {"x": ["batch", 16]}


def mlp_half():
    """An fp16 model (a user's `model.half()`): the draft's compute f32 leaves its f16 ops as they are."""
    module, inputs, dims = mlp()
    return module.half(), {"x": inputs["x"].half()}, dims
