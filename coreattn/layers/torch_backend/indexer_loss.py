"""The DSA indexer loss (Megatron-Core 0.19's ``compute_dsa_indexer_loss`` and its backward
``bwd_fused_indexer_loss_naive``) in torch ops, chunked over query tokens: never a [T, T] tensor.

Definitions, per query token n (sample b) and key position j of its sample. V(n) = {j : lo[n] <= j <
hi[n]} (the bounds; causality folded in); with the sparse loss ``E(n) = V(n) ∩ I(n)``, I(n) the set of
n's top-k indices (entries < 0 ignored, a repeated index counts once), else E(n) = V(n).

- Attention side (detached; query [.., np, Dq], key [.., Hkv, Dq], head h reads kv head h // (np / Hkv)):
  ``a[h, j] = scale * query[n, h] . key[j, kv(h)]`` (float32), ``P_h(j) = softmax_{j in E} a[h, j]``
  (0 off E), ``S(j) = sum_h P_h(j)`` (summed over the tensor-parallel ranks' heads too: an
  all-reduce of S), target ``t(j) = S(j) / max(sum_j S(j), 1e-10)``.
- Indexer side: ``z[j] = sum_h w[n, h] act(q[n, h] . k[j])`` (act ReLU or identity), ``log p(j) =
  z[j] - logsumexp_{j in E} z`` on E (0 off E).
- Row loss ``kl[n] = sum_{j in E} t(j) (log max(t(j), 1e-10) - log p(j))`` (Megatron clamps the log);
  a row with an empty E has t = 0 and kl = 0.
- Loss ``= coeff * sum_n m[n] kl[n] / max(sum_n m[n], 1)`` with m = ``query_valid_rows`` (all ones
  when not given, so the divisor is the row count B * S), or ``coeff * sum_n m[n] kl[n]`` with
  ``calculate_per_token_loss``.

Gradient (Megatron's backward, which uses the exact logit gradient of KL(t || softmax z) for a
normalized target): ``dL/dz[n, j] = g * c[n] * (p(j) - t(j))`` on E (0 off E), with ``c[n] = coeff *
m[n] / max(sum m, 1)`` (``coeff * m[n]`` per token) and g the loss's incoming gradient; then through
``z = sum_h w act(x)``, ``x[h, j] = q[n, h] . k[j]``:
``dw[n, h] = sum_j G[j] act(x[h, j])``, ``dx[h, j] = G[j] w[n, h] act'(x[h, j])`` (ReLU: x > 0),
``dq[n, h] = sum_j dx[h, j] k[j]``, ``dk[j] += sum_{n, h} dx[h, j] q[n, h]``.

Blockwise: every quantity above is a function of one query row and its own keys, so the rows are
cut into chunks of C tokens (C from a byte budget, coreattn/layers/torch_backend/indexer_topk.py) and
each chunk computes its [C, heads, keys] scores, the row softmaxes (each row's log-sum-exps over all
its keys at once, as a two-pass online softmax over key blocks would), t, kl and G, and adds its
part of dk: memory O(C * heads * keys) per chunk plus O(T) results. Dense loss: keys = the chunk's key
range; sparse loss: the chunk's [C, K] selected keys are gathered (the attention keys [C, K, Dq]
too), so its cost is O(T * K), not O(T^2). Since g only scales the gradient, the chunks compute the
gradients for g = 1 in the forward (when asked) and the backward multiplies by g: one pass over the
attention scores instead of Megatron's two (forward and recomputing backward). dk is accumulated
chunk by chunk in a fixed order (dense: a slice add; sparse: ``index_put_(accumulate=True)``,
deterministic on CPU and CUDA): deterministic.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from coreattn.layers.torch_backend.indexer_topk import (chunks, index_scores, sample_dims, score_dtype, select, side_rows,
                                                        visible)

EPS = 1e-10  # Megatron's INDEXER_LOSS_EPS: target normalizer and log clamp, and the softmax normalizer's floor


class LossResult(NamedTuple):
    loss: torch.Tensor  # 0-dim, float32 (float64 for float64 inputs)
    kl_rows: torch.Tensor  # [N] kl[n] before the row mask and scaling
    topk_indices: torch.Tensor | None  # [N, K] (index_dtype) when the loss computed them
    dq: torch.Tensor | None  # gradients for an incoming gradient of 1, in the score dtype
    dk: torch.Tensor | None
    dw: torch.Tensor | None


def masked_softmax(logits: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim restricted to ``valid`` (0 elsewhere; a row without a valid entry
    is all 0): Megatron's masked_softmax (whose EPS floor on the normalizer never binds for a row
    with a valid entry, whose largest term is exp(0) = 1)."""
    return torch.softmax(logits.masked_fill(~valid, float("-inf")), -1).nan_to_num_(0.0)


def masked_log_softmax(logits: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """log softmax over the valid entries (0 elsewhere; rows without any give 0)."""
    masked = logits.masked_fill(~valid, torch.finfo(logits.dtype).min)
    masked = torch.where(valid.any(-1, keepdim=True), masked, torch.zeros_like(masked))
    return torch.log_softmax(masked, -1).masked_fill(~valid, 0.0)


def unique_in_bounds(idx: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """[C, K] bool: the entry is >= 0, inside the row's bounds and the first of its value in the row."""
    ok = (idx >= lo[:, None]) & (idx < hi[:, None]) & (idx >= 0)
    key = torch.where(ok, idx, torch.full_like(idx, -1))
    ordered, order = torch.sort(key, dim=1, stable=True)
    repeat = torch.zeros_like(ok)
    repeat[:, 1:] = (ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)
    first = torch.empty_like(ok)
    first.scatter_(1, order, ~repeat)
    return ok & first


def attention_target(query: torch.Tensor, key: torch.Tensor, valid: torch.Tensor, scale: float, dtype,
                     tp_group=None) -> torch.Tensor:
    """t [C, E]: query [C, np, Dq]; key [E, Hkv, Dq] (dense: shared by the rows) or [C, E, Hkv, Dq]
    (gathered per row); valid [C, E]. Float ``dtype``."""
    heads, kv_heads = query.shape[1], key.shape[-2]
    group = heads // kv_heads
    qg = query.to(dtype).unflatten(1, (kv_heads, group))  # [C, Hkv, G, Dq]
    if key.dim() == 3:
        a = torch.einsum("cvgd,evd->cvge", qg, key.to(dtype))  # [C, Hkv, G, E]
    else:
        a = torch.einsum("cvgd,cevd->cvge", qg, key.to(dtype))
    probs = masked_softmax(a.flatten(1, 2) * scale, valid[:, None, :])  # [C, np, E]
    summed = probs.sum(1)  # [C, E]
    if tp_group is not None and torch.distributed.get_world_size(tp_group) > 1:
        torch.distributed.all_reduce(summed, group=tp_group)  # heads split over the tensor-parallel ranks
    return summed / summed.sum(-1, keepdim=True).clamp_min(EPS)


def loss_torch(q, k, weights, query, key, key_lo, key_hi, fmt: str, *, softmax_scale: float, loss_coeff: float,
               sparse: bool, topk_indices: torch.Tensor | None = None, topk: int | None = None, relu: bool = True,
               query_valid_rows: torch.Tensor | None = None, per_token: bool = False, tp_group=None,
               grads: bool = False, key_range=None, index_dtype: torch.dtype = torch.int64) -> LossResult:
    """The indexer loss of the module docstring on checked inputs.

    Index side q/k/weights and attention side query [.., np, Dq] / key [.., Hkv, Dq] in the layout
    ``fmt`` (as in coreattn/kernels/indexer_topk.py: thd, bshd or sbhd); key_lo/key_hi int32 [N];
    ``topk_indices`` int [N, K] (flat token rows n = b * S + s), or None with ``topk`` set: the
    chunks select them first (the torch top-k rule) and return them (``index_dtype``). ``query_valid_rows`` bool [N]
    or None. ``grads``: also return dq, dk, dw for an incoming gradient of 1.
    """
    heads = q.shape[-2]
    batch, seqlen_q, seqlen_k = sample_dims(q, k, fmt)
    n_rows = batch * seqlen_q
    dtype = score_dtype(q, k, weights)
    device = q.device
    kl_rows = torch.zeros(n_rows, dtype=dtype, device=device)
    rows_ok = (torch.ones(n_rows, dtype=torch.bool, device=device) if query_valid_rows is None
               else query_valid_rows.reshape(n_rows).to(device=device, dtype=torch.bool))
    count = rows_ok.sum().to(dtype).clamp_min(1.0)
    row_scale = loss_coeff * rows_ok.to(dtype) / (1.0 if per_token else count)  # [N]: dL/dkl[n]
    computed = None
    if topk_indices is None and topk is not None:
        computed = torch.full((n_rows, min(topk, seqlen_k)), -1, dtype=index_dtype, device=device)
    dq = torch.zeros(q.shape, dtype=dtype, device=device) if grads else None
    dk = torch.zeros(k.shape, dtype=dtype, device=device) if grads else None
    dw = torch.zeros(weights.shape, dtype=dtype, device=device) if grads else None

    elem = torch.finfo(dtype).bits // 8
    np_heads, kv_heads, dim_q = query.shape[-2], key.shape[-2], query.shape[-1]
    width = computed.shape[1] if computed is not None else (topk_indices.shape[-1] if sparse else 0)
    # per query row: dense, over the keys, the attention scores and their softmax [np] and the index
    # side's x, activation, products and gradient [H]; sparse, over its K gathered keys, the gathered
    # keys in their dtype and in float32 [Hkv * Dq + D], the attention [np] and index [H] temporaries;
    # a chunk that selects its top-k (fused) scores all keys for the index side first
    index_key = elem * (4 * heads + 4) + 16
    if not sparse:
        row_bytes = (elem * 3 * np_heads + index_key) * seqlen_k
    else:
        row_bytes = (2 * elem * (kv_heads * dim_q + k.shape[-1]) + elem * (3 * np_heads + 4 * heads) + 16) * width
        row_bytes += index_key * seqlen_k if computed is not None else 0
    for ch in chunks(key_lo, key_hi, batch, seqlen_q, seqlen_k, row_bytes, key_range):
        rows = slice(ch.b * seqlen_q + ch.s0, ch.b * seqlen_q + ch.s1)
        lo, hi = key_lo[rows].to(torch.int64), key_hi[rows].to(torch.int64)
        qc = side_rows(q, fmt, ch.b, ch.s0, ch.s1)  # [C, H, D]
        wc = side_rows(weights, fmt, ch.b, ch.s0, ch.s1).to(dtype)  # [C, H]
        query_c = side_rows(query, fmt, ch.b, ch.s0, ch.s1)  # [C, np, Dq]
        if sparse and computed is None:
            idx = topk_indices[rows].to(torch.int64)  # [C, K]
        else:
            kc = side_rows(k, fmt, ch.b, ch.k0, ch.k1)  # [J, D]
            z, x = index_scores(qc, kc, wc, relu, dtype)  # [C, J], [C, H, J]
            valid = visible(ch, lo, hi)
            if computed is not None:
                idx, _ = select(z, valid, ch.k0, computed.shape[1])
                computed[rows] = idx
        if sparse:
            # [C, K]; the chunk's own selection is unique and inside the bounds already
            valid = unique_in_bounds(idx, lo, hi) if computed is None else idx >= 0
            safe = torch.where(valid, idx, torch.zeros_like(idx)).clamp(0, max(seqlen_k - 1, 0))
            k_sel = side_rows(k, fmt, ch.b, 0, seqlen_k)[safe]  # [C, K, D]
            x = torch.einsum("chd,ckd->chk", qc.to(dtype), k_sel.to(dtype))  # [C, H, K]
            z = ((x.clamp_min(0) if relu else x) * wc[:, :, None]).sum(1)
            key_sel = side_rows(key, fmt, ch.b, 0, seqlen_k)[safe]  # [C, K, Hkv, Dq]
            target = attention_target(query_c, key_sel, valid, softmax_scale, dtype, tp_group)
        else:
            key_c = side_rows(key, fmt, ch.b, ch.k0, ch.k1)  # [J, Hkv, Dq]
            target = attention_target(query_c, key_c, valid, softmax_scale, dtype, tp_group)
        log_p = masked_log_softmax(z, valid)
        terms = target * (torch.log(target.clamp_min(1e-10)) - log_p)
        kl_rows[rows] = terms.masked_fill(~valid, 0.0).sum(-1)
        if not grads:
            continue
        g = ((masked_softmax(z, valid) - target) * row_scale[rows, None]).masked_fill(~valid, 0.0)  # dL/dz
        act = x.clamp_min(0) if relu else x
        side_rows(dw, fmt, ch.b, ch.s0, ch.s1).copy_(torch.einsum("ce,che->ch", g, act))
        dx = g[:, None, :] * wc[:, :, None]  # [C, H, E]
        if relu:
            dx = dx * (x > 0)
        if sparse:
            side_rows(dq, fmt, ch.b, ch.s0, ch.s1).copy_(torch.einsum("che,ced->chd", dx, k_sel.to(dtype)))
            part = torch.einsum("che,chd->ced", dx, qc.to(dtype))  # [C, K, D], 0 on invalid entries
            side_rows(dk, fmt, ch.b, 0, seqlen_k).index_put_((safe.flatten(),), part.flatten(0, 1), accumulate=True)
        else:
            side_rows(dq, fmt, ch.b, ch.s0, ch.s1).copy_(torch.matmul(dx, kc.to(dtype)))
            side_rows(dk, fmt, ch.b, ch.k0, ch.k1).add_(torch.einsum("chj,chd->jd", dx, qc.to(dtype)))
    kl = kl_rows * rows_ok.to(dtype)
    loss = kl.sum() * loss_coeff if per_token else kl.sum() / count * loss_coeff
    return LossResult(loss, kl_rows, computed, dq, dk, dw)
