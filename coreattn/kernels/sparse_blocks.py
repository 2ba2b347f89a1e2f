"""Block-sparse index rows for the sparse attention kernels (the op's block mode): torch ops only, no host sync.

In block mode (``block_size`` B) an entry of a token's index row names a *block*: B contiguous keys of
its sequence, block c being key positions ``[c * B, (c + 1) * B)`` counted from the sequence's first
key (thd: the sequence's first row of the packed k; padded: position 0 of the sample, so a right- or
left-padded sample's blocks sit on absolute positions, as MiniMax-M3's indexer anchors them). Each
key of a named block is then used as a token entry would be: inside the token's bounds
``[key_lo, key_hi)`` (its sequence, causality: a block holding the query is causal inside) and the
sample's rows, masked otherwise.

- ``block_starts``: the named blocks as the key row each starts at (``origin[n] + c * B``; -1 for a
  negative entry), ready for ``sparse_index.prepare_topk``, which sorts each row and turns repeats
  into -1 as for token entries (a block named twice counts once). Memory: the index rows alone,
  ``[N, Hidx, K]`` (K blocks per row: 16 for MiniMax-M3), never the ``[N, Hidx, K * B]`` keys.
- ``block_classes``: per prepared row the slots from its first block that meets the token's bounds
  to its last (``RowClasses.span``; ``full`` all 0: every row runs in the kernels' block mode), so
  the forward's and dQ's programs step over those blocks' keys only, B keys per block read as
  contiguous rows (tiles of BLOCK_N), never an index per key.
- ``block_table``: the blocks of the batch as ``(sample, first key, end key)`` rows, the key blocks
  of the dK/dV kernel's programs (they partition every sequence's keys: each key row has one
  writer), and ``transpose_blocks``: a CSR by block of the valid entries (for each index head and
  block, the query tokens naming it, ascending), the order in which that kernel sums them: bitwise
  deterministic, no atomics, no partial buffer.

Sizes are known on the host from shapes alone (thd: the table's capacity is ``cdiv(Tk, B)`` plus
the sequence count, an upper bound of every sequence's block count summed); lengths are read only
on the device.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from coreattn.kernels.sparse_index import INT32_MAX, RowClasses

class BlockLayout(NamedTuple):
    """The block mode of one call: ``size`` keys per block (B >= 1) and, thd, ``seq_k`` the int32
    ``[S + 1]`` cumulative key lengths (blocks start at each sequence's first row); padded: None
    (blocks start at position 0 of every sample)."""

    size: int
    seq_k: torch.Tensor | None


def block_starts(indices: torch.Tensor, origin: torch.Tensor, block_size: int) -> torch.Tensor:
    """int64 ``[N, Hidx, K]``: block entry c of token n as the key row ``origin[n] + c * B`` its block
    starts at; negative entries -1 (``prepare_topk`` also drops starts past int32: no block starts
    there). ``indices`` integer ``[N, Hidx, K]``, ``origin`` integer ``[N]``."""
    c = indices.to(torch.int64)
    start = origin.to(torch.int64)[:, None, None] + c.clamp(max=INT32_MAX) * block_size
    return torch.where(c >= 0, start, -1)


def _meets_bounds(topk: torch.Tensor, key_lo: torch.Tensor, key_hi: torch.Tensor, start: int, stop: int,
                  seqlen_k: int, block_size: int) -> torch.Tensor:
    """bool ``[C, Hidx, K]``: the prepared block entries of tokens [start, stop) whose block
    ``[r, r + B)`` meets ``[max(key_lo, 0), min(key_hi, seqlen_k))`` (the entries the kernels use)."""
    r = topk[start:stop].to(torch.int64)
    lo = key_lo[start:stop].to(torch.int64).clamp(min=0)[:, None, None]
    hi = torch.clamp(key_hi[start:stop].to(torch.int64), max=seqlen_k)[:, None, None]
    return (r >= 0) & (torch.maximum(r, lo) < torch.minimum(r + block_size, hi))


CLASSIFY_CHUNK_ENTRIES = 1 << 22  # block entries examined at once


def block_classes(topk: torch.Tensor, key_lo: torch.Tensor, key_hi: torch.Tensor, seqlen_k: int,
                  block_size: int) -> RowClasses:
    """``RowClasses`` of prepared block rows ``topk`` ``[N, Hidx, K]``: ``span`` the slots from the
    first entry whose block meets the token's bounds to the last (empty without one), ``full`` all
    0. Torch ops, a chunk of tokens at a time."""
    n, heads, n_slots = topk.shape
    span = torch.empty(n, heads, 2, dtype=torch.int32, device=topk.device)
    slots = torch.arange(n_slots, dtype=torch.int32, device=topk.device)
    step = max(1, CLASSIFY_CHUNK_ENTRIES // max(heads * n_slots, 1))
    for start in range(0, n, step):
        stop = min(n, start + step)
        valid = _meets_bounds(topk, key_lo, key_hi, start, stop, seqlen_k, block_size)
        some = valid.any(-1)
        span[start:stop, :, 0] = torch.where(some, torch.where(valid, slots, n_slots).amin(-1), 0)
        span[start:stop, :, 1] = torch.where(some, (valid * (slots + 1)).amax(-1), 0)
    return RowClasses(span, torch.zeros(n, heads, dtype=torch.int8, device=topk.device))


def table_size(layout: BlockLayout, batch: int, seqlen_k: int) -> int:
    """Rows of ``block_table``: padded, every sample's ``cdiv(Sk, B)`` blocks; thd, at most
    ``cdiv(Tk, B)`` plus one partial block per sequence."""
    per_sample = -(-seqlen_k // layout.size)
    if layout.seq_k is None:
        return batch * per_sample
    return per_sample + layout.seq_k.numel() - 1


def _thd_blocks(layout: BlockLayout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(cu int64 [S + 1], first block of each sequence int64 [S], its block count int64 [S])."""
    cu = layout.seq_k.to(torch.int64)
    count = (cu[1:] - cu[:-1]).clamp(min=0).add(layout.size - 1).div(layout.size, rounding_mode="floor")
    return cu, torch.cumsum(count, 0) - count, count


def block_table(layout: BlockLayout, batch: int, seqlen_k: int, device: torch.device) -> torch.Tensor:
    """int32 ``[table_size, 3]`` on ``device``: block i as (sample, first key position, end key
    position) in the sample (thd: sample 0, rows of the packed k); rows past the batch's blocks are
    empty (0, 0, 0)."""
    size, rows = layout.size, table_size(layout, batch, seqlen_k)
    i = torch.arange(rows, dtype=torch.int64, device=device)
    if layout.seq_k is None:
        per_sample = -(-seqlen_k // size)
        first = (i % max(per_sample, 1)) * size
        table = torch.stack([i // max(per_sample, 1), first, (first + size).clamp(max=seqlen_k)], 1)
        return table.to(torch.int32)
    cu, first_block, count = _thd_blocks(layout)
    seq = torch.searchsorted(first_block + count, i, right=True)  # the sequence holding block i, S past the last
    inside = seq < count.numel()
    seq = seq.clamp(max=max(count.numel() - 1, 0))
    first = cu[seq] + (i - first_block[seq]) * size if count.numel() else i * 0
    end = torch.minimum(first + size, cu[seq + 1]) if count.numel() else i * 0
    table = torch.stack([torch.zeros_like(i), first, end], 1)
    return torch.where(inside[:, None], table, 0).to(torch.int32)


class BlockCSR(NamedTuple):
    """The valid block entries grouped by block: segment ``h * table_size + i`` (index head h, block
    table row i) holds the query tokens ``entries[row_ptr[seg]:row_ptr[seg + 1]]`` naming it, ascending;
    past ``row_ptr[-1]`` come the invalid entries. ``row_ptr`` int32 ``[Hidx * table_size + 1]``,
    ``entries`` int32 ``[N * Hidx * K]``."""

    row_ptr: torch.Tensor
    entries: torch.Tensor


def transpose_blocks(topk: torch.Tensor, key_lo: torch.Tensor, key_hi: torch.Tensor, layout: BlockLayout, *,
                     batch: int, seqlen_q: int, seqlen_k: int) -> BlockCSR:
    """The CSR by block (``BlockCSR``) of the prepared block rows ``topk`` ``[N, Hidx, K]`` (key rows
    their blocks start at) of every query token: a stable sort of the segment ids (invalid entries
    one past the last), a searchsorted for the segment starts. Torch ops, no sync; memory about 24 B
    per (token, index head, slot) while sorting, 4 B kept."""
    n, heads, n_slots = topk.shape
    rows = table_size(layout, batch, seqlen_k)
    valid = _meets_bounds(topk, key_lo, key_hi, 0, n, seqlen_k, layout.size)
    r = topk.to(torch.int64).clamp(min=0)
    if layout.seq_k is None:
        sample = torch.arange(n, device=topk.device, dtype=torch.int64) // max(seqlen_q, 1)
        block = sample[:, None, None] * (-(-seqlen_k // layout.size)) + r // layout.size
    else:
        cu, first_block, _ = _thd_blocks(layout)
        seq = torch.searchsorted(cu[1:], r, right=True).clamp(max=max(first_block.numel() - 1, 0))
        block = first_block[seq] + (r - cu[seq]) // layout.size if first_block.numel() else r * 0
    head = torch.arange(heads, device=topk.device, dtype=torch.int64)[None, :, None]
    seg = torch.where(valid, head * rows + block, heads * rows).flatten()
    sorted_seg, order = torch.sort(seg, stable=True)  # within a segment: (token, head, slot) order
    entries = (order // (heads * n_slots)).to(torch.int32)
    bounds = torch.arange(heads * rows + 1, device=topk.device, dtype=torch.int64)
    return BlockCSR(torch.searchsorted(sorted_seg, bounds, out_int32=True), entries)
