"""Naive per-sample loop builders: the reference for coreattn.masks (written for clarity, not speed).

Every builder works on Python lists and plain loops and returns CPU tensors with the dtypes
coreattn promises, so tests can compare with torch.equal.
"""

from __future__ import annotations

import math

import torch


def padding_mask(seqlens: list[int], max_len: int, left_padding: bool = False) -> torch.Tensor:
    mask = torch.zeros(len(seqlens), max_len, dtype=torch.bool)
    for i, n in enumerate(seqlens):
        for s in range(max_len):
            mask[i, s] = (s >= max_len - n) if left_padding else (s < n)
    return mask


def cu_seqlens(seqlens: list[int]) -> torch.Tensor:
    out = [0]
    for n in seqlens:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32)


def seqlens_from_cu(cu: list[int]) -> torch.Tensor:
    return torch.tensor([cu[i + 1] - cu[i] for i in range(len(cu) - 1)], dtype=torch.int32)


def kept_count(keep: torch.Tensor) -> torch.Tensor:
    counts = []
    for row in keep.tolist():
        counts.append(sum(1 for v in row if v != 0))
    return torch.tensor(counts, dtype=torch.int32)


def spans(keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(start, length) per row, or None when some row has holes."""
    starts, lengths = [], []
    for row in keep.tolist():
        kept = [s for s, v in enumerate(row) if v != 0]
        if kept and kept[-1] - kept[0] + 1 != len(kept):
            return None
        starts.append(kept[0] if kept else 0)
        lengths.append(len(kept))
    return torch.tensor(starts, dtype=torch.int32), torch.tensor(lengths, dtype=torch.int32)


def unpad(x: torch.Tensor, keep: torch.Tensor):
    """(x_packed, indices int64, cu_seqlens int32, max_seqlen int)."""
    batch, seqlen = keep.shape
    rows, indices, lens = [], [], []
    for b in range(batch):
        n = 0
        for s in range(seqlen):
            if keep[b, s] != 0:
                rows.append(x[b, s])
                indices.append(b * seqlen + s)
                n += 1
        lens.append(n)
    packed = torch.stack(rows) if rows else x.new_zeros((0,) + tuple(x.shape[2:]))
    return packed, torch.tensor(indices, dtype=torch.int64), cu_seqlens(lens), max(lens, default=0)


def pad(x_packed: torch.Tensor, indices: list[int], batch: int, seqlen: int) -> torch.Tensor:
    out = x_packed.new_zeros((batch, seqlen) + tuple(x_packed.shape[1:]))
    for i, flat in enumerate(indices):
        out[flat // seqlen, flat % seqlen] = x_packed[i]
    return out


def token_ids(cu: list[int], total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions int64, sequence ids int32); tokens past cu[-1] form sequence B."""
    pos, seq = [], []
    bounds = list(cu)
    for t in range(total):
        b = len(bounds) - 1
        for i in range(len(bounds) - 1):
            if bounds[i] <= t < bounds[i + 1]:
                b = i
                break
        pos.append(t - bounds[b])
        seq.append(b)
    return torch.tensor(pos, dtype=torch.int64), torch.tensor(seq, dtype=torch.int32)


def align(seqlens: list[int], tp: int, cp: int) -> tuple[torch.Tensor, int]:
    multiple = tp * 2 * cp // math.gcd(tp, 2 * cp) if cp > 1 else tp
    out = []
    for n in seqlens:
        p = n
        while p % multiple:
            p += 1
        out.append(p)
    return torch.tensor(out, dtype=torch.int32), multiple


def keep_from_4d(mask: torch.Tensor, convention: str) -> torch.Tensor:
    batch, seqlen = mask.shape[0], mask.shape[-1]
    keep = torch.zeros(batch, seqlen, dtype=torch.bool)
    for b in range(batch):
        for s in range(seqlen):
            v = mask[b, 0, 0, s] if mask.shape[2] == 1 else mask[b, 0, s, s]
            keep[b, s] = (v == 0) if convention == "megatron" else (v != 0)
    return keep


def megatron_mask(keep: torch.Tensor, causal: bool) -> torch.Tensor:
    batch, seqlen = keep.shape
    out = torch.ones(batch, 1, seqlen, seqlen, dtype=torch.bool)
    for b in range(batch):
        for i in range(seqlen):
            for j in range(seqlen):
                if keep[b, i] != 0 and keep[b, j] != 0 and (not causal or j <= i):
                    out[b, 0, i, j] = False
    return out


def cp_partition(padded_lens: list[int], cp: int, rank: int) -> torch.Tensor:
    """Global positions rank `rank` holds, sequence after sequence: chunk rank, then chunk 2*cp-1-rank
    of each sequence cut into 2*cp equal chunks (Megatron/TE's zig-zag context-parallel split)."""
    out, start = [], 0
    for n in padded_lens:
        if cp == 1:
            out += list(range(start, start + n))
        else:
            c = n // (2 * cp)
            for chunk in (rank, 2 * cp - 1 - rank):
                out += [start + chunk * c + i for i in range(c)]
        start += n
    return torch.tensor(out, dtype=torch.int64)
