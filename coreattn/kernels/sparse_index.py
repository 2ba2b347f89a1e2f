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
                   seqlen_q: int, seqlen_k: int, batch: int) -> TopkCSR:
    """The CSR by key of tokens [start, stop)'s valid entries (``TopkCSR``).

    ``topk`` prepared ``[N, Hidx, K]``; ``key_lo``/``key_hi`` int32 ``[N]``; ``seqlen_q`` the
    tokens per sample (thd: all of them, so every token is sample 0), ``seqlen_k`` the key rows
    per sample, ``batch`` the samples (thd: 1); key row ``r = b * seqlen_k + j``. Torch ops, no
    sync: a stable sort of the segment ids (invalid entries get one past the last, so they sort
    last) and a searchsorted for the segment starts."""
    chunk = topk[start:stop]  # [C, Hidx, K]
    heads, n_slots = chunk.shape[1], chunk.shape[2]
    key_rows = batch * seqlen_k
    valid = valid_entries(topk, key_lo, key_hi, start, stop, seqlen_k)
    head = torch.arange(heads, device=topk.device, dtype=torch.int64)[None, :, None]
    seg = head * key_rows + key_rows_of(topk, start, stop, seqlen_q, seqlen_k) + chunk.to(torch.int64)
    seg = torch.where(valid, seg, heads * key_rows).flatten()
    sorted_seg, order = torch.sort(seg, stable=True)  # order within a segment: (token, head, slot)
    entries = (order // (heads * n_slots)) * n_slots + order % n_slots  # n_local * K + slot
    bounds = torch.arange(heads * key_rows + 1, device=topk.device, dtype=torch.int64)
    row_ptr = torch.searchsorted(sorted_seg, bounds, out_int32=True)
    return TopkCSR(row_ptr, entries.to(torch.int32))
