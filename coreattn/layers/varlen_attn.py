"""Public varlen attention functions: coreattn.varlen_attn and a flash-attn 2 drop-in."""

from __future__ import annotations

import torch

from coreattn.layers.backends import Backend
from coreattn.layers.bias import check_bias
from coreattn.kernels.packing import Packing, packed
from coreattn.layers.checks import check_flag, check_seqused, check_softmax_offset, check_varlen_inputs
from coreattn.layers.dispatch import public_result, run_attention


def varlen_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                max_seqlen_q: int, max_seqlen_k: int,
                dropout_p: float = 0.0, softmax_scale: float | None = None, causal: bool = False,
                window_size: tuple[int, int] = (-1, -1), return_lse: bool = False, *,
                causal_alignment: str = "bottom_right", deterministic: bool = True,
                seqused_q: torch.Tensor | None = None, seqused_k: torch.Tensor | None = None,
                softmax_offset: torch.Tensor | None = None, return_max_logit: bool = False,
                backend: str | Backend | None = None, bias=None):
    """Flash attention over packed variable-length sequences; V's head dim may differ from Q/K's.

    Args:
        q: ``[Tq, Hq, Dqk]``; k: ``[Tk, Hkv, Dqk]``; v: ``[Tk, Hkv, Dv]``. fp16, bf16 or fp32
            (fp32 runs at IEEE precision; float64 is accepted by the torch backend only).
            Head dims 1..256, Hq a multiple of Hkv (GQA/MQA). Views with last stride 1 are used
            in place, never copied.
        cu_seqlens_q, cu_seqlens_k: int32 ``[B+1]`` cumulative lengths starting at 0; empty
            sequences are allowed.
        max_seqlen_q, max_seqlen_k: the longest sequence lengths: ints, or 0-dim integer tensors
            (Transformer Engine's and Megatron's), which are never read, so a device tensor costs no
            host sync. The kernels do not use them (their grids follow the token counts); an int is
            checked against the longest sequence where the lengths are read (below).
        dropout_p: attention dropout on the normalized probabilities, ``0 <= p < 1``, kept ones
            scaled by ``1 / (1 - p)`` (flash-attn 2's definition; lse is unaffected). The keep mask
            is a counter-based function of (seed, offset, q head, query token, key token)
            (``coreattn/kernels/dropout.py``): the forward and backward regenerate it, it does not
            depend on block sizes, grid or backend (Triton and torch give the same mask), and the
            seed and offset come from torch's generator for the tensors' device, advanced on each
            call (``torch.manual_seed`` / ``torch.cuda.manual_seed`` make runs reproducible). Token
            ids are rows of q and k. ``npu_fused`` uses the op's own RNG (different masks).
        softmax_scale: defaults to ``1 / sqrt(Dqk)``.
        causal: causal mask. With ``causal_alignment="bottom_right"`` (flash-attn 2, the default)
            query i of a sequence sees keys ``j <= i + Lk - Lq``; with ``"top_left"`` (Megatron's
            ``causal``) keys ``j <= i``.
        window_size: ``(left, right)`` sliding window; query i sees keys in
            ``[i + shift - left, i + shift + right]`` where shift follows ``causal_alignment``;
            -1 means unlimited.
        return_lse: also return the log-sum-exp ``[Hq, Tq]`` float32 (natural log). It is not
            differentiable; backpropagating through ``out`` alone is supported.
        deterministic: the backward is always deterministic (no atomics); accepted so callers can
            state it.
        seqused_q, seqused_k: optional int32 ``[B]`` (flash-attn 3's names): only the first
            ``seqused[b]`` tokens of sequence b's slot ``[cu[b], cu[b+1])`` take part, e.g.
            Megatron's ``cu_seqlens_*_padded`` layout with the real lengths. Unused query rows
            get zeros (lse -inf) and no gradient; unused keys are seen by no query. Causal
            alignment and windows count within the used tokens.
        softmax_offset: optional floating ``[Hq]`` sink logits (Megatron's ``softmax_offset``,
            flash-attn's ``learnable_sink``, transformers' ``s_aux``), or one per query token and
            head, ``[Tq, Hq]`` (Inkling 2's ``sinks``): each query row's softmax denominator gains
            ``exp(offset)``, a virtual key with that logit and a zero value; "off-by-one" softmax is
            an offset of 0. Differentiable (a row's gradient is ``-p_sink * rowsum(dO * O)``, summed
            over the head's rows for ``[Hq]``; deterministic). The returned lse includes the sink
            term; a row that sees no key outputs zeros (lse = the offset).
        return_max_logit: also return the max over every visible (query, key) pair of the scaled
            logit ``softmax_scale * q.k``, float32 ``[Hq]`` per q head (Transformer Engine's
            ``return_max_logit``, for qk-clip): masked pairs and padding do not count, dropout does
            not change it, sinks are not logits of a key; -inf for a head without a visible pair.
            Not differentiable; no host sync.
        bias: optional additive bias computed in registers, never an ``[S, T]`` tensor
            (docs/features.md): ``coreattn.LowRankRelativeBias(states [Tq, Hq, R], proj [R, E])``,
            ``states[i, h] . proj[:, d]`` for ``0 <= d < E`` (Inkling 2), or
            ``coreattn.BucketedRelativeBias(embedding [num_buckets, Hq], bidirectional,
            max_distance)``, T5's ``embedding[bucket(-d), h]``; d = i + shift - j, the query's
            distance to the key along the causal diagonal (shift = Lk - Lq bottom-right, 0
            top-left). Differentiable in its tensors, deterministic. Not with return_max_logit.
        backend: ``"triton"``, ``"torch"`` or ``"npu_fused"`` (Ascend's fused op, the default on
            npu tensors) to override the per-device choice (see ``coreattn.layers.backends``);
            raises if it cannot run. ``npu_fused`` returns lse None.

    Returns:
        ``out`` ``[Tq, Hq, Dv]`` in q's dtype; with ``return_lse`` and/or ``return_max_logit``,
        ``(out, lse)``, ``(out, max_logit)`` or ``(out, lse, max_logit)``. A query that sees no key
        (and has no sink) gets zeros and lse = -inf.

    Malformed cu_seqlens (not starting at 0, decreasing, last entry != T) or an int max_seqlen below
    the longest sequence raise ``ValueError`` when cu_seqlens is on the CPU or
    ``COREATTN_VALIDATE=1`` (a host sync on GPU). Otherwise the GPU kernel turns malformed
    cu_seqlens into NaN outputs, and an underestimated max_seqlen only costs speed. With
    ``seqused_*`` the kernel checks each used span against the token count but not the order of
    the slots: unvalidated decreasing cu_seqlens there are the caller's responsibility.
    """
    params, max_seqlen_q, max_seqlen_k = check_varlen_inputs(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
        causal, window_size, causal_alignment)
    q_pack, k_pack = packed(cu_seqlens_q), packed(cu_seqlens_k)
    if seqused_q is not None or seqused_k is not None:
        # the op reads these as cu_seqlens slots holding the used counts (coreattn/layers/function.py)
        q_pack = Packing("thd", cu_seqlens_q, check_seqused("seqused_q", seqused_q, cu_seqlens_q))
        k_pack = Packing("thd", cu_seqlens_k, check_seqused("seqused_k", seqused_k, cu_seqlens_k))
    out, lse, max_logit = run_attention(q, k, v, q_pack, k_pack, max_seqlen_q, max_seqlen_k, params, deterministic,
                                        backend, softmax_offset=check_softmax_offset(softmax_offset, q),
                                        return_max_logit=check_flag("return_max_logit", return_max_logit),
                                        validate=True, bias=check_bias(bias, q, return_max_logit))
    return public_result(out, lse, max_logit, return_lse, return_max_logit)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                           softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False,
                           block_table=None):
    """flash-attn 2's ``flash_attn_varlen_func`` signature, for a one-line import swap.

    Supported subset: everything ``coreattn.varlen_attn`` supports (and V's head dim may differ),
    dropout included (coreattn's own keep mask, not flash-attn's). ``softcap``, ``alibi_slopes`` and
    ``block_table`` raise NotImplementedError when set. With ``return_attn_probs=True`` it returns
    ``(out, softmax_lse, None)``: the lse as flash-attn gives it, and no attention probabilities
    (nor flash-attn's encoded dropout mask).
    """
    if softcap != 0.0:
        raise NotImplementedError(f"softcap={softcap} is not supported by coreattn; pass 0.0")
    if alibi_slopes is not None:
        raise NotImplementedError("alibi_slopes is not supported by coreattn; pass None")
    if block_table is not None:
        raise NotImplementedError("block_table (paged KV) is not supported by coreattn; pass None")
    out, lse = varlen_attn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
                           window_size=window_size, return_lse=True, deterministic=deterministic)
    return (out, lse, None) if return_attn_probs else out
