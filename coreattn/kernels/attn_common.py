"""Triton helpers shared by the forward and backward attention kernels.

Masks are computed in registers from sequence-local indices and lengths. Sequence-local
indices are int32 vectors; sequence and block base offsets are scalar int64.

Addresses stay inside their tensors for every lane, masked or not. Compiled with num_stages >= 2,
Triton's software pipeliner issues a loop's loads ahead of time (cp.async on NVIDIA): for the
first iterations before it knows whether the loop runs at all, and for iterations past its last;
the load's mask turns the value off, but a masked-off asynchronous copy whose address is wild
still faults on the GPU (an H100 did, 2026-11-27). So every row index is clamped to the last row
of its sequence before the pointer is formed (``last_row``; an empty sequence's loops address row
0 of the sample: ``_first_row``), columns past a padded head dim wrap into the row (``_cols``),
and the mask keeps the values right. No address depends on a division by a value that can be
zero. (An ``if seqlen > 0`` around the loops would skip an empty sequence's prologue too, but the
ptxas of Triton 3.6 to 3.8 crashed on such branches around the pipelined wgmma loops of sm90.)

Per-lane offsets (issue 36): a tile's rows are a scalar int64 base (the sequence's first row, the
tile's first row, each times its stride) plus tile-local lane offsets ``lane * stride``
(``_lane_offsets``), lane < the tile's rows, never a sequence-local index times a stride. Triton
passes a stride below 2**31 as i32, so that product is an i32 multiply feeding the pointer add: it
wraps once ``(rows - 1) * stride`` reaches 2**31 (an sbhd token stride B*H*D of 16.9M elements
with 128-row tiles; the interpreter wraps alike). Kernels therefore come in two variants, chosen
at launch by ``int64_lanes`` from the strides and the tile alone (never lengths, so a packed batch
never recompiles; an sbhd stride grows with B, so a batch size crossing the bound compiles the
other variant once): ``INT64_LANES`` forms ``lane.to(tl.int64) * stride``. The default variant
keeps i32 lanes: many kernels sit at the 255-register ceiling on sm90 and sm100, and
triton-ascend turns int64 vector arithmetic into scalar code (docs/compile-report.md has what
the wide variant costs per kernel class). Column offsets inside a row are i32 (the last stride is
1). The one place lanes may not be tile-local, a keep mask's positions, is read as a tile base
plus lanes too (``_load_keep``).
"""

import contextlib
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from coreattn.kernels.packing import Packing, seq_strides

# Strides that follow the token count or padded length (lse/delta [H, T] or [B, H, S]; keep masks
# [B, S]): listed in the kernels' do_not_specialize with the lengths, or Triton would compile a
# variant per divisibility class (T == 1, T % 16 == 0, other) of each new packed batch.
LENGTH_STRIDES = ("stride_lb", "stride_lh", "stride_qkb", "stride_kkb")
INT32_MAX = 2**31 - 1
_FORCED_LANES: list = []  # forced_int64_lanes' values, innermost last


def batch_aligned(strides) -> bool:
    """``BATCH_ALIGNED`` for a launch whose batch and token strides are ``strides``: all multiples of 16.
    The batch strides are never specialized (bshd's S x H x D would flip its divisibility with S's parity
    where H x D is not a multiple of 16: a compile per parity); this flag gives the kernel their
    alignment back where it holds for every S (H x D a multiple of 16), and is False for every S
    where it does not (the token stride is not), so S never picks the variant."""
    return all(int(st) % 16 == 0 for st in strides)


@triton.jit
def _batch_stride(stride, ALIGNED: tl.constexpr):
    """A batch stride with the divisibility by 16 the launcher vouches for (``batch_aligned``): the same
    value, as a product by 16 the compiler's alignment analysis sees (``tl.multiple_of`` cannot mark a
    kernel argument)."""
    if ALIGNED:
        stride = (stride // 16) * 16
    return stride


def int64_lanes(rows: int, strides, cols: int = 0) -> bool:
    """The ``INT64_LANES`` variant for a kernel whose tiles have at most ``rows`` rows (lane offsets
    0 .. rows - 1) and whose lanes multiply ``strides`` (token strides of its row tensors, keep masks'
    position strides), plus up to ``cols`` column offsets inside a row: True when some lane offset
    can pass the int32 range. Strides and tiles only, never lengths (see the module docstring)."""
    if _FORCED_LANES:
        return _FORCED_LANES[-1]
    widest = max((abs(int(s)) for s in strides), default=0)
    return (rows - 1) * widest + cols > INT32_MAX


@contextlib.contextmanager
def forced_int64_lanes(value: bool):
    """Inside, every attention launch takes the given variant whatever its strides: how the compile
    report measures the int64 variant and the offset scan checks it (coreattn/tune/compiler.py)."""
    _FORCED_LANES.append(bool(value))
    try:
        yield
    finally:
        _FORCED_LANES.pop()


class TableBias(NamedTuple):
    """An additive attention bias computed in registers (``_bias_scores``): for query i, key j and q
    head h, with d = i + shift - j (shift as for the causal diagonal: Lk - Lq bottom-right, else 0),
    ``bias = sum_r coef[i, h, r] * table[h or 0, r, d - lo]`` where ``0 <= d - lo < extent``; outside
    that the end entries (``clamp``) or 0. Inkling 2's low-rank relative bias is coef = the relative
    states, table = its projection (one table for every head), lo 0; T5's bucketed bias is no coef and
    a table per head over d in [-max_distance, max_distance], clamped (coreattn.layers.bias)."""

    table: torch.Tensor  # [Ht, R, E] float32, Ht 1 (shared by the q heads) or Hq; contiguous
    coef: torch.Tensor | None  # [.., Hq, R] float32 in q's layout (last stride 1), or None (R = 1)
    lo: int
    clamp: bool


def bias_args(bias: TableBias | None, q_pack: Packing, dummy: torch.Tensor) -> dict:
    """The attention kernels' bias arguments (BIAS off without one)."""
    if bias is None:
        return dict(table_ptr=dummy, coef_ptr=dummy, stride_cb=0, stride_ct=0, stride_ch=0, stride_th=0, bias_lo=0,
                    bias_extent=1)
    heads_t, rank, extent = bias.table.shape
    if rank * extent > INT32_MAX:  # the kernels' table rows are int32 products r x extent (a constexpr) up to here
        raise ValueError(f"bias: a table of {rank} rows x {extent} entries per head passes 2**31 - 1 entries")
    coef = bias.coef
    cb, ct, ch = seq_strides(coef, q_pack.fmt) if coef is not None else (0, 0, 0)
    return dict(table_ptr=bias.table, coef_ptr=coef if coef is not None else bias.table, stride_cb=cb, stride_ct=ct,
                stride_ch=ch, stride_th=bias.table.stride(0) if heads_t > 1 else 0, bias_lo=bias.lo,
                bias_extent=extent, BIAS=True, BIAS_RANK=rank, BIAS_COEF=coef is not None, BIAS_CLAMP=bias.clamp)


@triton.jit
def _lane_offsets(lanes, stride, INT64_LANES: tl.constexpr):
    """``lanes * stride`` for tile-local lane indices (any shape, e.g. ``offs[:, None]``): in int64
    under INT64_LANES, else in int32 (the launcher has checked it fits: ``int64_lanes``)."""
    if INT64_LANES:
        lanes = lanes.to(tl.int64)
    return lanes * stride


@triton.jit
def _visible(q_idx, k_idx, seqlen_k, shift, window_left, window_right,
             HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, K_BOUND: tl.constexpr):
    """Query q_idx may attend to key k_idx (broadcast shapes, e.g. [M, 1] and [1, N]) under the
    causal/window band; with K_BOUND also k_idx < seqlen_k. Query rows past the sequence are never
    masked here: their results are not stored, and the backward's lse (+inf) zeroes them."""
    rel = k_idx - (q_idx + shift)  # key position relative to the query's diagonal; no int32 overflow
    if HAS_RIGHT:
        vis = rel <= window_right
        if HAS_LEFT:
            vis = vis & (rel >= -window_left)
    elif HAS_LEFT:
        vis = rel >= -window_left
    else:
        vis = rel == rel
    if K_BOUND:
        vis = vis & (k_idx < seqlen_k)
    return vis


@triton.jit
def _first_row(start, seqlen):
    """The row a loop over one side's sequence counts its row indices from. Each index is clamped to
    ``seqlen - 1`` before an address is formed; an empty sequence (whose start may be one past the
    tensor's last row) clamps every index to -1, and counted from row 1 that is row 0 of the sample,
    which every tensor the kernels get has (kernels/packing.py ``stand_in``): its loops run zero
    times, but a pipelined prologue still issues their first loads."""
    return tl.where(seqlen > 0, start, 1)


@triton.jit
def _cols(offs_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Column indices of a block that may pass the real head dim: those past it wrap into the row
    (masked off by the caller), so the address stays in the tensor; a constant modulus keeps the
    columns' contiguity, so loads stay vectorized."""
    if BLOCK_D > HEAD_DIM:
        return offs_d % HEAD_DIM
    return offs_d


@triton.jit
def _load_keep(keep_base, stride_s, i0, lanes, length, INT64_LANES: tl.constexpr):
    """Keep-mask entries (uint8 -> bool) at sequence positions ``i0 + lanes`` (only under
    HAS_*_KEEP), read at positions clamped to the last (``_first_row``): the tile's first position
    as an int64 base, then tile-local lanes (``_lane_offsets``)."""
    at = tl.minimum(lanes, length - 1 - i0)  # lanes from i0, inside the sequence
    ptrs = keep_base + tl.cast(i0, tl.int64) * stride_s + _lane_offsets(at, stride_s, INT64_LANES)
    return tl.load(ptrs, mask=lanes < length - i0, other=0) != 0


@triton.jit
def _tile_visible(rows, n0, offs_n, q_keep, k_keep_base, stride_kks, seqlen_k, shift, window_left, window_right,
                  HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_Q_KEEP: tl.constexpr,
                  HAS_K_KEEP: tl.constexpr, INT64_LANES: tl.constexpr):
    """[M, N] visibility of a masked (edge) tile, queries as rows and keys ``n0 + offs_n`` as
    columns: the band, the key bound and the keep masks (q_keep is the tile's [M] loaded once; the
    keys' entries are loaded here)."""
    cols = n0 + offs_n
    vis = _visible(rows[:, None], cols[None, :], seqlen_k, shift, window_left, window_right, HAS_LEFT, HAS_RIGHT,
                   True)
    if HAS_Q_KEEP:
        vis = vis & q_keep[:, None]
    if HAS_K_KEEP:
        vis = vis & _load_keep(k_keep_base, stride_kks, n0, offs_n, seqlen_k, INT64_LANES)[None, :]
    return vis


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
    [lo, full_lo) and [full_hi, hi) need masks; lo, full_lo and full_hi are multiples of BLOCK_M
    (or equal hi). The last, partial query block needs no mask for its bound: its rows past the
    sequence load lse = +inf (P = 0), and keys past the sequence only reach their own dK/dV
    rows, which are not stored."""
    n_last = tl.minimum(n0 + BLOCK_N, seqlen_k) - 1
    lo = n0 * 0
    hi = seqlen_q + n0 * 0
    full_lo = lo
    full_hi = hi
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
def _first_gid(gid_ptr, seq, start, seqlen_total, PACKED: tl.constexpr, HAS_GID: tl.constexpr):
    """Dropout token id of a sequence's first token (coreattn/kernels/dropout.py): given, or the
    token's row (packed) or ``b * S + position`` (padded)."""
    if HAS_GID:
        return tl.load(gid_ptr + seq)
    if PACKED:
        return start
    return seq * seqlen_total + start


@triton.jit
def _dropout_keep(seed, offset, head, q_ids, k_ids, threshold):
    """Keep mask for the query ids x key ids tile (broadcast shapes) of q head ``head``: Philox-4x32
    on (key id, query id, head, offset) keyed by the seed; kept iff the first word >> 1 >= threshold."""
    c0 = k_ids + q_ids * 0
    c1 = q_ids + k_ids * 0
    r, _, _, _ = tl.philox(seed, c0, c1, c0 * 0 + head, c0 * 0 + offset)
    return (r >> 1).to(tl.int32, bitcast=True) >= threshold


@triton.jit
def _poison(base, program, num_programs, n_rows, rows_per_batch, stride_b, stride_t,
            WIDTH: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_M: tl.constexpr):
    """Write NaN over the flat rows [0, n_rows) of a [B, S, WIDTH] view (row r: sample
    r // rows_per_batch, position r % rows_per_batch; a packed [T, WIDTH] view is one sample), in
    column blocks of BLOCK_W, grid-strided over programs: the answer to malformed cu_seqlens or
    spans on device."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_w = tl.arange(0, BLOCK_W)
    nan = tl.full([BLOCK_M, BLOCK_W], float("nan"), tl.float32)
    for r0 in range(program * BLOCK_M, n_rows, num_programs * BLOCK_M):
        rows = r0 + offs_m
        row = tl.minimum(rows, n_rows - 1)  # addresses inside the tensor for every lane
        b = row // rows_per_batch  # rows_per_batch >= 1 wherever n_rows > 0
        pos = row - b * rows_per_batch
        ptrs = base + b.to(tl.int64)[:, None] * stride_b + pos.to(tl.int64)[:, None] * stride_t
        for c0 in tl.static_range(0, WIDTH, BLOCK_W):
            cols = c0 + offs_w
            tl.store(ptrs + _cols(cols, WIDTH, c0 + BLOCK_W)[None, :], nan.to(base.dtype.element_ty),
                     mask=(rows[:, None] < n_rows) & (cols[None, :] < WIDTH))


@triton.jit
def _load_rows(base, stride_t, r0, row_ok, last_row, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
               BLOCK_D2: tl.constexpr, BLOCK_R: tl.constexpr, INT64_LANES: tl.constexpr):
    """Rows [r0, r0 + R) of a [rows, HEAD_DIM] view as one [R, BLOCK_D] block, or two column blocks
    ([R, BLOCK_D] and [R, BLOCK_D2]) when the head dim is split (BLOCK_D2 > 0; else the second is
    the first again). Rows past ``last_row`` (the sequence's last, counted as r0 is) are read from
    it and masked by ``row_ok``. Rows are ``r0`` times the stride as an int64 base plus the tile's
    lanes (``_lane_offsets``: int64 under INT64_LANES)."""
    offs_r = tl.minimum(tl.arange(0, BLOCK_R), last_row - r0)
    offs_d = tl.arange(0, BLOCK_D)
    ptrs = base + tl.cast(r0, tl.int64) * stride_t + _lane_offsets(offs_r[:, None], stride_t, INT64_LANES)
    if BLOCK_D <= HEAD_DIM:  # a whole column block: only the rows need a mask
        x = tl.load(ptrs + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    else:
        x = tl.load(ptrs + _cols(offs_d, HEAD_DIM, BLOCK_D)[None, :],
                    mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    x2 = x
    if BLOCK_D2 > 0:
        offs_d2 = BLOCK_D + tl.arange(0, BLOCK_D2)
        x2 = tl.load(ptrs + _cols(offs_d2, HEAD_DIM, BLOCK_D + BLOCK_D2)[None, :],
                     mask=row_ok[:, None] & (offs_d2[None, :] < HEAD_DIM), other=0.0)
    return x, x2


@triton.jit
def _store_rows(base, stride_t, r0, row_ok, last_row, x, x2, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                BLOCK_D2: tl.constexpr, BLOCK_R: tl.constexpr, INT64_LANES: tl.constexpr):
    """The inverse of _load_rows (x, x2 fp32 accumulators, cast to the destination's dtype)."""
    offs_r = tl.minimum(tl.arange(0, BLOCK_R), last_row - r0)
    offs_d = tl.arange(0, BLOCK_D)
    ptrs = base + tl.cast(r0, tl.int64) * stride_t + _lane_offsets(offs_r[:, None], stride_t, INT64_LANES)
    dtype = base.dtype.element_ty
    if BLOCK_D <= HEAD_DIM:
        tl.store(ptrs + offs_d[None, :], x.to(dtype), mask=row_ok[:, None])
    else:
        tl.store(ptrs + _cols(offs_d, HEAD_DIM, BLOCK_D)[None, :], x.to(dtype),
                 mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM))
    if BLOCK_D2 > 0:
        offs_d2 = BLOCK_D + tl.arange(0, BLOCK_D2)
        tl.store(ptrs + _cols(offs_d2, HEAD_DIM, BLOCK_D + BLOCK_D2)[None, :], x2.to(dtype),
                 mask=row_ok[:, None] & (offs_d2[None, :] < HEAD_DIM))


RANK_CHUNK = tl.constexpr(4)  # a low-rank bias's table rows read per iteration of its loop (_bias_scores)


@triton.jit
def _bias_scores(coef_ptrs, table_base, dist, lo, extent, RANK: tl.constexpr, COEF: tl.constexpr,
                 CLAMP: tl.constexpr):
    """The additive attention bias (natural-log units, fp32) of a tile of (query, key) pairs whose
    distances are ``dist`` = i + shift - j (any 2D shape; shift as for the causal diagonal):
    ``sum_r coef[i, r] * table[r, dist - lo]`` (``coef`` 1 and RANK 1 without COEF), for
    ``0 <= dist - lo < extent``; outside that the table's end entries (CLAMP) or 0. ``coef_ptrs``
    holds each query row's coefficients' address (broadcast against ``dist``: [M, 1] or [1, M]),
    its row clamped into the sequence by the caller; ``table_base`` the head's [RANK, extent] table.
    Every table address is clamped into the table, so masked lanes stay in bounds too. ``extent`` is a
    constexpr (a table's size, fixed per model: one compile per table shape, never per batch).
    Cost per pair: RANK gathered table loads and RANK multiply-adds (plus RANK row loads per row);
    without COEF (RANK 1) one load."""
    at = dist - lo
    inside = (at >= 0) & (at < extent)
    at = tl.minimum(tl.maximum(at, 0), extent - 1)
    if COEF:
        bias = at.to(tl.float32) * 0.0
        # RANK_CHUNK rows unrolled per iteration of a loop: at most that many [M, N] table reads live at once
        # (all 16 of Inkling 2's unrolled spilled on sm90; one per iteration spilled more)
        for r0 in range(0, RANK, RANK_CHUNK):
            for rr in tl.static_range(RANK_CHUNK):
                r = tl.minimum(r0 + rr, RANK - 1)  # a row past RANK re-reads the last, its coefficient zeroed
                c = tl.where(r0 + rr < RANK, tl.load(coef_ptrs + r).to(tl.float32), 0.0)
                # the row's offset: r x extent with the extent a constexpr (the kernels' bias_extent), int32 in every
                # variant (r < RANK: under RANK x extent < 2**31, which bias_args checks; in int64, or with a runtime
                # extent, the rows' addresses spilled on sm90)
                bias += c * tl.load(table_base + r * extent + at).to(tl.float32)
    else:
        bias = tl.load(table_base + at).to(tl.float32)
    if not CLAMP:
        bias = tl.where(inside, bias, 0.0)
    return bias


@triton.jit
def _bias_band(a_lo, a_hi, BLOCK: tl.constexpr, lo, extent):
    """The starts ``b0`` of the blocks of BLOCK indices b0 .. b0 + BLOCK - 1 that hold some pair at a
    distance ``a - b`` in [lo, lo + extent), for a in [a_lo, a_hi]: [near_lo, near_hi] (scalars, computed
    once per tile so a step's check is two compares). The forward and dQ kernels pass the query rows
    plus the shift as ``a`` and step over key blocks; the dK/dV kernel, whose steps are query blocks,
    passes its keys as ``a`` mirrored (a = n - shift, the distances negated: lo -> -lo - extent + 1)."""
    return a_lo - lo - extent - BLOCK + 2, a_hi - lo


@triton.jit
def _bias_near(b0, near_lo, near_hi, CLAMP: tl.constexpr):
    """Whether the block starting at ``b0`` has any bias to add (``_bias_band``'s interval): always with a
    clamped table; without, only where its distances meet the table (Inkling 2's full layers: the
    1,024-distance band of a long sequence), so the blocks outside skip the bias's work."""
    if CLAMP:
        return b0 == b0
    return (b0 >= near_lo) & (b0 <= near_hi)


@triton.jit
def _bias_row_grads(ds, p, dp, dcoef, far, table_base, dist, lo, extent, RANK: tl.constexpr, RB: tl.constexpr,
                    COEF: tl.constexpr, CLAMP: tl.constexpr):
    """The dQ kernel's share of a bias's gradient from a tile's ds = dL/d(logit) = p * (dp - delta)
    ([M, N] fp32, 0 at masked pairs; ``dist`` as for ``_bias_scores``): ``dcoef [M, RB] += sum_j ds *
    table[r, dist - lo]`` (COEF); with CLAMP, ``far [M, 4]`` gathers, for the pairs beyond the table's
    low end (dist < lo) and its high end (dist >= lo + extent), sum(p * dp) and sum(p) per row, from
    which the caller forms their sums of dS with the exact rowsum(P * dP) (the delta of the rounded
    output would carry its rounding into a sum over every row). They join the end entries' gradient;
    the entries inside come from the bias gradient kernel (kernels/attn_bias.py)."""
    at = dist - lo
    if COEF:
        inside = (at >= 0) & (at < extent)
        at_in = tl.minimum(tl.maximum(at, 0), extent - 1)
        r_ids = tl.arange(0, RB)
        for r0 in range(0, RANK, RANK_CHUNK):  # chunks, as in _bias_scores
            for rr in tl.static_range(RANK_CHUNK):
                row = table_base + tl.minimum(r0 + rr, RANK - 1) * extent  # as in _bias_scores
                entry = tl.load(row + at_in).to(tl.float32)
                if not CLAMP:
                    entry = tl.where(inside, entry, 0.0)
                dcoef += tl.where(r_ids[None, :] == r0 + rr, tl.sum(ds * entry, 1)[:, None], 0.0)
    if CLAMP:
        pdp = p * dp
        low, high = at < 0, at >= extent
        c = tl.arange(0, 4)[None, :]
        far += (tl.where(c == 0, tl.sum(tl.where(low, pdp, 0.0), 1)[:, None], 0.0)
                + tl.where(c == 1, tl.sum(tl.where(low, p, 0.0), 1)[:, None], 0.0)
                + tl.where(c == 2, tl.sum(tl.where(high, pdp, 0.0), 1)[:, None], 0.0)
                + tl.where(c == 3, tl.sum(tl.where(high, p, 0.0), 1)[:, None], 0.0))
    return dcoef, far
