"""The independent references for sparse (top-k) attention: dense masked softmax over the named key set.

Written from the definition (docs/dsa.md), not from the code under test: for each query token, a
Python loop builds the set of keys it may see (entries of its row, the first topk_length of them,
that are non-negative, inside its sequence, allowed by causality and inside the given key bounds;
a key named twice is one key), then attention is an ordinary softmax over the whole key side of
its sample with every other key masked. ``upcast=True`` is the float64 oracle; ``upcast=False``
the naive same-dtype baseline of the flash-attention criterion (scores and softmax in fp32 from
the input-dtype values, P rounded to the input dtype before P @ V, the output rounded). Both are
differentiable, so gradients are compared the same way.

Layouts: ``"thd"`` (q ``[Tq, Hq, D]``, positions are rows of the packed k), ``"bshd"``
(``[B, S, H, D]``, positions in the sample); sbhd callers transpose to bshd first.
"""

from __future__ import annotations

import math

import torch


def sparse_sets(topk: list, token_seq: list, token_pos: list, q_len: list, k_start: list, k_len: list, *,
                causal: bool, bottom_right: bool, topk_length: list | None = None,
                bounds: tuple[list, list] | None = None, window: tuple[int, int] | None = None) -> list[list[set]]:
    """For each query token n (sequence ``token_seq[n]`` or None for a token outside every
    sequence, position ``token_pos[n]`` in it) and index head, the set of visible key positions.
    ``window=(left, right)``: every row also names the keys of its sequence at relative positions
    ``pos + shift - left .. pos + shift + right`` (shift Lk - Lq bottom-right, 0 top-left), past
    ``topk_length``'s cut."""
    sets = []
    for n, row_heads in enumerate(topk):
        b = token_seq[n]
        per_head = []
        for row in row_heads:
            keys = set()
            used = list(row if topk_length is None else row[:max(0, topk_length[n])])
            if window is not None and b is not None:
                center = token_pos[n] + (k_len[b] - q_len[b] if bottom_right else 0)
                used += [k_start[b] + r for r in range(center - window[0], center + window[1] + 1)
                         if 0 <= r < k_len[b]]
            for j in used:
                if b is None or j < 0:
                    continue
                rel = j - k_start[b]
                if not 0 <= rel < k_len[b]:
                    continue
                if causal:
                    shift = k_len[b] - q_len[b] if bottom_right else 0
                    if rel > token_pos[n] + shift:
                        continue
                if bounds is not None and not bounds[0][n] <= j < bounds[1][n]:
                    continue
                keys.add(j)
            per_head.append(keys)
        sets.append(per_head)
    return sets


def sparse_attention_ref(q, k, v, sets, token_sample, *, v_head_dim=None, softmax_scale=None, upcast=True,
                         sinks=None):
    """out ``[N, Hq, Dv]`` and lse ``[N, Hq]`` (float64 when upcast) for query rows ``q [N, Hq, D]``
    whose keys are ``k[token_sample[n]]`` (``k [B, Sk, Hkv, D]``; thd: B = 1), v likewise or None
    (V = the first ``v_head_dim`` columns of k). ``sets[n][h]``: visible key positions of token n for
    index head h (one head shared by every kv head, or one per kv head). A token with no visible
    key outputs zeros and lse -inf. ``sinks``: ``[Hq]``, or ``[N, Hq]`` per query row."""
    dtype = q.dtype
    work = torch.float64 if upcast else torch.float32
    hq, hkv = q.shape[1], k.shape[2]
    group = hq // hkv
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    outs, lses = [], []
    for n in range(q.shape[0]):
        b = token_sample[n]
        keys = k[b].to(work)  # [Sk, Hkv, D]
        values = keys[..., :v_head_dim] if v is None else v[b].to(work)
        mask = torch.zeros(hkv, keys.shape[0], dtype=torch.bool)
        for g in range(hkv):
            for j in sets[n][g if len(sets[n]) > 1 else 0]:
                mask[g, j] = True
        mask = mask.repeat_interleave(group, dim=0)  # [Hq, Sk]
        s = torch.einsum("hd,jhd->hj", q[n].to(work), keys.repeat_interleave(group, dim=1)) * scale
        s = s.masked_fill(~mask, float("-inf"))
        row_max = s.amax(-1, keepdim=True) if s.shape[-1] else s.new_full((hq, 1), float("-inf"))
        row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max)).detach()
        if sinks is not None:  # a virtual key of logit sinks[h] (or sinks[n, h]) and value zero
            sink = (sinks if sinks.dim() == 1 else sinks[n]).to(work)[:, None]
            row_max = torch.maximum(row_max, sink.detach())
        e = torch.exp(s - row_max)
        denom = e.sum(-1, keepdim=True)
        if sinks is not None:
            denom = denom + torch.exp(sink - row_max)
        p = e / torch.where(denom == 0, torch.ones_like(denom), denom)
        if not upcast:
            p = p.to(dtype).to(work)
        outs.append(torch.einsum("hj,jhd->hd", p, values.repeat_interleave(group, dim=1)))
        lses.append((row_max + torch.log(denom)).squeeze(-1))
    dv = v_head_dim if v is None else v.shape[-1]
    out = torch.stack(outs) if outs else q.new_zeros((0, hq, dv), dtype=work)
    lse = torch.stack(lses) if lses else q.new_zeros((0, hq), dtype=work)
    return (out if upcast else out.to(dtype)), lse
