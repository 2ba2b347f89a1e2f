"""Varlen flash-attention backward: kernels and launcher.

Three kernels, all deterministic (no atomics):
1. ``_attn_bwd_preprocess_kernel``: delta = rowsum(dO * O) per query row, fp32;
2. ``_attn_bwd_dkdv_kernel``: one program per (key block, sequence, kv head) accumulates dK/dV
   over the query blocks that see its keys and over every q head of its GQA group, in a fixed
   order, and stores once;
3. ``_attn_bwd_dq_kernel``: one program per (query block, sequence, q head) accumulates dQ.
Masks, block skipping, layouts and the NaN answer to malformed cu_seqlens follow the forward,
and so does ``PERSISTENT`` (Ascend: each kernel's programs run as tasks of a core-count 1D grid).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from coreattn.kernels.attn_common import (LENGTH_STRIDES, _key_range, _layout_ok, _load_keep, _poison_program_rows,
                                          _query_range, _seq_span, _visible)
from coreattn.kernels.attn_fwd import LOG2E, dot_precision, kernel_window, launch_grid, mask_flags
from coreattn.kernels.config import bwd_config, head_block, target_of
from coreattn.kernels.packing import (Packing, keep_args, new_like, new_rowstat, rowstat_strides, seq_len_dim,
                                      seq_strides)


@triton.jit
def _preprocess_program(pid_m, b, head, out_ptr, do_ptr, delta_ptr, seqlen_total,
                        stride_ob, stride_ot, stride_oh, stride_db, stride_dt, stride_dh, stride_lb, stride_lh,
                        HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr):
    """Row block pid_m of sample b (0 when packed), head ``head``; rows outside any sequence get
    harmless values."""
    b = b.to(tl.int64)
    head = head.to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_DV)
    r0 = pid_m.to(tl.int64) * BLOCK_M
    row_ok = offs_m < seqlen_total - pid_m * BLOCK_M  # int32 vector compare (Ascend: no int64 vectors)
    mask = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM_V)
    o = tl.load(out_ptr + b * stride_ob + head * stride_oh + r0 * stride_ot
                + offs_m[:, None] * stride_ot + offs_d[None, :], mask=mask, other=0.0)
    do = tl.load(do_ptr + b * stride_db + head * stride_dh + r0 * stride_dt
                 + offs_m[:, None] * stride_dt + offs_d[None, :], mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    tl.store(delta_ptr + b * stride_lb + head * stride_lh + r0 + offs_m, delta, mask=row_ok)


@triton.jit(do_not_specialize=["seqlen_total", "grid_m", "batch", "stride_lb", "stride_lh"])
def _attn_bwd_preprocess_kernel(out_ptr, do_ptr, delta_ptr, seqlen_total, grid_m, batch, heads,
                                stride_ob, stride_ot, stride_oh, stride_db, stride_dt, stride_dh,
                                stride_lb, stride_lh,
                                HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr,
                                PERSISTENT: tl.constexpr):
    # grid: (grid_m row blocks, batch (1 when packed), heads); PERSISTENT: those programs as
    # tasks of a core-count 1D grid
    if PERSISTENT:
        for task in range(tl.program_id(0), grid_m * batch * heads, tl.num_programs(0)):
            _preprocess_program(task % grid_m, task // (grid_m * heads), (task // grid_m) % heads, out_ptr, do_ptr,
                                delta_ptr, seqlen_total, stride_ob, stride_ot, stride_oh, stride_db, stride_dt,
                                stride_dh, stride_lb, stride_lh, HEAD_DIM_V, BLOCK_DV, BLOCK_M)
    else:
        _preprocess_program(tl.program_id(0), tl.program_id(1), tl.program_id(2), out_ptr, do_ptr, delta_ptr,
                            seqlen_total, stride_ob, stride_ot, stride_oh, stride_db, stride_dt, stride_dh,
                            stride_lb, stride_lh, HEAD_DIM_V, BLOCK_DV, BLOCK_M)


@triton.jit
def _load_row_stats(lse_base, delta_base, rows, row_mask):
    """lse in the log2 domain with -inf (rows that see no key) turned into +inf so p = 0."""
    lse = tl.load(lse_base + rows, mask=row_mask, other=float("inf")) * 1.4426950408889634
    lse = tl.where(lse == float("-inf"), float("inf"), lse)
    delta = tl.load(delta_base + rows, mask=row_mask, other=0.0)
    return lse, delta


@triton.jit
def _dkdv_q_steps(dk, dv, k, v, k_keep, q_base, do_base, lse_base, delta_base, q_keep_base, stride_qt, stride_dot,
                  stride_qks, cols, m_lo, m_hi, seqlen_q, seqlen_k, shift, window_left, window_right, sm_scale_log2,
                  HEAD_DIM_QK: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                  BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr,
                  HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_Q_KEEP: tl.constexpr,
                  MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr):
    offs_m = tl.arange(0, BLOCK_M)
    offs_dqk = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    for m0 in range(m_lo, m_hi, BLOCK_M):
        rows = m0 + offs_m
        row_ok = rows < seqlen_q
        m0_64 = tl.cast(m0, tl.int64)
        q = tl.load(q_base + m0_64 * stride_qt + offs_m[:, None] * stride_qt + offs_dqk[None, :],
                    mask=row_ok[:, None] & (offs_dqk[None, :] < HEAD_DIM_QK), other=0.0)  # [M, DQK]
        do = tl.load(do_base + m0_64 * stride_dot + offs_m[:, None] * stride_dot + offs_dv[None, :],
                     mask=row_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V), other=0.0)  # [M, DV]
        lse, delta = _load_row_stats(lse_base, delta_base, rows, row_ok)
        sT = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION) * sm_scale_log2  # [N, M]
        pT = tl.math.exp2(sT - lse[None, :])
        if MASKED:
            vis = _visible(rows[None, :], cols[:, None], seqlen_q, seqlen_k, shift,
                           window_left, window_right, HAS_LEFT, HAS_RIGHT)
            q_keep = _load_keep(q_keep_base, stride_qks, rows, seqlen_q, HAS_Q_KEEP)
            vis = vis & k_keep[:, None] & q_keep[None, :]
            pT = tl.where(vis, pT, 0.0)
        dv += tl.dot(pT.to(do.dtype), do, input_precision=DOT_PRECISION)
        dpT = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)  # [N, M]
        dsT = pT * (dpT - delta[None, :])
        dk += tl.dot(dsT.to(q.dtype), q, input_precision=DOT_PRECISION)
    return dk, dv


@triton.jit
def _dkdv_program(pid_n, seq, kv_head, num_pid_n,
                  q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr,
                  q_seq_ptr, q_len_ptr, k_seq_ptr, k_len_ptr, q_keep_ptr, k_keep_ptr,
                  batch, seqlen_q_total, seqlen_k_total, group, sm_scale, sm_scale_log2, window_left, window_right,
                  stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                  stride_dob, stride_dot, stride_doh, stride_lb, stride_lh, stride_qkb, stride_qks, stride_kkb,
                  stride_kks, stride_dkb, stride_dkt, stride_dkh, stride_dvb, stride_dvt, stride_dvh,
                  HEAD_DIM_QK: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                  BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr,
                  HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, BOTTOM_RIGHT: tl.constexpr,
                  SPANS: tl.constexpr, HAS_Q_KEEP: tl.constexpr, HAS_K_KEEP: tl.constexpr,
                  DOT_PRECISION: tl.constexpr):
    """One program of the (key-block programs, sequences, kv heads) grid: key blocks pid_n,
    pid_n + num_pid_n, ... of sequence ``seq`` for kv head ``kv_head``."""
    seq64 = seq.to(tl.int64)
    kv64 = kv_head.to(tl.int64)
    dk_head = dk_ptr + seq64 * stride_dkb + kv64 * stride_dkh
    dv_head = dv_ptr + seq64 * stride_dvb + kv64 * stride_dvh
    ok = _layout_ok(q_seq_ptr, q_len_ptr, k_seq_ptr, k_len_ptr, seq, batch, seqlen_q_total, seqlen_k_total,
                    SPANS, BLOCK_B)
    if ok:
        q_start, seqlen_q = _seq_span(q_seq_ptr, q_len_ptr, seq, SPANS)
        k_start, seqlen_k = _seq_span(k_seq_ptr, k_len_ptr, seq, SPANS)
        shift = seqlen_q * 0
        if BOTTOM_RIGHT:
            shift = seqlen_k - seqlen_q
        q_seq = q_ptr + seq64 * stride_qb + q_start.to(tl.int64) * stride_qt
        do_seq = do_ptr + seq64 * stride_dob + q_start.to(tl.int64) * stride_dot
        stat_seq = seq64 * stride_lb + q_start.to(tl.int64)
        k_base = k_ptr + seq64 * stride_kb + k_start.to(tl.int64) * stride_kt + kv64 * stride_kh
        v_base = v_ptr + seq64 * stride_vb + k_start.to(tl.int64) * stride_vt + kv64 * stride_vh
        q_keep_base = q_keep_ptr + seq64 * stride_qkb + q_start.to(tl.int64) * stride_qks
        k_keep_base = k_keep_ptr + seq64 * stride_kkb + k_start.to(tl.int64) * stride_kks
        offs_n = tl.arange(0, BLOCK_N)
        offs_dqk = tl.arange(0, BLOCK_DQK)
        offs_dv = tl.arange(0, BLOCK_DV)
        for n0 in range(pid_n * BLOCK_N, seqlen_k, num_pid_n * BLOCK_N):
            cols = n0 + offs_n
            col_ok = cols < seqlen_k
            n0_64 = tl.cast(n0, tl.int64)
            kd_mask = col_ok[:, None] & (offs_dqk[None, :] < HEAD_DIM_QK)
            vd_mask = col_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V)
            k = tl.load(k_base + n0_64 * stride_kt + offs_n[:, None] * stride_kt + offs_dqk[None, :],
                        mask=kd_mask, other=0.0)  # [N, DQK]
            v = tl.load(v_base + n0_64 * stride_vt + offs_n[:, None] * stride_vt + offs_dv[None, :],
                        mask=vd_mask, other=0.0)  # [N, DV]
            k_keep = _load_keep(k_keep_base, stride_kks, cols, seqlen_k, HAS_K_KEEP)  # [N]
            dk = tl.zeros([BLOCK_N, BLOCK_DQK], tl.float32)
            dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
            lo, full_lo, full_hi, hi = _query_range(n0, seqlen_q, seqlen_k, shift, window_left, window_right,
                                                    BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT, HAS_Q_KEEP or HAS_K_KEEP)
            for head in range(kv_head * group, kv_head * group + group):  # GQA: the group's q heads, in order
                h64 = tl.cast(head, tl.int64)
                q_base = q_seq + h64 * stride_qh
                do_base = do_seq + h64 * stride_doh
                lse_base = lse_ptr + stat_seq + h64 * stride_lh
                delta_base = delta_ptr + stat_seq + h64 * stride_lh
                dk, dv = _dkdv_q_steps(dk, dv, k, v, k_keep, q_base, do_base, lse_base, delta_base, q_keep_base,
                                       stride_qt, stride_dot, stride_qks, cols, lo, full_lo, seqlen_q, seqlen_k, shift,
                                       window_left, window_right, sm_scale_log2, HEAD_DIM_QK, HEAD_DIM_V, BLOCK_DQK,
                                       BLOCK_DV, BLOCK_M, HAS_LEFT, HAS_RIGHT, HAS_Q_KEEP, True, DOT_PRECISION)
                dk, dv = _dkdv_q_steps(dk, dv, k, v, k_keep, q_base, do_base, lse_base, delta_base, q_keep_base,
                                       stride_qt, stride_dot, stride_qks, cols, full_lo, full_hi, seqlen_q, seqlen_k, shift,
                                       window_left, window_right, sm_scale_log2, HEAD_DIM_QK, HEAD_DIM_V, BLOCK_DQK,
                                       BLOCK_DV, BLOCK_M, HAS_LEFT, HAS_RIGHT, HAS_Q_KEEP, False, DOT_PRECISION)
                dk, dv = _dkdv_q_steps(dk, dv, k, v, k_keep, q_base, do_base, lse_base, delta_base, q_keep_base,
                                       stride_qt, stride_dot, stride_qks, cols, full_hi, hi, seqlen_q, seqlen_k, shift,
                                       window_left, window_right, sm_scale_log2, HEAD_DIM_QK, HEAD_DIM_V, BLOCK_DQK,
                                       BLOCK_DV, BLOCK_M, HAS_LEFT, HAS_RIGHT, HAS_Q_KEEP, True, DOT_PRECISION)
            dk_base = dk_head + k_start.to(tl.int64) * stride_dkt + n0_64 * stride_dkt
            dv_base = dv_head + k_start.to(tl.int64) * stride_dvt + n0_64 * stride_dvt
            tl.store(dk_base + offs_n[:, None] * stride_dkt + offs_dqk[None, :],
                     (dk * sm_scale).to(dk_ptr.dtype.element_ty), mask=kd_mask)
            tl.store(dv_base + offs_n[:, None] * stride_dvt + offs_dv[None, :],
                     dv.to(dv_ptr.dtype.element_ty), mask=vd_mask)
    else:
        _poison_program_rows(dk_head, pid_n, seq, num_pid_n, batch, seqlen_k_total, stride_dkt,
                             HEAD_DIM_QK, BLOCK_DQK, BLOCK_N, SPANS)
        _poison_program_rows(dv_head, pid_n, seq, num_pid_n, batch, seqlen_k_total, stride_dvt,
                             HEAD_DIM_V, BLOCK_DV, BLOCK_N, SPANS)


@triton.jit(do_not_specialize=["batch", "grid_n", "seqlen_q_total", "seqlen_k_total", "window_left", "window_right",
                             *LENGTH_STRIDES])
def _attn_bwd_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr,
    q_seq_ptr, q_len_ptr, k_seq_ptr, k_len_ptr, q_keep_ptr, k_keep_ptr,
    batch, heads, grid_n, seqlen_q_total, seqlen_k_total, group, sm_scale, sm_scale_log2, window_left, window_right,
    stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_dob, stride_dot, stride_doh, stride_lb, stride_lh, stride_qkb, stride_qks, stride_kkb, stride_kks,
    stride_dkb, stride_dkt, stride_dkh, stride_dvb, stride_dvt, stride_dvh,
    HEAD_DIM_QK: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, BOTTOM_RIGHT: tl.constexpr,
    SPANS: tl.constexpr, HAS_Q_KEEP: tl.constexpr, HAS_K_KEEP: tl.constexpr, DOT_PRECISION: tl.constexpr,
    PERSISTENT: tl.constexpr,
):
    # grid: (grid_n key-block programs per sequence, sequences, kv heads = ``heads``);
    # PERSISTENT: those programs as tasks of a core-count 1D grid
    if PERSISTENT:
        for task in range(tl.program_id(0), grid_n * batch * heads, tl.num_programs(0)):
            _dkdv_program(task % grid_n, task // (grid_n * heads), (task // grid_n) % heads, grid_n,
                          q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, q_seq_ptr, q_len_ptr,
                          k_seq_ptr, k_len_ptr, q_keep_ptr, k_keep_ptr, batch, seqlen_q_total, seqlen_k_total, group,
                          sm_scale, sm_scale_log2, window_left, window_right, stride_qb, stride_qt, stride_qh,
                          stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_dob, stride_dot,
                          stride_doh, stride_lb, stride_lh, stride_qkb, stride_qks, stride_kkb, stride_kks,
                          stride_dkb, stride_dkt, stride_dkh, stride_dvb, stride_dvt, stride_dvh,
                          HEAD_DIM_QK, HEAD_DIM_V, BLOCK_DQK, BLOCK_DV, BLOCK_M, BLOCK_N, BLOCK_B,
                          HAS_LEFT, HAS_RIGHT, BOTTOM_RIGHT, SPANS, HAS_Q_KEEP, HAS_K_KEEP, DOT_PRECISION)
    else:
        _dkdv_program(tl.program_id(0), tl.program_id(1), tl.program_id(2), tl.num_programs(0),
                      q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, q_seq_ptr, q_len_ptr,
                      k_seq_ptr, k_len_ptr, q_keep_ptr, k_keep_ptr, batch, seqlen_q_total, seqlen_k_total, group,
                      sm_scale, sm_scale_log2, window_left, window_right, stride_qb, stride_qt, stride_qh,
                      stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_dob, stride_dot,
                      stride_doh, stride_lb, stride_lh, stride_qkb, stride_qks, stride_kkb, stride_kks,
                      stride_dkb, stride_dkt, stride_dkh, stride_dvb, stride_dvt, stride_dvh,
                      HEAD_DIM_QK, HEAD_DIM_V, BLOCK_DQK, BLOCK_DV, BLOCK_M, BLOCK_N, BLOCK_B,
                      HAS_LEFT, HAS_RIGHT, BOTTOM_RIGHT, SPANS, HAS_Q_KEEP, HAS_K_KEEP, DOT_PRECISION)


@triton.jit
def _dq_kv_steps(dq, q, do, lse, delta, q_keep, k_base, v_base, k_keep_base, stride_kt, stride_vt, stride_kks,
                 rows, n_lo, n_hi, seqlen_q, seqlen_k, shift, window_left, window_right, sm_scale_log2,
                 HEAD_DIM_QK: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                 BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr,
                 HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_K_KEEP: tl.constexpr,
                 MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr):
    offs_n = tl.arange(0, BLOCK_N)
    offs_dqk = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    for n0 in range(n_lo, n_hi, BLOCK_N):
        cols = n0 + offs_n
        n0_64 = tl.cast(n0, tl.int64)
        col_ok = cols < seqlen_k
        k = tl.load(k_base + n0_64 * stride_kt + offs_n[:, None] * stride_kt + offs_dqk[None, :],
                    mask=col_ok[:, None] & (offs_dqk[None, :] < HEAD_DIM_QK), other=0.0)  # [N, DQK]
        v = tl.load(v_base + n0_64 * stride_vt + offs_n[:, None] * stride_vt + offs_dv[None, :],
                    mask=col_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V), other=0.0)  # [N, DV]
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * sm_scale_log2  # [M, N]
        p = tl.math.exp2(s - lse[:, None])
        if MASKED:
            vis = _visible(rows[:, None], cols[None, :], seqlen_q, seqlen_k, shift,
                           window_left, window_right, HAS_LEFT, HAS_RIGHT)
            k_keep = _load_keep(k_keep_base, stride_kks, cols, seqlen_k, HAS_K_KEEP)
            vis = vis & q_keep[:, None] & k_keep[None, :]
            p = tl.where(vis, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)  # [M, N]
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION)
    return dq


@triton.jit
def _dq_program(pid_m, seq, head, num_pid_m,
                q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr,
                q_seq_ptr, q_len_ptr, k_seq_ptr, k_len_ptr, q_keep_ptr, k_keep_ptr,
                batch, seqlen_q_total, seqlen_k_total, group, sm_scale, sm_scale_log2, window_left, window_right,
                stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                stride_dob, stride_dot, stride_doh, stride_lb, stride_lh, stride_qkb, stride_qks, stride_kkb,
                stride_kks, stride_dqb, stride_dqt, stride_dqh,
                HEAD_DIM_QK: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr,
                HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, BOTTOM_RIGHT: tl.constexpr,
                SPANS: tl.constexpr, HAS_Q_KEEP: tl.constexpr, HAS_K_KEEP: tl.constexpr,
                DOT_PRECISION: tl.constexpr):
    """One program of the (query-block programs, sequences, q heads) grid: query blocks pid_m,
    pid_m + num_pid_m, ... of sequence ``seq`` for q head ``head``."""
    seq64 = seq.to(tl.int64)
    h64 = head.to(tl.int64)
    dq_head = dq_ptr + seq64 * stride_dqb + h64 * stride_dqh
    ok = _layout_ok(q_seq_ptr, q_len_ptr, k_seq_ptr, k_len_ptr, seq, batch, seqlen_q_total, seqlen_k_total,
                    SPANS, BLOCK_B)
    if ok:
        q_start, seqlen_q = _seq_span(q_seq_ptr, q_len_ptr, seq, SPANS)
        k_start, seqlen_k = _seq_span(k_seq_ptr, k_len_ptr, seq, SPANS)
        shift = seqlen_q * 0
        if BOTTOM_RIGHT:
            shift = seqlen_k - seqlen_q
        kv64 = (head // group).to(tl.int64)
        q_base = q_ptr + seq64 * stride_qb + q_start.to(tl.int64) * stride_qt + h64 * stride_qh
        do_base = do_ptr + seq64 * stride_dob + q_start.to(tl.int64) * stride_dot + h64 * stride_doh
        k_base = k_ptr + seq64 * stride_kb + k_start.to(tl.int64) * stride_kt + kv64 * stride_kh
        v_base = v_ptr + seq64 * stride_vb + k_start.to(tl.int64) * stride_vt + kv64 * stride_vh
        stat = seq64 * stride_lb + h64 * stride_lh + q_start.to(tl.int64)
        dq_base = dq_head + q_start.to(tl.int64) * stride_dqt
        q_keep_base = q_keep_ptr + seq64 * stride_qkb + q_start.to(tl.int64) * stride_qks
        k_keep_base = k_keep_ptr + seq64 * stride_kkb + k_start.to(tl.int64) * stride_kks
        offs_m = tl.arange(0, BLOCK_M)
        offs_dqk = tl.arange(0, BLOCK_DQK)
        offs_dv = tl.arange(0, BLOCK_DV)
        for m0 in range(pid_m * BLOCK_M, seqlen_q, num_pid_m * BLOCK_M):
            rows = m0 + offs_m
            row_ok = rows < seqlen_q
            m0_64 = tl.cast(m0, tl.int64)
            qd_mask = row_ok[:, None] & (offs_dqk[None, :] < HEAD_DIM_QK)
            q = tl.load(q_base + m0_64 * stride_qt + offs_m[:, None] * stride_qt + offs_dqk[None, :],
                        mask=qd_mask, other=0.0)
            do = tl.load(do_base + m0_64 * stride_dot + offs_m[:, None] * stride_dot + offs_dv[None, :],
                         mask=row_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V), other=0.0)
            lse, delta = _load_row_stats(lse_ptr + stat, delta_ptr + stat, rows, row_ok)
            q_keep = _load_keep(q_keep_base, stride_qks, rows, seqlen_q, HAS_Q_KEEP)  # [M]
            dq = tl.zeros([BLOCK_M, BLOCK_DQK], tl.float32)
            lo, full_lo, full_hi, hi = _key_range(m0, seqlen_q, seqlen_k, shift, window_left, window_right,
                                                  BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT, HAS_Q_KEEP or HAS_K_KEEP)
            dq = _dq_kv_steps(dq, q, do, lse, delta, q_keep, k_base, v_base, k_keep_base, stride_kt, stride_vt,
                              stride_kks, rows, lo, full_lo, seqlen_q, seqlen_k, shift, window_left, window_right,
                              sm_scale_log2, HEAD_DIM_QK, HEAD_DIM_V, BLOCK_DQK, BLOCK_DV, BLOCK_N,
                              HAS_LEFT, HAS_RIGHT, HAS_K_KEEP, True, DOT_PRECISION)
            dq = _dq_kv_steps(dq, q, do, lse, delta, q_keep, k_base, v_base, k_keep_base, stride_kt, stride_vt,
                              stride_kks, rows, full_lo, full_hi, seqlen_q, seqlen_k, shift, window_left, window_right,
                              sm_scale_log2, HEAD_DIM_QK, HEAD_DIM_V, BLOCK_DQK, BLOCK_DV, BLOCK_N,
                              HAS_LEFT, HAS_RIGHT, HAS_K_KEEP, False, DOT_PRECISION)
            dq = _dq_kv_steps(dq, q, do, lse, delta, q_keep, k_base, v_base, k_keep_base, stride_kt, stride_vt,
                              stride_kks, rows, full_hi, hi, seqlen_q, seqlen_k, shift, window_left, window_right,
                              sm_scale_log2, HEAD_DIM_QK, HEAD_DIM_V, BLOCK_DQK, BLOCK_DV, BLOCK_N,
                              HAS_LEFT, HAS_RIGHT, HAS_K_KEEP, True, DOT_PRECISION)
            tl.store(dq_base + m0_64 * stride_dqt + offs_m[:, None] * stride_dqt + offs_dqk[None, :],
                     (dq * sm_scale).to(dq_ptr.dtype.element_ty), mask=qd_mask)
    else:
        _poison_program_rows(dq_head, pid_m, seq, num_pid_m, batch, seqlen_q_total, stride_dqt,
                             HEAD_DIM_QK, BLOCK_DQK, BLOCK_M, SPANS)


@triton.jit(do_not_specialize=["batch", "grid_m", "seqlen_q_total", "seqlen_k_total", "window_left", "window_right",
                             *LENGTH_STRIDES])
def _attn_bwd_dq_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr,
    q_seq_ptr, q_len_ptr, k_seq_ptr, k_len_ptr, q_keep_ptr, k_keep_ptr,
    batch, heads, grid_m, seqlen_q_total, seqlen_k_total, group, sm_scale, sm_scale_log2, window_left, window_right,
    stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_dob, stride_dot, stride_doh, stride_lb, stride_lh, stride_qkb, stride_qks, stride_kkb, stride_kks,
    stride_dqb, stride_dqt, stride_dqh,
    HEAD_DIM_QK: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, BOTTOM_RIGHT: tl.constexpr,
    SPANS: tl.constexpr, HAS_Q_KEEP: tl.constexpr, HAS_K_KEEP: tl.constexpr, DOT_PRECISION: tl.constexpr,
    PERSISTENT: tl.constexpr,
):
    # grid: (grid_m query-block programs per sequence, sequences, q heads = ``heads``);
    # PERSISTENT: those programs as tasks of a core-count 1D grid
    if PERSISTENT:
        for task in range(tl.program_id(0), grid_m * batch * heads, tl.num_programs(0)):
            _dq_program(task % grid_m, task // (grid_m * heads), (task // grid_m) % heads, grid_m,
                        q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, q_seq_ptr, q_len_ptr, k_seq_ptr,
                        k_len_ptr, q_keep_ptr, k_keep_ptr, batch, seqlen_q_total, seqlen_k_total, group, sm_scale,
                        sm_scale_log2, window_left, window_right, stride_qb, stride_qt, stride_qh, stride_kb,
                        stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_dob, stride_dot, stride_doh,
                        stride_lb, stride_lh, stride_qkb, stride_qks, stride_kkb, stride_kks, stride_dqb, stride_dqt,
                        stride_dqh, HEAD_DIM_QK, HEAD_DIM_V, BLOCK_DQK, BLOCK_DV, BLOCK_M, BLOCK_N, BLOCK_B,
                        HAS_LEFT, HAS_RIGHT, BOTTOM_RIGHT, SPANS, HAS_Q_KEEP, HAS_K_KEEP, DOT_PRECISION)
    else:
        _dq_program(tl.program_id(0), tl.program_id(1), tl.program_id(2), tl.num_programs(0),
                    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, q_seq_ptr, q_len_ptr, k_seq_ptr,
                    k_len_ptr, q_keep_ptr, k_keep_ptr, batch, seqlen_q_total, seqlen_k_total, group, sm_scale,
                    sm_scale_log2, window_left, window_right, stride_qb, stride_qt, stride_qh, stride_kb,
                    stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_dob, stride_dot, stride_doh,
                    stride_lb, stride_lh, stride_qkb, stride_qks, stride_kkb, stride_kks, stride_dqb, stride_dqt,
                    stride_dqh, HEAD_DIM_QK, HEAD_DIM_V, BLOCK_DQK, BLOCK_DV, BLOCK_M, BLOCK_N, BLOCK_B,
                    HAS_LEFT, HAS_RIGHT, BOTTOM_RIGHT, SPANS, HAS_Q_KEEP, HAS_K_KEEP, DOT_PRECISION)


def varlen_attn_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    lse: torch.Tensor, q_pack: Packing, k_pack: Packing, max_seqlen_q: int, max_seqlen_k: int,
                    softmax_scale: float, window_left: int = -1, window_right: int = -1, bottom_right: bool = True,
                    dq: torch.Tensor | None = None, dk: torch.Tensor | None = None, dv: torch.Tensor | None = None,
                    *, dropout_p: float = 0.0, rng_state: torch.Tensor | None = None):
    """Launch the backward kernels; returns dq, dk, dv in the layouts and dtypes of q, k, v.

    ``dout`` may be any strided view with last stride 1 (it is made so if not); ``out`` and
    ``lse`` are the forward's. Deterministic: no atomics; every gradient element inside a
    sequence is written once. ``dq``/``dk``/``dv`` may be given as preallocated buffers (rows
    outside spans are left as they are).
    """
    if dropout_p:
        raise NotImplementedError("dropout is not in the Triton kernels yet; use backend='torch'")
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    heads_q, dim_qk = q.shape[-2:]
    heads_kv, dim_v = v.shape[-2:]
    batch = q_pack.batch
    dq = new_like(q, q_pack, dim_qk) if dq is None else dq
    dk = new_like(k, k_pack, dim_qk) if dk is None else dk
    dv = new_like(v, k_pack, dim_v) if dv is None else dv
    seqlen_q_total, seqlen_k_total = seq_len_dim(q, q_pack.fmt), seq_len_dim(k, k_pack.fmt)
    if batch == 0 or (q.numel() == 0 and k.numel() == 0):
        return dq, dk, dv
    limit = max(seqlen_q_total, seqlen_k_total)
    window_left, window_right = kernel_window(window_left, limit), kernel_window(window_right, limit)
    target = target_of(q.device)
    block_dqk, block_dv = head_block(dim_qk), head_block(dim_v)
    cfg = bwd_config(q.device, block_dqk, block_dv, q.element_size())

    delta = new_rowstat(q, q_pack, fill=0.0)  # [H, T] or [B, H, S]
    if q.numel() > 0:
        pre_batch = 1 if q_pack.fmt == "thd" else batch
        grid, grid_x, persistent = launch_grid(q.device, target, triton.cdiv(seqlen_q_total, cfg.block_m), pre_batch,
                                               heads_q, hint=False, vector_only=True)
        _attn_bwd_preprocess_kernel[grid](
            out, dout, delta, seqlen_q_total, grid_x, pre_batch, heads_q, *seq_strides(out, q_pack.fmt),
            *seq_strides(dout, q_pack.fmt), *rowstat_strides(delta, q_pack),
            HEAD_DIM_V=dim_v, BLOCK_DV=block_dv, BLOCK_M=cfg.block_m, PERSISTENT=persistent,
        )
    common = dict(HEAD_DIM_QK=dim_qk, HEAD_DIM_V=dim_v, BLOCK_DQK=block_dqk, BLOCK_DV=block_dv,
                  BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, DOT_PRECISION=dot_precision(q.dtype, target),
                  num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                  **mask_flags(window_left, window_right, bottom_right, q_pack, k_pack))
    scalars = (seqlen_q_total, seqlen_k_total, heads_q // heads_kv, softmax_scale, softmax_scale * LOG2E,
               window_left, window_right)
    strides = (*seq_strides(q, q_pack.fmt), *seq_strides(k, k_pack.fmt), *seq_strides(v, k_pack.fmt),
               *seq_strides(dout, q_pack.fmt), *rowstat_strides(lse, q_pack), *keep_args(q_pack)[1:],
               *keep_args(k_pack)[1:])
    layout = (q_pack.seq, q_pack.lens, k_pack.seq, k_pack.lens, keep_args(q_pack)[0], keep_args(k_pack)[0])
    if k.numel() > 0:
        grid, grid_n, persistent = launch_grid(q.device, target, max(1, triton.cdiv(max_seqlen_k, cfg.block_n)),
                                               batch, heads_kv)
        _attn_bwd_dkdv_kernel[grid](q, k, v, dout, lse, delta, dk, dv, *layout, batch, heads_kv, grid_n, *scalars,
                                    *strides, *seq_strides(dk, k_pack.fmt), *seq_strides(dv, k_pack.fmt),
                                    PERSISTENT=persistent, **common)
    if q.numel() > 0:
        grid, grid_m, persistent = launch_grid(q.device, target, max(1, triton.cdiv(max_seqlen_q, cfg.block_m)),
                                               batch, heads_q)
        _attn_bwd_dq_kernel[grid](q, k, v, dout, lse, delta, dq, *layout, batch, heads_q, grid_m, *scalars, *strides,
                                  *seq_strides(dq, q_pack.fmt), PERSISTENT=persistent, **common)
    return dq, dk, dv
