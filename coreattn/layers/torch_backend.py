"""Pure-torch attention with the kernels' semantics: the CPU backend and the fallback.

Vectorized over the batch: each sequence (packed thd, or a span of a padded bshd/sbhd batch,
see coreattn/kernels/packing.py) is gathered into a padded [B, S, H, D] batch, the visibility
mask is built from positions and lengths, and rows that see no key give zeros and lse = -inf
without NaN in the forward or the backward. Memory is O(B * H * Sq * Sk): meant for CPU and
small shapes, not as a fast path. Gradients come from autograd.

The padded batch is sized by the true lengths, read from cu_seqlens or the spans (free on the
CPU, one host sync on a device), never by a caller's max_seqlen; malformed layouts raise here
even where the public functions skip their value checks (device tensors, no COREATTN_VALIDATE).
"""

from __future__ import annotations

import torch

from coreattn.kernels.packing import Packing, seq_len_dim
from coreattn.layers.checks import VarlenParams


def _spans(pack: Packing) -> tuple[torch.Tensor, torch.Tensor]:
    if not pack.spans:
        return pack.seq[:-1].long(), (pack.seq[1:] - pack.seq[:-1]).long()
    return pack.seq.long(), pack.lens.long()


def _longest(pack: Packing, n_tokens: int) -> int:
    """The longest sequence of a well-formed layout (one read of device values); raises
    ValueError on malformed cu_seqlens or spans."""
    starts, lens = _spans(pack)
    if lens.numel() == 0:
        return 0
    bad = (starts < 0) | (lens < 0) | (starts + lens > n_tokens)
    if not pack.spans:
        bad = bad | (pack.seq[0] != 0) | (pack.seq[-1] != n_tokens)
    longest, malformed = torch.stack([lens.max(), bad.any().long()]).tolist()
    if malformed:
        what = "spans (start/length or seqused)" if pack.spans else "cu_seqlens"
        raise ValueError(f"malformed {what}: a sequence does not fit in the {n_tokens} tokens (or cu_seqlens does "
                         "not run from 0 to the token count without decreasing)")
    return longest


def _token_index(x: torch.Tensor, pack: Packing, tok: torch.Tensor):
    """Index tuple selecting token positions ``tok`` [B, S] of x in its layout."""
    b = torch.arange(tok.shape[0], device=tok.device)[:, None].expand_as(tok)
    if pack.fmt == "thd":
        return (tok,)
    return (b, tok) if pack.fmt == "bshd" else (tok, b)


def _gather(x: torch.Tensor, pack: Packing, max_len: int):
    """x -> padded [B, max_len, H, D] of each sequence's tokens, the in-sequence mask [B, S],
    lengths [B] and token positions [B, S]."""
    n = seq_len_dim(x, pack.fmt)
    starts, lens = _spans(pack)
    pos = torch.arange(max_len, device=x.device)
    keep = pos[None, :] < lens[:, None]
    tok = (starts[:, None] + pos[None, :]).clamp(0, max(n - 1, 0))
    if n == 0:  # no token to index; 0 * x.sum() keeps the (empty) input in the autograd graph
        return x.new_zeros(tok.shape + x.shape[-2:]) + 0 * x.sum(), keep, lens, tok
    return x[_token_index(x, pack, tok)] * keep[:, :, None, None].to(x.dtype), keep, lens, tok


def _scatter(vals: torch.Tensor, like: torch.Tensor, pack: Packing, keep: torch.Tensor, tok: torch.Tensor,
             fill: float) -> torch.Tensor:
    """Inverse of _gather for [B, S, ...] values: packed rows, or a padded tensor laid out like ``like``."""
    if not pack.spans:
        return vals[keep]
    token_dims = 1 if pack.fmt == "thd" else 2
    out = torch.full(like.shape[:token_dims] + vals.shape[2:], fill, dtype=vals.dtype, device=vals.device)
    idx = tuple(i[keep] for i in _token_index(like, pack, tok))
    return out.index_put(idx, vals[keep])


def _keep_at(pack: Packing, tok: torch.Tensor) -> torch.Tensor:
    """The pack's keep mask read at the gathered token positions [B, S] (all True without a mask)."""
    if pack.keep is None:
        return torch.ones(tok.shape, dtype=torch.bool, device=tok.device)
    b = torch.arange(tok.shape[0], device=tok.device)[:, None]
    return pack.keep[b, tok.clamp(max=pack.keep.shape[1] - 1)] != 0


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


def attn_torch(q, k, v, q_pack: Packing, k_pack: Packing, params: VarlenParams) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns out (q's layout and dtype, last dim Dv) and lse float32 ([Hq, Tq] packed, [B, Hq, Sq] padded)."""
    hq, hkv = q.shape[-2], k.shape[-2]
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    max_q, max_k = _longest(q_pack, seq_len_dim(q, q_pack.fmt)), _longest(k_pack, seq_len_dim(k, k_pack.fmt))
    qp, keep_q, lens_q, tok_q = _gather(q.to(compute), q_pack, max_q)
    kp, _, lens_k, tok_k = _gather(k.to(compute), k_pack, max_k)
    vp, _, _, _ = _gather(v.to(compute), k_pack, max_k)
    b, sq = qp.shape[:2]
    qp = qp.view(b, sq, hkv, hq // hkv, qp.shape[-1])  # [B, Sq, Hkv, G, Dqk]
    scores = torch.einsum("bshgd,bthd->bhgst", qp, kp) * params.softmax_scale  # [B, Hkv, G, Sq, Sk]
    vis = visible_mask(lens_q, lens_k, max_q, max_k, params)
    vis = vis & _keep_at(q_pack, tok_q)[:, :, None] & _keep_at(k_pack, tok_k)[:, None, :]
    vis = vis[:, None, None]
    scores = scores.masked_fill(~vis, float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True) if scores.shape[-1] else scores.new_zeros(scores.shape[:-1] + (1,))
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max)).detach()
    e = torch.exp(scores - row_max)  # masked entries are exactly 0
    denom = e.sum(dim=-1, keepdim=True)
    p = e / torch.where(denom == 0, torch.ones_like(denom), denom)
    out = torch.einsum("bhgst,bthd->bshgd", p, vp).reshape(b, sq, hq, vp.shape[-1])
    lse = (row_max + torch.log(denom)).reshape(b, hq, sq).transpose(1, 2)  # [B, Sq, Hq]; -inf: no key
    out = _scatter(out.to(q.dtype), q, q_pack, keep_q, tok_q, 0.0)
    lse = _scatter(lse.float(), q, q_pack, keep_q, tok_q, float("-inf"))
    if q_pack.fmt == "thd":
        return out, lse.transpose(0, 1).contiguous()  # [Hq, Tq]
    lse = lse if q_pack.fmt == "bshd" else lse.transpose(0, 1)  # [B, S, Hq]
    return out, lse.transpose(1, 2).contiguous()  # [B, Hq, S]
