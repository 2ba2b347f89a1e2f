"""Pure-torch varlen attention with the kernel's semantics: the CPU backend and the fallback.

Vectorized over the batch: sequences are gathered into a padded [B, S, H, D] batch, the
visibility mask is built from positions and lengths, and rows that see no key give zeros and
lse = -inf without NaN in the forward or the backward. Memory is O(B * H * Sq * Sk); it is
meant for CPU and small shapes, not as a fast path. Gradients come from autograd.
"""

from __future__ import annotations

import torch

from coreattn.layers.checks import VarlenParams


def _gather_padded(x: torch.Tensor, cu: torch.Tensor, max_len: int):
    # x [T, H, D] -> [B, S, H, D], plus the keep mask [B, S] and lengths [B]
    lens = (cu[1:] - cu[:-1]).long()
    pos = torch.arange(max_len, device=x.device)
    keep = pos[None, :] < lens[:, None]  # [B, S]
    idx = (cu[:-1].long()[:, None] + pos[None, :]).clamp(max=max(x.shape[0] - 1, 0))
    padded = x[idx] if x.shape[0] > 0 else x.new_zeros(idx.shape + x.shape[1:])
    return padded * keep[:, :, None, None].to(x.dtype), keep, lens


def visible_mask(lens_q, lens_k, max_q: int, max_k: int, params: VarlenParams) -> torch.Tensor:
    """[B, Sq, Sk] bool: query i of sequence b may attend to key j."""
    i = torch.arange(max_q, device=lens_q.device)[None, :, None]
    j = torch.arange(max_k, device=lens_q.device)[None, None, :]
    shift = (lens_k - lens_q)[:, None, None] if params.bottom_right else 0
    vis = (i < lens_q[:, None, None]) & (j < lens_k[:, None, None])
    if params.window_left >= 0:
        vis = vis & (j >= i + shift - params.window_left)
    if params.window_right >= 0:
        vis = vis & (j <= i + shift + params.window_right)
    return vis


def varlen_attn_torch(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
                      params: VarlenParams) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns out [Tq, Hq, Dv] in q's dtype and lse [Hq, Tq] float32 (natural log)."""
    hq, hkv = q.shape[1], k.shape[1]
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    qp, keep_q, lens_q = _gather_padded(q.to(compute), cu_seqlens_q, max_seqlen_q)
    kp, _, lens_k = _gather_padded(k.to(compute), cu_seqlens_k, max_seqlen_k)
    vp, _, _ = _gather_padded(v.to(compute), cu_seqlens_k, max_seqlen_k)
    b, sq = qp.shape[:2]
    qp = qp.view(b, sq, hkv, hq // hkv, qp.shape[-1])  # [B, Sq, Hkv, G, Dqk]
    scores = torch.einsum("bshgd,bthd->bhgst", qp, kp) * params.softmax_scale  # [B, Hkv, G, Sq, Sk]
    vis = visible_mask(lens_q, lens_k, max_seqlen_q, max_seqlen_k, params)[:, None, None]
    scores = scores.masked_fill(~vis, float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max)).detach()
    e = torch.exp(scores - row_max)  # masked entries are exactly 0
    denom = e.sum(dim=-1, keepdim=True)
    p = e / torch.where(denom == 0, torch.ones_like(denom), denom)
    out = torch.einsum("bhgst,bthd->bshgd", p, vp).reshape(b, sq, hq, vp.shape[-1])
    lse = (row_max + torch.log(denom)).squeeze(-1)  # [B, Hkv, G, Sq]; -inf where no key is visible
    lse = lse.reshape(b, hq, sq).transpose(1, 2)  # [B, Sq, Hq]
    out = out[keep_q].to(q.dtype)  # [Tq, Hq, Dv]
    lse = lse[keep_q].transpose(0, 1).float().contiguous()  # [Hq, Tq]
    return out, lse
