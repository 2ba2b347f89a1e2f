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

``transpose_topk`` turns the entries of a chunk of query tokens into a CSR by key, compacted to the
keys the chunk names: for each named (index head, key row) the (token, slot) entries that name it,
in (token, slot) order (a stable sort, so the order is fixed: the deterministic backward sums each
key's partial gradients in it). Its segments are numbered on the device (the first entry of each,
a running count, a scatter of starts and keys), with their count left on the device: its size and
work follow the chunk's entries, never the key rows (``bincount`` or ``unique`` would read values to
size their outputs, a device-to-host sync). ``key_csr`` builds the CSR by key of every token at once
for the key-centric dK/dV (a counting sort, a chunk of tokens at a time: per segment the tokens that
name it, ascending).
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import torch

INT32_MAX = 2**31 - 1
TOKEN_DIMS = {"thd": 1, "bshd": 2, "sbhd": 2}


def _tokens_first(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """x with its token dims in (b, s) order: sbhd's [S, B, ...] as [B, S, ...] (a view)."""
    return x.transpose(0, 1) if fmt == "sbhd" else x


PREPARE_CHUNK_ENTRIES = 1 << 20  # index entries prepared at once: bounds the temporaries (the sort's int64
# permutation, 8 MiB, is the largest)


def prepare_topk(indices: torch.Tensor, fmt: str, topk_length: torch.Tensor | None = None, *,
                 extra: Callable[[int, int], torch.Tensor] | None = None, extra_width: int = 0) -> torch.Tensor:
    """The kernels' index tensor: int32 ``[N, Hidx, K]`` contiguous (see the module docstring).

    ``indices``: integer, the query token dims of ``fmt`` then ``K`` (thd ``[T, K]`` or
    ``[T, Hidx, K]``; bshd ``[B, S, (Hidx,) K]``; sbhd ``[S, B, (Hidx,) K]``). ``topk_length``:
    integer, shaped like the token dims (thd ``[T]``, bshd ``[B, S]``, sbhd ``[S, B]``), or None.
    ``extra`` (thd only): ``extra(n0, n1)`` gives int ``[n1 - n0, extra_width]`` entries that join
    every index head's row of tokens [n0, n1) after ``topk_length`` is applied (a key window: the
    result is then ``[N, Hidx, K + extra_width]``), made a chunk at a time like the rest.
    Shapes and dtypes are the caller's to check (coreattn.layers); this does torch ops only.
    Prepared a chunk of positions at a time (``PREPARE_CHUNK_ENTRIES`` entries, every sample's rows
    of those positions), straight from the caller's tensor into the int32 result: the sort's
    temporaries stay bounded whatever T x K is (at T = 8,192 and K = 2,048 they were 6.5 times the
    int32 result when prepared at once), and no copy of the whole index tensor is made."""
    dims = TOKEN_DIMS[fmt]
    if extra is not None and fmt != "thd":
        raise ValueError("prepare_topk: extra entries need the thd form of the token dims")
    idx = _tokens_first(indices, fmt)  # [T, (Hidx,) K] or [B, S, (Hidx,) K], a view
    if idx.dim() == dims + 1:
        idx = idx.unsqueeze(-2)  # one index head
    width = extra_width if extra is not None else 0
    lead, heads, n_slots = tuple(idx.shape[:dims]), idx.shape[-2], idx.shape[-1]
    out = torch.empty(*lead, heads, n_slots + width, dtype=torch.int32, device=idx.device)
    length = None if topk_length is None else _tokens_first(topk_length, fmt)
    per_position = max(1, torch.Size(lead[:-1]).numel() * heads * (n_slots + width))  # entries of one position
    step = max(1, PREPARE_CHUNK_ENTRIES // per_position)
    for p0 in range(0, lead[-1], step):
        rows = (slice(None),) * (dims - 1) + (slice(p0, p0 + step),)
        added = None if extra is None else extra(p0, min(p0 + step, lead[-1]))
        out[rows] = _prepare_rows(idx[rows], None if length is None else length[rows], added)
    return out.view(torch.Size(lead).numel(), heads, n_slots + width)


def _prepare_rows(idx: torch.Tensor, length: torch.Tensor | None, added: torch.Tensor | None = None) -> torch.Tensor:
    """``prepare_topk`` on a chunk ``[..., Hidx, K]`` (``length``: its ``[...]`` valid counts; ``added``:
    ``[..., W]`` entries appended to every head's row after the length is applied), int32 from the first
    copy on (no entry past int32 survives the first step)."""
    if idx.dtype not in (torch.int32, torch.int64):  # uint8, int16...: -1 must fit
        idx = idx.to(torch.int64)
    bad = (idx < 0) | (idx > INT32_MAX)
    if length is not None:
        bad |= torch.arange(idx.shape[-1], device=idx.device) >= length.to(torch.int64)[..., None, None]
    idx = idx.masked_fill(bad, -1).to(torch.int32)
    if added is not None:
        added = added.to(torch.int64)
        added = added.masked_fill((added < 0) | (added > INT32_MAX), -1).to(torch.int32)
        idx = torch.cat([idx, added[..., None, :].expand(*idx.shape[:-1], added.shape[-1])], -1)
    idx, _ = torch.sort(idx, dim=-1)
    if idx.shape[-1] > 1:  # duplicates: an entry equal to the one before it (sorted, so every repeat)
        repeat = (idx[..., 1:] == idx[..., :-1]) & (idx[..., 1:] >= 0)
        idx[..., 1:].masked_fill_(repeat, -1)
    return idx


class TopkCSR(NamedTuple):
    """The valid entries of a chunk of query tokens, grouped by key and compacted to the keys the chunk
    names: segment u (u < ``n_segs``, S slots in all) is (index head ``seg_head[u]``, key row
    ``seg_row[u]``) and holds ``entries[seg_ptr[u]:seg_ptr[u + 1]]``, in ascending (head, key row)
    order. ``entries`` int32 ``[C * Hidx * K]``: an entry is ``n_local * K + slot`` (its place in the
    chunk's ``[C, K]`` slots), in (token, slot) order within a segment; past the last segment come the
    invalid entries (any order). ``seg_ptr`` int32 ``[S + 1]``, ``seg_row``/``seg_head`` int32 ``[S]``
    (0 past ``n_segs``, whose segments are empty), ``n_segs`` int32 ``[1]`` on the device (no host
    read); S = min(C * Hidx * K, Hidx * key rows) bounds the segment count."""

    seg_ptr: torch.Tensor
    seg_row: torch.Tensor
    seg_head: torch.Tensor
    n_segs: torch.Tensor
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


def _segments(topk: torch.Tensor, key_lo: torch.Tensor, key_hi: torch.Tensor, start: int, stop: int, *,
              seqlen_q: int, seqlen_k: int, batch: int, skip: torch.Tensor | None) -> torch.Tensor:
    """int64 ``[C * Hidx * K]``: each entry's segment ``h * key_rows + r`` (index head h, key row
    r = b * seqlen_k + j) in (token, head, slot) order, ``Hidx * key_rows`` (past every segment) for an
    entry the kernels do not use (``valid_entries``, and the rows ``skip`` marks)."""
    chunk = topk[start:stop]  # [C, Hidx, K]
    heads, key_rows = chunk.shape[1], batch * seqlen_k
    valid = valid_entries(topk, key_lo, key_hi, start, stop, seqlen_k)
    if skip is not None:
        valid &= (skip[start:stop] == 0)[..., None]
    head = torch.arange(heads, device=topk.device, dtype=torch.int64)[None, :, None]
    seg = head * key_rows + key_rows_of(topk, start, stop, seqlen_q, seqlen_k) + chunk.to(torch.int64)
    return torch.where(valid, seg, heads * key_rows).flatten()


def transpose_topk(topk: torch.Tensor, key_lo: torch.Tensor, key_hi: torch.Tensor, start: int, stop: int, *,
                   seqlen_q: int, seqlen_k: int, batch: int, skip: torch.Tensor | None = None) -> TopkCSR:
    """The CSR by key of tokens [start, stop)'s valid entries (``TopkCSR``), compacted to the keys
    they name: its size and work follow the chunk's entries, never the key rows.

    ``topk`` prepared ``[N, Hidx, K]``; ``key_lo``/``key_hi`` int32 ``[N]``; ``seqlen_q`` the
    tokens per sample (thd: all of them, so every token is sample 0), ``seqlen_k`` the key rows
    per sample, ``batch`` the samples (thd: 1); key row ``r = b * seqlen_k + j``; ``skip``
    ``[N, Hidx]`` (nonzero: the row's entries are left out, as the full rows of ``row_classes``,
    whose gradients the range mode computes). Torch ops, no sync: a stable sort of the segment ids
    (invalid entries get one past the last, so they sort last), the first entry of each segment
    marked, a running count numbers the segments and a scatter writes their starts and keys."""
    heads, n_slots = topk.shape[1], topk.shape[2]
    key_rows = batch * seqlen_k
    seg = _segments(topk, key_lo, key_hi, start, stop, seqlen_q=seqlen_q, seqlen_k=seqlen_k, batch=batch, skip=skip)
    n_entries, dev = seg.numel(), topk.device
    sorted_seg, order = torch.sort(seg, stable=True)  # order within a segment: (token, head, slot)
    entries = ((order // (heads * n_slots)) * n_slots + order % n_slots).to(torch.int32)  # n_local * K + slot
    real = sorted_seg < heads * key_rows
    first = real.clone()
    first[1:] &= sorted_seg[1:] != sorted_seg[:-1]
    n_valid = real.sum(dtype=torch.int32).reshape(1)
    n_segs = first.sum(dtype=torch.int32).reshape(1)
    slots = max(1, min(n_entries, heads * key_rows))
    # segment u's slot for its first entry; every other entry writes one slot past the arrays (dropped)
    at = torch.where(first, torch.cumsum(first, 0) - 1, slots + 1)
    seg_ptr = n_valid.expand(slots + 2).clone()  # the segments past n_segs start (and end) at n_valid
    seg_ptr.scatter_(0, at, torch.arange(n_entries, device=dev, dtype=torch.int32))
    keys = torch.zeros(slots + 2, dtype=torch.int64, device=dev).scatter_(0, at, sorted_seg)[:slots]
    seg_head = torch.div(keys, max(key_rows, 1), rounding_mode="floor")
    seg_row = (keys - seg_head * key_rows).to(torch.int32)
    return TopkCSR(seg_ptr[:slots + 1], seg_row, seg_head.to(torch.int32), n_segs, entries)


KEY_CSR_CHUNK_ENTRIES = 1 << 22  # index entries placed at once by ``key_csr``: bounds its temporaries


class KeyCSR(NamedTuple):
    """The valid entries of every query token, grouped by key (the key-centric dK/dV's input):
    segment ``h * key_rows + r`` (index head h, key row r) holds the tokens ``entries[row_ptr[seg]:
    row_ptr[seg + 1]]`` that name it, ascending (a token names a key at most once per index head).
    ``row_ptr`` int64 ``[Hidx * key_rows + 1]``; ``entries`` int32 ``[N * Hidx * K]`` (query tokens
    n = b * S + s; past ``row_ptr[-1]``: unused)."""

    row_ptr: torch.Tensor
    entries: torch.Tensor


def key_csr(topk: torch.Tensor, key_lo: torch.Tensor, key_hi: torch.Tensor, *, seqlen_q: int, seqlen_k: int,
            batch: int, skip: torch.Tensor | None = None) -> KeyCSR:
    """``KeyCSR`` of the prepared ``topk`` ``[N, Hidx, K]`` (arguments as ``transpose_topk``'s, over all
    tokens), built a chunk of tokens at a time (``KEY_CSR_CHUNK_ENTRIES``: temporaries O(chunk)) by a
    counting sort: the entries per segment are counted (an integer scatter-add), their running sum
    gives ``row_ptr``, and each chunk's entries, stably sorted by segment, are written after the
    earlier chunks' (a per-segment fill count), so every segment lists its tokens in order. Torch
    ops, no sync; memory beyond the result: 16 B per segment and the chunk's temporaries."""
    n_tokens, heads, n_slots = topk.shape
    key_rows = batch * seqlen_k
    segs, dev = heads * key_rows, topk.device
    step = max(1, KEY_CSR_CHUNK_ENTRIES // max(heads * n_slots, 1))
    spans = [(t0, min(n_tokens, t0 + step)) for t0 in range(0, n_tokens, step)]
    chunk_segs = functools.partial(_segments, topk, key_lo, key_hi, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
                                   batch=batch, skip=skip)
    counts = torch.zeros(segs + 1, dtype=torch.int64, device=dev)  # the last: unused entries
    for t0, t1 in spans:
        seg = chunk_segs(t0, t1)
        counts.scatter_add_(0, seg, torch.ones_like(seg))
    row_ptr = torch.zeros(segs + 1, dtype=torch.int64, device=dev)
    row_ptr[1:] = torch.cumsum(counts[:segs], 0)
    entries = torch.empty(n_tokens * heads * n_slots + 1, dtype=torch.int32, device=dev)  # + a slot for the unused
    fill = torch.cat([row_ptr[:segs], torch.full((1,), entries.numel() - 1, dtype=torch.int64, device=dev)])
    for t0, t1 in spans:
        seg = chunk_segs(t0, t1)
        sorted_seg, order = torch.sort(seg, stable=True)
        rank = torch.arange(seg.numel(), device=dev) - torch.searchsorted(sorted_seg, sorted_seg)
        at = torch.where(sorted_seg < segs, fill[sorted_seg] + rank, entries.numel() - 1)
        entries.scatter_(0, at, (t0 + order // (heads * n_slots)).to(torch.int32))
        fill[:segs].scatter_add_(0, sorted_seg.clamp(max=segs - 1), (sorted_seg < segs).to(torch.int64))
    return KeyCSR(row_ptr, entries[:-1])


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
