"""Varlen flash-attention backward: kernels and launcher.

Three kernels, all deterministic (no atomics):
1. ``_attn_bwd_preprocess_kernel``: delta = rowsum(dO * O) per query row, fp32;
2. ``_attn_bwd_dkdv_kernel``: one program per (key tile, kv head) accumulates dK/dV over the
   query blocks that see its keys and over every q head of its GQA group, in a fixed order, and
   stores once;
3. ``_attn_bwd_dq_kernel``: one program per (query tile, q head) accumulates dQ.
They take separate tile configs (kernels/configs/dense.py: a dK/dV tile has many keys and steps over
few queries, a dQ tile the reverse). Tiles, masks, block skipping, split q/k head dims, dropout
(the forward's keep mask, regenerated), layouts, the tile maps (one layout check per call for
both kernels: kernels/tile_map.py), the NaN answer to malformed cu_seqlens and ``PERSISTENT``
(Ascend) follow the forward. The softmax offset needs no change to dQ/dK/dV: the saved
lse includes its sink term, so P = exp(S - lse) is already the forward's probability; for the
offset's own gradient the dQ kernel can also sum P * dP per row in fp32 (``SINK_GRAD``).
Each kernel's lane offsets take the ``INT64_LANES`` variant when its tensors' strides need it
(``lane_flags``, per kernel from its own tile: kernels/attn_common.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from coreattn.kernels.attn_bias import bias_table_grad
from coreattn.kernels.attn_common import (LENGTH_STRIDES, TableBias, _batch_stride, _bias_band, _bias_near,
                                          _bias_row_grads, _bias_scores, _cols, _dropout_keep, _first_gid, _first_row,
                                          _key_range, _lane_offsets, _load_keep, _load_rows, _poison, _query_range,
                                          _store_rows, _tile_visible, _visible, batch_aligned, bias_args)
from coreattn.kernels.attn_fwd import (LOG2E, RUNTIME_INTS, bias_rows, dot_precision, dropout_args, kernel_window,
                                       lane_flags, launch_grid, mask_flags)
from coreattn.kernels.configs.base import head_blocks
from coreattn.kernels.configs.dense import bwd_configs, preprocess_config, split_dkdv
from coreattn.kernels.configs.pick import tuned_fallback
from coreattn.kernels.configs.space import loop_flags
from coreattn.kernels.configs.targets import target_of
from coreattn.kernels.device import on_device
from coreattn.kernels.launch import launch
from coreattn.kernels.descriptors import row_descriptor, row_descriptors, usable
from coreattn.kernels.packing import (Packing, keep_args, new_like, new_rowstat, rowstat_strides, seq_len_dim,
                                      seq_strides, side_stand_ins, stand_in)
from coreattn.kernels.tile_map import _tile_rows, _tile_seq, tile_bound, tile_maps
from coreattn.kernels.tuned_cache import launch_class


@triton.jit
def _preprocess_program(pid_m, b, head, out_ptr, do_ptr, delta_ptr, seqlen_total,
                        stride_ob, stride_ot, stride_oh, stride_db, stride_dt, stride_dh, stride_lb, stride_lh,
                        HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr,
                        INT64_LANES: tl.constexpr):
    """Row block pid_m of sample b (0 when packed), head ``head``; rows outside any sequence get
    harmless values."""
    b = b.to(tl.int64)
    head = head.to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_DV)
    r0 = pid_m.to(tl.int64) * BLOCK_M
    row_ok = offs_m < seqlen_total - pid_m * BLOCK_M  # int32 vector compare (Ascend: no int64 vectors)
    offs_r = tl.minimum(offs_m, seqlen_total - 1 - pid_m * BLOCK_M)  # rows inside the tensor
    cols = _cols(offs_d, HEAD_DIM_V, BLOCK_DV)
    mask = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM_V)
    o = tl.load(out_ptr + b * stride_ob + head * stride_oh + r0 * stride_ot
                + _lane_offsets(offs_r[:, None], stride_ot, INT64_LANES) + cols[None, :], mask=mask, other=0.0)
    do = tl.load(do_ptr + b * stride_db + head * stride_dh + r0 * stride_dt
                 + _lane_offsets(offs_r[:, None], stride_dt, INT64_LANES) + cols[None, :], mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    tl.store(delta_ptr + b * stride_lb + head * stride_lh + r0 + offs_r, delta, mask=row_ok)


# the batch strides follow S in bshd (S x H x D): never specialized (or S's parity would pick a compile), their
# alignment from BATCH_ALIGNED (attn_common.batch_aligned)
@triton.jit(do_not_specialize=["seqlen_total", "grid_m", "batch", "stride_lb", "stride_lh", "stride_ob", "stride_db"])
def _attn_bwd_preprocess_kernel(out_ptr, do_ptr, delta_ptr, seqlen_total, grid_m, batch, heads,
                                stride_ob, stride_ot, stride_oh, stride_db, stride_dt, stride_dh,
                                stride_lb, stride_lh,
                                HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr,
                                PERSISTENT: tl.constexpr, INT64_LANES: tl.constexpr,
                                BATCH_ALIGNED: tl.constexpr = False):
    # tasks: (grid_m row blocks, batch (1 when packed), heads), row blocks fastest; PERSISTENT:
    # those tasks over a core-count 1D grid
    stride_ob = _batch_stride(stride_ob, BATCH_ALIGNED)
    stride_db = _batch_stride(stride_db, BATCH_ALIGNED)
    if PERSISTENT:
        for task in range(tl.program_id(0), grid_m * batch * heads, tl.num_programs(0)):
            t = tl.minimum(task, grid_m * batch * heads - 1)  # addresses inside for any task (see attn_common)
            _preprocess_program(t % grid_m, t // (grid_m * heads), (t // grid_m) % heads, out_ptr, do_ptr,
                                delta_ptr, seqlen_total, stride_ob, stride_ot, stride_oh, stride_db, stride_dt,
                                stride_dh, stride_lb, stride_lh, HEAD_DIM_V, BLOCK_DV, BLOCK_M, INT64_LANES)
    else:
        task = tl.program_id(0)
        _preprocess_program(task % grid_m, task // (grid_m * heads), (task // grid_m) % heads, out_ptr, do_ptr,
                            delta_ptr, seqlen_total, stride_ob, stride_ot, stride_oh, stride_db, stride_dt, stride_dh,
                            stride_lb, stride_lh, HEAD_DIM_V, BLOCK_DV, BLOCK_M, INT64_LANES)


@triton.jit
def _load_row_stats(lse_base, delta_base, rows, row_mask, last_row):
    """lse in the log2 domain with -inf (rows that see no key) turned into +inf so p = 0; rows
    past ``last_row`` (the sequence's last) are read from it and masked."""
    at = tl.minimum(rows, last_row)
    lse = tl.load(lse_base + at, mask=row_mask, other=float("inf")) * 1.4426950408889634
    lse = tl.where(lse == float("-inf"), float("inf"), lse)
    delta = tl.load(delta_base + at, mask=row_mask, other=0.0)
    return lse, delta


@triton.jit
def _dkdv_q_step(dk, dk2, dv, head, m0, offs_m, k, k2, v, k_keep, q_seq, do_seq, lse_seq, delta_seq, q_keep_base,
                 stride_qt, stride_qh, stride_dot, stride_doh, stride_lh, stride_qks, cols, seqlen_q, seqlen_k, shift,
                 window_left, window_right, sm_scale_log2, seed, rng_offset, drop_head0, q_gid0, k_ids,
                 drop_threshold, drop_scale, q_desc, q2_desc, do_desc, q_row0, coef_seq, table_ptr, stride_ct,
                 stride_ch, stride_th, bias_lo, bias_extent, near_lo, near_hi, HEAD_DIM_QK: tl.constexpr,
                 HEAD_DIM_V: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DQK2: tl.constexpr, BLOCK_DV: tl.constexpr,
                 BLOCK_M: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_Q_KEEP: tl.constexpr,
                 HAS_K_KEEP: tl.constexpr, DROPOUT: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                 MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr, TMA: tl.constexpr, INT64_LANES: tl.constexpr,
                 BIAS: tl.constexpr, BIAS_RANK: tl.constexpr, BIAS_COEF: tl.constexpr, BIAS_CLAMP: tl.constexpr):
    """Query block [m0, m0 + BLOCK_M) of q head ``head``. TMA: q and dO through descriptors (row
    ``q_row0 + m0``); in the MASKED blocks, which hold the partial last block (see _dkdv_tile),
    their rows past the sequence (another sequence's) are zeroed: a P of 0 times a non-finite q or
    dO would be NaN in every key's dK/dV. Rows are clamped to the sequence's last (seqlen_q >= 1)."""
    h64 = tl.cast(head, tl.int64)
    rows = m0 + offs_m
    row_ok = rows < seqlen_q
    if TMA:
        q = q_desc.load([q_row0 + m0, (h64 * stride_qh).to(tl.int32)])  # [M, DQK]
        q2 = q
        if BLOCK_DQK2 > 0:
            q2 = q2_desc.load([q_row0 + m0, (h64 * stride_qh).to(tl.int32) + BLOCK_DQK])
        do = do_desc.load([q_row0 + m0, (h64 * stride_doh).to(tl.int32)])  # [M, DV]
        if MASKED:
            q = tl.where(row_ok[:, None], q, 0.0)
            if BLOCK_DQK2 > 0:
                q2 = tl.where(row_ok[:, None], q2, 0.0)
            do = tl.where(row_ok[:, None], do, 0.0)
    else:
        q, q2 = _load_rows(q_seq + h64 * stride_qh, stride_qt, m0, row_ok, seqlen_q - 1, HEAD_DIM_QK, BLOCK_DQK,
                           BLOCK_DQK2, BLOCK_M, INT64_LANES)  # [M, DQK]
        do, _ = _load_rows(do_seq + h64 * stride_doh, stride_dot, m0, row_ok, seqlen_q - 1, HEAD_DIM_V, BLOCK_DV, 0,
                           BLOCK_M, INT64_LANES)  # [M, DV]
    lse, delta = _load_row_stats(lse_seq + h64 * stride_lh, delta_seq + h64 * stride_lh, rows, row_ok, seqlen_q - 1)
    sT = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)  # [N, M]
    if BLOCK_DQK2 > 0:
        sT = tl.dot(k2, tl.trans(q2), sT, input_precision=DOT_PRECISION)
    sT = sT * sm_scale_log2
    if BIAS:  # the forward's bias, transposed: keys as rows; the step's q head's coefficients and table
        coef_ptrs = (coef_seq + h64 * stride_ch + tl.cast(m0, tl.int64) * stride_ct
                     + _lane_offsets(tl.minimum(offs_m, seqlen_q - 1 - m0)[None, :], stride_ct, INT64_LANES))
        if _bias_near(m0, near_lo, near_hi, BIAS_CLAMP):
            sT += _bias_scores(coef_ptrs, table_ptr + h64 * stride_th, rows[None, :] + shift - cols[:, None],
                               bias_lo, bias_extent, BIAS_RANK, BIAS_COEF, BIAS_CLAMP) * 1.4426950408889634
    pT = tl.math.exp2(sT - lse[None, :])
    if MASKED:
        vis = _visible(rows[None, :], cols[:, None], seqlen_k, shift, window_left, window_right, HAS_LEFT,
                       HAS_RIGHT, False)
        if HAS_K_KEEP:
            vis = vis & k_keep[:, None]
        if HAS_Q_KEEP:
            vis = vis & _load_keep(q_keep_base, stride_qks, m0, offs_m, seqlen_q, INT64_LANES)[None, :]
        pT = tl.where(vis, pT, 0.0)
    keep = pT == pT
    if DROPOUT:
        keep = _dropout_keep(seed, rng_offset, head + drop_head0, (q_gid0 + rows)[None, :], k_ids[:, None],
                             drop_threshold)
    if DV:
        pdT = pT
        if DROPOUT:
            pdT = tl.where(keep, pT * drop_scale, 0.0)
        dv += tl.dot(pdT.to(do.dtype), do, input_precision=DOT_PRECISION)
    if DK:
        dpT = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)  # [N, M]
        if DROPOUT:
            dpT = tl.where(keep, dpT * drop_scale, 0.0)
        dsT = (pT * (dpT - delta[None, :])).to(q.dtype)
        dk += tl.dot(dsT, q, input_precision=DOT_PRECISION)
        if BLOCK_DQK2 > 0:
            dk2 += tl.dot(dsT, q2, input_precision=DOT_PRECISION)
    return dk, dk2, dv


@triton.jit
def _dkdv_q_steps(dk, dk2, dv, k, k2, v, k_keep, q_seq, do_seq, lse_seq, delta_seq, q_keep_base, stride_qt,
                  stride_qh, stride_dot, stride_doh, stride_lh, stride_qks, cols, m_lo, m_hi, head0, group,
                  seqlen_q, seqlen_k, shift, window_left, window_right,
                  sm_scale_log2, seed, rng_offset, drop_head0, q_gid0, k_ids, drop_threshold, drop_scale,
                  q_desc, q2_desc, do_desc, q_row0, coef_seq, table_ptr, stride_ct, stride_ch, stride_th, bias_lo,
                  bias_extent, near_lo, near_hi,
                  HEAD_DIM_QK: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DQK: tl.constexpr,
                  BLOCK_DQK2: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr,
                  HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_Q_KEEP: tl.constexpr,
                  HAS_K_KEEP: tl.constexpr, DROPOUT: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                  MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr, TMA: tl.constexpr, WARP_SPEC: tl.constexpr,
                  INT64_LANES: tl.constexpr, BIAS: tl.constexpr, BIAS_RANK: tl.constexpr, BIAS_COEF: tl.constexpr,
                  BIAS_CLAMP: tl.constexpr):
    """Query blocks [m_lo, m_hi) of each q head head0 .. head0 + group - 1 (GQA), as one flat loop
    (block-major: the group's heads of a block one after the other), so no loop nests around the
    pipelined steps; WARP_SPEC as in the forward's _fwd_kv_steps. A step's head is ``step % group``,
    inside the group for any step, and its block ``step // group``: the only divisor is the group
    size, a kernel argument of at least 1. (23b22de divided by the block count instead, head-major,
    which is 0 for an empty range: the pipeliner computes iteration 0's addresses even when the loop
    runs zero times, and an H100 faulted on 0 // 0 there.) A block past the range, which the
    pipeliner prefetches past the last step, has its rows clamped like any other."""
    offs_m = tl.arange(0, BLOCK_M)
    n_blocks = tl.cdiv(m_hi - m_lo, BLOCK_M)
    if WARP_SPEC:
        for step in tl.range(0, n_blocks * group, warp_specialize=True):
            dk, dk2, dv = _dkdv_q_step(
                dk, dk2, dv, head0 + step % group, m_lo + (step // group) * BLOCK_M,
                offs_m, k, k2, v, k_keep, q_seq, do_seq, lse_seq, delta_seq, q_keep_base, stride_qt, stride_qh,
                stride_dot, stride_doh, stride_lh, stride_qks, cols, seqlen_q, seqlen_k, shift, window_left,
                window_right, sm_scale_log2, seed, rng_offset, drop_head0, q_gid0, k_ids, drop_threshold, drop_scale,
                q_desc, q2_desc, do_desc, q_row0, coef_seq, table_ptr, stride_ct, stride_ch, stride_th, bias_lo,
                bias_extent, near_lo, near_hi, HEAD_DIM_QK, HEAD_DIM_V, BLOCK_DQK, BLOCK_DQK2, BLOCK_DV, BLOCK_M,
                HAS_LEFT, HAS_RIGHT, HAS_Q_KEEP, HAS_K_KEEP, DROPOUT, DK, DV, MASKED, DOT_PRECISION, TMA, INT64_LANES,
                BIAS, BIAS_RANK, BIAS_COEF, BIAS_CLAMP)
    else:
        for step in range(0, n_blocks * group):
            dk, dk2, dv = _dkdv_q_step(
                dk, dk2, dv, head0 + step % group, m_lo + (step // group) * BLOCK_M,
                offs_m, k, k2, v, k_keep, q_seq, do_seq, lse_seq, delta_seq, q_keep_base, stride_qt, stride_qh,
                stride_dot, stride_doh, stride_lh, stride_qks, cols, seqlen_q, seqlen_k, shift, window_left,
                window_right, sm_scale_log2, seed, rng_offset, drop_head0, q_gid0, k_ids, drop_threshold, drop_scale,
                q_desc, q2_desc, do_desc, q_row0, coef_seq, table_ptr, stride_ct, stride_ch, stride_th, bias_lo,
                bias_extent, near_lo, near_hi, HEAD_DIM_QK, HEAD_DIM_V, BLOCK_DQK, BLOCK_DQK2, BLOCK_DV, BLOCK_M,
                HAS_LEFT, HAS_RIGHT, HAS_Q_KEEP, HAS_K_KEEP, DROPOUT, DK, DV, MASKED, DOT_PRECISION, TMA, INT64_LANES,
                BIAS, BIAS_RANK, BIAS_COEF, BIAS_CLAMP)
    return dk, dk2, dv


@triton.jit
def _dkdv_tile(task, q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, map_ptr, q_keep_ptr, k_keep_ptr,
               q_gid_ptr, k_gid_ptr, rng_ptr, q_desc, q2_desc, do_desc, table_ptr, coef_ptr, stride_cb, stride_ct,
               stride_ch, stride_th, bias_lo, bias_extent,
               batch, heads, n_tiles, seqlen_q_total, seqlen_k_total, group, sm_scale, sm_scale_log2,
               window_left, window_right, drop_threshold, drop_scale,
               stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
               stride_dob, stride_dot, stride_doh, stride_lb, stride_lh, stride_qkb, stride_qks, stride_kkb,
               stride_kks, stride_dkb, stride_dkt, stride_dkh, stride_dvb, stride_dvt, stride_dvh,
               HEAD_DIM_QK: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DQK: tl.constexpr,
               BLOCK_DQK2: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, BOTTOM_RIGHT: tl.constexpr,
               PACKED: tl.constexpr, HAS_Q_KEEP: tl.constexpr, HAS_K_KEEP: tl.constexpr,
               DROPOUT: tl.constexpr, HAS_GID: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
               DOT_PRECISION: tl.constexpr, TMA: tl.constexpr, WARP_SPEC: tl.constexpr, INT64_LANES: tl.constexpr,
               BIAS: tl.constexpr, BIAS_RANK: tl.constexpr, BIAS_COEF: tl.constexpr, BIAS_CLAMP: tl.constexpr):
    """Task ``task`` of the (key tile, kv head) grid, heads fastest (``heads`` = kv heads): dK and/or
    dV (DK, DV) of one key tile. TMA: q and dO through the descriptors ``q_desc`` (``q2_desc``) and
    ``do_desc`` (packed thd only)."""
    kv_head = task % heads
    tile = task // heads
    kv64 = kv_head.to(tl.int64)
    seq = _tile_seq(map_ptr, tile)
    if seq >= 0:
        if seq < batch:
            n0, q_start, seqlen_q, k_start, seqlen_k = _tile_rows(map_ptr, tile)
            seq64 = seq.to(tl.int64)
            shift = seqlen_q * 0
            if BOTTOM_RIGHT:
                shift = seqlen_k - seqlen_q
            q_row = _first_row(q_start, seqlen_q).to(tl.int64)  # the query loops' rows count from here
            q_seq = q_ptr + seq64 * stride_qb + q_row * stride_qt
            do_seq = do_ptr + seq64 * stride_dob + q_row * stride_dot
            stat_seq = seq64 * stride_lb + q_row
            k_base = k_ptr + seq64 * stride_kb + k_start.to(tl.int64) * stride_kt + kv64 * stride_kh
            v_base = v_ptr + seq64 * stride_vb + k_start.to(tl.int64) * stride_vt + kv64 * stride_vh
            q_keep_base = q_keep_ptr + seq64 * stride_qkb + q_row * stride_qks
            k_keep_base = k_keep_ptr + seq64 * stride_kkb + k_start.to(tl.int64) * stride_kks
            coef_seq = coef_ptr + seq64 * stride_cb + q_row * stride_ct  # BIAS: the query rows' coefficients
            # BIAS: the query blocks m0 whose distances to these keys meet the table (kernels/attn_common.py)
            near_lo, near_hi = _bias_band(n0 - shift, n0 - shift + (BLOCK_N - 1), BLOCK_M, 1 - bias_lo - bias_extent,
                                          bias_extent)
            cols = n0 + tl.arange(0, BLOCK_N)
            col_ok = cols < seqlen_k
            k_row0 = k_start + n0
            k, k2 = _load_rows(k_base, stride_kt, n0, col_ok, seqlen_k - 1, HEAD_DIM_QK, BLOCK_DQK, BLOCK_DQK2,
                               BLOCK_N, INT64_LANES)
            v, _ = _load_rows(v_base, stride_vt, n0, col_ok, seqlen_k - 1, HEAD_DIM_V, BLOCK_DV, 0, BLOCK_N,
                              INT64_LANES)
            k_keep = col_ok
            if HAS_K_KEEP:
                k_keep = _load_keep(k_keep_base, stride_kks, n0, tl.arange(0, BLOCK_N), seqlen_k, INT64_LANES)  # [N]
            seed = 0
            rng_offset = 0
            drop_head0 = 0  # the call's head offset in dropout's head ids
            q_gid0 = 0
            k_ids = cols
            if DROPOUT:
                seed = tl.load(rng_ptr)
                rng_offset = tl.load(rng_ptr + 1).to(tl.int32)
                drop_head0 = tl.load(rng_ptr + 2).to(tl.int32)
                q_gid0 = _first_gid(q_gid_ptr, seq, q_start, seqlen_q_total, PACKED, HAS_GID)
                k_ids = _first_gid(k_gid_ptr, seq, k_start, seqlen_k_total, PACKED, HAS_GID) + cols
            dk = tl.zeros([BLOCK_N, BLOCK_DQK if DK else 16], tl.float32)
            dk2 = dk
            if BLOCK_DQK2 > 0 and DK:
                dk2 = tl.zeros([BLOCK_N, BLOCK_DQK2], tl.float32)
            dv = tl.zeros([BLOCK_N, BLOCK_DV if DV else 16], tl.float32)
            lo, full_lo, full_hi, hi = _query_range(n0, seqlen_q, seqlen_k, shift, window_left, window_right,
                                                    BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT, HAS_Q_KEEP or HAS_K_KEEP)
            if TMA:  # the partial last query block into the masked tail, which zeroes its rows past seqlen_q
                full_hi = tl.minimum(full_hi, tl.maximum(seqlen_q // BLOCK_M * BLOCK_M, full_lo))
            dk, dk2, dv = _dkdv_q_steps(dk, dk2, dv, k, k2, v, k_keep, q_seq, do_seq, lse_ptr + stat_seq,
                                        delta_ptr + stat_seq, q_keep_base, stride_qt, stride_qh, stride_dot,
                                        stride_doh, stride_lh, stride_qks, cols, lo, full_lo, kv_head * group,
                                        group, seqlen_q, seqlen_k, shift, window_left, window_right, sm_scale_log2,
                                        seed, rng_offset, drop_head0, q_gid0, k_ids, drop_threshold, drop_scale,
                                        q_desc, q2_desc, do_desc, q_start, coef_seq, table_ptr, stride_ct,
                                        stride_ch, stride_th, bias_lo, bias_extent, near_lo, near_hi, HEAD_DIM_QK, HEAD_DIM_V,
                                        BLOCK_DQK, BLOCK_DQK2, BLOCK_DV, BLOCK_M, HAS_LEFT, HAS_RIGHT, HAS_Q_KEEP,
                                        HAS_K_KEEP, DROPOUT, DK, DV, True, DOT_PRECISION, TMA, WARP_SPEC, INT64_LANES,
                                        BIAS, BIAS_RANK, BIAS_COEF, BIAS_CLAMP)
            dk, dk2, dv = _dkdv_q_steps(dk, dk2, dv, k, k2, v, k_keep, q_seq, do_seq, lse_ptr + stat_seq,
                                        delta_ptr + stat_seq, q_keep_base, stride_qt, stride_qh, stride_dot,
                                        stride_doh, stride_lh, stride_qks, cols, full_lo, full_hi, kv_head * group,
                                        group, seqlen_q, seqlen_k, shift, window_left, window_right, sm_scale_log2,
                                        seed, rng_offset, drop_head0, q_gid0, k_ids, drop_threshold, drop_scale,
                                        q_desc, q2_desc, do_desc, q_start, coef_seq, table_ptr, stride_ct,
                                        stride_ch, stride_th, bias_lo, bias_extent, near_lo, near_hi, HEAD_DIM_QK, HEAD_DIM_V,
                                        BLOCK_DQK, BLOCK_DQK2, BLOCK_DV, BLOCK_M, HAS_LEFT, HAS_RIGHT, HAS_Q_KEEP,
                                        HAS_K_KEEP, DROPOUT, DK, DV, False, DOT_PRECISION, TMA, WARP_SPEC, INT64_LANES,
                                        BIAS, BIAS_RANK, BIAS_COEF, BIAS_CLAMP)
            dk, dk2, dv = _dkdv_q_steps(dk, dk2, dv, k, k2, v, k_keep, q_seq, do_seq, lse_ptr + stat_seq,
                                        delta_ptr + stat_seq, q_keep_base, stride_qt, stride_qh, stride_dot,
                                        stride_doh, stride_lh, stride_qks, cols, full_hi, hi, kv_head * group,
                                        group, seqlen_q, seqlen_k, shift, window_left, window_right, sm_scale_log2,
                                        seed, rng_offset, drop_head0, q_gid0, k_ids, drop_threshold, drop_scale,
                                        q_desc, q2_desc, do_desc, q_start, coef_seq, table_ptr, stride_ct,
                                        stride_ch, stride_th, bias_lo, bias_extent, near_lo, near_hi, HEAD_DIM_QK, HEAD_DIM_V,
                                        BLOCK_DQK, BLOCK_DQK2, BLOCK_DV, BLOCK_M, HAS_LEFT, HAS_RIGHT, HAS_Q_KEEP,
                                        HAS_K_KEEP, DROPOUT, DK, DV, True, DOT_PRECISION, TMA, WARP_SPEC, INT64_LANES,
                                        BIAS, BIAS_RANK, BIAS_COEF, BIAS_CLAMP)
            # the head offsets are added here and the rows counted from the sample's start, so no
            # more than one row index stays live over the loops (sm90 192/128 is at 254 registers)
            dk_base = dk_ptr + kv64 * stride_dkh
            dv_base = dv_ptr + kv64 * stride_dvh
            if not PACKED:  # thd: one sample (batch stride 0)
                dk_base += seq64 * stride_dkb
                dv_base += seq64 * stride_dvb
            k_last = k_start + seqlen_k - 1  # the sequence's last row, counted from the sample's start
            if DK:
                _store_rows(dk_base, stride_dkt, k_row0, col_ok, k_last, dk * sm_scale, dk2 * sm_scale, HEAD_DIM_QK,
                            BLOCK_DQK, BLOCK_DQK2, BLOCK_N, INT64_LANES)
            if DV:
                _store_rows(dv_base, stride_dvt, k_row0, col_ok, k_last, dv, dv, HEAD_DIM_V, BLOCK_DV, 0, BLOCK_N,
                            INT64_LANES)
    else:
        n_rows_k = seqlen_k_total
        if not PACKED:
            n_rows_k = batch * seqlen_k_total
        if DK:
            _poison(dk_ptr + kv64 * stride_dkh, tile, n_tiles, n_rows_k, seqlen_k_total, stride_dkb, stride_dkt,
                    HEAD_DIM_QK, BLOCK_DQK, BLOCK_N)
        if DV:
            _poison(dv_ptr + kv64 * stride_dvh, tile, n_tiles, n_rows_k, seqlen_k_total, stride_dvb, stride_dvt,
                    HEAD_DIM_V, BLOCK_DV, BLOCK_N)


@triton.jit(do_not_specialize=RUNTIME_INTS)
def _attn_bwd_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr,
    map_ptr, q_keep_ptr, k_keep_ptr, q_gid_ptr, k_gid_ptr, rng_ptr, q_desc, q2_desc, do_desc,
    table_ptr, coef_ptr, stride_cb, stride_ct, stride_ch, stride_th, bias_lo, bias_extent: tl.constexpr,
    batch, heads, n_tiles, seqlen_q_total, seqlen_k_total, group, sm_scale, sm_scale_log2, window_left, window_right,
    drop_threshold, drop_scale,
    stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_dob, stride_dot, stride_doh, stride_lb, stride_lh, stride_qkb, stride_qks, stride_kkb, stride_kks,
    stride_dkb, stride_dkt, stride_dkh, stride_dvb, stride_dvt, stride_dvh,
    HEAD_DIM_QK: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DQK2: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, BOTTOM_RIGHT: tl.constexpr,
    PACKED: tl.constexpr, HAS_Q_KEEP: tl.constexpr, HAS_K_KEEP: tl.constexpr, DROPOUT: tl.constexpr,
    HAS_GID: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, DOT_PRECISION: tl.constexpr, PERSISTENT: tl.constexpr,
    INT64_LANES: tl.constexpr, TMA: tl.constexpr = False, WARP_SPEC: tl.constexpr = False, BIAS: tl.constexpr = False,
    BIAS_RANK: tl.constexpr = 1, BIAS_COEF: tl.constexpr = False, BIAS_CLAMP: tl.constexpr = False,
):
    # grid: n_tiles key tiles x kv heads (``heads``) programs; PERSISTENT: those tasks over a
    # core-count 1D grid
    if PERSISTENT:
        for task in range(tl.program_id(0), n_tiles * heads, tl.num_programs(0)):
            t = tl.minimum(task, n_tiles * heads - 1)  # addresses inside for any task (see attn_common)
            _dkdv_tile(t, q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, map_ptr,
                       q_keep_ptr, k_keep_ptr, q_gid_ptr, k_gid_ptr, rng_ptr, q_desc, q2_desc, do_desc, table_ptr,
                       coef_ptr, stride_cb, stride_ct, stride_ch, stride_th, bias_lo, bias_extent, batch, heads,
                       n_tiles, seqlen_q_total, seqlen_k_total, group, sm_scale, sm_scale_log2, window_left,
                       window_right, drop_threshold, drop_scale, stride_qb, stride_qt, stride_qh, stride_kb,
                       stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_dob, stride_dot, stride_doh,
                       stride_lb, stride_lh, stride_qkb, stride_qks, stride_kkb, stride_kks, stride_dkb, stride_dkt,
                       stride_dkh, stride_dvb, stride_dvt, stride_dvh, HEAD_DIM_QK, HEAD_DIM_V, BLOCK_DQK,
                       BLOCK_DQK2, BLOCK_DV, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT, BOTTOM_RIGHT,
                       PACKED, HAS_Q_KEEP, HAS_K_KEEP, DROPOUT, HAS_GID, DK, DV, DOT_PRECISION, TMA, WARP_SPEC,
                       INT64_LANES, BIAS, BIAS_RANK, BIAS_COEF, BIAS_CLAMP)
    else:
        _dkdv_tile(tl.program_id(0), q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, map_ptr,
                   q_keep_ptr, k_keep_ptr, q_gid_ptr, k_gid_ptr, rng_ptr, q_desc, q2_desc, do_desc, table_ptr,
                   coef_ptr, stride_cb, stride_ct, stride_ch, stride_th, bias_lo, bias_extent, batch,
                   heads, n_tiles, seqlen_q_total, seqlen_k_total, group, sm_scale, sm_scale_log2, window_left,
                   window_right, drop_threshold, drop_scale, stride_qb, stride_qt, stride_qh, stride_kb, stride_kt,
                   stride_kh, stride_vb, stride_vt, stride_vh, stride_dob, stride_dot, stride_doh, stride_lb,
                   stride_lh, stride_qkb, stride_qks, stride_kkb, stride_kks, stride_dkb, stride_dkt, stride_dkh,
                   stride_dvb, stride_dvt, stride_dvh, HEAD_DIM_QK, HEAD_DIM_V, BLOCK_DQK, BLOCK_DQK2, BLOCK_DV,
                   BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT, BOTTOM_RIGHT, PACKED, HAS_Q_KEEP,
                   HAS_K_KEEP, DROPOUT, HAS_GID, DK, DV, DOT_PRECISION, TMA, WARP_SPEC, INT64_LANES, BIAS, BIAS_RANK,
                   BIAS_COEF, BIAS_CLAMP)


@triton.jit
def _dq_kv_step(dq, dq2, delta_exact, dcoef, far, n0, offs_n, q, q2, do, lse, delta, q_keep, k_base, v_base,
                k_keep_base, stride_kt, stride_vt, stride_kks, rows, seqlen_q, seqlen_k, shift, window_left,
                window_right, sm_scale_log2, seed, rng_offset, head, q_ids, k_gid0, drop_threshold, drop_scale,
                k_desc, k2_desc, v_desc, k_row0, k_col, v_col, coef_ptrs, table_base, bias_lo, bias_extent, near_lo, near_hi,
                HEAD_DIM_QK: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DQK: tl.constexpr,
                BLOCK_DQK2: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr,
                HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_Q_KEEP: tl.constexpr,
                HAS_K_KEEP: tl.constexpr, DROPOUT: tl.constexpr, SINK_GRAD: tl.constexpr, MASKED: tl.constexpr,
                DOT_PRECISION: tl.constexpr, TMA: tl.constexpr, INT64_LANES: tl.constexpr, BIAS: tl.constexpr,
                BIAS_RANK: tl.constexpr, BIAS_COEF: tl.constexpr, BIAS_CLAMP: tl.constexpr, BIAS_GRAD: tl.constexpr,
                BIAS_RB: tl.constexpr):
    """dQ over key block [n0, n0 + BLOCK_N); with SINK_GRAD also delta_exact += rowsum(P * dP) in
    fp32 (the softmax offset's gradient needs delta without the output's rounding); with BIAS the
    forward's bias joins the scores and, with BIAS_GRAD, its coefficients' gradient and the rows'
    sums beyond a clamped table accumulate (kernels/attn_common.py ``_bias_row_grads``). TMA: k and v
    through descriptors; in the MASKED (edge) blocks their rows past the sequence (another
    sequence's) are zeroed, since dS and P are 0 there and 0 * inf would be NaN. Rows are clamped to
    the sequence's last (seqlen_k >= 1)."""
    cols = n0 + offs_n
    col_ok = cols < seqlen_k
    if TMA:
        k = k_desc.load([k_row0 + n0, k_col])  # [N, DQK]
        k2 = k
        if BLOCK_DQK2 > 0:
            k2 = k2_desc.load([k_row0 + n0, k_col + BLOCK_DQK])
        v = v_desc.load([k_row0 + n0, v_col])  # [N, DV]
        if MASKED:
            k = tl.where(col_ok[:, None], k, 0.0)
            if BLOCK_DQK2 > 0:
                k2 = tl.where(col_ok[:, None], k2, 0.0)
            v = tl.where(col_ok[:, None], v, 0.0)
    else:
        k, k2 = _load_rows(k_base, stride_kt, n0, col_ok, seqlen_k - 1, HEAD_DIM_QK, BLOCK_DQK, BLOCK_DQK2,
                           BLOCK_N, INT64_LANES)  # [N, DQK]
        v, _ = _load_rows(v_base, stride_vt, n0, col_ok, seqlen_k - 1, HEAD_DIM_V, BLOCK_DV, 0, BLOCK_N,
                          INT64_LANES)  # [N, DV]
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [M, N]
    if BLOCK_DQK2 > 0:
        s = tl.dot(q2, tl.trans(k2), s, input_precision=DOT_PRECISION)
    s = s * sm_scale_log2
    dist = rows[:, None] + shift - cols[None, :]  # BIAS: query - key distance of each pair
    near = n0 == n0  # BIAS: whether the tile meets the bias's band (kernels/attn_common.py _bias_near)
    if BIAS:
        near = _bias_near(n0, near_lo, near_hi, BIAS_CLAMP)
        if near:
            s += _bias_scores(coef_ptrs, table_base, dist, bias_lo, bias_extent, BIAS_RANK, BIAS_COEF,
                              BIAS_CLAMP) * 1.4426950408889634
    p = tl.math.exp2(s - lse[:, None])
    if MASKED:
        vis = _tile_visible(rows, n0, offs_n, q_keep, k_keep_base, stride_kks, seqlen_k, shift, window_left,
                            window_right, HAS_LEFT, HAS_RIGHT, HAS_Q_KEEP, HAS_K_KEEP, INT64_LANES)
        p = tl.where(vis, p, 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)  # [M, N]
    if DROPOUT:
        keep = _dropout_keep(seed, rng_offset, head, q_ids[:, None], (k_gid0 + cols)[None, :], drop_threshold)
        dp = tl.where(keep, dp * drop_scale, 0.0)
    if SINK_GRAD:
        delta_exact += tl.sum(p * dp, 1)
    ds = p * (dp - delta[:, None])
    if BIAS_GRAD:
        if near:
            dcoef, far = _bias_row_grads(ds, p, dp, dcoef, far, table_base, dist, bias_lo, bias_extent, BIAS_RANK,
                                         BIAS_RB, BIAS_COEF, BIAS_CLAMP)
    ds = ds.to(k.dtype)
    dq += tl.dot(ds, k, input_precision=DOT_PRECISION)
    if BLOCK_DQK2 > 0:
        dq2 += tl.dot(ds, k2, input_precision=DOT_PRECISION)
    return dq, dq2, delta_exact, dcoef, far


@triton.jit
def _dq_kv_steps(dq, dq2, delta_exact, dcoef, far, q, q2, do, lse, delta, q_keep, k_base, v_base,
                 k_keep_base, stride_kt, stride_vt, stride_kks, rows, n_lo, n_hi, seqlen_q, seqlen_k, shift,
                 window_left, window_right, sm_scale_log2, seed, rng_offset, head, q_ids, k_gid0, drop_threshold,
                 drop_scale, k_desc, k2_desc, v_desc, k_row0, k_col, v_col, coef_ptrs, table_base, bias_lo,
                 bias_extent, near_lo, near_hi,
                 HEAD_DIM_QK: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DQK: tl.constexpr,
                 BLOCK_DQK2: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr,
                 HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_Q_KEEP: tl.constexpr,
                 HAS_K_KEEP: tl.constexpr, DROPOUT: tl.constexpr, SINK_GRAD: tl.constexpr, MASKED: tl.constexpr,
                 DOT_PRECISION: tl.constexpr, TMA: tl.constexpr, WARP_SPEC: tl.constexpr, INT64_LANES: tl.constexpr,
                 BIAS: tl.constexpr, BIAS_RANK: tl.constexpr, BIAS_COEF: tl.constexpr, BIAS_CLAMP: tl.constexpr,
                 BIAS_GRAD: tl.constexpr, BIAS_RB: tl.constexpr):
    """dQ over key blocks [n_lo, n_hi); WARP_SPEC as in the forward's _fwd_kv_steps."""
    offs_n = tl.arange(0, BLOCK_N)
    if WARP_SPEC:
        for n0 in tl.range(n_lo, n_hi, BLOCK_N, warp_specialize=True):
            dq, dq2, delta_exact, dcoef, far = _dq_kv_step(
                dq, dq2, delta_exact, dcoef, far, n0, offs_n, q, q2, do, lse, delta, q_keep, k_base, v_base,
                k_keep_base, stride_kt, stride_vt, stride_kks, rows, seqlen_q, seqlen_k, shift, window_left,
                window_right, sm_scale_log2, seed, rng_offset, head, q_ids, k_gid0, drop_threshold, drop_scale, k_desc,
                k2_desc, v_desc, k_row0, k_col, v_col, coef_ptrs, table_base, bias_lo, bias_extent, near_lo, near_hi, HEAD_DIM_QK,
                HEAD_DIM_V, BLOCK_DQK, BLOCK_DQK2, BLOCK_DV, BLOCK_N, HAS_LEFT, HAS_RIGHT, HAS_Q_KEEP, HAS_K_KEEP,
                DROPOUT, SINK_GRAD, MASKED, DOT_PRECISION, TMA, INT64_LANES, BIAS, BIAS_RANK, BIAS_COEF, BIAS_CLAMP,
                BIAS_GRAD, BIAS_RB)
    else:
        for n0 in range(n_lo, n_hi, BLOCK_N):
            dq, dq2, delta_exact, dcoef, far = _dq_kv_step(
                dq, dq2, delta_exact, dcoef, far, n0, offs_n, q, q2, do, lse, delta, q_keep, k_base, v_base,
                k_keep_base, stride_kt, stride_vt, stride_kks, rows, seqlen_q, seqlen_k, shift, window_left,
                window_right, sm_scale_log2, seed, rng_offset, head, q_ids, k_gid0, drop_threshold, drop_scale, k_desc,
                k2_desc, v_desc, k_row0, k_col, v_col, coef_ptrs, table_base, bias_lo, bias_extent, near_lo, near_hi, HEAD_DIM_QK,
                HEAD_DIM_V, BLOCK_DQK, BLOCK_DQK2, BLOCK_DV, BLOCK_N, HAS_LEFT, HAS_RIGHT, HAS_Q_KEEP, HAS_K_KEEP,
                DROPOUT, SINK_GRAD, MASKED, DOT_PRECISION, TMA, INT64_LANES, BIAS, BIAS_RANK, BIAS_COEF, BIAS_CLAMP,
                BIAS_GRAD, BIAS_RB)
    return dq, dq2, delta_exact, dcoef, far


@triton.jit
def _dq_tile(task, q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, dsink_ptr, map_ptr, q_keep_ptr, k_keep_ptr,
             q_gid_ptr, k_gid_ptr, rng_ptr, k_desc, k2_desc, v_desc, table_ptr, coef_ptr, stride_cb, stride_ct,
             stride_ch, stride_th, bias_lo, bias_extent, dcoef_ptr, far_ptr, stride_far,
             batch, heads, n_tiles, seqlen_q_total, seqlen_k_total, group, sm_scale, sm_scale_log2,
             window_left, window_right, drop_threshold, drop_scale,
             stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
             stride_dob, stride_dot, stride_doh, stride_lb, stride_lh, stride_qkb, stride_qks, stride_kkb,
             stride_kks, stride_dqb, stride_dqt, stride_dqh,
             HEAD_DIM_QK: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DQK: tl.constexpr,
             BLOCK_DQK2: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, BOTTOM_RIGHT: tl.constexpr,
             PACKED: tl.constexpr, HAS_Q_KEEP: tl.constexpr, HAS_K_KEEP: tl.constexpr,
             DROPOUT: tl.constexpr, HAS_GID: tl.constexpr, SINK_GRAD: tl.constexpr, DOT_PRECISION: tl.constexpr,
             TMA: tl.constexpr, WARP_SPEC: tl.constexpr, INT64_LANES: tl.constexpr, BIAS: tl.constexpr,
             BIAS_RANK: tl.constexpr, BIAS_COEF: tl.constexpr, BIAS_CLAMP: tl.constexpr, BIAS_GRAD: tl.constexpr,
             BIAS_RB: tl.constexpr):
    """Task ``task`` of the (query tile, q head) grid, heads fastest. With SINK_GRAD, rowsum(P * dP)
    of each row goes to ``dsink_ptr`` (lse's layout). With BIAS_GRAD, the bias coefficients' gradient
    goes to ``dcoef_ptr`` (fp32, the coefficients' layout and strides; BIAS_COEF) and, for a clamped
    table, each row's sums of dS beyond its ends to ``far_ptr`` (two fp32 buffers in lse's layout,
    ``stride_far`` apart). TMA: k and v through the descriptors ``k_desc`` (``k2_desc``) and
    ``v_desc`` (packed thd only)."""
    head = task % heads
    tile = task // heads
    h64 = head.to(tl.int64)
    dq_head = dq_ptr + h64 * stride_dqh
    seq = _tile_seq(map_ptr, tile)
    if seq >= 0:
        if seq < batch:
            m0, q_start, seqlen_q, k_start, seqlen_k = _tile_rows(map_ptr, tile)
            seq64 = seq.to(tl.int64)
            shift = seqlen_q * 0
            if BOTTOM_RIGHT:
                shift = seqlen_k - seqlen_q
            kv64 = (head // group).to(tl.int64)
            q_base = q_ptr + seq64 * stride_qb + q_start.to(tl.int64) * stride_qt + h64 * stride_qh
            do_base = do_ptr + seq64 * stride_dob + q_start.to(tl.int64) * stride_dot + h64 * stride_doh
            k_row = _first_row(k_start, seqlen_k).to(tl.int64)  # the key loops' rows count from here
            k_base = k_ptr + seq64 * stride_kb + k_row * stride_kt + kv64 * stride_kh
            v_base = v_ptr + seq64 * stride_vb + k_row * stride_vt + kv64 * stride_vh
            stat = seq64 * stride_lb + h64 * stride_lh + q_start.to(tl.int64)
            q_keep_base = q_keep_ptr + seq64 * stride_qkb + q_start.to(tl.int64) * stride_qks
            k_keep_base = k_keep_ptr + seq64 * stride_kkb + k_row * stride_kks
            rows = m0 + tl.arange(0, BLOCK_M)
            row_ok = rows < seqlen_q
            q, q2 = _load_rows(q_base, stride_qt, m0, row_ok, seqlen_q - 1, HEAD_DIM_QK, BLOCK_DQK, BLOCK_DQK2,
                               BLOCK_M, INT64_LANES)
            do, _ = _load_rows(do_base, stride_dot, m0, row_ok, seqlen_q - 1, HEAD_DIM_V, BLOCK_DV, 0, BLOCK_M,
                               INT64_LANES)
            lse, delta = _load_row_stats(lse_ptr + stat, delta_ptr + stat, rows, row_ok, seqlen_q - 1)
            q_keep = row_ok
            if HAS_Q_KEEP:
                q_keep = _load_keep(q_keep_base, stride_qks, m0, tl.arange(0, BLOCK_M), seqlen_q, INT64_LANES)  # [M]
            seed = 0
            rng_offset = 0
            drop_head = head  # the q head as dropout counts it: plus the call's head offset
            q_ids = rows
            k_gid0 = 0
            if DROPOUT:
                seed = tl.load(rng_ptr)
                rng_offset = tl.load(rng_ptr + 1).to(tl.int32)
                drop_head = head + tl.load(rng_ptr + 2).to(tl.int32)
                q_ids = _first_gid(q_gid_ptr, seq, q_start, seqlen_q_total, PACKED, HAS_GID) + rows
                k_gid0 = _first_gid(k_gid_ptr, seq, k_start, seqlen_k_total, PACKED, HAS_GID)
            # BIAS: the tile's rows' coefficients (rows clamped into the sequence) and the head's table
            coef_rows = (seq64 * stride_cb + q_start.to(tl.int64) * stride_ct + h64 * stride_ch
                         + tl.cast(m0, tl.int64) * stride_ct
                         + _lane_offsets(tl.minimum(tl.arange(0, BLOCK_M), seqlen_q - 1 - m0)[:, None], stride_ct,
                                         INT64_LANES))  # [M, 1] element offsets
            coef_ptrs = coef_ptr + coef_rows
            table_base = table_ptr + h64 * stride_th
            near_lo, near_hi = _bias_band(m0 + shift, m0 + shift + (BLOCK_M - 1), BLOCK_N, bias_lo, bias_extent)
            dq = tl.zeros([BLOCK_M, BLOCK_DQK], tl.float32)
            dq2 = dq
            if BLOCK_DQK2 > 0:
                dq2 = tl.zeros([BLOCK_M, BLOCK_DQK2], tl.float32)
            delta_exact = tl.zeros([BLOCK_M], tl.float32)
            dcoef = tl.zeros([BLOCK_M, BIAS_RB], tl.float32)
            far = tl.zeros([BLOCK_M, 4], tl.float32)
            lo, full_lo, full_hi, hi = _key_range(m0, seqlen_q, seqlen_k, shift, window_left, window_right,
                                                  BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT, HAS_Q_KEEP or HAS_K_KEEP)
            k_col = 0  # TMA: the kv head's first column in the [T, Hkv * D] views
            v_col = 0
            if TMA:
                k_col = (kv64 * stride_kh).to(tl.int32)
                v_col = (kv64 * stride_vh).to(tl.int32)
            dq, dq2, delta_exact, dcoef, far = _dq_kv_steps(
                dq, dq2, delta_exact, dcoef, far, q, q2, do, lse, delta, q_keep, k_base, v_base,
                k_keep_base, stride_kt, stride_vt, stride_kks, rows, lo, full_lo, seqlen_q, seqlen_k, shift,
                window_left, window_right, sm_scale_log2, seed, rng_offset, drop_head, q_ids, k_gid0, drop_threshold,
                drop_scale, k_desc, k2_desc, v_desc, k_start, k_col, v_col, coef_ptrs, table_base, bias_lo,
                bias_extent, near_lo, near_hi, HEAD_DIM_QK, HEAD_DIM_V, BLOCK_DQK, BLOCK_DQK2, BLOCK_DV, BLOCK_N, HAS_LEFT, HAS_RIGHT,
                HAS_Q_KEEP, HAS_K_KEEP, DROPOUT, SINK_GRAD, True, DOT_PRECISION, TMA, WARP_SPEC, INT64_LANES, BIAS,
                BIAS_RANK, BIAS_COEF, BIAS_CLAMP, BIAS_GRAD, BIAS_RB)
            dq, dq2, delta_exact, dcoef, far = _dq_kv_steps(
                dq, dq2, delta_exact, dcoef, far, q, q2, do, lse, delta, q_keep, k_base, v_base,
                k_keep_base, stride_kt, stride_vt, stride_kks, rows, full_lo, full_hi, seqlen_q, seqlen_k, shift,
                window_left, window_right, sm_scale_log2, seed, rng_offset, drop_head, q_ids, k_gid0, drop_threshold,
                drop_scale, k_desc, k2_desc, v_desc, k_start, k_col, v_col, coef_ptrs, table_base, bias_lo,
                bias_extent, near_lo, near_hi, HEAD_DIM_QK, HEAD_DIM_V, BLOCK_DQK, BLOCK_DQK2, BLOCK_DV, BLOCK_N, HAS_LEFT, HAS_RIGHT,
                HAS_Q_KEEP, HAS_K_KEEP, DROPOUT, SINK_GRAD, False, DOT_PRECISION, TMA, WARP_SPEC, INT64_LANES, BIAS,
                BIAS_RANK, BIAS_COEF, BIAS_CLAMP, BIAS_GRAD, BIAS_RB)
            dq, dq2, delta_exact, dcoef, far = _dq_kv_steps(
                dq, dq2, delta_exact, dcoef, far, q, q2, do, lse, delta, q_keep, k_base, v_base,
                k_keep_base, stride_kt, stride_vt, stride_kks, rows, full_hi, hi, seqlen_q, seqlen_k, shift,
                window_left, window_right, sm_scale_log2, seed, rng_offset, drop_head, q_ids, k_gid0, drop_threshold,
                drop_scale, k_desc, k2_desc, v_desc, k_start, k_col, v_col, coef_ptrs, table_base, bias_lo,
                bias_extent, near_lo, near_hi, HEAD_DIM_QK, HEAD_DIM_V, BLOCK_DQK, BLOCK_DQK2, BLOCK_DV, BLOCK_N, HAS_LEFT, HAS_RIGHT,
                HAS_Q_KEEP, HAS_K_KEEP, DROPOUT, SINK_GRAD, True, DOT_PRECISION, TMA, WARP_SPEC, INT64_LANES, BIAS,
                BIAS_RANK, BIAS_COEF, BIAS_CLAMP, BIAS_GRAD, BIAS_RB)
            dq_base = dq_head + seq64 * stride_dqb + q_start.to(tl.int64) * stride_dqt
            _store_rows(dq_base, stride_dqt, m0, row_ok, seqlen_q - 1, dq * sm_scale, dq2 * sm_scale, HEAD_DIM_QK,
                        BLOCK_DQK, BLOCK_DQK2, BLOCK_M, INT64_LANES)
            if SINK_GRAD:
                tl.store(dsink_ptr + stat + tl.minimum(rows, seqlen_q - 1), delta_exact, mask=row_ok)
            if BIAS_GRAD:
                if BIAS_COEF:
                    r_ids = tl.arange(0, BIAS_RB)
                    tl.store(dcoef_ptr + coef_rows + tl.minimum(r_ids, BIAS_RANK - 1)[None, :], dcoef,
                             mask=row_ok[:, None] & (r_ids[None, :] < BIAS_RANK))
                if BIAS_CLAMP:  # each row's dS beyond the ends: sum(p * dp) - rowsum(P * dP) * sum(p) (SINK_GRAD)
                    c = tl.arange(0, 4)[None, :]
                    far_lo = tl.sum(tl.where(c == 0, far, 0.0), 1) - delta_exact * tl.sum(tl.where(c == 1, far, 0.0), 1)
                    far_hi = tl.sum(tl.where(c == 2, far, 0.0), 1) - delta_exact * tl.sum(tl.where(c == 3, far, 0.0), 1)
                    far_rows = far_ptr + stat + tl.minimum(rows, seqlen_q - 1)
                    tl.store(far_rows, far_lo, mask=row_ok)
                    tl.store(far_rows + stride_far, far_hi, mask=row_ok)
    else:
        n_rows_q = seqlen_q_total
        if not PACKED:
            n_rows_q = batch * seqlen_q_total
        _poison(dq_head, tile, n_tiles, n_rows_q, seqlen_q_total, stride_dqb, stride_dqt, HEAD_DIM_QK, BLOCK_DQK,
                BLOCK_M)
        if SINK_GRAD:
            _poison(dsink_ptr + h64 * stride_lh, tile, n_tiles, n_rows_q, seqlen_q_total, stride_lb, 1, 1, 1, BLOCK_M)
        if BIAS_GRAD:
            if BIAS_COEF:
                _poison(dcoef_ptr + h64 * stride_ch, tile, n_tiles, n_rows_q, seqlen_q_total, stride_cb, stride_ct,
                        BIAS_RANK, BIAS_RB, BLOCK_M)
            if BIAS_CLAMP:
                _poison(far_ptr + h64 * stride_lh, tile, n_tiles, n_rows_q, seqlen_q_total, stride_lb, 1, 1, 1,
                        BLOCK_M)


@triton.jit(do_not_specialize=RUNTIME_INTS)
def _attn_bwd_dq_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, dsink_ptr,
    map_ptr, q_keep_ptr, k_keep_ptr, q_gid_ptr, k_gid_ptr, rng_ptr, k_desc, k2_desc, v_desc,
    table_ptr, coef_ptr, stride_cb, stride_ct, stride_ch, stride_th, bias_lo, bias_extent: tl.constexpr, dcoef_ptr, far_ptr,
    stride_far,
    batch, heads, n_tiles, seqlen_q_total, seqlen_k_total, group, sm_scale, sm_scale_log2, window_left, window_right,
    drop_threshold, drop_scale,
    stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_dob, stride_dot, stride_doh, stride_lb, stride_lh, stride_qkb, stride_qks, stride_kkb, stride_kks,
    stride_dqb, stride_dqt, stride_dqh,
    HEAD_DIM_QK: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DQK2: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, BOTTOM_RIGHT: tl.constexpr,
    PACKED: tl.constexpr, HAS_Q_KEEP: tl.constexpr, HAS_K_KEEP: tl.constexpr, DROPOUT: tl.constexpr,
    HAS_GID: tl.constexpr, SINK_GRAD: tl.constexpr, DOT_PRECISION: tl.constexpr, PERSISTENT: tl.constexpr,
    INT64_LANES: tl.constexpr, TMA: tl.constexpr = False, WARP_SPEC: tl.constexpr = False, BIAS: tl.constexpr = False,
    BIAS_RANK: tl.constexpr = 1, BIAS_COEF: tl.constexpr = False, BIAS_CLAMP: tl.constexpr = False,
    BIAS_GRAD: tl.constexpr = False, BIAS_RB: tl.constexpr = 1,
):
    # grid: n_tiles query tiles x q heads (``heads``) programs; PERSISTENT: those tasks over a
    # core-count 1D grid
    if PERSISTENT:
        for task in range(tl.program_id(0), n_tiles * heads, tl.num_programs(0)):
            t = tl.minimum(task, n_tiles * heads - 1)  # addresses inside for any task (see attn_common)
            _dq_tile(t, q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, dsink_ptr, map_ptr,
                     q_keep_ptr, k_keep_ptr, q_gid_ptr, k_gid_ptr, rng_ptr, k_desc, k2_desc, v_desc, table_ptr,
                     coef_ptr, stride_cb, stride_ct, stride_ch, stride_th, bias_lo, bias_extent, dcoef_ptr, far_ptr,
                     stride_far, batch, heads, n_tiles,
                     seqlen_q_total, seqlen_k_total, group, sm_scale, sm_scale_log2, window_left, window_right,
                     drop_threshold, drop_scale, stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
                     stride_vb, stride_vt, stride_vh, stride_dob, stride_dot, stride_doh, stride_lb, stride_lh,
                     stride_qkb, stride_qks, stride_kkb, stride_kks, stride_dqb, stride_dqt, stride_dqh,
                     HEAD_DIM_QK, HEAD_DIM_V, BLOCK_DQK, BLOCK_DQK2, BLOCK_DV, BLOCK_M, BLOCK_N,
                     HAS_LEFT, HAS_RIGHT, BOTTOM_RIGHT, PACKED, HAS_Q_KEEP, HAS_K_KEEP, DROPOUT, HAS_GID,
                     SINK_GRAD, DOT_PRECISION, TMA, WARP_SPEC, INT64_LANES, BIAS, BIAS_RANK, BIAS_COEF, BIAS_CLAMP,
                     BIAS_GRAD, BIAS_RB)
    else:
        _dq_tile(tl.program_id(0), q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, dsink_ptr, map_ptr,
                 q_keep_ptr, k_keep_ptr, q_gid_ptr, k_gid_ptr, rng_ptr, k_desc, k2_desc, v_desc, table_ptr, coef_ptr,
                 stride_cb, stride_ct, stride_ch, stride_th, bias_lo, bias_extent, dcoef_ptr, far_ptr, stride_far,
                 batch, heads, n_tiles,
                 seqlen_q_total, seqlen_k_total, group, sm_scale, sm_scale_log2, window_left, window_right,
                 drop_threshold, drop_scale, stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
                 stride_vb, stride_vt, stride_vh, stride_dob, stride_dot, stride_doh, stride_lb, stride_lh,
                 stride_qkb, stride_qks, stride_kkb, stride_kks, stride_dqb, stride_dqt, stride_dqh,
                 HEAD_DIM_QK, HEAD_DIM_V, BLOCK_DQK, BLOCK_DQK2, BLOCK_DV, BLOCK_M, BLOCK_N,
                 HAS_LEFT, HAS_RIGHT, BOTTOM_RIGHT, PACKED, HAS_Q_KEEP, HAS_K_KEEP, DROPOUT, HAS_GID,
                 SINK_GRAD, DOT_PRECISION, TMA, WARP_SPEC, INT64_LANES, BIAS, BIAS_RANK, BIAS_COEF, BIAS_CLAMP,
                 BIAS_GRAD, BIAS_RB)


@on_device
@tuned_fallback
def varlen_attn_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    lse: torch.Tensor, q_pack: Packing, k_pack: Packing, max_seqlen_q: int, max_seqlen_k: int,
                    softmax_scale: float, window_left: int = -1, window_right: int = -1, bottom_right: bool = True,
                    dq: torch.Tensor | None = None, dk: torch.Tensor | None = None, dv: torch.Tensor | None = None,
                    *, dropout_p: float = 0.0, rng_state: torch.Tensor | None = None,
                    sink_rowsum: torch.Tensor | None = None, bias: TableBias | None = None):
    """Launch the backward kernels; returns dq, dk, dv in the layouts and dtypes of q, k, v.

    ``dout`` may be any strided view with last stride 1 (it is made so if not); ``out`` and
    ``lse`` are the forward's (lse includes any softmax offset's sink term, so the offset is not
    needed here; its gradient is coreattn.layers.function.softmax_offset_grad). ``dropout_p`` and
    ``rng_state`` must be the forward's. Deterministic: no atomics; every gradient element inside
    a sequence is written once. ``max_seqlen_*`` are not used (the grids follow the token counts).
    ``dq``/``dk``/``dv`` may be given as preallocated buffers (rows outside spans are left as they are).
    ``sink_rowsum``: an fp32 buffer in lse's layout, zero-filled, that receives rowsum(P * dP) of each
    row, accumulated in fp32 from the unrounded P (the softmax offset's gradient:
    coreattn.layers.function.softmax_offset_grad); None skips it.
    ``bias``: the forward's additive bias (kernels/attn_common.py ``TableBias``); the result is then
    (dq, dk, dv, d_table, d_coef): its table's gradient (fp32, the table's shape; kernels/attn_bias.py)
    and its coefficients' (fp32 in the coefficients' layout, None without coefficients).
    """
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    heads_q, dim_qk = q.shape[-2:]
    heads_kv, dim_v = v.shape[-2:]
    batch = q_pack.batch
    dq = new_like(q, q_pack, dim_qk) if dq is None else dq
    dk = new_like(k, k_pack, dim_qk) if dk is None else dk
    dv = new_like(v, k_pack, dim_v) if dv is None else dv
    seqlen_q_total, seqlen_k_total = seq_len_dim(q, q_pack.fmt), seq_len_dim(k, k_pack.fmt)
    d_coef = None if bias is None or bias.coef is None else torch.zeros_like(bias.coef, dtype=torch.float32)
    done = (dq, dk, dv) if bias is None else (dq, dk, dv, torch.zeros_like(bias.table, dtype=torch.float32), d_coef)
    if batch == 0 or (q.numel() == 0 and k.numel() == 0):
        return done
    limit = max(seqlen_q_total, seqlen_k_total)
    window_left, window_right = kernel_window(window_left, limit), kernel_window(window_right, limit)
    target = target_of(q.device)
    block_dqk, block_dqk2, block_dv = head_blocks(dim_qk, dim_v)
    has_bias = bias is not None
    cls = launch_class(q, v, window_left, window_right, heads_kv=heads_kv, dropout=dropout_p > 0,
                       sink=sink_rowsum is not None, keep=q_pack.keep is not None or k_pack.keep is not None,
                       bias=has_bias)
    blocks = (block_dqk + block_dqk2, block_dv, q.element_size())
    cols = max(block_dqk + block_dqk2, block_dv)  # the widest row a kernel reads or writes
    bias_kind = False if not has_bias else "coef" if bias.coef is not None else True  # configs/dense.py
    cfg_dkdv, cfg_dq = bwd_configs(q.device, *blocks, dropout=dropout_p > 0, cls=cls, bias=bias_kind)
    lanes_dkdv = lane_flags(max(cfg_dkdv.block_m, cfg_dkdv.block_n), cols,
                            ((q_pack, (q, dout) + bias_rows(bias)), (k_pack, (k, v, dk, dv))))
    lanes_dq = lane_flags(max(cfg_dq.block_m, cfg_dq.block_n), cols,
                          ((q_pack, (q, dout, dq) + bias_rows(bias)), (k_pack, (k, v))))
    if lanes_dq["INT64_LANES"]:  # that variant's own tile where it has one (no more rows: still INT64_LANES)
        cfg_dq = bwd_configs(q.device, *blocks, dropout=dropout_p > 0, cls=cls, int64_lanes=True, bias=bias_kind)[1]
    cfg_pre = preprocess_config(q.device, *blocks, dropout=dropout_p > 0, cls=cls, bias=bias_kind)

    delta = new_rowstat(q, q_pack, fill=0.0)  # [H, T] or [B, H, S]
    if q.numel() > 0:
        pre_batch = 1 if q_pack.fmt == "thd" else batch
        grid_m = triton.cdiv(seqlen_q_total, cfg_pre.block_m)
        grid, persistent = launch_grid(q.device, target, grid_m * pre_batch, heads_q, vector_only=True)
        launch(
            target, _attn_bwd_preprocess_kernel, grid,
            out, dout, delta, seqlen_q_total, grid_m, pre_batch, heads_q, *seq_strides(out, q_pack.fmt),
            *seq_strides(dout, q_pack.fmt), *rowstat_strides(delta, q_pack),
            HEAD_DIM_V=dim_v, BLOCK_DV=block_dv, BLOCK_M=cfg_pre.block_m, PERSISTENT=persistent,
            **lane_flags(cfg_pre.block_m, block_dv, ((q_pack, (out, dout)),)), **cfg_pre.launch(),
            BATCH_ALIGNED=batch_aligned((*seq_strides(out, q_pack.fmt)[:2], *seq_strides(dout, q_pack.fmt)[:2])),
        )
    has_q, has_k = q.numel() > 0, k.numel() > 0
    # a side without any token still gets a row 0 for the other kernel's loops to address (packing.stand_in)
    q_pack, q, dout = side_stand_ins(q_pack, q, dout)
    k_pack, k, v = side_stand_ins(k_pack, k, v)
    lse, delta = stand_in(lse, -1), stand_in(delta, -1)
    if has_bias and bias.coef is not None:  # the coefficients are q-shaped: their stand-in too
        bias = bias._replace(coef=stand_in(bias.coef, 1 if q_pack.fmt == "bshd" else 0))
    common = dict(batch=batch, seqlen_q_total=seqlen_q_total, seqlen_k_total=seqlen_k_total,
                  group=heads_q // heads_kv, sm_scale=softmax_scale, sm_scale_log2=softmax_scale * LOG2E,
                  window_left=window_left, window_right=window_right,
                  **dict(zip(("stride_qb", "stride_qt", "stride_qh"), seq_strides(q, q_pack.fmt))),
                  **dict(zip(("stride_kb", "stride_kt", "stride_kh"), seq_strides(k, k_pack.fmt))),
                  **dict(zip(("stride_vb", "stride_vt", "stride_vh"), seq_strides(v, k_pack.fmt))),
                  **dict(zip(("stride_dob", "stride_dot", "stride_doh"), seq_strides(dout, q_pack.fmt))),
                  **dict(zip(("stride_lb", "stride_lh"), rowstat_strides(lse, q_pack))),
                  **dict(zip(("stride_qkb", "stride_qks"), keep_args(q_pack)[1:])),
                  **dict(zip(("stride_kkb", "stride_kks"), keep_args(k_pack)[1:])),
                  q_keep_ptr=keep_args(q_pack)[0], k_keep_ptr=keep_args(k_pack)[0],
                  HEAD_DIM_QK=dim_qk, HEAD_DIM_V=dim_v, BLOCK_DQK=block_dqk, BLOCK_DQK2=block_dqk2,
                  BLOCK_DV=block_dv, DOT_PRECISION=dot_precision(q.dtype, target),
                  **dropout_args(dropout_p, rng_state, q_pack, k_pack),
                  **mask_flags(window_left, window_right, bottom_right, q_pack, k_pack), **bias_args(bias, q_pack, lse))
    n_tiles_k = tile_bound(batch, seqlen_k_total, cfg_dkdv.block_n, k_pack.fmt == "thd")
    n_tiles_q = tile_bound(batch, seqlen_q_total, cfg_dq.block_m, q_pack.fmt == "thd")
    run_dkdv, run_dq = has_k and n_tiles_k > 0, has_q and n_tiles_q > 0
    if has_bias and sink_rowsum is None:  # the table's gradient sums dS over rows: it takes the exact rowsum(P * dP)
        sink_rowsum = stand_in(new_rowstat(q, q_pack, fill=0.0), -1)
    # a clamped bias table: the dQ kernel's sums of each row's dS beyond its ends, [2, lse's layout]
    far = torch.zeros((2,) + tuple(lse.shape), dtype=torch.float32, device=q.device) if has_bias and bias.clamp else None
    if run_dkdv or run_dq:  # one layout check for both kernels, a map for each
        dq_map, dkdv_map = tile_maps(q_pack, k_pack, seqlen_q_total, seqlen_k_total, target,
                                     q_tiles=(cfg_dq.block_m, n_tiles_q) if run_dq else None,
                                     k_tiles=(cfg_dkdv.block_n, n_tiles_k) if run_dkdv else None)
    if run_dkdv:
        grid, persistent = launch_grid(q.device, target, n_tiles_k, heads_kv)
        # wide heads: dK and dV accumulators together would not fit the register file, so two passes
        split = split_dkdv(block_dqk + block_dqk2, block_dv, target, dropout_p > 0, gqa=heads_q != heads_kv,
                           bias=bias_kind)
        passes = ((True, False), (False, True)) if split else ((True, True),)
        loop = loop_flags(cfg_dkdv, target, cfg_dkdv.tma and usable((q_pack, k_pack), ((q, block_dqk + block_dqk2),
                                                                                        (dout, block_dv))))
        q_desc, q2_desc = row_descriptors(q, cfg_dkdv.block_m, block_dqk, block_dqk2) if loop["TMA"] else (None, None)
        do_desc = row_descriptor(dout, cfg_dkdv.block_m, block_dv) if loop["TMA"] else None
        for do_dk, do_dv in passes:
            launch(target, _attn_bwd_dkdv_kernel, grid, q, k, v, dout, lse, delta, dk, dv, dkdv_map, heads=heads_kv,
                   n_tiles=n_tiles_k, q_desc=q_desc, q2_desc=q2_desc, do_desc=do_desc,
                   **dict(zip(("stride_dkb", "stride_dkt", "stride_dkh"), seq_strides(dk, k_pack.fmt))),
                   **dict(zip(("stride_dvb", "stride_dvt", "stride_dvh"), seq_strides(dv, k_pack.fmt))),
                   BLOCK_M=cfg_dkdv.block_m, BLOCK_N=cfg_dkdv.block_n, DK=do_dk, DV=do_dv, PERSISTENT=persistent,
                   **lanes_dkdv, **loop, **cfg_dkdv.launch(), **common)
    if run_dq:
        grid, persistent = launch_grid(q.device, target, n_tiles_q, heads_q)
        loop = loop_flags(cfg_dq, target, cfg_dq.tma and usable((q_pack, k_pack), ((k, block_dqk + block_dqk2),
                                                                                    (v, block_dv))))
        k_desc, k2_desc = row_descriptors(k, cfg_dq.block_n, block_dqk, block_dqk2) if loop["TMA"] else (None, None)
        launch(target, _attn_bwd_dq_kernel, grid, q, k, v, dout, lse, delta, dq,
               lse if sink_rowsum is None else sink_rowsum, dq_map, k_desc=k_desc, k2_desc=k2_desc,
               dcoef_ptr=lse if d_coef is None else d_coef, far_ptr=lse if far is None else far,
               stride_far=0 if far is None else far.stride(0), BIAS_GRAD=has_bias,
               BIAS_RB=max(16, triton.next_power_of_2(bias.table.shape[1])) if has_bias and bias.coef is not None
               else 1,
               v_desc=row_descriptor(v, cfg_dq.block_n, block_dv) if loop["TMA"] else None, heads=heads_q,
               n_tiles=n_tiles_q, SINK_GRAD=sink_rowsum is not None,
               **dict(zip(("stride_dqb", "stride_dqt", "stride_dqh"), seq_strides(dq, q_pack.fmt))),
               BLOCK_M=cfg_dq.block_m, BLOCK_N=cfg_dq.block_n, PERSISTENT=persistent, **lanes_dq, **loop,
               **cfg_dq.launch(), **common)
    if not has_bias:
        return dq, dk, dv
    d_table = bias_table_grad(dout, q, k, v, lse, sink_rowsum, q_pack, k_pack, softmax_scale, window_left,
                              window_right, bottom_right, bias, far, dropout_p, rng_state) if has_q else done[3]
    return dq, dk, dv, d_table, d_coef
