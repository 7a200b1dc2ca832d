"""`graphmode bench --between-buckets`: requests that fall between buckets, beside eager at the
request's own shape.

A recipe's buckets are a contract: a request is padded up to the smallest bucket that holds
it. The default bench times shapes that are buckets; this mode compiles each model with the
contract a user would write for traffic it has not seen — batch buckets [1, 2, 4] and, for
text models, seq buckets synthesised under max_padding 0.5 — and times a random sample of
request shapes inside it (plus batch 3 x seq 50, the shape the issue measured), each padded to
its bucket by graphmode and run at its own shape by eager PyTorch. Per shape the row says
which bucket ran and how much of it was padding; per model `summary` gives the worst and the
mean ratio to eager over the sample, against the goals (no shape slower than eager, <= 0.9x
on average).

The models are ones graphmode's tests never build, from `transformers` configs a size up from
graphmode.capture.families' (hidden 192-256, 4 layers, random weights) and a small MLP-Mixer
written here (no `transformers` class): a T5 encoder, a Llama-style gated-MLP LM, DistilBERT,
a ViT and the Mixer.
"""
from __future__ import annotations

import random
import statistics
from collections import Counter
from typing import Any, Sequence

import torch
import torch.nn as nn

from graphmode.capture.families import SEQ, _hf, _tokens, randomize

BATCH_BUCKETS = [1, 2, 4]
SEQ_DIM = {"min": 2, "max": 128, "max_padding": 0.5}
ISSUE_SHAPE = {"batch": 3, "seq": 50}
EXACT_PLANS = 16           # recurring seq values that get buckets of their own (runtime/exact.py)
IMG = 64
MAX_RATIO_GOAL = 1.0       # no request shape slower than eager
MEAN_RATIO_GOAL = 0.9      # and this on average over the sample


def _text(model: nn.Module, **tok: Any):
    ex = _tokens(vocab=1000, **tok)
    return model, ex, {k: list(SEQ) for k in ex}


def t5_encoder():
    return _text(_hf("T5EncoderModel", "T5Config", d_model=256, d_kv=32, d_ff=1024, num_layers=4, num_heads=8,
                     vocab_size=1000))


def gated_lm():
    """Llama-style: RMSNorm, RoPE, grouped-query attention, SwiGLU MLP, an untied LM head."""
    return _text(_hf("LlamaForCausalLM", "LlamaConfig", hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                     num_attention_heads=8, num_key_value_heads=4, vocab_size=1000, max_position_embeddings=256,
                     use_cache=False, tie_word_embeddings=False))


def distilbert():
    return _text(_hf("DistilBertModel", "DistilBertConfig", dim=256, n_layers=4, n_heads=8, hidden_dim=1024,
                     vocab_size=1000, max_position_embeddings=256))


def vit():
    m = _hf("ViTModel", "ViTConfig", hidden_size=192, num_hidden_layers=4, num_attention_heads=6,
            intermediate_size=768, image_size=IMG, patch_size=8)
    x = torch.randn(2, 3, IMG, IMG, generator=torch.Generator().manual_seed(0))
    return m, {"pixel_values": x}, {"pixel_values": ["batch", 3, IMG, IMG]}


class _MixerBlock(nn.Module):
    def __init__(self, tokens: int, dim: int, token_hidden: int, channel_hidden: int):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.token_mlp = nn.Sequential(nn.Linear(tokens, token_hidden), nn.GELU(), nn.Linear(token_hidden, tokens))
        self.channel_mlp = nn.Sequential(nn.Linear(dim, channel_hidden), nn.GELU(), nn.Linear(channel_hidden, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.token_mlp(self.norm1(x).transpose(1, 2)).transpose(1, 2)
        return x + self.channel_mlp(self.norm2(x))


class Mixer(nn.Module):
    """MLP-Mixer (Tolstikhin et al. 2021), small: patches -> blocks of token- and
    channel-mixing MLPs -> mean over tokens -> a linear head."""

    def __init__(self, image: int = IMG, patch: int = 8, dim: int = 192, depth: int = 4, classes: int = 100):
        super().__init__()
        tokens = (image // patch) ** 2
        self.stem = nn.Conv2d(3, dim, patch, stride=patch)
        self.blocks = nn.Sequential(*[_MixerBlock(tokens, dim, 2 * tokens, 4 * dim) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = self.stem(pixel_values).flatten(2).transpose(1, 2)
        return self.head(self.norm(self.blocks(x)).mean(dim=1))


def mixer():
    torch.manual_seed(0)
    m = randomize(Mixer().eval())
    x = torch.randn(2, 3, IMG, IMG, generator=torch.Generator().manual_seed(0))
    return m, {"pixel_values": x}, {"pixel_values": ["batch", 3, IMG, IMG]}


MODELS = {name: f"graphmode.bench.between:{name}" for name in ("t5_encoder", "gated_lm", "distilbert", "vit", "mixer")}


def contract_recipe(bundle: Any, name: str, mode: str = "hybrid") -> dict:
    """The recipe of the contract: batch buckets BATCH_BUCKETS, seq (where the model has one)
    synthesised from SEQ_DIM; token ids pad with 1, masks are declared as masks. In `hybrid`
    mode (the default here) a request between buckets may run eager PyTorch at its own shape
    where that measured faster than padded or split (runtime/split.py); `graph` never does. Up
    to EXACT_PLANS recurring seq values get buckets of their own (runtime/exact.py)."""
    from graphmode.errors import GraphmodeError
    from graphmode.ir.types import TORCH_TO_DTYPE
    dims_of = set(bundle.dim_names)
    if not dims_of or not dims_of <= {"batch", "seq"}:
        raise GraphmodeError(f"{name}'s dims are {sorted(dims_of) or 'none'}: --between-buckets samples requests "
                             "over a batch and a seq dim only", where="--model", value=name,
                             fix="name the model's dynamic axes batch (axis 0) and seq (bundle input_dims), or "
                                 "bench it without --between-buckets")
    inputs = []
    for n in bundle.input_names:
        spec: dict[str, Any] = {"name": n, "dtype": TORCH_TO_DTYPE[bundle.example_inputs[n].dtype],
                                "shape": list(bundle.input_dims[n]), "pad_value": 1 if n == "input_ids" else 0}
        if n == "attention_mask":
            spec["role"] = "attention_mask"
        inputs.append(spec)
    dims: dict[str, Any] = {"batch": {"buckets": list(BATCH_BUCKETS)}} if "batch" in bundle.dim_names else {}
    if "seq" in bundle.dim_names:
        dims["seq"] = {**SEQ_DIM, "exact_plans": EXACT_PLANS}
    return {"version": 1, "name": f"between-{name}".replace("_", "-"), "inputs": inputs, "dims": dims,
            "exe_mode": mode, "memory": {"budget_mb": 4096}}


def sample_envs(bundle: Any, n: int, seed: int, buckets: dict[str, list[int]]) -> list[dict[str, int]]:
    """ISSUE_SHAPE (where the model has those dims), then `n` request shapes drawn uniformly
    inside the contract, none twice and none a bucket in every dim (`buckets`: the recipe's
    bucket values per dim): requests that fall between buckets."""
    dims = bundle.dim_names
    lo_hi = {"batch": (1, max(BATCH_BUCKETS)), "seq": (SEQ_DIM["min"], SEQ_DIM["max"])}
    out = [{d: ISSUE_SHAPE[d] for d in dims}] if set(dims) <= set(ISSUE_SHAPE) else []
    want = len(out) + n
    rng = random.Random(seed)
    for _ in range(100 * (n + 1)):
        if len(out) >= want:
            break
        env = {d: rng.randint(*lo_hi[d]) for d in dims}
        if env not in out and not all(env[d] in buckets.get(d, ()) for d in dims):
            out.append(env)
    return out


def summary(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per model: graphmode's ratio to eager over its sampled shapes (worst with its shape,
    mean), how many shapes, and whether the goals are met (None when some shape did not run)."""
    out = []
    for model in dict.fromkeys(r["model"] for r in rows):
        gm = [r for r in rows if r["model"] == model and r["engine"] == "graphmode"
              and r.get("condition", "quiet") == "quiet"]
        ratios = [(r["ratio_vs_eager"], r) for r in gm if r.get("ratio_vs_eager") is not None]
        if not ratios:
            out.append({"model": model, "shapes": len(gm), "timed": 0, "max": None, "mean": None, "met": None})
            continue
        worst, wr = max(ratios, key=lambda x: x[0])
        mean = statistics.fmean(x for x, _ in ratios)
        complete = len(ratios) == len(gm)
        chosen = Counter(_way(r) for _, r in ratios)
        out.append({"model": model, "shapes": len(gm), "timed": len(ratios), "max": round(worst, 4),
                    "chosen": dict(chosen),
                    "max_at": wr["shape"], "max_bucket": (wr.get("execution") or {}).get("ran_in")
                    or (wr.get("setup_detail") or {}).get("bucket"),
                    "mean": round(mean, 4),
                    "met": (worst <= MAX_RATIO_GOAL and mean <= MEAN_RATIO_GOAL) if complete else None})
    return out


def _way(row: dict[str, Any]) -> str:
    """How a graphmode row's timed calls ran: the chooser's way (padded, split, eager), or with
    one way only, in a plan of the request's own value (runtime/exact.py) or padded."""
    ways = (row.get("execution") or {}).get("ways") or {}
    if "chosen" in ways:
        return str(ways["chosen"])
    return "in its own plan" if (row.get("setup_detail") or {}).get("exact_plan") else "padded"


def summary_lines(rows: Sequence[dict[str, Any]]) -> list[str]:
    """One line per model: the worst and mean ratio to eager, against the goals."""
    lines = []
    for s in summary(rows):
        if s["max"] is None:
            lines.append(f"{s['model']}: no graphmode shape timed")
            continue
        verdict = {True: "met", False: "NOT met", None: "not settled (a shape did not run)"}[s["met"]]
        lines.append(f"{s['model']}: between buckets {verdict}: worst {s['max']:.2f}x eager at "
                     f"{'x'.join(map(str, s['max_at']))} (bucket {s['max_bucket']}), mean {s['mean']:.2f}x over "
                     f"{s['timed']} request shapes (goals: <= {MAX_RATIO_GOAL:.1f}x each, <= {MEAN_RATIO_GOAL:.1f}x "
                     "on average)" + _chosen(s.get("chosen") or {}))
    return lines


def _chosen(chosen: dict[str, int]) -> str:
    return "; ran " + ", ".join(f"{n} {way}" for way, n in sorted(chosen.items())) if chosen else ""


def way_lines(rows: Sequence[dict[str, Any]]) -> list[str]:
    """One line per graphmode shape between buckets: the best ms of each way tried (padded into
    its bucket, split into buckets it fills, eager at its own shape) and the one it runs."""
    out = []
    for r in rows:
        ways = (r.get("execution") or {}).get("ways")
        if r["engine"] != "graphmode" or r.get("condition", "quiet") != "quiet" or not ways:
            continue
        tried = ", ".join(f"{w} {ms:.2f}" for w, ms in ways.items() if w != "chosen")
        out.append(f"{r['model']} {'x'.join(map(str, r['shape']))}: runs {ways['chosen']} (best ms: {tried})")
    return out


__all__ = ["MODELS", "BATCH_BUCKETS", "SEQ_DIM", "ISSUE_SHAPE", "Mixer", "contract_recipe", "sample_envs",
           "summary", "summary_lines", "way_lines"]
