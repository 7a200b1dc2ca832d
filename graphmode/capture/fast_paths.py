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


@contextlib.contextmanager
def eager_fast_paths(module: torch.nn.Module) -> Iterator[None]:
    """While exporting `module`: each nn.TransformerEncoder in it whose eager forward may take the
    nested-tensor fast path zeroes the padded rows as that path does."""
    patched = []
    for sub in module.modules():
        if isinstance(sub, torch.nn.TransformerEncoder) and _fast_path_possible(sub) and "forward" not in vars(sub):
            sub.forward = _zeroing_forward(sub, sub.forward)
            patched.append(sub)
    try:
        yield
    finally:
        for sub in patched:
            del sub.forward


__all__ = ["eager_fast_paths"]
