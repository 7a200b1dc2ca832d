"""What eager PyTorch's fast paths do that torch.export does not trace, put back into the capture.

nn.TransformerEncoder in eval mode, given a `src_key_padding_mask` whose padding is at the end
of every row ("left aligned"), runs its layers on a nested tensor of the real positions and
pads the result back with zeros: the padded rows of its output are 0 (then its final norm, if
any, is applied to them). Under torch.export (`torch.compiler.is_compiling()`) it takes the
padded path instead, which computes those rows like any other. A graph captured as traced
answered a padded request with other values than eager in every padded row (rel L2 0.48 on a
2-layer encoder with 3 of 16 rows padded). While the model is exported, each such encoder's
forward zeroes the rows eager would, under the same data-dependent condition (the mask left
aligned), as tensor ops the graph carries; its real rows are the same either way.

nn.MultiheadAttention in eval mode, called as self-attention (query, key and value one tensor)
with boolean masks, runs `torch._native_multi_head_attention`, and nn.TransformerEncoderLayer in
eval mode runs `torch._transformer_encoder_layer_fwd` (float masks too): both answer NaN in every
query row whose keys are all masked, where the traced path (scaled_dot_product_attention when no
weights are asked for) answers a finite row. While the model is exported, each such module fills
those rows with NaN, as eager does.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from graphmode.errors import CaptureError


def _fast_path_possible(enc: torch.nn.TransformerEncoder) -> bool:
    """The conditions of TransformerEncoder.forward's sparsity fast path that do not depend on
    the call: the ones that do (a 3-d src, a key padding mask and no attention mask) are checked
    per call in `_zeroing_forward`."""
    first = enc.layers[0] if len(enc.layers) else None
    return (torch.backends.mha.get_fastpath_enabled() and bool(getattr(enc, "use_nested_tensor", False))
            and first is not None and not first.training)


def _zeroing_forward(enc: torch.nn.TransformerEncoder, forward: Any) -> Any:
    def run(src: torch.Tensor, mask: torch.Tensor | None = None, src_key_padding_mask: torch.Tensor | None = None,
            is_causal: bool | None = None) -> torch.Tensor:
        if src_key_padding_mask is None or mask is not None or src.dim() != 3:
            return forward(src, mask=mask, src_key_padding_mask=src_key_padding_mask, is_causal=is_causal)
        if not getattr(enc, "mask_check", True):
            raise CaptureError("nn.TransformerEncoder with mask_check=False: in eval mode eager moves the real "
                               "positions of every row to its front before the layers, whatever the mask, which "
                               "the exported graph does not", where=type(enc).__name__,
                               fix="construct the encoder with mask_check=True (the default), or run exe_mode eager")
        norm, enc.norm = enc.norm, None
        try:
            out = forward(src, mask=None, src_key_padding_mask=src_key_padding_mask, is_causal=is_causal)
        finally:
            enc.norm = norm
        keep = src_key_padding_mask.logical_not()           # a bool mask: True pads; a float one: nonzero pads
        # left aligned: no kept position after a padded one. Written as a scan and a mask so that
        # bucket padding (masked positions, whole masked rows) provably adds none
        padded_before = torch.cumsum(keep.logical_not(), 1) > 0
        misplaced = torch.logical_and(keep, padded_before).sum()
        aligned = misplaced == 0
        out = out.masked_fill((keep.logical_not() & aligned).unsqueeze(-1), 0.0)
        return norm(out) if norm is not None else out
    return run


def _mha_fast_path(mha: torch.nn.MultiheadAttention, query: Any, key: Any, value: Any, masks: list) -> bool:
    """MultiheadAttention.forward's conditions for `_native_multi_head_attention` in inference."""
    return (torch.backends.mha.get_fastpath_enabled() and query.dim() == 3 and query is key and key is value
            and all(m is None or not torch.is_floating_point(m) for m in masks)
            and mha.in_proj_weight is not None and query.dtype == mha.in_proj_weight.dtype
            and mha.in_proj_bias is not None and query.dtype == mha.in_proj_bias.dtype     # bias=False: no kernel
            and not mha.training and mha.num_heads % 2 == 0 and mha.batch_first and mha.bias_k is None
            and mha.bias_v is None and not mha.add_zero_attn and mha._qkv_same_embed_dim
            and not torch.is_autocast_enabled())


def _layer_fast_path(layer: torch.nn.TransformerEncoderLayer, src: Any) -> bool:
    """TransformerEncoderLayer.forward's conditions for `_transformer_encoder_layer_fwd` in inference."""
    attn = layer.self_attn
    return (torch.backends.mha.get_fastpath_enabled() and src.dim() == 3 and not layer.training
            and attn.batch_first and attn.in_proj_bias is not None and attn._qkv_same_embed_dim
            and bool(layer.activation_relu_or_gelu) and layer.norm1.eps == layer.norm2.eps
            and attn.num_heads % 2 == 0 and not torch.is_autocast_enabled()
            and not any(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in layer.modules()))


def _nan_where_fully_masked(out: torch.Tensor, mha: torch.nn.MultiheadAttention, query: torch.Tensor,
                            key_padding_mask: Any, attn_mask: Any) -> torch.Tensor:
    """`out` with NaN in every [batch, query row] whose keys are all masked by the key padding mask
    (batch, keys), the attention mask (rows, keys) or (batch * heads, rows, keys), or both: a bool
    mask masks where true, a float one where -inf. The NaN comes from a softmax of the masks, as in
    the native kernel (a row of -inf), so a row masked by padding reads as the padding analysis
    knows attention's rows."""
    batch, rows = query.shape[0], query.shape[1]

    def as_float(m: torch.Tensor) -> torch.Tensor:
        return m if torch.is_floating_point(m) else torch.zeros(m.shape, dtype=query.dtype).masked_fill(m, float("-inf"))
    scores = None
    if attn_mask is not None:
        scores = as_float(attn_mask).reshape(-1 if attn_mask.dim() == 3 else 1, mha.num_heads if attn_mask.dim() == 3
                                             else 1, rows, attn_mask.shape[-1])
    if key_padding_mask is not None:
        keys = as_float(key_padding_mask).reshape(batch, 1, 1, key_padding_mask.shape[-1])
        scores = keys if scores is None else scores + keys
    if scores is None:
        return out
    # 0 in a live row, NaN in a dead one; a NaN in one head's row reaches the whole row
    poison = torch.softmax(scores, -1).sum(-1).sum(1) * 0.0
    return out + poison.expand(batch, rows).unsqueeze(-1)


def _nan_rows_forward(mha: torch.nn.MultiheadAttention, forward: Any) -> Any:
    def run(query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
            average_attn_weights=True, is_causal=False):
        out, weights = forward(query, key, value, key_padding_mask=key_padding_mask, need_weights=need_weights,
                               attn_mask=attn_mask, average_attn_weights=average_attn_weights, is_causal=is_causal)
        if not _mha_fast_path(mha, query, key, value, [key_padding_mask, attn_mask]):
            return out, weights
        return _nan_where_fully_masked(out, mha, query, key_padding_mask, attn_mask), weights
    return run


def _nan_rows_layer_forward(layer: torch.nn.TransformerEncoderLayer, forward: Any) -> Any:
    def run(src, src_mask=None, src_key_padding_mask=None, is_causal=False):
        out = forward(src, src_mask=src_mask, src_key_padding_mask=src_key_padding_mask, is_causal=is_causal)
        if not _layer_fast_path(layer, src):
            return out
        return _nan_where_fully_masked(out, layer.self_attn, src, src_key_padding_mask, src_mask)
    return run


@contextlib.contextmanager
def eager_fast_paths(module: torch.nn.Module) -> Iterator[None]:
    """While exporting `module`: each nn.TransformerEncoder in it whose eager forward may take the
    nested-tensor fast path zeroes the padded rows as that path does, and each encoder layer and
    nn.MultiheadAttention answers NaN in fully masked rows as its native kernel does."""
    patched = []
    for sub in module.modules():
        if "forward" in vars(sub):
            continue
        if isinstance(sub, torch.nn.TransformerEncoder) and _fast_path_possible(sub):
            sub.forward = _zeroing_forward(sub, sub.forward)
            patched.append(sub)
        elif isinstance(sub, torch.nn.TransformerEncoderLayer) and not sub.training:
            sub.forward = _nan_rows_layer_forward(sub, sub.forward)
            patched.append(sub)
        elif isinstance(sub, torch.nn.MultiheadAttention) and not sub.training:
            sub.forward = _nan_rows_forward(sub, sub.forward)
            patched.append(sub)
    try:
        yield
    finally:
        for sub in patched:
            del sub.forward


__all__ = ["eager_fast_paths"]
