"""The small model the artifact and cache fuzzers compile (a spec: `models.py:mlp`), its
recipe, and the reference its outputs are checked against."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

SPEC = f"{Path(__file__).resolve()}:mlp"
RECIPE: dict[str, Any] = {"version": 1, "name": "fuzz-mlp", "targets": ["host"],
                          "inputs": [{"name": "x", "dtype": "f32", "shape": ["batch", 16]}],
                          "dims": {"batch": {"buckets": [1, 2]}}, "exe_mode": "graph",
                          "codegen": {"kernel_selection": "heuristic"}}


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        return self.c(torch.relu(self.b(h)) + h)


def mlp():
    torch.manual_seed(0)
    return MLP().eval(), {"x": torch.randn(2, 16)}, {"x": ["batch", 16]}


def sample(batch: int = 2) -> torch.Tensor:
    return torch.randn(batch, 16, generator=torch.Generator().manual_seed(batch))


def reference(batch: int = 2) -> torch.Tensor:
    module, _, _ = mlp()
    with torch.inference_mode():
        return module(sample(batch))


def check_output(out: Any, batch: int = 2) -> tuple[str, str]:
    """("accepted", "") when `out` is the MLP's answer to `sample(batch)`, else a wrong-output."""
    from graphmode.verify.numerics import rel_l2
    got = out[0] if isinstance(out, (tuple, list)) else out
    want = reference(batch)
    if not isinstance(got, torch.Tensor) or got.shape != want.shape:
        return "wrong-output", f"output {type(got).__name__} {getattr(got, 'shape', '')}, want {tuple(want.shape)}"
    err = rel_l2(got, want)
    return ("accepted", "") if err < 1e-5 else ("wrong-output", f"rel L2 {err:.2e} vs eager")


DECODER_RECIPE: dict[str, Any] = {
    "version": 1, "name": "fuzz-decoder", "exe_mode": "graph", "codegen": {"kernel_selection": "heuristic"},
    "inputs": [{"name": "input_ids", "dtype": "i64", "shape": ["batch", "seq"]},
               {"name": "attention_mask", "dtype": "i64", "shape": ["batch", "seq"], "role": "attention_mask"}],
    "dims": {"batch": {"buckets": [1, 2]}, "seq": {"buckets": [8, 16], "min": 2}},
    "memory": {"kv_cache": {"page_size": 4, "max_pages_per_seq": 8, "layers": 2, "kv_heads": 4, "head_dim": 8}}}
DECODER_SPEC = f"{Path(__file__).resolve()}:decoder"
VOCAB = 100


def decoder():
    """A 2-layer GPT-2 (4 heads of 8, vocabulary 100, random weights) for /v1/completions."""
    import warnings

    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    cfg = GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=64, bos_token_id=1, eos_token_id=2,
                     use_cache=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lm = GPT2LMHeadModel(cfg).eval()
    ex = {"input_ids": torch.randint(3, VOCAB, (2, 8)), "attention_mask": torch.ones(2, 8, dtype=torch.long)}
    return lm, ex, {k: ["batch", "seq"] for k in ex}
