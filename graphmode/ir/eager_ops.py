"""Eager ops ATen does not have, registered as torch ops (`torch.ops.graphmode.*`) so that a
`fallback` node can call them like any ATen op, and a `.gm` that holds one imports this module
(`ir/fallback.py` `op_module`).

`non_max_suppression` is ONNX's NonMaxSuppression, as the ONNX reference and ONNX Runtime
compute it: per batch and class, the boxes scoring above `score_threshold` in descending score
order (ties: the lower box index first), each kept unless its IoU with a box already kept
exceeds `iou_threshold` (a box of no area, or two boxes that do not overlap, never suppress),
at most `max_output` a class. The IoU is computed in f32 in the reference's order of operations,
so a box exactly at the threshold goes the same way.
"""
from __future__ import annotations

from typing import Optional

import torch


@torch.library.custom_op("graphmode::non_max_suppression", mutates_args=())
def non_max_suppression(boxes: torch.Tensor, scores: torch.Tensor, max_output: Optional[torch.Tensor],
                        iou_threshold: Optional[torch.Tensor], score_threshold: Optional[torch.Tensor],
                        center_point_box: int) -> torch.Tensor:
    limit = max(int(max_output.reshape(-1)[0]), 0) if max_output is not None and max_output.numel() else 0
    iou_thr = float(iou_threshold.reshape(-1)[0]) if iou_threshold is not None and iou_threshold.numel() else 0.0
    use_score = score_threshold is not None and score_threshold.numel() > 0
    score_thr = score_threshold.reshape(-1)[0].to(scores.dtype) if use_score else None
    picked: list[tuple[int, int, int]] = []
    for b in range(boxes.shape[0]):
        lo, hi = _corners(boxes[b].to(torch.float32), center_point_box)
        iou = _iou(lo, hi)
        for c in range(scores.shape[1]):
            s = scores[b, c]
            idx = torch.arange(s.shape[0])
            if use_score:
                idx = idx[s > score_thr]
            # descending score, ties by ascending index: a stable sort of the (ascending) candidates
            order = idx[torch.sort(s[idx], descending=True, stable=True).indices]
            kept: list[int] = []
            for i in order.tolist():
                if len(kept) >= limit:
                    break
                if not kept or not bool((iou[i, kept] > iou_thr).any()):
                    kept.append(i)
                    picked.append((b, c, i))
    return torch.tensor(picked, dtype=torch.int64).reshape(-1, 3)


def _corners(box: torch.Tensor, center_point_box: int) -> tuple[torch.Tensor, torch.Tensor]:
    """([x_min, y_min], [x_max, y_max]) of each box, from either diagonal's corners
    (center_point_box 0: [y1, x1, y2, x2]) or [x_center, y_center, width, height]."""
    if center_point_box == 0:
        x = torch.stack([box[:, 1], box[:, 3]], 1)
        y = torch.stack([box[:, 0], box[:, 2]], 1)
        return torch.stack([x.min(1).values, y.min(1).values], 1), torch.stack([x.max(1).values, y.max(1).values], 1)
    half = box[:, 2:] / 2
    return box[:, :2] - half, box[:, :2] + half


def _iou(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """Pairwise IoU, 0 where the boxes do not overlap or either has no area."""
    ilo = torch.maximum(lo[:, None], lo[None])
    ihi = torch.minimum(hi[:, None], hi[None])
    overlap = (ihi > ilo).all(-1)
    inter = (ihi[..., 0] - ilo[..., 0]) * (ihi[..., 1] - ilo[..., 1])
    area = (hi[:, 0] - lo[:, 0]) * (hi[:, 1] - lo[:, 1])
    union = area[:, None] + area[None] - inter
    ok = overlap & (inter > 0) & (area[:, None] > 0) & (area[None] > 0) & (union > 0)
    return torch.where(ok, inter / torch.where(ok, union, torch.ones_like(union)), torch.zeros_like(inter))
