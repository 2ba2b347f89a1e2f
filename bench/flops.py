"""Explicit FLOP model for attention, from an exact count of visible (query, key) pairs.

Per head, per visible pair: the forward does one Dqk-long dot product (S = QK^T) and one
Dv-long one (O = PV), 2 FLOPs per multiply-add; the backward recomputes S and computes dV, dP,
dQ and dK. Softmax and elementwise work are not counted (the usual convention).
"""

from __future__ import annotations

import numpy as np

MODES = ("fwd", "bwd", "fwdbwd")


def visible_pairs(len_q: int, len_k: int, causal: bool = False, window: tuple[int, int] = (-1, -1),
                  bottom_right: bool = True) -> int:
    """Number of (i, j) with query i < len_q attending key j < len_k.

    Query i sees keys ``[i + shift - left, i + shift + right]`` clipped to ``[0, len_k)``, with
    ``shift = len_k - len_q`` when ``bottom_right`` else 0; -1 is unlimited and causal sets
    ``right = 0`` whatever the window says (coreattn.varlen_attn's semantics).
    """
    left, right = window
    if causal:
        right = 0
    if len_q <= 0 or len_k <= 0:
        return 0
    shift = len_k - len_q if bottom_right else 0
    i = np.arange(len_q, dtype=np.int64) + shift
    lo = np.maximum(i - left, 0) if left >= 0 else np.zeros_like(i)
    hi = np.minimum(i + right, len_k - 1) if right >= 0 else np.full_like(i, len_k - 1)
    return int(np.clip(hi - lo + 1, 0, None).sum())


def batch_pairs(seqlens_q, seqlens_k=None, causal: bool = False, window: tuple[int, int] = (-1, -1),
                bottom_right: bool = True) -> int:
    """Visible pairs summed over the sequences of a packed batch."""
    seqlens_k = seqlens_q if seqlens_k is None else seqlens_k
    if len(seqlens_q) != len(seqlens_k):
        raise ValueError(f"{len(seqlens_q)} query lengths but {len(seqlens_k)} key lengths")
    return sum(visible_pairs(lq, lk, causal, window, bottom_right) for lq, lk in zip(seqlens_q, seqlens_k))


def attention_flops(pairs: int, num_heads_q: int, head_dim_qk: int, head_dim_v: int, mode: str) -> int:
    """FLOPs of ``mode`` ("fwd", "bwd", "fwdbwd") over all query heads."""
    fwd = 2 * pairs * (head_dim_qk + head_dim_v) * num_heads_q
    bwd = 2 * pairs * (3 * head_dim_qk + 2 * head_dim_v) * num_heads_q
    if mode == "fwd":
        return fwd
    if mode == "bwd":
        return bwd
    if mode == "fwdbwd":
        return fwd + bwd
    raise ValueError(f"unknown mode {mode!r}; choose one of {MODES}")
