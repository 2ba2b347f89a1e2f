"""Top-k sparse attention forward (DeepSeek Sparse Attention): kernel and launcher.

Each query token attends to the key positions its prepared index row names
(kernels/sparse_index.py ``prepare_topk``: int32 ``[N, Hidx, K]``, -1 = unused), intersected with
its bounds ``key_lo[n] <= j < key_hi[n]`` (positions in its sample; causality is folded into
key_hi) and with the key rows of its sample.

The rows are sorted into two modes first (kernels/sparse_index.py ``row_classes``, torch ops on
the device, no host read), one launch each, every output row written by exactly one:

- slot mode, the rows that name part of their range: program = (query token n, kv head g, block of
  BLOCK_H q heads of g's group), head blocks fastest. All heads of a group share the token's key set,
  so one gathered key block serves BLOCK_H rows of the MMA (absorbed MLA: one kv head and 16-128 q
  heads; a group smaller than 16 is padded with masked rows). The program loops over the slots of
  its row's valid entries only (``span``: a prepared row is sorted, so they lie between its first
  and last valid slot, -1 between them only where a key was named twice; the unused slots cost
  nothing) in blocks of BLOCK_N: it
  loads the indices (slots clamped to the row), marks the valid ones, gathers their key rows at
  addresses clamped into the token's bounds and then into the tensor (``_slot_rows``: every lane's
  address is inside k for any index value, also in the pipeliner's prologue and prefetches), masks
  the values;
- range mode, the full rows (their valid entries are every key of ``[lo, hi)``, as top-k gives every
  token of a sequence shorter than K): dense attention. Program = (block of BLOCK_T query tokens of a
  sample, kv head g, block of BLOCK_H q heads); its M = BLOCK_T x BLOCK_H rows (heads fastest: a GQA
  group smaller than 16 fills the tile with tokens, not masked heads) step over the keys of the
  union of their ranges, contiguous rows read without any index (``_range_keys``: clamped into the
  sample for any key), each (row, key) pair masked by the row's own range (causality across the
  token block, sequence boundaries inside it, key bounds): one key block serves every token of the
  block. Rows of the block that are not full are left to the slot mode.

Both run the online softmax in the log2 domain as kernels/attn_fwd.py does.

Absorbed MLA (``v`` None, ``v_dim`` given): V is the first ``v_dim`` columns of k. Where v's block
is the q/k dims' first block (576 = 512 + 64 with v_dim 512: the 512 block IS V) the gathered key
block serves as V with no second load (``V_IS_K``); its columns past v_dim only reach output
columns that are not stored. Otherwise V is gathered from k's first columns (a second load of rows
the first has just brought into the cache).

Row offsets of gathers and per-token bases are int64 (absorbed q is [T, 128, 576]: T * stride
passes 2^31 at about 29k tokens). A token without a visible key gets out 0 and lse -inf.
Lengths, token counts and K are runtime ints that never specialize.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from coreattn.kernels.attn_common import _batch_stride, _cols, batch_aligned
from coreattn.kernels.attn_fwd import LOG2E, dot_precision, launch_grid
from coreattn.kernels.configs.base import head_blocks
from coreattn.kernels.configs.sparse import range_tile, sparse_config
from coreattn.kernels.configs.targets import target_of
from coreattn.kernels.device import on_device
from coreattn.kernels.launch import launch
from coreattn.kernels.packing import seq_len_dim, seq_strides, stand_in
from coreattn.kernels.sparse_blocks import BlockLayout, block_classes
from coreattn.kernels.sparse_index import row_classes

# runtime ints that follow the batch, its lengths or the top-k: never specialized. The batch strides
# (bshd: S x H x D, whose divisibility by 16 flips with S's parity where H x D is not a multiple of 16) get
# their alignment from BATCH_ALIGNED (kernels/attn_common.py ``batch_aligned``: the same for every S) and
# are typed int64 in the kernels' signatures, so a stride past 2**31 does not change the compile key either
BATCH_STRIDES = ("stride_qb", "stride_kb", "stride_vb", "stride_ob", "stride_dob", "stride_dqb")
SPARSE_RUNTIME_INTS = ("n_tasks", "seqlen_q", "seqlen_k", "k_last", "n_slots", "n_tblocks", "stride_lb", "stride_lh",
                       *BATCH_STRIDES)
# the block mode's block size and tiles per block (model constants, but a block of 1 must not specialize)
BLOCK_RUNTIME_INTS = ("block_size", "n_sub")


@triton.jit
def _token(n, seqlen_q):
    """(sample, position) of query token n = b * seqlen_q + s (thd: seqlen_q is the token count, b = 0)."""
    b = n // seqlen_q
    return b, n - b * seqlen_q


@triton.jit
def _token_bounds(lo_ptr, hi_ptr, n, seqlen_k):
    """Token n's visible key positions [lo, hi), intersected with its sample's key rows [0, seqlen_k)."""
    lo = tl.maximum(tl.load(lo_ptr + n), 0)
    hi = tl.minimum(tl.load(hi_ptr + n), seqlen_k)
    return lo, hi


@triton.jit
def _slot_rows(idx_row, s0, offs_n, n_slots, lo, hi, k_last):
    """Slots [s0, s0 + BLOCK_N) of a token's index row: (valid [N], key row [N] to read).

    The slot is clamped into the row (n_slots >= 1), so the index load's address is inside for
    any s0, a prefetch past the last block included; the key row is clamped into the token's bounds
    [lo, max(hi, lo + 1) - 1] and then into the sample's rows [0, k_last], whatever value the index
    load returned (a masked-off asynchronous copy may leave anything): the gather never leaves k, and
    a valid entry's row is its own."""
    slots = s0 + offs_n
    slot_ok = slots < n_slots
    idx = tl.load(idx_row + tl.minimum(tl.maximum(slots, 0), n_slots - 1), mask=slot_ok, other=-1)
    valid = slot_ok & (idx >= lo) & (idx < hi)
    row = tl.minimum(tl.maximum(idx, lo), tl.maximum(hi, lo + 1) - 1)
    row = tl.minimum(tl.maximum(row, 0), k_last)
    return valid, row


@triton.jit
def _gather(base, row, valid, stride_t, HEAD_DIM: tl.constexpr, COL0: tl.constexpr, BLOCK_D: tl.constexpr):
    """Key (or value) rows ``row`` [N] of a [rows, HEAD_DIM] view, columns [COL0, COL0 + BLOCK_D),
    as one [N, BLOCK_D] block; invalid slots and columns past the head dim read as 0 (their
    addresses wrap into the row: kernels/attn_common.py ``_cols``)."""
    offs_d = COL0 + tl.arange(0, BLOCK_D)
    rows = base + row.to(tl.int64)[:, None] * stride_t
    if COL0 + BLOCK_D <= HEAD_DIM:  # a whole column block: only the rows need a mask
        return tl.load(rows + offs_d[None, :], mask=valid[:, None], other=0.0)
    # kernels/attn_common.py _cols, inline (each helper call costs the interpreter milliseconds)
    return tl.load(rows + (offs_d % HEAD_DIM)[None, :], mask=valid[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)


@triton.jit
def _range_keys(j0, offs_n, stop, k_last):
    """Keys [j0, j0 + BLOCK_N) of a contiguous range ending at ``stop``: (keys [N], load_ok [N], key
    row [N] to read, clamped into the sample's rows [0, k_last] for any j0: a prefetch past the
    range's end reads the last row, masked off)."""
    keys = j0 + offs_n
    return keys, keys < stop, tl.minimum(tl.maximum(keys, 0), k_last)


@triton.jit
def _row_offsets(s, heads, stride_t, stride_h):
    """int64 [M] element offsets of rows (position s, head) of a [.., S, H, D] view from its sample's base."""
    return s.to(tl.int64) * stride_t + heads.to(tl.int64) * stride_h


@triton.jit
def _tile(base, offs, ok, HEAD_DIM: tl.constexpr, COL0: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rows at ``base + offs`` [M] (int64), columns [COL0, COL0 + BLOCK_D) of a HEAD_DIM-wide row;
    rows not ``ok`` and columns past the head dim read as 0."""
    offs_d = COL0 + tl.arange(0, BLOCK_D)
    ptrs = base + offs[:, None] + _cols(offs_d, HEAD_DIM, COL0 + BLOCK_D)[None, :]
    return tl.load(ptrs, mask=ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)


@triton.jit
def _store_tile(base, offs, ok, x, HEAD_DIM: tl.constexpr, COL0: tl.constexpr, BLOCK_D: tl.constexpr):
    offs_d = COL0 + tl.arange(0, BLOCK_D)
    ptrs = base + offs[:, None] + _cols(offs_d, HEAD_DIM, COL0 + BLOCK_D)[None, :]
    tl.store(ptrs, x.to(base.dtype.element_ty), mask=ok[:, None] & (offs_d[None, :] < HEAD_DIM))


@triton.jit
def _q_tiles(base, offs, ok, HEAD_DIM_QK: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DQK2: tl.constexpr):
    """q rows at ``base + offs`` [M]: (its first block [M, DQK], its second [M, DQK2], the first
    where the q/k dim is not split)."""
    q = _tile(base, offs, ok, HEAD_DIM_QK, 0, BLOCK_DQK)
    q2 = q
    if BLOCK_DQK2 > 0:
        q2 = _tile(base, offs, ok, HEAD_DIM_QK, BLOCK_DQK, BLOCK_DQK2)
    return q, q2


@triton.jit
def _program_block(task, n_hblocks, heads_kv, n_tblocks):
    """Task -> (sample b, token block tb of the sample, kv head g, head block hb); head blocks
    fastest, then kv heads, then token blocks."""
    hb = task % n_hblocks
    rest = task // n_hblocks
    g = rest % heads_kv
    rest = rest // heads_kv
    b = rest // n_tblocks
    return b, rest - b * n_tblocks, g, hb


@triton.jit
def _block_rows(b, tb, hb, g, group, seqlen_q, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    """The M = BLOCK_T x BLOCK_H rows of token block tb of sample b (positions [tb * BLOCK_T, ...))
    and head block hb of kv head g's group, heads fastest: (token n [M] int64, position s [M] and q
    head [M], both clamped into the sample and the group for any tb, row_ok [M])."""
    r = tl.arange(0, BLOCK_T * BLOCK_H)
    offs_h = hb * BLOCK_H + r % BLOCK_H
    s = tb * BLOCK_T + r // BLOCK_H
    row_ok = (offs_h < group) & (s < seqlen_q)
    s = tl.minimum(tl.maximum(s, 0), seqlen_q - 1)
    heads = g * group + tl.minimum(offs_h, group - 1)
    return b.to(tl.int64) * seqlen_q + s, s, heads, row_ok


@triton.jit
def _range_rows(lo_ptr, hi_ptr, full_ptr, n, ih, idx_heads, seqlen_k, row_ok):
    """Range mode: the rows' visible keys [lo, hi) (within [0, seqlen_k)) and ``own`` [M]: the full
    rows (kernels/sparse_index.py ``row_classes``), the ones the range mode computes."""
    lo = tl.maximum(tl.load(lo_ptr + n), 0)
    hi = tl.minimum(tl.load(hi_ptr + n), seqlen_k)
    own = row_ok & (tl.load(full_ptr + n * idx_heads + ih) != 0)
    return lo, hi, own


@triton.jit
def _key_range(lo, hi, own):
    """[start, stop): the union's bounds of the own rows' key ranges (empty without one)."""
    live = own & (hi > lo)
    stop = tl.max(tl.where(live, hi, 0), 0)
    return tl.min(tl.where(live, lo, stop), 0), stop


@triton.jit
def _slot_row(span_ptr, full_ptr, n0, ih, idx_heads, heads, row_ok):
    """Slot mode, token n0: (own [M]: the rows unless the token's row is full, first and end slot of
    its valid entries: kernels/sparse_index.py ``row_classes``, empty for a full row). The class is
    loaded and compared per row: Triton 3.9's interpreter rejects a mask a scalar comparison
    broadcasts into."""
    at = n0 * idx_heads + ih
    own = row_ok & (tl.load(full_ptr + at + heads * 0) == 0)
    return own, tl.load(span_ptr + 2 * at), tl.load(span_ptr + 2 * at + 1)


@triton.jit
def _block_keys(idx_row, it, offs_n, n_slots, block_size, n_sub, lo, hi, k_last, BLOCK_N: tl.constexpr):
    """Block mode: tile ``it // BLOCK_N`` of a row whose entries name blocks (kernels/sparse_blocks.py:
    the key row each block starts at, -1 unused), ``n_sub`` tiles of BLOCK_N contiguous keys per block
    (n_sub >= 1): (valid [N], key row [N] to read). The slot is clamped into the row and the key rows
    into the token's bounds and then the sample's rows [0, k_last], whatever the index load returned:
    the addresses stay inside for any ``it``. Comparisons are vectors (Triton 3.9's interpreter rejects
    a mask a scalar comparison broadcasts into)."""
    tile = it // BLOCK_N
    slot = tile // n_sub
    inside = (tile - slot * n_sub) * BLOCK_N + offs_n  # [N] offsets of the keys in their block
    slot_v = offs_n * 0 + slot
    start = tl.load(idx_row + tl.minimum(tl.maximum(slot_v, 0), n_slots - 1))  # [N], one address
    keys = start + inside
    valid = (start >= 0) & (slot_v < n_slots) & (inside < block_size) & (keys >= lo) & (keys < hi)
    row = tl.minimum(tl.maximum(keys, lo), tl.maximum(hi, lo + 1) - 1)
    return valid, tl.minimum(tl.maximum(row, 0), k_last)


@triton.jit
def _program_keys(topk_ptr, span_ptr, full_ptr, lo_ptr, hi_ptr, b64, tb, n, ih, idx_heads, heads, row_ok, seqlen_q,
                  seqlen_k, n_slots, n_sub, RANGE: tl.constexpr, BLOCKS: tl.constexpr, BLOCK_N: tl.constexpr):
    """The keys a forward or dQ program steps over: (own [M]: the rows it computes, start, stop: its
    loop's bounds, lo, hi: the rows' bounds ([M]; slot and block mode: its token's, scalars), idx_row:
    the token's index row (slot and block mode; range mode: unused)). Block mode steps over BLOCK_N-key
    tiles, ``n_sub`` per slot of the row's span, numbered in keys (``it`` = tile x BLOCK_N)."""
    if RANGE:  # full rows: the keys [lo, hi) of each, contiguous
        lo, hi, own = _range_rows(lo_ptr, hi_ptr, full_ptr, n, ih, idx_heads, seqlen_k, row_ok)
        start, stop = _key_range(lo, hi, own)
        idx_row = topk_ptr
    else:  # slot mode: one token (BLOCK_T = 1), the slots of its valid entries
        n0 = b64 * seqlen_q + tb
        own, start, stop = _slot_row(span_ptr, full_ptr, n0, ih, idx_heads, heads, row_ok)
        lo, hi = _token_bounds(lo_ptr, hi_ptr, n0, seqlen_k)
        idx_row = topk_ptr + (n0 * idx_heads + ih) * n_slots
        if BLOCKS:
            start = start * n_sub * BLOCK_N
            stop = stop * n_sub * BLOCK_N
    return own, start, stop, lo, hi, idx_row


@triton.jit
def _key_block(it, offs_n, stop, k_last, own, lo, hi, idx_row, n_slots, block_size, n_sub, RANGE: tl.constexpr,
               BLOCKS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Keys (range mode), slots (slot mode) or a tile of a named block (block mode) [it, it + BLOCK_N)
    of a program's loop: (load_ok [N], key row [N] to read, seen: the (row, key) pairs that count,
    [M, N] or [1, N])."""
    if RANGE:
        keys, load_ok, row = _range_keys(it, offs_n, stop, k_last)
        seen = own[:, None] & (keys[None, :] >= lo[:, None]) & (keys[None, :] < hi[:, None])
    elif BLOCKS:
        load_ok, row = _block_keys(idx_row, it, offs_n, n_slots, block_size, n_sub, lo, hi, k_last, BLOCK_N)
        seen = load_ok[None, :]
    else:
        load_ok, row = _slot_rows(idx_row, it, offs_n, n_slots, lo, hi, k_last)
        seen = load_ok[None, :]
    return load_ok, row, seen


@triton.jit
def _key_rows(k_base, v_base, row, ok, stride_kt, stride_vt, HEAD_DIM_QK: tl.constexpr, HEAD_DIM_V: tl.constexpr,
              BLOCK_DQK: tl.constexpr, BLOCK_DQK2: tl.constexpr, BLOCK_DV: tl.constexpr, V_IS_K: tl.constexpr):
    """Key rows ``row`` [N]: (k's first block [N, DQK], its second [N, DQK2] (the first where the q/k
    dim is not split), v [N, DV]: absorbed MLA with V_IS_K, the first key block itself)."""
    kb = _gather(k_base, row, ok, stride_kt, HEAD_DIM_QK, 0, BLOCK_DQK)
    kb2 = kb
    if BLOCK_DQK2 > 0:
        kb2 = _gather(k_base, row, ok, stride_kt, HEAD_DIM_QK, BLOCK_DQK, BLOCK_DQK2)
    vb = kb
    if not V_IS_K:
        vb = _gather(v_base, row, ok, stride_vt, HEAD_DIM_V, 0, BLOCK_DV)
    return kb, kb2, vb


@triton.jit
def _sparse_fwd_program(task, q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, topk_ptr, span_ptr, full_ptr, lo_ptr, hi_ptr,
                        seqlen_q, seqlen_k, k_last, n_slots, heads_kv, group, n_hblocks, n_tblocks, idx_heads,
                        sm_scale_log2, stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb,
                        stride_vt, stride_vh, stride_ob, stride_ot, stride_oh, stride_lb, stride_lh, block_size, n_sub,
                        HEAD_DIM_QK: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DQK: tl.constexpr,
                        BLOCK_DQK2: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_T: tl.constexpr,
                        BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, V_IS_K: tl.constexpr, RANGE: tl.constexpr,
                        BLOCKS: tl.constexpr, DOT_PRECISION: tl.constexpr):
    b, tb, g, hb = _program_block(task, n_hblocks, heads_kv, n_tblocks)
    n, s, heads, row_ok = _block_rows(b, tb, hb, g, group, seqlen_q, BLOCK_T, BLOCK_H)
    ih = tl.minimum(g, idx_heads - 1)
    b64, g64 = b.to(tl.int64), g.to(tl.int64)
    q, q2 = _q_tiles(q_ptr + b64 * stride_qb, _row_offsets(s, heads, stride_qt, stride_qh), row_ok, HEAD_DIM_QK,
                     BLOCK_DQK, BLOCK_DQK2)  # [M, DQK], [M, DQK2]
    k_base = k_ptr + b64 * stride_kb + g64 * stride_kh
    v_base = v_ptr + b64 * stride_vb + g64 * stride_vh
    offs_n = tl.arange(0, BLOCK_N)
    own, start, stop, lo, hi, idx_row = _program_keys(topk_ptr, span_ptr, full_ptr, lo_ptr, hi_ptr, b64, tb, n, ih,
                                                      idx_heads, heads, row_ok, seqlen_q, seqlen_k, n_slots, n_sub,
                                                      RANGE, BLOCKS, BLOCK_N)
    m_i = tl.full([BLOCK_T * BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_T * BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_T * BLOCK_H, BLOCK_DV], tl.float32)
    for it in range(start, stop, BLOCK_N):
        load_ok, row, seen = _key_block(it, offs_n, stop, k_last, own, lo, hi, idx_row, n_slots, block_size, n_sub,
                                        RANGE, BLOCKS, BLOCK_N)
        kb, kb2, vb = _key_rows(k_base, v_base, row, load_ok, stride_kt, stride_vt, HEAD_DIM_QK, HEAD_DIM_V,
                                BLOCK_DQK, BLOCK_DQK2, BLOCK_DV, V_IS_K)  # [N, DQK], [N, DQK2], [N, DV]
        scores = tl.dot(q, tl.trans(kb), input_precision=DOT_PRECISION)  # [M, N]
        if BLOCK_DQK2 > 0:
            scores = tl.dot(q2, tl.trans(kb2), scores, input_precision=DOT_PRECISION)
        scores = tl.where(seen, scores * sm_scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        # a row that has seen no key yet keeps m = -inf; subtract 0 instead so p and alpha are 0, not NaN
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(scores - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(vb.dtype), vb, input_precision=DOT_PRECISION)
        m_i = m_new
    empty = l_i == 0.0  # no visible key: output 0 and lse = -inf
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * 0.6931471805599453)
    _store_tile(out_ptr + b64 * stride_ob, _row_offsets(s, heads, stride_ot, stride_oh), own, out, HEAD_DIM_V, 0,
                BLOCK_DV)
    tl.store(lse_ptr + b64 * stride_lb + heads.to(tl.int64) * stride_lh + s, lse, mask=own)


@triton.jit(do_not_specialize=SPARSE_RUNTIME_INTS + BLOCK_RUNTIME_INTS)
def _sparse_attn_fwd_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, topk_ptr, span_ptr, full_ptr, lo_ptr, hi_ptr,
    n_tasks, seqlen_q, seqlen_k, k_last, n_slots, heads_kv, group, n_hblocks, n_tblocks, idx_heads, sm_scale_log2,
    stride_qb: tl.int64, stride_qt, stride_qh, stride_kb: tl.int64,
    stride_kt, stride_kh, stride_vb: tl.int64, stride_vt, stride_vh,
    stride_ob: tl.int64, stride_ot, stride_oh, stride_lb, stride_lh, block_size, n_sub,
    HEAD_DIM_QK: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DQK2: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    V_IS_K: tl.constexpr, RANGE: tl.constexpr, BLOCKS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    PERSISTENT: tl.constexpr, BATCH_ALIGNED: tl.constexpr,
):
    # tasks: batch x n_tblocks token blocks x heads_kv x n_hblocks (= n_tasks); PERSISTENT (Ascend):
    # those tasks over a core-count 1D grid.
    stride_qb = _batch_stride(stride_qb, BATCH_ALIGNED)
    stride_kb = _batch_stride(stride_kb, BATCH_ALIGNED)
    stride_vb = _batch_stride(stride_vb, BATCH_ALIGNED)
    stride_ob = _batch_stride(stride_ob, BATCH_ALIGNED)
    if PERSISTENT:
        for task in range(tl.program_id(0), n_tasks, tl.num_programs(0)):
            t = tl.minimum(task, n_tasks - 1)  # addresses inside for any task (see attn_common)
            _sparse_fwd_program(t, q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, topk_ptr, span_ptr, full_ptr, lo_ptr,
                                hi_ptr, seqlen_q, seqlen_k, k_last, n_slots, heads_kv, group, n_hblocks, n_tblocks,
                                idx_heads, sm_scale_log2, stride_qb, stride_qt, stride_qh, stride_kb, stride_kt,
                                stride_kh, stride_vb, stride_vt, stride_vh, stride_ob, stride_ot, stride_oh,
                                stride_lb, stride_lh, block_size, n_sub, HEAD_DIM_QK, HEAD_DIM_V, BLOCK_DQK,
                                BLOCK_DQK2, BLOCK_DV, BLOCK_T, BLOCK_H, BLOCK_N, V_IS_K, RANGE, BLOCKS,
                                DOT_PRECISION)
    else:
        _sparse_fwd_program(tl.program_id(0), q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, topk_ptr, span_ptr, full_ptr,
                            lo_ptr, hi_ptr, seqlen_q, seqlen_k, k_last, n_slots, heads_kv, group, n_hblocks,
                            n_tblocks, idx_heads, sm_scale_log2, stride_qb, stride_qt, stride_qh, stride_kb,
                            stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_ob, stride_ot, stride_oh,
                            stride_lb, stride_lh, block_size, n_sub, HEAD_DIM_QK, HEAD_DIM_V, BLOCK_DQK, BLOCK_DQK2,
                            BLOCK_DV, BLOCK_T, BLOCK_H, BLOCK_N, V_IS_K, RANGE, BLOCKS, DOT_PRECISION)


class SparseProblem(NamedTuple):
    """What the sparse launchers derive from their arguments (host ints from shapes: no sync)."""

    fmt: str
    batch: int  # samples (thd: 1)
    seqlen_q: int  # query tokens per sample (thd: all)
    seqlen_k: int  # key rows per sample (thd: all); 0 when there is none
    n_tokens: int  # N = batch * seqlen_q
    heads_q: int
    heads_kv: int
    dim_qk: int
    dim_v: int
    blocks: tuple  # (BLOCK_DQK, BLOCK_DQK2, BLOCK_DV)
    absorbed: bool  # v None: V = k's first dim_v columns
    v_is_k: bool  # absorbed and v's block is k's first block: the gathered key block serves as V

    @property
    def group(self) -> int:
        return self.heads_q // self.heads_kv

    @property
    def key_rows(self) -> int:
        return self.batch * self.seqlen_k


def sparse_problem(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, fmt: str,
                   v_dim: int | None) -> SparseProblem:
    heads_q, dim_qk = q.shape[-2:]
    heads_kv = k.shape[-2]
    absorbed = v is None
    if absorbed:
        if v_dim is None or not 0 < v_dim <= dim_qk:
            raise ValueError(f"v None (absorbed MLA) needs 0 < v_dim <= the q/k head dim {dim_qk}, got {v_dim}")
        dim_v = v_dim
    else:
        dim_v = v.shape[-1]
    blocks = head_blocks(dim_qk, dim_v)
    batch = 1 if fmt == "thd" else q.shape[0 if fmt == "bshd" else 1]
    seqlen_q = seq_len_dim(q, fmt)
    return SparseProblem(fmt, batch, seqlen_q, seq_len_dim(k, fmt), batch * seqlen_q, heads_q, heads_kv, dim_qk,
                         dim_v, blocks, absorbed, absorbed and blocks[2] == blocks[0])


def key_side(k: torch.Tensor, v: torch.Tensor | None, prob: SparseProblem) -> tuple[torch.Tensor, torch.Tensor]:
    """(k, v) as the kernels read them: v None (absorbed) is k's first dim_v columns (a view); a
    side without any key row gets a one-row stand-in (packing.stand_in: the kernels' clamped
    gathers address row 0 of the sample, masked off)."""
    dim = 1 if prob.fmt == "bshd" else 0
    k = stand_in(k, dim)
    v = k[..., :prob.dim_v] if v is None else stand_in(v, dim)
    return k, v


def slots_of(topk: torch.Tensor) -> torch.Tensor:
    """The prepared indices, with K = 0 as one unused slot (the kernels clamp slots to K - 1)."""
    if topk.shape[-1] > 0:
        return topk
    return torch.full((*topk.shape[:-1], 1), -1, dtype=torch.int32, device=topk.device)


def lse_strides(lse: torch.Tensor, fmt: str) -> tuple[int, int]:
    """(stride_lb, stride_lh) of lse [Hq, T] (thd) or [B, Hq, S]; its token stride is 1."""
    if fmt == "thd":
        return 0, lse.stride(0)
    return lse.stride(0), lse.stride(1)


def new_lse(prob: SparseProblem, device: torch.device) -> torch.Tensor:
    shape = (prob.heads_q, prob.n_tokens) if prob.fmt == "thd" else (prob.batch, prob.heads_q, prob.seqlen_q)
    return torch.empty(shape, dtype=torch.float32, device=device)


def token_grid(device: torch.device, target: str, n_tokens: int, per_token: int,
               vector_only: bool = False) -> tuple[tuple[int], bool, int]:
    """(grid, PERSISTENT, tasks) for n_tokens x per_token tasks: kernels/attn_fwd.py ``launch_grid``
    (Ascend: a core-count grid; ``vector_only`` for kernels without tl.dot), plus the task count.
    A grid past the target's limits is looped at the launch (kernels/launch.py)."""
    grid, persistent = launch_grid(device, target, n_tokens, per_token, vector_only)
    return grid, persistent, n_tokens * per_token


class ModeTiles(NamedTuple):
    """A launch's row tile: BLOCK_T query tokens x BLOCK_H q heads (slot mode: one token), and the
    blocks of the sample's tokens and of a kv head's group it steps over."""

    block_t: int
    block_h: int
    n_tblocks: int
    n_hblocks: int


def mode_tiles(prob: SparseProblem, rows: int, range_mode: bool) -> ModeTiles:
    """The tiles of a launch whose config has ``rows`` MMA rows (``block_m``): range mode splits
    them into tokens x heads (configs/sparse.py ``range_tile``); slot mode's are q heads of one token."""
    if range_mode:
        block_t, block_h = range_tile(prob.group, rows)
        n_tblocks = triton.cdiv(prob.seqlen_q, block_t)
    else:
        block_t, block_h, n_tblocks = 1, rows, prob.seqlen_q
    return ModeTiles(block_t, block_h, n_tblocks, triton.cdiv(prob.group, block_h))


@on_device
def sparse_attn_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, topk: torch.Tensor,
                    key_lo: torch.Tensor, key_hi: torch.Tensor, fmt: str, softmax_scale: float, *,
                    v_dim: int | None = None, out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
                    blocks: BlockLayout | None = None):
    """Launch the sparse forward; returns (out, lse).

    q ``[.., Hq, Dqk]``, k ``[.., Hkv, Dqk]``, v ``[.., Hkv, Dv]`` or None (absorbed MLA: V = k's first
    ``v_dim`` columns; the kernel reads it from the gathered key block where it can) in layout
    ``fmt`` (thd, bshd, sbhd: kernels/packing.py; last strides 1, views used in place; k may have
    its own length in the padded layouts); ``topk`` prepared int32 ``[N, Hidx, K]``
    (kernels/sparse_index.py ``prepare_topk``; Hidx 1 or Hkv); ``key_lo``/``key_hi`` int32 ``[N]``,
    the positions each query token may see. Returns out ``[.., Hq, Dv]`` (q's dtype and layout)
    and lse float32 natural log, ``[Hq, T]`` (thd) or ``[B, Hq, S]``; -inf (out 0) for a token
    without a visible key. ``out``/``lse`` may be given as preallocated buffers (every element is
    written). Inputs are assumed checked by the caller (coreattn.layers).

    Two launches of the kernel, each writing the rows the other leaves (kernels/sparse_index.py
    ``row_classes``, torch ops on the device): the slot mode for the rows that name part of their
    range, the range mode for the full ones. ``blocks`` (the block mode): ``topk``'s entries are the
    key rows of named blocks (kernels/sparse_blocks.py), one launch in the block mode.
    """
    prob = sparse_problem(q, k, v, fmt, v_dim)
    if out is None:
        out = torch.empty((*q.shape[:-1], prob.dim_v), dtype=q.dtype, device=q.device)
    if lse is None:
        lse = new_lse(prob, q.device)
    if prob.n_tokens == 0 or prob.heads_q == 0:
        return out, lse
    target = target_of(q.device)
    block_dqk, block_dqk2, block_dv = prob.blocks
    k, v = key_side(k, v, prob)
    topk = slots_of(topk)
    if blocks is not None:
        _launch_block_fwd(q, k, v, out, lse, topk, key_lo, key_hi, fmt, softmax_scale, prob, target, blocks)
        return out, lse
    classes = row_classes(topk, key_lo, key_hi, prob.seqlen_k)
    aligned = batch_aligned(st for x in (q, k, v, out) for st in seq_strides(x, fmt)[:2])
    for range_mode in (False, True):
        cfg = sparse_config(target, "range_fwd" if range_mode else "fwd", block_dqk + block_dqk2, block_dv,
                            q.element_size(), prob.group)
        tiles = mode_tiles(prob, cfg.block_m, range_mode)
        grid, persistent, tasks = token_grid(q.device, target, prob.batch * tiles.n_tblocks,
                                             prob.heads_kv * tiles.n_hblocks)
        launch(
            target, _sparse_attn_fwd_kernel, grid, q, k, v, out, lse, topk, classes.span, classes.full, key_lo, key_hi,
            tasks, prob.seqlen_q, prob.seqlen_k, max(prob.seqlen_k, 1) - 1, topk.shape[-1], prob.heads_kv,
            prob.group, tiles.n_hblocks, tiles.n_tblocks, topk.shape[1], softmax_scale * LOG2E,
            *seq_strides(q, fmt), *seq_strides(k, fmt), *seq_strides(v, fmt), *seq_strides(out, fmt),
            *lse_strides(lse, fmt), 0, 1,
            HEAD_DIM_QK=prob.dim_qk, HEAD_DIM_V=prob.dim_v, BLOCK_DQK=block_dqk, BLOCK_DQK2=block_dqk2,
            BLOCK_DV=block_dv, BLOCK_T=tiles.block_t, BLOCK_H=tiles.block_h, BLOCK_N=cfg.block_n,
            V_IS_K=prob.v_is_k, RANGE=range_mode, BLOCKS=False, DOT_PRECISION=dot_precision(q.dtype, target),
            PERSISTENT=persistent, BATCH_ALIGNED=aligned, **cfg.launch(),
        )
    return out, lse


def block_tiles(block_size: int, block_n: int, n_slots: int) -> int:
    """Tiles of ``block_n`` keys per block of ``block_size`` (>= 1); the block mode's loop numbers its
    tiles in keys (K x tiles x block_n), which must stay within int32."""
    n_sub = triton.cdiv(block_size, block_n)
    if n_slots * n_sub * block_n >= 2**31:
        raise ValueError(f"{n_slots} blocks of {block_size} keys per index row exceed the block mode's int32 loop")
    return n_sub


@on_device
def _launch_block_fwd(q, k, v, out, lse, topk, key_lo, key_hi, fmt, softmax_scale, prob: SparseProblem, target,
                      blocks: BlockLayout) -> None:
    """The block mode's forward: a program per (query token, kv head, block of BLOCK_H q heads), stepping
    over the BLOCK_N-key tiles of its row's named blocks (each block's keys contiguous rows)."""
    block_dqk, block_dqk2, block_dv = prob.blocks
    classes = block_classes(topk, key_lo, key_hi, prob.seqlen_k, blocks.size)
    cfg = sparse_config(target, "block_fwd", block_dqk + block_dqk2, block_dv, q.element_size(), prob.group)
    tiles = mode_tiles(prob, cfg.block_m, False)
    grid, persistent, tasks = token_grid(q.device, target, prob.batch * tiles.n_tblocks,
                                         prob.heads_kv * tiles.n_hblocks)
    aligned = batch_aligned(st for x in (q, k, v, out) for st in seq_strides(x, fmt)[:2])
    launch(
        target, _sparse_attn_fwd_kernel, grid, q, k, v, out, lse, topk, classes.span, classes.full, key_lo, key_hi,
        tasks, prob.seqlen_q, prob.seqlen_k, max(prob.seqlen_k, 1) - 1, topk.shape[-1], prob.heads_kv,
        prob.group, tiles.n_hblocks, tiles.n_tblocks, topk.shape[1], softmax_scale * LOG2E,
        *seq_strides(q, fmt), *seq_strides(k, fmt), *seq_strides(v, fmt), *seq_strides(out, fmt),
        *lse_strides(lse, fmt), blocks.size, block_tiles(blocks.size, cfg.block_n, topk.shape[-1]),
        HEAD_DIM_QK=prob.dim_qk, HEAD_DIM_V=prob.dim_v, BLOCK_DQK=block_dqk, BLOCK_DQK2=block_dqk2,
        BLOCK_DV=block_dv, BLOCK_T=1, BLOCK_H=tiles.block_h, BLOCK_N=cfg.block_n, V_IS_K=prob.v_is_k,
        RANGE=False, BLOCKS=True, DOT_PRECISION=dot_precision(q.dtype, target), PERSISTENT=persistent,
        BATCH_ALIGNED=aligned, **cfg.launch(),
    )
