"""Public top-k sparse attention (DeepSeek Sparse Attention): coreattn.sparse_varlen_attn and sparse_padded_attn."""

from __future__ import annotations

import math
import operator

import torch

from coreattn.kernels.packing import FORMATS, seq_len_dim
from coreattn.layers.backends import Backend, parse_backend
from coreattn.layers.checks import (ALIGNMENTS, check_cu_seqlens, check_flag, check_key_bounds, check_max_seqlen,
                                    check_softmax_offset, check_spans, check_sparse_qkv, check_token_values,
                                    check_topk_indices)
from coreattn.layers.dsa.sparse_function import SparseLayout, sparse_attention

_SEMANTICS = """
    Each query token attends only to the keys its row of ``topk_indices`` names:

    - an entry is a key position: thd, a row of the packed k (a global offset, as Megatron's
      DSA indexer gives it); padded, a position in the token's own sample (0..Sk-1);
    - a negative entry (-1) is unused; rows need not be sorted;
    - **duplicates count once** (set semantics, as Megatron's own DSA path, which scatters the
      indices into a mask; kernels that gather would count a repeated key twice);
    - ``topk_length`` (optional, an integer tensor with q's token dims): only the first
      ``topk_length[n]`` entries of token n's row are used (cuDNN's compact prefix);
    - an entry outside the token's visible keys is masked, never read: the visible keys of a token
      are its own sequence's (thd: cu_seqlens_k's sequence b; padded: the span
      ``[k_start, k_start + k_len)`` of its sample) and, with ``causal``, those at relative
      position ``j <= i + Lk - Lq`` (``causal_alignment="bottom_right"``, flash-attn 2's default;
      the same as top-left for self-attention) or ``j <= i`` (``"top_left"``, Megatron's);
    - ``key_bounds=(starts, ends)`` (optional, integer tensors with q's token dims, Megatron's
      ``varlen_starts/ends``): token n also needs ``starts[n] <= j < ends[n]`` (intersected with
      the above; pass ``causal=False`` to use the bounds with the sequence alone);
    - ``topk_indices`` may be ``[.., K]`` (one row per token, shared by every head) or
      ``[.., Hkv, K]`` (a row per kv head, shared by that head's q heads);
    - ``key_window=(left, right)`` (optional, ints >= 0) adds to every token's row the keys at
      relative positions ``i + shift - left .. i + shift + right`` of its sequence (shift as for
      causality: ``Lk - Lq`` bottom-right, 0 top-left), before the rules above (so ``causal`` and
      ``key_bounds`` still apply): DeepSeek-V4's sliding window of raw keys next to its compressed
      entries. The window's entries join the prepared indices: memory O(tokens x (K + window)).

    ``block_size`` (optional, an int >= 1: block-sparse attention, MiniMax-M3's): an entry names a
    *block* of ``block_size`` contiguous keys instead of one key: block c of the token's sequence is
    the key positions ``c * block_size .. (c + 1) * block_size - 1`` counted from the sequence's first
    key (thd: cu_seqlens_k's row of the sequence; padded: position 0 of the sample, so blocks sit on
    absolute positions whatever the spans); a negative entry is unused, a block named twice counts
    once, and every key of a named block then follows the rules above (its sequence, causality: the
    block holding the query is causal inside, ``key_bounds``). Rows are ``[.., Hkv, nblocks]`` or
    ``[.., nblocks]``; memory O(tokens x nblocks): a block is never expanded into its keys' indices.
    Not with ``key_window``.

    ``softmax_offset`` (optional, a floating ``[Hq]`` tensor, or one logit per token and head, thd
    ``[T, Hq]`` / padded ``[B, Hq, S]``; differentiable: attention sinks, as gpt-oss's and
    DeepSeek-V4's, Inkling 2's per token): each row's softmax denominator gains ``exp(offset)``, a
    virtual key of value zero; lse includes it (a row that sees no key outputs zeros and its lse is the
    offset).

    A token that sees no key (all entries unused, masked, or outside its sequence) outputs zeros,
    its lse is -inf and every gradient through it is 0, never NaN.

    v may be None (absorbed MLA, DeepSeek-V3.2's 576 / 512): V is then the first ``v_head_dim``
    columns of k, and its gradient flows into k. GQA/MQA (``Hq`` a multiple of ``Hkv``); head dims
    1..256, 512 or 576 for q/k, 1..512 for v; fp16, bf16, fp32 (float64 on the torch backend). Views
    with last stride 1 are used in place.

    The backward is deterministic (two runs are bitwise equal) and saves q, k, v, out, lse, the
    prepared indices (int32, as many as topk_indices) and the key bounds; it recomputes the scores.
    Memory is O(tokens x (heads x head dim + top-k)) plus a bounded work buffer: never
    sequence x sequence.

    ``backend``: ``"triton"``, ``"torch"`` (any device; chunked over query tokens) or
    ``"npu_fused"`` (torch_npu's ``npu_sparse_flash_attention``: absorbed MLA 512 + 64, one key
    head, float16/bfloat16; a call outside its limits raises naming the limit) to override the
    per-device default (``coreattn.layers.backends.select_sparse_backend``: on Ascend NPUs
    npu_fused where the call fits, else Triton through triton-ascend, else torch; Triton on CUDA
    and ROCm; torch on CPU), which falls back with the reason logged, never raises. Nothing reads
    a device tensor's values (no host sync); malformed cu_seqlens or spans raise ``ValueError`` on
    CPU tensors (or with ``COREATTN_VALIDATE=1``)."""


def _check_common(softmax_scale, causal, causal_alignment, head_dim_qk: int) -> tuple[float, bool]:
    check_flag("causal", causal)
    if causal_alignment not in ALIGNMENTS:
        raise ValueError(f"causal_alignment must be one of {ALIGNMENTS}, got {causal_alignment!r}")
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim_qk), causal_alignment == "bottom_right"
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)) \
            or not math.isfinite(softmax_scale) or softmax_scale <= 0:
        raise ValueError(f"softmax_scale must be a positive finite float, got {softmax_scale!r}")
    return float(softmax_scale), causal_alignment == "bottom_right"


def _check_key_window(key_window) -> tuple[int, int]:
    if key_window is None:
        return (-1, -1)
    try:
        left, right = (operator.index(x) for x in key_window)
    except (TypeError, ValueError):
        raise TypeError(f"key_window must be None or a pair of ints (left, right), got {key_window!r}") from None
    if left < 0 or right < 0:
        raise ValueError(f"key_window entries must be >= 0 (keys added left and right of the token), got {key_window!r}")
    return left, right


def _check_block_size(block_size, key_window) -> int:
    """0 for token entries, else the block size (an int >= 1)."""
    if block_size is None:
        return 0
    if isinstance(block_size, bool):
        raise TypeError("block_size must be None or an int >= 1, got bool")
    try:
        size = operator.index(block_size)
    except TypeError:
        raise TypeError(f"block_size must be None or an int >= 1, got {type(block_size).__name__}") from None
    if not 1 <= size < 2**31:
        raise ValueError(f"block_size must be >= 1 (keys per named block), got {size}")
    if key_window is not None:
        raise ValueError("key_window adds token entries; it cannot be combined with block_size (block entries)")
    return size


def _run(q, k, v, topk_indices, layout: SparseLayout, topk_length, v_dim: int, key_bounds, softmax_scale, causal,
         causal_alignment, return_lse, backend, key_window=None, softmax_offset=None, block_size=None):
    """The checks common to both layouts (q, k, v and the layout already checked), then the op."""
    fmt = layout.fmt
    topk = check_topk_indices(topk_indices, q, k.shape[-2], fmt)
    length = check_token_values("topk_length", topk_length, q, fmt)
    bounds = check_key_bounds(key_bounds, q, fmt)
    scale, bottom_right = _check_common(softmax_scale, causal, causal_alignment, q.shape[-1])
    check_flag("return_lse", return_lse)
    window = _check_key_window(key_window)
    blocks = _check_block_size(block_size, key_window)
    offset = check_softmax_offset(softmax_offset, q, fmt)
    override = "" if backend is None else parse_backend(backend).value
    out, lse = sparse_attention(q, k, v, topk, length, layout, bounds, causal, bottom_right, scale, v_dim, override,
                                validate=True, window=window, softmax_offset=offset, block_size=blocks)
    return (out, lse) if return_lse else out


def sparse_varlen_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, topk_indices: torch.Tensor,
                       cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q=None, max_seqlen_k=None,
                       softmax_scale: float | None = None, causal: bool = True, *,
                       causal_alignment: str = "bottom_right", topk_length: torch.Tensor | None = None,
                       v_head_dim: int | None = None,
                       key_bounds: tuple[torch.Tensor, torch.Tensor] | None = None, return_lse: bool = False,
                       backend: str | Backend | None = None, key_window: tuple[int, int] | None = None,
                       softmax_offset: torch.Tensor | None = None, block_size: int | None = None):
    """Top-k sparse attention over packed variable-length sequences (DeepSeek Sparse Attention's core).

    Args:
        q: ``[Tq, Hq, Dqk]``; k: ``[Tk, Hkv, Dqk]``; v: ``[Tk, Hkv, Dv]``, or None with
            ``v_head_dim`` (absorbed MLA: V = ``k[..., :v_head_dim]``).
        topk_indices: integer ``[Tq, K]`` or ``[Tq, Hkv, K]``: for each query token the rows of k
            it may attend to (any integer dtype; int64 from Megatron's indexer is fine).
        cu_seqlens_q, cu_seqlens_k: int32 ``[B+1]`` cumulative lengths from 0; empty sequences
            are allowed.
        max_seqlen_q, max_seqlen_k: accepted for flash-attn-style calls (an int or a 0-dim integer
            tensor, never read) and not used.
        softmax_scale: defaults to ``1 / sqrt(Dqk)`` (Megatron's DSA passes
            ``1 / sqrt(qk_head_dim + qk_pos_emb_head_dim)``).
        causal, causal_alignment: see below (default causal, bottom-right like flash-attn 2).
        topk_length: optional integer ``[Tq]``: the number of leading entries of each row to use.
        v_head_dim: Dv when v is None (must be <= Dqk); may be given with v (must then match).
        key_bounds: optional ``(starts, ends)``, integer ``[Tq]`` each: rows of k token n may see.
        return_lse: also return the log-sum-exp ``[Hq, Tq]`` (float32; float64 for float64 inputs,
            natural log; not differentiable).
        backend: see below.
        key_window, softmax_offset: keys added around each token, attention sinks (see below).
        block_size: entries name blocks of that many keys of the token's sequence (see below).

    Returns:
        ``out`` ``[Tq, Hq, Dv]`` in q's dtype, or ``(out, lse)`` with ``return_lse``.
    """
    v_dim = check_sparse_qkv(q, k, v, "thd", v_head_dim)
    check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.device)
    check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, cu_seqlens_q.device)
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(f"cu_seqlens_q has {cu_seqlens_q.numel()} entries but cu_seqlens_k has "
                         f"{cu_seqlens_k.numel()}: q and k batch sizes must match")
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if value is not None:
            check_max_seqlen(name, value, 0)
    return _run(q, k, v, topk_indices, SparseLayout("thd", cu_seqlens_q, None, cu_seqlens_k, None), topk_length,
                v_dim, key_bounds, softmax_scale, causal, causal_alignment, return_lse, backend, key_window,
                softmax_offset, block_size)


def sparse_padded_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, topk_indices: torch.Tensor, *,
                       layout: str = "bshd", q_start: torch.Tensor | None = None, q_len: torch.Tensor | None = None,
                       k_start: torch.Tensor | None = None, k_len: torch.Tensor | None = None,
                       softmax_scale: float | None = None, causal: bool = True,
                       causal_alignment: str = "bottom_right", topk_length: torch.Tensor | None = None,
                       v_head_dim: int | None = None, key_bounds: tuple[torch.Tensor, torch.Tensor] | None = None,
                       return_lse: bool = False, backend: str | Backend | None = None,
                       key_window: tuple[int, int] | None = None, softmax_offset: torch.Tensor | None = None,
                       block_size: int | None = None):
    """Top-k sparse attention on a padded batch (bshd, or Megatron's sbhd), used in place.

    Args:
        q: ``[B, Sq, Hq, Dqk]`` (``layout="bshd"``) or ``[Sq, B, Hq, Dqk]`` (``"sbhd"``); k
            ``[.., Sk, .., Hkv, Dqk]`` and v ``[.., Sk, .., Hkv, Dv]`` (or None with ``v_head_dim``)
            in the same layout.
        topk_indices: integer with q's token dims then ``[K]`` or ``[Hkv, K]``: bshd
            ``[B, Sq, (Hkv,) K]``, sbhd ``[Sq, B, (Hkv,) K]`` (Megatron's ``[b, s, K]`` passed as a
            transposed view is used without a copy); entries are key positions in the sample.
        q_start, q_len, k_start, k_len: optional int32 ``[B]`` spans, as in ``coreattn.padded_attn``:
            sample b's real tokens are positions ``[start_b, start_b + len_b)`` (None: the whole
            row). Query tokens outside the q span output zeros; causal positions count from the
            spans' starts.
        topk_length, key_bounds: integer tensors with q's token dims (``[B, Sq]`` / ``[Sq, B]``);
            key bounds are positions in the sample.
        Other arguments as in ``coreattn.sparse_varlen_attn``.

    Returns:
        ``out`` in q's layout with last dim Dv, or ``(out, lse)`` with ``return_lse``: lse
        ``[B, Hq, Sq]`` (-inf for tokens that see no key).
    """
    if layout not in FORMATS[1:]:
        raise ValueError(f"layout must be 'bshd' or 'sbhd', got {layout!r}")
    v_dim = check_sparse_qkv(q, k, v, layout, v_head_dim)
    batch = q.shape[0] if layout == "bshd" else q.shape[1]
    q_start, q_len = check_spans("q_start", q_start, "q_len", q_len, batch, seq_len_dim(q, layout), q.device)
    k_start, k_len = check_spans("k_start", k_start, "k_len", k_len, batch, seq_len_dim(k, layout), q.device)
    return _run(q, k, v, topk_indices, SparseLayout(layout, q_start, q_len, k_start, k_len), topk_length, v_dim,
                key_bounds, softmax_scale, causal, causal_alignment, return_lse, backend, key_window, softmax_offset,
                block_size)


for _fn in (sparse_varlen_attn, sparse_padded_attn):  # the semantics both docstrings share
    if _fn.__doc__:  # None under python -OO
        _fn.__doc__ += _SEMANTICS
