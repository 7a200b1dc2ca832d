"""A causal LM as the module decoding captures: `(input_ids, position_ids) -> logits` with no
cache (the forward pass every causal LM has), and the sizes its KV cache needs. The graph
rewrite onto the paged cache is the `to_paged` pass (graphmode/passes/to_paged.py)."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from graphmode.errors import CaptureError, RecipeError

INPUTS = ("input_ids", "position_ids", "block_table", "start", "lens", "last")


class CausalLMForward(nn.Module):
    """`forward(input_ids, position_ids) -> logits` of a transformers causal LM, without a cache."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        out = self.lm(input_ids=input_ids, position_ids=position_ids, use_cache=False, return_dict=True)
        return out.logits


def lm_config(lm: nn.Module) -> dict[str, Any]:
    """Layers, heads, KV heads, head dim, vocab and context length from a transformers config."""
    cfg = getattr(lm, "config", None)
    if cfg is None:
        raise CaptureError(f"{type(lm).__name__} has no `config`: decoding needs a transformers causal LM",
                           where="model", fix="pass a transformers *ForCausalLM model (or a ModelBundle of one)")
    get = lambda *names, default=None: next((getattr(cfg, n) for n in names if getattr(cfg, n, None) is not None),  # noqa: E731
                                            default)
    gen = getattr(lm, "generation_config", None)    # transformers' generate reads its tokens from here first
    tok = lambda name: next((v for v in (getattr(gen, name, None), get(name)) if v is not None), None)  # noqa: E731
    heads = get("num_attention_heads", "n_head")
    hidden = get("hidden_size", "n_embd")
    # multi-head latent attention (DeepSeek-V2/V3): a key head is its no-position part and its
    # rotary part (config.head_dim is the rotary part alone), a value head v_head_dim wide
    nope, rope = get("qk_nope_head_dim"), get("qk_rope_head_dim")
    head_dim = nope + rope if nope and rope else get("head_dim", default=hidden // heads if hidden and heads else None)
    return {"layers": get("num_hidden_layers", "n_layer"), "heads": heads,
            "kv_heads": get("num_key_value_heads", default=1 if _multi_query(cfg) else heads),
            "head_dim": head_dim, "v_head_dim": get("v_head_dim", default=head_dim) if nope and rope else head_dim,
            "vocab": get("vocab_size"), "context": get("max_position_embeddings", "n_positions"),
            "eos": tok("eos_token_id"), "pad": tok("pad_token_id"), "sliding_window": sliding_window(cfg)}


def alibi(cfg: Any) -> bool:
    """Attention scores biased by ALiBi's per-head position slopes (Bloom always, MPT's and
    Falcon's when their config says so): the paged attention applies the causal mask only."""
    attn = getattr(cfg, "attn_config", None)
    return (getattr(cfg, "model_type", None) == "bloom" or getattr(cfg, "alibi", False) is True
            or getattr(attn, "alibi", False) is True)


ALIBI_WHY = ("adds ALiBi position biases to its attention scores, which graphmode's paged attention does not apply "
             "(it would answer other tokens)")


def refuse_no_lm_head(lm: nn.Module) -> None:
    """A decoder recipe for a model whose forward returns no logits (an encoder: DistilBertModel)
    was refused by the KV cache's sizes first, and with those fixed, by a capture error about a
    missing `logits`; neither said the model is no causal LM."""
    head = getattr(lm, "get_output_embeddings", None)
    try:
        missing = head is None or head() is None
    except Exception:  # noqa: BLE001 - a model whose own accessor fails has no head we can read either
        missing = True
    if missing:
        raise RecipeError(f"{type(lm).__name__} has no language-model head (get_output_embeddings() is None), so it "
                          "cannot decode: memory.kv_cache is for a causal LM whose forward returns logits",
                          where="memory.kv_cache", value=type(lm).__name__,
                          fix="remove memory.kv_cache to serve its forward pass (/v1/infer, /v1/embeddings), or "
                              "load the model's *ForCausalLM class")


def refuse_alibi(lm: nn.Module) -> None:
    """Before capture: an ALiBi model cannot decode on the KV cache, whatever else its capture meets."""
    if alibi(getattr(lm, "config", None)):
        raise CaptureError(f"{type(lm).__name__} {ALIBI_WHY}", where="memory.kv_cache",
                           fix="compile its forward pass (a recipe without memory.kv_cache); decoding it runs "
                               "eagerly in transformers")


def _multi_query(cfg: Any) -> bool:
    """One K/V head for every query head, said only by a flag: Falcon's original architecture
    (falcon-7b/40b: `multi_query` without `new_decoder_architecture`, which expands K/V to
    every head before attention)."""
    return getattr(cfg, "multi_query", False) is True and not getattr(cfg, "new_decoder_architecture", False)


def sliding_window(cfg: Any) -> int | None:
    """The tokens a query attends back over when the model limits it (Mistral's, Phi-3's and
    Gemma 2's `sliding_window`; Qwen2's when `use_sliding_window`; GPT-Neo's `window_size` on
    its local layers), else None."""
    w = getattr(cfg, "sliding_window", None)
    if "local" in (getattr(cfg, "attention_layers", None) or ()):      # GPT-Neo's local layers
        w = getattr(cfg, "window_size", None)
    if not isinstance(w, int) or isinstance(w, bool) or getattr(cfg, "use_sliding_window", True) is False:
        return None
    return w
