"""Triton helpers shared by the forward and backward attention kernels.

Masks are computed in registers from sequence-local indices and lengths. Sequence-local
indices are int32 vectors; sequence and block base offsets are scalar int64.
"""

import triton
import triton.language as tl

# Strides that follow the token count or padded length (lse/delta [H, T] or [B, H, S]; keep masks
# [B, S]): listed in the kernels' do_not_specialize with the lengths, or Triton would compile a
# variant per divisibility class (T == 1, T % 16 == 0, other) of each new packed batch.
LENGTH_STRIDES = ("stride_lb", "stride_lh", "stride_qkb", "stride_kkb")


@triton.jit
def _cu_seqlens_ok(cu_ptr, batch, total, BLOCK_B: tl.constexpr):
    """True when cu_seqlens starts at 0, never decreases and ends at ``total``."""
    ok = (tl.load(cu_ptr) == 0) & (tl.load(cu_ptr + batch) == total)
    offs = tl.arange(0, BLOCK_B)
    for b0 in range(0, batch, BLOCK_B):
        in_range = b0 + offs < batch
        lo = tl.load(cu_ptr + b0 + offs, mask=in_range, other=0)
        hi = tl.load(cu_ptr + b0 + offs + 1, mask=in_range, other=0)
        ok = ok & (tl.min(hi - lo, axis=0) >= 0)
    return ok


@triton.jit
def _visible(q_idx, k_idx, seqlen_q, seqlen_k, shift, window_left, window_right,
             HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """Query q_idx may attend to key k_idx (broadcast shapes, e.g. [M, 1] and [1, N])."""
    vis = (q_idx < seqlen_q) & (k_idx < seqlen_k)
    if HAS_LEFT:
        vis = vis & (k_idx >= q_idx + shift - window_left)
    if HAS_RIGHT:
        vis = vis & (k_idx <= q_idx + shift + window_right)
    return vis


@triton.jit
def _load_keep(keep_base, stride_s, idx, length, HAS_KEEP: tl.constexpr):
    """Keep-mask entries (uint8 -> bool) at sequence positions idx; True when there is no mask."""
    if HAS_KEEP:
        return tl.load(keep_base + idx * stride_s, mask=idx < length, other=0) != 0
    return idx >= 0


@triton.jit
def _key_range(m0, seqlen_q, seqlen_k, shift, window_left, window_right,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, ALL_MASKED: tl.constexpr):
    """Key blocks for queries [m0, m0 + BLOCK_M): [lo, full_lo) and [full_hi, hi) need masks,
    [full_lo, full_hi) is fully visible to every real query of the block (empty when
    ALL_MASKED). Blocks outside [lo, hi) are skipped. lo, full_lo and full_hi are multiples of
    BLOCK_N (or equal hi)."""
    m_last = tl.minimum(m0 + BLOCK_M, seqlen_q) - 1
    lo = m0 * 0
    hi = seqlen_k + m0 * 0
    full_lo = lo
    full_hi = (seqlen_k // BLOCK_N) * BLOCK_N
    if HAS_LEFT:
        lo = tl.maximum(m0 + shift - window_left, 0) // BLOCK_N * BLOCK_N
        full_lo = tl.cdiv(tl.maximum(m_last + shift - window_left, 0), BLOCK_N) * BLOCK_N
    if HAS_RIGHT:
        hi = tl.maximum(tl.minimum(hi, m_last + shift + window_right + 1), 0)
        full_hi = tl.minimum(full_hi, tl.maximum(m0 + shift + window_right + 1, 0) // BLOCK_N * BLOCK_N)
    lo = tl.minimum(lo, hi)
    full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), hi)
    if ALL_MASKED:  # keep masks: every block needs its mask
        full_lo = hi
        full_hi = hi
    return lo, full_lo, full_hi, hi


@triton.jit
def _query_range(n0, seqlen_q, seqlen_k, shift, window_left, window_right,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, ALL_MASKED: tl.constexpr):
    """The transpose of _key_range: query blocks that see keys [n0, n0 + BLOCK_N).
    [lo, full_lo) and [full_hi, hi) need masks; lo, full_lo and full_hi are multiples of BLOCK_M."""
    n_last = tl.minimum(n0 + BLOCK_N, seqlen_k) - 1
    lo = n0 * 0
    hi = seqlen_q + n0 * 0
    full_lo = lo
    full_hi = (seqlen_q // BLOCK_M) * BLOCK_M
    if HAS_RIGHT:  # key j is seen by queries i >= j - shift - window_right
        lo = tl.maximum(n0 - shift - window_right, 0) // BLOCK_M * BLOCK_M
        full_lo = tl.cdiv(tl.maximum(n_last - shift - window_right, 0), BLOCK_M) * BLOCK_M
    if HAS_LEFT:  # ... and by queries i <= j - shift + window_left
        hi = tl.maximum(tl.minimum(hi, n_last - shift + window_left + 1), 0)
        full_hi = tl.minimum(full_hi, tl.maximum(n0 - shift + window_left + 1, 0) // BLOCK_M * BLOCK_M)
    lo = tl.minimum(lo, hi)
    full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), hi)
    if ALL_MASKED:  # keep masks: every block needs its mask
        full_lo = hi
        full_hi = hi
    return lo, full_lo, full_hi, hi


@triton.jit
def _seq_span(seq_ptr, len_ptr, seq, SPANS: tl.constexpr):
    """(start, length) of sequence ``seq``: from cu_seqlens or from span tensors."""
    start = tl.load(seq_ptr + seq)
    if SPANS:
        length = tl.load(len_ptr + seq)
    else:
        length = tl.load(seq_ptr + seq + 1) - start
    return start, length


@triton.jit
def _layout_ok(q_seq_ptr, q_len_ptr, k_seq_ptr, k_len_ptr, seq, batch, seqlen_q_total, seqlen_k_total,
               SPANS: tl.constexpr, BLOCK_B: tl.constexpr):
    """cu_seqlens mode: both cu_seqlens are well formed (the same answer for every program).
    Span mode: this sample's q and k spans lie inside [0, S) (or [0, T))."""
    if SPANS:
        q_start, q_len = _seq_span(q_seq_ptr, q_len_ptr, seq, True)
        k_start, k_len = _seq_span(k_seq_ptr, k_len_ptr, seq, True)
        ok = (q_start >= 0) & (q_len >= 0) & (q_start + q_len <= seqlen_q_total)
        ok = ok & (k_start >= 0) & (k_len >= 0) & (k_start + k_len <= seqlen_k_total)
    else:
        ok = _cu_seqlens_ok(q_seq_ptr, batch, seqlen_q_total, BLOCK_B)
        ok = ok & _cu_seqlens_ok(k_seq_ptr, batch, seqlen_k_total, BLOCK_B)
    return ok


@triton.jit
def _poison_rows(base, row0_program, num_programs, total, stride_t,
                 WIDTH: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_M: tl.constexpr):
    """Write NaN over rows [0, total) of a [total, WIDTH] view at ``base`` (row stride stride_t),
    grid-strided over programs: the answer to malformed cu_seqlens or spans on device."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_w = tl.arange(0, BLOCK_W)
    nan = tl.full([BLOCK_M, BLOCK_W], float("nan"), tl.float32)
    for r0 in range(row0_program * BLOCK_M, total, num_programs * BLOCK_M):
        mask = (r0 + offs_m[:, None] < total) & (offs_w[None, :] < WIDTH)
        ptrs = base + tl.cast(r0, tl.int64) * stride_t + offs_m[:, None] * stride_t + offs_w[None, :]
        tl.store(ptrs, nan.to(base.dtype.element_ty), mask=mask)


@triton.jit
def _poison_program_rows(base, pid_m, seq, num_pid_m, batch, total, stride_t,
                         WIDTH: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_M: tl.constexpr,
                         SPANS: tl.constexpr):
    """This program's share of the NaN rows: its sample's rows (span mode; ``base`` points at the
    sample of a padded batch, or at a packed tensor's first row) or a grid-stride share of all
    tokens (cu_seqlens mode: every program agrees on failure)."""
    if SPANS:
        _poison_rows(base, pid_m, num_pid_m, total, stride_t, WIDTH, BLOCK_W, BLOCK_M)
    else:
        _poison_rows(base, seq * num_pid_m + pid_m, batch * num_pid_m, total, stride_t, WIDTH, BLOCK_W, BLOCK_M)
