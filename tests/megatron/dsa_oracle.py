"""Float64 oracle of the sparse-attention step of Megatron's DSAttention, written from its definition
(not from either implementation): each query attends, with a softmax, to the set of keys its top-k
row names (negative entries unused, a key named twice counts once, entries past ``topk_length``
unused) that its mask lets it see; a query that sees no key outputs 0.

What a query may see, as Megatron hands it to the step: per-row bounds ``[start, end)`` on the key
positions (``varlen_starts/ends`` with ``key_positions``, the identity when None), else an
additive ``[sq, sk]``/``[b, sq, sk]`` mask (-inf = hidden, a finite value is added to the score),
else top-left causal (key j <= query row s).
"""

from __future__ import annotations

import torch


def visible_keys(sq: int, sk: int, b: int, mask=None, starts=None, ends=None, key_positions=None):
    """bool [b, sq, sk] and the additive bias (float64 [b, sq, sk] or None)."""
    if starts is not None:
        pos = torch.arange(sk) if key_positions is None else key_positions.cpu().long()
        seen = (pos[None, :] >= starts.cpu().long()[:, None]) & (pos[None, :] < ends.cpu().long()[:, None])
        return seen.expand(b, sq, sk), None
    if mask is not None:
        bias = mask.cpu().double().expand(b, sq, sk)
        return torch.isfinite(bias), torch.where(torch.isfinite(bias), bias, 0.0)
    return (torch.arange(sk)[None, :] <= torch.arange(sq)[:, None]).expand(b, sq, sk), None


def named_keys(topk_indices, sk: int, topk_length=None):
    """bool [b, sq, sk]: the keys each top-k row names."""
    idx = topk_indices.cpu().long()
    b, sq, k = idx.shape
    if topk_length is not None:
        idx = torch.where(torch.arange(k)[None, None, :] < topk_length.cpu().long()[..., None], idx, -1)
    out = torch.zeros(b, sq, sk + 1, dtype=torch.bool)
    out.scatter_(-1, torch.where((idx >= 0) & (idx < sk), idx, sk), True)
    return out[..., :sk]


def sparse_attention_ref(query, key, value, topk_indices, softmax_scale, *, topk_length=None, **visibility):
    """query [sq, b, h, d], key [sk, b, hk, d], value [sk, b, hv, dv] (hk, hv: 1 or h) -> float64 [sq, b, h, dv]."""
    sq, b, h, _ = query.shape
    sk = key.shape[0]
    seen, bias = visible_keys(sq, sk, b, **visibility)
    allowed = seen & named_keys(topk_indices, sk, topk_length)  # [b, sq, sk]
    q = query.cpu().double()
    k = key.cpu().double().expand(sk, b, h, key.shape[3])
    v = value.cpu().double().expand(sk, b, h, value.shape[3])
    scores = torch.einsum("sbhd,tbhd->bhst", q, k) * softmax_scale
    if bias is not None:
        scores = scores + bias[:, None]
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row that sees nothing: all -inf -> 0
    return torch.einsum("bhst,tbhd->sbhd", probs, v)


def run_sparse_attention_ref(*, absorbed_mla, query, key, value, up_v_weight, topk_indices, softmax_scale, config,
                             mask, varlen_starts, varlen_ends, key_positions, topk_length=None):
    """megatron-core 0.19's ``dsa._run_sparse_attention`` from the definition, in float64; the
    result in the query's dtype: ``[sq, b, h * dv]``."""
    vis = dict(mask=mask, starts=varlen_starts, ends=varlen_ends, key_positions=key_positions)
    sq, b = query.shape[:2]
    if absorbed_mla:
        rank = config.kv_lora_rank
        latent = sparse_attention_ref(query, key, key[..., :rank], topk_indices, softmax_scale,
                                      topk_length=topk_length, **vis)
        out = torch.einsum("sbhc,hdc->sbhd", latent, up_v_weight.cpu().double())
    else:
        out = sparse_attention_ref(query, key, value, topk_indices, softmax_scale, topk_length=topk_length, **vis)
    return out.to(device=query.device, dtype=query.dtype).reshape(sq, b, -1)


def unfused_dsa_fn_ref(query, key, value, topk_indices, softmax_scale):
    """megatron-core 0.16-0.18's ``dsa.unfused_dsa_fn`` from the definition (top-left causal), in float64."""
    sq, b = query.shape[:2]
    out = sparse_attention_ref(query, key, value, topk_indices, softmax_scale)
    return out.to(device=query.device, dtype=query.dtype).reshape(sq, b, -1)
