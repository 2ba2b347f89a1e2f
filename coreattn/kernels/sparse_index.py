"""Top-k index preparation for the sparse attention kernels: torch ops only, no host sync.

The sparse op's indices name, for each query token, the key positions it attends to (DeepSeek
Sparse Attention's top-k: rows unsorted, -1 or any negative for an unused entry, duplicates
possible, an optional per-row valid count ``topk_length``). The kernels take them prepared once
per call (``prepare_topk``): int32 ``[N, Hidx, K]`` contiguous, query tokens numbered
``n = b * S + s`` (thd: the row), ``Hidx`` 1 (one set for every head) or the kv head count, every
row sorted ascending (gathers then walk the key rows in order) with

- entries at slot ``>= topk_length[n]`` set to -1 first (the length counts the rows' own order),
- negative entries, and entries past int32 (no key position is), -1,
- duplicates -1 (set semantics: a key named twice counts once, as a scattered mask counts it; a
  gather that counted it twice would give it twice the weight). Only the first of equal entries
  stays, so a row is ascending among its valid entries with -1 where its duplicates were.

Which keys an entry may reach (its sequence, causality) is not applied here: the kernels intersect
each entry with the token's bounds ``key_lo[n] <= j < key_hi[n]`` (and ``j`` below the key rows of
its sample) and mask the rest, so a wrong index is masked, never read out of its sequence.

``row_classes`` sorts the prepared rows into the kernels' two paths, with torch ops on the device (no
host read): a row whose valid entries are its token's whole visible range ``[lo, hi)`` (every key of
its causal range, as top-k 2,048 gives every token of a shorter sequence) is *full* and runs as
dense attention over contiguous keys (the kernels' range mode); any other row runs over its slots,
from the first valid one to the last (a sorted row holds its valid entries there, -1 between them
only where duplicates were), not over all K. ``range_visits`` gives the range-mode dK/dV kernel,
per key block, the query-token blocks whose full rows may see it.

``transpose_topk`` turns the entries of a chunk of query tokens into a CSR by key: for each
(index head, key row) the (token, slot) entries that name it, in (token, slot) order (a stable
sort, so the order is fixed: the deterministic backward sums each key's partial gradients in it).
Its row pointer comes from ``searchsorted`` on the sorted keys; ``bincount`` would read the
largest key to size its output, a device-to-host sync.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

INT32_MAX = 2**31 - 1
TOKEN_DIMS = {"thd": 1, "bshd": 2, "sbhd": 2}


def _tokens_first(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """x with its token dims in (b, s) order: sbhd's [S, B, ...] as [B, S, ...] (a view)."""
    return x.transpose(0, 1) if fmt == "sbhd" else x


PREPARE_CHUNK_ENTRIES = 1 << 20  # index entries prepared at once: bounds the temporaries (the sort's int64
# permutation, 8 MiB, is the largest)


def prepare_topk(indices: torch.Tensor, fmt: str, topk_length: torch.Tensor | None = None) -> torch.Tensor:
    """The kernels' index tensor: int32 ``[N, Hidx, K]`` contiguous (see the module docstring).

    ``indices``: integer, the query token dims of ``fmt`` then ``K`` (thd ``[T, K]`` or
    ``[T, Hidx, K]``; bshd ``[B, S, (Hidx,) K]``; sbhd ``[S, B, (Hidx,) K]``). ``topk_length``:
    integer, shaped like the token dims (thd ``[T]``, bshd ``[B, S]``, sbhd ``[S, B]``), or None.
    Shapes and dtypes are the caller's to check (coreattn.layers); this does torch ops only.
    Prepared a chunk of positions at a time (``PREPARE_CHUNK_ENTRIES`` entries, every sample's rows
    of those positions), straight from the caller's tensor into the int32 result: the sort's
    temporaries stay bounded whatever T x K is (at T = 8,192 and K = 2,048 they were 6.5 times the
    int32 result when prepared at once), and no copy of the whole index tensor is made."""
    dims = TOKEN_DIMS[fmt]
    idx = _tokens_first(indices, fmt)  # [T, (Hidx,) K] or [B, S, (Hidx,) K], a view
    if idx.dim() == dims + 1:
        idx = idx.unsqueeze(-2)  # one index head
    lead, heads, n_slots = tuple(idx.shape[:dims]), idx.shape[-2], idx.shape[-1]
    out = torch.empty(*lead, heads, n_slots, dtype=torch.int32, device=idx.device)
    length = None if topk_length is None else _tokens_first(topk_length, fmt)
    per_position = max(1, torch.Size(lead[:-1]).numel() * heads * n_slots)  # entries of one position, all samples
    step = max(1, PREPARE_CHUNK_ENTRIES // per_position)
    for p0 in range(0, lead[-1], step):
        rows = (slice(None),) * (dims - 1) + (slice(p0, p0 + step),)
        out[rows] = _prepare_rows(idx[rows], None if length is None else length[rows])
    return out.view(torch.Size(lead).numel(), heads, n_slots)


def _prepare_rows(idx: torch.Tensor, length: torch.Tensor | None) -> torch.Tensor:
    """``prepare_topk`` on a chunk ``[..., Hidx, K]`` (``length``: its ``[...]`` valid counts), int32
    from the first copy on (no entry past int32 survives the first step)."""
    if idx.dtype not in (torch.int32, torch.int64):  # uint8, int16...: -1 must fit
        idx = idx.to(torch.int64)
    bad = (idx < 0) | (idx > INT32_MAX)
    if length is not None:
        bad |= torch.arange(idx.shape[-1], device=idx.device) >= length.to(torch.int64)[..., None, None]
    idx = idx.masked_fill(bad, -1).to(torch.int32)
    idx, _ = torch.sort(idx, dim=-1)
    if idx.shape[-1] > 1:  # duplicates: an entry equal to the one before it (sorted, so every repeat)
        repeat = (idx[..., 1:] == idx[..., :-1]) & (idx[..., 1:] >= 0)
        idx[..., 1:].masked_fill_(repeat, -1)
    return idx


class TopkCSR(NamedTuple):
    """The valid entries of a chunk of query tokens, grouped by key.

    ``row_ptr`` int32 ``[Hidx * key_rows + 1]``: segment ``h * key_rows + r`` (index head h, key row
    r) holds ``entries[row_ptr[seg]:row_ptr[seg + 1]]``. ``entries`` int32 ``[C * Hidx * K]``: an
    entry is ``n_local * K + slot`` (its place in the chunk's ``[C, K]`` slots), in (token, slot)
    order within a segment; past ``row_ptr[-1]`` come the invalid entries (any order)."""

    row_ptr: torch.Tensor
    entries: torch.Tensor


def key_rows_of(topk: torch.Tensor, start: int, stop: int, seqlen_q: int, seqlen_k: int) -> torch.Tensor:
    """int64 ``[C, 1, 1]``: the first key row of each token's sample (``b * seqlen_k``; thd: 0)."""
    n = torch.arange(start, stop, device=topk.device, dtype=torch.int64)
    return (n // max(seqlen_q, 1) * seqlen_k)[:, None, None]


def valid_entries(topk: torch.Tensor, key_lo: torch.Tensor, key_hi: torch.Tensor, start: int, stop: int,
                  seqlen_k: int) -> torch.Tensor:
    """bool ``[C, Hidx, K]``: the entries of tokens [start, stop) the kernels use:
    ``max(key_lo[n], 0) <= j < min(key_hi[n], seqlen_k)``."""
    chunk = topk[start:stop]
    lo = key_lo[start:stop].to(torch.int64).clamp(min=0)[:, None, None]
    hi = torch.clamp(key_hi[start:stop].to(torch.int64), max=seqlen_k)[:, None, None]
    return (chunk >= lo) & (chunk < hi)


def transpose_topk(topk: torch.Tensor, key_lo: torch.Tensor, key_hi: torch.Tensor, start: int, stop: int, *,
                   seqlen_q: int, seqlen_k: int, batch: int, skip: torch.Tensor | None = None) -> TopkCSR:
    """The CSR by key of tokens [start, stop)'s valid entries (``TopkCSR``).

    ``topk`` prepared ``[N, Hidx, K]``; ``key_lo``/``key_hi`` int32 ``[N]``; ``seqlen_q`` the
    tokens per sample (thd: all of them, so every token is sample 0), ``seqlen_k`` the key rows
    per sample, ``batch`` the samples (thd: 1); key row ``r = b * seqlen_k + j``; ``skip``
    ``[N, Hidx]`` (nonzero: the row's entries are left out, as the full rows of ``row_classes``,
    whose gradients the range mode computes). Torch ops, no sync: a stable sort of the segment ids
    (invalid entries get one past the last, so they sort last) and a searchsorted for the segment
    starts."""
    chunk = topk[start:stop]  # [C, Hidx, K]
    heads, n_slots = chunk.shape[1], chunk.shape[2]
    key_rows = batch * seqlen_k
    valid = valid_entries(topk, key_lo, key_hi, start, stop, seqlen_k)
    if skip is not None:
        valid &= (skip[start:stop] == 0)[..., None]
    head = torch.arange(heads, device=topk.device, dtype=torch.int64)[None, :, None]
    seg = head * key_rows + key_rows_of(topk, start, stop, seqlen_q, seqlen_k) + chunk.to(torch.int64)
    seg = torch.where(valid, seg, heads * key_rows).flatten()
    sorted_seg, order = torch.sort(seg, stable=True)  # order within a segment: (token, head, slot)
    entries = (order // (heads * n_slots)) * n_slots + order % n_slots  # n_local * K + slot
    bounds = torch.arange(heads * key_rows + 1, device=topk.device, dtype=torch.int64)
    row_ptr = torch.searchsorted(sorted_seg, bounds, out_int32=True)
    return TopkCSR(row_ptr, entries.to(torch.int32))


CLASSIFY_CHUNK_ENTRIES = 1 << 22  # index entries classified at once: bounds row_classes' temporaries (5 B each)


class RowClasses(NamedTuple):
    """Which path of the kernels runs each (query token, index head) row of the prepared indices.

    ``span`` int32 ``[N, Hidx, 2]``: the slots ``[begin, end)`` from the row's first valid entry to
    its last (empty for a row without one, and for a full row); ``full`` int8 ``[N, Hidx]``: 1 where
    the row's valid entries are every key of the token's visible range ``[lo, hi)`` (an empty range
    included): the range mode's rows, 0 the slot mode's."""

    span: torch.Tensor
    full: torch.Tensor


def row_classes(topk: torch.Tensor, key_lo: torch.Tensor, key_hi: torch.Tensor, seqlen_k: int) -> RowClasses:
    """``RowClasses`` of the prepared ``topk`` ``[N, Hidx, K]`` (K >= 1) with the token bounds
    ``key_lo``/``key_hi`` int32 ``[N]`` and ``seqlen_k`` key rows per sample, valid as the kernels
    take an entry (``valid_entries``). A row's valid entries are distinct (prepared rows hold each
    key once), so it is full when their count is ``hi - lo``. Torch ops on topk's device, a chunk of
    tokens at a time (``CLASSIFY_CHUNK_ENTRIES``)."""
    n, heads, n_slots = topk.shape
    span = torch.empty(n, heads, 2, dtype=torch.int32, device=topk.device)
    full = torch.empty(n, heads, dtype=torch.int8, device=topk.device)
    slots = torch.arange(n_slots, dtype=torch.int32, device=topk.device)
    step = max(1, CLASSIFY_CHUNK_ENTRIES // max(heads * n_slots, 1))
    for start in range(0, n, step):
        stop = min(n, start + step)
        valid = valid_entries(topk, key_lo, key_hi, start, stop, seqlen_k)  # [C, Hidx, K]
        count = valid.sum(-1, dtype=torch.int32)  # [C, Hidx]
        lo = key_lo[start:stop].clamp(min=0)
        width = (torch.clamp(key_hi[start:stop], max=seqlen_k) - lo).clamp(min=0)  # [C]
        is_full = count == width[:, None]
        first = torch.where(valid, slots, n_slots).amin(-1)
        end = (valid * (slots + 1)).amax(-1)  # one past the last valid slot
        slot_mode = ~is_full & (count > 0)
        span[start:stop, :, 0] = torch.where(slot_mode, first, 0)
        span[start:stop, :, 1] = torch.where(slot_mode, end, 0)
        full[start:stop] = is_full
    return RowClasses(span, full)


def range_visits(full: torch.Tensor, key_lo: torch.Tensor, key_hi: torch.Tensor, *, batch: int, seqlen_q: int,
                 seqlen_k: int, block_t: int, block_n: int) -> torch.Tensor:
    """int32 ``[Hidx, B, n_kblocks, 2]``: for each (index head, sample, block of ``block_n`` keys)
    the blocks ``[first, end)`` of ``block_t`` query tokens of the sample (block t: positions
    ``[t * block_t, (t + 1) * block_t)``) that the range-mode dK/dV kernel visits: every block
    holding a full row (``full`` ``[N, Hidx]``) whose range ``[lo, hi)`` meets the key block, and
    those between them (a row's own mask leaves out what it does not see).

    Per token block the smallest lo and the largest hi of its full rows; a running maximum of hi and
    a minimum of lo from the end make both ascending, so a searchsorted finds the first block whose
    hi passes the key block's start and the last whose lo is below its end. Torch ops, no sync."""
    heads, dev = full.shape[1], full.device
    n_tblocks, n_kblocks = -(-seqlen_q // block_t), -(-seqlen_k // block_n)
    lo = key_lo.to(torch.int64).clamp(min=0)
    hi = torch.clamp(key_hi.to(torch.int64), max=seqlen_k)
    own = (full != 0) & (hi > lo)[:, None]  # [N, Hidx]
    lo = torch.where(own, lo[:, None], seqlen_k).view(batch, seqlen_q, heads)
    hi = torch.where(own, hi[:, None], 0).view(batch, seqlen_q, heads)
    pad = n_tblocks * block_t - seqlen_q
    lo = torch.nn.functional.pad(lo, (0, 0, 0, pad), value=seqlen_k).view(batch, n_tblocks, block_t, heads)
    hi = torch.nn.functional.pad(hi, (0, 0, 0, pad), value=0).view(batch, n_tblocks, block_t, heads)
    hi_run = hi.amax(2).cummax(1).values  # [B, n_tblocks, Hidx], ascending along the blocks
    lo_after = lo.amin(2).flip(1).cummin(1).values.flip(1)
    hi_run, lo_after = (x.permute(2, 0, 1).reshape(heads * batch, n_tblocks).contiguous() for x in (hi_run, lo_after))
    k0 = (torch.arange(n_kblocks, device=dev, dtype=torch.int64) * block_n).expand(heads * batch, n_kblocks)
    first = torch.searchsorted(hi_run, k0.contiguous(), right=True)
    end = torch.maximum(torch.searchsorted(lo_after, (k0 + block_n).contiguous()), first)
    return torch.stack([first, end], -1).to(torch.int32).view(heads, batch, n_kblocks, 2)
