"""Public varlen attention functions: coreattn.varlen_attn and a flash-attn 2 drop-in."""

from __future__ import annotations

import torch

from coreattn.adapters.backends import Backend
from coreattn.kernels.packing import Packing, packed
from coreattn.layers.checks import check_seqused, check_varlen_inputs
from coreattn.layers.dispatch import run_attention


def varlen_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                max_seqlen_q: int, max_seqlen_k: int,
                dropout_p: float = 0.0, softmax_scale: float | None = None, causal: bool = False,
                window_size: tuple[int, int] = (-1, -1), return_lse: bool = False, *,
                causal_alignment: str = "bottom_right", deterministic: bool = True,
                seqused_q: torch.Tensor | None = None, seqused_k: torch.Tensor | None = None,
                backend: str | Backend | None = None):
    """Flash attention over packed variable-length sequences; V's head dim may differ from Q/K's.

    Args:
        q: ``[Tq, Hq, Dqk]``; k: ``[Tk, Hkv, Dqk]``; v: ``[Tk, Hkv, Dv]``. fp16, bf16 or fp32
            (fp32 runs at IEEE precision; float64 is accepted by the torch backend only).
            Head dims 1..256, Hq a multiple of Hkv (GQA/MQA). Views with last stride 1 are used
            in place, never copied.
        cu_seqlens_q, cu_seqlens_k: int32 ``[B+1]`` cumulative lengths starting at 0; empty
            sequences are allowed.
        max_seqlen_q, max_seqlen_k: the longest sequence lengths (ints; they size the grid).
        dropout_p: must be 0.0 (accepted for flash-attn compatibility).
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
        backend: ``"triton"``, ``"torch"`` or ``"npu_fused"`` (Ascend's fused op, the default on
            npu tensors) to override the per-device choice (see ``coreattn.adapters.backends``);
            raises if it cannot run. ``npu_fused`` returns lse None.

    Returns:
        ``out`` ``[Tq, Hq, Dv]`` in q's dtype, or ``(out, lse)`` when ``return_lse``. A query that
        sees no key gets zeros and lse = -inf.

    Malformed cu_seqlens (not starting at 0, decreasing, last entry != T) or a max_seqlen below
    the longest sequence raise ``ValueError`` when cu_seqlens is on the CPU or
    ``COREATTN_VALIDATE=1`` (a host sync on GPU). Otherwise the GPU kernel turns malformed
    cu_seqlens into NaN outputs, and an underestimated max_seqlen only costs speed. With
    ``seqused_*`` the kernel checks each used span against the token count but not the order of
    the slots: unvalidated decreasing cu_seqlens there are the caller's responsibility.
    """
    params, max_seqlen_q, max_seqlen_k = check_varlen_inputs(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
        causal, window_size, causal_alignment, seqused=seqused_q is not None or seqused_k is not None)
    q_pack, k_pack = packed(cu_seqlens_q), packed(cu_seqlens_k)
    if seqused_q is not None or seqused_k is not None:
        q_pack = Packing("thd", cu_seqlens_q[:-1], check_seqused("seqused_q", seqused_q, cu_seqlens_q,
                                                                     "max_seqlen_q", max_seqlen_q))
        k_pack = Packing("thd", cu_seqlens_k[:-1], check_seqused("seqused_k", seqused_k, cu_seqlens_k,
                                                                     "max_seqlen_k", max_seqlen_k))
    out, lse, _ = run_attention(q, k, v, q_pack, k_pack, max_seqlen_q, max_seqlen_k, params, deterministic, backend)
    return (out, lse) if return_lse else out


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                           softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False,
                           block_table=None):
    """flash-attn 2's ``flash_attn_varlen_func`` signature, for a one-line import swap.

    Supported subset: everything ``coreattn.varlen_attn`` supports (and V's head dim may differ).
    ``softcap``, ``alibi_slopes``, ``block_table`` and ``dropout_p`` raise NotImplementedError
    when set. With ``return_attn_probs=True`` it returns ``(out, softmax_lse, None)``: the lse as
    flash-attn gives it, and no attention probabilities.
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
