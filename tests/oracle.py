"""Independent references for the attention tests: a plain per-sequence loop.

``attention_ref(..., upcast=True)`` is the float64 oracle. ``upcast=False`` is the naive
same-dtype baseline of the flash-attention criterion: scores and softmax in fp32 from the
input-dtype values, P rounded to the input dtype before P @ V, output rounded.
Both are differentiable so gradients can be compared the same way.

Optional features, written from their definitions: a softmax offset (sink) adds ``exp(offset[h])``
(or ``exp(offset[i, h])``, one per row) to each row's denominator (a virtual key with a zero value; lse includes it); dropout multiplies
the normalized probabilities by ``keep / (1 - p)``, where ``keep_fn(head, query id, key id)``
materializes the keep mask (broadcast [H, 1, 1], [1, Lq, 1], [1, 1, Lk]) on the tokens' ids.
"""

from __future__ import annotations

import math

import torch


def visible(i: int, j: int, len_q: int, len_k: int, causal: bool, window: tuple[int, int], bottom_right: bool) -> bool:
    shift = len_k - len_q if bottom_right else 0
    left, right = window
    if causal:
        right = 0
    if left >= 0 and j < i + shift - left:
        return False
    if right >= 0 and j > i + shift + right:
        return False
    return True


def _mask(len_q, len_k, causal, window, bottom_right, device):
    # built with Python loops on purpose: independent of the vectorized code under test
    rows = [[visible(i, j, len_q, len_k, causal, window, bottom_right) for j in range(len_k)] for i in range(len_q)]
    return torch.tensor(rows, dtype=torch.bool, device=device).reshape(len_q, len_k)


def _one_sequence(qs, ks, vs, m, scale, dtype, upcast, offset=None, keep=None, dropout_p=0.0, bias=None):
    """Attention of one sequence in the work dtype: qs [Lq, H, Dqk], ks/vs [Lk, H, D] (heads
    already repeated), m [Lq, Lk] (or [H, Lq, Lk]) visibility, offset [H] sink logits, keep
    [H, Lq, Lk] dropout keep mask. Returns out [Lq, H, Dv] and lse [H, Lq]."""
    s = torch.einsum("ihd,jhd->hij", qs, ks) * scale
    if bias is not None:  # [H, Lq, Lk] additive bias
        s = s + bias.to(s.dtype)
    s = s.masked_fill(~m, float("-inf"))  # [H, Lq, Lk]
    row_max = s.amax(-1, keepdim=True) if ks.shape[0] > 0 else s.new_full(s.shape[:-1] + (1,), float("-inf"))
    if offset is not None:  # [H] per head, or [H, Lq] per row
        sink = offset.to(s.dtype)[:, None, None] if offset.dim() == 1 else offset.to(s.dtype)[:, :, None]
        row_max = torch.maximum(row_max, sink)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max)).detach()
    e = torch.exp(s - row_max)
    denom = e.sum(-1, keepdim=True)
    if offset is not None:
        denom = denom + torch.exp(sink - row_max)
    p = e / torch.where(denom == 0, torch.ones_like(denom), denom)
    if keep is not None:
        p = p * keep.to(p.dtype) / (1.0 - dropout_p)
    if not upcast:
        p = p.to(dtype).to(s.dtype)
    return torch.einsum("hij,jhd->ihd", p, vs), (row_max + torch.log(denom)).squeeze(-1)


def attention_ref(q, k, v, cu_q, cu_k, *, causal=False, window=(-1, -1), bottom_right=True,
                  softmax_scale=None, upcast=True, softmax_offset=None, dropout_p=0.0, keep_fn=None,
                  q_ids=None, k_ids=None, bias_fn=None):
    """Returns out [Tq, Hq, Dv] and lse [Hq, Tq] (float64 when upcast, else out in q.dtype).
    ``softmax_offset`` [Hq] or per token [Tq, Hq] sink logits (may require grad); dropout with ``keep_fn`` on the token
    ids ``q_ids`` [Tq] / ``k_ids`` [Tk] (default: the rows of q and k). ``bias_fn(b, q_start, len_q, len_k)``:
    sequence b's additive bias [Hq, Lq, Lk] (b's queries are rows q_start .. q_start + len_q - 1)."""
    dtype = q.dtype
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    work = torch.float64 if upcast else torch.float32
    group = q.shape[1] // k.shape[1]
    outs, lses = [], []
    cu_q, cu_k = cu_q.tolist(), cu_k.tolist()
    offset = None if softmax_offset is None else softmax_offset.to(work)
    q_ids = torch.arange(q.shape[0]) if q_ids is None else q_ids
    k_ids = torch.arange(k.shape[0]) if k_ids is None else k_ids
    for b in range(len(cu_q) - 1):
        qs = q[cu_q[b]:cu_q[b + 1]].to(work)
        ks = k[cu_k[b]:cu_k[b + 1]].to(work).repeat_interleave(group, dim=1)
        vs = v[cu_k[b]:cu_k[b + 1]].to(work).repeat_interleave(group, dim=1)
        m = _mask(qs.shape[0], ks.shape[0], causal, window, bottom_right, q.device)
        keep = None
        if dropout_p > 0:
            keep = keep_fn(torch.arange(q.shape[1])[:, None, None], q_ids[cu_q[b]:cu_q[b + 1]][None, :, None],
                           k_ids[cu_k[b]:cu_k[b + 1]][None, None, :])
        off = offset if offset is None or offset.dim() == 1 else offset[cu_q[b]:cu_q[b + 1]].t()
        bias = None if bias_fn is None else bias_fn(b, cu_q[b], qs.shape[0], ks.shape[0])
        out, lse = _one_sequence(qs, ks, vs, m, scale, dtype, upcast, off, keep, dropout_p, bias)
        outs.append(out)
        lses.append(lse)
    out = torch.cat(outs) if outs else q.new_zeros((0, q.shape[1], v.shape[-1]), dtype=work)
    lse = torch.cat(lses, dim=1)
    if not upcast:
        out = out.to(dtype)
    return out, lse


def padded_attention_ref(q, k, v, q_keep, k_keep, *, causal=False, window=(-1, -1), bottom_right=True,
                         upcast=True, softmax_offset=None, dropout_p=0.0, keep_fn=None, bias_fn=None):
    """Padded bshd batch with [B, S] keep masks, positions counted from 0 in each row.

    A dropped query row, or one that sees no kept key, outputs zeros (with a sink: zeros too, the
    sink's value being zero). Dropout token ids are ``b * S + position``. ``bias_fn(b, 0, Sq, Sk)``:
    sample b's additive bias [Hq, Sq, Sk]. Returns out [B, Sq, Hq, Dv]."""
    dtype = q.dtype
    work = torch.float64 if upcast else torch.float32
    scale = 1.0 / math.sqrt(q.shape[-1])
    group = q.shape[2] // k.shape[2]
    sq, sk = q.shape[1], k.shape[1]
    band = _mask(sq, sk, causal, window, bottom_right, q.device)
    outs = []
    for b in range(q.shape[0]):
        qs = q[b].to(work)
        ks = k[b].to(work).repeat_interleave(group, dim=1)
        vs = v[b].to(work).repeat_interleave(group, dim=1)
        m = band & (q_keep[b] != 0)[:, None] & (k_keep[b] != 0)[None, :]
        keep = None
        if dropout_p > 0:
            keep = keep_fn(torch.arange(q.shape[2])[:, None, None], (b * sq + torch.arange(sq))[None, :, None],
                           (b * sk + torch.arange(sk))[None, None, :])
        offset = None if softmax_offset is None else softmax_offset.to(work)
        if offset is not None and offset.dim() == 3:  # [B, H, S]: per row
            offset = offset[b]
        bias = None if bias_fn is None else bias_fn(b, 0, sq, sk)
        out = _one_sequence(qs, ks, vs, m, scale, dtype, upcast, offset, keep, dropout_p, bias)[0]
        outs.append(out * (q_keep[b] != 0).to(work)[:, None, None])  # a dropped query row outputs zeros
    out = torch.stack(outs)
    return out if upcast else out.to(dtype)


def max_logit_ref(q, k, cu_q, cu_k, *, causal=False, window=(-1, -1), bottom_right=True, softmax_scale=None):
    """float64 [Hq]: per q head, the max over visible (query, key) pairs of every sequence of the
    scaled logit; -inf for a head without a visible pair."""
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    group = q.shape[1] // k.shape[1]
    best = torch.full((q.shape[1],), float("-inf"), dtype=torch.float64)
    cu_q, cu_k = cu_q.tolist(), cu_k.tolist()
    for b in range(len(cu_q) - 1):
        qs = q[cu_q[b]:cu_q[b + 1]].double()
        ks = k[cu_k[b]:cu_k[b + 1]].double().repeat_interleave(group, dim=1)
        m = _mask(qs.shape[0], ks.shape[0], causal, window, bottom_right, q.device)
        s = (torch.einsum("ihd,jhd->hij", qs, ks) * scale).masked_fill(~m, float("-inf"))
        if s.numel():
            best = torch.maximum(best, s.flatten(1).amax(1).cpu())
    return best
