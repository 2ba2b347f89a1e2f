"""Attention under an arbitrary dense mask (Megatron's ``arbitrary`` mask type), in plain torch.

This is the correct-but-slow path for masks that are not causal, windowed or padding: it
materializes the ``[B, H, Sq, Sk]`` scores, so memory is O(B * H * Sq * Sk). Padding masks of
shape ``[B, 1, 1, Sk]`` never come here: they run in the kernels as keep masks. Dropout, softmax
offsets and max logits follow the kernels' definitions (dropout: coreattn/kernels/dropout.py's keep
mask on padded-batch token ids ``b * S + position``, as ``padded_attn`` uses them).
"""

from __future__ import annotations

import torch
from einops import repeat

from coreattn.kernels import dropout


def dense_mask_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, masked: torch.Tensor, layout: str,
                    softmax_scale: float, *, dropout_p: float = 0.0, rng_state: torch.Tensor | None = None,
                    softmax_offset: torch.Tensor | None = None, return_max_logit: bool = False):
    """Softmax attention where ``masked`` (bool, True = masked out, broadcastable to
    ``[B, Hq, Sq, Sk]``) removes pairs. q ``[Sq, B, Hq, Dqk]`` (sbhd) or ``[B, Sq, Hq, Dqk]`` (bshd),
    k/v likewise with Hkv heads (GQA). Returns out in q's layout with last dim Dv; a query row with
    every key masked gets zeros (not NaN, and no NaN gradient). Scores and softmax run in fp32
    (float64 for float64 inputs); P is cast to the input dtype before P @ V as the kernels do.

    ``dropout_p``: dropout on the probabilities (``rng_state`` as coreattn.kernels.dropout draws
    it; drawn from the device's generator when None). ``softmax_offset``: float ``[Hq]`` sink
    logits. ``return_max_logit``: the result is ``(out, max_logit)``, max_logit float32 ``[Hq]``."""
    if layout == "sbhd":
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))  # views: [B, S, H, D]
    batch, seqlen_q, hq = q.shape[:3]
    seqlen_k, hkv = k.shape[1], k.shape[2]
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    qh = q.transpose(1, 2).to(compute)  # [B, Hq, Sq, Dqk]
    kh = repeat(k.to(compute), "b s kv d -> b (kv g) s d", g=hq // hkv)  # [B, Hq, Sk, Dqk]
    vh = repeat(v, "b s kv d -> b (kv g) s d", g=hq // hkv)  # [B, Hq, Sk, Dv]
    scores = torch.matmul(qh, kh.transpose(-1, -2)) * softmax_scale
    scores = scores.masked_fill(masked, float("-inf"))
    max_logit = None
    if return_max_logit:
        max_logit = scores.detach().transpose(0, 1).reshape(hq, -1).amax(dim=1).float() if scores.numel() \
            else scores.new_full((hq,), float("-inf"), dtype=torch.float32)
    row_max = scores.amax(dim=-1, keepdim=True) if seqlen_k else scores.new_full(scores.shape[:-1] + (1,),
                                                                                 float("-inf"))
    if softmax_offset is not None:
        sink = softmax_offset.to(compute).view(1, hq, 1, 1)
        row_max = torch.maximum(row_max, sink)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max)).detach()
    e = torch.exp(scores - row_max)
    denom = e.sum(dim=-1, keepdim=True)
    if softmax_offset is not None:
        denom = denom + torch.exp(sink - row_max)
    p = e / torch.where(denom == 0, torch.ones_like(denom), denom)
    if dropout_p > 0:
        state = rng_state if rng_state is not None else dropout.rng_state(q.device)
        rows = torch.arange(batch, device=q.device).view(batch, 1, 1, 1)
        heads = torch.arange(hq, device=q.device).view(1, hq, 1, 1)
        q_ids = rows * seqlen_q + torch.arange(seqlen_q, device=q.device).view(1, 1, seqlen_q, 1)
        k_ids = rows * seqlen_k + torch.arange(seqlen_k, device=q.device).view(1, 1, 1, seqlen_k)
        keep = dropout.keep_mask(state, dropout_p, heads, q_ids, k_ids)
        p = p * keep.to(p.dtype) / (1.0 - dropout_p)
    out = torch.matmul(p.to(v.dtype), vh)  # [B, Hq, Sq, Dv]
    out = out.permute(2, 0, 1, 3) if layout == "sbhd" else out.transpose(1, 2)
    return (out, max_logit) if return_max_logit else out
