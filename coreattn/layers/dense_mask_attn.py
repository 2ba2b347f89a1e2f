"""Attention under an arbitrary dense mask (Megatron's ``arbitrary`` mask type), in plain torch.

This is the correct-but-slow path for masks that are not causal, windowed or padding: it
materializes the ``[B, H, Sq, Sk]`` scores, so memory is O(B * H * Sq * Sk). Padding masks of
shape ``[B, 1, 1, Sk]`` never come here: they run in the kernels as keep masks.
"""

from __future__ import annotations

import torch


def dense_mask_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, masked: torch.Tensor, layout: str,
                    softmax_scale: float) -> torch.Tensor:
    """Softmax attention where ``masked`` (bool, True = masked out, broadcastable to
    ``[B, Hq, Sq, Sk]``) removes pairs. q ``[Sq, B, Hq, Dqk]`` (sbhd) or ``[B, Sq, Hq, Dqk]`` (bshd),
    k/v likewise with Hkv heads (GQA). Returns out in q's layout with last dim Dv; a query row with
    every key masked gets zeros (not NaN, and no NaN gradient). Scores and softmax run in fp32
    (float64 for float64 inputs); P is cast to the input dtype before P @ V as the kernels do."""
    if layout == "sbhd":
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))  # views: [B, S, H, D]
    hq, hkv = q.shape[2], k.shape[2]
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    qh = q.transpose(1, 2).to(compute)  # [B, Hq, Sq, Dqk]
    kh = k.transpose(1, 2).to(compute).repeat_interleave(hq // hkv, dim=1)  # [B, Hq, Sk, Dqk]
    vh = v.transpose(1, 2).repeat_interleave(hq // hkv, dim=1)  # [B, Hq, Sk, Dv]
    scores = torch.matmul(qh, kh.transpose(-1, -2)) * softmax_scale
    scores = scores.masked_fill(masked, float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max)).detach()
    e = torch.exp(scores - row_max)
    denom = e.sum(dim=-1, keepdim=True)
    p = e / torch.where(denom == 0, torch.ones_like(denom), denom)
    out = torch.matmul(p.to(v.dtype), vh)  # [B, Hq, Sq, Dv]
    return out.permute(2, 0, 1, 3) if layout == "sbhd" else out.transpose(1, 2)
