"""The indexer's block-max scores (MiniMax-M3's lightning indexer): kernel and launcher.

For query token n (sample b, position s) and each index head h, block c of the sample's keys (key
positions ``origin + c * B .. origin + (c + 1) * B - 1``; ``origin`` the row's ``key_lo`` with
``ORIGIN_AT_LO``, thd, else 0) scores

    block[n, h, c] = max over the block's keys j with key_lo[n] <= j < key_hi[n] of act(q[n, h, :] . k[j, :])

(float32; act ReLU or identity), -inf for a block without a visible key. One program per query token
of a chunk of rows: its q rows [H, D] stay in registers, the blocks meeting its bounds are walked in
tiles of BLOCK_N keys (``n_sub`` per block, contiguous rows: no index), one [H, D] x [D, BLOCK_N] dot
per tile, a running max per head, stored once per block into the chunk's ``[C, H, blocks]`` buffer
(prefilled with -inf by the launcher). The selection of the top blocks runs in torch on that buffer
(coreattn/layers/torch_backend/indexer_blocks.py): T / B blocks per row, not T keys.

Kernel-loop rules (kernels/attn_common.py): key rows clamped into ``[lo, max(hi, lo + 1) - 1]`` and the
sample before an address is formed, values masked, the stored block clamped into the buffer; row and
batch offsets int64; lengths, the block size and counts are runtime ints that never specialize.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from coreattn.kernels.attn_fwd import dot_precision
from coreattn.kernels.configs.indexer import MAX_TOPK_DIM, MAX_TOPK_HEADS, block_scores_config
from coreattn.kernels.configs.targets import target_of
from coreattn.kernels.device import on_device
from coreattn.kernels.launch import launch, slices

RUNTIME_INTS = ("row0", "seqlen_q", "seqlen_k", "block_size", "n_sub", "n_blocks", "stride_qb", "stride_qs",
                "stride_kb", "stride_ks")


@triton.jit(do_not_specialize=RUNTIME_INTS)
def _indexer_block_scores_kernel(q_ptr, k_ptr, lo_ptr, hi_ptr, out_ptr, row0, seqlen_q, seqlen_k, heads, block_size,
                                 n_sub, n_blocks, stride_qb, stride_qs, stride_qh, stride_kb, stride_ks,
                                 HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                                 BLOCK_N: tl.constexpr, ORIGIN_AT_LO: tl.constexpr, RELU: tl.constexpr,
                                 DOT_PRECISION: tl.constexpr):
    # grid: one program per query token row0 + pid (n = b * seqlen_q + s); seqlen_k >= 1, n_sub >= 1, n_blocks >= 1
    local = tl.program_id(0).to(tl.int64)
    row = row0 + local
    b = row // seqlen_q
    s = row - b * seqlen_q
    lo = tl.minimum(tl.maximum(tl.load(lo_ptr + row), 0), seqlen_k)
    hi = tl.maximum(tl.minimum(tl.load(hi_ptr + row), seqlen_k), lo)
    last = tl.minimum(tl.maximum(hi, lo + 1), seqlen_k) - 1  # every key address stays on rows [lo, last]
    origin = lo * 0
    if ORIGIN_AT_LO:
        origin = lo

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    h_ok = offs_h < heads
    h_rows = tl.minimum(offs_h, heads - 1).to(tl.int64)
    d_cols = tl.minimum(offs_d, HEAD_DIM - 1)  # columns past the head dim read its last (masked)
    d_ok = offs_d < HEAD_DIM
    q = tl.load(q_ptr + b * stride_qb + s * stride_qs + h_rows[:, None] * stride_qh + d_cols[None, :],
                mask=h_ok[:, None] & d_ok[None, :], other=0.0)  # [H, D]
    k_base = k_ptr + b * stride_kb
    out_row = out_ptr + local * heads * n_blocks + h_rows * n_blocks  # [H] the chunk's [C, H, blocks] rows

    first = (lo - origin) // block_size  # the blocks meeting [lo, hi)
    end = (hi - origin + block_size - 1) // block_size
    best = tl.full([BLOCK_H], float("-inf"), tl.float32)
    for t in range(first * n_sub, end * n_sub):
        c = t // n_sub
        sub = t - c * n_sub
        inside = sub * BLOCK_N + offs_n  # [N] offsets in the block
        cols = origin + c * block_size + inside
        ok = (inside < block_size) & (cols >= lo) & (cols < hi)
        rows = tl.minimum(tl.maximum(cols, lo), last).to(tl.int64)
        kt = tl.load(k_base + rows[:, None] * stride_ks + d_cols[None, :], mask=d_ok[None, :], other=0.0)  # [N, D]
        x = tl.dot(q, tl.trans(kt), input_precision=DOT_PRECISION)  # [H, N] float32
        if RELU:
            x = tl.maximum(x, 0.0)
        tile = tl.max(tl.where(ok[None, :], x, float("-inf")), 1)  # [H]
        sub_h = offs_h * 0 + sub  # vector compares (Triton 3.9's interpreter: no scalar mask broadcast)
        best = tl.where(sub_h == 0, tile, tl.maximum(best, tile))
        tl.store(out_row + tl.minimum(tl.maximum(c, 0), n_blocks - 1), best, mask=h_ok & (sub_h == n_sub - 1))


def _strides(q: torch.Tensor, k: torch.Tensor, fmt: str):
    """(batch, seqlen_q, seqlen_k, q strides (b, s, h), k strides (b, s)) of index-side q and k."""
    if fmt == "thd":
        return 1, q.shape[0], k.shape[0], (0, q.stride(0), q.stride(1)), (0, k.stride(0))
    if fmt == "bshd":
        return q.shape[0], q.shape[1], k.shape[1], (q.stride(0), q.stride(1), q.stride(2)), (k.stride(0), k.stride(1))
    return q.shape[1], q.shape[0], k.shape[0], (q.stride(1), q.stride(0), q.stride(2)), (k.stride(1), k.stride(0))


@on_device
def indexer_block_scores(q: torch.Tensor, k: torch.Tensor, key_lo: torch.Tensor, key_hi: torch.Tensor, fmt: str,
                         row0: int, row1: int, *, block_size: int, n_blocks: int, relu: bool = False) -> torch.Tensor:
    """float32 ``[row1 - row0, H, n_blocks]``: the block scores of query tokens [row0, row1) (flat n = b * S
    + s). ``fmt`` "thd" (q [T, H, D], k [T, D]; blocks from each row's key_lo), "bshd" (q [B, S, H, D], k
    [B, Sk, D]) or "sbhd" (q [S, B, H, D], k [Sk, B, D]) (blocks from position 0); views with last stride
    1; key_lo / key_hi int32 [N] contiguous. Inputs are assumed checked by the caller."""
    heads, dim = q.shape[-2:]
    batch, seqlen_q, seqlen_k, (qb, qs, qh), (kb, ks) = _strides(q, k, fmt)
    out = torch.full((row1 - row0, heads, n_blocks), float("-inf"), dtype=torch.float32, device=q.device)
    if row1 <= row0 or seqlen_k == 0 or n_blocks == 0:
        return out
    if heads > MAX_TOPK_HEADS or dim > MAX_TOPK_DIM:
        raise ValueError(f"the Triton block-score kernel takes up to {MAX_TOPK_HEADS} heads of dim up to "
                         f"{MAX_TOPK_DIM}, got {heads} x {dim}; use backend='torch'")
    target = target_of(q.device)
    cfg = block_scores_config(target)
    options = cfg.launch(target)
    for r0, r1 in slices(target, row1 - row0, options.get("num_warps")):  # launches within the grid limits
        launch(target, _indexer_block_scores_kernel, (r1 - r0,), q, k, key_lo, key_hi, out[r0:r1], row0 + r0,
               seqlen_q, seqlen_k, heads, block_size, triton.cdiv(block_size, cfg.block), n_blocks, qb, qs, qh, kb,
               ks, HEAD_DIM=dim, BLOCK_H=max(16, triton.next_power_of_2(heads)),
               BLOCK_D=max(16, triton.next_power_of_2(dim)), BLOCK_N=cfg.block, ORIGIN_AT_LO=fmt == "thd",
               RELU=relu, DOT_PRECISION=dot_precision(q.dtype, target), **options)
    return out
