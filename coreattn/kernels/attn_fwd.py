"""Varlen flash-attention forward: kernel and launcher.

One kernel for every case: causal/window masks are constexpr flags, head dims are real
(HEAD_DIM_*) plus padded power-of-two blocks (BLOCK_D*). Lengths and token counts are runtime
ints that never specialize, so a new packed batch never recompiles. max_seqlen only sizes the
grid: each program strides over its sequence's query blocks, so a too-small max_seqlen costs
speed, not correctness. ``PERSISTENT`` (Ascend) runs the same programs as tasks of a
core-count 1D grid (kernels/config.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from coreattn.kernels.attn_common import (LENGTH_STRIDES, _key_range, _layout_ok, _load_keep, _poison_program_rows,
                                          _seq_span, _visible)
from coreattn.kernels.config import fwd_config, head_block, persistent_grid, target_of
from coreattn.kernels.packing import (Packing, keep_args, kernel_flags, new_like, new_rowstat, rowstat_strides, seq_len_dim,
                                      seq_strides)

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
MAX_GRID_YZ = 65535
MAX_TASKS = 2**31 - 1  # persistent launches index their tasks with int32
CU_SCAN_BLOCK = 128  # fixed, so the batch size never enters a compile key


@triton.jit
def _fwd_kv_steps(acc, m_i, l_i, q, q_keep, k_base, v_base, k_keep_base, stride_kt, stride_vt, stride_kks,
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
        k_ptrs = k_base + tl.cast(n0, tl.int64) * stride_kt + offs_n[None, :] * stride_kt + offs_dqk[:, None]
        v_ptrs = v_base + tl.cast(n0, tl.int64) * stride_vt + offs_n[:, None] * stride_vt + offs_dv[None, :]
        if MASKED:
            kT = tl.load(k_ptrs, mask=(cols[None, :] < seqlen_k) & (offs_dqk[:, None] < HEAD_DIM_QK), other=0.0)
            v = tl.load(v_ptrs, mask=(cols[:, None] < seqlen_k) & (offs_dv[None, :] < HEAD_DIM_V), other=0.0)
        else:
            kT = tl.load(k_ptrs, mask=offs_dqk[:, None] < HEAD_DIM_QK, other=0.0)
            v = tl.load(v_ptrs, mask=offs_dv[None, :] < HEAD_DIM_V, other=0.0)
        s = tl.dot(q, kT, input_precision=DOT_PRECISION) * sm_scale_log2  # [M, N], log2 domain
        if MASKED:
            vis = _visible(rows[:, None], cols[None, :], seqlen_q, seqlen_k, shift,
                           window_left, window_right, HAS_LEFT, HAS_RIGHT)
            k_keep = _load_keep(k_keep_base, stride_kks, cols, seqlen_k, HAS_K_KEEP)
            vis = vis & q_keep[:, None] & k_keep[None, :]
            s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # a row that has seen no key yet keeps m = -inf; subtract 0 instead so p and alpha are 0, not NaN
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _fwd_q_block(q_base, k_base, v_base, o_base, lse_base, q_keep_base, k_keep_base, m0, seqlen_q, seqlen_k, shift,
                 window_left, window_right, sm_scale_log2, stride_qt, stride_kt, stride_vt, stride_ot,
                 stride_qks, stride_kks,
                 HEAD_DIM_QK: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                 BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_Q_KEEP: tl.constexpr,
                 HAS_K_KEEP: tl.constexpr, DOT_PRECISION: tl.constexpr):
    offs_m = tl.arange(0, BLOCK_M)
    offs_dqk = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    rows = m0 + offs_m
    row_ok = rows < seqlen_q
    q_ptrs = q_base + tl.cast(m0, tl.int64) * stride_qt + offs_m[:, None] * stride_qt + offs_dqk[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & (offs_dqk[None, :] < HEAD_DIM_QK), other=0.0)  # [M, DQK]
    q_keep = _load_keep(q_keep_base, stride_qks, rows, seqlen_q, HAS_Q_KEEP)  # [M]

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    lo, full_lo, full_hi, hi = _key_range(m0, seqlen_q, seqlen_k, shift, window_left, window_right,
                                          BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT, HAS_Q_KEEP or HAS_K_KEEP)
    acc, m_i, l_i = _fwd_kv_steps(acc, m_i, l_i, q, q_keep, k_base, v_base, k_keep_base, stride_kt, stride_vt,
                                  stride_kks, rows, lo, full_lo, seqlen_q, seqlen_k, shift, window_left, window_right,
                                  sm_scale_log2, HEAD_DIM_QK, HEAD_DIM_V, BLOCK_DQK, BLOCK_DV, BLOCK_N,
                                  HAS_LEFT, HAS_RIGHT, HAS_K_KEEP, True, DOT_PRECISION)
    acc, m_i, l_i = _fwd_kv_steps(acc, m_i, l_i, q, q_keep, k_base, v_base, k_keep_base, stride_kt, stride_vt,
                                  stride_kks, rows, full_lo, full_hi, seqlen_q, seqlen_k, shift, window_left, window_right,
                                  sm_scale_log2, HEAD_DIM_QK, HEAD_DIM_V, BLOCK_DQK, BLOCK_DV, BLOCK_N,
                                  HAS_LEFT, HAS_RIGHT, HAS_K_KEEP, False, DOT_PRECISION)
    acc, m_i, l_i = _fwd_kv_steps(acc, m_i, l_i, q, q_keep, k_base, v_base, k_keep_base, stride_kt, stride_vt,
                                  stride_kks, rows, full_hi, hi, seqlen_q, seqlen_k, shift, window_left, window_right,
                                  sm_scale_log2, HEAD_DIM_QK, HEAD_DIM_V, BLOCK_DQK, BLOCK_DV, BLOCK_N,
                                  HAS_LEFT, HAS_RIGHT, HAS_K_KEEP, True, DOT_PRECISION)

    empty = l_i == 0.0  # the row saw no key: output 0 and lse = -inf
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * 0.6931471805599453)
    o_ptrs = o_base + tl.cast(m0, tl.int64) * stride_ot + offs_m[:, None] * stride_ot + offs_dv[None, :]
    tl.store(o_ptrs, out.to(o_base.dtype.element_ty), mask=row_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V))
    tl.store(lse_base + tl.cast(m0, tl.int64) + offs_m, lse, mask=row_ok)


@triton.jit
def _fwd_program(pid_m, seq, head, num_pid_m,
                 q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, q_seq_ptr, q_len_ptr, k_seq_ptr, k_len_ptr, q_keep_ptr,
                 k_keep_ptr, batch, seqlen_q_total, seqlen_k_total, group, sm_scale_log2, window_left, window_right,
                 stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                 stride_ob, stride_ot, stride_oh, stride_lb, stride_lh, stride_qkb, stride_qks, stride_kkb, stride_kks,
                 HEAD_DIM_QK: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                 BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr,
                 HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, BOTTOM_RIGHT: tl.constexpr,
                 SPANS: tl.constexpr, HAS_Q_KEEP: tl.constexpr, HAS_K_KEEP: tl.constexpr,
                 DOT_PRECISION: tl.constexpr):
    """What one program of the (query-block programs, sequences, q heads) grid does: the query
    blocks pid_m, pid_m + num_pid_m, ... of sequence ``seq`` for q head ``head``."""
    o_head = out_ptr + seq.to(tl.int64) * stride_ob + head.to(tl.int64) * stride_oh
    lse_head = lse_ptr + seq.to(tl.int64) * stride_lb + head.to(tl.int64) * stride_lh
    ok = _layout_ok(q_seq_ptr, q_len_ptr, k_seq_ptr, k_len_ptr, seq, batch, seqlen_q_total, seqlen_k_total,
                    SPANS, BLOCK_B)
    if ok:
        q_start, seqlen_q = _seq_span(q_seq_ptr, q_len_ptr, seq, SPANS)
        k_start, seqlen_k = _seq_span(k_seq_ptr, k_len_ptr, seq, SPANS)
        shift = seqlen_q * 0
        if BOTTOM_RIGHT:
            shift = seqlen_k - seqlen_q
        kv_head = (head // group).to(tl.int64)
        q_base = q_ptr + seq.to(tl.int64) * stride_qb + q_start.to(tl.int64) * stride_qt + head.to(tl.int64) * stride_qh
        k_base = k_ptr + seq.to(tl.int64) * stride_kb + k_start.to(tl.int64) * stride_kt + kv_head * stride_kh
        v_base = v_ptr + seq.to(tl.int64) * stride_vb + k_start.to(tl.int64) * stride_vt + kv_head * stride_vh
        o_base = o_head + q_start.to(tl.int64) * stride_ot
        lse_base = lse_head + q_start.to(tl.int64)
        q_keep_base = q_keep_ptr + seq.to(tl.int64) * stride_qkb + q_start.to(tl.int64) * stride_qks
        k_keep_base = k_keep_ptr + seq.to(tl.int64) * stride_kkb + k_start.to(tl.int64) * stride_kks
        for m0 in range(pid_m * BLOCK_M, seqlen_q, num_pid_m * BLOCK_M):
            _fwd_q_block(q_base, k_base, v_base, o_base, lse_base, q_keep_base, k_keep_base, m0, seqlen_q, seqlen_k,
                         shift, window_left, window_right, sm_scale_log2, stride_qt, stride_kt, stride_vt, stride_ot,
                         stride_qks, stride_kks, HEAD_DIM_QK, HEAD_DIM_V, BLOCK_DQK, BLOCK_DV, BLOCK_M, BLOCK_N,
                         HAS_LEFT, HAS_RIGHT, HAS_Q_KEEP, HAS_K_KEEP, DOT_PRECISION)
    else:
        # malformed cu_seqlens or spans: NaN rather than silently wrong numbers
        _poison_program_rows(o_head, pid_m, seq, num_pid_m, batch, seqlen_q_total, stride_ot,
                             HEAD_DIM_V, BLOCK_DV, BLOCK_M, SPANS)
        _poison_program_rows(lse_head, pid_m, seq, num_pid_m, batch, seqlen_q_total, 1, 1, 1, BLOCK_M, SPANS)


@triton.jit(do_not_specialize=["batch", "grid_m", "seqlen_q_total", "seqlen_k_total", "window_left", "window_right",
                             *LENGTH_STRIDES])
def _varlen_attn_fwd_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, q_seq_ptr, q_len_ptr, k_seq_ptr, k_len_ptr, q_keep_ptr, k_keep_ptr,
    batch, heads, grid_m, seqlen_q_total, seqlen_k_total, group, sm_scale_log2, window_left, window_right,
    stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_ob, stride_ot, stride_oh, stride_lb, stride_lh, stride_qkb, stride_qks, stride_kkb, stride_kks,
    HEAD_DIM_QK: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, BOTTOM_RIGHT: tl.constexpr,
    SPANS: tl.constexpr, HAS_Q_KEEP: tl.constexpr, HAS_K_KEEP: tl.constexpr, DOT_PRECISION: tl.constexpr,
    PERSISTENT: tl.constexpr,
):
    # grid: (grid_m query-block programs per sequence, sequences, q heads). PERSISTENT (Ascend):
    # a 1D grid of core-count programs, each running a share of those same (pid_m, seq, head)
    # tasks in turn. seqlen_*_total is the token count T (thd) or the padded length S
    # (bshd/sbhd); see kernels/packing.py.
    if PERSISTENT:
        for task in range(tl.program_id(0), grid_m * batch * heads, tl.num_programs(0)):
            _fwd_program(task % grid_m, task // (grid_m * heads), (task // grid_m) % heads, grid_m,
                         q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, q_seq_ptr, q_len_ptr, k_seq_ptr, k_len_ptr,
                         q_keep_ptr, k_keep_ptr, batch, seqlen_q_total, seqlen_k_total, group, sm_scale_log2,
                         window_left, window_right, stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
                         stride_vb, stride_vt, stride_vh, stride_ob, stride_ot, stride_oh, stride_lb, stride_lh,
                         stride_qkb, stride_qks, stride_kkb, stride_kks, HEAD_DIM_QK, HEAD_DIM_V, BLOCK_DQK, BLOCK_DV,
                         BLOCK_M, BLOCK_N, BLOCK_B, HAS_LEFT, HAS_RIGHT, BOTTOM_RIGHT, SPANS, HAS_Q_KEEP, HAS_K_KEEP,
                         DOT_PRECISION)
    else:
        _fwd_program(tl.program_id(0), tl.program_id(1), tl.program_id(2), tl.num_programs(0),
                     q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, q_seq_ptr, q_len_ptr, k_seq_ptr, k_len_ptr,
                     q_keep_ptr, k_keep_ptr, batch, seqlen_q_total, seqlen_k_total, group, sm_scale_log2,
                     window_left, window_right, stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
                     stride_vb, stride_vt, stride_vh, stride_ob, stride_ot, stride_oh, stride_lb, stride_lh,
                     stride_qkb, stride_qks, stride_kkb, stride_kks, HEAD_DIM_QK, HEAD_DIM_V, BLOCK_DQK, BLOCK_DV,
                     BLOCK_M, BLOCK_N, BLOCK_B, HAS_LEFT, HAS_RIGHT, BOTTOM_RIGHT, SPANS, HAS_Q_KEEP, HAS_K_KEEP,
                     DOT_PRECISION)


def dot_precision(dtype: torch.dtype, target: str) -> str:
    """fp32 inputs run at IEEE precision (no TF32); 16-bit inputs use the native MMA. Ascend
    accepts only "ieee" and "hf32" (16-bit inputs are exact there either way)."""
    return "ieee" if dtype == torch.float32 or target == "ascend" else "tf32"


def check_grid(batch: int, heads: int) -> None:
    if batch > MAX_GRID_YZ or heads > MAX_GRID_YZ:
        raise ValueError(f"batch ({batch}) and heads ({heads}) must each be <= {MAX_GRID_YZ} for the Triton grid")


def launch_grid(device: torch.device, target: str, grid_x: int, batch: int, heads: int,
                hint: bool = True, vector_only: bool = False) -> tuple[tuple[int, ...], int, bool]:
    """(grid, grid_x, PERSISTENT) for a kernel whose programs are (grid_x, batch, heads).

    CUDA and the interpreter launch that 3D grid. Ascend launches a persistent 1D grid of
    core-count programs that loop over the grid_x * batch * heads tasks (kernels/config.py); the
    task count must fit int32, so when grid_x only sizes a grid-stride loop (``hint``) it is
    capped, costing speed, not correctness."""
    if target != "ascend":
        check_grid(batch, heads)
        return (grid_x, batch, heads), grid_x, False
    if hint:
        grid_x = max(1, min(grid_x, MAX_TASKS // (batch * heads)))
    if grid_x * batch * heads > MAX_TASKS:
        raise ValueError(f"{grid_x} x {batch} x {heads} tasks do not fit the persistent grid's int32 task index")
    return (persistent_grid(device, grid_x * batch * heads, vector_only),), grid_x, True


def kernel_window(window: int, limit: int) -> int:
    """A window at least as wide as every sequence (``limit``: the larger of the q and k token
    counts or padded lengths) sees everything it would see unbounded, so clamp it there: the
    kernels' int32 index arithmetic (``i + shift +- window``) then cannot overflow. -1 stays -1."""
    return min(window, limit)


def mask_flags(window_left: int, window_right: int, bottom_right: bool, q_pack: Packing, k_pack: Packing) -> dict:
    return dict(HAS_LEFT=window_left >= 0, HAS_RIGHT=window_right >= 0, BOTTOM_RIGHT=bottom_right,
                BLOCK_B=CU_SCAN_BLOCK, **kernel_flags(q_pack, k_pack))


def varlen_attn_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pack: Packing, k_pack: Packing,
                    max_seqlen_q: int, softmax_scale: float, window_left: int = -1, window_right: int = -1,
                    bottom_right: bool = True, out: torch.Tensor | None = None, lse: torch.Tensor | None = None, *,
                    dropout_p: float = 0.0, rng_state: torch.Tensor | None = None,
                    softmax_offset: torch.Tensor | None = None, return_max_logit: bool = False):
    """Launch the forward kernel on q/k/v laid out as ``q_pack``/``k_pack`` say (kernels/packing.py).

    thd: q [Tq, Hq, Dqk], k [Tk, Hkv, Dqk], v [Tk, Hkv, Dv]; returns out [Tq, Hq, Dv] (q's
    dtype) and lse [Hq, Tq] float32 (natural log, -inf for rows that see no key).
    bshd/sbhd: out in the same layout as q and lse [B, Hq, S]. In span mode rows outside the
    spans are zeros (lse -inf); rows a keep mask drops see no key (zeros, lse -inf). Last strides must be 1; inputs are assumed checked by the caller
    (coreattn.layers.checks). ``out``/``lse`` may be given as preallocated buffers.
    """
    if dropout_p or softmax_offset is not None or return_max_logit:
        raise NotImplementedError("dropout, softmax_offset and return_max_logit are not in the Triton kernels yet; "
                                  "use backend='torch'")
    heads_q, dim_qk = q.shape[-2:]
    heads_kv, dim_v = v.shape[-2:]
    batch = q_pack.batch
    if out is None:
        out = new_like(q, q_pack, dim_v)
    if lse is None:
        lse = new_rowstat(q, q_pack)
    seqlen_q_total, seqlen_k_total = seq_len_dim(q, q_pack.fmt), seq_len_dim(k, k_pack.fmt)
    if q.numel() == 0 or batch == 0:
        return out, lse
    limit = max(seqlen_q_total, seqlen_k_total)
    window_left, window_right = kernel_window(window_left, limit), kernel_window(window_right, limit)
    target = target_of(q.device)
    block_dqk, block_dv = head_block(dim_qk), head_block(dim_v)
    cfg = fwd_config(q.device, block_dqk, block_dv, q.element_size())
    grid, grid_m, persistent = launch_grid(q.device, target, max(1, triton.cdiv(max_seqlen_q, cfg.block_m)),
                                           batch, heads_q)
    _varlen_attn_fwd_kernel[grid](
        q, k, v, out, lse, q_pack.seq, q_pack.lens, k_pack.seq, k_pack.lens,
        keep_args(q_pack)[0], keep_args(k_pack)[0],
        batch, heads_q, grid_m, seqlen_q_total, seqlen_k_total, heads_q // heads_kv,
        softmax_scale * LOG2E, window_left, window_right,
        *seq_strides(q, q_pack.fmt), *seq_strides(k, k_pack.fmt), *seq_strides(v, k_pack.fmt),
        *seq_strides(out, q_pack.fmt), *rowstat_strides(lse, q_pack), *keep_args(q_pack)[1:], *keep_args(k_pack)[1:],
        HEAD_DIM_QK=dim_qk, HEAD_DIM_V=dim_v, BLOCK_DQK=block_dqk, BLOCK_DV=block_dv,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, DOT_PRECISION=dot_precision(q.dtype, target),
        PERSISTENT=persistent, **mask_flags(window_left, window_right, bottom_right, q_pack, k_pack),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out, lse
