"""The DSA lightning indexer's top-k and sparse loss on torch_npu's operators: the npu_fused mappings.

- ``indexer_topk_npu``: ``npu_lightning_indexer`` (BSND; thd as one sample) with
  ``sparse_mode`` 3 (its bottom-right causal mask) or 0 (none). It scores ReLU-activated heads, up
  to 64 heads of 128 against one key of 128, float16/bfloat16 q, k and weights of one dtype,
  ``sparse_count`` 1 to 2,048 or a multiple of 1,024 up to 8,192, so a call fits when those hold and
  its keys are what one of the two modes gives per sample (no ``key_bounds``, no packed
  ``cu_seqlens``: coreattn does not pass the operator sequence lengths). What the operator does
  differently is converted: its rows are in score order and may name keys its mask hid (its
  reference sorts them in with score -inf), so an entry outside the token's bounds becomes -1, and
  each row is ordered as coreattn orders it (score descending, then position, -1 last) on the
  scores it returns (``return_value=True``; they come back in the query's dtype, so keys whose
  scores round to one value there are ordered by position). Which key wins an exact tie for the
  K-th place is the operator's (not documented).
- ``indexer_loss_npu``: ``npu_sparse_lightning_indexer_grad_kl_loss`` (the sparse loss and its
  q/k/weights gradients in one call) fed the attention's softmax statistics by an
  ``npu_sparse_flash_attention`` forward over the same index list (the pairing the operator
  documents; the attention side is absorbed MLA, as there). Its kernel reads ``min(K, S2 - S1 + s +
  1)`` slots of row s of each sample (its causal mode 3 counted from the sample's start) whatever
  they hold: a -1 or a key past that count inside them is neither gathered nor masked, and the
  slot's stale contents enter the loss and the gradients. So it is called only where every row
  holds exactly that many valid keys by construction (``loss_unfit``): the top-k coreattn selects
  in the same call (``indexer_topk_and_loss``) over causal keys of whole samples (bottom-right, or
  as many keys as queries), its width one of the operator's K (1,024, 2,048, 4,096, ...) or every
  key (top-k >= Sk: each row then names all its causal keys); given ``topk_indices``, packed
  ``cu_seqlens`` (one BSND sample counts a later sequence's rows from the sample's start) and a
  narrower top-k (padded to the operator's K: its rows past the top-k hold -1 inside the read
  slots) fall back, as do a row mask (``query_valid_rows``), tensor-parallel heads, identity
  scoring, the dense loss and sizes outside its table (32, 64 or 128 attention heads, 8 to 64 index
  heads, B <= 256, S1 <= 8K, S2 <= 128K). The rows are prepared as sparse attention's
  (coreattn/layers/npu_fused/sparse.py: ascending, -1 last) and padded with -1 to the operator's K.
  Its loss is the sum over rows of KL with both distributions clamped at 1e-8 (MindSpeed divides it
  by B * S; Megatron clamps only the target inside its log, at 1e-10: the logged values differ
  where the indexer gives a key that carries attention less than 1e-8, docs/ascend.md); coreattn
  scales loss and gradients by ``loss_coeff`` and 1 / rows (not per-token). Its gradients are
  Megatron's (softmax of the index scores minus the target).

Nothing here reads a device tensor on the host; the operators take no host lists in BSND. An
operator whose kernel turns out missing on the device raises ``NpuOpUnavailable`` from its first
call (coreattn.kernels.npu.run_npu_op), for the caller to fall back.
"""

from __future__ import annotations

import torch

from coreattn.kernels import npu
from coreattn.kernels.sparse_index import prepare_topk
from coreattn.layers.npu_fused.sparse import (SFA_DIM, SFA_DTYPES, SFA_ROPE_DIM, UNLIMITED, op_indices, sfa_forward,
                                              split_rope, to_bsnd)

INDEX_HEADS = tuple(range(1, 65))  # npu_lightning_indexer: N1 <= 64 on Atlas A2/A3 (the earlier page: 64 only)
INDEX_DIM = 128  # D of its query and key
MAX_SPARSE_COUNT = 8192  # sparse_count in [1, 2048], or a multiple of 1,024 up to 8,192
CAUSAL, FULL = 3, 0  # sparse_mode: rightDownCausal / defaultMask
INT32_MAX = 2**31 - 1
# npu_sparse_lightning_indexer_grad_kl_loss's table of supported sizes
LOSS_HEADS = (32, 64, 128)  # N1, the attention's query heads
LOSS_INDEX_HEADS = (8, 16, 32, 64)  # N1index
LOSS_TOPK = (1024, 2048, 4096, 5120, 6144, 7168, 8192)  # K (its "3081" is left out: 3072 or a typo, not known)
LOSS_MAX_BATCH, LOSS_MAX_SEQLEN_Q, LOSS_MAX_SEQLEN_K = 256, 8 * 1024, 128 * 1024


def mask_mode(fmt: str, seqlen_q: int, seqlen_k: int, causal: bool, bottom_right: bool, cu_seqlens: bool,
              key_bounds: bool) -> int | str:
    """``npu_lightning_indexer``'s ``sparse_mode`` giving exactly the keys coreattn's bounds give, or why none does."""
    if key_bounds:
        return "key_bounds: the operators mask per sample (causal or none), not per row"
    if cu_seqlens:
        return "packed sequences (cu_seqlens): the operators' index convention across TND sequences is not documented"
    if not causal:
        return FULL
    top_left = fmt == "thd" or not bottom_right  # thd's causal bounds are top-left (row + 1)
    if top_left and seqlen_q != seqlen_k:
        return (f"top-left causal over {seqlen_q} queries and {seqlen_k} keys: the operators' causal mode is "
                "aligned bottom-right")
    return CAUSAL


def _index_side_unfit(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, relu: bool, name: str,
                      heads: tuple[int, ...]) -> str | None:
    if not relu:
        return f"{name} scores ReLU-activated heads only (relu=True)"
    if q.dtype not in SFA_DTYPES or k.dtype != q.dtype or weights.dtype != q.dtype:
        return (f"{name} takes float16 or bfloat16 q, k and weights of one dtype, got {q.dtype}, {k.dtype}, "
                f"{weights.dtype}")
    if q.shape[-2] not in heads or q.shape[-1] != INDEX_DIM:
        allowed = f"1 to {heads[-1]}" if heads == INDEX_HEADS else " or ".join(map(str, heads))
        return f"{name} takes {allowed} index heads of {INDEX_DIM}, got {q.shape[-2]} of {q.shape[-1]}"
    return None


def sparse_count_fits(count: int) -> bool:
    """npu_lightning_indexer's sparse_count: 1 to 2,048, or a multiple of 1,024 up to 8,192."""
    return 1 <= count <= 2048 or (count <= MAX_SPARSE_COUNT and count % 1024 == 0)


def topk_unfit(q, k, weights, topk: int, relu: bool, return_scores: bool, mode: int | str) -> str | None:
    """None when ``npu_lightning_indexer`` can select this call's top-k, else the limit it breaks
    (``topk``: the width it selects, min(topk, Sk))."""
    if isinstance(mode, str):
        return f"npu_lightning_indexer: {mode}"
    unfit = _index_side_unfit(q, k, weights, relu, "npu_lightning_indexer", INDEX_HEADS)
    if unfit:
        return unfit
    if not sparse_count_fits(topk):
        return (f"npu_lightning_indexer selects 1 to 2048 keys or a multiple of 1024 up to {MAX_SPARSE_COUNT} "
                f"(sparse_count), got topk={topk}")
    if return_scores:
        return ("npu_lightning_indexer's sparse_values come back in the query's dtype, not as coreattn's float32 "
                "scores")
    return None


def _index_tensors(q, k, weights, fmt: str):
    """q ``[B, S, 64, 128]``, k ``[B, Sk, 1, 128]``, weights ``[B, S, 64]``: BSND, contiguous."""
    return (to_bsnd(q, fmt).contiguous(), to_bsnd(k, fmt).unsqueeze(-2).contiguous(),
            to_bsnd(weights, fmt).contiguous())


def indexer_topk_npu(q, k, weights, key_lo, key_hi, topk: int, fmt: str, mode: int,
                     index_dtype: torch.dtype) -> torch.Tensor:
    """``[N, K]`` indices (K = min(topk, Sk)) as ``topk_torch`` selects them, from ``npu_lightning_indexer``."""
    query, key, w = _index_tensors(q, k, weights, fmt)
    batch, seqlen_q, seqlen_k = query.shape[0], query.shape[1], key.shape[1]
    width = min(topk, seqlen_k)
    if batch * seqlen_q == 0 or width == 0:
        return torch.full((batch * seqlen_q, width), -1, dtype=index_dtype, device=q.device)
    idx, values = npu.run_npu_op(
        "npu_lightning_indexer", query.device, query, key, w, actual_seq_lengths_query=None,
        actual_seq_lengths_key=None, block_table=None, layout_query="BSND", layout_key="BSND", sparse_count=width,
        sparse_mode=mode, pre_tokens=UNLIMITED, next_tokens=UNLIMITED, return_value=True)
    idx = idx.reshape(batch * seqlen_q, width).to(torch.int64)
    values = values.reshape(batch * seqlen_q, width).to(torch.float32)
    kept = (idx >= key_lo.to(torch.int64)[:, None]) & (idx < key_hi.to(torch.int64)[:, None])
    # coreattn's order: kept entries by score descending, then position; -1 last (two stable sorts)
    by_pos = torch.sort(torch.where(kept, idx, INT32_MAX), dim=1, stable=True)
    score = torch.where(by_pos.values < INT32_MAX, values.gather(1, by_pos.indices), float("-inf"))
    order = torch.sort(score, dim=1, descending=True, stable=True).indices
    chosen = by_pos.values.gather(1, order)
    return torch.where(chosen < INT32_MAX, chosen, -1).to(index_dtype)


def loss_topk(width: int) -> int | None:
    """The operator's K for index rows of ``width`` entries (padded with -1), or None past its largest."""
    return next((k for k in LOSS_TOPK if k >= width), None)


def loss_unfit(q, k, weights, query, key, *, sparse: bool, relu: bool, query_valid_rows, tp_group, fmt: str,
               causal: bool, bottom_right: bool, key_bounds: bool, width: int, selected: bool = False,
               packed: bool = False) -> str | None:
    """None when ``npu_sparse_lightning_indexer_grad_kl_loss`` can compute this call's loss over index
    rows of ``width`` entries, else why not. Its kernel reads min(K, S2 - S1 + s + 1) slots of row s
    whatever they hold, so each row must hold exactly that many valid keys by construction: rows of
    the top-k coreattn ``selected`` in this call, over causal keys of whole samples (not ``packed``
    sequences), as many as the operator's K or every key (module docstring)."""
    name = "npu_sparse_lightning_indexer_grad_kl_loss"
    if not sparse:
        return ("the dense loss: npu_dense_lightning_indexer_grad_kl_loss takes per-head keys of 128 + 64 (N2 = N1) "
                "and the dense attention's softmax_max/softmax_sum, which no documented torch_npu attention "
                "operator returns in its layout")
    read = f"{name} reads min(K, S2 - S1 + s + 1) slots of every row s whatever they hold"
    if not selected:
        return (f"given topk_indices: {read}, which only rows coreattn's top-k selects in the same call fill by "
                "construction (indexer_topk_and_loss)")
    batch = 1 if fmt == "thd" else (q.shape[0] if fmt == "bshd" else q.shape[1])
    seqlen_q, seqlen_k = (q.shape[0], k.shape[0]) if fmt != "bshd" else (q.shape[1], k.shape[1])
    if key_bounds or not causal:
        return f"{name} documents its causal sparse_mode 3 only: causal keys without key_bounds"
    if packed:
        return (f"packed sequences (cu_seqlens): {read}, counted from the start of the one BSND sample, and a later "
                "sequence's rows hold fewer keys than their position there")
    if (fmt == "thd" or not bottom_right) and seqlen_k != seqlen_q:
        return (f"{name}'s causal mode is aligned bottom-right: top-left causal over {seqlen_q} queries and "
                f"{seqlen_k} keys")
    unfit = _index_side_unfit(q, k, weights, relu, name, LOSS_INDEX_HEADS)
    if unfit:
        return unfit
    if query_valid_rows is not None:
        return f"query_valid_rows: {name} sums every row's loss"
    if tp_group is not None and torch.distributed.get_world_size(tp_group) > 1:
        return f"tensor-parallel heads: {name} sums the target over its own heads only"
    if query.dtype != q.dtype or key.dtype != q.dtype:
        return f"{name} takes query and key in the index side's dtype {q.dtype}, got {query.dtype} / {key.dtype}"
    if query.shape[-1] != SFA_DIM + SFA_ROPE_DIM or key.shape[-2] != 1:
        return (f"{name} takes absorbed MLA's attention side (query/key {SFA_DIM} + {SFA_ROPE_DIM}, one key head), "
                f"got query {tuple(query.shape)}, key {tuple(key.shape)}")
    if query.shape[-2] not in LOSS_HEADS:
        return f"{name} takes {', '.join(map(str, LOSS_HEADS))} attention heads, got {query.shape[-2]}"
    k_op = loss_topk(width)
    if k_op is None:
        return f"{name} takes index rows of up to {LOSS_TOPK[-1]} entries (K), got {width}"
    if width != k_op and width < seqlen_k:
        return (f"top-k {width} below the operator's K {k_op}: {read}, and rows with more than {width} causal keys "
                f"hold -1 inside them")
    if batch > LOSS_MAX_BATCH or seqlen_q > LOSS_MAX_SEQLEN_Q or seqlen_k > LOSS_MAX_SEQLEN_K:
        return (f"{name} takes B <= {LOSS_MAX_BATCH}, S1 <= {LOSS_MAX_SEQLEN_Q}, S2 <= {LOSS_MAX_SEQLEN_K} (thd: one "
                f"sample of T), got B {batch}, S1 {seqlen_q}, S2 {seqlen_k}")
    return None


def indexer_loss_npu(q, k, weights, query, key, key_lo, key_hi, fmt: str, *, softmax_scale: float, loss_coeff: float,
                     topk_indices: torch.Tensor, per_token: bool, grads: bool):
    """(loss, dq, dk, dw) of the sparse loss over ``topk_indices [N, K]`` (flat token rows), as
    ``loss_torch`` returns them (gradients for an incoming gradient of 1, float32; None without ``grads``)."""
    query_index, key_index, w = _index_tensors(q, k, weights, fmt)
    batch, seqlen_q, seqlen_k = query_index.shape[0], query_index.shape[1], key_index.shape[1]
    width = topk_indices.shape[-1]
    if batch * seqlen_q == 0 or seqlen_k == 0 or width == 0:  # no row has a key: the loss and its gradients are 0
        zeros = [torch.zeros(t.shape, dtype=torch.float32, device=t.device) if grads else None for t in (q, k, weights)]
        return torch.zeros((), dtype=torch.float32, device=q.device), *zeros
    rows = torch.nn.functional.pad(topk_indices[:, None, :], (0, loss_topk(width) - width), value=-1)  # the op's K
    prepared = prepare_topk(rows, "thd")  # [N, 1, K]: ascending, repeats and negatives -1
    idx, has_key = op_indices(prepared, key_lo, key_hi, seqlen_k, batch)
    halves = split_rope(query, fmt) + split_rope(key, fmt)  # query, query_rope, key, key_rope
    _, smax, ssum = sfa_forward(*halves, idx, softmax_scale)
    dq, dk, dw, loss = npu.run_npu_op(
        "npu_sparse_lightning_indexer_grad_kl_loss", q.device, halves[0], halves[2], query_index, key_index, w, idx,
        smax, ssum, softmax_scale, query_rope=halves[1], key_rope=halves[3], actual_seq_qlen=None,
        actual_seq_klen=None, layout="BSND", sparse_mode=CAUSAL, pre_tokens=UNLIMITED, next_tokens=UNLIMITED)
    scale = float(loss_coeff) / (1.0 if per_token else max(batch * seqlen_q, 1))
    loss = loss.reshape(()).to(torch.float32) * scale
    if not grads:
        return loss, None, None, None
    rows = has_key.view(batch, seqlen_q, 1)
    dq = torch.where(rows[..., None], dq.float() * scale, 0.0)  # [B, S, 64, 128]
    dw = torch.where(rows, dw.float() * scale, 0.0)  # [B, S, 64]
    dk = dk.float().squeeze(-2) * scale  # [B, Sk, 128]
    if fmt == "thd":
        return loss, dq[0], dk[0], dw[0]
    if fmt == "sbhd":
        return loss, dq.transpose(0, 1), dk.transpose(0, 1), dw.transpose(0, 1)
    return loss, dq, dk, dw

