"""Independent references for the DSA indexer tests, written from the definitions (Megatron-Core 0.19's
``_compute_index_scores``, ``fused_qk_topk_naive``, ``compute_dsa_indexer_loss``) with per-sample,
per-row loops, not from coreattn's code.

Tensors are taken in bshd form (q [B, S, H, D], k [B, Sk, D], w [B, S, H], query [B, S, np, Dq], key
[B, Sk, Hkv, Dq]; thd is B = 1) and bounds as [B, S] (lo, hi) lists. ``dtype`` float64 is the oracle;
float32 is the naive same-precision baseline of the flash criterion.
"""

from __future__ import annotations

import torch


def causal_bounds(batch: int, seqlen: int, cu_seqlens=None, causal: bool = True):
    """[B, S] lo and hi of self-attention: thd (B = 1) from cu_seqlens, else positions 0..s."""
    lo = [[0] * seqlen for _ in range(batch)]
    hi = [[(s + 1 if causal else seqlen) for s in range(seqlen)] for _ in range(batch)]
    if cu_seqlens is not None:
        cu = [int(c) for c in cu_seqlens]
        for s in range(seqlen):
            seq = next((i for i in range(len(cu) - 1) if cu[i] <= s < cu[i + 1]), len(cu) - 1)
            start = cu[seq] if seq < len(cu) - 1 else cu[-1]
            end = cu[seq + 1] if seq < len(cu) - 1 else cu[-1]
            lo[0][s] = start
            hi[0][s] = s + 1 if causal else end
    return lo, hi


def index_scores(q, k, w, relu: bool, dtype=torch.float64):
    """[B, S, Sk] scores sum_h w act(q_h . k) (no masking)."""
    x = torch.einsum("bshd,btd->bsht", q.to(dtype), k.to(dtype))
    if relu:
        x = x.clamp_min(0)
    return (x * w.to(dtype)[..., None]).sum(2)


def topk_ref(scores, lo, hi, topk: int):
    """[B, S, K] indices, K = min(topk, Sk): per row the keys in [lo, hi) with a score above -inf,
    by score descending then position ascending; -1 after."""
    scores = scores.detach()
    batch, seqlen, seqlen_k = scores.shape
    width = min(topk, seqlen_k)
    out = torch.full((batch, seqlen, width), -1, dtype=torch.int64)
    for b in range(batch):
        for s in range(seqlen):
            cand = [(-float(scores[b, s, j]), j) for j in range(lo[b][s], hi[b][s])
                    if float(scores[b, s, j]) > float("-inf")]
            for i, (_, j) in enumerate(sorted(cand)[:width]):
                out[b, s, i] = j
    return out


def _row_sets(lo, hi, topk_indices, sparse: bool, b: int, s: int) -> list[int]:
    keys = list(range(lo[b][s], hi[b][s]))
    if sparse:
        chosen = {int(j) for j in topk_indices[b, s].tolist() if j >= 0}
        keys = [j for j in keys if j in chosen]
    return keys


def loss_ref(q, k, w, query, key, lo, hi, softmax_scale: float, loss_coeff: float, *, sparse: bool,
             topk_indices=None, relu: bool = True, query_valid_rows=None, per_token: bool = False,
             dtype=torch.float64, clamp: float | None = None):
    """The indexer loss (differentiable in q, k, w through autograd): per row the KL of the target
    (head-summed attention softmax, normalized) against the softmax of the index scores over the
    row's keys (sparse: ∩ its top-k), Megatron's log clamp at 1e-10, averaged over the valid rows.
    ``clamp``: torch_npu's loss kernel's definition instead, both distributions clamped at it in
    every factor, sum max(t, c) (log max(t, c) - log max(p, c))."""
    batch, seqlen = q.shape[:2]
    heads, kv_heads = query.shape[2], key.shape[2]
    rows_ok = torch.ones(batch, seqlen, dtype=torch.bool) if query_valid_rows is None else query_valid_rows
    total = q.new_zeros((), dtype=dtype)
    for b in range(batch):
        for s in range(seqlen):
            keys = _row_sets(lo, hi, topk_indices, sparse, b, s)
            if not keys or not bool(rows_ok[b, s]):
                continue
            sel = torch.tensor(keys)
            target = torch.zeros(len(keys), dtype=dtype)
            for h in range(heads):
                kv = h // (heads // kv_heads)
                a = (key[b, sel, kv].to(dtype) @ query[b, s, h].to(dtype)) * softmax_scale
                target = target + torch.softmax(a, 0)
            target = (target / target.sum()).detach()
            x = k[b, sel].to(dtype) @ q[b, s].to(dtype).t()  # [E, H]
            z = ((x.clamp_min(0) if relu else x) * w[b, s].to(dtype)).sum(1)
            log_p = torch.log_softmax(z, 0)
            if clamp is not None:
                t = target.clamp_min(clamp)
                total = total + (t * (torch.log(t) - torch.log(log_p.exp().clamp_min(clamp)))).sum()
                continue
            total = total + (target * (torch.log(target.clamp_min(1e-10)) - log_p)).sum()
    count = 1.0 if per_token else max(int(rows_ok.sum()), 1)
    return total / count * loss_coeff
