"""The gradient of an additive attention bias's table: kernel and launcher.

A ``TableBias`` (kernels/attn_common.py) adds ``sum_r coef[i, h, r] * table[h, r, d - lo]`` to the
score of query i and key j, d = i + shift - j. The attention kernels compute it in registers
(``_bias_scores``); the dQ kernel also accumulates the coefficients' gradient (one row per query,
like dQ) and, for a clamped table, the rows' sums of dS beyond its ends. What is left is the
table's own gradient, ``dtable[h, r, k] = sum over the pairs at distance lo + k of dS * coef[i, h, r]``,
a sum along diagonals of dS: this module's kernel.

One program per (block of BLOCK_KB distances, q head, chunk of query tiles) walks its chunk's
query tiles (the dQ tile map's tiles of BLOCK_M rows, every ``n_chunks``-th) and for each
recomputes the scores of its tile's rows against the window of BLOCK_W keys that holds those
distances (P from the saved lse, dS = P (dP - delta), with the forward's masks, bias and dropout),
gathers dS into one column per distance (``tl.gather`` along the keys: column kk holds each row's
pair at distance d0 + kk) and adds ``coef^T @ columns`` (a [R, M] x [M, KB] dot; the column sums
without coefficients) to a register accumulator. Each program writes its [R, BLOCK_KB] once into
a partial buffer ``[n_chunks, Hq, R, extent]`` (fp32); a torch sum over chunks (and over heads for
a shared table) gives the table's gradient (on Ascend, and past a target's grid limits, PERSISTENT:
fewer programs step over those tasks; the launch goes through kernels/launch.py). No atomics, a fixed order: deterministic. Windows
outside the sequence's keys are skipped. The partial buffer is bounded (``PARTIAL_ELEMENTS``:
16 MiB) by the chunk count, at least one chunk.

Cost: per (query tile, distance block) the window's Q K^T and dO V^T dots ([M, D] x [D, W],
W the next power of two of M + KB - 1: about twice the pairs the block covers) and the gather;
over a sequence that is about twice the backward's Q K^T and dO V^T work on the band of
``extent`` distances (for Inkling 2's 1,024-key extent at 128k tokens, under 2% of the full
attention's; for its 1,024-token sliding windows, as much again as those two dots).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from coreattn.kernels.attn_common import (LENGTH_STRIDES, TableBias, _bias_scores, _cols, _dropout_keep, _first_gid,
                                          _lane_offsets, _load_keep, _load_rows, _visible)
from coreattn.kernels.attn_fwd import LOG2E, dot_precision, dropout_args, lane_flags, launch_grid, mask_flags
from coreattn.kernels.configs.base import head_blocks
from coreattn.kernels.configs.dense import bias_grad_config
from coreattn.kernels.configs.targets import target_of
from coreattn.kernels.device import on_device
from coreattn.kernels.launch import launch
from coreattn.kernels.packing import Packing, keep_args, rowstat_strides, seq_len_dim, seq_strides
from coreattn.kernels.tile_map import _tile_rows, _tile_seq, tile_bound, tile_maps

PARTIAL_ELEMENTS = 1 << 22  # fp32 entries of the partial buffer at most (16 MiB), unless one chunk needs more
BIAS_GRAD_INTS = ("batch", "n_tiles", "n_chunks", "seqlen_q_total", "seqlen_k_total", "window_left", "window_right",
                  "drop_threshold", *LENGTH_STRIDES)


@triton.jit
def _load_window(base, stride_t, lanes, ok, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_D2: tl.constexpr,
                 INT64_LANES: tl.constexpr):
    """Rows ``base + lanes * stride_t`` (tile-local lanes, already clamped into the sequence) as
    [W, BLOCK_D] (and [W, BLOCK_D2] when the head dim is split), masked by ``ok``."""
    rows = base + _lane_offsets(lanes[:, None], stride_t, INT64_LANES)
    offs_d = tl.arange(0, BLOCK_D)
    x = tl.load(rows + _cols(offs_d, HEAD_DIM, BLOCK_D)[None, :], mask=ok[:, None] & (offs_d[None, :] < HEAD_DIM),
                other=0.0)
    x2 = x
    if BLOCK_D2 > 0:
        offs_d2 = BLOCK_D + tl.arange(0, BLOCK_D2)
        x2 = tl.load(rows + _cols(offs_d2, HEAD_DIM, BLOCK_D + BLOCK_D2)[None, :],
                     mask=ok[:, None] & (offs_d2[None, :] < HEAD_DIM), other=0.0)
    return x, x2


@triton.jit
def _bias_grad_tile(acc, tile, kb, head, q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, map_ptr, q_keep_ptr,
                    k_keep_ptr, q_gid_ptr, k_gid_ptr, rng_ptr, table_base, coef_ptr, seqlen_q_total, seqlen_k_total,
                    group, sm_scale_log2, window_left, window_right, drop_threshold, drop_scale, bias_lo,
                    bias_extent, stride_cb, stride_ct, stride_ch,
                    stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                    stride_dob, stride_dot, stride_doh, stride_lb, stride_lh, stride_qkb, stride_qks, stride_kkb,
                    stride_kks, seq, HEAD_DIM_QK: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DQK: tl.constexpr,
                    BLOCK_DQK2: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_KB: tl.constexpr,
                    BLOCK_W: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                    BOTTOM_RIGHT: tl.constexpr, PACKED: tl.constexpr, HAS_Q_KEEP: tl.constexpr,
                    HAS_K_KEEP: tl.constexpr, DROPOUT: tl.constexpr, HAS_GID: tl.constexpr, BIAS_RANK: tl.constexpr,
                    BIAS_RB: tl.constexpr, BIAS_COEF: tl.constexpr, BIAS_CLAMP: tl.constexpr,
                    DOT_PRECISION: tl.constexpr, INT64_LANES: tl.constexpr):
    """``acc`` [RB, KB] plus query tile ``tile``'s (sequence ``seq``) share of distances
    bias_lo + kb * KB + [0, KB) of q head ``head``; unchanged when its key window misses the sequence."""
    m0, q_start, seqlen_q, k_start, seqlen_k = _tile_rows(map_ptr, tile)
    shift = seqlen_q * 0
    if BOTTOM_RIGHT:
        shift = seqlen_k - seqlen_q
    d0 = bias_lo + kb * BLOCK_KB  # the block's first distance
    j0 = m0 + shift - d0 - (BLOCK_KB - 1)  # the window's first key: row m0 + BLOCK_M - 1 at distance d0
    if (seqlen_k > 0) & (j0 < seqlen_k) & (j0 + BLOCK_W > 0):
        seq64 = seq.to(tl.int64)
        h64 = head.to(tl.int64)
        kv64 = (head // group).to(tl.int64)
        offs_m = tl.arange(0, BLOCK_M)
        offs_w = tl.arange(0, BLOCK_W)
        rows = m0 + offs_m
        row_ok = rows < seqlen_q
        q_base = q_ptr + seq64 * stride_qb + q_start.to(tl.int64) * stride_qt + h64 * stride_qh
        do_base = do_ptr + seq64 * stride_dob + q_start.to(tl.int64) * stride_dot + h64 * stride_doh
        q, q2 = _load_rows(q_base, stride_qt, m0, row_ok, seqlen_q - 1, HEAD_DIM_QK, BLOCK_DQK, BLOCK_DQK2, BLOCK_M,
                           INT64_LANES)
        do, _ = _load_rows(do_base, stride_dot, m0, row_ok, seqlen_q - 1, HEAD_DIM_V, BLOCK_DV, 0, BLOCK_M,
                           INT64_LANES)
        stat = seq64 * stride_lb + h64 * stride_lh + q_start.to(tl.int64)
        at = tl.minimum(rows, seqlen_q - 1)
        lse = tl.load(lse_ptr + stat + at, mask=row_ok, other=float("inf")) * 1.4426950408889634
        lse = tl.where(lse == float("-inf"), float("inf"), lse)  # rows that see nothing: P = 0
        delta = tl.load(delta_ptr + stat + at, mask=row_ok, other=0.0)
        # the window's keys, clamped into the sequence: an int64 base row and tile-local lanes
        k_row = tl.minimum(tl.maximum(j0, 0), seqlen_k - 1)
        cols = j0 + offs_w
        col_ok = (cols >= 0) & (cols < seqlen_k)
        k_lanes = tl.minimum(tl.maximum(cols, 0), seqlen_k - 1) - k_row
        k_base = k_ptr + seq64 * stride_kb + (k_start + k_row).to(tl.int64) * stride_kt + kv64 * stride_kh
        v_base = v_ptr + seq64 * stride_vb + (k_start + k_row).to(tl.int64) * stride_vt + kv64 * stride_vh
        k, k2 = _load_window(k_base, stride_kt, k_lanes, col_ok, HEAD_DIM_QK, BLOCK_DQK, BLOCK_DQK2, INT64_LANES)
        v, _ = _load_window(v_base, stride_vt, k_lanes, col_ok, HEAD_DIM_V, BLOCK_DV, 0, INT64_LANES)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [M, W]
        if BLOCK_DQK2 > 0:
            s = tl.dot(q2, tl.trans(k2), s, input_precision=DOT_PRECISION)
        coef_rows = (seq64 * stride_cb + q_start.to(tl.int64) * stride_ct + h64 * stride_ch
                     + tl.cast(m0, tl.int64) * stride_ct
                     + _lane_offsets(tl.minimum(offs_m, seqlen_q - 1 - m0), stride_ct, INT64_LANES))  # [M]
        s = s * sm_scale_log2 + _bias_scores(coef_ptr + coef_rows[:, None], table_base,
                                             rows[:, None] + shift - cols[None, :], bias_lo, bias_extent, BIAS_RANK,
                                             BIAS_COEF, BIAS_CLAMP) * 1.4426950408889634
        vis = _visible(rows[:, None], cols[None, :], seqlen_k, shift, window_left, window_right, HAS_LEFT, HAS_RIGHT,
                       True) & col_ok[None, :] & row_ok[:, None]
        if HAS_Q_KEEP:
            q_keep_base = q_keep_ptr + seq64 * stride_qkb + q_start.to(tl.int64) * stride_qks
            vis = vis & _load_keep(q_keep_base, stride_qks, m0, offs_m, seqlen_q, INT64_LANES)[:, None]
        if HAS_K_KEEP:
            k_keep_base = k_keep_ptr + seq64 * stride_kkb + (k_start + k_row).to(tl.int64) * stride_kks
            vis = vis & _load_keep(k_keep_base, stride_kks, 0, k_lanes, seqlen_k - k_row, INT64_LANES)[None, :]
        p = tl.where(vis, tl.math.exp2(s - lse[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)  # [M, W]
        if DROPOUT:
            seed = tl.load(rng_ptr)
            rng_offset = tl.load(rng_ptr + 1).to(tl.int32)
            drop_head = head + tl.load(rng_ptr + 2).to(tl.int32)
            q_ids = _first_gid(q_gid_ptr, seq, q_start, seqlen_q_total, PACKED, HAS_GID) + rows
            k_ids = _first_gid(k_gid_ptr, seq, k_start, seqlen_k_total, PACKED, HAS_GID) + cols
            keep = _dropout_keep(seed, rng_offset, drop_head, q_ids[:, None], k_ids[None, :], drop_threshold)
            dp = tl.where(keep, dp * drop_scale, 0.0)
        ds = p * (dp - delta[:, None])  # [M, W] fp32: dL/d(logit)
        # column kk: each row's pair at distance d0 + kk, key j0 + m - kk + KB - 1 (always inside the window)
        diag = tl.gather(ds, offs_m[:, None] - tl.arange(0, BLOCK_KB)[None, :] + (BLOCK_KB - 1), 1)  # [M, KB]
        if BIAS_COEF:
            r_ids = tl.arange(0, BIAS_RB)
            coef_t = tl.load(coef_ptr + coef_rows[None, :] + tl.minimum(r_ids, BIAS_RANK - 1)[:, None],
                             mask=(r_ids[:, None] < BIAS_RANK) & row_ok[None, :], other=0.0).to(tl.float32)
            acc += tl.dot(coef_t, diag, input_precision="ieee")  # [RB, KB]
        else:
            acc += tl.sum(diag, 0)[None, :]
    return acc


@triton.jit
def _bias_grad_task(pid, q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, map_ptr, q_keep_ptr, k_keep_ptr, q_gid_ptr,
                    k_gid_ptr, rng_ptr, table_ptr, coef_ptr, part_ptr, batch, heads, n_tiles, n_chunks, n_kblocks,
                    seqlen_q_total, seqlen_k_total, group, sm_scale_log2, window_left, window_right, drop_threshold,
                    drop_scale, bias_lo, bias_extent, stride_th, stride_cb, stride_ct, stride_ch, stride_pc, stride_ph,
                    stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt,
                    stride_vh, stride_dob, stride_dot, stride_doh, stride_lb, stride_lh, stride_qkb, stride_qks,
                    stride_kkb, stride_kks, HEAD_DIM_QK: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                    BLOCK_DQK: tl.constexpr, BLOCK_DQK2: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_KB: tl.constexpr, BLOCK_W: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                    BOTTOM_RIGHT: tl.constexpr, PACKED: tl.constexpr, HAS_Q_KEEP: tl.constexpr,
                    HAS_K_KEEP: tl.constexpr, DROPOUT: tl.constexpr, HAS_GID: tl.constexpr, BIAS_RANK: tl.constexpr,
                    BIAS_RB: tl.constexpr, BIAS_COEF: tl.constexpr, BIAS_CLAMP: tl.constexpr,
                    DOT_PRECISION: tl.constexpr, INT64_LANES: tl.constexpr):
    """Task ``pid`` of the (distance block, q head, query-tile chunk) grid, distance blocks fastest: the
    chunk's share of the head's table gradient over the block's distances, into the partial buffer."""
    kb = pid % n_kblocks
    head = (pid // n_kblocks) % heads
    chunk = pid // (n_kblocks * heads)
    table_base = table_ptr + head.to(tl.int64) * stride_th
    acc = tl.zeros([BIAS_RB, BLOCK_KB], tl.float32)
    malformed = n_tiles * 0
    for t in range(chunk, n_tiles, n_chunks):
        tile = tl.minimum(t, n_tiles - 1)
        seq = _tile_seq(map_ptr, tile)
        malformed = tl.maximum(malformed, (seq < 0).to(tl.int32))
        if (seq >= 0) & (seq < batch):
            acc = _bias_grad_tile(acc, tile, kb, head, q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, map_ptr,
                                  q_keep_ptr, k_keep_ptr, q_gid_ptr, k_gid_ptr, rng_ptr, table_base, coef_ptr,
                                  seqlen_q_total, seqlen_k_total, group, sm_scale_log2, window_left, window_right,
                                  drop_threshold, drop_scale, bias_lo, bias_extent, stride_cb, stride_ct, stride_ch,
                                  stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb,
                                  stride_vt, stride_vh, stride_dob, stride_dot, stride_doh, stride_lb, stride_lh,
                                  stride_qkb, stride_qks, stride_kkb, stride_kks, seq, HEAD_DIM_QK, HEAD_DIM_V,
                                  BLOCK_DQK, BLOCK_DQK2, BLOCK_DV, BLOCK_M, BLOCK_KB, BLOCK_W, HAS_LEFT, HAS_RIGHT,
                                  BOTTOM_RIGHT, PACKED, HAS_Q_KEEP, HAS_K_KEEP, DROPOUT, HAS_GID, BIAS_RANK, BIAS_RB,
                                  BIAS_COEF, BIAS_CLAMP, DOT_PRECISION, INT64_LANES)
    acc = tl.where(malformed > 0, float("nan"), acc)  # malformed cu_seqlens or spans: NaN, never silently wrong
    r_ids = tl.arange(0, BIAS_RB)
    k_ids = kb * BLOCK_KB + tl.arange(0, BLOCK_KB)
    part = part_ptr + chunk.to(tl.int64) * stride_pc + head.to(tl.int64) * stride_ph
    # addresses inside the buffer for every lane: rows and entries clamped, the mask keeps the values right
    # (its rows are bias_extent apart: a contiguous buffer; the product's factors constexprs, below 2**31)
    tl.store(part + tl.minimum(r_ids, BIAS_RANK - 1)[:, None] * bias_extent
             + tl.minimum(k_ids, bias_extent - 1)[None, :], acc,
             mask=(r_ids[:, None] < BIAS_RANK) & (k_ids[None, :] < bias_extent))


@triton.jit(do_not_specialize=BIAS_GRAD_INTS)
def _attn_bwd_bias_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, map_ptr, q_keep_ptr, k_keep_ptr, q_gid_ptr, k_gid_ptr, rng_ptr,
    table_ptr, coef_ptr, part_ptr,
    batch, heads, n_tiles, n_chunks, n_kblocks, seqlen_q_total, seqlen_k_total, group, sm_scale_log2, window_left,
    window_right, drop_threshold, drop_scale, bias_lo, bias_extent: tl.constexpr, stride_th, stride_cb, stride_ct, stride_ch,
    stride_pc, stride_ph,
    stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_dob, stride_dot, stride_doh, stride_lb, stride_lh, stride_qkb, stride_qks, stride_kkb, stride_kks,
    HEAD_DIM_QK: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DQK2: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_KB: tl.constexpr, BLOCK_W: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, BOTTOM_RIGHT: tl.constexpr, PACKED: tl.constexpr,
    HAS_Q_KEEP: tl.constexpr, HAS_K_KEEP: tl.constexpr, DROPOUT: tl.constexpr, HAS_GID: tl.constexpr,
    BIAS_RANK: tl.constexpr, BIAS_RB: tl.constexpr, BIAS_COEF: tl.constexpr, BIAS_CLAMP: tl.constexpr,
    DOT_PRECISION: tl.constexpr, INT64_LANES: tl.constexpr, PERSISTENT: tl.constexpr,
):
    # grid: n_kblocks x heads x n_chunks programs, or PERSISTENT: fewer, each stepping over those tasks
    n_tasks = n_kblocks * heads * n_chunks
    if PERSISTENT:
        for task in range(tl.program_id(0), n_tasks, tl.num_programs(0)):
            t = tl.minimum(task, n_tasks - 1)  # addresses inside for any task (see attn_common)
            _bias_grad_task(t, q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, map_ptr, q_keep_ptr, k_keep_ptr,
                            q_gid_ptr, k_gid_ptr, rng_ptr, table_ptr, coef_ptr, part_ptr, batch, heads, n_tiles,
                            n_chunks, n_kblocks, seqlen_q_total, seqlen_k_total, group, sm_scale_log2, window_left,
                            window_right, drop_threshold, drop_scale, bias_lo, bias_extent, stride_th, stride_cb,
                            stride_ct, stride_ch, stride_pc, stride_ph, stride_qb, stride_qt, stride_qh,
                            stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_dob, stride_dot,
                            stride_doh, stride_lb, stride_lh, stride_qkb, stride_qks, stride_kkb, stride_kks,
                            HEAD_DIM_QK, HEAD_DIM_V, BLOCK_DQK, BLOCK_DQK2, BLOCK_DV, BLOCK_M, BLOCK_KB, BLOCK_W,
                            HAS_LEFT, HAS_RIGHT, BOTTOM_RIGHT, PACKED, HAS_Q_KEEP, HAS_K_KEEP, DROPOUT, HAS_GID,
                            BIAS_RANK, BIAS_RB, BIAS_COEF, BIAS_CLAMP, DOT_PRECISION, INT64_LANES)
    else:
        _bias_grad_task(tl.program_id(0), q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, map_ptr, q_keep_ptr,
                        k_keep_ptr, q_gid_ptr, k_gid_ptr, rng_ptr, table_ptr, coef_ptr, part_ptr, batch, heads, n_tiles,
                        n_chunks, n_kblocks, seqlen_q_total, seqlen_k_total, group, sm_scale_log2, window_left,
                        window_right, drop_threshold, drop_scale, bias_lo, bias_extent, stride_th, stride_cb, stride_ct,
                        stride_ch, stride_pc, stride_ph, stride_qb, stride_qt, stride_qh, stride_kb,
                        stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_dob, stride_dot, stride_doh,
                        stride_lb, stride_lh, stride_qkb, stride_qks, stride_kkb, stride_kks, HEAD_DIM_QK, HEAD_DIM_V,
                        BLOCK_DQK, BLOCK_DQK2, BLOCK_DV, BLOCK_M, BLOCK_KB, BLOCK_W, HAS_LEFT, HAS_RIGHT, BOTTOM_RIGHT,
                        PACKED, HAS_Q_KEEP, HAS_K_KEEP, DROPOUT, HAS_GID, BIAS_RANK, BIAS_RB, BIAS_COEF, BIAS_CLAMP,
                        DOT_PRECISION, INT64_LANES)


def _chunks(n_tiles: int, heads: int, rank: int, extent: int) -> int:
    """Query-tile chunks of the table gradient kernel: as many as the partial buffer's bound allows."""
    return max(1, min(n_tiles, PARTIAL_ELEMENTS // max(1, heads * rank * extent)))


def _far_grad(bias: TableBias, far: torch.Tensor, q_pack: Packing, heads: int) -> torch.Tensor:
    """[Hq, R, 2]: the clamped table's end entries' gradient from the rows' sums of dS beyond them
    (``far`` [2, lse's layout], from the dQ kernel), weighted by the rows' coefficients."""
    if q_pack.fmt == "thd":
        rows = far.transpose(1, 2)  # [2, T, Hq]
    else:
        rows = far.transpose(2, 3).reshape(2, -1, heads)  # [2, B * S, Hq]: token b * S + s
    if bias.coef is None:
        return rows.sum(1).t().unsqueeze(1)  # [Hq, 1, 2]
    coef = bias.coef if q_pack.fmt != "sbhd" else bias.coef.transpose(0, 1)
    coef = coef.reshape(-1, heads, coef.shape[-1])  # [N, Hq, R]
    return torch.einsum("enh,nhr->hre", rows, coef)


@on_device
def bias_table_grad(dout, q, k, v, lse, delta, q_pack: Packing, k_pack: Packing, softmax_scale: float,
                    window_left: int, window_right: int, bottom_right: bool, bias: TableBias, far: torch.Tensor | None,
                    dropout_p: float = 0.0, rng_state: torch.Tensor | None = None) -> torch.Tensor:
    """The gradient of ``bias.table`` (its shape, fp32) from the backward's saved lse and delta
    (rowsum(dO * O), lse's layout), and ``far`` (the dQ kernel's sums beyond a clamped table's
    ends, [2, lse's layout]; None unless ``bias.clamp``). Windows already clamped (kernel_window);
    a side without tokens already stood in for (packing.side_stand_ins)."""
    heads_q, dim_qk = q.shape[-2:]
    heads_kv, dim_v = v.shape[-2:]
    heads_t, rank, extent = bias.table.shape
    batch = q_pack.batch
    target = target_of(q.device)
    block_dqk, block_dqk2, block_dv = head_blocks(dim_qk, dim_v)
    cfg = bias_grad_config(q.device)
    block_w = triton.next_power_of_2(cfg.block_m + cfg.block_n - 1)
    seqlen_q_total, seqlen_k_total = seq_len_dim(q, q_pack.fmt), seq_len_dim(k, k_pack.fmt)
    n_tiles = tile_bound(batch, seqlen_q_total, cfg.block_m, q_pack.fmt == "thd")
    n_kblocks = triton.cdiv(extent, cfg.block_n)
    n_chunks = _chunks(n_tiles, heads_q, rank, extent)
    part = torch.zeros((n_chunks, heads_q, rank, extent), dtype=torch.float32, device=q.device)
    if n_tiles > 0 and q.numel() > 0:
        tile_map, _ = tile_maps(q_pack, k_pack, seqlen_q_total, seqlen_k_total, target,
                                q_tiles=(cfg.block_m, n_tiles))
        grid, persistent = launch_grid(q.device, target, n_kblocks * n_chunks, heads_q)
        coef = bias.coef if bias.coef is not None else bias.table
        launch(
            target, _attn_bwd_bias_kernel, grid, q, k, v, dout, lse, delta, tile_map, keep_args(q_pack)[0], keep_args(k_pack)[0], table_ptr=bias.table,
            coef_ptr=coef, part_ptr=part, batch=batch, heads=heads_q, n_tiles=n_tiles, n_chunks=n_chunks,
            n_kblocks=n_kblocks, seqlen_q_total=seqlen_q_total, seqlen_k_total=seqlen_k_total,
            group=heads_q // heads_kv, sm_scale_log2=softmax_scale * LOG2E, window_left=window_left,
            window_right=window_right, bias_lo=bias.lo, bias_extent=extent,
            stride_th=bias.table.stride(0) if heads_t > 1 else 0,
            **dict(zip(("stride_cb", "stride_ct", "stride_ch"),
                       seq_strides(bias.coef, q_pack.fmt) if bias.coef is not None else (0, 0, 0))),
            stride_pc=part.stride(0), stride_ph=part.stride(1),
            **dict(zip(("stride_qb", "stride_qt", "stride_qh"), seq_strides(q, q_pack.fmt))),
            **dict(zip(("stride_kb", "stride_kt", "stride_kh"), seq_strides(k, k_pack.fmt))),
            **dict(zip(("stride_vb", "stride_vt", "stride_vh"), seq_strides(v, k_pack.fmt))),
            **dict(zip(("stride_dob", "stride_dot", "stride_doh"), seq_strides(dout, q_pack.fmt))),
            **dict(zip(("stride_lb", "stride_lh"), rowstat_strides(lse, q_pack))),
            **dict(zip(("stride_qkb", "stride_qks"), keep_args(q_pack)[1:])),
            **dict(zip(("stride_kkb", "stride_kks"), keep_args(k_pack)[1:])),
            HEAD_DIM_QK=dim_qk, HEAD_DIM_V=dim_v, BLOCK_DQK=block_dqk, BLOCK_DQK2=block_dqk2, BLOCK_DV=block_dv,
            BLOCK_M=cfg.block_m, BLOCK_KB=cfg.block_n, BLOCK_W=block_w, BIAS_RANK=rank,
            BIAS_RB=max(16, triton.next_power_of_2(rank)) if bias.coef is not None else 1,
            BIAS_COEF=bias.coef is not None, BIAS_CLAMP=bias.clamp, DOT_PRECISION=dot_precision(q.dtype, target),
            PERSISTENT=persistent,
            **lane_flags(block_w, max(block_dqk + block_dqk2, block_dv),
                         ((q_pack, (q, dout) + (() if bias.coef is None else (bias.coef,))), (k_pack, (k, v)))),
            **dropout_args(dropout_p, rng_state, q_pack, k_pack),
            **mask_flags(window_left, window_right, bottom_right, q_pack, k_pack), **cfg.launch(),
        )
    grad = part.sum(0)  # [Hq, R, E]: a fixed-order torch reduction
    if far is not None:
        ends = _far_grad(bias, far, q_pack, heads_q)  # [Hq, R, 2]
        grad[:, :, 0] += ends[..., 0]
        grad[:, :, extent - 1] += ends[..., 1]
    if heads_t == 1:
        grad = grad.sum(0, keepdim=True)
    return grad
