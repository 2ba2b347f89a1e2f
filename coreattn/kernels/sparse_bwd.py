"""Top-k sparse attention backward: kernels and launcher (the forward: kernels/sparse_fwd.py).

Deterministic by default (no float atomics; two runs are bitwise equal). The rows take the
forward's two modes (kernels/sparse_fwd.py; kernels/sparse_index.py ``row_classes``):

1. delta = rowsum(dO * O) per (token, q head), fp32: the dense backward's preprocess kernel
   (kernels/attn_bwd.py), which reads any of the three layouts;
2. ``_sparse_attn_dq_kernel``, per mode as the forward's programs: it recomputes P from the saved
   lse over the row's slot blocks (slot mode) or its contiguous keys (range mode, BLOCK_T tokens x
   BLOCK_H heads per tile), dP = dO V^T, dS = P (dP - delta), dQ += dS K, and stores dQ once;
3. ``_sparse_attn_dkv_kernel`` in range mode, a program per (block of BLOCK_N keys of a sample, kv
   head): dense attention's dK/dV. It loads its keys (and values) once and steps over the token
   blocks whose full rows may see them (``range_visits``) and the group's head blocks: S^T, P^T,
   dP^T, dS^T, dK += scale * dS^T q and dV += P^T dO (absorbed MLA where the key block is V: into the
   same accumulator's first columns), each (key, row) pair masked by the row's range; then it stores
   its rows into an fp32 accumulator ``[key rows, Hkv, row]``, one writer per row, every key row of
   the batch (0 where no full row sees it): no scatter, no partial buffer;
The slot mode's dK/dV then take one of two deterministic schedules (``dkv_schedule``: the one that
moves fewer bytes per (token, kv head, slot) entry; ``schedule=`` or ``COREATTN_SPARSE_DKV`` forces one):

token-centric ("partials": wide groups, absorbed MLA's 16-128 q heads on one latent head):

4. ``_sparse_attn_dkv_kernel`` in slot mode, a program per (query token, kv head, block of BLOCK_N
   of the row's valid slots; a block past them, and every block of a full row, does nothing): it
   gathers the slots' keys (and values) once and steps over the group's q heads in blocks of
   BLOCK_H: partial[n, g, slot] = scale * dS^T q (dK) and P^T dO (dV), fp32, one write per valid
   (token, slot);
5. ``_sparse_attn_reduce_kernel`` over the chunk's CSR by key (kernels/sparse_index.py
   ``transpose_topk``, full rows left out), compacted to the keys the chunk names: a task per
   (named key row, kv head, column block), its count read on the device (no host sync) by a bounded
   grid (``reduce_grid``: 16,384 programs on a GPU) whose programs step over the tasks; each adds its
   key's partial rows into the accumulator one at a time in (token, slot) order, so the sums do not
   depend on timing; one writer per accumulator row per launch. Its work and the CSR's follow the
   chunk's entries (at most C x Hidx x K segments), never the key rows: the backward is linear in T.
(4) and (5) run per chunk of query tokens whose partial buffer fits ``PARTIAL_BUDGET_BYTES``
(env ``COREATTN_SPARSE_BWD_BYTES``); a key's entries are added after the range mode's sum, in
(token, slot) order across chunks too, so any chunking gives bitwise the same gradients;

key-centric ("keys": small groups, per-head K/V as transformers' DeepSeek-V3.2 and GLM-5 and Megatron's
DSAttention in a plain MLA layer hand it, one q head per kv head):

4'. ``_sparse_attn_dkv_keys_kernel``, a program per (key row, kv head) over the tokens that name the
   key (kernels/sparse_index.py ``key_csr``: a CSR by key over every token, built a chunk of tokens
   at a time by a counting sort, tokens ascending), BLOCK_M entries x the group's heads per step: P,
   dP and dS recomputed from q, dO, lse and delta, dK += scale * dS q and dV += P dO summed over the
   step's rows (CUDA cores; no tl.dot), onto the range mode's sum, stored once. No partial buffer, no
   chunks: one launch. Deterministic (a fixed order, one writer per row) and bitwise repeatable, but
   its sums run in another order than the token-centric schedule's (they agree within rounding).

At the end the accumulator is cast into dk (and dv) in k's (v's) dtype and layout; absorbed MLA has
no dv: its V gradient is in dk's first v_dim columns.

``atomic=True`` (an option for the tuner or an explicit opt-in): (4) adds its rows atomically into
the fp32 accumulator after (3), in launches of at most ``MAX_LAUNCH_TASKS`` tasks; no partial buffer,
no CSR, no (5). Float atomics add in whatever order the programs run: results vary in the last bits
from run to run (not bitwise reproducible).

Saved by the forward for this (the caller keeps them): q, k, v, out, lse, the prepared indices and
the bounds: O(T * K) beyond the inputs and output (int32 indices, 4 B per slot). Recomputed: the
scores and probabilities (from lse), in (2), (3) and (4). Memory of this launcher beyond its
outputs: delta (4 B per (token, q head)); the fp32 accumulator, (Dqk + Dv) x 4 B per (key row, kv
head) (absorbed MLA with the key block as V: Dqk x 4 B; 576/512 over 32k keys: 75 MB; per-head
192/128 with 128 kv heads over 128k keys: 21 GB, as much as dK and dV in bf16 twice over); the
token-centric schedule's partial buffer per chunk of C query tokens, Hkv x C x K x (its row width,
padded to 4 columns) x 4 B, at most the budget (C is the largest that fits, at least 1: 576/512 with
K = 2048 is 4.7 MB per token, 227 tokens per chunk in the default 1 GiB; per-head 192/128 with 128 kv
heads 335 MB per token, 3 tokens per chunk), plus the chunk's CSR: about 60 B per (token, index head,
slot) while torch sorts and compacts it, 4 B kept and 12 B per segment; the key-centric schedule's
CSR instead: 4 B per (token, index head, slot) kept (the prepared indices' size again), 24 B per
(index head, key row) of counts and row pointers, and about 60 B per entry of one chunk of
``KEY_CSR_CHUNK_ENTRIES`` while it is built; the row classes (``row_classes``: 8 B per (token, index
head) of spans, 1 B of class) and the range mode's visits (8 B per (index head, sample, key block)).
The atomic variant needs the accumulator only.

Traffic per (token, kv head, slot) entry of the slot mode: the dQ kernel gathers its key (and value)
row; the token-centric dK/dV gathers it again and writes and reads its fp32 partial row (2 x 4 x row
width bytes: 4.6 KB at 576/512, 2.5 KB at 192/128); the key-centric dK/dV reads instead the token's q
and dO rows, lse and delta for each head of the group (648 B at 192/128 bf16, group 1: about what the
forward gathers); the atomic variant one fp32 atomic add per element of the row. Range mode: keys read
as contiguous rows, once per token block (dQ) and once per key block (dK/dV, which reads each full
row's q and dO once per key block of BLOCK_N keys); nothing written but dQ and the accumulator.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from coreattn.kernels.attn_bwd import _attn_bwd_preprocess_kernel
from coreattn.kernels.attn_common import _batch_stride, batch_aligned, int64_lanes
from coreattn.kernels.attn_fwd import LOG2E, dot_precision
from coreattn.kernels.configs.sparse import sparse_config
from coreattn.kernels.configs.targets import persistent_grid, target_of
from coreattn.kernels.device import on_device
from coreattn.kernels.launch import launch
from coreattn.kernels.packing import seq_strides
from coreattn.kernels.sparse_blocks import BlockLayout, block_classes, block_table, table_size, transpose_blocks
from coreattn.kernels.sparse_fwd import (BATCH_STRIDES, BLOCK_RUNTIME_INTS, SPARSE_RUNTIME_INTS, _block_rows,
                                         _key_block, _key_rows, _program_block, _program_keys, _q_tiles, _range_keys,
                                         _range_rows, _row_offsets, _slot_rows, _store_tile, _tile, _token,
                                         _token_bounds, block_tiles, key_side, lse_strides, mode_tiles, new_lse,
                                         slots_of, sparse_problem, token_grid)
from coreattn.kernels.sparse_index import key_csr, range_visits, row_classes, transpose_topk

PARTIAL_BUDGET_BYTES = 1 << 30  # the deterministic backward's partial buffer per chunk of query tokens
ENV_PARTIAL_BUDGET = "COREATTN_SPARSE_BWD_BYTES"
COLUMN_ALIGN = 4  # partial and accumulator rows are padded to 16 bytes


def partial_budget() -> int:
    """Bytes the partial buffer of one chunk may take: ``COREATTN_SPARSE_BWD_BYTES`` if set, else
    ``PARTIAL_BUDGET_BYTES`` (read at each call)."""
    value = os.environ.get(ENV_PARTIAL_BUDGET, "").strip()
    if not value:
        return PARTIAL_BUDGET_BYTES
    try:
        budget = int(value)
    except ValueError:
        raise ValueError(f"{ENV_PARTIAL_BUDGET}={value!r}: expected a number of bytes") from None
    if budget <= 0:
        raise ValueError(f"{ENV_PARTIAL_BUDGET}={value!r}: expected a positive number of bytes")
    return budget


@triton.jit
def _row_stats(lse_ptr, delta_ptr, b64, s, heads, ok, stride_lb, stride_lh):
    """lse (log2 domain; -inf, a token without a visible key, and rows not ``ok`` as +inf: P = 0) and
    delta of the rows (position s, q head) [M] of sample b."""
    at = b64 * stride_lb + heads.to(tl.int64) * stride_lh + s
    lse = tl.load(lse_ptr + at, mask=ok, other=float("inf")) * 1.4426950408889634
    lse = tl.where(lse == float("-inf"), float("inf"), lse)
    delta = tl.load(delta_ptr + at, mask=ok, other=0.0)
    return lse, delta


@triton.jit
def _sparse_dq_program(task, q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, topk_ptr, span_ptr, full_ptr,
                       lo_ptr, hi_ptr, seqlen_q, seqlen_k, k_last, n_slots, heads_kv, group, n_hblocks, n_tblocks,
                       idx_heads, sm_scale, sm_scale_log2, stride_qb, stride_qt, stride_qh, stride_kb, stride_kt,
                       stride_kh, stride_vb, stride_vt, stride_vh, stride_dob, stride_dot, stride_doh, stride_dqb,
                       stride_dqt, stride_dqh, stride_lb, stride_lh, block_size, n_sub,
                       HEAD_DIM_QK: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DQK: tl.constexpr,
                       BLOCK_DQK2: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
                       BLOCK_N: tl.constexpr, V_IS_K: tl.constexpr, RANGE: tl.constexpr, BLOCKS: tl.constexpr,
                       DOT_PRECISION: tl.constexpr):
    b, tb, g, hb = _program_block(task, n_hblocks, heads_kv, n_tblocks)
    n, s, heads, row_ok = _block_rows(b, tb, hb, g, group, seqlen_q, BLOCK_T, BLOCK_H)
    ih = tl.minimum(g, idx_heads - 1)
    b64, g64 = b.to(tl.int64), g.to(tl.int64)
    q, q2 = _q_tiles(q_ptr + b64 * stride_qb, _row_offsets(s, heads, stride_qt, stride_qh), row_ok, HEAD_DIM_QK,
                     BLOCK_DQK, BLOCK_DQK2)  # [M, DQK], [M, DQK2]
    do = _tile(do_ptr + b64 * stride_dob, _row_offsets(s, heads, stride_dot, stride_doh), row_ok, HEAD_DIM_V, 0,
               BLOCK_DV)  # [M, DV]
    own, start, stop, lo, hi, idx_row = _program_keys(topk_ptr, span_ptr, full_ptr, lo_ptr, hi_ptr, b64, tb, n, ih,
                                                      idx_heads, heads, row_ok, seqlen_q, seqlen_k, n_slots, n_sub,
                                                      RANGE, BLOCKS, BLOCK_N)
    lse, delta = _row_stats(lse_ptr, delta_ptr, b64, s, heads, own, stride_lb, stride_lh)
    k_base = k_ptr + b64 * stride_kb + g64 * stride_kh
    v_base = v_ptr + b64 * stride_vb + g64 * stride_vh
    offs_n = tl.arange(0, BLOCK_N)
    dq = tl.zeros([BLOCK_T * BLOCK_H, BLOCK_DQK], tl.float32)
    dq2 = dq  # a second block only where the q/k dim is split (a 0-wide tl.zeros is no tensor)
    if BLOCK_DQK2 > 0:
        dq2 = tl.zeros([BLOCK_T * BLOCK_H, BLOCK_DQK2], tl.float32)
    for it in range(start, stop, BLOCK_N):
        load_ok, row, seen = _key_block(it, offs_n, stop, k_last, own, lo, hi, idx_row, n_slots, block_size, n_sub,
                                        RANGE, BLOCKS, BLOCK_N)
        kb, kb2, vb = _key_rows(k_base, v_base, row, load_ok, stride_kt, stride_vt, HEAD_DIM_QK, HEAD_DIM_V,
                                BLOCK_DQK, BLOCK_DQK2, BLOCK_DV, V_IS_K)  # [N, DQK], [N, DQK2], [N, DV]
        scores = tl.dot(q, tl.trans(kb), input_precision=DOT_PRECISION)  # [M, N]
        if BLOCK_DQK2 > 0:
            scores = tl.dot(q2, tl.trans(kb2), scores, input_precision=DOT_PRECISION)
        p = tl.math.exp2(scores * sm_scale_log2 - lse[:, None])
        p = tl.where(seen, p, 0.0)
        dp = tl.dot(do, tl.trans(vb), input_precision=DOT_PRECISION)  # [M, N]
        ds = (p * (dp - delta[:, None])).to(kb.dtype)
        dq = tl.dot(ds, kb, dq, input_precision=DOT_PRECISION)
        if BLOCK_DQK2 > 0:
            dq2 = tl.dot(ds, kb2, dq2, input_precision=DOT_PRECISION)
    dq_base = dq_ptr + b64 * stride_dqb
    dq_offs = _row_offsets(s, heads, stride_dqt, stride_dqh)
    _store_tile(dq_base, dq_offs, own, dq * sm_scale, HEAD_DIM_QK, 0, BLOCK_DQK)
    if BLOCK_DQK2 > 0:
        _store_tile(dq_base, dq_offs, own, dq2 * sm_scale, HEAD_DIM_QK, BLOCK_DQK, BLOCK_DQK2)


@triton.jit(do_not_specialize=SPARSE_RUNTIME_INTS + BLOCK_RUNTIME_INTS)
def _sparse_attn_dq_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, topk_ptr, span_ptr, full_ptr, lo_ptr, hi_ptr,
    n_tasks, seqlen_q, seqlen_k, k_last, n_slots, heads_kv, group, n_hblocks, n_tblocks, idx_heads, sm_scale,
    sm_scale_log2, stride_qb: tl.int64, stride_qt, stride_qh, stride_kb: tl.int64,
    stride_kt, stride_kh, stride_vb: tl.int64, stride_vt, stride_vh,
    stride_dob: tl.int64, stride_dot, stride_doh, stride_dqb: tl.int64, stride_dqt, stride_dqh, stride_lb, stride_lh,
    block_size, n_sub,
    HEAD_DIM_QK: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DQK2: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    V_IS_K: tl.constexpr, RANGE: tl.constexpr, BLOCKS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    PERSISTENT: tl.constexpr, BATCH_ALIGNED: tl.constexpr,
):
    # tasks as the forward's: batch x n_tblocks x heads_kv x n_hblocks; PERSISTENT: over a core-count grid
    stride_qb = _batch_stride(stride_qb, BATCH_ALIGNED)
    stride_kb = _batch_stride(stride_kb, BATCH_ALIGNED)
    stride_vb = _batch_stride(stride_vb, BATCH_ALIGNED)
    stride_dob = _batch_stride(stride_dob, BATCH_ALIGNED)
    stride_dqb = _batch_stride(stride_dqb, BATCH_ALIGNED)
    if PERSISTENT:
        for task in range(tl.program_id(0), n_tasks, tl.num_programs(0)):
            t = tl.minimum(task, n_tasks - 1)
            _sparse_dq_program(t, q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, topk_ptr, span_ptr,
                               full_ptr, lo_ptr, hi_ptr, seqlen_q, seqlen_k, k_last, n_slots, heads_kv, group,
                               n_hblocks, n_tblocks, idx_heads, sm_scale, sm_scale_log2, stride_qb, stride_qt,
                               stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                               stride_dob, stride_dot, stride_doh, stride_dqb, stride_dqt, stride_dqh, stride_lb,
                               stride_lh, block_size, n_sub, HEAD_DIM_QK, HEAD_DIM_V, BLOCK_DQK, BLOCK_DQK2, BLOCK_DV,
                               BLOCK_T, BLOCK_H, BLOCK_N, V_IS_K, RANGE, BLOCKS, DOT_PRECISION)
    else:
        _sparse_dq_program(tl.program_id(0), q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, topk_ptr,
                           span_ptr, full_ptr, lo_ptr, hi_ptr, seqlen_q, seqlen_k, k_last, n_slots, heads_kv, group,
                           n_hblocks, n_tblocks, idx_heads, sm_scale, sm_scale_log2, stride_qb, stride_qt, stride_qh,
                           stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_dob, stride_dot,
                           stride_doh, stride_dqb, stride_dqt, stride_dqh, stride_lb, stride_lh, block_size, n_sub,
                           HEAD_DIM_QK, HEAD_DIM_V, BLOCK_DQK, BLOCK_DQK2, BLOCK_DV, BLOCK_T, BLOCK_H, BLOCK_N,
                           V_IS_K, RANGE, BLOCKS, DOT_PRECISION)


@triton.jit
def _put_cols(base, rows_off, row_ok, x, WIDTH: tl.constexpr, COL0: tl.constexpr, BLOCK_D: tl.constexpr,
              ATOMIC: tl.constexpr):
    """Columns [COL0, COL0 + BLOCK_D) of fp32 rows at ``base + rows_off`` [N] (int64 element
    offsets), the first ``WIDTH`` of them: stored, or atomically added (ATOMIC)."""
    offs_d = COL0 + tl.arange(0, BLOCK_D)
    if COL0 + BLOCK_D <= WIDTH:  # a whole column block: only the rows need a mask
        ptrs = base + rows_off[:, None] + offs_d[None, :]
        mask = row_ok[:, None] & (offs_d[None, :] >= 0)
    else:
        ptrs = base + rows_off[:, None] + (offs_d % WIDTH)[None, :]
        mask = row_ok[:, None] & (offs_d[None, :] < WIDTH)
    if ATOMIC:
        tl.atomic_add(ptrs, x, mask=mask, sem="relaxed")
    else:
        tl.store(ptrs, x, mask=mask)


@triton.jit
def _put_dkv(out_ptr, rows_off, row_ok, dk, dk2, dv, HEAD_DIM_QK: tl.constexpr, HEAD_DIM_V: tl.constexpr,
             BLOCK_DQK: tl.constexpr, BLOCK_DQK2: tl.constexpr, BLOCK_DV: tl.constexpr, V_IS_K: tl.constexpr,
             ATOMIC: tl.constexpr):
    """The fp32 dK (and dV, in the columns after dK's) rows [N] at ``out_ptr + rows_off``."""
    _put_cols(out_ptr, rows_off, row_ok, dk, HEAD_DIM_QK, 0, BLOCK_DQK, ATOMIC)
    if BLOCK_DQK2 > 0:
        _put_cols(out_ptr, rows_off, row_ok, dk2, HEAD_DIM_QK, BLOCK_DQK, BLOCK_DQK2, ATOMIC)
    if not V_IS_K:
        _put_cols(out_ptr + HEAD_DIM_QK, rows_off, row_ok, dv, HEAD_DIM_V, 0, BLOCK_DV, ATOMIC)


@triton.jit
def _dkv_step(kb, kb2, vb, q, q2, do, seen, lse, delta, dk, dk2, dv, sm_scale, sm_scale_log2,
              BLOCK_DQK2: tl.constexpr, V_IS_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """dK (dV) of keys kb [N, DQK] (kb2, vb [N, DV]) += what rows q [M, DQK] (q2, do [M, DV], lse and
    delta [M]) give through the (key, row) pairs ``seen`` [N, M]: S^T, P^T, dP^T, dS^T, then dK += dS^T q
    and dV += P^T dO (absorbed MLA with V_IS_K: into dK's first block)."""
    scores = tl.dot(kb, tl.trans(q), input_precision=DOT_PRECISION)  # [N, M]
    if BLOCK_DQK2 > 0:
        scores = tl.dot(kb2, tl.trans(q2), scores, input_precision=DOT_PRECISION)
    p = tl.math.exp2(scores * sm_scale_log2 - lse[None, :])
    p = tl.where(seen, p, 0.0)
    dp = tl.dot(vb, tl.trans(do), input_precision=DOT_PRECISION)  # [N, M]
    ds = (p * (dp - delta[None, :]) * sm_scale).to(kb.dtype)
    dk = tl.dot(ds, q, dk, input_precision=DOT_PRECISION)
    if BLOCK_DQK2 > 0:
        dk2 = tl.dot(ds, q2, dk2, input_precision=DOT_PRECISION)
    if V_IS_K:  # absorbed MLA: dV joins dK's first block
        dk = tl.dot(p.to(do.dtype), do, dk, input_precision=DOT_PRECISION)
    else:
        dv = tl.dot(p.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
    return dk, dk2, dv


@triton.jit
def _sparse_dkv_program(task, q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, out_ptr, topk_ptr, span_ptr, lo_ptr,
                        hi_ptr, token0, chunk, seqlen_q, seqlen_k, k_last, n_slots, heads_kv, group, n_sblocks,
                        idx_heads, sm_scale, sm_scale_log2, stride_qb, stride_qt, stride_qh, stride_kb, stride_kt,
                        stride_kh, stride_vb, stride_vt, stride_vh, stride_dob, stride_dot, stride_doh, stride_lb,
                        stride_lh, stride_row,
                        HEAD_DIM_QK: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DQK: tl.constexpr,
                        BLOCK_DQK2: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_H: tl.constexpr,
                        BLOCK_N: tl.constexpr, V_IS_K: tl.constexpr, ATOMIC: tl.constexpr,
                        DOT_PRECISION: tl.constexpr):
    """Slot mode: slot block ``task % n_sblocks`` of the valid span of kv head g's row of token
    ``token0 + n_local``. Writes the slots' fp32 dK (and dV) rows: into the partial buffer
    ``[Hkv, chunk, K, stride_row]`` at (g, n_local, slot), or (ATOMIC) added into the accumulator
    ``[key rows, Hkv, stride_row]`` at (the slot's key row, g). A block past the span (a full row's
    span is empty) does nothing."""
    sb = task % n_sblocks
    rest = task // n_sblocks
    g = rest % heads_kv
    n_local = rest // heads_kv
    n = token0 + n_local
    b, s = _token(n, seqlen_q)
    b64, s64, g64 = b.to(tl.int64), s.to(tl.int64), g.to(tl.int64)
    at = n.to(tl.int64) * idx_heads + tl.minimum(g, idx_heads - 1)
    s_first = tl.load(span_ptr + 2 * at) + sb * BLOCK_N
    if s_first < tl.load(span_ptr + 2 * at + 1):
        lo, hi = _token_bounds(lo_ptr, hi_ptr, n, seqlen_k)
        offs_n = tl.arange(0, BLOCK_N)
        valid, row = _slot_rows(topk_ptr + at * n_slots, s_first, offs_n, n_slots, lo, hi, k_last)
        kb, kb2, vb = _key_rows(k_ptr + b64 * stride_kb + g64 * stride_kh, v_ptr + b64 * stride_vb + g64 * stride_vh,
                                row, valid, stride_kt, stride_vt, HEAD_DIM_QK, HEAD_DIM_V, BLOCK_DQK, BLOCK_DQK2,
                                BLOCK_DV, V_IS_K)  # [N, DQK], [N, DQK2], [N, DV]
        q_base = q_ptr + b64 * stride_qb + s64 * stride_qt
        do_base = do_ptr + b64 * stride_dob + s64 * stride_dot
        dk = tl.zeros([BLOCK_N, BLOCK_DQK], tl.float32)
        dk2 = dk
        if BLOCK_DQK2 > 0:
            dk2 = tl.zeros([BLOCK_N, BLOCK_DQK2], tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
        for h0 in range(0, group, BLOCK_H):  # group >= 1
            offs_h = h0 + tl.arange(0, BLOCK_H)
            head_ok = offs_h < group
            heads = g * group + tl.minimum(offs_h, group - 1)
            q, q2 = _q_tiles(q_base, heads.to(tl.int64) * stride_qh, head_ok, HEAD_DIM_QK, BLOCK_DQK,
                             BLOCK_DQK2)  # [H, DQK], [H, DQK2]
            do = _tile(do_base, heads.to(tl.int64) * stride_doh, head_ok, HEAD_DIM_V, 0, BLOCK_DV)  # [H, DV]
            lse, delta = _row_stats(lse_ptr, delta_ptr, b64, s, heads, head_ok, stride_lb, stride_lh)
            dk, dk2, dv = _dkv_step(kb, kb2, vb, q, q2, do, valid[:, None], lse, delta, dk, dk2, dv, sm_scale,
                                    sm_scale_log2, BLOCK_DQK2, V_IS_K, DOT_PRECISION)
        if ATOMIC:
            rows_off = ((b64 * seqlen_k + row) * heads_kv + g) * stride_row  # [N] accumulator rows
        else:
            slots = tl.minimum(s_first + offs_n, n_slots - 1)
            rows_off = ((g64 * chunk + n_local) * n_slots + slots) * stride_row  # [N] partial rows
        _put_dkv(out_ptr, rows_off, valid, dk, dk2, dv, HEAD_DIM_QK, HEAD_DIM_V, BLOCK_DQK, BLOCK_DQK2, BLOCK_DV,
                 V_IS_K, ATOMIC)


@triton.jit
def _range_dkv_program(task, q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, acc_ptr, full_ptr, lo_ptr, hi_ptr,
                       visit_ptr, batch, seqlen_q, seqlen_k, k_last, heads_kv, group, n_hblocks, n_kblocks, idx_heads,
                       sm_scale, sm_scale_log2, stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
                       stride_vb, stride_vt, stride_vh, stride_dob, stride_dot, stride_doh, stride_lb, stride_lh,
                       stride_row,
                       HEAD_DIM_QK: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DQK: tl.constexpr,
                       BLOCK_DQK2: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_T: tl.constexpr,
                       BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, V_IS_K: tl.constexpr,
                       DOT_PRECISION: tl.constexpr):
    """Range mode: keys [kb * BLOCK_N, ...) of sample b, kv head g (task: kv heads fastest). Their
    dK (dV) from the full rows that see them, as dense attention's dK/dV: the keys loaded once, the
    rows of the token blocks ``visit[g's index head, b, kb]`` (kernels/sparse_index.py
    ``range_visits``) in steps of BLOCK_T tokens x BLOCK_H heads, each (key, row) pair masked by the
    row's own range; then stored into the accumulator ``[key rows, Hkv, stride_row]``, one writer per
    row (every key row of the sample, 0 where no full row sees it)."""
    g = task % heads_kv
    rest = task // heads_kv
    kb = rest % n_kblocks
    b = rest // n_kblocks
    ih = tl.minimum(g, idx_heads - 1)
    b64, g64 = b.to(tl.int64), g.to(tl.int64)
    offs_n = tl.arange(0, BLOCK_N)
    keys, key_ok, row = _range_keys(kb * BLOCK_N, offs_n, seqlen_k, k_last)
    kt, kt2, vt = _key_rows(k_ptr + b64 * stride_kb + g64 * stride_kh, v_ptr + b64 * stride_vb + g64 * stride_vh, row,
                            key_ok, stride_kt, stride_vt, HEAD_DIM_QK, HEAD_DIM_V, BLOCK_DQK, BLOCK_DQK2, BLOCK_DV,
                            V_IS_K)  # [N, DQK], [N, DQK2], [N, DV]
    visit = visit_ptr + ((ih.to(tl.int64) * batch + b) * n_kblocks + kb) * 2
    tb_first = tl.load(visit)
    tb_end = tl.load(visit + 1)
    q_base = q_ptr + b64 * stride_qb
    do_base = do_ptr + b64 * stride_dob
    dk = tl.zeros([BLOCK_N, BLOCK_DQK], tl.float32)
    dk2 = dk
    if BLOCK_DQK2 > 0:
        dk2 = tl.zeros([BLOCK_N, BLOCK_DQK2], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    for hb in range(0, n_hblocks):
        for tb in range(tb_first, tb_end):
            n, s, heads, row_ok = _block_rows(b, tb, hb, g, group, seqlen_q, BLOCK_T, BLOCK_H)
            lo, hi, own = _range_rows(lo_ptr, hi_ptr, full_ptr, n, ih, idx_heads, seqlen_k, row_ok)
            q, q2 = _q_tiles(q_base, _row_offsets(s, heads, stride_qt, stride_qh), row_ok, HEAD_DIM_QK, BLOCK_DQK,
                             BLOCK_DQK2)  # [M, DQK], [M, DQK2]
            do = _tile(do_base, _row_offsets(s, heads, stride_dot, stride_doh), row_ok, HEAD_DIM_V, 0,
                       BLOCK_DV)  # [M, DV]
            lse, delta = _row_stats(lse_ptr, delta_ptr, b64, s, heads, own, stride_lb, stride_lh)
            seen = own[None, :] & (keys[:, None] >= lo[None, :]) & (keys[:, None] < hi[None, :])  # [N, M]
            dk, dk2, dv = _dkv_step(kt, kt2, vt, q, q2, do, seen, lse, delta, dk, dk2, dv, sm_scale, sm_scale_log2,
                                    BLOCK_DQK2, V_IS_K, DOT_PRECISION)
    rows_off = ((b64 * seqlen_k + row) * heads_kv + g) * stride_row  # [N] accumulator rows
    _put_dkv(acc_ptr, rows_off, key_ok, dk, dk2, dv, HEAD_DIM_QK, HEAD_DIM_V, BLOCK_DQK, BLOCK_DQK2, BLOCK_DV,
             V_IS_K, False)


@triton.jit
def _dkv_task(task, q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, out_ptr, topk_ptr, span_ptr, full_ptr, lo_ptr,
              hi_ptr, visit_ptr, token0, chunk, batch, seqlen_q, seqlen_k, k_last, n_slots, heads_kv, group,
              n_sblocks, n_hblocks, n_kblocks, idx_heads, sm_scale, sm_scale_log2, stride_qb, stride_qt, stride_qh,
              stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_dob, stride_dot, stride_doh,
              stride_lb, stride_lh, stride_row,
              HEAD_DIM_QK: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DQK2: tl.constexpr,
              BLOCK_DV: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
              V_IS_K: tl.constexpr, ATOMIC: tl.constexpr, RANGE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    if RANGE:
        _range_dkv_program(task, q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, out_ptr, full_ptr, lo_ptr, hi_ptr,
                           visit_ptr, batch, seqlen_q, seqlen_k, k_last, heads_kv, group, n_hblocks, n_kblocks,
                           idx_heads, sm_scale, sm_scale_log2, stride_qb, stride_qt, stride_qh, stride_kb, stride_kt,
                           stride_kh, stride_vb, stride_vt, stride_vh, stride_dob, stride_dot, stride_doh, stride_lb,
                           stride_lh, stride_row, HEAD_DIM_QK, HEAD_DIM_V, BLOCK_DQK, BLOCK_DQK2, BLOCK_DV, BLOCK_T,
                           BLOCK_H, BLOCK_N, V_IS_K, DOT_PRECISION)
    else:
        _sparse_dkv_program(task, q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, out_ptr, topk_ptr, span_ptr,
                            lo_ptr, hi_ptr, token0, chunk, seqlen_q, seqlen_k, k_last, n_slots, heads_kv, group,
                            n_sblocks, idx_heads, sm_scale, sm_scale_log2, stride_qb, stride_qt, stride_qh,
                            stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_dob, stride_dot,
                            stride_doh, stride_lb, stride_lh, stride_row, HEAD_DIM_QK, HEAD_DIM_V, BLOCK_DQK,
                            BLOCK_DQK2, BLOCK_DV, BLOCK_H, BLOCK_N, V_IS_K, ATOMIC, DOT_PRECISION)


@triton.jit(do_not_specialize=SPARSE_RUNTIME_INTS + ("token0", "chunk", "batch", "n_sblocks", "n_kblocks"))
def _sparse_attn_dkv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, out_ptr, topk_ptr, span_ptr, full_ptr, lo_ptr, hi_ptr, visit_ptr,
    n_tasks, token0, chunk, batch, seqlen_q, seqlen_k, k_last, n_slots, heads_kv, group, n_sblocks, n_hblocks,
    n_kblocks, idx_heads, sm_scale, sm_scale_log2, stride_qb: tl.int64,
    stride_qt, stride_qh, stride_kb: tl.int64, stride_kt, stride_kh,
    stride_vb: tl.int64, stride_vt, stride_vh, stride_dob: tl.int64,
    stride_dot, stride_doh, stride_lb, stride_lh, stride_row,
    HEAD_DIM_QK: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DQK2: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    V_IS_K: tl.constexpr, ATOMIC: tl.constexpr, RANGE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    PERSISTENT: tl.constexpr, BATCH_ALIGNED: tl.constexpr,
):
    # tasks: slot mode, the chunk's tokens x heads_kv x n_sblocks slot blocks (slot blocks fastest); range
    # mode, batch x n_kblocks key blocks x heads_kv. PERSISTENT: over a core-count grid
    stride_qb = _batch_stride(stride_qb, BATCH_ALIGNED)
    stride_kb = _batch_stride(stride_kb, BATCH_ALIGNED)
    stride_vb = _batch_stride(stride_vb, BATCH_ALIGNED)
    stride_dob = _batch_stride(stride_dob, BATCH_ALIGNED)
    if PERSISTENT:
        for task in range(tl.program_id(0), n_tasks, tl.num_programs(0)):
            t = tl.minimum(task, n_tasks - 1)
            _dkv_task(t, q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, out_ptr, topk_ptr, span_ptr, full_ptr,
                      lo_ptr, hi_ptr, visit_ptr, token0, chunk, batch, seqlen_q, seqlen_k, k_last, n_slots, heads_kv,
                      group, n_sblocks, n_hblocks, n_kblocks, idx_heads, sm_scale, sm_scale_log2, stride_qb,
                      stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                      stride_dob, stride_dot, stride_doh, stride_lb, stride_lh, stride_row, HEAD_DIM_QK, HEAD_DIM_V,
                      BLOCK_DQK, BLOCK_DQK2, BLOCK_DV, BLOCK_T, BLOCK_H, BLOCK_N, V_IS_K, ATOMIC, RANGE,
                      DOT_PRECISION)
    else:
        _dkv_task(tl.program_id(0), q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, out_ptr, topk_ptr, span_ptr,
                  full_ptr, lo_ptr, hi_ptr, visit_ptr, token0, chunk, batch, seqlen_q, seqlen_k, k_last, n_slots,
                  heads_kv, group, n_sblocks, n_hblocks, n_kblocks, idx_heads, sm_scale, sm_scale_log2, stride_qb,
                  stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_dob,
                  stride_dot, stride_doh, stride_lb, stride_lh, stride_row, HEAD_DIM_QK, HEAD_DIM_V, BLOCK_DQK,
                  BLOCK_DQK2, BLOCK_DV, BLOCK_T, BLOCK_H, BLOCK_N, V_IS_K, ATOMIC, RANGE, DOT_PRECISION)


@triton.jit
def _entry_row(entries_ptr, e, n_entries, chunk_slots):
    """The partial row (a position in the chunk's [C, K] slots) of CSR entry e, for any e: the
    entry's index clamped into the array (e past a segment's end is what a pipelined prefetch
    asks for) and its value into the chunk's slots, whatever it read."""
    ent = tl.load(entries_ptr + tl.minimum(tl.maximum(e, 0), n_entries - 1))
    return tl.minimum(tl.maximum(ent, 0), chunk_slots - 1)


@triton.jit
def _sparse_reduce_program(task, part_ptr, acc_ptr, seg_ptr, seg_row_ptr, seg_head_ptr, entries_ptr, heads_kv,
                           heads_per_seg, seg_slots, key_rows, chunk_slots, n_entries, width, n_cblocks, stride_row,
                           BLOCK_W: tl.constexpr):
    """Columns [cb * BLOCK_W, ...) of the chunk's segment u (key row r, index head h: kernels/sparse_index.py
    ``TopkCSR``) for kv head g, the gg-th of h's: acc += its partial rows, one at a time in the CSR's
    order. Every index read is clamped into its array and every value into its range (any value read,
    a pipelined prefetch's included, addresses inside the accumulator and the partial buffer)."""
    cb = task % n_cblocks
    rest = task // n_cblocks
    gg = rest % heads_per_seg
    u = tl.minimum(rest // heads_per_seg, seg_slots - 1)
    r = tl.minimum(tl.maximum(tl.load(seg_row_ptr + u), 0), key_rows - 1)
    g = tl.minimum(tl.maximum(tl.load(seg_head_ptr + u) * heads_per_seg + gg, 0), heads_kv - 1)
    start = tl.load(seg_ptr + u)
    end = tl.load(seg_ptr + u + 1)
    offs_w = cb * BLOCK_W + tl.arange(0, BLOCK_W)
    cols = tl.minimum(offs_w, width - 1)
    # an empty segment: no traffic (compared as vectors: Triton 3.9's interpreter rejects the mask a scalar
    # comparison broadcasts into)
    some = (offs_w < width) & (offs_w * 0 + start < end)
    acc_row = acc_ptr + (r.to(tl.int64) * heads_kv + g) * stride_row
    acc = tl.load(acc_row + cols, mask=some, other=0.0)
    part_g = part_ptr + g.to(tl.int64) * chunk_slots * stride_row
    for e in range(start, end):
        ent = _entry_row(entries_ptr, e, n_entries, chunk_slots)
        acc += tl.load(part_g + ent.to(tl.int64) * stride_row + cols, mask=some, other=0.0)
    tl.store(acc_row + cols, acc, mask=some)


@triton.jit(do_not_specialize=("seg_slots", "key_rows", "chunk_slots", "n_entries"))
def _sparse_attn_reduce_kernel(part_ptr, acc_ptr, seg_ptr, seg_row_ptr, seg_head_ptr, n_segs_ptr, entries_ptr,
                               heads_kv, heads_per_seg, seg_slots, key_rows, chunk_slots, n_entries, width, n_cblocks,
                               stride_row, BLOCK_W: tl.constexpr):
    # tasks: the chunk's segments (their count read on the device: no host sync) x the kv heads of a segment's
    # index head x column blocks, over a bounded grid (``reduce_grid``) whose programs step over them; a grid
    # larger than the tasks leaves the rest of its programs without any
    n_tasks = tl.load(n_segs_ptr) * (heads_per_seg * n_cblocks)
    for task in range(tl.program_id(0), n_tasks, tl.num_programs(0)):
        _sparse_reduce_program(task, part_ptr, acc_ptr, seg_ptr, seg_row_ptr, seg_head_ptr, entries_ptr, heads_kv,
                               heads_per_seg, seg_slots, key_rows, chunk_slots, n_entries, width, n_cblocks,
                               stride_row, BLOCK_W)


@triton.jit
def _key_vector(base, HEAD_DIM: tl.constexpr, COL0: tl.constexpr, BLOCK_D: tl.constexpr):
    """Columns [COL0, COL0 + BLOCK_D) of one row at ``base`` as fp32 [BLOCK_D] (0 past the head dim)."""
    offs_d = COL0 + tl.arange(0, BLOCK_D)
    return tl.load(base + tl.minimum(offs_d, HEAD_DIM - 1), mask=offs_d < HEAD_DIM, other=0.0).to(tl.float32)


@triton.jit
def _acc_cols(acc_row, x, HEAD_DIM: tl.constexpr, COL0: tl.constexpr, BLOCK_D: tl.constexpr):
    """Stores fp32 [BLOCK_D] ``x`` into columns [COL0, COL0 + BLOCK_D) of an accumulator row, the first HEAD_DIM."""
    offs_d = COL0 + tl.arange(0, BLOCK_D)
    tl.store(acc_row + tl.minimum(offs_d, HEAD_DIM - 1), x, mask=offs_d < HEAD_DIM)


@triton.jit
def _rows_fp32(base, offs, ok, HEAD_DIM: tl.constexpr, COL0: tl.constexpr, BLOCK_D: tl.constexpr):
    return _tile(base, offs, ok, HEAD_DIM, COL0, BLOCK_D).to(tl.float32)


@triton.jit
def _keys_dkv_program(task, q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, acc_ptr, row_ptr, entries_ptr, n_entries,
                      n_tokens, seqlen_q, seqlen_k, key_rows, heads_kv, group, idx_heads, sm_scale, sm_scale_log2,
                      stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                      stride_dob, stride_dot, stride_doh, stride_lb, stride_lh, stride_row,
                      HEAD_DIM_QK: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DQK: tl.constexpr,
                      BLOCK_DQK2: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_G: tl.constexpr,
                      V_IS_K: tl.constexpr):
    """Key-centric dK (dV) of key row r, kv head g (task: kv heads fastest): the tokens that name the key
    (kernels/sparse_index.py ``KeyCSR``, ascending) in steps of BLOCK_M x the group's heads, each step's
    P = exp(q k^T scale - lse), dP = dO v^T, dS = P (dP - delta) recomputed per row; dK += scale * dS q and
    dV += P dO summed over the step's rows, onto the accumulator row's value (the range mode's sum),
    stored once. One writer per accumulator row, a fixed order: deterministic."""
    g = task % heads_kv
    r = task // heads_kv
    b = r // seqlen_k
    j = r - b * seqlen_k
    b64, g64 = b.to(tl.int64), g.to(tl.int64)
    seg = tl.minimum(g, idx_heads - 1).to(tl.int64) * key_rows + r  # row_ptr has Hidx * key_rows + 1 entries
    start = tl.load(row_ptr + seg)
    end = tl.load(row_ptr + seg + 1)
    k_row = k_ptr + b64 * stride_kb + j.to(tl.int64) * stride_kt + g64 * stride_kh
    kr = _key_vector(k_row, HEAD_DIM_QK, 0, BLOCK_DQK)
    kr2 = kr
    if BLOCK_DQK2 > 0:
        kr2 = _key_vector(k_row, HEAD_DIM_QK, BLOCK_DQK, BLOCK_DQK2)
    vr = kr
    if not V_IS_K:
        vr = _key_vector(v_ptr + b64 * stride_vb + j.to(tl.int64) * stride_vt + g64 * stride_vh, HEAD_DIM_V, 0,
                         BLOCK_DV)
    acc_row = acc_ptr + (r.to(tl.int64) * heads_kv + g) * stride_row
    dk = _key_vector(acc_row, HEAD_DIM_QK, 0, BLOCK_DQK)  # the range mode's sum first
    dk2 = dk
    if BLOCK_DQK2 > 0:
        dk2 = _key_vector(acc_row, HEAD_DIM_QK, BLOCK_DQK, BLOCK_DQK2)
    dv = dk
    if not V_IS_K:
        dv = _key_vector(acc_row + HEAD_DIM_QK, HEAD_DIM_V, 0, BLOCK_DV)
    offs = tl.arange(0, BLOCK_M * BLOCK_G)
    head_ok = offs % BLOCK_G < group
    heads = g * group + tl.minimum(offs % BLOCK_G, group - 1)  # [R] q heads of g's group
    for e0 in range(start, end, BLOCK_M):
        e = e0 + offs // BLOCK_G
        ok = (e < end) & head_ok
        n = tl.load(entries_ptr + tl.minimum(tl.maximum(e, 0), n_entries - 1))
        n = tl.minimum(tl.maximum(n, 0), n_tokens - 1)  # any value read names a token
        bq = n // seqlen_q
        s = n - bq * seqlen_q
        bq64 = bq.to(tl.int64)
        q_offs = bq64 * stride_qb + _row_offsets(s, heads, stride_qt, stride_qh)
        q = _rows_fp32(q_ptr, q_offs, ok, HEAD_DIM_QK, 0, BLOCK_DQK)  # [R, DQK]
        scores = tl.sum(q * kr[None, :], 1)
        if BLOCK_DQK2 > 0:
            q2 = _rows_fp32(q_ptr, q_offs, ok, HEAD_DIM_QK, BLOCK_DQK, BLOCK_DQK2)
            scores += tl.sum(q2 * kr2[None, :], 1)
        do = _rows_fp32(do_ptr, bq64 * stride_dob + _row_offsets(s, heads, stride_dot, stride_doh), ok, HEAD_DIM_V, 0,
                        BLOCK_DV)  # [R, DV]
        at = bq64 * stride_lb + heads.to(tl.int64) * stride_lh + s
        lse = tl.load(lse_ptr + at, mask=ok, other=float("inf")) * 1.4426950408889634
        lse = tl.where(lse == float("-inf"), float("inf"), lse)
        delta = tl.load(delta_ptr + at, mask=ok, other=0.0)
        p = tl.where(ok, tl.math.exp2(scores * sm_scale_log2 - lse), 0.0)
        ds = p * (tl.sum(do * vr[None, :], 1) - delta) * sm_scale
        dk += tl.sum(ds[:, None] * q, 0)
        if BLOCK_DQK2 > 0:
            dk2 += tl.sum(ds[:, None] * q2, 0)
        if V_IS_K:
            dk += tl.sum(p[:, None] * do, 0)
        else:
            dv += tl.sum(p[:, None] * do, 0)
    _acc_cols(acc_row, dk, HEAD_DIM_QK, 0, BLOCK_DQK)
    if BLOCK_DQK2 > 0:
        _acc_cols(acc_row, dk2, HEAD_DIM_QK, BLOCK_DQK, BLOCK_DQK2)
    if not V_IS_K:
        _acc_cols(acc_row + HEAD_DIM_QK, dv, HEAD_DIM_V, 0, BLOCK_DV)


@triton.jit(do_not_specialize=SPARSE_RUNTIME_INTS + ("n_entries", "n_tokens", "key_rows"))
def _sparse_attn_dkv_keys_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, acc_ptr, row_ptr, entries_ptr, n_tasks, n_entries, n_tokens,
    seqlen_q, seqlen_k, key_rows, heads_kv, group, idx_heads, sm_scale, sm_scale_log2, stride_qb: tl.int64, stride_qt,
    stride_qh, stride_kb: tl.int64, stride_kt, stride_kh, stride_vb: tl.int64, stride_vt, stride_vh,
    stride_dob: tl.int64, stride_dot, stride_doh, stride_lb, stride_lh, stride_row,
    HEAD_DIM_QK: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DQK2: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_G: tl.constexpr, V_IS_K: tl.constexpr,
    PERSISTENT: tl.constexpr, BATCH_ALIGNED: tl.constexpr,
):
    # tasks: key rows x heads_kv (kv heads fastest); PERSISTENT: over a bounded grid (Ascend's cores, or a
    # grid past the target's limits: kernels/launch.py)
    stride_qb = _batch_stride(stride_qb, BATCH_ALIGNED)
    stride_kb = _batch_stride(stride_kb, BATCH_ALIGNED)
    stride_vb = _batch_stride(stride_vb, BATCH_ALIGNED)
    stride_dob = _batch_stride(stride_dob, BATCH_ALIGNED)
    if PERSISTENT:
        for task in range(tl.program_id(0), n_tasks, tl.num_programs(0)):
            t = tl.minimum(task, n_tasks - 1)
            _keys_dkv_program(t, q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, acc_ptr, row_ptr, entries_ptr,
                              n_entries, n_tokens, seqlen_q, seqlen_k, key_rows, heads_kv, group, idx_heads, sm_scale,
                              sm_scale_log2, stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
                              stride_vb, stride_vt, stride_vh, stride_dob, stride_dot, stride_doh, stride_lb,
                              stride_lh, stride_row, HEAD_DIM_QK, HEAD_DIM_V, BLOCK_DQK, BLOCK_DQK2, BLOCK_DV,
                              BLOCK_M, BLOCK_G, V_IS_K)
    else:
        _keys_dkv_program(tl.program_id(0), q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, acc_ptr, row_ptr,
                          entries_ptr, n_entries, n_tokens, seqlen_q, seqlen_k, key_rows, heads_kv, group, idx_heads,
                          sm_scale, sm_scale_log2, stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
                          stride_vb, stride_vt, stride_vh, stride_dob, stride_dot, stride_doh, stride_lb, stride_lh,
                          stride_row, HEAD_DIM_QK, HEAD_DIM_V, BLOCK_DQK, BLOCK_DQK2, BLOCK_DV, BLOCK_M, BLOCK_G,
                          V_IS_K)


def _aligned(width: int) -> int:
    return triton.cdiv(width, COLUMN_ALIGN) * COLUMN_ALIGN


def chunk_tokens(n_tokens: int, heads_kv: int, n_slots: int, stride_row: int, budget: int, n_cblocks: int = 1) -> int:
    """Query tokens per chunk: the most whose partial buffer (Hkv x C x K rows of stride_row fp32)
    fits ``budget`` bytes, at least 1, at most n_tokens; its rows times the reduce's column blocks
    (the reduce's int32 task counter) also stay within int32."""
    per_token = heads_kv * n_slots * stride_row * 4
    rows_cap = max(1, (2**31 - 1 - REDUCE_PROGRAMS) // max(heads_kv * n_slots * n_cblocks, 1))
    return max(1, min(n_tokens, budget // per_token, rows_cap))


# tasks of one slot-mode dK/dV launch: program ids (and a looped launch's task counter past the last task by
# its grid, kernels/launch.py) stay within int32
MAX_LAUNCH_TASKS = 2**31 - 1 - 2**26
REDUCE_PROGRAMS = 16384  # the reduce's grid on a GPU (several waves of any device); its programs step over the tasks
_INTERPRETER_REDUCE_PROGRAMS = 3  # so that the tests' reduces step over several tasks per program


def reduce_grid(device: torch.device, target: str, tasks: int) -> tuple[int]:
    """The reduce's grid for at most ``tasks`` tasks (the chunk's segment slots x kv heads per segment x
    column blocks; how many are real is on the device): bounded, its programs step over the real ones
    (Ascend: the vector cores)."""
    if target == "ascend":
        return (persistent_grid(device, tasks, vector_only=True),)
    cap = _INTERPRETER_REDUCE_PROGRAMS if target == "interpreter" else REDUCE_PROGRAMS
    return (max(1, min(tasks, cap)),)


ENV_SCHEDULE = "COREATTN_SPARSE_DKV"
SCHEDULES = ("partials", "keys")
KEYS_MAX_GROUP = 4  # the largest group ``dkv_schedule``'s byte rule sends to the key-centric dK/dV (16-bit; fp32: 2)


def dkv_schedule(prob, elem: int, stride_row: int, atomic: bool = False, schedule: str | None = None) -> str:
    """How the slot mode's dK/dV run: "atomic" (``atomic``), else ``schedule`` or
    ``COREATTN_SPARSE_DKV`` if given ("partials" or "keys"), else the one that moves fewer bytes per
    (token, kv head, slot) entry:

    - "partials" (token-centric, (4) + (5)): the slot's key (and value) row gathered, its fp32 partial
      row written and read back: (Dqk + Dv) x elem + 2 x 4 x stride_row bytes (Dv 0 where V is the key
      block), whatever the group;
    - "keys" (key-centric, (4')): each head of the group reads the token's q and dO rows, lse and delta:
      group x ((Dqk + Dv) x elem + 8) bytes.

    192/128 bf16 (per-head K/V): 3,200 against 648 x group, keys up to 4 q heads per kv head; absorbed
    MLA 576/512 with 16-128 q heads: partials."""
    if atomic:
        return "atomic"
    chosen = schedule or os.environ.get(ENV_SCHEDULE, "").strip().lower() or None
    if chosen is not None:
        if chosen not in SCHEDULES:
            raise ValueError(f"sparse dK/dV schedule {chosen!r} ({ENV_SCHEDULE}): expected one of {SCHEDULES}")
        return chosen
    gather = (prob.dim_qk + (0 if prob.v_is_k else prob.dim_v)) * elem
    partials = gather + 2 * 4 * stride_row
    keys = prob.group * ((prob.dim_qk + prob.dim_v) * elem + 8)
    return "keys" if keys < partials else "partials"


@on_device
def sparse_attn_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, out: torch.Tensor,
                    lse: torch.Tensor, topk: torch.Tensor, key_lo: torch.Tensor, key_hi: torch.Tensor, fmt: str,
                    softmax_scale: float, *, v_dim: int | None = None, atomic: bool = False,
                    schedule: str | None = None, blocks: BlockLayout | None = None):
    """Launch the sparse backward; returns (dq, dk, dv), each in its input's dtype and layout (dv
    None when v is None: absorbed MLA's V gradient is in dk's first v_dim columns).

    Arguments as for ``sparse_attn_fwd`` (kernels/sparse_fwd.py), plus ``dout`` (any strided view
    with last stride 1; made so if not) and the forward's ``out`` and ``lse``. Deterministic unless
    ``atomic``; ``schedule`` picks the slot mode's dK/dV ("partials", "keys"; None: ``dkv_schedule``'s
    choice). ``blocks``: the block mode (``topk`` holds the key rows of named blocks; ``atomic`` and
    ``schedule`` change nothing there). See the module docstring for the memory each takes.
    """
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    prob = sparse_problem(q, k, v, fmt, v_dim)
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    dk_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv_out = None if v is None else torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if prob.n_tokens == 0 or prob.heads_q == 0:
        dk_out.zero_()
        if dv_out is not None:
            dv_out.zero_()
        return dq, dk_out, dv_out
    target = target_of(q.device)
    block_dqk, block_dqk2, block_dv = prob.blocks
    widths = (block_dqk + block_dqk2, block_dv, q.element_size(), prob.group)
    cfg_dq, cfg_rdq, cfg_dkv, cfg_rdkv, cfg_reduce, cfg_pre = (
        sparse_config(target, kernel, *widths) for kernel in ("dq", "range_dq", "dkv", "range_dkv", "reduce", "pre"))
    k, v = key_side(k, v, prob)
    topk = slots_of(topk)
    n_slots, idx_heads = topk.shape[-1], topk.shape[1]
    if blocks is not None:
        classes = block_classes(topk, key_lo, key_hi, prob.seqlen_k, blocks.size)
    else:
        classes = row_classes(topk, key_lo, key_hi, prob.seqlen_k)
    scale = dict(sm_scale=softmax_scale, sm_scale_log2=softmax_scale * LOG2E)
    aligned = batch_aligned(st for x in (q, k, v, dout, out, dq) for st in seq_strides(x, fmt)[:2])
    consts = dict(HEAD_DIM_QK=prob.dim_qk, HEAD_DIM_V=prob.dim_v, BLOCK_DQK=block_dqk, BLOCK_DQK2=block_dqk2,
                  BLOCK_DV=block_dv, V_IS_K=prob.v_is_k, DOT_PRECISION=dot_precision(q.dtype, target),
                  BATCH_ALIGNED=aligned)
    qkv_strides = (*seq_strides(q, fmt), *seq_strides(k, fmt), *seq_strides(v, fmt), *seq_strides(dout, fmt))

    # (1) delta = rowsum(dO * O), in lse's layout
    delta = new_lse(prob, q.device)
    pre_batch = 1 if fmt == "thd" else prob.batch
    grid_m = triton.cdiv(prob.seqlen_q, cfg_pre.block_m)
    grid, persistent, _ = token_grid(q.device, target, grid_m * pre_batch, prob.heads_q, vector_only=True)
    launch(
        target, _attn_bwd_preprocess_kernel, grid,
        out, dout, delta, prob.seqlen_q, grid_m, pre_batch, prob.heads_q, *seq_strides(out, fmt),
        *seq_strides(dout, fmt), *lse_strides(delta, fmt), HEAD_DIM_V=prob.dim_v, BLOCK_DV=block_dv,
        BLOCK_M=cfg_pre.block_m, PERSISTENT=persistent,
        INT64_LANES=int64_lanes(cfg_pre.block_m, (seq_strides(out, fmt)[1], seq_strides(dout, fmt)[1]), block_dv),
        BATCH_ALIGNED=aligned,
        **cfg_pre.launch(),
    )
    common = dict(seqlen_q=prob.seqlen_q, seqlen_k=prob.seqlen_k, k_last=max(prob.seqlen_k, 1) - 1, n_slots=n_slots,
                  heads_kv=prob.heads_kv, group=prob.group, idx_heads=idx_heads, **scale,
                  **dict(zip(("stride_qb", "stride_qt", "stride_qh", "stride_kb", "stride_kt", "stride_kh",
                              "stride_vb", "stride_vt", "stride_vh", "stride_dob", "stride_dot", "stride_doh"),
                             qkv_strides)),
                  **dict(zip(("stride_lb", "stride_lh"), lse_strides(lse, fmt))), **consts)
    if blocks is not None:
        acc = _block_grads(q, k, v, dout, lse, delta, dq, topk, classes, key_lo, key_hi, prob, target, common,
                           blocks, widths, fmt)
        _grads_into(acc, prob, fmt, dk_out, dv_out)
        return dq, dk_out, dv_out

    # (2) dQ: the slot mode's rows, then the range mode's (full rows)
    for range_mode, cfg in ((False, cfg_dq), (True, cfg_rdq)):
        tiles = mode_tiles(prob, cfg.block_m, range_mode)
        grid, persistent, tasks = token_grid(q.device, target, prob.batch * tiles.n_tblocks,
                                             prob.heads_kv * tiles.n_hblocks)
        launch(
            target, _sparse_attn_dq_kernel, grid,
            q, k, v, dout, lse, delta, dq, topk, classes.span, classes.full, key_lo, key_hi, tasks,
            n_hblocks=tiles.n_hblocks, n_tblocks=tiles.n_tblocks, **common,
            **dict(zip(("stride_dqb", "stride_dqt", "stride_dqh"), seq_strides(dq, fmt))), block_size=0, n_sub=1,
            BLOCK_T=tiles.block_t, BLOCK_H=tiles.block_h, BLOCK_N=cfg.block_n, RANGE=range_mode, BLOCKS=False,
            PERSISTENT=persistent, **cfg.launch(),
        )

    # (3) + (4) dK (dV) into an fp32 accumulator [key rows, Hkv, stride_row]: first the range mode's, which
    # stores every key row (full rows' dK/dV as dense products), then the slot mode's rows added to it
    width = prob.dim_qk + (0 if prob.v_is_k else prob.dim_v)
    stride_row = _aligned(width)
    key_rows = prob.key_rows
    acc = torch.empty((max(key_rows, 1), prob.heads_kv, stride_row), dtype=torch.float32, device=q.device)
    if key_rows > 0:
        dkv_args = dict(**common, stride_row=stride_row, n_sblocks=triton.cdiv(n_slots, cfg_dkv.block_n),
                        batch=prob.batch, span_ptr=classes.span, full_ptr=classes.full)
        tiles = mode_tiles(prob, cfg_rdkv.block_m, True)
        n_kblocks = triton.cdiv(prob.seqlen_k, cfg_rdkv.block_n)
        visits = range_visits(classes.full, key_lo, key_hi, batch=prob.batch, seqlen_q=prob.seqlen_q,
                              seqlen_k=prob.seqlen_k, block_t=tiles.block_t, block_n=cfg_rdkv.block_n)
        grid, persistent, tasks = token_grid(q.device, target, prob.batch * n_kblocks, prob.heads_kv)
        launch(target, _sparse_attn_dkv_kernel, grid, q, k, v, dout, lse, delta, acc, topk, lo_ptr=key_lo,
               hi_ptr=key_hi, visit_ptr=visits, n_tasks=tasks, token0=0, chunk=0, n_hblocks=tiles.n_hblocks,
               n_kblocks=n_kblocks, BLOCK_T=tiles.block_t, BLOCK_H=tiles.block_h, BLOCK_N=cfg_rdkv.block_n,
               ATOMIC=False, RANGE=True, PERSISTENT=persistent, **dkv_args, **cfg_rdkv.launch())
        slot_args = dict(dkv_args, visit_ptr=visits, n_hblocks=1, n_kblocks=n_kblocks, BLOCK_T=1,
                         BLOCK_H=cfg_dkv.block_m, BLOCK_N=cfg_dkv.block_n, RANGE=False, **cfg_dkv.launch())
        per_token = prob.heads_kv * dkv_args["n_sblocks"]
        plan = dkv_schedule(prob, q.element_size(), stride_row, atomic, schedule)
        if plan == "atomic":  # launches of at most MAX_LAUNCH_TASKS tasks (int32 task ids), token0 on
            step = max(1, MAX_LAUNCH_TASKS // per_token)
            for token0 in range(0, prob.n_tokens, step):
                grid, persistent, tasks = token_grid(q.device, target, min(step, prob.n_tokens - token0), per_token)
                launch(target, _sparse_attn_dkv_kernel, grid, q, k, v, dout, lse, delta, acc, topk, lo_ptr=key_lo,
                       hi_ptr=key_hi, n_tasks=tasks, token0=token0, chunk=prob.n_tokens, ATOMIC=True,
                       PERSISTENT=persistent, **slot_args)
        elif plan == "keys":  # (4') key-centric: a program per (key row, kv head) over the tokens that name it
            csr = key_csr(topk, key_lo, key_hi, seqlen_q=prob.seqlen_q, seqlen_k=prob.seqlen_k, batch=prob.batch,
                          skip=classes.full)
            cfg_keys = sparse_config(target, "keys", *widths)
            block_g = triton.next_power_of_2(prob.group)
            if block_g > cfg_keys.block_m:  # only a forced schedule: the byte rule picks groups up to KEYS_MAX_GROUP
                raise ValueError(f"the key-centric dK/dV takes up to {cfg_keys.block_m} q heads per kv head at head "
                                 f"dims {prob.dim_qk}/{prob.dim_v}, got {prob.group}; use schedule='partials'")
            grid, persistent, tasks = token_grid(q.device, target, key_rows, prob.heads_kv, vector_only=True)
            launch(target, _sparse_attn_dkv_keys_kernel, grid, q, k, v, dout, lse, delta, acc, csr.row_ptr,
                   csr.entries, tasks, csr.entries.numel(), prob.n_tokens, prob.seqlen_q, prob.seqlen_k, key_rows,
                   prob.heads_kv, prob.group, idx_heads, softmax_scale, softmax_scale * LOG2E, *qkv_strides,
                   *lse_strides(lse, fmt), stride_row, HEAD_DIM_QK=prob.dim_qk, HEAD_DIM_V=prob.dim_v,
                   BLOCK_DQK=block_dqk, BLOCK_DQK2=block_dqk2, BLOCK_DV=block_dv,
                   BLOCK_M=max(1, cfg_keys.block_m // block_g), BLOCK_G=block_g, V_IS_K=prob.v_is_k,
                   PERSISTENT=persistent, BATCH_ALIGNED=aligned, **cfg_keys.launch())
        else:  # (4) + (5) token-centric partials, a chunk of query tokens at a time
            n_cblocks = triton.cdiv(width, cfg_reduce.block_n)
            chunk = chunk_tokens(prob.n_tokens, prob.heads_kv, n_slots, stride_row, partial_budget(), n_cblocks)
            part = torch.empty((prob.heads_kv, chunk, n_slots, stride_row), dtype=torch.float32, device=q.device)
            heads_per_seg = prob.heads_kv // idx_heads  # a segment's index head serves these kv heads
            for token0 in range(0, prob.n_tokens, chunk):
                token1 = min(prob.n_tokens, token0 + chunk)
                grid, persistent, tasks = token_grid(q.device, target, token1 - token0, per_token)
                launch(target, _sparse_attn_dkv_kernel, grid, q, k, v, dout, lse, delta, part, topk, lo_ptr=key_lo,
                       hi_ptr=key_hi, n_tasks=tasks, token0=token0, chunk=chunk, ATOMIC=False, PERSISTENT=persistent,
                       **slot_args)
                csr = transpose_topk(topk, key_lo, key_hi, token0, token1, seqlen_q=prob.seqlen_q,
                                     seqlen_k=prob.seqlen_k, batch=prob.batch, skip=classes.full)
                seg_slots = csr.seg_row.numel()
                launch(target, _sparse_attn_reduce_kernel,
                       reduce_grid(q.device, target, seg_slots * heads_per_seg * n_cblocks), part, acc, csr.seg_ptr,
                       csr.seg_row, csr.seg_head, csr.n_segs, csr.entries, prob.heads_kv, heads_per_seg, seg_slots,
                       key_rows, chunk * n_slots, csr.entries.numel(), width, n_cblocks, stride_row,
                       BLOCK_W=cfg_reduce.block_n, **cfg_reduce.launch())
    _grads_into(acc, prob, fmt, dk_out, dv_out)
    return dq, dk_out, dv_out


def _grads_into(acc: torch.Tensor, prob, fmt: str, dk_out: torch.Tensor, dv_out: torch.Tensor | None) -> None:
    """The accumulator [B * Sk (+ unused rows), Hkv, stride_row] into dk (dv) in k's (v's) dtype and layout."""
    acc = acc[:prob.key_rows].view(prob.batch, prob.seqlen_k, prob.heads_kv, acc.shape[-1])
    dk = acc[..., :prob.dim_qk]
    dv = acc[..., prob.dim_qk:prob.dim_qk + prob.dim_v]
    if prob.absorbed and not prob.v_is_k:
        dk = dk.clone()
        dk[..., :prob.dim_v] += dv
    _copy_layout(dk_out, dk, fmt)
    if dv_out is not None:
        _copy_layout(dv_out, dv, fmt)


def _copy_layout(dst: torch.Tensor, src: torch.Tensor, fmt: str) -> None:
    """dst (thd [T, H, D], bshd [B, S, H, D], sbhd [S, B, H, D]) = src [B, S, H, D] (thd: B = 1), cast."""
    if fmt == "thd":
        src = src[0]
    elif fmt == "sbhd":
        src = src.transpose(0, 1)
    dst.copy_(src)


@triton.jit
def _block_dkv_program(task, q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, acc_ptr, table_ptr, row_ptr,
                       entries_ptr, lo_ptr, hi_ptr, n_blocks, n_entries, n_tokens, seqlen_q, seqlen_k, k_last,
                       heads_kv, group, n_hblocks, n_sub, idx_heads, sm_scale, sm_scale_log2, stride_qb, stride_qt,
                       stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_dob,
                       stride_dot, stride_doh, stride_lb, stride_lh, stride_row,
                       HEAD_DIM_QK: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DQK: tl.constexpr,
                       BLOCK_DQK2: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_T: tl.constexpr,
                       BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, V_IS_K: tl.constexpr,
                       DOT_PRECISION: tl.constexpr):
    """Block mode: tile ``t`` (BLOCK_N keys) of block table row i, kv head g (task: kv heads fastest, then
    tiles, then blocks). The keys are loaded once; the query tokens naming the block (the CSR by block,
    kernels/sparse_blocks.py ``transpose_blocks``, ascending) are walked BLOCK_T at a time with the
    group's q heads, BLOCK_H per step, as the MMA rows: S^T, P^T (from lse), dP^T, dS^T, dK += dS^T q,
    dV += P^T dO, each (key, row) pair masked by the row's bounds. Then its key rows are stored into
    the accumulator ``[key rows, Hkv, stride_row]``: one writer per row (the table's blocks partition
    the keys), a fixed order of the sums, no atomics."""
    g = task % heads_kv
    rest = task // heads_kv
    t = rest % n_sub
    i = rest // n_sub
    row_at = table_ptr + i.to(tl.int64) * 3
    b = tl.load(row_at)
    b64, g64 = b.to(tl.int64), g.to(tl.int64)
    offs_n = tl.arange(0, BLOCK_N)
    keys = tl.load(row_at + 1) + t * BLOCK_N + offs_n  # [N] positions in sample b
    key_ok = keys < tl.load(row_at + 2)
    row = tl.minimum(tl.maximum(keys, 0), k_last)
    kt, kt2, vt = _key_rows(k_ptr + b64 * stride_kb + g64 * stride_kh, v_ptr + b64 * stride_vb + g64 * stride_vh, row,
                            key_ok, stride_kt, stride_vt, HEAD_DIM_QK, HEAD_DIM_V, BLOCK_DQK, BLOCK_DQK2, BLOCK_DV,
                            V_IS_K)  # [N, DQK], [N, DQK2], [N, DV]
    seg = tl.minimum(g, idx_heads - 1).to(tl.int64) * n_blocks + i
    e_first = tl.load(row_ptr + seg)
    e_end = tl.load(row_ptr + seg + 1)
    q_base = q_ptr + b64 * stride_qb
    do_base = do_ptr + b64 * stride_dob
    dk = tl.zeros([BLOCK_N, BLOCK_DQK], tl.float32)
    dk2 = dk
    if BLOCK_DQK2 > 0:
        dk2 = tl.zeros([BLOCK_N, BLOCK_DQK2], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    r = tl.arange(0, BLOCK_T * BLOCK_H)
    for hb in range(0, n_hblocks):
        offs_h = hb * BLOCK_H + r % BLOCK_H
        heads = g * group + tl.minimum(offs_h, group - 1)
        for e0 in range(e_first, e_end, BLOCK_T):
            e = e0 + r // BLOCK_H  # [M] CSR entries: a token per BLOCK_H rows
            ok = (offs_h < group) & (e < e_end)
            n = tl.load(entries_ptr + tl.minimum(tl.maximum(e, 0), n_entries - 1))
            n = tl.minimum(tl.maximum(n, 0), n_tokens - 1)  # whatever the load returned
            s = tl.minimum(tl.maximum(n - b * seqlen_q, 0), seqlen_q - 1)  # the token's position in sample b
            lo = tl.load(lo_ptr + n)
            hi = tl.load(hi_ptr + n)
            q, q2 = _q_tiles(q_base, _row_offsets(s, heads, stride_qt, stride_qh), ok, HEAD_DIM_QK, BLOCK_DQK,
                             BLOCK_DQK2)  # [M, DQK], [M, DQK2]
            do = _tile(do_base, _row_offsets(s, heads, stride_dot, stride_doh), ok, HEAD_DIM_V, 0, BLOCK_DV)  # [M, DV]
            lse, delta = _row_stats(lse_ptr, delta_ptr, b64, s, heads, ok, stride_lb, stride_lh)
            seen = ok[None, :] & key_ok[:, None] & (keys[:, None] >= lo[None, :]) & (keys[:, None] < hi[None, :])
            dk, dk2, dv = _dkv_step(kt, kt2, vt, q, q2, do, seen, lse, delta, dk, dk2, dv, sm_scale, sm_scale_log2,
                                    BLOCK_DQK2, V_IS_K, DOT_PRECISION)
    rows_off = ((b64 * seqlen_k + row) * heads_kv + g) * stride_row  # [N] accumulator rows
    _put_dkv(acc_ptr, rows_off, key_ok, dk, dk2, dv, HEAD_DIM_QK, HEAD_DIM_V, BLOCK_DQK, BLOCK_DQK2, BLOCK_DV, V_IS_K,
             False)


@triton.jit(do_not_specialize=("n_tasks", "n_blocks", "n_entries", "n_tokens", "seqlen_q", "seqlen_k", "k_last",
                               "n_sub", "stride_lb", "stride_lh", *BATCH_STRIDES))
def _sparse_attn_block_dkv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, acc_ptr, table_ptr, row_ptr, entries_ptr, lo_ptr, hi_ptr,
    n_tasks, n_blocks, n_entries, n_tokens, seqlen_q, seqlen_k, k_last, heads_kv, group, n_hblocks, n_sub,
    idx_heads, sm_scale, sm_scale_log2, stride_qb: tl.int64, stride_qt, stride_qh, stride_kb: tl.int64, stride_kt,
    stride_kh, stride_vb: tl.int64, stride_vt, stride_vh, stride_dob: tl.int64, stride_dot, stride_doh, stride_lb,
    stride_lh, stride_row,
    HEAD_DIM_QK: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DQK2: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    V_IS_K: tl.constexpr, DOT_PRECISION: tl.constexpr, PERSISTENT: tl.constexpr, BATCH_ALIGNED: tl.constexpr,
):
    # the block mode's dK/dV: its own kernel (as the reduce kernel), since its grid is the block table and
    # it reads a CSR by block. tasks: table rows x n_sub tiles x heads_kv; PERSISTENT: over a core-count grid.
    # Batch strides as the other sparse kernels take them (kernels/attn_common.py ``batch_aligned``)
    stride_qb = _batch_stride(stride_qb, BATCH_ALIGNED)
    stride_kb = _batch_stride(stride_kb, BATCH_ALIGNED)
    stride_vb = _batch_stride(stride_vb, BATCH_ALIGNED)
    stride_dob = _batch_stride(stride_dob, BATCH_ALIGNED)
    if PERSISTENT:
        for task in range(tl.program_id(0), n_tasks, tl.num_programs(0)):
            t = tl.minimum(task, n_tasks - 1)
            _block_dkv_program(t, q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, acc_ptr, table_ptr, row_ptr,
                               entries_ptr, lo_ptr, hi_ptr, n_blocks, n_entries, n_tokens, seqlen_q, seqlen_k, k_last,
                               heads_kv, group, n_hblocks, n_sub, idx_heads, sm_scale, sm_scale_log2, stride_qb,
                               stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                               stride_dob, stride_dot, stride_doh, stride_lb, stride_lh, stride_row, HEAD_DIM_QK,
                               HEAD_DIM_V, BLOCK_DQK, BLOCK_DQK2, BLOCK_DV, BLOCK_T, BLOCK_H, BLOCK_N, V_IS_K,
                               DOT_PRECISION)
    else:
        _block_dkv_program(tl.program_id(0), q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, acc_ptr, table_ptr,
                           row_ptr, entries_ptr, lo_ptr, hi_ptr, n_blocks, n_entries, n_tokens, seqlen_q, seqlen_k,
                           k_last, heads_kv, group, n_hblocks, n_sub, idx_heads, sm_scale, sm_scale_log2, stride_qb,
                           stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                           stride_dob, stride_dot, stride_doh, stride_lb, stride_lh, stride_row, HEAD_DIM_QK,
                           HEAD_DIM_V, BLOCK_DQK, BLOCK_DQK2, BLOCK_DV, BLOCK_T, BLOCK_H, BLOCK_N, V_IS_K,
                           DOT_PRECISION)


@on_device
def _block_grads(q, k, v, dout, lse, delta, dq, topk, classes, key_lo, key_hi, prob, target, common: dict,
                 blocks: BlockLayout, widths: tuple, fmt: str) -> torch.Tensor:
    """The block mode's dQ (into ``dq``) and dK/dV (returned: the fp32 accumulator [key rows, Hkv,
    stride_row], zero where no row sees a key)."""
    cfg_dq, cfg_dkv = (sparse_config(target, kernel, *widths) for kernel in ("block_dq", "block_dkv"))
    tiles = mode_tiles(prob, cfg_dq.block_m, False)
    grid, persistent, tasks = token_grid(q.device, target, prob.batch * tiles.n_tblocks,
                                         prob.heads_kv * tiles.n_hblocks)
    launch(
        target, _sparse_attn_dq_kernel, grid,
        q, k, v, dout, lse, delta, dq, topk, classes.span, classes.full, key_lo, key_hi, tasks,
        n_hblocks=tiles.n_hblocks, n_tblocks=tiles.n_tblocks, **common,
        **dict(zip(("stride_dqb", "stride_dqt", "stride_dqh"), seq_strides(dq, fmt))), block_size=blocks.size,
        n_sub=block_tiles(blocks.size, cfg_dq.block_n, topk.shape[-1]), BLOCK_T=1, BLOCK_H=tiles.block_h,
        BLOCK_N=cfg_dq.block_n, RANGE=False, BLOCKS=True, PERSISTENT=persistent, **cfg_dq.launch(),
    )
    width = prob.dim_qk + (0 if prob.v_is_k else prob.dim_v)
    stride_row = _aligned(width)
    acc = torch.zeros((max(prob.key_rows, 1), prob.heads_kv, stride_row), dtype=torch.float32, device=q.device)
    n_blocks = table_size(blocks, prob.batch, prob.seqlen_k)
    if prob.key_rows == 0 or n_blocks == 0:
        return acc
    table = block_table(blocks, prob.batch, prob.seqlen_k, q.device)
    csr = transpose_blocks(topk, key_lo, key_hi, blocks, batch=prob.batch, seqlen_q=prob.seqlen_q,
                           seqlen_k=prob.seqlen_k)
    tiles = mode_tiles(prob, cfg_dkv.block_m, True)
    n_sub = block_tiles(blocks.size, cfg_dkv.block_n, 1)
    grid, persistent, tasks = token_grid(q.device, target, n_blocks * n_sub, prob.heads_kv)
    keep = ("seqlen_q", "seqlen_k", "k_last", "heads_kv", "group", "idx_heads", "sm_scale", "sm_scale_log2",
            "stride_qb", "stride_qt", "stride_qh", "stride_kb", "stride_kt", "stride_kh", "stride_vb", "stride_vt",
            "stride_vh", "stride_dob", "stride_dot", "stride_doh", "stride_lb", "stride_lh", "HEAD_DIM_QK",
            "HEAD_DIM_V", "BLOCK_DQK", "BLOCK_DQK2", "BLOCK_DV", "V_IS_K", "DOT_PRECISION", "BATCH_ALIGNED")
    launch(
        target, _sparse_attn_block_dkv_kernel, grid, q, k, v, dout, lse, delta, acc, table, csr.row_ptr, csr.entries, key_lo, key_hi, tasks, n_blocks,
        csr.entries.numel(), prob.n_tokens, n_hblocks=tiles.n_hblocks, n_sub=n_sub, stride_row=stride_row,
        **{name: common[name] for name in keep}, BLOCK_T=tiles.block_t, BLOCK_H=tiles.block_h,
        BLOCK_N=cfg_dkv.block_n, PERSISTENT=persistent, **cfg_dkv.launch(),
    )
    return acc
