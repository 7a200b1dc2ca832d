"""The stored int4 weight format of `qlinear` (recipe `precision.weights: int4`).

A weight W [N, K] is cut along K into groups of G (32, 64 or 128) weights; each group has an
f32 scale s and a zero point z, and holds 4-bit codes q in 0..15 standing for (q - z) * s.
symmetric: z = 8 for every group (not stored); s = the group's largest-magnitude weight / -8,
so that weight is exactly -8 steps and the codes span [-8, 7] (llama.cpp's q4_0 rule).
asymmetric: s = (max - min) / 15 and z = round(-min / s) in 0..15, over the group's range widened
to hold 0 (an integer zero point must stand for 0).

Packing (two codes a byte, llama.cpp's order inside a group): the G codes of a group take
G / 2 bytes; byte j holds code j in its low nibble and code j + G/2 in its high nibble, so one
vector load of bytes gives, after a mask and a shift, two runs of consecutive weights.

In the graph: weight u8 [N, K/2], scale f32 [N, K/G] (symmetric) or f32 [N, K/G, 2] holding
(scale, zero) per group (asymmetric; the zero an integer-valued float). G = K / groups.

Activations (the qlinear attribute `act`, recipe `precision.int4_activations`): f32 (the
default: the answer is dequantize-then-matmul) or q8, llama.cpp q8_0's rule, for integer dot
products with the symmetric group-32 codes (q4_0 x q8_0): each row of x is cut into blocks
of 32; a block's d = max|x| / 127 and its codes r = round_half_even(x * (1 / d)) (0 when
d = 0), so y[n] = sum over blocks of (integer sum of r * (q - 8)) * (s * d) (+ bias).
"""
from __future__ import annotations

import torch

GROUPS = (32, 64, 128)
ACTIVATIONS = ("f32", "q8")
Q8_BLOCK = 32
SCHEMES = ("symmetric", "asymmetric")
SYMMETRIC_ZERO = 8


def pack(q: torch.Tensor, group: int) -> torch.Tensor:
    """u8 [N, K/2] from codes q (integers 0..15) [N, K]."""
    n, k = q.shape
    q = q.to(torch.uint8).reshape(n, k // group, 2, group // 2)
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def unpack(packed: torch.Tensor, group: int) -> torch.Tensor:
    """Codes u8 [N, K] (0..15) from packed u8 [N, K/2]."""
    n, half = packed.shape
    p = packed.reshape(n, 2 * half // group, 1, group // 2)
    return torch.cat([p & 15, p >> 4], dim=2).reshape(n, 2 * half)


def quantize(w: torch.Tensor, group: int, scheme: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed u8 [N, K/2], scale f32 [N, K/G] or [N, K/G, 2]) for an f32 [N, K] weight."""
    w = w.detach().float()
    n, k = w.shape
    blocks = w.reshape(n, k // group, group)
    if scheme == "symmetric":
        idx = blocks.abs().argmax(dim=2, keepdim=True)
        peak = blocks.gather(2, idx)[..., 0]
        scale = torch.where(peak != 0, peak / -8.0, torch.ones_like(peak))
        q = torch.round(blocks / scale[..., None]).clamp_(-8, 7) + SYMMETRIC_ZERO
        return pack(q.reshape(n, k), group), scale.contiguous()
    lo, hi = blocks.amin(dim=2).clamp(max=0), blocks.amax(dim=2).clamp(min=0)     # the range holds 0
    scale = torch.where(hi > lo, (hi - lo) / 15.0, torch.ones_like(hi))
    zero = torch.round(-lo / scale).clamp_(0, 15)
    q = (torch.round(blocks / scale[..., None]) + zero[..., None]).clamp_(0, 15)
    return pack(q.reshape(n, k), group), torch.stack([scale, zero], dim=2).contiguous()


def group_of(packed_shape, scale_shape) -> int:
    """G from the shapes of the packed weight [N, K/2] and its scales [N, K/G(, 2)]."""
    return 2 * int(packed_shape[1]) // int(scale_shape[1])


def dequantize(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The f32 weight [N, K]: (q - z) * s per group."""
    group = group_of(packed.shape, scale.shape)
    n = packed.shape[0]
    q = unpack(packed, group).float().reshape(n, -1, group)
    if scale.dim() == 3:
        s, z = scale[..., 0], scale[..., 1]
    else:
        s, z = scale, torch.full_like(scale, SYMMETRIC_ZERO)
    return ((q - z.float()[..., None]) * s.float()[..., None]).reshape(n, -1)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes f32 [..., K/32, 32] holding integers in -127..127, d f32 [..., K/32]): q8 blocks
    of x [..., K] (module doc), each f32 operation as the kernels do it."""
    xb = x.float().reshape(*x.shape[:-1], x.shape[-1] // Q8_BLOCK, Q8_BLOCK)
    d = xb.abs().amax(dim=-1) / 127.0
    inv = torch.where(d != 0, 1.0 / torch.where(d != 0, d, torch.ones_like(d)), torch.zeros_like(d))
    return torch.round(xb * inv[..., None]), d


def q8_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
    """qlinear with act q8 over symmetric group-32 codes: exact integer block sums, each times
    s * d in f32, summed over the blocks (+ bias)."""
    if scale.dim() != 2 or group_of(packed.shape, scale.shape) != Q8_BLOCK:
        raise ValueError("q8 activations need symmetric int4 codes of group 32")
    n = packed.shape[0]
    r, d = quantize_activations(x)                                          # [..., B, 32], [..., B]
    codes = unpack(packed, Q8_BLOCK).reshape(n, -1, Q8_BLOCK).double() - SYMMETRIC_ZERO
    dots = torch.einsum("...bk,nbk->...nb", r.double(), codes).float()      # integers below 2^16: exact
    y = (dots * (scale.float() * d[..., None, :])).sum(dim=-1)
    return y + bias if bias is not None else y


__all__ = ["ACTIVATIONS", "GROUPS", "Q8_BLOCK", "SCHEMES", "SYMMETRIC_ZERO", "dequantize", "group_of", "pack",
           "q8_linear", "quantize", "quantize_activations", "unpack"]
