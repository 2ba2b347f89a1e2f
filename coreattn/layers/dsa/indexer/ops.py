"""The DSA lightning indexer's public ops: top-k selection, the indexer loss, the Hadamard rotation.

Layouts (``layout``): "thd" — q [T, H, D], k [T, D], weights [T, H], one packed stream whose
sequences ``cu_seqlens`` (int32 [B+1]) delimits; "bshd" — q [B, S, H, D], k [B, Sk, D], weights
[B, S, H]; "sbhd" — q [S, B, H, D], k [Sk, B, D], weights [S, B, H] (Megatron's indexer tensors; its thd
path hands sbhd with B = 1 and explicit bounds). Results per query token have its token dims first:
thd [T, ...], bshd [B, S, ...], sbhd [S, B, ...] (a transposed view of a [B, S, ...] buffer, so
``.transpose(0, 1)`` is Megatron's contiguous [b, s, ...]).

Keys each query sees: positions ``key_lo <= j < key_hi`` of its sample (thd: rows of the stream),
given as ``key_bounds=(lo, hi)`` (Megatron's varlen_starts/ends) or derived (coreattn/layers/dsa/indexer/
checks.py ``key_bounds``: causal by default, from cu_seqlens or the padded length).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from coreattn.kernels import npu
from coreattn.layers.backends import NPU_LOSS_OPS, NPU_TOPK_OPS, Backend
from coreattn.layers.dsa.indexer import checks
from coreattn.layers.dsa.indexer.function import HadamardFunction, IndexerLossFunction, indexer_backend, loss_npu
from coreattn.layers.npu_fused.indexer import indexer_topk_npu, loss_unfit, mask_mode, topk_unfit
from coreattn.layers.torch_backend.indexer_blocks import block_topk_torch
from coreattn.layers.torch_backend.indexer_loss import loss_torch
from coreattn.layers.torch_backend.indexer_topk import topk_torch


class IndexerTopk(NamedTuple):
    indices: torch.Tensor  # index_dtype [*tokens, K], K = min(topk, Sk): score descending, then position; -1 unused
    # (block mode: [*tokens, H, K] block ids, K = min(topk, blocks))
    scores: torch.Tensor | None  # float32 [*tokens, K] (float64 for float64 inputs on torch), -inf unused


def _topk(tokens, q, k, weights, lo, hi, key_range, topk, relu, return_scores, backend: Backend, index_dtype,
          mode=None):
    if backend is Backend.NPU_FUSED:
        return indexer_topk_npu(q, k, weights, lo, hi, topk, tokens.layout, mode, index_dtype), None
    if backend is Backend.TRITON and q.dtype != torch.float64:
        from coreattn.kernels.indexer_topk import indexer_topk_fwd

        return indexer_topk_fwd(q, k, weights, lo, hi, topk, tokens.layout, relu=relu, return_scores=return_scores,
                                index_dtype=index_dtype)
    return topk_torch(q, k, weights, lo, hi, topk, tokens.layout, relu=relu, return_scores=return_scores,
                      key_range=key_range, index_dtype=index_dtype)


def _mask_mode(tokens, cu_seqlens, causal, causal_alignment, key_bounds):
    """npu_lightning_indexer's sparse_mode for these keys, or why it has none (npu_fused/indexer.py)."""
    return mask_mode(tokens.layout, tokens.seqlen_q, tokens.seqlen_k, causal, causal_alignment == "bottom_right",
                     cu_seqlens is not None, key_bounds is not None)


def _topk_backend(tokens, q, k, weights, topk, relu, return_scores, mode, backend) -> Backend:
    width = min(topk, tokens.seqlen_k)
    return indexer_backend(q.device, backend, what="indexer top-k", ops=NPU_TOPK_OPS,
                           unfit=lambda: topk_unfit(q, k, weights, width, relu, return_scores, mode))


def _select(tokens, q, k, weights, lo, hi, key_range, topk, relu, return_scores, chosen: Backend, index_dtype, mode,
            backend):
    """``_topk`` on ``chosen``; where torch_npu's indexer turns out to have no kernel on this device
    (its first call says so, remembered), on the backend chosen again (unless the caller named npu_fused)."""
    try:
        return _topk(tokens, q, k, weights, lo, hi, key_range, topk, relu, return_scores, chosen, index_dtype, mode)
    except npu.NpuOpUnavailable:
        again = _topk_backend(tokens, q, k, weights, topk, relu, return_scores, mode, backend)
        if again is Backend.NPU_FUSED:
            raise
        return _topk(tokens, q, k, weights, lo, hi, key_range, topk, relu, return_scores, again, index_dtype, mode)


def indexer_topk(q, k, weights, topk: int, *, layout: str = "thd", cu_seqlens=None, causal: bool = True,
                 causal_alignment: str = "bottom_right", key_bounds=None, relu: bool = True,
                 return_scores: bool = False, max_seqlen=None, backend=None,
                 index_dtype: torch.dtype = torch.int64, block_size: int | None = None,
                 local_blocks: int = 1) -> IndexerTopk:
    """The ``topk`` keys of largest index score for every query token, without a [T, T] tensor.

    ``score[n, j] = sum_h weights[n, h] * act(q[n, h] . k[j])`` in float32 (act: ReLU with
    ``relu``, else identity: Megatron's ``dsa_indexer_scoring_relu``), over the keys the query sees.
    Selection: the largest scores, **the lower key position first among equal scores**; keys scoring
    -inf are never selected; a row with fewer selectable keys than K gets -1 in the rest (Megatron's
    convention); K = min(topk, Sk) as Megatron's ``torch.topk`` width. Rows are in that order.
    Deterministic; both backends apply the same rule to their float32 scores (which may differ in
    the last bits: the head sums run in another order). float64 inputs (torch backend) rank float64
    scores with the same tie rule. Not differentiable (indices).

    Returns ``IndexerTopk(indices, scores)``: indices [*tokens, K] (thd [T, K]; bshd [B, S, K]; sbhd
    [S, B, K]) of ``index_dtype`` (int64, Megatron's, or int32: half the memory, what coreattn's
    sparse attention keeps), scores (with ``return_scores``) their float32 scores, -inf unused.

    ``max_seqlen`` (thd, optional host int): at least every row's key span, the tail past
    ``cu_seqlens[-1]`` included; the torch backend on a GPU then scores each chunk of rows against
    the keys within that span only (it reads no bounds there: no sync), not the whole stream.

    **Block mode** (``block_size`` B, ``weights`` None: MiniMax-M3's indexer): the keys are cut into
    blocks of B (block c: positions ``origin + c * B ..``, ``origin`` the row's first visible key in thd,
    its sequence's start; 0 in the padded layouts) and every head h selects on its own: block c scores
    ``max act(q[n, h] . k[j])`` over the block's visible keys (no weights, no head sum; act as above:
    ``relu=False`` is MiniMax-M3's raw q . k), -inf without one; the ``local_blocks`` blocks ending at the
    row's last visible key's block (at least block 0) score +inf, always kept. Indices are block ids
    ``[*tokens, H, K]``, K = min(topk, cdiv(Sk, B)), ordered by the same rule (the lower block first among
    equal scores), -1 unused: the rows ``sparse_*_attn(..., block_size=B)`` takes with H = its Hkv.
    Memory: ``[*tokens, H, K]`` and one chunk of scores, never ``[T, T]``. The Triton kernel
    (coreattn/kernels/indexer_blocks.py) computes the block scores; the selection is torch's top-k on
    them (T / B blocks per row).
    """
    if block_size is not None:
        return _block_topk(q, k, weights, topk, layout, cu_seqlens, causal, causal_alignment, key_bounds, relu,
                           return_scores, max_seqlen, backend, index_dtype, block_size, local_blocks)
    tokens, q, k, weights = checks.check_index_side(q, k, weights, layout)
    topk = checks.check_topk(topk)
    index_dtype = checks.check_index_dtype(index_dtype)
    lo, hi, key_range = checks.key_bounds(tokens, q.device, cu_seqlens=cu_seqlens, causal=causal,
                                          causal_alignment=causal_alignment, bounds=key_bounds,
                                          max_seqlen=checks.check_span(max_seqlen, tokens))
    mode = _mask_mode(tokens, cu_seqlens, causal, causal_alignment, key_bounds)
    chosen = _topk_backend(tokens, q, k, weights, topk, relu, return_scores, mode, backend)
    with torch.no_grad():
        idx, scores = _select(tokens, q, k, weights, lo, hi, key_range, topk, relu, return_scores, chosen, index_dtype,
                              mode, backend)
    return IndexerTopk(tokens.unflat(idx), None if scores is None else tokens.unflat(scores))


def _block_topk(q, k, weights, topk, layout, cu_seqlens, causal, causal_alignment, key_bounds, relu, return_scores,
                max_seqlen, backend, index_dtype, block_size, local_blocks) -> IndexerTopk:
    """indexer_topk's block mode (see its docstring)."""
    if weights is not None:
        raise ValueError("weights must be None with block_size: each head selects its own blocks (no head sum)")
    block_size = checks.check_topk(block_size, "block_size")
    local_blocks = checks.check_count(local_blocks, "local_blocks")
    stand_in = q.new_zeros(()).expand(q.shape[:-1]) if isinstance(q, torch.Tensor) else None  # no weights to check
    tokens, q, k, _ = checks.check_index_side(q, k, stand_in, layout)
    topk = checks.check_topk(topk)
    index_dtype = checks.check_index_dtype(index_dtype)
    lo, hi, key_range = checks.key_bounds(tokens, q.device, cu_seqlens=cu_seqlens, causal=causal,
                                          causal_alignment=causal_alignment, bounds=key_bounds,
                                          max_seqlen=checks.check_span(max_seqlen, tokens))
    chosen = indexer_backend(q.device, backend, what="indexer block top-k", ops=NPU_TOPK_OPS,
                             unfit=lambda: "npu_lightning_indexer has no block-max scoring (block_size)")
    options = dict(block_size=block_size, local_blocks=local_blocks, relu=relu, return_scores=return_scores,
                   index_dtype=index_dtype)
    scorer = None
    if chosen is Backend.TRITON and q.dtype != torch.float64:  # the kernel scores, torch selects
        from coreattn.kernels.indexer_blocks import indexer_block_scores

        def scorer(row0, row1, n_blocks):
            return indexer_block_scores(q, k, lo, hi, tokens.layout, row0, row1, block_size=block_size,
                                        n_blocks=n_blocks, relu=relu)
    with torch.no_grad():
        idx, scores = block_topk_torch(q, k, lo, hi, topk, tokens.layout, key_range=key_range, scorer=scorer,
                                       **options)
    return IndexerTopk(tokens.unflat(idx), None if scores is None else tokens.unflat(scores))


def _loss(q, k, weights, query, key, softmax_scale, loss_coeff, topk_indices, topk, *, sparse, layout, cu_seqlens,
          causal, causal_alignment, key_bounds, relu, query_valid_rows, calculate_per_token_loss, tp_group, max_seqlen,
          backend, index_dtype=torch.int64):
    tokens, q, k, weights = checks.check_index_side(q, k, weights, layout)
    index_dtype = checks.check_index_dtype(index_dtype)
    query, key = checks.check_attention_side(query, key, tokens, q.device)
    lo, hi, key_range = checks.key_bounds(tokens, q.device, cu_seqlens=cu_seqlens, causal=causal,
                                          causal_alignment=causal_alignment, bounds=key_bounds,
                                          max_seqlen=checks.check_span(max_seqlen, tokens))
    rows = checks.check_query_valid_rows(query_valid_rows, tokens, q.device)
    given = isinstance(topk_indices, torch.Tensor) and topk_indices.dim() > 0
    width = min(topk, tokens.seqlen_k) if topk is not None else (topk_indices.shape[-1] if given else 0)
    selects = topk is not None  # the rows are coreattn's top-k of this call (loss_unfit)

    def choose_loss():
        return indexer_backend(
            q.device, backend, what="indexer loss", ops=NPU_LOSS_OPS,
            unfit=lambda: loss_unfit(q, k, weights, query, key, sparse=sparse, relu=relu, query_valid_rows=rows,
                                     tp_group=tp_group, fmt=layout, causal=causal,
                                     bottom_right=causal_alignment == "bottom_right",
                                     key_bounds=key_bounds is not None, width=width, selected=selects,
                                     packed=cu_seqlens is not None))

    loss_backend = choose_loss()
    selected = None
    chosen = None
    if topk is not None:
        mode = _mask_mode(tokens, cu_seqlens, causal, causal_alignment, key_bounds)
        chosen = _topk_backend(tokens, q, k, weights, topk, relu, False, mode, backend)
    if chosen is not None and (chosen is Backend.NPU_FUSED or loss_backend is Backend.NPU_FUSED
                               or (chosen is Backend.TRITON and q.dtype != torch.float64)):
        with torch.no_grad():  # the kernel (or operator) selects; the loss takes its indices
            selected, _ = _select(tokens, q, k, weights, lo, hi, key_range, topk, relu, False, chosen, index_dtype,
                                  mode, backend)
        topk_indices, topk = selected, None
    elif topk_indices is not None:
        topk_indices = checks.check_topk_indices(topk_indices, tokens, q.device)
    elif sparse and topk is None:
        raise ValueError("the sparse loss needs topk_indices (or topk, to select them)")
    options = dict(fmt=layout, softmax_scale=float(softmax_scale), loss_coeff=float(loss_coeff), sparse=bool(sparse),
                   topk=topk, relu=relu, query_valid_rows=rows, per_token=bool(calculate_per_token_loss),
                   tp_group=tp_group, key_range=key_range, index_dtype=index_dtype)
    impl = loss_npu if loss_backend is Backend.NPU_FUSED else loss_torch
    try:
        loss, computed = IndexerLossFunction.apply(q, k, weights, query, key, lo, hi, topk_indices,
                                                   torch.is_grad_enabled(), options, impl)
    except npu.NpuOpUnavailable:  # its first call found no kernel on this device (remembered): the fallback
        if choose_loss() is Backend.NPU_FUSED:
            raise
        loss, computed = IndexerLossFunction.apply(q, k, weights, query, key, lo, hi, topk_indices,
                                                   torch.is_grad_enabled(), options, loss_torch)
    if topk is not None:  # the torch chunks selected them
        selected = computed
    return loss, None if selected is None else tokens.unflat(selected)


def indexer_loss(q, k, weights, query, key, softmax_scale: float, loss_coeff: float, *, topk_indices=None,
                 sparse: bool = False, layout: str = "thd", cu_seqlens=None, causal: bool = True,
                 causal_alignment: str = "bottom_right", key_bounds=None, relu: bool = True, query_valid_rows=None,
                 calculate_per_token_loss: bool = False, tp_group=None, max_seqlen=None, backend=None) -> torch.Tensor:
    """The DSA indexer loss as Megatron-Core 0.19 defines it (``compute_dsa_indexer_loss``; the math is
    in coreattn/layers/torch_backend/indexer_loss.py), computed chunk by chunk: never a [T, T] tensor.

    KL(target || softmax of the index scores) per query row over its keys (``sparse``: only its
    ``topk_indices``, Megatron's ``dsa_indexer_use_sparse_loss``), the target being the attention
    probabilities ``softmax(softmax_scale * query . key)`` summed over heads and normalized;
    averaged over the rows (``query_valid_rows`` counts only those; ``calculate_per_token_loss``:
    summed) and scaled by ``loss_coeff``. ``query`` [*tokens, np, Dq] and ``key`` [*key tokens, Hkv,
    Dq] (np % Hkv == 0; Megatron's absorbed MLA key has Hkv = 1) are detached. ``tp_group``: the
    attention heads are split over these ranks (the summed target is all-reduced, chunk by chunk).
    Returns the 0-dim float32 loss, differentiable in q, k and weights (gradients equal Megatron's
    backward: (softmax(z) - target) through the index scores). ``max_seqlen``: as in ``indexer_topk``.
    """
    loss, _ = _loss(q, k, weights, query, key, softmax_scale, loss_coeff, topk_indices, None, sparse=sparse,
                    layout=layout, cu_seqlens=cu_seqlens, causal=causal, causal_alignment=causal_alignment,
                    key_bounds=key_bounds, relu=relu, query_valid_rows=query_valid_rows,
                    calculate_per_token_loss=calculate_per_token_loss, tp_group=tp_group, max_seqlen=max_seqlen,
                    backend=backend)
    return loss


def indexer_topk_and_loss(q, k, weights, query, key, topk: int, softmax_scale: float, loss_coeff: float, *,
                          sparse: bool = False, layout: str = "thd", cu_seqlens=None, causal: bool = True,
                          causal_alignment: str = "bottom_right", key_bounds=None, relu: bool = True,
                          query_valid_rows=None, calculate_per_token_loss: bool = False, tp_group=None,
                          max_seqlen=None, backend=None,
                          index_dtype: torch.dtype = torch.int64) -> tuple[torch.Tensor, torch.Tensor]:
    """``(indices, loss)``: ``indexer_topk``'s indices (``index_dtype``) and ``indexer_loss`` over them,
    as Megatron's ``FusedDSAIndexerLoss`` returns them (the torch backend scores each chunk once for both)."""
    loss, indices = _loss(q, k, weights, query, key, softmax_scale, loss_coeff, None, checks.check_topk(topk), sparse=sparse,
                 layout=layout, cu_seqlens=cu_seqlens, causal=causal, causal_alignment=causal_alignment,
                          key_bounds=key_bounds, relu=relu, query_valid_rows=query_valid_rows,
                          calculate_per_token_loss=calculate_per_token_loss, tp_group=tp_group,
                          max_seqlen=max_seqlen, backend=backend, index_dtype=index_dtype)
    return indices, loss


def hadamard_transform(x: torch.Tensor, scale: float = 1.0, *, backend=None) -> torch.Tensor:
    """``scale * x @ H`` over the last dim (fast_hadamard_transform's ``hadamard_transform``: H the
    Sylvester Hadamard matrix of the next power of two, x zero-padded to it and the result cut back),
    computed in float32 and returned in x's dtype; differentiable (the backward is the same transform).
    Any float dtype and dim (the Triton kernel takes dims up to 256; beyond, torch)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in checks.FLOATS:
        raise TypeError(f"x must be float16, bfloat16, float32 or float64, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError("x must have at least one dim (the transformed last dim)")
    chosen = indexer_backend(x.device, backend)  # torch_npu has no Hadamard operator: Triton or torch
    from coreattn.kernels.configs.indexer import MAX_HADAMARD_DIM

    if x.shape[-1] > MAX_HADAMARD_DIM:
        chosen = Backend.TORCH
    return HadamardFunction.apply(x if x.numel() == 0 or x.stride(-1) == 1 else x.contiguous(), float(scale), chosen)


def rotate_activation(x: torch.Tensor, *, backend=None) -> torch.Tensor:
    """Megatron's ``rotate_activation``: ``hadamard_transform(x, x.shape[-1] ** -0.5)``, for any float
    dtype (Megatron's needs bf16 and the CUDA library) on any device."""
    return hadamard_transform(x, x.shape[-1] ** -0.5, backend=backend)
