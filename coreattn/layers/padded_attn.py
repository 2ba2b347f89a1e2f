"""Public attention over padded batches (bshd or sbhd), masks computed in registers from spans or keep masks."""

from __future__ import annotations

import torch

from coreattn.layers.backends import Backend
from coreattn.layers.bias import check_bias
from coreattn.kernels.packing import FORMATS, Packing, seq_len_dim
from coreattn.layers.checks import (check_flag, check_keep_mask, check_options, check_qkv, check_softmax_offset,
                                    check_spans)
from coreattn.layers.dispatch import public_result, run_attention


def padded_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, layout: str = "bshd",
                q_start: torch.Tensor | None = None, q_len: torch.Tensor | None = None,
                k_start: torch.Tensor | None = None, k_len: torch.Tensor | None = None,
                q_keep_mask: torch.Tensor | None = None, k_keep_mask: torch.Tensor | None = None,
                dropout_p: float = 0.0, softmax_scale: float | None = None, causal: bool = False,
                window_size: tuple[int, int] = (-1, -1), causal_alignment: str = "bottom_right",
                return_lse: bool = False, deterministic: bool = True, softmax_offset: torch.Tensor | None = None,
                return_max_logit: bool = False, backend: str | Backend | None = None, bias=None):
    """Flash attention on a padded batch, used in place (no unpad copies, no S×S mask).

    Args:
        q: ``[B, Sq, Hq, Dqk]`` (``layout="bshd"``) or ``[Sq, B, Hq, Dqk]`` (``"sbhd"``, Megatron's
            layout); k ``[.., Sk, .., Hkv, Dqk]`` and v ``[.., Sk, .., Hkv, Dv]`` in the same layout.
            Strided views are fine as long as the last stride is 1.
        q_start, q_len, k_start, k_len: optional int32 ``[B]`` spans: sample b's real tokens are
            positions ``[start_b, start_b + len_b)`` (right padding: start 0; left padding: start
            S - len). None means the whole padded length. A span that does not fit raises on CPU
            (or with ``COREATTN_VALIDATE=1``); on GPU every output of the call becomes NaN.
        q_keep_mask, k_keep_mask: optional ``[B, Sq]`` / ``[B, Sk]`` keep masks (bool or 0/1 int;
            True = the token takes part), e.g. an HF ``attention_mask``, holes allowed. They are
            read in registers at each position; no S×S tensor is built. A dropped query row
            outputs zeros (lse -inf); a dropped key is seen by no query. For self-attention with
            padding pass the same mask for both.
        causal, window_size, causal_alignment: as in ``coreattn.varlen_attn``, with positions
            counted from each span's start (from 0 without spans).
        dropout_p: as in ``coreattn.varlen_attn``; token ids are ``b * S + position`` (raw padded
            positions), so a padded batch and its packed (unpadded) form draw different masks.
        softmax_offset: as in ``coreattn.varlen_attn``; per token it is ``[B, Hq, S]``.
        Other arguments (``return_max_logit``, ``bias``, ...) as in ``coreattn.varlen_attn``, with the
        bias's distances counted from each span's start (from 0 without spans).

    Returns:
        ``out`` in q's layout with last dim Dv (zeros outside the q spans); with ``return_lse``
        and/or ``return_max_logit`` also lse ``[B, Hq, Sq]`` float32 (-inf outside the spans and for
        rows that see no key) and/or max_logit ``[Hq]``, in that order, as ``varlen_attn`` returns them.
    """
    if layout not in FORMATS[1:]:
        raise ValueError(f"layout must be 'bshd' or 'sbhd', got {layout!r}")
    check_qkv(q, k, v, layout)
    params = check_options(q.shape[-1], dropout_p, softmax_scale, causal, window_size, causal_alignment)
    batch = q.shape[0] if layout == "bshd" else q.shape[1]
    seqlen_q, seqlen_k = seq_len_dim(q, layout), seq_len_dim(k, layout)
    q_start, q_len = check_spans("q_start", q_start, "q_len", q_len, batch, seqlen_q, q.device)
    k_start, k_len = check_spans("k_start", k_start, "k_len", k_len, batch, seqlen_k, q.device)
    q_keep = check_keep_mask("q_keep_mask", q_keep_mask, batch, seqlen_q, q.device)
    k_keep = check_keep_mask("k_keep_mask", k_keep_mask, batch, seqlen_k, q.device)
    out, lse, max_logit = run_attention(q, k, v, Packing(layout, q_start, q_len, q_keep),
                                        Packing(layout, k_start, k_len, k_keep), seqlen_q, seqlen_k, params,
                                        deterministic, backend, softmax_offset=check_softmax_offset(softmax_offset, q, layout),
                                        return_max_logit=check_flag("return_max_logit", return_max_logit),
                                        validate=True, bias=check_bias(bias, q, return_max_logit))
    return public_result(out, lse, max_logit, return_lse, return_max_logit)
