"""Varlen flash-attention forward: kernel and launcher.

One kernel for every case: causal/window masks, keep masks, dropout, softmax offsets (sinks) and
max logits are constexpr flags; head dims are real (HEAD_DIM_*) plus padded power-of-two blocks
(BLOCK_D*), and a q/k head dim that is not a power of two may be split into two blocks
(192 = 128 + 64) so its dot products cost what the real dim costs.

Grid: one program per (query tile, q head), the tiles of every sequence numbered one after the
other; each program reads its tile's sequence, first row and spans from the call's tile map
(kernels/tile_map.py: built once per call, which also checks the layout), so the grid is sized by
the token count alone, max_seqlen is never needed (an underestimate cannot lose rows) and a
program's work does not grow with the number of sequences. One query tile per program keeps the
kernel free of an outer loop around the pipelined key loop (which made Hopper spill). Lengths and
token counts are runtime ints that never specialize: a new packed batch never recompiles.
``PERSISTENT`` (Ascend) runs the same programs as tasks of a core-count 1D grid (kernels/configs/targets.py).
A tile's rows are an int64 base plus per-lane ``lane * stride``, in int32 unless ``INT64_LANES``,
which ``lane_flags`` sets when a stride times the tile's rows can pass 2**31 (strides only, never
lengths: kernels/attn_common.py ``_lane_offsets``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from coreattn.kernels.attn_common import (LENGTH_STRIDES, _bias_band, _bias_near, _bias_scores, _cols, _dropout_keep, _first_gid, _first_row,
                                          _key_range, _lane_offsets, _load_keep, _load_rows, _poison, _tile_visible,
                                          TableBias, bias_args, int64_lanes)
from coreattn.kernels.configs.base import head_blocks
from coreattn.kernels.configs.dense import fwd_config
from coreattn.kernels.configs.pick import tuned_fallback
from coreattn.kernels.configs.space import loop_flags
from coreattn.kernels.configs.targets import CDNA_TARGETS, persistent_grid, target_of
from coreattn.kernels.device import on_device
from coreattn.kernels.launch import launch
from coreattn.kernels.descriptors import row_descriptor, row_descriptors, usable
from coreattn.kernels.packing import (Packing, keep_args, kernel_flags, new_like, new_rowstat, rowstat_strides, seq_len_dim,
                                      seq_strides, side_stand_ins)
from coreattn.kernels.tile_map import _tile_rows, _tile_seq, tile_bound, tile_maps
from coreattn.kernels.tuned_cache import launch_class

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
MAX_TASKS = 2**31 - 1  # program ids and persistent task indices are int32
# runtime ints that follow the batch, its lengths or the dropout probability: never specialized
RUNTIME_INTS = ("batch", "n_tiles", "seqlen_q_total", "seqlen_k_total", "window_left", "window_right",
                "drop_threshold", *LENGTH_STRIDES)


@triton.jit
def _qk_scores(q, q2, k_base, stride_kt, n0, offs_n, col_ok, k_desc, k2_desc, k_row0, k_col,
               HEAD_DIM_QK: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DQK2: tl.constexpr, MASKED: tl.constexpr,
               DOT_PRECISION: tl.constexpr, TMA: tl.constexpr, INT64_LANES: tl.constexpr):
    """q @ k^T for keys [n0, n0 + N): [M, N] fp32. The q/k dims may come in two blocks (q2, the
    second, is [M, BLOCK_DQK2] when BLOCK_DQK2 > 0), so a non-power-of-two dim is not padded.
    TMA: k's rows come through descriptors over the packed [T, H * D] tensor (row ``k_row0 + n0``,
    column ``k_col``); rows past the sequence hold another sequence's keys, whose scores the
    caller's mask replaces. ``offs_n``: the block's key offsets, clamped to the last row of k."""
    if TMA:
        s = tl.dot(q, tl.trans(k_desc.load([k_row0 + n0, k_col])), input_precision=DOT_PRECISION)
        if BLOCK_DQK2 > 0:
            s = tl.dot(q2, tl.trans(k2_desc.load([k_row0 + n0, k_col + BLOCK_DQK])), s,
                       input_precision=DOT_PRECISION)
        return s
    offs_d = tl.arange(0, BLOCK_DQK)
    k_rows = k_base + tl.cast(n0, tl.int64) * stride_kt + _lane_offsets(offs_n[None, :], stride_kt, INT64_LANES)
    k_ptrs = k_rows + _cols(offs_d, HEAD_DIM_QK, BLOCK_DQK)[:, None]
    kd_mask = offs_d[:, None] < HEAD_DIM_QK
    if MASKED:
        kd_mask = kd_mask & col_ok[None, :]
    s = tl.dot(q, tl.load(k_ptrs, mask=kd_mask, other=0.0), input_precision=DOT_PRECISION)
    if BLOCK_DQK2 > 0:
        offs_d2 = BLOCK_DQK + tl.arange(0, BLOCK_DQK2)
        k2_ptrs = k_rows + _cols(offs_d2, HEAD_DIM_QK, BLOCK_DQK + BLOCK_DQK2)[:, None]
        kd2_mask = offs_d2[:, None] < HEAD_DIM_QK
        if MASKED:
            kd2_mask = kd2_mask & col_ok[None, :]
        s = tl.dot(q2, tl.load(k2_ptrs, mask=kd2_mask, other=0.0), s, input_precision=DOT_PRECISION)
    return s


@triton.jit
def _fwd_kv_step(acc, m_i, l_i, n0, offs_n, offs_dv, q, q2, q_keep, k_base, v_base, k_keep_base, stride_kt, stride_vt,
                 stride_kks, rows, seqlen_q, seqlen_k, shift, window_left, window_right, sm_scale_log2, seed,
                 rng_offset, head, q_ids, k_gid0, drop_threshold, k_desc, k2_desc, v_desc, k_row0, k_col, v_col,
                 coef_ptrs, table_base, bias_lo, bias_extent, near_lo, near_hi,
                 HEAD_DIM_QK: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DQK: tl.constexpr,
                 BLOCK_DQK2: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr,
                 HAS_RIGHT: tl.constexpr, HAS_Q_KEEP: tl.constexpr, HAS_K_KEEP: tl.constexpr, DROPOUT: tl.constexpr,
                 MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr, TMA: tl.constexpr, INT64_LANES: tl.constexpr,
                 BIAS: tl.constexpr, BIAS_RANK: tl.constexpr, BIAS_COEF: tl.constexpr, BIAS_CLAMP: tl.constexpr):
    """Key block [n0, n0 + BLOCK_N). TMA: k and v through descriptors; in the MASKED (edge) blocks
    the rows past the sequence are another sequence's (or zeros past T), so v's are zeroed there: a
    probability of 0 times a non-finite value would be NaN. The unmasked blocks lie inside the
    sequence. Key rows are clamped to the sequence's last (seqlen_k >= 1) for every iteration: the
    pipeliner loads ahead, also past the loop's last."""
    cols = n0 + offs_n
    col_ok = cols < seqlen_k
    offs_k = tl.minimum(offs_n, seqlen_k - 1 - n0)  # [N] rows from n0, inside the sequence
    s = _qk_scores(q, q2, k_base, stride_kt, n0, offs_k, col_ok, k_desc, k2_desc, k_row0, k_col, HEAD_DIM_QK,
                   BLOCK_DQK, BLOCK_DQK2, MASKED, DOT_PRECISION, TMA, INT64_LANES) * sm_scale_log2  # [M, N], log2
    if BIAS:  # the additive bias, from the pairs' distances (kernels/attn_common.py _bias_scores)
        if _bias_near(n0, near_lo, near_hi, BIAS_CLAMP):
            s += _bias_scores(coef_ptrs, table_base, rows[:, None] + shift - cols[None, :], bias_lo, bias_extent,
                              BIAS_RANK, BIAS_COEF, BIAS_CLAMP) * 1.4426950408889634
    if TMA:
        v = v_desc.load([k_row0 + n0, v_col])  # [N, DV]
        if MASKED:
            v = tl.where(col_ok[:, None], v, 0.0)
    else:
        v_ptrs = (v_base + tl.cast(n0, tl.int64) * stride_vt + _lane_offsets(offs_k[:, None], stride_vt, INT64_LANES)
                  + _cols(offs_dv, HEAD_DIM_V, BLOCK_DV)[None, :])
        if MASKED:
            v = tl.load(v_ptrs, mask=col_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V), other=0.0)
        else:
            v = tl.load(v_ptrs, mask=offs_dv[None, :] < HEAD_DIM_V, other=0.0)
    if MASKED:
        vis = _tile_visible(rows, n0, offs_n, q_keep, k_keep_base, stride_kks, seqlen_k, shift, window_left,
                            window_right, HAS_LEFT, HAS_RIGHT, HAS_Q_KEEP, HAS_K_KEEP, INT64_LANES)
        s = tl.where(vis, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # a row that has seen no key yet keeps m = -inf; subtract 0 instead so p and alpha are 0, not NaN
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)  # the normalizer counts every probability, dropped or not
    if DROPOUT:
        keep = _dropout_keep(seed, rng_offset, head, q_ids[:, None], (k_gid0 + cols)[None, :], drop_threshold)
        p = tl.where(keep, p, 0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _fwd_kv_steps(acc, m_i, l_i, q, q2, q_keep, k_base, v_base, k_keep_base, stride_kt, stride_vt, stride_kks,
                  rows, n_lo, n_hi, seqlen_q, seqlen_k, shift, window_left, window_right, sm_scale_log2,
                  seed, rng_offset, head, q_ids, k_gid0, drop_threshold, k_desc, k2_desc, v_desc, k_row0, k_col, v_col,
                  coef_ptrs, table_base, bias_lo, bias_extent, near_lo, near_hi,
                  HEAD_DIM_QK: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DQK: tl.constexpr,
                  BLOCK_DQK2: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr,
                  HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_Q_KEEP: tl.constexpr,
                  HAS_K_KEEP: tl.constexpr, DROPOUT: tl.constexpr, MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr,
                  TMA: tl.constexpr, WARP_SPEC: tl.constexpr, INT64_LANES: tl.constexpr, BIAS: tl.constexpr,
                  BIAS_RANK: tl.constexpr, BIAS_COEF: tl.constexpr, BIAS_CLAMP: tl.constexpr):
    """Key blocks [n_lo, n_hi). WARP_SPEC: the loop is warp-specialized (Triton splits loads, MMAs
    and softmax into partitions); it is a separate loop so that the plain one stays what
    Tritons without ``tl.range(warp_specialize=)`` (triton-ascend 3.2) parse."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_dv = tl.arange(0, BLOCK_DV)
    if WARP_SPEC:
        for n0 in tl.range(n_lo, n_hi, BLOCK_N, warp_specialize=True):
            acc, m_i, l_i = _fwd_kv_step(acc, m_i, l_i, n0, offs_n, offs_dv, q, q2, q_keep, k_base, v_base,
                                         k_keep_base, stride_kt,
                                         stride_vt, stride_kks, rows, seqlen_q, seqlen_k, shift, window_left,
                                         window_right, sm_scale_log2, seed, rng_offset, head, q_ids, k_gid0,
                                         drop_threshold, k_desc, k2_desc, v_desc, k_row0, k_col, v_col, coef_ptrs,
                                         table_base, bias_lo, bias_extent, near_lo, near_hi, HEAD_DIM_QK,
                                         HEAD_DIM_V, BLOCK_DQK, BLOCK_DQK2, BLOCK_DV, BLOCK_N, HAS_LEFT, HAS_RIGHT,
                                         HAS_Q_KEEP, HAS_K_KEEP, DROPOUT, MASKED, DOT_PRECISION, TMA, INT64_LANES,
                                         BIAS, BIAS_RANK, BIAS_COEF, BIAS_CLAMP)
    else:
        for n0 in range(n_lo, n_hi, BLOCK_N):
            acc, m_i, l_i = _fwd_kv_step(acc, m_i, l_i, n0, offs_n, offs_dv, q, q2, q_keep, k_base, v_base,
                                         k_keep_base, stride_kt,
                                         stride_vt, stride_kks, rows, seqlen_q, seqlen_k, shift, window_left,
                                         window_right, sm_scale_log2, seed, rng_offset, head, q_ids, k_gid0,
                                         drop_threshold, k_desc, k2_desc, v_desc, k_row0, k_col, v_col, coef_ptrs,
                                         table_base, bias_lo, bias_extent, near_lo, near_hi, HEAD_DIM_QK,
                                         HEAD_DIM_V, BLOCK_DQK, BLOCK_DQK2, BLOCK_DV, BLOCK_N, HAS_LEFT, HAS_RIGHT,
                                         HAS_Q_KEEP, HAS_K_KEEP, DROPOUT, MASKED, DOT_PRECISION, TMA, INT64_LANES,
                                         BIAS, BIAS_RANK, BIAS_COEF, BIAS_CLAMP)
    return acc, m_i, l_i


@triton.jit
def _fwd_tile(task, q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, map_ptr, q_keep_ptr, k_keep_ptr, q_gid_ptr, k_gid_ptr,
              rng_ptr, sink_ptr, max_ptr, k_desc, k2_desc, v_desc, table_ptr, coef_ptr, stride_cb, stride_ct, stride_ch,
              stride_th, bias_lo, bias_extent,
              batch, heads, n_tiles, seqlen_q_total, seqlen_k_total, group, sm_scale_log2, window_left, window_right,
              drop_threshold, drop_scale,
              stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
              stride_ob, stride_ot, stride_oh, stride_lb, stride_lh, stride_qkb, stride_qks, stride_kkb, stride_kks,
              HEAD_DIM_QK: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DQK: tl.constexpr,
              BLOCK_DQK2: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, BOTTOM_RIGHT: tl.constexpr,
              PACKED: tl.constexpr, HAS_Q_KEEP: tl.constexpr, HAS_K_KEEP: tl.constexpr,
              DROPOUT: tl.constexpr, HAS_GID: tl.constexpr, HAS_SINK: tl.constexpr, RETURN_MAX: tl.constexpr,
              DOT_PRECISION: tl.constexpr, TMA: tl.constexpr, WARP_SPEC: tl.constexpr, INT64_LANES: tl.constexpr,
              SINK_ROWS: tl.constexpr, BIAS: tl.constexpr, BIAS_RANK: tl.constexpr, BIAS_COEF: tl.constexpr,
              BIAS_CLAMP: tl.constexpr):
    """Task ``task`` of the (query tile, q head) grid, heads fastest. TMA: k and v are read through
    the descriptors ``k_desc`` (``k2_desc`` for a split q/k dim) and ``v_desc`` (packed thd only)."""
    head = task % heads
    tile = task // heads
    o_head = out_ptr + head.to(tl.int64) * stride_oh
    lse_head = lse_ptr + head.to(tl.int64) * stride_lh
    seq = _tile_seq(map_ptr, tile)
    if seq >= 0:
        if seq < batch:
            m0, q_start, seqlen_q, k_start, seqlen_k = _tile_rows(map_ptr, tile)
            seq64 = seq.to(tl.int64)
            shift = seqlen_q * 0
            if BOTTOM_RIGHT:
                shift = seqlen_k - seqlen_q
            kv_head = (head // group).to(tl.int64)
            q_base = q_ptr + seq64 * stride_qb + q_start.to(tl.int64) * stride_qt + head.to(tl.int64) * stride_qh
            k_row = _first_row(k_start, seqlen_k).to(tl.int64)  # the key loops' rows count from here
            k_base = k_ptr + seq64 * stride_kb + k_row * stride_kt + kv_head * stride_kh
            v_base = v_ptr + seq64 * stride_vb + k_row * stride_vt + kv_head * stride_vh
            q_keep_base = q_keep_ptr + seq64 * stride_qkb + q_start.to(tl.int64) * stride_qks
            k_keep_base = k_keep_ptr + seq64 * stride_kkb + k_row * stride_kks

            offs_m = tl.arange(0, BLOCK_M)
            offs_dv = tl.arange(0, BLOCK_DV)
            rows = m0 + offs_m
            row_ok = rows < seqlen_q
            q, q2 = _load_rows(q_base, stride_qt, m0, row_ok, seqlen_q - 1, HEAD_DIM_QK, BLOCK_DQK, BLOCK_DQK2,
                               BLOCK_M, INT64_LANES)
            q_keep = row_ok
            if HAS_Q_KEEP:
                q_keep = _load_keep(q_keep_base, stride_qks, m0, offs_m, seqlen_q, INT64_LANES)  # [M]
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

            coef_ptrs = coef_ptr  # BIAS: each row's coefficients (rows clamped into the sequence), the head's table
            table_base = table_ptr
            near_lo, near_hi = _bias_band(m0 + shift, m0 + shift + (BLOCK_M - 1), BLOCK_N, bias_lo, bias_extent)
            if BIAS:
                coef_ptrs = (coef_ptr + seq64 * stride_cb + q_start.to(tl.int64) * stride_ct + head.to(tl.int64)
                             * stride_ch + tl.cast(m0, tl.int64) * stride_ct
                             + _lane_offsets(tl.minimum(offs_m, seqlen_q - 1 - m0)[:, None], stride_ct, INT64_LANES))
                table_base = table_ptr + head.to(tl.int64) * stride_th
            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_M], tl.float32)
            acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
            lo, full_lo, full_hi, hi = _key_range(m0, seqlen_q, seqlen_k, shift, window_left, window_right,
                                                  BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT, HAS_Q_KEEP or HAS_K_KEEP)
            k_col = 0  # TMA: the kv head's first column in the [T, Hkv * D] views
            v_col = 0
            if TMA:
                k_col = (kv_head * stride_kh).to(tl.int32)
                v_col = (kv_head * stride_vh).to(tl.int32)
            acc, m_i, l_i = _fwd_kv_steps(acc, m_i, l_i, q, q2, q_keep, k_base, v_base, k_keep_base, stride_kt,
                                          stride_vt, stride_kks, rows, lo, full_lo, seqlen_q, seqlen_k, shift,
                                          window_left, window_right, sm_scale_log2, seed, rng_offset, drop_head,
                                          q_ids, k_gid0, drop_threshold, k_desc, k2_desc, v_desc, k_start, k_col,
                                          v_col, coef_ptrs, table_base, bias_lo, bias_extent, near_lo, near_hi, HEAD_DIM_QK,
                                          HEAD_DIM_V, BLOCK_DQK, BLOCK_DQK2, BLOCK_DV, BLOCK_N,
                                          HAS_LEFT, HAS_RIGHT, HAS_Q_KEEP, HAS_K_KEEP, DROPOUT, True, DOT_PRECISION,
                                          TMA, WARP_SPEC, INT64_LANES, BIAS, BIAS_RANK, BIAS_COEF, BIAS_CLAMP)
            acc, m_i, l_i = _fwd_kv_steps(acc, m_i, l_i, q, q2, q_keep, k_base, v_base, k_keep_base, stride_kt,
                                          stride_vt, stride_kks, rows, full_lo, full_hi, seqlen_q, seqlen_k, shift,
                                          window_left, window_right, sm_scale_log2, seed, rng_offset, drop_head,
                                          q_ids, k_gid0, drop_threshold, k_desc, k2_desc, v_desc, k_start, k_col,
                                          v_col, coef_ptrs, table_base, bias_lo, bias_extent, near_lo, near_hi, HEAD_DIM_QK,
                                          HEAD_DIM_V, BLOCK_DQK, BLOCK_DQK2, BLOCK_DV, BLOCK_N,
                                          HAS_LEFT, HAS_RIGHT, HAS_Q_KEEP, HAS_K_KEEP, DROPOUT, False,
                                          DOT_PRECISION, TMA, WARP_SPEC, INT64_LANES, BIAS, BIAS_RANK,
                                          BIAS_COEF, BIAS_CLAMP)
            acc, m_i, l_i = _fwd_kv_steps(acc, m_i, l_i, q, q2, q_keep, k_base, v_base, k_keep_base, stride_kt,
                                          stride_vt, stride_kks, rows, full_hi, hi, seqlen_q, seqlen_k, shift,
                                          window_left, window_right, sm_scale_log2, seed, rng_offset, drop_head,
                                          q_ids, k_gid0, drop_threshold, k_desc, k2_desc, v_desc, k_start, k_col,
                                          v_col, coef_ptrs, table_base, bias_lo, bias_extent, near_lo, near_hi, HEAD_DIM_QK,
                                          HEAD_DIM_V, BLOCK_DQK, BLOCK_DQK2, BLOCK_DV, BLOCK_N,
                                          HAS_LEFT, HAS_RIGHT, HAS_Q_KEEP, HAS_K_KEEP, DROPOUT, True, DOT_PRECISION,
                                          TMA, WARP_SPEC, INT64_LANES, BIAS, BIAS_RANK, BIAS_COEF, BIAS_CLAMP)
            if RETURN_MAX:  # the largest visible scaled logit of this tile (before the sink joins the max)
                tl.store(max_ptr + head.to(tl.int64) * n_tiles + tile,
                         tl.max(tl.where(row_ok, m_i, float("-inf")), 0) * 0.6931471805599453)
            if HAS_SINK:  # the sink: one more key with logit offset[head] (log2 domain here) and a zero value
                if SINK_ROWS:  # one logit per row and head, in lse's layout (and strides)
                    sink_rows = (sink_ptr + head.to(tl.int64) * stride_lh + seq64 * stride_lb
                                 + q_start.to(tl.int64) + tl.cast(m0, tl.int64))
                    sink = tl.load(sink_rows + tl.minimum(offs_m, seqlen_q - 1 - m0)).to(tl.float32)
                    sink = sink * 1.4426950408889634
                else:
                    sink = tl.load(sink_ptr + head).to(tl.float32) * 1.4426950408889634
                m_fin = tl.maximum(m_i, sink)
                alpha = tl.math.exp2(m_i - m_fin)
                l_i = l_i * alpha + tl.math.exp2(sink - m_fin)
                acc = acc * alpha[:, None]
                m_i = m_fin
            empty = l_i == 0.0  # the row saw no key (and there is no sink): output 0 and lse = -inf
            l_safe = tl.where(empty, 1.0, l_i)
            out = acc * (drop_scale / l_safe)[:, None]
            lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * 0.6931471805599453)
            o_base = o_head + seq64 * stride_ob + q_start.to(tl.int64) * stride_ot
            o_rows = tl.minimum(offs_m, seqlen_q - 1 - m0)  # [M] rows from m0, inside the sequence
            o_ptrs = (o_base + tl.cast(m0, tl.int64) * stride_ot + _lane_offsets(o_rows[:, None], stride_ot,
                                                                                 INT64_LANES)
                      + _cols(offs_dv, HEAD_DIM_V, BLOCK_DV)[None, :])
            tl.store(o_ptrs, out.to(o_base.dtype.element_ty), mask=row_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V))
            lse_base = lse_head + seq64 * stride_lb + q_start.to(tl.int64)
            tl.store(lse_base + tl.cast(m0, tl.int64) + o_rows, lse, mask=row_ok)
    else:
        # malformed cu_seqlens or spans (the map tells every program): NaN rather than silently wrong numbers
        n_rows_q = seqlen_q_total
        if not PACKED:
            n_rows_q = batch * seqlen_q_total
        _poison(o_head, tile, n_tiles, n_rows_q, seqlen_q_total, stride_ob, stride_ot, HEAD_DIM_V, BLOCK_DV, BLOCK_M)
        _poison(lse_head, tile, n_tiles, n_rows_q, seqlen_q_total, stride_lb, 1, 1, 1, BLOCK_M)
        if RETURN_MAX:
            tl.store(max_ptr + head.to(tl.int64) * n_tiles + tile, float("nan"))


@triton.jit(do_not_specialize=RUNTIME_INTS)
def _varlen_attn_fwd_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, map_ptr, q_keep_ptr, k_keep_ptr, q_gid_ptr, k_gid_ptr, rng_ptr, sink_ptr,
    max_ptr, k_desc, k2_desc, v_desc, table_ptr, coef_ptr, stride_cb, stride_ct, stride_ch, stride_th, bias_lo,
    bias_extent: tl.constexpr,
    batch, heads, n_tiles, seqlen_q_total, seqlen_k_total, group, sm_scale_log2, window_left, window_right,
    drop_threshold, drop_scale,
    stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_ob, stride_ot, stride_oh, stride_lb, stride_lh, stride_qkb, stride_qks, stride_kkb, stride_kks,
    HEAD_DIM_QK: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DQK2: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, BOTTOM_RIGHT: tl.constexpr,
    PACKED: tl.constexpr, HAS_Q_KEEP: tl.constexpr, HAS_K_KEEP: tl.constexpr, DROPOUT: tl.constexpr,
    HAS_GID: tl.constexpr, HAS_SINK: tl.constexpr, RETURN_MAX: tl.constexpr, DOT_PRECISION: tl.constexpr,
    PERSISTENT: tl.constexpr, INT64_LANES: tl.constexpr, TMA: tl.constexpr = False, WARP_SPEC: tl.constexpr = False,
    SINK_ROWS: tl.constexpr = False, BIAS: tl.constexpr = False, BIAS_RANK: tl.constexpr = 1,
    BIAS_COEF: tl.constexpr = False, BIAS_CLAMP: tl.constexpr = False,
):
    # grid: n_tiles * heads programs (CUDA, interpreter), or PERSISTENT (Ascend): a core-count 1D
    # grid whose programs run those same tasks in turn. seqlen_*_total is the token count T (thd)
    # or the padded length S (bshd/sbhd); see kernels/packing.py.
    if PERSISTENT:
        for task in range(tl.program_id(0), n_tiles * heads, tl.num_programs(0)):
            t = tl.minimum(task, n_tiles * heads - 1)  # addresses inside for any task (see attn_common)
            _fwd_tile(t, q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, map_ptr,
                      q_keep_ptr, k_keep_ptr, q_gid_ptr, k_gid_ptr, rng_ptr, sink_ptr, max_ptr, k_desc, k2_desc, v_desc,
                      table_ptr, coef_ptr, stride_cb, stride_ct, stride_ch, stride_th, bias_lo, bias_extent, batch, heads, n_tiles,
                      seqlen_q_total, seqlen_k_total, group, sm_scale_log2, window_left, window_right,
                      drop_threshold, drop_scale, stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
                      stride_vb, stride_vt, stride_vh, stride_ob, stride_ot, stride_oh, stride_lb, stride_lh,
                      stride_qkb, stride_qks, stride_kkb, stride_kks, HEAD_DIM_QK, HEAD_DIM_V, BLOCK_DQK,
                      BLOCK_DQK2, BLOCK_DV, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT, BOTTOM_RIGHT,
                      PACKED, HAS_Q_KEEP, HAS_K_KEEP, DROPOUT, HAS_GID, HAS_SINK, RETURN_MAX, DOT_PRECISION, TMA,
                      WARP_SPEC, INT64_LANES, SINK_ROWS, BIAS, BIAS_RANK, BIAS_COEF, BIAS_CLAMP)
    else:
        _fwd_tile(tl.program_id(0), q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, map_ptr,
                  q_keep_ptr, k_keep_ptr, q_gid_ptr, k_gid_ptr, rng_ptr, sink_ptr, max_ptr, k_desc, k2_desc, v_desc,
                  table_ptr, coef_ptr, stride_cb, stride_ct, stride_ch, stride_th, bias_lo, bias_extent, batch, heads, n_tiles,
                  seqlen_q_total, seqlen_k_total, group, sm_scale_log2, window_left, window_right,
                  drop_threshold, drop_scale, stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
                  stride_vb, stride_vt, stride_vh, stride_ob, stride_ot, stride_oh, stride_lb, stride_lh,
                  stride_qkb, stride_qks, stride_kkb, stride_kks, HEAD_DIM_QK, HEAD_DIM_V, BLOCK_DQK,
                  BLOCK_DQK2, BLOCK_DV, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT, BOTTOM_RIGHT,
                  PACKED, HAS_Q_KEEP, HAS_K_KEEP, DROPOUT, HAS_GID, HAS_SINK, RETURN_MAX, DOT_PRECISION, TMA,
                  WARP_SPEC, INT64_LANES, SINK_ROWS, BIAS, BIAS_RANK, BIAS_COEF, BIAS_CLAMP)


def dot_precision(dtype: torch.dtype, target: str) -> str:
    """fp32 inputs run at IEEE precision (no TF32); 16-bit inputs use the native MMA. Ascend
    accepts only "ieee" and "hf32", Triton's HIP backend "ieee" and bf16x3/bf16x6 (tf32 on gfx942
    only): 16-bit inputs are exact there either way and still take the MFMA, and fp32 takes
    CDNA's fp32 MFMA (v_mfma_f32_*_f32), which is IEEE."""
    return "ieee" if dtype == torch.float32 or target == "ascend" or target in CDNA_TARGETS else "tf32"


def launch_grid(device: torch.device, target: str, n_tiles: int, heads: int,
                vector_only: bool = False) -> tuple[tuple[int], bool]:
    """(grid, PERSISTENT) for a kernel whose programs are n_tiles * heads tasks: that 1D grid on
    CUDA, HIP and the interpreter (``launch``, kernels/launch.py, loops it where it passes the target's
    limits); on Ascend a persistent grid of core-count programs that loop over the tasks
    (kernels/configs/targets.py)."""
    tasks = n_tiles * heads
    if tasks > MAX_TASKS:
        raise ValueError(f"{n_tiles} tiles x {heads} heads = {tasks} programs exceed the int32 grid of the Triton "
                         "kernels; split the batch")
    if target != "ascend":
        return (tasks,), False
    programs = persistent_grid(device, tasks, vector_only)
    if tasks - 1 + programs > MAX_TASKS:  # the task loop's int32 counter steps past the last task by the grid
        raise ValueError(f"{n_tiles} tiles x {heads} heads = {tasks} tasks over {programs} programs overflow the "
                         "int32 task counter of the persistent kernels; split the batch")
    return (programs,), True


def lane_flags(rows: int, cols: int, sides) -> dict:
    """``INT64_LANES`` for a kernel whose tiles have at most ``rows`` rows and ``cols`` columns, over
    ``sides``: (packing, tensors in its layout) pairs whose token strides, and the packing's keep
    mask's position stride, its lanes multiply (kernels/attn_common.py ``int64_lanes``)."""
    strides = [keep_args(pack)[2] for pack, _ in sides]
    strides += [seq_strides(x, pack.fmt)[1] for pack, tensors in sides for x in tensors]
    return dict(INT64_LANES=int64_lanes(rows, strides, cols))


def bias_rows(bias: TableBias | None) -> tuple:
    """The bias tensors in q's layout whose rows a kernel's lanes address (for ``lane_flags``)."""
    return () if bias is None or bias.coef is None else (bias.coef,)


def sink_arg(softmax_offset: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """The sink logits as the forward kernel reads them: ``[Hq]``, or one per row and head in lse's
    layout (``[Hq, T]`` / ``[B, Hq, S]``), read with lse's strides (copied into them if they differ)."""
    if softmax_offset.dim() == 1 or softmax_offset.stride() == lse.stride():
        return softmax_offset
    return torch.empty_like(lse, dtype=softmax_offset.dtype).copy_(softmax_offset)


def kernel_window(window: int, limit: int) -> int:
    """A window at least as wide as every sequence (``limit``: the larger of the q and k token
    counts or padded lengths) sees everything it would see unbounded, so clamp it there: the
    kernels' int32 index arithmetic (``i + shift +- window``) then cannot overflow. -1 stays -1."""
    return min(window, limit)


def mask_flags(window_left: int, window_right: int, bottom_right: bool, q_pack: Packing, k_pack: Packing) -> dict:
    return dict(HAS_LEFT=window_left >= 0, HAS_RIGHT=window_right >= 0, BOTTOM_RIGHT=bottom_right,
                PACKED=q_pack.fmt == "thd", **kernel_flags(q_pack, k_pack))


def dropout_args(dropout_p: float, rng_state: torch.Tensor | None, q_pack: Packing, k_pack: Packing) -> dict:
    """Kernel arguments for dropout (coreattn/kernels/dropout.py): the RNG state tensor, the keep
    threshold and 1 / (1 - p); given token ids (``Packing.gid``) when the packings carry them."""
    from coreattn.kernels.dropout import keep_threshold

    if dropout_p > 0 and rng_state is None:
        raise ValueError("dropout_p > 0 needs rng_state (coreattn.kernels.dropout.rng_state)")
    has_gid = q_pack.gid is not None or k_pack.gid is not None
    if has_gid and (q_pack.gid is None or k_pack.gid is None):
        raise ValueError("give dropout token ids (Packing.gid) for both q and k, or for neither")
    dummy = q_pack.seq
    return dict(q_gid_ptr=q_pack.gid if has_gid else dummy, k_gid_ptr=k_pack.gid if has_gid else dummy,
                rng_ptr=rng_state if dropout_p > 0 else dummy, drop_threshold=keep_threshold(dropout_p),
                drop_scale=1.0 / (1.0 - dropout_p), DROPOUT=dropout_p > 0, HAS_GID=has_gid and dropout_p > 0)


@on_device
@tuned_fallback
def varlen_attn_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pack: Packing, k_pack: Packing,
                    max_seqlen_q: int, softmax_scale: float, window_left: int = -1, window_right: int = -1,
                    bottom_right: bool = True, out: torch.Tensor | None = None, lse: torch.Tensor | None = None, *,
                    dropout_p: float = 0.0, rng_state: torch.Tensor | None = None,
                    softmax_offset: torch.Tensor | None = None, return_max_logit: bool = False,
                    bias: TableBias | None = None):
    """Launch the forward kernel on q/k/v laid out as ``q_pack``/``k_pack`` say (kernels/packing.py).

    thd: q [Tq, Hq, Dqk], k [Tk, Hkv, Dqk], v [Tk, Hkv, Dv]; returns out [Tq, Hq, Dv] (q's
    dtype) and lse [Hq, Tq] float32 (natural log, -inf for rows that see no key and no sink).
    bshd/sbhd: out in the same layout as q and lse [B, Hq, S]. In span mode rows outside the
    spans are zeros (lse -inf); rows a keep mask drops see no key. ``max_seqlen_q`` is not used:
    the grid is sized by the token count. Last strides must be 1; inputs are assumed checked by
    the caller (coreattn.layers.checks). ``out``/``lse`` may be given as preallocated buffers.

    ``dropout_p``/``rng_state``: dropout with the keep mask of coreattn/kernels/dropout.py (rng_state
    the int64 [3] tensor it draws). ``softmax_offset``: float sink logits, [Hq] or one per row and
    head in lse's layout ([Hq, Tq] / [B, Hq, S]) (lse includes the sink). ``return_max_logit``: also
    return the max visible scaled logit per q head, float32 [Hq] (-inf for a head without a visible
    pair): the result is then (out, lse, max_logit). ``bias``: an additive bias computed in
    registers (kernels/attn_common.py ``TableBias``; not with return_max_logit).
    """
    heads_q, dim_qk = q.shape[-2:]
    heads_kv, dim_v = v.shape[-2:]
    batch = q_pack.batch
    if out is None:
        out = new_like(q, q_pack, dim_v)
    if lse is None:
        lse = new_rowstat(q, q_pack)
    seqlen_q_total, seqlen_k_total = seq_len_dim(q, q_pack.fmt), seq_len_dim(k, k_pack.fmt)
    target = target_of(q.device)
    block_dqk, block_dqk2, block_dv = head_blocks(dim_qk, dim_v)
    cls = launch_class(q, v, window_left, window_right, heads_kv=heads_kv, dropout=dropout_p > 0,
                       sink=softmax_offset is not None, max_logit=return_max_logit,
                       keep=q_pack.keep is not None or k_pack.keep is not None, bias=bias is not None)
    cfg = fwd_config(q.device, block_dqk + block_dqk2, block_dv, q.element_size(), dropout=dropout_p > 0, cls=cls,
                     bias=False if bias is None else "coef" if bias.coef is not None else True)
    n_tiles = tile_bound(batch, seqlen_q_total, cfg.block_m, q_pack.fmt == "thd")
    max_logit = torch.full((heads_q, max(n_tiles, 1)), float("-inf"), device=q.device) if return_max_logit else None
    if q.numel() > 0 and batch > 0 and n_tiles > 0:
        limit = max(seqlen_q_total, seqlen_k_total)
        window_left, window_right = kernel_window(window_left, limit), kernel_window(window_right, limit)
        k_pack, k, v = side_stand_ins(k_pack, k, v)  # no key at all: still a row 0 (packing.stand_in)
        tile_map, _ = tile_maps(q_pack, k_pack, seqlen_q_total, seqlen_k_total, target,
                                q_tiles=(cfg.block_m, n_tiles))
        grid, persistent = launch_grid(q.device, target, n_tiles, heads_q)
        loop = loop_flags(cfg, target, cfg.tma and usable((q_pack, k_pack), ((k, block_dqk + block_dqk2),
                                                                              (v, block_dv))))
        k_desc, k2_desc = row_descriptors(k, cfg.block_n, block_dqk, block_dqk2) if loop["TMA"] else (None, None)
        launch(
            target, _varlen_attn_fwd_kernel, grid,
            q, k, v, out, lse, tile_map, keep_args(q_pack)[0], keep_args(k_pack)[0], k_desc=k_desc, k2_desc=k2_desc,
            v_desc=row_descriptor(v, cfg.block_n, block_dv) if loop["TMA"] else None,
            sink_ptr=sink_arg(softmax_offset, lse) if softmax_offset is not None else q_pack.seq,
            max_ptr=max_logit if return_max_logit else lse,
            batch=batch, heads=heads_q, n_tiles=n_tiles, seqlen_q_total=seqlen_q_total, seqlen_k_total=seqlen_k_total,
            group=heads_q // heads_kv, sm_scale_log2=softmax_scale * LOG2E, window_left=window_left,
            window_right=window_right,
            **dict(zip(("stride_qb", "stride_qt", "stride_qh"), seq_strides(q, q_pack.fmt))),
            **dict(zip(("stride_kb", "stride_kt", "stride_kh"), seq_strides(k, k_pack.fmt))),
            **dict(zip(("stride_vb", "stride_vt", "stride_vh"), seq_strides(v, k_pack.fmt))),
            **dict(zip(("stride_ob", "stride_ot", "stride_oh"), seq_strides(out, q_pack.fmt))),
            **dict(zip(("stride_lb", "stride_lh"), rowstat_strides(lse, q_pack))),
            **dict(zip(("stride_qkb", "stride_qks"), keep_args(q_pack)[1:])),
            **dict(zip(("stride_kkb", "stride_kks"), keep_args(k_pack)[1:])),
            HEAD_DIM_QK=dim_qk, HEAD_DIM_V=dim_v, BLOCK_DQK=block_dqk, BLOCK_DQK2=block_dqk2, BLOCK_DV=block_dv,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, DOT_PRECISION=dot_precision(q.dtype, target),
            HAS_SINK=softmax_offset is not None, SINK_ROWS=softmax_offset is not None and softmax_offset.dim() > 1,
            RETURN_MAX=return_max_logit, PERSISTENT=persistent,
            **lane_flags(max(cfg.block_m, cfg.block_n), max(block_dqk + block_dqk2, block_dv),
                         ((q_pack, (q, out) + bias_rows(bias)), (k_pack, (k, v)))),
            **bias_args(bias, q_pack, lse),
            **dropout_args(dropout_p, rng_state, q_pack, k_pack),
            **mask_flags(window_left, window_right, bottom_right, q_pack, k_pack),
            **loop, **cfg.launch(),
        )
    if not return_max_logit:
        return out, lse
    return out, lse, max_logit.amax(dim=1)
