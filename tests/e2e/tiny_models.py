"""Tiny models for contract tests, loadable as `path/to/tiny_models.py:function` model specs."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class _Pool(nn.Module):
    def __init__(self, masked: bool):
        super().__init__()
        self.emb, self.lin, self.masked = nn.Embedding(50, 16), nn.Linear(16, 8), masked

    def forward(self, ids, mask):
        h = self.lin(self.emb(ids))
        if not self.masked:
            return h.mean(1)                       # padding along seq changes the mean
        m = mask[..., None].float()
        return (h * m).sum(1) / m.sum(1).clamp(min=1e-9)


class _Rrelu(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return F.rrelu(self.lin(x), training=False)   # aten.rrelu: no graphmode lowering, no torch decomposition


def _pool(masked: bool):
    torch.manual_seed(0)
    ex = {"ids": torch.randint(0, 50, (2, 8)), "mask": torch.ones(2, 8, dtype=torch.long)}
    return _Pool(masked).eval(), ex, {"ids": ["batch", "seq"], "mask": ["batch", "seq"]}


def mean_pool():
    return _pool(False)


def masked_mean_pool():
    return _pool(True)


def rrelu():
    torch.manual_seed(0)
    return _Rrelu().eval(), (torch.randn(4, 8),)


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).eval(), (torch.randn(4, 16),)


def nan_weights():
    """A model whose weights went NaN (a diverged checkpoint): eager answers NaN everywhere."""
    model, ex = mlp()
    with torch.no_grad():
        model[0].weight[0, 0] = float("nan")       # one NaN reaches every output through the second linear
    return model, ex


class _Log(nn.Module):
    def forward(self, x):
        return torch.log(x) * 2.0            # NaN where x < 0: half of a standard normal input


def log_of_input():
    return _Log().eval(), (torch.randn(4, 16),)


def recipe(name: str, inputs: list[dict], dims: dict, **over) -> dict:
    r = {"version": 1, "name": name, "inputs": inputs, "dims": dims, "codegen": {"kernel_selection": "heuristic"}}
    r.update(over)
    return r


POOL_INPUTS = [{"name": "ids", "dtype": "i64", "shape": ["batch", "seq"]},
               {"name": "mask", "dtype": "i64", "shape": ["batch", "seq"], "pad_value": 0}]
POOL_DIMS = {"batch": {"buckets": [1, 2, 4]}, "seq": {"buckets": [4, 8], "min": 2}}


class _Indexed(nn.Module):
    """Token ids (vocab 50), token types (2) and positions (16) through embeddings, then a
    masked mean: the index inputs a BERT takes, at a size a test compiles in seconds."""

    def __init__(self):
        super().__init__()
        self.tok, self.typ, self.pos = nn.Embedding(50, 8), nn.Embedding(2, 8), nn.Embedding(16, 8)
        self.lin = nn.Linear(8, 4)

    def forward(self, ids, token_type_ids, mask):
        pos = torch.arange(ids.shape[1])
        h = self.lin(self.tok(ids) + self.typ(token_type_ids) + self.pos(pos)[None])
        m = mask[..., None].float()
        return (h * m).sum(1) / m.sum(1).clamp(min=1e-9)


INDEXED_INPUTS = [{"name": "ids", "dtype": "i64", "shape": ["batch", "seq"]},
                  {"name": "token_type_ids", "dtype": "i64", "shape": ["batch", "seq"]},
                  {"name": "mask", "dtype": "i64", "shape": ["batch", "seq"], "role": "attention_mask"}]


def indexed():
    torch.manual_seed(0)
    ex = {"ids": torch.randint(0, 50, (2, 8)), "token_type_ids": torch.zeros(2, 8, dtype=torch.long),
          "mask": torch.ones(2, 8, dtype=torch.long)}
    return _Indexed().eval(), ex, {k: ["batch", "seq"] for k in ex}
