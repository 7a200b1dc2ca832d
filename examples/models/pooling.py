"""Two small sentence encoders that differ only in how they pool over `seq`.

    graphmode compile --model examples/models/pooling.py:mean_pool --recipe examples/recipes/pooled_encoder.yaml
    graphmode compile --model examples/models/pooling.py:masked_mean_pool --recipe examples/recipes/pooled_encoder.yaml

`mean_pool` averages every position, so padding `seq` up to a bucket changes its answer:
graphmode refuses the recipe and names the line below. `masked_mean_pool` averages over the
attention mask, whose padded positions are 0, so padding is proven safe.
"""
from __future__ import annotations

import torch
import torch.nn as nn


class Encoder(nn.Module):
    def __init__(self, masked: bool, vocab: int = 1000, hidden: int = 64):
        super().__init__()
        self.masked = masked
        self.emb = nn.Embedding(vocab, hidden)
        self.layer = nn.TransformerEncoderLayer(hidden, 4, 4 * hidden, dropout=0.0, batch_first=True)
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, input_ids, attention_mask):
        h = self.layer(self.emb(input_ids), src_key_padding_mask=attention_mask == 0)
        h = self.proj(h)
        if not self.masked:
            return h.mean(dim=1)
        m = attention_mask[..., None].to(h.dtype)
        return (h * m).sum(dim=1) / m.sum(dim=1).clamp(min=1e-9)


def _build(masked: bool):
    torch.manual_seed(0)
    ids = torch.randint(0, 1000, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    return Encoder(masked).eval(), {"input_ids": ids, "attention_mask": mask}, \
        {"input_ids": ["batch", "seq"], "attention_mask": ["batch", "seq"]}


def mean_pool():
    return _build(False)


def masked_mean_pool():
    return _build(True)
